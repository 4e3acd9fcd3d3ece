"""Autotuning: the engine's performance settings chosen online from measured throughput
(``autotune``), by Bayesian optimisation (``bayes``)."""

from .autotune import DIMENSIONS, Autotuner, Settings

__all__ = ["Autotuner", "DIMENSIONS", "Settings"]
