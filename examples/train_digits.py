"""Decentralized training of a small CNN on scikit-learn's handwritten digits.

Run on 4 local ranks (any N works; with plain ``python`` it is a world of one)::

    gossamer run -np 4 examples/train_digits.py
    gossamer run -np 4 examples/train_digits.py --optimizer push_sum --topology one_peer

The data is scikit-learn's bundled digits set (1797 images of 8x8 pixels, read from the
file that ships inside the package: nothing is downloaded). A fixed-seed split keeps 20 % of
it for testing; every rank trains :class:`gossamer.models.SmallCNN` on its own shard of the
rest (rank ``r`` takes every ``n``-th example from ``r``) and only ever exchanges parameters
with its neighbours:

- ``atc`` (default): adapt-then-combine, a local Adam step, then averaging with the
  in-neighbours (``optim.AdaptThenCombine``);
- ``awc``: adapt-with-combine, the averaging overlaps the backward pass;
- ``gradient_allreduce``: the data-parallel baseline (all models stay identical);
- ``win_put`` and ``push_sum``: asynchronous, over one-sided windows;
- ``dcd``: adapt-then-combine whose averaging sends compressed differences (DCD-PSGD,
  Bagua's low-precision ring, ``communication="difference_gossip"``; 8-bit unless
  ``--compression`` says otherwise; ``--topology exponential`` only).

``--compression uint8`` (or ``topk:0.01``, ``qsgd:16``, ...) compresses what travels:
CHOCO-gossip for ``atc`` and ``awc``, a compressed allreduce with error feedback for
``gradient_allreduce``, compressed puts for ``win_put`` (``push_sum`` takes none).

``--topology exponential`` averages with all in-neighbours of the exponential-two graph
each step; ``one_peer`` with a single peer per step (the one-peer exponential schedule).
Rank 0 shows a progress bar and, per epoch, the mean training loss over ranks, the mean test
accuracy of the ranks' own models and their consensus distance (RMS distance from the
average model). At the end it reports the test accuracy of the ranks' models and of their
average, beside a single-process baseline: rank 0 trains the same model from the same
initial weights on the whole training set, with the same optimizer, learning-rate schedule
and batch size, for the same number of samples in total (so with ``n`` times the steps), after the
decentralized run (``--no-baseline`` skips it). ``<out>/train_digits.png`` shows the loss,
test accuracy and consensus distance per epoch.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import gossamer
from gossamer import compression, optim
from gossamer import topology as topo
from gossamer.communicators.powersgd import parse_powersgd
from gossamer.data import load_digits
from gossamer.models import SmallCNN

OPTIMIZERS = {
    "atc": optim.AdaptThenCombine,
    "awc": optim.AdaptWithCombine,
    "gradient_allreduce": optim.GradientAllreduce,
    "push_sum": optim.PushSum,
    "win_put": optim.WindowPut,
    "dcd": functools.partial(optim.AdaptThenCombine, communication="difference_gossip"),
}


def split(images, labels, test_fraction, seed):
    """A fixed-seed train/test split, the same on every rank."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = round(test_fraction * len(labels))
    test, train = order[:n_test], order[n_test:]
    return (images[train], labels[train]), (images[test], labels[test])


def accuracy(model, images, labels) -> float:
    """Fraction of ``images`` that ``model`` labels correctly; ``model`` is left unchanged.

    A model prepared for quantization-aware training (``compression.quantize_model``) is
    evaluated with its observers off: eval mode alone does not stop them, and the test
    images would move its quantization ranges. Those that were on are turned back on.
    """
    modules = dict(model.named_modules())
    quantizers = [modules[name] for name in compression.fake_quant_modules(model)]
    observing = [q for q in quantizers if q.observer_enabled[0]]
    for quantizer in observing:
        quantizer.disable_observer()
    model.eval()
    try:
        with torch.no_grad():
            correct = (model(images).argmax(dim=1) == labels).sum().item()
    finally:
        model.train()
        for quantizer in observing:
            quantizer.enable_observer()
    return correct / len(labels)


def make_model(seed: int) -> nn.Module:
    """SmallCNN with its lazy layer materialised, so its parameters can be broadcast."""
    torch.manual_seed(seed)
    model = SmallCNN()
    with torch.no_grad():
        model(torch.zeros(1, 1, 8, 8))
    return model


