"""What every benchmark prints about the machine it ran on, and the compiled steps loaded at
the first ring (imported by the bench scripts)."""

import json
import os
import platform
import socket
import subprocess
import sys

import numpy as np

# Benchmarks time the steady state, where a long job's rings run their compiled steps: these
# load at the first ring (HORORING_COMPILED_STEPS=wait), not after the calls a short job never
# reaches (Config.compiled_steps_after). Set HORORING_COMPILED_STEPS to time another mode.
os.environ.setdefault("HORORING_COMPILED_STEPS", "wait")

def machine_info():
    """Return the CPU, core count, MPI library and package versions of this host."""
    from mpi4py import MPI
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
            "mpi": MPI.Get_library_version().splitlines()[0],
            "mpi4py": __import__("mpi4py").__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def json_rows_of(command, timeout, what, env=None):
    """Run a benchmark's MPI job and return the JSON objects it printed one per line.

    ``env``: variables set for the job on top of this process's environment. Exits the
    driver with the job's stderr tail if the job fails.
    """
    job = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                         env=None if env is None else {**os.environ, **env})
    if job.returncode != 0:
        sys.exit(f"{what} failed:\n{job.stderr[-3000:]}")
    return [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]


def setup_torch_distributed(comm, backend="gloo"):
    """Start a torch.distributed group (``backend``: gloo or nccl) over ``comm``'s ranks on loopback.

    Returns False when torch is not installed. Rank 0 picks a free port and broadcasts it.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group(backend, rank=comm.Get_rank(), world_size=comm.Get_size())
    return True


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def machine_line(info):
    """One header line naming the CPU, cores, MPI and versions."""
    return (f"# CPU {info['cpu']}, {info['cores']} cores; {info['mpi']}; mpi4py "
            f"{info['mpi4py']}, numpy {info['numpy']}, Python {info['python']}")


def parse_size(text):
    """A size as the scripts' --sizes take it: bytes, or with KiB, MiB or B after it."""
    text = text.strip()
    for suffix, factor in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * factor)
    return int(text)
