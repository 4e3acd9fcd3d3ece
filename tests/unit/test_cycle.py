"""The negotiation cycle in one process: several ranks played by threads over an in-process
exchange, with an executor that records what it is handed. No MPI, no engine thread."""

import threading
import time

import numpy as np
import pytest

from hororing.engine.cycle import FLAG_FAILED, FLAG_SHUTDOWN, Cycle, JobEnded
from hororing.engine.negotiation import Meta
from hororing.engine.request import Handle, Request
from hororing.ops import Sum


class _Hub:
    """What the ranks of one LocalExchange group have posted, by collective number."""

    def __init__(self, size):
        self.size = size
        self.lock = threading.Lock()
        self.posted = {}  # number -> {rank: payload}


class _Posted:
    """One rank's part in one collective: complete when every rank has posted."""

    def __init__(self, hub, number, deliver):
        self._hub, self._number, self._deliver, self._done = hub, number, deliver, False

    def Test(self):
        if not self._done:
            with self._hub.lock:
                payloads = self._hub.posted[self._number]
                if len(payloads) == self._hub.size:
                    self._deliver([payloads[rank] for rank in range(self._hub.size)])
                    self._done = True
        return self._done


class _Repeated:
    def __init__(self, exchange, kind, sendbuf, recvbuf, op):
        self._start = lambda: exchange.post(sendbuf, _deliver_into(kind, recvbuf, op))

    def start(self):
        return self._start()

    def free(self):
        pass


def _deliver_into(kind, recvbuf, op=None):
    def deliver(payloads):
        if kind == "allreduce":
            assert op == "band"
            recvbuf[...] = np.bitwise_and.reduce(np.stack(payloads), axis=0)
        else:
            recvbuf[...] = np.stack(payloads)
    return deliver


class LocalExchange:
    """``exchange.MpiExchange``'s calls for one of ``hub.size`` ranks in this process."""

    def __init__(self, hub, rank):
        self._hub, self.size, self.rank = hub, hub.size, rank
        self._count = 0

    def post(self, payload, deliver):
        number, self._count = self._count, self._count + 1
        with self._hub.lock:
            self._hub.posted.setdefault(number, {})[self.rank] = np.array(payload, copy=True)
        return _Posted(self._hub, number, deliver)

    def repeated(self, kind, sendbuf, recvbuf, op=None):
        return _Repeated(self, kind, sendbuf, recvbuf, op)

    def allgather(self, row, rows):
        return self.post(row, _deliver_into("allgather", rows))

    def allgatherv(self, own, gathered, lengths, offsets):
        def deliver(payloads):
            for rank, payload in enumerate(payloads):
                gathered[offsets[rank]:offsets[rank] + lengths[rank]] = payload
        return self.post(np.frombuffer(own, dtype=np.uint8), deliver)


class RecordingExecutor:
    """Completes each request with its name (an error response with its error), and
    records the names in the order it was handed them; folds nothing."""

    def __init__(self):
        self.ran = []

    def execute(self, responses, take):
        for response in responses:
            self.ran.append(response.name)
            request = take(response.name)
            if request is None:
                continue
            if response.error is not None:
                request.handle.set_error(ValueError(response.error))
            else:
                request.handle.set_result(response.name)

    def lone_bytes(self, response):
        return None


class FoldingExecutor(RecordingExecutor):
    """Folds a one-element float64 Sum allreduce into the exchange, as the latency path would."""

    def lone_bytes(self, response):
        return 8 if response.error is None and response.meta.kind == "allreduce" else None

    def contribute(self, request, out, plan=None, least=0):
        out.view(np.float64)[0] = request.tensor[0]
        return True

    def finish(self, response, request, rows, plan=None):
        self.ran.append(response.name)
        request.handle.set_result(float(rows.view(np.float64).sum()))

    def execute(self, responses, take):
        for response in responses:
            self.ran.append(response.name)
            request = take(response.name)
            request.handle.set_result(None)  # the vote's path: not what these tests check


