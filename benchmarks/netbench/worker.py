"""The per-rank training script of the emulated-cluster benchmark (started by the runner).

    gossamer run --nnodes H --node-rank K ... -m benchmarks.netbench.worker --out f.json ...

For each model, strategies are measured in rounds; each round visits every strategy once,
in an order rotated by one per round, so slow drift (thermal, other load) spreads over all
of them. A measurement: build the model and optimizer, ``warmup`` steps, then ``steps``
timed steps between barriers, with the host's ``eth0`` transmit counter read before and
after. ``compute`` is the same step without any communication: the local cost that the
runner subtracts to get the communication time. Rank 0 writes one JSON row per measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gossamer
from benchmarks.netbench.report import choco_spec
from benchmarks.netbench.runner import job_arguments
from gossamer import communicators, optim
from gossamer import topology as topo
from gossamer.compression import get_compressor
from gossamer.models import MLP, SmallResNet

# Bagua's six algorithms through the facade (``gossamer.bagua``), flat (hierarchical=False:
# every rank is a peer, as in the rows above); decentralized pairs ranks with shift_one.
BAGUA_STRATEGIES = (
    "bagua-gradient-allreduce",
    "bagua-bytegrad",
    "bagua-decentralized",
    "bagua-low-precision-decentralized",
    "bagua-qadam",
    "bagua-async",
)
STRATEGIES = (
    "compute",
    "ddp",
    "gradient-allreduce",
    "gradient-allreduce-25mb",
    "raw-allreduce",
    "awc/exp2",
    "atc/exp2",
    "atc/one-peer",
    "atc-forward/one-peer",
    "awc/one-peer",
    "awc-one-bucket/one-peer",
    "raw/one-peer",
    "raw-exchange/one-peer",
    "raw-exchange/shift",
    "raw-exchange/swap",
    "raw-exchange/swap-duplex",
    "raw-exchange/swap-recv-first",
    "raw-overlap/one-peer",
    "gossamer-exchange/one-peer",
    "choco-uint8/one-peer",
    "dcd-uint8/ring",
    "bytegrad",
    "topk-ef/allreduce",
    "randomk-ef/allreduce",
    "randomk8-ef/allreduce",
    "hier-atc",
    "win-put",
    *BAGUA_STRATEGIES,
)


# Random-k gradient allreduce with error reset: float32 values, and four times the positions
# as 8-bit codes in the same payload.
RANDOMK = {
    "randomk-ef/allreduce": "randomk:0.01:reset=true:cyclic=true",
    "randomk8-ef/allreduce": "randomk:0.04:quantize=true:reset=true:cyclic=true",
}


class TinyTransformer(nn.Module):
    """A two-layer transformer encoder classifier over token sequences (~0.9M parameters)."""

    def __init__(self, vocab: int = 1000, dim: int = 128, layers: int = 2, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, classes)`` from the mean of the encoded tokens."""
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


# name -> (constructor, input maker for a batch size)
MODELS = {
    # 1024 -> 5 x 1024 -> 10: 5.26M parameters, 21 MB of float32 per exchange.
    "mlp": (lambda: MLP(1024, 1024, 10, depth=5), lambda b: torch.randn(b, 1024)),
    "resnet": (lambda: SmallResNet(width=16), lambda b: torch.randn(b, 3, 32, 32)),
    "transformer": (TinyTransformer, lambda b: torch.randint(0, 1000, (b, 32))),
}


def param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (what one model exchange moves)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


_TWIN: list = []


class RawAllreduce:
    """The allreduce probe: after backward, the flat gradient averaged by one ``all_reduce``.

    Serial (no overlap with backward) and without gossamer's thread or call check: what one
    gloo ring allreduce of the whole gradient costs, beside DDP (overlapped buckets) and
    gossamer's ``GradientAllreduce``.
    """

    def __init__(self, sgd: torch.optim.Optimizer, model: nn.Module) -> None:
        self.sgd, self.params = sgd, list(model.parameters())

    def zero_grad(self) -> None:
        """As ``torch.optim.Optimizer.zero_grad``."""
        self.sgd.zero_grad()

    def step(self) -> None:
        """Average the gradients in one call, then the local step."""
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat /= gossamer.size()
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()
        self.sgd.step()


