"""gossamer.checkpoint: layout, integrity checks, errors on every rank, a world of one."""

import json
import os
import random
import re

import numpy as np
import pytest
import torch
from torch import nn

import gossamer
from gossamer import checkpoint, optim
from gossamer.checkpoint import CheckpointError
from gossamer.testing import run_distributed


def _net():
    return nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.3), nn.Linear(4, 1))


def _steps(model, opt, count):
    for _ in range(count):
        opt.zero_grad()
        model(torch.randn(5, 3)).square().mean().backward()
        opt.step()


# ---------------------------------------------------------------------- one process
def test_plain_torch_resume_is_exact_without_init(tmp_path):
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _steps(model, opt, 3)
    checkpoint.save(tmp_path, model, opt, extra={"epoch": 2, "note": ("a", b"b")})
    py, npy = random.random(), np.random.rand()
    _steps(model, opt, 3)  # draws from the global generator (data, dropout)
    reference = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(1)
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    assert checkpoint.load(tmp_path, model, opt) == {"epoch": 2, "note": ("a", b"b")}
    assert (random.random(), np.random.rand()) == (py, npy)
    assert opt.param_groups[0]["lr"] == 0.1
    _steps(model, opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(reference, model.parameters(), strict=True))
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "rank0.pt"]


def test_arguments_are_checked_at_the_boundary(tmp_path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=re.escape("path must be a str or os.PathLike; got 3")):
        checkpoint.save(3, model, opt)
    with pytest.raises(TypeError, match=re.escape("model must be an nn.Module")):
        checkpoint.save(tmp_path, "model", opt)
    with pytest.raises(TypeError, match="optimizer must be a gossamer"):
        checkpoint.save(tmp_path, model, model)
    with pytest.raises(TypeError, match=r"extra\['f'\]\[1\] is a object"):
        checkpoint.save(tmp_path, model, opt, extra={"f": [1, object()]})
    assert not (tmp_path / checkpoint.MANIFEST).exists()
    checkpoint.save(tmp_path, model, opt)
    with pytest.raises(TypeError, match="restore_rng must be a bool; got 'yes'"):
        checkpoint.load(tmp_path, model, opt, restore_rng="yes")
    with pytest.raises(ValueError, match="holds one module; model has 2"):
        checkpoint.load(tmp_path, [model, _net()], opt)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        checkpoint.load(tmp_path / "nothing", model, opt)
    with pytest.raises(ValueError, match="path must name a directory; got ''"):
        checkpoint.save("", model, opt)  # it wrote into the working directory
    # Another torch optimizer: SGD's hyper-parameters replaced Adam's, which then failed.
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"saved with a torch.optim.SGD; .* torch.optim.Adam"):
        checkpoint.load(tmp_path, model, adam)
    assert adam.param_groups[0]["lr"] == 1e-3 and "betas" in adam.param_groups[0]
    wider = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.3), nn.Linear(5, 1))
    with pytest.raises(ValueError, match=r"entry '0.weight' has shape \(4, 3\); .* \(5, 3\)"):
        checkpoint.load(tmp_path, wider, torch.optim.SGD(wider.parameters(), lr=0.1))


