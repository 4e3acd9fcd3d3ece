"""hororing.torch's verbs on tensors: results, autograd through them, the blocking call's
reused view, refusals (the optimizer and helpers: test_torch_optimizer.py)."""

import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402


def test_allreduce_verbs_on_tensors():
    size, rank = hvd.size(), hvd.rank()
    total = sum(range(size))
    assert torch.equal(hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum), torch.full((3,), float(total)))
    tensor = torch.full((2, 2), float(rank))
    assert hvd.allreduce_(tensor, op=hvd.Max) is tensor
    assert torch.equal(tensor, torch.full((2, 2), float(size - 1)))
    handle = hvd.allreduce_async(torch.ones(4, dtype=torch.int32), op=hvd.Sum)
    assert torch.equal(hvd.synchronize(handle), torch.full((4,), size, dtype=torch.int32))
    bf16 = hvd.allreduce(torch.full((5,), 1.5, dtype=torch.bfloat16))
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, torch.full((5,), 1.5, dtype=torch.bfloat16))
    in_place_bf16 = torch.full((3,), float(rank), dtype=torch.bfloat16)
    hvd.allreduce_(in_place_bf16, op=hvd.Sum)
    assert torch.equal(in_place_bf16, torch.full((3,), float(total), dtype=torch.bfloat16))
    first, second = hvd.grouped_allreduce([torch.ones(2), torch.ones(3)], op=hvd.Sum)
    assert torch.equal(first, torch.full((2,), float(size))) and second.shape == (3,)


def test_other_verbs_on_tensors():
    size, rank = hvd.size(), hvd.rank()
    gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)))
    assert gathered.shape == (size * (size + 1) // 2, 2)
    assert torch.equal(hvd.broadcast(torch.tensor([rank]), size - 1), torch.tensor([size - 1]))
    received = hvd.alltoall(torch.arange(size) + 10 * rank)
    assert received.tolist() == [10 * peer + rank for peer in range(size)]
    part = hvd.reducescatter(torch.ones(size * 2, 3), op=hvd.Sum)
    assert torch.equal(part, torch.full((2, 3), float(size)))


def test_autograd_through_allreduce_allgather_broadcast():
    size, rank = hvd.size(), hvd.rank()
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), float(size)))  # allreduce(Sum) of ones
    x = torch.ones(2, 3, requires_grad=True)
    hvd.allreduce(x.t()).sum().backward()  # non-contiguous input and gradient
    assert torch.equal(x.grad, torch.ones(2, 3))
    rows = torch.full((rank + 1, 2), 1.0, requires_grad=True)
    gathered = hvd.allgather(rows)
    weights = torch.arange(gathered.shape[0], dtype=torch.float32).unsqueeze(1)
    (gathered * weights).sum().backward()
    offset = rank * (rank + 1) // 2
    expected = torch.arange(offset, offset + rank + 1, dtype=torch.float32).unsqueeze(1).expand(-1, 2)
    assert torch.equal(rows.grad, expected)  # every rank's gradient is the same: average = itself
    y = torch.ones(4, requires_grad=True)
    hvd.broadcast(y, root_rank=0).sum().backward()
    assert torch.equal(y.grad, torch.ones(4) if rank == 0 else torch.zeros(4))


