"""Hook-driven overlap: the local step bucket by bucket, from the backward pass.

:class:`BucketwiseOptimizer` is the base of the optimizers that step each bucket as soon as
the backward pass has produced its gradients and start its round at once
(adapt-then-combine, push-sum). Its bookkeeping: from a parameter's gradient hook to the
bucket it completes (:class:`Arrivals`), and from a module's forward pre-hook to the buckets
whose result the module must wait for (:func:`module_buckets`).
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from gossamer.fusion import Bucket
from gossamer.optim.base import DecentralizedOptimizer, NoSync

__all__ = ["Arrivals", "BucketwiseOptimizer", "module_buckets", "queue_order"]

SEND_ORDERS = ("backward", "forward")


def queue_order(count: int, send_order: str | int) -> list[int]:
    """The order in which ``count`` buckets' rounds are queued (see BucketwiseOptimizer).

    Raises:
        ValueError: ``send_order`` is not ``"backward"``, ``"forward"`` or an int >= 0.
    """
    if isinstance(send_order, str) and send_order in SEND_ORDERS:
        tail = 0 if send_order == "backward" else count - 1
    elif isinstance(send_order, int) and not isinstance(send_order, bool) and send_order >= 0:
        tail = min(send_order, count - 1)
    else:
        raise ValueError(
            f"send_order must be 'backward', 'forward' or an int >= 0; got {send_order!r}"
        )
    head = count - max(tail, 0)
    return list(range(head)) + list(range(count - 1, head - 1, -1))


class Arrivals:
    """The parameters whose gradient arrived during the step under way, per bucket.

    Args:
        buckets (Sequence[Bucket]): the optimizer's buckets.
        names (Mapping[torch.Tensor, str]): each parameter's name, for error messages.
    """

    def __init__(self, buckets: Sequence[Bucket], names: Mapping[torch.Tensor, str]) -> None:
        self._bucket_of = {p: i for i, b in enumerate(buckets) for p in b.tensors}
        self._sizes = [len(b.tensors) for b in buckets]
        self._names = names
        self.reset()

    def reset(self) -> None:
        """Forget the arrivals: a new step begins."""
        self._seen: set[torch.Tensor] = set()
        self._missing = list(self._sizes)

    @property
    def any(self) -> bool:
        """Whether a gradient arrived since the last :meth:`reset`."""
        return bool(self._seen)

    def arrive(self, param: torch.Tensor) -> int | None:
        """Record ``param``'s gradient; the index of its bucket if that completed the bucket.

        Raises:
            RuntimeError: ``param``'s gradient already arrived in this step: a second
                backward pass before ``step()`` (the first already stepped with a partial
                gradient, which cannot be undone).
        """
        if param in self._seen:
            raise RuntimeError(
                f"the gradient of {self._names.get(param, 'a parameter')!r} arrived twice "
                "before step(): with overlap=True the local step of each bucket is taken in "
                "the backward pass that completes its gradients, so a second backward pass "
                "(gradient accumulation) must run inside optimizer.no_sync(), except the last; "
                "or construct the optimizer with overlap=False"
            )
        self._seen.add(param)
        index = self._bucket_of[param]
        self._missing[index] -= 1
        return index if self._missing[index] == 0 else None


def module_buckets(
    models: Sequence[nn.Module], buckets: Sequence[Bucket]
) -> list[tuple[nn.Module, list[int]]]:
    """Each module that owns parameters of ``buckets`` directly, with those buckets' indices.

    Only a module's own parameters count (``recurse=False``), so a module's forward pre-hook
    waits for exactly the buckets its forward reads; modules owning none are left out.
    """
    index_of = {p: i for i, b in enumerate(buckets) for p in b.tensors}
    found: list[tuple[nn.Module, list[int]]] = []
    seen: set[int] = set()
    for model in models:
        for module in model.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            indices = sorted(
                {index_of[p] for p in module.parameters(recurse=False) if p in index_of}
            )
            if indices:
                found.append((module, indices))
    return found


class BucketwiseOptimizer(NoSync, DecentralizedOptimizer, abc.ABC):
    """An optimizer that takes the local step bucket by bucket, from the backward pass.

    With ``overlap=True``, on communication steps, the post-accumulate-grad hook of each
    parameter records its gradient; when a bucket's gradients are all in, the bucket is
    stepped (:meth:`_step_bucket`, which says what to send) and the stepped buckets are
    queued in :attr:`send_order`, up to the first one not stepped yet, so that every rank
    starts the same rounds in the same order (the order is fixed at construction, never
    by timing). The step's first round advances the communicator (a dynamic schedule's
    peers are fixed for the whole step). :meth:`_take_remaining_steps` (called by
    ``step()``) steps and queues the buckets backward did not complete. A bucket's step is
    the wrapped optimizer's ``step()`` with its ``param_groups`` cut down to the bucket's
    parameters, so that optimizer's step hooks run once per bucket.

    The communication thread runs rounds one at a time in queue order, and the buckets
    are numbered in the order backward produces them (the model's last layers first), so
    the order chooses which rounds the next forward pass waits for:

    - ``send_order="backward"``: index order. The wire starts with the first bucket and
      never waits for a later one, but the model's first layers are sent last: the next
      forward pass starts only when every round is done.
    - ``send_order="forward"``: bucket 0 at once, then the others front of the model first
      (``0, n-1, n-2, ..., 1``), queued when backward has produced them all. Where the
      wire is the bottleneck the forward pass then computes its first layers while the
      last buckets are on the wire; where it is not (a long backward pass, many buckets)
      the rounds of buckets 1 .. n-1 start only at the end of backward.
    - an int ``k`` >= 0: index order, but the last ``k`` buckets (the model's front) go
      front first: ``0, ..., n-k-1, n-1, ..., n-k`` (``k = n - 1`` is ``"forward"``).

    Args:
        optimizer, model, **kwargs: as for :class:`DecentralizedOptimizer`.
        overlap (bool): take the local steps and start the rounds from the backward pass.
        send_order (str | int): ``"backward"`` (default), ``"forward"``, or ``k`` (above).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model,
        *,
        overlap: bool = True,
        send_order: str | int = "backward",
        **kwargs,
    ):
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool; got {overlap!r}")
        queue_order(1, send_order)  # checked first: a failed constructor leaves no hooks
        super().__init__(optimizer, model, **kwargs)
        self.overlap = overlap
        self.send_order = send_order
        #: the bucket indices in the order their rounds are queued (the same on every rank)
        self.queue_order = queue_order(len(self.buckets), send_order)
        self._position = {index: k for k, index in enumerate(self.queue_order)}
        self._arrivals = Arrivals(self.buckets, self.param_names)
        # Buckets stepped in this step and not queued yet: index -> (what to send, finish).
        self._ready: dict[int, tuple[torch.Tensor, Callable | None]] = {}
        self._queued = 0  # buckets 0.._queued-1 are queued in this step
        if overlap:
            self._hooks += [
                p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params
            ]

    @property
    def step_in_progress(self) -> bool:
        """Whether a backward pass began this step's local steps and ``step()`` has not run."""
        return self._arrivals.any or bool(self._ready) or self._queued > 0

    def _check_loss_scaler(self) -> None:
        if self.overlap:
            raise RuntimeError(
                f"{type(self).__name__}(overlap=True) takes its local steps during "
                "backward(), before a loss scaler (torch.amp.GradScaler) can unscale or "
                "check the gradients: build it with overlap=False to train with one "
                "(gossamer.optim.AdaptThenCombine(..., overlap=False); with the BlueFog "
                "facade, DistributedAdaptWithCombineOptimizer)"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; first finish, as :meth:`step` does, a step backward began.

        With ``overlap=True`` the backward pass of a communication step already took the
        local steps of its buckets and sent them, so a ``step()`` left out (a batch skipped
        after its backward pass) cannot undo them; the step is finished here, with a
        warning, and the next backward pass begins a new one. Every rank then runs the same
        rounds, whether it skipped ``step()`` or not.
        """
        if self._arrivals.any or self._ready or self._queued:
            warnings.warn(
                f"{type(self).__name__}.zero_grad() before step(): with overlap=True the "
                "backward pass already took this step's local steps and sent them, so "
                "zero_grad() finished the step as step() does; to skip a batch, skip its "
                "backward pass (or construct the optimizer with overlap=False)",
                RuntimeWarning,
                stacklevel=2,
            )
            self.step()
        super().zero_grad(set_to_none)

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self._no_sync or not self._is_round():
            return
        if not self._arrivals.any:  # before the first local step of this step, not at step()
            self._check_usable()
        index = self._arrivals.arrive(param)
        if index is not None:
            try:
                self._ready[index] = self._step_bucket(index)
                self._queue_ready()
            except BaseException:
                self._restart_step()  # the next backward pass begins a new step
                raise

    @abc.abstractmethod
    def _step_bucket(self, index: int) -> tuple[torch.Tensor, Callable | None]:
        """Take bucket ``index``'s local step; return what to send and the result's finish."""

    def _queued_up_to(self, indices: Iterable[int]) -> set[int]:
        """``indices`` and every bucket queued before any of them."""
        last = max(self._position[i] for i in indices)
        return set(self.queue_order[: last + 1])

    def _step_only(self, params: Iterable[torch.Tensor], closure=None):
        """The wrapped optimizer's step restricted to ``params`` (its own update rule)."""
        if self._skip_update:
            return None
        wanted = set(params)
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if p in wanted]
            return self.optimizer.step(closure)
        finally:
            for g, params_of_group in zip(groups, saved, strict=True):
                g["params"] = params_of_group

    def _queue_ready(self) -> None:
        """Queue the stepped buckets in :attr:`queue_order`, up to the first not stepped."""
        order = self.queue_order
        while self._queued < len(order) and order[self._queued] in self._ready:
            index = order[self._queued]
            if self._queued == 0:  # the step's first round fixes its peers (dynamic schedules)
                self.communicator.next_round()
            sent, finish = self._ready.pop(index)
            bucket = self.buckets[index]
            # The result may overwrite the packing buffer, not a tensor that finish reads.
            handle = self.communicator.start(sent, index, in_place=sent is bucket.flat)
            self._pending.append((bucket, handle, finish))
            self._queued += 1

    def _take_remaining_steps(self) -> None:
        """Step and queue every bucket backward did not; the step's bookkeeping restarts."""
        # The first bucket not queued was never stepped (else it would be queued). Each is
        # queued before the next is stepped: its round overlaps the following steps.
        try:
            while self._queued < len(self.buckets):
                index = self.queue_order[self._queued]
                self._ready[index] = self._step_bucket(index)
                self._queue_ready()
        finally:
            self._restart_step()

    def _restart_step(self) -> None:
        """Forget this step's arrivals and buckets not queued (the rounds queued go on)."""
        self._arrivals.reset()
        self._ready.clear()
        self._queued = 0
