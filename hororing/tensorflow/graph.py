"""Collectives inside traced graphs: a ``tf.function``, or a TF1 ``tf.Graph`` run by a Session.

Three things differ from eager execution.

Names. An op is built once and may run many times; every run submits the name it was given
when it was built, so the ranks pair each run by that name, whatever order TensorFlow's
executor picks for the ops one ``session.run`` executes. The name comes from the outermost
graph (the branches of a ``tf.cond`` and loop bodies are graphs numbered process-wide, which
differ between ranks that built different numbers of ops): a ``tf.function``'s own name, or
for a ``tf.Graph`` a label given in the order graphs first hold a collective, then the graph's
name counter, which numbers collectives in program order.

Failures. A Python op's exception reaches the program as ``tf.errors.UnknownError`` (or
``InvalidArgumentError`` for ValueError/TypeError), whatever its type, while Horovod's ops
fail with ``FailedPreconditionError`` when the ranks disagree. So the op reports such a
failure as an output, and ``raise_on_failure`` turns it into that error: in the failing branch
of a ``tf.cond``, a read of a variable that does not exist, named by the failure's message
(TensorFlow's error for a missing variable is a ``FailedPreconditionError``). The branch runs
only on failure.

Threads. A blocking collective holds one of TensorFlow's inter-op threads while it waits for
its peers. If a ``session.run`` has more independent collectives ready than there are threads,
and the ranks started different ones first, every thread waits on a collective whose peers
cannot start it: a hang. TensorFlow sizes its pool by the number of cores (two on a small
machine), so importing ``hororing.tensorflow`` raises the default (environment.py,
``HORORING_TF_INTER_OP_THREADS``), before any session exists; a ``tf.function`` runs its
collectives one after another and needs only one.
"""

import itertools
import weakref

import tensorflow as tf

from ..process_sets import registered_id

_GRAPH_LABELS = weakref.WeakKeyDictionary()
_graph_numbers = itertools.count()


def op_name(kind, name, process_set=None):
    """The name the engine matches this collective by, or None for the core to number it.

    Raises:
        TypeError: a ``name`` that is not a non-empty str.
    """
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str or None, got {name!r}")
        return name
    if tf.executing_eagerly():
        return None
    graph = outermost_graph()
    # the set's id, not its membership: a rank outside the set learns it when the op runs
    # (InvalidArgumentError, as Horovod's op fails), not while the graph is built
    label = registered_id(process_set)
    unique = graph.unique_name(f"hororing_{kind}_set{label}", mark_as_used=True)
    return f"{_graph_label(graph)}/{unique}"


def outermost_graph():
    """The graph being built, or the outermost graph it is nested in: the outermost function
    graph, or, when a TF1 program builds a ``tf.Graph``, that graph. (An eager program's
    ``tf.function`` also has an outer graph, the process's default one, which every trace
    shares: its name counter would number a retrace differently on each rank.)"""
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "outer_graph", None) is not None:
        outer = graph.outer_graph
        if (getattr(outer, "outer_graph", None) is None and not hasattr(outer, "name")
                and tf.compat.v1.executing_eagerly_outside_functions()):
            break
        graph = outer
    return graph


def _graph_label(graph):
    name = getattr(graph, "name", None)
    if name:  # a tf.function's graph
        return name
    label = _GRAPH_LABELS.get(graph)
    if label is None:
        label = _GRAPH_LABELS[graph] = f"graph{next(_graph_numbers)}"
    return label


def raise_on_failure(outputs, failure):
    """Return ``outputs``, or raise ``FailedPreconditionError`` when ``failure`` (a string
    tensor) is not empty."""
    passed = tf.equal(failure, "")
    if not hasattr(tf.compat.v1.get_default_graph(), "outer_graph"):
        # a TF1 graph: Switch sends each value down one branch only, and the other is dead
        # (never run); cheaper than a tf.cond, whose two branch functions every op would add
        # to a graph that a TF1 program keeps growing
        failed, _ = tf.raw_ops.Switch(data=failure, pred=passed)  # live on failure only
        error = tf.cast(_raise_failure(failed), tf.bool)            # raises when it runs
        _, succeeded = tf.raw_ops.Switch(data=passed, pred=passed)  # live on success only
        gate, _ = tf.raw_ops.Merge(inputs=[error, succeeded])       # live once either is
        with tf.control_dependencies([gate]):
            return [tf.identity(output) for output in outputs]

    def proceed():
        return [tf.identity(output) for output in outputs]

    def fail():  # the read always fails; its value is used, so no pass prunes it away
        read = _raise_failure(failure)
        return [output + tf.cast(read, output.dtype) for output in outputs]
    results = tf.cond(passed, proceed, fail)
    return list(results) if isinstance(results, (list, tuple)) else [results]


def _raise_failure(failure):
    """An op that fails with ``FailedPreconditionError`` and ``failure``'s message when run."""
    handle = tf.py_function(_unfound_variable, [failure], tf.resource)
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int8)


def _unfound_variable(failure):
    """A handle to a variable no session holds, named by the failure's message."""
    message = failure.numpy().decode("utf-8", "replace")
    return tf.raw_ops.VarHandleOp(dtype=tf.int8, shape=[], container="hororing",
                                  shared_name=f"hororing collective failed: {message} |")
