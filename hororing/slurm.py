"""Running under Slurm: what srun and an allocation say, where MPI's launcher says nothing.

Two things a job started by ``srun`` (rather than mpiexec) needs from hororing (the refusal
of srun's separate singletons, ``--mpi=none``, is world.py's, with every other launcher's):

- a share of the node's cores per rank: torch divides its threads by the ranks on a node
  when mpiexec says how many (MPI_LOCALNRANKS, OMPI_COMM_WORLD_LOCAL_SIZE); srun says it in
  its own words, so every rank would use every core (TensorFlow divides under neither, so
  ``import hororing.tensorflow`` gives it the same share under both);
- for ``hororun`` inside ``salloc``/``sbatch``: the allocation's tasks, nodes and slots.

The environment is read by environment.py (``Launch``); this module decides.
"""

import os
import re
import sys

from . import cores
from .environment import launch_environment

__all__ = ["Allocation", "allocation", "expand_nodelist",
           "local_tasks", "per_rank_threads", "set_blas_threads", "set_framework_threads",
           "tasks_per_node",
           "tensorflow_intra_op_threads"]


def tasks_per_node(text):
    """Slurm's compressed tasks-per-node list, expanded: ``"2(x3),1"`` -> [2, 2, 2, 1].

    Raises:
        ValueError: ``text`` is not in that form.
    """
    counts = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if match is None:
            raise ValueError(f"cannot read Slurm's tasks per node {text!r}: expected "
                             f"items like 2 or 2(x3), comma-separated")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def local_tasks(launch=None):
    """The ranks on this node as the launcher tells them, or None where it does not."""
    launch = launch or launch_environment()
    if launch.launcher_local_size:
        return launch.launcher_local_size
    if launch.in_slurm_step and launch.slurm_step_tasks_per_node:
        counts = tasks_per_node(launch.slurm_step_tasks_per_node)
        node = launch.slurm_node_id or 0
        if 0 <= node < len(counts):
            return counts[node]
    return None


def per_rank_threads(local_size, cpus=None):
    """Cores per rank when ``local_size`` ranks share this process's cores (at least 1): its
    affinity mask, at most its cgroup's CPU quota (``hororing.cores``), unless ``cpus`` says."""
    if cpus is None:
        cpus = cores.node_cores([cores.affinity()], [cores.quota()])
    return max(1, (cpus or 1) // max(1, local_size))


def set_framework_threads(local_size, launch=None):
    """Under srun, give torch (when imported) its share of the node's cores, as mpiexec's
    MPI_LOCALNRANKS makes torch do by itself; return the threads set, or None.

    Left alone: a launcher that said the local size itself, and OMP_NUM_THREADS set by the user.
    """
    launch = launch or launch_environment()
    if not launch.in_slurm_step or launch.launcher_local_size or launch.user_threads:
        return None
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    threads = per_rank_threads(local_size)
    torch.set_num_threads(threads)
    return threads


_BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def set_blas_threads(local_size, environ=None):
    """Give numpy's BLAS (OpenBLAS or MKL: the PowerSGD hook's matrix products, a numpy
    model's) this rank's share of the node's cores where several ranks share the node: each
    BLAS otherwise starts a thread per core in every rank, and ranks x cores threads spin
    against each other (PowerSGD rank 1, 4 ranks on 2 cores: 1144 ms a step, 649 ms with one
    thread each). Returns the threads set, or None: one rank on the node, the user set one
    of OMP/OPENBLAS/MKL_NUM_THREADS, or threadpoolctl is missing."""
    env = os.environ if environ is None else environ
    if local_size <= 1 or any(env.get(name) for name in _BLAS_THREAD_VARIABLES):
        return None
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    threads = per_rank_threads(local_size)
    threadpool_limits(limits=threads, user_api="blas")
    return threads


def tensorflow_intra_op_threads(launch=None):
    """TensorFlow's intra-op threads for this rank: its share of the node's cores where a
    launcher (mpiexec or srun) says how many ranks share the node; None to leave TensorFlow's
    default (the user set TF_NUM_INTRAOP_THREADS or OMP_NUM_THREADS, or no launcher said)."""
    launch = launch or launch_environment()
    if launch.tf_intra_op_threads_set or launch.user_threads:
        return None
    local = local_tasks(launch)
    return per_rank_threads(local) if local else None


class Allocation:
    """A Slurm allocation as ``hororun`` uses it: its tasks and (host, slots) pairs."""

    def __init__(self, job_id, tasks, hosts):
        self.job_id = job_id
        self.tasks = tasks
        self.hosts = hosts

    def __repr__(self):
        return f"Allocation(job {self.job_id}, {self.tasks} tasks on {self.hosts})"


def allocation(launch=None):
    """The allocation this process runs in (salloc, sbatch), or None outside one.

    Raises:
        ValueError: Slurm's node list or tasks per node cannot be read.
    """
    launch = launch or launch_environment()
    if not launch.slurm_job_id or not launch.slurm_nodelist:
        return None
    nodes = expand_nodelist(launch.slurm_nodelist)
    counts = tasks_per_node(launch.slurm_tasks_per_node) if launch.slurm_tasks_per_node else []
    if len(counts) != len(nodes):
        counts = [max(1, (launch.slurm_tasks or len(nodes)) // len(nodes))] * len(nodes)
    tasks = launch.slurm_tasks or sum(counts)
    return Allocation(launch.slurm_job_id, tasks, list(zip(nodes, counts)))


def expand_nodelist(text):
    """Slurm's host list, expanded: ``"n[1-3,7],gpu[01-02]"`` -> n1 n2 n3 n7 gpu01 gpu02.

    Raises:
        ValueError: a bracket that is not closed or a range that cannot be read.
    """
    hosts = []
    for item in _split_outside_brackets(text):
        match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
        if match is None:
            if "[" in item or "]" in item:
                raise ValueError(f"cannot read Slurm's node list {text!r} at {item!r}")
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"cannot read Slurm's node list {text!r} at {part!r}")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{width}d}{suffix}")
    return hosts


def _split_outside_brackets(text):
    items, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if current:
        items.append(current)
    return [item.strip() for item in items if item.strip()]
