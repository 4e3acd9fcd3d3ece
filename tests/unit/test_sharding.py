"""The file sharder's plan: disjoint, complete, balanced and deterministic, for any input."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hororing.data import Shard, plan_shards, shard_files

file_sets = st.dictionaries(st.from_regex(r"[a-z]{1,6}/[a-z0-9]{1,8}\.rec", fullmatch=True),
                            st.integers(min_value=0, max_value=10**9), max_size=100)
plan_arguments = dict(size=st.integers(min_value=1, max_value=16),
                      balance=st.sampled_from(["bytes", "count"]), shuffle=st.booleans(),
                      seed=st.integers(0, 2**32), epoch=st.integers(0, 1000))


@settings(max_examples=300, deadline=None)
@given(files=file_sets, **plan_arguments)
def test_plan_is_disjoint_complete_and_balanced(files, size, balance, shuffle, seed, epoch):
    plan = plan_shards(files, size, balance=balance, shuffle=shuffle, seed=seed, epoch=epoch)
    assert len(plan) == size
    assigned = [path for shard in plan for path in shard]
    assert sorted(assigned) == sorted(files)  # complete, and nothing twice
    assert all(shard == sorted(shard) for shard in plan)
    if balance == "bytes":
        loads = [sum(files[path] for path in shard) for shard in plan]
        largest = max(files.values(), default=0)
        assert max(loads) <= min(loads) + largest
    else:
        counts = [len(shard) for shard in plan]
        assert max(counts) - min(counts) <= 1


@settings(max_examples=200, deadline=None)
@given(files=file_sets, data=st.data(), **plan_arguments)
def test_plan_depends_on_the_set_not_the_order(files, data, size, balance, shuffle, seed, epoch):
    reordered = dict(data.draw(st.permutations(list(files.items()))))
    arguments = dict(balance=balance, shuffle=shuffle, seed=seed, epoch=epoch)
    assert plan_shards(files, size, **arguments) == plan_shards(reordered, size, **arguments)


def test_a_new_epoch_gives_a_new_valid_plan_when_shuffled():
    files = {f"part-{index:02d}.rec": 1000 + index for index in range(40)}
    plans = {repr(plan_shards(files, 4, shuffle=True, epoch=epoch)) for epoch in range(5)}
    assert len(plans) == 5
    assert plan_shards(files, 4, epoch=0) == plan_shards(files, 4, epoch=3)  # no shuffle: fixed


def test_largest_first_keeps_the_spread_small():
    files = {f"f{index}": size for index, size in enumerate([10, 9, 8, 7, 6, 5, 4, 3, 2, 1])}
    loads = [sum(files[path] for path in shard) for shard in plan_shards(files, 3)]
    assert max(loads) - min(loads) <= 1


@pytest.fixture
def sized_files(tmp_path):
    paths = []
    for index, size in enumerate([300, 10, 120, 50, 75, 5]):
        path = tmp_path / f"part-{index}.rec"
        path.write_bytes(b"x" * size)
        paths.append(str(path))
    return paths


def test_shard_files_takes_a_list_or_a_pattern(sized_files, tmp_path):
    by_list = [shard_files(sized_files, rank, 3) for rank in range(3)]
    by_pattern = [shard_files(str(tmp_path / "part-*.rec"), rank, 3) for rank in range(3)]
    assert by_list == by_pattern
    assert sorted(path for shard in by_list for path in shard) == sorted(sized_files)
    assert all(isinstance(shard, Shard) and shard.record_slice is None for shard in by_list)


def test_more_ranks_than_files_names_both_numbers(sized_files):
    with pytest.raises(ValueError, match=r"cannot shard 6 file\(s\) over 8 ranks"):
        shard_files(sized_files, 0, 8)


def test_split_records_shares_every_file_with_a_record_slice(sized_files):
    shard = shard_files(sized_files, 5, 8, split_records=True)
    assert list(shard) == sorted(sized_files) and shard.record_slice == (5, 8)


def test_missing_file_is_named(sized_files, tmp_path):
    missing = str(tmp_path / "gone.rec")
    with pytest.raises(FileNotFoundError, match="gone.rec' does not exist"):
        shard_files(sized_files + [missing], 0, 2)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file_is_named(sized_files):
    os.chmod(sized_files[2], 0)
    try:
        with pytest.raises(PermissionError, match="part-2.rec' is not readable"):
            shard_files(sized_files, 0, 2)
    finally:
        os.chmod(sized_files[2], 0o644)


@pytest.mark.parametrize("files,arguments,message", [
    ("/nonexistent/*.rec", {"rank": 0, "size": 2}, "matched no files"),
    ([], {"rank": 0, "size": 2}, "the file list is empty"),
    (None, {"rank": 0, "size": 2, "balance": "size"}, "balance must be one of"),
    (None, {"rank": 0}, "pass both rank and size"),
    (None, {"rank": 3, "size": 3}, r"rank must be an int in \[0, 3\), got 3"),
    (None, {"rank": 0, "size": 0}, "size must be an int >= 1, got 0"),
])
def test_bad_arguments_are_named(sized_files, files, arguments, message):
    with pytest.raises(ValueError, match=message):
        shard_files(sized_files if files is None else files, **arguments)


def test_a_file_listed_twice_is_refused(sized_files):
    with pytest.raises(ValueError, match="listed more than once"):
        shard_files(sized_files + [sized_files[0]], 0, 2)
