"""torch.distributed over the hororing backend: ``dist.init_process_group("hororing")`` with
nothing set under mpiexec, every collective against a float64 reference computed on each rank
from every rank's inputs, sync and async, sizes no rank count divides; subgroups; point to
point; mismatches named on every rank; and what runs over it unchanged: DDP (its own hooks),
ZeroRedundancyOptimizer, FSDP2, torch.distributed.checkpoint.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import hororing.torch as hvd  # noqa: E402
from hororing.errors import PreconditionError  # noqa: E402

SIZES = [1, 7, 1001]
R = dist.ReduceOp


@pytest.fixture(scope="module", autouse=True)
def process_group():
    assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ
    dist.init_process_group("hororing")
    yield
    dist.destroy_process_group()


def rank_size():
    return dist.get_rank(), dist.get_world_size()


def data(rank, count, dtype=torch.float32, salt=0):
    """Rank ``rank``'s input: distinct per rank, exact in every dtype used here."""
    values = (np.arange(count) * 7 + rank * 13 + salt) % 11 - 5 + rank
    return torch.tensor(values, dtype=dtype)


def everyone(count, dtype=torch.float64, salt=0):
    return torch.stack([data(r, count, dtype, salt) for r in range(dist.get_world_size())])


REFERENCE = {R.SUM: lambda x: x.sum(0), R.AVG: lambda x: x.mean(0),
             R.PRODUCT: lambda x: x.prod(0), R.MIN: lambda x: x.min(0).values,
             R.MAX: lambda x: x.max(0).values}


def test_the_group_comes_from_mpi():
    assert (dist.get_rank(), dist.get_world_size()) == (hvd.rank(), hvd.size())
    assert dist.get_backend() == "hororing"


@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("op", [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce(count, op, dtype, async_op):
    if op == R.AVG and not dtype.is_floating_point:
        pytest.skip("AVG of integers: torch's backends refuse it too")
    rank, size = rank_size()
    tensor = data(rank, count, dtype)
    work = dist.all_reduce(tensor, op=op, async_op=async_op)
    if async_op:
        assert work.get_future().wait()[0] is tensor
        work.wait()
    expected = REFERENCE[op](everyone(count))
    torch.testing.assert_close(tensor.double(), expected.to(torch.float64), rtol=1e-6, atol=0)


def test_premul_sum_and_bfloat16():
    rank, size = rank_size()
    tensor = data(rank, 9)
    dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(0.5))
    torch.testing.assert_close(tensor.double(), everyone(9).sum(0) * 0.5)
    half = data(rank, 33, torch.bfloat16)
    dist.all_reduce(half)
    torch.testing.assert_close(half.double(), everyone(33).sum(0))


def test_a_bitwise_op_is_refused_by_name_on_every_rank():
    with pytest.raises(ValueError, match="BAND|bitwise"):
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.BAND)
    tensor = torch.ones(3)
    dist.all_reduce(tensor)  # the group goes on
    assert tensor.tolist() == [dist.get_world_size()] * 3


def test_mismatched_shapes_are_named_on_every_rank():
    """A call's name holds its kind, dtype and shape (so repeated calls hit the engine's
    cache): differing shapes meet as differing names, which the deadlock check names on
    every rank, each rank's call with its shape."""
    rank, size = rank_size()
    if size == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(PreconditionError, match=r"Deadlock.*allreduce\.float32\.3\."):
        dist.all_reduce(torch.ones(3 + rank))
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    assert tensor.tolist() == [size] * 4


def test_mismatched_collectives_are_named_on_every_rank():
    rank, size = rank_size()
    if size == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(PreconditionError):
        if rank == 0:
            dist.broadcast(torch.ones(5), src=0)
        else:
            dist.all_reduce(torch.ones(5))


@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_forms(count, async_op):
    rank, size = rank_size()
    outputs = [torch.empty(count) for _ in range(size)]
    work = dist.all_gather(outputs, data(rank, count), async_op=async_op)
    if async_op:
        work.wait()
    torch.testing.assert_close(torch.stack(outputs).double(), everyone(count))
    flat = torch.empty(size * count, dtype=torch.float64)
    work = dist.all_gather_into_tensor(flat, data(rank, count, torch.float64),
                                       async_op=async_op)
    if async_op:
        work.wait()
    torch.testing.assert_close(flat, everyone(count).reshape(-1))


