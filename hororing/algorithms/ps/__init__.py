"""Parameter-server mode, the baseline beside the ring: an algorithm like the others, with
its own ranks (``AsyncPSOptimizer``, above the engine in ``async_optimizer.py``, trains
through its servers asynchronously).

- ``roles``: which ranks serve and which work, set up in ``hvd.init(mode="ps")``; server
  processes run ``server.serve`` there and exit.
- ``workers``: the workers' allreduce through dedicated servers (``ServerClient``) or through
  colocated shards (``Colocated``); the engine uses either in place of the ring.
- ``server``: a dedicated server's loop.
- ``placement``: which server holds which tensor, a pure plan every worker builds alike.
- ``asynchronous``: asynchronous SGD, the servers holding the parameters.
- ``protocol``: the tags, op and dtype tables, and the reduction order they all share.
"""
