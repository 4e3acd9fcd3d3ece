"""The Python function calls one steady-state blocking 4 KiB allreduce costs its caller.

Each call through the library's layers costs time on every collective (a 4 KiB allreduce is
a few tens of microseconds, most of it Python); this holds the count where it stands, so a
change that adds layers to the hot path is seen. Counted in the calling thread, the median
over calls, a wait for the peers as one call, at every rank count.
"""

import pathlib
import statistics
import sys

import numpy as np
import pytest

import hororing as hvd

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
from bench_call_cost import calls_made  # noqa: E402  (the benchmark's column counts alike)

# the calls counted at this point (1-3 ranks, on a quiet machine and beside busy loops alike:
# Sum 22, Average 27 where the lane's cycle runs Python's steps, asking the loader each call
# until its compiled cycle is due (HORORING_COMPILED_STEPS_AFTER); 10 where it runs compiled:
# the division is a few calls more; the repeated call runs its lane, engine/lane.py), with
# one to spare; the bound for a repeated blocking call is 30. Lower them when the path
# gets leaner. Fewer than FEWEST: the count itself is broken
FEWEST = 6
BUDGET = {hvd.Sum: 23, hvd.Average: 28}


def calls_per_allreduce(call, repeats=60):
    """The median count of Python calls ``call()`` makes (``calls_made``: a wait for the
    peers counts as one call however long it takes)."""
    return statistics.median(calls_made(call) for _ in range(repeats))


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average], ids=["Sum", "Average"])
def test_a_repeated_blocking_4_kib_allreduce_stays_within_its_call_budget(op, named):
    """Named or not (an unnamed blocking call repeats one name: Group.blocking_name, which
    the door answers for the main thread without the call)."""
    values = np.ones(1024, dtype=np.float32)
    name = f"budget.{op}" if named else None

    def call():
        values[...] = 1.0
        hvd.allreduce_(values, op=op, name=name)
    for _ in range(20):  # the steady state: the fold's plan made, the names cached
        call()
    calls = calls_per_allreduce(call)
    assert FEWEST <= calls <= BUDGET[op], f"{calls} Python calls per blocking 4 KiB allreduce_"
    expected = 1.0 if op == hvd.Average else float(hvd.size())
    np.testing.assert_array_equal(values, np.full(1024, expected, dtype=np.float32))


# the torch binding's blocking verbs on a tensor that needs no gradient (1-3 ranks: allreduce
# 27, allreduce_ 26 with the lane's cycle in Python as above, broadcast 64 at this point, with
# one to spare); they skip the autograd Function. The bound for a repeated blocking
# torch call is 40
TORCH_BUDGET = {"allreduce": 28, "allreduce_": 27, "broadcast": 65}


@pytest.mark.parametrize("verb", sorted(TORCH_BUDGET))
def test_the_torch_bindings_blocking_verbs_stay_within_their_call_budget(verb):
    torch = pytest.importorskip("torch")
    import hororing.torch as hvd_torch

    tensor = torch.full((1024,), float(hvd.rank() + 1))
    results = []

    def call():
        if verb == "allreduce":
            results.append(hvd_torch.allreduce(tensor, op=hvd.Sum, name="budget.torch"))
        elif verb == "allreduce_":
            inplace = torch.full((1024,), float(hvd.rank() + 1))
            assert hvd_torch.allreduce_(inplace, op=hvd.Sum, name="budget.torch_") is inplace
            results.append(inplace)
        else:
            results.append(hvd_torch.broadcast(tensor, 0, name="budget.torch.broadcast"))
    for _ in range(20):
        call()
    calls = calls_per_allreduce(call)
    assert FEWEST <= calls <= TORCH_BUDGET[verb], f"{calls} Python calls per blocking torch {verb}"
    expected = (sum(range(1, hvd.size() + 1)) if verb.startswith("allreduce") else 1.0)
    assert all(torch.equal(result, torch.full((1024,), float(expected))) for result in results)
