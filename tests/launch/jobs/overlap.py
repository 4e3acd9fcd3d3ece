"""DistributedOptimizer under HOROVOD_TIMELINE: a few steps of a deep MLP; rank 0 writes the trace."""
import torch

import hororing.torch as hvd

hvd.init()
torch.manual_seed(0)
layers = []
for _ in range(6):
    layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
inputs = torch.randn(512, 1024)
for step in range(3):
    optimizer.zero_grad()
    model(inputs).square().mean().backward()
    optimizer.step()
hvd.shutdown()