def test_interrupted_or_changed_checkpoints_are_refused(tmp_path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint.save(tmp_path, model, opt)
    data = bytearray((tmp_path / "rank0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "rank0.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape("does not match manifest.json")):
        checkpoint.load(tmp_path, model, opt)
    manifest = tmp_path / checkpoint.MANIFEST
    manifest.write_text(manifest.read_text()[:25])  # truncated mid-string
    with pytest.raises(CheckpointError, match=r"manifest\.json is not valid JSON"):
        checkpoint.load(tmp_path, model, opt)
    manifest.write_text("[]")
    with pytest.raises(CheckpointError, match="not a gossamer checkpoint manifest"):
        checkpoint.load(tmp_path, model, opt)
    manifest.unlink()
    with pytest.raises(CheckpointError, match=re.escape("has no manifest.json: the save was")):
        checkpoint.load(tmp_path, model, opt)


# ---------------------------------------------------------------------- four ranks
def _outcome(call):
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def _awc(model):
    return optim.AdaptWithCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)


def _errors(root):
    r = gossamer.rank()
    torch.manual_seed(r)
    model = _net()
    opt = _awc(model)
    _steps(model, opt, 2)
    out = {}
    bad = {"x": object()} if r == 1 else None
    out["bad_extra"] = _outcome(lambda: checkpoint.save(f"{root}/a", model, opt, extra=bad))
    out["manifest_after_failure"] = os.path.exists(f"{root}/a/manifest.json")
    out["other_paths"] = _outcome(lambda: checkpoint.save(f"{root}/p{r // 2}", model, opt))
    out["other_paths_written"] = os.path.exists(f"{root}/p{r // 2}")
    checkpoint.save(f"{root}/b", model, opt)
    gossamer.barrier()
    if r == 2:
        with open(f"{root}/b/rank2.pt", "ab") as file:
            file.write(b"!")
    gossamer.barrier()
    out["changed_file"] = _outcome(lambda: checkpoint.load(f"{root}/b", model, opt))
    checkpoint.save(f"{root}/c", model, opt)
    if r == 0:
        os.remove(f"{root}/c/manifest.json")
    out["no_manifest"] = _outcome(lambda: checkpoint.load(f"{root}/c", model, opt))
    model(torch.randn(5, 3))  # the combine starts here
    out["mid_step"] = _outcome(lambda: checkpoint.save(f"{root}/d", model, opt))
    opt.step()
    checkpoint.save(f"{root}/e", model, opt)
    opt.close()
    push = optim.PushSum(torch.optim.SGD(model.parameters(), lr=0.1), model)
    checkpoint.save(f"{root}/push", model, push)
    push.close()
    opt = _awc(model)
    out["other_optimizer"] = _outcome(lambda: checkpoint.load(f"{root}/push", model, opt))
    out["plain_torch"] = _outcome(lambda: checkpoint.load(f"{root}/e", model, opt.optimizer))
    opt.close()
    return out


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    return root, run_distributed(_errors, 4, args=(str(root),), timeout=120)


def test_a_failure_on_one_rank_raises_on_every_rank(errors):
    _, out = errors
    assert out[1]["bad_extra"].startswith("TypeError: extra['x'] is a object")
    for r in (0, 2, 3):
        assert out[r]["bad_extra"] == (
            "CheckpointError: checkpoint save failed on rank(s) [1]; see their errors"
        )
    assert not any(o["manifest_after_failure"] for o in out)


def test_ranks_saving_to_other_directories_are_refused_on_every_rank(errors):
    # Rank 0's manifest would list files that ranks 2 and 3 wrote elsewhere.
    root, out = errors
    for r, o in enumerate(out):
        assert o["other_paths"] == (
            "ValueError: path must name the same directory on every rank; ranks [2, 3] gave "
            f"another than rank 0 (this rank: {str(root / f'p{r // 2}')!r})"
        )
        assert not o["other_paths_written"]  # refused before anything was written


def test_a_changed_rank_file_is_detected(errors):
    _, out = errors
    assert "rank2.pt does not match manifest.json" in out[2]["changed_file"]
    assert all("load failed on rank(s) [2]" in out[r]["changed_file"] for r in (0, 1, 3))


def test_a_missing_manifest_is_reported_by_every_rank(errors):
    _, out = errors
    assert "has no manifest.json" in out[0]["no_manifest"]
    for r in (1, 2, 3):
        assert out[r]["no_manifest"].startswith(
            "CheckpointError: rank 0 could not read the manifest: CheckpointError: path"
        )


def test_saving_in_the_middle_of_a_step_is_refused(errors):
    _, out = errors
    assert all("in the middle of a step" in o["mid_step"] for o in out)


def test_state_of_another_optimizer_is_refused(errors):
    _, out = errors
    assert all(
        "saved by PushSum; this optimizer runs AdaptWithCombine" in o["other_optimizer"]
        for o in out
    )
    assert all("class AdaptWithCombine; optimizer has class SGD" in o["plain_torch"] for o in out)


def test_another_world_size_is_refused_naming_both(errors):
    root, _ = errors
    manifest = json.loads((root / "e" / checkpoint.MANIFEST).read_text())
    assert manifest["world_size"] == 4 and manifest["ranks"] == [0, 1, 2, 3]
    assert manifest["step"] == 3 and manifest["gossamer_version"] == gossamer.__version__
    model = _net()
    with pytest.raises(ValueError, match="world size 4; this job has world size 1"):
        checkpoint.load(root / "e", model, torch.optim.SGD(model.parameters(), lr=0.1))


# ---------------------------------------------------------------------- a world of one
def _world_of_one(root):
    results = []
    for cls in (optim.AdaptThenCombine, optim.PushSum):
        torch.manual_seed(0)
        model = _net()
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
        _steps(model, opt, 2)
        checkpoint.save(f"{root}/{cls.__name__}", model, opt)
        _steps(model, opt, 2)
        opt.close()
        reference = [p.detach().clone() for p in model.parameters()]
        model = _net()
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
        checkpoint.load(f"{root}/{cls.__name__}", model, opt)
        _steps(model, opt, 2)
        opt.close()
        resumed = list(model.parameters())
        results.append(all(torch.equal(a, b) for a, b in zip(reference, resumed, strict=True)))
    return results


def test_a_world_of_one_resumes_exactly(tmp_path):
    assert run_distributed(_world_of_one, 1, args=(str(tmp_path),)) == [[True, True]]


def _wrapper_mismatches(root):
    def skewscout(model):
        atc = optim.AdaptThenCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)
        return optim.SkewScout(atc, lambda m: 1.0)

    def cocofl(model):
        return optim.CoCoFL(torch.optim.SGD(model.parameters(), lr=0.1), model)

    def atc(model):
        return optim.AdaptThenCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)

    messages = []
    for saved, loaded, kwargs in [
        (skewscout, atc, {}),
        (atc, skewscout, {}),
        (cocofl, skewscout, {}),
        (None, cocofl, {"resize": True}),  # the fixture's 4-rank checkpoint
    ]:
        path = f"{root}/e"
        if saved is not None:
            model = _net()
            path = f"{root}/{saved.__name__}"
            checkpoint.save(path, model, saved(model))
        model = _net()
        try:
            checkpoint.load(path, model, loaded(model), **kwargs)
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_a_wrapper_loads_only_its_own_kind_and_does_not_resize(errors):
    root, _ = errors
    [messages] = run_distributed(_wrapper_mismatches, 1, args=(str(root),))
    assert len(messages) == 4, messages
    assert "class SkewScout; optimizer has class AdaptThenCombine" in messages[0]
    assert "class AdaptThenCombine; optimizer has class SkewScout" in messages[1]
    assert "class CoCoFL; optimizer has class SkewScout" in messages[2]
    assert "this one holds ranks [0, 1, 2, 3] of world size 4" in messages[3]


def test_attach_checks_its_arguments():
    model = _net()
    with pytest.raises(TypeError, match=re.escape("module must be an nn.Module; got 'm'")):
        checkpoint.attach("m", "x", torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="name must be a str; got 3"):
        checkpoint.attach(model, 3, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="stateful must be an object with state_dict"):
        checkpoint.attach(model, "x", object())
    with pytest.raises(TypeError, match="stateful must be an object with state_dict"):
        checkpoint.attach(model, "x", torch.optim.lr_scheduler.StepLR)  # the class


def test_a_model_with_other_entries_is_refused_naming_them(tmp_path):
    model = _net()
    checkpoint.save(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1))
    wrapped = nn.Sequential(_net())  # as a DDP-style wrapper: "0.0.weight" for "0.weight"
    with pytest.raises(ValueError, match=r"it lacks \['0.0.bias', '0.0.weight'"):
        checkpoint.load(tmp_path, wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1))
