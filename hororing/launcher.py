"""``hororun``: horovodrun's command line, turned into the mpiexec call of the MPI in use.

    hororun -np 4 python train.py
    hororun -np 8 -H node1:4,node2:4 python train.py
    hororun -np 8 --hostfile hosts python train.py       # lines "host slots=4" or "host:4"
    salloc -n 4 hororun python train.py                  # -np: the allocation's tasks
    hororun --slurm -np 4 python train.py                # the ranks as srun's tasks
    hororun --check-build

The mpiexec is the one next to this Python (the ``mpi`` extra's MPICH or Open MPI) or the
first on PATH; ``--mpiexec`` names another. MPICH's Hydra and Open MPI take different flags
for hosts; Open MPI also needs ``--allow-run-as-root`` as root and ``--oversubscribe`` for
more ranks than cores, which hororun adds. ``--verbose`` prints the command it runs.
"""

import argparse
import importlib.util
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile

from . import slurm
from .config import launch_environment, variable_of

MPICH, OPEN_MPI = "MPICH", "Open MPI"


def main(argv=None):
    """Run the command line; return the job's exit status."""
    args = _parser().parse_args(argv)
    mpiexec = args.mpiexec or find_mpiexec()
    if args.check_build:
        print(check_build(mpiexec))
        return 0
    if not args.command:
        _parser().error("give the command to run, e.g. hororun -np 2 python train.py")
    if args.discovery_script or args.min_np is not None:
        return _run_elastic(args, mpiexec)
    try:
        within = allocation_of(args)
    except ValueError as error:
        sys.stderr.write(f"hororun: {error}\n")
        return 2
    if args.np is None and within is not None:
        args.np = within.tasks  # salloc -n 4 / sbatch -n 4: the allocation's tasks
    if args.np is None:
        _parser().error("-np is required: the number of processes to start")
    if args.np < 1:
        _parser().error(f"-np must be >= 1, got {args.np}")
    if within is not None and args.np > within.tasks:
        sys.stderr.write(f"hororun: -np {args.np} asks for more ranks than Slurm job "
                         f"{within.job_id} was allocated ({within.tasks} tasks on "
                         f"{', '.join(host for host, _ in within.hosts)}); ask for at most "
                         f"{within.tasks}, or allocate more (salloc/sbatch -n {args.np})\n")
        return 2
    if args.slurm:
        return _run_with_srun(args, mpiexec)
    if mpiexec is None:
        sys.stderr.write("hororun: no mpiexec found next to this Python or on PATH; install "
                         "'hororing[mpi]' (MPICH from PyPI) or load your cluster's MPI\n")
        return 2
    with tempfile.TemporaryDirectory(prefix="hororun-") as scratch:
        try:
            command, env = build_command(args, mpiexec, mpi_flavor(mpiexec), scratch,
                                         in_allocation=within is not None)
        except ValueError as error:
            sys.stderr.write(f"hororun: {error}\n")
            return 2
        if args.verbose:
            print("hororun: " + " ".join(_quote(part) for part in command), flush=True)
        return run_and_explain(command, env)


