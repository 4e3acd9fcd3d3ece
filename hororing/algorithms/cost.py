"""What each allreduce algorithm costs, as hororing runs it: its steps, messages and bytes
as functions of the rank count and the buffer, priced on a host and a link.

The classic alpha-beta-gamma models (``costmodel.py``, over these shapes) price the network
alone. Here a step also pays hororing's own work on the CPU: posting the sends and receives,
waiting, Python's loop (``Host.step_s``, measured tens of microseconds here, against a few
for the link), each extra message of a step (the ring's sub-chunks), the numpy reductions
and copies. The algorithms' shapes (``plan.py`` schedules):

============  ==========================  =============================  ===================
algorithm     Python steps                bytes on a rank's link         bytes reduced
============  ==========================  =============================  ===================
ring          2(n-1), pieces each         2(n-1)/n·S                     (n-1)/n·S
rabenseifner  2·Σ(f-1) (+2 if folded)     2(m-1)/m·S (+2S if folded)     (m-1)/m·S (+S)
rec. doubl.   log2 m (+2 if folded)       log2 m·S (+2S if folded)       log2 m·S (+S)
small         one MPI_Allgather call      (n-1)·S                        (n-1)·S
============  ==========================  =============================  ===================

m is the members (``plan.halving_factors``: n, or the largest power of two below it with
the extra ranks folded in), f its factors. Messages travel in sub-chunk pieces; the ring's
and Rabenseifner's reductions overlap their transfers piece by piece (the ring's counted as
two pieces at least: it posts a step's receives a step ahead, while it reduces). The halving
algorithms' steps exchange with partners (v XOR 2^i), priced apart from the ring's steps
with both neighbours (``Host.pair_step_s``). The gathered path's own steps run inside MPI
(ceil(log2 n) latencies, no Python). With k ranks per node, the steps between nodes share
the node's link: Rabenseifner's phases whose partners lie on other nodes carry k ranks'
bytes at once, as does every step of recursive doubling and the gather; the ring's
neighbours cross one link per node pair, one rank's bytes each.

Within a node the link is the node's memory (``Link.memory_Bps``): while the messages a
step has in flight across the node (ranks per node x message) fit in the caches
(``Link.cache_bytes``), a message moves at the link's bandwidth; beyond them, each byte also
pays its share of the node's memory bandwidth, which its ranks split. So on one node of 16
ranks a 16 MiB Rabenseifner's first phase (16 x 8 MiB in flight) runs from memory, where the
ring's 1 MiB steps stay in cache: measured, the ring takes 14 ms and Rabenseifner's 33.

``contention`` multiplies the CPU terms where ranks outnumber cores (an oversubscribed run).

The allreduce through a node's shared memory (``shared.py``) is not priced here: where every
rank is on one node it takes the message algorithms' sizes below ``SHARED_LARGEST_BYTES``
(``with_shared``), a range placed by measurement, and every size where ranks crowd the cores
of a node with a large cache and its segments grow (``shared_segment_bytes``).
"""

import dataclasses
import math

from .plan import halving_factors, ring_pieces

KINDS = ("small", "ring", "recursive_doubling", "rabenseifner")


@dataclasses.dataclass(frozen=True)
class Link:
    """The network between two ranks: one message's latency, each rank's bandwidth."""

    name: str
    latency_s: float
    bandwidth_Bps: float  # bytes per second, each direction
    copies: bool = False  # its transfers are copies made by the ranks' CPUs (shared memory)
    cache_bytes: float = None  # a node's messages in flight beyond which they leave its caches
    memory_Bps: float = None   # the node's memory bandwidth then, shared by its ranks

    def memory_s(self, messages, node_ranks):
        """The memory's extra seconds for ``messages``, ``(message bytes, bytes)`` pairs, with
        ``node_ranks`` ranks of a node exchanging at once: each byte's share of the memory
        bandwidth, weighted by how far the node's bytes in flight overflow the caches (a
        smooth step around ``cache_bytes``)."""
        if not self.memory_Bps or not self.cache_bytes:
            return 0.0
        seconds = 0.0
        for message, nbytes in messages:
            flight = (node_ranks * message / self.cache_bytes) ** 2
            seconds += nbytes * flight / (1.0 + flight) * node_ranks / self.memory_Bps
        return seconds


