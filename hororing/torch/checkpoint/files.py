"""A checkpoint's directory: written whole or not at all.

A save writes into ``<path>.saving`` and only once every rank's files and DCP's ``.metadata``
are written does rank 0 rename it to ``<path>`` (replacing the previous checkpoint there). A
rank that dies while saving leaves ``<path>.saving`` behind and ``<path>`` as it was. A load
checks that ``.metadata`` is there and that every file it names is as long as it says.
"""

import os
import shutil
import warnings

METADATA = ".metadata"


def saving(path):
    return f"{os.fspath(path)}.saving"


def unwritable(path):
    """Why a checkpoint cannot be saved at ``path`` (rank 0 asks), or None. ``path`` may be
    missing, empty, or a checkpoint (which the save replaces); anything else is kept."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} is a file; a checkpoint is a directory"
    if os.path.isdir(path) and os.listdir(path) and \
            not os.path.exists(os.path.join(path, METADATA)):
        return (f"{path} is a directory that holds no checkpoint (no {METADATA}): a save "
                f"would replace it, so it is left alone; choose another path")
    return None


def begin(path):
    """Rank 0, before a save: an empty ``<path>.saving`` (what a torn save left is gone)."""
    directory = saving(path)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)


def publish(path):
    """Rank 0, after every rank's part and the metadata are written: the new checkpoint
    takes ``path``'s place."""
    path = os.fspath(path)
    old = f"{path}.old"
    if os.path.isdir(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(saving(path), path)
    shutil.rmtree(old, ignore_errors=True)


def read_metadata(path):
    """DCP's metadata of the checkpoint at ``path``. Raises ``ValueError`` naming what is
    missing or short (a torn save) instead of loading part of it."""
    from torch.distributed.checkpoint import FileSystemReader
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, METADATA)):
        if os.path.isdir(saving(path)):
            raise ValueError(
                f"the save of {path} did not finish (a rank stopped while saving): "
                f"{saving(path)} holds part of it and cannot be loaded; load an earlier "
                f"checkpoint")
        if not os.path.isdir(path):
            raise ValueError(f"no checkpoint at {path}: there is no such directory")
        raise ValueError(f"{path} is not a complete checkpoint: it has no {METADATA} "
                         f"(written last, once every rank's files are)")
    if os.path.isdir(saving(path)):
        warnings.warn(f"{saving(path)} holds a later save that did not finish (a rank stopped "
                      f"while saving); the complete checkpoint at {path} is loaded",
                      stacklevel=3)
    metadata = FileSystemReader(path).read_metadata()
    needed = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, length in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise ValueError(f"checkpoint {path} is torn: {name} is missing (its metadata "
                             f"names it)")
        if os.path.getsize(file) < length:
            raise ValueError(f"checkpoint {path} is torn: {name} holds "
                             f"{os.path.getsize(file)} bytes, its metadata needs {length}")
    if metadata.planner_data is None:
        raise ValueError(f"checkpoint {path} was saved without its keys' paths (DCP's "
                         f"flatten_state_dict=False): it cannot be matched to a model")
    return metadata
