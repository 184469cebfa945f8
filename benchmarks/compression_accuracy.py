"""Digits accuracy per compressor: compressed gradient allreduce, 8-bit CHOCO gossip, 8-bit QAT.

Run under the launcher (4 ranks; about 6 minutes on a 2-core machine shared with other jobs)::

    gossamer run -np 4 benchmarks/compression_accuracy.py
    gossamer run -np 4 benchmarks/compression_accuracy.py --compressors topk:0.1 --no-gossip
    gossamer run -np 4 benchmarks/compression_accuracy.py --no-gossip --optimizer sgd \
        --local-momentum --name compression_accuracy_sgd

Every configuration trains :class:`gossamer.models.SmallCNN` on scikit-learn's bundled digits
(the loader, split and model of ``examples/train_digits.py``) from the same initial weights,
on the same shards and batches, with Adam (``--optimizer sgd``: SGD with momentum; with
``--local-momentum`` each rank's momentum buffer is what is compressed, so error feedback
acts on the momentum-corrected update) and a cosine learning-rate decay, for a fixed
number of steps, then reports the mean test accuracy of the ranks' models and the bytes each
rank sent per step (``gossamer.profiling.bytes_sent``: point-to-point messages exactly,
collectives by their ring cost, call headers included), and the test accuracy of the
average of the ranks' models (one uncompressed allreduce after the run, not counted):

- ``allreduce``: uncompressed gradient allreduce, the baseline of the compressed rows;
- ``--warmup K``: the first K steps of each compressed row run uncompressed;
- ``allreduce + <c> + EF``: ``GradientAllreduce(compression=c, error_feedback=True)`` for
  every registered compressor (``--compressors`` picks others);
- ``gossip``: uncompressed adapt-with-combine over the exponential-two graph, the baseline of
  the CHOCO rows; ``choco <c>``: the same with CHOCO-gossip compressed by ``c`` (``uint8``;
  ``--choco-compressors`` picks others), at CHOCO's default consensus step (or
  ``--choco-gamma``);
- ``gossip ATC``: uncompressed adapt-then-combine (step, then average) over the same graph,
  the baseline of the DCD row;
- ``dcd uint8 (ATC)``: the same with ``communication="difference_gossip"`` and ``uint8``
  compression (DCD-PSGD, Bagua's low-precision decentralized algorithm);
- ``QAT ...``: the model prepared by ``compression.quantize_model`` (torch's 8-bit
  quantization-aware training) with allreduce, and with 8-bit CHOCO (8-bit training).

Rank 0 prints a markdown table and writes it, with the raw numbers as JSON, under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

import gossamer
from gossamer import communicators, compression, optim, profiling
from gossamer import topology as topo
from gossamer.communicators.powersgd import parse_powersgd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
# Also when imported as benchmarks.compression_accuracy (the tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import argtypes
from train_digits import accuracy, load_digits, make_model, split

COMPRESSORS = (
    "fp16",
    "bf16",
    "uint8",
    "qsgd:16",
    "natural",
    "natural_dithering:8",
    "topk:0.01",
    "randomk:0.01",
    "stc:0.01",
    "sign",
)


def configurations(
    compressors: list[str], gossip: bool, choco: Sequence[str] = ("uint8",)
) -> list[tuple[str, dict]]:
    """(row name, options) in table order; options: optimizer, compression, qat."""
    rows = [("allreduce", {"optimizer": "allreduce"})]
    rows += [
        (f"allreduce + {c} + EF", {"optimizer": "allreduce", "compression": c}) for c in compressors
    ]
    if gossip:
        rows += [
            ("gossip", {"optimizer": "gossip"}),
            *((f"choco {c}", {"optimizer": "gossip", "compression": c}) for c in choco),
            ("gossip ATC", {"optimizer": "atc"}),
            ("dcd uint8 (ATC)", {"optimizer": "dcd", "compression": "uint8"}),
            ("QAT allreduce", {"optimizer": "allreduce", "qat": True}),
            ("QAT choco uint8", {"optimizer": "gossip", "compression": "uint8", "qat": True}),
        ]
    return rows


def train(options: dict, data, args, seed: int) -> tuple[float, float, float, float]:
    """Train one configuration.

    Returns:
        (mean test accuracy of the ranks' models, test accuracy of their average,
        bytes/step/rank, seconds). The averaging is one uncompressed allreduce after the
        run, not counted in the bytes; it matters where the ranks' models differ (gossip,
        random-k with error reset).
    """
    rank, size = gossamer.rank(), gossamer.size()
    (images, labels), (test_images, test_labels) = data
    shard_images, shard_labels = images[rank::size], labels[rank::size]
    model = make_model(seed)
    if options.get("qat"):
        compression.quantize_model(model)
    if args.optimizer == "adam":
        base = torch.optim.Adam(model.parameters(), lr=args.lr)
    elif args.local_momentum:
        base = torch.optim.SGD(model.parameters(), lr=args.lr)
        optim.MomentumCorrection(model, args.momentum)
    else:
        base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    spec = options.get("compression")

    def make_opt(spec):
        if options["optimizer"] == "allreduce":
            extra = {"compression": spec, "error_feedback": True} if spec else {}
            return optim.GradientAllreduce(base, model, **extra)
        graph = topo.exponential_two(size)
        if options["optimizer"] == "gossip" and spec and args.choco_gamma is not None:
            choco = communicators.ChocoGossip(spec, gamma=args.choco_gamma, topology=graph)
            return optim.AdaptWithCombine(base, model, communicator=choco)
        if options["optimizer"] == "gossip":
            return optim.AdaptWithCombine(base, model, topology=graph, compression=spec)
        # DCD (Bagua's low-precision algorithm) steps, then gossips: adapt-then-combine.
        dcd = {"communication": "difference_gossip"} if options["optimizer"] == "dcd" else {}
        return optim.AdaptThenCombine(base, model, topology=graph, compression=spec, **dcd)

    # An uncompressed warm-up (--warmup steps), then the configuration's compressor.
    warm = spec is not None and args.warmup > 0
    opt = make_opt(None if warm else spec)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(base, args.steps)
    loss_fn = nn.CrossEntropyLoss()
    gossamer.barrier()
    profiling.reset_bytes_sent()
    start = time.perf_counter()
    per_epoch = len(shard_labels) // args.batch_size
    for step in range(args.steps):
        epoch, k = divmod(step, per_epoch)
        if k == 0:
            generator = torch.Generator().manual_seed(seed * 10_000 + epoch * 100 + rank)
            order = torch.randperm(len(shard_labels), generator=generator)
        batch = order[k * args.batch_size : (k + 1) * args.batch_size]
        if warm and step == args.warmup:
            opt.close()
            opt = make_opt(spec)
        opt.zero_grad()
        loss_fn(model(shard_images[batch]), shard_labels[batch]).backward()
        opt.step()
        schedule.step()
    opt.synchronize()
    seconds = time.perf_counter() - start
    sent = profiling.bytes_sent() / args.steps
    opt.close()
    acc = accuracy(model, test_images, test_labels)
    mean = gossamer.allreduce(torch.tensor([acc, sent], dtype=torch.float64))
    with torch.no_grad():
        for value in model.state_dict().values():
            if value.is_floating_point():
                value.copy_(gossamer.allreduce(value))
    averaged = accuracy(model, test_images, test_labels)
    return float(mean[0]), averaged, float(mean[1]), seconds


def with_differences(results: list[dict]) -> list[dict]:
    """Each result with ``difference``: its accuracy minus its baseline's, of the same seed.

    The baseline is the uncompressed run of the row's optimizer: ``allreduce``, ``gossip``
    (CHOCO rows) or ``gossip ATC`` (DCD); also ``ratio``, its bytes against the baseline's
    (``None`` in a world of one, which sends nothing).
    """
    names = {"allreduce": "allreduce", "gossip": "gossip", "atc": "gossip ATC", "dcd": "gossip ATC"}
    base = {(r["seed"], r["name"]): r for r in results if r["name"] in names.values()}
    out = []
    for r in results:
        ref = base[r["seed"], names[r["optimizer"]]]
        ratio = r["bytes"] / ref["bytes"] if ref["bytes"] else None
        out.append(r | {"difference": r["accuracy"] - ref["accuracy"], "ratio": ratio})
    return out


def table(results: list[dict], steps: int, size: int) -> str:
    """The markdown table of one seed: accuracy, its difference to the row's baseline, bytes."""
    lines = [
        f"| configuration ({size} ranks, {steps} steps) | test accuracy % | vs baseline "
        "(points) | averaged model % | bytes / step / rank | vs baseline |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in with_differences(results):
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(
            f"| {r['name']} | {100 * r['accuracy']:.2f} | {100 * r['difference']:+.2f} | "
            f"{100 * r['averaged_model_accuracy']:.2f} | {r['bytes']:,.0f} | {ratio} |"
        )
    return "\n".join(lines)


def seeds_table(results: list[dict], steps: int, size: int) -> str:
    """Several seeds: per row its difference to the baseline on each seed, mean and worst.

    One seed's test accuracy moves in steps of 1/360 (0.28 point), so a 1-point target is
    judged on the mean over seeds and on how many seeds are within it.
    """
    rows: dict[str, list[dict]] = {}
    for r in with_differences(results):
        rows.setdefault(r["name"], []).append(r)
    seeds = sorted({r["seed"] for r in results})
    lines = [
        f"| configuration ({size} ranks, {steps} steps) | mean accuracy % | points vs "
        f"baseline, seeds {', '.join(map(str, seeds))} | mean | worst | within 1 point | "
        "bytes / step / rank |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, runs in rows.items():
        points = [100 * r["difference"] for r in runs]
        within = sum(p >= -1 for p in points)
        lines.append(
            f"| {name} | {sum(100 * r['accuracy'] for r in runs) / len(runs):.2f} | "
            f"{' '.join(f'{p:+.2f}' for p in points)} | {sum(points) / len(points):+.2f} | "
            f"{min(points):+.2f} | {within} of {len(points)} | "
            f"{sum(r['bytes'] for r in runs) / len(runs):,.0f} |"
        )
    return "\n".join(lines)


_STEP = argtypes.checked(float, lambda g: 0 < g <= 1, "in (0, 1]")


def _gamma(text: str) -> float | str:
    """An argparse ``type=`` for ``--choco-gamma``: ``auto`` or a step in (0, 1]."""
    return text if text == "auto" else _STEP(text)


def _check_compressor(spec: str) -> None:
    """Raise ValueError unless ``spec`` is a compressor that compressed allreduce takes."""
    try:
        if parse_powersgd(spec) is not None:  # torch's PowerSGD
            return
    except ValueError as err:  # a bad rank
        raise ValueError(f"--compressors={spec!r}: {err}") from None
    if compression.get_compressor(spec, argument="--compressors").name == "none":
        raise ValueError(
            f"--compressors={spec!r}: the uncompressed row, allreduce, always runs; "
            "give compressors only"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=argtypes.POSITIVE, default=300, help="training steps per run"
    )
    parser.add_argument("--batch-size", type=argtypes.POSITIVE, default=16, help="per rank")
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (cosine decay to 0); default 3e-3 for Adam, 0.1 for SGD",
    )
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    parser.add_argument(
        "--local-momentum",
        action="store_true",
        help="SGD: momentum on each rank before compression (error feedback on the "
        "momentum-corrected update) instead of on the averaged gradient",
    )
    parser.add_argument(
        "--warmup",
        type=argtypes.checked(int, lambda n: n >= 0, ">= 0"),
        default=0,
        help="uncompressed steps before the compressor's",
    )
    parser.add_argument(
        "--seed",
        type=int,
        nargs="+",
        default=[0],
        help="seeds of the weights, split and batches; several: every row per seed, and a "
        "table of the differences to the baseline over the seeds",
    )
    parser.add_argument(
        "--compressors", nargs="*", default=list(COMPRESSORS), help="compressor specs to run"
    )
    parser.add_argument("--no-gossip", action="store_true", help="skip the gossip and QAT rows")
    parser.add_argument(
        "--choco-compressors",
        nargs="*",
        default=["uint8"],
        help="compressor specs of the CHOCO-gossip rows (against uncompressed gossip)",
    )
    parser.add_argument(
        "--choco-gamma",
        type=_gamma,
        default=None,
        help="CHOCO's consensus step, in (0, 1] or 'auto'; default: per compressor",
    )
    parser.add_argument("--name", default="compression_accuracy", help="results file stem")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    for spec in args.compressors:  # all now, not after the rows before a bad one trained
        try:
            _check_compressor(spec)
        except ValueError as err:
            parser.error(str(err))
    for spec in args.choco_compressors:
        try:
            if compression.get_compressor(spec, argument="--choco-compressors").name == "none":
                raise ValueError(
                    f"--choco-compressors={spec!r}: the uncompressed row, gossip, always runs"
                )
        except ValueError as err:
            parser.error(str(err))
    if args.lr is None:
        args.lr = 3e-3 if args.optimizer == "adam" else 0.1
    gossamer.init()
    results = []
    for seed in args.seed:
        torch.manual_seed(seed)
        data = split(*load_digits(), 0.2, seed)
        smallest = len(data[0][1]) // gossamer.size()  # the smallest shard
        if args.batch_size > smallest:
            gossamer.shutdown()
            parser.error(
                f"--batch-size must be <= {smallest}, a shard's size; got {args.batch_size}"
            )
        rows = configurations(args.compressors, not args.no_gossip, args.choco_compressors)
        results += [run_row(name, options, data, args, seed) for name, options in rows]
    if gossamer.rank() == 0:
        one = len(args.seed) == 1
        text = (table if one else seeds_table)(results, args.steps, gossamer.size())
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.md").write_text(text + "\n")
        (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    gossamer.shutdown()


def run_row(name: str, options: dict, data, args, seed: int) -> dict:
    """Train one row on one seed; rank 0 prints a line; the row's result."""
    acc, averaged, sent, seconds = train(options, data, args, seed)
    settings = {k: getattr(args, k) for k in ("optimizer", "lr", "warmup", "steps")}
    if args.optimizer == "sgd":
        settings.update(momentum=args.momentum, local_momentum=args.local_momentum)
    if gossamer.rank() == 0:
        print(
            f"{name:32s} seed {seed} acc {100 * acc:6.2f} % (averaged model "
            f"{100 * averaged:6.2f} %)  {sent:12,.0f} B/step  {seconds:6.1f} s"
        )
    return (
        {"name": name, "seed": seed, **options, "accuracy": acc}
        | {"averaged_model_accuracy": averaged, "bytes": sent, "seconds": seconds}
        | {"settings": settings}
    )


if __name__ == "__main__":
    main()
