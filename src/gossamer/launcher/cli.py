"""The ``gossamer`` command line: ``gossamer run -np N [options] script.py args...``.

``gossamer run`` is a thin layer over ``torch.distributed.run`` (torchrun): it translates
BlueFog-style options into torchrun's, starts one torchrun agent per machine, forwards the
ranks' output line by line, and turns a failed rank into a message that names it and an
exit code that passes the rank's through.

This module imports neither torch nor the gossamer runtime: options are checked (and
``--version`` answered) without them; torch is imported once a job starts.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import uuid
from dataclasses import dataclass

from gossamer.env import CHECKPOINT_DIR, CHECKPOINT_EVERY, CHECKPOINT_RESIZE
from gossamer.launcher import preload
from gossamer.launcher.hosts import AGENT_FLAG, parse_hosts, place, run_hosts, watch_parent
from gossamer.launcher.signals import Interrupted, Interruption, interrupted_message

__all__ = ["build_parser", "main"]

# Our options that take a value; used to find where the user's command starts.
_VALUED = {
    "-np",
    "--np",
    "--num-proc",
    "-H",
    "--hosts",
    "--nnodes",
    "--nproc-per-node",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-conf",
    "--node-rank",
    "--network-interface",
    "--ssh-port",
    "--log-dir",
    "--min-ranks",
    "--max-restarts",
    "--checkpoint-dir",
    "--checkpoint-every",
}
# Single-machine jobs rendezvous through gossamer.launcher.loopback (its BACKEND); named here
# too because importing that module imports torch.
_LOOPBACK_BACKEND = "gossamer-loopback"
_LOOPBACK_INTERFACE = "lo"


def _positive_int(name: str):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 1; got {text!r}")
        return int(text)

    return parse


def _nodes(text: str) -> tuple[int, int]:
    """``--nnodes N`` or ``--nnodes MIN:MAX``, as (MIN, MAX)."""
    low, colon, high = text.partition(":")
    high = high if colon else low
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise argparse.ArgumentTypeError(
            f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX; got {text!r}"
        )
    return int(low), int(high)


def _count(name: str):
    def parse(text: str) -> int:
        if not text.isdigit():
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 0; got {text!r}")
        return int(text)

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The parser of the options before the user's command."""
    parser = argparse.ArgumentParser(prog="gossamer", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--version", action="store_true", help="print the version")
    sub = parser.add_subparsers(dest="subcommand")
    run = sub.add_parser(
        "run",
        help="start N ranks of a program",
        usage="gossamer run -np N [options] (script.py | -m module) [args...]",
    )
    run.add_argument(
        "-np",
        "--np",  # else argparse takes it for an abbreviation of --nproc-per-node
        "--num-proc",
        type=_positive_int("-np"),
        dest="num_proc",
        help="total number of ranks",
    )
    run.add_argument(
        "-H",
        "--hosts",
        help="hosts and slots, e.g. host1:4,host2:4 (ssh to hosts that are not this one)",
    )
    run.add_argument(
        "--nnodes",
        type=_nodes,
        help="machines in the job, N or MIN:MAX (machines may join and leave: the ranks "
        "restart, and --checkpoint-dir resumes them from the average); run `gossamer run` "
        "on each with the same --rdzv-endpoint",
    )
    run.add_argument(
        "--nproc-per-node",
        type=_positive_int("--nproc-per-node"),
        help="ranks on this machine (default: -np / --nnodes)",
    )
    run.add_argument("--rdzv-endpoint", help="host:port of the rendezvous (multi-machine)")
    run.add_argument("--rdzv-id", help="job id shared by all machines (default: a fixed one)")
    run.add_argument(
        "--rdzv-conf",
        help="torchrun's rendezvous settings, e.g. last_call_timeout=5 (how long a job of "
        "--nnodes MIN:MAX waits for more machines once MIN are there; default 30 s)",
    )
    run.add_argument(
        "--node-rank",
        type=int,
        help="this machine's index (0..nnodes-1): static rendezvous at --rdzv-endpoint, "
        "served by machine 0; its ranks are node_rank*nproc_per_node onwards",
    )
    run.add_argument("--network-interface", help="network interface for gloo and NCCL traffic")
    run.add_argument("--ssh-port", type=_positive_int("--ssh-port"), help="ssh port for -H")
    run.add_argument(
        "--tag-output",
        action="store_true",
        help="put [rank] before every stdout line and [rank,stderr] before every stderr line",
    )
    run.add_argument(
        "--log-dir",
        help="also write each rank's output to DIR/rank.<k>.stdout and DIR/rank.<k>.stderr",
    )
    run.add_argument("--verbose", action="store_true", help="show torchrun's own log")
    run.add_argument(
        "--no-preload",
        action="store_true",
        help="start every rank as a fresh python (default: fork it from one process that "
        "imported torch once; docs/launcher.md)",
    )
    fault = run.add_argument_group("fault tolerance (docs/fault-tolerance.md)")
    fault.add_argument(
        "--elastic",
        action="store_true",
        help="a rank that dies (or fails) does not stop the others while --min-ranks ranks "
        "of this machine are alive; for scripts that train with elastic=True gossip. Exit "
        "code 0 when the others finish with 0 (a line names each lost rank)",
    )
    fault.add_argument(
        "--min-ranks",
        type=_positive_int("--min-ranks"),
        help="with --elastic: fewer live ranks on this machine fail the job (default 1)",
    )
    fault.add_argument(
        "--max-restarts",
        type=_count("--max-restarts"),
        default=0,
        help="restart every rank up to K times when the job fails (default 0); with "
        "--checkpoint-dir the ranks resume from the newest checkpoint",
    )
    fault.add_argument(
        "--checkpoint-dir",
        help="directory of automatic checkpoints: the ranks' gossamer.checkpoint.AutoResume "
        "saves there and resumes from the newest complete one",
    )
    fault.add_argument(
        "--checkpoint-every",
        type=_positive_int("--checkpoint-every"),
        help="with --checkpoint-dir: steps between automatic checkpoints",
    )
    # Given by a -H launcher to the agents it starts (see hosts.watch_parent).
    run.add_argument(AGENT_FLAG, action="store_true", dest="hosts_agent", help=argparse.SUPPRESS)
    return parser


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split argv into the launcher's options and the user's command (script or -m module)."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "-m" or not token.startswith("-"):
            if token == "run" and i == 0:
                i += 1
                continue
            return argv[:i], argv[i:]
        i += 2 if token in _VALUED else 1
    return argv, []


def _fail(parser: argparse.ArgumentParser, message: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"gossamer run: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gossamer`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, command = _split(argv)
    parser = build_parser()
    args = parser.parse_args(ours)
    if args.version:
        print(f"gossamer {_version()}")
        return 0
    if args.subcommand != "run":
        parser.print_help(sys.stderr)
        return 2
    try:
        plan = _plan(args, command)
    except ValueError as err:
        return _fail(parser, str(err))
    if args.network_interface and not args.hosts:  # with -H the other hosts' interfaces
        try:
            socket.if_nametoindex(args.network_interface)
        except OSError:
            names = sorted(name for _, name in socket.if_nameindex())
            return _fail(
                parser,
                f"--network-interface: no interface {args.network_interface!r} on this "
                f"machine; it has {names}",
            )
    if plan.resizable:
        os.environ[CHECKPOINT_RESIZE] = "1"
        # torch's c10d rendezvous shares its store with the ranks, but its rank 0 publishes
        # the store's address only in the first round: a machine that joins a running job
        # waits for it forever (torch 2.13, dynamic_rendezvous.next_rendezvous). Unshared,
        # every round's rank 0 hosts a fresh store for its ranks.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if args.checkpoint_dir:
        # The ranks inherit the launcher's environment; gossamer.checkpoint.AutoResume reads it.
        os.environ[CHECKPOINT_DIR] = os.path.abspath(args.checkpoint_dir)
        os.environ[CHECKPOINT_EVERY] = str(args.checkpoint_every)
        if args.elastic:
            # The survivors' checkpoints hold fewer ranks: a restart resumes their average.
            os.environ[CHECKPOINT_RESIZE] = "1"
    if args.network_interface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.network_interface
        os.environ["NCCL_SOCKET_IFNAME"] = args.network_interface
    elif plan.loopback:
        _pin_to_loopback()
    with Interruption() as interruption:
        try:
            return _launch(args, plan, command, interruption)
        except Interrupted as err:
            # Before torchrun started anything (torch was still being imported, say).
            if not args.hosts_agent:
                print(interrupted_message(0), file=sys.stderr)
            return 128 + err.signum


def _launch(
    args: argparse.Namespace, plan: _Plan, command: list[str], interruption: Interruption
) -> int:
    agent_options = [f"--log-dir={plan.log_dir}"] if plan.log_dir else []
    if args.tag_output:
        agent_options.append("--tag-output")
    if args.network_interface:
        agent_options.append(f"--network-interface={args.network_interface}")
    if args.verbose:
        agent_options.append("--verbose")
    if args.no_preload:
        agent_options.append("--no-preload")
    if args.elastic:
        agent_options += ["--elastic", f"--min-ranks={args.min_ranks or 1}"]
    if args.checkpoint_dir:
        agent_options += [
            f"--checkpoint-dir={os.path.abspath(args.checkpoint_dir)}",
            f"--checkpoint-every={args.checkpoint_every}",
        ]
    if plan.hosts:
        return run_hosts(
            plan.hosts,
            command,
            interruption,
            agent_options=agent_options,
            rdzv_id=args.rdzv_id,
            ssh_port=args.ssh_port,
        )
    if args.hosts_agent:
        watch_parent()
    torchrun, preloader = plan.torchrun, None
    if not args.no_preload:
        # Started first, so that it imports torch while this process does.
        preloader = preload.start()
        # The plan ends with the command (`-m m` as `--module m`); torchrun starts clients.
        torchrun = [*torchrun[: -len(command)], "--no-python", *preload.client_command(command)]
    from gossamer.launcher.agent import run_agent  # imports torch

    try:
        return run_agent(
            torchrun,
            interruption,
            verbose=args.verbose,
            tag_output=args.tag_output,
            log_dir=plan.log_dir,
            announce_interrupt=not args.hosts_agent,
            elastic=args.elastic,
            min_ranks=args.min_ranks or 1,
        )
    finally:
        if preloader is not None:
            preloader.stop()


def _pin_to_loopback() -> None:
    """Keep gloo's and NCCL's sockets of a single-machine job on the loopback interface.

    Without a name they bind to the address the host name resolves to, which is usually
    reachable from the network. A name the user set wins.
    """
    if _LOOPBACK_INTERFACE not in {name for _, name in socket.if_nameindex()}:
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _LOOPBACK_INTERFACE)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", _LOOPBACK_INTERFACE)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gossamer")
    except metadata.PackageNotFoundError:
        # Running from a source tree. The root package is loaded already (Python imports a
        # package's parents first) and holds the version; importing it by name here would
        # make the launcher depend on the root package's API.
        return str(getattr(sys.modules.get("gossamer"), "__version__", "unknown"))


