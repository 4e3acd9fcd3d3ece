"""What an ended launch left in this host's shared memory, and its removal.

The ranks of one node share memory through files in /dev/shm (MPICH's ``mpich_shm_*``, Open
MPI's ``sm_segment.*`` and ``vader_segment.*``), which MPI unlinks in MPI_Finalize (MPICH's
shared windows, hororing's fold rows among them, are unlinked as soon as they are mapped). A rank that is killed (a fault, a job ended by a stalled peer, the
launch an elastic job replaces) never gets there, and its node keeps 1-16 MiB for each such
launch: a container's /dev/shm, often 64 MiB, fills within a few relaunches, and the next
MPI_Init fails.

After a launch ends, hororun removes, on the host it runs on, the files named as MPI names
them that were made since the launch began, belong to this user, and that no process on the
host has open or mapped (so never a running job's, a launch started ahead included). A file
made in the last ``SETTLE_S`` seconds is left for the next look: another job on the host may
be between making its file and mapping it. Files on other hosts stay where they are.
"""

import contextlib
import os
import sys
import time

DIRECTORY = "/dev/shm"
PREFIXES = ("mpich_shm_", "sm_segment.", "vader_segment.")
SETTLE_S = 1.0


def in_use(directory=DIRECTORY):
    """The paths under ``directory`` that a process on this host maps or holds open."""
    inside = directory.rstrip("/") + "/"
    used = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(inside)
                    if at >= 0:
                        used.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(inside):
                    used.add(target)
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    return used


def _made_since(since, directory):
    """(path, time made) of each MPI-named file of this user in ``directory`` made at or after
    ``since``."""
    uid, found = os.getuid(), []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(PREFIXES):
            continue
        try:
            status = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if status.st_uid == uid and status.st_ctime >= since:
            found.append((entry.path, status.st_ctime))
    return found


def left_behind(since, directory=DIRECTORY, settle_s=SETTLE_S):
    """The MPI shared-memory files in ``directory`` made at or after ``since`` (time.time())
    and at least ``settle_s`` ago, owned by this user, that no process has open or mapped."""
    settled = time.time() - settle_s
    candidates = [path for path, made in _made_since(since, directory) if made <= settled]
    if not candidates:
        return []
    used = in_use(directory)
    return sorted(path for path in candidates if path not in used)


def remove_left_behind(since, directory=DIRECTORY, settle_s=SETTLE_S, wait=False):
    """Remove what ``left_behind`` finds; return (files removed, their bytes). With ``wait``
    (the launches are over), first wait until the newest such file is ``settle_s`` old."""
    if wait:
        newest = max((made for _, made in _made_since(since, directory)), default=None)
        if newest is not None:
            time.sleep(max(0.0, min(settle_s, newest + settle_s - time.time())))
    count = size = 0
    for path in left_behind(since, directory, settle_s):
        try:
            nbytes = os.stat(path).st_size
            os.unlink(path)
        except OSError:
            continue
        count, size = count + 1, size + nbytes
    return count, size


def describe(count, size):
    """One line for the launcher's log, or None where nothing was removed."""
    if not count:
        return None
    return (f"removed {count} shared-memory file{'s' if count != 1 else ''} "
            f"({size / 2**20:.1f} MiB) that ended ranks left in {DIRECTORY}")


@contextlib.contextmanager
def removed_after(who):
    """``with removed_after("hororun"): <run a launch>``: once it has ended, wait for its
    files to settle, remove what it left, and say so on stderr as ``who``."""
    began = time.time()
    try:
        yield
    finally:
        said = describe(*remove_left_behind(began, wait=True))
        if said:
            sys.stderr.write(f"{who}: {said}\n")
