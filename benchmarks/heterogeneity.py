"""Skewed data and uneven devices: accuracy, bytes and pace of the skew-aware methods.

    python -m benchmarks.heterogeneity --quick     # ~3 min on 2 cores: launches 8 ranks
    python -m benchmarks.heterogeneity             # the full run (~15 min on 2 cores)

Run from the repository root; the script starts its own job of ``--ranks`` ranks with the
gossamer launcher (``gossamer run -np 8 -m benchmarks.heterogeneity --worker ...``), and
that one job runs every configuration in turn (process start costs more than a
configuration on a small machine).

Every configuration trains the same MLP (64-64-64-10, identical initial weights) on
scikit-learn's bundled digits (:func:`gossamer.data.load_digits`, a fixed 20 % test split),
each rank on its own part of the training set, with SGD (momentum 0.9), ``--batch`` images
per rank per step, for ``--steps`` steps (250; ``--quick``: 64 steps, ring only). The
training set is split three ways (:mod:`gossamer.data`): IID, Dirichlet(0.1) label skew,
and 2 classes per rank. The methods (:data:`METHODS`):

- ``atc``: adapt-then-combine on the graph (``ring`` or ``exp2``), every step
  (``--atc-period``: every that many steps);
- ``allreduce``: gradient allreduce, the centralized reference;
- ``d-cliques``: ATC on a D-Cliques graph built from the label histograms (cliques of 4);
- ``clumping``: ATC on a peer-clumping graph (degree 2, label histograms as the proxy);
- ``skewscout``: ATC on the graph, its period tuned by SkewScout (probe every 20 steps,
  threshold 10 points of accuracy loss, drift threshold 150, period 1 to 16), each rank
  probing on 64 of its images;
- ``fedhisyn``: groups by step time, ring inside each group, global average every 8 steps
  of the slow group (the fast group takes proportionally more steps). The step times are
  the simulated devices' (``--fedhisyn-speeds given``, the default: on a shared 2-core
  machine the contention between 8 ranks swamps a few milliseconds of simulated slowness)
  or timed over 10 local steps (``measured``);
- ``cocofl``: the slow ranks freeze the first layer and run it in int8 (they are not made
  faster for it: the simulated delay stays), averaging on the graph every step;
- ``clique-avg``, ``ngc``, ``compngc``, ``dacfl`` (evaluated at its tracked average,
  correction gain ``--dacfl-correction``), ``ngo``:
  the other skew optimizers, when built (skipped with a line saying so otherwise; their
  bytes are not counted where they send more than one model per neighbour per round).

Graphs (``--graphs``): ``ring``, ``exp2`` and ``onepeer``, a time-varying graph (exp-2 walked
by the one-peer exponential schedule: one peer per round, shift 1, 2, 4, ...), on which only
``atc``, ``skewscout`` and ``dacfl`` run.

Uneven devices: every rank sleeps ``--delay-ms`` per step, the odd ranks twice that (they
are 2x slower; ``--slow-every K``: ranks K-1, 2K-1, ..., so ``4`` makes a quarter of them
slow), in every configuration, so the synchronous methods run at the slow ranks'
pace and samples/s compare like with like.

Reported per configuration: the final test accuracy (mean over ranks of each rank's own
model), the gap to the same method on the IID split (points), the final accuracy of the
network's average model (every rank's parameters averaged; no method deploys it, but it
separates drift between the ranks from a worse mean), the bytes each rank sent
(mean over ranks; counted from the rounds taken: a neighbour round sends the model to
every out-neighbour, an allreduce of M bytes counts 2(n-1)/n*M as a ring allreduce does),
and samples/s (all ranks' samples over the slowest rank's training time; evaluation
excluded). Writes ``results/heterogeneity/{results.json,table.md,accuracy.png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import gossamer
from gossamer import compression, data, optim
from gossamer import topology as topo
from gossamer.models import MLP

DRIFT_THRESHOLD = 150.0  # SkewScout's drift threshold (see --skewscout-drift-threshold)
PARTITIONS = ("iid", "dirichlet-0.1", "2-classes")
GRAPHS = ("ring", "exp2", "onepeer")  # onepeer: the one-peer exponential schedule on exp2
DEFAULT_GRAPHS = ("ring", "exp2")
# methods of the other skew optimizers: (module, class) that must exist for them to run
LATER = {
    "clique-avg": ("gossamer.optim", "CliqueAveraging"),
    "ngc": ("gossamer.optim", "NGC"),
    "compngc": ("gossamer.optim", "CompNGC"),
    "dacfl": ("gossamer.optim", "DACFL"),
    "ngo": ("gossamer.communicators", "NonlinearGossip"),
}


@dataclass
class Setup:
    """What one configuration's builder sees (the same on every rank)."""

    rank: int
    size: int
    graph: topo.Topology | None
    partition: data.Partition
    histograms: np.ndarray
    probe: tuple[torch.Tensor, torch.Tensor]
    slow: bool
    args: argparse.Namespace
    dynamic: bool = False  # graph is exp2 walked by the one-peer exponential schedule

    def mixing(self) -> dict:
        """The optimizer's keyword for the graph: a static topology or a fresh schedule."""
        if self.dynamic:
            return {"schedule": topo.one_peer_exponential(self.graph, self.rank)}
        return {"topology": self.graph}


