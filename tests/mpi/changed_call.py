"""A peer that changes its repeated allreduce: the check the lane's and the shared rows'
tests share."""

import numpy as np
import pytest

import hororing as hvd
from reference import assert_close

MESSAGES = {"op": "Mismatched ALLREDUCE reduction operations",
            "shape": "Mismatched ALLREDUCE tensor shapes",
            "dtype": "Mismatched data types"}


def last_rank_changes_its_call(name, values, change):
    """Every rank but the last calls ``allreduce_`` of ``values`` (float32 ones) under
    ``name`` with Sum, as it has been; the last changes the ``change`` ("op", "shape" or
    "dtype"). The mismatch is named on every rank, and the same call as before then gives
    the sum: the job goes on."""
    mine, op = values.copy(), hvd.Sum
    if hvd.rank() == hvd.size() - 1:
        if change == "op":
            op = hvd.Max
        elif change == "shape":
            mine = np.ones(values.size + 1, dtype=np.float32)
        else:
            mine = np.ones(values.size, dtype=np.float64)
    with pytest.raises(Exception, match=MESSAGES[change]):
        hvd.allreduce_(mine, name=name, op=op)
    assert_close(hvd.allreduce_(values.copy(), name=name, op=hvd.Sum),
                 np.full(values.size, float(hvd.size()), dtype=np.float32))
