"""Hooks for TF1 training sessions (``tf.compat.v1.train.MonitoredTrainingSession``)."""

import tensorflow as tf

from .functions import broadcast_global_variables


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcast every global variable from ``root_rank`` once the session is created.

    So every rank starts from the same initial values (random ones, or a checkpoint that
    only ``root_rank`` restored). Give it to every rank's session::

        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session: ...

    Args:
        root_rank: the rank whose values win.
        device: accepted for Horovod compatibility (hororing's collectives run on the host).
    """

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph is not graph:
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