@dataclass
class Method:
    """A row of the method table: how to build it and how to count its bytes."""

    build: Callable[[nn.Module, torch.optim.Optimizer, Setup], object]
    on_graph: bool  # runs once per graph (else once per partition, on its own graph)
    needs: tuple[str, str] | None = None  # (module, class) that may not be built yet
    closure: bool = False  # step(closure) computes the loss; the loop does no backward
    counted: bool = True  # whether _sent_bytes knows this method's traffic
    dynamic: bool = False  # whether it runs on the time-varying "onepeer" graph


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        value = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return value


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(64, 64, 10, depth=2)


# ---------------------------------------------------------------- builders
def _atc(model, base, s):
    period = s.args.atc_period
    return optim.AdaptThenCombine(base, model, num_steps_per_communication=period, **s.mixing())


def _allreduce(model, base, s):
    return optim.GradientAllreduce(base, model)


def _d_cliques(model, base, s):
    cliques = topo.d_cliques(s.histograms, clique_size=4, seed=s.args.seed)
    return optim.AdaptThenCombine(base, model, topology=cliques.topology)


def _clumping(model, base, s):
    features = s.histograms / s.histograms.sum(axis=1, keepdims=True)
    clumps = topo.peer_clumping(features, degree=min(2, s.size - 1), seed=s.args.seed)
    return optim.AdaptThenCombine(base, model, topology=clumps.topology)


def _skewscout(model, base, s):
    atc = optim.AdaptThenCombine(base, model, **s.mixing())
    x, y = s.probe
    control = optim.PeriodController(
        threshold=s.args.skewscout_threshold,
        drift_threshold=s.args.skewscout_drift_threshold or None,
        min_period=1,
        max_period=s.args.skewscout_max_period,
        hysteresis=s.args.skewscout_hysteresis,
    )
    return optim.SkewScout(
        atc, lambda m: _accuracy(m, x, y), controller=control, probe_every=s.args.probe_every
    )


def _fedhisyn(model, base, s):
    if s.args.fedhisyn_speeds == "measured" or not s.args.delay_ms:
        return optim.FedHiSyn(base, model, num_groups=2, interval=8, calibration_steps=10)
    # The simulated device's step time: on a loaded machine, contention swamps a few ms.
    step_time = s.args.delay_ms * (2 if s.slow else 1) / 1000
    return optim.FedHiSyn(base, model, num_groups=2, interval=8, step_time=step_time)


