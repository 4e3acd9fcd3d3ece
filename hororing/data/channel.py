"""Per-rank input channels: each rank reads its own FIFO, fed by its own producer process.

This is the pipe-mode setting done right. One FIFO shared by the ranks of a job lets the
first reader take the stream and leaves the others blocked forever; here every rank gets a
FIFO in a private directory (0700, FIFO 0600), a producer child process streams that rank's
files into it, and an exclusive lock refuses a second reader instead of letting two readers
split (or fight over) one stream. A producer that fails or dies surfaces as ChannelError in
the reader; the directory is removed when the channel closes, on error, at exit and on
SIGTERM. A reader killed outright (SIGKILL) cannot clean up: its directory records the
reader's pid, and the next ``open_channel`` in the same place removes directories whose
reader is gone.
"""

import fcntl
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref

from .records import READ_BYTES, ProducerError, parse_frames, split_rows
from .streams import check_npy_rows, resolve_format, shuffled, take_record_slice

POLL_MS = 200
_PREFIX = "hororing-channel-"
_OWNER = "reader.pid"  # in each private directory: the pid of the process that reads it
_PRODUCER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "producer.py")
# launcher and MPI variables stay out of the producer: it must never join the MPI job
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPI_", "MPICH_", "HYDRA_", "OMPI_", "I_MPI_")


class ChannelError(RuntimeError):
    """A channel's producer failed, died, or the stream broke off."""


class ChannelBusyError(ChannelError):
    """The channel already has a reader; each rank's channel has exactly one."""


def open_channel(files, *, format=None, rank=None, directory=None, shuffle_buffer=0, seed=0,
                 block_bytes=READ_BYTES):
    """Start a producer streaming ``files`` into a new FIFO private to this rank; return it.

    Args:
        files: this rank's files, usually from :func:`shard_files` (a Shard's record slice is
            honoured).
        format: ``"records"`` (samples are bytes) or ``"npy"`` (samples are rows); by default
            from the file extension.
        rank: names the channel's directory; defaults to ``hvd.rank()`` when initialized.
        directory: where the private directory is created (default: the system temp dir).
        shuffle_buffer: when > 0, shuffle samples through a buffer of this many.
        seed: the shuffle buffer's seed.
        block_bytes: how much the producer moves per write (the pipe is grown to it).

    Returns:
        A :class:`Channel`: iterate it for samples; close it (or use ``with``) when done.

    Example:
        >>> with hvd.data.open_channel(hvd.data.shard_files("data/*.rec")) as channel:
        ...     for payload in channel:
        ...         train_on(decode(payload))
    """
    paths = [os.fspath(path) for path in files]
    format = resolve_format(paths, format)
    row_type = check_npy_rows(paths) if format == "npy" else None
    for path in paths:
        if not os.access(path, os.R_OK):
            raise FileNotFoundError(f"input file {path!r} is missing or not readable")
    if rank is None:
        from ..context import is_initialized, rank as context_rank
        rank = context_rank() if is_initialized() else os.getpid()
    remove_stale_channels(directory)
    _end_cleanly_on_sigterm()
    private = tempfile.mkdtemp(prefix=f"{_PREFIX}rank{rank}-", dir=directory)
    try:
        with open(os.path.join(private, _OWNER), "w") as file:
            file.write(str(os.getpid()))
        fifo = os.path.join(private, "channel")
        os.mkfifo(fifo, 0o600)
        os.chmod(fifo, 0o600)
        spec = os.path.join(private, "producer.json")
        with open(spec, "w") as file:
            json.dump({"fifo": fifo, "format": format, "files": paths,
                       "block_bytes": int(block_bytes)}, file)
        channel = Channel(fifo, format=format, row_type=row_type, files=paths,
                          private_dir=private, producer_spec=spec,
                          record_slice=getattr(files, "record_slice", None),
                          shuffle_buffer=shuffle_buffer, seed=seed)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    return channel


