"""Compressed communication against the algorithms simulated in one process.

CHOCO-gossip (Koloskova et al., 2019) and the compressed allreduce (ByteGrad's
scatter-reduce-gather, allgather of sparse payloads) are run on real ranks and compared with
a reference that runs the same algorithm for every rank in the test process, with the
library's compressors (which are tested on their own in tests/unit).
"""

import math
import re

import pytest
import torch

import gossamer
from gossamer import communicators, optim
from gossamer import topology as topo
from gossamer.compression import Payload, compression_quality, get_compressor
from gossamer.testing import run_distributed
from problems import least_squares_data, least_squares_optimum, linear_model


def _start(rank, numel=1000):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64)


def _run_rounds(comm, x, rounds):
    for _ in range(rounds):
        comm.next_round()
        x = comm.start(x, 0).wait()
    return x


def _choco(spec, dynamic, rounds):
    n, r = gossamer.size(), gossamer.rank()
    g = topo.exponential_two(n)
    if dynamic:
        comm = communicators.ChocoGossip(spec, schedule=topo.one_peer_exponential(g, r))
    else:
        comm = communicators.ChocoGossip(spec, topology=g)
    return _run_rounds(comm, _start(r), rounds)


def _simulate_static_choco(spec, n, rounds, gamma=None):
    """CHOCO on exp-2 for all ranks in one process: x_i += gamma sum_j W[j,i](h_j - h_i)."""
    cs = [get_compressor(spec) for _ in range(n)]  # each rank's own (random-k: same seed)
    gamma = communicators.default_gamma(cs[0]) if gamma is None else gamma
    W = torch.tensor(topo.exponential_two(n).weights)
    xs = [_start(r) for r in range(n)]
    hat = [torch.zeros_like(x) for x in xs]
    for _ in range(rounds):
        for i in range(n):
            hat[i] = hat[i] + cs[i].decompress(cs[i].compress(xs[i] - hat[i]))
        xs = [
            xs[i] + gamma * sum(W[j, i] * (hat[j] - hat[i]) for j in range(n) if j != i)
            for i in range(n)
        ]
    return xs


@pytest.mark.parametrize(
    ("world_size", "spec"), [(2, "uint8"), (4, "uint8"), (3, "randomk:0.2:quantize=true")]
)
def test_static_choco_matches_the_one_process_simulation(world_size, spec):
    got = run_distributed(_choco, world_size, args=(spec, False, 5))
    want = _simulate_static_choco(spec, world_size, 5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9)


def _alternating_steps(r, n, rounds):
    """One successor, then two, in turn: the destinations' STC payloads differ in size."""
    for k in range(rounds):
        hops = (1,) if k % 2 == 0 else (1, 2)
        yield topo.Step.uniform([(r + h) % n for h in hops], [(r - h) % n for h in hops])


def _choco_alternating(spec, rounds):
    r, n = gossamer.rank(), gossamer.size()
    comm = communicators.ChocoGossip(spec, schedule=_alternating_steps(r, n, rounds))
    return _run_rounds(comm, _start(r, 4000), rounds)


def _simulate_edged_choco(spec, n, rounds):
    """Scheduled CHOCO in one process, a public copy per directed edge (i, d)."""
    c = get_compressor(spec)
    gamma = communicators.default_gamma(c)
    xs = [_start(r, 4000) for r in range(n)]
    hat = {}
    for steps in zip(*(_alternating_steps(r, n, rounds) for r in range(n)), strict=True):
        for i, step in enumerate(steps):
            for d in step.send_ranks:
                h = hat.setdefault((i, d), torch.zeros_like(xs[i]))
                hat[i, d] = h + c.decompress(c.compress(xs[i] - h))
        new = []
        for i, step in enumerate(steps):
            own = sum(hat[i, d] for d in step.send_ranks) / len(step.send_ranks)
            pull = sum(w * (hat[s, i] - own) for s, w in step.src_weights.items())
            new.append(xs[i] + gamma * pull)
        xs = new
    return xs