@dataclasses.dataclass(frozen=True)
class Host:
    """hororing's CPU costs on one core of a host."""

    step_s: float      # one exchange of an algorithm written in Python: post, wait, loop
                       # (with both ring neighbours)
    piece_s: float     # each further message within a step (the ring's sub-chunks)
    call_s: float      # one allreduce called: its setup in Python, or MPI's collective call
    reduce_Bps: float  # a numpy reduction, bytes of result per second
    copy_Bps: float    # a numpy copy
    pair_step_s: float = None  # one exchange with a partner (rank XOR 2^i); None: step_s
    ring_step_s: float = None  # one ring step where the ring's steps run compiled
                               # (algorithms/compiled/); None: step_s


@dataclasses.dataclass(frozen=True)
class Shape:
    """An algorithm's work for one allreduce, on its busiest rank."""

    steps: float = 0.0        # exchanges run from Python
    messages: float = 0.0     # further messages within those steps
    calls: float = 0.0        # calls: an algorithm's setup, or an MPI collective's
    mpi_steps: float = 0.0    # latencies paid inside MPI's own collectives
    near_bytes: float = 0.0   # bytes over links within a node
    far_bytes: float = 0.0    # bytes over the node's link (already multiplied by sharing)
    far_steps: float = 0.0    # exchanges (of steps and mpi_steps) that cross nodes
    reduced: float = 0.0      # bytes of reductions
    copied: float = 0.0       # bytes of copies
    pieces: float = 1.0       # messages a step's data is cut into: the ring reduces one piece
                              # while the next ones arrive
    pairs: bool = False       # the steps exchange with partners, not ring neighbours
    ring: bool = False        # the steps are the ring's (compiled where the host says so)
    near_messages: tuple = ()  # (message bytes, bytes) of the transfers within a node
    node_ranks: int = 1       # the ranks of a node exchanging at once

    def time(self, host, far, near=None, contention=1.0):
        """Seconds on ``host`` with ``far`` the link between nodes, ``near`` within one
        (default ``far``: one rank per node)."""
        near = near or far
        step_s = host.step_s
        if self.pairs and host.pair_step_s is not None:
            step_s = host.pair_step_s
        elif self.ring and host.ring_step_s is not None:
            step_s = host.ring_step_s
        cpu = (self.steps * step_s + self.messages * host.piece_s
               + self.calls * host.call_s + self.copied / host.copy_Bps)
        near_s = (self.near_bytes / near.bandwidth_Bps
                  + near.memory_s(self.near_messages, self.node_ranks))
        wire = (self.far_bytes / far.bandwidth_Bps * (contention if far.copies else 1.0)
                + near_s * (contention if near.copies else 1.0))
        reduce = contention * self.reduced / host.reduce_Bps
        if self.pieces > 1:
            data = max(wire, reduce) + min(wire, reduce) / self.pieces
        else:
            data = wire + reduce
        all_steps = self.steps + self.mpi_steps
        return (contention * cpu + data + self.far_steps * far.latency_s
                + (all_steps - self.far_steps) * near.latency_s)


