"""One torchrun agent in this process: this machine's ranks, their output and their end.

Imports torch (the rest of the launcher does not), so the command line imports this module
only once it has checked its options and a job is really about to start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import elastic_launch

from gossamer.launcher import loopback
from gossamer.launcher.output import Forwarder, make_fifo
from gossamer.launcher.signals import (
    Interrupted,
    Interruption,
    children,
    interrupted_message,
    kill_process_trees,
)
from gossamer.launcher.surviving import SurvivingAgent, surviving_agents

__all__ = ["RankOutput", "run_agent"]

# The agent's own signal handlers are ours (see Interruption); torchrun keeps only this one.
_TORCH_SIGNALS = "SIGQUIT"
_TORCHRUN_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
)


class RankOutput(LogsSpecs):
    """torchrun's log specification, pointed at one pipe per rank and stream.

    torchrun starts each rank with its stdout and stderr opened on the paths returned by
    :meth:`reify`: named pipes that a :class:`~gossamer.launcher.output.Forwarder` reads.

    Args:
        workdir (str): private directory for the pipes and torchrun's error files.
        forwarder (Forwarder): what reads the pipes.
        tag_output (bool): put ``[rank] `` / ``[rank,stderr] `` before every line.
        log_dir (str, optional): also write ``rank.<k>.stdout`` / ``.stderr`` there.
    """

    def __init__(
        self, workdir: str, forwarder: Forwarder, *, tag_output: bool, log_dir: str | None
    ) -> None:
        super().__init__(log_dir=workdir)
        self._workdir = workdir
        self._forwarder = forwarder
        self._tag_output = tag_output
        self._user_log_dir = log_dir
        self._attempt = 0
        self.started: list[int] = []  # global ranks started, in order

    @property
    def root_log_dir(self) -> str:
        """The private directory (torchrun asks for it)."""
        return self._workdir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Create the pipes of the ranks about to start (``envs`` is keyed by local rank)."""
        self._attempt += 1
        dest = LogsDest()
        for local_rank, env in sorted(envs.items()):
            rank = int(env.get("RANK", local_rank))
            self.started.append(rank)
            for stream, fd, paths in (("stdout", 1, dest.stdouts), ("stderr", 2, dest.stderrs)):
                path = os.path.join(self._workdir, f"{self._attempt}.rank.{rank}.{stream}")
                read_fd, keepalive_fd = make_fifo(path)
                prefix = ""
                if self._tag_output:
                    prefix = f"[{rank}] " if stream == "stdout" else f"[{rank},stderr] "
                log_path = None
                if self._user_log_dir is not None:
                    log_path = os.path.join(self._user_log_dir, f"rank.{rank}.{stream}")
                self._forwarder.add(
                    read_fd, dest=fd, prefix=prefix, log_path=log_path, keepalive_fd=keepalive_fd
                )
                paths[local_rank] = path
            error_file = os.path.join(self._workdir, f"{self._attempt}.rank.{rank}.error.json")
            dest.error_files[local_rank] = error_file
            env["TORCHELASTIC_ERROR_FILE"] = error_file
        return dest


