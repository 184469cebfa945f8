"""Checkpoints that outlive a death: the survivors of an elastic job save, and resume resized.

One of 4 ranks SIGKILLs itself, either between two steps (a neighbour learns of it in the
next exchange) or just before a save (nobody has noticed when the save starts, so the save
itself must find out from the heartbeats). The survivors then save through the store. The
manifest must list exactly their files, each file must hold what that rank returned, and a
fresh job of 3 (and of 4) ranks must resume the mean of the three saved states, computed
here in one process from the files.
"""

import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gossamer
from gossamer import checkpoint, optim, topology
from gossamer.testing import free_port, run_distributed

WORLD, VICTIM = 4, 2
SURVIVORS = [0, 1, 3]


def _net():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _train(model, opt, count):
    for _ in range(count):
        opt.zero_grad()
        model(torch.randn(5, 3)).square().mean().backward()
        opt.step()


def _survive_and_save(root, when):
    rank = gossamer.rank()
    torch.manual_seed(rank)
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = optim.AdaptWithCombine(sgd, model, topology=topology.ring(WORLD), elastic=True)
    _train(model, opt, 3)
    checkpoint.save(f"{root}/before", model, opt)  # nobody dead yet: every rank's file
    if rank == VICTIM and when == "step":
        os.kill(os.getpid(), signal.SIGKILL)
    _train(model, opt, 3)
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)  # when == "save": right before it
    checkpoint.save(f"{root}/after", model, opt, extra={"from": rank})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, 2)  # and they train on
    return {"state": state, "live": gossamer.live_ranks()}