def test_all_gather_into_tensor_in_place_and_overlapping():
    """FSDP2's way: the input is this rank's chunk of the output (gathered in place); an
    input lying elsewhere in the output is gathered through a buffer of its own."""
    rank, size = rank_size()
    output = torch.zeros(size * 5)
    output[5 * rank:5 * rank + 5] = data(rank, 5)
    dist.all_gather_into_tensor(output, output[5 * rank:5 * rank + 5])
    torch.testing.assert_close(output.double(), everyone(5).reshape(-1))
    if size > 1:
        output = torch.zeros(size * 5)
        elsewhere = (rank + 1) % size
        output[5 * elsewhere:5 * elsewhere + 5] = data(rank, 5)
        dist.all_gather_into_tensor(output, output[5 * elsewhere:5 * elsewhere + 5])
        torch.testing.assert_close(output.double(), everyone(5).reshape(-1))


def test_object_collectives():
    rank, size = rank_size()
    gathered = [None] * size
    dist.all_gather_object(gathered, {"rank": rank, "word": "x" * rank})
    assert gathered == [{"rank": r, "word": "x" * r} for r in range(size)]
    objects = [("root", size - 1)] if rank == size - 1 else [None]
    dist.broadcast_object_list(objects, src=size - 1)
    assert objects == [("root", size - 1)]
    received = [None]
    dist.scatter_object_list(received, [r * 10 for r in range(size)] if rank == 0 else None,
                             src=0)
    assert received == [rank * 10]
    at_root = [None] * size if rank == 0 else None
    dist.gather_object(rank + 0.5, at_root, dst=0)
    if rank == 0:
        assert at_root == [r + 0.5 for r in range(size)]


@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("op", [R.SUM, R.AVG, R.MAX])
def test_reduce_scatter_forms(count, op):
    rank, size = rank_size()
    whole = torch.stack([data(rank, count, salt=part) for part in range(size)])
    output = torch.empty(count)
    dist.reduce_scatter_tensor(output, whole.reshape(-1).clone(), op=op)
    everything = torch.stack([torch.stack([data(r, count, torch.float64, salt=part)
                                           for part in range(size)]) for r in range(size)])
    expected = REFERENCE[op](everything)[rank]
    torch.testing.assert_close(output.double(), expected)
    listed = torch.empty(count)
    dist.reduce_scatter(listed, [row.clone() for row in whole], op=op)
    torch.testing.assert_close(listed.double(), expected)


@pytest.mark.parametrize("count", [1, 1001])
def test_broadcast_reduce_gather_scatter_from_every_root(count):
    rank, size = rank_size()
    for root in range(size):
        tensor = data(rank, count)
        dist.broadcast(tensor, src=root)
        torch.testing.assert_close(tensor.double(), everyone(count)[root])

        tensor = data(rank, count)
        dist.reduce(tensor, dst=root, op=R.SUM)
        expected = everyone(count).sum(0) if rank == root else data(rank, count, torch.float64)
        torch.testing.assert_close(tensor.double(), expected)

        gathered = [torch.empty(count) for _ in range(size)] if rank == root else None
        dist.gather(data(rank, count), gathered, dst=root)
        if rank == root:
            torch.testing.assert_close(torch.stack(gathered).double(), everyone(count))

        piece = torch.empty(count)
        parts = [data(r, count, salt=root) for r in range(size)] if rank == root else None
        dist.scatter(piece, parts, src=root)
        torch.testing.assert_close(piece.double(), data(rank, count, torch.float64, salt=root))


def test_all_to_all_single_even_and_uneven():
    rank, size = rank_size()
    rows = 3 * size
    tensor = data(rank, rows * 2).reshape(rows, 2)
    output = torch.empty_like(tensor)
    dist.all_to_all_single(output, tensor)
    expected = torch.cat([everyone(rows * 2)[r].reshape(rows, 2)[3 * rank:3 * rank + 3]
                          for r in range(size)])
    torch.testing.assert_close(output.double(), expected)

    def sends(source):  # rank ``source`` sends source + destination + 1 rows to each rank
        return [source + destination + 1 for destination in range(size)]
    mine = sends(rank)
    tensor = torch.arange(sum(mine), dtype=torch.float32) + 100 * rank
    incoming = [sends(source)[rank] for source in range(size)]
    output = torch.empty(sum(incoming))
    dist.all_to_all_single(output, tensor, output_split_sizes=incoming, input_split_sizes=mine)
    pieces = []
    for source in range(size):
        start = sum(sends(source)[:rank])
        pieces.append(torch.arange(start, start + sends(source)[rank], dtype=torch.float64)
                      + 100 * source)
    torch.testing.assert_close(output.double(), torch.cat(pieces))