def run_agent(
    torchrun_argv: list[str],
    interruption: Interruption,
    *,
    verbose: bool = False,
    tag_output: bool = False,
    log_dir: str | None = None,
    announce_interrupt: bool = True,
    elastic: bool = False,
    min_ranks: int = 1,
) -> int:
    """Run one torchrun agent here until its ranks end; return the launcher's exit code.

    Args:
        torchrun_argv (list[str]): torchrun's arguments, the program and its arguments last.
        interruption (Interruption): the launcher's installed signal handlers.
        verbose (bool): let torchrun's own log through.
        tag_output (bool): prefix every line of the ranks with their rank.
        log_dir (str, optional): existing directory for per-rank output files.
        announce_interrupt (bool): print the one "interrupted" line (not for agents that a
            ``-H`` launcher started: it prints the line for the whole job).
        elastic (bool): a rank's death does not stop the others while ``min_ranks`` of
            this agent's ranks are alive (:class:`~gossamer.launcher.surviving.SurvivingAgent`).
        min_ranks (int): see ``elastic``.

    Returns:
        0 (with ``elastic``: also when ranks were lost but the others finished with code 0;
        a line names each lost rank), the first failed rank's exit code (128 + signal for a
        killed rank), 128 + signal when the launcher was interrupted, or 1 when the
        rendezvous failed.
    """
    if not verbose:
        _silence_torchrun()
    # torchrun would pick 1 as well, but with a banner on every launch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    loopback.register()
    workdir = tempfile.mkdtemp(prefix="gossamer-run-")
    # Every rank of this launch, and nothing else, has this in its environment.
    ours = f"TORCHELASTIC_ERROR_FILE={workdir}{os.sep}".encode()
    forwarder = Forwarder()
    output = RankOutput(workdir, forwarder, tag_output=tag_output, log_dir=log_dir)
    messages: list[str] = []
    try:
        try:
            # The ranks get SIGTERM (a Python program ends quietly), whatever came here.
            interruption.raise_as = lambda signum: SignalException(
                f"gossamer run got {signal.Signals(signum).name}", sigval=signal.SIGTERM
            )
            interruption.on_repeat = lambda: kill_process_trees(children(ours))
            # --log-dir: otherwise torchrun makes a /tmp/torchelastic_* directory it never
            # removes; the directory is ours and goes at the end.
            args = torchrun.parse_args([f"--log-dir={workdir}", *torchrun_argv])
            config, cmd, cmd_args = torchrun.config_from_args(args)
            config.logs_specs = output
            config.signals_to_handle = _TORCH_SIGNALS
            agents: list[SurvivingAgent] = []
            with surviving_agents(min_ranks, agents) if elastic else contextlib.nullcontext():
                elastic_launch(config, cmd)(*cmd_args)
            code = 0
            if agents:
                messages = _survival_report(agents[-1])
        finally:
            interruption.disarm()
    except ChildFailedError as err:
        code, messages = _failure_report(err)
    except (SignalException, Interrupted) as err:
        signum = interruption.signum or int(getattr(err, "sigval", signal.SIGTERM))
        code = 128 + signum
        if announce_interrupt:
            messages = [interrupted_message(len(output.started))]
    except RendezvousError as err:
        code = 1
        messages = [f"gossamer run: the rendezvous failed: {type(err).__name__}: {err}"]
    finally:
        # A signal can land between two steps of torchrun's start-up, before it tracks a
        # rank it has just started; ranks run in sessions of their own, so nothing else
        # would stop them.
        leftover = children(ours)
        kill_process_trees(leftover)
        for pid in leftover:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        forwarder.close()
        shutil.rmtree(workdir, ignore_errors=True)
    for message in messages:
        print(message, file=sys.stderr)
    return code


def _silence_torchrun() -> None:
    # torchrun's modules set their own loggers' levels (LOGLEVEL, WARNING by default), so a
    # parent's level would not hold; cutting propagation does, for loggers made later too.
    for name in _TORCHRUN_LOGGERS:
        logger = logging.getLogger(name)
        logger.propagate = False
        if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
            logger.addHandler(logging.NullHandler())  # else logging's last resort prints


def _survival_report(agent: SurvivingAgent) -> list[str]:
    lines = []
    for rank, failure in sorted(agent.lost.items()):
        lines.append(
            f"gossamer run: rank {rank} (local rank {failure.local_rank}, pid "
            f"{failure.pid}) {_how(failure.exitcode)}; the others went on (--elastic)"
        )
    return lines


def _how(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"failed with exit code {code}"


def _failure_report(err: ChildFailedError) -> tuple[int, list[str]]:
    rank, failure = err.get_first_failure()
    code = failure.exitcode
    lines = [
        f"gossamer run: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) "
        f"{_how(code)}"
    ]
    for other in sorted(r for r in err.failures if r != rank):
        lines.append(
            f"gossamer run: rank {other} then ended with code {err.failures[other].exitcode}"
        )
    return (128 - code if code < 0 else code or 1), lines
