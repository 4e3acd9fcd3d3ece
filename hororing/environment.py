"""The environment beyond the settings: what the launcher told this process (``Launch``)
and the process-wide switches hororing sets for the frameworks before they start (TensorFlow's
thread pools, torch's huge pages). With config.py (the settings), the one place that reads
environment variables; the parsing rules are config.py's.
"""

import dataclasses
import os

from .config import _flag, _lookup, _parse, as_horovod

# TensorFlow's inter-op threads, raised by ``import hororing.tensorflow`` before any session
# exists: a blocking collective in a TF1 graph holds one while it waits for its peers
# (tensorflow/graph.py), and TensorFlow's default, the number of cores, lets a session.run
# with more independent collectives than cores hang. 64: above the most independent
# collectives one session.run of Horovod's TensorFlow suite holds (docs/tensorflow.md).
TF_INTER_OP_THREADS = 64


def reserve_tf_inter_op_threads(environ=None):
    """Set TF_NUM_INTEROP_THREADS to HORORING_TF_INTER_OP_THREADS (default 64) unless the
    user set it; return the number in effect.

    Raises:
        ValueError: HORORING_TF_INTER_OP_THREADS is not a positive integer.
    """
    env = os.environ if environ is None else environ
    if "TF_NUM_INTEROP_THREADS" in env:
        return int(env["TF_NUM_INTEROP_THREADS"])
    raw = env.get("HORORING_TF_INTER_OP_THREADS", str(TF_INTER_OP_THREADS))
    threads = _parse("tf_inter_op_threads", ("HORORING_TF_INTER_OP_THREADS",), raw, int)
    if threads <= 0:
        raise ValueError(f"HORORING_TF_INTER_OP_THREADS must be > 0, got {threads}")
    env["TF_NUM_INTEROP_THREADS"] = str(threads)
    return threads


def checkpoint_writer(environ=None):
    """How ``hvd.checkpoint`` writes each rank's file: HORORING_CHECKPOINT_WRITER, ``direct``
    (the default: around the page cache, torch/checkpoint/direct.py) or ``filesystem`` (DCP's
    own FileSystemWriter).

    Raises:
        ValueError: any other value.
    """
    env = os.environ if environ is None else environ
    chosen = env.get("HORORING_CHECKPOINT_WRITER", "").strip() or "direct"
    if chosen not in ("direct", "filesystem"):
        raise ValueError(f"HORORING_CHECKPOINT_WRITER={chosen!r}: use 'direct' (the default) "
                         f"or 'filesystem' (DCP's FileSystemWriter)")
    return chosen


