"""``hororun --check-build``: what this installation can run, in horovodrun's layout."""

import importlib.util

from .mpiexec import mpi_flavor

__all__ = ["check_build"]


def check_build(mpiexec=None):
    """The installation's capabilities, in the layout of ``horovodrun --check-build``."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        __version__ = version("hororing")
    except PackageNotFoundError:  # run from a checkout that is not installed
        __version__ = "unknown"

    def mark(available):
        return "[X]" if available else "[ ]"

    has = {name: importlib.util.find_spec(name) is not None
           for name in ("torch", "tensorflow", "numba", "cupy", "mpi4py")}
    mpi = mpi_flavor(mpiexec) if mpiexec else None
    lines = [
        f"hororing v{__version__}:",
        "",
        "Available Frameworks:",
        f"    {mark(has['tensorflow'] and importlib.util.find_spec('hororing.tensorflow') is not None)} TensorFlow",
        f"    {mark(has['torch'])} PyTorch",
        f"    {mark(True)} NumPy",
        "",
        "Available Controllers:",
        f"    {mark(has['mpi4py'])} MPI" + (f" ({mpi}, {mpiexec})" if mpi else " (no mpiexec found)"),
        f"    {mark(False)} Gloo",
        "",
        "Available Tensor Operations:",
        f"    {mark(False)} NCCL",
        f"    {mark(False)} DDL",
        f"    {mark(False)} CCL",
        f"    {mark(has['mpi4py'])} MPI",
        f"    {mark(False)} Gloo",
        f"    {mark(has['numba'] or has['cupy'])} CUDA device buffers (hororing's ring)",
    ]
    return "\n".join(lines)
