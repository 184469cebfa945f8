r"""PowerSGD gradient averaging: torch's shipped DDP hook behind gossamer's communicator.

PowerSGD (Vogels et al., NeurIPS 2019) replaces the allreduce of each gradient matrix
:math:`M \in \mathbb{R}^{n \times m}` (a parameter viewed as ``shape[0]`` rows) by the
allreduces of two thin factors of rank :math:`r`, one step of power iteration:

.. math::

    P = \operatorname{orth}\Big(\tfrac1N \sum_i M_i Q\Big), \qquad
    Q = \tfrac1N \sum_i M_i^\top P, \qquad \hat M = P Q^\top,

with ``Q`` warm-started from the previous step and error feedback on :math:`M_i - \hat M`.
Tensors for which :math:`(n + m) r \cdot` ``min_compression_rate`` :math:`\ge n m` (biases,
small layers) are averaged uncompressed. The math runs in
:func:`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`, unchanged:
:class:`PowerSGDAllreduce` hands it each bucket as an object with the four methods the hook
reads from a DDP ``GradBucket`` (``buffer``, ``index``, ``is_last``, ``gradients``), on
gossamer's communication thread, so its collectives are ordered with gossamer's own.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from gossamer import transport
from gossamer.communicators.base import Communicator, Pending
from gossamer.communicators.compressed import configuration_id
from gossamer.fusion import Bucket
from gossamer.profiling import count_collective

__all__ = ["PowerSGDAllreduce", "parse_powersgd"]

_NOT_SAVED = ("process_group", "rng")
# What the constructor's arguments set: a state saved with other values is refused.
_CONFIGURED = {
    "matrix_approximation_rank": "rank",
    "start_powerSGD_iter": "start_iter",
    "min_compression_rate": "min_compression_rate",
    "use_error_feedback": "error_feedback",
    "warm_start": "warm_start",
}

#: the first step that compresses, unless given: torch's default is 1000 (DDP's bucket
#: rebuild), its documentation's example 10; a few uncompressed steps help accuracy.
DEFAULT_START_ITER = 10


def parse_powersgd(spec: object) -> int | None:
    """The rank of a ``"powersgd"`` / ``"powersgd:<rank>"`` spec, or None for other values.

    Raises:
        ValueError: a ``powersgd`` spec whose rank is not an integer >= 1.
    """
    if not isinstance(spec, str):
        return None
    parts = [part.strip().lower() for part in spec.strip().split(":")]  # as get_compressor
    if parts[0] != "powersgd":
        return None
    if len(parts) == 1:
        return 1
    if len(parts) == 2 and parts[1].isdigit() and int(parts[1]) >= 1:
        return int(parts[1])
    raise ValueError(f"compression must be 'powersgd' or 'powersgd:<rank >= 1>'; got {spec!r}")


class _HookBucket:
    """What ``powerSGD_hook`` reads of a DDP ``GradBucket``, over a gossamer bucket's copy."""

    def __init__(self, flat: torch.Tensor, index: int, last: bool, shapes) -> None:
        self._flat, self._index, self._last = flat, index, last
        self._views, offset = [], 0
        for shape in shapes:
            numel = int(np.prod(shape, dtype=np.int64))
            if numel:  # the hook views each as shape[0] rows, which an empty one cannot be
                self._views.append(flat[offset : offset + numel].view(shape))
            offset += numel

    def buffer(self) -> torch.Tensor:
        return self._flat

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def gradients(self) -> list[torch.Tensor]:
        return self._views


def _matrix_shape(t: torch.Tensor) -> tuple[int, ...]:
    # The hook views a tensor as shape[0] rows; a 0-d parameter has no shape[0].
    return tuple(t.shape) if t.dim() > 0 else (1,)


