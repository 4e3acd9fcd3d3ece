"""Inputs every rank can regenerate for every other rank, and numpy references over them.

Each rank's input comes from a generator seeded by (test seed, rank), so any rank builds
all ranks' inputs locally and computes the expected result without MPI.
"""

import numpy as np

import hororing as hvd

FLOAT_DTYPES = ("float16", "float32", "float64")
ALL_DTYPES = ("uint8", "int8", "int16", "int32", "int64") + FLOAT_DTYPES


def rank_input(rank, shape, dtype, seed=0, op=None):
    """Deterministic input of ``rank``: small values, kept positive and tiny for Product."""
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if op == hvd.Product:
        return rng.integers(1, 3, size=shape).astype(dtype)
    if dtype.kind == "f":
        return rng.uniform(-20, 20, size=shape).astype(dtype)
    low = 0 if dtype.kind == "u" else -20
    return rng.integers(low, 21, size=shape).astype(dtype)


def all_inputs(size, shape, dtype, seed=0, op=None):
    return [rank_input(rank, shape, dtype, seed, op) for rank in range(size)]


def reference_allreduce(inputs, op, prescale=1.0, postscale=1.0):
    """The expected allreduce in float64 / Python integers, then cast to the input dtype."""
    dtype = inputs[0].dtype
    wide = np.float64 if dtype.kind == "f" else object
    stacked = np.stack([np.asarray(array, dtype=wide) for array in inputs])
    if dtype.kind == "f":
        stacked = stacked * prescale
    elif prescale != 1.0:
        stacked = np.trunc(stacked.astype(np.float64) * prescale).astype(object)
    if op in (hvd.Sum, hvd.Average):
        result = stacked.sum(axis=0)
    elif op == hvd.Min:
        result = stacked.min(axis=0)
    elif op == hvd.Max:
        result = stacked.max(axis=0)
    else:
        result = stacked.prod(axis=0)
    size = len(inputs)
    if op == hvd.Average:
        if dtype.kind == "f":
            result = result / size
        else:  # the sum in the dtype (wrapped, as MPI's), then C division: toward zero
            result = _wrapped(result, dtype)
            result = np.array([(abs(v) // size) * (1 if v >= 0 else -1) for v in result.ravel()],
                              dtype=object).reshape(result.shape)
    if dtype.kind == "f":
        result = result * postscale
    elif postscale != 1.0:
        result = np.trunc(result.astype(np.float64) * postscale)
    if dtype.kind in "iu":  # wrapped to the dtype's range (a product of 8 twos in uint8 is 0)
        wrapped = _wrapped(np.asarray(result), dtype)
        return np.array(wrapped.ravel().tolist(), dtype=dtype).reshape(wrapped.shape)
    return np.asarray(result).astype(dtype)


def _wrapped(values, dtype):
    """Integer ``values`` wrapped to ``dtype``'s range, as arithmetic in the dtype wraps (sums
    of 8 ranks' int8 values leave it)."""
    bits = 8 * dtype.itemsize
    wrapped = []
    for value in values.ravel():
        value = int(value) % (1 << bits)
        if dtype.kind == "i" and value >= 1 << (bits - 1):
            value -= 1 << bits
        wrapped.append(value)
    return np.array(wrapped, dtype=object).reshape(values.shape)


def tolerance(dtype):
    return {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}.get(np.dtype(dtype).name, 0)


def assert_close(actual, expected):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    rtol = tolerance(expected.dtype)
    if rtol == 0:
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64),
                                   rtol=rtol, atol=rtol * 40)


def assert_identical_on_every_rank(array):
    """Gather the bytes of ``array`` from every rank and require them to be equal."""
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    gathered = hvd.allgather(raw.reshape(1, -1))
    for row in gathered[1:]:
        assert row.tobytes() == gathered[0].tobytes(), "ranks hold different bytes"


def adasum_pair(a, b):
    """Adasum of two vectors, as Maleki et al. write it, in float64."""
    dot = float(np.dot(a, b))
    scale_a = 1.0 - dot / (2.0 * float(np.dot(a, a))) if np.any(a) else 1.0
    scale_b = 1.0 - dot / (2.0 * float(np.dot(b, b))) if np.any(b) else 1.0
    return scale_a * a + scale_b * b


def adasum_tree(vectors):
    """The ranks' vectors combined as the library's tree combines them: rank P + i into
    rank i first (P: the largest power of two up to the count), then halves recursively."""
    vectors = [np.asarray(vector, dtype=np.float64).ravel() for vector in vectors]
    core = 1
    while core * 2 <= len(vectors):
        core *= 2
    folded = [adasum_pair(vectors[i], vectors[i + core]) if i + core < len(vectors)
              else vectors[i] for i in range(core)]

    def halves(group):
        if len(group) == 1:
            return group[0]
        middle = len(group) // 2
        return adasum_pair(halves(group[:middle]), halves(group[middle:]))
    return halves(folded)


def int8_mean(changes, residuals, working=np.float64):
    """The average of every rank's change sent as int8 with error feedback, written out:
    rank r sends its change plus ``residuals[r]`` in whole steps of the largest magnitude
    over 127 (that step held as a float32), keeps in ``residuals[r]`` what the steps missed,
    and the sent values are summed in rank order and divided by the ranks. ``changes``: one
    array per rank; every value is computed in ``working`` (a float32 model's changes are
    rounded in float32, where a halfway case can fall the other way than in float64)."""
    total = np.zeros(np.shape(changes[0]), dtype=working)
    for rank, change in enumerate(changes):
        wanted = np.asarray(change, dtype=working) + np.asarray(residuals[rank], dtype=working)
        peak = float(np.abs(wanted).max())
        step = working(np.float32(peak / 127)) if peak > 0 else working(1.0)
        sent = np.clip(np.rint(wanted / step), -127, 127) * step
        residuals[rank] = wanted - sent
        total += sent
    return total / working(len(changes))


def every_rank_on_one_node():
    """Whether every rank of the job shares one node, as MPI sees nodes (emulated hosts and
    MPICH's cliques are nodes of their own): asked of MPI, not of hororing."""
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() == MPI.COMM_WORLD.Get_size()
    finally:
        node.Free()
