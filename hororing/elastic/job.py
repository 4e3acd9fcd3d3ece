"""What a rank knows of the elastic job around it, and how hororun tells it the hosts changed.

hororun's elastic mode sets HORORING_ELASTIC_DIR (where each host keeps its commits),
HORORING_ELASTIC_LAUNCH (0 for the first launch, then 1, 2, ... for each relaunch) and
HORORING_ELASTIC_MIN_NP (--min-np). A rank started any other way (plain mpiexec) has none: its
commits stay in memory, as Horovod's.

A launch that grows the job is started ahead, while the job runs (HORORING_ELASTIC_HANDOVER=1):
its ranks import, initialise and build their model, then wait in ``hvd.elastic.run``'s entry
(``await_handover``): once every rank is there, rank 0 says so on stderr (``READY``); hororun
then asks the running job to stop at its next commit and, once it has, sends SIGUSR1, on which
the waiting ranks go on to read that commit.

When ranks die and the survivors go on in process (ULFM, ``recovery.py``), the new rank 0
tells hororun the job's size on stderr (``SHRUNK``), so that hororun knows the job has fewer
ranks than the hosts offer.

Host updates arrive as SIGUSR1, which mpiexec (Hydra and Open MPI's mpirun alike) forwards to
every rank. hororun starts each rank with SIGUSR1 ignored until ``listen()`` installs the
handler, so an early notice is lost rather than fatal; hororun repeats it until the job
answers.
"""

import signal
import sys
import threading

from ..environment import launch_environment

DIR_ENV = "HORORING_ELASTIC_DIR"
LAUNCH_ENV = "HORORING_ELASTIC_LAUNCH"
MIN_NP_ENV = "HORORING_ELASTIC_MIN_NP"
HANDOVER_ENV = "HORORING_ELASTIC_HANDOVER"
NOTICE_SIGNAL = signal.SIGUSR1
# exit status of every rank when the job stops at a commit so that hororun relaunches it at the
# size the hosts now allow (EX_TEMPFAIL)
RESCALE_STATUS = 75
# what rank 0 writes to stderr once every rank has agreed to stop for a host change
ACKNOWLEDGEMENT = b"hororing.elastic: hosts changed;"
# what the new rank 0 writes to stderr when the survivors of a failure go on in process,
# followed by the job's new size
SHRUNK = b"hororing.elastic: going on in process with"
# what rank 0 writes to stderr (hororun keeps it from the user's) as the job enters and as it
# leaves ``hvd.elastic.run``: under ULFM a job whose every rank was killed ends with mpiexec's
# status 0, and hororun tells it from one that finished by the second line
ENTERED = b"hororing.elastic: run entered"
RETURNED = b"hororing.elastic: run returned"
# what rank 0 of a launch started ahead writes once every rank waits to take over
READY = b"hororing.elastic: ready to take over"
# what rank 0 writes once every host has written the commit the job stopped at, followed by
# that commit's number (the launch started ahead may read it while this one exits)
STOPPED = b"hororing.elastic: commit written on every host"


def mark(line, *words):
    """Write ``line`` (ENTERED, RETURNED or STOPPED), then ``words``, for hororun, from rank 0
    of a supervised job."""
    if supervised():
        sys.stderr.write(" ".join([line.decode(), *map(str, words)]) + "\n")
        sys.stderr.flush()


class _Handover:
    done = False


def await_handover(barrier, rank):
    """In a launch started ahead, wait until hororun says the job it replaces has stopped.

    Every rank waits for SIGUSR1, sleeping (a rank waiting in an MPI call would spin, taking a
    core from the job still running); ``barrier()`` first makes sure every rank takes the
    signal before rank 0 says READY. A no-op in any other launch.
    """
    if not launch_environment().elastic_handover or _Handover.done:
        return
    _Handover.done = True  # once per process: a second hvd.elastic.run runs at once
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("hvd.elastic.run must be called from the main thread in a launch "
                           "that hororun started ahead (HORORING_ELASTIC_HANDOVER=1): the "
                           "signal to take over reaches the main thread only")
    go = threading.Event()
    signal.signal(NOTICE_SIGNAL, lambda signum, frame: go.set())
    barrier()
    if rank == 0:
        sys.stderr.write(READY.decode() + "\n")
        sys.stderr.flush()
    while not go.wait(0.05):
        pass
    signal.signal(NOTICE_SIGNAL, signal.SIG_IGN)


def directory():
    """The job's elastic directory on this host, or None outside hororun's elastic mode."""
    return launch_environment().elastic_dir or None


def supervised():
    return directory() is not None


def launch():
    """0 for the job's first launch, n for its n-th relaunch."""
    return launch_environment().elastic_launch


def min_size():
    """The fewest ranks the job may go on with (hororun's --min-np; 1 outside hororun)."""
    return max(1, launch_environment().elastic_min_np)


class _Notices:
    lock = threading.Lock()
    count = 0
    listening = False


def _on_notice(signum, frame):
    _Notices.count += 1


def listen():
    """Count hororun's host-update notices from now on (main thread; idempotent)."""
    with _Notices.lock:
        if _Notices.listening or not supervised():
            return
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(NOTICE_SIGNAL, _on_notice)
        _Notices.listening = True


def stop_listening():
    """Ignore further notices: the wrapped function has returned or the job is stopping.

    Python restores SIGUSR1's default action (terminate) as it exits, so a notice that
    hororun repeats while the rank exits would otherwise kill it with signal 10.
    """
    with _Notices.lock:
        if _Notices.listening and threading.current_thread() is threading.main_thread():
            signal.signal(NOTICE_SIGNAL, signal.SIG_IGN)
            _Notices.listening = False


def notices():
    """How many host-update notices this rank has received."""
    return _Notices.count
