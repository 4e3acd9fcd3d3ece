"""Where the hosts of a job come from when ``hororun`` is given none: the allocation of the
scheduler or operator it runs under.

- Slurm (``salloc``/``sbatch``): the node list and tasks per node (``slurm.py``); MPI's own
  Slurm support then places the ranks, so hororun passes no hosts (``managed``).
- PBS: ``$PBS_NODEFILE``, one line per slot.
- LSF: ``LSB_MCPU_HOSTS`` (``"host1 4 host2 4"``), else ``LSB_DJOB_HOSTFILE``.
- Kubeflow's MPI Operator (v2beta1) and Trainer's MPI runtime: the launcher pod, not itself a
  worker, has the workers in /etc/mpi/hostfile, named by the variable of the MPI in the image:
  ``OMPI_MCA_orte_default_hostfile`` (Open MPI, ``name slots=N`` lines), ``HYDRA_HOST_FILE``
  (MPICH) or ``I_MPI_HYDRA_HOST_FILE`` (Intel MPI, both ``name:N``); the ranks start over ssh.

hororun passes the hosts of the last three to mpiexec itself, so that either MPI's mpiexec
starts the ranks there, whichever variable was set. The environment is read by environment.py.
"""

import dataclasses

from .. import slurm
from ..environment import launch_environment
from .hosts import parse_lsf_hosts, read_hostfile

__all__ = ["Allocation", "find"]


@dataclasses.dataclass
class Allocation:
    """The hosts a scheduler gave the job.

    Attributes:
        name: what to call it in a message ("Slurm job 42", "PBS job 7.server").
        job_id: the scheduler's id of the job ("" where there is none).
        tasks: the ranks it has room for (-np's default and bound).
        hosts: [(host, slots)].
        unit: what one of ``tasks`` is called by the scheduler ("tasks", "slots").
        more: how a user asks for more, for the refusal of -np beyond ``tasks``.
        managed: MPI finds the hosts itself (Slurm): hororun passes none, and no
            --oversubscribe.
    """

    name: str
    job_id: str
    tasks: int
    hosts: list
    unit: str
    more: str
    managed: bool = False

    def refusal(self, np):
        """The message for ``-np np`` beyond the allocation, or None where it fits."""
        if np <= self.tasks:
            return None
        return (f"-np {np} asks for more ranks than {self.name} was allocated ({self.tasks} "
                f"{self.unit} on {', '.join(host for host, _ in self.hosts)}); ask for at most "
                f"{self.tasks}, or {self.more}")


def find(launch=None):
    """The allocation this process runs in, or None outside any.

    Raises:
        ValueError: the scheduler's host list or file cannot be read, naming the variable.
    """
    launch = launch or launch_environment()
    for reader in (_slurm, _pbs, _lsf, _mpi_operator):
        found = reader(launch)
        if found is not None:
            return found
    return None


def _slurm(launch):
    within = slurm.allocation(launch)
    if within is None:
        return None
    return Allocation(f"Slurm job {within.job_id}", within.job_id, within.tasks, within.hosts,
                      "tasks", "allocate more (salloc/sbatch -n N)", managed=True)


def _pbs(launch):
    if not launch.pbs_nodefile:
        return None
    hosts = _read(launch.pbs_nodefile, "PBS_NODEFILE")
    return Allocation(f"PBS job {launch.pbs_job_id or '(no PBS_JOBID)'}", launch.pbs_job_id,
                      _total(hosts), hosts, "slots",
                      "ask PBS for more (qsub -l select=N:ncpus=C:mpiprocs=C)")


def _lsf(launch):
    if launch.lsf_hosts:
        try:
            hosts = parse_lsf_hosts(launch.lsf_hosts)
        except ValueError as error:
            raise ValueError(f"{error} (set by LSF for job {launch.lsf_job_id or '?'})") from None
    elif launch.lsf_hostfile:
        hosts = _read(launch.lsf_hostfile, "LSB_DJOB_HOSTFILE")
    else:
        return None
    return Allocation(f"LSF job {launch.lsf_job_id or '(no LSB_JOBID)'}", launch.lsf_job_id,
                      _total(hosts), hosts, "slots", "ask LSF for more (bsub -n N)")


# the MPI Operator's variable for each MPI's host file (its mpi_job_controller.go)
_OPERATOR_HOSTFILES = (("ompi_hostfile", "OMPI_MCA_orte_default_hostfile"),
                       ("hydra_hostfile", "HYDRA_HOST_FILE"),
                       ("intel_hostfile", "I_MPI_HYDRA_HOST_FILE"))


def _mpi_operator(launch):
    for field, variable in _OPERATOR_HOSTFILES:
        path = getattr(launch, field)
        if path:
            break
    else:
        return None
    hosts = _read(path, variable)
    if launch.mpi_job_role:
        name, more = (f"the MPIJob (its host file {path})",
                      "give the MPIJob more workers (Worker replicas) or slotsPerWorker")
    else:
        name, more = (f"the host file {path} ({variable})", f"list more hosts in {path}")
    return Allocation(name, "", _total(hosts), hosts, "slots", more)


def _read(path, variable):
    try:
        return read_hostfile(path)
    except OSError as error:
        raise ValueError(f"{variable} names {path}, which cannot be read ({error.strerror}); "
                         f"unset {variable} or give the hosts with -H/--hostfile") from None
    except ValueError as error:
        raise ValueError(f"{error} (named by {variable})") from None


def _total(hosts):
    return sum(slots for _, slots in hosts)
