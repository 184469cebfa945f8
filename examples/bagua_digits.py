"""Bagua's MNIST example, ported to scikit-learn's digits and run by ``gossamer.bagua``.

Run on 4 local ranks (any N works; with plain ``python`` it is a world of one)::

    gossamer run -np 4 examples/bagua_digits.py --algorithm bytegrad
    python -m gossamer.launcher run -np 4 examples/bagua_digits.py --algorithm async

``--algorithm`` is one of ``gradient_allreduce`` (default), ``bytegrad``, ``decentralized``,
``low_precision_decentralized``, ``qadam`` and ``async``, as in Bagua's
``examples/mnist/main.py``; the program is Bagua's with four changes: the import
(``import gossamer.bagua as bagua``), the data (scikit-learn's bundled 8x8 digits, 1797
images read from the file inside the package, nothing downloaded, a fixed 80/20 split),
the network's first dense layer (sized for 8x8 inputs) and the length of an epoch. An
MNIST epoch is 938 steps, a pass over the digits 23 (batch 64); an epoch here is
``--passes`` reshuffled passes (default 8: 184 steps, 2576 in all), so that the schedule
(learning rate decayed 0.7x per epoch) trains to the end. With ``--passes 1`` (322
steps) every algorithm stops short, the weight-averaging ones about 2 points below
gradient allreduce (docs/bagua-migration.md has both). It runs on CPU (gloo) and, where
CUDA is available, on the rank's GPU (NCCL). Every rank trains on its
``DistributedSampler`` shard with a per-rank batch of ``--batch-size / world size``; rank 0
prints the test loss and accuracy of its model after every epoch, and at the end the test
accuracy of every rank's model (decentralized and asynchronous algorithms leave them
slightly different). Dropout draws differ between ranks (Bagua's example seeds CUDA with
``666 + rank``); QAdam takes its own ``--qadam-lr`` (default 1e-3, Adam's usual: Bagua's
example passes it Adadelta's 1.0, which is no learning rate for Adam) and
``--qadam-warmup-steps`` (default a fifth of the steps, as Bagua's QAdam tutorial advises:
after the warm-up the second moment is frozen, and with 60 warm-up steps of 2576 seed 1
diverged).

On one host, Bagua's default ``hierarchical=True`` (ByteGrad, both decentralized
algorithms, QAdam) averages exactly inside the machine, so nothing is compressed or
gossiped; ``GOSSAMER_NODES_PER_MACHINE=1`` makes every rank a machine::

    GOSSAMER_NODES_PER_MACHINE=1 gossamer run -np 4 examples/bagua_digits.py --algorithm qadam
"""

from __future__ import annotations

import argparse
import logging
import math
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR

import gossamer.bagua as bagua
from gossamer import data as gossamer_data

ALGORITHMS = (
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "qadam",
    "async",
)


class Net(nn.Module):
    """Bagua's MNIST network with ``fc1`` sized for 8x8 images (64 x 2 x 2 features)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the 10 classes."""
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The digits as ``(images (1797, 1, 8, 8), labels)``, normalized like Bagua's MNIST."""
    images, labels = gossamer_data.load_digits()
    return (images - images.mean()) / images.std(), labels


