"""A bucket reduced where its large members lie: only the small ones are packed.

Fusing a bucket copies every member into the fusion buffer and back out after the
reduction: two passes over its bytes. For a member large enough that those copies cost more
than the messages of a ring of its own, that is the wrong trade (eight 4 MiB arrays at 2 ranks
on one host: 14.5 ms fused against 8.4 ms one by one). Here a host bucket the ring reduces is
laid out as segments instead: each large member is a segment of its own, reduced in its
output's memory, and each run of small members between them is one segment, packed into
the fusion buffer (or, where it already lies back to back in place, viewed there). The ring
cuts its pieces at the segments' bounds, so no message spans two segments.

Which members are large depends only on their sizes and the route, the same on every rank;
where each segment's memory is (the member itself, a packed run, a span of adjacent
in-place members) is each rank's own business, so ranks whose tensors lie differently in
memory still send the same messages.
"""

from typing import NamedTuple

from ..algorithms import cost
from ..algorithms.segmented import Segmented
from ..kernels import pack


class Segment(NamedTuple):
    start: int  # the segment's elements [start, stop) in the bucket
    stop: int
    first: int  # its members [first, last) in bucket order
    last: int
    large: bool  # one large member (else a run of small ones)


def plan(sizes, itemsize, member_bytes):
    """The segments of a bucket of members of ``sizes`` elements each, or None when none is
    of ``member_bytes`` or more: the bucket is then fused whole. A zero ``member_bytes``
    turns segments off."""
    if not member_bytes or len(sizes) < 2 or max(sizes) * itemsize < member_bytes:
        return None
    segments = []
    offset = run_start = run_first = 0
    for index, count in enumerate(sizes):
        if count * itemsize >= member_bytes:
            if run_first < index:  # the small members before it
                segments.append(Segment(run_start, offset, run_first, index, False))
            segments.append(Segment(offset, offset + count, index, index + 1, True))
            run_start, run_first = offset + count, index + 1
        offset += count
    if run_first < len(sizes):
        segments.append(Segment(run_start, offset, run_first, len(sizes), False))
    # a run of empty members has nothing to reduce
    return [segment for segment in segments if segment.stop > segment.start]


def lay_out(segments, inputs, outputs, place, fusion_view):
    """The ``Segmented`` buffer over a host bucket's ``segments``, and what to unpack after
    the reduction: ``(view, ranges, outputs)`` per packed run.

    A large member is reduced in its output (its input copied there first where the two
    differ); a run of small members where it lies, when it is reduced in place and lies back
    to back (``place.span``), else packed into ``fusion_view(count)``, one region of the
    fusion buffer holding every packed run."""
    packing = []  # segments whose members are packed
    parts = [None] * len(segments)
    for index, segment in enumerate(segments):
        members = slice(segment.first, segment.last)
        if segment.large:
            output = outputs[segment.first]
            if output is not inputs[segment.first]:
                place.copy(output.reshape(-1), inputs[segment.first])
            parts[index] = output.reshape(-1)
            continue
        parts[index] = place.span(inputs[members], outputs[members])
        if parts[index] is None:
            packing.append(index)
    unpacking = []
    if packing:
        region = fusion_view(sum(segments[index].stop - segments[index].start
                                 for index in packing))
        offset = 0
        for index in packing:
            segment = segments[index]
            members = slice(segment.first, segment.last)
            view = region[offset:offset + segment.stop - segment.start]
            offset += view.size
            unpacking.append((view, pack(inputs[members], view), outputs[members]))
            parts[index] = view
    return Segmented(parts), unpacking


_PRICED_AS = {"shared": "ring"}


def split_pays(counts, itemsize, route, ranks, far, per_node):
    """Whether reducing each of the segments of ``counts`` elements on its own, by the
    algorithm the ``route``'s table gives its size, is priced at least ``cost.MARGIN`` below
    one ring over them all (``ranks`` ranks, ``per_node`` on a node, linked by ``far``):
    where a ring over the whole bucket has more bytes in flight than a node's caches hold,
    smaller ones stay in them."""
    shm = cost.PRESETS["shm"]

    def price(kind, nbytes):
        return cost.predict(kind, ranks, nbytes, cost.HOST, far, shm, per_node=per_node,
                            subchunk_bytes=route.subchunk_bytes,
                            piece_ceiling=route.piece_ceiling)
    one = price("ring", sum(counts) * itemsize)
    # the shared-memory allreduce is not priced (cost.with_shared): where the table gives it
    # a segment, the ring stands in, which it was measured no faster than in its range
    parts = sum(price(_PRICED_AS.get(kind, kind), count * itemsize)
                for kind, count in ((cost.lookup(route.table, count * itemsize), count)
                                    for count in counts))
    return parts < (1 - cost.MARGIN) * one
