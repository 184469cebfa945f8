"""checkpoint.AutoResume in one process (plain torch, no init): when it saves, what it keeps,
which checkpoint it resumes from, and its settings. The restart under `gossamer run` is in
tests/launcher/test_elastic_run.py."""

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from gossamer import checkpoint
from gossamer.checkpoint import AutoResume


def _job():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(auto, model, opt, total):
    for _ in range(auto.steps, total):
        opt.zero_grad()
        model(torch.randn(4, 3)).square().mean().backward()
        opt.step()
        auto.after_step(extra={"seen": auto.steps + 1})


def test_saves_every_n_steps_keeps_the_newest_and_resumes_exactly(tmp_path):
    model, opt = _job()
    auto = AutoResume(model, opt, directory=tmp_path, every=3, keep=2)
    assert auto.enabled and auto.steps == 0 and auto.resumed_from is None
    _train(auto, model, opt, 8)  # saves after steps 3 and 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000003", "step00000006"]
    _train(auto, model, opt, 10)  # step 9 saved, step 3 pruned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000006", "step00000009"]
    want = [p.detach().clone() for p in model.parameters()]

    model, opt = _job()  # a restart: fresh objects, other random state
    torch.manual_seed(123)
    auto = AutoResume(model, opt, directory=tmp_path, every=3)
    assert auto.steps == 9 and auto.extra == {"seen": 9}
    assert auto.resumed_from == tmp_path / "step00000009"
    _train(auto, model, opt, 10)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), want, strict=True))


def test_an_incomplete_newest_checkpoint_is_skipped(tmp_path):
    model, opt = _job()
    auto = AutoResume(model, opt, directory=tmp_path, every=2, keep=5)
    _train(auto, model, opt, 4)
    (tmp_path / "step00000004" / checkpoint.MANIFEST).unlink()  # a save cut short
    (tmp_path / "step00000099").mkdir()  # no manifest at all
    auto = AutoResume(*_job(), directory=tmp_path, every=2)
    assert auto.steps == 2 and auto.resumed_from == tmp_path / "step00000002"


def test_only_whole_checkpoints_count_toward_keep(tmp_path):
    # A save killed after its rank files (no manifest) is not one of the `keep` newest:
    # counting it would leave one whole checkpoint where two were asked for.
    model, opt = _job()
    auto = AutoResume(model, opt, directory=tmp_path, every=2, keep=2)
    _train(auto, model, opt, 4)
    cut = tmp_path / "step00000005"
    cut.mkdir()
    (cut / "rank0.pt").write_bytes(b"x")
    auto.steps = 5  # as if resumed from a checkpoint of step 5 that another job wrote
    _train(auto, model, opt, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000004", "step00000006"]


def test_pruning_deletes_the_files_of_ranks_a_larger_job_had(tmp_path):
    # A job of 4 ranks saved steps 2 and 4 (one save killed mid-write), then resumed on
    # fewer ranks: pruning must leave nothing of the old checkpoints, whoever wrote it.
    for step in (2, 4):
        old = tmp_path / f"step{step:08d}"
        old.mkdir()
        for rank in range(4):
            (old / f"rank{rank}.pt").write_bytes(b"x")
        (old / ".rank3.pt.4242.tmp").write_bytes(b"x")
    model, opt = _job()
    auto = AutoResume(model, opt, directory=tmp_path, every=2, keep=1)
    _train(auto, model, opt, 8)  # resumes nothing (no manifest), saves 2, 4, 6, 8
    assert [p.name for p in tmp_path.iterdir()] == ["step00000008"]


def test_pruning_outlives_the_directory_vanishing_as_it_is_opened(tmp_path, monkeypatch):
    # A rank with no file of an old checkpoint (a job resumed on more ranks than saved it)
    # can list the checkpoint, then find it removed by the ranks that pruned their files.
    model, opt = _job()
    auto = AutoResume(model, opt, directory=tmp_path, every=2, keep=1)
    _train(auto, model, opt, 2)
    gone, iterdir = tmp_path / "step00000002", Path.iterdir

    def removed_first(path):
        if path == gone:
            shutil.rmtree(gone)
        return iterdir(path)

    monkeypatch.setattr(Path, "iterdir", removed_first)
    _train(auto, model, opt, 4)
    assert [p.name for p in tmp_path.iterdir()] == ["step00000004"]


def test_the_launcher_variables_are_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("GOSSAMER_CHECKPOINT_DIR", str(tmp_path / "ck"))
    monkeypatch.setenv("GOSSAMER_CHECKPOINT_EVERY", "2")
    model, opt = _job()
    auto = AutoResume(model, opt)
    assert auto.directory == tmp_path / "ck" and auto.every == 2
    _train(auto, model, opt, 2)
    assert (tmp_path / "ck" / "step00000002" / checkpoint.MANIFEST).is_file()


def test_off_without_a_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("GOSSAMER_CHECKPOINT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    model, opt = _job()
    auto = AutoResume(model, opt)
    assert not auto.enabled
    _train(auto, model, opt, 5)
    assert auto.steps == 5 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"directory": 5, "every": 1}, TypeError, "directory must be a str or os.PathLike; got 5"),
        (
            {"directory": "d"},
            ValueError,
            "every must be an integer >= 1 with a directory; got None",
        ),
        ({"directory": "d", "every": 0}, ValueError, "got 0"),
        ({"directory": "d", "every": 1, "keep": 0}, ValueError, "keep must be an integer >= 1"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, words, monkeypatch):
    monkeypatch.delenv("GOSSAMER_CHECKPOINT_EVERY", raising=False)
    with pytest.raises(error, match=words):
        AutoResume(*_job(), **kwargs)


def test_a_directory_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"'.*file' exists and is not a directory"):
        AutoResume(*_job(), directory=tmp_path / "file", every=3)
