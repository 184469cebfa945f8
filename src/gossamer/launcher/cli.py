"""The ``gossamer`` command line: ``gossamer run -np N [options] script.py args...``.

``gossamer run`` is a thin layer over ``torch.distributed.run`` (torchrun): it translates
BlueFog-style options into torchrun's, starts one torchrun agent per machine, and turns a
failed rank into a message that names it and an exit code that passes the rank's through.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import uuid

from gossamer.launcher.hosts import is_local_host, parse_hosts, place

__all__ = ["build_parser", "main"]

# Our options that take a value; used to find where the user's command starts.
_VALUED = {
    "-np",
    "--num-proc",
    "-H",
    "--hosts",
    "--nnodes",
    "--nproc-per-node",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--node-rank",
    "--network-interface",
    "--ssh-port",
}
# Variables forwarded to ranks started over ssh (local ranks inherit the whole environment).
_FORWARDED_PREFIXES = ("GOSSAMER_", "PYTHONPATH", "OMP_NUM_THREADS", "GLOO_", "NCCL_")
_DEFAULT_RDZV_PORT = 29400


def _positive_int(name: str):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 1; got {text!r}")
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
        type=_positive_int("--nnodes"),
        help="machines in the job; run `gossamer run` on each with the same --rdzv-endpoint",
    )
    run.add_argument(
        "--nproc-per-node",
        type=_positive_int("--nproc-per-node"),
        help="ranks on this machine (default: -np / --nnodes)",
    )
    run.add_argument("--rdzv-endpoint", help="host:port of the rendezvous (multi-machine)")
    run.add_argument("--rdzv-id", help="job id shared by all machines (default: a fixed one)")
    run.add_argument(
        "--node-rank",
        type=int,
        help="this machine's index (0..nnodes-1): static rendezvous at --rdzv-endpoint, "
        "served by machine 0; its ranks are node_rank*nproc_per_node onwards",
    )
    run.add_argument("--network-interface", help="network interface for gloo and NCCL traffic")
    run.add_argument("--ssh-port", type=_positive_int("--ssh-port"), help="ssh port for -H")
    run.add_argument("--verbose", action="store_true", help="show torchrun's own log")
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
        from gossamer import __version__

        print(f"gossamer {__version__}")
        return 0
    if args.subcommand != "run":
        parser.print_help(sys.stderr)
        return 2
    try:
        plan = _plan(args, command)
    except ValueError as err:
        return _fail(parser, str(err))
    if args.network_interface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.network_interface
        os.environ["NCCL_SOCKET_IFNAME"] = args.network_interface
    if plan["hosts"]:
        return _run_hosts(args, plan["hosts"], command)
    return _run_agent(plan["torchrun"], verbose=args.verbose)


def _plan(args: argparse.Namespace, command: list[str]) -> dict:
    if not command or command == ["-m"]:
        raise ValueError("no program given: add `script.py [args]` or `-m module [args]`")
    if command[0] != "-m" and not os.path.isfile(command[0]):
        raise ValueError(f"script {command[0]!r} does not exist")
    if args.hosts and (args.nnodes or args.rdzv_endpoint):
        raise ValueError("-H/--hosts cannot be combined with --nnodes/--rdzv-endpoint")
    if args.hosts:
        if args.num_proc is None:
            raise ValueError("-np is required with -H/--hosts")
        return {"hosts": place(args.num_proc, parse_hosts(args.hosts))}
    nnodes = args.nnodes or 1
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
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id or 'gossamer'}",
        ]
    else:
        torchrun = ["--standalone", "--nnodes=1"]
    torchrun += [f"--nproc-per-node={per_node}", "--max-restarts=0"]
    if command[0] == "-m":
        torchrun += ["--module", *command[1:]]
    else:
        torchrun += command
    return {"hosts": None, "torchrun": torchrun}


def _run_agent(torchrun_argv: list[str], *, verbose: bool) -> int:
    """Run one torchrun agent in this process; return the first failed rank's exit code."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not verbose:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        # torchrun would pick 1 as well, but with a banner on every launch.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun.run(torchrun.parse_args(torchrun_argv))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode
        how = (
            f"was killed by signal {signal.Signals(-code).name}"
            if code < 0
            else f"failed with exit code {code}"
        )
        print(
            f"gossamer run: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}",
            file=sys.stderr,
        )
        for other in sorted(r for r in err.failures if r != rank):
            print(
                f"gossamer run: rank {other} then ended with code {err.failures[other].exitcode}",
                file=sys.stderr,
            )
        return 128 - code if code < 0 else code or 1
    return 0


def _run_hosts(args: argparse.Namespace, hosts: list[tuple[str, int]], command: list[str]) -> int:
    """Start one agent per host (locally or over ssh) around one c10d rendezvous."""
    first = hosts[0][0]
    endpoint = (
        f"127.0.0.1:{_free_port()}" if is_local_host(first) else f"{first}:{_DEFAULT_RDZV_PORT}"
    )
    job = args.rdzv_id or uuid.uuid4().hex[:12]
    procs = []
    for host, count in hosts:
        agent = [
            sys.executable,
            "-m",
            "gossamer.launcher",
            "run",
            f"--nnodes={len(hosts)}",
            f"--nproc-per-node={count}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={job}",
        ]
        if args.network_interface:
            agent.append(f"--network-interface={args.network_interface}")
        if args.verbose:
            agent.append("--verbose")
        agent += command
        if not is_local_host(host):
            agent = _over_ssh(host, agent, args.ssh_port)
        procs.append(subprocess.Popen(agent))
    return _wait_all(procs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _over_ssh(host: str, agent: list[str], port: int | None) -> list[str]:
    forwarded = [f"{k}={v}" for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIXES)]
    remote = f"cd {shlex.quote(os.getcwd())} && exec env {shlex.join(forwarded + agent)}"
    ssh = ["ssh", "-o", "BatchMode=yes"]
    if port:
        ssh += ["-p", str(port)]
    return [*ssh, host, remote]


def _wait_all(procs: list[subprocess.Popen]) -> int:
    """Wait for every agent; once one fails, stop the others and return its code."""
    code = 0
    try:
        for proc in procs:
            status = proc.wait()
            if status and not code:
                code = status
                for other in procs:
                    if other.poll() is None:
                        other.terminate()
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        raise
    return code
