"""hvd.checkpoint: DCP checkpoints written by every rank, read at any size, by any kind of
optimizer, and by a plain process with neither MPI nor hororing.

The reference is large-batch training on one process (sharded_reference.py): every rank's
gradient averaged into a plain torch optimizer.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import hororing.torch as hvd  # noqa: E402
from sharded_reference import (assert_matches, groups_of,  # noqa: E402,F401
                               make_parameters, reference_run, stage, train)

NAMES = ["first", "bias", "second", "unused", "frozen"]
ADAM = (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01})
KINDS = ["plain", "distributed", "sharded", "stage2", "zero"]


class Parameters(torch.nn.Module):
    """sharded_reference's parameters as a model, named (with a buffer)."""

    def __init__(self, parameters):
        super().__init__()
        for name, parameter in zip(NAMES, parameters):
            setattr(self, name, parameter)
        self.register_buffer("seen", torch.arange(3, dtype=torch.float32))


def build(kind, parameters):
    optimizer_class, options = ADAM
    if kind == "plain":
        return optimizer_class(groups_of(parameters), **options)
    if kind == "zero":
        return hvd.ZeroRedundancyOptimizer(groups_of(parameters), optimizer_class, **options)
    sharded = {"distributed": False, "sharded": True, "stage2": 2}[kind]
    return hvd.DistributedOptimizer(optimizer_class(groups_of(parameters), **options),
                                    sharded=sharded)


def trained(kind, steps=2):
    parameters = make_parameters()
    optimizer = build(kind, parameters)
    train(kind, parameters, optimizer, range(steps))
    return Parameters(parameters), parameters, optimizer


def plain_read(path):
    """The checkpoint as a process with no MPI and no hororing reads it (rank 0 runs it)."""
    out = os.path.join(path + ".pt")
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("PMI", "MPI", "HYDRA", "OMPI", "PMIX"))}
    script = ("import sys, torch\n"
              "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
              "assert 'mpi4py' not in sys.modules and 'hororing' not in sys.modules\n"
              "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", script, path, out], check=True, env=environment,
                   timeout=120)
    state = torch.load(out, weights_only=False)
    os.remove(out)
    return state


def test_a_sharded_adam_reads_back_in_a_plain_process_as_one_process_adam(directory, stage):
    model, _, optimizer = trained({True: "sharded", 2: "stage2"}[stage])
    path = os.path.join(directory, "ckpt")
    hvd.checkpoint.save(path, model, optimizer, step=2)
    if hvd.rank() == 0:
        state = plain_read(path)
        parameters, reference = reference_run(*ADAM, steps=2)
        assert state["extra"] == {"step": 2}
        assert sorted(state["model"]) == sorted(NAMES + ["seen"])
        for name, parameter in zip(NAMES, parameters):  # the reference's tolerance
            tolerance = 1e-7 if parameter.dtype == torch.float64 else 1e-5
            np.testing.assert_allclose(state["model"][name].numpy(),
                                       parameter.detach().numpy(), rtol=tolerance,
                                       atol=tolerance)
        for name, parameter in zip(NAMES, parameters):
            expected = reference.state.get(parameter)
            if expected is None:  # frozen: no state
                assert name not in state["optim"]["state"]
                continue
            saved = state["optim"]["state"][name]
            assert float(saved["step"]) == 2.0
            for key in ("exp_avg", "exp_avg_sq"):
                assert saved[key].shape == parameter.shape
                np.testing.assert_allclose(saved[key].numpy(), expected[key].numpy(),
                                           rtol=1e-6, atol=1e-9)
        assert [group["params"] for group in state["optim"]["param_groups"]] == \
            [["first", "bias"], ["second", "unused", "frozen"]]
        assert state["optim"]["param_groups"][1]["lr"] == 0.05
    hvd.barrier()


