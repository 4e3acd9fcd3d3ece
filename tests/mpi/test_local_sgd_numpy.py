"""hvd.LocalSGD and hvd.DiLoCo over numpy optimizers against a simulation of every rank on
one process: each rank trains alone on its own batches, and the syncs are computed here from
all of them."""

import numpy as np
import pytest

import hororing as hvd
from hororing.optim import SGD
from hororing.periodic import cut
from reference import int8_mean

SHAPES = {"w1": (6, 9), "b1": (9,), "w2": (9, 2), "b2": (2,)}


def initial(seed):
    generator = np.random.default_rng(seed)
    return {name: generator.standard_normal(shape) * 0.5 for name, shape in SHAPES.items()}


def own_params():
    """Every rank its own start: rank 0's must win."""
    return initial(5 + hvd.rank())


def gradients(params, rank, step):
    """The mean squared error's gradients of a tanh layer and a linear one, on a batch that
    rank ``rank`` draws at ``step``."""
    generator = np.random.default_rng(1000 * step + rank)
    inputs, targets = generator.standard_normal((5, 6)), generator.standard_normal((5, 2))
    hidden = np.tanh(inputs @ params["w1"] + params["b1"])
    error = 2 * (hidden @ params["w2"] + params["b2"] - targets) / targets.size
    back = error @ params["w2"].T * (1 - hidden ** 2)
    return {"w1": inputs.T @ back, "b1": back.sum(0), "w2": hidden.T @ error,
            "b2": error.sum(0)}


def train(optimizer, steps, first=0):
    for step in range(first, steps):
        for name, grad in gradients(optimizer.params, hvd.rank(), step).items():
            optimizer.grads[name][...] = grad
        optimizer.step()


def assert_params(params, expected, tolerance=1e-12):
    for name in SHAPES:
        np.testing.assert_allclose(params[name], expected[name], rtol=tolerance, atol=tolerance)


def assert_same_on_every_rank(params):
    for theirs in hvd.allgather_object(params, name="test.numpy_same_on_every_rank"):
        assert_params(params, theirs, tolerance=0)


def average(all_params, names=SHAPES):
    for name in names:
        mean = sum(params[name] for params in all_params) / len(all_params)
        for params in all_params:
            params[name][...] = mean


def simulate_local_sgd(steps, sync_every, warmup, sync_now=False):
    models = [initial(5) for _ in range(hvd.size())]
    inner = [SGD(params, lr=0.1, momentum=0.9) for params in models]
    for step in range(steps):
        all_grads = [gradients(params, rank, step) for rank, params in enumerate(models)]
        if step < warmup:
            for name in SHAPES:
                mean = sum(grads[name] for grads in all_grads) / len(all_grads)
                for grads in all_grads:
                    grads[name] = mean
        for optimizer, grads in zip(inner, all_grads):
            for name in SHAPES:
                optimizer.grads[name][...] = grads[name]
            optimizer.step()
        if step + 1 > warmup and (step + 1 - warmup) % sync_every == 0:
            average(models)
    if sync_now and steps > warmup:
        average(models)
    return models[hvd.rank()]


def local_sgd(sync_every, warmup=0):
    params = own_params()
    return hvd.LocalSGD(SGD(params, lr=0.1, momentum=0.9), sync_every=sync_every,
                        warmup_steps=warmup)


@pytest.mark.parametrize("sync_every,warmup", [(1, 0), (3, 0), (4, 2)])
def test_local_sgd_averages_the_parameters_every_h_steps(sync_every, warmup):
    optimizer = local_sgd(sync_every, warmup)
    train(optimizer, 7)
    assert_params(optimizer.params, simulate_local_sgd(7, sync_every, warmup))
    optimizer.sync_now()
    assert_params(optimizer.params, simulate_local_sgd(7, sync_every, warmup, sync_now=True))
    assert_same_on_every_rank(optimizer.params)


