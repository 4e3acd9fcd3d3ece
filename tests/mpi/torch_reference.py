"""What the torch tests compute their expectations from: every rank's input, a small model,
its local loss, and the step or gradients of large-batch training done locally."""

import torch

import hororing.torch as hvd


def rank_tensor(rank, shape, seed=0):
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(*shape, generator=generator)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def local_loss(model, rank):
    data = rank_tensor(rank, (5, 4), seed=3)
    return model(data).pow(2).mean()


def expected_step(lr):
    """One SGD step with the gradient averaged over every rank's data, computed locally."""
    model = make_model()
    grads = None
    for rank in range(hvd.size()):
        model.zero_grad()
        local_loss(model, rank).backward()
        current = [p.grad.clone() for p in model.parameters()]
        grads = current if grads is None else [g + c for g, c in zip(grads, current)]
    with torch.no_grad():
        for parameter, grad in zip(model.parameters(), grads):
            parameter -= lr * grad / hvd.size()
    return [p.detach() for p in model.parameters()]


def expected_average_gradients(passes=1):
    """Every rank's gradients of local_loss (``passes`` backward passes each), averaged."""
    model = make_model()
    total = [torch.zeros_like(p) for p in model.parameters()]
    for rank in range(hvd.size()):
        model.zero_grad()
        for _ in range(passes):
            local_loss(model, rank).backward()
        total = [t + p.grad for t, p in zip(total, model.parameters())]
    return [t / hvd.size() for t in total]
