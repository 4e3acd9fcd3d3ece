"""CUDA tensors: DistributedOptimizer gives the parameters it gives on CPU tensors; allreduce
keeps the device; SyncBatchNorm matches BatchNorm1d on the global batch."""
import torch

import hororing.torch as hvd

hvd.init()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())


def train(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=[(f"{device}.{n}", p) for n, p in
                                                           model.named_parameters()])
    generator = torch.Generator().manual_seed(hvd.rank())
    for _ in range(10):
        x = torch.randn(16, 32, generator=generator).to(device)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


for on_gpu, on_cpu in zip(train("cuda"), train("cpu")):
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
