"""What each rank of ``hororing.run`` executes: ``python -m hororing.runner.task``.

Rank 0 reads the pickled (function, args, kwargs) from its stdin (mpiexec forwards the
driver's stdin to rank 0 only, on any host) and broadcasts it. Each rank runs the function;
rank 0 gathers the results and prints them on one marked stdout line. A rank whose function
raises reports the error on one marked stderr line and aborts the job, so that no rank waits
forever in a collective for it.
"""

import base64
import os
import pickle
import sys
import traceback

from mpi4py import MPI

from ..errors import HorovodInternalError
from .programmatic import ERROR_MARK, RESULT_MARK


def main():
    world = MPI.COMM_WORLD
    payload = sys.stdin.buffer.read() if world.rank == 0 else None
    payload = world.bcast(payload, root=0)
    try:
        func, args, kwargs = pickle.loads(payload)
        outcome = (True, func(*args, **kwargs))
        pickle.dumps(outcome[1])  # an unpicklable result is this rank's error, named here
    except BaseException as error:  # noqa: BLE001 - every failure is reported, then fatal
        report = {"rank": world.rank, "error": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc(),
                  # a peer failed or left: the driver names the peer's own error first
                  "consequence": isinstance(error, HorovodInternalError)}
        _leave_report(report, world.rank)
        line = base64.b64encode(pickle.dumps(report)).decode()
        sys.stderr.write(f"{ERROR_MARK}{line}\n")
        sys.stderr.flush()
        world.Abort(1)
        return
    results = world.gather(outcome[1], root=0)
    if world.rank == 0:
        line = base64.b64encode(pickle.dumps(results)).decode()
        sys.stdout.write(f"{RESULT_MARK}{line}\n")
        sys.stdout.flush()


def _leave_report(report, rank):
    """The report as a file in the driver's folder, where this rank can reach it."""
    folder = sys.argv[1] if len(sys.argv) > 1 else ""
    if not folder or not os.path.isdir(folder):
        return
    path = os.path.join(folder, f"error.{rank}")
    try:
        with open(path + ".part", "wb") as handle:
            pickle.dump(report, handle)
        os.replace(path + ".part", path)
    except OSError:  # the stderr line still carries it
        pass


if __name__ == "__main__":
    main()
