"""The pool of out-of-place results: a block is reused only once nothing refers to it."""

import numpy as np
import pytest

from hororing.config import Config
from hororing.engine.buffers import OutputPool

MiB = 1 << 20
FLOAT32 = np.dtype(np.float32)


def address(array):
    return array.__array_interface__["data"][0]


def test_a_block_comes_back_only_when_every_view_of_it_is_gone():
    pool = OutputPool(16 * MiB)
    first = pool.empty((MiB // 4,), FLOAT32)
    where = address(first)
    view = first.reshape(2, -1)[1]
    del first
    second = pool.empty((MiB // 4,), FLOAT32)
    assert address(second) != where  # the view still holds the first block
    del view
    third = pool.empty((2, MiB // 8), FLOAT32)
    assert address(third) == where and third.shape == (2, MiB // 8)
    assert not np.shares_memory(second, third)


def test_small_results_and_results_over_capacity_are_not_pooled():
    pool = OutputPool(4 * MiB)
    small = pool.empty((10,), FLOAT32)
    large = pool.empty((2 * MiB,), FLOAT32)  # 8 MiB > capacity
    assert small.base is None and large.base is None


def test_capacity_lets_go_of_the_oldest_blocks():
    pool = OutputPool(3 * MiB)
    held = [pool.empty((MiB // 4,), FLOAT32) for _ in range(3)]
    extra = pool.empty((MiB // 4,), FLOAT32)  # every pooled block is in use: the oldest leaves
    assert len({address(array) for array in held + [extra]}) == 4
    held[0][...] = 7.0  # still the caller's, intact
    assert pool._held <= 3 * MiB and np.all(held[0] == 7.0)


def test_a_negative_pool_size_is_refused_with_its_variable():
    with pytest.raises(ValueError, match="HORORING_OUTPUT_POOL_BYTES"):
        Config.from_environ({"HORORING_OUTPUT_POOL_BYTES": "-1"})
