"""hororing.tensorflow in TF1 graphs: a ``tf.Graph`` run by a ``tf.compat.v1.Session``.

Every verb in a graph run several times with fed inputs, many independent collectives in one
``session.run`` finishing in different orders on different ranks, failures as TensorFlow's
errors, the TF1 optimizer (also with ``backward_passes_per_step``) under
``MonitoredTrainingSession`` with ``BroadcastGlobalVariablesHook``. Expected values are
computed with numpy from every rank's inputs (seeded by rank), never with hororing.
"""

import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import hororing.tensorflow as hvd  # noqa: E402
from hororing.context import current  # noqa: E402


def rank_array(rank, shape, seed=0, dtype=np.float32):
    return np.random.default_rng(1000 * seed + rank).normal(size=shape).astype(dtype)


def every_rank(shape, seed=0, dtype=np.float32):
    return [rank_array(rank, shape, seed, dtype) for rank in range(hvd.size())]


@pytest.fixture
def session():
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
        yield session


def test_every_verb_in_a_graph_run_with_new_inputs_each_time(session):
    size, rank = hvd.size(), hvd.rank()
    dense = tf.compat.v1.placeholder(tf.float32, [7, 3])       # 7 rows: no multiple of 2, 3, 4
    rows = tf.compat.v1.placeholder(tf.float64, [None, 2])     # rank + 1 rows
    scatter = tf.compat.v1.placeholder(tf.float32, [2 * size + 1, 3])
    ops = {
        "sum": hvd.allreduce(dense, op=hvd.Sum),
        "average": hvd.allreduce(dense),
        "max": hvd.allreduce(dense, op=hvd.Max),
        "grouped": hvd.grouped_allreduce([dense, tf.cast(dense, tf.float64) * 2], op=hvd.Sum),
        "gathered": hvd.allgather(rows),
        "broadcast": hvd.broadcast(dense, root_rank=size - 1),
        "alltoall": hvd.alltoall(tf.fill([sum(range(1, size + 1)), 2], float(rank)),
                                 splits=list(range(1, size + 1))),
        "scattered": hvd.reducescatter(scatter, op=hvd.Sum),
        "rank": hvd.rank_op(),
    }
    for run in range(3):
        inputs = every_rank((7, 3), seed=run)
        gather_inputs = [rank_array(peer, (peer + 1, 2), seed=10 + run, dtype=np.float64)
                         for peer in range(size)]
        scatter_inputs = every_rank((2 * size + 1, 3), seed=20 + run)
        out = session.run(ops, {dense: inputs[rank], rows: gather_inputs[rank],
                                scatter: scatter_inputs[rank]})
        np.testing.assert_allclose(out["sum"], np.sum(inputs, axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["average"], np.mean(inputs, axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out["max"], np.max(inputs, axis=0))
        np.testing.assert_allclose(out["grouped"][1], 2 * np.sum(inputs, axis=0), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_array_equal(out["gathered"], np.concatenate(gather_inputs))
        np.testing.assert_array_equal(out["broadcast"], inputs[size - 1])
        # rank r sent r'+1 rows to rank r': this rank got rank+1 rows from every peer
        assert out["alltoall"][0][:, 0].tolist() == [float(peer) for peer in range(size)
                                                     for _ in range(rank + 1)]
        assert out["alltoall"][1].tolist() == [rank + 1] * size
        start = sum(2 + (peer < 1) for peer in range(rank))  # the first rank has one more row
        np.testing.assert_allclose(out["scattered"], np.sum(scatter_inputs, axis=0)
                                   [start:start + 2 + (rank < 1)], rtol=1e-5, atol=1e-6)
        assert out["rank"] == rank


def test_independent_collectives_of_one_run_pair_by_name_whatever_their_order(session):
    """24 allreduces that nothing orders: each waits for its input, which rank-dependent delays
    make ready first-to-last on even ranks and last-to-first on odd ones."""
    size, rank = hvd.size(), hvd.rank()
    count = 24

    def late(value, index):
        position = index if rank % 2 == 0 else count - 1 - index
        time.sleep(0.002 * position)
        return value

    results = []
    for index in range(count):
        value = tf.fill([3 + index % 4], float(100 * index + rank))
        value = tf.numpy_function(lambda v, index=index: late(v, index), [value], tf.float32,
                                  stateful=True)
        results.append(hvd.allreduce(value, op=hvd.Sum))
    for _ in range(2):
        out = session.run(results)
        for index, result in enumerate(out):
            expected = sum(100.0 * index + peer for peer in range(size))
            assert result.tolist() == [expected] * (3 + index % 4), index


def test_an_op_run_many_times_is_negotiated_once(session):
    total = hvd.allreduce(tf.fill([5], float(hvd.rank())), op=hvd.Sum)
    assert session.run(total).tolist() == [float(sum(range(hvd.size())))] * 5
    before = current().engine.stats()["gather_cycles"]
    for _ in range(10):
        session.run(total)
    # the name it was built with is reused by every run: cached after the first, so later runs
    # are one bit in the vote (a gathered cycle or two may come from a slow rank's stall check)
    assert current().engine.stats()["gather_cycles"] - before <= 2


def test_failures_are_tensorflow_errors_and_the_job_goes_on(session):
    size = hvd.size()
    mismatched = hvd.allreduce(tf.ones([2 + hvd.rank()]))
    not_divisible = hvd.alltoall(tf.ones([size + 1]))
    fine = hvd.allreduce(tf.ones([2]), op=hvd.Sum)
    if size > 1:
        with pytest.raises(tf.errors.FailedPreconditionError,
                           match="Mismatched ALLREDUCE tensor shapes"):
            session.run(mismatched)
        with pytest.raises(tf.errors.InvalidArgumentError, match="divisible"):
            session.run(not_divisible)
    assert session.run(fine).tolist() == [float(size)] * 2


def test_sparse_gradients_and_broadcasts_in_a_graph(session):
    size, rank = hvd.size(), hvd.rank()
    table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
    ids = tf.constant([rank % 6, (rank + 1) % 6])
    grad = tf.gradients(tf.reduce_sum(tf.gather(table, ids)), table)[0]
    assert isinstance(grad, tf.IndexedSlices)
    averaged = tf.convert_to_tensor(hvd.allreduce(grad))
    resource = tf.Variable(tf.fill([3], float(rank)))
    reference = tf.compat.v1.Variable(tf.fill([2], float(rank)), use_resource=False)
    broadcast_all = hvd.broadcast_global_variables(root_rank=size - 1)
    session.run(tf.compat.v1.global_variables_initializer())
    expected = np.zeros((6, 2), np.float32)
    for peer in range(size):
        for row in (peer % 6, (peer + 1) % 6):
            expected[row] += 1.0 / size
    np.testing.assert_allclose(session.run(averaged), expected, rtol=1e-6)
    session.run(broadcast_all)
    assert session.run(resource).tolist() == [float(size - 1)] * 3
    assert session.run(reference).tolist() == [float(size - 1)] * 2
    session.run(tf.compat.v1.global_variables_initializer())
    values = hvd.broadcast_([resource, reference], root_rank=0)
    assert [value.tolist() for value in session.run(values)] == [[0.0] * 3, [0.0] * 2]
    assert session.run(resource).tolist() == [0.0] * 3


def _regression(rank, seed=30):
    inputs = rank_array(rank, (8, 3), seed=seed)
    targets = inputs @ np.array([1.0, -2.0, 0.5], np.float32) + 0.1 * rank
    return inputs, targets.astype(np.float32)


def _reference_descent(start, steps, rate, passes_per_step=1):
    """Gradient descent on the mean squared error, each pass's gradient the ranks' average."""
    weights = start.copy()
    pending = np.zeros_like(weights)
    for step in range(steps):
        grads = []
        for peer in range(hvd.size()):
            inputs, targets = _regression(peer)
            grads.append(2 * inputs.T @ (inputs @ weights - targets) / len(targets))
        pending += np.mean(grads, axis=0)
        if (step + 1) % passes_per_step == 0:
            weights -= rate * pending
            pending[:] = 0
    return weights


@pytest.mark.parametrize("passes_per_step", [1, 2])
def test_v1_optimizer_in_a_monitored_training_session(passes_per_step):
    rank = hvd.rank()
    starts = [rank_array(peer, (3,), seed=40) for peer in range(hvd.size())]
    graph = tf.Graph()
    with graph.as_default():
        inputs, targets = _regression(rank)
        weights = tf.Variable(starts[rank])  # every rank starts elsewhere: the hook fixes that
        loss = tf.reduce_mean(tf.square(tf.linalg.matvec(tf.constant(inputs), weights)
                                        - tf.constant(targets)))
        step = tf.compat.v1.train.get_or_create_global_step()
        optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05),
                                             backward_passes_per_step=passes_per_step)
        train = optimizer.minimize(loss, global_step=step)
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session:
            for _ in range(6):
                session.run(train)
            final, steps = session.run([weights, step])
    expected = _reference_descent(starts[0], 6, 0.05, passes_per_step)
    np.testing.assert_allclose(final, expected, rtol=1e-4, atol=1e-5)
    assert steps == 6  # a pass that only accumulates still counts as a step
    assert hvd.allgather_object(final.tobytes()) == [final.tobytes()] * hvd.size()


def test_tensorflow_state_in_a_graph_syncs_restores_and_commits(session):
    rank = hvd.rank()
    weights = tf.compat.v1.get_variable("elastic_w", initializer=np.full((2, 3), rank + 1.0,
                                                                         np.float32))
    bias = tf.compat.v1.get_variable("elastic_b", initializer=np.full(3, -rank, np.float64))
    session.run(tf.compat.v1.global_variables_initializer())
    state = hvd.elastic.TensorFlowState([weights, bias], session=session, step=10 + rank)
    state.sync()
    w, b = session.run([weights, bias])
    assert np.array_equal(w, np.ones((2, 3))) and np.array_equal(b, np.zeros(3))
    assert state.step == 10
    weights.load(np.full((2, 3), 7.0), session)
    state.step = 11
    state.restore()
    assert np.array_equal(session.run(weights), np.ones((2, 3))) and state.step == 10
    weights.load(np.full((2, 3), 5.0), session)
    state.step = 12
    state.commit()
    weights.load(np.zeros((2, 3)), session)
    state.restore()
    assert np.array_equal(session.run(weights), np.full((2, 3), 5.0)) and state.step == 12
    snapshot = state.snapshot()
    assert np.array_equal(snapshot["handlers"]["variables"][0], np.full((2, 3), 5.0))
