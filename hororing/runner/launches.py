"""One launch of an elastic job: the mpiexec started, its stderr watched for what the ranks
tell hororun, and where its ranks run."""

import socket
import subprocess
import sys
import threading
import time

from ..elastic import commits, job
from .output import copy_lines


class Launch:
    """One mpiexec the driver started: its number, size and placement, and what its output
    said so far."""

    def __init__(self, number, size, placed, process, drained, acknowledged):
        self.number = number
        self.size = size
        self.placed = placed
        self.process = process
        self.drained = drained  # waits until its output is consumed
        self.acknowledged = acknowledged  # its ranks agreed to stop at their next commit
        self.ready = threading.Event()  # started ahead: every rank waits to take over
        self.started = time.monotonic()
        self.going = False  # started ahead: told to take over


# what srun prints when an allocation no longer holds a node a step asks for
REFUSALS = ("Requested node configuration is not available", "Unable to create step")


def start_copying_stderr(command, env, acknowledged, refused=None, shrunk=None, marked=None):
    """Start ``command``; copy its stderr to ours, watching for the ranks' acknowledgement,
    (``refused``, an event) for srun refusing to start mpiexec's daemons, (``shrunk``, called
    with the line) for the survivors of a failure going on in process, and (``marked``, called
    with the line, which is not copied) for rank 0 entering and leaving hvd.elastic.run, a
    launch started ahead being ready to take over, and the commit the job stopped at being
    written on every host."""
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)

    def watch(line):
        if refused is not None and any(text.encode() in line for text in REFUSALS):
            refused.set()
        if shrunk is not None and job.SHRUNK in line:
            shrunk(line)
        if any(marker in line for marker in (job.ENTERED, job.RETURNED, job.READY, job.STOPPED)):
            if marked is not None:
                marked(line)
            return True
        return False
    pump = threading.Thread(target=copy_lines,
                            args=(process.stderr, sys.stderr, acknowledged, watch), daemon=True)
    pump.start()
    return process, pump.join


def short(placed, hosts):
    """What ``placed`` [(host, slots)] uses that ``hosts`` no longer offer (empty: none)."""
    available = dict(hosts)
    return [f"{host} has {available.get(host, 0)} of the {used} slots in use"
            for host, used in placed if available.get(host, 0) < used]


def is_local(host):
    """Whether ``host`` is this machine, whose disk the driver can read commits from."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    return host in names


def newest_local_commit(directory):
    found = commits.sequences(directory)
    return found[0] if found else -1


def stopped_at(line):
    """The commit number a job.STOPPED line from a launch's rank 0 names (None: it names none)."""
    words = line.split(job.STOPPED, 1)[1].split()
    return int(words[0]) if words and words[0].isdigit() else None
