"""GPU tests: the real device path. Every test here skips, with the reason, without a GPU.

Run on a machine with a GPU and cupy (and torch with CUDA for the torch test):
``python -m pytest tests/gpu``. Multi-rank cases launch 2 ranks that share GPU 0.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

JOBS = pathlib.Path(__file__).parent / "jobs"


def gpu_reason():
    """Why the GPU tests cannot run here, or None when they can."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "NUMBA_ENABLE_CUDASIM is set: these tests need a real GPU"
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install 'hororing[cuda]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver
        return f"no usable CUDA driver ({error})"
    return None if count > 0 else "no GPU visible"


REASON = gpu_reason()


def pytest_collection_modifyitems(items):
    if REASON is not None:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=REASON))


@pytest.fixture
def launch():
    def run(ranks, job, *args, env=None, timeout=300):
        beside_python = pathlib.Path(sys.executable).parent / "mpiexec"
        mpiexec = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
        if mpiexec is None:
            pytest.skip("no mpiexec")
        environment = dict(os.environ)
        environment.update(env or {})
        return subprocess.run([mpiexec, "-n", str(ranks), sys.executable, str(JOBS / job), *args],
                              capture_output=True, text=True, timeout=timeout, env=environment)
    return run
