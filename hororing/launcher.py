"""``hororun``: horovodrun's command line, turned into the mpiexec call of the MPI in use.

    hororun -np 4 python train.py
    hororun -np 8 -H node1:4,node2:4 python train.py
    hororun -np 8 --hostfile hosts python train.py       # lines "host slots=4" or "host:4"
    salloc -n 4 hororun python train.py                  # -np: the allocation's tasks
    hororun --slurm -np 4 python train.py                # the ranks as srun's tasks
    hororun --as-horovod -np 2 python horovod_script.py  # 'import horovod' is hororing
    hororun python train.py        # in a PBS or LSF job, or an MPI Operator's launcher pod
    hororun --check-build

The mpiexec is the one next to this Python (the ``mpi`` extra's MPICH or Open MPI) or the
first on PATH; ``--mpiexec`` names another. MPICH's Hydra and Open MPI take different flags
for hosts; Open MPI also needs ``--allow-run-as-root`` as root and ``--oversubscribe`` for
more ranks than cores, which hororun adds. ``--verbose`` prints the command it runs.

This module is the command line; what it stands on lives in ``runner/``: host lists
(``hosts.py``), the schedulers' allocations (``allocations.py``), the mpiexec of each MPI
(``mpiexec.py``), the elastic driver and its host discovery, ``--check-build``.
"""

import argparse
import os
import shlex
import shutil
import sys
import tempfile

from .config import variable_of
from .environment import launch_environment
from .runner import allocations, leftovers
from .runner.build_info import check_build
from .runner.hosts import hostfile_or_hosts, parse_hosts, read_hostfile
from .runner.mpiexec import (MPICH, OPEN_MPI, SRUN_PLUGINS, find_mpiexec, mpi_flavor,
                             mpiexec_command, quote, run_and_explain, ulfm_support)

__all__ = ["MPICH", "OPEN_MPI", "build_command", "check_build", "find_mpiexec", "main",
           "mpi_flavor", "parse_hosts", "read_hostfile"]


def main(argv=None):
    """Run the command line; return the job's exit status (2: refused, with the reason on
    stderr)."""
    args = _parser().parse_args(argv)
    mpiexec = args.mpiexec or find_mpiexec()
    if args.check_build:
        print(check_build(mpiexec))
        return 0
    if not args.command:
        _parser().error("give the command to run, e.g. hororun -np 2 python train.py")
    elastic = bool(args.discovery_script or args.min_np is not None)
    try:
        within = _size_from_allocation(args, elastic)
        if mpiexec is None and not args.slurm:
            raise ValueError("no mpiexec found next to this Python or on PATH; install "
                             "'hororing[mpi]' (MPICH from PyPI) or load your cluster's MPI")
        if elastic:
            driver = _elastic_driver(args, mpiexec, within)
        elif args.slurm:
            return _run_with_srun(args, mpiexec)
        else:
            with tempfile.TemporaryDirectory(prefix="hororun-") as scratch:
                command, env = build_command(args, mpiexec, mpi_flavor(mpiexec), scratch, within)
                if args.verbose:
                    print("hororun: " + " ".join(quote(part) for part in command), flush=True)
                with leftovers.removed_after("hororun"):  # killed ranks' shared memory
                    return run_and_explain(command, env)
    except ValueError as error:
        sys.stderr.write(f"hororun: {error}\n")
        return 2
    return driver.run()


def _size_from_allocation(args, elastic):
    """The allocation hororun runs in (None where hosts or a discovery script were given, or
    outside one); sets ``args.np`` to its size where none was asked, and checks -np/--min-np.

    Raises:
        ValueError: the allocation cannot be read, or -np asks for more than it has.
    """
    within = None
    if not (args.hosts or args.hostfile or args.discovery_script):
        within = allocations.find()
    if within is not None and args.np is None and (not elastic or args.min_np is None):
        args.np = within.tasks  # salloc -n 4, a PBS/LSF job, the MPIJob's workers
    if elastic:
        min_np = args.min_np if args.min_np is not None else args.np
        if min_np is None or min_np < 1:
            _parser().error("elastic mode needs -np or --min-np >= 1")
        if args.max_np is not None and args.max_np < min_np:
            _parser().error(f"--max-np {args.max_np} is below the minimum {min_np}")
        return within
    if args.np is None:
        _parser().error("-np is required: the number of processes to start")
    if args.np < 1:
        _parser().error(f"-np must be >= 1, got {args.np}")
    if within is not None and within.refusal(args.np):
        raise ValueError(within.refusal(args.np))
    return within


