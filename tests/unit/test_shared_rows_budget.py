"""The shared memory the fold's rows and the shared allreduce's large segments may take: a
quarter of what /dev/shm has free (the rows at most SHARED_ROWS_MOST), the fixed budget where
it cannot be read."""

import os

from hororing.engine import fold


class _Stat:
    def __init__(self, free_bytes):
        self.f_frsize = 4096
        self.f_bavail = free_bytes // 4096


def test_a_quarter_of_the_free_shared_memory_at_most_the_ceiling(monkeypatch):
    monkeypatch.setattr(os, "statvfs", lambda path: _Stat(64 << 20))  # a container's default
    assert fold.shared_rows_budget() == 16 << 20
    monkeypatch.setattr(os, "statvfs", lambda path: _Stat(20 << 20))  # the MPI took the rest
    assert fold.shared_rows_budget() == 5 << 20
    monkeypatch.setattr(os, "statvfs", lambda path: _Stat(24 << 30))
    assert fold.shared_rows_budget() == fold.SHARED_ROWS_MOST


def test_without_a_readable_dev_shm_the_fixed_budget(monkeypatch, tmp_path):
    def missing(path):
        raise FileNotFoundError(path)
    monkeypatch.setattr(os, "statvfs", missing)
    assert fold.shared_rows_budget() == fold.SHARED_ROWS_BUDGET
    monkeypatch.undo()
    assert 0 <= fold.shared_rows_budget(str(tmp_path)) <= fold.SHARED_ROWS_MOST


def test_the_shared_allreduce_window_takes_a_quarter_of_the_free_shared_memory(monkeypatch):
    from hororing.algorithms import shared
    monkeypatch.setattr(os, "statvfs", lambda path: _Stat(64 << 20))
    assert shared.shm_quarter() == 16 << 20  # no ceiling: the segments' rule asks for room

    def missing(path):
        raise FileNotFoundError(path)
    monkeypatch.setattr(os, "statvfs", missing)
    assert shared.shm_quarter() is None