def _cocofl(model, base, s):
    # MLP = Sequential(Flatten, Linear, ReLU, Linear, ReLU, Linear): "1" is the first layer.
    return optim.CoCoFL(base, model, frozen=["1"], constrained=s.slow, topology=s.graph)


def _built(needs: tuple[str, str]) -> object | None:
    module, name = needs
    return getattr(importlib.import_module(module), name, None)


def _clique_averaging(model, base, s):
    cliques = topo.d_cliques(s.histograms, clique_size=4, seed=s.args.seed)
    return _built(LATER["clique-avg"])(base, model, cliques)


def _undirected(name):
    """The graph made undirected, with Metropolis-Hastings weights (a ring is unchanged).

    NGC sends cross-gradients back along every edge.
    """

    def build(model, base, s):
        adjacency = s.graph.adjacency
        graph = topo.metropolis_hastings_weights((adjacency + adjacency.T) > 0)
        extra = {"compression": s.args.compngc_compression} if name == "compngc" else {}
        return _built(LATER[name])(base, model, topology=graph, **extra)

    return build


def _dacfl(model, base, s):
    """DACFL on the graph as it is (directed exp-2, the one-peer schedule: its gain < 1)."""
    return _built(LATER["dacfl"])(base, model, correction=s.args.dacfl_correction, **s.mixing())


def _ngo(model, base, s):
    gossip = _built(LATER["ngo"])(s.graph, power=s.args.ngo_power, step_size=s.args.ngo_step_size)
    return optim.AdaptThenCombine(base, model, communicator=gossip)


METHODS: dict[str, Method] = {
    "atc": Method(_atc, True, dynamic=True),
    "allreduce": Method(_allreduce, False),
    "d-cliques": Method(_d_cliques, False),
    "clumping": Method(_clumping, False),
    "skewscout": Method(_skewscout, True, dynamic=True),
    "fedhisyn": Method(_fedhisyn, False),
    "cocofl": Method(_cocofl, True),
    # the other skew optimizers; bytes of the first three are not counted (they also send
    # gradients or cross-gradients, which the round count here does not see)
    "clique-avg": Method(_clique_averaging, False, LATER["clique-avg"], counted=False),
    "ngc": Method(_undirected("ngc"), True, LATER["ngc"], closure=True, counted=False),
    "compngc": Method(_undirected("compngc"), True, LATER["compngc"], closure=True, counted=False),
    "dacfl": Method(_dacfl, True, LATER["dacfl"], dynamic=True),
    "ngo": Method(_ngo, True, LATER["ngo"]),
}


# ---------------------------------------------------------------- bytes
def _model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _allreduce_bytes(nbytes: int, size: int) -> float:
    return 2 * (size - 1) / size * nbytes


def _sent_bytes(opt: object, model: nn.Module, size: int, rank: int) -> float:
    """This rank's bytes sent, counted from the rounds the optimizer took (see the module)."""
    mb = _model_bytes(model)
    if isinstance(opt, optim.SkewScout):
        return _sent_bytes(opt.inner, model, size, rank) + opt.probe_bytes
    if isinstance(opt, optim.CoCoFL):
        per = (
            _allreduce_bytes(mb, size) if opt.topology is None else mb * _degree(opt.topology, rank)
        )
        return opt.rounds * per
    if isinstance(opt, optim.GradientAllreduce):
        return opt.communicator.rounds * _allreduce_bytes(mb, size)
    if isinstance(opt, optim.DecentralizedOptimizer):
        comm = opt.communicator
        every = comm.global_average_every
        total = comm.rounds
        global_rounds = total // every if every else 0
        if getattr(comm, "schedule", None) is not None:  # the one-peer schedule: one per round
            degree = 0 if comm.step is None else len(comm.step.send_ranks)
        else:
            degree = _degree(getattr(comm, "topology", None) or gossamer.get_topology(), rank)
        sent = (total - global_rounds) * mb * degree
        sent += global_rounds * _allreduce_bytes(mb, size)
        if isinstance(opt, optim.FedHiSyn) and opt.groups is not None and opt.calibration_steps:
            sent += _allreduce_bytes(mb, size)  # the average that ends calibration
        return sent
    return float("nan")  # a method this table does not know how to count


