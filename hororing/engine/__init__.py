"""The engine: per-rank background progress, cross-rank negotiation, fused execution.

What the rest of hororing (and its tests and benchmarks) may use, and nothing else:

- ``Engine.submit(request, blocking)`` (``request.Request``), returning a ``request.Handle``;
  ``Handle.synchronize()`` waits for it, driving the engine from the caller's thread;
- ``Engine.stats()``, ``Engine.set_timeline(timeline)``, ``Engine.stop(...)``,
  ``Engine.close()``;
- ``Engine.allreduce``, the allreduce pipeline (``allreduce.AllreducePipeline``):
  ``force(kind)`` to make every bucket take one algorithm (``ring``, ``small``,
  ``hierarchical``, ``ps``; None to choose by size again; call it on every rank between
  collectives), ``watch()`` to record the buffers handed to the algorithms,
  ``device_transport()`` and ``hierarchical_stats()``.
"""