# what mpiexec's own messages mean, for the line hororun adds when a job fails
_SIGNATURES = [
    ("assert (!closed) failed", "mpiexec lost its connection to a host: the processes of a "
                                "host died, or its link failed"),
    ("Ending the job: no progress", "a collective made no progress for longer than "
                                    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (see the stall warning "
                                    "above: it names the ranks and hosts waited on)"),
    ("EXIT STRING: Killed (signal 9)", "a rank was killed (SIGKILL: out of memory, or by hand)"),
    ("exited on signal 9", "a rank was killed (SIGKILL: out of memory, or by hand)"),
]


def run_and_explain(command, env):
    """Run mpiexec, its stderr passed through; if it fails, add one line saying why, when its
    messages say so."""
    from .runner.output import copy_lines

    seen = []

    def watch(line):
        for signature, meaning in _SIGNATURES:
            if signature.encode() in line and meaning not in seen:
                seen.append(meaning)
        return False

    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    copy_lines(process.stderr, sys.stderr, keep=watch)
    status = process.wait()
    if status != 0 and seen:
        sys.stderr.write(f"hororun: the job failed (exit status {status}): {'; '.join(seen)}\n")
    return status


def allocation_of(args):
    """The Slurm allocation hororun runs in, where no hosts or discovery script were given
    (those win); else None.

    Raises:
        ValueError: Slurm's node list or tasks per node cannot be read.
    """
    if args.hosts or args.hostfile or getattr(args, "discovery_script", None):
        return None
    return slurm.allocation()


def _run_elastic(args, mpiexec):
    from .runner import discovery
    from .runner.elastic import ElasticDriver

    try:
        within = allocation_of(args)
    except ValueError as error:
        sys.stderr.write(f"hororun: {error}\n")
        return 2
    if args.np is None and args.min_np is None and within is not None:
        args.np = within.tasks
    min_np = args.min_np if args.min_np is not None else args.np
    if min_np is None or min_np < 1:
        _parser().error("elastic mode needs -np or --min-np >= 1")
    if args.max_np is not None and args.max_np < min_np:
        _parser().error(f"--max-np {args.max_np} is below the minimum {min_np}")
    if mpiexec is None:
        sys.stderr.write("hororun: no mpiexec found next to this Python or on PATH\n")
        return 2
    try:
        hosts = None if args.discovery_script else hosts_of(args)
    except ValueError as error:
        sys.stderr.write(f"hororun: {error}\n")
        return 2
    discover = discovery.choose(args.discovery_script, args.slots, hosts, args.np, min_np,
                                args.max_np, allocation=within)
    env = job_environment(args)
    flavor = mpi_flavor(mpiexec)

    def command_for(size, hosts, scratch):
        return mpiexec_command(mpiexec, flavor, size, hosts, scratch) + shlex.split(args.mpi_args)

    driver = ElasticDriver(command_for, args.command, discover, min_np, args.max_np,
                           args.elastic_timeout, args.reset_limit, args.elastic_dir, env,
                           args.discovery_interval, args.verbose)
    return driver.run()


def _parser():
    parser = argparse.ArgumentParser(
        prog="hororun", description="Launch a hororing (or Horovod) training script with MPI.")
    parser.add_argument("-np", "--num-proc", dest="np", type=int,
                        help="number of processes (one per GPU where there are GPUs)")
    parser.add_argument("-H", "--hosts", help="hosts and their slots: host1:4,host2:4")
    parser.add_argument("-hostfile", "--hostfile", dest="hostfile",
                        help="file of hosts, one per line: 'host slots=4' or 'host:4'")
    parser.add_argument("--start-timeout", type=float, default=None,
                        help="seconds for every rank to reach hvd.init(); the job ends with an "
                             "error naming the missing ranks otherwise")
    parser.add_argument("--verbose", action="store_true", help="print the mpiexec command")
    parser.add_argument("--check-build", action="store_true",
                        help="print the frameworks, controllers and operations available")
    parser.add_argument("--mpiexec", help="the mpiexec to use (default: next to this Python, "
                                          "then PATH)")
    parser.add_argument("--slurm", action="store_true",
                        help="start the ranks with srun (--mpi=pmi2 for MPICH, --mpi=pmix for "
                             "Open MPI) instead of mpiexec; inside salloc/sbatch -np defaults "
                             "to the allocation's tasks either way")
    parser.add_argument("--mpi-args", default="",
                        help="more mpiexec arguments, as one string (e.g. the launcher of "
                             "scripts/emulated_hosts.sh: --mpi-args \"$(cat DIR/mpi-args)\")")
    tuning = parser.add_argument_group(
        "autotuning", "tune the engine's performance settings while the job runs "
                      "(docs/tuning.md, \"Autotuning\")")
    tuning.add_argument("--autotune", action="store_true", help="HOROVOD_AUTOTUNE=1")
    tuning.add_argument("--autotune-log-file", help="rank 0 writes the CSV log of each setting "
                                                    "scored there")
    tuning.add_argument("--autotune-warmup-samples", type=int,
                        help="samples run first and not scored (default: 3)")
    tuning.add_argument("--autotune-steps-per-sample", type=int,
                        help="steps per sample (default: 10)")
    tuning.add_argument("--autotune-bayes-opt-max-samples", type=int,
                        help="settings scored before the winner is chosen (default: 20)")
    tuning.add_argument("--autotune-gaussian-process-noise", type=float,
                        help="the Gaussian process's noise (default: 0.8)")
    elastic = parser.add_argument_group(
        "elastic", "relaunch the job from its newest commit when a rank dies or the hosts "
                   "change (hvd.elastic.run; docs/elastic.md)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                         help="fewest ranks to train with (default: -np); turns elastic mode on")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                         help="most ranks to train with (default: no bound)")
    elastic.add_argument("--host-discovery-script", dest="discovery_script",
                         help="prints the hosts available now, one 'host' or 'host:slots' a "
                              "line; turns elastic mode on")
    elastic.add_argument("--slots", "--slots-per-host", dest="slots", type=int, default=1,
                         help="slots of a discovered host whose line names none (default: 1)")
    elastic.add_argument("--elastic-timeout", type=float,
                         default=launch_environment().elastic_timeout_s,
                         help="seconds to wait for --min-np slots (default: 600)")
    elastic.add_argument("--reset-limit", type=int,
                         help="relaunches allowed, for faults and host changes (default: none)")
    elastic.add_argument("--elastic-dir",
                         help="where each host keeps the job's commits (default: a new "
                              "temporary directory)")
    elastic.add_argument("--discovery-interval", type=float, default=1.0,
                         help="seconds between runs of the discovery script (default: 1)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return parser


def find_mpiexec():
    """Return the mpiexec beside this interpreter, else the first on PATH, else None."""
    beside = pathlib.Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def mpi_flavor(mpiexec):
    """MPICH or OPEN_MPI, from ``mpiexec --version``."""
    try:
        output = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        output = ""
    return OPEN_MPI if "Open MPI" in output or "OpenRTE" in output else MPICH


def build_command(args, mpiexec, flavor, scratch, in_allocation=False):
    """The mpiexec command line and environment for ``args``.

    ``in_allocation``: inside salloc/sbatch with no hosts given, MPI's own Slurm support
    places the ranks on the allocation's nodes (Hydra and Open MPI start their daemons with
    srun), and Slurm's limits stand: no ``--oversubscribe``.

    Raises:
        ValueError: a malformed host list or host file.
    """
    env = job_environment(args)
    return mpiexec_command(mpiexec, flavor, args.np, hosts_of(args), scratch,
                           in_allocation=in_allocation) + \
        shlex.split(args.mpi_args) + list(args.command), env


SRUN_PLUGINS = {MPICH: "pmi2", OPEN_MPI: "pmix"}  # what each PyPI MPI speaks under srun


def _run_with_srun(args, mpiexec):
    """hororun --slurm: start the ranks as srun's tasks, with the PMI plugin of the MPI in use."""
    srun = shutil.which("srun")
    if srun is None:
        sys.stderr.write("hororun: --slurm needs srun on PATH (Slurm's client)\n")
        return 2
    flavor = mpi_flavor(mpiexec) if mpiexec else MPICH
    command = [srun, f"--mpi={SRUN_PLUGINS[flavor]}", "-n", str(args.np)]
    if args.hosts or args.hostfile:
        try:
            hosts = hosts_of(args)
        except ValueError as error:
            sys.stderr.write(f"hororun: {error}\n")
            return 2
        command += ["--nodelist", ",".join(host for host, _ in hosts)]
    command += shlex.split(args.mpi_args) + list(args.command)
    if args.verbose:
        print("hororun: " + " ".join(_quote(part) for part in command), flush=True)
    return run_and_explain(command, job_environment(args))


# hororun's options that become the job's environment variables: option -> Config field
_ENVIRONMENT_OPTIONS = {"start_timeout": "start_timeout_s", "autotune_log_file": "autotune_log",
                        "autotune_warmup_samples": "autotune_warmup_samples",
                        "autotune_steps_per_sample": "autotune_steps_per_sample",
                        "autotune_bayes_opt_max_samples": "autotune_bayes_opt_max_samples",
                        "autotune_gaussian_process_noise": "autotune_gaussian_process_noise"}


def job_environment(args):
    """This process's environment, with the variables hororun's options set."""
    env = dict(os.environ)
    for option, field in _ENVIRONMENT_OPTIONS.items():
        value = getattr(args, option, None)
        if value is not None:
            env[variable_of(field)] = str(value)
    if getattr(args, "autotune", False):
        env[variable_of("autotune")] = "1"
    return env


def hosts_of(args):
    """The (host, slots) pairs of ``-H`` or ``--hostfile``, or None for this machine."""
    return hostfile_or_hosts(args.hostfile, args.hosts)


def hostfile_or_hosts(hostfile, hosts):
    """The (host, slots) pairs of a host file or a ``host:slots,...`` list, or None."""
    if hostfile:
        return read_hostfile(hostfile)
    return parse_hosts(hosts) if hosts else None


def mpiexec_command(mpiexec, flavor, np, hosts, scratch, in_allocation=False):
    """``mpiexec`` with the flags that start ``np`` ranks on ``hosts`` (None: this machine,
    or with ``in_allocation`` the Slurm allocation's nodes, which the MPI finds itself)."""
    command = [mpiexec, "-n", str(np)]
    if flavor == OPEN_MPI:
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
        slots = sum(count for _, count in hosts) if hosts else os.cpu_count() or 1
        # more ranks than slots, or than this machine's cores when its hosts are this machine
        # (Open MPI binds each rank to a core and refuses to share one otherwise)
        local = not hosts or all(host in ("localhost", "127.0.0.1") for host, _ in hosts)
        if not in_allocation and (np > slots or (local and np > (os.cpu_count() or 1))):
            command.append("--oversubscribe")
        if hosts:
            command += ["-H", ",".join(f"{host}:{count}" for host, count in hosts)]
    elif hosts:
        hostfile = pathlib.Path(scratch) / "hosts"
        hostfile.write_text("".join(f"{host}:{count}\n" for host, count in hosts))
        command += ["-f", str(hostfile)]
    return command


def parse_hosts(text):
    """``"a:4,b:2"`` -> [("a", 4), ("b", 2)] (a host without slots has one)."""
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if item:
            hosts.append(_host_and_slots(item, item.partition(":")[0], item.partition(":")[2]))
    if not hosts:
        raise ValueError(f"-H needs host:slots pairs, e.g. node1:4,node2:4; got {text!r}")
    return hosts


def read_hostfile(path):
    """Hosts from a file of 'host slots=N' (Horovod, Open MPI) or 'host:N' (MPICH) lines."""
    hosts = []
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        if "slots=" in line:
            host, _, slots = line.partition("slots=")
            hosts.append(_host_and_slots(line, host.strip(), slots.strip(), path, number))
        else:
            host, _, slots = line.partition(":")
            hosts.append(_host_and_slots(line, host.strip(), slots.strip(), path, number))
    if not hosts:
        raise ValueError(f"host file {path} lists no hosts")
    return hosts


def _host_and_slots(text, host, slots, path=None, number=None):
    where = f" ({path}, line {number})" if path else ""
    if not host or (slots and not slots.isdigit()) or slots == "0":
        raise ValueError(f"cannot read host entry {text!r}{where}: expected host:slots or "
                         f"'host slots=N' with N >= 1")
    return host, int(slots) if slots else 1


def check_build(mpiexec=None):
    """The installation's capabilities, in the layout of ``horovodrun --check-build``."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        __version__ = version("hororing")
    except PackageNotFoundError:  # run from a checkout that is not installed
        __version__ = "unknown"

    def mark(available):
        return "[X]" if available else "[ ]"

    has = {name: importlib.util.find_spec(name) is not None
           for name in ("torch", "tensorflow", "numba", "cupy", "mpi4py")}
    mpi = mpi_flavor(mpiexec) if mpiexec else None
    lines = [
        f"hororing v{__version__}:",
        "",
        "Available Frameworks:",
        f"    {mark(has['tensorflow'] and importlib.util.find_spec('hororing.tensorflow') is not None)} TensorFlow",
        f"    {mark(has['torch'])} PyTorch",
        f"    {mark(True)} NumPy",
        "",
        "Available Controllers:",
        f"    {mark(has['mpi4py'])} MPI" + (f" ({mpi}, {mpiexec})" if mpi else " (no mpiexec found)"),
        f"    {mark(False)} Gloo",
        "",
        "Available Tensor Operations:",
        f"    {mark(False)} NCCL",
        f"    {mark(False)} DDL",
        f"    {mark(False)} CCL",
        f"    {mark(has['mpi4py'])} MPI",
        f"    {mark(False)} Gloo",
        f"    {mark(has['numba'] or has['cupy'])} CUDA device buffers (hororing's ring)",
    ]
    return "\n".join(lines)


def _quote(part):
    return part if part and all(c.isalnum() or c in "-_./:=," for c in part) else repr(part)


if __name__ == "__main__":
    sys.exit(main())
