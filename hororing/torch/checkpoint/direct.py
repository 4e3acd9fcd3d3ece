"""A DCP storage writer that writes each rank's file around the page cache.

A checkpoint's bytes are written once and not read back by the process that wrote them.
Written through the page cache, as DCP's ``FileSystemWriter`` writes them, they cost a copy
into the cache, the kernel's writeback of it and, inside ``torch.save``, a CRC of every byte:
about 2 s of CPU for a rank's 580 MiB on a 2-core VM, taken from training when the ranks fill
the cores (an async save's steps ran 1.2x slower in the median). With ``O_DIRECT`` the disk
reads the bytes straight from memory: 0.05 s of CPU for the same file.

The file is laid out so that every tensor's bytes start on a block boundary and are written
straight from the memory they are in, where that memory starts on a page (the staging memory
of an async save is allocated so, ``aligned_empty``); the small zip records ``torch.save``
puts around them go through a page-aligned bounce buffer, as do tensors elsewhere in memory.
Each item is the ``torch.save`` of it that ``FileSystemWriter`` writes (no CRC of the data),
at the offset and length the metadata records; the gaps between items are never read. So
``dcp.load``, ``FileSystemReader`` and ``dcp_to_torch_save`` read the files as they read
``FileSystemWriter``'s.

Where the file system refuses ``O_DIRECT`` (tmpfs, some network file systems) the same bytes
are written through the page cache. ``HORORING_CHECKPOINT_WRITER=filesystem`` uses DCP's own
writer instead.
"""

import errno
import functools
import io
import math
import mmap
import os

import torch

from ...environment import checkpoint_writer

BLOCK = 4096  # what O_DIRECT asks of offsets, lengths and addresses (512 on most disks)
ALIGNED_FROM = 256 << 10  # staging memory from this size on gets its own mapping
_BOUNCE = 4 << 20  # the bounce buffer: zip records, small and unaligned tensors
_CHUNK = 64 << 20  # the most bytes one write() is given
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # (Linux; elsewhere the page cache it is)


def usable():
    """Whether this writer can run here (``torch.serialization.skip_data``: torch 2.5 on)
    and is not turned off."""
    return checkpoint_writer() == "direct" and hasattr(torch.serialization, "skip_data")


def aligned_empty(shape, dtype):
    """An uninitialized CPU tensor which this writer hands to the disk without a copy: from
    ``ALIGNED_FROM`` bytes on, its memory starts on a page (an anonymous mapping of its own;
    smaller ones, not worth a mapping each, come from torch's allocator)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < ALIGNED_FROM:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).reshape(
        shape)


def writer(path):
    """The storage writer for a checkpoint directory: this one where ``usable()``, else
    DCP's ``FileSystemWriter``."""
    from torch.distributed.checkpoint import FileSystemWriter
    if not usable():
        return FileSystemWriter(path)
    return _writer_class()(path)


@functools.cache
def _writer_class():
    """The writer's class, made on first use (torch.distributed.checkpoint is imported
    then, not with this module)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    class DirectWriter(FileSystemWriter):
        """``FileSystemWriter`` with ``write_data`` writing one file per rank around the page
        cache (module docstring)."""

        def write_data(self, plan, planner):
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            results = []
            with _File(os.path.join(self.path, name), self.sync_files) as out:
                for item in plan.items:
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        start = out.position
                        out.put(data.getbuffer())
                    else:
                        start = write_tensor(out, data.detach().cpu())
                    length = out.position - start
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name, start, length)))
            future = torch.futures.Future()
            future.set_result(results)
            return future

    return DirectWriter


def write_tensor(out, tensor):
    """``torch.save(tensor)``'s bytes at ``out``'s position (after zeros that put the data
    on a block boundary, where it is written from where it lies: memory on a page); returns
    where they start."""
    plain = tensor.layout == torch.strided and not tensor.is_quantized
    if plain and (not tensor.is_contiguous()
                  or tensor.untyped_storage().nbytes() != tensor.nbytes):
        tensor = tensor.clone(memory_format=torch.contiguous_format)  # (as DCP saves a view)
    framed = _framed(tensor) if plain else None
    if framed is None:  # a layout this does not know: the whole torch.save through the buffer
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        start = out.position
        out.put(buffer.getbuffer())
        return start
    head, tail = framed
    data = tensor.reshape(-1).view(torch.uint8).numpy()
    # memory on a page goes out from where it lies (and is laid out so, O_DIRECT or not)
    if data.ctypes.data % BLOCK == 0 and data.nbytes >= BLOCK:
        out.pad(len(head))  # the data's first byte on a block boundary
        start = out.position
        out.put(head)
        out.put_aligned(data)
    else:
        start = out.position
        out.put(head)
        out.put(data)
    out.put(tail)
    return start


class _Capture:
    """A file for ``torch.save`` under ``skip_data``: it keeps the bytes written and where
    the writer seeked over a storage's data."""

    def __init__(self):
        self.parts, self.holes, self.position = [], [], 0

    def write(self, data):
        data = bytes(data)
        self.parts.append((self.position, data))
        self.position += len(data)
        return len(data)

    def seek(self, offset, whence=os.SEEK_SET):
        if whence != os.SEEK_CUR:
            raise io.UnsupportedOperation("only relative seeks")
        self.holes.append((self.position, offset))
        self.position += offset
        return self.position

    def tell(self):
        return self.position

    def flush(self):
        pass


