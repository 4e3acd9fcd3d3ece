"""Ranks that disagree about one collective: the first difference, in Horovod's words.

Before any data moves, every rank's metadata for a name (``negotiation.Meta``) is compared
with the lowest rank's; the first field that differs becomes the collective's error, worded
as Horovod words it (its own tests match these messages), on every rank.
"""

from ..ops import op_name


def mismatch(name, metas):
    """Return Horovod's message for the first disagreement among ``metas``, or None."""
    ranks = sorted(metas)
    first_rank = ranks[0]
    first = metas[first_rank]
    for rank in ranks[1:]:
        message = _compare(first, metas[rank])
        if message is not None:
            return f"{message} (tensor '{name}': rank {first_rank} vs rank {rank})"
    return None


def _compare(a, b):
    """Horovod's words for the first way ``a`` and ``b`` (two ranks' Metas of one name)
    disagree, or None."""
    kind = a.kind.upper()
    if a.kind != b.kind:
        return (f"Mismatched MPI operations: One rank did an {kind}, but another rank did an "
                f"{b.kind.upper()}.")
    return (_difference(a, b, kind, _COMPARED_FIRST) or _shape_difference(a, b, kind)
            or _difference(a, b, kind, _COMPARED_LAST))


def _difference(a, b, kind, compared):
    for field, words, shown in compared:
        if getattr(a, field) != getattr(b, field) and (field != "root" or a.kind == "broadcast"):
            return words.format(kind=kind, a=shown(a), b=shown(b))
    return None


def _shape_difference(a, b, kind):
    if a.kind in ("allgather", "alltoall"):  # dimension 0 may differ
        if len(a.shape) != len(b.shape):
            return (f"Mismatched {kind} tensor shapes: One rank sent a tensor of rank "
                    f"{len(a.shape)}, but another rank sent a tensor of rank {len(b.shape)}.")
        for dim in range(1, len(a.shape)):
            if a.shape[dim] != b.shape[dim]:
                return (f"Mismatched {kind} tensor shapes: One rank sent a tensor with dimension "
                        f"{dim} equal to {a.shape[dim]}, but another rank sent a tensor with "
                        f"dimension {dim} equal to {b.shape[dim]}.")
    elif a.shape != b.shape:
        return (f"Mismatched {kind} tensor shapes: One rank sent a tensor of shape "
                f"{list(a.shape)}, but another rank sent a tensor of shape {list(b.shape)}.")
    return None


# the fields compared before the shapes and after them: Horovod's words for a mismatch, and
# how a rank's Meta shows the field in them
_COMPARED_FIRST = (
    ("dtype", "Mismatched data types: One rank had type {a}, but another rank had type {b}.",
     lambda meta: meta.dtype),
    ("wire", "Mismatched {kind} compression: One rank sent {a} on the wire, but another rank "
             "sent {b}. Use the same compression= on every rank.", lambda meta: _wire_name(meta)),
    ("device", "Mismatched {kind} CPU/GPU device selection: One rank specified device {a}, but "
               "another rank specified device {b}.", lambda meta: meta.device),
)
_COMPARED_LAST = (
    ("op", "Mismatched {kind} reduction operations: One rank specified {a}, but another rank "
           "specified {b}.", lambda meta: op_name(meta.op)),
    ("root", "Mismatched {kind} root ranks: One rank specified root rank {a}, but another rank "
             "specified root rank {b}.", lambda meta: meta.root),
    ("prescale", "Mismatched prescale factors: One rank sent factor {a}, but another rank sent "
                 "factor {b}.", lambda meta: meta.prescale),
    ("postscale", "Mismatched postscale factors: One rank sent factor {a}, but another rank "
                  "sent factor {b}.", lambda meta: meta.postscale),
)


def _wire_name(meta):
    # without compression, float16 travels (and is summed) as float32
    return meta.wire or ("float32" if meta.dtype == "float16" else meta.dtype)
