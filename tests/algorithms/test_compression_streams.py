"""Random streams of stochastic compressors inside communicators: per rank, per step, resumable.

Random-k's positions must be the same on every rank (their values are summed), QSGD's and
natural compression's rounding noise must be independent across ranks (so that it averages
out), and a communicator's ``state_dict`` must make a resumed run draw what the
uninterrupted one draws. Each property is checked against the algorithm run for every rank
in the test process with the compressors configured by hand.
"""

import pytest
import torch

import gossamer
from gossamer import communicators
from gossamer import topology as topo
from gossamer.compression import QSGD, Natural, RandomK, for_rank, get_compressor, rank_seed
from gossamer.testing import run_distributed


def _start(rank, numel=1000, same=False):
    g = torch.Generator().manual_seed(100 + (0 if same else rank))
    return torch.randn(numel, generator=g, dtype=torch.float64)


def _rounds(comm, x, rounds):
    for _ in range(rounds):
        comm.next_round()
        x = comm.start(x, 0).wait()
    return x


def test_for_rank_splits_noise_and_shares_positions():
    q = QSGD(4, seed=7)
    q.load_state_dict({"step": 5})
    mine = for_rank(q, 3)
    assert mine.seed == rank_seed(7, 3) != rank_seed(7, 2) and mine.step == 5
    assert len({rank_seed(0, r) for r in range(64)} | {0}) == 65
    assert for_rank(RandomK(0.1, seed=7), 3).seed == 7
    assert for_rank(get_compressor("topk:0.1"), 3) == get_compressor("topk:0.1")
    with pytest.raises(ValueError, match="rank"):
        for_rank(q, -1)
    with pytest.raises(TypeError, match="compressor"):
        for_rank("qsgd:4", 0)


def _randomk_round(rounds):
    comm = communicators.CompressedAllreduce("randomk:0.1", error_feedback=False)
    x = _start(gossamer.rank())
    outs = []
    for _ in range(rounds):
        comm.next_round()
        outs.append(comm.start(x, 0).wait())
    return outs


@pytest.mark.parametrize("world_size", [2, 3])
def test_randomk_allreduce_keeps_the_same_positions_on_every_rank(world_size):
    got = run_distributed(_randomk_round, world_size, args=(2,))
    for step in range(2):
        decoded = []
        for r in range(world_size):
            c = RandomK(0.1)
            c.load_state_dict({"step": step})
            decoded.append(c.decompress(c.compress(_start(r))))
        want = sum(decoded) / world_size
        support = want != 0
        assert int(support.sum()) == 100  # one position per block, the same on all ranks
        for outs in got:
            torch.testing.assert_close(outs[step], want)
    assert not torch.equal(got[0][0] != 0, got[0][1] != 0)  # a new draw each step


def _qsgd_same_input(levels):
    comm = communicators.CompressedAllreduce(f"qsgd:{levels}", error_feedback=False)
    return comm.compressor.seed, _rounds(comm, _start(0, same=True), 1)


def _simulate_qsgd(levels, n, numel=1000):
    """Scatter-reduce-gather where rank r quantizes with QSGD(levels, seed=rank_seed(0, r))."""
    per = -(-numel // n)
    cs = [QSGD(levels, seed=rank_seed(0, r)) for r in range(n)]
    x = torch.zeros(per * n, dtype=torch.float64)
    x[:numel] = _start(0, numel, same=True)
    sent = [[cs[r].decompress(cs[r].compress(p)) for p in x.view(n, per)] for r in range(n)]
    reduced = [sum(sent[r][k] for r in range(n)) / n for k in range(n)]
    out = torch.cat([cs[k].decompress(cs[k].compress(reduced[k])) for k in range(n)])
    errors = [torch.cat(sent[r]) - x for r in range(n)]
    return out[:numel], errors


def test_qsgd_rounding_noise_is_independent_across_ranks():
    n = 4
    got = run_distributed(_qsgd_same_input, n, args=(2,))
    assert [seed for seed, _ in got] == [rank_seed(0, r) for r in range(n)]
    want, errors = _simulate_qsgd(2, n)
    for _, out in got:
        torch.testing.assert_close(out, want)
    # Same input on every rank, yet uncorrelated errors: the average's error shrinks.
    for r in range(1, n):
        corr = torch.corrcoef(torch.stack([errors[0], errors[r]]))[0, 1]
        assert abs(float(corr)) < 0.15
    mean_error = torch.stack(errors).mean(0).norm()
    assert mean_error < 0.7 * errors[0].norm()


def _resume(kind, spec):
    n, r = gossamer.size(), gossamer.rank()

    def make():
        if kind == "choco":
            return communicators.ChocoGossip(spec, topology=topo.exponential_two(n))
        return communicators.CompressedAllreduce(spec)

    comm = make()
    x = _rounds(comm, _start(r), 3)
    state = comm.state_dict()
    saved = {k: v for k, v in state.items()}
    saved_x = x.clone()
    uninterrupted = _rounds(comm, x, 2)
    resumed_comm = make()
    resumed_comm.load_state_dict(saved)
    resumed = _rounds(resumed_comm, saved_x, 2)
    fresh = _rounds(make(), saved_x.clone(), 2)  # same input, streams from step 0
    return uninterrupted, resumed, fresh


@pytest.mark.parametrize(
    ("kind", "spec"),
    [("allreduce", "qsgd:4"), ("allreduce", "randomk:0.2"), ("choco", "natural")],
)
def test_state_dict_resumes_the_random_streams_exactly(kind, spec):
    for uninterrupted, resumed, fresh in run_distributed(_resume, 2, args=(kind, spec)):
        torch.testing.assert_close(resumed, uninterrupted, rtol=0, atol=0)
        assert not torch.equal(fresh, uninterrupted)  # the saved step made the difference


def test_natural_in_choco_draws_a_stream_per_rank():
    got = run_distributed(_choco_seed, 2)
    assert got == [rank_seed(0, 0), rank_seed(0, 1)]
    assert Natural().seed == 0


def _choco_seed():
    return communicators.ChocoGossip("natural").compressor.seed
