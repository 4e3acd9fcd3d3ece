"""Rabenseifner's allreduce and recursive doubling, every rank a thread over an in-process
stand-in for MPI's point-to-point calls: 1 to 16 ranks, powers of two and not, buffers not
divisible by the rank count, every op; results against a float64 / integer reference, the
same bits on every rank, and the steps and bytes the schedules promise."""

import collections
import math
import threading

import numpy as np
import pytest

from hororing.algorithms.halving import Rabenseifner, RecursiveDoubling
from hororing.algorithms.plan import fold, halving_factors, halving_schedule, prime_factors


class _Request:
    def __init__(self, test):
        self.Test = test


class _Network:
    """Messages in flight between thread ranks, in order per (source, destination)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queues = collections.defaultdict(collections.deque)
        self.sent = collections.Counter()  # rank -> messages


class _Comm:
    def __init__(self, network, rank, size):
        self.network, self.rank, self.size = network, rank, size

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank

    def Isend(self, buffer, dest, tag=0):
        with self.network.lock:
            self.network.queues[(self.rank, dest)].append(np.array(buffer, copy=True))
            self.network.sent[self.rank] += 1
        return _Request(lambda: True)

    def Irecv(self, buffer, source, tag=0):
        done = []

        def test():
            if not done:
                with self.network.lock:
                    queue = self.network.queues[(source, self.rank)]
                    if not queue:
                        return False
                    message = queue.popleft()
                assert message.size == buffer.size, (message.size, buffer.size)
                buffer[...] = message
                done.append(True)
            return True
        return _Request(test)


def run_ranks(size, make, inputs, op="sum", finalize=None):
    """Run ``make(comm).allreduce`` on ``size`` thread ranks; their results and algorithms."""
    network = _Network()
    results, algorithms, errors = [None] * size, [None] * size, []

    def rank_main(rank):
        try:
            algorithm = algorithms[rank] = make(_Comm(network, rank, size))
            buffer = inputs[rank].copy()
            algorithm.allreduce(buffer, op, finalize)
            results[rank] = buffer
        except BaseException as error:  # reported by the test
            errors.append(error)
    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank never finished"
    if errors:
        raise errors[0]
    assert not any(network.queues.values()), "messages left unreceived"
    return results, algorithms, network


ALGORITHMS = {"rabenseifner": Rabenseifner, "recursive_doubling": RecursiveDoubling,
              # messages in pieces of 40 bytes (reduce-scatter pieces reduced as they arrive)
              "rabenseifner_pieces": lambda comm: Rabenseifner(comm, subchunk_bytes=40),
              "recursive_doubling_pieces": lambda comm: RecursiveDoubling(comm,
                                                                          subchunk_bytes=40)}
REFERENCE = {"sum": np.sum, "min": np.min, "max": np.max, "product": np.prod}


def _inputs(size, count, dtype, op, seed):
    rng = np.random.default_rng([seed, size, count])
    if op == "product":
        return [rng.choice([1, 1, 1, 2, -1], size=count).astype(dtype) for _ in range(size)]
    if np.dtype(dtype).kind == "f":
        return [rng.uniform(-20, 20, size=count).astype(dtype) for _ in range(size)]
    return [rng.integers(-20, 21, size=count).astype(dtype) for _ in range(size)]


@pytest.mark.parametrize("kind", sorted(ALGORITHMS))
@pytest.mark.parametrize("size", list(range(1, 17)))
@pytest.mark.parametrize("count", [1, 7, 1001])
def test_sum_matches_the_reference_with_the_same_bits_everywhere(kind, size, count):
    inputs = _inputs(size, count, "float64", "sum", seed=1)
    results, _, _ = run_ranks(size, ALGORITHMS[kind], inputs)
    expected = np.sum(np.stack(inputs), axis=0)
    np.testing.assert_allclose(results[0], expected, rtol=1e-12, atol=1e-12)
    for result in results[1:]:
        assert result.tobytes() == results[0].tobytes()


@pytest.mark.parametrize("kind", sorted(ALGORITHMS))
@pytest.mark.parametrize("size", [3, 5, 6, 8, 12])
@pytest.mark.parametrize("op", sorted(REFERENCE))
@pytest.mark.parametrize("dtype", ["int32", "float32", "uint8"])
def test_every_op_and_dtype(kind, size, op, dtype):
    if dtype == "uint8" and op == "product":
        pytest.skip("negative factors")
    inputs = _inputs(size, 37, dtype, op, seed=2)
    if dtype == "uint8":  # sums of 12 ranks' values up to 20 fit
        inputs = [np.abs(array.astype(np.int64)).astype(np.uint8) for array in
                  _inputs(size, 37, "int32", op, seed=2)]
    results, _, _ = run_ranks(size, ALGORITHMS[kind], inputs, op=op)
    expected = REFERENCE[op](np.stack(inputs).astype(np.float64), axis=0)
    np.testing.assert_allclose(results[0].astype(np.float64), expected, rtol=1e-5)
    for result in results[1:]:
        assert result.tobytes() == results[0].tobytes()


@pytest.mark.parametrize("kind", sorted(ALGORITHMS))
@pytest.mark.parametrize("size", [1, 2, 5, 7, 8, 16])
def test_the_finalizer_runs_once_on_every_element(kind, size):
    """Average: each reduced element divided once, on whichever rank reduced it."""
    inputs = _inputs(size, 999, "float64", "sum", seed=3)

    def divide(piece):
        piece /= size
    results, _, _ = run_ranks(size, ALGORITHMS[kind], inputs, finalize=divide)
    np.testing.assert_allclose(results[-1], np.mean(np.stack(inputs), axis=0), rtol=1e-12)
    for result in results[:-1]:
        assert result.tobytes() == results[-1].tobytes()


def test_float16_buffers_are_reduced_in_float16_the_same_everywhere():
    inputs = _inputs(6, 100, "float16", "sum", seed=4)
    for make in ALGORITHMS.values():
        results, _, _ = run_ranks(6, make, inputs)  # 6: on its factors, 2 x 3
        np.testing.assert_allclose(results[0].astype(np.float64),
                                   np.sum(np.stack(inputs).astype(np.float64), axis=0), atol=0.2)
        assert len({result.tobytes() for result in results}) == 1


@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_a_power_of_two_moves_the_ring_s_bytes_in_log_steps(size):
    count = 16 * 1024
    inputs = _inputs(size, count, "float32", "sum", seed=5)
    _, algorithms, network = run_ranks(size, Rabenseifner, inputs)
    steps = 2 * int(math.log2(size))
    for rank, algorithm in enumerate(algorithms):
        assert network.sent[rank] == steps
        assert algorithm.bytes_sent == 2 * (size - 1) * count * 4 // size
    _, algorithms, network = run_ranks(size, RecursiveDoubling, inputs)
    assert set(network.sent.values()) == {steps // 2}
    assert {algorithm.bytes_sent for algorithm in algorithms} == {steps // 2 * count * 4}
    # in pieces of 4 KiB: the first halving step's 32 KiB message (of 64 KiB) as 8 pieces,
    # and the allgather's last step's alike
    _, algorithms, network = run_ranks(size, lambda comm: Rabenseifner(
        comm, subchunk_bytes=4096), inputs)
    halves = [count * 4 // 2 >> step for step in range(int(math.log2(size)))]
    pieces = sum(max(1, -(-half // 4096)) for half in halves)
    assert set(network.sent.values()) == {2 * pieces}
    assert {algorithm.bytes_sent for algorithm in algorithms} == {
        2 * (size - 1) * count * 4 // size}


def test_a_count_with_small_prime_factors_runs_on_them_without_a_fold():
    assert halving_factors(12) == (12, (2, 2, 3))
    assert halving_factors(1000) == (1000, (2, 2, 2, 5, 5, 5))
    assert halving_factors(96) == (96, (2, 2, 2, 2, 2, 3))
    # a large prime factor: the largest power of two, the extra ranks folded in
    assert halving_factors(11) == (8, (2, 2, 2))
    assert halving_factors(4093) == (2048, (2,) * 11)
    assert halving_factors(1016) == (512, (2,) * 9)  # 8 x 127
    assert prime_factors(360) == (2, 2, 2, 3, 3, 5)
    count = 12 * 5
    inputs = _inputs(12, count, "float64", "sum", seed=6)
    _, algorithms, network = run_ranks(12, Rabenseifner, inputs)
    for rank, algorithm in enumerate(algorithms):
        assert network.sent[rank] == 2 * (1 + 1 + 2)
        assert algorithm.bytes_sent == 2 * 11 * count * 8 // 12


@pytest.mark.parametrize("size,members", [(3, 2), (6, 4), (7, 4), (13, 8)])
def test_folded_ranks_hand_their_buffer_over_and_take_the_result(size, members):
    roles = [fold(size, rank, members) for rank in range(size)]
    extra = size - members
    assert [role.virtual for role in roles].count(None) == extra
    assert sorted(role.virtual for role in roles if role.virtual is not None) == \
        list(range(members))
    for rank, role in enumerate(roles):
        if role.virtual is None:
            assert roles[role.partner].partner == rank


@pytest.mark.parametrize("factors", [(2, 2, 2), (3, 2), (2, 5), (7,), (3, 3, 2)])
def test_every_block_is_owned_by_exactly_one_member(factors):
    members = math.prod(factors)
    owned = [halving_schedule(rank, factors, lambda v: v)[1] for rank in range(members)]
    assert sorted(owned) == [(block, block + 1) for block in range(members)]
    for rank in range(members):
        steps, _ = halving_schedule(rank, factors, lambda v: v)
        assert len(steps) == 2 * sum(factor - 1 for factor in factors)
