"""Chrome trace ("Trace Event Format") timeline of negotiation and collectives per tensor.

Rank 0 writes it, as Horovod does. Each tensor is one row (a trace "process" named as
Horovod names it, ``<kind>.<name>``: ``allreduce.grad.fc1``); activities are complete ("X")
events in microseconds, named as Horovod's (NEGOTIATE_ALLREDUCE, ALLREDUCE, the fusion
copies; CYCLE_START marks with HOROVOD_TIMELINE_MARK_CYCLES). Events reach the file as the job
runs: the engine flushes it after every cycle that recorded one, so the file can be opened
at any moment. Until shutdown it is a JSON array without its closing bracket, which the
Trace Event Format allows and Perfetto and chrome://tracing read; shutdown closes it.
"""

import json
import threading
import time


class Timeline:
    """Writes trace events for one rank to ``path``."""

    def __init__(self, path, mark_cycles=False):
        self.path = path
        self.mark_cycles = mark_cycles
        self._file = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._rows = {}
        self._lock = threading.Lock()
        self._origin = time.monotonic()
        self._closed = False
        self._dirty = False  # events written since the last flush

    def span(self, name, activity, started, ended, kind=None):
        """Record ``activity`` on tensor ``name`` (of collective ``kind``, e.g. "allreduce")
        from ``started`` to ``ended`` (monotonic s)."""
        with self._lock:
            if self._closed:
                return
            row = self._row(row_name(name, kind))
            self._write({"name": activity, "ph": "X", "pid": row, "tid": 0,
                         "ts": self._micros(started), "dur": max(0.0, (ended - started) * 1e6)})

    def cycle(self, number):
        """Mark the start of a negotiation cycle (only with HOROVOD_TIMELINE_MARK_CYCLES)."""
        if not self.mark_cycles:
            return
        with self._lock:
            if not self._closed:
                self._write({"name": f"CYCLE_START {number}", "ph": "i", "s": "g", "pid": 0,
                             "tid": 0, "ts": self._micros(time.monotonic())})

    def flush(self):
        """Hand what was recorded to the file now (the engine calls it after each cycle)."""
        with self._lock:
            if self._dirty and not self._closed:
                self._file.flush()
                self._dirty = False

    def close(self):
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._file.write(json.dumps({"name": "process_name", "ph": "M", "pid": 0,
                                         "args": {"name": "hororing"}}))
            self._file.write("\n]\n")
            self._file.close()

    def _row(self, name):
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._write({"name": "process_name", "ph": "M", "pid": row, "args": {"name": name}})
            self._write({"name": "process_sort_index", "ph": "M", "pid": row,
                         "args": {"sort_index": row}})
        return row

    def _micros(self, moment):
        return (moment - self._origin) * 1e6

    def _write(self, event):
        self._file.write(json.dumps(event))
        self._file.write(",\n")
        self._dirty = True


def row_name(name, kind):
    """A tensor's row as Horovod names it: ``<kind>.<name>`` (a generated name such as
    ``allreduce.noname.3`` already has its kind in front)."""
    if kind is None or name.startswith(kind + ".noname."):
        return name
    return f"{kind}.{name}"


_REDUCTION_ACTIVITIES = ("MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER")


def overlap_report(events):
    """How much of each training step's allreduce work ran while backward was still running.

    ``events`` is a timeline as written by :class:`Timeline` (the parsed JSON array) of a run
    that allreduced the same set of tensors once per step, as DistributedOptimizer does.
    Step k's backward window runs from the k-th submission of its first tensor to the k-th
    submission of its last one (each NEGOTIATE_ALLREDUCE span starts when its tensor was
    submitted: when backward produced it, or, for a bucket the optimizer starts whole, its
    last gradient; a model of one bucket has an empty window and nothing hidden). Its
    reduction time is the union of the k-th fusion-copy and ALLREDUCE spans of those
    tensors; the hidden part is what lies inside the window. Returns a dict with per-step
    ``(hidden_us, total_us)`` pairs and the overall ``hidden_fraction`` (None when nothing
    was reduced).
    """
    rows = {event["pid"]: event["args"]["name"] for event in events
            if event.get("ph") == "M" and event.get("name") == "process_name"}
    submitted, reductions = {}, {}
    for event in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"]):
        name = rows.get(event["pid"])
        span = (event["ts"], event["ts"] + event["dur"])
        if event["name"] == "NEGOTIATE_ALLREDUCE":
            submitted.setdefault(name, []).append(span[0])
            reductions.setdefault(name, []).append([])
        elif event["name"] in _REDUCTION_ACTIVITIES and reductions.get(name):
            reductions[name][-1].append(span)
    steps = min((len(times) for times in submitted.values()), default=0)
    per_step = []
    for step in range(steps):
        starts = [times[step] for times in submitted.values()]
        window = (min(starts), max(starts))
        spans = _union([span for spans in reductions.values() for span in spans[step]])
        total = sum(end - start for start, end in spans)
        hidden = sum(max(0.0, min(end, window[1]) - max(start, window[0])) for start, end in spans)
        per_step.append((hidden, total))
    total = sum(step_total for _, step_total in per_step)
    return {"steps": per_step, "tensors": len(submitted),
            "hidden_fraction": sum(hidden for hidden, _ in per_step) / total if total else None}


def _union(spans):
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
