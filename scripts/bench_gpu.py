#!/usr/bin/env python
"""GPU benchmark: hororing's device kernels and the staged ring against their yardsticks.

    python scripts/bench_gpu.py --json docs/results/gpu.json

Part 1 runs in this process on one GPU (the numba.cuda kernels, on cupy arrays where cupy
is installed, else on numba device arrays):

  reduce    kernels.reduce_into (a += b, float32) in GB/s of memory traffic (2 reads and
            1 write per element), against a device-to-device copy (1 read, 1 write) of the
            same size measured in the same run: the kernel's share of the copy bandwidth
  fp16      kernels.to_fp16 and from_fp16 (float32 <-> float16 with a scale): elements/s
            and GB/s of traffic (4 + 2 bytes per element)
  pack      kernels.pack of --tensors tensors into one fusion buffer (one launch per 32
            tensors) against one device-to-device copy per tensor (cupy's, and numba's)

Part 2 starts ``mpiexec -n 2`` on the same GPU (the two ranks share it) once per
--transports (HORORING_DEVICE_RING: direct, staged) and times ``hvd.allreduce_`` of each
--ring-bytes float32 on device arrays against the same call on numpy arrays (the host ring),
taking turns in rounds; busbw = bytes/time * 2(n-1)/n for both.

Every row carries #wrong: elements differing from a reference computed on the host.
Under NUMBA_ENABLE_CUDASIM=1 (no GPU) the script runs on numba's simulator: use tiny sizes;
the code paths are exercised, the timings mean nothing.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

MiB = 1 << 20


def main():
    args = parse_args()
    if args.ring_child:
        ring_child(args)
        return
    from benchinfo import machine_info
    device = Device(args.backend)
    report = {"machine": machine_info(), "device": device.name, "backend": device.backend,
              "simulator": os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"}
    print(f"# hororing GPU benchmark on {device.name} ({device.backend} arrays"
          f"{', numba CUDA simulator: timings meaningless' if report['simulator'] else ''})")
    report["reduce"] = [reduce_row(device, nbytes, args) for nbytes in sizes(args.sizes)]
    report["fp16"] = [fp16_row(device, nbytes, args) for nbytes in sizes(args.sizes)]
    report["pack"] = pack_row(device, args)
    report["ring"] = run_ring(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


# ---- one GPU: kernels ------------------------------------------------------------------

class Device:
    """Allocation, copies and synchronization for cupy or numba.cuda arrays."""

    def __init__(self, backend):
        if backend == "auto":
            backend = "cupy" if importlib.util.find_spec("cupy") else "numba"
        self.backend = backend
        from numba import cuda
        self.cuda = cuda
        if backend == "cupy":
            import cupy
            self.cupy = cupy
            properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
            self.name = properties["name"].decode() if isinstance(properties["name"], bytes) \
                else properties["name"]
        else:
            current = getattr(cuda, "get_current_device", None)  # absent in the simulator
            name = getattr(current() if current else cuda.current_context().device, "name",
                           "numba CUDA simulator")
            self.name = name.decode() if isinstance(name, bytes) else str(name)

    def to_device(self, array):
        if self.backend == "cupy":
            return self.cupy.asarray(array)
        return self.cuda.to_device(array)

    def empty(self, count, dtype):
        if self.backend == "cupy":
            return self.cupy.empty(count, dtype=dtype)
        return self.cuda.device_array(count, dtype=dtype)

    def to_host(self, array):
        return self.cupy.asnumpy(array) if self.backend == "cupy" else array.copy_to_host()

    def copy(self, destination, source):
        """One device-to-device copy (cudaMemcpy), no kernel."""
        if self.backend == "cupy":
            destination.data.copy_from_device(source.data, source.nbytes)
        else:
            destination.copy_to_device(source)

    def view(self, array):
        """The numba view the hororing kernels take a cupy array through (no copy)."""
        from hororing.gpu import as_device_view
        return as_device_view(array) if self.backend == "cupy" else array

    def synchronize(self):
        if self.backend == "cupy":
            self.cupy.cuda.runtime.deviceSynchronize()
        else:
            self.cuda.synchronize()


def timed(device, function, args):
    """Median over --rounds of a block's mean seconds per call (synchronized around it)."""
    function()
    device.synchronize()
    started = time.perf_counter()
    function()
    device.synchronize()
    once = time.perf_counter() - started
    calls = int(min(max(args.seconds / args.rounds / max(once, 1e-7), 1), 10000))
    times = []
    for _ in range(args.rounds):
        device.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            function()
        device.synchronize()
        times.append((time.perf_counter() - started) / calls)
    return float(np.median(times))


