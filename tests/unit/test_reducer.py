"""The reducer's bookkeeping, framework-free: passes counted, whole buckets completed, a
gradient computed twice refused, bucket names, the one check of backward_passes_per_step."""

import pytest

from hororing.reducer import Reducer, bucket_name, check_passes


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_backward_passes_per_step_is_an_int_of_at_least_one(value):
    with pytest.raises(ValueError, match=rf"backward_passes_per_step must be an int >= 1, "
                                         rf"got {value!r}"):
        check_passes(value)


def test_a_valid_count_of_passes_is_returned_as_an_int():
    assert check_passes(3) == 3 and type(check_passes(3)) is int


def test_a_bucket_is_named_by_its_first_and_last_gradient_and_its_length():
    assert bucket_name(["fc2.bias", "fc2.weight", "fc1.bias"]) == "bucket.fc2.bias..fc1.bias.3"
    assert bucket_name(["w"]) == "bucket.w..w.1"


def _reducer(passes=1):
    names = {key: f"layer{key}" for key in range(5)}
    reducer = Reducer(names, passes)
    buckets = reducer.take_buckets([((0, 1), "flat01"), ((2,), "flat2"), ((3, 4), "flat34")],
                                   whole=lambda members: members != (2,), whole_bytes=64)
    return reducer, buckets


def test_whole_buckets_are_named_numbered_and_the_last_marked():
    reducer, buckets = _reducer()
    assert [(b.members, b.flat, b.name, b.index, b.last) for b in buckets] == [
        ((0, 1), "flat01", "bucket.layer0..layer1.2", 0, False),
        ((3, 4), "flat34", "bucket.layer3..layer4.2", 2, True)]
    assert reducer.bucket_of(2) is None and reducer.bucket_of(4) is buckets[1]
    assert reducer.whole_bytes == 64


def test_a_bucket_is_ready_when_its_last_gradient_is_in_and_a_lone_one_at_once():
    reducer, (first, second) = _reducer()
    assert reducer.ready(4, started=False) is None
    assert reducer.ready(2, started=False) == 2
    assert reducer.ready(3, started=False) is second
    assert reducer.ready(1, started=False) is None
    assert reducer.ready(0, started=False) is first


def test_every_pass_is_counted_and_only_the_last_makes_a_gradient_ready():
    reducer, (first, _) = _reducer(passes=3)
    for _ in range(2):
        assert reducer.ready(0, started=False) is None
        assert reducer.ready(1, started=False) is None
        assert reducer.ready(2, started=False) is None
    assert reducer.ready(0, started=False) is None
    assert reducer.ready(1, started=False) is first
    assert reducer.ready(2, started=False) == 2


def test_a_gradient_computed_twice_before_a_step_is_refused_by_name():
    reducer, _ = _reducer()
    reducer.ready(0, started=False)  # in its bucket, which waits for 1
    with pytest.raises(RuntimeError, match="the gradient of 'layer0' was computed more than "
                                           "backward_passes_per_step=1 times before step"):
        reducer.ready(0, started=False)
    with pytest.raises(RuntimeError, match="the gradient of 'layer2' was computed more than"):
        reducer.ready(2, started=True)  # the binding started it already


def test_a_finished_step_starts_the_count_again():
    reducer, (first, _) = _reducer(passes=2)
    reducer.ready(0, started=False)
    reducer.ready(0, started=False)  # the second pass: in, waiting for 1
    reducer.step_done()
    assert reducer.ready(0, started=False) is None
    assert reducer.ready(0, started=False) is None
    assert reducer.ready(1, started=False) is None
    assert reducer.ready(1, started=False) is first


def test_buckets_taken_again_replace_or_add_and_forgotten_ones_start_alone():
    reducer, (first, second) = _reducer()
    reducer.forget([3, 4])
    assert reducer.bucket_of(3) is None and reducer.bucket_of(0) is first
    (added,) = reducer.take_buckets([((3, 4), "new")], whole=lambda members: True, update=True)
    assert reducer.bucket_of(0) is first and reducer.bucket_of(4) is added
    reducer.take_buckets([((0,), "only")], whole=lambda members: True)
    assert reducer.bucket_of(4) is None and reducer.bucket_of(0).flat == "only"