def _resume(root, resize):
    torch.manual_seed(100 + gossamer.rank())
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = optim.AdaptWithCombine(sgd, model, topology=topology.ring(gossamer.size()))
    try:
        extra = checkpoint.load(f"{root}/after", model, opt, resize=resize)
    except ValueError as err:
        return {"error": str(err)}
    buffers = [opt.optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    return {"state": model.state_dict(), "buffers": buffers, "extra": extra}


def _saved(directory, rank):
    return torch.load(directory / f"rank{rank}.pt", weights_only=True)


@pytest.mark.parametrize("when", ["step", "save"])
def test_survivors_save_and_resume_from_their_average(tmp_path, when):
    results = run_distributed(
        _survive_and_save, WORLD, args=(str(tmp_path), when), dies=[VICTIM], timeout=120
    )
    before = json.loads((tmp_path / "before" / checkpoint.MANIFEST).read_text())
    assert before["ranks"] == list(range(WORLD))
    after = tmp_path / "after"
    manifest = json.loads((after / checkpoint.MANIFEST).read_text())
    assert manifest["world_size"] == WORLD
    assert manifest["ranks"] == SURVIVORS
    assert [f["file"] for f in manifest["files"]] == [f"rank{r}.pt" for r in SURVIVORS]
    assert not (after / f"rank{VICTIM}.pt").exists()
    for r in SURVIVORS:
        assert results[r]["live"] == SURVIVORS
        saved = _saved(after, r)["model"]
        for key, value in results[r]["state"].items():
            torch.testing.assert_close(saved[key], value, rtol=0, atol=0)

    files = [_saved(after, r) for r in SURVIVORS]
    for world in (3, 4):
        refused = run_distributed(_resume, world, args=(str(tmp_path), False))
        assert all("resize=True" in r["error"] for r in refused), refused
        resumed = run_distributed(_resume, world, args=(str(tmp_path), True))
        for got in resumed:
            assert got["extra"] == {"from": 0}
            for key, value in got["state"].items():
                want = torch.stack([f["model"][key].double() for f in files]).mean(0)
                torch.testing.assert_close(value, want.float())
            states = [f["optimizer"]["optimizer"]["state"] for f in files]
            for index, buffer in enumerate(got["buffers"]):
                want = torch.stack([s[index]["momentum_buffer"].double() for s in states])
                torch.testing.assert_close(buffer, want.mean(0).float())


def _auto(root):
    rank = gossamer.rank()
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = optim.AdaptWithCombine(sgd, model, topology=topology.ring(WORLD), elastic=True)
    auto = checkpoint.AutoResume(model, opt, directory=root, every=2, keep=1)
    for step in range(10):
        if rank == 0 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # the rank that prunes, when all live
        _train(model, opt, 1)
        auto.after_step()
    return auto.steps


def test_auto_resume_saves_and_prunes_after_the_lowest_rank_died(tmp_path):
    results = run_distributed(_auto, WORLD, args=(str(tmp_path),), dies=[0], timeout=120)
    assert results[1:] == [10, 10, 10]
    # keep=1: the old checkpoints are gone, rank 0's files and manifests included.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000010"]
    newest = tmp_path / "step00000010"
    manifest = json.loads((newest / checkpoint.MANIFEST).read_text())
    assert manifest["ranks"] == [1, 2, 3]
    assert sorted(p.name for p in newest.iterdir()) == ["manifest.json"] + [
        f"rank{r}.pt" for r in (1, 2, 3)
    ]


def _one_rank_fails(root):
    rank = gossamer.rank()
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = optim.AdaptWithCombine(sgd, model, topology=topology.ring(3), elastic=True)
    _train(model, opt, 1)
    try:
        checkpoint.save(root, model, opt, extra={1} if rank == 1 else None)
    except Exception as err:
        return type(err).__name__, str(err)
    return None


def test_a_rank_that_fails_an_elastic_save_fails_it_everywhere(tmp_path):
    results = run_distributed(_one_rank_fails, 3, args=(str(tmp_path),))
    assert results[1][0] == "TypeError"
    for r in (0, 2):
        assert results[r] == (
            "CheckpointError",
            "checkpoint save failed on rank(s) [1]; see their errors",
        )
    assert not (tmp_path / checkpoint.MANIFEST).exists()


def _elastic_save(path):
    model = _net()
    opt = optim.AdaptWithCombine(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        topology=topology.ring(gossamer.size()),
        elastic=True,
    )
    checkpoint.save(path, model, opt)
    return sorted(os.listdir(path))


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_elastic_save_after_a_re_init_on_the_same_user_store_writes_its_manifest(
    tmp_path, world_size
):
    # The harness passes its store to init and re-inits when a call's variables change: the
    # second runtime's save met the first one's keys there and wrote no manifest.
    for run in range(2):
        path = str(tmp_path / f"run{run}")
        # GOSSAMER_TEST_RUN is read by nothing: it forces a re-init.
        env = {"GOSSAMER_TEST_RUN": str(run)}
        listed = run_distributed(_elastic_save, world_size, args=(path,), env=env)[0]
        assert checkpoint.MANIFEST in listed, (run, listed)


def _elastic_save_on(port, path):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    gossamer.shutdown()  # the harness's runtime; it inits again at the next call
    try:
        gossamer.init(store=store, timeout=10)
        listed = _elastic_save(path)
        manifest = json.loads((Path(path) / checkpoint.MANIFEST).read_text())
        return listed, manifest["ranks"]
    finally:
        gossamer.shutdown()


@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)])
def test_jobs_of_other_sizes_on_one_user_store_keep_their_keys_apart(tmp_path, sizes):
    # A store that outlives jobs, here served by this process: the inits of a job of one
    # size there must not make the ranks of a later job of another size disagree on keys.
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for run, size in enumerate(sizes):
        path = str(tmp_path / f"run{run}")
        # No rank dies here. On a slow machine a rank still setting up its process group
        # once beat too late for GOSSAMER_DEAD_AFTER: its peers now see its process run.
        env = {"GOSSAMER_TEST_RUN": f"{tmp_path.name}-{run}"}  # a re-init at the next call
        out = run_distributed(_elastic_save_on, size, args=(port, path), env=env, timeout=60)
        assert out[0] == (
            sorted([checkpoint.MANIFEST, *(f"rank{r}.pt" for r in range(size))]),
            list(range(size)),
        ), (run, out[0])
    del server
