"""The engine: per-rank background progress, cross-rank negotiation, fused execution.

What the rest of hororing (and its tests and benchmarks) may use, and nothing else:

- ``Engine.submit(request, blocking)`` (``request.Request``), returning a ``request.Handle``;
  ``Handle.synchronize()`` waits for it, driving the engine from the caller's thread;
  ``Engine.submit_blocking(request)`` for a blocking verb (its cycle may run in the call);
  ``Engine.lanes`` (name -> ``lane.Lane``: its ``door``, ``dtype`` and ``shape``) and
  ``Engine.run_lane(lane, tensor)`` for a repeated blocking call, whose first call's
  request carries ``lane_key(inplace, average, op, prescale, postscale)`` as its ``door``;
  ``Engine.check_free(name)`` and ``Engine.in_flight`` (the names in flight, read only);
- ``Engine.stats()``, ``Engine.set_timeline(timeline)``, ``Engine.stop(...)``,
  ``Engine.close()``;
- ``Engine.allreduce``, the allreduce pipeline (``allreduce.AllreducePipeline``):
  ``force(kind)`` to make every bucket take one algorithm (``ring``, ``small``,
  ``hierarchical``, ``ps``; None to choose by size again; call it on every rank between
  collectives), ``watch()`` to record the buffers handed to the algorithms,
  ``device_transport()``, ``hierarchical_stats()`` and ``has(kind)``;
- for the optimizers' gradient buckets: ``assign(metas, limit)``, the engine's own fusion
  rule (``buckets.py``), ``Engine.route`` (lay out by its ``fusion_threshold``, again when
  its ``version`` changes), ``Engine.reduction_order(names)`` (the order the previous
  step's tensors were reduced in), ``with Engine.batch():`` (submissions that start
  together);
- for groups and the autotuner: ``Engine.on_missed_error`` (a group's hook for names it
  skips), ``Engine.tuner`` and ``Engine.apply_settings(settings)``.

The names below are the engine's face: no module outside ``engine/`` imports any other engine
name (tests/unit/test_layout.py holds it).
"""

from .scaling import scaling
from .buckets import assign
from .engine import FLAG_FAILED, Engine
from .lane import lane_key
from .negotiation import JOIN_NAME, Meta
from .request import GroupHandle, Handle, Request

__all__ = ["Engine", "FLAG_FAILED", "GroupHandle", "Handle", "JOIN_NAME", "Meta", "Request",
           "assign", "lane_key", "scaling"]
