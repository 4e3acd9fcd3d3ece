"""Two ranks sharing a GPU: every collective on cupy arrays against host references, over
the transport named by the first argument (direct, staged, cuda-aware)."""
import sys

import cupy
import numpy as np

import hororing as hvd
from hororing.context import current

hvd.init()
rank, size = hvd.rank(), hvd.size()
assert current().engine.allreduce.device_transport() == sys.argv[1], \
    current().engine.allreduce.device_transport()
for count in (0, 1, 1001, 3 * 1024 * 1024 + 7):  # the last is 12 MiB of float32: the ring
    values = (np.arange(count) % 17 + rank).astype(np.float32)
    result = hvd.allreduce(cupy.asarray(values), op=hvd.Sum, name=f"sum{count}")
    assert isinstance(result, cupy.ndarray) and result.device.id == cupy.cuda.Device().id
    expected = (np.arange(count) % 17 * size + size * (size - 1) // 2).astype(np.float32)
    np.testing.assert_array_equal(result.get(), expected)
# random floats, every op, a count no rank count divides: bitwise alike on every rank, and
# within rounding of a float64 reference
for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
    for count in (7, 100003, 2 * 1024 * 1024 + 3):
        inputs = [np.random.default_rng([count, op, r]).uniform(0.5, 1.5, count).astype(np.float32)
                  for r in range(size)]
        result = hvd.allreduce(cupy.asarray(inputs[rank]), op=op, name=f"op{op}.{count}").get()
        wide = np.stack([i.astype(np.float64) for i in inputs])
        expected = {hvd.Average: wide.mean(0), hvd.Sum: wide.sum(0), hvd.Min: wide.min(0),
                    hvd.Max: wide.max(0), hvd.Product: wide.prod(0)}[op]
        np.testing.assert_allclose(result, expected, rtol=1e-6)
        everyone = hvd.allgather_object(result.tobytes())
        assert all(payload == everyone[0] for payload in everyone), f"op {op}, {count}"
# a bucket larger than any before (the device-direct ring shares a larger buffer), then a
# float64 one, in place
for count, dtype in ((9 * 1024 * 1024 + 1, np.float32), (1024 * 1024 + 5, np.float64)):
    array = cupy.full(count, rank + 1, dtype=dtype)
    hvd.allreduce_(array, op=hvd.Sum, name=f"grow{count}")
    assert float(array[0].get()) == size * (size + 1) / 2 and bool((array == array[0]).all())
array = cupy.full((5, 3), rank + 1.0, dtype=cupy.float64)
assert hvd.allreduce_(array, name="inplace") is array
np.testing.assert_allclose(array.get(), (size + 1) / 2)
handles = [hvd.allreduce_async(cupy.full(n, rank, cupy.float16), name=f"f16.{n}") for n in range(1, 50)]
for n, handle in zip(range(1, 50), handles):
    np.testing.assert_allclose(hvd.synchronize(handle).get(), (size - 1) / 2)
gathered = hvd.allgather(cupy.full((rank + 1, 2), rank, cupy.int32), name="ag")
np.testing.assert_array_equal(gathered.get(), np.concatenate(
    [np.full((r + 1, 2), r, np.int32) for r in range(size)]))
b = cupy.full(4, rank, cupy.int64)
hvd.broadcast_(b, root_rank=size - 1, name="bc")
np.testing.assert_array_equal(b.get(), size - 1)
print("cupy collectives ok", rank, flush=True)
hvd.shutdown()