class RawOnePeer:
    """The reference row: after the local step, the flat model exchanged by hand.

    Serial (no overlap): ``isend``/``irecv`` of the flat parameters with the one-peer
    exponential schedule's peer, in 32 chunks, then the average written back. As gossamer
    does by default: with ``duplex``, bytes from a lower to a higher rank travel on the
    world group and the other way on a second group, and with ``recv_first`` the receives
    are posted before the sends; a pair swap on one group with sends first runs at half
    the link (``raw-exchange/swap`` shows it). It is what the wire allows, without
    gossamer's header, thread or combine.
    """

    def __init__(
        self,
        sgd: torch.optim.Optimizer,
        model: nn.Module,
        duplex: bool = True,
        recv_first: bool = True,
    ) -> None:
        self.sgd, self.params = sgd, list(model.parameters())
        self.flat = torch.cat([p.detach().flatten() for p in self.params])
        self.recv = torch.empty_like(self.flat)
        graph = topo.exponential_two(gossamer.size())
        self.schedule = topo.one_peer_exponential(graph, gossamer.rank())
        self.recv_first = recv_first
        if duplex and not _TWIN:  # collective: every rank builds the same rows in order
            _TWIN.append(dist.new_group(list(range(gossamer.size()))))
        self.twin = _TWIN[0] if duplex else None

    def zero_grad(self) -> None:
        """As ``torch.optim.Optimizer.zero_grad``."""
        self.sgd.zero_grad()

    def step(self) -> None:
        """Local step, then the exchange and the average."""
        self.sgd.step()
        for work in self._start():
            work.wait()
        self._average()

    def _start(self) -> list:
        torch.cat([p.detach().flatten() for p in self.params], out=self.flat)
        step = next(self.schedule)
        (dst,), (src,) = step.send_ranks, step.recv_ranks
        rank = gossamer.rank()
        out = self.twin if rank > dst else None
        into = self.twin if src > rank else None

        def sends() -> list:
            return [dist.isend(c, dst, out, k) for k, c in enumerate(self.flat.tensor_split(32))]

        def recvs() -> list:
            return [dist.irecv(c, src, into, k) for k, c in enumerate(self.recv.tensor_split(32))]

        return recvs() + sends() if self.recv_first else sends() + recvs()

    def _average(self) -> None:
        self.flat.add_(self.recv).div_(2)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


class RawOverlapOnePeer(RawOnePeer):
    """The overlap probe: adapt-with-combine written by hand with ``torch.distributed``.

    A forward pre-hook starts the exchange of x_t, forward and backward run while gloo's
    threads move the bytes, and ``step`` waits, averages and applies the local step:
    x_{t+1} = (x_t + x_peer) / 2 - lr * grad(x_t). Its step time is what overlap can reach
    on this machine without gossamer.
    """

    def __init__(self, sgd: torch.optim.Optimizer, model: nn.Module) -> None:
        super().__init__(sgd, model)
        self.works: list = []
        model.register_forward_pre_hook(lambda *_: self.works.extend(self._start()))

    def step(self) -> None:
        """Wait for the exchange started before forward, average, then the local step."""
        for work in self.works:
            work.wait()
        self.works.clear()
        self._average()
        self.sgd.step()


_GROUPS: list = []


