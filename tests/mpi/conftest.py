"""Multi-rank tests: run with ``mpiexec -n N python -m pytest --with-mpi tests/mpi``.

A test that fails on one rank prints its report and aborts the whole job, so the other
ranks never wait for a collective that will not come.
"""

import os
import shutil
import sys
import tempfile

# device-array tests run numba.cuda in its CPU simulator here (tests/gpu has the real thing)
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# add_process_set / remove_process_set are tested (Horovod's opt-in switch)
os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")

import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hororing as hvd  # noqa: E402


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.mpi)


@pytest.fixture(scope="session", autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture
def directory():
    """A directory every rank sees, emptied afterwards."""
    path = hvd.broadcast_object(tempfile.mkdtemp(prefix="hororing-test-")
                                if hvd.rank() == 0 else None, root_rank=0)
    yield path
    hvd.barrier()
    if hvd.rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


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


@pytest.fixture(scope="module", autouse=True)
def default_process_group_ends_with_its_module():
    """torch.distributed's default group, where a module's tests started it (a checkpoint
    starts one where none exists), is ended with the module: the next module may start its
    own."""
    def initialized():
        dist = sys.modules.get("torch.distributed")
        return dist is not None and dist.is_available() and dist.is_initialized()
    started = initialized()
    yield
    if not started and initialized():
        from hororing.torch import checkpoint
        checkpoint.wait_pending()
        sys.modules["torch.distributed"].destroy_process_group()


@pytest.fixture
def reduced_buffers():
    """Record (algorithm kind, dtype name, element count) of every buffer the engine hands to
    an allreduce algorithm (a fused batch of tensors is one buffer)."""
    from hororing.context import current
    with current().engine.allreduce.watch() as seen:
        yield seen