def test_a_tensor_reduced_plain_and_then_needing_a_gradient_gets_one():
    """A plain tensor's view is reused by the next blocking call of it; once the tensor
    needs a gradient that call is differentiable again."""
    size = hvd.size()
    x = torch.ones(3)
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((3,), float(size)))
    x.requires_grad_()
    reduced = hvd.allreduce(x, op=hvd.Sum)
    assert reduced.grad_fn is not None
    (reduced * torch.arange(3.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(3.0) * size)


def test_grouped_allreduce_with_fp16_sends_float16_and_sums_right(reduced_buffers):
    # values that float16 holds exactly, so the float16 sums equal the float64 reference
    # (a float16 input is its own payload: it must come back unchanged)
    tensors = [torch.arange(n, dtype=dtype) % 5 + hvd.rank()
               for n, dtype in ((7, torch.float32), (1001, torch.float32), (33, torch.float16))]
    originals = [tensor.clone() for tensor in tensors]
    results = hvd.grouped_allreduce(tensors, op=hvd.Sum, compression=hvd.Compression.fp16,
                                    name="grouped.fp16")
    size = hvd.size()
    for tensor, result in zip(tensors, results):
        expected = (torch.arange(tensor.numel(), dtype=torch.float64) % 5) * size \
            + size * (size - 1) / 2
        assert result.dtype == tensor.dtype
        torch.testing.assert_close(result.double(), expected, rtol=0, atol=0)
    for tensor, original in zip(tensors, originals):
        assert torch.equal(tensor, original)
    if size > 1:
        assert reduced_buffers and {dtype for _, dtype, _ in reduced_buffers} == {"float16"}


def test_in_place_grouped_allreduce_writes_every_member():
    tensors = [torch.arange(n, dtype=torch.float64) * (hvd.rank() + 1) for n in (3, 1001)]
    results = hvd.grouped_allreduce_(tensors, op=hvd.Sum, name="grouped.inplace")
    total = hvd.size() * (hvd.size() + 1) / 2  # sum over ranks of (rank + 1)
    for tensor, result in zip(tensors, results):
        assert result is tensor
        torch.testing.assert_close(tensor, torch.arange(tensor.numel(), dtype=torch.float64) * total,
                                   rtol=0, atol=0)


def test_torch_bad_input():
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor, got list"):
        hvd.allreduce_async([1.0])
    with pytest.raises(TypeError, match="synchronize takes a handle"):
        hvd.synchronize(None)


LIST_REFUSED = {
    "allreduce": lambda x: hvd.allreduce(x), "allreduce_": lambda x: hvd.allreduce_(x),
    "allreduce_async": lambda x: hvd.allreduce_async(x),
    "allgather": lambda x: hvd.allgather(x), "allgather_async": lambda x: hvd.allgather_async(x),
    "broadcast": lambda x: hvd.broadcast(x, 0), "broadcast_": lambda x: hvd.broadcast_(x, 0),
    "alltoall": lambda x: hvd.alltoall(x), "reducescatter": lambda x: hvd.reducescatter(x),
    "grouped_allreduce": lambda x: hvd.grouped_allreduce([x]),
    "grouped_allreduce_": lambda x: hvd.grouped_allreduce_([x]),
    "grouped_allgather": lambda x: hvd.grouped_allgather([x]),
    "grouped_reducescatter": lambda x: hvd.grouped_reducescatter([x]),
}
NEEDS_A_DIMENSION = ("allgather", "allgather_async", "alltoall", "reducescatter",
                     "grouped_allgather", "grouped_reducescatter")


@pytest.mark.parametrize("verb", list(LIST_REFUSED))
def test_every_torch_verb_refuses_a_list_and_a_0d_tensor_where_rows_are_needed(verb):
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor, got list"):
        LIST_REFUSED[verb]([1.0, 2.0])
    if verb in NEEDS_A_DIMENSION:
        with pytest.raises(ValueError, match=r"tensor must have at least 1 dimension\(s\), got a "
                                             r"0-d array of shape \(\); reshape it"):
            LIST_REFUSED[verb](torch.tensor(3.0))


@pytest.mark.parametrize("verb", ["grouped_allreduce", "grouped_allgather",
                                  "grouped_reducescatter", "grouped_allreduce_async"])
def test_torch_grouped_verbs_refuse_a_tensor_where_a_list_belongs(verb):
    with pytest.raises(TypeError, match="takes a list of tensors, got Tensor"):
        getattr(hvd, verb)(torch.ones(2, 3))


def test_the_torch_verbs_enter_by_the_core_door(monkeypatch):
    from test_collectives import door_counter
    seen = door_counter(monkeypatch)
    total = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="door.torch.allreduce")
    hvd.grouped_allreduce([torch.ones(2)], op=hvd.Sum, name="door.torch.grouped")
    hvd.broadcast(torch.ones(2), root_rank=0, name="door.torch.broadcast")
    assert seen == ["allreduce", "allreduce", "broadcast"]
    assert torch.equal(total, torch.full((3,), float(hvd.size())))


@pytest.mark.parametrize("start", [
    lambda tensor, name: hvd.allreduce_async(tensor, name=name),
    lambda tensor, name: hvd.allreduce_async_(tensor, name=name),
    lambda tensor, name: hvd.allgather_async(tensor, name=name),
    lambda tensor, name: hvd.broadcast_async(tensor, 0, name=name),
    lambda tensor, name: hvd.broadcast_async_(tensor, 0, name=name),
    lambda tensor, name: hvd.alltoall_async(tensor, name=name),
    lambda tensor, name: hvd.reducescatter_async(tensor, name=name),
    lambda tensor, name: hvd.grouped_allreduce_async([tensor], name=name),
    lambda tensor, name: hvd.grouped_allreduce_async_([tensor], name=name),
    lambda tensor, name: hvd.grouped_allgather_async([tensor], name=name),
    lambda tensor, name: hvd.grouped_reducescatter_async([tensor], name=name),
], ids=["allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "alltoall",
        "reducescatter", "grouped_allreduce", "grouped_allreduce_", "grouped_allgather",
        "grouped_reducescatter"])
