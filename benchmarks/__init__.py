"""Benchmarks run by ``make bench`` (serving), ``make bench-engine`` and ``make bench-kv``."""
