"""hororing.torch behaves as horovod.torch where scripts depend on it.

Return types, gradients of the grouped and alltoall/reducescatter collectives, process
sets in the optimizer, optimizer state broadcast, join, warnings and error types.
"""

import threading
import warnings

import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402


def test_zero_dim_tensors_keep_their_shape():
    loss = torch.tensor(float(hvd.rank()))
    averaged = hvd.allreduce(loss)
    assert averaged.shape == ()
    assert f"{averaged:.4f}" == f"{sum(range(hvd.size())) / hvd.size():.4f}"
    assert hvd.broadcast(torch.tensor(7 + hvd.rank()), 0).shape == ()
    (grouped,) = hvd.grouped_allreduce([torch.tensor(1.0)], op=hvd.Sum)
    assert grouped.shape == () and grouped.item() == hvd.size()


def test_alltoall_returns_received_splits_only_when_splits_are_given():
    size, rank = hvd.size(), hvd.rank()
    received = hvd.alltoall(torch.arange(size, dtype=torch.float32) + 10 * rank)
    assert isinstance(received, torch.Tensor)
    assert received.tolist() == [10.0 * peer + rank for peer in range(size)]
    splits = torch.tensor([1] * size, dtype=torch.int32)
    received, received_splits = hvd.alltoall(torch.arange(size) + 10 * rank, splits)
    assert received_splits.dtype == torch.int32 and received_splits.tolist() == [1] * size
    with pytest.raises(ValueError, match="splits must be a tensor of integers"):
        hvd.alltoall(torch.ones(size), torch.ones(size))


def test_alltoall_gradient_goes_back_to_the_sender():
    size, rank = hvd.size(), hvd.rank()
    rows = torch.ones(size, 2, requires_grad=True)
    received = hvd.alltoall(rows)
    weights = torch.arange(size, dtype=torch.float32).unsqueeze(1) + 1  # row i came from rank i
    (received * weights).sum().backward()
    # the row sent to peer p was weighted there by (rank + 1)
    assert torch.equal(rows.grad, torch.full((size, 2), float(rank + 1)))


def test_grouped_allreduce_is_differentiable():
    size = hvd.size()
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(2, 2, requires_grad=True)
    first, second = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    (first.sum() + 2 * second.sum()).backward()
    assert torch.equal(a.grad, torch.full((3,), float(size)))
    assert torch.equal(b.grad, torch.full((2, 2), 2.0 * size))


def test_grouped_allgather_and_its_gradient():
    size, rank = hvd.size(), hvd.rank()
    a = torch.full((rank + 1, 2), float(rank), requires_grad=True)
    b = torch.full((1,), float(rank), requires_grad=True)
    gathered_a, gathered_b = hvd.grouped_allgather([a, b])
    assert gathered_a.shape == (size * (size + 1) // 2, 2)
    assert gathered_b.tolist() == [float(peer) for peer in range(size)]
    (3 * gathered_a.sum() + gathered_b.sum()).backward()
    assert torch.equal(a.grad, torch.full((rank + 1, 2), 3.0))  # averaged: the same everywhere
    assert torch.equal(b.grad, torch.ones(1))


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_values_and_gradient_as_horovod_defines_them(op):
    size, rank = hvd.size(), hvd.rank()
    op = getattr(hvd, op)
    rows = 2 * size + 1  # not divisible by the size
    x = (torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) + rank).requires_grad_()
    mine = hvd.reducescatter(x, op=op, prescale_factor=2.0)
    total = sum(torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) + peer
                for peer in range(size)) * 2.0
    expected = total if op == hvd.Sum else total / size
    start = rank * (rows // size) + min(rank, rows % size)
    count = rows // size + (rank < rows % size)
    assert torch.allclose(mine, expected[start:start + count])
    mine.sum().backward()
    # Horovod: the gradient is the allgather of the output gradients, times the prescale
    # factor, times size for Sum
    assert torch.equal(x.grad, torch.full((rows, 2), 2.0 * (size if op == hvd.Sum else 1)))
    a, b = hvd.grouped_reducescatter([torch.ones(size, 1), torch.ones(2 * size)], op=hvd.Sum)
    assert torch.equal(a, torch.full((1, 1), float(size))) and torch.equal(b, torch.full((2,), float(size)))


def test_adasum_is_refused_where_horovod_refuses_it():
    with pytest.raises(RuntimeError, match="op=Adasum is supported by allreduce"):
        hvd.reducescatter(torch.ones(hvd.size()), op=hvd.Adasum)
    with pytest.raises(TypeError, match="op=Adasum reduces floating-point tensors.*int64"):
        hvd.allreduce(torch.ones(1, dtype=torch.int64), op=hvd.Adasum)


def test_sparse_allreduce_async_equals_the_dense_allreduce():
    size, rank = hvd.size(), hvd.rank()
    dense = torch.zeros(6, 3)
    dense[rank % 6] = rank + 1.0
    dense[5] = 1.0
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse.t", op=hvd.Average)
    result = handle()
    assert result.is_sparse
    assert torch.allclose(result.to_dense(), hvd.allreduce(dense, name="dense.t"))
    with pytest.raises(TypeError, match="sparse COO"):
        hvd.sparse_allreduce_async(dense, name="x", op=hvd.Sum)


def model_and_data(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(hvd.rank()))
    return model, data


def test_broadcast_optimizer_state_reaches_the_wrapper_and_a_fresh_optimizer():
    model, data = model_and_data(seed=3)
    lr = 0.1 if hvd.rank() == 0 else 0.2 + hvd.rank()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                                         weight_decay=0.1),
                                         named_parameters=model.named_parameters())
    before = [parameter.detach().clone() for parameter in model.parameters()]
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # fresh: no state, no gradients
    assert optimizer.param_groups[0]["lr"] == 0.1  # the wrapper sees the loaded groups
    for parameter, value in zip(model.parameters(), before):
        assert torch.equal(parameter, value)  # the step that made the state was undone
        assert parameter.grad is not None and not parameter.grad.any()
    model(data).sum().backward()
    optimizer.step()
    momenta = [optimizer.state[parameter]["momentum_buffer"] for parameter in model.parameters()]
    assert all(buffer is not None for buffer in momenta)


