r"""Gradient allreduce: the data-parallel baseline (torch DDP, Horovod), overlapped.

Every rank steps with the average gradient :math:`\bar g = \frac1n \sum_i g_i`, so all
models' parameters stay identical (buffers, such as BatchNorm's running statistics, stay
each rank's own: torch DDP broadcasts rank 0's, gossamer averages none). A bucket's
allreduce starts from gradient hooks as soon as every gradient in it is ready; buckets start
in a fixed order on every rank, so collectives always pair up.
"""

from __future__ import annotations

import torch

from gossamer import ops
from gossamer.communicators import Allreduce, Communicator
from gossamer.compression import Compressor
from gossamer.optim.base import DecentralizedOptimizer, NoSync, evaluate
from gossamer.transport import check_flag

__all__ = ["GradientAllreduce"]


class GradientAllreduce(NoSync, DecentralizedOptimizer):
    """Average the gradients over all ranks during the backward pass, then step.

    ``compression="topk:0.01"`` (or any compressor) averages through a
    :class:`~gossamer.communicators.CompressedAllreduce`, with error feedback by default for
    biased compressors; ``compression="powersgd:<rank>"`` runs torch's PowerSGD hook
    (:class:`~gossamer.communicators.PowerSGDAllreduce`); ``communicator=`` takes any
    communicator object.
    ``num_steps_per_communication=k`` accumulates the gradients of ``k`` backward passes
    locally and averages them on the ``k``-th (call :meth:`step` after it); :meth:`no_sync`
    skips communication for the backward passes inside it, as torch DDP's does. Parameters
    that received no gradient in a step are averaged as zeros, so no rank waits for them.
    A parameter that no rank used gets a zero gradient, which momentum and weight decay still
    act on; with ``find_unused_parameters=True`` it keeps the gradient it had (``None``
    after ``zero_grad()``), as in torch DDP with the same flag, for one more allreduce of a
    bit per parameter each communicating step.

    The averaged gradients are written by :meth:`synchronize`, which :meth:`step` calls: after
    ``backward()`` the gradients are still this rank's own (torch DDP's are averaged by
    then). To clip or unscale averaged gradients, call ``opt.synchronize()`` first, then
    change them, then ``opt.step()`` (which does not average again); changed before
    :meth:`synchronize`, they are overwritten by the average of the unchanged ones. So
    with a loss scaler: ``opt.synchronize()``, then ``scaler.unscale_(opt)`` (optional) and
    ``scaler.step(opt)``; a scaler's step before :meth:`synchronize` raises ``RuntimeError``.

    Example:
        >>> opt = GradientAllreduce(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> loss_fn(model(x), y).backward()   # allreduce of each bucket starts in here
        >>> opt.step()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model,
        *,
        communicator: Communicator | None = None,
        compression: str | Compressor | None = None,
        error_feedback: bool | None = None,
        num_steps_per_communication: int = 1,
        fusion_threshold_bytes=8 * 2**20,
        find_unused_parameters: bool = False,
    ) -> None:
        check_flag(find_unused_parameters, "find_unused_parameters", "GradientAllreduce")
        if communicator is None and compression is None and error_feedback is None:
            # The buckets hold copies of the gradients: averaging them in place saves a copy.
            communicator = Allreduce(in_place=True)
        super().__init__(
            optimizer,
            model,
            communicator=communicator,
            communication=None if communicator is not None else "allreduce",
            compression=compression,
            error_feedback=error_feedback,
            num_steps_per_communication=num_steps_per_communication,
            fusion_threshold_bytes=fusion_threshold_bytes,
        )
        self.find_unused_parameters = find_unused_parameters
        self._bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b.tensors}
        self._arrivals = dict.fromkeys(self.params, 0)
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        self._dirty = False  # a gradient arrived since the last synchronize
        self._accumulating = False  # a gradient arrived since the last step
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    @property
    def step_in_progress(self) -> bool:
        """Whether a backward pass produced gradients that :meth:`step` has not used yet."""
        return self._accumulating

    def _grad_ready(self, param: torch.Tensor) -> None:
        if param.grad.is_sparse:
            raise TypeError(
                f"GradientAllreduce averages dense gradients; {self.param_names[param]!r} got "
                "a sparse one (nn.Embedding(sparse=True)?): use a dense gradient"
            )
        self._accumulating = True
        if self._no_sync:
            return
        self._dirty = True
        self._arrivals[param] += 1
        J = self.num_steps_per_communication
        # By the count, not by whether the bucket started: a bucket that waits for a
        # parameter no pass reaches never starts in backward, and the misuse is the same.
        if self._arrivals[param] > J:
            raise RuntimeError(
                f"the gradient of {self.param_names[param]!r} arrived {self._arrivals[param]} "
                f"times before step(), more than num_steps_per_communication={J}: run the "
                "passes that only accumulate inside optimizer.no_sync()"
            )
        if self._arrivals[param] == self.num_steps_per_communication:
            index = self._bucket_of[param]
            self._ready[index] += 1
            self._launch(until_ready=True)

    def _launch(self, until_ready: bool) -> None:
        """Start buckets in index order: all of them, or up to the first one not ready."""
        while self._launched < len(self.buckets):
            bucket = self.buckets[self._launched]
            if until_ready and self._ready[self._launched] < len(bucket.tensors):
                return
            self.communicator.next_round()
            flat = bucket.pack(lambda p: p.grad)
            self._pending.append((bucket, self.communicator.start(flat, self._launched), None))
            self._launched += 1

    def _used_anywhere(self) -> dict[torch.Tensor, bool] | None:
        """Per parameter, whether any rank's backward reached it (None: not asked for)."""
        if not self.find_unused_parameters:
            return None
        mine = torch.tensor([self._arrivals[p] > 0 for p in self.params])
        anywhere = ops.allreduce(mine, op="bor")
        return dict(zip(self.params, anywhere.tolist(), strict=True))

    def synchronize(self) -> None:
        """Start what is left, wait for everything, and write the averaged gradients.

        Does nothing when no gradient arrived since the last call (so a second call does not
        average again).
        """
        if not self._dirty and not self._pending:
            return
        self._dirty = False
        self._launch(until_ready=False)
        pending, self._pending = self._pending, []
        try:
            used = self._used_anywhere()
            for bucket, handle, _ in pending:
                if handle is None:
                    continue
                averaged = handle.wait()

                def grad_of(p: torch.Tensor) -> torch.Tensor:
                    if p.grad is None:
                        if used is not None and not used[p]:
                            return torch.empty_like(p)  # left None, as DDP leaves it
                        p.grad = torch.zeros_like(p)
                    return p.grad

                bucket.unpack(averaged, grad_of)
        finally:
            # Also after a failed wait (a rank lost): counters left at "launched" would make
            # every later step skip communication and step on local gradients alone.
            self._arrivals = dict.fromkeys(self.params, 0)
            self._ready = [0] * len(self.buckets)
            self._launched = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; first finish the allreduces a backward pass started.

        As with torch DDP, a ``step()`` left out after a backward pass (a skipped batch)
        drops that pass's averaged gradients; the rounds it launched complete here, so
        every rank runs the same collectives whether it skipped ``step()`` or not.
        """
        if self._accumulating:
            self.synchronize()
            self._accumulating = False
        super().zero_grad(set_to_none)

    def _check_loss_scaler(self) -> None:
        if self._dirty or self._pending:
            raise RuntimeError(
                "GradientAllreduce: a loss scaler (torch.amp.GradScaler) stepped this "
                "optimizer before its gradients were averaged, so it unscaled and checked "
                "this rank's own gradients, and ranks would skip different steps: call "
                "opt.synchronize() before scaler.unscale_(opt) and scaler.step(opt)"
            )

    def step(self, closure=None):
        """Wait for the averaged gradients, then take the wrapped optimizer's step.

        A ``closure`` is evaluated first (see :func:`~gossamer.optim.base.evaluate`).
        """
        loss = evaluate(closure)
        self.synchronize()
        self.steps += 1
        self._accumulating = False
        if self._skip_update:  # every rank alike: the scaler checked the averages
            self.communicator.discard_round()
        self._update()
        return loss
