"""Run the worker as a real multi-machine job on an emulated cluster.

Each host's ranks start through ``gossamer run --nnodes H --node-rank K`` inside the host's
namespace, with the static rendezvous at host 0's address and gloo bound to the host's
``eth0``, exactly as on separate machines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.netbench.cluster import Cluster, format_rate


def job_arguments(parser: argparse.ArgumentParser) -> None:
    """Add what :func:`run_job` passes every job module: ``--out``, ``--interface``, ``--meta``."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--interface", default="eth0", help="the host's interface (counters)")
    parser.add_argument("--meta", default="{}", help="JSON merged into every row")


__all__ = ["REPO", "checked", "publish", "run_job"]

REPO = Path(__file__).resolve().parents[2]
RDZV_PORT = 29511


def run_job(
    cluster: Cluster,
    ranks_per_host: int,
    worker_args: list[str],
    out_dir: Path,
    *,
    module: str = "benchmarks.netbench.worker",
    timeout: float = 1800.0,
    launcher_args: tuple[str, ...] = (),
    lost_host: int | None = None,
) -> list[dict]:
    """Run ``module`` on ``ranks_per_host`` ranks on every host; return rank 0's rows.

    ``launcher_args`` go to every host's ``gossamer run``; the launcher of ``lost_host``
    (whose ranks the job kills on purpose) may exit with any code.

    Raises:
        RuntimeError: a host's launcher failed or the job ran past ``timeout`` (its log
            file is named); every process started is stopped first.
    """
    hosts = cluster.hosts
    tag = f"{module.rsplit('.', 1)[-1]}-{format_rate(cluster.rate)}-{len(hosts)}x{ranks_per_host}"
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result = out_dir / f"rows-{tag}.json"
    result.unlink(missing_ok=True)
    meta = {
        "rate": cluster.rate,
        "hosts": len(hosts),
        "ranks_per_host": ranks_per_host,
        "congestion": cluster.congestion_used,
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]))
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for host in hosts:
            argv = [
                *cluster.netns_exec(host), sys.executable, "-m", "gossamer.launcher", "run",
                *launcher_args, "--nnodes", str(len(hosts)), "--node-rank", str(host.index),
                "--nproc-per-node", str(ranks_per_host),
                "--rdzv-endpoint", f"{hosts[0].address}:{RDZV_PORT}",
                "--network-interface", host.interface,
                "-m", module, "--out", str(result),
                "--interface", host.interface, "--meta", json.dumps(meta), *worker_args,
            ]  # fmt: skip
            log = logs / f"{tag}-h{host.index}.log"
            with open(log, "w") as sink:
                # Own session: the whole launcher tree can be stopped by its group id.
                proc = subprocess.Popen(
                    argv, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            procs.append((proc, log))
        _wait(procs, time.monotonic() + timeout, lost_host)
    finally:
        _stop(procs)
    return json.loads(result.read_text())


def _wait(procs: list[tuple[subprocess.Popen, Path]], deadline: float, lost: int | None) -> None:
    while True:
        codes = [proc.poll() for proc, _ in procs]
        if lost is not None and codes[lost] is not None:
            codes[lost] = 0
        for code, (_, log) in zip(codes, procs, strict=True):
            if code:
                tail = log.read_text()[-2000:]
                raise RuntimeError(f"host launcher exited with {code}; see {log}:\n{tail}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"job timed out; logs in {procs[0][1].parent}")
        time.sleep(0.2)


def _stop(procs: list[tuple[subprocess.Popen, Path]]) -> None:
    """Stop the process groups this job started (only those), politely then for sure."""
    live = [proc for proc, _ in procs if proc.poll() is None]
    for proc in live:
        _signal_group(proc, signal.SIGTERM)
    for proc in live:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)


def publish(out: Path, name: str, lines: list[str], rows: list[dict]) -> None:
    """Print a table and write it to ``out/<name>.md``, its rows to ``out/<name>.json``."""
    text = "\n".join(lines)
    print(text)
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")


def checked(convert, test=None, rule: str = ""):
    """An argparse ``type=``: ``convert(text)``, refused unless ``test(value)`` ("must be rule").

    ``convert``'s ValueError becomes the option's error too, so every bad value is an
    argparse error (exit code 2, the option and the value named) before :func:`preflight`.
    """

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError as err:
            name = getattr(convert, "__name__", "")
            message = f"invalid {name} value: {text!r}" if name in ("int", "float") else err
            raise argparse.ArgumentTypeError(str(message)) from None
        if test is not None and not test(value):
            raise argparse.ArgumentTypeError(f"must be {rule}; got {text}")
        return value

    return parse
