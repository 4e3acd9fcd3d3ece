"""Local gradient aggregation: ``backward_passes_per_step`` for optimizers that lack their own.

The gradients of N backward passes are summed on each rank, and only the N-th pass reduces
the sum across ranks and applies it; the passes in between move no data. Keras 3 optimizers
accumulate themselves (``gradient_accumulation_steps``, used by keras/optimizer.py); tf-keras
optimizers get this helper, which Horovod's wrapper exposes as ``optimizer._agg_helper``.

It runs eagerly and inside ``tf.function``: the sums and the pass counter are variables made
on first use, and the choice between "keep summing" and "reduce and apply" is a ``tf.cond``
on the counter, which is the same on every rank, so every rank takes the same branch and
reduces together.
"""

import tensorflow as tf


class LocalGradientAggregation:
    """Sum gradients over ``steps`` passes; reduce them with ``reduce`` on the last one.

    Args:
        steps: backward passes per update (> 1).
        average: apply the mean of the passes' gradients (True) or their sum (False, Horovod's
            default for ``average_aggregated_gradients``).
        reduce: ``reduce(grads, variables) -> grads``, the reduction across ranks.

    Attributes:
        counter: passes since the last update (a tf.Variable, read as Horovod's is).
    """

    def __init__(self, steps, average, reduce):
        self.steps = steps
        self.average = average
        self._reduce = reduce
        self.counter = None
        self._sums = None

    def compute_gradients(self, grads, variables):
        """Add ``grads`` to the sums; return the reduced sums on the last pass of a step and
        the local sums on the others (None stays None)."""
        grads = [tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad
                 for grad in grads]
        self._build(grads, variables)
        present = [index for index, grad in enumerate(grads) if grad is not None]
        updates = [self._sums[index].assign_add(tf.cast(grads[index], self._sums[index].dtype))
                   for index in present]
        with tf.control_dependencies(updates):
            count = self.counter.assign_add(1)
        results = [None] * len(grads)
        if not present:
            return results

        def local_sums():
            return [tf.identity(self._sums[index].read_value()) for index in present]

        def reduced_sums():
            sums = local_sums()
            if self.average:
                sums = [total / tf.cast(self.steps, total.dtype) for total in sums]
            return self._reduce(sums, [variables[index] for index in present])

        chosen = tf.cond(tf.equal(count, self.steps), reduced_sums, local_sums)
        for index, value in zip(present, tf.nest.flatten(chosen)):
            results[index] = value
        return results

    def apply_gradients(self, apply, grads, counted=None):
        """Run ``apply()`` on the last pass of a step, then start the sums over; on the other
        passes add one to ``counted`` instead (Keras's ``iterations``, a TF1 ``global_step``;
        None: nothing), as an applied step would. ``grads`` are what ``compute_gradients``
        returned: the counter is read after them (a TF1 graph has no other order)."""
        def update():
            done = [item for item in tf.nest.flatten(apply())
                    if tf.is_tensor(item) or isinstance(item, tf.Operation)]
            with tf.control_dependencies(done):
                resets = [total.assign(tf.zeros_like(total)) for total in self._sums if
                          total is not None]
                resets.append(self.counter.assign(0))
            with tf.control_dependencies(resets):
                return tf.constant(True)

        def skip():
            if counted is None:
                return tf.constant(False)
            with tf.control_dependencies([counted.assign_add(tf.ones([], counted.dtype))]):
                return tf.constant(False)
        with tf.control_dependencies([grad for grad in grads if grad is not None]):
            last_pass = tf.equal(self.counter.read_value(), self.steps)
        return tf.cond(last_pass, update, skip)

    def _build(self, grads, variables):
        if self.counter is not None:
            return
        with tf.init_scope():  # made once, outside any tf.function being traced
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                       name="hororing_aggregation_counter")
            self._sums = [None if grad is None else
                          tf.Variable(tf.zeros(variable.shape, grad.dtype), trainable=False,
                                      name="hororing_aggregated_gradient")
                          for grad, variable in zip(grads, variables)]