class SizedFoldingExecutor(FoldingExecutor):
    """Folds float64 Sum allreduces of any length, each in the first bytes of the rows, as
    ``fold.LatencyFolding`` does; records the rows' width of every folded call."""

    def __init__(self):
        super().__init__()
        self.widths = []

    def lone_bytes(self, response):
        if response.error is not None or response.meta.kind != "allreduce":
            return None
        return 8 * int(np.prod(response.meta.shape))

    def contribute(self, request, out, plan=None, least=0):
        nbytes = request.tensor.nbytes
        if nbytes > out.nbytes or nbytes < least:
            return False
        out[:nbytes].view(np.float64)[...] = request.tensor
        return True

    def finish(self, response, request, rows, plan=None):
        self.ran.append(response.name)
        self.widths.append(rows.shape[1])
        nbytes = request.tensor.nbytes
        request.handle.set_result(rows[:, :nbytes].view(np.float64).sum(axis=0).tolist())


class AcrossNodes(LocalExchange):
    """A LocalExchange whose ranks are on different nodes."""

    def one_node(self):
        return False


def _request(name, value=0.0, shape=(1,)):
    meta = Meta("allreduce", "float64", shape, Sum)
    return Request(name, meta, np.full(shape, value), None, Handle(name, None))


def _play(size, script, executor=RecordingExecutor, cache_capacity=64, exchange=LocalExchange):
    """Run ``script(rank, cycle, run)`` on ``size`` threads, one Cycle each, over one
    LocalExchange group; ``run(fresh)`` runs the next cycle with the requests ``fresh`` and
    returns its responses' names. Returns the rank's script results, by rank."""
    hub = _Hub(size)
    results, errors = [None] * size, []

    def rank_main(rank):
        pending = {}
        runner = executor()  # the driver's side: runs what a cycle decided, and folds
        cycle = Cycle(exchange(hub, rank), runner, cache_capacity)

        def run(fresh, **kwargs):
            pending.update((request.name, request) for request in fresh)
            decision = cycle.run(fresh, deadline=time.monotonic() + 30, **kwargs)
            assert decision is not None, "a peer never took part in the cycle"
            take = lambda name: pending.pop(name, None)  # noqa: E731
            if decision.folded is not None:
                (response,) = decision.responses
                runner.finish(response, take(response.name), decision.folded)
            else:
                runner.execute(decision.responses, take)
            return [response.name for response in decision.responses]
        try:
            results[rank] = script(rank, cycle, run)
        except BaseException as error:  # reported after join
            errors.append((rank, error))
    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank's cycle never ended"
    if errors:
        raise errors[0][1]
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_new_names_are_gathered_then_repeated_names_go_by_bit(size):
    def script(rank, cycle, run):
        names = [f"grad.{index}" for index in (range(4) if rank % 2 == 0 else reversed(range(4)))]
        first = run([_request(name) for name in names])
        gathered = cycle.stats["gather_cycles"]
        second = run([_request(name) for name in names])
        return first, second, gathered, cycle.stats["gather_cycles"]
    results = _play(size, script)
    for first, second, gathered, gathered_after in results:
        assert sorted(first) == sorted(second) == [f"grad.{index}" for index in range(4)]
        assert gathered == 1 and gathered_after == 1  # the second cycle was the vote alone
    # every rank ran the same responses in the same order
    assert len({tuple(first) for first, *_ in results}) == 1
    assert len({tuple(second) for _, second, *_ in results}) == 1


def test_a_name_not_every_rank_submitted_waits_for_it():
    def script(rank, cycle, run):
        if rank == 0:
            return run([_request("a"), _request("b")]), run([])
        return run([_request("a")]), run([_request("b")])
    for first, second in _play(2, script):
        assert first == ["a"]
        assert second == ["b"]


def test_a_shape_mismatch_fails_that_tensor_on_every_rank_before_data_moves():
    handles = {}

    def script(rank, cycle, run):
        request = _request("w", shape=(3,) if rank == 0 else (4,))
        handles[rank] = request.handle
        return run([request])
    results = _play(2, script)
    assert results == [["w"], ["w"]]
    for handle in handles.values():
        with pytest.raises(ValueError, match="w"):
            handle.result()


def test_a_failure_flag_ends_the_job_on_every_rank_with_its_message():
    def script(rank, cycle, run):
        with pytest.raises(JobEnded, match="rank 1 failed: out of memory") as ended:
            run([], flags=FLAG_FAILED if rank == 1 else 0,
                message="out of memory" if rank == 1 else None)
        return ended.value.failed
    assert _play(3, script) == [True, True, True]


def test_a_shutdown_ends_the_job_for_the_other_ranks_only():
    def script(rank, cycle, run):
        if rank == 0:
            return run([], flags=FLAG_SHUTDOWN)
        with pytest.raises(JobEnded, match="rank 0 shut down") as ended:
            run([])
        return ended.value.failed
    assert _play(2, script) == [[], False]


