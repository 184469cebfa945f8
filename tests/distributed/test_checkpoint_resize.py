"""gossamer.checkpoint.load(..., resize=True): a checkpoint of 3 ranks resumed on 1, 2 and 4.

The reference is computed here, in one process, from the saved rank files themselves: the
mean of the three models and of the three momentum (or Adam moment) buffers.
"""

import pytest
import torch
from torch import nn

import gossamer
from gossamer import checkpoint, env, optim, topology
from gossamer.testing import run_distributed

SAVED = 3


def _net():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _awc(model, size):
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return optim.AdaptWithCombine(sgd, model, topology=topology.ring(size))


def _train(model, opt, count):
    for _ in range(count):
        opt.zero_grad()
        model(torch.randn(5, 3)).square().mean().backward()
        opt.step()


def _save(root):
    r, n = gossamer.rank(), gossamer.size()
    torch.manual_seed(r)
    model = _net()
    opt = _awc(model, n)
    _train(model, opt, 3)
    checkpoint.save(f"{root}/awc", model, opt, extra={"epoch": 7, "rank": r})
    opt.close()
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, adam, 2)
    checkpoint.save(f"{root}/adam", model, adam)


def _resume(root):
    n = gossamer.size()
    torch.manual_seed(100 + gossamer.rank())  # the loaded state must not depend on it
    model = _net()
    opt = _awc(model, n)
    extra = checkpoint.load(f"{root}/awc", model, opt, resize=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = [opt.optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    steps = opt.steps
    _train(model, opt, 2)  # the new topology works from the loaded state
    opt.close()
    adam_model = _net()
    adam = torch.optim.Adam(adam_model.parameters(), lr=0.01)
    checkpoint.load(f"{root}/adam", adam_model, adam, resize=True)
    moments = [adam.state[p]["exp_avg_sq"].clone() for p in adam_model.parameters()]
    return state, buffers, steps, extra, moments


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("resize")
    run_distributed(_save, SAVED, args=(str(root),), timeout=120)
    files = {
        name: [torch.load(root / name / f"rank{k}.pt", weights_only=True) for k in range(SAVED)]
        for name in ("awc", "adam")
    }
    return root, files


def _mean(tensors):
    return sum(t.double() for t in tensors) / len(tensors)


@pytest.mark.parametrize("size", [2, 4])
def test_every_rank_resumes_from_the_mean_of_the_saved_ranks(saved, size):
    root, files = saved
    awc, adam = files["awc"], files["adam"]
    out = run_distributed(_resume, size, args=(str(root),), timeout=120)
    want_model = {k: _mean([f["model"][k] for f in awc]) for k in awc[0]["model"]}
    inner = [f["optimizer"]["optimizer"]["state"] for f in awc]
    want_buffers = [_mean([s[i]["momentum_buffer"] for s in inner]) for i in range(4)]
    adam_state = [f["optimizer"]["state"] for f in adam]
    want_moments = [_mean([s[i]["exp_avg_sq"] for s in adam_state]) for i in range(4)]
    for state, buffers, steps, extra, moments in out:
        for key, value in want_model.items():
            torch.testing.assert_close(state[key].double(), value, rtol=1e-6, atol=1e-7)
        for got, want in zip(buffers + moments, want_buffers + want_moments, strict=True):
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-9)
        assert steps == 3 and extra == {"epoch": 7, "rank": 0}
    # Different saved models, so the mean is not any one of them.
    assert not torch.equal(awc[0]["model"]["0.weight"], awc[1]["model"]["0.weight"])


def test_a_world_of_one_resumes_the_mean_without_init(saved):
    root, files = saved
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="world size 3; this job has world size 1"):
        checkpoint.load(root / "adam", model, torch.optim.Adam(model.parameters()))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    checkpoint.load(root / "adam", model, adam, resize=True)
    want = _mean([f["model"]["2.bias"] for f in files["adam"]])
    torch.testing.assert_close(model.state_dict()["2.bias"].double(), want, rtol=1e-6, atol=0)
    with pytest.raises(TypeError, match="resize must be a bool; got 'yes'"):
        checkpoint.load(root / "adam", model, sgd, resize="yes")