def shape(kind, ranks, nbytes, per_node=1, subchunk_bytes=1 << 20, piece_ceiling=0):
    """The Shape of allreduce ``kind`` of ``nbytes`` over ``ranks`` ranks, ``per_node`` to a
    node (consecutive ranks share a node); the ring's pieces as ``plan.ring_pieces`` cuts
    them."""
    n, size, k = ranks, float(nbytes), max(1, min(per_node, ranks))
    if n <= 1:
        return Shape()
    nodes = math.ceil(n / k)
    if kind == "ring":
        steps = 2 * (n - 1)
        pieces = ring_pieces(size / n, subchunk_bytes, piece_ceiling)
        wire = 2 * (n - 1) / n * size
        far = wire if nodes > 1 else 0.0
        return Shape(steps=steps, calls=1, messages=steps * (pieces - 1), near_bytes=wire - far,
                     far_bytes=far, far_steps=steps if nodes > 1 else 0,
                     reduced=(n - 1) / n * size, pieces=max(2, pieces), ring=True,
                     near_messages=((size / n, wire - far),), node_ranks=k)
    if kind == "small":
        rounds = math.ceil(math.log2(n))
        far_rounds = math.ceil(math.log2(nodes)) if nodes > 1 else 0
        # the rows from other nodes reach each node through its link, k ranks' worth
        far = (n - k) * size * k if nodes > 1 else 0.0
        return Shape(calls=1, mpi_steps=rounds, far_steps=far_rounds,
                     near_bytes=(k - 1) * size, far_bytes=far, reduced=(n - 1) * size,
                     near_messages=((size, (k - 1) * size),), node_ranks=k)
    members, factors = halving_factors(n) if kind == "rabenseifner" else \
        (1 << (n.bit_length() - 1), None)
    folded = members < n
    if kind == "recursive_doubling":
        rounds = members.bit_length() - 1
        # partners 1, 2, 4, ... apart: those at least k apart are on other nodes
        far_rounds = sum(1 for bit in range(rounds) if (1 << bit) >= k)
        fold_bytes = 2 * size if folded else 0.0
        near = (rounds - far_rounds) * size + fold_bytes
        return Shape(steps=rounds + 2 * folded, calls=1, near_bytes=near,
                     far_bytes=far_rounds * size * k, far_steps=far_rounds,
                     reduced=(rounds + folded) * size,
                     copied=(rounds / 2 + folded) * size, pairs=True,
                     near_messages=((size, near),), node_ranks=k)
    if kind == "rabenseifner":
        steps = near_bytes = far_bytes = far_steps = messages = 0.0
        length, stride = size, 1
        first_pieces = None
        near_messages = []
        for factor in factors:
            phase_steps = 2 * (factor - 1)
            phase_bytes = 2 * (factor - 1) / factor * length
            # a reduce-scatter message is cut into sub-chunk pieces, reduced as they arrive
            pieces = max(1, math.ceil(length / factor / subchunk_bytes))
            first_pieces = first_pieces or pieces
            messages += (factor - 1) * (pieces - 1)
            if stride >= k:  # the group's members lie on different nodes, k ranks per link
                far_bytes += phase_bytes * k
                far_steps += phase_steps
            else:
                near_bytes += phase_bytes
                near_messages.append((length / factor, phase_bytes))
            steps += phase_steps
            length /= factor
            stride *= factor
        if folded:
            steps += 2
            near_bytes += 2 * size
            near_messages.append((size, 2 * size))
        return Shape(steps=steps, calls=1, messages=messages, near_bytes=near_bytes,
                     far_bytes=far_bytes, far_steps=far_steps,
                     reduced=(members - 1) / members * size + folded * size,
                     copied=folded * size, pieces=first_pieces or 1,
                     pairs=all(factor == 2 for factor in factors),
                     near_messages=tuple(near_messages), node_ranks=k)
    raise ValueError(f"unknown allreduce {kind!r}; one of {', '.join(KINDS)}")


def predict(kind, ranks, nbytes, host, far, near=None, per_node=1, contention=1.0,
            subchunk_bytes=1 << 20, piece_ceiling=0):
    """Seconds of allreduce ``kind``; see ``Shape.time`` and ``shape``."""
    return shape(kind, ranks, nbytes, per_node, subchunk_bytes,
                 piece_ceiling).time(host, far, near, contention)


