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


class _RecordingMemory:
    """Device memory that records the staged ring's copies and event waits."""

    def __init__(self):
        self.downloads, self.uploads, self.waited = [], [], []

    def download(self, source, start, stop, host, stream):
        self.downloads.append((start, stop))

    def upload(self, target, start, stop, host, stream):
        self.uploads.append((start, stop))

    def record(self, stream):
        memory, block = self, self.downloads[-1] if self.downloads else None

        class Event:
            @staticmethod
            def synchronize():
                memory.waited.append(block)
        return Event()


class _Stream:
    @staticmethod
    def synchronize():
        pass


def _stage(memory, bounds, order, copy_elements, count=100):
    return staged._Stage(memory, None, None, np.zeros(count), bounds, order,
                         copy_elements * 8, _Stream(), _Stream())


def test_staging_copies_down_in_blocks_in_reading_order_and_waits_only_for_what_is_read():
    memory = _RecordingMemory()
    # chunks [0, 35) and [35, 70) and [70, 100); the ring reads chunk 1 first, then 0, then 2
    stage = _stage(memory, [(0, 35), (35, 70), (70, 100)], [1, 0, 2], copy_elements=10)
    assert memory.downloads == [(35, 45), (45, 55), (55, 65), (65, 70), (0, 10), (10, 20),
                                (20, 30), (30, 35), (70, 80), (80, 90), (90, 100)]
    stage.need(40, 50)  # a piece across two blocks of chunk 1: both waited for
    assert memory.waited == [(35, 45), (45, 55)]
    stage.need(0, 5)
    assert memory.waited[2:] == [(0, 10)]
    stage.need(30, 40)  # a piece across two chunks' blocks
    assert memory.waited[3:] == [(30, 35), (35, 45)]
    stage.need(7, 7)  # nothing to read
    assert len(memory.waited) == 5


def test_staging_joins_adjacent_final_pieces_into_few_copies():
    memory = _RecordingMemory()
    stage = _stage(memory, [(0, 100)], [0], copy_elements=10)
    for start, stop in [(0, 4), (4, 8), (8, 12), (12, 13), (20, 22), (22, 22), (40, 41)]:
        stage.final(start, stop)
    assert memory.uploads == [(0, 12), (12, 13), (20, 22)]  # 12 >= 10 elements; gaps split
    stage.finish()
    assert memory.uploads == [(0, 12), (12, 13), (20, 22), (40, 41)]  # every element, once


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


@pytest.mark.parametrize("setting,aware,explicit,one_node,can_share,expected", [
    ("auto", False, False, True, True, "direct"),      # one node, cupy: the device-direct ring
    ("auto", False, False, True, False, "staged"),     # numba cannot share device memory
    ("auto", False, False, False, True, "staged"),     # across nodes without CUDA-aware MPI
    ("auto", True, False, False, True, "cuda-aware"),  # across nodes, the MPI takes pointers
    ("auto", True, False, True, True, "direct"),       # in a node, IPC still beats a detour
    ("auto", True, True, True, True, "cuda-aware"),    # HORORING_CUDA_AWARE=1 asked for MPI
    ("staged", True, True, True, True, "staged"),
    ("direct", False, False, True, True, "direct"),
])
def test_device_transport_choice(setting, aware, explicit, one_node, can_share, expected):
    from hororing.engine.device import choose_transport
    assert choose_transport(setting, aware, explicit, one_node, can_share) == expected


def test_a_forced_device_direct_ring_that_cannot_run_says_why():
    from hororing.engine.device import choose_transport
    with pytest.raises(ValueError, match="needs every rank on one node.*use auto or staged"):
        choose_transport("direct", False, False, False, True)
    with pytest.raises(ValueError, match="needs cupy .*install 'hororing\\[cuda\\]'"):
        choose_transport("direct", False, False, True, False)
    with pytest.raises(ValueError, match="HORORING_DEVICE_RING"):
        Config.from_environ({"HORORING_DEVICE_RING": "nvlink"})
    assert Config.from_environ({"HORORING_DEVICE_RING": "Direct"}).device_ring == "direct"


class _Recording:
    contributors = 2
    out_of_place = True

    def __init__(self):
        self.calls = []

    def rings(self):
        return ()

    def allreduce(self, buffer, op, finalize=None, segments=None, source=None):
        self.calls.append(buffer.nbytes)


def test_by_size_sends_small_buckets_one_way_and_large_ones_the_other():
    from hororing.engine.device import BySize
    large, small = _Recording(), _Recording()
    split = BySize(large, small, 1000)
    for count in (10, 125, 124, 5000):
        split.allreduce(np.zeros(count), "sum")
    assert large.calls == [1000, 40000] and small.calls == [80, 992]


class _Memory:
    """Device memory whose arrays are numpy arrays at made-up addresses."""
    name = "cupy"

    def __init__(self, allocations):
        self.allocations = allocations  # [(base, size)]

    @staticmethod
    def pointer(array):
        return array.address

    def allocation_base(self, pointer):
        for base, size in self.allocations:
            if base <= pointer < base + size:
                return base
        return None

    @staticmethod
    def from_pointer(pointer, shape, dtype, owner):
        return ("span", pointer, shape)


class _At(np.ndarray):
    pass


def _at(address, count):
    array = np.zeros(count, np.float32).view(_At)
    array.address = address
    return array


def test_a_span_never_crosses_from_one_allocation_into_the_next():
    from hororing.engine.device import DeviceBuffers
    place = DeviceBuffers.__new__(DeviceBuffers)
    arrays = [_at(1000, 10), _at(1040, 6), _at(1064, 4)]  # back to back: 1000..1080
    place.memory = _Memory([(1000, 4096)])
    assert place.span(arrays, arrays) == ("span", 1000, (20,))
    place.memory = _Memory([(1000, 64), (1064, 512)])  # two allocations, adjacent
    assert place.span(arrays, arrays) is None
    place.memory = _Memory([(1000, 4096)])
    assert place.span(arrays, [arrays[0], arrays[1], _at(1064, 4)]) is None  # out of place
    assert place.span([arrays[0], arrays[2]], [arrays[0], arrays[2]]) is None  # a gap


def test_cupy_memory_copies_between_host_and_device_at_the_right_addresses():
    # the driver calls the staged ring makes through cupy, recorded instead of made
    from types import SimpleNamespace
    from hororing.gpu.cupy_memory import CupyMemory
    calls = []
    memory = CupyMemory.__new__(CupyMemory)
    memory.runtime = SimpleNamespace(
        memcpyDeviceToHost=2, memcpyHostToDevice=1,
        memcpyAsync=lambda *arguments: calls.append(arguments))
    device = SimpleNamespace(data=SimpleNamespace(ptr=0x10000), itemsize=8)
    host = np.zeros(100, np.float64)
    stream = SimpleNamespace(ptr=77)
    memory.download(device, 10, 25, host, stream)
    memory.upload(device, 30, 31, host, stream)
    memory.download(device, 5, 5, host, stream)  # nothing to copy: no call
    base = host.ctypes.data
    assert calls == [(base + 80, 0x10000 + 80, 120, 2, 77), (0x10000 + 240, base + 240, 8, 1, 77)]