def test_the_resize_switch_of_auto_resume_is_read_and_checked():
    assert env.settings({"GOSSAMER_CHECKPOINT_RESIZE": "1"}).checkpoint_resize
    assert not env.settings({}).checkpoint_resize
    with pytest.raises(ValueError, match="GOSSAMER_CHECKPOINT_RESIZE must be 0 or 1; got 'y'"):
        env.settings({"GOSSAMER_CHECKPOINT_RESIZE": "y"})
    model = _net()
    with pytest.raises(TypeError, match="resize must be a bool or None; got 1"):
        checkpoint.AutoResume(model, torch.optim.SGD(model.parameters(), lr=0.1), resize=1)


def _window_put(model, kind):
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)  # only the combine moves the model
    if kind == "push-sum":
        return optim.PushSum(sgd, model)
    graph = topology.exponential_two(gossamer.size())
    schedule = topology.one_peer_exponential(graph, gossamer.rank())
    return optim.WindowPut(sgd, model, schedule=schedule)


def _window_round(model, opt):
    opt.zero_grad()
    model(torch.randn(5, 3)).square().mean().backward()
    opt.synchronize()  # this rank's puts land before any rank combines
    gossamer.barrier()
    opt.step()
    gossamer.barrier()


def _save_windows(root, kind):
    torch.manual_seed(gossamer.rank())
    model = _net()
    opt = _window_put(model, kind)
    _window_round(model, opt)
    checkpoint.save(f"{root}/{kind}", model, opt)
    opt.close()


def _resume_windows(root, kind):
    torch.manual_seed(100 + gossamer.rank())  # initial models the slots must not keep
    model = _net()
    opt = _window_put(model, kind)
    checkpoint.load(f"{root}/{kind}", model, opt, resize=True)
    loaded = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    _window_round(model, opt)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    opt.close()
    return loaded, after


@pytest.mark.parametrize("kind", ["win-put-one-peer", "push-sum"])
def test_window_slots_restart_from_the_mean(tmp_path, kind):
    run_distributed(_save_windows, 2, args=(str(tmp_path), kind), timeout=120)
    out = run_distributed(_resume_windows, 3, args=(str(tmp_path), kind), timeout=120)
    for loaded, after in out:
        assert torch.equal(loaded, out[0][0])  # one mean on every rank ...
        torch.testing.assert_close(after, loaded, rtol=0, atol=1e-6)  # ... that a combine keeps


def _auto_resume(root, total, resize):
    torch.manual_seed(gossamer.rank())
    model = _net()
    opt = _awc(model, gossamer.size())
    auto = checkpoint.AutoResume(model, opt, directory=root, every=2, keep=1, resize=resize)
    start = auto.steps
    for _ in range(start, total):
        _train(model, opt, 1)
        auto.after_step()
    opt.close()
    return start


@pytest.mark.parametrize("size", [2, 3])
def test_auto_resume_on_fewer_ranks_prunes_every_file_of_the_larger_jobs_checkpoints(
    tmp_path, size
):
    run_distributed(_auto_resume, 4, args=(str(tmp_path), 4, False), timeout=120)
    # Saves of the larger job that were killed mid-write leave temporary files behind.
    (tmp_path / "step00000004" / ".rank3.pt.4242.tmp").write_bytes(b"x")
    (tmp_path / "step00000004" / f".{checkpoint.MANIFEST}.4242.tmp").write_bytes(b"x")
    starts = run_distributed(_auto_resume, size, args=(str(tmp_path), 8, True), timeout=120)
    assert starts == [4] * size
    assert [p.name for p in tmp_path.iterdir()] == ["step00000008"]
    kept = sorted(p.name for p in (tmp_path / "step00000008").iterdir())
    assert kept == sorted([checkpoint.MANIFEST, *(f"rank{r}.pt" for r in range(size))])


@pytest.mark.parametrize("size", [3, 4])
def test_auto_resume_on_more_ranks_prunes_the_smaller_jobs_checkpoints(tmp_path, size):
    # The ranks the smaller job lacked own no file of its checkpoints: the others may remove
    # a pruned directory while they still look into it.
    run_distributed(_auto_resume, 2, args=(str(tmp_path), 4, False), timeout=120)
    starts = run_distributed(_auto_resume, size, args=(str(tmp_path), 8, True), timeout=120)
    assert starts == [4] * size
    assert [p.name for p in tmp_path.iterdir()] == ["step00000008"]
    kept = sorted(p.name for p in (tmp_path / "step00000008").iterdir())
    assert kept == sorted([checkpoint.MANIFEST, *(f"rank{r}.pt" for r in range(size))])
