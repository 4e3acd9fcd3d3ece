"""Run-time settings: with environment.py (what the launcher said, the process switches), the
one place that reads environment variables.

Each setting accepts Horovod's name (``HOROVOD_*``) and hororing's (``HORORING_*``); the
hororing name wins when both are set. Defaults that are performance choices name the
benchmark that set them.
"""

import dataclasses
import os

MiB = 1024 * 1024
MODES = ("ring", "ps")
PLACEMENTS = ("round_robin", "greedy_bytes", "partitioned")  # see ps/placement.py
DEVICE_RINGS = ("auto", "direct", "staged")  # see engine/device.py
COMPILED_STEPS = ("auto", "wait", "off")  # see algorithms/compiled/
RING_SUBCHUNK_IN_NODE = MiB
RING_SUBCHUNK_ACROSS_NODES = 256 * 1024
RING_PIECE_CEILING_ACROSS_NODES = MiB
# The automatic latency-path total for a job that spans nodes, unless the total is set: there
# the gathered rows cross the links between hosts. Measured across 2 emulated hosts x 2 ranks
# (scripts/bench_allreduce.py --hierarchical, docs/hosts.md): a 64 KiB allreduce took 2197 us
# on the latency path against 551 us hierarchical at 1 Gbit/s, and the same at 10 Gbit/s
# (323 against 314 us); 4 KiB stays faster on the latency path at both rates.
SMALL_TOTAL_ACROSS_NODES = 256 * 1024
# The waits' spin where a node runs more ranks than it has cores and none is set
# (Config.spin_tests): at 4 and 8 ranks on 2 cores a 64 KiB allreduce took 0.57-0.61 and
# 0.51-0.61 of MPI_Allreduce's speed with the 50 tests' spin, 0.83-0.96 and 0.62-1.03 with
# one (scripts/bench_call_cost.py, docs/tuning.md); with a core per rank the spin stays.
OVERSUBSCRIBED_SPIN_TESTS = 1


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings for one hororing context (see README, "Environment variables")."""

    # Bytes of same-dtype allreduce tensors fused into one collective (Horovod's default).
    fusion_threshold: int = 64 * MiB
    # Bytes a gradient bucket that starts whole holds at most (handed to a comm hook, or one
    # flat allreduce; and at most the fusion threshold; 0: the fusion threshold alone), as
    # DDP's bucket_cap_mb: a bucket's wire starts once its last gradient is in, so smaller
    # buckets start sooner. Measured across 2 emulated 1 Gbit/s hosts
    # (scripts/bench_compression.py, docs/compression.md): the fp16 hook's step 0.62-0.63x of
    # uncompressed at 64 MiB, 0.61 at 25, 0.57-0.58 at 16 and 8.
    hook_bucket_bytes: int = 16 * MiB
    # Bucket members of at least this many bytes are reduced where they lie, not packed into
    # the fusion buffer (engine/segments.py); -1: the cost model's size for the job (where
    # two copies of a member cost what the ring's extra pieces at its ends do:
    # cost.in_place_member_bytes); 0: every member is packed.
    in_place_member_bytes: int = -1
    # Milliseconds the background thread waits after the first asynchronous submission
    # before it negotiates, so that tensors submitted together fuse (Horovod's default).
    cycle_time_ms: float = 1.0
    # Negotiated tensors remembered so a repeat costs one bit, not a metadata exchange.
    cache_capacity: int = 1024
    # Where every rank is on one node, a folded allreduce's rows of 8 KiB and more (of every
    # width where the fold's cycle runs compiled on the window's flags) go through a
    # shared-memory window of the node rather than an allgather (engine/exchange.py): 64 KiB
    # at 2 ranks in 15.7 µs against 21.9 (docs/benchmarks.md). Off: always gathered.
    shared_fold: bool = True
    # Where every rank is on one node, allreduces the cost model gives a message algorithm,
    # below 4 MiB (cost.SHARED_LARGEST_BYTES), read each other's values in a shared-memory
    # window of the node (algorithms/shared.py). Off: the ring and the halving algorithms,
    # as across nodes.
    shared_allreduce: bool = True
    stall_check_seconds: float = 60.0
    stall_shutdown_seconds: float = 0.0  # 0: never end the job on a stall
    stall_check_enabled: bool = True
    # Every rank blocked this long in collectives none of which every rank submitted (ranks
    # waiting on different names) ends in an error naming what each rank waits on, on every
    # rank (engine/deadlocks.py); 0: wait for ever, as Horovod does (the stall warning still
    # speaks). A few seconds: a slow rank is not blocked, so the grace only has to outlast a
    # thread about to submit the match.
    deadlock_grace_seconds: float = 5.0
    timeline_path: str = ""
    timeline_mark_cycles: bool = False
    # Allreduces below this many bytes take the latency path (one MPI_Allgather, then a local
    # reduction in rank order); from it up, the pipelined ring. None (the default): automatic,
    # small_allreduce_total_bytes // ranks, so the rows every rank gathers stay under that
    # total. The latency path gathers ranks x bytes where the ring moves ~2 x bytes, so its
    # crossover shrinks as the job grows: measured at 2, 3 and 4 ranks where
    # ranks x bytes is 1-2 MiB (scripts/bench_tuning.py --setting small, docs/tuning.md).
    # A job across nodes takes at most SMALL_TOTAL_ACROSS_NODES unless the total is set.
    small_allreduce_bytes: object = None
    small_allreduce_total_bytes: int = MiB
    # Hierarchical allreduce (reduce inside each node, across nodes by slices, gather):
    # True = every ring-sized bucket (HOROVOD_HIERARCHICAL_ALLREDUCE=1); False = never (=0);
    # None = automatic: when the job spans several nodes and some node runs several ranks,
    # buckets from hierarchical_threshold_bytes up (None: every bucket the ring would take).
    # Measured across emulated hosts (network namespaces, 1 and 10 Gbit/s links, 2 and 4
    # hosts x 2 ranks; scripts/bench_allreduce.py --hierarchical, docs/hosts.md): the
    # hierarchical allreduce was faster than the flat ring at every size from 128 KiB, up to
    # 1.95x; each host's link carries the bytes of one rank instead of its ranks' share of
    # the ring's passes.
    hierarchical_allreduce: object = None
    hierarchical_threshold_bytes: object = None
    # Ring sub-chunk: the unit that is in flight while the previous one is reduced. None:
    # automatic, RING_SUBCHUNK_IN_NODE for a ring within one node, RING_SUBCHUNK_ACROSS_NODES
    # for one that crosses nodes (subchunk_bytes()). Measured in one node:
    # scripts/bench_tuning.py --setting subchunk, docs/tuning.md (256 KiB 15-54% slower);
    # across emulated hosts at 1 Gbit/s, 4 hosts: a 4 MiB ring took 1.35-1.50x its model
    # with 1 MiB sub-chunks (each 1 MiB chunk went as one message, unpipelined) and 1.00x with
    # 256 KiB, 1 and 16 MiB unchanged; pieces across nodes then grow (piece_ceiling(): a
    # third less CPU in a training step's allreduces, docs/hosts.md). Set: every piece's size.
    ring_subchunk_bytes: object = None
    # How every wait on MPI requests polls (transport.wait): this many tests back to back,
    # then tests with a sched_yield between them up to wait_yield_tests, then sleeps that
    # double up to wait_max_sleep_us. Spinning is fastest when each rank has a core; yielding
    # and sleeping let an oversubscribed job move. Measured: scripts/bench_tuning.py
    # --setting waits, docs/tuning.md.
    wait_spin_tests: int = 50
    wait_yield_tests: int = 2000
    wait_max_sleep_us: float = 1000.0
    # How often the engine looks for its peers' wake-ups: while collectives flow (the
    # background thread, and a blocking caller whose peers are late), and after a second
    # without any. Measured: scripts/bench_tuning.py --setting poll, docs/tuning.md.
    poll_active_us: float = 500.0
    poll_idle_us: float = 5000.0
    log_level: str = "warning"
    # The ring's steps compiled with numba (algorithms/compiled/): "auto" loads them in the
    # background once a kind of buffer has had compiled_steps_after calls and runs them once
    # ready, "wait" waits for them at the first ring, "off" keeps the Python steps.
    # Measured: scripts/bench_call_cost.py, docs/benchmarks.md. Loading takes about 1.5 s of
    # a rank's CPU and pays back after about 750 calls of 1 MiB at 8 ranks (more for smaller
    # buffers): a short job never loads them (docs/compiled.md).
    compiled_steps: str = "auto"
    compiled_steps_after: int = 1000
    # "ring", or "ps": allreduce through parameter servers (the baseline the ring is
    # compared with; README, "Parameter-server mode").
    mode: str = "ring"
    ps_servers: int = 1  # the last k ranks serve; 0 = colocated (every rank holds a shard)
    ps_placement: str = "round_robin"
    ps_partition_bytes: int = 1024 * 1024  # "partitioned" splits tensors from this size up
    ps_replicas: int = 0  # pushes aggregated per step (replicas_to_aggregate); 0 = all workers
    # Device buffers straight to MPI (True) or staged through pinned host memory (False);
    # None: ask the MPI library (hororing/gpu/aware.py).
    cuda_aware: object = None
    # How device buckets travel (engine/device.py): "auto" takes the device-direct ring (CUDA
    # IPC between the ranks of one node) where every rank shares a node and cupy is there,
    # else the CUDA-aware MPI where the library is one, else the staged ring; "direct" or
    # "staged" forces one. Measured on a lent GPU (scripts/bench_gpu.py, docs/gpu.md).
    device_ring: str = "auto"
    # With the device-direct ring, buckets below this many bytes take the staged paths (the
    # host's latency path or ring through pinned memory). Measured with two ranks sharing
    # one H200 (scripts/bench_gpu.py, docs/gpu.md): the direct ring costs ~0.7 ms at any
    # size up to 8 MiB, each step waiting for the other process's work on the GPU, where the
    # staged paths took 0.14 ms at 64 KiB and 0.42 ms at 1 MiB; direct won from 8 MiB.
    device_direct_min_bytes: int = 2 * MiB
    # The staged ring (no CUDA-aware MPI) copies the device buffer down in blocks of this
    # many bytes (the ring waits only for the blocks a piece spans) and finished pieces back
    # in copies of at least this many. Through numba each copy cost ~120 us of Python and
    # driver time, so one per 1 MiB ring piece cost more than the bytes (measured on an H100
    # with scripts/bench_gpu.py's device allreduce, docs/gpu.md: 64 MiB took 43.9 ms with one
    # copy per piece, 25.9 ms with 8 MiB copies); through cupy a copy is one driver call.
    staged_copy_bytes: int = 8 * MiB
    # Out-of-place host allreduces of at least 1 MiB return arrays from a pool of at most
    # this many bytes, reused once the caller has let go of them (0: a fresh array each
    # time). A fresh large array is fresh pages: writing the result faults and zeroes each
    # one, which at 32-64 MiB cost as much as the ring itself (2 ranks, scripts/
    # bench_allreduce.py --algorithms outplace ring, docs/benchmarks.md).
    output_pool_bytes: int = 256 * MiB
    # init() makes GPU local_rank % device_count current (False: leave the current GPU alone).
    select_device: bool = True
    # add_process_set()/remove_process_set() after init (Horovod's opt-in switch).
    dynamic_process_sets: bool = False
    # Seconds every rank has to reach init() (hororun --start-timeout); 0: wait for ever.
    start_timeout_s: float = 0.0
    # Online tuning of the fusion threshold, cycle time, small-message total, ring sub-chunk
    # and hierarchical switch (tuning/autotune.py; Horovod's names and defaults).
    autotune: bool = False
    autotune_log: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8
    # a setting given explicitly is fixed under autotuning (Horovod's rule); True: it is
    # where tuning starts
    autotune_from_set: bool = False
    # the fields set explicitly (environment or init() arguments), filled by from_environ
    explicit: frozenset = frozenset()

    def small_threshold(self, ranks, across_nodes=False):
        """Bytes below which an allreduce over ``ranks`` ranks takes the latency path
        (``across_nodes``: the ranks span several nodes)."""
        if self.small_allreduce_bytes is not None:
            return self.small_allreduce_bytes
        total = self.small_allreduce_total_bytes
        if across_nodes and "small_allreduce_total_bytes" not in self.explicit:
            total = min(total, SMALL_TOTAL_ACROSS_NODES)
        return total // max(ranks, 1)

    def spin_tests(self, ranks_on_node, cores):
        """The waits' spin phase (``wait_spin_tests``) for a rank whose node runs
        ``ranks_on_node`` ranks on ``cores`` cores: where the ranks outnumber the cores and
        the spin is not set, one test, then the yields (a spinning rank holds a core that
        a peer it waits for needs). Measured: docs/tuning.md, "Oversubscribed waits"."""
        if ranks_on_node > cores and "wait_spin_tests" not in self.explicit:
            return OVERSUBSCRIBED_SPIN_TESTS
        return self.wait_spin_tests

    def subchunk_bytes(self, across_nodes):
        """The ring's sub-chunk for a ring within one node or one that crosses nodes."""
        if self.ring_subchunk_bytes is not None:
            return self.ring_subchunk_bytes
        return RING_SUBCHUNK_ACROSS_NODES if across_nodes else RING_SUBCHUNK_IN_NODE

    def piece_ceiling(self, across_nodes):
        """How large a ring's pieces may grow (plan.ring_pieces; 0: pieces of subchunk_bytes):
        across nodes, unless the sub-chunk is set."""
        set_or_within = self.ring_subchunk_bytes is not None or not across_nodes
        return 0 if set_or_within else RING_PIECE_CEILING_ACROSS_NODES

    @classmethod
    def from_environ(cls, environ=None, **overrides):
        """Build a Config from ``environ`` (default ``os.environ``) and explicit overrides."""
        env = os.environ if environ is None else environ
        values = {}
        for field, (names, parse) in _ENV_FIELDS.items():
            raw = _lookup(env, names)
            if raw is not None:
                values[field] = _parse(field, names, raw, parse)
        values.update({key: value for key, value in overrides.items() if value is not None})
        config = cls(explicit=frozenset(values), **values)
        config.validate()
        return config

    def validate(self):
        """Raise ValueError naming a setting that is out of range."""
        if self.fusion_threshold < 0:
            raise ValueError(f"fusion threshold must be >= 0 bytes, got {self.fusion_threshold}")
        if self.cycle_time_ms < 0:
            raise ValueError(f"cycle time must be >= 0 ms, got {self.cycle_time_ms}")
        if self.deadlock_grace_seconds < 0:
            raise ValueError(f"deadlock grace must be >= 0 s (HORORING_DEADLOCK_GRACE_SECONDS; "
                             f"0: wait for ever), got {self.deadlock_grace_seconds}")
        if self.cache_capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {self.cache_capacity}")
        if self.ring_subchunk_bytes is not None and self.ring_subchunk_bytes <= 0:
            raise ValueError(f"ring sub-chunk must be > 0 bytes, got {self.ring_subchunk_bytes}")
        if self.hierarchical_threshold_bytes is not None and self.hierarchical_threshold_bytes < 0:
            raise ValueError(f"hierarchical threshold must be >= 0 bytes, got "
                             f"{self.hierarchical_threshold_bytes}")
        if self.small_allreduce_bytes is not None and self.small_allreduce_bytes < 0:
            raise ValueError(f"small allreduce threshold must be >= 0 bytes "
                             f"(HORORING_SMALL_ALLREDUCE_BYTES), got {self.small_allreduce_bytes}")
        if self.small_allreduce_total_bytes < 0:
            raise ValueError(f"small allreduce total must be >= 0 bytes "
                             f"(HORORING_SMALL_ALLREDUCE_TOTAL_BYTES), got "
                             f"{self.small_allreduce_total_bytes}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (HORORING_MODE), got {self.mode!r}")
        if self.ps_servers < 0:
            raise ValueError(f"the number of PS servers must be >= 0 (0: colocated), got "
                             f"{self.ps_servers} (HORORING_PS_SERVERS)")
        if self.ps_placement not in PLACEMENTS:
            raise ValueError(f"PS placement must be one of {PLACEMENTS} (HORORING_PS_PLACEMENT), "
                             f"got {self.ps_placement!r}")
        if self.ps_partition_bytes <= 0:
            raise ValueError(f"PS partition size must be > 0 bytes, got {self.ps_partition_bytes}")
        if self.start_timeout_s < 0:
            raise ValueError(f"start timeout must be >= 0 s (HOROVOD_START_TIMEOUT), got "
                             f"{self.start_timeout_s}")
        for name in ("wait_spin_tests", "wait_yield_tests", "wait_max_sleep_us",
                     "poll_active_us", "poll_idle_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (HORORING_{name.upper()}), got "
                                 f"{getattr(self, name)}")
        if self.wait_yield_tests < self.wait_spin_tests:
            raise ValueError(f"wait_yield_tests ({self.wait_yield_tests}) must be >= "
                             f"wait_spin_tests ({self.wait_spin_tests}): the yield phase "
                             f"follows the spin phase (HORORING_WAIT_YIELD_TESTS)")
        if self.compiled_steps not in COMPILED_STEPS:
            raise ValueError(f"compiled steps must be one of {', '.join(COMPILED_STEPS)} "
                             f"(HORORING_COMPILED_STEPS), got {self.compiled_steps!r}")
        if self.compiled_steps_after < 1:
            raise ValueError(f"compiled steps after must be >= 1 call "
                             f"(HORORING_COMPILED_STEPS_AFTER), got {self.compiled_steps_after}")
        if self.device_ring not in DEVICE_RINGS:
            raise ValueError(f"device ring must be one of {', '.join(DEVICE_RINGS)} "
                             f"(HORORING_DEVICE_RING), got {self.device_ring!r}")
        if self.device_direct_min_bytes < 0:
            raise ValueError(f"device-direct minimum must be >= 0 bytes "
                             f"(HORORING_DEVICE_DIRECT_MIN_BYTES), got "
                             f"{self.device_direct_min_bytes}")
        if self.staged_copy_bytes <= 0:
            raise ValueError(f"staged copy size must be > 0 bytes (HORORING_STAGED_COPY_BYTES), "
                             f"got {self.staged_copy_bytes}")
        if self.hook_bucket_bytes < 0:
            raise ValueError(f"comm hook bucket size must be >= 0 bytes "
                             f"(HORORING_HOOK_BUCKET_BYTES; 0: the fusion threshold), got "
                             f"{self.hook_bucket_bytes}")
        if self.in_place_member_bytes < -1:
            raise ValueError(f"in-place member size must be >= 0 bytes, or -1 for the cost "
                             f"model's (HORORING_IN_PLACE_MEMBER_BYTES), got "
                             f"{self.in_place_member_bytes}")
        if self.output_pool_bytes < 0:
            raise ValueError(f"output pool must be >= 0 bytes (HORORING_OUTPUT_POOL_BYTES; 0: "
                             f"no pool), got {self.output_pool_bytes}")
        if self.autotune_steps_per_sample < 1 or self.autotune_warmup_samples < 0 \
                or self.autotune_bayes_opt_max_samples < 1 \
                or self.autotune_gaussian_process_noise < 0:
            raise ValueError(f"autotune settings out of range: HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE "
                             f"must be >= 1 (got {self.autotune_steps_per_sample}), _WARMUP_"
                             f"SAMPLES >= 0 (got {self.autotune_warmup_samples}), _BAYES_OPT_"
                             f"MAX_SAMPLES >= 1 (got {self.autotune_bayes_opt_max_samples}), "
                             f"_GAUSSIAN_PROCESS_NOISE >= 0 (got "
                             f"{self.autotune_gaussian_process_noise})")
        if self.ps_replicas < 0:
            raise ValueError(f"replicas_to_aggregate must be >= 1 (or 0 for all workers), got "
                             f"{self.ps_replicas}")


