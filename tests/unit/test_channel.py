"""Per-rank channels in one process: what goes in comes out once, failures surface, cleanup."""

import os
import signal
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hororing.data import (ChannelBusyError, ChannelError, RecordWriter, Shard, attach_channel,
                           open_channel, read_shard)

pytestmark = pytest.mark.timeout(60)


def write_shard(directory, files=3, records=500):
    paths = []
    for index in range(files):
        path = str(directory / f"part-{index}.rec")
        with RecordWriter(path) as out:
            for record in range(records * (index + 1)):
                out.write(f"{index}:{record}:".encode() * (record % 7))
        paths.append(path)
    return paths


def test_channel_delivers_exactly_the_records_of_its_files(tmp_path):
    files = write_shard(tmp_path)
    with open_channel(files, rank=0, directory=tmp_path) as channel:
        received = list(channel)
    assert received == list(read_shard(files))
    assert len(received) == 500 + 1000 + 1500


def test_channel_carries_npy_rows(tmp_path):
    arrays = [np.arange(index * 40, (index + 1) * 40, dtype=np.float64).reshape(10, 2, 2)
              for index in range(3)]
    files = []
    for index, array in enumerate(arrays):
        files.append(str(tmp_path / f"part-{index}.npy"))
        np.save(files[-1], array)
    with open_channel(files, rank=0, block_bytes=64) as channel:
        rows = list(channel)
    np.testing.assert_array_equal(np.stack(rows), np.concatenate(arrays))


def test_channel_honours_record_slices_and_the_shuffle_buffer(tmp_path):
    files = write_shard(tmp_path, files=2, records=50)
    expected = list(read_shard(Shard(files, record_slice=(1, 3))))
    with open_channel(Shard(files, record_slice=(1, 3)), rank=0) as channel:
        assert list(channel) == expected
    with open_channel(files, rank=0, shuffle_buffer=16, seed=4) as channel:
        shuffled = list(channel)
    assert sorted(shuffled) == sorted(read_shard(files)) and shuffled != list(read_shard(files))


def test_private_directory_and_fifo_permissions(tmp_path):
    with open_channel(write_shard(tmp_path), rank=3, directory=tmp_path) as channel:
        directory = os.path.dirname(channel.path)
        assert os.path.basename(directory).startswith("hororing-channel-rank3-")
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_ISFIFO(os.stat(channel.path).st_mode)
        assert stat.S_IMODE(os.stat(channel.path).st_mode) == 0o600
        next(iter(channel))
    assert not os.path.exists(directory)


def test_a_second_reader_in_this_process_is_refused(tmp_path):
    with open_channel(write_shard(tmp_path), rank=0) as channel:
        with pytest.raises(ChannelBusyError, match="already has a reader; each rank's channel"):
            attach_channel(channel.path)
        assert len(list(channel)) == 3000  # the refused reader took nothing


def test_a_second_reader_in_another_process_is_refused(tmp_path):
    with open_channel(write_shard(tmp_path), rank=0) as channel:
        script = textwrap.dedent(f"""
            from hororing.data import ChannelBusyError, attach_channel
            try:
                attach_channel({channel.path!r})
            except ChannelBusyError as error:
                print("refused:", error)
        """)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=30)
        assert "refused: channel" in result.stdout, result.stderr
        assert len(list(channel)) == 3000


def test_a_killed_producer_is_reported(tmp_path):
    files = write_shard(tmp_path, files=3, records=20000)
    channel = open_channel(files, rank=0)
    samples = iter(channel)
    next(samples)
    os.kill(channel.producer_pid, signal.SIGKILL)
    with pytest.raises(ChannelError, match="was killed by signal SIGKILL"):
        for _ in samples:
            pass
    assert not os.path.exists(os.path.dirname(channel.path))  # cleaned up on error


def test_a_producer_that_dies_before_writing_is_reported(tmp_path):
    files = write_shard(tmp_path, files=1)
    channel = open_channel(files, rank=0)
    os.kill(channel.producer_pid, signal.SIGKILL)
    with pytest.raises(ChannelError, match="the producer .* was killed"):
        list(channel)


def test_a_truncated_file_is_named(tmp_path):
    files = write_shard(tmp_path)
    with open(files[1], "r+b") as file:
        file.truncate(os.path.getsize(files[1]) - 19)  # inside the last record
    with pytest.raises(Exception, match=r"part-1.rec.*(CRC|truncated)"):
        with open_channel(files, rank=0) as channel:
            list(channel)


