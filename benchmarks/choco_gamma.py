"""CHOCO-gossip's consensus step per compressor: default, ``gamma="auto"`` and a fixed one.

Average consensus on the exponential graph of 4 ranks, 1000 float64 values per rank,
simulated in one process with the library's compressors (the update of
:class:`gossamer.communicators.ChocoGossip`, which ``tests/algorithms`` checks against this
simulation)::

    python benchmarks/choco_gamma.py
    python benchmarks/choco_gamma.py --compressors topk:0.01 sign:bucket=64 --rounds 400 2000

For each compressor and step (``communicators.default_gamma``, ``"auto"`` =
``communicators.choco_gamma`` of ``compression.compression_quality``, and ``--fixed``) it
prints the consensus error ``||X - mean(X)||`` relative to its start after each number of
``--rounds``, as a markdown table, also written under ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import argtypes  # this folder: the script runs as a file
import torch

from gossamer import communicators, compression
from gossamer import topology as topo


def simulate(spec: str, gamma: float, graph: topo.Topology, checks: list[int]) -> list[float]:
    """CHOCO for all ranks: h_i += D(C(x_i - h_i)); x_i += gamma sum_j w_ji (h_j - h_i)."""
    c = compression.get_compressor(spec)
    w = torch.tensor(graph.weights, dtype=torch.float64)
    n = len(w)
    x = torch.stack(
        [torch.randn(1000, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
         for r in range(n)]
    )  # fmt: skip
    h = torch.zeros_like(x)
    start = (x - x.mean(0)).norm()
    errors = []
    for t in range(1, max(checks) + 1):
        for i in range(n):
            h[i] += c.decompress(c.compress(x[i] - h[i]))
        x = x + gamma * (w.T @ h - h)
        if t in checks:
            errors.append(float((x - x.mean(0)).norm() / start))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--compressors",
        nargs="*",
        default=["topk:0.01", "topk:0.1", "sign", "sign:bucket=64", "uint8"],
    )
    parser.add_argument(
        "--rounds",
        type=argtypes.POSITIVE,
        nargs="+",
        default=[400, 2000],
        help="numbers of rounds after which to report the error (columns in ascending order)",
    )
    parser.add_argument("--fixed", type=float, default=0.1, help="the fixed step compared")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    if len(set(args.rounds)) < len(args.rounds):
        parser.error(f"argument --rounds: repeated values; got {' '.join(map(str, args.rounds))}")
    args.rounds = sorted(args.rounds)  # simulate() reports in ascending order
    for spec in args.compressors:
        try:
            compression.get_compressor(spec, argument="--compressors")
        except ValueError as err:
            parser.error(f"argument {err}")
    graph = topo.exponential_two(4)
    lines = [
        "| compressor | gamma | value | "
        + " | ".join(f"after {r} rounds" for r in args.rounds)
        + " |",
        "|---|---|---:|" + "---:|" * len(args.rounds),
    ]
    for spec in args.compressors:
        c = compression.get_compressor(spec)
        auto = communicators.choco_gamma(compression.compression_quality(c, 1000), graph)
        steps = (("default", communicators.default_gamma(c)), ("auto", auto))
        for label, gamma in (*steps, (f"fixed {args.fixed}", args.fixed)):
            errors = simulate(spec, gamma, graph, args.rounds)
            row = " | ".join(f"{e:.1e}" for e in errors)
            lines.append(f"| `{spec}` | {label} | {gamma:.4f} | {row} |")
            print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "choco_gamma.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
