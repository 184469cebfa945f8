"""Ranks of different speed (DeDLOC): each makes progress at its own pace when gossip is async.

    gossamer run -np 4 benchmarks/async_speed.py
    gossamer run -np 4 benchmarks/async_speed.py --delays-ms 0,0,30,90 --seconds 20

Every rank trains :class:`gossamer.models.SmallCNN` on its shard of the bundled digits with
Adam over ``exponential_two(n)``; rank ``k`` sleeps ``delays_ms[k]`` after each step, a
device that much slower (a shorter list repeats: ``delays_ms[k % len(delays_ms)]``). Each
optimizer runs for ``--seconds`` of wall time:

- ``awc`` (``AdaptWithCombine``, synchronous): every step waits for the neighbours' values
  of the same step, so every rank moves at the slowest one's pace. (To stop together the
  ranks agree each step, with a one-element allreduce, whether the time is up.)
- ``win_put`` (``WindowPut``) and ``push_sum`` (``PushSum``): one-sided puts, a rank
  combines whatever its neighbours last put, so nobody waits for a slow rank's step.

Per rank it reports steps per second and staleness: after each step a rank also puts
``(its step count, the time)`` into a two-element clock window over the same graph; when
it finishes a step it reads its in-neighbours' newest clocks and records how old they are
(ms since that neighbour's last put) and how many steps the neighbour is behind it. And the
final test accuracy of every rank's model. Writes ``<out>/async_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import argtypes  # this folder: the script runs as a file
import torch
from torch import nn

import gossamer
from gossamer import ops, optim, topology
from gossamer.data import load_digits
from gossamer.models import SmallCNN
from gossamer.windows import Window

OPTIMIZERS = {
    "awc": optim.AdaptWithCombine,
    "win_put": optim.WindowPut,
    "push_sum": optim.PushSum,
}


def run(name: str, args: argparse.Namespace, data) -> dict:
    """One optimizer for ``args.seconds``: this rank's steps/s, staleness and accuracy."""
    rank, size = gossamer.rank(), gossamer.size()
    (images, labels), (test_images, test_labels) = data
    images, labels = images[rank::size], labels[rank::size]
    torch.manual_seed(args.seed)
    model = SmallCNN()
    model(images[:1])  # materialise the lazy layer: one starting point on every rank
    graph = topology.exponential_two(size)
    opt = OPTIMIZERS[name](torch.optim.Adam(model.parameters(), lr=args.lr), model, topology=graph)
    clock = Window.create(torch.zeros(2, dtype=torch.float64), topology=graph, name=f"clock-{name}")
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    delay = args.delays_ms[rank % len(args.delays_ms)] / 1000
    ages, behind, steps = [], [], 0
    loss_fn = nn.CrossEntropyLoss()
    gossamer.barrier()
    start = time.perf_counter()
    while not _time_is_up(name, start, args.seconds):
        batch = torch.randint(len(labels), (args.batch_size,), generator=generator)
        opt.zero_grad()
        loss_fn(model(images[batch]), labels[batch]).backward()
        opt.step()
        time.sleep(delay)
        steps += 1
        now = time.time()
        clock.put(torch.tensor([steps, now], dtype=torch.float64))
        for their_steps, their_time in (b.tolist() for b in clock.buffers().values()):
            if their_steps > 0:  # that neighbour has put at least once
                ages.append(1000 * (now - their_time))
                behind.append(steps - their_steps)
    elapsed = time.perf_counter() - start
    opt.synchronize()
    gossamer.barrier()  # every put has landed before the windows go
    opt.close()
    clock.free()
    return {
        "optimizer": name,
        "rank": rank,
        "delay_ms": 1000 * delay,
        "steps": steps,
        "steps_per_s": steps / elapsed,
        "age_ms": statistics.mean(ages) if ages else float("nan"),
        "steps_behind": statistics.mean(behind) if behind else float("nan"),
        "accuracy": _accuracy(model, test_images, test_labels),
    }


def _time_is_up(name: str, start: float, seconds: float) -> bool:
    up = time.perf_counter() - start >= seconds
    if name != "awc":
        return up
    # Synchronous steps must match across ranks: stop when any rank's time is up.
    return bool(ops.allreduce(torch.tensor([float(up)]), op="max")[0])


def _accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(images).argmax(1) == labels).float().mean().item()
    model.train()
    return correct


def table(rows: list[dict]) -> str:
    """One markdown row per optimizer and rank."""
    lines = [
        "| optimizer | rank | extra delay (ms) | steps | steps/s | neighbours' newest value, "
        "age (ms) | neighbours' steps behind | test accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {r['rank']:.0f} | {r['delay_ms']:.0f} | {r['steps']:.0f} | "
            f"{r['steps_per_s']:.1f} | {r['age_ms']:.0f} | {r['steps_behind']:+.1f} | "
            f"{100 * r['accuracy']:.2f} % |"
        )
    return "\n".join(lines)


_FIELDS = ("rank", "delay_ms", "steps", "steps_per_s", "age_ms", "steps_behind", "accuracy")


def _gather(row: dict) -> list[dict]:
    """Every rank's row (numbers only travel: one float64 row per rank)."""
    mine = torch.tensor([[float(row[f]) for f in _FIELDS]], dtype=torch.float64)
    every = ops.allgather(mine).tolist()
    return [
        {"optimizer": row["optimizer"], **dict(zip(_FIELDS, values, strict=True))}
        for values in every
    ]


def _split(seed: int):
    images, labels = load_digits()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test, train = order[: len(order) // 5], order[len(order) // 5 :]
    return (images[train], labels[train]), (images[test], labels[test])


_POSITIVE_FLOAT = argtypes.checked(float, lambda s: math.isfinite(s) and s > 0, "finite, > 0")


def _delays(text: str) -> list[float]:
    """An argparse ``type=`` for ``--delays-ms``: comma-separated finite values >= 0."""
    try:
        delays = [float(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
    if not all(math.isfinite(d) and d >= 0 for d in delays):
        raise argparse.ArgumentTypeError(f"each must be finite, >= 0; got {text}")
    return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--delays-ms",
        type=_delays,
        default=[0.0, 0.0, 20.0, 60.0],
        help="per rank, comma-separated; a list shorter than the ranks repeats (rank k sleeps "
        "value k mod its length), a longer one is cut (default: 0,0,20,60)",
    )
    parser.add_argument(
        "--seconds", type=_POSITIVE_FLOAT, default=15.0, help="wall time per optimizer"
    )
    parser.add_argument("--optimizers", default="awc,win_put,push_sum")
    parser.add_argument("--batch-size", type=argtypes.POSITIVE, default=16)
    parser.add_argument("--lr", type=_POSITIVE_FLOAT, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/async_speed"))
    args = parser.parse_args()
    names = args.optimizers.split(",")
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        parser.error(
            f"argument --optimizers: unknown {', '.join(unknown)} (choose from "
            f"{', '.join(OPTIMIZERS)}); got {args.optimizers}"
        )
    torch.set_num_threads(1)
    gossamer.init()
    data = _split(args.seed)
    rows = []
    for name in names:
        mine = run(name, args, data)
        rows += _gather(mine)
    if gossamer.rank() == 0:
        text = table(rows)
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "async_speed.md").write_text(text + "\n")
        (args.out / "async_speed.json").write_text(json.dumps(rows, indent=1))
    gossamer.shutdown()


if __name__ == "__main__":
    main()
