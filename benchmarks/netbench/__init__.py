"""Emulated-cluster benchmark: network namespaces as hosts, tc-shaped links, real jobs.

``python -m benchmarks.netbench --preset smoke`` (root and iproute2 needed). Modules:
:mod:`~benchmarks.netbench.cluster` (namespaces, shaping, cleanup),
:mod:`~benchmarks.netbench.runner` (one ``gossamer run`` per host),
:mod:`~benchmarks.netbench.worker` (the per-rank training script) and
:mod:`~benchmarks.netbench.report` (aggregation, cost model, table, plot).
"""
