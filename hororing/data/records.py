"""Streaming readers for record files and .npy shards, and the frame format both travel in.

Record file: an 8-byte header (``HRREC``, a zero byte, version 2 as little-endian uint16), then
frames, then a trailer. A frame is ``<length: uint32 LE> <crc32 of payload: uint32 LE>
<payload>``. The trailer is ``<0xFFFFFFFC: uint32> <chain: uint32> <records: uint64>``, where
chain is the crc32 of the records' crc32 words in order: a file cut anywhere, even exactly
between two records, lacks it, so a reader can tell a complete file from a truncated one.
(Version 1 files had no trailer and are refused.) A channel carries the same frames and
trailers without the header, plus control frames that a file never holds: FILE (length
0xFFFFFFFD, second word = index of the file whose frames follow), END (length 0xFFFFFFFF,
second word = number of bytes sent) and ERROR (length 0xFFFFFFFE, second word = byte length of
a UTF-8 message that follows).

This module imports only the standard library (numpy when .npy files are read): a channel's
producer process runs it without importing the rest of hororing.
"""

import os
import struct
import zlib

MAGIC_PREFIX = b"HRREC\x00"
VERSION = 2
MAGIC = MAGIC_PREFIX + struct.pack("<H", VERSION)
FRAME = struct.Struct("<II")
TRAILER_COUNT = struct.Struct("<Q")  # follows the trailer's frame words
END = 0xFFFFFFFF
ERROR = 0xFFFFFFFE
FILE = 0xFFFFFFFD
TRAILER = 0xFFFFFFFC
MAX_RECORD = 0xFFFFFFFB
READ_BYTES = 1 << 20


class RecordFormatError(ValueError):
    """A record file or channel stream is not in the expected format (corrupt or truncated)."""


class RecordWriter:
    """Write a record file: ``with RecordWriter(path) as out: out.write(payload)``.

    Args:
        path: the file to create (overwritten if present).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self.count = 0
        self._chain = 0
        self._file = open(self.path, "wb")
        self._file.write(MAGIC)

    def write(self, payload):
        """Append one record (bytes-like, at most 4 GiB - 3 bytes)."""
        data = memoryview(payload).cast("B")
        if data.nbytes > MAX_RECORD:
            raise ValueError(f"a record holds at most {MAX_RECORD} bytes, got {data.nbytes}")
        check = zlib.crc32(data)
        self._file.write(FRAME.pack(data.nbytes, check))
        self._file.write(data)
        self._chain = chain_crc(self._chain, check)
        self.count += 1

    def close(self):
        """Write the trailer (record count and checksum chain), flush and close the file."""
        if not self._file.closed:
            self._file.write(FRAME.pack(TRAILER, self._chain) + TRAILER_COUNT.pack(self.count))
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def chain_crc(chain, record_crc):
    """Fold one record's crc32 into the running checksum a trailer carries."""
    return zlib.crc32(FRAME.pack(record_crc, 0)[:4], chain)


def check_header(header, path):
    """Raise RecordFormatError unless ``header`` is this version's record-file header."""
    if header == MAGIC:
        return
    if header.startswith(MAGIC_PREFIX) and len(header) == len(MAGIC):
        version = struct.unpack("<H", header[len(MAGIC_PREFIX):])[0]
        raise RecordFormatError(
            f"{path!r} is a hororing record file of format version {version}, which has no "
            f"trailer, so a copy cut between two records cannot be told from a complete one; "
            f"rewrite it with this version's hororing.data.RecordWriter (format {VERSION})")
    raise RecordFormatError(
        f"{path!r} is not a hororing record file (header {header!r}, expected {MAGIC!r}); "
        f"write it with hororing.data.RecordWriter")


def read_records(path, read_bytes=READ_BYTES):
    """Yield each record (bytes) of a record file, streaming ``read_bytes`` at a time."""
    path = os.fspath(path)
    with open(path, "rb", buffering=0) as file:
        check_header(file.read(len(MAGIC)), path)
        yield from parse_frames(lambda: file.read(read_bytes), path, offset=len(MAGIC))