def in_place_member_bytes(ranks, host, far):
    """The size from which a bucket member is cheaper reduced where it lies than packed.

    Packed, its bytes are copied into the fusion buffer and back out: 2 S / copy bandwidth.
    Where it lies, the ring cuts its pieces at the member's two ends: each cut adds a piece
    to the chunk it falls in, and that chunk is sent 2(n-1) times along the ring (n-1 hops
    of the scatter-reduce, n-1 of the allgather), one extra message (the link's latency and
    the host's cost of a piece) each time; two cuts: 4 (n-1) messages. Equal at
    S = 2 (n-1) (latency + piece) copy bandwidth.
    """
    if ranks < 2:
        return 0
    return int(2 * (ranks - 1) * (far.latency_s + host.piece_s) * host.copy_Bps)


def bandwidth_bound(ranks, nbytes, far, host=None, per_node=1):
    """What a bandwidth-optimal allreduce pays: 2(N-1)/N of the buffer through each node's
    link (N nodes of ``per_node`` ranks) and, with ``host``, (n-1)/n of it reduced on each
    rank (the classic lower bound's beta and gamma terms: every element is combined n-1
    times, spread over n ranks)."""
    nodes = math.ceil(ranks / max(1, per_node))
    if ranks <= 1:
        return 0.0
    reduce = (ranks - 1) / ranks * nbytes / host.reduce_Bps if host is not None else 0.0
    return 2 * (nodes - 1) / nodes * nbytes / far.bandwidth_Bps + reduce


def latency_bound(ranks, far):
    """No allreduce finishes in fewer than ceil(log2 n) latencies."""
    return math.ceil(math.log2(ranks)) * far.latency_s if ranks > 1 else 0.0


MARGIN = 0.1  # a kind later in KINDS must be this much faster to be chosen


def choose(ranks, nbytes, host, far, near=None, per_node=1, kinds=KINDS, small_bytes=None,
           subchunk_bytes=1 << 20, margin=MARGIN, piece_ceiling=0, contention=1.0):
    """The fastest of ``kinds`` by the model (the gathered path only below ``small_bytes``,
    where given). A kind later in ``kinds`` is chosen over an earlier one only where it is
    faster by ``margin``: the model is not that exact, and at 2 ranks, where Rabenseifner's
    is the ring's schedule, the ring also overlaps its allgather with the reduction."""
    best = None
    for kind in kinds:
        if kind == "small" and small_bytes is not None and nbytes >= small_bytes:
            continue
        seconds = predict(kind, ranks, nbytes, host, far, near, per_node,
                          contention=contention, subchunk_bytes=subchunk_bytes,
                          piece_ceiling=piece_ceiling)
        if best is None or seconds < best[0] * (1 - margin):
            best = (seconds, kind)
    return best[1]


def choices(ranks, host, far, near=None, per_node=1, kinds=KINDS, small_bytes=None,
            subchunk_bytes=1 << 20, largest=1 << 31, margin=MARGIN, piece_ceiling=0,
            contention=1.0):
    """The choice by size as ranges: ``((below_bytes, kind), ...)``, the last one below
    None (any size). Sizes are tried at powers of two and at ``small_bytes``; a range runs
    up to the next size where the choice changes. ``contention``: ranks per core on the
    busiest node, where above 1 (``Shape.time``)."""
    sizes = sorted({1 << shift for shift in range(0, largest.bit_length())}
                   | ({small_bytes - 1, small_bytes} if small_bytes else set()))
    table = []
    for nbytes in sizes:
        kind = choose(ranks, nbytes, host, far, near, per_node, kinds, small_bytes,
                      subchunk_bytes, margin, piece_ceiling, contention)
        if not table or table[-1][1] != kind:
            if table:
                table[-1] = (nbytes, table[-1][1])
            table.append((None, kind))
    return tuple(table)


