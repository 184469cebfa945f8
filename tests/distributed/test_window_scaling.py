"""The window service keeps no state that grows with its history (long runs stay as fast).

A gloo send reports completion only to ``wait``: a service that keeps its answers' sends in a
list and filters it with ``is_completed()`` on every message never shrinks the list, and each
message costs time proportional to every message before it (4 ranks x 1,000 mutex-protected
accumulates: 196 calls/s in the first 10 %, 29 in the last). The sends must be retired.
"""

import time

import pytest
import torch

import gossamer
from gossamer import topology as topo
from gossamer.testing import run_distributed
from gossamer.windows.registry import registry

CALLS = 250
BOUND = 200  # the old service held about 6 sends per mutex-protected call: 1,500 here


def _queued_sends(svc) -> int:
    sends = svc._sends
    return sends.qsize() if hasattr(sends, "qsize") else len(sends)


def _drained(svc) -> int:
    # every answer this service sent was received (each origin waited for it), so the sends
    # retire; give the thread that retires them a moment to get there
    deadline = time.monotonic() + 10.0
    while _queued_sends(svc) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _queued_sends(svc)


def _many_accumulates(require_mutex):
    r, n = gossamer.rank(), gossamer.size()
    x = torch.full((8,), float(r + 1), dtype=torch.float64)
    graph = topo.exponential_two(n)
    with gossamer.Window.create(x, zero_init=True, topology=graph) as win:
        svc = registry().service
        gossamer.barrier()
        most = 0
        for _ in range(CALLS):
            win.accumulate(require_mutex=require_mutex)
            most = max(most, _queued_sends(svc))
        gossamer.barrier()  # every rank's accumulates have landed
        sums = {s: b.sum().item() for s, b in win.buffers().items()}
        left = _drained(svc)
        pending = len(svc._pending)
        state = svc.windows[win._state.wid]
        with state.lock:
            busy = [s for s, m in state.mutexes.items() if m.holder is not None or m.waiters]
        gossamer.barrier()
    return sums, most, left, pending, busy


@pytest.mark.parametrize("require_mutex", [True, False], ids=["mutex", "plain"])
def test_long_run_of_accumulates_keeps_the_service_bounded(require_mutex):
    n = 4
    graph = topo.exponential_two(n)
    got = run_distributed(_many_accumulates, n, args=(require_mutex,), timeout=120)
    for r, (sums, most, left, pending, busy) in enumerate(got):
        # nothing lost: every in-neighbour s added s + 1 into each of 8 elements per call
        assert sums == {s: float(CALLS * 8 * (s + 1)) for s in graph.in_neighbors(r)}
        assert most <= BOUND, f"rank {r}: {most} sends held at once after <= {CALLS} calls"
        assert left == 0, f"rank {r}: {left} sends never retired"
        assert pending == 0
        assert busy == []