@pytest.mark.parametrize("loaded_into", KINDS)
@pytest.mark.parametrize("saved_from", KINDS)
def test_every_kind_of_optimizer_resumes_from_every_kind(directory, saved_from, loaded_into):
    # on one rank the unsharded DistributedOptimizer leaves the gradient of the parameter
    # the loss never uses as None (Adam skips it) where every other kind averages zeros
    unused = 3 if hvd.size() == 1 and "distributed" in (saved_from, loaded_into) else None
    model, _, optimizer = trained(saved_from)
    path = os.path.join(directory, "ckpt")
    hvd.checkpoint.save(path, model, optimizer, epoch=1)

    resumed = make_parameters()  # the initial values: the load must replace them
    again = build(loaded_into, resumed)
    assert hvd.checkpoint.load(path, Parameters(resumed), again) == {"epoch": 1}
    train(loaded_into, resumed, again, range(2, 4))
    expected, _ = reference_run(*ADAM, steps=4)
    assert_matches(*([value for index, value in enumerate(values) if index != unused]
                     for values in (resumed, expected)))
    full = again.gather_state_dict() if loaded_into == "zero" else again.state_dict()
    steps = [float(entry["step"]) for index, entry in full["state"].items()
             if index != unused]
    assert steps and steps == [4.0] * len(steps)


def test_extra_values_come_back_as_saved(directory):
    model, _, optimizer = trained("sharded")
    extra = {"step": 7, "sampler": {"epoch": 2, "seen": [1, 5, 9]},
             "scale": torch.tensor([0.5, 2.0], dtype=torch.float64), "name": "run-a"}
    path = os.path.join(directory, "ckpt")
    hvd.checkpoint.save(path, model, optimizer, **extra)
    resumed = make_parameters()
    loaded = hvd.checkpoint.load(path, Parameters(resumed), build("sharded", resumed))
    assert sorted(loaded) == sorted(extra)
    assert torch.equal(loaded.pop("scale"), extra.pop("scale"))
    assert loaded == extra


def test_a_model_alone_and_a_ddp_wrapped_one_share_their_names(directory):
    model, parameters, _ = trained("distributed")
    path = os.path.join(directory, "ckpt")
    hvd.checkpoint.save(path, model)
    if dist.is_initialized():  # DDP wraps the model; the checkpoint names its module's
        wrapped = torch.nn.parallel.DistributedDataParallel(Parameters(make_parameters()))
        hvd.checkpoint.load(path, wrapped)
        for name, value in zip(NAMES, parameters):
            assert torch.equal(getattr(wrapped.module, name).detach(), value.detach())


def test_async_save_writes_the_state_of_its_call_while_training_goes_on(directory):
    model, parameters, optimizer = trained("sharded")
    path = os.path.join(directory, "ckpt")
    first = hvd.checkpoint.async_save(path, model, optimizer, step=2)
    train("sharded", parameters, optimizer, range(2, 4))  # during the background write
    second = hvd.checkpoint.async_save(path + "-4", model, optimizer, step=4)  # waits first
    assert first.done()
    second.wait()
    first.wait()  # already waited for: returns at once
    for where, steps in ((path, 2), (path + "-4", 4)):
        resumed = make_parameters()
        again = build("sharded", resumed)
        assert hvd.checkpoint.load(where, Parameters(resumed), again) == {"step": steps}
        expected, _ = reference_run(*ADAM, steps=steps)
        assert_matches(resumed, expected)
        train("sharded", resumed, again, range(steps, steps + 1))
        expected, _ = reference_run(*ADAM, steps=steps + 1)
        assert_matches(resumed, expected)


@pytest.fixture
def held_staging(monkeypatch):
    """An async save's thread holds its copy of the parameters and optimizer state until
    ``release`` is set (a timer sets it after 0.3 s: nothing can wait forever)."""
    import threading

    import hororing.torch.checkpoint as checkpoint
    release = threading.Event()
    copy_later = checkpoint._copy_later

    def held(later):
        release.wait(60)
        return copy_later(later)
    monkeypatch.setattr(checkpoint, "_copy_later", held)
    timer = threading.Timer(0.3, release.set)
    yield release, timer
    release.set()
    timer.cancel()


