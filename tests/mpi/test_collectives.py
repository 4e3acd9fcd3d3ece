"""allgather, broadcast, alltoall, reducescatter, barrier, join and the object helpers."""

import numpy as np
import pytest

import hororing as hvd
from reference import ALL_DTYPES, all_inputs, assert_close, rank_input, reference_allreduce


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_allgather_with_a_different_first_dimension_per_rank(dtype):
    rows = lambda rank: (rank * 2) % 3  # some ranks send no rows at all
    mine = rank_input(hvd.rank(), (rows(hvd.rank()), 3), dtype, seed=5)
    result = hvd.allgather(mine, name=f"gather.{dtype}")
    expected = np.concatenate([rank_input(rank, (rows(rank), 3), dtype, seed=5)
                               for rank in range(hvd.size())])
    np.testing.assert_array_equal(result, expected)
    assert result.dtype == np.dtype(dtype)


def test_allgather_async():
    handle = hvd.allgather_async(np.array([hvd.rank()], dtype=np.int32))
    np.testing.assert_array_equal(hvd.synchronize(handle), np.arange(hvd.size(), dtype=np.int32))


@pytest.mark.parametrize("dtype", ["uint8", "float16", "int64", "float64"])
def test_broadcast_from_every_root(dtype):
    for root in range(hvd.size()):
        mine = rank_input(hvd.rank(), (4, 3), dtype, seed=root)
        result = hvd.broadcast(mine, root_rank=root, name=f"bcast.{dtype}.{root}")
        np.testing.assert_array_equal(result, rank_input(root, (4, 3), dtype, seed=root))
        if hvd.rank() != root:
            np.testing.assert_array_equal(mine, rank_input(hvd.rank(), (4, 3), dtype, seed=root))


def test_broadcast_in_place():
    tensor = np.full(5, hvd.rank(), dtype=np.int32)
    root = hvd.size() - 1
    assert hvd.broadcast_(tensor, root) is tensor
    np.testing.assert_array_equal(tensor, np.full(5, root, dtype=np.int32))
    handle = hvd.broadcast_async_(np.full(2, float(hvd.rank())), 0)
    np.testing.assert_array_equal(hvd.synchronize(handle), np.zeros(2))


def test_alltoall_even_split():
    size = hvd.size()
    mine = np.arange(2 * size) + 100 * hvd.rank()
    received, splits = hvd.alltoall(mine)
    expected = np.concatenate([np.arange(2 * size)[2 * hvd.rank():2 * hvd.rank() + 2] + 100 * rank
                               for rank in range(size)])
    np.testing.assert_array_equal(received, expected)
    np.testing.assert_array_equal(splits, np.full(size, 2))


def test_alltoall_uneven_splits_with_zeros():
    size = hvd.size()
    splits_of = lambda rank: [(rank + peer) % 3 for peer in range(size)]
    def block(rank):
        return np.arange(sum(splits_of(rank)) * 2, dtype=np.float32).reshape(-1, 2) + 1000 * rank
    received, splits = hvd.alltoall(block(hvd.rank()), splits=splits_of(hvd.rank()))
    pieces = []
    for rank in range(size):
        start = sum(splits_of(rank)[:hvd.rank()])
        pieces.append(block(rank)[start:start + splits_of(rank)[hvd.rank()]])
    np.testing.assert_array_equal(received, np.concatenate(pieces))
    np.testing.assert_array_equal(splits, [splits_of(rank)[hvd.rank()] for rank in range(size)])


@pytest.mark.parametrize("rows", [1, 3, 7, 16, 1001])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average], ids=["Sum", "Average"])
@pytest.mark.parametrize("dtype", ["int32", "float32", "float16"])
def test_reducescatter_gives_extra_rows_to_the_first_ranks(rows, op, dtype):
    size, rank = hvd.size(), hvd.rank()
    mine = rank_input(rank, (rows, 2), dtype, seed=rows)
    result = hvd.reducescatter(mine, op=op, name=f"rs.{rows}.{op}.{dtype}")
    np.testing.assert_array_equal(mine, rank_input(rank, (rows, 2), dtype, seed=rows))
    full = reference_allreduce(all_inputs(size, (rows, 2), dtype, rows), op)
    base, extra = divmod(rows, size)
    start = rank * base + min(rank, extra)
    mine_rows = base + (1 if rank < extra else 0)
    assert_close(result, full[start:start + mine_rows])


