"""The hierarchical allreduce across MPICH's simulated nodes (MPIR_CVAR_NUM_CLIQUES).

MPICH deals ranks to cliques in turn: 4 ranks in 2 give nodes {0,2} {1,3}; 5 in 2 give
{0,2,4} {1,3} (uneven); 6 in 4 give {0,4} {1,5} {2} {3} (uneven, two single-rank nodes).
"""

import re

import pytest


@pytest.mark.parametrize("ranks, cliques, layout", [(4, 2, {2: 4}), (5, 2, {3: 3, 2: 2}),
                                                    (6, 4, {2: 4, 1: 2})])
def test_hierarchical_allreduce_across_simulated_nodes(launch, ranks, cliques, layout):
    # automatic choice from 256 KiB up: the 300001-element allreduce takes it
    job = launch(ranks, "hierarchical.py", env={"MPIR_CVAR_NUM_CLIQUES": str(cliques),
                                                "HORORING_HIERARCHICAL_THRESHOLD_BYTES": "262144"},
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


def test_hierarchical_allreduce_on_by_default_across_nodes_and_off_when_asked(launch):
    for env in ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, {}):  # forced on, and the default
        on = launch(4, "hierarchical.py", env={"MPIR_CVAR_NUM_CLIQUES": "2", **env},
                    timeout=120)
        assert on.returncode == 0, on.stderr[-3000:]
        assert on.stdout.count("nodes 2 local size 2") == 4
    off = launch(4, "hierarchical.py", env={"MPIR_CVAR_NUM_CLIQUES": "2",
                                            "HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, timeout=120)
    assert off.returncode == 0, off.stderr[-3000:]
    assert off.stdout.count("hierarchical off") == 4