def _elastic_driver(args, mpiexec, within):
    """The elastic driver of ``args`` (``--min-np`` or a discovery script), ready to run."""
    from .runner import discovery
    from .runner.elastic import ElasticDriver

    min_np = args.min_np if args.min_np is not None else args.np
    hosts = None if args.discovery_script else hosts_of(args)
    discover = discovery.choose(args.discovery_script, args.slots, hosts, args.np, min_np,
                                args.max_np, allocation=within)
    flavor = mpi_flavor(mpiexec)
    in_process = _in_process_recovery(args.fault_recovery, mpiexec, flavor)
    ulfm = ["--with-ft", "ulfm"] if in_process else []

    def command_for(size, hosts, scratch, env):
        return mpiexec_command(mpiexec, flavor, size, hosts, scratch, env=env) + ulfm + \
            shlex.split(args.mpi_args)

    return ElasticDriver(command_for, args.command, discover, min_np, args.max_np,
                         args.elastic_timeout, args.reset_limit, args.elastic_dir,
                         job_environment(args), args.discovery_interval, args.verbose,
                         in_process=in_process, cooldown=args.blacklist_cooldown_range,
                         warm=_warm_modules(args.warm_start, args.command),
                         handover=args.handover == "auto" and
                         not (within is not None and within.managed),
                         handover_timeout=args.handover_timeout)


def _warm_modules(choice, command):
    """The modules a warm process imports ahead for relaunched ranks (``--warm-start``);
    empty: no warm starts (off, or a command that is not ``PYTHON script|-m module``)."""
    from .runner import warm

    if choice == "off" or not warm.is_python(command):
        return []
    if choice == "auto":
        return warm.auto_modules(command)
    return [name.strip() for name in choice.split(",") if name.strip()]


def _in_process_recovery(choice, mpiexec, flavor):
    """Whether the survivors of a dead rank go on in process (``--fault-recovery``)."""
    if choice == "relaunch":
        return False
    able = flavor == OPEN_MPI and ulfm_support(mpiexec)
    if choice == "in-process" and not able:
        raise ValueError(
            f"--fault-recovery in-process needs Open MPI built with ULFM (its ompi_info says "
            f"'FT MPI support: yes'); {mpiexec} is "
            + ("Open MPI without it" if flavor == OPEN_MPI else flavor)
            + ". Use --fault-recovery relaunch (or auto) with this MPI.")
    return able


def build_command(args, mpiexec, flavor, scratch, within=None):
    """The mpiexec command line and environment for ``args``.

    ``within``: the allocation hororun runs in (no hosts given). Slurm's (``managed``): MPI's
    own Slurm support places the ranks on its nodes (Hydra and Open MPI start their daemons
    with srun), and Slurm's limits stand: no ``--oversubscribe``. Any other: its hosts.

    Raises:
        ValueError: a malformed host list or host file, or more ranks than its slots.
    """
    hosts = hosts_of(args)
    if hosts is not None and args.np > sum(slots for _, slots in hosts):
        # as horovodrun refuses: MPICH would wrap the extra ranks onto the hosts silently,
        # two ranks then sharing a GPU or a core on a real host
        listed = ", ".join(f"{host}:{slots}" for host, slots in hosts)
        raise ValueError(f"-np {args.np} asks for more processes than the hosts' "
                         f"{sum(slots for _, slots in hosts)} slots ({listed}); lower -np, or "
                         f"give the hosts more slots (host:N in -H, 'host slots=N' in a host "
                         f"file)")
    if hosts is None and within is not None and not within.managed:
        hosts = within.hosts
    env = job_environment(args)
    return mpiexec_command(mpiexec, flavor, args.np, hosts, scratch,
                           in_allocation=within is not None and within.managed, env=env) + \
        shlex.split(args.mpi_args) + list(args.command), env


