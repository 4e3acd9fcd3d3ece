"""The fusion rule, written once: which allreduces share a fused bucket, and how many bytes
each takes there.

The engine fuses each cycle's ready collectives by it (``executor.py``), and the optimizers
lay gradients out in memory by it (one flat tensor per bucket, so a bucket is reduced where it
lies: ``optim.py``, ``torch/optimizer.py``; the sharded layout cuts its flat vector by it,
``torch/shard_layout.py``). Every caller describes its tensors as the engine does, as
``Meta``s, and calls ``assign``: the key and the size are the rule's, never the caller's, so
the memory an optimizer lays out is back to back in exactly the buckets the engine forms.
"""

from .allreduce import wire_bytes

__all__ = ["assign", "bucket_key", "fusion_key"]


def fusion_key(meta):
    """What allreduces must share to be fused: dtype, op, scale factors, place and wire dtype.
    None for any other collective, which runs alone."""
    if meta.kind != "allreduce":
        return None
    return (meta.dtype, meta.op, meta.prescale, meta.postscale, meta.device, meta.wire)


def assign(metas, limit):
    """The fused buckets of ``metas`` (in order), as lists of indices into ``metas``.

    Allreduces of one ``fusion_key`` fill one bucket after another: one goes into its key's
    open bucket unless its bytes on the wire (``allreduce.wire_bytes``) would take the bucket
    past ``limit``, and then opens a new one (so one larger than ``limit`` has a bucket of its
    own). Any other collective is a bucket of its own. Buckets come in the order of their
    first member.
    """
    open_buckets = {}  # key -> [bytes, indices] of the bucket allreduces of that key go into
    buckets = []
    for index, meta in enumerate(metas):
        key = fusion_key(meta)
        if key is None:
            buckets.append([index])
            continue
        size = wire_bytes(meta)
        bucket = open_buckets.get(key)
        if bucket is None or bucket[0] + size > limit:
            bucket = open_buckets[key] = [0, []]
            buckets.append(bucket[1])
        bucket[0] += size
        bucket[1].append(index)
    return buckets


def bucket_key(name, cache_id):
    """Where a tensor goes in a fused bucket: cached names by id, then the names the cache
    had no room for, by name (both the same on every rank)."""
    return (0, cache_id, "") if cache_id is not None else (1, 0, name)
