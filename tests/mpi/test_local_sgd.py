"""hvd.LocalSGD and hvd.DiLoCo against a simulation of every rank on one process: each rank
trains alone on its own batches, and the syncs are computed from all of them here."""

import copy
import os

import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402
from hororing.periodic import cut  # noqa: E402
from reference import int8_mean  # noqa: E402


def make_model(seed=5):
    torch.manual_seed(seed + hvd.rank())  # every rank its own: rank 0's must win
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(),
                               torch.nn.Linear(9, 2)).double()


def loss_of(model, rank, step):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    target = torch.randn(5, 2, generator=generator, dtype=torch.float64)
    return torch.nn.functional.mse_loss(model(data), target)


def rank0_model():
    """Rank 0's initial model, as every rank starts from it."""
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(),
                               torch.nn.Linear(9, 2)).double()


def assert_parameters(model, expected, tolerance=1e-12):
    for parameter, wanted in zip(model.parameters(), expected):
        torch.testing.assert_close(parameter.detach(), wanted, rtol=tolerance, atol=tolerance)


def mean(tensors):
    return sum(tensors) / len(tensors)


def average_models(models):
    with torch.no_grad():
        for parameters in zip(*(model.parameters() for model in models)):
            average = mean([parameter.detach().clone() for parameter in parameters])
            for parameter in parameters:
                parameter.copy_(average)


def simulate_local_sgd(steps, sync_every, warmup, sync_now=False):
    models = [rank0_model() for _ in range(hvd.size())]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) for model in models]
    for step in range(steps):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
        if step < warmup:
            for parameters in zip(*(model.parameters() for model in models)):
                average = mean([parameter.grad for parameter in parameters])
                for parameter in parameters:
                    parameter.grad = average.clone()
        for optimizer in optimizers:
            optimizer.step()
        if step + 1 > warmup and (step + 1 - warmup) % sync_every == 0:
            average_models(models)
    if sync_now and steps > warmup:
        average_models(models)
    return [parameter.detach() for parameter in models[hvd.rank()].parameters()]


@pytest.mark.parametrize("sync_every,warmup", [(1, 0), (3, 0), (4, 2)])
def test_local_sgd_averages_the_parameters_every_h_steps(sync_every, warmup):
    model = make_model()
    optimizer = hvd.LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             sync_every=sync_every, warmup_steps=warmup)
    steps = 7
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(model, hvd.rank(), step).backward()
        optimizer.step()
    # between syncs each rank has its own parameters; 7 steps end off a sync unless H = 1
    assert_parameters(model, simulate_local_sgd(steps, sync_every, warmup))


def assert_same_on_every_rank(model):
    mine = [parameter.detach().clone() for parameter in model.parameters()]
    for theirs in hvd.allgather_object(mine, name="test.same_on_every_rank"):
        assert_parameters(model, theirs, tolerance=0)


def test_local_sgd_sync_now_averages_off_the_schedule_once():
    model = make_model()
    optimizer = hvd.LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             sync_every=3, warmup_steps=1)
    for step in range(8):
        optimizer.zero_grad()
        loss_of(model, hvd.rank(), step).backward()
        optimizer.step()
    optimizer.sync_now()
    assert_parameters(model, simulate_local_sgd(8, 3, 1, sync_now=True))
    assert_same_on_every_rank(model)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    optimizer.sync_now()  # averaged at this step already: nothing moves
    assert_parameters(model, before, tolerance=0)


def fragments_of(parameters, count):
    return [[parameters[position] for position in run]
            for run in cut([parameter.numel() for parameter in parameters], count)]


def simulate_diloco(steps, sync_every, fragments, overlap=False, sync_now=False, int8=False):
    models = [rank0_model() for _ in range(hvd.size())]
    residuals = {}  # position -> each rank's residual (int8)
    inner = [torch.optim.AdamW(model.parameters(), lr=0.01) for model in models]
    global_model = rank0_model()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    cut = fragments_of(list(global_model.parameters()), fragments)
    index = {id(parameter): position for position, parameter in
             enumerate(global_model.parameters())}

    def of(model, position):
        return list(model.parameters())[position]

    def apply(positions, members, changes, sent):
        """The outer step of one fragment; each model goes on from it, plus what it gained
        since ``sent`` (its parameters when the changes were taken; None: nothing since)."""
        for parameter in global_model.parameters():
            parameter.grad = None
        for parameter, change in zip(members, changes):
            parameter.grad = change
        outer.step()
        with torch.no_grad():
            for rank, model in enumerate(models):
                for number, (position, parameter) in enumerate(zip(positions, members)):
                    gained = 0 if sent is None else of(model, position) - sent[rank][number]
                    of(model, position).copy_(parameter + gained)

    def sync(members, overlapped):
        positions = [index[id(parameter)] for parameter in members]
        if int8:
            changes = [torch.from_numpy(int8_mean(
                [(parameter.detach() - of(model, position).detach()).numpy()
                 for model in models],
                residuals.setdefault(position, [0.0] * len(models))))
                for position, parameter in zip(positions, members)]
        else:
            changes = [mean([parameter.detach() - of(model, position).detach()
                             for model in models])
                       for position, parameter in zip(positions, members)]
        if overlapped:
            sent = [[of(model, position).detach().clone() for position in positions]
                    for model in models]
            pending.append((positions, members, changes, sent))
        else:
            apply(positions, members, changes, None)

    def due(step, number):
        return step % sync_every == (number + 1) * sync_every // fragments % sync_every

    pending = []
    for step in range(1, steps + 1):
        for rank, (model, optimizer) in enumerate(zip(models, inner)):
            optimizer.zero_grad()
            loss_of(model, rank, step - 1).backward()
            optimizer.step()
        for waiting in pending:
            apply(*waiting)
        pending = []
        for number, members in enumerate(cut):
            if due(step, number):
                sync(members, overlap)
    for waiting in pending:
        apply(*waiting)
    if sync_now:
        for number, members in enumerate(cut):
            if not due(steps, number):
                sync(members, False)
    return [parameter.detach() for parameter in models[hvd.rank()].parameters()]