class PowerSGDAllreduce(Communicator):
    r"""Each round: the global average of the bucket, PowerSGD-compressed (torch's hook).

    Args:
        rank (int): the approximation rank :math:`r` (``matrix_approximation_rank``).
        start_iter (int): steps averaged uncompressed before PowerSGD starts
            (``start_powerSGD_iter``; at least 2 with error feedback or warm start, as torch
            requires). Default 10; torch's own default is 1000.
        min_compression_rate (float): compress a matrix only if it shrinks by more than this.
        error_feedback (bool): keep each bucket's compression error for the next round.
        warm_start (bool): start each power iteration from the previous ``Q``.
        seed (int): seed of the random initial ``Q`` (the same on every rank).
        global_average_every (int, optional): every K-th round is a full-precision average.

    The state (:meth:`state_dict`) is torch's ``PowerSGDState`` as it pickles itself
    (iteration, residuals, ``P`` and ``Q`` memories, random state), so a resumed run
    continues exactly. Bytes on the wire (``profiling.bytes_sent``) count each allreduce
    (of the uncompressed tensors, of the ``P`` s, of the ``Q`` s) at the ring cost.
    """

    name = "powersgd_allreduce"

    def __init__(
        self,
        rank: int = 1,
        *,
        start_iter: int = DEFAULT_START_ITER,
        min_compression_rate: float = 2,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        global_average_every: int | None = None,
    ) -> None:
        super().__init__(global_average_every=global_average_every)
        for name, value in (("rank", rank), ("start_iter", start_iter), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int; got {value!r}")
        if rank < 1:
            raise ValueError(f"rank must be an int >= 1; got {rank!r}")
        for name, flag in (("error_feedback", error_feedback), ("warm_start", warm_start)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool; got {flag!r}")
        if (error_feedback or warm_start) and start_iter < 2:
            raise ValueError(
                f"start_iter must be >= 2 with error_feedback or warm_start (torch's "
                f"PowerSGD requires it); got {start_iter!r}"
            )
        if isinstance(min_compression_rate, bool) or not (
            isinstance(min_compression_rate, int | float) and min_compression_rate > 0
        ):
            raise ValueError(
                f"min_compression_rate must be a positive number; got {min_compression_rate!r}"
            )
        self.rank = rank
        config = (
            f"PowerSGD(rank={rank}, start_iter={start_iter}, min_compression_rate="
            f"{min_compression_rate}, error_feedback={error_feedback}, warm_start={warm_start})"
        )
        self.codec = configuration_id(config)
        self._config = config
        self.state = torch_powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=error_feedback,
            warm_start=warm_start,
            random_seed=seed,
        )
        self._shapes: list[list[tuple[int, ...]]] = []

    def bind(self, buckets: Sequence[Bucket]) -> None:
        """Learn the parameter shapes of each bucket (PowerSGD compresses them as matrices)."""
        self._shapes = [[_matrix_shape(t) for t in b.tensors] for b in buckets]

    def _shapes_of(self, flat: torch.Tensor, index: int) -> list[tuple[int, ...]]:
        if index < len(self._shapes):
            shapes = self._shapes[index]
            if sum(int(np.prod(s)) for s in shapes) == flat.numel():
                return shapes
        # Not bound (a bare communicator): the flat bucket is one vector, never compressed.
        return [(flat.numel(),)]

    def _wire_bytes(self, shapes, itemsize: int, compressed: bool) -> int:
        """Bytes this round allreduces (before the ring factor), as the hook splits them."""
        if not compressed:
            return sum(int(np.prod(s)) for s in shapes) * itemsize
        total = 0
        for s in shapes:
            n = s[0]
            m = int(np.prod(s[1:], dtype=np.int64)) if len(s) > 1 else 1
            r = min(n, m, self.rank)
            small = (n + m) * r * self.state.min_compression_rate >= n * m
            total += n * m if small else (n + m) * r
        return total * itemsize

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        x = flat.detach().reshape(-1).clone()  # the hook writes its result into the buffer
        shapes = self._shapes_of(x, index)
        last = index == max(len(self._shapes), 1) - 1
        return transport.submit(self.name, lambda: self._round(x, index, last, shapes, flat))

    def _round(self, x, index, last, shapes, flat) -> torch.Tensor:
        n = transport.group_size(None)
        compressed = self.state.iter >= self.state.start_powerSGD_iter
        # The header carries the configuration and the iteration: ranks that disagree
        # (another rank, a state loaded on one rank only) raise instead of mixing factors.
        transport.check_same_call(
            "compressed_allreduce",
            x,
            None,
            aux=self.state.iter,
            codec=self.codec,
            explain=lambda i: f"iteration {i}",
        )
        out = torch_powersgd.powerSGD_hook(self.state, _HookBucket(x, index, last, shapes)).wait()
        nbytes = self._wire_bytes(shapes, x.element_size(), compressed)
        count_collective(self.name, "all_reduce", nbytes, n)
        return out.view_as(flat)

    def compression_config(self) -> str:
        """``PowerSGD(rank=..., start_iter=..., ...)``."""
        return self._config

    def discard_round(self) -> None:
        """Drop torch's residuals and warm-start factors: an overflow made them non-finite.

        The factors are drawn again from the state's generator, alike on every rank.
        """
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memory.clear()

    def state_dict(self) -> dict:
        """Rounds and torch's ``PowerSGDState`` (as its ``__getstate__``, without the group)."""
        slots = [s for s in torch_powersgd.PowerSGDState.__slots__ if s not in _NOT_SAVED]
        torch_state = {s: copy.deepcopy(getattr(self.state, s)) for s in slots}
        # numpy's RandomState as tensors and numbers, which torch.load(weights_only) accepts.
        _, keys, pos, has_gauss, gauss = self.state.rng.get_state()
        torch_state["rng"] = {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
        return {**super().state_dict(), "powersgd": torch_state}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: ``state`` was saved with another configuration (``rank``,
                ``start_iter``, ``min_compression_rate``, ``error_feedback``, ``warm_start``).
        """
        saved = dict(state["powersgd"])
        for slot, argument in _CONFIGURED.items():
            if slot in saved and saved[slot] != getattr(self.state, slot):
                raise ValueError(
                    f"state was saved with {argument}={saved[slot]!r}; this "
                    f"{type(self).__name__} runs {argument}={getattr(self.state, slot)!r}"
                )
        super().load_state_dict(state)
        rng = saved.pop("rng")
        keys = rng["keys"].numpy().astype(np.uint32)
        self.state.rng.set_state(("MT19937", keys, rng["pos"], rng["has_gauss"], rng["gauss"]))
        for slot, value in saved.items():
            setattr(self.state, slot, copy.deepcopy(value))
