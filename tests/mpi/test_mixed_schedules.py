"""A random mix of blocking and asynchronous allreduces of many sizes, the same calls in the
same order on every rank, each rank pausing at its own moments: the ranks meet the
negotiation's cycles at different points (a rank's calls announced in one cycle, a peer's
over several; a rank with news starting a cycle its peers join only when woken), and the
fold's rows change width as the sizes go by. The deadlock check (which would end a hang
after its grace) is off, so a cycle one rank cannot finish fails the test by its timeout.
Every result against the reference."""

import random
import time

import numpy as np
import pytest

import hororing as hvd
from reference import assert_close

SIZES = (1, 16, 1000, 2049, 4096, 8209, 20000)  # gathered and shared rows, and the ring's
ROUNDS = 300
CASES = ((hvd.Sum, "float32"), (hvd.Max, "int32"), (hvd.Average, "float64"))


@pytest.fixture(autouse=True)
def no_deadlock_check():
    hvd.shutdown()
    hvd.init(deadlock_grace_seconds=0)
    yield
    hvd.shutdown()
    hvd.init()


def _values(rank, count, dtype):
    return (np.arange(count) % 997 + 3 * rank).astype(dtype)


def _expected(op, count, dtype):
    stacked = np.stack([_values(rank, count, np.float64) for rank in range(hvd.size())])
    if op == hvd.Max:
        return stacked.max(axis=0).astype(dtype)
    total = stacked.sum(axis=0)
    return (total / hvd.size() if op == hvd.Average else total).astype(dtype)


@pytest.mark.timeout(120)
def test_a_random_mix_of_blocking_and_asynchronous_calls_completes_on_every_rank():
    schedule = random.Random(2026)  # the same on every rank
    pauses = random.Random(100 + hvd.rank())  # this rank's own
    for round_ in range(ROUNDS):
        calls = [(schedule.choice(SIZES), schedule.choice(CASES))
                 for _ in range(1 if schedule.random() < 0.6 else schedule.randint(2, 4))]
        handles = []
        for index, (count, (op, dtype)) in enumerate(calls):
            name = f"mixed.{index}.{count}.{dtype}"
            tensor = _values(hvd.rank(), count, dtype)
            if len(calls) == 1:
                handles.append(hvd.allreduce(tensor, name=name, op=op))
            else:
                handles.append(hvd.allreduce_async(tensor, name=name, op=op))
            if pauses.random() < 0.2:
                time.sleep(pauses.random() * 1e-3)
        for handle, (count, (op, dtype)) in zip(handles, calls):
            result = handle if len(calls) == 1 else hvd.synchronize(handle)
            expected = _expected(op, count, dtype)
            if op == hvd.Average:
                assert_close(result, expected)
            else:
                np.testing.assert_array_equal(result, expected, err_msg=f"round {round_}")
