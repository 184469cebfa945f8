"""Training that outlives a rank: 4 ranks learn digits, one is killed at 40 %, the rest go on.

Run::

    gossamer run -np 4 --elastic examples/elastic_digits.py
    gossamer run -np 6 --elastic examples/elastic_digits.py --victim 3 --kill-at 0.5
    gossamer run -np 4 --elastic examples/elastic_digits.py --optimizer push_sum
    python examples/elastic_digits.py     # the same: it starts `gossamer run --elastic`

Every rank trains :class:`gossamer.models.SmallCNN` on its shard of scikit-learn's bundled
digits (the loader of ``train_digits.py``) with adapt-then-combine over
``exponential_two(n)`` and ``elastic=True`` (``--optimizer push_sum`` or ``win_put``: the
asynchronous optimizers over elastic windows instead). At ``--kill-at`` of the run the victim rank
SIGKILLs itself (no clean-up, as a crash or an OOM kill would). Its neighbours' next
exchange with it fails, the heartbeats confirm the death, the survivors agree on the new
live set through the rendezvous store (membership epoch 1), and they go on averaging over
``exponential_two(n).without([victim])`` (Sinkhorn re-weighting, doubly stochastic). The
survivors keep what the victim's model had taught theirs, and take over its data: on the
membership change each re-shards the training set over ``gossamer.live_ranks()``.
``--elastic`` makes the launcher's agent let the survivors run (without it, torchrun's agent
stops every rank when one dies); its store holds the membership, so any rank may be the
victim, rank 0 included. ``--no-kill`` runs the same job without a death (the reference of
``benchmarks/elastic_digits.py``).

Rank ``min(live)`` prints, per survivor, when it learned of the death, the time from the
kill to its next step completed among the survivors only, its longest step after the kill
(the stall) beside the median step before it, and its final test accuracy;
``<out>/elastic_digits.png`` shows each rank's test accuracy over time with the kill and the
membership changes marked. Histories travel through the rendezvous store (collectives
cannot run once a rank is dead).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn
from train_digits import _POSITIVE, _checked, accuracy, load_digits, make_model, split

import gossamer
from gossamer import context, optim
from gossamer import topology as topo

_KEY = "elastic_digits/"


def spawn(args: argparse.Namespace) -> int:
    """Not started by a launcher: run this script under ``gossamer run --elastic``."""
    launcher = [sys.executable, "-m", "gossamer.launcher", "run", "-np", str(args.world_size)]
    return subprocess.call([*launcher, "--elastic", *sys.argv])


def total_steps(args: argparse.Namespace, size: int, n_train: int) -> int:
    """The run's steps: ``--steps``, else ``--epochs`` of ``n_train`` images over ``size``."""
    if args.steps is not None:
        return args.steps
    return args.epochs * (n_train // (size * args.batch_size))


def check_steps(parser: argparse.ArgumentParser, args: argparse.Namespace, size: int) -> None:
    """Refuse a run too short to train, or, with a kill, to measure the victim's death.

    The report compares the steps after the kill with the median step before it (two steps
    completed at least), and the victim must die before the last step or nothing happens.
    """
    n_train = len(split(*load_digits(), 0.2, args.seed)[0][1])
    total = total_steps(args, size, n_train)
    source = f"--steps {args.steps}" if args.steps is not None else f"--epochs {args.epochs}"
    if total < 1:
        parser.error(
            f"argument --batch-size: must be <= {n_train // size} ({n_train} training images "
            f"over {size} ranks); got {args.batch_size}"
        )
    if args.no_kill:
        return
    if not 2 <= round(args.kill_at * total) <= total - 1:
        fits = next(n for n in itertools.count(1) if 2 <= round(args.kill_at * n) <= n - 1)
        parser.error(
            f"{source} gives {total} steps, too few for --kill-at {args.kill_at}: the victim "
            f"must complete 2 steps before it is killed and die before the last step; "
            f"use --steps >= {fits}"
        )


def train(args: argparse.Namespace) -> None:
    """One rank: train, record accuracy over time, die if it is the victim."""
    torch.set_num_threads(1)
    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    store = context.runtime().store
    train_set, (test_images, test_labels) = split(*load_digits(), 0.2, args.seed)
    images, labels = train_set[0][rank::size], train_set[1][rank::size]
    total = total_steps(args, size, len(train_set[1]))
    kill_step = round(args.kill_at * total)

    model = make_model(args.seed)  # the same seed: one starting point on every rank
    base = torch.optim.Adam(model.parameters(), lr=args.lr)
    kind = {"atc": optim.AdaptThenCombine, "push_sum": optim.PushSum, "win_put": optim.WindowPut}
    opt = kind[args.optimizer](base, model, topology=topo.exponential_two(size), elastic=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(base, total)
    loss_fn = nn.CrossEntropyLoss()
    changes: list[dict] = []
    changed = threading.Event()

    def on_change(change) -> None:  # on the communication thread: record, signal, return
        changes.append({"t": time.time(), "epoch": change.epoch, "live": list(change.live)})
        changed.set()

    gossamer.on_membership_change(on_change)
    start = time.time()
    history = {"rank": rank, "start": start, "acc": [], "step_done": [], "changes": changes}
    generator = torch.Generator().manual_seed(args.seed * 10_000 + rank)
    order, at = torch.randperm(len(labels), generator=generator), 0
    for step in range(total):
        if rank == args.victim and step == kill_step and not args.no_kill:
            store.set(f"{_KEY}killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if changed.is_set():  # take over the dead ranks' data: re-shard over the live set
            changed.clear()
            live = gossamer.live_ranks()
            images = train_set[0][live.index(rank) :: len(live)]
            labels = train_set[1][live.index(rank) :: len(live)]
            order, at = torch.randperm(len(labels), generator=generator), 0
        if at + args.batch_size > len(order):  # the next pass over this rank's shard
            order, at = torch.randperm(len(labels), generator=generator), 0
        batch = order[at : at + args.batch_size]
        at += args.batch_size
        opt.zero_grad()
        loss_fn(model(images[batch]), labels[batch]).backward()
        opt.step()
        schedule.step()
        opt.synchronize()  # this step's combine has landed: the step is complete
        history["step_done"].append(time.time())
        if step % args.eval_every == 0 or step == total - 1:
            history["acc"].append((time.time(), step, accuracy(model, test_images, test_labels)))
    store.set(f"{_KEY}{rank}", json.dumps(history))
    live = gossamer.live_ranks()
    if rank == min(live):
        histories = [json.loads(store.get(f"{_KEY}{r}")) for r in live]
        if args.no_kill:
            final = statistics.mean(h["acc"][-1][2] for h in histories)
            print(f"final test accuracy, mean over the {size} ranks: {100 * final:.2f}%")
        else:
            report(histories, store, args, kill_step)
    gossamer.shutdown()


def report(histories: list[dict], store, args: argparse.Namespace, kill_step: int) -> None:
    """Print recovery times and final accuracies; plot accuracy over time."""
    killed_at = float(store.get(f"{_KEY}killed_at"))
    start = min(h["start"] for h in histories)
    print(f"rank {args.victim} was killed at step {kill_step}, {killed_at - start:.2f} s in")
    for h in histories:
        done = h["step_done"]
        gaps = [(b - a, b) for a, b in itertools.pairwise(done)]
        before = [g for g, b in gaps if b < killed_at]
        stall = max((g for g, b in gaps if b > killed_at), default=float("nan"))
        # An asynchronous rank that never sent to the victim may finish before it hears.
        learned = h["changes"][0]["t"] if h["changes"] else killed_at
        heard = f"{learned - killed_at:.2f} s after the kill" if h["changes"] else "never"
        # the first step that completes once this rank trains among the survivors only
        resumed = next((t for t in done if t >= learned), float("nan"))
        print(
            f"rank {h['rank']}: learned of the death {heard}; next completed step "
            f"{resumed - killed_at:.2f} s after the kill; longest "
            f"step after the kill {stall:.2f} s (median before it "
            f"{1000 * statistics.median(before):.0f} ms); final test accuracy "
            f"{100 * h['acc'][-1][2]:.2f}%"
        )
    final = statistics.mean(h["acc"][-1][2] for h in histories)
    print(f"final test accuracy, mean over the {len(histories)} survivors: {100 * final:.2f}%")
    path = args.out / "elastic_digits.png"
    plot(histories, start, killed_at, path)
    print(f"wrote {path}")


def plot(histories: list[dict], start: float, killed_at: float, path: Path) -> None:
    """Accuracy over time per survivor, the kill and the membership changes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for h in histories:
        t = [a[0] - start for a in h["acc"]]
        line = ax.plot(t, [100 * a[2] for a in h["acc"]], marker=".", label=f"rank {h['rank']}")
        for change in h["changes"]:
            ax.axvline(change["t"] - start, color=line[0].get_color(), ls=":", lw=1)
    ax.axvline(killed_at - start, color="k", ls="--", label="victim killed")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("elastic gossip on digits (dotted: a survivor adopts the new live set)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="without a launcher")
    parser.add_argument("--victim", type=int, default=2, help="rank to kill (not with --no-kill)")
    parser.add_argument("--kill-at", type=float, default=0.4, help="fraction of the run")
    parser.add_argument("--epochs", type=_POSITIVE, default=5, help="of the starting world size")
    parser.add_argument("--steps", type=_POSITIVE, help="total steps (instead of --epochs)")
    parser.add_argument("--batch-size", type=_POSITIVE, default=16, help="per rank")
    parser.add_argument(
        "--lr",
        type=_checked(float, lambda r: math.isfinite(r) and r > 0, "finite, > 0"),
        default=3e-3,
    )
    parser.add_argument("--eval-every", type=_POSITIVE, default=5, help="steps between accuracies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the PNG")
    parser.add_argument("--no-kill", action="store_true", help="nobody dies (a reference)")
    parser.add_argument(
        "--optimizer", choices=["atc", "push_sum", "win_put"], default="atc", help="elastic"
    )
    args = parser.parse_args()
    launched = "RANK" in os.environ
    size = int(os.environ["WORLD_SIZE"]) if launched else args.world_size
    if not args.no_kill and not 0 <= args.victim < size:
        parser.error(f"--victim must be in [0, {size}); got {args.victim}")
    if not 0 < args.kill_at < 1:
        parser.error(f"--kill-at must be in (0, 1); got {args.kill_at}")
    check_steps(parser, args, size)
    if launched:
        train(args)
    else:
        sys.exit(spawn(args))


if __name__ == "__main__":
    main()