@dataclass(frozen=True)
class _Plan:
    """What a checked command line will start."""

    hosts: list[tuple[str, int]] | None  # -H: one agent per host
    torchrun: list[str]  # otherwise: torchrun's arguments for the agent in this process
    loopback: bool  # a single-machine job: everything on 127.0.0.1
    log_dir: str | None  # absolute
    resizable: bool = False  # --nnodes MIN:MAX: the world size may change at a restart


def _plan(args: argparse.Namespace, command: list[str]) -> _Plan:
    if not command or command == ["-m"]:
        raise ValueError("no program given: add `script.py [args]` or `-m module [args]`")
    if command[0] != "-m" and not os.path.isfile(command[0]):
        missing = "is a directory, not a script" if os.path.isdir(command[0]) else "does not exist"
        raise ValueError(f"script {command[0]!r} {missing}")
    log_dir = _log_dir(args.log_dir)
    _check_fault_options(args)
    if args.hosts and (args.nnodes or args.rdzv_endpoint):
        raise ValueError("-H/--hosts cannot be combined with --nnodes/--rdzv-endpoint")
    if args.hosts:
        if args.num_proc is None:
            raise ValueError("-np is required with -H/--hosts")
        return _Plan(place(args.num_proc, parse_hosts(args.hosts)), [], False, log_dir)
    low, nnodes = args.nnodes or (1, 1)
    resizable = low < nnodes
    if resizable:
        _check_resizable(args)
    per_node = args.nproc_per_node
    if per_node is None:
        if args.num_proc is None:
            raise ValueError("-np (or --nproc-per-node) is required")
        if args.num_proc % nnodes:
            raise ValueError(
                f"-np {args.num_proc} is not divisible by --nnodes {nnodes}; "
                "give --nproc-per-node on each machine instead"
            )
        per_node = args.num_proc // nnodes
    elif args.num_proc is not None and not resizable and args.num_proc != per_node * nnodes:
        raise ValueError(
            f"-np {args.num_proc} disagrees with --nproc-per-node {per_node} x --nnodes "
            f"{nnodes} = {per_node * nnodes}; give one of them"
        )
    if args.min_ranks is not None and args.min_ranks > per_node:
        raise ValueError(
            f"--min-ranks {args.min_ranks} is more than the {per_node} ranks of this machine "
            "(it counts this machine's live ranks)"
        )
    if nnodes > 1 and not args.rdzv_endpoint:
        raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint host:port")
    if args.node_rank is not None:
        if not 0 <= args.node_rank < nnodes:
            raise ValueError(f"--node-rank must be in 0..{nnodes - 1}; got {args.node_rank}")
        if not args.rdzv_endpoint:
            raise ValueError("--node-rank needs --rdzv-endpoint host:port")
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--rdzv-endpoint must be host:port; got {args.rdzv_endpoint!r}")
        # Static rendezvous: ranks follow node order (node k holds k*nproc..), which the
        # c10d rendezvous does not promise; machine 0's agent serves the store.
        torchrun = [
            f"--nnodes={nnodes}",
            "--rdzv-backend=static",
            f"--master-addr={host}",
            f"--master-port={port}",
            f"--node-rank={args.node_rank}",
        ]
    elif args.rdzv_endpoint:
        torchrun = [
            f"--nnodes={low}:{nnodes}" if resizable else f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id or 'gossamer'}",
        ]
    else:
        # Not --standalone: its stores listen on every interface (see loopback.py).
        torchrun = [
            "--nnodes=1",
            f"--rdzv-backend={_LOOPBACK_BACKEND}",
            "--rdzv-endpoint=127.0.0.1:0",
            f"--rdzv-id={args.rdzv_id or uuid.uuid4().hex[:12]}",
        ]
    if args.rdzv_conf:
        torchrun.append(f"--rdzv-conf={args.rdzv_conf}")
    torchrun += [f"--nproc-per-node={per_node}", f"--max-restarts={args.max_restarts}"]
    if command[0] == "-m":
        torchrun += ["--module", *command[1:]]
    else:
        torchrun += command
    loopback = nnodes == 1 and not args.rdzv_endpoint
    return _Plan(None, torchrun, loopback, log_dir, resizable)


