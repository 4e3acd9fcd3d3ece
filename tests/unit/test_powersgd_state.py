"""PowerSGD's state when the optimizer lays its buckets out again (the autotuner moved the
fusion threshold): the new buckets take over their parameters' error, and the old buckets'
state is dropped once none of their parameters is left to them."""

import numpy as np

from hororing import ops
from hororing.comm_hooks import GradBucket, Reduction
from hororing.powersgd import PowerSGD

SHAPES = {"a": (3,), "b": (2,), "c": (2, 2)}


def bucket(name, parameters):
    array = np.zeros(sum(int(np.prod(SHAPES[p])) for p in parameters))
    return GradBucket(0, name, array, array, [SHAPES[p] for p in parameters], parameters,
                      Reduction(ops.Average), None)


def test_new_buckets_take_over_their_parameters_error_and_old_state_is_dropped():
    hook = PowerSGD(rank=1, start_iter=0)
    hook._claim(bucket("old", ["a", "b", "c"]))
    hook._errors["old"] = np.arange(9.0)  # a: 0 1 2, b: 3 4, c: 5 6 7 8
    hook._qs["old"] = np.ones(4)
    hook._claim(bucket("new.1", ["c", "a"]))
    np.testing.assert_array_equal(hook._errors["new.1"], [5, 6, 7, 8, 0, 1, 2])
    assert "old" in hook._errors  # b is still there
    hook._claim(bucket("new.2", ["b"]))
    np.testing.assert_array_equal(hook._errors["new.2"], [3, 4])
    state = hook.state_dict()
    assert set(state["errors"]) == {"new.1", "new.2"} and not state["qs"]
    hook._claim(bucket("new.1", ["c", "a"]))  # seen before: nothing changes
    np.testing.assert_array_equal(hook._errors["new.1"], [5, 6, 7, 8, 0, 1, 2])


def test_without_error_feedback_only_q_is_dropped():
    hook = PowerSGD(rank=1, start_iter=0, use_error_feedback=False)
    hook._claim(bucket("old", ["a", "b"]))
    hook._qs["old"] = np.ones(3)
    hook._claim(bucket("new", ["b", "a"]))
    assert hook.state_dict() == {"iter": 0, "errors": {}, "qs": {}}


def test_a_binding_registers_its_arrays_and_powersgd_works_them_through_it():
    """PowerSGD knows numpy's arrays; a binding's tensors reach it through the namespace the
    binding registered (hororing.torch registers torch's), nothing else."""
    import numpy as np

    from hororing.powersgd import arrays

    class Boxed:
        def __init__(self, values):
            self.values = np.asarray(values)

    class BoxedArrays:
        name = "boxed"

        @staticmethod
        def to_host(box):
            return box.values.copy()

    assert arrays.arrays_for(np.ones(2)) is arrays.NUMPY
    assert arrays.arrays_for(Boxed([1.0])) is None
    namespace = BoxedArrays()
    arrays.register(namespace, lambda value: isinstance(value, Boxed))
    try:
        assert arrays.arrays_for(Boxed([1.0])) is namespace
        assert arrays.on_host(Boxed([1.0, 2.0])).tolist() == [1.0, 2.0]
    finally:
        arrays._REGISTERED.remove(next(entry for entry in arrays._REGISTERED
                                       if entry[1] is namespace))
    assert arrays.on_host([3.0]).tolist() == [3.0]