# Where every rank is on one node, the allreduce through the node's shared memory
# (shared.py) takes the buffers below this size that a message algorithm would take. It is
# placed by measurement, not priced: on a 2-core EPYC VM (docs/benchmarks.md, "The allreduce
# through the node's shared memory") it beat the ring, Rabenseifner's and recursive doubling
# from 64 KiB to 1 MiB at 3, 4 and 8 ranks (0.61-0.86 of the ring's time) and was level with
# the ring at 2 ranks and 1 MiB. Through the library's whole path, against the compiled ring
# (docs/benchmarks.md, "The shared allreduce up to 4 MiB"), it ran 2, 3 and 3.9 MiB in
# 0.49-0.92 of the ring's time at 2, 3, 4, 8 and 16 ranks (level once, 1.05 at 4 ranks and
# 3.9 MiB); from 4 MiB the two changed places from one half hour to the next (4 MiB
# 0.54-1.05, 16 MiB 0.76-1.41 at 2-8 ranks), the ring's messages copied once where the
# shared rows are copied in and out, so the ring keeps them.
SHARED_LARGEST_BYTES = 4 << 20
_MESSAGES = ("ring", "rabenseifner", "recursive_doubling")
# Its segments (a row of its window each, two barriers each) are SHARED_SEGMENT_BYTES. Where
# ranks crowd their cores (SHARED_CROWDED or more to a core), a barrier waits for every rank
# to be scheduled in turn, about 1 ms at 8 ranks on 2 cores: there, on a node whose last-level
# cache holds SHARED_CROWDED_CACHE_BYTES, the segments are SHARED_CROWDED_SEGMENT_BYTES where
# the node's shared memory holds the window, and it takes every size a message algorithm
# would. Measured (docs/benchmarks.md, "Fewer barriers where ranks crowd the cores"): on a
# 2-core Xeon VM with a 105 MiB L3 it ran 16 MiB at 8 ranks in 0.89-0.94 of the ring's time
# and at 16 ranks in 0.80, where with 1 MiB segments it was slower than the ring from 16 MiB.
# On a 2-core EPYC VM with a 32 MiB L3 the same segments lost to the ring (1.3 times its time
# at 16 MiB, 8 ranks) while a barrier was MPI's; with the window's flags and a rank's own
# chunk read where it lies they won there too (docs/benchmarks.md, "Large segments on a
# 32 MiB cache"): forced through the library beside the forced ring, 4 MiB at 8 and 16 ranks
# in 0.42-0.86 of its time, 16 MiB in 0.62-0.87, 64 MiB at 8 ranks in 0.94-1.06. No node with
# a smaller cache was measured. At 2 and 4 ranks 1 MiB segments ran faster than 4 or 16 MiB
# ones (a segment's rows stay in the caches).
SHARED_SEGMENT_BYTES = 1 << 20
SHARED_CROWDED = 4
SHARED_CROWDED_SEGMENT_BYTES = 16 << 20
SHARED_CROWDED_CACHE_BYTES = 32 << 20


def shared_segment_bytes(ranks, contention, window_budget, cache_bytes):
    """The shared allreduce's segment for ``ranks`` ranks on one node at ``contention`` ranks
    per core whose last-level cache is ``cache_bytes`` (None: unknown), its windows ((ranks
    + 1) segments, and 2 for the segments that go around the node) taking at most
    ``window_budget`` bytes beyond what 1 MiB segments take.
    Every rank must use the same: the executor agrees on the smallest."""
    if contention >= SHARED_CROWDED and cache_bytes is not None and \
            cache_bytes >= SHARED_CROWDED_CACHE_BYTES and \
            (ranks + 3) * SHARED_CROWDED_SEGMENT_BYTES <= window_budget:
        return SHARED_CROWDED_SEGMENT_BYTES
    return SHARED_SEGMENT_BYTES


