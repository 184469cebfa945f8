"""Training that outlives its peers: one of 4 ranks SIGKILLs itself in the middle of training.

With ``elastic=True`` the survivors finish. Their parameters are compared, step by step
from the kill on, with a one-process simulation of what the survivors' algorithm does (see
``ElasticRound``: a rank whose peer is the dead one combines with the survivors' weights in
the round of the death; a rank that hears of it through a peer's header epoch does one
round later), and exact diffusion reaches the closed-form least-squares optimum of the
survivors' data. With ``elastic=False`` every survivor raises ``RankLostError`` naming the
dead rank. Each case runs on fresh ranks (``run_distributed(..., dies=...)``).
"""

import os
import signal

import numpy as np
import pytest
import torch

import gossamer
from gossamer import communicators
from gossamer.compression import get_compressor
from gossamer.optim import AdaptThenCombine, AdaptWithCombine
from gossamer.testing import run_distributed
from gossamer.topology import (
    drop_dead,
    exponential_two,
    metropolis_hastings_weights,
    one_peer_exponential,
    ring,
)
from problems import least_squares_data, least_squares_loss, linear_model

WORLD, VICTIM, KILL_STEP = 4, 2, 6


def _graph(kind, world):
    """ring(n), or ("chord") ring(n) plus the edge 1 -- 3 with Metropolis-Hastings weights.

    In the chorded graph rank 1 has degree 3 until rank 2 dies, so rank 0, which is not a
    neighbour of rank 2, changes its weight on rank 1 (1/4 -> 1/3) when it learns of the
    death: the round in which it learns shows in its parameters.
    """
    if kind == "ring":
        return ring(world)
    adj = ring(world).adjacency.copy()
    adj[1, 3] = adj[3, 1] = True
    return metropolis_hastings_weights(adj)


def _train(kind, steps, lr, elastic):
    """Train on this rank's least-squares share; the victim kills itself at KILL_STEP."""
    rank, world = gossamer.rank(), gossamer.size()
    A, b = least_squares_data(rank)
    model = linear_model()
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    if kind in ("ring", "chord"):
        opt = AdaptWithCombine(sgd, model, topology=_graph(kind, world), elastic=elastic)
    elif kind == "one_peer":
        schedule = one_peer_exponential(exponential_two(world), rank)
        opt = AdaptWithCombine(sgd, model, schedule=schedule, elastic=elastic)
    else:  # exact diffusion: reaches the survivors' optimum with a constant step
        opt = AdaptThenCombine(
            sgd, model, topology=ring(world), exact_diffusion=True, elastic=elastic
        )
    changes = []
    gossamer.on_membership_change(lambda c: changes.append((c.epoch, c.live, c.lost)))
    trace = []
    for step in range(steps):
        if rank == VICTIM and step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            opt.zero_grad()
            least_squares_loss(model, A, b).backward()
            opt.step()
            opt.synchronize()
        except gossamer.RankLostError as err:
            return {"error": str(err), "ranks": err.ranks, "step": step}
        trace.append(model.weight.detach().clone().squeeze(0))
    return {"trace": torch.stack(trace), "live": gossamer.live_ranks(), "changes": changes}


def _grad(x, rank):
    A, b = (t.numpy() for t in least_squares_data(rank))
    return A.T @ (A @ x - b) / len(b)


def _simulate_awc(kind, steps, lr, world):
    """AWC on every rank in one process: x <- W_t x - lr * grad(x), dead rank frozen.

    ring, chord: a static graph; after the kill, a rank uses ``graph.without([2])``
    (Metropolis-Hastings) from the round in which it knows: the dead rank's neighbours in
    the round of the kill, the others one round after a neighbour knew (on ring(6): ranks 1
    and 3, then 0 and 4, then 5).
    one_peer: ``drop_dead`` of each rank's step from the kill on (a step that does not touch
    the dead rank is unchanged, so when a rank learns does not matter).
    """
    dead = {VICTIM}
    x = np.zeros((world, 5))
    old = _graph(kind if kind != "one_peer" else "ring", world)
    new = old.without([VICTIM])
    schedules = [one_peer_exponential(exponential_two(world), r) for r in range(world)]
    knows = set()
    out = []
    for step in range(steps):
        after = step >= KILL_STEP
        if kind != "one_peer" and after:
            # headers of this round carry what the senders knew at its start
            heard = {r for r in range(world) if any(s in knows for s in old.in_neighbors(r))}
            touches = {r for r in range(world) if VICTIM in old.in_neighbors(r)}
            knows = knows | heard | touches
        steps_now = [next(s) for s in schedules]
        mixed = x.copy()
        for r in range(world):
            if after and r in dead:
                continue
            if kind != "one_peer":
                graph = new if r in knows else old
                self_weight, weights = graph.recv_weights(r)
            else:
                st = drop_dead(steps_now[r], dead) if after else steps_now[r]
                self_weight, weights = st.self_weight, st.src_weights
            mixed[r] = self_weight * x[r] + sum(w * x[s] for s, w in weights.items())
            mixed[r] -= lr * _grad(x[r], r)
        x = mixed
        out.append(x.copy())
    return np.stack(out)  # (steps, world, 5)


def _survivors_optimum():
    parts = [least_squares_data(r) for r in range(WORLD) if r != VICTIM]
    A = torch.cat([a for a, _ in parts]).numpy()
    b = torch.cat([b for _, b in parts]).numpy()
    return np.linalg.lstsq(A, b, rcond=None)[0]