def reduce_row(device, nbytes, args):
    from hororing.kernels import reduce_into
    count = nbytes // 4
    first = (np.arange(count) % 13).astype(np.float32)
    second = (np.arange(count) % 7).astype(np.float32)
    target, source = device.to_device(first), device.to_device(second)
    reduce_into(device.view(target), device.view(source), "sum")
    device.synchronize()
    wrong = int(np.count_nonzero(device.to_host(target) != first + second))
    copy_to = device.empty(count, np.float32)
    copy_s = timed(device, lambda: device.copy(copy_to, source), args)
    target_view, source_view = device.view(target), device.view(source)
    # sum, which stores every element (max stores only where the source is larger)
    reduce_s = timed(device, lambda: reduce_into(target_view, source_view, "sum"), args)
    row = {"bytes": nbytes, "copy_GBs": 2 * nbytes / copy_s / 1e9,
           "reduce_GBs": 3 * nbytes / reduce_s / 1e9, "wrong": wrong}
    row["reduce_over_copy"] = row["reduce_GBs"] / row["copy_GBs"]
    print(f"reduce {nbytes:>11} B: copy {row['copy_GBs']:8.1f} GB/s, reduce "
          f"{row['reduce_GBs']:8.1f} GB/s ({row['reduce_over_copy']:.0%} of the copy), "
          f"#wrong {wrong}", flush=True)
    return row


def fp16_row(device, nbytes, args):
    from hororing.kernels import from_fp16, to_fp16
    count = nbytes // 4
    values = (np.arange(count) % 1000).astype(np.float32)
    source, half, back = (device.to_device(values), device.empty(count, np.float16),
                          device.empty(count, np.float32))
    source_view, half_view, back_view = device.view(source), device.view(half), device.view(back)
    to_fp16(source_view, half_view, 0.5)
    from_fp16(half_view, back_view, 2.0)
    device.synchronize()
    wrong = int(np.count_nonzero(device.to_host(back) != values))
    down_s = timed(device, lambda: to_fp16(source_view, half_view, 0.5), args)
    up_s = timed(device, lambda: from_fp16(half_view, back_view, 2.0), args)
    row = {"bytes": nbytes, "to_fp16_Gelems": count / down_s / 1e9,
           "from_fp16_Gelems": count / up_s / 1e9, "to_fp16_GBs": 6 * count / down_s / 1e9,
           "from_fp16_GBs": 6 * count / up_s / 1e9, "wrong": wrong}
    print(f"fp16   {nbytes:>11} B: to_fp16 {row['to_fp16_Gelems']:7.2f} G elements/s "
          f"({row['to_fp16_GBs']:.1f} GB/s), from_fp16 {row['from_fp16_Gelems']:7.2f} G "
          f"elements/s ({row['from_fp16_GBs']:.1f} GB/s), #wrong {wrong}", flush=True)
    return row


