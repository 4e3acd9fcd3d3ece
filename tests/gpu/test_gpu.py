"""The kernels on a real GPU (cupy and numba.cuda arrays), and device collectives under mpiexec."""

import numpy as np
import pytest

from hororing import kernels
from hororing.gpu import query_mpi_cuda_support

DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "min", "max", "product"])
@pytest.mark.parametrize("library", ["cupy", "numba"])
def test_reduce_on_the_gpu_matches_numpy(library, dtype, op):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 4, 1_000_003).astype(dtype)
    b = rng.integers(0, 4, 1_000_003).astype(dtype)
    target, source = _device(library, a), _device(library, b)
    kernels.reduce_into(target, source, op)
    kernels.reduce_into(a, b, op)
    np.testing.assert_array_equal(_host(target), a)


def test_compression_and_pack_on_the_gpu_match_numpy():
    from numba import cuda

    source = np.random.default_rng(1).standard_normal(300_001).astype(np.float32) * 1e4
    for to, wire_dtype in ((kernels.to_fp16, np.float16), (kernels.to_bf16, np.uint16)):
        wire, host_wire = cuda.device_array(source.size, wire_dtype), np.empty(source.size, wire_dtype)
        to(cuda.to_device(source), wire, prescale=0.25)
        to(source, host_wire, prescale=0.25)
        np.testing.assert_array_equal(wire.copy_to_host(), host_wire)
    arrays = [np.full(n, n, np.float32) for n in range(1, 101)]
    buffer = cuda.device_array(sum(a.size for a in arrays), np.float32)
    kernels.pack([cuda.to_device(a) for a in arrays], buffer)
    np.testing.assert_array_equal(buffer.copy_to_host(), np.concatenate(arrays))


# the direct ring for every bucket, however small (by default small ones are staged)
TRANSPORTS = {"direct": {"HORORING_DEVICE_RING": "direct", "HORORING_DEVICE_DIRECT_MIN_BYTES": "0"},
              "staged": {"HORORING_DEVICE_RING": "staged"},
              "cuda-aware": {"HORORING_CUDA_AWARE": "1"}}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_cupy_collectives_two_ranks_on_one_gpu(launch, transport):
    if transport == "cuda-aware" and not query_mpi_cuda_support()[0]:
        pytest.skip(f"this MPI is not CUDA-aware ({query_mpi_cuda_support()[1]})")
    job = launch(2, "cupy_collectives.py", transport, env=TRANSPORTS[transport])
    assert job.returncode == 0, _output(job)
    assert job.stdout.count("cupy collectives ok") == 2


@pytest.mark.parametrize("transport", ["direct", "staged"])
def test_torch_cuda_tensors_through_distributed_optimizer(launch, transport):
    _torch_job(launch, "torch_cuda.py", transport, "torch cuda ok")


@pytest.mark.parametrize("transport", ["direct", "staged"])
def test_torch_comm_hooks_on_cuda_gradients(launch, transport):
    _torch_job(launch, "torch_hooks.py", transport, "torch hooks ok")


def _torch_job(launch, job_file, transport, done):
    """Run a torch CUDA job at 2 ranks over ``transport``; each rank prints ``done``."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    job = launch(2, job_file, transport, env=TRANSPORTS[transport])
    assert job.returncode == 0, _output(job)
    assert job.stdout.count(done) == 2


def _output(job):
    """What a failed job printed: the start of its stderr holds the first rank's traceback
    (an engine failure's among them), its end the last."""
    return (f"stdout:\n{job.stdout[-2000:]}\nstderr (start):\n{job.stderr[:5000]}\n"
            f"stderr (end):\n{job.stderr[-3000:]}")


def _device(library, array):
    if library == "cupy":
        import cupy

        return cupy.asarray(array)
    from numba import cuda

    return cuda.to_device(array)


def _host(array):
    return array.get() if hasattr(array, "get") else array.copy_to_host()


def test_numpy_example_trains_on_cupy_arrays(launch):
    import pathlib
    import re

    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_numpy.py"
    job = launch(2, str(example), "--device", "gpu")
    assert job.returncode == 0, _output(job)
    assert float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1)) >= 0.95


def test_torch_example_trains_on_cuda(launch, tmp_path):
    import pathlib
    import re

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train.py"
    job = launch(2, str(example), "--device", "cuda",
                 "--checkpoint", str(tmp_path / "checkpoint.pt"))
    assert job.returncode == 0, _output(job)
    assert float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1)) >= 0.95
