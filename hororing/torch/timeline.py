"""Horovod's start_timeline / stop_timeline, over the core's timeline."""

from ..context import start_timeline, stop_timeline

__all__ = ["start_timeline", "stop_timeline"]
