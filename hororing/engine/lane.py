"""A repeated blocking allreduce, planned once and run many times: its lane.

A loop of the same blocking allreduce settles into the fold (``fold.py``): each call is one
cycle whose one exchange carries the data. Once a call has completed so, the engine keeps
its ``Lane`` by name: what the door must see again to skip the checks it made on that call
(the same arguments, given as they were; an array of the same dtype and shape),
the metadata every rank agreed on, its cache id and the fold's plan for it. The next call
that fits goes from the door to ``Engine.run_lane``, which runs that one cycle written out
(``Cycle.run_lane``), without the queue, the door's checks or the plan's lookups. Whatever
else is going on (something queued or pending, a gathered cycle asked for, the cached entry
changed, a rank joined, the timeline or the autotuner running, the route changed) sends the
call the usual way before anything is exchanged; a fold the ranks do not agree on goes on
to the vote, as the usual cycle does from that point. Either way the bits are the fold's.
While it runs, the call is in flight under its name as a submitted call is, so another
thread's call under that name is refused, whichever way the first one went.
"""


class Lane:
    """One name's plan: ``door`` is ``lane_key``'s (in place, op, prescale, postscale),
    ``dtype`` and ``shape`` the array's: what a later call must match to be this lane's again
    (the door compares them, ``door.allreduce_now``); the rest is what the engine runs it
    with."""

    __slots__ = ("name", "door", "dtype", "shape", "meta", "cache_id", "response", "plan")

    def __init__(self, request, response, plan):
        self.name = request.name
        self.door = request.door
        self.dtype = request.tensor.dtype
        self.shape = request.tensor.shape
        self.meta = request.meta
        self.cache_id = request.cache_id
        self.response = response  # the cached Response (the same object while cached)
        self.plan = plan  # fold._Plan


def lane_key(inplace, average, op, prescale_factor, postscale_factor):
    """What the door compares a later blocking allreduce with (``Request.door``,
    ``Lane.door``): its arguments where each is of the type a lane takes (no ``average``, an
    int op, float factors, so that a call is the lane's again only when it gives them so:
    True is not the op 1, nor 1 the factor 1.0); None where a call takes no lane."""
    if average is None and type(op) is int and type(prescale_factor) is float \
            and type(postscale_factor) is float:
        return inplace, op, prescale_factor, postscale_factor
    return None


class Lanes(dict):
    """name -> Lane, for one engine; kept small (a training loop repeats a few names)."""

    CAPACITY = 64

    def learn(self, request, response, plan):
        """``request`` (a call the door marked ``door``) completed by the fold, agreed as
        ``response``: keep its lane. ``plan``: the fold's plan it ran with."""
        if len(self) >= self.CAPACITY and request.name not in self:
            self.clear()
        self[request.name] = Lane(request, response, plan)