def _flag(text):
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1/true/false, got {text!r}")


def _servers(text):
    if text.strip().lower() == "colocated":
        return 0
    return int(text)


def _not_flag(text):
    return not _flag(text)


def _names(suffix):
    return ("HORORING_" + suffix, "HOROVOD_" + suffix)


_ENV_FIELDS = {
    "fusion_threshold": (_names("FUSION_THRESHOLD"), int),
    "hook_bucket_bytes": (("HORORING_HOOK_BUCKET_BYTES",), int),
    "in_place_member_bytes": (("HORORING_IN_PLACE_MEMBER_BYTES",), int),
    "cycle_time_ms": (_names("CYCLE_TIME"), float),
    "shared_fold": (("HORORING_SHARED_FOLD",), _flag),
    "shared_allreduce": (("HORORING_SHARED_ALLREDUCE",), _flag),
    "cache_capacity": (_names("CACHE_CAPACITY"), int),
    "stall_check_seconds": (_names("STALL_CHECK_TIME_SECONDS"), float),
    "stall_shutdown_seconds": (_names("STALL_SHUTDOWN_TIME_SECONDS"), float),
    "stall_check_enabled": (_names("STALL_CHECK_DISABLE"), _not_flag),
    "deadlock_grace_seconds": (("HORORING_DEADLOCK_GRACE_SECONDS",), float),
    "timeline_path": (_names("TIMELINE"), str),
    "timeline_mark_cycles": (_names("TIMELINE_MARK_CYCLES"), _flag),
    "small_allreduce_bytes": (("HORORING_SMALL_ALLREDUCE_BYTES",), int),
    "small_allreduce_total_bytes": (("HORORING_SMALL_ALLREDUCE_TOTAL_BYTES",), int),
    "ring_subchunk_bytes": (("HORORING_RING_SUBCHUNK_BYTES",), int),
    "hierarchical_allreduce": (_names("HIERARCHICAL_ALLREDUCE"), _flag),
    "hierarchical_threshold_bytes": (("HORORING_HIERARCHICAL_THRESHOLD_BYTES",), int),
    "log_level": (_names("LOG_LEVEL"), str),
    "compiled_steps": (("HORORING_COMPILED_STEPS",), str.lower),
    "compiled_steps_after": (("HORORING_COMPILED_STEPS_AFTER",), int),
    "mode": (("HORORING_MODE",), str.lower),
    "ps_servers": (("HORORING_PS_SERVERS",), _servers),
    "ps_placement": (("HORORING_PS_PLACEMENT",), str),
    "ps_partition_bytes": (("HORORING_PS_PARTITION_BYTES",), int),
    "ps_replicas": (("HORORING_PS_REPLICAS_TO_AGGREGATE",), int),
    "wait_spin_tests": (("HORORING_WAIT_SPIN_TESTS",), int),
    "wait_yield_tests": (("HORORING_WAIT_YIELD_TESTS",), int),
    "wait_max_sleep_us": (("HORORING_WAIT_MAX_SLEEP_US",), float),
    "poll_active_us": (("HORORING_POLL_ACTIVE_US",), float),
    "poll_idle_us": (("HORORING_POLL_IDLE_US",), float),
    "cuda_aware": (("HORORING_CUDA_AWARE",), _flag),
    "device_ring": (("HORORING_DEVICE_RING",), str.lower),
    "device_direct_min_bytes": (("HORORING_DEVICE_DIRECT_MIN_BYTES",), int),
    "staged_copy_bytes": (("HORORING_STAGED_COPY_BYTES",), int),
    "output_pool_bytes": (("HORORING_OUTPUT_POOL_BYTES",), int),
    "select_device": (("HORORING_SELECT_DEVICE",), _flag),
    "dynamic_process_sets": (_names("DYNAMIC_PROCESS_SETS"), _flag),
    "start_timeout_s": (_names("START_TIMEOUT"), float),
    "autotune": (_names("AUTOTUNE"), _flag),
    "autotune_log": (_names("AUTOTUNE_LOG"), str),
    "autotune_warmup_samples": (_names("AUTOTUNE_WARMUP_SAMPLES"), int),
    "autotune_steps_per_sample": (_names("AUTOTUNE_STEPS_PER_SAMPLE"), int),
    "autotune_bayes_opt_max_samples": (_names("AUTOTUNE_BAYES_OPT_MAX_SAMPLES"), int),
    "autotune_gaussian_process_noise": (_names("AUTOTUNE_GAUSSIAN_PROCESS_NOISE"), float),
    "autotune_from_set": (("HORORING_AUTOTUNE_FROM_SET",), _flag),
}


def _lookup(env, names):
    for name in names:
        if name in env:
            return env[name]
    return None


def _parse(field, names, raw, parse):
    try:
        return parse(raw)
    except ValueError as error:
        named = names[0] if len(names) == 1 else f"{names[0]} (or {names[-1]})"
        raise ValueError(f"environment variable {named} has an invalid value {raw!r} for "
                         f"{field}: {error}") from None


def variable_of(field):
    """The environment variable that sets Config field ``field`` (its Horovod name where it
    has one): what a launcher sets for its ranks."""
    return _ENV_FIELDS[field][0][-1]


def as_horovod(environ=None):
    """Whether HORORING_AS_HOROVOD=1 asks for ``import horovod`` to be hororing (read here,
    not in environment.py: alias.py loads this module alone, by path, at start-up).

    Raises:
        ValueError: HORORING_AS_HOROVOD is not a flag.
    """
    env = os.environ if environ is None else environ
    return _parse("as_horovod", ("HORORING_AS_HOROVOD",), env.get("HORORING_AS_HOROVOD", ""),
                  _flag)
