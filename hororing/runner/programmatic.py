"""``hororing.run``: run a Python function on N ranks and get their results (``horovod.run``).

The function, its arguments and its results travel pickled (cloudpickle for the function, so
functions of ``__main__`` and closures work): to rank 0 through mpiexec's stdin, back from
rank 0 on one marked stdout line (hororing.runner.task). Everything else the ranks print
passes through. A rank whose function raises reports it on a marked stderr line and, where
the driver's report folder is reachable (the driver's host or a shared file system), in a
file there too: the job's abort can end mpiexec before it has forwarded the last lines.
"""

import base64
import os
import pickle
import subprocess
import sys
import tempfile
import threading

from ..config import variable_of
from . import leftovers
from .hosts import hostfile_or_hosts
from .mpiexec import find_mpiexec, mpi_flavor, mpiexec_command
from .output import copy_lines

# the lines by which the ranks (hororing.runner.task) hand back results and errors
RESULT_MARK = "\x1ehororing.run.result "
ERROR_MARK = "\x1ehororing.run.error "


class RunError(RuntimeError):
    """A rank's function raised (the message names the rank), or the job failed."""


def run(func, args=(), kwargs=None, np=None, min_np=None, max_np=None, slots=None,
        reset_limit=None, hosts=None, hostfile=None, start_timeout=None, verbose=None,
        use_gloo=None, use_mpi=None, mpi_args=None, executable=None, num_proc=None,
        min_num_proc=None, max_num_proc=None, host_discovery_script=None,
        elastic_timeout=None, env=None, **ignored):
    """Run ``func(*args, **kwargs)`` on every rank; return the results in rank order.

    Args:
        func: any function (closures and functions of ``__main__`` included).
        np / num_proc: the number of ranks (default 1).
        hosts: ``"host1:4,host2:4"``; hostfile: a file of ``host slots=N`` lines.
        min_np, max_np, host_discovery_script, slots, reset_limit, elastic_timeout: run under
            hororun's elastic driver (``func`` then uses ``hvd.elastic.run``); the results
            are those of the launch that finished.
        start_timeout: seconds for every rank to reach ``hvd.init()``.
        use_gloo: refused (hororing runs over MPI only); use_mpi: accepted.
        mpi_args: extra mpiexec arguments (a string or a list).
        executable: the Python of the ranks (default: this one).
        env: the ranks' environment (default: this process's).
        **ignored: Horovod's ssh and network options, which mpiexec's configuration covers.

    Raises:
        RunError: naming the rank whose function raised, with its traceback, or the job's
            exit status when it failed otherwise.
        ValueError: for ``use_gloo=True`` or a bad host list.

    Example:
        >>> results = hororing.run(lambda: __import__("hororing").init() or 1, np=2)
    """
    import cloudpickle

    if use_gloo:
        raise ValueError("hororing runs over MPI only: call hororing.run without use_gloo")
    np = np or num_proc or 1
    min_np = min_np or min_num_proc
    max_np = max_np or max_num_proc
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise RunError("no mpiexec found next to this Python or on PATH; install "
                       "'hororing[mpi]' or load your cluster's MPI")
    flavor = mpi_flavor(mpiexec)
    host_list = hostfile_or_hosts(hostfile, hosts)
    extra = mpi_args.split() if isinstance(mpi_args, str) else list(mpi_args or [])
    environment = dict(os.environ if env is None else env)
    if start_timeout is not None:
        environment[variable_of("start_timeout_s")] = str(start_timeout)
    # the ranks import what the caller can (a function of an imported module is pickled by
    # reference), so they get the caller's import path first
    paths = [os.path.abspath(entry or os.curdir) for entry in sys.path]
    paths += [entry for entry in environment.get("PYTHONPATH", "").split(os.pathsep) if entry]
    environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
        entry for entry in paths if os.path.isdir(entry)))
    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    with tempfile.TemporaryDirectory(prefix="hororing-run-reports-") as reports:
        # the ranks get the folder where a failing rank also leaves its report
        command = [executable or sys.executable, "-m", "hororing.runner.task", reports]
        collector = _Collector(verbose, reports)
        status = _launch(mpiexec, flavor, extra, command, environment, payload, collector, np,
                         min_np, max_np, host_list, host_discovery_script, slots, reset_limit,
                         elastic_timeout)
        return collector.results(status)


