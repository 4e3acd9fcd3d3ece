"""Two ranks sharing a GPU: every collective on cupy arrays against host references."""
import cupy
import numpy as np

import hororing as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
for count in (0, 1, 1001, 3 * 1024 * 1024 + 7):  # the last is 12 MiB of float32: the ring
    values = (np.arange(count) % 17 + rank).astype(np.float32)
    result = hvd.allreduce(cupy.asarray(values), op=hvd.Sum, name=f"sum{count}")
    assert isinstance(result, cupy.ndarray) and result.device.id == cupy.cuda.Device().id
    expected = (np.arange(count) % 17 * size + size * (size - 1) // 2).astype(np.float32)
    np.testing.assert_array_equal(result.get(), expected)
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