def test_reducescatter_of_the_same_element_count_split_by_other_rows():
    """The ring keeps the pieces it cut a buffer into, per buffer shape: two reducescatters
    of 24 elements whose rows split them at different places each get their own."""
    size, rank = hvd.size(), hvd.rank()
    for shape in [(12, 2), (8, 3), (24, 1), (12, 2)]:
        mine = rank_input(rank, shape, "float32", seed=shape[0])
        result = hvd.reducescatter(mine, op=hvd.Sum, name=f"rs.same.{shape}")
        full = reference_allreduce(all_inputs(size, shape, "float32", shape[0]), hvd.Sum)
        base, extra = divmod(shape[0], size)
        start = rank * base + min(rank, extra)
        assert_close(result, full[start:start + base + (1 if rank < extra else 0)])


@pytest.mark.parametrize("count", [1, 10, 1001])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average], ids=["Sum", "Average"])
def test_reducescatter_in_place_reduces_where_the_tensor_lies(count, op):
    """hororing's in-place reducescatter: this rank's rows come back as a view into its own
    tensor, with the values of the copying reducescatter; prescale before, postscale after."""
    size, rank = hvd.size(), hvd.rank()
    mine = rank_input(rank, (count,), "float64", seed=count)
    handle = hvd.reducescatter_async_(mine, name=f"rs_.{count}.{op}", op=op,
                                      prescale_factor=0.5, postscale_factor=3.0)
    result = hvd.synchronize(handle)
    full = reference_allreduce(all_inputs(size, (count,), "float64", count), op, 0.5, 3.0)
    base, extra = divmod(count, size)
    start = rank * base + min(rank, extra)
    assert np.shares_memory(result, mine) or result.size == 0
    assert_close(result, full[start:start + base + (1 if rank < extra else 0)])


def test_reducescatter_in_place_of_float16():
    """Summed in float32 through a copy, as a float16 allreduce is; with wire="float16" (a
    compressed payload) summed in float16 where it lies, Average dividing first: 40000 from
    every rank overflows float16 summed (it ends at 65504), not averaged."""
    size, rank = hvd.size(), hvd.rank()
    plain = np.full(7, 1000.0 + rank, dtype=np.float16)
    result = hvd.synchronize(hvd.reducescatter_async_(plain, name="rs_.half", op=hvd.Sum))
    base, extra = divmod(7, size)
    rows = base + (1 if rank < extra else 0)
    np.testing.assert_array_equal(result, np.full(rows, sum(1000.0 + r for r in range(size)),
                                                  dtype=np.float16))
    wired = np.full(7, 40000.0, dtype=np.float16)
    result = hvd.synchronize(hvd.reducescatter_async_(wired, name="rs_.wire", wire="float16"))
    assert np.shares_memory(result, wired) or result.size == 0
    np.testing.assert_array_equal(result, np.full(rows, 40000.0, dtype=np.float16))


def test_reducescatter_in_place_refuses_what_it_cannot_reduce_in_place():
    with pytest.raises(TypeError, match="C-contiguous numpy array"):
        hvd.reducescatter_async_(np.zeros((4, 4))[:, 1], name="rs_.strided")
    with pytest.raises(TypeError, match="takes a float16 numpy array"):
        hvd.reducescatter_async_(np.zeros(4, dtype=np.float32), name="rs_.w", wire="float16")


def test_barrier_and_join_return_the_last_rank_everywhere():
    hvd.barrier()
    # rank r has r + 1 batches; joined ranks contribute zeros and Average still divides by size
    for step in range(hvd.rank() + 1):
        averaged = hvd.allreduce(np.ones(3), name="uneven")
        active = hvd.size() - step
        np.testing.assert_allclose(averaged, np.full(3, active / hvd.size()))
    assert hvd.join() == hvd.size() - 1