def torch_huge_pages(environ=None):
    """Set THP_MEM_ALLOC_ENABLE=1 (torch's CPU allocator then asks the kernel for transparent
    huge pages for allocations of 2 MiB and more) unless the user set it or
    HORORING_TORCH_HUGE_PAGES=0; return whether torch's large tensors get huge pages.

    torch reads the variable once, at its first large allocation, so ``import hororing.torch``
    calls this before any model is built. Reductions over large tensors are memory-bound, and
    without huge pages they pay for TLB misses (measured: a blocking 64 MiB allreduce of a
    ``torch.zeros`` tensor at 2 ranks, 12.5-13.2 ms without huge pages, 8.6-9.5 ms with them,
    the numpy verb's 8.4-9.0 in the same runs; docs/benchmarks.md).

    Raises:
        ValueError: HORORING_TORCH_HUGE_PAGES is not a flag.
    """
    env = os.environ if environ is None else environ
    if "THP_MEM_ALLOC_ENABLE" in env:
        return env["THP_MEM_ALLOC_ENABLE"].strip() not in ("", "0")
    wanted = _parse("torch_huge_pages", ("HORORING_TORCH_HUGE_PAGES",),
                    env.get("HORORING_TORCH_HUGE_PAGES", "1"), _flag)
    if wanted:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    return wanted


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the launcher told this process (hororing/slurm.py reads it).

    MPI's launchers: Hydra (MPICH) sets PMI_SIZE and MPI_LOCALNRANKS, Open MPI
    OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_LOCAL_SIZE; srun with a PMI plugin sets PMI_SIZE
    too. Slurm: a task of a job step (srun) has SLURM_STEP_NUM_TASKS, SLURM_NODEID and the
    step's tasks per node; an allocation (salloc, sbatch) has SLURM_JOB_ID, SLURM_NTASKS, its
    node list and tasks per node. PBS and LSF jobs, and the launcher of Kubeflow's MPI Operator,
    name their hosts in files and variables of their own.
    """

    launcher_size: object = None        # int: the job size an MPI launcher or PMI announced
    launcher_local_size: object = None  # int: ranks on this node, from MPI's launcher
    # what each launcher says of the job's size (world.py compares it with MPI's world)
    pmi_size: object = None             # int: PMI_SIZE (MPICH's Hydra, srun's PMI plugins)
    ompi_world_size: object = None      # int: OMPI_COMM_WORLD_SIZE (Open MPI's mpirun)
    pmix_rank: object = None            # int: PMIX_RANK (Open MPI 5's prterun, srun --mpi=pmix)
    mvapich_size: object = None         # int: MV2_COMM_WORLD_SIZE (MVAPICH2's launchers)
    torch_world_size: object = None     # int: WORLD_SIZE with RANK and MASTER_ADDR (torchrun...)
    torchelastic: bool = False          # TORCHELASTIC_RUN_ID: torchrun itself
    slurm_step_tasks: object = None     # int: tasks of the srun step this process belongs to
    slurm_node_id: object = None        # int: this node's index in the step
    slurm_step_tasks_per_node: str = ""  # e.g. "2(x2),1"
    slurm_job_id: str = ""
    slurm_tasks: object = None          # int: the allocation's tasks (SLURM_NTASKS)
    slurm_nodelist: str = ""            # the allocation's nodes, e.g. "n[1-2]"
    slurm_tasks_per_node: str = ""      # the allocation's tasks per node, e.g. "2(x2)"
    # other schedulers' allocations, for hororun with no hosts given (runner/allocations.py)
    pbs_job_id: str = ""                # PBS_JOBID
    pbs_nodefile: str = ""              # PBS_NODEFILE: one line per slot
    lsf_job_id: str = ""                # LSB_JOBID
    lsf_hosts: str = ""                 # LSB_MCPU_HOSTS: "host1 4 host2 4"
    lsf_hostfile: str = ""              # LSB_DJOB_HOSTFILE: one line per slot
    # Kubeflow's MPI Operator: the launcher's host file, in the variable of each MPI
    mpi_job_role: str = ""              # K_MPI_JOB_ROLE: "launcher" or "worker"
    ompi_hostfile: str = ""             # OMPI_MCA_orte_default_hostfile (Open MPI)
    hydra_hostfile: str = ""            # HYDRA_HOST_FILE (MPICH)
    intel_hostfile: str = ""            # I_MPI_HYDRA_HOST_FILE (Intel MPI)
    user_threads: bool = False          # OMP_NUM_THREADS is set: leave thread counts alone
    tf_intra_op_threads_set: bool = False
    allow_singletons: bool = False      # HORORING_ALLOW_SINGLETONS=1
    as_horovod: bool = False            # HORORING_AS_HOROVOD=1: 'import horovod' is hororing
    legacy_keras: bool = False          # TF_USE_LEGACY_KERAS=1: tf.keras is tf-keras
    # set by hororun's elastic mode for its ranks (elastic/job.py)
    elastic_dir: str = ""               # HORORING_ELASTIC_DIR: where commits are kept
    elastic_launch: int = 0             # HORORING_ELASTIC_LAUNCH: 0, then one per relaunch
    elastic_min_np: int = 0             # HORORING_ELASTIC_MIN_NP: the fewest ranks to go on with
    elastic_handover: bool = False      # HORORING_ELASTIC_HANDOVER=1: wait to take over
    elastic_timeout_s: float = 600.0    # HOROVOD_ELASTIC_TIMEOUT: hororun's default

    @property
    def in_slurm_step(self):
        return self.slurm_step_tasks is not None


def failures_tolerated(environ=None):
    """Whether mpiexec started this rank tolerating a peer's death (Open MPI's ULFM,
    ``mpiexec --with-ft ulfm``, which sets OMPI_MCA_mpi_ft_enable in every rank): then
    hororing, not mpi4py, finalizes MPI at exit (``_mpi.py``)."""
    env = os.environ if environ is None else environ
    try:
        return _flag(env.get("OMPI_MCA_mpi_ft_enable", ""))
    except ValueError:  # not a value Open MPI sets: not ours to refuse
        return False


def launch_environment(environ=None):
    """The launcher's facts about this process, from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ

    def number(*names):
        raw = _lookup(env, names)
        try:
            return int(raw) if raw not in (None, "") else None
        except ValueError:
            return None

    allow = env.get("HORORING_ALLOW_SINGLETONS", "")
    legacy = env.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes")
    return Launch(
        launcher_size=number("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"),
        launcher_local_size=number("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        pmi_size=number("PMI_SIZE"),
        ompi_world_size=number("OMPI_COMM_WORLD_SIZE"),
        pmix_rank=number("PMIX_RANK"),
        mvapich_size=number("MV2_COMM_WORLD_SIZE"),
        torch_world_size=(number("WORLD_SIZE") if "RANK" in env and "MASTER_ADDR" in env
                          else None),
        torchelastic="TORCHELASTIC_RUN_ID" in env,
        slurm_step_tasks=number("SLURM_STEP_NUM_TASKS"),
        slurm_node_id=number("SLURM_NODEID"),
        slurm_step_tasks_per_node=env.get("SLURM_STEP_TASKS_PER_NODE", ""),
        slurm_job_id=env.get("SLURM_JOB_ID", ""),
        slurm_tasks=number("SLURM_NTASKS", "SLURM_NPROCS"),
        slurm_nodelist=env.get("SLURM_JOB_NODELIST", "") or env.get("SLURM_NODELIST", ""),
        slurm_tasks_per_node=env.get("SLURM_TASKS_PER_NODE", ""),
        pbs_job_id=env.get("PBS_JOBID", ""),
        pbs_nodefile=env.get("PBS_NODEFILE", ""),
        lsf_job_id=env.get("LSB_JOBID", ""),
        lsf_hosts=env.get("LSB_MCPU_HOSTS", ""),
        lsf_hostfile=env.get("LSB_DJOB_HOSTFILE", ""),
        mpi_job_role=env.get("K_MPI_JOB_ROLE", ""),
        ompi_hostfile=env.get("OMPI_MCA_orte_default_hostfile", ""),
        hydra_hostfile=env.get("HYDRA_HOST_FILE", ""),
        intel_hostfile=env.get("I_MPI_HYDRA_HOST_FILE", ""),
        user_threads=bool(env.get("OMP_NUM_THREADS")),
        tf_intra_op_threads_set="TF_NUM_INTRAOP_THREADS" in env,
        allow_singletons=_parse("allow_singletons", ("HORORING_ALLOW_SINGLETONS",), allow,
                                _flag),
        as_horovod=as_horovod(env),
        legacy_keras=legacy,
        elastic_dir=env.get("HORORING_ELASTIC_DIR", ""),
        elastic_launch=number("HORORING_ELASTIC_LAUNCH") or 0,
        elastic_min_np=number("HORORING_ELASTIC_MIN_NP") or 0,
        elastic_handover=env.get("HORORING_ELASTIC_HANDOVER", "") == "1",
        elastic_timeout_s=_parse("elastic_timeout", ("HOROVOD_ELASTIC_TIMEOUT",),
                                 env.get("HOROVOD_ELASTIC_TIMEOUT", "600"), float),
    )


def torch_rendezvous(environ=None):
    """What torch.distributed's env:// rendezvous would read here: (whether RANK is set,
    MASTER_ADDR, MASTER_PORT); the last two "" where unset."""
    env = os.environ if environ is None else environ
    return "RANK" in env, env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")


def reserve_tf_intra_op_threads(threads, environ=None):
    """Set TF_NUM_INTRAOP_THREADS to ``threads`` (read by TensorFlow when its runtime starts)."""
    env = os.environ if environ is None else environ
    env["TF_NUM_INTRAOP_THREADS"] = str(threads)
