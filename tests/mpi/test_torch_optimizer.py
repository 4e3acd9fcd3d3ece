"""hororing.torch's DistributedOptimizer (compression, backward passes, sparse gradients,
Adasum), broadcast_parameters and the optimizer state, lazy modules, SyncBatchNorm."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402
from torch_reference import expected_step, local_loss, make_model, rank_tensor  # noqa: E402


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_distributed_optimizer_averages_gradients(compression):
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=getattr(hvd.Compression, compression))
    assert isinstance(optimizer, torch.optim.Optimizer)
    local_loss(model, hvd.rank()).backward()
    optimizer.step()
    tolerance = {"none": 1e-6, "fp16": 1e-3, "bf16": 1e-2}[compression]
    for got, want in zip(model.parameters(), expected_step(0.1)):
        torch.testing.assert_close(got.detach(), want, atol=tolerance, rtol=tolerance)


def test_fp16_compression_halves_the_bytes_on_the_wire(reduced_buffers):
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    local_loss(model, hvd.rank()).backward()
    optimizer.step()
    if hvd.size() > 1:  # (a single rank has no hooks and sends nothing)
        assert reduced_buffers and {dtype for _, dtype, _ in reduced_buffers} == {"float16"}


def test_backward_passes_and_unnamed_parameters_and_scheduler():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.2)
    optimizer = hvd.DistributedOptimizer(inner, backward_passes_per_step=2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        (local_loss(model, hvd.rank()) / 2).backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1) == inner.param_groups[0]["lr"]
    for got, want in zip(model.parameters(), expected_step(0.2)):
        torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=1e-6)
    restored = torch.optim.SGD(make_model().parameters(), lr=1.0)
    restored.load_state_dict(optimizer.state_dict())
    assert restored.param_groups[0]["lr"] == pytest.approx(0.1)


def test_parameter_without_gradient_on_some_ranks_takes_part():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                         named_parameters=model.named_parameters())
    if hvd.rank() == 0:
        model[0](torch.ones(1, 4)).sum().backward()  # the last layer gets no gradient here
    else:
        model(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # must not hang
    if hvd.size() > 1:  # zeros took part for the missing gradient (size 1 reduces nothing)
        assert all(p.grad is not None for p in model.parameters())


def test_zero_grad_while_pending_and_skip_synchronize():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    local_loss(model, hvd.rank()).backward()
    if hvd.size() > 1:
        with pytest.raises(RuntimeError, match=r"optimizer.zero_grad\(\) was called after "
                                               r"loss.backward\(\) but before optimizer.step\(\)"):
            optimizer.zero_grad()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    with optimizer.skip_synchronize():
        optimizer.step()
    for got, want in zip(model.parameters(), expected_step(0.1)):
        torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=1e-6)
    optimizer.zero_grad()


def test_named_parameters_errors():
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="Parameter names in named_parameters must be unique. "
                                         "Found duplicates: 0.weight"):
        hvd.DistributedOptimizer(sgd, named_parameters=named + [named[0]])
    with pytest.raises(ValueError, match="named_parameters was specified, but one or more model "
                                         "parameters were not named"):
        hvd.DistributedOptimizer(sgd, named_parameters=named[:1])
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1, got 0"):
        hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)


def test_broadcast_parameters_and_optimizer_state():
    rank = hvd.rank()
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(rank)
        model.bias.fill_(-rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert torch.equal(model.weight, torch.zeros(2, 3)) and torch.equal(model.bias, torch.zeros(2))
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=hvd.size() - 1)
    with pytest.raises(ValueError, match="invalid params of type"):
        hvd.broadcast_parameters(model, root_rank=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1), betas=(0.9, 0.99))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.01) and isinstance(group["lr"], float)
    assert isinstance(group["betas"], tuple)
    with pytest.raises(ValueError, match="cannot broadcast torch.optim.LBFGS state"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)


def test_lazy_modules_are_refused_until_a_forward_pass_then_broadcast_like_any_other():
    torch.manual_seed(hvd.rank())  # a different initialization on every rank on purpose
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    fix = "not initialized yet.*lazy module.*Run one forward pass"
    with pytest.raises(ValueError, match=f"broadcast_parameters: parameter '0.bias' is {fix}"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    with pytest.raises(ValueError, match=f"broadcast_optimizer_state: .* is {fix}"):
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    with pytest.raises(ValueError, match=f"DistributedOptimizer: parameter '0.weight' is {fix}"):
        hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    model(torch.zeros(1, 3))  # the parameters exist from here on
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # creates Adam's state, then sends
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    x = torch.arange(6.0).reshape(2, 3) * (hvd.rank() + 1)
    optimizer.zero_grad()
    model(x).square().sum().backward()
    optimizer.step()
    values = torch.cat([p.detach().ravel() for p in model.parameters()]
                       + [v.ravel() for s in optimizer.state.values() for v in s.values()
                          if torch.is_tensor(v)]).numpy()
    everyone = hvd.allgather_object(values)
    assert all(np.array_equal(other, everyone[0]) for other in everyone)


def test_sync_batch_norm_matches_batch_norm_on_the_global_batch():
    size, rank = hvd.size(), hvd.rank()
    inputs = [rank_tensor(r, (4, 3, 5), seed=9) for r in range(size)]
    sync = hvd.SyncBatchNorm(3)
    local_input = inputs[rank].clone().requires_grad_(True)
    output = sync(local_input)
    (output * torch.arange(5.0)).sum().backward()
    reference = torch.nn.BatchNorm1d(3)
    global_input = torch.cat(inputs).requires_grad_(True)
    expected = reference(global_input)
    (expected * torch.arange(5.0)).sum().backward()
    torch.testing.assert_close(output, expected[4 * rank:4 * rank + 4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(local_input.grad, global_input.grad[4 * rank:4 * rank + 4],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sync.running_mean, reference.running_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sync.running_var, reference.running_var, atol=1e-6, rtol=1e-5)


def test_convert_sync_batchnorm_keeps_the_weights_and_syncs_the_statistics():
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(4)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
    with torch.no_grad():
        plain[1].weight.uniform_(0.5, 1.5)
        plain[1].running_mean.fill_(0.25)
    reference = copy.deepcopy(plain)
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(plain)
    assert isinstance(converted[1], hvd.SyncBatchNorm)
    assert isinstance(converted[2][0], hvd.SyncBatchNorm)
    assert converted[1].weight is plain[1].weight and converted[0] is plain[0]
    inputs = [rank_tensor(r, (4, 5), seed=11) for r in range(size)]
    output = converted(inputs[rank])
    expected = reference(torch.cat(inputs))
    torch.testing.assert_close(output, expected[4 * rank:4 * rank + 4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(converted[1].running_mean, reference[1].running_mean,
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sparse_as_dense,predivide", [(False, 1.0), (True, 1.0), (False, 4.0)])
def test_sparse_embedding_gradients_are_averaged(sparse_as_dense, predivide):
    def rows_of(rank):
        return torch.tensor([rank % 5, (3 * rank + 1) % 5, 4, rank % 5])

    def loss_of(embedding, rank):
        return (embedding(rows_of(rank)) * (rank + 1)).sum()

    embedding = torch.nn.Embedding(5, 3, sparse=True)
    with torch.no_grad():
        embedding.weight.copy_(torch.arange(15, dtype=torch.float32).reshape(5, 3))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=1.0),
                                         named_parameters=embedding.named_parameters(),
                                         sparse_as_dense=sparse_as_dense,
                                         gradient_predivide_factor=predivide)
    loss_of(embedding, hvd.rank()).backward()
    optimizer.synchronize()
    grad = embedding.weight.grad
    # sparse_as_dense reduces densely and hands the optimizer a sparse gradient again
    # (as Horovod does: SparseAdam accepts nothing else)
    assert grad.is_sparse
    # reference: every rank's dense gradient, computed here, averaged
    expected = torch.zeros(5, 3)
    for rank in range(hvd.size()):
        reference = torch.nn.Embedding(5, 3)
        loss_of(reference, rank).backward()
        expected += reference.weight.grad
    torch.testing.assert_close(grad.to_dense(), expected / hvd.size())
    with optimizer.skip_synchronize():
        optimizer.step()


def test_a_sparse_gradient_with_an_op_other_than_sum_or_average_names_sparse_as_dense():
    embedding = torch.nn.Embedding(5, 3, sparse=True)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=1.0),
                                         named_parameters=embedding.named_parameters(),
                                         op=hvd.Adasum)
    if hvd.size() == 1:
        pytest.skip("one rank reduces nothing")
    with pytest.raises(ValueError, match="sparse_as_dense=True"):
        embedding(torch.tensor([0, 1])).sum().backward()
    optimizer._handles.clear()


def test_distributed_optimizer_with_adasum_combines_each_gradient_by_the_tree():
    from reference import adasum_tree
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=model.named_parameters(), op=hvd.Adasum)
    per_rank = []
    for rank in range(hvd.size()):
        reference_model = make_model()
        local_loss(reference_model, rank).backward()
        per_rank.append([p.grad.double().numpy().ravel() for p in reference_model.parameters()])
    for _ in range(2):  # the second step runs on the gradients' bucket views
        optimizer.zero_grad()
        local_loss(model, hvd.rank()).backward()
        optimizer.step()
        for index, parameter in enumerate(model.parameters()):
            expected = adasum_tree([grads[index] for grads in per_rank])
            np.testing.assert_allclose(parameter.grad.double().numpy().ravel(), expected,
                                       rtol=1e-5, atol=1e-6)