def datasets(seed: int) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """A fixed 80/20 train/test split, the same on every rank."""
    images, labels = load_digits()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test, train = order[: len(order) // 5], order[len(order) // 5 :]
    return (
        torch.utils.data.TensorDataset(images[train], labels[train]),
        torch.utils.data.TensorDataset(images[test], labels[test]),
    )


def train(args, model, train_loader, optimizer, epoch, device) -> None:
    """One epoch over this rank's shard (Bagua's ``train``)."""
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            logging.info(
                "Train Epoch: %d [%d/%d (%.0f%%)]\tLoss: %.6f",
                epoch,
                batch_idx * len(data),
                len(train_loader.sampler),
                100.0 * batch_idx / len(train_loader),
                loss.item(),
            )


def test(model, test_loader, device) -> tuple[float, float]:
    """Test loss and accuracy of this rank's model (Bagua's ``test``)."""
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    n = len(test_loader.dataset)
    logging.info(
        "Test set: Average loss: %.4f, Accuracy: %d/%d (%.1f%%)",
        test_loss / n,
        correct,
        n,
        100.0 * correct / n,
    )
    return test_loss / n, correct / n


def make_algorithm(args, model):
    """The optimizer and the Bagua algorithm that ``--algorithm`` names."""
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    if args.algorithm == "gradient_allreduce":
        from gossamer.bagua.algorithms import gradient_allreduce

        algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
    elif args.algorithm == "decentralized":
        from gossamer.bagua.algorithms import decentralized

        algorithm = decentralized.DecentralizedAlgorithm()
    elif args.algorithm == "low_precision_decentralized":
        from gossamer.bagua.algorithms import decentralized

        algorithm = decentralized.LowPrecisionDecentralizedAlgorithm()
    elif args.algorithm == "bytegrad":
        from gossamer.bagua.algorithms import bytegrad

        algorithm = bytegrad.ByteGradAlgorithm()
    elif args.algorithm == "qadam":
        from gossamer.bagua.algorithms import q_adam

        optimizer = q_adam.QAdamOptimizer(
            model.parameters(), lr=args.qadam_lr, warmup_steps=args.qadam_warmup_steps
        )
        algorithm = q_adam.QAdamAlgorithm(optimizer)
    elif args.algorithm == "async":
        from gossamer.bagua.algorithms import async_model_average

        algorithm = async_model_average.AsyncModelAverageAlgorithm(
            sync_interval_ms=args.async_sync_interval
        )
    else:
        raise NotImplementedError(args.algorithm)
    return optimizer, algorithm


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


def main() -> None:
    parser = argparse.ArgumentParser(description="Bagua's MNIST example on the digits")
    parser.add_argument("--batch-size", type=_POSITIVE, default=64, help="over all ranks")
    parser.add_argument("--test-batch-size", type=_POSITIVE, default=1000)
    parser.add_argument("--epochs", type=_POSITIVE, default=14)
    parser.add_argument(
        "--passes",
        type=_POSITIVE,
        default=8,
        help="passes over the shard per epoch (MNIST is longer)",
    )
    parser.add_argument("--lr", type=float, default=1.0, help="Adadelta learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning-rate decay per epoch")
    parser.add_argument("--log-interval", type=_POSITIVE, default=10)
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="gradient_allreduce")
    parser.add_argument("--async-sync-interval", type=int, default=500, help="ms, for async")
    parser.add_argument("--qadam-lr", type=float, default=1e-3, help="QAdam learning rate")
    parser.add_argument(
        "--qadam-warmup-steps", type=int, default=None, help="default: a fifth of the steps"
    )
    parser.add_argument("--set-deterministic", action="store_true")
    parser.add_argument("--seed", type=int, default=666)
    args = parser.parse_args()

    if args.set_deterministic:
        np.random.seed(args.seed)
        random.seed(args.seed)
        torch.use_deterministic_algorithms(True)
    # Same initial weights everywhere; with_bagua broadcasts rank 0's anyway.
    torch.manual_seed(args.seed)

    if torch.cuda.is_available():
        torch.cuda.set_device(bagua.get_local_rank())
    bagua.init_process_group()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    )
    torch.set_num_threads(1)  # ranks share the machine's cores

    logging.basicConfig(format="%(levelname)s:%(message)s", level=logging.ERROR)
    if bagua.get_rank() == 0:
        logging.getLogger().setLevel(logging.INFO)

    train_set, test_set = datasets(args.seed)
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=bagua.get_world_size(), rank=bagua.get_rank(), seed=args.seed
    )
    train_loader = torch.utils.data.DataLoader(
        train_set, sampler=sampler, batch_size=max(args.batch_size // bagua.get_world_size(), 1)
    )
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size)
    steps = args.epochs * args.passes * len(train_loader)
    if args.qadam_warmup_steps is None:
        args.qadam_warmup_steps = steps // 5

    model = Net().to(device)
    # Dropout draws from here on: a different stream on every rank, as Bagua's example
    # gets from seeding CUDA with 666 + rank (identical masks would correlate the ranks).
    torch.manual_seed(args.seed + bagua.get_rank())
    optimizer, algorithm = make_algorithm(args, model)
    model = model.with_bagua([optimizer], algorithm)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    accuracy, loss = 0.0, 0.0
    for epoch in range(1, args.epochs + 1):
        if args.algorithm == "async":
            model.bagua_algorithm.resume(model)
        for p in range(args.passes):  # a fresh shuffle each pass
            sampler.set_epoch(epoch * args.passes + p)
            train(args, model, train_loader, optimizer, epoch, device)
        if args.algorithm == "async":
            model.bagua_algorithm.abort(model)
        loss, accuracy = test(model, test_loader, device)
        scheduler.step()
    if args.algorithm == "qadam" and not math.isfinite(loss):
        # Bagua's QAdam freezes Adam's second moment after the warm-up: an entry still
        # zero then (a unit not yet active) divides its update by eps, and the run diverges.
        logging.warning(
            "QAdam diverged on rank %d (test loss %s): %d warm-up steps of %d are too few to "
            "estimate the second moment it then freezes; give --qadam-warmup-steps more",
            bagua.get_rank(),
            loss,
            args.qadam_warmup_steps,
            steps,
        )

    # Every rank's final accuracy, gathered on all (decentralized models differ slightly).
    mine = torch.tensor([accuracy], device=device)
    every = torch.zeros(bagua.get_world_size(), device=device)
    bagua.allgather(mine, every)
    if bagua.get_rank() == 0:
        print(
            f"{args.algorithm}: {bagua.get_world_size()} ranks x {steps} steps; test accuracy "
            f"per rank {', '.join(f'{a:.4f}' for a in every.tolist())}; "
            f"mean {every.mean().item():.4f}"
        )


if __name__ == "__main__":
    main()
