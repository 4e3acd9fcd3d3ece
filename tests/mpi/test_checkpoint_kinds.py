"""Every kind of optimizer checkpoint resumes in every kind of optimizer: a plain torch
optimizer, hvd.DistributedOptimizer, DistributedOptimizer(sharded=True) and
ZeroRedundancyOptimizer. Two steps, a state_dict written and read back as a file is, a fresh
model and optimizer of another kind loading it, two more steps: the parameters and Adam's
step count as four steps of large-batch training on one process (sharded_reference.py).
"""

import io

import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402
from sharded_reference import (assert_matches, groups_of,  # noqa: E402
                               make_parameters, reference_run, train)

KINDS = ["plain", "distributed", "sharded", "zero"]
OPTIMIZERS = [(torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
              (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True})]


def build(kind, parameters, optimizer_class, options):
    if kind == "plain":
        return optimizer_class(groups_of(parameters), **options)
    if kind == "zero":
        return hvd.ZeroRedundancyOptimizer(groups_of(parameters), optimizer_class, **options)
    return hvd.DistributedOptimizer(optimizer_class(groups_of(parameters), **options),
                                    sharded=kind == "sharded")


def full_state(kind, optimizer):
    """The optimizer's whole state as a user saves it, read back from the bytes of a file."""
    if kind == "zero":
        optimizer.consolidate_state_dict(to=0)
        state = hvd.broadcast_object(optimizer.state_dict() if hvd.rank() == 0 else None,
                                     root_rank=0)
    else:
        state = optimizer.state_dict()
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    return torch.load(saved)


@pytest.mark.parametrize("optimizer_class,options", OPTIMIZERS,
                         ids=[cls.__name__ for cls, _ in OPTIMIZERS])
@pytest.mark.parametrize("loaded_into", KINDS)
@pytest.mark.parametrize("saved_from", KINDS)
def test_a_checkpoint_resumes_in_every_kind_of_optimizer(saved_from, loaded_into,
                                                         optimizer_class, options):
    # on one rank the unsharded DistributedOptimizer reduces nothing and, as Horovod's, leaves
    # the gradient of a parameter the loss never used as None (Adam then skips it), where
    # large-batch training and every other kind give it zeros (Adam's weight decay moves it)
    unused = 3 if hvd.size() == 1 and "distributed" in (saved_from, loaded_into) else None
    parameters = make_parameters()
    optimizer = build(saved_from, parameters, optimizer_class, options)
    train(saved_from, parameters, optimizer, range(2))
    state = full_state(saved_from, optimizer)
    assert steps_of(state, unused) == [2.0] * len(steps_of(state, unused)) != []

    resumed = make_parameters()
    with torch.no_grad():
        for parameter, value in zip(resumed, parameters):
            parameter.copy_(value)
    again = build(loaded_into, resumed, optimizer_class, options)
    again.load_state_dict(state)
    train(loaded_into, resumed, again, range(2, 4))

    expected, _ = reference_run(optimizer_class, options, steps=4)
    assert_matches(*(([value for index, value in enumerate(values) if index != unused])
                     for values in (resumed, expected)))
    # Adam counts its steps in a tensor per parameter, in place: a tensor shared between
    # parameters would count once per parameter that holds it
    after = full_state(loaded_into, again)
    assert steps_of(after, unused) == [4.0] * len(steps_of(after, unused)) != []


def steps_of(state, unused):
    return [entry["step"].item() for index, entry in sorted(state["state"].items())
            if index != unused]