def _run_with_srun(args, mpiexec):
    """hororun --slurm: start the ranks as srun's tasks, with the PMI plugin of the MPI in use."""
    srun = shutil.which("srun")
    if srun is None:
        raise ValueError("--slurm needs srun on PATH (Slurm's client)")
    flavor = mpi_flavor(mpiexec) if mpiexec else MPICH
    command = [srun, f"--mpi={SRUN_PLUGINS[flavor]}", "-n", str(args.np)]
    hosts = hosts_of(args)
    if hosts:
        command += ["--nodelist", ",".join(host for host, _ in hosts)]
    command += shlex.split(args.mpi_args) + list(args.command)
    if args.verbose:
        print("hororun: " + " ".join(quote(part) for part in command), flush=True)
    with leftovers.removed_after("hororun"):  # this node's tasks' shared memory
        return run_and_explain(command, job_environment(args))


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
    parser.add_argument("--as-horovod", action="store_true",
                        help="the ranks import hororing as 'horovod' (HORORING_AS_HOROVOD=1): "
                             "scripts written for Horovod run unchanged")
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
    elastic.add_argument("--fault-recovery", choices=["auto", "in-process", "relaunch"],
                         default="auto",
                         help="when a rank dies: the survivors go on in process (Open MPI "
                              "with ULFM, started --with-ft ulfm), or the job is relaunched "
                              "from its newest commit; auto: in process where the MPI can")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2,
                         metavar=("MIN", "MAX"),
                         help="seconds (drawn between MIN and MAX) for which a rank's slot is "
                              "not used again after the rank died and the survivors went on "
                              "in process (default: not for the rest of the job, unless "
                              "--min-np needs it)")
    elastic.add_argument("--warm-start", default="auto", metavar="auto|off|MODULES",
                         help="relaunched ranks on this host are forked from a process that "
                              "has imported MODULES (comma-separated) already, instead of "
                              "each importing them again; auto: the heavy ones (torch, numpy, "
                              "hororing) the script imports; off: none")
    elastic.add_argument("--handover", choices=["auto", "off"], default="auto",
                         help="when the hosts offer more slots, the bigger launch starts "
                              "beside the running job (its ranks import and build their model "
                              "meanwhile, on the same hosts, GPUs included) and takes over at "
                              "the job's next commit; off: the job stops first, then the "
                              "bigger launch starts; auto: ahead, except inside a Slurm "
                              "allocation (a job step waits for the running step's resources)")
    elastic.add_argument("--handover-timeout", type=float, default=120.0, metavar="SECONDS",
                         help="seconds the launch started ahead has to start every rank and "
                              "reach hvd.elastic.run; past them it is ended and the job grows "
                              "by stopping first, then launching (default: 120)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return parser


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
    if getattr(args, "as_horovod", False):
        env["HORORING_AS_HOROVOD"] = "1"
        if not alias_installed():
            sys.stderr.write(
                "hororun: --as-horovod: this Python has no hororing-horovod-alias.pth in its "
                "site-packages (an editable install does not put it there), so 'import "
                "horovod' in the ranks will fail; install hororing from its wheel, or copy "
                "hororing/horovod-alias.pth into site-packages as "
                "hororing-horovod-alias.pth\n")
    return env


def alias_installed():
    """Whether this Python's site-packages has the file that starts the ``horovod`` alias."""
    import site
    import sysconfig

    folders = [sysconfig.get_paths()["purelib"], site.getusersitepackages(),
               *site.getsitepackages()]
    return any(os.path.exists(os.path.join(folder, "hororing-horovod-alias.pth"))
               for folder in folders)


def hosts_of(args):
    """The (host, slots) pairs of ``-H`` or ``--hostfile``, or None for this machine."""
    return hostfile_or_hosts(args.hostfile, args.hosts)


if __name__ == "__main__":
    sys.exit(main())
