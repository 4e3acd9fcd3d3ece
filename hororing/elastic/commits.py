"""Commits on disk: one file per commit, written whole or not at all.

A file is ``commit-<seq>.pkl`` in the job's elastic directory on each host: the pickled state
followed by a trailer (magic, sequence number, payload length, CRC-32). It is written under a
temporary name and renamed into place, so a writer killed mid-write leaves the previous commit
intact and a half-written temporary file that no reader trusts. The newest two commits are
kept.
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
    os.replace(temporary, final)
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


def read(directory, seq):
    """The object of commit ``seq``, or None if its file is missing, short or corrupt."""
    try:
        data = path_of(directory, seq).read_bytes()
    except OSError:
        return None
    if len(data) < _TRAILER.size:
        return None
    magic, stored_seq, length, crc = _TRAILER.unpack(data[-_TRAILER.size:])
    payload = memoryview(data)[:-_TRAILER.size]
    if magic != _MAGIC or stored_seq != seq or length != len(payload) or \
            zlib.crc32(payload) != crc:
        return None
    return pickle.loads(payload)


def newest(directory):
    """(seq, object) of the newest intact commit in ``directory``, or (-1, None)."""
    for seq in sequences(directory):
        obj = read(directory, seq)
        if obj is not None:
            return seq, obj
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
