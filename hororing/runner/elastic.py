"""hororun's elastic driver: relaunch the job on the hosts there are, from its newest commit.

An MPI world does not outlive a dead rank (MPICH from PyPI has no fault-tolerance extension,
and mpiexec ends every rank when one dies), so the driver supervises mpiexec. Where the MPI is
an Open MPI with ULFM, the job is started ``--with-ft ulfm`` and the survivors of a dead rank
go on in process (``elastic/recovery.py``); the relaunch below is then for growth, for too
few survivors, and for failures that are not a dead rank:

1. It asks the discovery (a script, or the fixed ``-H``/``--hostfile`` hosts) for hosts,
   waits up to ``--elastic-timeout`` until they offer ``--min-np`` slots, and launches
   min(slots, ``--max-np``) ranks with HORORING_ELASTIC_DIR and HORORING_ELASTIC_LAUNCH set.
   Inside a Slurm allocation with no hosts given, the discovery is the allocation's live node
   list (squeue), not SLURM_JOB_NODELIST, which keeps naming nodes taken away from the job.
   Each rank starts with SIGUSR1 ignored (``sh -c 'trap "" USR1; exec ...'``) until
   ``hvd.elastic.run`` listens for it.
2. While the job runs it polls the discovery every ``--discovery-interval`` seconds. When
   the hosts would give the job another size, or a host in use is gone, it sends SIGUSR1 to
   mpiexec (which forwards it to every rank) and repeats that each poll until rank 0 answers
   on stderr (``job.ACKNOWLEDGEMENT``; a signal that reaches a rank as it exits makes Hydra
   fail the job): the ranks stop together at their next commit with status 75.
3. Whatever ended the job (status 75, a rank that raised, a rank killed, or srun refusing to
   start mpiexec's daemons on a node the allocation no longer holds, which mpiexec would wait
   on for ever; three refusals in a row end the job, naming the nodes), it relaunches on
   the hosts discovered then, and the new ranks resume from the newest commit that any host
   kept. Status 0 ends the driver. ``--reset-limit`` bounds the relaunches; where ranks run on
   this machine, three failed launches in a row with no new commit on its disk end the job as
   well, since relaunching a job that fails before its first commit would loop forever.
4. In process (ULFM), the new rank 0 reports the survivors' size on stderr (``job.SHRUNK``).
   The dead ranks' slots are held out, as Horovod blacklists a failed worker's host: for a
   time drawn from ``--blacklist-cooldown-range``, else for the rest of the job (unless
   ``--min-np`` needs them). The job grows back, stopping at a commit and relaunched, when
   the hosts offer more slots than it has beside those held out.
"""

import functools
import math
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ..elastic import commits, job
from . import discovery, warm
from .output import copy_lines

_IGNORE_NOTICES = 'trap "" USR1; exec "$@"'
NO_PROGRESS_LIMIT = 3


def log(message):
    stamp = time.strftime("%H:%M:%S")
    sys.stderr.write(f"hororun[elastic] {stamp} {message}\n")
    sys.stderr.flush()


