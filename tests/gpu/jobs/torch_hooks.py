"""Communication hooks on CUDA gradients: allreduce, fp16 and bf16 train as they do on CPU
tensors; the fp16 hook's buckets travel in float16 (half the bytes), bf16's in bfloat16
through host memory where the transport stages (cupy has no bfloat16) and in float32 over
the device-direct ring; PowerSGD (rank 2, after 2 plain steps) trains on CUDA gradients
keeping its error vectors and Q on the GPU, and on fixed gradients whose top singular values
stand apart it gives the vectors it gives on CPU tensors (a training run is no reference for
it: on CPU alone, weights scaled by 1 + 1e-6 moved this MLP's parameters by 1.3e-3 after 10
PowerSGD steps, against 2e-7 with the allreduce hook); hvd.allreduce(compression=fp16 or
bf16) of a CUDA tensor gives the bits the CPU path gives. The first argument names the
transport (direct, staged)."""
import sys

import numpy as np
import torch

import hororing.torch as hvd
from hororing.comm_hooks import GradBucket, Reduction
from hororing.context import current

hvd.init()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
pipeline = current().engine.allreduce
assert pipeline.device_transport() == sys.argv[1]
# what each hook's CUDA buckets travel as
TRAVELS = {"allreduce": "float32", "fp16": "float16",
           "bf16": "float32" if sys.argv[1] == "direct" else "bfloat16", "powersgd": "float32"}
HOOKS = {"allreduce": lambda: hvd.comm_hooks.allreduce, "fp16": lambda: hvd.comm_hooks.fp16,
         "bf16": lambda: hvd.comm_hooks.bf16,
         "powersgd": lambda: hvd.comm_hooks.powersgd(rank=2, start_iter=2)}


def train(device, hook_name):
    """Train an MLP with ``hook_name``'s hook; the dtypes its buckets were reduced in."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4)).to(device)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=[(f"{device}.{hook_name}.{n}", p) for n, p in model.named_parameters()],
        comm_hook=HOOKS[hook_name]())
    generator = torch.Generator().manual_seed(hvd.rank())
    held_out = torch.randn(256, 32, generator=torch.Generator().manual_seed(7)).to(device)
    losses = [float(model(held_out).square().mean())]
    with pipeline.watch() as seen:
        for _ in range(10):
            optimizer.zero_grad()
            x = torch.randn(16, 32, generator=generator).to(device)
            model(x).square().mean().backward()
            optimizer.step()
    losses.append(float(model(held_out).square().mean()))
    return ([p.detach().cpu() for p in model.parameters()], {dtype for _, dtype, _ in seen},
            losses, optimizer)


for hook_name, travels in TRAVELS.items():
    on_gpu, gpu_dtypes, gpu_losses, gpu_optimizer = train("cuda", hook_name)
    on_cpu, _, cpu_losses, _ = train("cpu", hook_name)
    assert gpu_dtypes == {travels}, (hook_name, gpu_dtypes)
    if hook_name == "powersgd":  # trains, its state on the GPU; its values are checked below
        state = gpu_optimizer.state_dict()["comm_hook"]
        kept = list(state["errors"].values()) + list(state["qs"].values())
        assert state["errors"] and state["qs"], state
        assert all(isinstance(t, torch.Tensor) and t.is_cuda for t in kept), \
            [getattr(t, "device", type(t)) for t in kept]
        for losses in (gpu_losses, cpu_losses):  # a held-out batch's loss, before and after
            assert losses[1] < 0.8 * losses[0], (hook_name, losses)  # 0.66 on CPU
        continue
    for gpu_parameter, cpu_parameter in zip(on_gpu, on_cpu):
        torch.testing.assert_close(gpu_parameter, cpu_parameter, rtol=2e-3, atol=2e-4)

# PowerSGD's vectors on CUDA tensors against CPU tensors, the same inputs: this rank's
# gradients are a 48 x 40 matrix with singular values 8, 4 (its rank-2 part, shared by the
# ranks up to small rotations) over noise of 0.1, and a vector sent uncompressed
SHAPES = [(48, 40), (40,)]


def gradients(step):
    rng = np.random.default_rng([hvd.rank(), step])
    shared = np.random.default_rng(step)
    left = np.linalg.qr(shared.standard_normal((48, 2)) + 0.05 * rng.standard_normal((48, 2)))[0]
    right = np.linalg.qr(shared.standard_normal((40, 2)))[0]
    matrix = left @ np.diag([8.0, 4.0]) @ right.T + 0.1 * rng.standard_normal((48, 40))
    return np.concatenate([matrix.ravel(), rng.standard_normal(40)]).astype(np.float32)


def powersgd_on(device, steps=4):
    hook = hvd.comm_hooks.powersgd(rank=2, start_iter=1)
    reduced = []
    for step in range(steps):
        flat = torch.from_numpy(gradients(step)).to(device)
        bucket = GradBucket(0, "hooks.powersgd.fixed", flat, flat, SHAPES, ["m", "v"],
                            Reduction(hvd.Average), None)
        result = hook(None, bucket).wait()
        assert result.device.type == device, result.device
        reduced.append(result.cpu().double())
    return reduced


for step, (on_gpu, on_cpu) in enumerate(zip(powersgd_on("cuda"), powersgd_on("cpu"))):
    torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-4, atol=1e-4 * float(on_cpu.abs().max()),
                               msg=lambda text, step=step: f"PowerSGD step {step}: {text}")

# one allreduce with compression=: 16 bits on the wire, the CPU path's bits
generator = torch.Generator().manual_seed(100 + hvd.rank())
values = torch.randn(30011, generator=generator)  # no rank count divides it
everyone = hvd.allgather(values.unsqueeze(0), name="hooks.inputs").double()
for kind, epsilon in (("fp16", 2.0 ** -10), ("bf16", 2.0 ** -7)):
    compression = getattr(hvd.Compression, kind)
    with pipeline.watch() as seen:
        on_gpu = hvd.allreduce(values.cuda(), op=hvd.Average, compression=compression,
                               name=f"hooks.{kind}.cuda")
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.float32
    assert {dtype for _, dtype, _ in seen} == {TRAVELS[kind]}, (kind, seen)
    on_cpu = hvd.allreduce(values, op=hvd.Average, compression=compression,
                           name=f"hooks.{kind}.cpu")
    if TRAVELS[kind] != "float32":  # the same 16-bit hops as on the host
        assert torch.equal(on_gpu.cpu(), on_cpu), kind
    for result in (on_gpu.cpu(), on_cpu):
        error = (result.double() - everyone.mean(0)).abs()
        assert bool((error <= 3 * epsilon * everyone.abs().mean(0) + 1e-7).all()), \
            (kind, error.max())

print("torch hooks ok", hvd.rank(), flush=True)
hvd.shutdown()