def test_every_async_verb_refuses_a_name_in_flight_before_converting_its_tensor(start):
    """A tensor on the meta device would be refused by the conversion with its own message;
    the name in flight is named first (converting can release the GIL, and a collective
    just submitted under that name could finish meanwhile, so a second call's refusal
    would depend on the peers' timing, as Horovod's duplicate-name tests found). Rank 0's
    first call stays in flight until the others submit theirs, after the barrier."""
    if hvd.size() < 2:
        pytest.skip("a collective of one rank can finish at once")
    tensor = torch.ones(hvd.size(), 2)
    if hvd.rank() == 0:
        handle = start(tensor, "twice")
        with pytest.raises(ValueError, match="named 'twice(.0)?' is already in flight"):
            start(torch.ones(hvd.size(), 2, device="meta"), "twice")
    hvd.barrier()
    if hvd.rank() != 0:
        handle = start(tensor, "twice")
    hvd.synchronize(handle)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.uint8,
                                   torch.int8, torch.int16, torch.int32, torch.int64])
def test_a_repeated_blocking_allreduce_of_a_plain_tensor_returns_new_tensors(dtype):
    """The blocking allreduce of a CPU tensor that needs no gradient (the binding's plain
    path): each call returns a new tensor of the input's dtype and shape holding the sum of
    every rank's values, and leaves the input as it was, strided inputs and Horovod's
    default op (Average) included."""
    size, rank = hvd.size(), hvd.rank()
    results = []
    for step in range(6):  # repeated: the later calls run the name's lane
        values = (torch.arange(1001) % 7 + rank + step).to(dtype)
        tensor = values.clone()
        result = hvd.allreduce(tensor, op=hvd.Sum, name=f"plain.{dtype}")
        expected = sum((torch.arange(1001, dtype=torch.int64) % 7 + peer + step)
                       for peer in range(size))
        assert result.dtype == dtype and result.shape == tensor.shape
        assert torch.equal(result, expected.to(dtype)), step
        assert torch.equal(tensor, values)  # the input is left alone
        assert result.data_ptr() != tensor.data_ptr()
        results.append(result)
    assert len({result.data_ptr() for result in results}) == len(results)  # none reused
    strided = torch.full((4, 6), float(rank + 1))[:, ::2]
    assert torch.equal(hvd.allreduce(strided, op=hvd.Sum),
                       torch.full((4, 3), float(size * (size + 1) // 2)))
    average = hvd.allreduce(torch.full((5,), float(rank)))
    assert torch.allclose(average, torch.full((5,), (size - 1) / 2))


@pytest.mark.parametrize("verb", ["allreduce", "allreduce_"])
@pytest.mark.parametrize("tensor_of_the_call", ["its own", "the one in flight"])
def test_a_blocking_allreduce_under_a_name_in_flight_is_refused_before_converting(
        monkeypatch, verb, tensor_of_the_call):
    """``Tensor.numpy`` releases the GIL: a collective in flight under the name could
    complete meanwhile, so the name is checked before a tensor is converted. The tensor in
    flight was converted already: its view is reused, and the door refuses the name."""
    if hvd.size() < 2:
        pytest.skip("a collective of one rank can finish at once")
    tensor = torch.ones(3)
    if hvd.rank() == 0:
        handle = hvd.allreduce_async(tensor, op=hvd.Sum, name="plain.twice")
        converted = []
        numpy = torch.Tensor.numpy
        monkeypatch.setattr(torch.Tensor, "numpy",
                            lambda self, *args, **kwargs: converted.append(self) or
                            numpy(self, *args, **kwargs))
        second = tensor if tensor_of_the_call == "the one in flight" else torch.ones(3)
        with pytest.raises(ValueError, match="named 'plain.twice' is already in flight"):
            getattr(hvd, verb)(second, op=hvd.Sum, name="plain.twice")
        monkeypatch.undo()
        assert converted == []
    hvd.barrier()
    if hvd.rank() != 0:
        handle = hvd.allreduce_async(tensor, op=hvd.Sum, name="plain.twice")
    assert torch.equal(hvd.synchronize(handle), torch.full((3,), float(hvd.size())))
    assert torch.equal(tensor, torch.ones(3))
