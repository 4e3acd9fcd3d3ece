"""Communication hooks on CUDA gradients: allreduce, fp16 and bf16 train as they do on CPU
tensors; the fp16 hook's buckets travel in float16 (half the bytes), bf16's in bfloat16
through host memory where the transport stages (cupy has no bfloat16) and in float32 over
the device-direct ring; PowerSGD (rank 2, after 2 plain steps) keeps its factors on the GPU
and trains as on CPU gradients; hvd.allreduce(compression=fp16 or bf16) of a CUDA tensor
gives the bits the CPU path gives. The first argument names the transport (direct,
staged)."""
import sys

import torch

import hororing.torch as hvd
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
    with pipeline.watch() as seen:
        for _ in range(10):
            optimizer.zero_grad()
            x = torch.randn(16, 32, generator=generator).to(device)
            model(x).square().mean().backward()
            optimizer.step()
    return [p.detach().cpu() for p in model.parameters()], {dtype for _, dtype, _ in seen}


for hook_name, travels in TRAVELS.items():
    on_gpu, gpu_dtypes = train("cuda", hook_name)
    on_cpu, _ = train("cpu", hook_name)
    assert gpu_dtypes == {travels}, (hook_name, gpu_dtypes)
    for gpu_parameter, cpu_parameter in zip(on_gpu, on_cpu):
        torch.testing.assert_close(gpu_parameter, cpu_parameter, rtol=2e-3, atol=2e-4)

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
