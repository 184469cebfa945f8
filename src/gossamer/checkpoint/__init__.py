"""Checkpoints for exact resume: one file per rank, and a manifest that vouches for them.

In decentralized training every rank holds a different model, different optimizer moments
and different communication state (window slots, push-sum weights, exact diffusion's
previous step). So a checkpoint is one ``torch.save`` file per rank, ``rank<k>.pt``, plus
``manifest.json``, which rank 0 writes only after every rank's file is on disk and which
lists each file with its size and SHA-256. :func:`load` trusts a file only if the manifest
vouches for it, so a save that was interrupted is detected, not half loaded.

``torch.distributed.checkpoint`` does not fit: its planner treats tensors that several ranks
save under the same name as replicas and keeps one copy (``dedup_save_plans``), which would
give every rank rank 0's model on load; its strengths, resharding across world sizes and
deduplication, have nothing to work on when no two ranks hold the same state.

Example:
    >>> gossamer.checkpoint.save("ckpt/step100", model, opt, extra={"epoch": 3})
    >>> # ... a new job, with the same number of ranks:
    >>> extra = gossamer.checkpoint.load("ckpt/step100", model, opt)

:class:`AutoResume` saves every N steps and, in a job that torchrun restarted
(``gossamer run --max-restarts K --checkpoint-dir D --checkpoint-every N``), resumes from
the newest complete checkpoint on its own.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossamer import context, ops
from gossamer.checkpoint._attached import attach, load_attached
from gossamer.checkpoint._auto import AutoResume
from gossamer.checkpoint._files import (
    MANIFEST,
    RECORD,
    CheckpointError,
    exchange,
    is_complete,
    read_rank_file,
    shared_manifest,
    write_manifest,
    write_rank_file,
)
from gossamer.checkpoint._resize import averaged_payload
from gossamer.checkpoint._state import (
    WRAPPERS,
    capture,
    check_fit,
    check_plain,
    decentralized,
    set_rng,
)
from gossamer.checkpoint._survivors import survivors_begin, survivors_save
from gossamer.errors import NotInitializedError
from gossamer.optim.base import DecentralizedOptimizer
from gossamer.optim.cocofl import CoCoFL
from gossamer.optim.skewscout import SkewScout

__all__ = ["MANIFEST", "AutoResume", "CheckpointError", "attach", "load", "save"]


def save(
    path: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: DecentralizedOptimizer | torch.optim.Optimizer | SkewScout | CoCoFL,
    *,
    extra: Any = None,
) -> Path:
    """Write this rank's state to ``path/rank<k>.pt``; rank 0 then writes the manifest.

    (After a death in an elastic job: the lowest live rank writes it.)

    Collective: every rank calls it between two steps (after ``step()``, before the next
    forward pass). It starts with a barrier, so no put or accumulate of an asynchronous
    optimizer is in flight while the window slots are read. Saved per rank: the model's
    ``state_dict()``, the optimizer's ``state_dict()`` (for a decentralized optimizer, the
    wrapped optimizer's state and every counter, schedule position, generator, window slot
    and push-sum weight its next steps depend on), the state of what :func:`attach` put
    beside the model (the Bagua facade's engine), the random generators of torch, Python
    and NumPy (dropout, shuffling), and ``extra``. Works without ``gossamer.init()`` in a
    single process.

    With an elastic optimizer (``elastic=True``) the save outlives dead ranks: it needs no
    collective over the world, the barrier and the exchange of the ranks' records go
    through the rendezvous store among the live ranks, and the manifest lists the files of
    the live ranks only (its ``ranks``). Such a checkpoint of the survivors resumes with
    ``load(..., resize=True)``, from their average. A rank that dies during the save is
    waited for until its heartbeat stops (:data:`~gossamer.transport.liveness.DEAD_AFTER_S`,
    or at once with the launcher's tombstone), then left out.

    Args:
        path (str | os.PathLike): the checkpoint directory (created if needed), the same
            on every rank (as an absolute path). Ranks on machines without a shared file
            system each write their own file there; the manifest is on rank 0's machine.
        model (nn.Module | Sequence[nn.Module]): the model(s) whose ``state_dict`` is saved.
        optimizer (DecentralizedOptimizer | torch.optim.Optimizer | SkewScout | CoCoFL): the
            optimizer (``SkewScout`` and ``CoCoFL`` with their whole state: period
            controller and probes; step and round counters).
        extra: anything else to resume (epoch, learning-rate scheduler state, data-loader
            position) made of dict, list, tuple, str, int, float, bool, None, bytes and
            tensors, so that ``torch.load(weights_only=True)`` reads it back.

    Returns:
        Path: the checkpoint directory.

    Raises:
        TypeError: a bad ``path``, ``model``, ``optimizer`` or ``extra``.
        ValueError: the optimizer is in the middle of a step, ``path`` is empty, or ranks
            gave other directories than rank 0 (on every rank).
        CheckpointError: another rank failed (on the ranks that did not; the failing rank
            raises its own error). No manifest is written then.
    """
    rank, size = _world()
    survivors = size > 1 and _is_elastic(optimizer)
    error: Exception | None = None
    try:
        # This rank's puts land (acknowledged) before the barrier, after which peers read
        # their window slots.
        inner = decentralized(optimizer)
        if inner is not None and not inner.step_in_progress:
            inner.synchronize()
    except Exception as err:
        error = err
    if survivors:
        key = survivors_begin()
    elif size > 1:  # also the barrier
        sums = ops.allgather(torch.tensor([_checksum(path)], dtype=torch.int64)).tolist()
    record = [0] * RECORD
    try:
        if error is not None:
            raise error
        directory = _directory(path)
        if size > 1 and not survivors:
            _check_same_directory(directory, sums)
        models, single = _models(model)
        _check_optimizer(optimizer, "save")
        check_plain(extra, "extra")
        payload = capture(rank, size, models, single, optimizer, extra)
        directory.mkdir(parents=True, exist_ok=True)
        if rank == 0 or survivors:  # survivors: the manifest's writer is not known yet
            # Until the new manifest lands, the directory is not a checkpoint at all.
            (directory / MANIFEST).unlink(missing_ok=True)
        record = write_rank_file(directory, rank, payload)
    except Exception as err:
        error = err
    if survivors:
        survivors_save(key, error, record, lambda records: write_manifest(directory, records, size))
        return directory
    records = dict(enumerate(exchange(rank, size, error, record, "save")))
    error = None
    if rank == 0:
        try:
            write_manifest(directory, records, size)
        except Exception as err:
            error = err
    exchange(rank, size, error, [], "writing the manifest")
    return directory


def load(
    path: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: DecentralizedOptimizer | torch.optim.Optimizer | SkewScout | CoCoFL,
    *,
    restore_rng: bool = True,
    resize: bool = False,
) -> Any:
    r"""Restore this rank's state from a checkpoint that :func:`save` wrote; return ``extra``.

    Collective: every rank calls it after building the model and the optimizer (same
    classes, model, ``fusion_threshold_bytes``, topology, and a fresh schedule if one is
    used) and before training. Rank 0 reads the manifest and sends it to every rank; each
    rank checks its own file's size and SHA-256 against it before loading anything, and no
    rank returns before every rank has loaded (so no neighbour's new put can land in a slot
    before the slot is restored).

    Args:
        path (str | os.PathLike): the checkpoint directory.
        model (nn.Module | Sequence[nn.Module]): the model(s) to load into, as saved.
        optimizer (DecentralizedOptimizer | torch.optim.Optimizer | SkewScout | CoCoFL): the
            optimizer.
        restore_rng (bool): also restore torch's, Python's and NumPy's random generators.
        resize (bool): accept a checkpoint of another number of ranks ``n``. Then every
            rank loads the mean of the ``n`` saved models, :math:`x_i = \frac{1}{n}
            \sum_k x_k`, and of the wrapped torch optimizer's floating-point state, plus
            saved rank 0's step counter and ``extra``; the communication state stays as the
            new optimizer built it and the generators are not restored. Not exact (no
            mapping of ``n`` models onto ``m`` ranks is); rank 0 must be able to read every
            saved rank's file. With the same number of ranks it changes nothing. A
            checkpoint of the survivors of a death (elastic) needs it: its ``n`` are the
            survivors. ``SkewScout`` and ``CoCoFL`` do not resize (their per-rank state has
            no mean).

    Returns:
        the ``extra`` given to :func:`save` (saved rank 0's after a resize).

    Raises:
        TypeError: a bad ``path``, ``model`` or ``optimizer``.
        FileNotFoundError: ``path`` is not a directory.
        ValueError: the checkpoint was written by another number of ranks, or by the
            survivors of a death, and ``resize`` is False (or the optimizer is a
            ``SkewScout`` or ``CoCoFL``), or it does not fit the model (a
            tensor of another shape) or the optimizer (another wrapper, or another torch
            optimizer inside it).
        CheckpointError: no manifest (an interrupted save), a file that does not match it,
            or another rank failed.
    """
    rank, size = _world()
    error: Exception | None = None
    directory: Path | None = None
    try:
        if not isinstance(restore_rng, bool):
            raise TypeError(f"restore_rng must be a bool; got {restore_rng!r}")
        if not isinstance(resize, bool):
            raise TypeError(f"resize must be a bool; got {resize!r}")
        directory = _directory(path)
        models, single = _models(model)
        _check_optimizer(optimizer, "load")
    except Exception as err:
        error = err
    payload: dict = {}
    resized = False
    try:
        # Collective, so every rank takes part even when its own arguments were bad.
        manifest = shared_manifest(rank, size, directory)
        resized = resize and (manifest["world_size"] != size or not is_complete(manifest))
        if resized and isinstance(optimizer, WRAPPERS):
            raise ValueError(
                f"resize: a {type(optimizer).__qualname__} resumes only a complete "
                f"checkpoint of this job's world size {size}; this one holds ranks "
                f"{manifest['ranks']} of world size {manifest['world_size']}"
            )
        if resized:
            payload = averaged_payload(directory, manifest, rank, size)  # collective too
        elif error is None and directory is not None:
            payload = read_rank_file(directory, manifest, rank, size)
        if error is None:
            check_fit(payload, single, models, optimizer)
    except Exception as err:
        error = error or err
    exchange(rank, size, error, [], "load")
    try:
        if decentralized(optimizer) is not None:
            optimizer.synchronize()
        states = [payload["model"]] if single else payload["model"]
        for module, state in zip(models, states, strict=True):
            module.load_state_dict(state)
        if resized and isinstance(optimizer, DecentralizedOptimizer):
            # Averaged inner state and the step counter; the communication state stays.
            optimizer.optimizer.load_state_dict(payload["optimizer"]["optimizer"])
            optimizer.steps = payload["optimizer"]["steps"]
            # Window slots still hold the models they were made from, not the average.
            optimizer.communicator.rebind(optimizer.buckets)
        else:
            optimizer.load_state_dict(payload["optimizer"])
        load_attached(models, payload.get("attached", []), resized)
        if restore_rng and not resized:
            set_rng(payload["rng"])
    except Exception as err:
        error = err
    exchange(rank, size, error, [], "load")
    return payload["extra"]


# ---------------------------------------------------------------------- arguments
def _world() -> tuple[int, int]:
    if context.is_initialized():
        return context.rank(), context.size()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise NotInitializedError(
            "gossamer.checkpoint needs gossamer.init() in a job of more than one process"
        )
    return 0, 1


def _directory(path: object) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike; got {path!r}")
    if not os.fspath(path):  # Path("") is the working directory
        raise ValueError("path must name a directory; got ''")
    return Path(path)


def _checksum(path: object) -> int:
    """A number naming ``path`` (-1 for no path), compared across ranks."""
    if not isinstance(path, str | os.PathLike):
        return -1
    return zlib.crc32(os.fsencode(os.path.abspath(os.fspath(path))))


def _check_same_directory(directory: Path, sums: list[int]) -> None:
    """Raise on every rank when ranks name other directories than rank 0's.

    A checkpoint is one directory: rank 0's manifest would list files written elsewhere.
    """
    other = [r for r, value in enumerate(sums) if value != sums[0]]
    if other:
        raise ValueError(
            f"path must name the same directory on every rank; ranks {other} gave another "
            f"than rank 0 (this rank: {str(directory)!r})"
        )


def _models(model: object) -> tuple[list[nn.Module], bool]:
    if isinstance(model, nn.Module):
        return [model], True
    models = list(model) if isinstance(model, Sequence) and not isinstance(model, str) else []
    if not models or not all(isinstance(m, nn.Module) for m in models):
        raise TypeError(f"model must be an nn.Module or a sequence of them; got {model!r}")
    return models, False


def _is_elastic(optimizer: object) -> bool:
    """Whether the optimizer's rounds outlive dead peers (then so must its checkpoints)."""
    inner = decentralized(optimizer)
    return inner is not None and getattr(inner.communicator, "elastic", False) is True


def _check_optimizer(optimizer: object, what: str) -> None:
    if not isinstance(optimizer, (DecentralizedOptimizer, torch.optim.Optimizer, *WRAPPERS)):
        raise TypeError(
            "optimizer must be a gossamer DecentralizedOptimizer, SkewScout or CoCoFL, or a "
            f"torch.optim.Optimizer; got {optimizer!r}"
        )
    inner = decentralized(optimizer)
    if inner is not None and inner.step_in_progress:
        raise ValueError(
            f"optimizer {optimizer!r} is in the middle of a step (its communication has "
            f"started); {what} between steps: after step(), before the next forward pass"
        )
