"""The sharder and per-rank channels across ranks: every record read once, by one rank."""

import os
import shutil
import signal
import tempfile

import numpy as np
import pytest

import hororing as hvd
from hororing.data import RecordWriter

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shared_files():
    """Files written by rank 0 in a directory every rank sees; returns the list of paths."""
    directory = None
    if hvd.rank() == 0:
        directory = tempfile.mkdtemp(prefix="hororing-test-data-")
        for index in range(2 * hvd.size() + 3):  # not a multiple of the rank count
            with RecordWriter(os.path.join(directory, f"part-{index:02d}.rec")) as out:
                for record in range(37 + 11 * index):
                    out.write(f"{index}/{record}".encode())
    directory = hvd.broadcast_object(directory, root_rank=0)
    yield sorted(os.path.join(directory, name) for name in os.listdir(directory))
    hvd.barrier()
    if hvd.rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)


def every_record(paths):
    return [f"{int(os.path.basename(path)[5:7])}/{record}".encode()
            for path in paths for record in range(37 + 11 * int(os.path.basename(path)[5:7]))]


def test_shards_are_disjoint_and_complete(shared_files):
    mine = hvd.data.shard_files(shared_files)
    shards = hvd.allgather_object(list(mine))
    assert sorted(path for shard in shards for path in shard) == shared_files
    assert shards[hvd.rank()] == list(mine) and all(shards)


def test_every_rank_reads_its_own_channel_and_nothing_is_lost_or_read_twice(shared_files):
    mine = hvd.data.shard_files(shared_files, shuffle=True, epoch=1)
    with hvd.data.open_channel(mine) as channel:
        received = list(channel)
    assert received == every_record(mine)  # exactly this rank's files' records, in order
    everything = [record for part in hvd.allgather_object(received) for record in part]
    assert sorted(everything) == sorted(every_record(shared_files))


def test_a_rank_given_a_different_list_is_named_on_every_rank(shared_files):
    files = shared_files[:-1] if hvd.rank() == hvd.size() - 1 else shared_files
    if hvd.size() == 1:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(ValueError, match=rf"rank {hvd.size() - 1} was given a different file "
                                         rf"list or plan \({len(shared_files) - 1} files"):
        hvd.data.shard_files(files)


def test_a_missing_file_on_one_rank_fails_every_rank(shared_files):
    files = list(shared_files)
    if hvd.rank() == 0:
        files[0] = files[0] + ".missing"
    if hvd.rank() == 0:
        with pytest.raises(FileNotFoundError, match=r"\.missing' does not exist"):
            hvd.data.shard_files(files)
    else:
        with pytest.raises(ValueError, match=r"shard_files failed on rank 0: FileNotFoundError"):
            hvd.data.shard_files(files)


def test_more_ranks_than_files_fails_on_every_rank(shared_files):
    if hvd.size() == 1:
        pytest.skip("one rank can always take every file")
    few = shared_files[:hvd.size() - 1]
    with pytest.raises(ValueError, match=rf"cannot shard {len(few)} file\(s\) over "
                                         rf"{hvd.size()} ranks"):
        hvd.data.shard_files(few)
    shard = hvd.data.shard_files(few, split_records=True)
    records = [record for part in hvd.allgather_object(list(hvd.data.read_shard(shard)))
               for record in part]
    assert sorted(records) == sorted(every_record(few))


def test_equal_steps_agree_across_ranks(shared_files):
    mine = hvd.data.shard_files(shared_files, balance="count")
    local = hvd.data.count_samples(mine)
    counts = hvd.allgather_object(local)
    for policy, pick in (("min", min), ("pad", max)):
        plan = hvd.data.equal_steps(local, batch_size=8, policy=policy)
        assert plan.steps == pick(-(-count // 8) for count in counts)
        assert plan.samples == tuple(counts)
        batches = list(plan.take(iter(range(plan.local_steps))))
        assert len(batches) == plan.steps
        # every rank can now run one collective per batch and none is left waiting
        for _ in batches:
            hvd.allreduce(np.ones(1), name="equal_steps.batch")


def test_equal_steps_arguments_must_match(shared_files):
    if hvd.size() == 1:
        pytest.skip("needs two ranks to disagree")
    batch_size = 8 if hvd.rank() == 0 else 16
    with pytest.raises(ValueError, match=r"rank 1 passed batch_size=16"):
        hvd.data.equal_steps(10, batch_size=batch_size)
    bad = -1 if hvd.rank() == 1 else 10
    with pytest.raises(ValueError, match=r"local_samples must be an int >= 0|equal_steps failed "
                                         r"on rank 1"):
        hvd.data.equal_steps(bad, batch_size=8)


def test_a_rank_reading_another_ranks_channel_is_refused(shared_files):
    mine = hvd.data.shard_files(shared_files)
    with hvd.data.open_channel(mine) as channel:
        paths = hvd.allgather_object(channel.path)
        neighbour = paths[(hvd.rank() + 1) % hvd.size()]
        with pytest.raises(hvd.data.ChannelBusyError, match="already has a reader"):
            hvd.data.attach_channel(neighbour)
        hvd.barrier()  # every refusal done before anyone reads: the refused took nothing
        assert list(channel) == every_record(mine)


def test_a_dying_producer_is_reported_on_its_rank(shared_files):
    mine = hvd.data.shard_files(shared_files)
    channel = hvd.data.open_channel(mine)
    os.kill(channel.producer_pid, signal.SIGKILL)
    with pytest.raises(hvd.data.ChannelError, match="killed by signal SIGKILL"):
        list(channel)
    assert not os.path.exists(os.path.dirname(channel.path))
    hvd.barrier()
