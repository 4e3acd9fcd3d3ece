"""Collective algorithms: plans (pure functions) and the code that executes them."""