def test_step_after_synchronize_warns_as_horovod_does():
    model, data = model_and_data(seed=4)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    model(data).sum().backward()
    optimizer.synchronize()
    grads = [parameter.grad.clone() for parameter in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    assert len(caught) == 1
    assert "optimizer.step() called without optimizer.skip_synchronize()" in str(caught[0].message)
    for parameter, grad in zip(model.parameters(), grads):
        assert torch.equal(parameter.grad, grad)  # not reduced a second time
    assert set(optimizer._parameter_names.values()) == {name for name, _ in model.named_parameters()}


def test_optimizer_over_a_process_set_averages_within_it():
    if hvd.size() < 2:
        pytest.skip("needs two sets")
    size, rank = hvd.size(), hvd.rank()
    even = hvd.add_process_set(list(range(0, size, 2)))
    odd = hvd.add_process_set(list(range(1, size, 2)))
    mine = even if rank % 2 == 0 else odd
    try:
        weight = torch.nn.Parameter(torch.zeros(3))
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD([weight], lr=1.0),
                                             named_parameters=[("w", weight)], process_set=mine)
        (weight * (rank + 1)).sum().backward()
        optimizer.step()
        expected = -sum(member + 1 for member in mine.ranks) / len(mine.ranks)
        assert torch.allclose(weight, torch.full((3,), expected))
    finally:
        hvd.remove_process_set(odd)
        hvd.remove_process_set(even)


def test_broadcast_parameters_takes_a_plain_list():
    tensors = [torch.full((2,), float(hvd.rank())), torch.full((1,), 10.0 + hvd.rank())]
    hvd.broadcast_parameters(tensors, root_rank=0)
    assert tensors[0].tolist() == [0.0, 0.0] and tensors[1].tolist() == [10.0]


def test_join_takes_a_device_and_other_collectives_fail_while_a_rank_is_joined():
    size, rank = hvd.size(), hvd.rank()
    if size < 2:
        assert hvd.join(-1) == 0
        return
    if rank == 0:
        last = hvd.join(-1)
    else:
        with pytest.raises(RuntimeError, match="Broadcast is not supported with Join"):
            hvd.broadcast(torch.ones(2), rank)  # a different root on every rank: still no hang
        last = hvd.join()
    assert last != 0 and hvd.allgather_object(last) == [last] * size
    # rank 0 never made the failed unnamed broadcast; its next unnamed one still pairs up
    assert hvd.broadcast(torch.tensor([rank]), 0).tolist() == [0]
    with pytest.raises(TypeError, match="takes an int device id"):
        hvd.join("cuda")


def test_unnamed_collectives_from_two_threads_at_once_pair_up_correctly():
    size, rank = hvd.size(), hvd.rank()
    results = {}

    def worker(label, value):
        results[label] = [hvd.allreduce(torch.full((4,), value * (rank + 1)), op=hvd.Sum)
                          for _ in range(20)]

    threads = [threading.Thread(target=worker, args=(label, value), name=f"worker-{label}")
               for label, value in (("a", 1.0), ("b", 1000.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = size * (size + 1) / 2
    assert all(torch.equal(result, torch.full((4,), total)) for result in results["a"])
    assert all(torch.equal(result, torch.full((4,), 1000 * total)) for result in results["b"])


def test_build_queries():
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert not (hvd.ccl_built() or hvd.ddl_built() or hvd.rocm_built() or hvd.gloo_built())
    assert hvd.nccl_built() == 0
    assert hvd.cuda_built() == torch.cuda.is_available()