def parse_frames(read_chunk, source, offset=0, control=False, files=None):
    """Yield the payloads of the frames in a byte stream.

    Args:
        read_chunk: returns the next bytes of the stream, ``b""`` at its end.
        source: names the stream in errors.
        offset: the file position of the first byte ``read_chunk`` returns (for errors).
        control: accept control frames (a channel); on END the generator checks the byte count
            the END frame carries and returns; on ERROR it raises ``ProducerError``.
        files: the files a channel's FILE frames index; errors then name the file.
    """
    buffer = b""
    position = 0
    base = 0  # stream bytes before buffer[0]
    file_start = -offset  # stream position of byte 0 of the current file
    records, chain = 0, 0   # of the current file, for its trailer
    # whether the current file's trailer was seen (None: a channel before its first file)
    complete = None if control else False
    while True:
        available = len(buffer) - position
        if available >= FRAME.size:
            length, check = FRAME.unpack_from(buffer, position)
            if length < TRAILER and available >= FRAME.size + length:
                if complete:
                    raise RecordFormatError(f"{source!r}: data after its trailer at byte "
                                            f"{base + position - file_start}")
                start = position + FRAME.size
                payload = buffer[start:start + length]
                if zlib.crc32(payload) != check:
                    raise RecordFormatError(
                        f"{source!r}: the record at byte {base + position - file_start} fails "
                        f"its CRC check (corrupt or truncated file)")
                position = start + length
                records, chain = records + 1, chain_crc(chain, check)
                yield payload
                continue
            if length == TRAILER and available >= FRAME.size + TRAILER_COUNT.size:
                (count,) = TRAILER_COUNT.unpack_from(buffer, position + FRAME.size)
                if count != records or check != chain:
                    raise RecordFormatError(
                        f"{source!r}: its trailer promises {count} records but {records} "
                        f"were read (or their checksums differ): the file is corrupt")
                position += FRAME.size + TRAILER_COUNT.size
                complete = True
                continue
            if length >= FILE:
                if not control:
                    raise RecordFormatError(
                        f"{source!r}: bad record length {length:#x} at byte "
                        f"{base + position - file_start}")
                if length == FILE:
                    _check_complete(complete, source)
                    source = files[check] if files and check < len(files) else source
                    position += FRAME.size
                    file_start = base + position - len(MAGIC)
                    records, chain, complete = 0, 0, False
                    continue
                if length == END:
                    if check != (base + position) & 0xFFFFFFFF:
                        raise ProducerError(
                            f"the producer sent {check} bytes (mod 2**32) but "
                            f"{base + position} arrived")
                    _check_complete(complete, source)
                    return
                raise ProducerError(_read_message(buffer, position + FRAME.size, check,
                                                  read_chunk))
        chunk = read_chunk()
        if not chunk:
            break
        base += position
        buffer = buffer[position:] + chunk
        position = 0
    partial = position < len(buffer)
    if control:
        # no END frame: the producer died or failed; say where the stream broke off
        where = f"inside a record of {source!r}" if partial else "between records"
        raise ProducerError(None, f"the stream ended {where} without its end marker")
    if partial:
        raise RecordFormatError(
            f"{source!r} ends inside a record at byte {base + position - file_start} "
            f"(truncated file)")
    _check_complete(complete, source)


def _check_complete(complete, source):
    """Raise for a record file whose frames ended without the trailer (cut short)."""
    if complete is False:
        raise RecordFormatError(
            f"{source!r} ends without its trailer after a whole record: the file was cut short "
            f"(truncated between two records), or it is still being written")


def _read_message(buffer, start, length, read_chunk):
    while len(buffer) < start + length:
        chunk = read_chunk()
        if not chunk:
            break
        buffer += chunk
    return buffer[start:start + length].decode("utf-8", "replace")


class ProducerError(RuntimeError):
    """A channel's producer reported an error, or the stream ended without an END frame.

    ``args[0]`` is the producer's message (None when it sent none); ``args[1]``, when present,
    says where the stream broke off.
    """


def npy_layout(path):
    """Return ``(dtype, row_shape, rows, data_offset)`` of a .npy file, reading only its header."""
    import numpy as np
    path = os.fspath(path)
    with open(path, "rb") as file:
        try:
            version = np.lib.format.read_magic(file)
            if version == (1, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(file)
            else:
                shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(file)
        except ValueError as error:
            raise RecordFormatError(f"{path!r} is not a readable .npy file: {error}") from None
        offset = file.tell()
    if dtype.hasobject:
        raise RecordFormatError(f"{path!r} holds Python objects; save plain numeric arrays")
    if not shape:
        raise RecordFormatError(f"{path!r} holds a 0-d array; shards need a first (row) axis")
    if fortran_order and len(shape) > 1:
        raise RecordFormatError(
            f"{path!r} is in Fortran order, so its rows are not contiguous; save it with "
            f"np.save(path, np.ascontiguousarray(array))")
    return dtype, tuple(shape[1:]), shape[0], offset


def read_npy_blocks(path, block_rows=None, block_bytes=READ_BYTES, layout=None):
    """Yield raw bytes of consecutive blocks of whole rows of a .npy file.

    A block holds ``block_rows`` rows, or by default as many as fit in ``block_bytes`` (at
    least one). ``layout`` is the file's ``npy_layout`` when the caller has read it already.
    """
    import numpy as np
    dtype, row_shape, rows, offset = layout or npy_layout(path)
    row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
    if block_rows is None:
        block_rows = max(block_bytes // max(row_bytes, 1), 1)
    with open(path, "rb", buffering=0) as file:
        file.seek(offset)
        remaining = rows
        while remaining:
            count = min(block_rows, remaining)
            block = file.read(count * row_bytes)
            if len(block) != count * row_bytes:
                raise RecordFormatError(
                    f"{path!r} ends early: its header promises {rows} rows (truncated file)")
            remaining -= count
            yield block


def read_npy(path, block_rows=1024):
    """Yield the rows of a .npy file (arrays of the file's dtype), streaming by blocks."""
    layout = npy_layout(path)
    for block in read_npy_blocks(path, block_rows, layout=layout):
        yield from split_rows(block, layout[0], layout[1])


def split_rows(block, dtype, row_shape):
    """Return the rows packed in ``block`` as read-only arrays."""
    import numpy as np
    array = np.frombuffer(block, dtype=dtype)
    return list(array.reshape((-1,) + tuple(row_shape)))
