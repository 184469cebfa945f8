"""Training throughput on synthetic data: torch DDP beside gossamer's optimizers.

    gossamer run -np 4 benchmarks/bench_train.py [--preset smoke] [--out results]

BlueFog's method: for each model and strategy, a few warm-up batches, then timed batches
(zero_grad, forward, cross-entropy, backward, step) on random data; samples/s summed over
ranks, with the spread of the per-repetition rates (mean +- 1.96 std; none with one
repetition, as in ``--preset smoke``). Strategies: torch
DDP (gloo), gossamer gradient allreduce, adapt-with-combine and adapt-then-combine over the
static exponential-two graph and the dynamic one-peer schedule, and the window (win-put)
optimizer; gossamer strategies with tensor fusion on and off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import gossamer
from gossamer import optim
from gossamer import topology as topo
from gossamer.models import MLP, SmallResNet

PRESETS = {
    "full": {"batch": 32, "warmup": 3, "batches": 5, "reps": 3},
    "smoke": {"batch": 8, "warmup": 1, "batches": 2, "reps": 1},
}
MODELS = {
    "mlp": (lambda: MLP(1024, 512, 10, depth=3), (1024,)),
    "resnet": (lambda: SmallResNet(width=16), (3, 32, 32)),
}


def _wrap(strategy: str, model: nn.Module, fusion: bool):
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    rank, size = gossamer.rank(), gossamer.size()
    threshold = 8 * 2**20 if fusion else None
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model), sgd
    if strategy == "gradient-allreduce":
        return model, optim.GradientAllreduce(sgd, model, fusion_threshold_bytes=threshold)
    kind, graph = strategy.split("/")
    extra = {"fusion_threshold_bytes": threshold}
    if graph == "one-peer":
        extra["schedule"] = topo.one_peer_exponential(topo.exponential_two(size), rank)
    cls = {
        "awc": optim.AdaptWithCombine,
        "atc": optim.AdaptThenCombine,
        "win-put": optim.WindowPut,
    }[kind]
    return model, cls(sgd, model, **extra)


def run(model_name: str, strategy: str, fusion: bool, cfg: dict) -> tuple[float, float | None]:
    build, shape = MODELS[model_name]
    torch.manual_seed(0)
    net, opt = _wrap(strategy, build(), fusion)
    x = torch.randn(cfg["batch"], *shape)
    y = torch.randint(0, 10, (cfg["batch"],))
    loss_fn = nn.CrossEntropyLoss()

    def batch() -> None:
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(cfg["warmup"]):
        batch()
    rates = []
    for _ in range(cfg["reps"]):
        gossamer.barrier()
        start = time.perf_counter()
        for _ in range(cfg["batches"]):
            batch()
        rates.append(cfg["batch"] * cfg["batches"] / (time.perf_counter() - start))
    if hasattr(opt, "free"):
        gossamer.barrier()
        opt.free()
    totals = gossamer.allreduce(torch.tensor(rates, dtype=torch.float64), average=False)
    # One repetition has no spread to show (None: not "+- 0.0").
    spread = 1.96 * statistics.pstdev(totals.tolist()) if len(rates) > 1 else None
    return float(totals.mean()), spread


def _spread(spread: float | None) -> str:
    return "" if spread is None else f" +- {spread:.1f}"


STRATEGIES = [
    "ddp",
    "gradient-allreduce",
    "awc/exp2",
    "awc/one-peer",
    "atc/exp2",
    "atc/one-peer",
    "win-put/exp2",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    gossamer.init()
    cfg = PRESETS[args.preset]
    rows = []
    for model_name in args.models:
        ddp = None
        for strategy in STRATEGIES:
            for fusion in [True] if strategy == "ddp" else [True, False]:
                rate, spread = run(model_name, strategy, fusion, cfg)
                ddp = rate if strategy == "ddp" else ddp
                rows.append(
                    {
                        "model": model_name,
                        "strategy": strategy,
                        "fusion": fusion,
                        "samples_per_s": rate,
                        "spread": spread,
                        "vs_ddp": rate / ddp,
                    }
                )
    if gossamer.rank() == 0:
        lines = [
            "| model | strategy | fusion | samples/s (all ranks) | vs DDP |",
            "|---|---|---|---:|---:|",
        ]
        lines += [
            f"| {r['model']} | {r['strategy']} | {'on' if r['fusion'] else 'off'} | "
            f"{r['samples_per_s']:.1f}{_spread(r['spread'])} | {r['vs_ddp']:.2f} |"
            for r in rows
        ]
        text = "\n".join(lines)
        print(f"{gossamer.size()} ranks, gloo, batch {cfg['batch']} per rank\n\n{text}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_train.md").write_text(text + "\n")
        (out / "bench_train.json").write_text(json.dumps(rows, indent=2) + "\n")
    gossamer.shutdown()


if __name__ == "__main__":
    main()