def test_all_to_all_lists():
    rank, size = rank_size()
    inputs = [torch.full((destination + 2,), float(rank * 10 + destination))
              for destination in range(size)]
    outputs = [torch.empty(rank + 2) for _ in range(size)]
    dist.all_to_all(outputs, inputs)
    for source, output in enumerate(outputs):
        assert output.tolist() == [float(source * 10 + rank)] * (rank + 2)


def test_coalesced_all_reduce():
    rank, size = rank_size()
    tensors = [data(rank, count) for count in SIZES]
    with dist.distributed_c10d._coalescing_manager(async_ops=True) as manager:
        for tensor in tensors:
            dist.all_reduce(tensor)
    manager.wait()
    for tensor, count in zip(tensors, SIZES):
        torch.testing.assert_close(tensor.double(), everyone(count).sum(0))


def test_point_to_point_around_the_ring():
    rank, size = rank_size()
    if size == 1:
        pytest.skip("needs two ranks")
    right, left = (rank + 1) % size, (rank - 1) % size
    received = torch.empty(5, 3)
    operations = [dist.P2POp(dist.isend, data(rank, 15).reshape(5, 3), right),
                  dist.P2POp(dist.irecv, received, left)]
    for work in dist.batch_isend_irecv(operations):
        work.wait()
    torch.testing.assert_close(received.double(), everyone(15)[left].reshape(5, 3))
    column = torch.empty(4, 2)[:, 1]  # not contiguous
    if rank == 0:
        dist.send(torch.arange(4.0), dst=size - 1, tag=3)
    elif rank == size - 1:
        dist.recv(column, src=0, tag=3)
        assert column.tolist() == [0.0, 1.0, 2.0, 3.0]
    if rank == 1:
        dist.send(torch.tensor([42.0]), dst=0)
    elif rank == 0:
        anyone = torch.empty(1)
        assert dist.recv(anyone) == 1
        assert anyone.item() == 42.0
    dist.barrier()


def test_point_to_point_between_two_ranks_of_a_fresh_group_needs_no_one_else():
    rank, size = rank_size()
    if size == 1:
        pytest.skip("needs two ranks")
    group = dist.new_group(list(range(size)))
    if rank == 0:
        dist.send(torch.arange(6.0), dst=1, group=group)
    elif rank == 1:
        received = torch.empty(6)
        dist.recv(received, src=0, group=group)
        assert received.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    dist.barrier()


def test_subgroups_run_on_their_members_only():
    rank, size = rank_size()
    evens = list(range(0, size, 2))
    group = dist.new_group(evens)
    if rank in evens:
        tensor = data(rank, 11)
        dist.all_reduce(tensor, group=group)
        torch.testing.assert_close(tensor.double(), everyone(11)[evens].sum(0))
        root = evens[-1]
        tensor = data(rank, 3)
        dist.broadcast(tensor, src=root, group=group)
        torch.testing.assert_close(tensor.double(), everyone(3)[root])
    tensor = torch.ones(2)
    dist.all_reduce(tensor)  # the world group unaffected
    assert tensor.tolist() == [size] * 2


# ---- what runs over it ----------------------------------------------------------------------

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def batch(rank, step):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 12, generator=generator), torch.randn(6, 5, generator=generator)


def reference_parameters(steps, optimizer_class=torch.optim.SGD, **options):
    """The same training on one process: each step's gradient the mean of every rank's."""
    net = model()
    optimizer = optimizer_class(net.parameters(), **options)
    for step in range(steps):
        optimizer.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(net(x), y)
                   for x, y in (batch(r, step) for r in range(dist.get_world_size())))
        (loss / dist.get_world_size()).backward()
        optimizer.step()
    return [parameter.detach() for parameter in net.parameters()]