def simulate_diloco(steps, sync_every, fragments, overlap=False, sync_now=False, int8=False):
    models = [initial(5) for _ in range(hvd.size())]
    residuals = {name: [np.zeros(shape) for _ in models] for name, shape in SHAPES.items()}
    inner = [SGD(params, lr=0.05, momentum=0.9) for params in models]
    global_params = initial(5)
    outer = SGD(global_params, lr=0.7, momentum=0.9, nesterov=True)
    names = list(SHAPES)
    runs = [[names[position] for position in run]
            for run in cut([int(np.prod(SHAPES[name])) for name in names], fragments)]
    velocity = {name: np.zeros(shape) for name, shape in SHAPES.items()}

    def outer_step(members, changes):
        """Nesterov SGD on the fragment's global parameters, written out."""
        for name, change in zip(members, changes):
            velocity[name] = outer.momentum * velocity[name] + change
            global_params[name] -= outer.lr * (change + outer.momentum * velocity[name])

    def apply(members, changes, sent):
        outer_step(members, changes)
        for rank, params in enumerate(models):
            for number, name in enumerate(members):
                gained = 0 if sent is None else params[name] - sent[rank][number]
                params[name][...] = global_params[name] + gained

    def sync(members, overlapped):
        if int8:
            changes = [int8_mean([global_params[name] - params[name] for params in models],
                                 residuals[name]) for name in members]
        else:
            changes = [sum(global_params[name] - params[name] for params in models)
                       / len(models) for name in members]
        if overlapped:
            pending.append((members, changes,
                            [[params[name].copy() for name in members] for params in models]))
        else:
            apply(members, changes, None)

    def due(step, number):
        return step % sync_every == (number + 1) * sync_every // fragments % sync_every

    pending = []
    for step in range(1, steps + 1):
        for rank, (params, optimizer) in enumerate(zip(models, inner)):
            for name, grad in gradients(params, rank, step - 1).items():
                optimizer.grads[name][...] = grad
            optimizer.step()
        for waiting in pending:
            apply(*waiting)
        pending = []
        for number, members in enumerate(runs):
            if due(step, number):
                sync(members, overlap)
    for waiting in pending:
        apply(*waiting)
    if sync_now:
        for number, members in enumerate(runs):
            if not due(steps, number):
                sync(members, False)
    return models[hvd.rank()]


def diloco(sync_every, fragments, compression=hvd.Compression.none, overlap=False,
           params=None, int8=False):
    params = own_params() if params is None else params
    return hvd.DiLoCo(SGD(params, lr=0.05, momentum=0.9),
                      SGD(params, lr=0.7, momentum=0.9, nesterov=True),
                      sync_every=sync_every, fragments=fragments, compression=compression,
                      overlap=overlap, int8=int8)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
@pytest.mark.parametrize("sync_every,fragments", [(1, 1), (3, 1), (4, 2), (3, 4)])
def test_diloco_steps_the_outer_optimizer_with_the_averaged_change(sync_every, fragments,
                                                                   overlap):
    optimizer = diloco(sync_every, fragments, overlap=overlap)
    train(optimizer, 9)
    optimizer.synchronize()
    assert_params(optimizer.params, simulate_diloco(9, sync_every, fragments, overlap))


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
@pytest.mark.parametrize("steps", [7, 8])
def test_diloco_sync_now_syncs_every_fragment_not_synced_at_this_step(steps, overlap):
    optimizer = diloco(4, 3, overlap=overlap)  # fragments due at steps 1, 2, 0 mod 4
    train(optimizer, steps)
    optimizer.sync_now()
    assert_params(optimizer.params, simulate_diloco(steps, 4, 3, overlap, sync_now=True))
    assert_same_on_every_rank(optimizer.params)
    before = {name: value.copy() for name, value in optimizer.params.items()}
    optimizer.sync_now()  # every fragment synced at this step: an outer step would move them
    assert_params(optimizer.params, before, tolerance=0)


