"""DistributedOptimizer on CUDA tensors gives the same parameters as on CPU tensors."""
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
print("torch cuda ok", hvd.rank(), flush=True)
hvd.shutdown()
