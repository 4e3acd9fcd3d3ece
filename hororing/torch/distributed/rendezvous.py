"""``init_process_group`` with nothing set, under mpirun, hororun or srun: rank and world size
come from MPI.

torch's default rendezvous (``env://``) wants RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
which MPI launchers do not set. Where RANK is unset, the rendezvous below takes the rank and
size of hororing's job (``hvd.init()``); the store is a TCPStore at MASTER_ADDR:MASTER_PORT
when those are set, else a store of this process's own (``ProcessStore``): the hororing
backend needs no shared store, and anything that does (a gloo group) is told so by name.
Where RANK is set (torchrun and its kind), torch's own rendezvous runs unchanged.
"""

import importlib
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from ...environment import torch_rendezvous

# the module (torch.distributed.rendezvous is also the name of a function in the package)
_HANDLERS = getattr(importlib.import_module("torch.distributed.rendezvous"),
                    "_rendezvous_handlers", None)


class ProcessStore(dist.Store):
    """A key-value store of this process alone: what it was given, it has. Asking for a key
    another rank would have to set raises at once, naming the fix, instead of waiting out
    torch's timeout."""

    def __init__(self, rank):
        super().__init__()
        self._rank = rank
        self._values = {}

    def _missing(self, keys):
        return RuntimeError(
            f"rank {self._rank} asked torch.distributed's store for {keys!r}, which another "
            f"process would set, but this job has no shared store: init_process_group ran "
            f"under an MPI launcher without MASTER_ADDR. The hororing backend needs none; for "
            f"a backend that does (gloo, nccl), export MASTER_ADDR (rank 0's host) and "
            f"MASTER_PORT (a free port there) before starting")

    def set(self, key, value):
        self._values[key] = bytes(value) if not isinstance(value, str) else value.encode()

    def get(self, key):
        if key not in self._values:
            raise self._missing([key])
        return self._values[key]

    def add(self, key, amount):
        value = int(self._values.get(key, b"0")) + amount
        self._values[key] = str(value).encode()
        return value

    def compare_set(self, key, expected, desired):
        current = self._values.get(key)
        expected = expected.encode() if isinstance(expected, str) else bytes(expected)
        if (current is None and not expected) or current == expected:
            self.set(key, desired)
            return self._values[key]
        return current if current is not None else expected

    def check(self, keys):
        return all(key in self._values for key in keys)

    def wait(self, keys, timeout=None):
        missing = [key for key in keys if key not in self._values]
        if missing:
            raise self._missing(missing)

    def delete_key(self, key):
        return self._values.pop(key, None) is not None

    def num_keys(self):
        return len(self._values)


_KEPT = []  # the ProcessStores made, alive as long as torch may call them


def _from_mpi(url, timeout=timedelta(minutes=30), **kwargs):
    """The env:// rendezvous where no torch launcher set RANK: MPI's rank and size."""
    from ... import context
    context.init()
    rank, size = context.rank(), context.size()
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    for key, mine in (("rank", rank), ("world_size", size)):
        if key in query and int(query[key]) != mine:
            raise ValueError(f"init_process_group was given {key}={query[key]}, but MPI made "
                             f"this process {key} {mine}: leave {key} out under an MPI "
                             f"launcher, or pass hvd.rank() and hvd.size()")
    _, address, port = torch_rendezvous()
    if address and port:
        store = dist.TCPStore(address, int(port), size, rank == 0, timeout)
    else:
        store = ProcessStore(rank)
        # torch keeps only the C++ side of a store; its Python methods go with the object
        _KEPT.append(store)
    yield store, rank, size
    raise RuntimeError("the MPI rendezvous cannot run again: MPI's ranks are fixed for the job")


def _env_or_mpi(torch_env):
    def handler(url, timeout=timedelta(minutes=30), **kwargs):
        query = parse_qs(urlparse(url).query)
        rank_set, address, _ = torch_rendezvous()
        if rank_set or ("rank" in query and "world_size" in query and address):
            return torch_env(url, timeout=timeout, **kwargs)
        return _from_mpi(url, timeout=timeout, **kwargs)
    handler.hororing = True
    return handler


def install():
    """Let the env:// rendezvous take rank and size from MPI where RANK is unset (once)."""
    if _HANDLERS is None:
        return
    current = _HANDLERS.get("env")
    if current is not None and not getattr(current, "hororing", False):
        _HANDLERS["env"] = _env_or_mpi(current)
