"""Record files, .npy shards, the shuffle buffer and equal step counts, in one process."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hororing.data import (RecordFormatError, RecordWriter, Shard, count_samples, plan_steps,
                           read_npy, read_records, read_shard, shuffled)


def write_records(path, payloads):
    with RecordWriter(path) as out:
        for payload in payloads:
            out.write(payload)
    return str(path)


@settings(max_examples=50, deadline=None)
@given(payloads=st.lists(st.binary(max_size=300), max_size=40),
       read_bytes=st.integers(min_value=1, max_value=700))
def test_records_round_trip_across_any_read_size(tmp_path_factory, payloads, read_bytes):
    path = write_records(tmp_path_factory.mktemp("rec") / "a.rec", payloads)
    assert list(read_records(path, read_bytes=read_bytes)) == payloads


def cut_after_record(path, keep):
    """Cut a record file exactly after its first ``keep`` records (a clean boundary)."""
    data = open(path, "rb").read()
    position = 8
    for _ in range(keep):
        position += 8 + int.from_bytes(data[position:position + 4], "little")
    open(path, "wb").write(data[:position])


def test_a_file_cut_exactly_between_two_records_is_refused(tmp_path):
    path = write_records(tmp_path / "a.rec", [b"record %d" % index for index in range(1000)])
    assert count_samples([path]) == 1000
    cut_after_record(path, 500)
    with pytest.raises(RecordFormatError, match=r"a.rec' ends without its trailer after a whole "
                                                r"record: the file was cut short"):
        list(read_records(path))
    with pytest.raises(RecordFormatError, match="ends without its trailer"):
        count_samples([path])
    empty = write_records(tmp_path / "empty.rec", [])
    assert list(read_records(empty)) == [] and count_samples([empty]) == 0
    cut_after_record(empty, 0)  # the header alone
    with pytest.raises(RecordFormatError, match="ends without its trailer"):
        list(read_records(empty))


def test_a_version_1_file_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "old.rec"
    path.write_bytes(b"HRREC\x00\x01\x00" + (3).to_bytes(4, "little") + b"\0\0\0\0abc")
    with pytest.raises(RecordFormatError, match=r"old.rec' is a hororing record file of format "
                                                r"version 1, which has no trailer.*RecordWriter"):
        list(read_records(path))


def test_a_trailer_that_disagrees_with_the_records_is_corruption(tmp_path):
    path = write_records(tmp_path / "a.rec", [b"x", b"y"])
    data = bytearray(open(path, "rb").read())
    data[-8] = 3  # the trailer now promises three records
    open(path, "wb").write(bytes(data))
    with pytest.raises(RecordFormatError, match="its trailer promises 3 records but 2 were read"):
        list(read_records(path))
    with pytest.raises(RecordFormatError, match="its trailer does not match its 2 records"):
        count_samples([path])


def test_reading_streams_the_file(tmp_path):
    path = write_records(tmp_path / "a.rec", [bytes([index % 256]) * 100 for index in range(1000)])
    records = read_records(path, read_bytes=4096)
    assert next(records) == bytes([0]) * 100
    # the header and one 4 KiB block have been read, not the 108 KB file
    assert records.gi_frame.f_locals["file"].tell() == 8 + 4096
    assert sum(1 for _ in records) == 999


def test_truncated_file_is_named_with_the_offset(tmp_path):
    path = write_records(tmp_path / "a.rec", [b"abc", b"defgh"])
    with open(path, "r+b") as file:
        file.truncate(8 + 11 + 8 + 2)
    with pytest.raises(RecordFormatError, match=r"a.rec' ends inside a record at byte 19"):
        list(read_records(path))


def test_corrupt_record_fails_its_crc(tmp_path):
    path = write_records(tmp_path / "a.rec", [b"abc", b"defgh"])
    data = bytearray(open(path, "rb").read())
    data[-17] ^= 0xFF  # the last payload byte: the trailer (16 bytes) follows it
    open(path, "wb").write(bytes(data))
    with pytest.raises(RecordFormatError, match=r"record at byte 19 fails its CRC check"):
        list(read_records(path))


def test_a_file_of_another_format_is_refused(tmp_path):
    path = tmp_path / "a.rec"
    path.write_bytes(b"not a record file")
    with pytest.raises(RecordFormatError, match="is not a hororing record file"):
        list(read_records(path))


def test_npy_rows_stream_in_blocks(tmp_path):
    array = np.arange(7 * 3 * 2, dtype=np.int16).reshape(7, 3, 2)
    np.save(tmp_path / "a.npy", array)
    rows = list(read_npy(tmp_path / "a.npy", block_rows=3))
    assert len(rows) == 7
    np.testing.assert_array_equal(np.stack(rows), array)


@pytest.mark.parametrize("array,message", [
    (np.asfortranarray(np.ones((3, 4))), "Fortran order"),
    (np.array([1, "x"], dtype=object), "holds Python objects"),
    (np.float32(3), "0-d array"),
])
def test_npy_files_that_cannot_stream_by_row_are_refused(tmp_path, array, message):
    np.save(tmp_path / "a.npy", array, allow_pickle=True)
    with pytest.raises(RecordFormatError, match=message):
        list(read_npy(tmp_path / "a.npy"))


def test_read_shard_chains_files_and_honours_a_record_slice(tmp_path):
    first = write_records(tmp_path / "a.rec", [b"a0", b"a1", b"a2"])
    second = write_records(tmp_path / "b.rec", [b"b0", b"b1"])
    assert list(read_shard([first, second])) == [b"a0", b"a1", b"a2", b"b0", b"b1"]
    sliced = Shard([first, second], record_slice=(1, 2))
    assert list(read_shard(sliced)) == [b"a1", b"b0"]
    assert count_samples(sliced) == 2 and count_samples([first, second]) == 5


def test_npy_shards_need_one_row_type(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((2, 3), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((2, 4), np.float32))
    with pytest.raises(RecordFormatError, match=r"b.npy' holds rows of float32 \(4,\)"):
        list(read_shard([tmp_path / "a.npy", tmp_path / "b.npy"]))


@settings(max_examples=100, deadline=None)
@given(count=st.integers(0, 200), buffer_size=st.integers(1, 50), seed=st.integers(0, 99))
def test_shuffle_buffer_permutes_and_holds_at_most_its_size(count, buffer_size, seed):
    pulled = []

    def source():
        for index in range(count):
            pulled.append(index)
            yield index

    out = []
    for item in shuffled(source(), buffer_size, seed):
        out.append(item)
        assert len(pulled) - len(out) <= buffer_size
    assert sorted(out) == list(range(count))
    assert out == list(shuffled(range(count), buffer_size, seed))


def test_shuffle_buffer_size_is_checked():
    with pytest.raises(ValueError, match="shuffle buffer size must be an int >= 1, got 0"):
        list(shuffled(range(3), 0))


@pytest.mark.parametrize("samples,policy,drop_last,steps", [
    ([10, 7, 9], "min", False, 3), ([10, 7, 9], "pad", False, 4),
    ([10, 7, 9], "min", True, 2), ([10, 7, 9], "pad", True, 3), ([0, 5], "min", False, 0),
])
def test_step_plan_is_the_same_for_every_rank(samples, policy, drop_last, steps):
    plans = [plan_steps(samples, rank, 3, policy=policy, drop_last=drop_last)
             for rank in range(len(samples))]
    assert {plan.steps for plan in plans} == {steps}


def test_take_pads_by_repeating_the_first_batches_and_truncates():
    short = plan_steps([4, 10], 0, 2, policy="pad")  # this rank: 2 batches, every rank 5
    assert list(short.take(iter(["b0", "b1"]))) == ["b0", "b1", "b0", "b1", "b0"]
    long = plan_steps([4, 10], 1, 2, policy="min")
    assert list(long.take(iter(range(5)))) == [0, 1]


def test_take_cannot_pad_from_nothing():
    plan = plan_steps([0, 4], 0, 2, policy="pad")
    with pytest.raises(ValueError, match="this rank's data gave no batch"):
        list(plan.take(iter([])))


@pytest.mark.parametrize("arguments,message", [
    ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
    ({"policy": "max"}, "policy must be one of"),
])
def test_step_plan_arguments_are_checked(arguments, message):
    with pytest.raises(ValueError, match=message):
        plan_steps([3, 4], 0, **{"batch_size": 2, **arguments})
