"""Every dtype BlueFog programs use, on every operation, against references computed here.

One distributed call per world size runs every dtype through every operation (process
start and round trips dominate on two cores, not the operations).
"""

import pytest
import torch

import gossamer
from gossamer import topology as topo
from gossamer.testing import run_distributed

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
COMPLEX = [torch.complex64, torch.complex128]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
AVERAGED = FLOATS + COMPLEX
EVERY = AVERAGED + INTS + [torch.bool]
MOVED_ONLY = [torch.uint16, torch.uint32, torch.uint64]  # no arithmetic in torch: moved only


def value(rank, dtype, shape=(3, 4)):
    """Rank ``rank``'s input: wide enough that int sums wrap around in their dtype."""
    g = torch.Generator().manual_seed(17 + rank)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.complex128).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.3
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**15)), min(info.max, 2**15 - 1)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


def _key(dtype):
    return str(dtype).removeprefix("torch.")


def _every_dtype_every_op():
    r, n = gossamer.rank(), gossamer.size()
    graph = topo.exponential_two(n)
    out = {}
    for dtype in EVERY + MOVED_ONLY:
        x = value(r, dtype)
        ragged = value(r, dtype, shape=(r + 1, 2))
        got = {
            "broadcast": gossamer.broadcast(x, root=n - 1),
            "broadcast_0d": gossamer.broadcast(x[1, 2].clone(), root=0),
            "allgather": gossamer.allgather(ragged),
            "neighbor_allgather": gossamer.neighbor_allgather(ragged, topology=graph),
        }
        if dtype not in MOVED_ONLY:
            got["sum"] = gossamer.allreduce(x, average=False)
            inplace = x.clone()
            gossamer.allreduce_(inplace, average=False)
            got["sum_"] = inplace
        if dtype in AVERAGED:
            got["average"] = gossamer.allreduce(x)
            got["neighbor_allreduce"] = gossamer.neighbor_allreduce(x, topology=graph)
            got["neighbor_allreduce_weighted"] = gossamer.neighbor_allreduce(
                x,
                self_weight=0.25,
                src_weights=dict.fromkeys(graph.in_neighbors(r), 0.5),
                topology=graph,
            )
            if n > 1:
                got["pair_gossip"] = gossamer.pair_gossip(x, r ^ 1 if r ^ 1 < n else r - 1)
            if n > 1:
                gossamer.set_machine_topology(topo.fully_connected(gossamer.machine_size()))
                got["hierarchical"] = gossamer.hierarchical_neighbor_allreduce(x)
        for op, y in got.items():
            out[_key(dtype), op] = y
    return out


def _tolerance(dtype):
    return {
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1e-2, atol=2e-2),
        torch.float32: dict(rtol=1e-5, atol=1e-6),
        torch.complex64: dict(rtol=1e-5, atol=1e-6),
    }.get(dtype, dict(rtol=1e-12, atol=1e-12))


def _wide(t):
    return t.to(torch.complex128) if t.dtype.is_complex else t.double()


def _close(got, want, dtype, what):
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if dtype in AVERAGED:
        torch.testing.assert_close(_wide(got), _wide(want), **_tolerance(dtype), msg=what)
    else:
        assert torch.equal(got, want), f"{what}: {got} != {want}"


def _references(n, dtype):
    xs = [value(r, dtype) for r in range(n)]
    ragged = [value(r, dtype, shape=(r + 1, 2)) for r in range(n)]
    graph = topo.exponential_two(n)
    refs = [{} for _ in range(n)]
    for r in range(n):
        srcs = graph.in_neighbors(r)
        refs[r]["broadcast"] = xs[n - 1]
        refs[r]["broadcast_0d"] = xs[0][1, 2]
        refs[r]["allgather"] = torch.cat(ragged)
        refs[r]["neighbor_allgather"] = (
            torch.cat([ragged[s] for s in srcs]) if srcs else ragged[r][:0]
        )
        if dtype in MOVED_ONLY:
            continue
        if dtype == torch.bool:
            total = torch.stack(xs).any(dim=0)
        elif dtype in INTS:
            total = sum(x.long() for x in xs).to(dtype)  # wraps around as the dtype does
        else:
            total = sum(_wide(x) for x in xs)
        refs[r]["sum"] = refs[r]["sum_"] = total
        if dtype not in AVERAGED:
            continue
        wide = [_wide(x) for x in xs]
        refs[r]["average"] = total / n
        refs[r]["neighbor_allreduce"] = (wide[r] + sum(wide[s] for s in srcs)) / (len(srcs) + 1)
        refs[r]["neighbor_allreduce_weighted"] = 0.25 * wide[r] + sum(0.5 * wide[s] for s in srcs)
        if n > 1:
            partner = r ^ 1 if r ^ 1 < n else r - 1
            refs[r]["pair_gossip"] = (wide[r] + wide[partner]) / 2
            refs[r]["hierarchical"] = total / n  # fully connected machines: the global mean
    return refs


# World 4 as 2 machines of 2 and world 2 as 2 machines of 1: hierarchical exchanges cross
# machines, and so do the point-to-point ones (chunked when large).
WORLDS = {1: None, 2: {"GOSSAMER_NODES_PER_MACHINE": "1"}, 4: {"GOSSAMER_NODES_PER_MACHINE": "2"}}


@pytest.mark.parametrize("world_size", sorted(WORLDS))
def test_every_dtype_on_every_operation(world_size):
    got = run_distributed(_every_dtype_every_op, world_size, env=WORLDS[world_size])
    checked = 0
    for dtype in EVERY + MOVED_ONLY:
        refs = _references(world_size, dtype)
        for r in range(world_size):
            for op, want in refs[r].items():
                _close(got[r][_key(dtype), op], want, dtype, f"rank {r} {op} {_key(dtype)}")
                checked += 1
            assert len(refs[r]) == sum(1 for k in got[r] if k[0] == _key(dtype))
    assert checked > 50 * world_size
