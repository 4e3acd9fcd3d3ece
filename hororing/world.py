"""Refusing a job MPI does not have: processes started together that MPI made jobs of one.

A launcher that does not start processes the way the loaded MPI library expects (torchrun,
Spark's TorchDistributor, Kubeflow's PyTorchJob, Ray's TorchTrainer; another MPI's mpirun;
``srun --mpi=none``) leaves every process an MPI singleton: each initializes a world of size 1
and would train alone, silently. MPI cannot join such processes afterwards. So ``init()``
compares what the launcher's variables claim (``environment.Launch``) with MPI's world, and every
process raises before any collective, naming the launcher and the command to use.
``HORORING_ALLOW_SINGLETONS=1`` says separate size-1 jobs are intended.
"""

__all__ = ["check_world"]

_ALLOW = "Set HORORING_ALLOW_SINGLETONS=1 if separate size-1 jobs are what you want."
_MPI_LAUNCH = ("launch the script with `hororun -np {n} python SCRIPT` or "
               "`mpirun -np {n} python SCRIPT`")


def check_world(world_size, launch):
    """Raise when a launcher claims a job larger than MPI's world.

    Args:
        world_size: MPI.COMM_WORLD's size.
        launch: ``environment.Launch``, what the launcher's variables say.

    Raises:
        RuntimeError: naming the launcher, the sizes, and the command to use.
    """
    if launch.allow_singletons:
        return
    claim = _largest_claim(launch)
    if claim is None:
        return
    launcher, claimed, fix = claim
    if claimed <= world_size:
        return
    raise RuntimeError(
        f"{launcher} started {claimed} processes, but MPI made this one a job of size "
        f"{world_size}: every process would train alone. {fix} {_ALLOW}")


def _largest_claim(launch):
    """(launcher, processes it claims, the fix) for the launcher that claims most, or None."""
    claims = []
    tasks = launch.slurm_step_tasks
    if tasks is not None and tasks > 1 and launch.launcher_size != 1:
        # (mpiexec -n 1 inside a step announces 1 itself: then the step's count is not ours)
        claims.append((
            "srun", tasks,
            "srun's PMI plugin is not one this MPI understands (--mpi=none, or the cluster's "
            "default). Launch with `srun --mpi=pmi2` for MPICH (the PyPI 'mpich' package) or "
            "`srun --mpi=pmix` for Open MPI (`srun --mpi=list` shows what the cluster has), or "
            "with mpiexec/hororun inside the allocation."))
    if launch.torch_world_size is not None:
        launcher = ("torchrun" if launch.torchelastic else
                    "a torch.distributed launcher (RANK, WORLD_SIZE, MASTER_ADDR are set: Spark's "
                    "TorchDistributor, Kubeflow's PyTorchJob, Ray's TorchTrainer or the like)")
        claims.append((launcher, launch.torch_world_size,
                       "hororing is an MPI library, and processes started by torch.distributed's "
                       "launchers cannot join one MPI job: " + _MPI_LAUNCH.format(
                           n=launch.torch_world_size) + " (on Kubernetes, Kubeflow's MPIJob; "
                       "docs/clusters.md). A torch.distributed script runs there as it is, "
                       "with init_process_group(\"hororing\") (docs/torch_distributed.md)."))
    other_mpi = ("the mpirun that started it belongs to another MPI library than the one "
                 "mpi4py loaded here (`python -c \"from mpi4py import MPI; "
                 "print(MPI.Get_library_version())\"` names it): use that library's mpirun, "
                 "or hororun.")
    if launch.ompi_world_size is not None:
        claims.append(("Open MPI's mpirun (OMPI_COMM_WORLD_SIZE)", launch.ompi_world_size,
                       other_mpi))
    if launch.pmix_rank is not None:  # PMIx gives no size in the environment: a rank says enough
        claims.append(("a PMIx launcher (Open MPI 5's mpirun, srun --mpi=pmix; PMIX_RANK)",
                       launch.pmix_rank + 1, other_mpi))
    if launch.pmi_size is not None:
        claims.append(("a PMI launcher (MPICH's mpiexec, Intel MPI, srun's PMI; PMI_SIZE)",
                       launch.pmi_size, other_mpi))
    if launch.mvapich_size is not None:
        claims.append(("MVAPICH2's launcher (MV2_COMM_WORLD_SIZE)", launch.mvapich_size,
                       other_mpi))
    if not claims:
        return None
    return max(claims, key=lambda claim: claim[1])
