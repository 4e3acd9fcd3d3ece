"""hororing.tensorflow: verbs on tf tensors eagerly and in tf.function, gradients, tapes.

Expected values are computed here with numpy from every rank's inputs, which each rank can
build itself (they are seeded by rank), never with hororing.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import hororing.tensorflow as hvd  # noqa: E402


def rank_array(rank, shape, seed=0, dtype=np.float32):
    return np.random.default_rng(1000 * seed + rank).normal(size=shape).astype(dtype)


def every_rank(shape, seed=0, dtype=np.float32):
    return [rank_array(rank, shape, seed, dtype) for rank in range(hvd.size())]


# ---- the verbs, eager ---------------------------------------------------------------------

@pytest.mark.parametrize("op, reference", [("Sum", np.sum), ("Average", np.mean),
                                           ("Min", np.min), ("Max", np.max),
                                           ("Product", np.prod)])
def test_allreduce_ops_match_numpy(op, reference):
    inputs = every_rank((7, 3), seed=1)  # 7 rows: not a multiple of 2, 3 or 4 ranks
    result = hvd.allreduce(tf.constant(inputs[hvd.rank()]), op=getattr(hvd, op))
    assert result.dtype == tf.float32 and result.shape == (7, 3)
    np.testing.assert_allclose(result.numpy(), reference(np.stack(inputs), axis=0), rtol=1e-5)


def test_allreduce_dtypes_scaling_and_variables():
    size, rank = hvd.size(), hvd.rank()
    ints = hvd.allreduce(tf.fill([5], rank + 1), op=hvd.Sum)
    assert ints.dtype == tf.int32 and ints.numpy().tolist() == [size * (size + 1) // 2] * 5
    half = hvd.allreduce(tf.ones([3], tf.float16) * 2)
    assert half.dtype == tf.float16 and half.numpy().tolist() == [2.0] * 3
    brain = hvd.allreduce(tf.fill([4], tf.constant(1.5, tf.bfloat16)), op=hvd.Sum)
    assert brain.dtype == tf.bfloat16 and brain.numpy().astype(float).tolist() == [1.5 * size] * 4
    scaled = hvd.allreduce(tf.ones([2]), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert scaled.numpy().tolist() == [float(size)] * 2
    variable = tf.Variable(tf.fill([3], float(rank)))
    assert hvd.allreduce(variable, op=hvd.Max).numpy().tolist() == [float(size - 1)] * 3
    compressed = hvd.allreduce(tf.fill([6], 0.25 * (rank + 1)), compression=hvd.Compression.fp16)
    assert compressed.dtype == tf.float32
    np.testing.assert_allclose(compressed.numpy(), 0.25 * (size + 1) / 2, rtol=1e-3)


def test_allgather_broadcast_alltoall_reducescatter():
    size, rank = hvd.size(), hvd.rank()
    gathered = hvd.allgather(tf.constant(np.full((rank + 1, 2), rank, np.int64)))
    assert gathered.numpy().tolist() == [[peer, peer] for peer in range(size)
                                         for _ in range(peer + 1)]
    flags = hvd.broadcast(tf.constant([rank == size - 1, True]), root_rank=size - 1)
    assert flags.dtype == tf.bool and flags.numpy().tolist() == [True, True]
    received = hvd.alltoall(tf.range(2 * size) + 100 * rank)
    assert received.numpy().tolist() == [100 * peer + 2 * rank + k for peer in range(size)
                                         for k in range(2)]
    splits = [peer + 1 for peer in range(size)]  # rank r sends r'+1 rows to rank r'
    rows = tf.constant(np.full((sum(splits), 1), rank, np.float32))
    got, got_splits = hvd.alltoall(rows, splits=splits)
    assert got_splits.numpy().tolist() == [rank + 1] * size
    assert got.numpy().ravel().tolist() == [float(peer) for peer in range(size)
                                            for _ in range(rank + 1)]
    inputs = every_rank((2 * size + 1, 3), seed=2)  # one row more than an even split
    mine = hvd.reducescatter(tf.constant(inputs[rank]), op=hvd.Sum)
    total = np.sum(inputs, axis=0)
    start = sum(2 + (peer < 1) for peer in range(rank))
    np.testing.assert_allclose(mine.numpy(), total[start:start + 2 + (rank < 1)], rtol=1e-5)


def test_grouped_verbs():
    size, rank = hvd.size(), hvd.rank()
    first, second = hvd.grouped_allreduce([tf.ones([3]), tf.fill([2, 2], float(rank))], op=hvd.Sum)
    assert first.numpy().tolist() == [float(size)] * 3
    assert second.numpy().tolist() == [[float(sum(range(size)))] * 2] * 2
    gathered = hvd.grouped_allgather([tf.fill([1], rank), tf.fill([2, 1], 7)])
    assert gathered[0].numpy().tolist() == list(range(size)) and gathered[1].shape == (2 * size, 1)
    blocks = hvd.grouped_reducescatter([tf.ones([size, 2]), tf.ones([2 * size])])
    assert blocks[0].numpy().tolist() == [[1.0, 1.0]] and blocks[1].numpy().tolist() == [1.0, 1.0]


def test_object_helpers_and_queries():
    rank = hvd.rank()
    assert hvd.broadcast_object({"from": rank}, root_rank=0) == {"from": 0}
    assert hvd.allgather_object(rank * 2) == [2 * peer for peer in range(hvd.size())]
    assert int(hvd.size_op()) == hvd.size() and int(hvd.rank_op()) == rank
    assert int(hvd.local_size_op()) == hvd.local_size() and int(hvd.local_rank_op()) == hvd.local_rank()
    assert int(hvd.process_set_included_op()) == 1
    hvd.barrier()


def test_join_and_barrier_run_when_the_function_runs():
    @tf.function
    def finish():
        hvd.barrier()
        return hvd.join()
    for _ in range(2):  # traced once, joined on every call
        last = int(finish())
        assert hvd.allgather_object(last) == [last] * hvd.size() and 0 <= last < hvd.size()
    assert int(hvd.join()) in range(hvd.size())


def test_broadcast_variables_assigns_root_values():
    rank = hvd.rank()
    variables = [tf.Variable(tf.fill([3], float(rank))), tf.Variable(rank, dtype=tf.int64),
                 tf.Variable(tf.fill([2, 2], tf.constant(rank, tf.bfloat16)))]
    assert hvd.broadcast_variables(variables, root_rank=hvd.size() - 1) is None
    last = hvd.size() - 1
    assert variables[0].numpy().tolist() == [float(last)] * 3
    assert int(variables[1].numpy()) == last
    assert variables[2].numpy().astype(float).tolist() == [[float(last)] * 2] * 2


def test_broadcast_variables_of_an_unbuilt_keras_model_warns_that_nothing_was_sent():
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.layers.Dense(2)])  # weights made on the first call
    with pytest.warns(UserWarning, match="given no variables.*built on its first batch"):
        hvd.broadcast_variables(model.variables, root_rank=0)


# ---- inside tf.function ---------------------------------------------------------------------

def test_tf_function_runs_collectives_in_program_order_every_call():
    size, rank = hvd.size(), hvd.rank()

    @tf.function
    def step(small, large):
        # independent of each other: only program order keeps them paired across ranks
        a = hvd.allreduce(small, op=hvd.Sum)
        b = hvd.allgather(large)
        c = hvd.broadcast(small * 0 + tf.cast(hvd.rank_op(), tf.float32), root_rank=0)
        d = hvd.allreduce(large, op=hvd.Max)
        return a, b, c, d

    for call in range(3):
        a, b, c, d = step(tf.fill([3], float(rank + call)), tf.fill([2, 4], float(rank)))
        assert a.shape == (3,) and b.shape == (2 * size, 4)  # static shapes survive the op
        assert a.numpy().tolist() == [float(sum(range(size)) + size * call)] * 3
        assert b.numpy()[::2, 0].tolist() == [float(peer) for peer in range(size)]
        assert c.numpy().tolist() == [0.0] * 3
        assert d.numpy().max() == size - 1
    assert step.experimental_get_tracing_count() == 1  # one trace: the names are reused


def test_collective_in_a_cond_branch_pairs_up_after_rank_dependent_tracing():
    @tf.function
    def busy(x):
        for _ in range(hvd.rank() + 1):  # each rank builds a different number of graphs
            x = tf.cond(x[0] > 0, lambda: x + 1, lambda: x)
        return x
    busy(tf.ones([1]))

    @tf.function
    def step(x):  # the branch's own graph is numbered process-wide; the name must not be
        return tf.cond(x[0] > 0, lambda: hvd.allreduce(x, op=hvd.Sum), lambda: x)
    assert step(tf.ones([2])).numpy().tolist() == [float(hvd.size())] * 2


def test_tf_function_with_jit_compile_is_refused_with_the_fix():
    @tf.function(jit_compile=True)
    def step(x):
        return hvd.allreduce(x)
    with pytest.raises(RuntimeError, match="jit_compile=False"):
        step(tf.ones([2]))


# ---- gradients ------------------------------------------------------------------------------

def test_gradients_of_the_collectives():
    size, rank = hvd.size(), hvd.rank()
    x = tf.Variable(tf.ones([3]))
    with tf.GradientTape(persistent=True) as tape:
        summed = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum))
        rows = tf.Variable(tf.ones([rank + 1, 2]))
        gathered = hvd.allgather(rows * 1.0)
        weights = tf.range(tf.shape(gathered)[0], dtype=tf.float32)[:, None]
        weighted = tf.reduce_sum(gathered * weights)
        broadcast = tf.reduce_sum(hvd.broadcast(x * 3.0, root_rank=0))
        scattered = tf.reduce_sum(hvd.reducescatter(tf.reshape(x, [3, 1]) * 1.0, op=hvd.Sum))
    assert tape.gradient(summed, x).numpy().tolist() == [float(size)] * 3  # allreduce(Sum) of ones
    offset = rank * (rank + 1) // 2
    expected = [[float(offset + k)] * 2 for k in range(rank + 1)]
    assert tape.gradient(weighted, rows).numpy().tolist() == expected
    # the averaged gradient on the root, zero elsewhere
    assert tape.gradient(broadcast, x).numpy().tolist() == [3.0 if rank == 0 else 0.0] * 3
    # allgather of the ones the output's gradient is, scaled by size for Sum (Horovod's rule)
    assert tape.gradient(scattered, x).numpy().tolist() == [float(size)] * 3


def test_distributed_gradient_tape_averages_and_fuses(reduced_buffers):
    size, rank = hvd.size(), hvd.rank()
    shapes = [(5, 3), (3,), (3, 2), (2,)]
    weights = [tf.Variable(rank_array(0, shape, seed=5 + index)) for index, shape in enumerate(shapes)]
    inputs = every_rank((4, 5), seed=9)

    def loss_of(x):
        hidden = tf.tanh(tf.matmul(x, weights[0]) + weights[1])
        return tf.reduce_sum(tf.square(tf.matmul(hidden, weights[2]) + weights[3]))

    local = []
    for peer in range(size):  # every rank's own gradient, computed here as a reference
        with tf.GradientTape() as plain:
            loss = loss_of(tf.constant(inputs[peer]))
        local.append([grad.numpy() for grad in plain.gradient(loss, weights)])
    with tf.GradientTape() as tape:
        loss = loss_of(tf.constant(inputs[rank]))
    del reduced_buffers[:]
    grads = hvd.DistributedGradientTape(tape).gradient(loss, weights)
    for index, grad in enumerate(grads):
        np.testing.assert_allclose(grad.numpy(), np.mean([g[index] for g in local], axis=0),
                                   rtol=1e-5, atol=1e-6)
    if size > 1:  # four gradients, one fused reduction (size 1 moves no data)
        assert [count for _, _, count in reduced_buffers] == [sum(np.prod(s) for s in shapes)]


@pytest.mark.parametrize("kind,wire", [("fp16", "float16"), ("bf16", "bfloat16")])
def test_16_bit_compression_sends_a_tapes_gradients_in_16_bits(kind, wire, reduced_buffers):
    size, rank = hvd.size(), hvd.rank()
    weights = [tf.Variable(tf.ones([5])), tf.Variable(tf.ones([3]))]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(weights[0] * float(rank + 1)) + tf.reduce_sum(weights[1])
    del reduced_buffers[:]
    grads = hvd.DistributedGradientTape(
        tape, compression=getattr(hvd.Compression, kind)).gradient(loss, weights)
    assert [grad.dtype for grad in grads] == [tf.float32, tf.float32]
    # at 1-3 ranks the 16-bit sums of (rank + 1) / size and 1 / size round to these values
    assert grads[0].numpy().tolist() == [(size + 1) / 2] * 5
    assert grads[1].numpy().tolist() == [1.0] * 3
    if size > 1:  # half the bytes: the fused buffer is 16-bit
        assert reduced_buffers and {dtype for _, dtype, _ in reduced_buffers} == {wire}


def test_gradient_tape_in_tf_function_and_sparse_gradients():
    size, rank = hvd.size(), hvd.rank()
    table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
    dense = tf.Variable(tf.ones([2]))
    ids = tf.constant([rank % 6, (rank + 1) % 6])

    @tf.function
    def grads(sparse_as_dense):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids) * dense)
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, [table, dense])

    expected = np.zeros((6, 2), np.float32)
    for peer in range(size):
        for row in (peer % 6, (peer + 1) % 6):
            expected[row] += 1.0 / size
    sparse, _ = grads(False)
    assert isinstance(sparse, tf.IndexedSlices)
    np.testing.assert_allclose(tf.convert_to_tensor(sparse).numpy(), expected, rtol=1e-6)
    densified, dense_grad = grads(True)
    assert isinstance(densified, tf.Tensor)
    np.testing.assert_allclose(densified.numpy(), expected, rtol=1e-6)
    expected_dense = np.mean([table.numpy()[[peer % 6, (peer + 1) % 6]].sum(axis=0)
                              for peer in range(size)], axis=0)
    np.testing.assert_allclose(dense_grad.numpy(), expected_dense, rtol=1e-6)


def test_partial_tape_keeps_local_layers_local():
    import keras
    size, rank = hvd.size(), hvd.rank()
    shared, local = keras.layers.Dense(2), keras.layers.Dense(1)
    x = tf.constant(rank_array(rank, (3, 4), seed=11))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(shared(x)))
    variables = shared.trainable_weights + local.trainable_weights
    reference = tape.gradient(loss, variables)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(shared(x)))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    grads = tape.gradient(loss, variables)
    for grad, own in zip(grads[2:], reference[2:]):  # local: own gradient / size
        np.testing.assert_allclose(grad.numpy(), own.numpy() / size, rtol=1e-5)
    averaged = hvd.allreduce(reference[0])
    np.testing.assert_allclose(grads[0].numpy(), averaged.numpy(), rtol=1e-5)
    # Horovod's split of the same gradients: (variable, gradient) pairs, local then global
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(shared(x)))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, variables)
    assert [variable.name for variable, _ in local_pairs] == \
        [variable.name for variable in local.trainable_weights]
    assert [variable.name for variable, _ in global_pairs] == \
        [variable.name for variable in shared.trainable_weights]
    for (_, grad), expected in zip(local_pairs + global_pairs, grads[2:] + grads[:2]):
        np.testing.assert_allclose(grad.numpy(), expected.numpy(), rtol=1e-6)


def test_horovods_private_basics_list_the_process_sets_ranks():
    """``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()``, which Horovod's process set
    tests read: every registered set's ranks by id, the global set's 0."""
    from hororing.tensorflow import mpi_ops
    size = hvd.size()
    assert mpi_ops._basics._get_process_set_ids_and_ranks() == {0: list(range(size))}
    if size < 2:
        return
    evens = hvd.add_process_set(list(range(0, size, 2)))
    try:
        assert mpi_ops._basics._get_process_set_ids_and_ranks() == {
            0: list(range(size)), evens.process_set_id: list(range(0, size, 2))}
    finally:
        hvd.remove_process_set(evens)
    assert mpi_ops._basics._get_process_set_ids_and_ranks() == {0: list(range(size))}


def test_v1_optimizer_averages_compute_gradients():
    size, rank = hvd.size(), hvd.rank()
    variable = tf.Variable([1.0, 2.0])
    optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
    pairs = optimizer.compute_gradients(lambda: tf.reduce_sum(variable * float(rank)),
                                        var_list=[variable])
    average = sum(range(size)) / size
    assert pairs[0][0].numpy().tolist() == [average] * 2
    optimizer.apply_gradients(pairs)
    assert variable.numpy().tolist() == [1.0 - 0.5 * average, 2.0 - 0.5 * average]


def test_sync_batch_normalization_uses_the_global_batch():
    size, rank = hvd.size(), hvd.rank()
    inputs = every_rank((3, 4), seed=13)
    layer = hvd.SyncBatchNormalization(epsilon=1e-3, momentum=0.5)
    out = layer(tf.constant(inputs[rank]), training=True).numpy()
    everything = np.concatenate(inputs)
    mean, var = everything.mean(axis=0), everything.var(axis=0)
    np.testing.assert_allclose(out, (inputs[rank] - mean) / np.sqrt(var + 1e-3), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * mean, rtol=1e-4, atol=1e-6)
    assert size == hvd.size()


# ---- bad input ------------------------------------------------------------------------------

def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="tf.convert_to_tensor"):
        hvd.allreduce(np.ones(3))
    with pytest.raises(TypeError, match="dtype string"):
        hvd.broadcast(tf.constant(["a"]), root_rank=0)
    with pytest.raises(TypeError, match="complex64"):
        hvd.allreduce(tf.constant([1j], tf.complex64))
    with pytest.raises(TypeError, match="bool tensor, which cannot be reduced"):
        hvd.allreduce(tf.constant([True]))
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.allgather(tf.constant(1.0))
    with pytest.raises(TypeError, match="wraps a Keras optimizer or a tf.compat.v1"):
        hvd.DistributedOptimizer(object())
    with pytest.raises(TypeError, match="wraps a tf.GradientTape"):
        hvd.DistributedGradientTape(object())


def test_mismatched_shapes_fail_on_every_rank():
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    # both TensorFlow's error (as Horovod's op raises) and hororing's
    with pytest.raises(tf.errors.FailedPreconditionError, match="shape") as caught:
        hvd.allreduce(tf.ones([2 + hvd.rank()]), name="tf.mismatched")
    assert isinstance(caught.value, hvd.HorovodInternalError)
    # the job goes on afterwards
    assert hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist() == [float(hvd.size())] * 2


def test_mismatch_inside_tf_function_keeps_the_message():
    if hvd.size() == 1:
        pytest.skip("needs two ranks")

    @tf.function
    def step(x):
        return hvd.allreduce(x)
    with pytest.raises(tf.errors.FailedPreconditionError,
                       match="Mismatched ALLREDUCE tensor shapes"):
        step(tf.ones([2 + hvd.rank()]))
    assert step(tf.ones([2])).numpy().tolist() == [1.0, 1.0]


def test_elastic_run_rolls_back_when_a_collective_fails_inside_a_tf_function():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    variable = tf.Variable(np.zeros(3, np.float32))
    state = hvd.elastic.TensorFlowState([variable], step=0)

    @tf.function
    def mismatched():  # the ranks disagree on the shape
        return hvd.allreduce(tf.zeros([2 + hvd.rank() % 2]), name="elastic.tf_mismatch")

    @hvd.elastic.run
    def train(state):
        variable.assign(np.ones(3, np.float32))
        state.step = 1
        state.commit()
        variable.assign(np.full(3, 9.0, np.float32))
        state.step = 2
        mismatched()

    with pytest.raises(hvd.HorovodInternalError, match="elastic.tf_mismatch"):
        train(state)
    assert state.step == 1 and np.array_equal(variable.numpy(), np.ones(3))


def test_adasum_eagerly_and_in_tf_function_matches_the_tree():
    from reference import adasum_tree
    inputs = every_rank((7, 3), seed=41, dtype=np.float64)
    expected = adasum_tree(inputs).reshape(7, 3)
    eager = hvd.allreduce(tf.constant(inputs[hvd.rank()]), op=hvd.Adasum, name="tf.adasum")
    np.testing.assert_allclose(eager.numpy(), expected, rtol=1e-12, atol=1e-12)
    traced = tf.function(lambda x: hvd.allreduce(x, op=hvd.Adasum, name="tf.adasum.fn"))
    np.testing.assert_allclose(traced(tf.constant(inputs[hvd.rank()])).numpy(), expected,
                               rtol=1e-12, atol=1e-12)