@pytest.mark.parametrize("world_size", [3, 4])
def test_scheduled_choco_with_payloads_of_several_sizes_matches_the_simulation(world_size):
    got = run_distributed(_choco_alternating, world_size, args=("stc:0.01", 6))
    want = _simulate_edged_choco("stc:0.01", world_size, 6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9)


def _result_buffers(kind, rounds):
    graph = topo.exponential_two(gossamer.size())
    if kind == "choco":
        comm = communicators.ChocoGossip("uint8", topology=graph)
    elif kind == "difference_gossip":
        comm = communicators.DifferenceGossip("uint8", topology=graph)
    else:
        comm = communicators.NeighborAllreduce(topology=graph)
    x, results = _start(gossamer.rank()), []
    for _ in range(rounds):  # every result is kept alive: new tensors could not share memory
        comm.next_round()
        results.append(comm.start(x.clone(), 0).wait())
    last = results[-1]
    comm.next_round()
    fed_back = comm.start(last, 0).wait()  # the last result as the input: the other buffer
    return {r.data_ptr() for r in results}, last.data_ptr(), fed_back.data_ptr()


@pytest.mark.parametrize("kind", ["choco", "difference_gossip", "neighbor_allreduce"])
def test_posted_rounds_write_into_kept_buffers(kind):
    for kept, last, fed_back in run_distributed(_result_buffers, 3, args=(kind, 4)):
        assert kept == {last} and fed_back != last


@pytest.mark.parametrize("spec", ["uint8", "topk:0.1"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "one-peer"])
def test_choco_reaches_consensus_and_keeps_the_average(spec, dynamic):
    n = 4
    start = torch.stack([_start(r) for r in range(n)])
    got = torch.stack(
        run_distributed(
            _choco,
            n,
            args=(
                spec,
                dynamic,
                400,
            ),
        )
    )
    spread0 = (start - start.mean(0)).norm()
    spread = (got - got.mean(0)).norm()
    assert spread < 1e-6 * spread0, f"consensus error {spread / spread0:.2e} of its start"
    torch.testing.assert_close(got.mean(0), start.mean(0), rtol=1e-6, atol=1e-9)


def _choco_auto(spec, rounds):
    comm = communicators.ChocoGossip(spec, gamma="auto", topology=topo.exponential_two(4))
    x = _run_rounds(comm, _start(gossamer.rank()), rounds)
    return x, comm.bucket_gamma(0)


def _spread(xs):
    xs = torch.stack(list(xs))
    return (xs - xs.mean(0)).norm().item()


def test_choco_auto_gamma_is_koloskovas_step_and_converges_where_a_fixed_one_diverges():
    spec, n, rounds = "topk:0.01", 4, 300
    # exp-2 on 4 ranks: W = circulant(1/3, 1/3, 1/3, 0), eigenvalues 1, 1/3, +-i/3, so
    # rho = 1 - 1/3 and beta = max |1 - lambda| = |1 - i/3| = sqrt(10)/3.
    rho, beta = 2 / 3, math.sqrt(10) / 3
    delta = compression_quality(get_compressor(spec), 1000)
    gamma = rho**2 * delta / (16 * rho + rho**2 + 4 * beta**2 + 2 * rho * beta**2 - 8 * rho * delta)
    assert communicators.choco_gamma(delta, topo.exponential_two(n)) == pytest.approx(gamma)
    results = run_distributed(_choco_auto, n, args=(spec, rounds))
    assert all(g == pytest.approx(gamma, rel=1e-12) for _, g in results)  # same on every rank
    got = [x for x, _ in results]
    want = _simulate_static_choco(spec, n, rounds, gamma=gamma)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9)
    start = [_start(r) for r in range(n)]
    torch.testing.assert_close(sum(got) / n, sum(start) / n, rtol=1e-6, atol=1e-9)
    assert _spread(got) < 0.8 * _spread(start)
    # A fixed step that suits topk:0.1 (0.2, measured in default_gamma) diverges here.
    assert _spread(_simulate_static_choco(spec, n, rounds, gamma=0.2)) > _spread(start)


