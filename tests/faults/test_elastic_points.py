"""The fault suite with elastic gossip: a rank is SIGKILLed mid-training; the survivors finish.

Every neighbour-averaging optimizer built with ``elastic=True`` runs on 4 ranks (a static
graph, a one-peer schedule, CHOCO and compressed win-put); rank 2 kills itself before its 6th step.
Each survivor must take all its steps without an error, agree that the live ranks are
``[0, 1, 3]``, and keep averaging: the survivors start from different models and fit the same
data, so only gossip can remove their difference in the directions the data does not see
(16 samples, 50 weights). Without ``elastic`` the same kill ends the job with
``RankLostError`` (``test_fault_points.py``).
"""

import os
import signal
import time

import pytest
import torch

import gossamer
from gossamer.optim import AdaptThenCombine, AdaptWithCombine, PushSum, WindowPut
from gossamer.testing import run_distributed
from gossamer.topology import exponential_two, one_peer_exponential, ring

WORLD, VICTIM, KILL_AT, STEPS = 4, 2, 5, 40

# point: (optimizer class, keyword arguments but the schedule, one-peer schedule?)
POINTS = {
    "awc_exp2": (AdaptWithCombine, {}, False),
    "awc_one_peer": (AdaptWithCombine, {}, True),
    "awc_global_every_4": (AdaptWithCombine, {"global_average_every": 4}, False),
    "awc_uint8_ring": (AdaptWithCombine, {"topology": ring(WORLD), "compression": "uint8"}, False),
    "awc_uint8_one_peer": (AdaptWithCombine, {"compression": "uint8"}, True),
    "atc_ring": (AdaptThenCombine, {"topology": ring(WORLD)}, False),
    "atc_one_peer": (AdaptThenCombine, {}, True),
    "exact_diffusion_ring": (AdaptThenCombine, {"exact_diffusion": True}, False),
    "win_put_ring": (WindowPut, {"topology": ring(WORLD)}, False),
    "win_put_one_peer": (WindowPut, {}, True),
    "win_put_uint8": (WindowPut, {"topology": ring(WORLD), "compression": "uint8"}, False),
    "push_sum_exp2": (PushSum, {}, False),
    "push_sum_one_peer": (PushSum, {}, True),
}


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(point: str) -> dict:
    cls, kwargs, one_peer = POINTS[point]
    rank = gossamer.rank()
    torch.manual_seed(rank)  # different models
    model = torch.nn.Linear(50, 1)
    start = _flat(model)
    if one_peer:
        kwargs = {**kwargs, "schedule": one_peer_exponential(exponential_two(WORLD), rank)}
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.01), model, elastic=True, **kwargs)
    data = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))  # the same data
    longest = 0.0
    for step in range(STEPS):
        if rank == VICTIM and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        began = time.monotonic()
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        opt.step()
        if step >= KILL_AT:  # the steps that find the death, not the first one's warm-up
            longest = max(longest, time.monotonic() - began)
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    if hasattr(opt, "free"):
        opt.free()  # collective over the live ranks
    return {"start": start, "end": _flat(model), "live": gossamer.live_ranks(), "slowest": longest}


def _spread(values: list[torch.Tensor]) -> float:
    stacked = torch.stack(values)
    return (stacked - stacked.mean(0)).norm().item()


@pytest.mark.parametrize("point", list(POINTS))
def test_survivors_of_elastic_gossip_finish_and_keep_averaging(point):
    results = run_distributed(_train, WORLD, args=(point,), dies=[VICTIM], timeout=120)
    survivors = [r for r in range(WORLD) if r != VICTIM]
    assert results[VICTIM] is None
    for r in survivors:
        assert results[r]["live"] == survivors, (r, results[r]["live"])
    before = _spread([results[r]["start"] for r in survivors])
    after = _spread([results[r]["end"] for r in survivors])
    print(
        point,
        "slowest step from the kill on (s):",
        [round(results[r]["slowest"], 2) for r in survivors],
    )
    # Push-sum's puts land whenever they arrive, so how far its survivors mix in 40 steps
    # depends on timing (0.054 of the start once on a loaded machine, 0.109 once in CI
    # with the one-peer schedule); without gossip the spread stays near the start (the
    # data fix 16 of the 50 directions), so a quarter still tells mixing from none.
    limit = 0.25 if POINTS[point][0] is PushSum else 0.05
    assert after < limit * before, (point, before, after)