def train(net, optimizer, steps):
    for step in range(steps):
        optimizer.zero_grad()
        x, y = batch(dist.get_rank(), step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()


def same_on_every_rank(tensors):
    flat = torch.cat([tensor.detach().reshape(-1) for tensor in tensors])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    for copy in copies:
        assert torch.equal(copy, flat)


@pytest.mark.parametrize("hook", ["none", "allreduce", "fp16"])
def test_ddp_trains_as_one_process_on_the_global_batch(hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    net = torch.nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.001)
    if hook == "allreduce":
        net.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    train(net, torch.optim.SGD(net.parameters(), lr=0.1), 4)
    tolerance = dict(rtol=2e-3, atol=2e-3) if hook == "fp16" else dict(rtol=1e-5, atol=1e-6)
    for mine, expected in zip(net.parameters(), reference_parameters(4, lr=0.1)):
        torch.testing.assert_close(mine.detach(), expected, **tolerance)
    same_on_every_rank(net.parameters())


def test_ddp_powersgd_and_post_local_sgd_keep_ranks_together():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    net = torch.nn.parallel.DistributedDataParallel(model())
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                        start_powerSGD_iter=2)
    net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    train(net, torch.optim.SGD(net.parameters(), lr=0.05), 5)
    same_on_every_rank(net.parameters())

    local = torch.nn.parallel.DistributedDataParallel(model())
    alone, _ = dist.new_subgroups(group_size=1)  # after step 2 each rank steps on its own
    local.register_comm_hook(post_localSGD_hook.PostLocalSGDState(
        process_group=None, subgroup=alone, start_localSGD_iter=2),
        post_localSGD_hook.post_localSGD_hook)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.05)
    averager = PeriodicModelAverager(period=2, warmup_steps=2)
    for step in range(5):  # the averager averages after steps 2 and 4 (its count from 0)
        optimizer.zero_grad()
        x, y = batch(dist.get_rank(), step)
        torch.nn.functional.mse_loss(local(x), y).backward()
        optimizer.step()
        averager.average_parameters(local.parameters())
    same_on_every_rank(local.parameters())


def test_zero_redundancy_optimizer_matches_adam_on_the_global_batch():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    net = torch.nn.parallel.DistributedDataParallel(model())
    optimizer = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam,
                                        lr=0.01)
    train(net, optimizer, 4)
    expected = reference_parameters(4, torch.optim.Adam, lr=0.01)
    for mine, reference in zip(net.parameters(), expected):
        torch.testing.assert_close(mine.detach(), reference, rtol=1e-5, atol=1e-6)


def test_fsdp2_matches_one_process_on_the_global_batch():
    from torch.distributed.fsdp import fully_shard
    net = model()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    train(net, torch.optim.SGD(net.parameters(), lr=0.1), 3)
    for mine, expected in zip(net.parameters(), reference_parameters(3, lr=0.1)):
        torch.testing.assert_close(mine.full_tensor().detach(), expected, rtol=1e-5, atol=1e-6)


def test_dcp_checkpoint_is_written_by_every_rank_and_read_without_mpi(tmp_path_factory):
    import torch.distributed.checkpoint as dcp
    rank, size = rank_size()
    where = [str(tmp_path_factory.mktemp("dcp"))] if rank == 0 else [None]
    dist.broadcast_object_list(where, src=0)
    wrapped = torch.nn.parallel.DistributedDataParallel(model())  # the same on every rank
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    train(wrapped, optimizer, 2)
    net = wrapped.module
    dcp.save({"model": net.state_dict(), "optim": optimizer.state_dict()},
             checkpoint_id=where[0])
    fresh = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(),
                                torch.nn.Linear(24, 5))
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=where[0])
    fresh.load_state_dict(state["model"])
    for a, b in zip(net.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    dist.barrier()
    if rank == 0:
        files = sorted(os.listdir(where[0]))
        assert ".metadata" in files and len([f for f in files if f.endswith(".distcp")]) == size
        target = os.path.join(where[0], "whole.pt")
        clean = {key: value for key, value in os.environ.items()
                 if not key.startswith(("PMI", "MPI", "HYDRA", "OMPI", "PMIX"))}
        subprocess.run([sys.executable, "-c",
                        "import sys, torch.distributed.checkpoint.format_utils as f; "
                        "f.dcp_to_torch_save(sys.argv[1], sys.argv[2])", where[0], target],
                       check=True, env=clean, timeout=120)
        whole = torch.load(target)
        for key, value in net.state_dict().items():
            assert torch.equal(whole["model"][key], value)
