"""The torch.distributed backend's parts that need no MPI: the store a job without
MASTER_ADDR gets, and how torch's reduce ops map to hororing's."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from hororing import ops  # noqa: E402
from hororing.environment import torch_rendezvous  # noqa: E402
from hororing.torch.distributed.backend import reduction  # noqa: E402
from hororing.torch.distributed.rendezvous import ProcessStore  # noqa: E402


def test_the_process_store_keeps_what_this_rank_set():
    store = ProcessStore(rank=3)
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert store.add("count", 2) == 2 and store.add("count", 3) == 5
    assert store.check(["a"]) and not store.check(["a", "b"])
    assert store.num_keys() == 2
    assert store.delete_key("a") and not store.delete_key("a")


def test_the_process_store_names_the_fix_for_a_key_another_rank_would_set():
    store = ProcessStore(rank=1)
    with pytest.raises(RuntimeError, match=r"rank 1 .*'peer'.*MASTER_ADDR.*MASTER_PORT"):
        store.get("peer")
    with pytest.raises(RuntimeError, match="no shared store"):
        store.wait(["x"])


def test_a_prefix_store_over_it_works_as_torch_uses_it():
    inner = ProcessStore(rank=0)  # held: torch keeps only a Python store's C++ side
    store = dist.PrefixStore("group/", inner)
    store.set("key", "value")
    assert store.get("key") == b"value"


@pytest.mark.parametrize("torch_op, expected", [
    (dist.ReduceOp.SUM, (ops.Sum, 1.0)), (dist.ReduceOp.AVG, (ops.Average, 1.0)),
    (dist.ReduceOp.PRODUCT, (ops.Product, 1.0)), (dist.ReduceOp.MIN, (ops.Min, 1.0)),
    (dist.ReduceOp.MAX, (ops.Max, 1.0))])
def test_reduce_ops_map_to_hororings(torch_op, expected):
    assert reduction(torch_op) == expected


def test_premul_sum_is_a_sum_with_a_prescale():
    assert reduction(dist._make_nccl_premul_sum(0.25)) == (ops.Sum, 0.25)


@pytest.mark.parametrize("bitwise", [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR])
def test_bitwise_ops_are_refused_with_what_to_use(bitwise):
    with pytest.raises(ValueError, match="MAX .*MIN"):
        reduction(bitwise)


def test_the_rendezvous_reads_torchs_variables():
    assert torch_rendezvous({}) == (False, "", "")
    assert torch_rendezvous({"RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == \
        (True, "h", "1")