class ProbeExchange:
    """``probe/<shift|swap|ring>:c=<chunks>:g=<groups>:r=<ratio>``: a raw exchange alone.

    Every step sends ``ratio`` (default 1) times the model's bytes, in ``chunks`` pieces
    (default 32) spread round-robin over ``groups`` gloo groups per direction (default 1;
    gloo opens one connection per group and pair), receives posted first: to rank + 1
    (``shift``), to rank + size/2 (``swap``), or the same buffer to both ring neighbours
    (``ring``, the pattern of Bagua's low-precision ring). No compute, copy or average: the
    wire time the strategies of the same run can be held against.
    """

    def __init__(self, model: nn.Module, spec: str) -> None:
        kind, *opts = spec.split(":")
        kv = dict(o.split("=") for o in opts)
        self.chunks, ngroups = int(kv.get("c", 32)), int(kv.get("g", 1))
        nbytes = int(float(kv.get("r", 1)) * param_bytes(model))
        while len(_GROUPS) < 2 * ngroups:  # collective, same order on every rank
            _GROUPS.append(dist.new_group(list(range(gossamer.size()))))
        self.up, self.down = _GROUPS[0:ngroups], _GROUPS[ngroups : 2 * ngroups]
        size, rank = gossamer.size(), gossamer.rank()
        offsets = {"shift": [1], "swap": [size // 2], "ring": sorted({1, size - 1})}[kind]
        self.dsts = [(rank + o) % size for o in offsets]
        self.srcs = [(rank - o) % size for o in offsets]
        self.sent = torch.zeros(nbytes, dtype=torch.uint8)
        self.received = [torch.empty_like(self.sent) for _ in self.srcs]

    def zero_grad(self) -> None:
        """Nothing to zero: the probe computes nothing."""

    def step(self) -> None:
        """Post every receive, then every send; wait for all."""
        rank = gossamer.rank()
        works = []
        for src, buf in zip(self.srcs, self.received, strict=True):
            groups = self.down if src > rank else self.up
            for k, c in enumerate(buf.tensor_split(self.chunks)):
                works.append(dist.irecv(c, src, groups[k % len(groups)], k))
        for dst in self.dsts:
            groups = self.down if rank > dst else self.up
            for k, c in enumerate(self.sent.tensor_split(self.chunks)):
                works.append(dist.isend(c, dst, groups[k % len(groups)], k))
        for work in works:
            work.wait()


class GossamerExchange(RawOnePeer):
    """The exchange probe beside ``raw-exchange``: the same one-peer average.

    It goes through ``gossamer.neighbor_allreduce`` (header, engine thread, combine)
    instead of by hand.
    """

    def step(self) -> None:
        """Exchange and average the flat model; no local step (the probe skips compute)."""
        torch.cat([p.detach().flatten() for p in self.params], out=self.flat)
        step = next(self.schedule)
        averaged = gossamer.neighbor_allreduce(
            self.flat,
            self_weight=step.self_weight,
            src_weights=dict(step.src_weights),
            dst_weights=dict(step.dst_weights),
        )
        # Written back from the result, as raw-exchange writes back its averaged buffer:
        # one copy each (this probe copied the result into its buffer first, until session 13).
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(averaged[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


class BaguaStep:
    """A model wrapped by ``with_bagua``: its optimizer, and ``free`` to stop its threads."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        self.optimizer, self.model = optimizer, model

    def zero_grad(self) -> None:
        """As ``torch.optim.Optimizer.zero_grad``."""
        self.optimizer.zero_grad()

    def step(self) -> None:
        """The optimizer's step (Bagua's post-step hooks run inside it)."""
        self.optimizer.step()

    def free(self) -> None:
        """Stop the asynchronous algorithm's background rounds (others have none)."""
        algorithm = self.model.bagua_algorithm
        if hasattr(algorithm, "abort"):
            algorithm.abort(self.model)


def wrap_bagua(strategy: str, model: nn.Module, sgd: torch.optim.Optimizer):
    """``model.with_bagua`` with the algorithm ``strategy`` names (a ``bagua-`` row)."""
    import gossamer.bagua as bagua
    from gossamer.bagua.algorithms import (
        async_model_average,
        bytegrad,
        decentralized,
        gradient_allreduce,
        q_adam,
    )

    bagua.init_process_group()  # gossamer is initialized: this only checks
    optimizer = sgd
    if strategy == "bagua-gradient-allreduce":
        algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
    elif strategy == "bagua-bytegrad":
        algorithm = bytegrad.ByteGradAlgorithm(hierarchical=False)
    elif strategy == "bagua-decentralized":
        algorithm = decentralized.DecentralizedAlgorithm(
            hierarchical=False, peer_selection_mode="shift_one"
        )
    elif strategy == "bagua-low-precision-decentralized":
        algorithm = decentralized.LowPrecisionDecentralizedAlgorithm(hierarchical=False)
    elif strategy == "bagua-qadam":
        # Adam's own learning rate (SGD's means nothing to Adam); one warm-up step, so the
        # timed steps are the compressed stage (too short a warm-up for accuracy runs).
        optimizer = q_adam.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=1)
        algorithm = q_adam.QAdamAlgorithm(optimizer, hierarchical=False)
    elif strategy == "bagua-async":
        algorithm = async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=100)
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    return model.with_bagua([optimizer], algorithm), BaguaStep(optimizer, model)


def _fixed_peer(offset: int):
    """A schedule that sends to rank + offset and receives from rank - offset every step."""
    size, rank = gossamer.size(), gossamer.rank()
    send, recv = (rank + offset) % size, (rank - offset) % size
    return itertools.repeat(topo.Step((send,), (recv,), 0.5, {recv: 0.5}, {send: 1.0}))


def _variant(suffix: str) -> dict:
    """The optimizer options that a strategy's dash-separated suffix names.

    ``-one-bucket``, ``-<N>mb`` (bucket size), ``-forward`` or ``-k<K>`` (``send_order``),
    ``-copy`` (the parameters stay out of the buckets: a copy into them and one out of them
    per round, as before session 16).
    """
    options: dict = {}
    for part in filter(None, suffix.replace("one-bucket", "onebucket").split("-")):
        if part == "copy":
            options["copy"] = True
        elif part == "onebucket":
            options["fusion_threshold_bytes"] = 2**40
        elif part.endswith("mb"):
            options["fusion_threshold_bytes"] = int(float(part.removesuffix("mb")) * 2**20)
        elif part == "forward":
            options["send_order"] = "forward"
        elif part.startswith("k") and part[1:].isdigit():
            options["send_order"] = int(part[1:])
        else:
            raise ValueError(f"unknown strategy option {part!r}")
    return options


def _copying(cls: type, copy: bool) -> type:
    """``cls``, or with ``copy`` its variant whose parameters stay out of the buckets."""
    return type(f"Copying{cls.__name__}", (cls,), {"params_in_buckets": False}) if copy else cls


def is_strategy(name: str) -> bool:
    """Whether :func:`wrap` builds ``name``; checked before any namespace is made.

    A listed one, or one of the families ``probe/<kind>``, ``gradient-allreduce-<N>mb``,
    ``atc|awc<variant>/one-peer`` and ``choco-<compressor>[-copy]/one-peer``.
    """
    if name in STRATEGIES or name in BAGUA_STRATEGIES:
        return True
    try:
        if name.startswith("probe/"):
            return bool(name.removeprefix("probe/"))
        if name.startswith("gradient-allreduce-") and name.endswith("mb"):
            return float(name.removeprefix("gradient-allreduce-").removesuffix("mb")) > 0
        if name.startswith(("atc", "awc")) and name.endswith("/one-peer"):
            return isinstance(_variant(name.removesuffix("/one-peer")[3:]), dict)
        if name.startswith("choco-") and name.endswith("/one-peer"):
            return get_compressor(choco_spec(name)[0]) is not None
    except (TypeError, ValueError):
        return False
    return False


def wrap(strategy: str, model: nn.Module, sgd: torch.optim.Optimizer):
    """The model to call and the optimizer to step for ``strategy``, around ``sgd``."""
    size, rank = gossamer.size(), gossamer.rank()
    if strategy == "compute":
        return model, sgd
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model), sgd
    if strategy.startswith("gradient-allreduce"):
        # -<N>mb: buckets of N MiB instead of gossamer's 8 (-25mb: DDP's bucket_cap_mb).
        mib = strategy.removeprefix("gradient-allreduce").strip("-").removesuffix("mb")
        fusion = {"fusion_threshold_bytes": int(float(mib) * 2**20)} if mib else {}
        return model, optim.GradientAllreduce(sgd, model, **fusion)
    if strategy == "awc/exp2":
        return model, optim.AdaptWithCombine(sgd, model, topology=topo.exponential_two(size))
    if strategy == "atc/exp2":
        return model, optim.AdaptThenCombine(sgd, model, topology=topo.exponential_two(size))
    if strategy.startswith(("atc", "awc")) and strategy.endswith("/one-peer"):
        # atc|awc[-one-bucket|-<N>mb][-forward|-k<K>][-copy]/one-peer (see _variant).
        schedule = topo.one_peer_exponential(topo.exponential_two(size), rank)
        options = _variant(strategy.removesuffix("/one-peer")[3:])
        cls = optim.AdaptThenCombine if strategy.startswith("atc") else optim.AdaptWithCombine
        cls = _copying(cls, options.pop("copy", False))
        return model, cls(sgd, model, schedule=schedule, **options)
    if strategy in ("raw/one-peer", "raw-exchange/one-peer"):
        return model, RawOnePeer(sgd, model)
    if strategy.startswith("raw-exchange/s"):
        # The two halves of the 4-rank one-peer schedule, alone: a shift, and a pair swap:
        # on one group with sends posted first, with each direction on its own group, and
        # on one group with receives posted first.
        raw = RawOnePeer(
            sgd,
            model,
            duplex=strategy in ("raw-exchange/shift", "raw-exchange/swap-duplex"),
            recv_first=strategy not in ("raw-exchange/swap", "raw-exchange/swap-duplex"),
        )
        raw.schedule = _fixed_peer(1 if strategy.endswith("shift") else size // 2)
        return model, raw
    if strategy.startswith("probe/"):
        return model, ProbeExchange(model, strategy.removeprefix("probe/"))
    if strategy == "raw-allreduce":
        return model, RawAllreduce(sgd, model)
    if strategy == "gossamer-exchange/one-peer":
        return model, GossamerExchange(sgd, model)
    if strategy == "raw-overlap/one-peer":
        return model, RawOverlapOnePeer(sgd, model)
    if strategy.startswith("choco-") and strategy.endswith("/one-peer"):
        spec, copy = choco_spec(strategy)
        schedule = topo.one_peer_exponential(topo.exponential_two(size), rank)
        choco = communicators.ChocoGossip(spec, schedule=schedule)
        return model, _copying(optim.AdaptWithCombine, copy)(sgd, model, communicator=choco)
    if strategy == "dcd-uint8/ring":
        # Bagua's low-precision ring as gossamer's own DCD under ATC: each bucket's round
        # starts from the backward pass instead of after the step.
        dcd = communicators.DifferenceGossip("uint8", topology=topo.ring(size))
        return model, optim.AdaptThenCombine(sgd, model, communicator=dcd)
    if strategy == "bytegrad":
        bytegrad = communicators.CompressedAllreduce("uint8", error_feedback=False)
        return model, optim.GradientAllreduce(sgd, model, communicator=bytegrad)
    if strategy == "topk-ef/allreduce":
        return model, optim.GradientAllreduce(sgd, model, compression="topk:0.01")
    if strategy in RANDOMK:
        return model, optim.GradientAllreduce(sgd, model, compression=RANDOMK[strategy])
    if strategy == "hier-atc":
        gossamer.set_machine_topology(topo.exponential_two(gossamer.machine_size()))
        return model, optim.AdaptThenCombine(
            sgd, model, communication="hierarchical_neighbor_allreduce"
        )
    if strategy == "win-put":
        return model, optim.WindowPut(sgd, model, topology=topo.exponential_two(size))
    if strategy in BAGUA_STRATEGIES:
        return wrap_bagua(strategy, model, sgd)
    raise ValueError(f"unknown strategy {strategy!r}")


def release(strategy: str, opt) -> None:
    """Undo what :func:`wrap` set up beyond the optimizer (windows, machine topology)."""
    if hasattr(opt, "free"):
        opt.free()
    if strategy == "hier-atc":
        gossamer.set_machine_topology(None)


def _tx_bytes(interface: str) -> int:
    # `ip netns exec` remounts /sys, so this is the namespace's own interface.
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())


