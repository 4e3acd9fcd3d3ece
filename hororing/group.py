"""A Group: this rank's membership of one process set (communicator, engine, numbering)."""

import threading

from .engine import FLAG_FAILED


class Group:
    """This rank's membership of one process set: its communicator, engine and numbering."""

    def __init__(self, set_id, ranks, comm, engine):
        self.set_id = set_id
        self.ranks = list(ranks)       # job ranks, ascending
        self.comm = comm
        self.engine = engine
        self.size = len(self.ranks)
        self.rank = comm.Get_rank()
        self._index = {rank: index for index, rank in enumerate(self.ranks)}
        self._name_counters = {}       # name prefix -> the next number it gives
        self._names_lock = threading.Lock()
        # the main thread's blocking names (``blocking_name``), which the door takes without
        # the call where the calling thread's ident is ``main_ident``
        self.main_ident = threading.main_thread().ident
        self.main_blocking_names = _BlockingNames()
        engine.on_missed_error = self.skip_name

    def set_rank(self, job_rank):
        """Return the index in this set of ``job_rank`` (``hvd.rank()`` numbering).

        Raises:
            ValueError: ``job_rank`` is not a member.
        """
        index = self._index.get(job_rank)
        if index is None:
            raise ValueError(f"rank {job_rank} is not in process set {self.set_id} (ranks "
                             f"{self.ranks}); root_rank must be one of them")
        return index

    def auto_name(self, kind):
        """Name an unnamed collective; equal on all members that make the same calls.

        Each thread numbers its own calls, and names from threads other than the main one
        carry the thread's name: unnamed calls from two threads at once then cannot swap
        numbers between ranks (which would pair different tensors), provided the ranks
        start their threads in the same order, as they give them the same names.
        """
        thread = threading.current_thread()
        prefix = kind if thread is threading.main_thread() else f"{kind}.{thread.name}"
        with self._names_lock:
            number = self._name_counters.get(prefix, 0)
            self._name_counters[prefix] = number + 1
        return f"{prefix}.noname.{number}"

    def blocking_name(self, kind):
        """Name an unnamed blocking call: the same name for every such call of ``kind`` from
        this thread, so a loop of them is cached (and folded) as a named call is, where
        ``auto_name``'s numbered names would each take a negotiation by name (measured: a
        4 KiB allreduce at 2 ranks, 108 us against 10). A blocking call is the only call of
        its thread in flight, and every member makes the same calls, so they pair as the
        numbered names would; it takes no number from ``auto_name``'s count."""
        thread = threading.current_thread()
        if thread is threading.main_thread():
            return self.main_blocking_names[kind]
        return f"{kind}.{thread.name}.noname.blocking"

    def skip_name(self, name):
        """Catch up with the peers after a generated ``name`` failed without this rank.

        A collective that fails while this rank is inside ``join()`` was named by the
        ranks that made the call; this rank never did, so its count for that kind would
        lag and its next unnamed call of that kind would never pair with theirs.
        """
        prefix, separator, number = name.rpartition(".noname.")
        if not separator or not number.isdigit():
            return
        with self._names_lock:
            if self._name_counters.get(prefix, 0) <= int(number):
                self._name_counters[prefix] = int(number) + 1

    def leave(self, failure=None):
        """Leave the process set: stop its engine (telling its peers: a shutdown, or
        ``failure``, a message) and free its communicator."""
        stop_engine(self.engine, failure)
        self.engine.close()
        self.comm.Free()


def stop_engine(engine, failure=None):
    """Tell ``engine``'s peers this rank leaves: a shutdown, or ``failure`` (a message)."""
    if failure is None:
        engine.stop()
    else:
        engine.stop(message=failure, flags=FLAG_FAILED, deadline_s=10.0)


class _BlockingNames(dict):
    """kind -> the main thread's blocking name for it (``Group.blocking_name``), made on
    first use."""

    def __missing__(self, kind):
        name = self[kind] = f"{kind}.noname.blocking"
        return name