def _degree(graph: topo.Topology, rank: int) -> int:
    return len(graph.out_neighbors(rank))


# ---------------------------------------------------------------- training
class Clock:
    """Training time of this rank, without evaluation; the job's pace is the slowest's."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self._start


class Batches:
    """This rank's batches: reshuffled passes over its part, the same for every method."""

    def __init__(self, part: np.ndarray, batch: int, seed: int) -> None:
        self.part, self.batch = torch.tensor(part), batch
        self.generator = torch.Generator().manual_seed(seed)
        self.order, self.at = self._shuffle(), 0

    def _shuffle(self) -> torch.Tensor:
        return self.part[torch.randperm(len(self.part), generator=self.generator)]

    def next(self) -> torch.Tensor:
        """The next batch of indices."""
        if self.at + self.batch > len(self.order):
            self.order, self.at = self._shuffle(), 0
        self.at += self.batch
        return self.order[self.at - self.batch : self.at]


def _steps(opt, model, batches, train, count, s, loss_fn, closure=False) -> None:
    x, y = train
    delay = s.args.delay_ms / 1000 * (2 if s.slow else 1)
    for _ in range(count):
        index = batches.next()
        opt.zero_grad()
        if closure:  # NGC evaluates the loss at several models itself
            opt.step(lambda index=index: loss_fn(model(x[index]), y[index]))
        else:
            loss_fn(model(x[index]), y[index]).backward()
            opt.step()
        if delay:
            time.sleep(delay)  # the simulated device: the slow ranks are 2x slower


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _evaluate(opt, model, test) -> float:
    """Mean test accuracy over ranks of the model each rank would deploy.

    That is the model itself, or the tracked average model of an optimizer that keeps one
    (DACFL's ``averaged()``).
    """
    averaged = getattr(opt, "averaged", None)
    with averaged() if callable(averaged) else contextlib.nullcontext():
        return _mean(_accuracy(model, *test))


def _average_model_accuracy(model: nn.Module, test) -> float:
    """Test accuracy of the network's average model (the ranks' parameters averaged)."""
    params = list(model.parameters())
    own = [p.detach().clone() for p in params]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    try:
        return _accuracy(model, *test)
    finally:
        with torch.no_grad():
            for p, value in zip(params, own, strict=True):
                p.copy_(value)


