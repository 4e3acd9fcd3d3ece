"""Ending a launched job whole: hororun, its mpiexec and every rank, including ranks an MPI's
daemon started in process groups of their own (Open MPI's), which a signal to the launch's
session does not reach. Used by the benchmarks and tests that bound a job by a timeout."""

import os
import signal
import time


def descendants(pid):
    """The pids of every process below ``pid`` now (children, theirs, ...)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # ended while being read
        children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def ask_for_stacks(process, script, settle=3.0):
    """Send SIGUSR2 to every process below ``process`` that runs ``script`` (``python
    SCRIPT ...``: the ranks of a job that registered ``faulthandler`` on it, which then
    write every thread's stack to stderr; not mpiexec, whose command line names the script
    too), and give them ``settle`` seconds to write. Returns how many were asked."""
    asked = 0
    for pid in descendants(process.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                args = cmdline.read().split(b"\0")
            if len(args) < 2 or args[1] != script.encode() or \
                    not os.path.basename(args[0]).startswith(b"python"):
                continue
            os.kill(pid, signal.SIGUSR2)
            asked += 1
        except (OSError, ProcessLookupError):
            continue
    if asked:
        time.sleep(settle)
    return asked


def end_job(process, grace=3.0, also=()):
    """End ``process`` (a launch started with ``start_new_session=True``) and everything below
    it: SIGTERM to the launch first, so that hororun and mpiexec stop their ranks as on a
    cluster, then, after ``grace`` seconds, SIGKILL to every process that was below it and to
    the pids in ``also`` (ranks known by other means, e.g. pid files)."""
    below = set(descendants(process.pid)) | set(also)
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    if process.poll() is None:
        below |= {process.pid, *descendants(process.pid)}
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