def train_baseline(initial, train, steps, args):
    """Rank 0 alone: the same model and optimizer on all the training data, ``steps`` steps."""
    model = make_model(args.seed)
    model.load_state_dict(initial)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    loss_fn = nn.CrossEntropyLoss()
    images, labels = train
    generator = torch.Generator().manual_seed(args.seed)
    order, at = torch.randperm(len(labels), generator=generator), 0
    for _ in range(steps):
        if at + args.batch_size > len(order):  # next pass over the data
            order, at = torch.randperm(len(labels), generator=generator), 0
        batch = order[at : at + args.batch_size]
        at += args.batch_size
        opt.zero_grad()
        loss_fn(model(images[batch]), labels[batch]).backward()
        opt.step()
        schedule.step()
    return model


def plot(history, title, path):
    """Write loss, test accuracy and consensus distance per epoch to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    epochs = range(1, len(history["loss"]) + 1)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].plot(epochs, history["loss"], marker=".")
    axes[0].set_ylabel("training loss (mean over ranks)")
    axes[1].plot(epochs, [100 * a for a in history["accuracy"]], marker=".")
    axes[1].set_ylabel("test accuracy, % (mean over ranks)")
    # Gradient allreduce keeps the models identical: a distance of exactly 0.
    axes[2].semilogy(epochs, [max(d, 1e-12) for d in history["consensus"]], marker=".")
    axes[2].set_ylabel("consensus distance")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _checked(kind, test, rule: str):
    """An argparse ``type=``: ``kind(text)``, refused unless ``test(value)`` ("must be rule")."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {rule}; got {text}")
        return value

    return parse


_POSITIVE = _checked(int, lambda n: n >= 1, ">= 1")


