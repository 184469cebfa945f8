"""The policy of `gossamer run --elastic`'s agent (`SurvivingAgent._monitor_workers`).

The agent reads only its process context's handlers; fake ones with given exit codes stand
for rank processes (the end-to-end runs are in test_elastic_run.py).
"""

from types import SimpleNamespace

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from gossamer.launcher.surviving import SurvivingAgent


def _agent(min_ranks):
    agent = SurvivingAgent.__new__(SurvivingAgent)  # no rendezvous or spec needed here
    agent.min_ranks, agent.lost, agent._watched = min_ranks, {}, None
    return agent


def _context(codes):
    handlers = {
        lr: SimpleNamespace(proc=SimpleNamespace(poll=lambda c=code: c, pid=100 + lr))
        for lr, code in enumerate(codes)
    }
    return SimpleNamespace(subprocess_handlers=handlers, error_files=dict.fromkeys(handlers, ""))


def _monitor(agent, codes):
    """One poll of the agent, its ranks (global 4, 5, 6, ...) having these exit codes."""
    if agent._pcontext is None:
        agent._pcontext = _context(codes)
    for lr, code in enumerate(codes):
        agent._pcontext.subprocess_handlers[lr].proc.poll = lambda c=code: c
    workers = [SimpleNamespace(global_rank=4 + i) for i in range(len(codes))]
    # Not the agent's store: no tombstones (those are tested end to end).
    spec = SimpleNamespace(rdzv_handler=SimpleNamespace(use_agent_store=False))
    group = SimpleNamespace(workers=workers, spec=spec)
    return agent._monitor_workers(group)


@pytest.fixture
def agent():
    a = _agent(min_ranks=2)
    a._pcontext = None
    return a


def test_a_dead_rank_is_recorded_and_the_others_run_on(agent):
    result = _monitor(agent, [None, -9, None])
    assert result.state == WorkerState.HEALTHY
    assert list(agent.lost) == [5]
    assert agent.lost[5].exitcode == -9 and agent.lost[5].pid == 101


def test_the_group_succeeds_when_the_survivors_finish(agent):
    _monitor(agent, [None, -9, None])
    result = _monitor(agent, [0, -9, 0])
    assert result.state == WorkerState.SUCCEEDED
    assert sorted(result.return_values) == [4, 5, 6]  # torchrun records every rank
    assert list(agent.lost) == [5]


def test_fewer_than_min_ranks_alive_fails_the_group_with_every_loss(agent):
    _monitor(agent, [None, -9, None])
    result = _monitor(agent, [1, -9, None])
    assert result.state == WorkerState.FAILED
    assert sorted(result.failures) == [4, 5]
    assert result.failures[4].exitcode == 1


def test_a_new_attempt_forgets_the_last_ones_losses(agent):
    _monitor(agent, [None, -9, None])
    agent._pcontext = _context([None, None, None])  # torchrun restarted the group
    assert _monitor(agent, [None, None, None]).state == WorkerState.HEALTHY
    assert agent.lost == {}


def test_min_ranks_must_be_positive():
    with pytest.raises(ValueError, match="min_ranks must be >= 1; got 0"):
        SurvivingAgent(min_ranks=0, spec=None, logs_specs=None)