def diloco(model, sync_every, fragments, compression=hvd.Compression.none, overlap=False,
           int8=False):
    return hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                      torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True),
                      sync_every=sync_every, fragments=fragments, compression=compression,
                      overlap=overlap, int8=int8)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
@pytest.mark.parametrize("sync_every,fragments", [(1, 1), (3, 1), (4, 2), (3, 4)])
def test_diloco_steps_the_outer_optimizer_with_the_averaged_change(sync_every, fragments,
                                                                   overlap):
    model = make_model()
    optimizer = diloco(model, sync_every, fragments, overlap=overlap)
    steps = 9
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(model, hvd.rank(), step).backward()
        optimizer.step()
    optimizer.synchronize()
    assert_parameters(model, simulate_diloco(steps, sync_every, fragments, overlap),
                      tolerance=1e-10)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
@pytest.mark.parametrize("steps", [7, 8])
def test_diloco_sync_now_syncs_every_fragment_not_synced_at_this_step(steps, overlap):
    model = make_model()
    optimizer = diloco(model, 4, 3, overlap=overlap)  # fragments due at steps 1, 2, 0 mod 4
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(model, hvd.rank(), step).backward()
        optimizer.step()
    optimizer.sync_now()
    assert_parameters(model, simulate_diloco(steps, 4, 3, overlap, sync_now=True),
                      tolerance=1e-10)
    assert_same_on_every_rank(model)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    optimizer.sync_now()  # every fragment synced at this step: an outer step would still move
    assert_parameters(model, before, tolerance=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_diloco_in_16_bits_stays_near_the_exact_one(overlap):
    exact, rounded = make_model(), make_model()
    optimizers = [diloco(exact, 3, 2, overlap=overlap),
                  diloco(rounded, 3, 2, hvd.Compression.fp16, overlap=overlap)]
    for step in range(6):
        for model, optimizer in zip((exact, rounded), optimizers):
            optimizer.zero_grad()
            loss_of(model, hvd.rank(), step).backward()
            optimizer.step()
    for optimizer in optimizers:
        optimizer.synchronize()
    assert_parameters(rounded, [parameter.detach() for parameter in exact.parameters()],
                      tolerance=5e-3)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
@pytest.mark.parametrize("sync_every,fragments", [(1, 1), (3, 1), (4, 2)])
def test_diloco_in_int8_sends_what_the_reference_sends_and_keeps_the_rest(sync_every,
                                                                          fragments, overlap):
    model = make_model()
    optimizer = diloco(model, sync_every, fragments, overlap=overlap, int8=True)
    for step in range(9):
        optimizer.zero_grad()
        loss_of(model, hvd.rank(), step).backward()
        optimizer.step()
    optimizer.synchronize()
    assert_parameters(model, simulate_diloco(9, sync_every, fragments, overlap, int8=True),
                      tolerance=1e-10)


@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
def test_a_state_dict_resumes_diloco_exactly(int8):
    model = make_model()
    optimizer = diloco(model, 3, 2, int8=int8)
    for step in range(4):
        optimizer.zero_grad()
        loss_of(model, hvd.rank(), step).backward()
        optimizer.step()
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    resumed_model = make_model(seed=11)
    resumed = diloco(resumed_model, 3, 2, int8=int8)
    resumed_model.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    for step in range(4, 9):
        for one, opt in ((model, optimizer), (resumed_model, resumed)):
            opt.zero_grad()
            loss_of(one, hvd.rank(), step).backward()
            opt.step()
    assert_parameters(resumed_model, [parameter.detach() for parameter in model.parameters()],
                      tolerance=0)


def test_bad_arguments_are_named():
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with pytest.raises(ValueError, match="sync_every must be an integer >= 1"):
        hvd.LocalSGD(model, inner, sync_every=0)
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
        hvd.LocalSGD(model, inner, sync_every=2, warmup_steps=-1)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="outer optimizer must be over the model's trained "
                                         "parameters: it holds 2 that are not the model's"):
        hvd.DiLoCo(model, inner, torch.optim.SGD(other.parameters(), lr=0.7), sync_every=2)
    with pytest.raises(ValueError, match="fragments must be an integer from 1 to the model's 4"):
        hvd.DiLoCo(model, inner, outer, sync_every=2, fragments=5)
    with pytest.raises(ValueError, match="Compression.none, .fp16 or .bf16"):
        hvd.DiLoCo(model, inner, outer, sync_every=2, compression="int8")
    with pytest.raises(ValueError, match="int8=True sends int8 rows: leave compression"):
        hvd.DiLoCo(model, inner, outer, sync_every=2, compression=hvd.Compression.fp16,
                   int8=True)


