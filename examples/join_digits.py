"""Machines that leave and join: 4 ranks learn digits, one machine dies at 40 %, one joins at 60 %.

Run (it starts the machines itself)::

    python examples/join_digits.py
    python examples/join_digits.py --no-faults     # the same job, nobody leaves or joins

Each "machine" is one ``gossamer run`` (one torchrun agent) with one rank, started with
``--nnodes 3:4 --rdzv-endpoint 127.0.0.1:<port> --max-restarts 3 --checkpoint-dir D
--checkpoint-every 5``: a job of 3 to 4 machines over torchrun's c10d rendezvous. Every rank
trains :class:`gossamer.models.SmallCNN` on its shard of the bundled digits with
adapt-then-combine over ``exponential_two(n)``, and :class:`gossamer.checkpoint.AutoResume`
saves every 5 steps.

- **A machine dies** at 40 % of the run: its rank SIGKILLs its own agent, then itself (no
  clean-up, as a power cut). The other ranks' next exchange fails (``RankLostError``),
  their agents restart them, and torch's rendezvous drops the dead machine once its
  heartbeat stops; the 3 survivors resume from the newest checkpoint of 4 ranks, each from
  the mean of the 4 saved models (``checkpoint.load(..., resize=True)``, which the range
  ``--nnodes 3:4`` turns on).
- **A machine joins** at 60 %: the driver starts a fifth ``gossamer run``. Its agent waits in
  the rendezvous; the running agents see it, restart their ranks in a round of 4, and all
  4 resume from the mean of the 3 survivors' checkpoint. (The survivors wait at 60 % for
  the newcomer, so that the join lands at the same step on any machine.)

Both changes restart every rank (torchrun admits or drops a machine only in a new
rendezvous round); the steps since the newest checkpoint are redone. ``elastic=True``
gossip (``examples/elastic_digits.py``) instead keeps the survivors running without a
restart, but cannot admit a newcomer. The driver prints the times of each change, the
joining rank's accuracy against the others', and the final accuracy, and plots every
rank's test accuracy over the steps with the changes marked (``<out>/join_digits.png``).
The driver also hosts the rendezvous store (in a cluster, the ``--rdzv-endpoint`` machine
does, and must not be the one that dies: an agent that hosted it would take it down).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from train_digits import _POSITIVE, accuracy, load_digits, make_model, split

import gossamer
from gossamer import checkpoint, optim
from gossamer import topology as topo

_VICTIM, _JOINER = "JOIN_DIGITS_VICTIM", "JOIN_DIGITS_JOINER"
_AGENT_PID = "join_digits.victim_agent.pid"  # the driver writes it, the victim reads it


# ---------------------------------------------------------------------- one rank
def train(args: argparse.Namespace) -> None:
    """One rank: resume if there is a checkpoint, train, log accuracy; die or wait on cue."""
    torch.set_num_threads(1)
    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    (images, labels), (test_images, test_labels) = split(*load_digits(), 0.2, args.seed)
    images, labels = images[rank::size], labels[rank::size]
    model = make_model(args.seed)
    base = torch.optim.Adam(model.parameters(), lr=args.lr)
    opt = optim.AdaptThenCombine(base, model, topology=topo.exponential_two(size))
    auto = checkpoint.AutoResume(model, opt)
    log = Log(args.out / "join_digits.jsonl", rank=rank, size=size)
    log.write("start", step=auto.steps, joiner=_JOINER in os.environ)
    kill_step, join_step = round(args.kill_at * args.steps), round(args.join_at * args.steps)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(auto.steps, args.steps):
        generator = torch.Generator().manual_seed(args.seed * 100_003 + step * 101 + rank)
        batch = torch.randint(len(labels), (args.batch_size,), generator=generator)
        opt.zero_grad()
        loss_fn(model(images[batch]), labels[batch]).backward()
        opt.step()
        auto.after_step()
        if auto.steps % args.eval_every == 0:
            opt.synchronize()
            log.write("acc", step=auto.steps, acc=accuracy(model, test_images, test_labels))
        if not args.no_faults and _VICTIM in os.environ and auto.steps == kill_step:
            log.write("killed", step=auto.steps)
            # The machine's agent (its launcher: a rank's parent is the launcher's
            # preloader, not the agent)...
            os.kill(int((args.out / _AGENT_PID).read_text()), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)  # ...and its rank
        if not args.no_faults and size == args.machines - 1 and auto.steps == join_step:
            log.write("waiting", step=auto.steps)
            while True:  # until the newcomer's arrival makes torchrun restart this rank
                time.sleep(0.1)
    opt.synchronize()
    log.write("done", step=args.steps, acc=accuracy(model, test_images, test_labels))
    gossamer.shutdown()


class Log:
    """One JSON line per event, appended to a file that every rank shares (one machine)."""

    def __init__(self, path: Path, **fields: object) -> None:
        self.path, self.fields = path, fields

    def write(self, event: str, **fields: object) -> None:
        """Append one event with this rank's fields and the time."""
        line = json.dumps({"t": time.time(), "event": event, **self.fields, **fields})
        with open(self.path, "a") as file:  # one short write: lines never interleave
            file.write(line + "\n")


