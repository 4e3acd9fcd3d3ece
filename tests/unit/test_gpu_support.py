"""Host-side pieces of the GPU path: the staging order, CUDA-aware detection, device arrays."""

import numpy as np
import pytest

from hororing import gpu
from hororing.algorithms.plan import ring_schedule
from hororing.algorithms import staged
from hororing.algorithms.staged import first_reads
from hororing.config import Config


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16])
def test_staging_copies_every_chunk_once_in_the_order_the_ring_reads_them(size):
    for rank in range(size):
        schedule = ring_schedule(size, rank, allgather=True)
        order = first_reads(schedule, size)
        assert sorted(order) == list(range(size))
        if size > 1:
            # the chunk sent first, then the chunk each scatter-reduce step combines into
            assert order[0] == schedule.steps[0].send_chunk
            reduced = [step.recv_chunk for step in schedule.steps if step.reduce]
            assert order[1:] == reduced


class _RecordingDevice:
    """A device buffer that records the ranges copied back into it."""

    def __init__(self, copies):
        self.copies = copies

    def __getitem__(self, piece):
        copies = self.copies

        class Slice:
            @staticmethod
            def copy_to_device(host, stream):
                copies.append((piece.start, piece.stop))
        return Slice()


def test_staging_joins_adjacent_final_pieces_into_few_copies():
    copies = []
    stage = staged._Stage.__new__(staged._Stage)
    stage.device, stage.host, stage.pending = _RecordingDevice(copies), np.zeros(100), None
    stage.copy_elements = 10  # copies of at least 10 elements, where pieces are adjacent
    stage.up = type("Stream", (), {"synchronize": staticmethod(lambda: None)})
    for start, stop in [(0, 4), (4, 8), (8, 12), (12, 13), (20, 22), (22, 22), (40, 41)]:
        stage.final(start, stop)
    assert copies == [(0, 12), (12, 13), (20, 22)]  # 12 >= 10 elements; then gaps split
    stage.finish()
    assert copies == [(0, 12), (12, 13), (20, 22), (40, 41)]  # every final element, once


def test_the_pip_mpich_says_it_is_not_cuda_aware():
    aware, how = gpu.query_mpi_cuda_support()
    assert aware is False, how
    assert gpu.cuda_aware(None) is False


def test_cuda_aware_override_wins(caplog):
    assert gpu.cuda_aware(False) is False
    with caplog.at_level("WARNING", logger="hororing"):
        assert gpu.cuda_aware(True) is True
    assert "not CUDA-aware" in caplog.text


@pytest.mark.parametrize("raw,value", [("1", True), ("0", False)])
def test_cuda_aware_from_the_environment(raw, value):
    assert Config.from_environ({"HORORING_CUDA_AWARE": raw}).cuda_aware is value
    assert Config.from_environ({}).cuda_aware is None
    with pytest.raises(ValueError, match="HORORING_CUDA_AWARE"):
        Config.from_environ({"HORORING_CUDA_AWARE": "maybe"})


def test_device_arrays_are_recognised_without_importing_gpu_libraries():
    assert not gpu.is_device_array(np.ones(3))
    assert not gpu.is_device_array([1, 2])

    class Interface:
        __cuda_array_interface__ = {}

    assert gpu.is_device_array(Interface())


def test_numba_device_arrays_are_checked():
    cuda = pytest.importorskip("numba.cuda")
    array = cuda.to_device(np.ones((4, 4), np.float32))
    assert gpu.is_device_array(array)
    assert gpu.check_device_array(array) is array
    assert gpu.as_device_view(array) is array
    with pytest.raises(ValueError, match=r"non-contiguous device array \(shape \(4, 2\)"):
        gpu.check_device_array(array[:, ::2])


class _TorchLikeCudaTensor:
    """What a torch CUDA tensor shows the engine: a dtype numpy cannot read, no numpy-style
    strides or flags, and ``__cuda_array_interface__``."""

    def __init__(self, typestr, shape, strides=None):
        self.dtype = pytest.importorskip("torch").float32  # torch's own dtype object
        self.shape = shape
        self.__cuda_array_interface__ = {"typestr": typestr, "shape": shape, "strides": strides,
                                         "data": (0, False), "version": 3}


def test_torch_cuda_tensors_are_read_through_the_cuda_array_interface():
    tensor = _TorchLikeCudaTensor("<f4", (4, 4))
    assert gpu.device_dtype(tensor) == np.float32
    assert gpu.check_device_array(tensor) is tensor
    assert gpu.check_device_array(_TorchLikeCudaTensor("<f4", (4, 2), strides=(8, 4))) is not None
    with pytest.raises(ValueError, match=r"non-contiguous device array \(shape \(4, 2\)"):
        gpu.check_device_array(_TorchLikeCudaTensor("<f4", (4, 2), strides=(16, 4)))
    with pytest.raises(TypeError, match="unsupported dtype complex64"):
        gpu.check_device_array(_TorchLikeCudaTensor("<c8", (3,)))


def test_device_selection_can_be_turned_off():
    assert gpu.select_device(0, enabled=False) is None
