"""Payload size, speed and error of every compressor on one CPU thread.

    python benchmarks/bench_compression.py [--numel 5260000] [--preset smoke] [--out results]
        [--device cuda]

For one float32 tensor of ``--numel`` standard normal entries (default: the 5.26 M
parameters of the project's benchmark model) and each compressor, the table shows the
payload size and its ratio to float32, compress and decompress throughput (GB/s of float32
input), the relative error ``||x - D(C(x))|| / ||x||``, and at 1 Gbit/s the transfer time
the smaller payload saves against the time compress + decompress spend (above 1: worth it
on such a link), and the time to add a received payload into a tensor, by ``decompress``
then ``add_`` and by the fused ``decompress_add_``. Times are medians over repetitions
(``--stat min``: the fastest), with torch on one thread. ``--clock cpu`` measures the
calling thread's CPU time instead of wall time, which on a machine shared with other jobs
is closer to what an idle machine shows. ``--device cuda`` runs the compressors on the GPU
(wall clock, synchronised before each reading).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import argtypes  # this folder: the script runs as a file
import torch

from gossamer.compression import get_compressor

PRESETS = {"full": (5_260_000, 7), "smoke": (10_000, 2)}
SPECS = [
    "none",
    "fp16",
    "bf16",
    "uint8",
    "uint8:32",
    "qsgd:16",
    "qsgd:4",
    "natural",
    "natural_dithering:8",
    "topk:0.01",
    "randomk:0.01",
    "stc:0.01",
    "sign",
]
LINK_BITS_PER_S = 1e9


def measure(spec: str, x: torch.Tensor, reps: int, clock, stat) -> dict:
    compressor = get_compressor(spec)
    payload = compressor.compress(x)  # warm-up: allocator, lazy initialisation
    compressor.decompress(payload)
    target = torch.zeros_like(x)
    compress_s, decompress_s, add_s, fused_add_s = [], [], [], []
    for _ in range(reps):
        start = clock()
        payload = compressor.compress(x)
        middle = clock()
        compressor.decompress(payload)  # not kept: each timed call gets the same memory
        compress_s.append(middle - start)
        decompress_s.append(clock() - middle)
        # What a gossip step does per received payload: add it into a public copy.
        start = clock()
        target.add_(compressor.decompress(payload))
        middle = clock()
        compressor.decompress_add_(payload, target)
        add_s.append(middle - start)
        fused_add_s.append(clock() - middle)
    exact = x.double()
    error = (exact - compressor.decompress(payload).double()).norm() / exact.norm()
    raw = x.numel() * x.element_size()
    return {
        "compressor": compressor.name,
        "payload_bytes": payload.nbytes,
        "ratio": payload.nbytes / raw,
        "compress_s": stat(compress_s),
        "decompress_s": stat(decompress_s),
        "add_decompressed_s": stat(add_s),
        "decompress_add_s": stat(fused_add_s),
        "relative_error": error.item(),
        "saved_s": (raw - payload.nbytes) * 8 / LINK_BITS_PER_S,
    }


def table(rows: list[dict], raw_bytes: int) -> str:
    lines = [
        "| compressor | payload bytes | ratio vs float32 | compress GB/s | decompress GB/s "
        "| compress + decompress ms | relative error | saved / spent at 1 Gbit/s "
        "| add decompressed ms | decompress_add_ ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        spent = row["compress_s"] + row["decompress_s"]
        gain = "-" if row["saved_s"] <= 0 else f"{row['saved_s'] / spent:.1f}"
        lines.append(
            f"| `{row['compressor']}` | {row['payload_bytes']:,} | {row['ratio']:.4f} "
            f"| {raw_bytes / row['compress_s'] / 1e9:.2f} "
            f"| {raw_bytes / row['decompress_s'] / 1e9:.2f} | {spent * 1e3:.1f} "
            f"| {row['relative_error']:.4f} | {gain} | {row['add_decompressed_s'] * 1e3:.1f} "
            f"| {row['decompress_add_s'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def _synchronised(clock, device: torch.device):
    """``clock`` read once the device has finished the work queued so far."""

    def read() -> float:
        torch.cuda.synchronize(device)
        return clock()

    return read


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--numel", type=argtypes.POSITIVE, help="elements (overrides the preset's)")
    parser.add_argument(
        "--reps", type=argtypes.POSITIVE, help="repetitions (overrides the preset's)"
    )
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--stat", choices=["median", "min"], default="median")
    parser.add_argument("--specs", nargs="+", default=SPECS, help="compressor specs")
    parser.add_argument("--device", default="cpu", help="where the tensor lives (cpu, cuda)")
    parser.add_argument("--out", default="results", help="folder for bench_compression.{md,json}")
    args = parser.parse_args()
    for spec in args.specs:  # every spec now, not after the first rows have run
        try:
            get_compressor(spec, argument="--specs")
        except ValueError as err:
            parser.error(str(err))
    numel, reps = PRESETS[args.preset]
    numel = args.numel if args.numel is not None else numel
    reps = args.reps if args.reps is not None else reps
    torch.set_num_threads(1)
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        parser.error(f"--device {args.device!r}: {err}")
    if device.type != "cpu" and args.clock == "cpu":
        parser.error(f"--clock cpu times the host thread only; got --device {args.device}")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    if device.type == "cuda":
        clock = _synchronised(time.perf_counter, device)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    stat = statistics.median if args.stat == "median" else min
    # Untimed: malloc's first model-sized allocations page-fault until its heap has grown,
    # which would otherwise slow down whichever compressor runs first.
    measure("bf16", x, 3, clock, stat)
    rows = [measure(spec, x, reps, clock, stat) for spec in args.specs]
    text = table(rows, numel * 4)
    header = (
        f"{numel:,} float32 elements ({numel * 4 / 1e6:.1f} MB) on {_device_name(device)}, "
        f"torch {torch.__version__}, 1 thread, {args.stat} of {reps}, {args.clock} clock"
    )
    print(header + "\n\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_compression.md").write_text(header + "\n\n" + text + "\n")
    meta = {"numel": numel, "reps": reps, "clock": args.clock, "stat": args.stat}
    meta["device"] = _device_name(device)
    meta["torch"] = torch.__version__
    (out / "bench_compression.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
