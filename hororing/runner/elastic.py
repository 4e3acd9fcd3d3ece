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
4. A job that grows (more slots than it has, no host in use gone) is relaunched ahead
   (``handover``): once rank 0 of the running launch has entered ``hvd.elastic.run``, the
   next launch starts beside it with HORORING_ELASTIC_HANDOVER=1; its ranks import, initialise
   and build their model while the job trains, and wait in ``hvd.elastic.run`` until rank 0
   reports them all there (``job.READY``). Only then is the running job asked to stop at its
   next commit; when it has, SIGUSR1 tells the waiting ranks to read that commit and go on.
   The job pauses for one commit's write and read instead of a launch. A launch started ahead
   that ends, no longer fits the hosts, or has not reported every rank ready within
   ``--handover-timeout`` (a rank stuck in its start would otherwise hold the growth back for
   ever), is ended and the job relaunched as in 2-3.
5. In process (ULFM), the new rank 0 reports the survivors' size on stderr (``job.SHRUNK``).
   The dead ranks' slots are held out, as Horovod blacklists a failed worker's host: for a
   time drawn from ``--blacklist-cooldown-range``, else for the rest of the job (unless
   ``--min-np`` needs them). The job grows back (4.) when the hosts offer more slots than
   it has beside those held out; the driver looks again as a held-out slot comes back.
