"""Aggregation, cost model, markdown table and plot of the emulated-cluster benchmark.

Everything here is pure (no processes, no network) and unit-tested.

Cost model (DESIGN.md section 6, bandwidth only: latency L = 0 since tc cannot add it):
each host has one full-duplex link of B bits/s, so a step's communication time is the
bytes that the busiest host must send, divided by B/8. With M bytes per model:
ring allreduce (DDP, gradient allreduce) sends 2(n-1)/n * M per host, whatever the ranks
per host (contiguous ranks: one ring edge leaves each host); static exponential-two
averaging sends M to each off-host neighbour of each rank, log2(n) of them with one rank
per host; one-peer dynamic exponential-two sends M to one peer per step; hierarchical
averaging sends M to each of the log2(machines) neighbouring machines. The *ceiling* is the
throughput with communication perfectly overlapped: n * batch / max(compute, comm).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks.netbench.cluster import format_rate

__all__ = [
    "aggregate",
    "ceiling_samples_per_s",
    "comm_seconds",
    "host_egress_bytes",
    "markdown_table",
    "plot",
    "plot_accuracy",
    "accuracy_table",
    "accuracy_targets",
    "targets",
]

RING = (
    "ddp",
    "gradient-allreduce",
    "gradient-allreduce-25mb",
    "raw-allreduce",
    "bagua-gradient-allreduce",
)
# Bytes per step not fixed: async averages on its own clock (every sync_interval_ms).
UNMODELLED = ("bagua-async",)
EXP2 = ("awc/exp2", "atc/exp2", "win-put")
ONE_PEER = (
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
    "bagua-decentralized",
)


def _exp2_offsets(n: int) -> list[int]:
    return [2**i for i in range(max(1, math.ceil(math.log2(n))) if n > 1 else 0) if 2**i < n]


# Compressed strategies: (the uncompressed pattern they follow, bytes sent per model byte).
COMPRESSED = {
    "bytegrad": ("ddp", 0.25),
    "bagua-bytegrad": ("ddp", 0.25),
    "bagua-qadam": ("ddp", 0.25),  # the 8-bit gradient average after one warm-up step
    # the fixed ring: one 8-bit difference to each of the two neighbours
    "bagua-low-precision-decentralized": ("ring-neighbours", 0.25),
    "dcd-uint8/ring": ("ring-neighbours", 0.25),  # the same ring through DifferenceGossip
    # every rank's top 1 % (float32 value + int32 index) reaches every other rank
    "topk-ef/allreduce": ("allgather", 0.02),
    # random-k's shared positions: an allreduce of 1 % of the model (float32 values, or
    # four times as many 8-bit codes summed by ByteGrad)
    "randomk-ef/allreduce": ("ddp", 0.01),
    "randomk8-ef/allreduce": ("ddp", 0.01),
}


def choco_spec(strategy: str) -> tuple[str, bool]:
    """``choco-<compressor spec>[-copy]/one-peer``: the spec, and whether to copy (``-copy``)."""
    name = strategy.removeprefix("choco-").removesuffix("/one-peer")
    return name.removesuffix("-copy"), name.endswith("-copy")


def host_egress_bytes(strategy: str, model_bytes: float, ranks: int, per_host: int) -> float:
    """Bytes the busiest host sends per step under ``strategy`` (ranks placed contiguously)."""
    if strategy.startswith("probe/"):  # probe/<kind>:...:r=<ratio> (worker.ProbeExchange)
        kind, *opts = strategy.removeprefix("probe/").split(":")
        ratio = float(dict(o.split("=") for o in opts).get("r", 1))
        pattern = "ring-neighbours" if kind == "ring" else "raw-exchange/shift"
        return host_egress_bytes(pattern, ratio * model_bytes, ranks, per_host)
    if strategy.startswith("choco-") and strategy.endswith("/one-peer"):  # any compressor
        from gossamer.compression import get_compressor  # torch only where it is needed

        compressor = get_compressor(choco_spec(strategy)[0])
        ratio = compressor.payload_nbytes(10**6) / (4 * 10**6)  # the payload of float32
        return host_egress_bytes("atc/one-peer", ratio * model_bytes, ranks, per_host)
    if strategy in COMPRESSED:
        pattern, ratio = COMPRESSED[strategy]
        if pattern == "allgather":
            hosts = ranks // per_host
            return 0.0 if hosts <= 1 else (ranks - per_host) * ratio * model_bytes
        return host_egress_bytes(pattern, ratio * model_bytes, ranks, per_host)
    n, p, m = ranks, per_host, model_bytes
    hosts = n // p
    if strategy == "compute" or hosts <= 1:
        return 0.0
    if strategy in RING or strategy.startswith("gradient-allreduce-"):
        return 2 * (n - 1) / n * m

    def off_host(rank: int, offset: int) -> bool:
        return (rank + offset) % n // p != rank // p

    offsets = _exp2_offsets(n)
    if strategy in EXP2:
        return max(sum(m for r in range(h * p, h * p + p) for o in offsets if off_host(r, o))
                   for h in range(hosts))  # fmt: skip
    if strategy in ONE_PEER or strategy.startswith(("awc-", "atc-")):
        # The schedule cycles through the offsets; average over one cycle.
        per_offset = [
            max(sum(m for r in range(h * p, h * p + p) if off_host(r, o)) for h in range(hosts))
            for o in offsets
        ]
        return sum(per_offset) / len(per_offset)
    if strategy == "hier-atc":
        return len(_exp2_offsets(hosts)) * m
    if strategy == "ring-neighbours":  # to the left and the right neighbour (one when n == 2)
        sides = {1 % n, (n - 1) % n} - {0}
        return max(sum(m for r in range(h * p, h * p + p) for o in sides if off_host(r, o))
                   for h in range(hosts))  # fmt: skip
    raise ValueError(f"no cost model for {strategy!r}")


def comm_seconds(strategy: str, model_bytes: float, ranks: int, per_host: int, rate: int | None):
    """Modelled communication seconds per step.

    None when the link is unshaped or the strategy's bytes per step are not fixed
    (:data:`UNMODELLED`).
    """
    if rate is None or strategy in UNMODELLED:
        return None
    return host_egress_bytes(strategy, model_bytes, ranks, per_host) / (rate / 8)


def ceiling_samples_per_s(
    strategy: str, model_bytes: float, ranks: int, per_host: int, rate, batch: int, compute_s
) -> float | None:
    """Throughput with communication perfectly hidden behind compute (the cost-model bound)."""
    comm = comm_seconds(strategy, model_bytes, ranks, per_host, rate)
    if comm is None or not compute_s:
        return None
    return ranks * batch / max(compute_s, comm)


def _key(row: dict) -> tuple:
    return (row["rate"] or 0, row["model"], row["hosts"], row["ranks_per_host"], row["strategy"])


def aggregate(rows: list[dict]) -> list[dict]:
    """Median, min and max over repetitions of each (rate, model, layout, strategy).

    Adds the communication time (step time minus the median ``compute`` step time of the
    same group), link utilisation (bytes sent by a host / (rate * communication time)),
    the ratio to DDP and the cost-model ceiling.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[_key(row)].append(row)
    out = []
    for _, members in sorted(groups.items(), key=lambda kv: kv[0]):
        first = members[0]
        rates = [m["samples_per_s"] for m in members]
        out.append(
            {
                "rate": first["rate"],
                "model": first["model"],
                "hosts": first["hosts"],
                "ranks_per_host": first["ranks_per_host"],
                "strategy": first["strategy"],
                "ranks": first["ranks"],
                "batch": first["batch"],
                "params_bytes": first["params_bytes"],
                "reps": len(members),
                "samples_per_s": statistics.median(rates),
                "samples_min": min(rates),
                "samples_max": max(rates),
                "step_s": statistics.median(m["step_s"] for m in members),
                "tx_bytes": statistics.median(m["tx_bytes_per_step_per_rank"] for m in members),
                # rows written before these were recorded have none
                "user_s": _median_of(members, "user_cpu_s_per_step_per_rank"),
                "sys_s": _median_of(members, "sys_cpu_s_per_step_per_rank"),
            }
        )
    by_group = {(r["rate"], r["model"], r["hosts"], r["ranks_per_host"], r["strategy"]): r
                for r in out}  # fmt: skip
    for r in out:
        group = (r["rate"], r["model"], r["hosts"], r["ranks_per_host"])
        compute = by_group.get((*group, "compute"))
        ddp = by_group.get((*group, "ddp"))
        compute_s = compute["step_s"] if compute else None
        r["comm_s"] = max(r["step_s"] - compute_s, 0.0) if compute_s is not None else None
        r["utilisation"] = None
        if r["rate"] and r["comm_s"] and r["strategy"] != "compute":
            host_bytes = r["tx_bytes"] * r["ranks_per_host"]
            r["utilisation"] = host_bytes / (r["rate"] / 8 * r["comm_s"])
        if r["strategy"] == "compute":
            r["vs_ddp"] = r["ceiling"] = None
            continue
        r["vs_ddp"] = r["samples_per_s"] / ddp["samples_per_s"] if ddp else None
        r["ceiling"] = ceiling_samples_per_s(
            r["strategy"], r["params_bytes"], r["ranks"], r["ranks_per_host"],
            r["rate"], r["batch"], compute_s,
        )  # fmt: skip
    return out


