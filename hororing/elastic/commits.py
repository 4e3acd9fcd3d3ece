"""Commits on disk: one file per commit, written whole or not at all.

A file is ``commit-<seq>.pkl`` in the job's elastic directory on each host: the pickled state
followed by a trailer (magic, sequence number, payload length, CRC-32). It is written under a
temporary name, flushed to the disk (fsync), renamed into place, and the directory is flushed
too, as databases do: a writer killed mid-write leaves the previous commit intact and a
half-written temporary file that no reader trusts, and a machine that loses power after a
commit returned still has it. The newest two commits are kept; the older one is deleted only
once the new one is on the disk. A reader that finds the newest file torn or corrupt anyway
(a disk that lied) says so, naming the file, and takes the one before.
"""

import os
import pathlib
import pickle
import struct
import zlib

_MAGIC = b"HORORING-COMMIT1"
_TRAILER = struct.Struct(f"<{len(_MAGIC)}sQQI")
_PREFIX, _SUFFIX = "commit-", ".pkl"
KEEP = 2


class _CrcWriter:
    """A file that keeps the CRC-32 and length of what is written to it (for pickle.dump)."""

    def __init__(self, file):
        self.file = file
        self.crc = 0
        self.length = 0

    def write(self, data):
        view = memoryview(data).cast("B")  # pickle also hands over PickleBuffers
        self.crc = zlib.crc32(view, self.crc)
        self.length += view.nbytes
        return self.file.write(view)


def path_of(directory, seq):
    return pathlib.Path(directory) / f"{_PREFIX}{seq:010d}{_SUFFIX}"


def write(directory, seq, obj):
    """Write commit ``seq`` of ``obj`` atomically; drop commits older than the newest KEEP."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = path_of(directory, seq)
    temporary = directory / f".{final.name}.{os.getpid()}.tmp"
    with open(temporary, "wb") as file:
        writer = _CrcWriter(file)
        pickle.dump(obj, writer, protocol=pickle.HIGHEST_PROTOCOL)
        file.write(_TRAILER.pack(_MAGIC, seq, writer.length, writer.crc))
        file.flush()
        os.fsync(file.fileno())  # the bytes on the disk before the name points at them
    os.replace(temporary, final)
    _sync_directory(directory)  # the rename on the disk before an older commit goes
    for old in sequences(directory)[KEEP:]:
        path_of(directory, old).unlink(missing_ok=True)
    return final


def sequences(directory):
    """The commit numbers with a file in ``directory``, newest first (not yet verified)."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        name = path.name
        if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
            digits = name[len(_PREFIX):-len(_SUFFIX)]
            if digits.isdigit():
                found.append(int(digits))
    return sorted(found, reverse=True)


def _sync_directory(directory):
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read(directory, seq):
    """The object of commit ``seq``, or None if its file is missing, short or corrupt."""
    return _checked(directory, seq)[0]


def _checked(directory, seq):
    """(object, None) for an intact commit ``seq``; (None, what is wrong with it) else."""
    try:
        data = path_of(directory, seq).read_bytes()
    except OSError as error:
        return None, f"unreadable ({error.strerror})"
    if len(data) < _TRAILER.size:
        return None, f"torn: {len(data)} bytes, shorter than its trailer"
    magic, stored_seq, length, crc = _TRAILER.unpack(data[-_TRAILER.size:])
    payload = memoryview(data)[:-_TRAILER.size]
    if magic != _MAGIC:
        return None, "torn: no commit trailer at its end"
    if stored_seq != seq:
        return None, f"holds commit {stored_seq}, not {seq}"
    if length != len(payload):
        return None, f"torn: {len(payload)} bytes of state where {length} were written"
    if zlib.crc32(payload) != crc:
        return None, "corrupt: its checksum does not match"
    return pickle.loads(payload), None


def newest(directory, report=None):
    """(seq, object) of the newest intact commit in ``directory``, or (-1, None).

    ``report(path, problem)`` is told of each newer commit file skipped as torn or corrupt.
    """
    for seq in sequences(directory):
        obj, problem = _checked(directory, seq)
        if problem is None:
            return seq, obj
        if report is not None:
            report(path_of(directory, seq), problem)
    return -1, None


def remove_temporaries(directory):
    """Delete what writers killed mid-write left behind; return [(name, bytes)] deleted."""
    directory = pathlib.Path(directory)
    removed = []
    if directory.is_dir():
        for path in sorted(directory.glob(".*.tmp")):
            try:
                removed.append((path.name, path.stat().st_size))
                path.unlink()
            except OSError:
                pass
    return removed
