"""Benchmarks run by `grove bench NAME` (see shared_rl/registry.py BENCHMARKS)."""