def test_choco_gamma_checks_its_arguments():
    with pytest.raises(ValueError, match="delta must be in"):
        communicators.choco_gamma(-0.5, topo.exponential_two(4))
    with pytest.raises(TypeError, match="topology must be a Topology"):
        communicators.choco_gamma(0.5, [[1.0]])
    with pytest.raises(ValueError, match="no spectral gap"):
        communicators.choco_gamma(0.5, topo.Topology([[1.0, 0.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="needs a static topology"):
        communicators.ChocoGossip("uint8", gamma="auto", schedule=iter([]))
    with pytest.raises(ValueError, match="or 'auto'"):
        communicators.ChocoGossip("uint8", gamma="fast")


def _compressed_allreduce(spec, feedback):
    comm = communicators.CompressedAllreduce(spec, error_feedback=feedback)
    return _run_rounds(comm, _start(gossamer.rank(), 1001), 1)


def _simulate_scatter_gather(spec, n, numel=1001):
    c = get_compressor(spec)
    per = -(-numel // n)
    chunks = []
    for r in range(n):
        x = torch.zeros(per * n, dtype=torch.float64)
        x[:numel] = _start(r, numel)
        chunks.append([c.decompress(c.compress(part)) for part in x.view(n, per)])
    reduced = [sum(chunks[r][k] for r in range(n)) / n for k in range(n)]
    out = torch.cat([c.decompress(c.compress(part)) for part in reduced])
    return out[:numel]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_uint8_scatter_reduce_gather_matches_the_simulation(world_size):
    got = run_distributed(
        _compressed_allreduce,
        world_size,
        args=(
            "uint8",
            False,
        ),
    )
    want = _simulate_scatter_gather("uint8", world_size)
    exact = torch.stack([_start(r, 1001) for r in range(world_size)]).mean(0)
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-9)
        assert (g - exact).abs().max() < 0.05  # two 8-bit quantizations of values ~N(0, 1)


def _sparse_allreduce(spec, dtype):
    comm = communicators.CompressedAllreduce(spec, error_feedback=False)
    return _run_rounds(comm, _start(gossamer.rank(), 1001).to(dtype), 1)


@pytest.mark.parametrize(
    ("n", "spec", "dtype"),
    [(3, "topk:0.1", torch.float64), (2, "stc:0.1", torch.float32), (4, "stc:0.1", torch.float64)],
)
def test_sparse_allreduce_averages_the_decoded_payloads(n, spec, dtype):
    got = run_distributed(_sparse_allreduce, n, args=(spec, dtype))
    c = get_compressor(spec)
    want = sum(c.decompress(c.compress(_start(r, 1001).to(dtype))) for r in range(n)) / n
    for g in got:
        torch.testing.assert_close(g, want)


def _rounds_of_distinct_inputs(spec, average, rounds):
    comm = communicators.CompressedAllreduce(spec, average=average)
    r = gossamer.rank()
    out = []
    for t in range(rounds):
        comm.next_round()
        out.append(comm.start(_start(r + 10 * t, 1001), 0).wait())
    return torch.stack(out)


def _simulate_randomk(spec, n, rounds, average):
    """Random-k with error feedback, all ranks in one process.

    p_i = C(u_i + e_i). The kept values of the n payloads are summed: as they are, or,
    with coded values (``quantize=true``, 8-bit or ``bits=b``), by ByteGrad (n chunks padded
    with zeros, min-max codes, the owner's sum re-coded), at the positions of plain random-k
    of the same seed.
    With error reset rank i gets G_i = u_i + mean_j p_j - p_i, else the mean for all.
    """
    cs = [get_compressor(spec) for _ in range(n)]  # same seed: the same positions every round
    where = get_compressor(re.sub(r":(quantize=true|reset=true|bits=\d)", "", spec))
    residuals = [torch.zeros(1001, dtype=torch.float64) for _ in range(n)]
    out = []
    for t in range(rounds):
        kept = where.decompress(where.compress(torch.ones(1001, dtype=torch.float64))) != 0
        us = [_start(r + 10 * t, 1001) for r in range(n)]
        ps = []
        for i in range(n):
            corrected = us[i] + residuals[i]
            ps.append(cs[i].decompress(cs[i].compress(corrected)))
            residuals[i] = corrected - ps[i]
        if "quantize=true" in spec:
            shared = _bytegrad_at(kept, ps, n, average, cs[0].values_codec)
        else:
            shared = sum(ps) / n if average else sum(ps)
        if "reset=true" in spec:
            scale = 1 if average else n
            out.append(torch.stack([scale * (us[i] - ps[i]) + shared for i in range(n)]))
        else:
            out.append(torch.stack([shared] * n))
    return torch.stack(out, 1)  # [rank, round, element]


def _bytegrad_at(kept, ps, n, average, codes):
    k = int(kept.sum())
    per = -(-k // n)
    padded = torch.zeros(n, per * n, dtype=torch.float64)
    for i in range(n):
        padded[i, :k] = ps[i][kept]
    coded = [[codes.decompress(codes.compress(c)) for c in row.view(n, per)] for row in padded]
    sums = [sum(coded[i][j] for i in range(n)) / (n if average else 1) for j in range(n)]
    shared = torch.zeros(len(kept), dtype=torch.float64)
    shared[kept] = torch.cat([codes.decompress(codes.compress(s)) for s in sums])[:k]
    return shared


@pytest.mark.parametrize(("world_size", "average"), [(2, True), (3, True), (3, False)])
def test_randomk_error_reset_matches_the_one_process_simulation(world_size, average):
    spec, rounds = "randomk:0.1:reset=true", 4
    got = torch.stack(
        run_distributed(_rounds_of_distinct_inputs, world_size, args=(spec, average, rounds))
    )
    want = _simulate_randomk(spec, world_size, rounds, average)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # Mass is preserved: the ranks' results add up to the uncompressed ones, every round.
    inputs = torch.stack(
        [torch.stack([_start(r + 10 * t, 1001) for t in range(rounds)]) for r in range(world_size)]
    )
    exact = inputs.sum(0) if average else world_size * inputs.sum(0)
    torch.testing.assert_close(got.sum(0), exact, rtol=1e-12, atol=1e-12)
    # ... while the ranks differ (their residuals), unlike plain error feedback.
    assert (got[0] - got[1]).abs().max() > 0.1
    with pytest.raises(ValueError, match="error_feedback=False"):
        communicators.CompressedAllreduce(spec, error_feedback=False)


@pytest.mark.parametrize(
    ("world_size", "spec", "average"),
    [
        (2, "randomk:0.1:quantize=true", True),
        (3, "randomk:0.1:quantize=true", False),
        (3, "randomk:0.1:quantize=true:reset=true", True),
        (3, "randomk:0.1:quantize=true:bits=4:reset=true", True),
        (2, "randomk:0.1:quantize=true:bits=2", False),
    ],
)
def test_quantized_randomk_allreduce_matches_the_one_process_simulation(world_size, spec, average):
    rounds = 3
    got = torch.stack(
        run_distributed(_rounds_of_distinct_inputs, world_size, args=(spec, average, rounds))
    )
    want = _simulate_randomk(spec, world_size, rounds, average)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _topk_least_squares(steps):
    model = linear_model()
    opt = optim.GradientAllreduce(
        torch.optim.SGD(model.parameters(), lr=0.05), model, compression="topk:0.4"
    )
    A, b = least_squares_data(gossamer.rank())
    # EF's residuals hold each rank's share of the compression error, so x trails the
    # exact iterate by O(lr): a decaying step size brings it to the optimum.
    for step in range(steps):
        opt.param_groups[0]["lr"] = 0.1 * 0.985**step
        opt.zero_grad()
        ((model(A).squeeze(1) - b) ** 2).mean().backward()
        opt.step()
    return model.weight.detach().reshape(-1)


def test_topk_gradient_allreduce_with_error_feedback_reaches_the_optimum():
    # 400 steps land at 1.3e-5; without error feedback the same run stops at 3.7e-2.
    optimum = least_squares_optimum(4)
    for weight in run_distributed(_topk_least_squares, 4, args=(400,)):
        assert (weight - optimum).norm() < 1e-4


def test_compression_options_are_checked():
    with pytest.raises(ValueError, match="gamma"):
        communicators.ChocoGossip("uint8", gamma=1.5)
    with pytest.raises(ValueError, match="compression"):
        communicators.make("hierarchical_neighbor_allreduce", compression="uint8")
    with pytest.raises(ValueError, match="error_feedback"):
        communicators.make("allreduce", error_feedback=True)
    assert isinstance(communicators.make(compression="uint8"), communicators.ChocoGossip)
    assert isinstance(
        communicators.make("allreduce", compression="sign"), communicators.CompressedAllreduce
    )
    # CHOCO always compensates the error: True is what it does, False cannot be honoured.
    choco = communicators.make(compression="topk:0.1", error_feedback=True)
    assert isinstance(choco, communicators.ChocoGossip)
    with pytest.raises(ValueError, match=r"error_feedback=False with compression='topk:0.1'"):
        communicators.make(compression="topk:0.1", error_feedback=False)
    with pytest.raises(TypeError, match="error_feedback must be a bool or None; got 'yes'"):
        communicators.make(compression="topk:0.1", error_feedback="yes")
    with pytest.raises(ValueError, match="error_feedback=True needs a compression"):
        communicators.CompressedAllreduce("none", error_feedback=True)


def test_a_state_of_another_configuration_is_refused_at_load():
    topk = communicators.CompressedAllreduce("topk:0.1")
    state = topk.state_dict()
    with pytest.raises(ValueError, match=r"saved with error_feedback=True.*runs error_feedback=F"):
        communicators.CompressedAllreduce("topk:0.1", error_feedback=False).load_state_dict(state)
    plain = communicators.CompressedAllreduce("topk:0.1", error_feedback=False).state_dict()
    with pytest.raises(ValueError, match=r"saved with error_feedback=False"):
        topk.load_state_dict(plain)
    with pytest.raises(ValueError, match=r"compression='topk:0.1'; this .* compression='sign'"):
        communicators.CompressedAllreduce("sign").load_state_dict(state)
    choco = communicators.ChocoGossip("uint8").state_dict()
    with pytest.raises(ValueError, match=r"'uint8'; this ChocoGossip runs compression='qsgd"):
        communicators.ChocoGossip("qsgd:16").load_state_dict(choco)
    topk.load_state_dict(state)  # its own state loads


def test_payload_travels_as_bytes():
    c = get_compressor("uint8")
    p = c.compress(_start(0))
    assert p.buffer.dtype == torch.uint8 and p.nbytes <= 0.26 * 8 * 1000
    assert isinstance(Payload(p.buffer, p.shape, p.dtype), Payload)


# ---------------------------------------------------------------- DCD-PSGD
def _dcd(spec, graph_name, rounds):
    n = gossamer.size()
    graph = topo.ring(n) if graph_name == "ring" else topo.exponential_two(n)
    comm = communicators.DifferenceGossip(spec, topology=graph)
    x = _run_rounds(comm, _start(gossamer.rank()), rounds)
    return x, comm.state_dict()["replicas"][0]  # the last round's differences taken first


def _simulate_dcd(spec, graph_name, n, rounds):
    """DCD for all ranks in one process, from its definition, replicas starting at zero."""
    c = get_compressor(spec)
    graph = topo.ring(n) if graph_name == "ring" else topo.exponential_two(n)
    W = torch.tensor(graph.weights, dtype=torch.float64)
    xs = [_start(r) for r in range(n)]
    public = [torch.zeros_like(x) for x in xs]  # w_i, and every replica of it (equal)
    for _ in range(rounds):
        sources = [[j for j in range(n) if j != i and W[j, i] != 0] for i in range(n)]
        diffs = [
            xs[i]
            + sum((W[j, i] * public[j] for j in sources[i]), torch.zeros_like(xs[i]))
            + (W[i, i] - 2) * public[i]
            for i in range(n)
        ]
        public = [public[i] + c.decompress(c.compress(diffs[i])) for i in range(n)]
        xs = [p.clone() for p in public]
    return xs, public


@pytest.mark.parametrize(
    ("world_size", "graph_name", "spec"),
    # uint8 rounds are posted; stc's payload size varies, so its rounds run on the thread
    [(2, "exp2", "uint8"), (3, "ring", "uint8"), (4, "exp2", "uint8"), (4, "ring", "stc:0.1")],
)
def test_difference_gossip_matches_the_one_process_simulation(world_size, graph_name, spec):
    got = run_distributed(_dcd, world_size, args=(spec, graph_name, 6))
    want, public = _simulate_dcd(spec, graph_name, world_size, 6)
    for rank, ((x, replicas), w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(x, w, rtol=1e-6, atol=1e-9)
        # every replica is its owner's public model, the last round's differences taken too
        for key, replica in replicas.items():
            owner = rank if key == "self" else key
            torch.testing.assert_close(replica, public[owner], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("spec", ["none", "uint8"])
def test_difference_gossip_reaches_consensus_near_the_average(spec):
    n = 4
    start = torch.stack([_start(r) for r in range(n)])
    got = torch.stack([x for x, _ in run_distributed(_dcd, n, args=(spec, "exp2", 150))])
    spread0 = (start - start.mean(0)).norm()
    spread = (got - got.mean(0)).norm()
    assert spread < 1e-6 * spread0, f"consensus error {spread / spread0:.2e} of its start"
    # Uncompressed, the average is kept exactly; 8-bit, up to the first rounds' error.
    error = (got.mean(0) - start.mean(0)).norm() / start.mean(0).norm()
    assert error < (1e-12 if spec == "none" else 1e-2), f"average moved by {error:.2e}"


def _dcd_options():
    errors, made = [], communicators.make("difference_gossip", compression="qsgd:16")
    for options in (
        {"schedule": iter(())},
        {"global_average_every": 2},
        {"error_feedback": True},
    ):
        try:
            communicators.make("difference_gossip", **options)
        except ValueError as error:
            errors.append(str(error))
    try:
        communicators.DifferenceGossip("uint8", topology=topo.ring(gossamer.size() + 1)).bind([])
    except gossamer.TopologyError as error:
        errors.append(str(error))
    default = communicators.make("difference_gossip")
    return errors, made.compressor.name, default.compressor.name


def test_difference_gossip_options_are_checked():
    errors, made, default = run_distributed(_dcd_options, 2)[0]
    assert made.startswith("qsgd:16") and default == "uint8"
    assert "schedule=" in errors[0] and "global_average_every=2" in errors[1]
    assert "error_feedback=True" in errors[2]
    assert "topology has 3 ranks but the world has 2" in errors[3]


def _no_contraction():
    errors = []
    model = torch.nn.Linear(32, 32)  # one bucket of 1056 elements
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for build in (
        lambda: optim.AdaptWithCombine(sgd, model, compression="qsgd:4"),
        lambda: optim.AdaptThenCombine(sgd, model, compression="randomk:0.1:unbiased=true"),
        lambda: optim.WindowPut(sgd, model, compression="qsgd:4"),
        lambda: communicators.ChocoGossip("qsgd:4").start(torch.zeros(1056), 0),
    ):
        try:
            build()
        except ValueError as err:
            errors.append(str(err))
    optim.AdaptWithCombine(sgd, model, compression="natural").close()  # a contraction
    return errors


def test_choco_refuses_a_compressor_that_is_no_contraction():
    """qsgd:4 on 1056 elements loses 1.8 times the signal: the public copies diverged
    (the spread of the ranks grew 1e14-fold in 60 steps), whatever gamma."""
    for errors in run_distributed(_no_contraction, 2):
        assert len(errors) == 4, errors
        assert errors[0].startswith(
            "compression='qsgd:4' is not a contraction on bucket 0 of 1056 elements (relative "
            "error 1.8"
        )
        assert "randomk:0.1:unbiased=true" in errors[1] and "qsgd:4" in errors[2]
        assert "public copies would diverge" in errors[3]


def _compressed_communicators(spec):
    ring = topo.ring(gossamer.size())
    return [
        communicators.CompressedAllreduce(spec),
        communicators.ChocoGossip(spec, topology=ring),
        communicators.DifferenceGossip(spec, topology=ring),
    ]


def _half_sum_and_refusals(dtype, spec):
    # Every rank's 30000 is representable in float16; their sum is not.
    x = torch.full((6,), 30000.0, dtype=dtype)
    average = communicators.CompressedAllreduce(spec).start(x).wait()
    empty = communicators.CompressedAllreduce(spec).start(torch.empty(0, dtype=dtype)).wait()
    refused = []
    for comm in _compressed_communicators(spec):
        try:
            comm.start(torch.ones(4, dtype=torch.int32))
        except TypeError as err:
            refused.append(str(err))
    return average, empty, refused


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("spec", ["none", "fp16", "uint8", "randomk:0.5", "topk:0.5"])
def test_half_precision_sums_in_float32_and_integers_are_refused(world_size, spec):
    for dtype in (torch.float16, torch.bfloat16):
        runs = run_distributed(_half_sum_and_refusals, world_size, args=(dtype, spec))
        for average, empty, refused in runs:
            kept = average[average != 0]  # the sparsifiers keep some entries
            assert average.dtype == dtype and kept.numel() > 0
            assert torch.isfinite(average).all(), average
            assert torch.allclose(kept.float(), torch.tensor(30000.0), rtol=0.01)
            assert empty.numel() == 0 and empty.dtype == dtype
            assert len(refused) == 3 and all("got torch.int32" in e for e in refused)


def _mismatched_dtypes(spec):
    # Same size on the wire, different meaning: rank 0 float16, the others bfloat16.
    dtype = torch.float16 if gossamer.rank() == 0 else torch.bfloat16
    errors = []
    for comm in _compressed_communicators(spec):
        try:
            comm.start(torch.arange(8, dtype=dtype)).wait()
        except gossamer.PeerError as err:
            errors.append(type(err).__name__)
    return errors


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("spec", ["none", "fp16", "uint8", "topk:0.5"])
def test_ranks_with_different_dtypes_raise_instead_of_mixing(world_size, spec):
    for errors in run_distributed(_mismatched_dtypes, world_size, args=(spec,)):
        assert errors == ["PeerError"] * 3


def _different_settings(kind, specs):
    """``kind`` built with ``specs[rank]`` (None: uncompressed); the error each rank got."""
    spec = specs[gossamer.rank() % len(specs)]
    model = linear_model()
    kinds = {"allreduce": optim.GradientAllreduce, "awc": optim.AdaptWithCombine}
    cls = kinds.get(kind, optim.WindowPut)
    try:
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), model, compression=spec)
        A, b = least_squares_data(gossamer.rank())
        ((model(A).squeeze(1) - b) ** 2).mean().backward()
        opt.step()
        opt.close()
    except gossamer.PeerError as err:
        return str(err)
    return None


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "kind, specs, mine",
    [
        (
            "allreduce",
            ["uint8", None],
            [
                "compressed_allreduce of float64[5] with compression='uint8'",
                "allreduce of float64[5]",
            ],
        ),
        ("allreduce", ["uint8", "topk:0.5"], ["compression='uint8'", "compression='topk:0.5'"]),
        ("allreduce", ["powersgd:1", "powersgd:2"], ["PowerSGD(rank=1,", "PowerSGD(rank=2,"]),
        (
            "awc",
            ["fp16", "bf16"],
            ["compression='fp16' on float64", "compression='bf16' on float64"],
        ),
        (
            "window",
            ["uint8", None],
            [
                "compression='uint8', gamma=0.8",
                "window_create (push_sum=False, elastic=False) of float32[1]",
            ],
        ),
    ],
)
def test_ranks_with_different_compression_raise_naming_theirs(world_size, kind, specs, mine):
    """Every rank raises at once (no timeout) and names its own configuration.

    Before, an uncompressed rank waited for the posted allreduce's group, which a
    compressed rank never makes, until the deadline; a window rank mixed puts of another
    compressor silently; and the message showed two equal calls.
    """
    errors = run_distributed(_different_settings, world_size, args=(kind, specs), timeout=60)
    for rank, error in enumerate(errors):
        assert error is not None and "mismatched call" in error, error
        assert mine[rank % len(specs)] in error, error
