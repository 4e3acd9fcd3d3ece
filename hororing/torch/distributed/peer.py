"""Point to point for the hororing process group: send, recv (from a rank or any) on the
group's own duplicate communicator (``_p2p``), so they never match the engine's messages.
Each returns a RequestWork over the MPI request."""

import torch

from ..._mpi import MPI
from .work import RequestWork


class PointToPoint:
    """The process group's sends and receives; needs ``_p2p`` (the duplicate communicator)
    and ``_job_rank`` (which checks a group rank)."""

    def send(self, tensors, dst, tag):
        self._job_rank(dst, "dst")
        tensor = _host(tensors[0], "send").contiguous()
        request = self._p2p.Isend(_buffer(tensor), dest=dst, tag=tag)
        return RequestWork(request, tensors, finish=lambda: tensor)

    def recv(self, tensors, src, tag):
        self._job_rank(src, "src")
        return self._receive(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._receive(tensors, MPI.ANY_SOURCE, tag)

    def _receive(self, tensors, source, tag):
        target = _host(tensors[0], "recv")
        staging = target if target.is_contiguous() else torch.empty_like(
            target, memory_format=torch.contiguous_format)
        request = self._p2p.Irecv(_buffer(staging), source=source, tag=tag)
        finish = None if staging is target else (lambda: target.copy_(staging))
        return RequestWork(request, tensors, finish)


def _host(tensor, verb):
    if tensor.device.type != "cpu":
        raise ValueError(f"{verb} of the hororing backend moves CPU tensors; this one is on "
                         f"{tensor.device}: send tensor.cpu() and copy it back")
    return tensor


def _buffer(tensor):
    """An MPI buffer over a contiguous CPU tensor's bytes."""
    return tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else bytearray()
