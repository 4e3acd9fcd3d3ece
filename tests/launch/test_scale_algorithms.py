"""The halving algorithms in jobs of 6 ranks (2 x 3, on its factors) and 11 (Rabenseifner's
and recursive doubling's fold onto 8): the default picks them by the cost model's table,
every algorithm gives the reference with the same bits on every rank, on buffers not
divisible by the rank count. With the ring's Python steps the table takes the halving
algorithms for mid sizes; with its compiled steps (the default where numba is installed), the
ring. On this one host the allreduce through shared memory takes the sizes below 4 MiB that
the model gives those (``cost.with_shared``): it is switched off for the model's own choice,
and on in a job of its own; where ranks crowd the cores (8 on 2) of a node with a large cache
it takes every size, in large segments (``cost.shared_segment_bytes``), the largest of which
goes around the node where 8 rows of it outgrow the last-level cache."""

import os

import pytest

import hororing
from hororing.algorithms import cost

pytestmark = pytest.mark.timeout(300)

COUNTS = (1, 1001, 40_003, 550_007)  # the last one past cost.SHARED_LARGEST_BYTES in float64


def allreduce_every_way():
    import hashlib

    import numpy as np

    import hororing as hvd
    from hororing.algorithms import cost
    from hororing.context import current

    hvd.init()
    pipeline = current().engine.allreduce
    size, rank = hvd.size(), hvd.rank()
    report = {"default": [], "digests": [], "wrong": 0}
    for count in COUNTS:
        for dtype, op in (("float64", hvd.Sum), ("int32", hvd.Max), ("float32", hvd.Average)):
            inputs = [np.random.default_rng([count, peer]).integers(-50, 50, count)
                      .astype(dtype) for peer in range(size)]
            stacked = np.stack(inputs).astype(np.float64)
            expected = {hvd.Sum: stacked.sum(0), hvd.Max: stacked.max(0),
                        hvd.Average: stacked.mean(0)}[op]
            kinds = (None, "ring", "small", "rabenseifner", "recursive_doubling")
            if pipeline.has("shared"):
                kinds += ("shared",)
            for kind in kinds:
                pipeline.force(kind)
                try:
                    with pipeline.watch() as seen:
                        result = hvd.allreduce(inputs[rank], op=op,
                                               name=f"every.{count}.{dtype}.{kind}")
                finally:
                    pipeline.force(None)
                if kind is None:
                    nbytes = count * np.dtype(dtype).itemsize
                    report["default"].append((nbytes, seen[0][0],
                                              cost.lookup(pipeline.route.table, nbytes)))
                else:
                    assert seen[0][0] == kind, (kind, seen)
                if not np.allclose(result.astype(np.float64), expected, rtol=1e-6):
                    report["wrong"] += 1
                report["digests"].append(hashlib.sha1(result.tobytes()).hexdigest())
    report["table"] = pipeline.route.table
    report["shared"] = pipeline.route.shared
    report["contention"] = pipeline.route.contention
    report["compiled_ring"] = pipeline.route.compiled_ring
    shared = pipeline.host.algorithms.get("shared")
    report["around_above"] = None if shared is None or shared.around_above is None \
        else shared.around_above()
    report["around_segments"] = 0 if shared is None else shared.around_segments
    hvd.shutdown()
    return report


def segment_for_this_node(ranks, contention):
    """The shared allreduce's segment the rule gives ``ranks`` ranks at ``contention`` on
    this node, read as the executor reads it (its free /dev/shm, its last-level cache)."""
    from hororing import cores
    from hororing.algorithms.shared import shm_quarter
    return cost.shared_segment_bytes(ranks, contention, shm_quarter() or 0,
                                     cores.last_level_cache())


@pytest.mark.parametrize("ranks, steps, shared", [(6, "off", "0"), (11, "off", "0"),
                                                  (6, "auto", "0"), (6, "auto", "1"),
                                                  (8, "auto", "1")])
def test_the_default_follows_the_model_and_every_rank_agrees_bitwise(ranks, steps, shared):
    if steps == "auto":
        pytest.importorskip("numba")
    reports = hororing.run(allreduce_every_way, np=ranks,
                           env=dict(os.environ, HORORING_COMPILED_STEPS=steps,
                                    HORORING_SHARED_ALLREDUCE=shared))
    assert all(report["wrong"] == 0 for report in reports), [r["wrong"] for r in reports]
    first = reports[0]
    for report in reports[1:]:
        assert report["digests"] == first["digests"]
        assert report["default"] == first["default"]
    for nbytes, seen, table_kind in first["default"]:
        assert seen == table_kind, (nbytes, seen, table_kind)
    kinds = {kind for _, kind in first["table"]}
    seen = {seen for _, seen, _ in first["default"]}
    assert first["compiled_ring"] == (steps == "auto")
    if shared == "1":
        assert first["shared"] == segment_for_this_node(ranks, first["contention"])
    if shared == "1" and first["shared"] == cost.SHARED_CROWDED_SEGMENT_BYTES:
        # ranks crowd the cores (8 on 2) of a large cache: the shared allreduce in large
        # segments, every size
        assert first["contention"] >= cost.SHARED_CROWDED
        assert kinds == {"small", "shared"}, first["table"]
        assert seen == {"small", "shared"}
        # the largest buffer's one segment went around the node (algorithms/shared.py)
        # exactly where 8 rows of it outgrow the last-level cache
        largest = COUNTS[-1] * 8
        around = first["around_above"] is not None and largest > first["around_above"]
        assert (first["around_segments"] > 0) == around, (first["around_above"],
                                                          first["around_segments"])
    elif shared == "1":  # the model's ring below 4 MiB goes through shared memory
        assert first["shared"] == cost.SHARED_SEGMENT_BYTES
        assert kinds == {"small", "shared", "ring"}, first["table"]
        assert seen == {"small", "shared", "ring"}
    elif steps == "off":  # on one host the model takes Rabenseifner's for mid sizes
        assert "rabenseifner" in kinds, first["table"]
        assert seen >= {"small", "rabenseifner"}
    else:  # a compiled ring step is priced below the halving algorithms' Python steps
        assert kinds == {"small", "ring"}, first["table"]
        assert seen == {"small", "ring"}