@pytest.mark.parametrize("kind", ["distributed", "sharded", "stage2"])
def test_a_step_waits_for_the_async_saves_copy_of_the_state_of_its_call(directory, kind,
                                                                          held_staging):
    release, timer = held_staging
    model, parameters, optimizer = trained(kind)
    path = os.path.join(directory, "ckpt")
    handle = hvd.checkpoint.async_save(path, model, optimizer, step=2)
    assert not handle.staged()  # the parameters and the state are not copied yet
    timer.start()
    train(kind, parameters, optimizer, range(2, 4))  # its first step waits for the copy
    assert handle.staged()
    handle.wait()
    resumed = make_parameters()
    again = build(kind, resumed)
    assert hvd.checkpoint.load(path, Parameters(resumed), again) == {"step": 2}
    expected, _ = reference_run(*ADAM, steps=2)
    # the unused parameter on one rank: see test_every_kind_of_optimizer_resumes_from_every_kind
    unused = 3 if hvd.size() == 1 and kind == "distributed" else None
    assert_matches(*([value for index, value in enumerate(values) if index != unused]
                     for values in (resumed, expected)))


def test_a_tensor_changed_outside_step_before_it_was_staged_fails_the_save_on_every_rank(
        directory, held_staging):
    release, _ = held_staging
    model, parameters, optimizer = trained("sharded")
    path = os.path.join(directory, "ckpt")
    handle = hvd.checkpoint.async_save(path, model, optimizer, step=2)
    if hvd.rank() == 0:
        with torch.no_grad():
            parameters[0].add_(1.0)  # in place, not by the optimizer's step
    release.set()
    expect_refusal(handle.wait, "changed in place after async_save", "wait_staged")
    assert not os.path.exists(path)


def test_a_save_replaces_the_previous_checkpoint_only_once_complete(directory):
    model, parameters, optimizer = trained("distributed")
    path = os.path.join(directory, "ckpt")
    hvd.checkpoint.save(path, model, optimizer, step=2)
    train("distributed", parameters, optimizer, range(2, 3))
    hvd.checkpoint.save(path, model, optimizer, step=3)
    assert not os.path.exists(path + ".saving") and not os.path.exists(path + ".old")
    resumed = make_parameters()
    assert hvd.checkpoint.load(path, Parameters(resumed),
                               build("distributed", resumed)) == {"step": 3}


def expect_refusal(call, *words):
    """Every rank raises ValueError naming ``words`` (no rank goes on into a collective)."""
    with pytest.raises(ValueError) as raised:
        call()
    for word in words:
        assert word in str(raised.value), str(raised.value)
    hvd.barrier()


def test_a_checkpoint_of_another_model_is_refused_naming_the_keys(directory):
    model, _, optimizer = trained("sharded")
    path = os.path.join(directory, "ckpt")
    hvd.checkpoint.save(path, model, optimizer)

    other = Parameters(make_parameters())
    other.extra_layer = torch.nn.Linear(2, 2)
    expect_refusal(lambda: hvd.checkpoint.load(path, other), "missing from the checkpoint",
                   "extra_layer.weight", "extra_layer.bias")

    wider = make_parameters()
    wider[1] = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
    expect_refusal(lambda: hvd.checkpoint.load(path, Parameters(wider)),
                   "bias: saved (5,), this model's (6,)")

    fewer = torch.nn.Module()
    fewer.first = torch.nn.Parameter(torch.zeros(7, 5, dtype=torch.float64))
    expect_refusal(lambda: hvd.checkpoint.load(path, fewer), "not in this model",
                   "second", "frozen", "seen")