def _launch(mpiexec, flavor, extra, command, environment, payload, collector, np, min_np,
            max_np, host_list, host_discovery_script, slots, reset_limit, elastic_timeout):
    if min_np is not None or max_np is not None or host_discovery_script:
        return _run_elastic(mpiexec, flavor, extra, command, environment, payload, collector,
                            np, min_np, max_np, host_list, host_discovery_script, slots,
                            reset_limit, elastic_timeout)
    with tempfile.TemporaryDirectory(prefix="hororing-run-") as scratch:
        full = mpiexec_command(mpiexec, flavor, np, host_list, scratch,
                               env=environment) + extra + command
        with leftovers.removed_after("hororing.run"):  # killed ranks' shared memory
            return collector.launch(full, environment, payload)


def _run_elastic(mpiexec, flavor, extra, command, environment, payload, collector, np, min_np,
                 max_np, host_list, script, slots, reset_limit, elastic_timeout):
    from . import discovery
    from .elastic import ElasticDriver

    discover = discovery.choose(script, slots, host_list, np, min_np, max_np)

    def command_for(size, hosts, scratch, env):
        return mpiexec_command(mpiexec, flavor, size, hosts, scratch, env=env) + extra

    driver = ElasticDriver(command_for, command, discover, min_np or np, max_np,
                           600.0 if elastic_timeout is None else elastic_timeout, reset_limit,
                           None, environment, start=collector.starter(payload))
    return driver.run()


def cause(reports):
    """The report to name first: the lowest rank whose error is its own, not a
    HorovodInternalError raised because a peer failed or left (whose report can reach the
    driver before the failing rank's abort ends it), else the lowest rank."""
    own = [report for report in reports if not report.get("consequence")]
    return min(own or reports, key=lambda report: report["rank"])


class _Collector:
    """Starts a launch with the payload on stdin and keeps rank 0's result line."""

    def __init__(self, verbose, reports):
        self.verbose = verbose
        self.reports = reports
        self.result = None
        self.errors = []

    def starter(self, payload):
        """A start function for the elastic driver: every launch gets the payload."""
        def start(command, env, acknowledged):
            self.result, self.errors = None, []
            for name in os.listdir(self.reports):  # an earlier launch's reports
                os.unlink(os.path.join(self.reports, name))
            return self.start(command, env, payload, acknowledged)
        return start

    def launch(self, command, env, payload):
        process, drained = self.start(command, env, payload)
        status = process.wait()
        drained()
        return status

    def start(self, command, env, payload, acknowledged=None):
        if self.verbose:
            sys.stderr.write("hororing.run: " + " ".join(command) + "\n")
        process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        pumps = [threading.Thread(target=copy_lines, daemon=True, args=(
                     process.stdout, sys.stdout, None, self._keeper(RESULT_MARK))),
                 threading.Thread(target=copy_lines, daemon=True, args=(
                     process.stderr, sys.stderr, acknowledged, self._keeper(ERROR_MARK)))]
        for pump in pumps:
            pump.start()
        try:
            process.stdin.write(payload)
            process.stdin.close()
        except BrokenPipeError:  # the job ended before reading it; its status says why
            pass

        def drained():
            for pump in pumps:
                pump.join()
        return process, drained

    def _keeper(self, mark):
        marker = mark.encode()

        def keep(line):
            if not line.startswith(marker):
                return False
            value = pickle.loads(base64.b64decode(line[len(marker):]))
            if mark == RESULT_MARK:
                self.result = value
            else:
                self.errors.append(value)
            return True
        return keep

    def _reported(self):
        """The errors reported on stderr and, where stderr lost them, in the report folder."""
        errors = {report["rank"]: report for report in self.errors}
        for name in sorted(os.listdir(self.reports)):
            if name.startswith("error."):
                try:
                    with open(os.path.join(self.reports, name), "rb") as handle:
                        report = pickle.load(handle)
                except (OSError, EOFError, pickle.UnpicklingError):
                    continue
                errors.setdefault(report["rank"], report)
        return list(errors.values())

    def results(self, status):
        self.errors = self._reported()
        if self.errors:
            first = cause(self.errors)
            ranks = ", ".join(str(report["rank"]) for report in
                              sorted(self.errors, key=lambda report: report["rank"]))
            raise RunError(f"hororing.run: rank {first['rank']} raised {first['error']} "
                           f"(ranks that raised: {ranks})\n{first['traceback']}")
        if status != 0 or self.result is None:
            raise RunError(f"hororing.run: the job failed with exit status {status} before "
                           f"rank 0 returned the results")
        return self.result
