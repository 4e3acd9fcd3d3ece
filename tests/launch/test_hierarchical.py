"""The hierarchical allreduce across MPICH's simulated nodes (MPIR_CVAR_NUM_CLIQUES).

MPICH deals ranks to cliques in turn: 4 ranks in 2 give nodes {0,2} {1,3}; 5 in 2 give
{0,2,4} {1,3} (uneven); 6 in 4 give {0,4} {1,5} {2} {3} (uneven, two single-rank nodes).
"""

import re

import pytest


@pytest.mark.parametrize("ranks, cliques, layout", [(4, 2, {2: 4}), (5, 2, {3: 3, 2: 2}),
                                                    (6, 4, {2: 4, 1: 2})])
def test_hierarchical_allreduce_across_simulated_nodes(launch, ranks, cliques, layout):
    job = launch(ranks, "hierarchical.py", env={"MPIR_CVAR_NUM_CLIQUES": str(cliques)},
                 timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]
    found = re.findall(r"rank (\d+) nodes (\d+) local size (\d+) parts (\d+) cross-node bytes (\d+)",
                       job.stdout)
    assert sorted(int(rank) for rank, *_ in found) == list(range(ranks))
    assert {int(nodes) for _, nodes, *_ in found} == {cliques}
    sizes = {}
    for _, _, local_size, _, _ in found:
        sizes[int(local_size)] = sizes.get(int(local_size), 0) + 1
    assert sizes == layout
    assert sum(int(sent) for *_, sent in found) > 0  # data crossed between nodes
    assert "UCX WARN" not in job.stderr + job.stdout


def test_hierarchical_allreduce_can_be_switched_off(launch):
    job = launch(4, "hierarchical.py", env={"MPIR_CVAR_NUM_CLIQUES": "2",
                                            "HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("hierarchical off") == 4
