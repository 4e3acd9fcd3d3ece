"""Multi-rank tests: run with ``mpiexec -n N python -m pytest --with-mpi tests/mpi``.

A test that fails on one rank prints its report and aborts the whole job, so the other
ranks never wait for a collective that will not come.
"""

import sys

import pytest
from mpi4py import MPI

import hororing as hvd


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.mpi)


@pytest.fixture(scope="session", autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] {item.nodeid} FAILED; aborting every rank\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