# ---------------------------------------------------------------------- the driver
def drive(args: argparse.Namespace) -> int:
    """Start the machines, add the newcomer when the survivors wait, report."""
    shutil.rmtree(args.out / "join_digits_ckpt", ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "join_digits.jsonl"
    log_path.unlink(missing_ok=True)
    port = _free_port()
    # The rendezvous store lives here, not in an agent: an agent that hosted it would take
    # it down when its machine dies (in a cluster: the --rdzv-endpoint machine must live).
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False
    )
    machines = [
        _machine(args, port, i, {_VICTIM: "1"} if i == args.machines - 1 else {})
        for i in range(args.machines)
    ]
    (args.out / _AGENT_PID).write_text(str(machines[-1].pid))  # what the victim kills
    began = time.time()
    while not args.no_faults and not any(e["event"] == "waiting" for e in _events(log_path)):
        if all(m.poll() is not None for m in machines):
            break
        time.sleep(0.2)
    if not args.no_faults:
        machines.append(_machine(args, port, args.machines, {_JOINER: "1"}))
    codes = [m.wait() for m in machines]
    if not args.no_faults:
        codes.pop(args.machines - 1)  # the machine that died (its agent was SIGKILLed)
    del store
    report(_events(log_path), began, args)
    return max(codes)


def _machine(args: argparse.Namespace, port: int, index: int, extra: dict) -> subprocess.Popen:
    low = args.machines if args.no_faults else args.machines - 1
    command = [
        sys.executable, "-m", "gossamer.launcher", "run",
        "--nnodes", f"{low}:{args.machines}", "--nproc-per-node", "1",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"join-digits-{port}",
        "--rdzv-conf", "last_call_timeout=2",
        "--max-restarts", "3",
        "--checkpoint-dir", str(args.out / "join_digits_ckpt"), "--checkpoint-every", "5",
        *sys.argv,
    ]  # fmt: skip
    environ = dict(os.environ, GLOO_SOCKET_IFNAME="lo", **extra)
    output = open(args.out / f"join_digits.machine{index}.log", "w")  # noqa: SIM115
    return subprocess.Popen(command, env=environ, stdout=output, stderr=subprocess.STDOUT)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(events: list[dict], began: float, args: argparse.Namespace) -> None:
    """Print the changes, the newcomer's catch-up and the final accuracy; plot."""
    starts = [e for e in events if e["event"] == "start"]
    for e in starts:
        if e["rank"] == 0:
            print(f"{e['t'] - began:6.1f} s: {e['size']} ranks start at step {e['step']}")
    killed = next((e for e in events if e["event"] == "killed"), None)
    if killed:
        resumed = _first_step_after(events, killed["t"], args.machines - 1)
        print(
            f"machine killed at step {killed['step']}, {killed['t'] - began:.1f} s; the "
            f"survivors' first evaluation {resumed - killed['t']:.1f} s later"
        )
    waiting = next((e for e in events if e["event"] == "waiting"), None)
    if waiting:
        joined = _first_step_after(events, waiting["t"], args.machines)
        print(
            f"newcomer started at step {waiting['step']}; first evaluation of "
            f"{args.machines} ranks "
            f"{joined - waiting['t']:.1f} s later"
        )
        _catch_up(events, waiting["t"])
    done = [e for e in events if e["event"] == "done"]
    if done:
        accuracy = 100 * statistics.mean(e["acc"] for e in done)
        print(f"final test accuracy, mean over {len(done)} ranks: {accuracy:.2f}%")
    else:
        print("no rank finished: see the machines' logs join_digits.machine<k>.log")
    path = args.out / "join_digits.png"
    plot(events, path)
    print(f"wrote {path}")


