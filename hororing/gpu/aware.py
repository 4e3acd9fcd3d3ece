"""Is this MPI CUDA-aware? Asked of the library itself; HORORING_CUDA_AWARE overrides.

A device pointer handed to an MPI that is not CUDA-aware crashes the process instead of
raising, so the answer defaults to "no" unless the library says yes.
"""

import ctypes
import logging
import re

from .._mpi import MPI

log = logging.getLogger("hororing")


def query_mpi_cuda_support():
    """Return (aware, how): what the loaded MPI library says about CUDA buffers.

    Asks ``MPIX_Query_cuda_support()`` (MPICH, Open MPI) through ctypes, then the MPI 4.1
    info key ``mpi_memory_alloc_kinds`` (a 'cuda' kind means device memory is supported).
    ``aware`` is None when neither answers.
    """
    for path in _loaded_mpi_libraries():
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return bool(query()), f"MPIX_Query_cuda_support() in {path}"
    try:
        kinds = MPI.COMM_WORLD.Get_info().Get("mpi_memory_alloc_kinds")
    except (MPI.Exception, AttributeError):
        kinds = None
    if kinds is not None:
        return any(kind.split(":")[0] == "cuda" for kind in kinds.split(",")), \
            f"mpi_memory_alloc_kinds={kinds}"
    return None, "the MPI library answers neither MPIX_Query_cuda_support nor mpi_memory_alloc_kinds"


def cuda_aware(override):
    """Decide whether device buffers go to MPI directly (True) or through host staging.

    Args:
        override: the HORORING_CUDA_AWARE setting: None (ask the library), True or False.
    """
    if override is not None:
        if override:
            aware, how = query_mpi_cuda_support()
            if aware is False:
                log.warning("HORORING_CUDA_AWARE=1, but %s says this MPI is not CUDA-aware; "
                            "device buffers will be handed to it anyway", how)
        return bool(override)
    aware, _ = query_mpi_cuda_support()
    return bool(aware)


def _loaded_mpi_libraries():
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:
        return []
    return sorted(set(re.findall(r"(/\S*/libmpi[^/\s]*\.so[.\d]*)$", text, re.MULTILINE)))
