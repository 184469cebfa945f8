"""``gossamer run --elastic``: a torchrun agent that lets the other ranks run when one dies.

torchrun's :class:`LocalElasticAgent` asks its process context whether the ranks are done
(``pcontext.wait(0)``), and the context *itself* stops every rank as soon as one has
failed; the agent then restarts the group or gives up. Ranks that train with
``elastic=True`` gossip could have gone on. :class:`SurvivingAgent` changes only that
policy: it polls the rank processes itself, records a rank that failed (killed, or a
non-zero exit) as *lost*, and reports the group healthy while at least ``min_ranks`` of
this agent's ranks are alive (running, or finished with code 0 after the last loss: a rank
that finished before a loss, or had left by ``shutdown()`` without having found it lost,
did not go on without the lost one). Below that it reports
the group failed with every loss so far, and torchrun does what it always does: restart
the group (``--max-restarts``) or stop it. When every rank has ended and at least
``min_ranks`` ended with code 0, the group has succeeded; the lost ranks are kept in
:attr:`SurvivingAgent.lost` for the launcher's report.

:func:`launch_agent` of torch has no parameter for the agent's class, so
:func:`surviving_agents` swaps the name it looks up for the duration of one launch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from gossamer import env

__all__ = ["SurvivingAgent", "surviving_agents"]

logger = logging.getLogger("gossamer")


class SurvivingAgent(LocalElasticAgent):
    """A :class:`LocalElasticAgent` whose ranks outlive a dead peer.

    Args:
        min_ranks (int): the fewest of this agent's ranks that must be alive (running, or
            finished with code 0 after the last loss); fewer fails the group (torchrun then
            restarts it or stops). 1 lets the job run on as long as any rank does.
        **kwargs: :class:`LocalElasticAgent`'s arguments.

    Attributes:
        lost (dict[int, ProcessFailure]): global rank -> failure of each rank lost in the
            current attempt (cleared when torchrun restarts the group).
    """

    def __init__(self, *, min_ranks: int = 1, **kwargs: Any) -> None:
        if min_ranks < 1:
            raise ValueError(f"min_ranks must be >= 1; got {min_ranks}")
        super().__init__(**kwargs)
        self.min_ranks = min_ranks
        self.lost: dict[int, ProcessFailure] = {}
        self._before_loss: set[int] = set()  # ranks that finished with 0 before a loss
        self._watched: object | None = None  # the process context `lost` belongs to

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        result = super()._invoke_run(role)
        if result.is_failed():
            # torchrun meets the other machines' agents at an exit barrier only on success,
            # so theirs would wait 300 s for this one. The job goes on without this
            # machine's ranks: meet them there, which also keeps the store up if this agent
            # serves it.
            self._exit_barrier()
        return result

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        pcontext = self._pcontext
        handlers = getattr(pcontext, "subprocess_handlers", None)
        if handlers is None:  # function entry points (not started by the launcher)
            return super()._monitor_workers(worker_group)
        if pcontext is not self._watched:  # a new attempt: forget the last one's losses
            self._watched, self.lost, self._before_loss = pcontext, {}, set()
        codes = {
            local_rank: (worker_group.workers[local_rank].global_rank, handler.proc.poll())
            for local_rank, handler in handlers.items()
        }
        running = {rank for rank, code in codes.values() if code is None}
        finished = {rank for rank, code in codes.values() if code == 0}
        for local_rank, (global_rank, code) in codes.items():
            handler = handlers[local_rank]
            if code not in (None, 0) and global_rank not in self.lost:
                # Ranks already done did not go on without it (an early finisher, and the
                # others then raising RankLostError, is a failed job). One that has left
                # but not yet exited counts too: the others find its exit at once.
                self._before_loss |= finished | self._left(worker_group, running, global_rank)
                self.lost[global_rank] = ProcessFailure(
                    local_rank=local_rank,
                    pid=handler.proc.pid,
                    exitcode=code,
                    error_file=pcontext.error_files[local_rank],  # type: ignore[union-attr]
                )
                self._mark_dead(worker_group, global_rank)
        if len(handlers) - len(self.lost) - len(self._before_loss) < self.min_ranks:
            # torchrun's own path from here: stop the rest, then restart or give up.
            return RunResult(state=WorkerState.FAILED, failures=dict(self.lost))
        if running:
            return RunResult(state=WorkerState.HEALTHY)
        # Every rank needs a value (torchrun records an event per rank); a process has none.
        done = {w.global_rank: None for w in worker_group.workers}
        return RunResult(state=WorkerState.SUCCEEDED, return_values=done)

    def _mark_dead(self, worker_group: WorkerGroup, rank: int) -> None:
        """Write ``rank``'s tombstone where its peers' liveness reads it (the agent's store).

        The peers then confirm the death at once instead of waiting for its heartbeat to go
        stale, and a peer still in ``gossamer.init()`` stops waiting for a rank that died
        before it got there. Best effort: without it they still find a death after init by
        the heartbeat (one before init then costs them ``GOSSAMER_TIMEOUT``).
        """
        try:
            ranks = self._ranks_store(worker_group)
            if ranks is not None:
                ranks.set(f"{env.DEAD_KEY}{rank}", "1")
                ranks.add(env.DEATHS_KEY, 1)
        except Exception:
            logger.warning("could not mark rank %d dead in the store", rank, exc_info=True)

    def _left(self, worker_group: WorkerGroup, ranks: set[int], lost: int) -> set[int]:
        """The ``ranks`` that left by ``shutdown()`` without having found ``lost`` lost.

        Read from the marks :data:`gossamer.env.LEFT_KEY` in the ranks' store; best effort
        (none without the agent's store).
        """
        try:
            store = self._ranks_store(worker_group) if ranks else None
            if store is None:
                return set()
            marks = {r: f"{env.LEFT_KEY}{r}" for r in ranks}
            return {
                r
                for r, key in marks.items()
                if store.check([key]) and str(lost) not in store.get(key).decode().split(",")
            }
        except Exception:
            logger.warning("could not read which ranks left", exc_info=True)
            return set()

    def _ranks_store(self, worker_group: WorkerGroup) -> dist.Store | None:
        """The store the ranks of this attempt use, if it is this agent's; else None."""
        spec = worker_group.spec
        if not spec.rdzv_handler.use_agent_store:
            return None  # the ranks' store is not this agent's: they judge by heartbeats
        store = dist.TCPStore(
            worker_group.master_addr,
            worker_group.master_port,
            is_master=False,
            timeout=timedelta(seconds=5),
        )
        # The prefix the ranks of this attempt use (gossamer.context, as torch's env://).
        attempt = spec.max_restarts - self._remaining_restarts
        return dist.PrefixStore(f"/worker/attempt_{attempt}", store)


@contextlib.contextmanager
def surviving_agents(min_ranks: int, made: list[SurvivingAgent]) -> Iterator[None]:
    """Make torch's ``elastic_launch`` start :class:`SurvivingAgent` agents meanwhile.

    Args:
        min_ranks (int): every agent's ``min_ranks``.
        made (list[SurvivingAgent]): the agents made are appended to it, in order.
    """

    def make(**kwargs: Any) -> SurvivingAgent:
        agent = SurvivingAgent(min_ranks=min_ranks, **kwargs)
        made.append(agent)
        return agent

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = make  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]