def pack_row(device, args):
    from hororing.kernels import pack
    counts = [args.tensor_bytes // 4 + index for index in range(args.tensors)]  # uneven sizes
    hosts = [np.full(count, index, dtype=np.float32) for index, count in enumerate(counts)]
    tensors = [device.to_device(host) for host in hosts]
    views = [device.view(tensor) for tensor in tensors]
    buffer = device.empty(sum(counts), np.float32)
    buffer_view = device.view(buffer)
    ranges = pack(views, buffer_view)
    device.synchronize()
    wrong = int(np.count_nonzero(device.to_host(buffer) != np.concatenate(hosts)))
    slices = [buffer[start:stop] for start, stop in ranges]

    def separate():
        for piece, tensor in zip(slices, tensors):
            device.copy(piece, tensor)

    def numba_copies():  # the same copies through numba views, as the engine holds them
        for (start, stop), view in zip(ranges, views):
            buffer_view[start:stop].copy_to_device(view)
    fused_s = timed(device, lambda: pack(views, buffer_view), args)
    separate_s = timed(device, separate, args)
    numba_s = timed(device, numba_copies, args)
    row = {"tensors": args.tensors, "bytes": int(sum(counts) * 4), "pack_us": fused_s * 1e6,
           "separate_copies_us": separate_s * 1e6, "numba_copies_us": numba_s * 1e6,
           "speedup": separate_s / fused_s, "wrong": wrong}
    print(f"pack   {args.tensors} tensors, {row['bytes']} B: kernel launches {row['pack_us']:.1f} us, "
          f"{args.tensors} {device.backend} copies {row['separate_copies_us']:.1f} us, "
          f"{args.tensors} numba copies {row['numba_copies_us']:.1f} us, speed-up "
          f"{row['speedup']:.1f}x, #wrong {wrong}", flush=True)
    return row


# ---- two ranks on one GPU: the staged (or CUDA-aware) ring against the host ring ----------

def run_ring(args):
    """One 2-rank job per device transport; each times the device allreduce beside the host
    ring on numpy arrays of the same size, taking turns."""
    from benchinfo import json_rows_of
    rows = []
    for transport in args.transports:
        command = [args.mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", os.path.abspath(__file__), "--ring-child",
                   "--ring-bytes", args.ring_bytes, "--rounds", str(args.rounds),
                   "--seconds", str(args.seconds), "--backend", args.backend]
        for row in json_rows_of(command, args.timeout, f"the 2-rank {transport} ring job",
                                env={"HORORING_DEVICE_RING": transport}):
            print(f"ring   2 ranks, {row['bytes']:>9} B: device {row['device_busbw_GBs']:7.2f} "
                  f"GB/s busbw ({row['transport']}, {row['device_s'] * 1e3:.2f} ms), host "
                  f"{row['host_busbw_GBs']:.2f} GB/s ({row['host_s'] * 1e3:.2f} ms), "
                  f"device/host {row['device_over_host']:.2f}, #wrong {row['wrong']}", flush=True)
            rows.append(row)
    return rows


def ring_child(args):
    from mpi4py import MPI

    import hororing as hvd
    from hororing.context import current
    hvd.init()
    device = Device(args.backend)
    for nbytes in sizes(args.ring_bytes):
        row = ring_row(hvd, device, nbytes, args, MPI.COMM_WORLD)
        row["transport"] = current().engine.allreduce.device_transport()
        if hvd.rank() == 0:
            print(json.dumps(row), flush=True)
    hvd.shutdown()


def ring_row(hvd, device, nbytes, args, comm):
    from mpi4py import MPI

    size, rank = hvd.size(), hvd.rank()
    count = nbytes // 4
    pattern = (np.arange(count) % 7).astype(np.float32)
    expected = pattern * size + size * (size - 1) / 2
    host = pattern + rank
    on_device = device.to_device(host)
    hvd.allreduce_(host, op=hvd.Sum, name=f"ring.host.{nbytes}")
    hvd.allreduce_(on_device, op=hvd.Sum, name=f"ring.device.{nbytes}")
    wrong = int(np.count_nonzero(host != expected)
                + np.count_nonzero(device.to_host(on_device) != expected))
    wrong = comm.allreduce(wrong)
    host_buffer = np.zeros(count, np.float32)
    device_buffer = device.to_device(np.zeros(count, np.float32))
    runs = {"host": lambda: hvd.allreduce_(host_buffer, op=hvd.Sum, name=f"ring.host.{nbytes}"),
            "device": lambda: hvd.allreduce_(device_buffer, op=hvd.Sum,
                                             name=f"ring.device.{nbytes}")}
    times = {name: [] for name in runs}
    for run in runs.values():
        run()
    # one block length on every rank (the slowest rank's), or the ranks' calls would not pair
    once = comm.allreduce(max(_once(runs["device"]), _once(runs["host"])), op=MPI.MAX)
    per_block = max(1, int(args.seconds / args.rounds / 2 / max(once, 1e-6)))
    for round_index in range(args.rounds):
        order = list(runs) if round_index % 2 == 0 else list(runs)[::-1]
        for name in order:
            comm.Barrier()
            started = time.perf_counter()
            for _ in range(per_block):
                runs[name]()
            device.synchronize()
            times[name].append(comm.allreduce(time.perf_counter() - started,
                                              op=MPI.MAX) / per_block)
    factor = 2 * (size - 1) / size
    row = {"bytes": nbytes, "ranks": size, "wrong": wrong, "calls_per_block": per_block,
           "host_s": float(np.median(times["host"])), "device_s": float(np.median(times["device"]))}
    row["host_busbw_GBs"] = nbytes / row["host_s"] * factor / 1e9
    row["device_busbw_GBs"] = nbytes / row["device_s"] * factor / 1e9
    row["device_over_host"] = row["device_busbw_GBs"] / row["host_busbw_GBs"]
    return row


def _once(function):
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def sizes(text):
    return [int(value) for value in text.split(",")]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--backend", choices=["auto", "cupy", "numba"], default="auto")
    parser.add_argument("--sizes", default=",".join(str(s * MiB) for s in (1, 16, 64, 256)),
                        help="bytes per buffer for the reduce and fp16 rows")
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--tensor-bytes", type=int, default=64 * 1024,
                        help="about this many bytes per packed tensor")
    parser.add_argument("--ring-bytes", default=f"{64 * 1024},{MiB},{8 * MiB},{64 * MiB}",
                        help="bytes per device allreduce in the 2-rank jobs")
    parser.add_argument("--transports", nargs="+", default=["direct", "staged"],
                        choices=["auto", "direct", "staged"],
                        help="HORORING_DEVICE_RING of each 2-rank job")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per row")
    parser.add_argument("--mpiexec", default="mpiexec")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json")
    parser.add_argument("--ring-child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    main()