def test_a_torn_checkpoint_is_named_and_not_loaded(directory):
    model, _, optimizer = trained("sharded")
    path = os.path.join(directory, "ckpt")
    hvd.checkpoint.save(path, model, optimizer)
    fresh = Parameters(make_parameters())
    before = [parameter.detach().clone() for parameter in fresh.parameters()]

    if hvd.rank() == 0:  # a shard cut short
        shutil.copytree(path, path + "-cut")
        data = sorted(name for name in os.listdir(path + "-cut") if name.endswith(".distcp"))
        victim = os.path.join(path + "-cut", data[-1])
        with open(victim, "r+b") as file:
            file.truncate(os.path.getsize(victim) // 2)
    hvd.barrier()
    expect_refusal(lambda: hvd.checkpoint.load(path + "-cut", fresh), "is torn", ".distcp")

    if hvd.rank() == 0:  # what a rank that died while saving leaves: no metadata, unpublished
        shutil.copytree(path, path + "-torn.saving")
        os.remove(os.path.join(path + "-torn.saving", ".metadata"))
    hvd.barrier()
    expect_refusal(lambda: hvd.checkpoint.load(path + "-torn", fresh), "did not finish",
                   "-torn.saving")
    expect_refusal(lambda: hvd.checkpoint.load(path + "-torn.saving", fresh),
                   "not a complete checkpoint")
    for parameter, value in zip(fresh.parameters(), before):
        assert torch.equal(parameter.detach(), value)


def test_a_directory_that_is_not_a_checkpoint_is_left_alone(directory):
    model, _, optimizer = trained("distributed")
    kept = os.path.join(directory, "results")
    if hvd.rank() == 0:
        os.makedirs(kept)
        with open(os.path.join(kept, "notes.txt"), "w") as file:
            file.write("keep me")
    hvd.barrier()
    expect_refusal(lambda: hvd.checkpoint.save(kept, model, optimizer),
                   "holds no checkpoint")
    assert os.listdir(kept) == ["notes.txt"]


def test_an_optimizer_over_parameters_not_in_the_model_is_refused(directory):
    model, _, optimizer = trained("distributed")
    stranger = torch.nn.Parameter(torch.zeros(3))
    optimizer.add_param_group({"params": [stranger]})
    with pytest.raises(ValueError, match="not in the model"):
        hvd.checkpoint.save(os.path.join(directory, "ckpt"), model, optimizer)


def test_saves_and_loads_leave_the_engines_response_cache_to_training(directory):
    # a save's object gathers differ in size each time: cached, they would fill the cache
    # that a training loop's repeated names need (a full cache keeps nothing new)
    from hororing.context import current
    cache = current().engine.cycle.negotiator.cache
    model, parameters, optimizer = trained("sharded")
    path = os.path.join(directory, "ckpt")
    hvd.checkpoint.save(path, model, optimizer, step=0)
    hvd.checkpoint.load(path, model, optimizer)
    before = len(cache._entries)
    for number in range(3):
        train("sharded", parameters, optimizer, range(number, number + 1))
        hvd.checkpoint.save(path, model, optimizer, step=number, log=list(range(number * 50)))
        hvd.checkpoint.load(path, model, optimizer)
    assert len(cache._entries) == before


def test_an_optimizer_of_some_ranks_only_is_refused_before_any_collective(directory):
    if hvd.size() < 3:
        pytest.skip("needs a process set of some ranks, not all")
    subset = hvd.add_process_set([0, 1])
    try:
        if subset.included():  # the other ranks call nothing: no collective may start
            model, parameters, _ = trained("plain")
            optimizer = hvd.DistributedOptimizer(torch.optim.SGD(parameters, lr=0.1),
                                                 process_set=subset)
            with pytest.raises(ValueError, match="process_set has 2 of the 3 ranks"):
                hvd.checkpoint.save(os.path.join(directory, "ckpt"), model, optimizer)
    finally:
        hvd.barrier()
        hvd.remove_process_set(subset)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_async_save_stages_every_dtype_bit_for_bit(directory, dtype):
    """The staging copy is a byte copy (bfloat16 included, which numpy has not): what is read
    back equals what was there at the call, even though the model changes right after."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)).to(dtype)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    path = os.path.join(directory, f"ckpt-{str(dtype)[6:]}")
    handle = hvd.checkpoint.async_save(path, model, step=1)
    with torch.no_grad():  # after the call: not in the checkpoint
        for parameter in model.parameters():
            parameter.add_(1)
    handle.wait()
    fresh = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)).to(dtype)
    assert hvd.checkpoint.load(path, fresh) == {"step": 1}
    for name, value in fresh.state_dict().items():
        assert value.dtype == dtype and torch.equal(value, saved[name]), name
