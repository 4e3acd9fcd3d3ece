"""Process sets: collectives over a subset of the ranks, added at init or dynamically."""

import dataclasses
import re

import numpy as np
import pytest

import hororing as hvd
from hororing.context import current
from reference import all_inputs, assert_close, rank_input, reference_allreduce


def even_and_odd():
    """The sets of even and odd ranks, and this rank's."""
    size = hvd.size()
    if size == 1:
        pytest.skip("at one rank every set is the global set")
    even = hvd.add_process_set([rank for rank in range(0, size, 2)])
    odd = hvd.add_process_set([rank for rank in range(1, size, 2)])
    mine = even if hvd.rank() % 2 == 0 else odd
    return even, odd, mine


def remove(*sets):
    for process_set in sets:
        if process_set is not None:
            assert hvd.remove_process_set(process_set)


def test_collectives_within_even_and_odd_sets_match_references():
    even, odd, mine = even_and_odd()
    members = mine.ranks
    rank = hvd.rank()
    try:
        assert mine.size() == len(members) and mine.rank() == members.index(rank)
        assert mine.included() and (odd is None or even.included() != odd.included())
        shape = (7, 3)  # 7 rows: not divisible by a set of 2
        inputs = all_inputs(hvd.size(), shape, "float64", seed=41)
        total = hvd.allreduce(inputs[rank], op=hvd.Sum, name="ps.sum", process_set=mine)
        assert_close(total, reference_allreduce([inputs[r] for r in members], hvd.Sum))
        root = members[-1]  # in hvd.rank() numbering
        got = hvd.broadcast(inputs[rank], root, name="ps.bcast", process_set=mine)
        np.testing.assert_array_equal(got, inputs[root])
        rows = [np.full((member + 1, 2), member, dtype=np.int32) for member in members]
        gathered = hvd.allgather(rows[members.index(rank)], name="ps.gather", process_set=mine)
        np.testing.assert_array_equal(gathered, np.concatenate(rows))
        part = hvd.reducescatter(inputs[rank], op=hvd.Sum, name="ps.rs", process_set=mine)
        full = reference_allreduce([inputs[r] for r in members], hvd.Sum)
        index = members.index(rank)
        per, extra = divmod(shape[0], len(members))
        start = index * per + min(index, extra)
        assert_close(part, full[start:start + per + (index < extra)])
        sent = np.arange(len(members), dtype=np.int64) + 100 * rank
        received, splits = hvd.alltoall(sent, name="ps.a2a", process_set=mine)
        np.testing.assert_array_equal(received, [100 * member + index for member in members])
        assert hvd.allgather_object(rank, process_set=mine) == members
        assert hvd.broadcast_object({"from": root} if rank == root else None, root,
                                    process_set=mine) == {"from": root}
        hvd.barrier(process_set=mine)
        # the global set still works beside them
        assert hvd.allreduce(np.ones(2), op=hvd.Sum, name="ps.global").tolist() == [hvd.size()] * 2
    finally:
        remove(odd, even)


def test_grouped_allgather_and_reducescatter_within_a_set():
    even, odd, mine = even_and_odd()
    members, rank = mine.ranks, hvd.rank()
    try:
        first, second = hvd.grouped_allgather([np.full((1,), rank), np.full((2, 2), rank)],
                                              process_set=mine)
        np.testing.assert_array_equal(first, members)
        assert second.shape == (2 * len(members), 2)
        a, b = hvd.grouped_reducescatter([np.ones((5, 2)), np.ones(len(members) * 2)],
                                         op=hvd.Sum, process_set=mine)
        assert (a == len(members)).all() and b.tolist() == [len(members)] * 2
    finally:
        remove(odd, even)


def test_a_rank_outside_the_set_is_refused():
    if hvd.size() < 2:
        pytest.skip("needs a rank outside the set")
    only_zero = hvd.add_process_set([0])
    try:
        if hvd.rank() != 0:
            with pytest.raises(ValueError, match=r"rank \d+ is not a member of process set"):
                hvd.allreduce(np.ones(1), process_set=only_zero)
            assert only_zero.rank() is None and not only_zero.included()
        else:
            assert hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=only_zero).tolist() == [1.0]
            with pytest.raises(ValueError, match="rank 1 is not in process set"):
                hvd.broadcast(np.ones(1), 1, process_set=only_zero)
    finally:
        assert hvd.remove_process_set(only_zero)