@pytest.mark.parametrize(("kind", "world"), [("ring", 4), ("one_peer", 4), ("chord", 6)])
def test_elastic_awc_survivors_follow_the_simulation(kind, world):
    steps, lr = 30, 0.1
    results = run_distributed(
        _train, world, args=(kind, steps, lr, True), dies=[VICTIM], timeout=120
    )
    assert results[VICTIM] is None  # it died
    want = _simulate_awc(kind, steps, lr, world)
    live = tuple(r for r in range(world) if r != VICTIM)
    for r in live:
        got = results[r]
        assert "error" not in got, got
        assert got["live"] == list(live)
        assert got["changes"] == [(1, live, (VICTIM,))]
        np.testing.assert_allclose(got["trace"].numpy(), want[:, r], rtol=1e-9, atol=1e-12)


def test_elastic_exact_diffusion_reaches_the_survivors_optimum():
    results = run_distributed(
        _train, WORLD, args=("exact", 150, 0.2, True), dies=[VICTIM], timeout=120
    )
    optimum = _survivors_optimum()
    everyone = np.linalg.lstsq(
        torch.cat([least_squares_data(r)[0] for r in range(WORLD)]).numpy(),
        torch.cat([least_squares_data(r)[1] for r in range(WORLD)]).numpy(),
        rcond=None,
    )[0]
    assert np.abs(optimum - everyone).max() > 1e-2  # the two optima are told apart
    for r in (0, 1, 3):
        final = results[r]["trace"][-1].numpy()
        np.testing.assert_allclose(final, optimum, atol=1e-6)


@pytest.mark.parametrize("kind", ["ring", "one_peer"])
def test_without_elastic_survivors_raise_naming_the_dead_rank(kind):
    results = run_distributed(
        _train, WORLD, args=(kind, 30, 0.1, False), dies=[VICTIM], timeout=120
    )
    for r in (0, 1, 3):
        got = results[r]
        assert got["ranks"] == [VICTIM], got
        assert f"rank {VICTIM} was lost" in got["error"], got
        assert got["step"] >= KILL_STEP - 1, got


def test_elastic_needs_neighbour_averaging():
    with pytest.raises(ValueError, match="elastic=True"):
        from gossamer.communicators import make

        make("allreduce", elastic=True)


CHOCO_ROUNDS = 16


def _choco_rounds():
    """Pure CHOCO-uint8 averaging on ring(4); the victim kills itself at round KILL_STEP."""
    rank = gossamer.rank()
    comm = communicators.ChocoGossip("uint8", topology=ring(WORLD), elastic=True)
    x = torch.randn(300, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)
    trace = []
    for step in range(CHOCO_ROUNDS):
        if rank == VICTIM and step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.next_round()
        x = comm.start(x, 0).wait()
        trace.append(x.clone())
    return {"trace": torch.stack(trace), "live": gossamer.live_ranks()}


def _simulate_elastic_choco():
    """CHOCO for every rank in one process, each switching to ring(4).without([2]) when it knows.

    The rule of ``_simulate_awc``: ranks 1 and 3 in the round of the death, rank 0 one
    round later. Public copies h are updated by every live rank; the dead rank's is frozen.
    """
    c = get_compressor("uint8")
    gamma = communicators.default_gamma(c)
    old = ring(WORLD)
    new = old.without([VICTIM])
    xs = [
        torch.randn(300, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
        for r in range(WORLD)
    ]
    hat = [torch.zeros_like(x) for x in xs]
    knows, out = set(), []
    for step in range(CHOCO_ROUNDS):
        after = step >= KILL_STEP
        live = [r for r in range(WORLD) if not (after and r == VICTIM)]
        if after:
            heard = {r for r in live if any(s in knows for s in old.in_neighbors(r))}
            touches = {r for r in live if VICTIM in old.in_neighbors(r)}
            knows |= heard | touches
        for i in live:
            hat[i] = hat[i] + c.decompress(c.compress(xs[i] - hat[i]))
        mixed = list(xs)
        for i in live:
            _, weights = (new if i in knows else old).recv_weights(i)
            pull = sum(w * (hat[j] - hat[i]) for j, w in weights.items())
            mixed[i] = xs[i] + gamma * pull
        xs = mixed
        out.append(torch.stack(xs))
    return torch.stack(out)  # (rounds, world, 300)


def test_elastic_choco_survivors_follow_the_simulation():
    results = run_distributed(_choco_rounds, WORLD, dies=[VICTIM], timeout=120)
    want = _simulate_elastic_choco()
    survivors = [r for r in range(WORLD) if r != VICTIM]
    for r in survivors:
        assert results[r]["live"] == survivors
        torch.testing.assert_close(results[r]["trace"], want[:, r], rtol=1e-6, atol=1e-9)
    # Consensus goes on among the survivors.
    final = torch.stack([results[r]["trace"][-1] for r in survivors])
    first = torch.stack([results[r]["trace"][KILL_STEP] for r in survivors])
    assert (final - final.mean(0)).norm() < 0.1 * (first - first.mean(0)).norm()


def test_elastic_choco_needs_fixed_size_payloads():
    with pytest.raises(ValueError, match=r"compression='stc:0\.1'"):
        communicators.ChocoGossip("stc:0.1", elastic=True)
