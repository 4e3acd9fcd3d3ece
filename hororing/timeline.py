"""Chrome trace ("Trace Event Format") timeline of negotiation and collectives per tensor.

Rank 0 writes it, as Horovod does. Each tensor is one row (a trace "process" named after
the tensor); activities are complete ("X") events in microseconds. The file is a JSON array
that Perfetto and chrome://tracing open; it is closed properly at shutdown.
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

    def span(self, name, activity, started, ended):
        """Record ``activity`` on tensor ``name`` from ``started`` to ``ended`` (monotonic s)."""
        with self._lock:
            if self._closed:
                return
            row = self._row(name)
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
