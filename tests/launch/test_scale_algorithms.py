"""The halving algorithms in jobs of 6 ranks (2 x 3, on its factors) and 11 (Rabenseifner's
and recursive doubling's fold onto 8): the default picks them by the cost model's table,
every algorithm gives the reference with the same bits on every rank, on buffers not
divisible by the rank count. With the ring's Python steps the table takes the halving
algorithms for mid sizes; with its compiled steps (the default where numba is installed), the
ring."""

import os

import pytest

import hororing

pytestmark = pytest.mark.timeout(300)

COUNTS = (1, 1001, 40_003, 300_007)


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
            for kind in (None, "ring", "small", "rabenseifner", "recursive_doubling"):
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
    report["compiled_ring"] = pipeline.route.compiled_ring
    hvd.shutdown()
    return report


@pytest.mark.parametrize("ranks, steps", [(6, "off"), (11, "off"), (6, "auto")])
def test_the_default_follows_the_model_and_every_rank_agrees_bitwise(ranks, steps):
    if steps == "auto":
        pytest.importorskip("numba")
    reports = hororing.run(allreduce_every_way, np=ranks,
                           env=dict(os.environ, HORORING_COMPILED_STEPS=steps))
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
    if steps == "off":  # on one host the model takes Rabenseifner's for mid sizes
        assert "rabenseifner" in kinds, first["table"]
        assert seen >= {"small", "rabenseifner"}
    else:  # a compiled ring step is priced below the halving algorithms' Python steps
        assert kinds == {"small", "ring"}, first["table"]
        assert seen == {"small", "ring"}