"""

import functools
import math
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ..elastic import job
from . import discovery, leftovers, warm
from .launches import REFUSALS, Launch, is_local, newest_local_commit, short, stopped_at, \
    start_copying_stderr

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
        warm: the modules relaunched ranks find imported (``warm.py``; empty: none).
        handover: a launch that grows the job starts ahead, beside the running one, and takes
            over at its next commit (4. above).
        handover_timeout: seconds a launch started ahead has to report every rank ready.
    """

    def __init__(self, command_for, command, discover, min_np, max_np=None,
                 elastic_timeout=600.0, reset_limit=None, directory=None, env=None,
                 interval=1.0, verbose=False, start=None, in_process=False, cooldown=None,
                 warm=(), handover=False, handover_timeout=120.0):
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
        self.handover = handover
        self.handover_timeout = handover_timeout
        self._ahead = None  # the launch started ahead, waiting to take over
        self._going = threading.Lock()  # told to go once, from the main or the stderr thread
        self._stopped_at = None  # the commit the running job stopped at, from its rank 0

    def run(self):
        """Return the job's exit status: 0 when it finished, else why it stopped."""
        if self.in_process:
            log("a rank that dies is recovered in process: the survivors go on (Open MPI's "
                "ULFM, mpiexec --with-ft ulfm)")
        self._began = time.time()  # what the launches leave in shared memory is removed
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
            leftovers.remove_left_behind(self._began, wait=True)  # the launches are over

    def _supervise(self, directory, scratch):
        try:
            return self._relaunching(directory, scratch)
        finally:
            if self._ahead is not None:
                self._end(self._ahead.process)
                self._ahead = None

    def _relaunching(self, directory, scratch):
        launch, resets, fruitless, refusals = 0, 0, 0, 0
        while True:
            before = newest_local_commit(directory)
            current = self._take_over(directory)
            self._stopped_at = None
            if current is None:
                hosts = self._wait_for_hosts()
                if hosts is None:
                    return 1
                size = self._size(hosts)
                current = self._start(launch, size, discovery.assign(hosts, size), directory,
                                      scratch)
            placed = current.placed
            status = self._watch(current, directory, scratch)
            said = leftovers.describe(*leftovers.remove_left_behind(self._began))
            if said:
                log(f"launch {launch} ended: {said}")
            if status == 0:
                log(f"launch {launch} finished")
                return 0
            after = newest_local_commit(directory)
            refusals = refusals + 1 if self._refused.is_set() else 0
            if refusals >= NO_PROGRESS_LIMIT:
                log(f"Slurm refused {refusals} launches in a row on "
                    + ",".join(host for host, _ in placed) + ": the discovery names nodes the "
                    "allocation does not hold (SLURM_JOB_NODELIST keeps the nodes of "
                    "submission; ask squeue -h -j $SLURM_JOB_ID -o %N, or give no discovery "
                    "script inside the allocation); stopping")
                return status or 1
            if status == job.RESCALE_STATUS:
                # a launch that took over at once may have committed since; its rank 0 said
                stopped = after if self._stopped_at is None else self._stopped_at
                log(f"launch {launch} stopped at commit {stopped} for the new hosts")
                fruitless = 0
            else:
                log(f"launch {launch} failed with exit status {status} (a rank died or raised;"
                    f" the newest commit on this machine is {after})")
                counted = any(is_local(host) for host, _ in placed)
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

    def _until_next_poll(self):
        """Seconds to the next look at the hosts: ``interval``, or sooner where a held-out
        slot comes back sooner (the job grows as soon as it may)."""
        now = time.monotonic()
        soonest = min((until for until in self._held_out if until > now), default=math.inf)
        return max(0.01, min(self.interval, soonest - now + 0.01))

    def _marked(self, line):
        """A marker line from a launch's stderr (on the thread that reads it)."""
        if job.READY in line:  # from the launch started ahead
            if self._ahead is not None:
                self._ahead.ready.set()
        elif job.STOPPED in line:  # the running job's commit is on every host: go at once
            self._stopped_at = stopped_at(line)
            ahead = self._ahead
            if ahead is not None and ahead.ready.is_set() and ahead.process.poll() is None:
                self._go(ahead)
        else:
            self._in_run = job.ENTERED in line

    def _go(self, ahead):
        """Tell the ready launch started ahead to read the newest commit and go on."""
        with self._going:
            if ahead.going:
                return
            ahead.going = True
            self._running = ahead.size
            self._in_run = False  # before its rank 0 can say it entered
            ahead.process.send_signal(job.NOTICE_SIGNAL)

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

    def _start(self, launch, size, placed, directory, scratch, ahead=False):
        """Start launch number ``launch`` (``ahead``: beside the running one, its ranks
        waiting to take over)."""
        env = dict(self.env)
        env[job.DIR_ENV] = str(directory)
        env[job.LAUNCH_ENV] = str(launch)
        env[job.MIN_NP_ENV] = str(self.min_np)
        if ahead:
            env[job.HANDOVER_ENV] = "1"
        else:
            self._running = size
            self._in_run = False
        own = os.path.join(scratch, f"launch-{launch}")  # its host file: two launches
        os.makedirs(own, exist_ok=True)  # overlap when one is started ahead
        command = self.command_for(size, placed, own, env) + \
            ["sh", "-c", _IGNORE_NOTICES, "hororun-rank"] + self._rank_command(scratch)
        log(f"launch {launch}: {size} ranks on " +
            ",".join(f"{host}:{slots}" for host, slots in placed) +
            (", started ahead to take over at the running job's next commit" if ahead else ""))
        if self.verbose:
            log("command: " + " ".join(command))
        acknowledged = threading.Event()
        if not ahead:
            self._refused.clear()
        process, drained = self.start(command, env, acknowledged)
        return Launch(launch, size, placed, process, drained, acknowledged)

    def _take_over(self, directory):
        """Tell the launch started ahead, if any and ready, to go on from the newest commit;
        that launch, or None (then it was ended, and the job is launched anew)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if not ahead.going:  # else told as soon as the commit was on every host
            why = self._unfit(ahead)
            if why is None and not ahead.ready.is_set():
                why = "was not ready"
            if why is not None:
                log(f"launch {ahead.number}, started ahead, {why}; ending it")
                self._end(ahead.process)
                return None
            self._go(ahead)
        self._refused.clear()
        at = newest_local_commit(directory) if self._stopped_at is None else self._stopped_at
        log(f"launch {ahead.number} takes over from commit {at}")
        return ahead

    def _unfit(self, ahead, hosts=None):
        """Why the launch started ahead cannot take over, or None."""
        if ahead.process.poll() is not None:
            return f"ended with exit status {ahead.process.returncode}"
        if hosts is None:
            try:
                hosts = self.discover()
            except discovery.DiscoveryError:
                return None  # keep it: the discovery answers again at the next poll
        missing = short(ahead.placed, hosts)
        return "no longer fits the hosts (" + "; ".join(missing) + ")" if missing else None

    def _watch(self, current, directory, scratch):
        """Supervise a running launch until it ends; its exit status."""
        launch, process, placed = current.number, current.process, current.placed
        noticed = declined = False  # declined: a launch started ahead failed; not again
        try:
            while True:
                try:
                    status = process.wait(timeout=self._until_next_poll())
                    current.drained()
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
                if current.acknowledged.is_set():
                    continue  # the ranks are stopping: a signal now could hit an exiting one
                try:
                    hosts = self.discover()
                except discovery.DiscoveryError as error:
                    log(f"discovery failed, keeping the hosts in use: {error}")
                    continue
                change = self._change(self._running, placed, hosts)
                if self._ahead is not None:
                    why = self._unfit(self._ahead, hosts)
                    if why is None and not self._ahead.ready.is_set() and \
                            time.monotonic() - self._ahead.started > self.handover_timeout:
                        why = (f"was not ready within --handover-timeout "
                               f"{self.handover_timeout:g} s")
                    if why is not None or short(placed, hosts):
                        log(f"launch {self._ahead.number}, started ahead, "
                            f"{why or 'is not wanted: a host in use is gone'}; ending it")
                        self._end(self._ahead.process)
                        self._ahead, declined = None, True
                    elif not self._ahead.ready.is_set():
                        continue  # its ranks are starting; the job trains on meanwhile
                    else:
                        change = f"launch {self._ahead.number}, started ahead, is ready"
                        if not noticed:
                            log(f"{change}; asking launch {launch} to stop at its next commit")
                            noticed = True
                elif change and self.handover and self._in_run and not declined and \
                        not short(placed, hosts):
                    size = self._size(hosts)
                    self._ahead = self._start(launch + 1, size, discovery.assign(hosts, size),
                                              directory, scratch, ahead=True)
                    continue
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

    def _change(self, size, placed, hosts):
        """Why the running job should stop for ``hosts``, or None."""
        missing = short(placed, hosts)
        if missing:
            return "; ".join(missing)
        new_size = self._size(hosts)
        if new_size > size:
            return f"{new_size} slots usable, the job has {size}"
        return None