def _median_of(members: list[dict], key: str) -> float | None:
    values = [m[key] for m in members if key in m]
    return statistics.median(values) if values else None


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def markdown_table(agg: list[dict]) -> str:
    """The aggregated rows as a markdown table."""
    lines = [
        "| rate | model | hosts x ranks | strategy | samples/s median [min-max] | step ms | "
        "MB sent/step/rank | comm ms | link util | CPU ms user+sys | vs DDP | ceiling samples/s |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in agg:
        lines.append(
            f"| {format_rate(r['rate'])} | {r['model']} | {r['hosts']}x{r['ranks_per_host']} | "
            f"{r['strategy']} | {r['samples_per_s']:.1f} [{r['samples_min']:.1f}-"
            f"{r['samples_max']:.1f}] | {r['step_s'] * 1e3:.1f} | {r['tx_bytes'] / 1e6:.2f} | "
            f"{_fmt(r['comm_s'], '.1f', 1e3)} | {_fmt(r['utilisation'], '.0%')} | "
            f"{_fmt(r['user_s'], '.1f', 1e3)}+{_fmt(r['sys_s'], '.1f', 1e3)} | "
            f"{_fmt(r['vs_ddp'], '.2f')} | {_fmt(r['ceiling'], '.1f')} |"
        )
    return "\n".join(lines)


COLUMNS = (
    "comm ms: step time minus the `compute` step (the same step without communication), i.e."
    " the communication left exposed. link util: bytes a host sends per step / (rate x comm"
    " ms); above 100% means that overlap with backward hid part of the transfer. CPU ms: the"
    " user and system CPU time of one rank's process (all its threads) per step, mean over"
    " ranks; where ranks share cores, the ranks' CPU time over the number of cores is a"
    " lower bound on the step."
)


def targets(agg: list[dict]) -> list[str]:
    """The issue's targets (one rank per host, MLP) as met/missed lines."""
    lines = []
    for r in agg:
        if r["ranks_per_host"] != 1 or r["vs_ddp"] is None:
            continue
        where = f"{format_rate(r['rate'])} {r['model']} {r['hosts']}x1"
        if r["strategy"] == "gradient-allreduce":
            ok = r["vs_ddp"] >= 0.95
            lines.append(f"{where}: gradient-allreduce {r['vs_ddp']:.2f}x DDP (target >= 0.95): "
                         f"{'met' if ok else 'MISSED'}")  # fmt: skip
        if r["strategy"] == "atc/one-peer" and r["model"] == "mlp" and r["rate"] in (10**9, 10**8):
            ok = r["vs_ddp"] >= 1.5
            lines.append(f"{where}: atc/one-peer {r['vs_ddp']:.2f}x DDP (target >= 1.5): "
                         f"{'met' if ok else 'MISSED'}")  # fmt: skip
        if r["utilisation"] is not None and r["strategy"] in ("ddp", "gradient-allreduce",
                                                              "atc/one-peer"):  # fmt: skip
            ok = r["utilisation"] >= 0.9
            lines.append(f"{where}: {r['strategy']} link utilisation {r['utilisation']:.0%} "
                         f"(target >= 90%): {'met' if ok else 'MISSED'}")  # fmt: skip
    return lines


# ------------------------------------------------------------------------------ plot
def _series(agg: list[dict], model: str) -> dict[str, list[tuple[float, float, float | None]]]:
    """Strategy -> [(rate, samples/s, ceiling)], sorted by rate; unshaped plotted at 40 Gbit."""
    series: dict[str, list] = defaultdict(list)
    for r in agg:
        if r["model"] == model and r["strategy"] != "compute":
            label = f"{r['strategy']} ({r['hosts']}x{r['ranks_per_host']})"
            series[label].append((r["rate"] or 4e10, r["samples_per_s"], r["ceiling"]))
    return {k: sorted(v) for k, v in series.items()}


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot(agg: list[dict], model: str, path: Path) -> None:
    """Samples/s against bandwidth, one line per strategy, dashed cost-model ceilings."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (label, points) in enumerate(_series(agg, model).items()):
        colour = f"C{i}"
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=colour, label=label)
        ceil = [(p[0], p[2]) for p in points if p[2]]
        if ceil:
            ax.plot(*zip(*ceil, strict=True), "x--", color=colour, alpha=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth (bit/s; unshaped at 4e10)")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title(f"{model}: measured (solid) and cost-model ceiling (dashed)")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------ time to accuracy
def accuracy_table(rows: list[dict]) -> str:
    """Time to the target accuracy per strategy, with the speed-up over DDP."""
    ddp = next((r for r in rows if r["strategy"] == "ddp"), None)
    lines = [
        "| rate | hosts x ranks | strategy | step ms | steps to target | time to target s | "
        "vs DDP | final accuracy |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        speedup = None
        if ddp and ddp["time_to_target_s"] and r["time_to_target_s"]:
            speedup = ddp["time_to_target_s"] / r["time_to_target_s"]
        lines.append(
            f"| {format_rate(r['rate'])} | {r['hosts']}x{r['ranks_per_host']} | "
            f"{r['strategy']} | {r['step_s'] * 1e3:.1f} | {r['steps_to_target'] or '-'} | "
            f"{_fmt(r['time_to_target_s'], '.1f')} | {_fmt(speedup, '.2f')} | "
            f"{r['final_accuracy']:.2%} |"
        )
    return "\n".join(lines)


def accuracy_targets(rows: list[dict]) -> list[str]:
    """The issue's time-to-accuracy target as met/missed lines."""
    ddp = next((r for r in rows if r["strategy"] == "ddp"), None)
    rivals = [r for r in rows if r["strategy"] not in ("ddp", "gradient-allreduce")]
    timed = [r for r in rivals if r["time_to_target_s"]]
    if not ddp or not ddp["time_to_target_s"] or not timed:
        return ["time to accuracy: DDP or every decentralized strategy missed the target"]
    best = min(timed, key=lambda r: r["time_to_target_s"])
    speedup = ddp["time_to_target_s"] / best["time_to_target_s"]
    gap = 100 * (ddp["final_accuracy"] - best["final_accuracy"])
    return [
        f"best decentralized ({best['strategy']}) reaches {best['target']:.0%} {speedup:.2f}x "
        f"faster than DDP (target >= 1.5): {'met' if speedup >= 1.5 else 'MISSED'}",
        f"its final accuracy is {gap:.2f} points below DDP's (target <= 1): "
        f"{'met' if gap <= 1 else 'MISSED'}",
    ]


def plot_accuracy(rows: list[dict], path: Path) -> None:
    """Mean test accuracy of the ranks' models against training time, one line each."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        _, seconds, accuracy = zip(*r["curve"], strict=True)
        ax.plot(seconds, [100 * a for a in accuracy], ".-", label=r["strategy"])
    if rows:
        ax.axhline(100 * rows[0]["target"], color="grey", ls=":", label="target")
    ax.set_xlabel("training time (s, slowest rank)")
    ax.set_ylabel("test accuracy, % (mean over ranks)")
    ax.set_ylim(50, 100)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)
