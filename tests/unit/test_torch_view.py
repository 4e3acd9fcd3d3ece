"""A CPU tensor's numpy view (``bridge.cpu_view``): reused for the same tensor, made again
whenever what it depends on changed, so a reused view never reads stale or wrong memory."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hororing.torch import bridge  # noqa: E402


def _same_as_numpy(tensor):
    view = bridge.cpu_view(tensor)
    expected = tensor.numpy()
    assert view.dtype == expected.dtype and view.shape == expected.shape
    assert view.strides == expected.strides
    assert view.__array_interface__["data"][0] == expected.__array_interface__["data"][0]
    np.testing.assert_array_equal(view, expected)
    return view


def test_the_same_tensor_gets_its_view_again_and_sees_its_values_change():
    tensor = torch.arange(8, dtype=torch.float32)
    first = _same_as_numpy(tensor)
    assert bridge.cpu_view(tensor) is first
    tensor.mul_(3)  # in place: the same memory, the view sees it
    np.testing.assert_array_equal(bridge.cpu_view(tensor), np.arange(8) * 3)


@pytest.mark.parametrize("change", ["set_", "shrunk", "data", "dtype", "transpose_"])
def test_a_tensor_whose_memory_shape_strides_or_dtype_changed_gets_a_new_view(change):
    tensor = torch.arange(16, dtype=torch.float32).reshape(4, 4).clone()
    first = _same_as_numpy(tensor)
    if change == "set_":
        tensor.set_(torch.full((4, 4), 7.0))
    elif change == "shrunk":  # the same memory, another shape
        tensor.resize_(2, 2)  # (growing it is refused: torch keeps a viewed storage's size)
    elif change == "data":
        tensor.data = torch.zeros(2, 8)
    elif change == "dtype":  # the same memory, seen as int32
        tensor.data = tensor.view(torch.int32)
    else:  # the same memory and shape, other strides
        tensor.transpose_(0, 1)
    view = _same_as_numpy(tensor)
    assert view is not first


def test_another_tensor_over_the_same_memory_gets_its_own_view():
    base = torch.arange(8, dtype=torch.float64)
    first = _same_as_numpy(base)
    alias = base.view(8)
    assert _same_as_numpy(alias) is not first


def test_a_large_tensor_is_not_kept_alive_by_its_view():
    import weakref
    tensor = torch.zeros(bridge.VIEW_BYTES // 4 + 1, dtype=torch.float32)
    _same_as_numpy(tensor)
    alive = weakref.ref(tensor)
    del tensor
    assert alive() is None


def test_the_blocking_verbs_plain_view_reuses_the_last_tensors_view_while_it_stays_plain():
    """``plain_view``: a plain tensor's view is made (after the name check: True), then
    reused for the same tensor (the door checks the name: False) until it needs a gradient
    or its memory, shape, strides or dtype change; a tensor that is not plain gets None."""
    tensor = torch.arange(6, dtype=torch.float32)
    first, checked = bridge.plain_view(tensor, None, None)
    assert checked is True and first is bridge.cpu_view(tensor)
    assert bridge.plain_view(tensor, None, None) == (first, False)
    tensor.data = torch.arange(6, dtype=torch.float64)
    again, checked = bridge.plain_view(tensor, None, None)
    assert checked is True and again is not first and again.dtype == np.float64
    np.testing.assert_array_equal(again, np.arange(6))
    tensor.requires_grad_()
    assert bridge.plain_view(tensor, None, None) == (None, False)
    assert bridge.plain_view(tensor.detach(), None, None)[0] is not None


@pytest.mark.parametrize("kind", ["bfloat16", "parameter", "sparse", "meta"])
def test_a_tensor_that_is_not_plain_gets_no_view(kind):
    tensor = {"bfloat16": lambda: torch.ones(4, dtype=torch.bfloat16),
              "parameter": lambda: torch.nn.Parameter(torch.ones(4), requires_grad=False),
              "sparse": lambda: torch.ones(4).to_sparse(),
              "meta": lambda: torch.ones(4, device="meta")}[kind]()
    assert bridge.plain_view(tensor, None, None) == (None, False)


def test_a_view_made_by_as_numpy_is_reused_over_the_same_memory():
    """A Parameter needing no gradient goes through ``as_numpy`` the first time; its view is
    then the last one made, and the blocking verbs reuse it: the same memory as the
    Parameter, so an in-place result still lands in it."""
    tensor = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    made = bridge.as_numpy(tensor)
    assert bridge.plain_view(tensor, None, None) == (made, False)
    assert made.__array_interface__["data"][0] == tensor.data_ptr()


def test_a_few_tensors_in_turn_each_keep_their_view_up_to_views_of_them():
    """A loop reducing a few tensors in turn (a loss and its metrics) reuses each one's view;
    a tensor past ``VIEWS`` lets the oldest go."""
    tensors = [torch.arange(4, dtype=torch.float32) + index for index in range(bridge.VIEWS)]
    views = [_same_as_numpy(tensor) for tensor in tensors]
    for _ in range(2):
        for tensor, view in zip(tensors, views):
            assert bridge.cpu_view(tensor) is view
            assert bridge.plain_view(tensor, None, None) == (view, False)
    _same_as_numpy(torch.zeros(4))
    assert bridge.cpu_view(tensors[0]) is not views[0]
    assert bridge.cpu_view(tensors[-1]) is views[-1]


def test_the_kept_views_hold_no_more_than_view_bytes_of_dropped_tensors():
    import weakref
    count = bridge.VIEW_BYTES // 4 // 3 + 1  # three of them are over VIEW_BYTES
    tensors = [torch.zeros(count, dtype=torch.float32) for _ in range(3)]
    alive = [weakref.ref(tensor) for tensor in tensors]
    for tensor in tensors:
        _same_as_numpy(tensor)
    del tensor, tensors
    assert alive[0]() is None
    assert alive[2]() is not None


def test_in_place_copies_a_float32_copy_back_into_its_bfloat16_tensor_when_the_copy_is_a_tensor(
        monkeypatch):
    """On a GPU, ``as_numpy`` hands on a bfloat16 tensor's float32 copy as a torch tensor, not
    a numpy array; ``in_place`` must still copy the result back into the bfloat16 tensor
    (the copy stands in for the CUDA one here: what ``in_place`` decides depends on the
    copy's type, not on the device)."""
    tensor = torch.tensor([1.5, 2.5, -4.0], dtype=torch.bfloat16)
    copy = tensor.float()
    monkeypatch.setattr(bridge, "as_numpy", lambda t, argument="tensor", bfloat16=False: copy)
    submitted = []
    handle = bridge.in_place(tensor, lambda array: submitted.append(array) or "inner")
    assert submitted == [copy] and handle.inner == "inner"
    result = handle.finish(torch.tensor([3.0, 5.0, -8.0]))
    assert result is tensor and tensor.dtype == torch.bfloat16
    assert tensor.tolist() == [3.0, 5.0, -8.0]