def check_compression(parser, spec: str, optimizer: str) -> None:
    """Refuse a ``--compression`` the library would refuse, before any rank starts."""
    try:
        powersgd = parse_powersgd(spec)
    except ValueError as err:
        parser.error(f"--compression: {err}")
    if powersgd is not None:  # torch's PowerSGD, a gradient hook, not a registered compressor
        if optimizer != "gradient_allreduce":
            parser.error(
                f"--compression {spec} (torch's PowerSGD) is for --optimizer "
                f"gradient_allreduce only; got --optimizer {optimizer}"
            )
        return
    try:
        compression.get_compressor(spec, argument="--compression")
    except ValueError as err:  # it names the option, the value and the valid forms
        parser.error(str(err))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="atc")
    parser.add_argument("--topology", choices=("exponential", "one_peer"), default="exponential")
    parser.add_argument("--epochs", type=_POSITIVE, default=15)
    parser.add_argument("--batch-size", type=_POSITIVE, default=16, help="per rank")
    parser.add_argument(
        "--lr", type=float, default=3e-3, help="Adam learning rate (cosine decay to 0)"
    )
    parser.add_argument(
        "--compression", default=None, help='compress what travels: "uint8", "topk:0.01", ...'
    )
    parser.add_argument(
        "--test-fraction", type=_checked(float, lambda f: 0 < f < 1, "in (0, 1)"), default=0.2
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="skip the 1-process run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the PNG")
    args = parser.parse_args()
    if args.compression is not None:
        check_compression(parser, args.compression, args.optimizer)
    if args.optimizer == "push_sum" and args.compression not in (None, "none"):
        parser.error(
            "--compression is not built for --optimizer push_sum (its puts must "
            "carry the mass exactly); use win_put, atc or awc"
        )
    if args.optimizer == "dcd" and args.topology != "exponential":
        # DifferenceGossip keeps a replica per in-neighbour, exact only while that
        # neighbour sends every step: a schedule that changes the peers would break them.
        parser.error(
            f"--topology {args.topology} is not built for --optimizer dcd (its replicas "
            "need a static graph); use --topology exponential"
        )

    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    train, (test_images, test_labels) = split(*load_digits(), args.test_fraction, args.seed)
    shard_images, shard_labels = train[0][rank::size], train[1][rank::size]
    # The synchronous optimizers need every rank to take the same number of steps.
    steps_per_epoch = len(train[1]) // (size * args.batch_size)
    n_train = len(train[1])
    problem = None  # nothing to train or to test on
    if len(test_labels) == 0 or n_train < size:
        problem = f"--test-fraction {args.test_fraction} leaves {len(test_labels)} test and "
        problem += f"{n_train} training images for {size} ranks"
    elif steps_per_epoch == 0:
        problem = f"--batch-size must be <= {n_train // size} ({n_train} training images over "
        problem += f"{size} ranks); got {args.batch_size}"
    if problem:
        gossamer.shutdown()
        parser.error(problem)

    model = make_model(args.seed)
    optim.broadcast_parameters(model.state_dict(), root_rank=0)  # one starting point
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    graph = topo.exponential_two(size)
    where = {}
    if args.optimizer != "gradient_allreduce":
        if args.topology == "one_peer":
            where["schedule"] = topo.one_peer_exponential(graph, rank)
        else:
            where["topology"] = graph
    base = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.compression is not None:
        where["compression"] = args.compression
    opt = OPTIMIZERS[args.optimizer](base, model, **where)
    # Cosine decay to 0: late steps are small, so the last epochs do not bounce around and
    # the ranks' models drift less apart (the consensus distance scales with the step).
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(base, args.epochs * steps_per_epoch)
    loss_fn = nn.CrossEntropyLoss()
    # What travels, as the optimizer built it: dcd compresses (uint8) even when not asked to.
    used = getattr(opt.communicator, "compressor", None) if args.optimizer == "dcd" else None
    shown = used.name if used is not None else args.compression or "none"
    if rank == 0:
        print(
            f"digits: {len(train[1])} train / {len(test_labels)} test images; {size} ranks x "
            f"{steps_per_epoch} steps x batch {args.batch_size} per epoch; {args.optimizer} "
            f"over {'one peer of ' if args.topology == 'one_peer' else ''}{graph.name}; "
            f"Adam lr {args.lr}; compression {shown}"
        )

    history = {"loss": [], "accuracy": [], "consensus": []}
    bar = tqdm(
        total=args.epochs * steps_per_epoch,
        disable=rank != 0 or args.no_progress,
        desc="train",
        unit="step",
        leave=False,
    )
    start = time.perf_counter()
    for epoch in range(args.epochs):
        generator = torch.Generator().manual_seed(args.seed * 10_000 + epoch * 100 + rank)
        order = torch.randperm(len(shard_labels), generator=generator)
        total = 0.0
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            opt.zero_grad()
            loss = loss_fn(model(shard_images[batch]), shard_labels[batch])
            loss.backward()
            opt.step()
            schedule.step()
            total += loss.item()
            bar.update()
        opt.synchronize()  # ATC's last combine is still in flight otherwise
        loss = gossamer.allreduce(torch.tensor([total / steps_per_epoch])).item()
        acc = gossamer.allreduce(torch.tensor([accuracy(model, test_images, test_labels)]))
        distance = optim.consensus_distance(model)
        history["loss"].append(loss)
        history["accuracy"].append(acc.item())
        history["consensus"].append(distance)
        if rank == 0:
            bar.write(
                f"epoch {epoch + 1:3d}/{args.epochs}  loss {loss:.4f}  test acc "
                f"{100 * acc.item():6.2f}%  consensus distance {distance:.3e}  "
                f"({time.perf_counter() - start:.1f} s)"
            )
    bar.close()
    if hasattr(opt, "free"):
        opt.free()  # the asynchronous optimizers' windows (collective)
    train_time = time.perf_counter() - start

    every = gossamer.allgather(torch.tensor([accuracy(model, test_images, test_labels)]))
    mean, worst = every.mean().item(), every.min().item()
    optim.allreduce_parameters(model)  # what one would deploy: the average model
    averaged = accuracy(model, test_images, test_labels)

    baseline = None
    if rank == 0 and size > 1 and not args.no_baseline:
        t0 = time.perf_counter()
        single = train_baseline(initial, train, size * args.epochs * steps_per_epoch, args)
        baseline = (accuracy(single, test_images, test_labels), time.perf_counter() - t0)
    gossamer.barrier()  # the other ranks wait here while rank 0 runs the baseline

    if rank == 0:
        print(
            f"final test accuracy {100 * mean:.2f}% (mean over ranks, worst {100 * worst:.2f}%)"
            f"; averaged model {100 * averaged:.2f}%; train time {train_time:.1f} s"
        )
        if baseline is not None:
            samples = size * args.epochs * steps_per_epoch * args.batch_size
            print(
                f"single-process baseline: test accuracy {100 * baseline[0]:.2f}% "
                f"({samples} samples seen, as above; {baseline[1]:.1f} s)"
            )
        path = args.out / "train_digits.png"
        plot(history, f"digits, {args.optimizer}, {size} ranks", path)
        print(f"wrote {path}")
    gossamer.shutdown()


if __name__ == "__main__":
    main()