class ElasticDriver:
    """Runs ``command`` under ``mpiexec`` again and again until it succeeds or cannot go on.

    Args:
        command_for: ``command_for(size, hosts, scratch, env)`` returns the mpiexec command
            (without the rank command) for ``size`` ranks on ``hosts`` [(host, slots)], whose
            environment is ``env``.
        command: the rank command.
        discover: a callable that returns the hosts [(host, slots)] available now.
        min_np, max_np: the job's bounds (max_np None: no bound).
        elastic_timeout: seconds to wait for ``min_np`` slots before giving up.
        reset_limit: relaunches allowed (None: no limit).
        directory: where this machine's ranks keep their commits (a new temporary directory
            when None, removed at the end).
        env: the environment for mpiexec.
        interval: seconds between discovery polls.
        start: ``start(command, env, acknowledged)`` starts a launch and returns the process
            and a function that waits for its output to be consumed; it must set the event
            ``acknowledged`` when the job's stderr carries ``job.ACKNOWLEDGEMENT`` (default:
            ``start_copying_stderr``).
        in_process: the job runs ``--with-ft ulfm``: survivors of a dead rank go on in it.
        cooldown: (min, max) seconds a dead rank's slot is held out after the survivors went
            on in process (None: for the rest of the job).
    """

    def __init__(self, command_for, command, discover, min_np, max_np=None,
                 elastic_timeout=600.0, reset_limit=None, directory=None, env=None,
                 interval=1.0, verbose=False, start=None, in_process=False, cooldown=None,
                 warm=()):
        self.command_for = command_for
        self.command = list(command)
        self.discover = discover
        self.min_np = min_np
        self.max_np = max_np
        self.elastic_timeout = elastic_timeout
        self.reset_limit = reset_limit
        self.directory = directory
        self.env = dict(os.environ if env is None else env)
        self.interval = interval
        self.verbose = verbose
        self._refused = threading.Event()  # the scheduler refused to start a launch's daemons
        self.start = start or functools.partial(start_copying_stderr, refused=self._refused,
                                                shrunk=self._shrunk, marked=self._marked)
        self.in_process = in_process
        self.cooldown = cooldown
        self._running = None  # the running launch's size (smaller after an in-process shrink)
        self._in_run = False  # rank 0 is inside hvd.elastic.run (job.ENTERED, job.RETURNED)
        self._held_out = []  # when each dead rank's slot may be used again (inf: never)
        self.warm = list(warm)  # the modules relaunched ranks find imported (warm.py)
        self._warm = None  # (the warm process, its socket) while the job runs

    def run(self):
        """Return the job's exit status: 0 when it finished, else why it stopped."""
        if self.in_process:
            log("a rank that dies is recovered in process: the survivors go on (Open MPI's "
                "ULFM, mpiexec --with-ft ulfm)")
        owned = self.directory is None
        directory = self.directory or tempfile.mkdtemp(prefix="hororun-elastic-")
        try:
            with tempfile.TemporaryDirectory(prefix="hororun-") as scratch:
                try:
                    return self._supervise(pathlib.Path(directory), scratch)
                finally:
                    self._stop_warm()
        finally:
            if owned:
                shutil.rmtree(directory, ignore_errors=True)

    def _supervise(self, directory, scratch):
        launch, resets, fruitless, refusals = 0, 0, 0, 0
        while True:
            hosts = self._wait_for_hosts()
            if hosts is None:
                return 1
            size = self._size(hosts)
            placed = discovery.assign(hosts, size)
            before = _newest_local_commit(directory)
            status = self._launch(launch, size, placed, directory, scratch)
            if status == 0:
                log(f"launch {launch} finished")
                return 0
            after = _newest_local_commit(directory)
            refusals = refusals + 1 if self._refused.is_set() else 0
            if refusals >= NO_PROGRESS_LIMIT:
                log(f"Slurm refused {refusals} launches in a row on "
                    + ",".join(host for host, _ in placed) + ": the discovery names nodes the "
                    "allocation does not hold (SLURM_JOB_NODELIST keeps the nodes of "
                    "submission; ask squeue -h -j $SLURM_JOB_ID -o %N, or give no discovery "
                    "script inside the allocation); stopping")
                return status or 1
            if status == job.RESCALE_STATUS:
                log(f"launch {launch} stopped at commit {after} for the new hosts")
                fruitless = 0
            else:
                log(f"launch {launch} failed with exit status {status} (a rank died or raised;"
                    f" the newest commit on this machine is {after})")
                counted = any(_is_local(host) for host, _ in placed)
                fruitless = fruitless + 1 if counted and after == before else 0
                if fruitless >= NO_PROGRESS_LIMIT:
                    log(f"{fruitless} launches in a row failed without a new commit; stopping")
                    return status
            resets += 1
            if self.reset_limit is not None and resets > self.reset_limit:
                log(f"reset limit {self.reset_limit} reached; stopping")
                return status
            launch += 1

    def _size(self, hosts):
        slots = discovery.total_slots(hosts)
        usable = slots - self._holding_out()
        if usable < self.min_np:  # held-out slots come back before the job stops for good
            usable = min(slots, self.min_np)
        return usable if self.max_np is None else min(usable, self.max_np)

    def _holding_out(self):
        now = time.monotonic()
        self._held_out = [until for until in self._held_out if until > now]
        return len(self._held_out)

    def _marked(self, line):
        self._in_run = job.ENTERED in line

    def _shrunk(self, line):
        """The job's stderr says the survivors of a failure went on in process."""
        try:
            size = int(line.split(job.SHRUNK, 1)[1].split()[0])
        except (IndexError, ValueError):
            return
        lost = (self._running or size) - size
        self._running = size
        for _ in range(max(lost, 0)):
            until = math.inf if self.cooldown is None else \
                time.monotonic() + random.uniform(*self.cooldown)
            self._held_out.append(until)
        log(f"{lost} rank(s) died; the job goes on in process with {size}; their slots are "
            f"held out " + ("for the rest of the job" if self.cooldown is None else
                            "for --blacklist-cooldown-range"))

    def _wait_for_hosts(self):
        deadline = time.monotonic() + self.elastic_timeout
        reported = None
        while True:
            try:
                hosts = self.discover()
            except discovery.DiscoveryError as error:
                hosts, reason = [], str(error)
            else:
                reason = f"{discovery.total_slots(hosts)} slots on {len(hosts)} hosts"
            if discovery.total_slots(hosts) >= self.min_np:
                return hosts
            if reported != reason:
                log(f"waiting for {self.min_np} slots: {reason}")
                reported = reason
            if time.monotonic() >= deadline:
                log(f"no {self.min_np} slots within --elastic-timeout {self.elastic_timeout:g} s"
                    f" ({reason}); stopping")
                return None
            time.sleep(self.interval)

    def _launch(self, launch, size, placed, directory, scratch):
        env = dict(self.env)
        env[job.DIR_ENV] = str(directory)
        env[job.LAUNCH_ENV] = str(launch)
        env[job.MIN_NP_ENV] = str(self.min_np)
        self._running = size
        self._in_run = False
        command = self.command_for(size, placed, scratch, env) + \
            ["sh", "-c", _IGNORE_NOTICES, "hororun-rank"] + self._rank_command(scratch)
        log(f"launch {launch}: {size} ranks on " +
            ",".join(f"{host}:{slots}" for host, slots in placed))
        if self.verbose:
            log("command: " + " ".join(command))
        acknowledged = threading.Event()
        self._refused.clear()
        process, drained = self.start(command, env, acknowledged)
        noticed = False
        try:
            while True:
                try:
                    status = process.wait(timeout=self.interval)
                    drained()
                    if status == 0 and self.in_process and self._in_run:
                        # ULFM's mpiexec gives no status for killed ranks: every one was
                        log(f"launch {launch} ended inside hvd.elastic.run with no rank left "
                            f"(every rank was killed)")
                        return 1
                    return status
                except subprocess.TimeoutExpired:
                    pass
                if self._refused.is_set():
                    # mpiexec would wait for ever for the daemons srun did not start
                    log(f"launch {launch}: Slurm refused to start its processes on "
                        + ",".join(host for host, _ in placed) + " (srun: " + REFUSALS[0]
                        + "): the allocation does not hold them now; ending this launch")
                    return self._end(process)
                if acknowledged.is_set():
                    continue  # the ranks are stopping: a signal now could hit an exiting one
                change = self._change(self._running, placed)
                if change:
                    if not noticed:
                        log(f"hosts changed ({change}); asking launch {launch} to stop at its "
                            f"next commit")
                        noticed = True
                    process.send_signal(job.NOTICE_SIGNAL)  # again each poll until answered
        except BaseException:
            self._end(process)
            raise

    def _rank_command(self, scratch):
        """What each rank runs: the command, through the warm start's shim where there are
        modules to import ahead (the first launch's ranks start fresh and have the warm
        processes for their keys made, ``warm.py``)."""
        if not self.warm:
            return self.command
        if self._warm is None:
            path = os.path.join(scratch, "warm.sock")
            process = subprocess.Popen(
                [self.command[0], "-m", "hororing.runner.warm", path, ",".join(self.warm)],
                env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)
            self._warm = (process, path)
            deadline = time.monotonic() + 10.0  # the first ranks ask it for warm processes
            while not os.path.exists(path) and process.poll() is None and \
                    time.monotonic() < deadline:
                time.sleep(0.02)
        return warm.wrap(self.command[0], self._warm[1], self.command)

    def _stop_warm(self):
        if self._warm is not None:
            self._end(self._warm[0])  # its ranks die with it
            self._warm = None

    @staticmethod
    def _end(process):
        """Stop a launch's mpiexec; its exit status."""
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def _change(self, size, placed):
        """Why the running job should stop for the hosts discovered now, or None."""
        try:
            hosts = self.discover()
        except discovery.DiscoveryError as error:
            log(f"discovery failed, keeping the hosts in use: {error}")
            return None
        available = dict(hosts)
        short = [f"{host} has {available.get(host, 0)} of the {used} slots in use"
                 for host, used in placed if available.get(host, 0) < used]
        if short:
            return "; ".join(short)
        new_size = self._size(hosts)
        if new_size > size:
            return f"{new_size} slots usable, the job has {size}"
        return None


# what srun prints when an allocation no longer holds a node a step asks for
REFUSALS = ("Requested node configuration is not available", "Unable to create step")


def start_copying_stderr(command, env, acknowledged, refused=None, shrunk=None, marked=None):
    """Start ``command``; copy its stderr to ours, watching for the ranks' acknowledgement,
    (``refused``, an event) for srun refusing to start mpiexec's daemons, (``shrunk``, called
    with the line) for the survivors of a failure going on in process, and (``marked``, called
    with the line, which is not copied) for rank 0 entering and leaving hvd.elastic.run."""
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)

    def watch(line):
        if refused is not None and any(text.encode() in line for text in REFUSALS):
            refused.set()
        if shrunk is not None and job.SHRUNK in line:
            shrunk(line)
        if job.ENTERED in line or job.RETURNED in line:
            if marked is not None:
                marked(line)
            return True
        return False
    pump = threading.Thread(target=copy_lines,
                            args=(process.stderr, sys.stderr, acknowledged, watch), daemon=True)
    pump.start()
    return process, pump.join


def _is_local(host):
    """Whether ``host`` is this machine, whose disk the driver can read commits from."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    return host in names


def _newest_local_commit(directory):
    found = commits.sequences(directory)
    return found[0] if found else -1
