"""Benchmarks (importable so that tests can reach benchmarks.netbench)."""