def periodic(kind, model):
    if kind == "LocalSGD":
        return hvd.LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            sync_every=3)
    return diloco(model, 3, 2, overlap=kind == "DiLoCo-overlapped", int8=kind == "DiLoCo-int8")


def train(model, optimizer, steps):
    for step in steps:
        optimizer.zero_grad()
        loss_of(model, hvd.rank(), step).backward()
        optimizer.step()


@pytest.mark.parametrize("kind", ["LocalSGD", "DiLoCo", "DiLoCo-overlapped", "DiLoCo-int8"])
def test_a_checkpoint_between_syncs_resumes_every_rank_where_it_was(directory, kind):
    # saved after step 4 of syncs every 3 steps: each rank's parameters and inner state are
    # its own, and training from the checkpoint goes on as training that never stopped
    model = make_model()
    optimizer = periodic(kind, model)
    train(model, optimizer, range(4))
    path = os.path.join(directory, "ckpt")
    hvd.checkpoint.save(path, model, optimizer, step=4)
    resumed_model = make_model(seed=11)
    resumed = periodic(kind, resumed_model)
    assert hvd.checkpoint.load(path, resumed_model, resumed) == {"step": 4}
    if kind != "DiLoCo-overlapped":  # (the save lands its sync in flight, as synchronize())
        assert_parameters(resumed_model, [parameter.detach() for parameter in
                                          model.parameters()], tolerance=0)
    if hvd.size() > 1:  # between syncs the ranks differ: each read its own entry
        ranks = hvd.allgather_object([parameter.detach() for parameter in
                                      resumed_model.parameters()])
        assert any(not torch.equal(mine, theirs) for mine, theirs in zip(ranks[0], ranks[1]))
    train(model, optimizer, range(4, 9))
    train(resumed_model, resumed, range(4, 9))
    for one in (optimizer, resumed):
        getattr(one, "synchronize", lambda: None)()
    assert_parameters(resumed_model, [parameter.detach() for parameter in model.parameters()],
                      tolerance=0)


@pytest.mark.parametrize("kind", ["LocalSGD", "DiLoCo"])
def test_an_async_save_holds_the_state_of_its_call_while_training_goes_on(directory, kind):
    model = make_model()
    optimizer = periodic(kind, model)
    train(model, optimizer, range(4))
    at_call = [parameter.detach().clone() for parameter in model.parameters()]
    path = os.path.join(directory, "ckpt")
    handle = hvd.checkpoint.async_save(path, model, optimizer, step=4)
    train(model, optimizer, range(4, 7))  # a sync (step 6) while the save is in flight
    handle.wait()
    resumed_model = make_model(seed=11)
    resumed = periodic(kind, resumed_model)
    assert hvd.checkpoint.load(path, resumed_model, resumed) == {"step": 4}
    assert_parameters(resumed_model, at_call, tolerance=0)
    assert resumed.steps == 4


def test_a_checkpoint_is_read_only_by_the_kind_that_saved_it(directory):
    model = make_model()
    path = os.path.join(directory, "ckpt")
    hvd.checkpoint.save(path, model, periodic("DiLoCo", model))
    with pytest.raises(ValueError, match="saved with DiLoCo, and LocalSGD reads only"):
        hvd.checkpoint.load(path, model, periodic("LocalSGD", model))
    with pytest.raises(ValueError, match="saved with DiLoCo, each rank's model and optimizer "
                                         "state under its rank: load it with that optimizer"):
        hvd.checkpoint.load(path, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="saved with DiLoCo, each rank's model"):
        hvd.checkpoint.load(path, model)
    plain = os.path.join(directory, "plain")
    hvd.checkpoint.save(plain, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="saved with neither LocalSGD nor DiLoCo .* load the "
                                         "model alone"):
        hvd.checkpoint.load(plain, model, periodic("DiLoCo", model))
    with pytest.raises(ValueError, match="save it with hvd.checkpoint.save"):
        hvd.checkpoint.save_optimizer(plain, periodic("LocalSGD", model))