def test_diloco_in_16_bits_stays_near_the_exact_one():
    exact, rounded = diloco(3, 2), diloco(3, 2, hvd.Compression.fp16)
    train(exact, 6)
    train(rounded, 6)
    assert_params(rounded.params, exact.params, tolerance=5e-3)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
@pytest.mark.parametrize("sync_every,fragments", [(1, 1), (3, 1), (4, 2)])
def test_diloco_in_int8_sends_what_the_reference_sends_and_keeps_the_rest(sync_every,
                                                                          fragments, overlap):
    optimizer = diloco(sync_every, fragments, overlap=overlap, int8=True)
    train(optimizer, 9)
    optimizer.synchronize()
    assert_params(optimizer.params, simulate_diloco(9, sync_every, fragments, overlap,
                                                    int8=True))
    exact = diloco(sync_every, fragments, overlap=overlap)
    train(exact, 9)
    exact.synchronize()
    assert_params(optimizer.params, exact.params, tolerance=2e-2)


@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
def test_a_state_dict_resumes_diloco_exactly(int8):
    optimizer = diloco(3, 2, int8=int8)
    train(optimizer, 4)
    saved = ({name: value.copy() for name, value in optimizer.params.items()},
             optimizer.state_dict(), optimizer.optimizer._velocity,
             optimizer.outer_optimizer._velocity)
    resumed = diloco(3, 2, params=initial(11), int8=int8)
    for name, value in saved[0].items():
        resumed.params[name][...] = value
    resumed.load_state_dict(saved[1])
    for mine, theirs in ((resumed.optimizer, saved[2]), (resumed.outer_optimizer, saved[3])):
        for name, value in theirs.items():
            mine._velocity[name][...] = value
    train(optimizer, 9, first=4)
    train(resumed, 9, first=4)
    assert_params(resumed.params, optimizer.params, tolerance=0)


def test_nesterov_sgd_is_torchs():
    torch = pytest.importorskip("torch")
    params = initial(3)
    theirs = {name: torch.tensor(value, requires_grad=True) for name, value in params.items()}
    mine = SGD({name: value.copy() for name, value in params.items()}, lr=0.3, momentum=0.8,
               nesterov=True)
    reference = torch.optim.SGD(list(theirs.values()), lr=0.3, momentum=0.8, nesterov=True)
    for step in range(4):
        grads = gradients(mine.params, 0, step)
        for name, grad in grads.items():
            mine.grads[name][...] = grad
            theirs[name].grad = torch.tensor(grad)
        mine.step()
        reference.step()
    assert_params(mine.params, {name: value.detach().numpy() for name, value in theirs.items()})


def test_bad_arguments_are_named():
    params = own_params()
    inner, outer = SGD(params, lr=0.1), SGD(params, lr=0.7)
    with pytest.raises(ValueError, match="sync_every must be an integer >= 1"):
        hvd.LocalSGD(inner, sync_every=0)
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
        hvd.LocalSGD(inner, sync_every=2, warmup_steps=-1)
    with pytest.raises(TypeError, match="LocalSGD's optimizer must have .params, .grads"):
        hvd.LocalSGD(object(), sync_every=2)
    with pytest.raises(ValueError, match="outer optimizer must be over the inner optimizer's"):
        hvd.DiLoCo(inner, SGD(own_params(), lr=0.7), sync_every=2)
    with pytest.raises(ValueError, match="fragments must be an integer from 1 to the model's 4"):
        hvd.DiLoCo(inner, outer, sync_every=2, fragments=5)
    with pytest.raises(ValueError, match="Compression.none, .fp16 or .bf16"):
        hvd.DiLoCo(inner, outer, sync_every=2, compression="int8")
    with pytest.raises(ValueError, match="int8=True sends int8 rows: leave compression"):
        hvd.DiLoCo(inner, outer, sync_every=2, compression=hvd.Compression.fp16, int8=True)
    with pytest.raises(ValueError, match="nesterov=True needs a momentum"):
        SGD(params, lr=0.1, nesterov=True)
