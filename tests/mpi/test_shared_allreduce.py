"""The allreduce through the node's shared memory (algorithms/shared.py), where every rank of
the job is on one node: the same bits as the gathered path (both combine every rank's values
in rank order) for every op and several dtypes, with prescale and postscale, sizes no rank
count divides, in place and out of place, across segments; the same bits again when a
repeated call folds; offered exactly where the ranks share a node; the route choosing it and
HORORING_SHARED_ALLREDUCE's switch taking it away."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing import faults
from hororing.algorithms import cost
from hororing.shared_window import SharedWindow
from hororing.algorithms.shared import SharedMemory
from hororing.context import current
from reference import (all_inputs, assert_close, assert_identical_on_every_rank,
                       every_rank_on_one_node, rank_input, reference_allreduce)

OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
DTYPES = ["float16", "float32", "float64", "int32", "uint8"]
LENGTHS = [1, 1001, 70001]  # none divisible by 2, 3, 4 or 5; 1: ranks with empty chunks


OFFERED = MPI.COMM_WORLD.Get_size() > 1 and every_rank_on_one_node()
NEEDS_SHARED = pytest.mark.skipif(not OFFERED, reason="the ranks do not all share one node "
                                  "(or there is one rank): no shared-memory allreduce")


def _pipeline():
    return current().engine.allreduce


def _forced(kind, call):
    """``call()`` with every bucket reduced by ``kind``; the kinds that ran."""
    pipeline = _pipeline()
    pipeline.force(kind)
    try:
        with pipeline.watch() as seen:
            result = call()
    finally:
        pipeline.force(None)
    return result, {entry[0] for entry in seen}


def test_offered_exactly_where_every_rank_sharesevery_rank_on_one_node():
    assert _pipeline().has("shared") == OFFERED
    if not OFFERED:
        with pytest.raises(ValueError, match="no 'shared' allreduce in this job"):
            _pipeline().force("shared")


@NEEDS_SHARED
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bits_of_the_gathered_path_for_every_op(dtype, length):
    for index, op in enumerate(OPS):
        inputs = all_inputs(hvd.size(), (length,), dtype, index, op)
        mine = inputs[hvd.rank()]
        name = f"shared.bits.{dtype}.{length}.{hvd.ops.op_name(op)}"
        shared, ran = _forced("shared", lambda: hvd.allreduce(mine, name=name + ".s", op=op))
        assert ran == {"shared"}
        gathered, ran = _forced("small", lambda: hvd.allreduce(mine, name=name + ".g", op=op))
        assert ran == {"small"}
        assert shared.tobytes() == gathered.tobytes(), (dtype, length, hvd.ops.op_name(op))
        assert_close(shared, reference_allreduce(inputs, op))
        assert_identical_on_every_rank(shared)


@NEEDS_SHARED
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_prescale_and_postscale_in_place(dtype):
    inputs = all_inputs(hvd.size(), (1001,), dtype, 7)
    for op in (hvd.Sum, hvd.Average):
        buffers = {}
        for kind in ("shared", "small"):
            buffer = inputs[hvd.rank()].copy()
            _, ran = _forced(kind, lambda: hvd.allreduce_(
                buffer, name=f"shared.scaled.{dtype}.{op}.{kind}", op=op, prescale_factor=0.5,
                postscale_factor=3.0))
            assert ran == {kind}
            buffers[kind] = buffer
        assert buffers["shared"].tobytes() == buffers["small"].tobytes()
        assert_close(buffers["shared"], reference_allreduce(inputs, op, 0.5, 3.0))


@NEEDS_SHARED
def test_a_fused_bucket_and_a_16_bit_wire():
    """Several tensors fused into one buffer, and float32 tensors sent as float16
    (the torch binding's Compression.fp16: the reduction runs in float16), each as the gathered path gives it."""
    inputs = [all_inputs(hvd.size(), (length,), "float32", length) for length in (3, 517, 2049)]

    def bucket(kind):
        handles = [hvd.allreduce_async(values[hvd.rank()], name=f"shared.bucket.{kind}.{index}",
                                       op=hvd.Average)
                   for index, values in enumerate(inputs)]
        return [hvd.synchronize(handle) for handle in handles]

    shared, ran = _forced("shared", lambda: bucket("shared"))
    assert ran == {"shared"}
    gathered, ran = _forced("small", lambda: bucket("small"))
    assert ran == {"small"}
    for mine, theirs, values in zip(shared, gathered, inputs):
        assert mine.tobytes() == theirs.tobytes()
        assert_close(mine, reference_allreduce(values, hvd.Average))

    def wire16(kind):
        import torch

        import hororing.torch as htorch
        tensor = torch.from_numpy(inputs[1][hvd.rank()].copy())
        return htorch.allreduce(tensor, name=f"shared.fp16.{kind}", op=htorch.Sum,
                                compression=htorch.Compression.fp16).numpy()
    shared, ran = _forced("shared", lambda: wire16("shared"))
    assert ran == {"shared"}
    gathered, _ = _forced("small", lambda: wire16("small"))
    assert shared.tobytes() == gathered.tobytes()
    assert_identical_on_every_rank(shared)


@NEEDS_SHARED
@pytest.mark.parametrize("flags", [False, True], ids=["mpi-barrier", "flag-barrier"])
@pytest.mark.parametrize("segment_bytes", [64, 4096])
def test_segments_and_empty_chunks_on_its_own_communicator(segment_bytes, flags):
    """The algorithm alone with tiny rows: many segments, the last a partial one, chunks that
    are empty where a segment has fewer elements than ranks; in place and out of place,
    with a finalizer applied once per element; its barriers MPI's or the window's flags."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=hvd.rank())
    algorithm = SharedMemory(node, segment_bytes=segment_bytes, flags=flags)
    try:
        for length in (2, 17, 3001):
            inputs = all_inputs(hvd.size(), (length,), "float64", length)
            expected = np.sum(inputs, axis=0) * 2.0
            in_place = inputs[hvd.rank()].copy()
            algorithm.allreduce(in_place, "sum", finalize=lambda piece: piece.__imul__(2.0))
            out = np.full(length, np.nan)
            source = inputs[hvd.rank()].copy()
            algorithm.allreduce(out, "sum", finalize=lambda piece: piece.__imul__(2.0),
                                source=source)
            assert np.array_equal(source, inputs[hvd.rank()])  # the input untouched
            for result in (in_place, out):
                np.testing.assert_allclose(result, expected, rtol=1e-12)
                assert_identical_on_every_rank(result)
    finally:
        algorithm.free()


@NEEDS_SHARED
def test_the_flag_barrier_orders_every_write_before_every_read():
    """The window's flag barrier (shared_window.SharedWindow, flags=True): round after round each
    rank writes the round into its row, passes a barrier, reads every rank's row and passes
    a second barrier before writing again; ranks arrive late at random, one rank in turn
    sleeping before it writes. A barrier that let a rank through before every rank had
    written (or before every rank had read) shows the wrong round here."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=hvd.rank())
    window = SharedWindow(node, node.Get_size(), 64 * 8, flags=True)
    rows = window.rows.view(np.int64)
    random = np.random.default_rng(hvd.rank())
    seen = []
    try:
        for round_ in range(1, 201):
            if round_ % node.Get_size() == node.Get_rank() or random.random() < 0.1:
                time.sleep(random.random() * 1e-3)
            rows[node.Get_rank()] = round_
            window.barrier()
            seen.append(rows.min() == round_ and rows.max() == round_)
            window.barrier()
    finally:
        window.free()
        node.Free()
    assert all(seen), f"rounds read with another rank's row of another round: " \
                      f"{[i + 1 for i, ok in enumerate(seen) if not ok][:10]}"


@NEEDS_SHARED
def test_its_barriers_wait_on_flags_unless_a_dead_peer_is_recovered_from():
    """The job's shared allreduce waits on the window's flags, except under an MPI that
    recovers from a dead peer in process (ULFM), whose own barrier fails when one dies."""
    assert _pipeline().host.algorithms["shared"].flags is not faults.supported()


@NEEDS_SHARED
def test_a_repeated_call_folds_with_the_same_bits():
    """Below the latency path's threshold a repeated call the route gives the shared
    allreduce folds into the negotiation (each rank reduces every row in rank order): its
    results are the shared allreduce's, bit for bit."""
    engine = current().engine
    length = 4099
    name = "shared.folds"

    def stats():
        return engine.stats().get("inline_hits", 0)
    expected = {}
    for seed in range(3):  # unfolded: the first call of each value set under a new name
        values = rank_input(hvd.rank(), (length,), "float32", seed)
        expected[seed], ran = _forced(
            "shared", lambda: hvd.allreduce(values, name=f"{name}.first.{seed}", op=hvd.Average))
        assert ran == {"shared"}
    pipeline = _pipeline()
    pipeline.force("shared")
    try:
        folded = False
        for _ in range(200):
            before = stats()
            hvd.allreduce(np.zeros(length, np.float32), name=name, op=hvd.Average)
            if MPI.COMM_WORLD.allreduce(stats() > before, op=MPI.LAND):
                folded = True
                break
        assert folded
        for seed in range(3):
            values = rank_input(hvd.rank(), (length,), "float32", seed)
            result = hvd.allreduce(values, name=name, op=hvd.Average)
            assert result.tobytes() == expected[seed].tobytes(), seed
    finally:
        pipeline.force(None)


@NEEDS_SHARED
def test_the_route_chooses_it_and_the_switch_takes_it_away():
    length = (4 << 20) // 4 + 3  # 4 MiB: a bandwidth-bound size
    table = _pipeline().route.table
    assert "shared" in {kind for _, kind in table}, table
    values = rank_input(hvd.rank(), (length,), "float32")
    hvd.shutdown()
    hvd.init(shared_allreduce=False)
    try:
        assert not _pipeline().has("shared")
        assert "shared" not in {kind for _, kind in _pipeline().route.table}
        with _pipeline().watch() as seen:
            result = hvd.allreduce(values, name="shared.off", op=hvd.Sum)
        assert "shared" not in {entry[0] for entry in seen}
        assert_close(result, reference_allreduce(all_inputs(hvd.size(), (length,), "float32"),
                                                 hvd.Sum))
    finally:
        hvd.shutdown()
        hvd.init()


@NEEDS_SHARED
@pytest.mark.parametrize("in_place", [False, True])
def test_a_bucket_of_large_members_reduced_where_they_lie(in_place):
    """A fused bucket whose large members are reduced in their own memory (the bucket laid
    out in segments, engine/segments.py): below ``cost.SHARED_LARGEST_BYTES`` the shared
    allreduce goes through it segment by segment; above, the ring or one reduction per
    segment."""
    for lengths in ([150001, 7, 120003, 3], [300001, 5, 300003], [600001, 5, 600003]):
        inputs = [all_inputs(hvd.size(), (length,), "float32", length) for length in lengths]
        mine = [values[hvd.rank()].copy() for values in inputs]
        name = f"shared.members.{len(lengths)}.{in_place}"
        laid_out = []  # the buffers handed to an algorithm: segmented or flat

        def observe(kind, buffer):
            laid_out.append((kind, type(buffer).__name__))
        _pipeline().observers.append(observe)
        try:
            if in_place:
                hvd.grouped_allreduce_(mine, name=name, op=hvd.Average)
                results = mine
            else:
                results = hvd.grouped_allreduce(mine, name=name, op=hvd.Average)
        finally:
            _pipeline().observers.remove(observe)
        # members are large from the cost model's size, which grows with the rank count
        # (218 KB at 3 ranks, 764 KB at 8: there the first bucket is packed whole)
        if 4 * sum(lengths) < cost.SHARED_LARGEST_BYTES and \
                4 * max(lengths) >= _pipeline().route.member_bytes:
            assert laid_out == [("shared", "Segmented")], laid_out
        for result, values in zip(results, inputs):
            assert_close(result, reference_allreduce(values, hvd.Average))
            assert_identical_on_every_rank(result)


CHUNKED_LENGTH = 150001  # 300 KB in float16 to 1.2 MB in float64: rows reduced chunk by chunk


def _until_folded(call, most=200):
    """``call()`` until a call has folded on every rank (at most ``most``); whether one did.
    Whether a given call folds depends on the peers' timing, so whether to go on is agreed
    outside the library."""
    engine = current().engine
    for _ in range(most):
        before = engine.stats().get("inline_hits", 0)
        call()
        if MPI.COMM_WORLD.allreduce(engine.stats().get("inline_hits", 0) > before,
                                    op=MPI.LAND):
            return True
    return False


@pytest.fixture(params=[True, False], ids=["chunks", "rows"])
def chunked(request, monkeypatch):
    """Shared fold rows of 256 KiB and more reduced chunk by chunk whether or not ranks
    crowd the cores (the default: from 32 KiB where each has a core, from 256 KiB where they
    crowd), or never; the length of the rows differs, so they are made again."""
    from hororing.engine import fold
    least = 256 * 1024 if request.param else 1 << 40
    monkeypatch.setattr(fold, "CHUNKED_BYTES", least)
    monkeypatch.setattr(fold, "CROWDED_CHUNKED_BYTES", least)
    return request.param


@NEEDS_SHARED
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32"])
def test_a_repeated_call_above_the_latency_threshold_folds_with_the_same_bits(
        dtype, in_place, chunked):
    """A repeated call the shared allreduce would take at any size up to 2 MiB folds, its rows
    reduced whole by every rank or chunk by chunk (each rank its chunk of every row, then a
    second barrier): for every op the bits of the unfolded shared allreduce, and a float64
    reference's values."""
    from hororing.engine.fold import _Chunked
    length = CHUNKED_LENGTH + (0 if chunked else 2)
    fold = current().engine.cycle._fold
    pipeline = _pipeline()
    folded = []  # whether each compared call folded (most do; timing decides)
    for index, op in enumerate(OPS):
        name = f"shared.chunked.{dtype}.{in_place}.{hvd.ops.op_name(op)}"
        inputs = {seed: all_inputs(hvd.size(), (length,), dtype, 10 * index + seed, op)
                  for seed in range(3)}
        expected = {}
        for seed, values in inputs.items():  # unfolded: a new name each time
            expected[seed], ran = _forced("shared", lambda: hvd.allreduce(
                values[hvd.rank()], name=f"{name}.first.{seed}", op=op))
            assert ran == {"shared"}
        pipeline.force("shared")
        try:
            buffer = inputs[0][hvd.rank()].copy()

            def call(seed=0):
                buffer[...] = inputs[seed][hvd.rank()]
                return hvd.allreduce_(buffer, name=name, op=op) if in_place else \
                    hvd.allreduce(buffer, name=name, op=op)
            assert _until_folded(call)
            assert isinstance(fold.gathered, _Chunked) == chunked
            for seed, values in inputs.items():
                hits = current().engine.stats()["inline_hits"]
                result = call(seed)
                assert result.tobytes() == expected[seed].tobytes(), (seed, op)
                assert (result is buffer) == in_place
                if not in_place:
                    assert buffer.tobytes() == values[hvd.rank()].tobytes()  # input untouched
                assert_close(result, reference_allreduce(values, op))
                folded.append(current().engine.stats()["inline_hits"] > hits)
        finally:
            pipeline.force(None)
    assert MPI.COMM_WORLD.allreduce(sum(folded)) > 0


@NEEDS_SHARED
@pytest.mark.parametrize("change", ["op", "shape", "dtype"])
def test_a_peer_that_changes_a_chunked_fold_fails_every_rank_by_name(change, monkeypatch):
    """Under a chunked fold the last rank changes its call: every rank names the mismatch
    (none enters the chunks' barrier), and the next call gives the sum."""
    from changed_call import last_rank_changes_its_call
    from hororing.engine import fold
    monkeypatch.setattr(fold, "CHUNKED_BYTES", 256 * 1024)
    monkeypatch.setattr(fold, "CROWDED_CHUNKED_BYTES", 256 * 1024)
    name = f"shared.chunked.mismatch.{change}"
    values = np.ones(CHUNKED_LENGTH + 4, dtype=np.float32)
    _pipeline().force("shared")
    try:
        assert _until_folded(lambda: hvd.allreduce_(values.copy(), name=name, op=hvd.Sum))
        assert isinstance(current().engine.cycle._fold.gathered, fold._Chunked)
        last_rank_changes_its_call(name, values, change)
    finally:
        _pipeline().force(None)


@NEEDS_SHARED
def test_rows_beyond_the_shared_memory_budget_do_not_fold(monkeypatch):
    """Above the latency threshold the fold's rows must fit the node's budget
    (fold.shared_rows_budget): a repeated call whose rows would not takes the shared allreduce
    every time, with the right sum."""
    monkeypatch.setattr(current().engine._folding, "rows_budget", 1 << 20)
    length = (1 << 20) // 4 + 5  # 1 MiB of float32 a row: over the budget at any rank count
    values = np.arange(length, dtype=np.float32) + hvd.rank()
    expected = np.arange(length, dtype=np.float64) * hvd.size() + sum(range(hvd.size()))
    engine = current().engine
    before = engine.stats().get("inline_hits", 0)
    with _pipeline().watch() as seen:
        for _ in range(12):
            assert_close(hvd.allreduce(values, name="shared.budget", op=hvd.Sum),
                         expected.astype(np.float32))
    assert engine.stats().get("inline_hits", 0) == before
    assert {entry[0] for entry in seen} == {"shared"}
