"""runner/leftovers.py: after a launch, the MPI shared-memory files its ranks left are removed,
and never a file a process still maps or holds open, one made before the launch, one too new
to judge, or one MPI did not name."""

import mmap
import os
import subprocess
import sys
import time

from hororing.runner import leftovers


def make(directory, name, nbytes=4096):
    path = directory / name
    path.write_bytes(b"\0" * nbytes)
    return str(path)


def test_only_unused_mpi_files_made_since_the_launch_began_are_removed(tmp_path):
    before = make(tmp_path, "mpich_shm_before_0")
    time.sleep(0.05)
    began = time.time()
    time.sleep(0.05)
    left = [make(tmp_path, "mpich_shm_abc_0", 8192), make(tmp_path, "sm_segment.host.0.1.0"),
            make(tmp_path, "vader_segment.host.0.1.0")]
    other = make(tmp_path, "not_mpi_0")
    mapped = make(tmp_path, "mpich_shm_mapped_0")
    held = make(tmp_path, "sm_segment.host.0.2.0")
    with open(mapped, "r+b") as handle:
        mapping = mmap.mmap(handle.fileno(), 0)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); "
                               "print(flush=True); time.sleep(60)", held],
                              stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()  # the file is open in another process
        assert leftovers.left_behind(began, str(tmp_path), settle_s=60) == []  # too new
        assert leftovers.left_behind(began, str(tmp_path), settle_s=0) == sorted(left)
        assert leftovers.remove_left_behind(began, str(tmp_path), settle_s=0) == \
            (3, 8192 + 4096 + 4096)
    finally:
        holder.kill()
        holder.wait()
        mapping.close()
    assert sorted(os.listdir(tmp_path)) == sorted(
        os.path.basename(path) for path in (before, other, mapped, held))
    # once nothing holds them, the mapped and the open file go too
    assert leftovers.remove_left_behind(began, str(tmp_path), settle_s=0)[0] == 2
    assert sorted(os.listdir(tmp_path)) == ["mpich_shm_before_0", "not_mpi_0"]


def test_the_log_line_says_how_much_was_removed():
    assert leftovers.describe(0, 0) is None
    assert leftovers.describe(2, 3 * 2**20) == \
        "removed 2 shared-memory files (3.0 MiB) that ended ranks left in /dev/shm"


def test_a_directory_that_cannot_be_read_finds_nothing(tmp_path):
    assert leftovers.left_behind(0, str(tmp_path / "absent"), settle_s=0) == []
