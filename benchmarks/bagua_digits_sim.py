"""Why weight averaging trails gradient allreduce on the Bagua digits example, without gossamer.

    python -m benchmarks.bagua_digits_sim --seed 1 [--lr 1.0] [--passes 1]

One process simulates ``examples/bagua_digits.py`` on 4 ranks with plain torch: the same
shards, batches of 16, Adadelta and schedule (``--passes`` reshuffled passes over each
shard per epoch, as the example's option, whose default there is 8). Gradient allreduce
is one Adadelta on the mean of the 4 gradients; decentralized
(``peer_selection_mode="all"``) averages the weights, then every rank takes its own
Adadelta step on its own 16-sample gradient (each rank's optimizer state stays its own,
as in Bagua). It prints the mean step lengths and both final test accuracies: the
averaged step is shorter than allreduce's, because the mean of steps that Adadelta
normalized separately partly cancels; more passes per epoch let both train to the end.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "bagua_digits.py"
RANKS, BATCH, EPOCHS, GAMMA = 4, 16, 14, 0.7


def _example():
    spec = importlib.util.spec_from_file_location("bagua_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _accuracy(model: torch.nn.Module, test) -> float:
    model.eval()
    images, labels = test.tensors
    with torch.no_grad():
        return (model(images).argmax(1) == labels).float().mean().item()


def _passes(samplers, loaders, epoch: int, passes: int):
    """Yield the 4 ranks' batches of ``passes`` reshuffled passes over their shards."""
    for p in range(passes):
        for sampler in samplers:
            sampler.set_epoch(epoch * passes + p)
        yield from zip(*loaders, strict=True)


def _positive_float(text: str) -> float:
    """An argparse ``type=``: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be finite, > 0; got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lr", type=_positive_float, default=1.0)
    parser.add_argument("--passes", type=int, default=1, help="passes over the shard per epoch")
    args = parser.parse_args()
    if args.passes < 1:
        parser.error(f"--passes must be >= 1; got {args.passes}")
    torch.set_num_threads(1)
    ex = _example()
    train, test = ex.datasets(args.seed)
    samplers = [
        torch.utils.data.distributed.DistributedSampler(
            train, num_replicas=RANKS, rank=r, seed=args.seed
        )
        for r in range(RANKS)
    ]
    loaders = [torch.utils.data.DataLoader(train, sampler=s, batch_size=BATCH) for s in samplers]
    torch.manual_seed(args.seed)
    start = ex.Net()
    allreduce = copy.deepcopy(start)
    ar_opt = torch.optim.Adadelta(allreduce.parameters(), lr=args.lr)
    models = [copy.deepcopy(start) for _ in range(RANKS)]
    opts = [torch.optim.Adadelta(m.parameters(), lr=args.lr) for m in models]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, GAMMA) for o in [ar_opt, *opts]]
    ar_steps, avg_steps, rank_steps = [], [], []
    for epoch in range(1, EPOCHS + 1):
        for batches in _passes(samplers, loaders, epoch, args.passes):
            before = _flat(allreduce)
            ar_opt.zero_grad()
            for r, (x, y) in enumerate(batches):
                torch.manual_seed(1000 * epoch + r)  # the same dropout draws in both
                allreduce.train()
                (F.nll_loss(allreduce(x), y) / RANKS).backward()
            ar_opt.step()
            ar_steps.append((_flat(allreduce) - before).norm().item())
            with torch.no_grad():
                mean = torch.stack([_flat(m) for m in models]).mean(0)
                for m in models:
                    torch.nn.utils.vector_to_parameters(mean.clone(), m.parameters())
            deltas = []
            for r, ((x, y), m, opt) in enumerate(zip(batches, models, opts, strict=True)):
                torch.manual_seed(1000 * epoch + r)
                m.train()
                opt.zero_grad()
                F.nll_loss(m(x), y).backward()
                opt.step()
                deltas.append(_flat(m) - mean)
            avg_steps.append(torch.stack(deltas).mean(0).norm().item())
            rank_steps.append(statistics.mean(d.norm().item() for d in deltas))
        for scheduler in schedulers:
            scheduler.step()
    ar, avg, rank = (statistics.mean(v) for v in (ar_steps, avg_steps, rank_steps))
    print(f"seed {args.seed}, lr {args.lr}, {len(ar_steps)} steps")
    print(f"mean step length: allreduce {ar:.4f}, decentralized {avg:.4f} ({avg / ar:.2f}x)")
    print(f"decentralized: the mean of 4 rank steps is {avg / rank:.2f}x one rank's step")
    print(
        f"test accuracy: allreduce {_accuracy(allreduce, test):.4f}, "
        f"decentralized {_accuracy(models[0], test):.4f}"
    )


if __name__ == "__main__":
    main()
