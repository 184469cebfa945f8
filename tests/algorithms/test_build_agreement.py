"""Ranks that build an optimizer with other settings raise when they build it, on every rank.

Before, a period, cliques or a topology that differed across ranks paired rounds of
different steps silently, or waited for the deadline (audit of session 36).
"""

import pytest
import torch

import gossamer
from gossamer import optim
from gossamer import topology as topo
from gossamer.errors import PeerArgumentError, PeerError
from gossamer.testing import run_distributed


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _build(kind, differ):
    """Build ``kind`` on every rank; rank 0 gives another value when ``differ``."""
    r, n = gossamer.rank(), gossamer.size()
    other = differ and r == 0
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    period = 2 if other else 1
    if kind == "awc":
        return optim.AdaptWithCombine(sgd, model, num_steps_per_communication=period)
    if kind == "dacfl":
        return optim.DACFL(sgd, model, topology=topo.ring(n), correction=0.5 if other else 1.0)
    if kind == "cliques":
        cliques = [[0], list(range(1, n))] if other else [list(range(n))]
        return optim.CliqueAveraging(sgd, model, cliques)
    if kind == "ngc":
        graph = topo.fully_connected(n) if other else topo.ring(n)
        return optim.NGC(sgd, model, topology=graph)
    if kind == "fedhisyn":
        return optim.FedHiSyn(sgd, model, num_groups=1, interval=3 if other else 2, step_time=0.1)
    if kind == "cocofl":
        return optim.CoCoFL(sgd, model, num_steps_per_communication=period)
    atc = optim.AdaptThenCombine(sgd, model)
    return optim.SkewScout(atc, lambda m: 0.5, probe_every=3 if other else 2)


KINDS = ["awc", "dacfl", "cliques", "ngc", "fedhisyn", "cocofl", "skewscout"]
NAMES = {
    "awc": "AdaptWithCombine",
    "dacfl": "DACFL",
    "cliques": "CliqueAveraging",
    "ngc": "NGC",
    "fedhisyn": "FedHiSyn",
    "cocofl": "CoCoFL",
    "skewscout": "SkewScout",
}


def _outcome(kind, differ):
    try:
        built = _build(kind, differ)
    except PeerError as err:
        return f"{type(err).__name__}: {err}"
    (built.inner if kind == "skewscout" else built).close()
    return "built"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_other_settings_on_one_rank_raise_on_every_rank(kind, world_size):
    assert run_distributed(_outcome, world_size, args=(kind, False)) == ["built"] * world_size
    out = run_distributed(_outcome, world_size, args=(kind, True))
    others = list(range(1, world_size))
    for message in out:
        assert message.startswith(
            f"PeerError: {NAMES[kind]}: ranks {others} gave other settings than "
            "rank 0; every rank must give the same (this rank: "
        ), message
    assert out[0] != out[1]  # each names its own settings


def _one_bad_build():
    model = _model()
    threshold = -1 if gossamer.rank() == 1 else 0  # refused on rank 1 only
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        built = optim.AdaptWithCombine(sgd, model, fusion_threshold_bytes=threshold)
    except PeerArgumentError as err:
        return f"PeerArgumentError {err.ranks}: {err}"
    except ValueError as err:
        return f"ValueError: {err}"
    built.close()
    return "built"


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_whose_build_fails_makes_the_others_raise(world_size):
    out = run_distributed(_one_bad_build, world_size)
    assert out[1].startswith("ValueError: fusion_threshold_bytes must be an int >= 0")
    for r in (0, *range(2, world_size)):
        assert out[r] == (
            "PeerArgumentError [1]: AdaptWithCombine: ranks [1] could not build it (their "
            "errors say why)"
        )