def test_a_file_cut_between_records_is_named_through_the_channel(tmp_path):
    files = write_shard(tmp_path, records=100)
    data = open(files[1], "rb").read()
    position = 8
    for _ in range(50):  # keep the first 50 records whole
        position += 8 + int.from_bytes(data[position:position + 4], "little")
    open(files[1], "wb").write(data[:position])
    with pytest.raises(Exception, match=r"part-1.rec' ends without its trailer"):
        with open_channel(files, rank=0) as channel:
            list(channel)


def test_a_file_removed_after_opening_is_named(tmp_path):
    files = write_shard(tmp_path, files=2, records=30000)
    channel = open_channel(files, rank=0)
    os.remove(files[1])  # the producer has not reached it yet
    with pytest.raises(ChannelError, match=r"FileNotFoundError.*part-1.rec"):
        list(channel)


def test_closing_early_stops_the_producer_and_removes_the_directory(tmp_path):
    channel = open_channel(write_shard(tmp_path, records=20000), rank=0)
    next(iter(channel))
    producer = channel._producer
    channel.close()
    assert producer.poll() is not None
    assert not os.path.exists(os.path.dirname(channel.path))


def test_a_channel_is_one_pass(tmp_path):
    with open_channel(write_shard(tmp_path, files=1), rank=0) as channel:
        list(channel)
        with pytest.raises(ChannelError, match="can be iterated once"):
            iter(channel)


def test_unreadable_input_is_named_before_starting(tmp_path):
    with pytest.raises(FileNotFoundError, match="gone.rec' is missing"):
        open_channel([str(tmp_path / "gone.rec")], rank=0)


def test_channels_are_removed_at_exit(tmp_path):
    files = write_shard(tmp_path, files=1)
    script = textwrap.dedent(f"""
        import os
        from hororing.data import open_channel
        channel = open_channel({files!r}, rank=0, directory={str(tmp_path)!r})
        next(iter(channel))
        print(os.path.dirname(channel.path))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=30)
    directory = result.stdout.strip()
    assert directory.startswith(str(tmp_path)), result.stderr
    assert not os.path.exists(directory)


def start_reader(tmp_path, files):
    """A process that opens a channel in tmp_path, reads one record, says where, and waits."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from hororing.data import open_channel
        channel = open_channel({files!r}, rank=0, directory={str(tmp_path)!r})
        samples = iter(channel)  # held: a dropped iterator closes its channel
        next(samples)
        print(os.path.dirname(channel.path), flush=True)
        # short sleeps: a process-directed SIGTERM may land on another thread (numpy's BLAS
        # starts some), and Python runs the handler in the main thread at its next bytecode,
        # which one long sleep would put off by up to its length
        for _ in range(600):
            time.sleep(0.1)
    """)
    reader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    return reader, reader.stdout.readline().strip()


def test_a_reader_ended_by_sigterm_removes_its_channel(tmp_path):
    files = write_shard(tmp_path, files=1)
    reader, directory = start_reader(tmp_path, files)
    assert os.path.isdir(directory)
    reader.send_signal(signal.SIGTERM)
    assert reader.wait(timeout=30) == 128 + signal.SIGTERM
    assert not os.path.exists(directory)


def test_a_killed_readers_channel_is_removed_at_the_next_open(tmp_path):
    files = write_shard(tmp_path, files=1)
    reader, directory = start_reader(tmp_path, files)
    reader.kill()
    reader.wait(timeout=30)
    assert os.path.isdir(directory)  # SIGKILL: nothing could run
    alive, alive_directory = start_reader(tmp_path, files)
    try:
        with open_channel(files, rank=1, directory=str(tmp_path)) as channel:
            assert len(list(channel)) == 500
        assert not os.path.exists(directory)
        assert os.path.isdir(alive_directory)  # its reader still runs: left alone
    finally:
        alive.kill()
        alive.wait(timeout=30)


def test_a_corrupt_length_field_is_reported_as_such(tmp_path):
    files = write_shard(tmp_path, files=1, records=50)
    data = bytearray(open(files[0], "rb").read())
    data[8:12] = (1 << 20).to_bytes(4, "little")  # the first record claims 1 MiB
    open(files[0], "wb").write(bytes(data))
    with pytest.raises(ChannelError, match=r"sent every file and its end marker, but the stream "
                                           r"read here .*a record's length field is corrupt"):
        with open_channel(files, rank=0) as channel:
            list(channel)