def run_one(name: str, method: Method, s: Setup, train, test) -> dict:
    """Train one configuration; the same row on every rank."""
    args = s.args
    model = _model(args.seed)
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = method.build(model, base, s)
    loss_fn = nn.CrossEntropyLoss()
    batches = Batches(s.partition.part(s.rank), args.batch, seed=1000 * args.seed + s.rank)
    clock, curve, samples = Clock(), [], 0
    if isinstance(opt, optim.FedHiSyn):
        # Calibration steps, then rounds: the slow group's `interval` steps, x-axis = its steps.
        with clock:
            _steps(opt, model, batches, train, opt.calibration_steps, s, loss_fn)
        samples += opt.calibration_steps * args.batch
        done, per_eval = opt.calibration_steps, max(1, args.eval_every // opt.interval)
        while done + opt.interval <= args.steps:
            rounds = min(per_eval, (args.steps - done) // opt.interval)
            with clock:
                _steps(opt, model, batches, train, rounds * opt.steps_per_round, s, loss_fn)
                opt.synchronize()
            samples += rounds * opt.steps_per_round * args.batch
            done += rounds * opt.interval
            curve.append((done, _evaluate(opt, model, test)))
        if not curve:  # --steps shorter than calibration and one round
            curve.append((done, _evaluate(opt, model, test)))
    else:
        done = 0
        while done < args.steps:
            count = min(args.eval_every, args.steps - done)
            with clock:
                _steps(opt, model, batches, train, count, s, loss_fn, method.closure)
                opt.synchronize()
            samples += count * args.batch
            done += count
            curve.append((done, _evaluate(opt, model, test)))
    averaged = getattr(opt, "averaged", None)
    with averaged() if callable(averaged) else contextlib.nullcontext():
        average_accuracy = _average_model_accuracy(model, test)
    sent = _mean(_sent_bytes(opt, model, s.size, s.rank)) if method.counted else float("nan")
    seconds = _max(clock.seconds)
    total_samples = _mean(samples) * s.size
    row = {
        "method": name,
        "accuracy": curve[-1][1],
        "average_model_accuracy": average_accuracy,
        "curve": curve,
        "bytes_per_rank": sent,
        "samples_per_s": total_samples / seconds,
        "train_seconds": seconds,
    }
    if isinstance(opt, optim.SkewScout):
        row["periods"] = [p for _, p in opt.controller.history]
        row["drifts"] = [round(d, 1) for d in opt.controller.drifts]
        row["losses"] = [round(x, 3) for x, _ in opt.controller.history]
    if isinstance(opt, optim.FedHiSyn):
        row["groups"] = [list(g) for g in opt.groups]
    close = getattr(opt, "close", None)
    if close is not None:
        close()
    return row


def _partition(kind: str, labels: torch.Tensor, size: int, seed: int) -> data.Partition:
    if kind == "iid":
        return data.iid(labels, size, seed=seed)
    if kind == "dirichlet-0.1":
        return data.dirichlet(labels, size, alpha=0.1, seed=seed)
    return data.shards(labels, size, classes_per_part=2, seed=seed)


def _split(seed: int):
    x, y = data.load_digits(flatten=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[: len(y) // 5], order[len(y) // 5 :]
    return (x[train], y[train]), (x[test], y[test])


def worker(args: argparse.Namespace) -> None:
    """One rank of the job: every configuration in turn; rank 0 reports."""
    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    args.ranks = size  # what the report says (a plain `python` run is a world of one)
    train, test = _split(args.seed)
    graphs = {"ring": topo.ring(size), "exp2": topo.exponential_two(size)}
    graphs["onepeer"] = graphs["exp2"]
    rows: list[dict] = []
    say = print if rank == 0 else (lambda *a, **k: None)
    methods = [m for m in args.methods if m in METHODS]
    _warm_up(rank, size, graphs, train, test, args)
    for kind in args.partitions:
        partition = _partition(kind, train[1], size, args.seed)
        histograms = data.label_histograms(partition, train[1], num_classes=10)
        skew = data.skew(partition, train[1]).mean
        say(f"--- partition {kind}: skew {skew:.2f}, part sizes {partition.sizes.tolist()}")
        part = torch.tensor(partition.part(rank))
        probe_index = part[torch.randperm(len(part), generator=torch.Generator().manual_seed(7))]
        probe = (train[0][probe_index[:64]], train[1][probe_index[:64]])
        for name in methods:
            method = METHODS[name]
            if method.needs is not None and _built(method.needs) is None:
                where = ".".join(method.needs)
                say(f"{name:10s} not built yet ({where} is missing): skipped")
                continue
            for graph_name in args.graphs if method.on_graph else ("own",):
                if graph_name == "onepeer" and not method.dynamic:
                    say(f"{name:10s} onepeer: runs on static graphs only, skipped")
                    continue
                s = Setup(
                    rank,
                    size,
                    graphs.get(graph_name),
                    partition,
                    histograms,
                    probe,
                    slow=rank % args.slow_every == args.slow_every - 1,
                    args=args,
                    dynamic=graph_name == "onepeer",
                )
                try:
                    row = run_one(name, method, s, train, test)
                except TypeError as err:
                    if method.needs is None:
                        raise
                    # every rank fails alike (same arguments), so the job stays in step
                    say(f"{name:10s} built but not wired here ({err}): skipped")
                    break
                row.update(partition=kind, graph=graph_name, skew=skew)
                rows.append(row)
                say(
                    f"{name:10s} {graph_name:5s} acc {100 * row['accuracy']:6.2f}%  "
                    f"{row['bytes_per_rank'] / 1e6:8.2f} MB/rank  "
                    f"{row['samples_per_s']:8.0f} samples/s"
                    + (f"  periods {row['periods']}" if "periods" in row else "")
                    + (f"  groups {row['groups']}" if "groups" in row else "")
                )
    if rank == 0:
        report(rows, args)
    gossamer.shutdown()


def _warm_up(rank, size, graphs, train, test, args) -> None:
    """A few untimed steps on every graph: gloo opens its connections on first use."""
    partition = data.iid(train[1], size, seed=args.seed)
    quick = argparse.Namespace(**{**vars(args), "steps": 4, "eval_every": 4, "delay_ms": 0})
    for graph in graphs.values():
        s = Setup(rank, size, graph, partition, np.ones((size, 10)), test, False, quick)
        run_one("warm-up", METHODS["atc"], s, train, test)
    s = Setup(rank, size, None, partition, np.ones((size, 10)), test, False, quick)
    run_one("warm-up", METHODS["allreduce"], s, train, test)


# ---------------------------------------------------------------- report
def _with_gaps(rows: list[dict]) -> list[dict]:
    iid = {(r["method"], r["graph"]): r["accuracy"] for r in rows if r["partition"] == "iid"}
    for r in rows:
        base = iid.get((r["method"], r["graph"]))
        r["gap_to_iid"] = None if base is None else 100 * (r["accuracy"] - base)
    return rows


def _slow_ranks(args: argparse.Namespace) -> str:
    k = args.slow_every
    return "odd ranks" if k == 2 else f"ranks {k - 1}, {2 * k - 1}, ... (1 in {k})"


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    """The table of results, ready to paste into docs/heterogeneity.md."""
    lines = [
        f"{args.ranks} ranks, digits, MLP 64-64-64-10, SGD(momentum 0.9, lr {args.lr}), batch "
        f"{args.batch}/rank, {args.steps} steps, {_slow_ranks(args)} 2x slower ({args.delay_ms} / "
        f"{2 * args.delay_ms} ms sleep per step){', --quick' if args.quick else ''}.",
        "",
        "| partition | method | graph | final accuracy | gap to IID (points) | "
        "average model | MB sent per rank | samples/s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gap = "" if r["gap_to_iid"] is None else f"{r['gap_to_iid']:+.1f}"
        gap = "ref" if r["partition"] == "iid" else gap
        sent = "n/c" if np.isnan(r["bytes_per_rank"]) else f"{r['bytes_per_rank'] / 1e6:.2f}"
        average = r.get("average_model_accuracy")
        average = "" if average is None else f"{100 * average:.1f}%"
        lines.append(
            f"| {r['partition']} | {r['method']} | {r['graph']} | {100 * r['accuracy']:.1f}% | "
            f"{gap} | {average} | {sent} | {r['samples_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Test accuracy against steps (the slow ranks' steps), one panel per partition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["partition"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        for r in rows:
            if r["partition"] != kind:
                continue
            steps, acc = zip(*r["curve"], strict=True)
            style = "--" if r["graph"] == "exp2" else "-"
            ax.plot(steps, [100 * a for a in acc], style, label=f"{r['method']} ({r['graph']})")
        ax.set_title(kind)
        ax.set_xlabel("steps (slow ranks)")
        ax.set_ylabel("test accuracy, % (mean over ranks)")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(rows: list[dict], args: argparse.Namespace) -> None:
    """Print the table; write JSON, markdown and the plot under ``args.out``."""
    rows = _with_gaps(rows)
    table = markdown(rows, args)
    print()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"args": _plain(args), "rows": rows}))
    (args.out / "table.md").write_text(table)
    plot(rows, args.out / "accuracy.png")
    print(f"wrote {args.out}/results.json, table.md, accuracy.png")


def _plain(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


# ---------------------------------------------------------------- entry
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (fewer steps)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="default 250, --quick 64")
    parser.add_argument("--eval-every", type=int, default=None, help="default 25, --quick 16")
    parser.add_argument("--probe-every", type=int, default=20, help="SkewScout's")
    parser.add_argument(
        "--skewscout-threshold", type=float, default=0.1, help="accuracy loss that shortens"
    )
    parser.add_argument(
        "--skewscout-drift-threshold",
        type=float,
        default=DRIFT_THRESHOLD,
        help="local drift in gradient steps (squared) that shortens; 0: accuracy only",
    )
    parser.add_argument("--skewscout-max-period", type=int, default=16)
    parser.add_argument(
        "--skewscout-hysteresis",
        type=float,
        default=0.5,
        help="SkewScout grows the period below this fraction of each threshold",
    )
    parser.add_argument(
        "--dacfl-correction", type=float, default=0.5, help="DACFL's correction gain (1: paper)"
    )
    parser.add_argument("--ngo-power", type=float, default=0.5, help="nonlinear gossip's p")
    parser.add_argument(
        "--ngo-step-size", type=float, default=0.5, help="nonlinear gossip's step size"
    )
    parser.add_argument(
        "--atc-period", type=int, default=1, help="steps between the atc rows' averaging rounds"
    )
    parser.add_argument(
        "--compngc-compression", default="topk:0.03", help="CompNGC's cross-gradient compressor"
    )
    parser.add_argument("--batch", type=int, default=16, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="fast ranks' sleep")
    parser.add_argument(
        "--slow-every", type=int, default=2, help="rank r is 2x slower when r %% K == K - 1"
    )
    parser.add_argument(
        "--fedhisyn-speeds",
        choices=("given", "measured"),
        default="given",
        help="FedHiSyn's step times: the simulated devices' (default) or timed (10 steps)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=PARTITIONS)
    parser.add_argument(
        "--graphs",
        nargs="+",
        default=None,
        choices=GRAPHS,
        help="default ring exp2, --quick ring; onepeer: exp2's one-peer schedule",
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", type=Path, default=Path("results/heterogeneity"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 64 if args.quick else 250
    if args.eval_every is None:
        args.eval_every = 16 if args.quick else 25
    if args.graphs is None:
        args.graphs = ["ring"] if args.quick else list(DEFAULT_GRAPHS)
    for name in (
        "ranks",
        "steps",
        "eval_every",
        "probe_every",
        "batch",
        "skewscout_max_period",
        "atc_period",
        "slow_every",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    try:  # before any rank starts (CompNGC would refuse it on every rank)
        spec = compression.get_compressor(
            args.compngc_compression, argument="--compngc-compression"
        )
    except ValueError as err:
        parser.error(f"argument {err}")
    if spec.name == "none":
        parser.error(
            "argument --compngc-compression: CompNGC needs a compression other than 'none'; "
            f"got {args.compngc_compression}"
        )
    if "2-classes" in args.partitions and 2 * args.ranks < 10 and not args.worker:
        parser.error(
            f"--partitions 2-classes needs --ranks >= 5 (2 classes per rank must cover the "
            f"10 digits); got --ranks {args.ranks}: pass --partitions iid dirichlet-0.1"
        )
    return args


def launch(argv: list[str]) -> int:
    """Start the job: ``gossamer run -np R -m benchmarks.heterogeneity --worker ...``."""
    args = parse(argv)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    paths = [str(root / "src"), str(root), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    command = [sys.executable, "-m", "gossamer.launcher", "run", "-np", str(args.ranks)]
    command += ["-m", "benchmarks.heterogeneity", "--worker", *argv]
    return subprocess.call(command, env=env, cwd=root)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        worker(args)
    else:
        sys.exit(launch(argv))


if __name__ == "__main__":
    main()