def _first_step_after(events: list[dict], t: float, size: int) -> float:  # nan: none
    """When ``size`` ranks first evaluated after ``t`` (every ``--eval-every`` steps)."""
    done = ("acc", "done")
    times = [e["t"] for e in events if e["event"] in done and e["t"] > t and e["size"] == size]
    return min(times, default=float("nan"))


def _catch_up(events: list[dict], since: float) -> None:
    """The newcomer's accuracy against the others' mean at each evaluation after joining."""
    joiner = next(e["rank"] for e in events if e["event"] == "start" and e["joiner"])
    after = [e for e in events if e["event"] == "acc" and e["t"] > since]
    for step in sorted({e["step"] for e in after})[:4]:
        mine = [e["acc"] for e in after if e["step"] == step and e["rank"] == joiner]
        others = [e["acc"] for e in after if e["step"] == step and e["rank"] != joiner]
        if mine and others:
            print(
                f"  step {step}: newcomer (rank {joiner}) {100 * mine[0]:.2f}%, others "
                f"{100 * statistics.mean(others):.2f}%"
            )


def plot(events: list[dict], path: Path) -> None:
    """Each rank's test accuracy over the steps of each start; the death and arrival marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    started: dict[tuple, int] = {}  # (size, rank) -> the step its current start resumed at
    curves: dict[tuple, list] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] == "start":
            started[e["size"], e["rank"]] = e["step"]
        elif e["event"] == "acc":
            key = (started[e["size"], e["rank"]], e["size"], e["rank"])
            curves.setdefault(key, []).append(e)
    for (begin, size, rank), points in sorted(curves.items()):
        label = f"{size} ranks from step {begin}: rank {rank}"
        ax.plot([p["step"] for p in points], [100 * p["acc"] for p in points], lw=1, label=label)
    marks = {e["event"]: e["step"] for e in events if e["event"] in ("killed", "waiting")}
    if "killed" in marks:
        ax.axvline(marks["killed"], color="k", ls="--", label="a machine dies")
    if "waiting" in marks:
        ax.axvline(marks["waiting"], color="k", ls=":", label="a machine joins")
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy (%)")
    lowest = min((100 * p["acc"] for points in curves.values() for p in points), default=80)
    ax.set_ylim(bottom=min(80, lowest - 2))  # the top 20 %, unless accuracy stays lower
    ax.set_title("digits on machines that leave and join (each restart resumes the average)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=4, help="machines (one rank each)")
    parser.add_argument("--steps", type=_POSITIVE, default=200)
    parser.add_argument("--kill-at", type=float, default=0.4, help="fraction of the run")
    parser.add_argument("--join-at", type=float, default=0.6, help="fraction of the run")
    parser.add_argument("--batch-size", type=_POSITIVE, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=_POSITIVE, default=5, help="steps between accuracies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"), help="output folder")
    parser.add_argument("--no-faults", action="store_true", help="nobody leaves or joins")
    args = parser.parse_args()
    if args.machines < 2:
        parser.error(f"--machines must be >= 2; got {args.machines}")
    if not 0 < args.kill_at < args.join_at < 1:
        parser.error(f"need 0 < --kill-at < --join-at < 1; got {args.kill_at}, {args.join_at}")
    args.out = args.out.resolve()
    if "RANK" in os.environ:
        train(args)
    else:
        sys.exit(drive(args))


if __name__ == "__main__":
    main()
