"""A channel's producer: streams one rank's files into that rank's FIFO, then an END frame.

Run as a script in a child process (``python producer.py SPEC``), never imported by the
library: the child starts without importing hororing, and needs only the standard library,
numpy and the sibling ``records`` module. The END frame carries the number of bytes sent before it, so the reader can tell that nothing
was lost. SPEC is a JSON file with ``fifo``,
``format`` (``records`` or ``npy``), ``files`` and ``block_bytes``.
"""

import errno
import fcntl
import json
import os
import sys
import zlib

if __package__:
    from .records import (END, ERROR, FILE, FRAME, MAGIC, TRAILER, TRAILER_COUNT,
                          RecordFormatError, chain_crc, check_header, read_npy_blocks)
else:  # run as a script: the sibling module is importable by name
    from records import (END, ERROR, FILE, FRAME, MAGIC, TRAILER, TRAILER_COUNT,
                         RecordFormatError, chain_crc, check_header, read_npy_blocks)

F_SETPIPE_SZ = 1031  # Linux fcntl: grow the pipe so each write moves a large block


def main(spec_path):
    with open(spec_path) as file:
        spec = json.load(file)
    # O_NONBLOCK open fails (ENXIO) instead of blocking forever when the reader is gone
    fd = os.open(spec["fifo"], os.O_WRONLY | os.O_NONBLOCK)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, spec["block_bytes"])
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size: keep the default size
    pipe = _Pipe(fd)
    try:
        if spec["format"] == "npy":
            _stream_npy(pipe, spec["files"], spec["block_bytes"])
        else:
            _stream_records(pipe, spec["files"], spec["block_bytes"])
    except BrokenPipeError:
        return 3  # the reader closed the channel early: nothing left to do
    except Exception as error:  # report any failure to the reader, then fail
        message = f"{type(error).__name__}: {error}".encode("utf-8", "replace")
        try:
            pipe.write(FRAME.pack(ERROR, len(message)) + message)
        except OSError:
            pass
        print(message.decode(), file=sys.stderr)
        return 1
    try:
        os.write(fd, FRAME.pack(END, pipe.sent & 0xFFFFFFFF))  # 8 bytes: one atomic pipe write
    except BrokenPipeError:
        return 3
    os.close(fd)
    return 0


def _stream_records(pipe, files, block_bytes):
    """Copy each record file's frames into the pipe in large blocks.

    The file body is already in the channel's frame format, so the producer only copies. A FILE
    frame goes before each file: a truncated file then fails the reader's CRC check on its last
    record or lacks its trailer, and the reader's error names the file.
    """
    for index, path in enumerate(files):
        with open(path, "rb", buffering=0) as file:
            check_header(file.read(len(MAGIC)), path)
            pipe.write(FRAME.pack(FILE, index))
            pipe.copy_from(file.fileno(), os.fstat(file.fileno()).st_size - len(MAGIC),
                           block_bytes)


def _stream_npy(pipe, files, block_bytes):
    """Send each .npy file's rows as frames of whole rows, then a trailer, as a record file."""
    for index, path in enumerate(files):
        pipe.write(FRAME.pack(FILE, index))
        count, chain = 0, 0
        for block in read_npy_blocks(path, block_bytes=block_bytes):
            check = zlib.crc32(block)
            pipe.write(FRAME.pack(len(block), check))
            pipe.write(block)
            count, chain = count + 1, chain_crc(chain, check)
        pipe.write(FRAME.pack(TRAILER, chain) + TRAILER_COUNT.pack(count))


class _Pipe:
    """The FIFO's write end, counting the bytes sent for the END frame."""

    def __init__(self, fd):
        self.fd = fd
        self.sent = 0

    def write(self, data):
        """Write all of ``data``."""
        view = memoryview(data)
        self.sent += view.nbytes
        while view:
            view = view[os.write(self.fd, view):]

    def copy_from(self, source, size, block_bytes):
        """Move ``size`` bytes from the file's position into the pipe, by splice where available.

        splice hands page-cache pages to the pipe without copying them through this process,
        so the producer costs the rank's core almost nothing.
        """
        splice = getattr(os, "splice", None)
        remaining = size
        while remaining > 0:
            count = min(block_bytes, remaining)
            if splice is not None:
                try:
                    moved = splice(source, self.fd, count)
                    self.sent += moved
                except OSError as error:
                    if error.errno not in (errno.EINVAL, errno.ENOSYS):
                        raise
                    splice = None
                    continue
            else:
                block = os.read(source, count)
                moved = len(block)
                self.write(block)
            if moved == 0:
                raise RecordFormatError("a record file shrank while it was being sent")
            remaining -= moved


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
