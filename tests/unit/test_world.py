"""The launchers whose processes MPI would leave as separate jobs of size 1 (world.py)."""

import pytest

from hororing.environment import launch_environment
from hororing.world import check_world

TORCH = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("environ,launcher,claimed,fix", [
    (dict(TORCH, TORCHELASTIC_RUN_ID="none"), "torchrun", 4, r"hororun -np 4 python SCRIPT"),
    (TORCH, r"a torch.distributed launcher \(RANK, WORLD_SIZE, MASTER_ADDR are set: Spark's "
            r"TorchDistributor", 4, r"Kubeflow's MPIJob.*init_process_group\(\"hororing\"\)"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
     r"Open MPI's mpirun \(OMPI_COMM_WORLD_SIZE\)", 2, r"another MPI library than the one "
                                                      r"mpi4py loaded"),
    ({"PMIX_RANK": "2"}, r"a PMIx launcher", 3, "use that library's mpirun, or hororun"),
    ({"PMI_SIZE": "3", "PMI_RANK": "0"}, r"a PMI launcher \(MPICH's mpiexec", 3, "hororun"),
    ({"MV2_COMM_WORLD_SIZE": "8"}, r"MVAPICH2's launcher", 8, "hororun"),
])
def test_a_launcher_claiming_more_processes_than_mpi_has_is_refused(environ, launcher,
                                                                     claimed, fix):
    with pytest.raises(RuntimeError, match=rf"^{launcher}.* started {claimed} processes, but MPI "
                                           rf"made this one a job of size 1: every process "
                                           rf"would train alone\..*{fix}.*"
                                           rf"HORORING_ALLOW_SINGLETONS=1"):
        check_world(1, launch_environment(environ))


@pytest.mark.parametrize("environ,world_size", [
    (dict(TORCH, TORCHELASTIC_RUN_ID="none"), 4),         # mpirun inside torchrun's env: 4 of 4
    ({"OMPI_COMM_WORLD_SIZE": "2"}, 2),                   # Open MPI's own job
    ({"PMI_SIZE": "3"}, 3),                               # Hydra's own job
    ({"PMIX_RANK": "0"}, 1),                              # a PMIx job of one
    ({"WORLD_SIZE": "4"}, 1),                             # WORLD_SIZE alone: not torch's family
    ({"WORLD_SIZE": "4", "RANK": "0"}, 1),                # no MASTER_ADDR either
    (dict(TORCH, HORORING_ALLOW_SINGLETONS="1"), 1),      # intended
    ({}, 1),                                              # a plain singleton
])
def test_a_world_that_matches_its_launcher_or_none_is_accepted(environ, world_size):
    check_world(world_size, launch_environment(environ))
