"""Horovod's build queries for torch: the shared answers, and whether CUDA tensors reduce here."""

import importlib.util

import torch

from ..build import (ccl_built, ddl_built, gloo_built, gloo_enabled, gpu_available, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)

__all__ = ["ccl_built", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "gpu_available",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rocm_built"]


def cuda_built():
    """True when CUDA tensors can be reduced here: torch sees a GPU and numba (which runs
    hororing's device kernels) is installed."""
    return torch.cuda.is_available() and importlib.util.find_spec("numba") is not None
