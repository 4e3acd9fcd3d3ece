"""What this installation supports, answered with Horovod's build queries.

hororing is pure Python over MPI: MPI is always there; there is no gloo, NCCL, oneCCL, DDL
or ROCm controller. Whether device tensors are reduced on the device is a question for each
framework binding (``cuda_built`` lives there).
"""


def mpi_built():
    """True: hororing always runs over MPI."""
    return True


def mpi_enabled():
    """True: MPI carries every collective."""
    return True


def mpi_threads_supported():
    """True: hororing requires (and checks for) MPI_THREAD_MULTIPLE."""
    return True


def gloo_built():
    """False: hororing has no gloo controller."""
    return False


def gloo_enabled():
    """False: hororing has no gloo controller."""
    return False


def nccl_built():
    """0 (false): device tensors are reduced by hororing's ring, not by NCCL."""
    return 0


def ccl_built():
    """False: no oneCCL support."""
    return False


def ddl_built():
    """False: no IBM DDL support."""
    return False


def rocm_built():
    """False: no ROCm support."""
    return False


def gpu_available(ext_base_name, verbose=False):
    """Horovod's query: True if the ``ext_base_name`` binding ("torch", "tensorflow") reduces
    GPU tensors on the device (its ``cuda_built()``)."""
    import importlib

    try:
        binding = importlib.import_module(f"hororing.{ext_base_name}")
    except ImportError as error:
        if verbose:
            print(f"hororing.{ext_base_name} is not available: {error}")
        return False
    return bool(binding.cuda_built())