def test_a_repeated_lone_allreduce_folds_into_the_first_exchange():
    def script(rank, cycle, run):
        values = []
        for step in range(6):
            request = _request("loss", value=rank + step)
            run([request])
            values.append(request.handle.result())
        return values, cycle.stats["inline_hits"]
    for values, hits in _play(3, script, executor=FoldingExecutor):
        # the first two cycles go the usual way and tell the fold what repeats; the rest fold
        assert hits == 4
        assert values[2:] == [float(sum(rank + step for rank in range(3))) for step in range(2, 6)]


def _turns(lengths, rounds):
    """A script calling one float64 allreduce per name ``t{index}`` of each length in turn,
    ``rounds`` times, each rank's values its rank plus the round; gives each call's result,
    the folded calls' widths and the cycle's folded count."""
    def script(rank, cycle, run):
        results = []
        for step in range(rounds):
            for index, length in enumerate(lengths):
                request = _request(f"t{index}", value=rank + step, shape=(length,))
                run([request])
                results.append(request.handle.result())
        return results, cycle._fold.received_bytes, cycle.stats["inline_hits"]
    return script


@pytest.mark.parametrize("size", [2, 3])
def test_lone_allreduces_of_different_sizes_in_turn_fold_in_rows_of_the_widest(size):
    """A scalar, a vector and a longer vector in turn: once each name is cached (its first
    call goes by name, the usual way) and a size has come round again (a loop), every call
    folds, each in the first bytes of rows as wide as the widest (rounded to a multiple of
    ``ROW_ALIGN``), and each result is its own call's."""
    from hororing.engine.fold import ROW_ALIGN, _HEAD
    lengths, rounds = (1, 5, 3), 4
    results = _play(size, _turns(lengths, rounds), executor=SizedFoldingExecutor)
    width = -(-8 * max(lengths) // ROW_ALIGN) * ROW_ALIGN
    for values, received, hits in results:
        assert hits == len(lengths) * (rounds - 1) - 1
        assert received == size * (_HEAD + width)
        calls = [(step, length) for step in range(rounds) for length in lengths]
        for (step, length), value in zip(calls, values):
            if value is not None:  # the vote's path leaves it None (FoldingExecutor)
                assert value == [float(sum(rank + step for rank in range(size)))] * length


def test_across_nodes_calls_of_different_sizes_fold_only_within_the_extra_bytes_allowed():
    """Across nodes a narrower call folds in wider rows only while the rows carry at most
    ``MIXED_EXTRA_BYTES`` beyond it over all ranks: 1000 and 1001 values fold in turn, a
    scalar beside 8000 values never does (both go the usual way: a vote every call)."""
    from hororing.engine.fold import MIXED_EXTRA_BYTES
    size = 3
    assert 8 * 8000 - 8 > MIXED_EXTRA_BYTES // size > 8  # what the two cases rest on
    near = _play(size, _turns((1000, 1001), 3), executor=SizedFoldingExecutor,
                 exchange=AcrossNodes)
    assert all(hits == 3 for *_, hits in near)
    far = _play(size, _turns((1, 8000), 3), executor=SizedFoldingExecutor,
                exchange=AcrossNodes)
    assert all(hits == 0 for *_, hits in far)
    same_far = _play(size, _turns((1, 8000), 3), executor=SizedFoldingExecutor)
    assert all(hits == 3 for *_, hits in same_far)  # within a node, any width folds


def test_lone_cycles_of_sizes_that_do_not_come_round_again_do_not_fold():
    """Lone cycles of different sizes that do not repeat (asynchronous calls meeting cycles
    one at a time) start no fold: its exchange would be wasted whenever a cycle then holds
    several calls. A size that comes round again starts it."""
    def script(rank, cycle, run):
        for length in (1, 2, 3, 4, 5):
            run([_request(f"once.{length}", value=rank, shape=(length,))])
        before = cycle.stats["inline_cycles"]
        run([_request("once.5", value=rank, shape=(5,))])  # 5 came before: a loop
        return before, cycle.stats["inline_cycles"], cycle._fold.bytes
    for before, after, width in _play(2, script, executor=SizedFoldingExecutor):
        assert before == 0 and after == 0  # the repeat itself went the usual way
        assert width == 48  # the next cycle folds, in rows of the widest (40 bytes, to 48)
