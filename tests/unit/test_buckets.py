"""The one fusion rule (engine/buckets.py): which allreduces share a bucket, by their Metas."""

from hororing.engine import Meta, assign


def allreduce(count, dtype="float32", **fields):
    return Meta("allreduce", dtype=dtype, shape=(count,), **fields)


def test_allreduces_of_one_key_fill_buckets_up_to_the_limit_in_order():
    metas = [allreduce(10), allreduce(10), allreduce(10), allreduce(30), allreduce(5),
             allreduce(5)]
    # 40 bytes each for the first three: two fit in 100, the third opens a bucket; 120 bytes
    # alone (larger than the limit); the last two share the bucket the fifth opens
    assert assign(metas, 100) == [[0, 1], [2], [3], [4, 5]]


def test_the_key_is_dtype_op_scales_place_and_wire_and_other_kinds_run_alone():
    metas = [allreduce(1), allreduce(1, dtype="float64"), allreduce(1, op=3),
             allreduce(1, prescale=0.5), allreduce(1, device="cuda"), allreduce(1, wire="float16"),
             Meta("allgather", dtype="float32", shape=(1,)), allreduce(1),
             Meta("broadcast", dtype="float32", shape=(1,), root=0)]
    assert assign(metas, 1 << 20) == [[0, 7], [1], [2], [3], [4], [5], [6], [8]]


def test_sizes_are_bytes_on_the_wire():
    # float16 without a chosen wire is summed in float32: 4 bytes an element; with the fp16
    # wire, 2
    assert assign([allreduce(25, "float16")] * 2, 100) == [[0], [1]]
    assert assign([allreduce(25, "float16", wire="float16")] * 2, 100) == [[0, 1]]