def _framed(tensor):
    """(the bytes ``torch.save(tensor)`` writes before the data, those after it), or None
    where they cannot be told apart."""
    capture = _Capture()
    try:
        with torch.serialization.skip_data():
            torch.save(tensor, capture)
    except (io.UnsupportedOperation, RuntimeError):
        return None
    if len(capture.holes) != 1 or capture.holes[0][1] != tensor.nbytes:
        return None
    start = capture.holes[0][0]
    head = b"".join(data for position, data in capture.parts if position < start)
    tail = b"".join(data for position, data in capture.parts if position >= start)
    if len(head) != start:
        return None
    return head, tail


class _File:
    """A file written in whole blocks: bytes gather in a page-aligned bounce buffer and go
    out a block at a time; ``put_aligned`` writes page-aligned memory where it lies."""

    def __init__(self, path, sync):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.sync = sync
        self.direct = bool(_O_DIRECT)
        try:
            self.fd = os.open(path, flags | _O_DIRECT, 0o644)
        except OSError:  # a file system without O_DIRECT
            self.fd = os.open(path, flags, 0o644)
            self.direct = False
        self.bounce = mmap.mmap(-1, _BOUNCE)
        self.filled = 0  # bytes in the bounce buffer, not yet written
        self.written = 0  # bytes written: the file offset of the bounce buffer's first byte

    @property
    def position(self):
        return self.written + self.filled

    def put(self, data):
        view = memoryview(data).cast("B")
        while len(view):
            count = min(len(view), _BOUNCE - self.filled)
            self.bounce[self.filled:self.filled + count] = view[:count]
            self.filled += count
            view = view[count:]
            if self.filled == _BOUNCE:
                self._flush()

    def pad(self, before):
        """Zeros, so that ``before`` bytes on the position is on a block boundary."""
        self.put(bytes(-(self.position + before) % BLOCK))

    def put_aligned(self, data):
        """``data`` (page-aligned memory) at the position, which is on a block boundary: its
        whole blocks written from where they lie, the rest through the buffer."""
        self._flush()  # (everything: the position is on a block boundary)
        whole = data.nbytes // BLOCK * BLOCK
        self._write(memoryview(data)[:whole])
        self.written += whole
        self.put(memoryview(data)[whole:])

    def _flush(self, pad=False):
        """Write the bounce buffer's whole blocks (``pad``: all of it, zero-filled to a
        block) and keep the rest at its start."""
        whole = self.filled // BLOCK * BLOCK
        if pad and whole < self.filled:
            whole += BLOCK
            self.bounce[self.filled:whole] = bytes(whole - self.filled)
        self._write(memoryview(self.bounce)[:whole])
        rest = max(0, self.filled - whole)
        self.bounce[:rest] = self.bounce[whole:whole + rest]
        self.written += whole
        self.filled = rest

    def _write(self, view):
        while len(view):
            try:
                count = os.write(self.fd, view[:_CHUNK])
            except OSError as error:
                if not (self.direct and error.errno == errno.EINVAL):  # O_DIRECT refused
                    raise
                self._buffered()
                continue
            view = view[count:]

    def _buffered(self):
        import fcntl
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self.direct = False

    def __enter__(self):
        return self

    def __exit__(self, *failed):
        try:
            if failed[0] is None:  # (a failed write leaves the file as it is: never published)
                length = self.position
                self._flush(pad=True)
                os.ftruncate(self.fd, length)  # (the last block's zeros beyond the end)
                if self.sync:
                    os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.bounce.close()
