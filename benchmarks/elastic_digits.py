"""Killing 1 of 4 ranks midway vs an uninterrupted 3-rank run, on digits (issue 17's target).

    python -m benchmarks.elastic_digits                 # seeds 0 and 1 (6 jobs)
    python -m benchmarks.elastic_digits --seeds 0 1 2 --steps 145
    python -m benchmarks.elastic_digits --optimizer push_sum   # elastic windows

Run from the repository root. For every seed it runs ``examples/elastic_digits.py`` three
times through the launcher:

- ``gossamer run -np 4 --elastic examples/elastic_digits.py --seed S`` (rank 2 SIGKILLs
  itself at 40 % of the run; the 3 survivors go on with ``elastic=True`` gossip);
- ``gossamer run -np 3 examples/elastic_digits.py --seed S --no-kill`` (the reference);
- ``gossamer run -np 4 examples/elastic_digits.py --seed S --no-kill`` (what the 4 ranks
  reach without the kill).

Every run takes the same number of steps (``--steps``, default 145: 5 epochs of the
3-rank run); after the kill the survivors re-shard the data over the live ranks.

For every seed it reports the final test accuracy of each run (mean over the ranks that
finished), the difference between the killed run and the 3-rank reference, the launchers'
exit codes, and for the killed run the time from the kill to each survivor's next
completed step among the survivors (the stall; the example's own measurement). Writes
``results/elastic_digits/{results.json,table.md}``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "elastic_digits.py"
_FLOAT = r"([0-9.]+)"


def _job(np_: int, options: list[str], args: list[str], out: Path) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "gossamer.launcher", "run", "-np", str(np_), *options]
    cmd += [str(EXAMPLE), "--out", str(out), *args]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr, time.time() - start


def run_seed(seed: int, steps: int, out: Path, optimizer: str = "atc") -> dict:
    """The killed 4-rank run and the 3-rank reference of one seed."""
    common = ["--seed", str(seed), "--steps", str(steps), "--optimizer", optimizer]
    code_k, text_k, wall_k = _job(4, ["--elastic"], common, out / f"killed{seed}")
    code_r, text_r, wall_r = _job(3, [], [*common, "--no-kill"], out / f"ref{seed}")
    code_4, text_4, _ = _job(4, [], [*common, "--no-kill"], out / f"four{seed}")
    killed = re.search(rf"mean over the 3 survivors: {_FLOAT}%", text_k)
    ref = re.search(rf"mean over the 3 ranks: {_FLOAT}%", text_r)
    four = re.search(rf"mean over the 4 ranks: {_FLOAT}%", text_4)
    stalls = [float(v) for v in re.findall(rf"next completed step {_FLOAT} s after", text_k)]
    if not (killed and ref and four and stalls):
        raise RuntimeError(f"seed {seed}: unexpected output\n{text_k}\n{text_r}\n{text_4}")
    return {
        "seed": seed,
        "killed_acc": float(killed.group(1)),
        "reference_acc": float(ref.group(1)),
        "four_no_kill_acc": float(four.group(1)),
        "stall_s": stalls,
        "launcher_exit_killed": code_k,
        "launcher_exit_reference": code_r,
        "launcher_exit_four": code_4,
        "wall_s": [round(wall_k, 1), round(wall_r, 1)],
        "killed_output": text_k,
    }


def table(rows: list[dict]) -> str:
    """A markdown table of the runs."""
    lines = [
        "| seed | 4 ranks, rank 2 killed at 40 % | 3 ranks, no kill | difference (points) "
        "| 4 ranks, no kill | kill -> next step (s), per survivor | launcher exits |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stall = ", ".join(f"{s:.2f}" for s in r["stall_s"])
        lines.append(
            f"| {r['seed']} | {r['killed_acc']:.2f} % | {r['reference_acc']:.2f} % | "
            f"{r['killed_acc'] - r['reference_acc']:+.2f} | {r['four_no_kill_acc']:.2f} % | "
            f"{stall} | {r['launcher_exit_killed']}, {r['launcher_exit_reference']}, "
            f"{r['launcher_exit_four']} |"
        )
    diffs = [r["killed_acc"] - r["reference_acc"] for r in rows]
    stalls = [s for r in rows for s in r["stall_s"]]
    lines.append(
        f"\nmean difference {statistics.mean(diffs):+.2f} points; stall {min(stalls):.2f}-"
        f"{max(stalls):.2f} s (median {statistics.median(stalls):.2f} s)"
    )
    return "\n".join(lines)


def _steps(text: str) -> int:
    """An argparse ``type=`` for ``--steps``: enough for the example to kill at 40 %.

    Its victim completes 2 steps before it is killed at step ``round(0.4 * steps)``, and
    dies before the last step: 4 steps at least.
    """
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if steps < 4:
        raise argparse.ArgumentTypeError(
            f"must be >= 4 (the victim is killed at 40 %, after 2 steps); got {text}"
        )
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=_steps, default=145, help="total steps of every run")
    parser.add_argument("--out", type=Path, default=Path("results/elastic_digits"))
    parser.add_argument(
        "--optimizer", choices=["atc", "push_sum", "win_put"], default="atc", help="elastic"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.steps, args.out, args.optimizer))
        print(table(rows[-1:]).splitlines()[2], flush=True)
    text = table(rows)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
