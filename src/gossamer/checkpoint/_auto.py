"""Automatic checkpoints of a training loop, and resuming from the newest after a restart.

``gossamer run --checkpoint-dir D --checkpoint-every N --max-restarts K`` passes ``D`` and
``N`` to every rank (``GOSSAMER_CHECKPOINT_DIR``, ``GOSSAMER_CHECKPOINT_EVERY``). When a
rank dies, torchrun's agent restarts every rank (up to ``K`` times); each new rank's
:class:`AutoResume` then loads the newest *complete* checkpoint under ``D`` (one with a
manifest: :func:`~gossamer.checkpoint.save` writes it last) and the loop continues from the
step it holds. The same script runs unchanged without the options: nothing is saved and it
starts at step 0.

``gossamer run --nnodes MIN:MAX`` lets the job change size at a restart (a machine joins
or leaves); it sets ``GOSSAMER_CHECKPOINT_RESIZE=1``, and :class:`AutoResume` then resumes a
checkpoint of another number of ranks with ``load(..., resize=True)``: every rank starts
from the saved ranks' average.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gossamer import context, env, ops
from gossamer.checkpoint._files import MANIFEST
from gossamer.optim.base import DecentralizedOptimizer
from gossamer.optim.cocofl import CoCoFL
from gossamer.optim.skewscout import SkewScout
from gossamer.transport import live_ranks

__all__ = ["AutoResume"]

_NAME = re.compile(r"step(\d+)")
# What a save writes (checkpoint._files): a rank's file or the manifest, or the temporary
# file of one whose save was killed. The group is the rank that owns a rank file.
_SAVED_FILE = re.compile(r"\.?(?:rank(\d+)\.pt|manifest\.json)(?:\.\d+\.tmp)?")


class AutoResume:
    """Save every ``every`` steps under ``directory``; on creation, resume from the newest.

    Collective: every rank creates it after building the model and the optimizer (it loads
    the newest complete checkpoint, if any) and calls :meth:`after_step` after every
    ``step()``. Checkpoint ``k`` (after ``k`` steps) is ``directory/step<k>`` (8 digits);
    the ``keep`` newest are kept. Resuming is exact (bit for bit, see
    :func:`~gossamer.checkpoint.load`) when the loop picks its data by step number (or keeps
    its data position in ``extra``) and the job has as many ranks as the saved one.

    Example:
        >>> auto = gossamer.checkpoint.AutoResume(model, opt)  # loads the newest, if any
        >>> if auto.extra is not None:
        ...     scheduler.load_state_dict(auto.extra["scheduler"])
        >>> for step in range(auto.steps, total_steps):
        ...     train_one_step(step)
        ...     auto.after_step(extra={"scheduler": scheduler.state_dict()})

    Args:
        model (nn.Module | Sequence[nn.Module]): as for :func:`~gossamer.checkpoint.save`.
        optimizer (DecentralizedOptimizer | torch.optim.Optimizer | SkewScout | CoCoFL):
            likewise.
        directory (str | os.PathLike, optional): where checkpoints go; default
            ``GOSSAMER_CHECKPOINT_DIR`` (``gossamer run --checkpoint-dir``). None and unset:
            off (nothing is saved or loaded).
        every (int, optional): steps between checkpoints; default
            ``GOSSAMER_CHECKPOINT_EVERY`` (``--checkpoint-every``), required when a
            directory is given.
        keep (int): how many of the newest checkpoints to keep (>= 1).
        resize (bool, optional): resume a checkpoint saved by another number of ranks
            (every rank loads the saved ranks' average, see
            :func:`~gossamer.checkpoint.load`); default ``GOSSAMER_CHECKPOINT_RESIZE``
            (set by ``gossamer run --nnodes MIN:MAX``), else False.

    Attributes:
        steps (int): steps completed: 0 in a fresh job, the loaded checkpoint's step after
            a resume, then counted by :meth:`after_step`.
        extra: the ``extra`` of the loaded checkpoint (None when nothing was loaded).
        resumed_from (Path | None): the checkpoint loaded.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: DecentralizedOptimizer | torch.optim.Optimizer | SkewScout | CoCoFL,
        *,
        directory: str | os.PathLike | None = None,
        every: int | None = None,
        keep: int = 2,
        resize: bool | None = None,
    ) -> None:
        settings = env.settings()
        resize = settings.checkpoint_resize if resize is None else resize
        if not isinstance(resize, bool):
            raise TypeError(f"resize must be a bool or None; got {resize!r}")
        if directory is None:
            directory = settings.checkpoint_dir
            every = every if every is not None else settings.checkpoint_every
        if directory is not None and not isinstance(directory, str | os.PathLike):
            raise TypeError(f"directory must be a str or os.PathLike; got {directory!r}")
        if directory is not None and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise ValueError(f"every must be an integer >= 1 with a directory; got {every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1; got {keep!r}")
        if directory is not None and Path(directory).exists() and not Path(directory).is_dir():
            # Else the first save fails, `every` steps into training.
            raise ValueError(f"directory {str(directory)!r} exists and is not a directory")
        self.model, self.optimizer = model, optimizer
        self.directory = None if directory is None else Path(directory)
        self.every, self.keep, self.resize = every, keep, resize
        self.steps = 0
        self.extra: Any = None
        self.resumed_from: Path | None = None
        if self.directory is not None:
            self._resume()

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are saved and loaded (a directory was given or set)."""
        return self.directory is not None

    def after_step(self, extra: Any = None) -> Path | None:
        """Count one completed step; save when the count is a multiple of ``every``.

        Collective (every rank calls it after every ``step()``).

        Args:
            extra: what else to resume (scheduler state, data position), as for
                :func:`~gossamer.checkpoint.save`; handed back as :attr:`extra` on resume.

        Returns:
            Path | None: the checkpoint written, or None.
        """
        from gossamer.checkpoint import save  # the package imports this module

        self.steps += 1
        if self.directory is None or self.steps % self.every:
            return None
        path = self.directory / f"step{self.steps:08d}"
        save(path, self.model, self.optimizer, extra={"steps": self.steps, "extra": extra})
        self._prune(path)
        return path

    def _resume(self) -> None:
        from gossamer.checkpoint import load

        newest = _agree(_newest(self.directory))  # type: ignore[arg-type]
        if newest < 0:
            return
        path = self.directory / f"step{newest:08d}"  # type: ignore[operator]
        saved = load(path, self.model, self.optimizer, resize=self.resize)
        self.steps, self.extra, self.resumed_from = saved["steps"], saved["extra"], path

    def _prune(self, newest: Path) -> None:
        """Delete this rank's files of all but the ``keep`` newest checkpoints.

        Where this rank sees the manifests (``newest``'s), only whole checkpoints count
        toward ``keep``, and what a killed save left is deleted; elsewhere (a machine
        without a shared file system, which holds no manifest) every directory counts.
        The lowest live rank also deletes the manifest first (from then on the directory
        is no checkpoint at all) and every file no live rank owns: those of dead ranks, of
        ranks a larger job had before it resumed on fewer, and the temporary files (of
        rank files or of the manifest) a killed save left.
        """
        assert self.directory is not None
        whole = (newest / MANIFEST).is_file()
        kept = sorted(_checkpoints(self.directory, complete=whole))[-self.keep :]
        old = [s for s in _checkpoints(self.directory, complete=False) if s not in kept]
        rank, _, live = _live()
        lowest = rank == live[0]
        for step in old:
            path = self.directory / f"step{step:08d}"
            if path == newest:
                continue
            if lowest:
                (path / MANIFEST).unlink(missing_ok=True)
            try:
                entries = list(path.iterdir())
            except (FileNotFoundError, NotADirectoryError):
                # A rank with no file there (the job resumed on more ranks than saved it)
                # can find it gone: the ranks with files removed it as they pruned it.
                continue
            for entry in entries:
                found = _SAVED_FILE.fullmatch(entry.name)
                if found is None:
                    continue
                owner = None if found.group(1) is None else int(found.group(1))
                if owner == rank or (lowest and owner not in live):
                    entry.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                path.rmdir()  # the last rank to delete its file removes the directory


def _live() -> tuple[int, int, list[int]]:
    """This rank, the world size and the live ranks (all, unless an elastic job lost some)."""
    if not context.is_initialized() or context.size() == 1:
        return 0, 1, [0]
    return context.rank(), context.size(), live_ranks()


def _checkpoints(directory: Path, *, complete: bool) -> list[int]:
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.fullmatch(entry.name)
        if match and (not complete or (entry / MANIFEST).is_file()):
            found.append(int(match.group(1)))
    return found


def _newest(directory: Path) -> int:
    return max(_checkpoints(directory, complete=True), default=-1)


def _agree(value: int) -> int:
    """Rank 0's ``value`` on every rank (other machines may not see rank 0's manifests)."""
    if not context.is_initialized() or context.size() == 1:
        return value
    return int(ops.broadcast(torch.tensor([value], dtype=torch.int64), root=0)[0])
