"""The MPI that starts the ranks: which mpiexec, which MPI it is, the command line that starts
``np`` ranks on a host list in its own flags, and what its messages mean when a job fails."""

import os
import pathlib
import shutil
import subprocess
import sys

__all__ = ["MPICH", "OPEN_MPI", "SRUN_PLUGINS", "find_mpiexec", "mpi_flavor", "mpiexec_command",
           "quote", "run_and_explain", "ulfm_support"]

MPICH, OPEN_MPI = "MPICH", "Open MPI"
SRUN_PLUGINS = {MPICH: "pmi2", OPEN_MPI: "pmix"}  # what each PyPI MPI speaks under srun


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


def ulfm_support(mpiexec):
    """Whether the Open MPI of ``mpiexec`` was built with ULFM (its ``ompi_info`` says "FT MPI
    support: yes"): started with ``--with-ft ulfm``, its jobs outlive a dead rank."""
    beside = pathlib.Path(mpiexec).parent / "ompi_info"
    info = str(beside) if beside.exists() else shutil.which("ompi_info")
    if info is None:
        return False
    try:
        output = subprocess.run([info], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.split(":", 1)[0].strip() == "FT MPI support" and
               line.split(":", 1)[1].strip().startswith("yes")
               for line in output.splitlines() if ":" in line)


def mpiexec_command(mpiexec, flavor, np, hosts, scratch, in_allocation=False, env=None):
    """``mpiexec`` with the flags that start ``np`` ranks on ``hosts`` (None: this machine,
    or with ``in_allocation`` the Slurm allocation's nodes, which the MPI finds itself).

    ``env``: the job's environment. Hydra (MPICH) passes all of it to every host; Open MPI
    passes only its own variables to daemons it starts over ssh, so on other hosts each
    variable of ``env`` is named with ``-x`` (hororun's settings, the elastic directory,
    HOROVOD_*/HORORING_* tuning), as horovodrun does.
    """
    command = [mpiexec, "-n", str(np)]
    local = not hosts or all(host in ("localhost", "127.0.0.1") for host, _ in hosts)
    if flavor == OPEN_MPI:
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
        slots = sum(count for _, count in hosts) if hosts else os.cpu_count() or 1
        # more ranks than slots, or than this machine's cores when its hosts are this machine
        # (Open MPI binds each rank to a core and refuses to share one otherwise)
        if not in_allocation and (np > slots or (local and np > (os.cpu_count() or 1))):
            command.append("--oversubscribe")
        if hosts:
            command += ["-H", ",".join(f"{host}:{count}" for host, count in hosts)]
        if env is not None and not local and not in_allocation:
            for name in sorted(filter(_exported, env)):
                command += ["-x", name]
    elif hosts:
        hostfile = pathlib.Path(scratch) / "hosts"
        hostfile.write_text("".join(f"{host}:{count}\n" for host, count in hosts))
        command += ["-f", str(hostfile)]
    return command


# what a host's own shell sets, or Open MPI itself: never carried to other hosts
_LOCAL_VARIABLES = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "HOME", "USER", "LOGNAME",
                    "SHELL", "TERM", "DISPLAY", "MAIL", "TMPDIR"}
_LOCAL_PREFIXES = ("OMPI_", "PRTE_", "PMIX_", "OPAL_", "SSH_", "BASH_FUNC", "XDG_")


def _exported(name):
    return (name.isidentifier() and name.isascii() and name not in _LOCAL_VARIABLES
            and not name.startswith(_LOCAL_PREFIXES))


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
    from .output import copy_lines

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


def quote(part):
    """``part`` as it may be pasted into a shell (for --verbose)."""
    return part if part and all(c.isalnum() or c in "-_./:=," for c in part) else repr(part)