def remove_stale_channels(directory=None):
    """Remove channel directories (of this user) whose reader process no longer exists.

    Returns the directories removed. A directory whose reader is alive, or that another user
    owns, is left alone.
    """
    parent = directory or tempfile.gettempdir()
    removed = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for entry in entries:
        path = os.path.join(parent, entry)
        if not entry.startswith(_PREFIX):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, _OWNER)) as file:
                pid = int(file.read().strip())
        except (OSError, ValueError):
            continue  # being created right now, or not one of ours
        if not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_cleanly_on_sigterm():
    """Turn SIGTERM into a normal exit, so open channels are removed (their finalizers run
    at exit). Only where SIGTERM still has its default action and only from the main thread:
    a handler the application installed is left alone."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(128 + signum)


def attach_channel(path, *, format="records", row_type=None):
    """Read an existing channel FIFO fed by some other producer (one reader only).

    Raises:
        ChannelBusyError: the channel already has a reader.
    """
    return Channel(os.fspath(path), format=format, row_type=row_type)


class Channel:
    """One rank's input stream: a FIFO, its lock, and (when opened here) its producer."""

    def __init__(self, fifo, *, format, row_type=None, files=None, private_dir=None,
                 producer_spec=None, record_slice=None, shuffle_buffer=0, seed=0):
        self.path = fifo
        self.files = list(files or [])
        self.format = format
        self._row_type = row_type
        self._record_slice = record_slice
        self._shuffle_buffer = shuffle_buffer
        self._seed = seed
        self._producer = None
        self._log_path = None
        self._started = False
        # the read end is open before the producer starts: it opens the write end without
        # blocking, and fails rather than waits if the reader is gone
        self._fd = _open_exclusive(fifo)
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN | select.POLLHUP)
        if producer_spec is not None:
            try:
                self._start_producer(producer_spec)
            except BaseException:
                os.close(self._fd)
                raise
        # runs on close(), when the channel is collected, and at interpreter exit
        self._finalizer = weakref.finalize(self, _cleanup, self._fd, self._producer, private_dir)

    @property
    def producer_pid(self):
        """The producer process's pid (None when attached to an outside producer)."""
        return None if self._producer is None else self._producer.pid

    def _start_producer(self, spec):
        self._log_path = os.path.join(os.path.dirname(spec), "producer.log")
        environment = {name: value for name, value in os.environ.items()
                       if not name.startswith(_LAUNCHER_PREFIXES)}
        with open(self._log_path, "wb") as log:
            self._producer = subprocess.Popen(
                [sys.executable, _PRODUCER, spec], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log, env=environment, close_fds=True)

    def __iter__(self):
        if self._started:
            raise ChannelError(f"channel {self.path!r} is a stream and can be iterated once; "
                               f"open a new channel for another pass")
        self._started = True
        samples = self._samples()
        samples = take_record_slice(samples, self._record_slice)
        if self._shuffle_buffer:
            samples = shuffled(samples, self._shuffle_buffer, self._seed)
        return iter(samples)

    def _samples(self):
        frames = parse_frames(self._read_chunk, self.path, control=True, files=self.files)
        try:
            yield from self._decoded(frames)
        except ProducerError as error:
            failure = self._failure(*error.args)
            self.close()
            raise ChannelError(failure) from None
        except BaseException:
            self.close()
            raise
        self.close()

    def _decoded(self, frames):
        """Yield the samples of the frames: payloads as they are, or the rows of npy blocks."""
        if self.format != "npy":
            return frames
        return itertools.chain.from_iterable(
            split_rows(payload, *self._row_type) for payload in frames)

    def _read_chunk(self):
        poller = self._poller
        while True:
            if poller.poll(POLL_MS):
                try:
                    return os.read(self._fd, READ_BYTES)
                except BlockingIOError:
                    continue
            if self._producer is not None and self._producer.poll() is not None:
                # it may have written and exited between the poll and this check
                if poller.poll(0):
                    continue
                raise ProducerError(None, "it never opened the channel")

    def _failure(self, message, where=None):
        """Describe why the stream ended without its END frame."""
        if message is None and self._producer is not None:
            try:
                code = self._producer.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None and code < 0:
                message = f"the producer (pid {self._producer.pid}) was killed by signal " \
                          f"{signal.Signals(-code).name}"
            elif code == 0:
                # the producer sent everything and its end marker; the reader lost its place
                return (f"channel {self.path!r} failed: the producer (pid {self._producer.pid}) "
                        f"sent every file and its end marker, but the stream read here "
                        f"{where or 'broke off'}: a record's length field is corrupt (it claims "
                        f"more bytes than its file holds), or another process read part of "
                        f"this FIFO (each channel must have exactly one reader)")
            else:
                message = f"the producer (pid {self._producer.pid}) exited with status {code}"
            tail = self._log_tail()
            if tail:
                message += f": {tail}"
            if where:
                message += f" ({where})"
        elif message is None:
            message = where or "the writer closed the FIFO before the end of the stream"
        return f"channel {self.path!r} failed: {message}"

    def _log_tail(self):
        try:
            with open(self._log_path, "rb") as log:
                lines = log.read().decode("utf-8", "replace").strip().splitlines()
        except (OSError, TypeError):
            return ""
        return lines[-1] if lines else ""

    def close(self):
        """Stop the producer, close the FIFO and remove the channel's private directory."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _open_exclusive(fifo):
    if not os.path.exists(fifo):
        raise FileNotFoundError(f"channel {fifo!r} does not exist")
    # nonblocking: opening a FIFO for reading would otherwise wait for a writer
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ChannelBusyError(
            f"channel {fifo!r} already has a reader; each rank's channel has exactly one. "
            f"Open this rank's own channel with hvd.data.open_channel(shard_files(...))"
        ) from None
    return fd


def _cleanup(fd, producer, private_dir):
    try:
        os.close(fd)  # a producer still writing now gets EPIPE and exits
    except OSError:
        pass
    if producer is not None and producer.poll() is None:
        producer.terminate()
        try:
            producer.wait(timeout=5)
        except subprocess.TimeoutExpired:
            producer.kill()
            producer.wait()
    if private_dir is not None:
        shutil.rmtree(private_dir, ignore_errors=True)