def measure(model_name: str, strategy: str, args: argparse.Namespace) -> dict:
    """One measurement of ``strategy`` on ``model_name``; the same dict on every rank."""
    build, inputs = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    net, opt = wrap(strategy, model, torch.optim.SGD(model.parameters(), lr=0.01))
    x = inputs(args.batch)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        # The exchange-only probe skips compute: SGD then steps nothing (no gradients).
        if "exchange/" not in strategy and not strategy.startswith("probe/"):
            loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    gossamer.barrier()
    # One reader per host: every rank of a host shares its link.
    reader = gossamer.local_rank() == 0
    tx0 = _tx_bytes(args.interface) if reader else 0
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    # Inside the timed window: the barrier runs after any communication a step left in
    # flight, as the one before the window did, so the window holds exactly `steps`
    # steps' communication (a round started ahead for the next step would otherwise be
    # free: session 13's prefetch, docs/benchmarks.md).
    gossamer.barrier()
    elapsed = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    tx = _tx_bytes(args.interface) - tx0 if reader else 0
    release(strategy, opt)
    # The job is as fast as its slowest rank; bytes are summed over hosts.
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    total_tx = gossamer.allreduce(torch.tensor([float(tx)], dtype=torch.float64), average=False)
    # Where a step's time goes on shared cores: this process's CPU (all its threads) and
    # its page faults (fresh model-sized tensors fault in every page), mean over ranks.
    spent = [
        usage.ru_utime - usage0.ru_utime,
        usage.ru_stime - usage0.ru_stime,
        float(usage.ru_minflt - usage0.ru_minflt),
    ]
    per_rank = torch.tensor(spent, dtype=torch.float64)
    user_s, sys_s, faults = (gossamer.allreduce(per_rank) / args.steps).tolist()
    step_s = float(slowest) / args.steps
    return {
        "model": model_name,
        "strategy": strategy,
        "params_bytes": param_bytes(model),
        "batch": args.batch,
        "ranks": gossamer.size(),
        "step_s": step_s,
        "samples_per_s": gossamer.size() * args.batch / step_s,
        "tx_bytes_per_step_per_rank": float(total_tx) / args.steps / gossamer.size(),
        "user_cpu_s_per_step_per_rank": user_s,
        "sys_cpu_s_per_step_per_rank": sys_s,
        "page_faults_per_step_per_rank": faults,
    }


def main(argv: list[str] | None = None) -> None:
    """Measure every (model, strategy) ``reps`` times and write the rows to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    job_arguments(parser)
    parser.add_argument("--models", default="mlp")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    gossamer.init()
    torch.set_num_threads(1)
    meta = json.loads(args.meta)
    strategies = [s for s in args.strategies.split(",") if s]
    rows = []
    for model_name in args.models.split(","):
        for rep in range(args.reps):
            shift = rep % len(strategies)
            for strategy in strategies[shift:] + strategies[:shift]:
                row = measure(model_name, strategy, args)
                row.update(meta, rep=rep)
                rows.append(row)
                if gossamer.rank() == 0:
                    print(
                        f"netbench: {model_name} {strategy} rep {rep}: "
                        f"{row['samples_per_s']:.1f} samples/s, "
                        f"{row['tx_bytes_per_step_per_rank'] / 1e6:.2f} MB/step/rank",
                        flush=True,
                    )
    if gossamer.rank() == 0:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    gossamer.shutdown()


if __name__ == "__main__":
    main()