def _check_resizable(args: argparse.Namespace) -> None:
    low, high = args.nnodes
    if not args.rdzv_endpoint:
        raise ValueError(f"--nnodes {low}:{high} needs --rdzv-endpoint host:port (c10d)")
    if args.node_rank is not None:
        raise ValueError(f"--nnodes {low}:{high} cannot take --node-rank (a static rendezvous)")
    if args.nproc_per_node is None or args.num_proc is not None:
        raise ValueError(
            f"--nnodes {low}:{high} takes --nproc-per-node, not -np: the number of ranks "
            "changes with the machines"
        )
    if args.elastic:
        raise ValueError(
            f"--elastic cannot be combined with --nnodes {low}:{high}: survivors that run on "
            "without a rank, and ranks that restart when a machine joins, are two ways of "
            "changing the job (not built together)"
        )


def _check_fault_options(args: argparse.Namespace) -> None:
    if args.min_ranks is not None and not args.elastic:
        raise ValueError("--min-ranks needs --elastic")
    if (args.checkpoint_dir is None) != (args.checkpoint_every is None):
        raise ValueError("--checkpoint-dir and --checkpoint-every go together")
    if args.checkpoint_dir == "":
        raise ValueError("--checkpoint-dir must name a directory; got ''")
    ckpt = args.checkpoint_dir
    if ckpt and os.path.exists(ckpt) and not os.path.isdir(ckpt):
        # Else the first save fails, steps into training.
        path = os.path.abspath(ckpt)
        raise ValueError(f"--checkpoint-dir {path!r} exists and is not a directory")
    if args.max_restarts and (args.hosts or args.node_rank is not None):
        # A static rendezvous cannot bring the other machines' agents into a restart.
        raise ValueError(
            "--max-restarts needs the c10d rendezvous: use --nnodes with --rdzv-endpoint "
            "(without -H or --node-rank) on each machine"
        )


def _log_dir(path: str | None) -> str | None:
    """``--log-dir`` made absolute and created; refused before anything starts."""
    if path is None:
        return None
    if not path:
        raise ValueError("--log-dir must name a directory; got ''")
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--log-dir {path!r} cannot be created: {err.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--log-dir {path!r} is not writable")
    return path