def test_broadcast_and_allgather_objects():
    payload = {"rank": hvd.rank(), "data": list(range(hvd.rank()))}
    assert hvd.broadcast_object(payload, root_rank=hvd.size() - 1) == {
        "rank": hvd.size() - 1, "data": list(range(hvd.size() - 1))}
    gathered = hvd.allgather_object(payload)
    assert gathered == [{"rank": rank, "data": list(range(rank))} for rank in range(hvd.size())]


def test_topology():
    assert 0 <= hvd.local_rank() < hvd.local_size() <= hvd.size()
    assert 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.allreduce(np.array([1]), op=hvd.Sum)[0] == hvd.size()


def test_a_timeline_started_at_run_time_is_live_then_closed_by_stop(tmp_path_factory):
    import json
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("timeline") / "t.json")
                                if hvd.rank() == 0 else None, root_rank=0)
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(np.ones(5), name="live.grad")
    hvd.barrier()  # rank 0's cycle that ran the allreduce has flushed it by now
    if hvd.rank() == 0:
        text = open(path, encoding="utf-8").read()
        events = json.loads(text.rstrip().rstrip(",") + "]")  # unterminated while live
        rows = {event["args"]["name"] for event in events if event.get("name") == "process_name"}
        assert "allreduce.live.grad" in rows
        assert any(event.get("name", "").startswith("CYCLE_START") for event in events)
    hvd.stop_timeline()
    if hvd.rank() == 0:
        json.loads(open(path, encoding="utf-8").read())  # closed: a complete JSON array


def door_counter(monkeypatch):
    """The kinds that enter by ``door.start``, in order, as calls go through it."""
    from hororing import door
    seen, real = [], door.start

    def counted(kind, *args, **kwargs):
        seen.append(kind)
        return real(kind, *args, **kwargs)
    monkeypatch.setattr(door, "start", counted)
    return seen


def test_every_verb_enters_by_the_one_door(monkeypatch):
    seen = door_counter(monkeypatch)
    size = hvd.size()
    total = hvd.allreduce(np.ones(3), op=hvd.Sum, name="door.allreduce")
    hvd.grouped_allreduce([np.ones(2), np.ones(1)], name="door.grouped")
    gathered = hvd.allgather(np.full((1, 2), hvd.rank()), name="door.allgather")
    hvd.broadcast(np.ones(2), root_rank=0, name="door.broadcast")
    hvd.alltoall(np.ones(size), name="door.alltoall")
    hvd.reducescatter(np.ones(size), name="door.reducescatter")
    hvd.barrier()
    assert seen == ["allreduce", "allreduce", "allreduce", "allgather", "broadcast",
                    "alltoall", "reducescatter", "barrier"]
    np.testing.assert_array_equal(total, np.full(3, size))
    np.testing.assert_array_equal(gathered[:, 0], np.arange(size))
    with pytest.raises(ValueError, match="unknown collective 'allmerge'"):
        hvd.door.start("allmerge", np.ones(2))
    with pytest.raises(TypeError, match=r"broadcast takes root_rank \(root_rank required\); "
                                        r"got wrong"):
        hvd.door.start("broadcast", np.ones(2), wrong=1)


def test_a_large_reducescatter_read_where_it_lies_twice():
    """Out of place, a reducescatter of its own dtype reads the input where it lies and sums
    into a pooled scratch buffer (2 MiB here: pooled): the input is untouched, and a second
    call with other values, the first result still held, gets its own values."""
    size, rank = hvd.size(), hvd.rank()
    shape = (65537, 8)
    results = []
    for seed in (1, 2):
        mine = rank_input(rank, shape, "float32", seed=seed)
        results.append(hvd.reducescatter(mine, op=hvd.Average, name="rs.large"))
        np.testing.assert_array_equal(mine, rank_input(rank, shape, "float32", seed=seed))
    base, extra = divmod(shape[0], size)
    start = rank * base + min(rank, extra)
    for seed, result in zip((1, 2), results):
        full = reference_allreduce(all_inputs(size, shape, "float32", seed), hvd.Average)
        assert_close(result, full[start:start + base + (1 if rank < extra else 0)])
