"""Passing a job's output through while reading it (hororun and hororing.run use this)."""

from ..elastic import job


def copy_lines(stream, sink, acknowledged=None, keep=None):
    """Copy ``stream``'s lines to ``sink``; set ``acknowledged`` on the ranks' answer to a
    notice; lines for which ``keep(line)`` is true are kept from ``sink``."""
    for line in iter(stream.readline, b""):
        if acknowledged is not None and job.ACKNOWLEDGEMENT in line:
            acknowledged.set()
        if keep is not None and keep(line):
            continue
        sink.write(line.decode(errors="replace"))
        sink.flush()
    stream.close()
