"""The sharded optimizer's tests' shared model and reference (tests/mpi/test_sharded_*.py).

Each rank trains on its own data. The reference is computed on every rank alone: a plain
torch optimizer stepped with the mean of every rank's gradient (each rank can compute them
all, since the data are seeded by rank). The sharded optimizer must match it, leave the
parameters bitwise identical on every rank, and hold optimizer state for its slice only.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402
from reference import assert_identical_on_every_rank  # noqa: E402

STEPS = 4
CONFIGS = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    (torch.optim.Adagrad, {"lr": 0.1}),
]


def make_parameters():
    """The same on every rank: 35 + 5 float64 and 15 + 13 float32 elements (none divisible
    by 2, 3 or 4 ranks overall), a parameter that never gets a gradient, a frozen one."""
    generator = torch.Generator().manual_seed(7)

    def parameter(*shape, dtype=torch.float64, requires_grad=True):
        return torch.nn.Parameter(torch.randn(*shape, generator=generator, dtype=dtype),
                                  requires_grad=requires_grad)
    return [parameter(7, 5), parameter(5), parameter(5, 3, dtype=torch.float32),
            parameter(13, dtype=torch.float32), parameter(4, requires_grad=False)]


def groups_of(parameters):
    first, bias, second, unused, frozen = parameters
    return [{"params": [first, bias]}, {"params": [second, unused, frozen], "lr": 0.05}]


def loss_of(parameters, rank, step):
    first, bias, second, _, frozen = parameters
    data = torch.randn(6, 7, generator=torch.Generator().manual_seed(100 * step + rank),
                       dtype=torch.float64)
    hidden = torch.tanh(data @ first + bias + frozen.sum())
    return (hidden @ second.double()).pow(2).mean()  # float64 gradients stay float64


def reference_run(optimizer_class, options, steps=STEPS, passes=1, clip=None):
    """Every rank's gradient, averaged, into a plain optimizer: what large-batch training
    on one process does. ``passes``: backward passes accumulated per step; ``clip``:
    (max_norm, norm_type) for torch's clip_grad_norm_ on the averaged gradient (the norms it
    returned are kept in ``optimizer.norms``)."""
    norms = []
    parameters = make_parameters()
    optimizer = optimizer_class(groups_of(parameters), **options)
    for step in range(steps):
        grads = [torch.zeros_like(parameter) for parameter in parameters]
        for rank in range(hvd.size()):
            for parameter in parameters:
                parameter.grad = None
            for index in range(passes):
                (loss_of(parameters, rank, passes * step + index) / passes).backward()
            for total, parameter in zip(grads, parameters):
                if parameter.grad is not None:
                    total += parameter.grad
        for total, parameter in zip(grads, parameters):
            if parameter.requires_grad:
                parameter.grad = total / hvd.size()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(
                [parameter for parameter in parameters if parameter.requires_grad], *clip)))
        optimizer.step()
    optimizer.norms = norms
    return parameters, optimizer


def sharded_run(optimizer_class, options, steps=STEPS, make=None, passes=1, set_to_none=True,
                stage=True, clip=None):
    parameters = make_parameters()
    optimizer = make(parameters) if make else hvd.DistributedOptimizer(
        optimizer_class(groups_of(parameters), **options), sharded=stage,
        backward_passes_per_step=passes)
    norms = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=set_to_none)
        for index in range(passes):
            (loss_of(parameters, hvd.rank(), passes * step + index) / passes).backward()
        if clip is not None:
            norms.append(float(optimizer.clip_grad_norm_(*clip)))
        optimizer.step()
    optimizer.norms = norms
    return parameters, optimizer


def train(kind, parameters, optimizer, steps):
    """``steps`` of training with ``optimizer``: a plain torch optimizer (``kind`` "plain")
    gets the averaged gradient computed on this rank alone, any other its own rank's."""
    for step in steps:
        if kind == "plain":  # the averaged gradient, computed on this rank alone
            grads = [torch.zeros_like(parameter) for parameter in parameters]
            for rank in range(hvd.size()):
                for parameter in parameters:
                    parameter.grad = None
                loss_of(parameters, rank, step).backward()
                for total, parameter in zip(grads, parameters):
                    if parameter.grad is not None:
                        total += parameter.grad
            for total, parameter in zip(grads, parameters):
                parameter.grad = total / hvd.size() if parameter.requires_grad else None
        else:
            optimizer.zero_grad()
            loss_of(parameters, hvd.rank(), step).backward()
        optimizer.step()


# how each slice's gradients are cut into buckets, each reduce-scattered on its own as soon
# as its parameters' gradients are ready: one bucket per slice (the default's, for these
# sizes), or one per parameter (40 bytes: five float64 or ten float32 elements at most)
LAYOUTS = [("one_bucket", True, None), ("bucket_per_parameter", True, 40),
           ("stage_2", 2, 40)]


@pytest.fixture(params=LAYOUTS, ids=[name for name, _, _ in LAYOUTS])
def stage(request, monkeypatch):
    """The ``sharded=`` value of a layout, with the bucket size it sets."""
    _, stage, bucket_bytes = request.param
    if bucket_bytes is not None:
        from hororing.torch import sharded
        monkeypatch.setattr(sharded, "_BUCKET_BYTES", bucket_bytes)
    return stage


def assert_matches(parameters, expected):
    for parameter, reference in zip(parameters, expected):
        assert_identical_on_every_rank(parameter.detach().numpy())
        # the sums run in another order than the reference's; the float64 parameters see the
        # float32 one's rounding through the loss, hence 1e-7 and not float64's own precision
        tolerance = 1e-7 if parameter.dtype == torch.float64 else 1e-5
        np.testing.assert_allclose(parameter.detach().numpy(), reference.detach().numpy(),
                                   rtol=tolerance, atol=tolerance)  # parameters are O(1)