# A segment of the shared allreduce whose rows (one a rank) outgrow the node's last-level
# cache goes around the node instead (``shared.SharedMemory._segment_around``: each rank
# combines its input into one row where it lies, chunk after chunk in turn, nothing copied
# in). Measured (docs/benchmarks.md, "Around the node where the rows outgrow the cache"): on a
# 2-core EPYC VM (32 MiB L3), the algorithm alone against the rows, 16 MiB at 8 ranks in
# 0.73 of their time and at 16 ranks in 0.76; 4 MiB at 16 ranks 0.99; but 1 MiB at 16 ranks in
# 1.18 of their time, where the rows fit the cache.
def shared_around_above(ranks, cache_bytes, folded_bytes, small_bytes):
    """The bytes above which a shared allreduce's segment goes around the node: those whose
    ``ranks`` rows would outgrow a last-level cache of ``cache_bytes`` (None or 0: unknown,
    then none goes around), and never a size the negotiation's fold takes (``folded_bytes``,
    its most) or the gathered path (below ``small_bytes``): both combine in rank order, as
    the rows do, and a call's first and later runs must give the same bits."""
    if not cache_bytes:
        return None
    return max(cache_bytes // ranks, folded_bytes, small_bytes)


def shared_largest(segment_bytes):
    """The size from which a message algorithm takes over from the shared allreduce with
    segments of ``segment_bytes`` (None: it takes every size)."""
    return None if segment_bytes >= SHARED_CROWDED_SEGMENT_BYTES else SHARED_LARGEST_BYTES


def with_shared(table, largest=SHARED_LARGEST_BYTES):
    """``table`` (``choices``) with ``shared`` wherever it gives one of the message
    algorithms to a buffer below ``largest`` bytes (None: of any size)."""
    if largest is None:
        largest = float("inf")
    ranges, start = [], 0
    for below, kind in table:
        stop = float("inf") if below is None else below
        if kind in _MESSAGES and start < largest:
            ranges.append((min(stop, largest), "shared"))
            if stop > largest:
                ranges.append((stop, kind))
        else:
            ranges.append((stop, kind))
        start = stop
    merged = []
    for stop, kind in ranges:
        if merged and merged[-1][1] == kind:
            merged[-1] = (stop, kind)
        else:
            merged.append((stop, kind))
    return tuple((None if stop == float("inf") else stop, kind) for stop, kind in merged)


def lookup(table, nbytes):
    """The kind ``choices`` gives for a buffer of ``nbytes``."""
    for below, kind in table:
        if below is None or nbytes < below:
            return kind
    raise ValueError("an empty choice table")


# Links: latency and each rank's bandwidth. "shm" is this host's memory between processes
# (MPICH's shared-memory transport), calibrated with HOST (docs/scale.md); the networks
# are presets for the simulator and the choice between nodes.
PRESETS = {
    "shm": Link("one host's shared memory", 5.35e-6, 3.64e9, copies=True, cache_bytes=39.9e6,
                memory_Bps=30.6e9),
    "1gbe": Link("1 Gbit/s Ethernet", 50e-6, 125e6),
    "10gbe": Link("10 Gbit/s Ethernet", 25e-6, 1.25e9),
    "100gbe": Link("100 Gbit/s Ethernet", 10e-6, 12.5e9),
    "ib200": Link("200 Gbit/s InfiniBand", 2e-6, 25e9),
}

# hororing's CPU costs on one core of a host with a core per rank (a 16-core Xeon; fitted to
# scripts/bench_scale.py's runs there at 2-16 ranks, two runs each, and across 2 emulated
# 1 Gbit/s hosts: docs/scale.md, docs/results/scale_fit.json)
HOST = Host(step_s=14.3e-6, piece_s=0.0, call_s=6.06e-6, reduce_Bps=7.12e9, copy_Bps=10.2e9,
            pair_step_s=12.2e-6)

# The same host with the ring's steps compiled (algorithms/compiled/): a step posts, tests and
# reduces in machine code. Set from this repository's 2-core VM (docs/compiled.md): at 2 ranks
# a 4 KiB ring took 20.6 us with Python's steps and 13.3 compiled, ~3.7 us less per step; the
# fitted step_s (14.3 us) holds more than the interpreter's share, so the compiled step is
# priced at what remains of it beside the link's latency, 2 us.
COMPILED_RING = dataclasses.replace(HOST, ring_step_s=2.0e-6)