def test_bad_sets_are_refused_on_every_rank():
    everyone = list(range(hvd.size()))
    with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
        hvd.add_process_set(everyone)  # the global set's ranks
    with pytest.raises(ValueError, match=r"distinct ranks in \[0, \d+\)"):
        hvd.add_process_set([0, hvd.size()])
    with pytest.raises(ValueError, match="list of process ranks"):
        hvd.ProcessSet(["a"])
    if hvd.size() > 1:
        with pytest.raises(ValueError, match="was given different ranks on different ranks"):
            hvd.add_process_set([0] if hvd.rank() == 0 else [0, 1])
    if hvd.size() == 1:
        return  # [0] is the global set's ranks
    added = hvd.add_process_set([0])
    assert hvd.remove_process_set(added) and added.process_set_id is None
    assert not hvd.remove_process_set(added)
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(np.ones(1), process_set=added)
    with pytest.raises(TypeError, match="process_set must be a hvd.ProcessSet"):
        hvd.allreduce(np.ones(1), process_set=[0])


def test_dynamic_sets_need_the_switch(monkeypatch):
    context = current()
    monkeypatch.setattr(context, "config",
                        dataclasses.replace(context.config, dynamic_process_sets=False))
    with pytest.raises(ValueError, match="set HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        hvd.add_process_set([0])


def test_static_sets_from_init_by_ranks_and_by_communicator():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.size == 1:
        pytest.skip("every set of one rank is the global set: a duplicate (see the next test)")
    hvd.shutdown()
    split = world.Split(color=world.rank % 2, key=world.rank)  # evens and odds
    by_comm = hvd.ProcessSet(split)
    sets = [by_comm]
    by_ranks = None
    if world.size > 2:  # the first two ranks: neither the evens nor the odds
        by_ranks = hvd.ProcessSet([0, 1])
        sets.append(by_ranks)
    try:
        hvd.init(process_sets=sets)
        assert hvd.global_process_set.ranks == list(range(world.size))
        assert by_comm.ranks == list(range(world.rank % 2, world.size, 2))
        if by_ranks is not None:
            assert by_ranks.ranks == [0, 1] and by_ranks.size() == 2
        value = rank_input(hvd.rank(), (4,), "float32", seed=5)
        total = hvd.allreduce(value, op=hvd.Sum, process_set=by_comm)
        expected = reference_allreduce([rank_input(r, (4,), "float32", seed=5)
                                        for r in by_comm.ranks], hvd.Sum)
        assert_close(total, expected)
    finally:
        hvd.shutdown()
        split.Free()
        hvd.init()


def test_more_misuse_is_refused_with_the_fix_named(monkeypatch):
    from mpi4py import MPI
    with pytest.raises(NotImplementedError, match="Please build the process set via a list"):
        hvd.add_process_set(hvd.ProcessSet(MPI.COMM_WORLD))
    with pytest.raises(TypeError, match="remove_process_set takes a ProcessSet"):
        hvd.remove_process_set([0])
    stale = hvd.ProcessSet([0])
    stale.process_set_id = 999  # never registered under that id
    with pytest.raises(ValueError, match="process set 999 has been removed or was never added"):
        hvd.allreduce(np.ones(1), process_set=stale)
    context = current()
    monkeypatch.setattr(context, "config",
                        dataclasses.replace(context.config, dynamic_process_sets=False))
    with pytest.raises(ValueError, match=r"remove_process_set\(\) needs dynamic process sets"):
        hvd.remove_process_set(stale)


def test_init_refuses_process_sets_of_the_wrong_type():
    hvd.shutdown()
    try:
        with pytest.raises(TypeError, match="takes a list of hvd.ProcessSet, got str"):
            hvd.init(process_sets="dynamic")
        assert not hvd.is_initialized()  # refused before anything was set up
        with pytest.raises(TypeError, match="takes hvd.ProcessSet objects, got list"):
            hvd.init(process_sets=[[0]])
    finally:
        hvd.shutdown()
        hvd.init()


def test_duplicate_static_sets_are_refused_on_every_rank_and_the_job_goes_on():
    from mpi4py import MPI
    size = hvd.size()
    copies = [hvd.ProcessSet([0]), hvd.ProcessSet([0])]
    repeated = ("process_sets[1] with ranks [0] repeats process_sets[0]" if size > 1 else
                "process_sets[0] with ranks [0] repeats the global set")  # [0] is everyone
    with pytest.raises(ValueError) as refused:
        hvd.init(process_sets=copies)
    assert f"duplicate process sets (rank 0: {repeated}" in str(refused.value)
    # a communicator of every rank repeats the global set, whatever the order of its ranks
    reversed_world = MPI.COMM_WORLD.Split(color=0, key=-MPI.COMM_WORLD.rank)
    try:
        with pytest.raises(ValueError, match="repeats the global set"):
            hvd.init(process_sets=[hvd.ProcessSet(reversed_world)])
    finally:
        reversed_world.Free()
    # only this rank's list is bad: every rank refuses, none waits for the others
    lopsided = [hvd.ProcessSet([0])] * (2 if hvd.rank() == size - 1 else 1)
    with pytest.raises(ValueError, match=f"rank {size - 1}: process_sets"):
        hvd.init(process_sets=lopsided)
    assert hvd.is_initialized()
    assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [float(size)] * 2


def test_a_duplicate_in_one_ranks_own_view_raises_there_and_the_others_go_on(caplog):
    """A set given by a communicator stands for different ranks on different processes, so a
    duplicate can be one rank's own: as in Horovod, the sets are registered (each once) and
    only the ranks whose list repeats one raise; the others succeed and are warned."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    size, rank = world.size, world.rank
    if size == 1:
        pytest.skip("at one rank every set is the global set")
    hvd.shutdown()
    split = world.Split(color=rank % 2, key=rank)  # evens and odds
    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
    # evens repeat their own communicator; at two ranks [0] is both the evens and the last set
    repeats = rank % 2 == 0 or size == 2
    sets = [hvd.ProcessSet(split), hvd.ProcessSet(evens), hvd.ProcessSet([0])]
    try:
        with caplog.at_level("WARNING", logger="hororing"):
            if repeats:
                repeat = f"rank 0: process_sets[1] with ranks {evens} repeats process_sets[0]"
                with pytest.raises(ValueError, match=re.escape(repeat)):
                    hvd.init(process_sets=sets)
            else:
                hvd.init(process_sets=sets)
                assert "ranks [0" in caplog.text and "raised ValueError" in caplog.text
        assert hvd.is_initialized()
        expected = {0: list(range(size)), 1: evens, 2: odds}
        if size > 2:
            expected[3] = [0]
        assert {set_id: current().sets.ranks(set_id) for set_id in current().sets.ids()} == expected
        mine = sets[0]
        assert mine.ranks == (evens if rank % 2 == 0 else odds)
        total = hvd.allreduce(np.full(3, rank + 1.0), op=hvd.Sum, process_set=mine)
        assert total.tolist() == [float(sum(r + 1 for r in mine.ranks))] * 3
    finally:
        hvd.shutdown()
        split.Free()
        hvd.init()


def test_lists_that_differ_in_kind_across_ranks_are_refused_on_every_rank():
    from mpi4py import MPI
    if hvd.size() == 1:
        pytest.skip("needs two ranks to differ")
    world = MPI.COMM_WORLD
    # rank 0 gives its first set by ranks, the others by a communicator: the registration's
    # collectives would part ways, so every rank refuses before any set is registered
    split = world.Split(color=0 if world.rank == 0 else 1, key=world.rank)
    before = current().sets.ids()
    try:
        first = hvd.ProcessSet([0]) if world.rank == 0 else hvd.ProcessSet(split)
        with pytest.raises(ValueError, match=r"different process_sets\[0\] on different ranks "
                                             r"\(\{0: 'ranks \[0\]', 1: 'a communicator'"):
            hvd.init(process_sets=[first])
        assert current().sets.ids() == before
        assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [float(hvd.size())] * 2
    finally:
        split.Free()
