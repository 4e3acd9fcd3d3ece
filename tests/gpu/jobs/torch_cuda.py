"""CUDA tensors: DistributedOptimizer gives the parameters it gives on CPU tensors, its
CUDA gradients are views into one flat device bucket; allreduce keeps the device;
SyncBatchNorm matches BatchNorm1d on the global batch. The first argument names the
transport (direct, staged)."""
import sys

import torch

import hororing.torch as hvd
from hororing.context import current

hvd.init()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())


def train(device, passes=1, unused=False):
    """Train an MLP; ``unused``: with a head the loss never reaches (its bucket waits for a
    gradient that never comes: synchronize() must still start it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    head = torch.nn.Linear(4, 3).to(device)
    parameters = list(model.named_parameters()) + (list(head.named_parameters()) if unused else [])
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in parameters], lr=0.1),
                                         named_parameters=[(f"{device}.{passes}.{unused}.{n}", p)
                                                           for n, p in parameters],
                                         backward_passes_per_step=passes)
    generator = torch.Generator().manual_seed(hvd.rank())
    for _ in range(10):
        optimizer.zero_grad()
        for _ in range(passes):
            x = torch.randn(16, 32, generator=generator).to(device)
            model(x).square().mean().backward()
        optimizer.step()
    if device == "cuda":  # every gradient a view into the one flat bucket, back to back
        grads = sorted((p.grad for p in model.parameters()), key=lambda g: g.data_ptr())
        base = grads[0].untyped_storage().data_ptr()
        assert all(g.untyped_storage().data_ptr() == base for g in grads)
        for before, after in zip(grads, grads[1:]):
            assert before.data_ptr() + before.numel() * 4 == after.data_ptr()
    return [p.detach().cpu() for _, p in parameters]


assert current().engine.allreduce.device_transport() == sys.argv[1]
for passes, unused in ((1, False), (2, False), (1, True)):
    for on_gpu, on_cpu in zip(train("cuda", passes, unused), train("cpu", passes, unused)):
        torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-4, atol=1e-5)
x = torch.arange(6.0, device="cuda") + hvd.rank()
y = hvd.allreduce(x, op=hvd.Sum)
assert y.device == x.device
torch.testing.assert_close(y.cpu(), (torch.arange(6.0) * hvd.size() + sum(range(hvd.size()))))
# SyncBatchNorm on CUDA inputs: the statistics of the global batch, as BatchNorm1d computes them
generator = torch.Generator().manual_seed(7)
inputs = [torch.randn(4, 3, 5, generator=generator) for _ in range(hvd.size())]
sync = hvd.SyncBatchNorm(3).cuda()
local = inputs[hvd.rank()].cuda().requires_grad_(True)
output = sync(local)
(output * torch.arange(5.0, device="cuda")).sum().backward()
reference = torch.nn.BatchNorm1d(3)
whole = torch.cat(inputs).requires_grad_(True)
expected = reference(whole)
(expected * torch.arange(5.0)).sum().backward()
rows = slice(4 * hvd.rank(), 4 * hvd.rank() + 4)
assert output.device.type == "cuda" and local.grad.device.type == "cuda"
torch.testing.assert_close(output.cpu(), expected[rows], atol=1e-5, rtol=1e-5)
torch.testing.assert_close(local.grad.cpu(), whole.grad[rows], atol=1e-5, rtol=1e-5)
torch.testing.assert_close(sync.running_var.cpu(), reference.running_var, atol=1e-6, rtol=1e-5)
print("torch cuda ok", hvd.rank(), flush=True)
hvd.shutdown()
