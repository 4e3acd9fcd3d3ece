"""The engine: per-rank background progress, cross-rank negotiation, fused execution."""
