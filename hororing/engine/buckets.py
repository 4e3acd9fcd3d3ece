"""The fusion rule, written once: which tensors share a fused bucket.

The engine fuses each cycle's ready allreduces by it, and the optimizers lay gradients out
in memory by it (one flat tensor per bucket, so a bucket is reduced where it lies); the two
must agree for that memory to be back to back in the order the engine reduces it.
"""


def fill_buckets(items, key, nbytes, limit):
    """Group ``items`` into buckets, in order.

    Items of one ``key(item)`` fill one bucket after another: an item goes into its key's
    open bucket unless its ``nbytes(item)`` would take the bucket past ``limit`` bytes, and
    then opens a new one (so an item larger than ``limit`` has a bucket of its own).

    Returns:
        The buckets (lists of items), in the order of each bucket's first item.
    """
    open_buckets = {}  # key -> [bytes, items] of the bucket items of that key go into
    buckets = []
    for item in items:
        size = nbytes(item)
        bucket = open_buckets.get(key(item))
        if bucket is None or bucket[0] + size > limit:
            bucket = open_buckets[key(item)] = [0, []]
            buckets.append(bucket[1])
        bucket[0] += size
        bucket[1].append(item)
    return buckets
