r"""Asynchronous model averaging: a background thread averages the weights periodically.

Every ``sync_interval_ms`` the background thread takes a snapshot :math:`s` of the weights,
averages it over the ranks and applies :math:`x \leftarrow x + \bar s - s` (see
:mod:`gossamer.bagua.asynchronous`); training never waits for other ranks' steps, so ranks
may run different numbers of steps. The first ``warmup_steps`` steps use synchronous
gradient allreduce instead. Call ``model.bagua_algorithm.abort(model)`` when training ends
(and ``resume(model)`` to start again); both are collective and may be repeated.
"""

from __future__ import annotations

import logging
from enum import IntEnum
from typing import Any

import torch

from gossamer.bagua._groups import BaguaProcessGroup
from gossamer.bagua._state import state
from gossamer.bagua.algorithms.base import Algorithm, AlgorithmImpl
from gossamer.bagua.asynchronous import ASYNC_PEER_SELECTION_MODES, BackgroundLoop, new_gloo_group
from gossamer.bagua.bucket import BaguaBucket
from gossamer.bagua.communication import barrier

__all__ = ["AsyncModelAverageAlgorithm", "AsyncModelAverageAlgorithmImpl"]

logger = logging.getLogger(__name__)


class _AsyncInternalState(IntEnum):
    NEW = 0
    SCHEDULED = 1
    STARTED = 2
    STOPPED = 3


def _check(peer_selection_mode: object, sync_interval_ms: object, warmup_steps: object) -> None:
    if peer_selection_mode not in ASYNC_PEER_SELECTION_MODES:
        raise ValueError(
            f"peer_selection_mode must be one of {ASYNC_PEER_SELECTION_MODES}; "
            f"got {peer_selection_mode!r}"
        )
    for name, value in (("sync_interval_ms", sync_interval_ms), ("warmup_steps", warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0; got {value!r}")


def _engine(model: Any) -> Any:
    """The engine of a wrapped module, a DDP wrapper, or the engine itself."""
    from gossamer.bagua.data_parallel.bagua_distributed import BaguaDistributedDataParallel

    if isinstance(model, BaguaDistributedDataParallel):
        return model
    for attr in ("inner", "bagua_ddp"):
        found = getattr(model, "__dict__", {}).get(attr)
        if isinstance(found, BaguaDistributedDataParallel):
            return found
    raise TypeError(
        f"expected a module wrapped with with_bagua(), a DistributedDataParallel or its "
        f"engine; got {type(model).__name__}"
    )


class AsyncModelAverageAlgorithmImpl(AlgorithmImpl):
    """:class:`AsyncModelAverageAlgorithm` bound to a process group."""

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        peer_selection_mode: str = "all",
        sync_interval_ms: int = 500,
        warmup_steps: int = 0,
    ) -> None:
        _check(peer_selection_mode, sync_interval_ms, warmup_steps)
        super().__init__(process_group)
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps
        self.step_id = 0
        self.status = _AsyncInternalState.NEW
        # The background rounds get a gloo group of their own (collective: made now).
        ranks = list(process_group.ranks)
        self.thread_group = BaguaProcessGroup(
            ranks, None, "async", torch_group=new_gloo_group(ranks)
        )
        self._loop: BackgroundLoop | None = None
        self._op: Any = None
        self._held = False  # this (training) thread holds the weight lock
        state().closers.append(self._stop_locally)

    @property
    def rounds(self) -> int:
        """Averaging rounds applied so far on this rank (beyond Bagua, for monitoring)."""
        return 0 if self._op is None else self._op.rounds

    # ---------------------------------------------------------------- set-up
    def need_reset(self) -> bool:
        """Counts steps; True once, when warm-up ends."""
        self.step_id += 1
        if self.warmup_steps > 0 and self.step_id == self.warmup_steps + 1:
            logger.info("async model average starts from step %d", self.step_id)
            return True
        return False

    def _averaging(self) -> bool:
        return self.step_id >= self.warmup_steps

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        """Gradients during warm-up, then the weights."""
        if not self._averaging():
            return super().init_tensors(bagua_ddp)
        return [
            param.ensure_bagua_tensor(name, bagua_ddp.bagua_module_name)
            for name, param in reversed(bagua_ddp.bagua_build_params())
        ]

    def tensors_to_buckets(self, tensors: list[list[Any]], do_flatten: bool) -> list[BaguaBucket]:
        """Warm-up buckets, then all weights in one bucket.

        Raises:
            ValueError: ``do_flatten=False`` (as in Bagua).
        """
        if not do_flatten:
            raise ValueError("the async algorithm supports do_flatten=True only")
        if not self._averaging():
            return super().tensors_to_buckets(tensors, do_flatten)
        return [BaguaBucket([t for group in tensors for t in group], flatten=True, name="0")]

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        """Gradient allreduce during warm-up; then start the background rounds."""
        bagua_ddp._bagua_backend.wait_pending_comm_ops()
        bucket.clear_ops()
        if not self._averaging():
            bucket.append_centralized_synchronous_op(
                hierarchical=False, average=True, group=self.process_group
            )
            return
        self._op = bucket._async_op = bucket.append_asynchronous_model_average_op(
            self.peer_selection_mode, group=self.thread_group
        )
        if self.sync_interval_ms > 0 and self.status == _AsyncInternalState.NEW:
            # Every rank starts its loop here, at the same point of the program, so no rank
            # waits in a round for a peer whose loop never started.
            self._start()

    def _start(self) -> None:
        self._op.reset()
        self._loop = BackgroundLoop(
            self._op.run_round, self.sync_interval_ms / 1000, "gossamer-bagua-async"
        )
        self.status = _AsyncInternalState.STARTED

    def _stop_locally(self) -> None:
        if self._op is not None:
            self._op.stopped_locally = True
        if self._loop is not None:
            self._loop.wake()

    def _raise_loop_error(self) -> None:
        if self._loop is not None and self._loop.error is not None:
            error, self._loop.error = self._loop.error, None
            raise RuntimeError("asynchronous model averaging failed") from error

    # ---------------------------------------------------------------- hooks
    def init_forward_pre_hook(self, bagua_ddp: Any):
        """After warm-up: take the weight lock for the forward pass, backward and step."""

        def hook(input: Any) -> None:
            if self.step_id > self.warmup_steps and self._op is not None:
                self._raise_loop_error()
                if not self._held:
                    self._op.lock_weight()
                    self._held = True

        return hook

    def init_backward_hook(self, bagua_ddp: Any):
        """During warm-up, mark gradients ready."""
        warm = super().init_backward_hook(bagua_ddp)

        def hook(parameter_name: str, parameter: torch.Tensor) -> None:
            if self.step_id <= self.warmup_steps:
                warm(parameter_name, parameter)

        return hook

    def init_post_backward_hook(self, bagua_ddp: Any):
        """During warm-up, wait for the gradient allreduce."""

        def hook() -> None:
            if self.step_id <= self.warmup_steps:
                bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp: Any):
        """Release the weight lock: a round may apply its update until the next forward."""

        def hook(optimizer: torch.optim.Optimizer) -> None:
            self._release()

        return hook

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._op.unlock_weight()

    # ---------------------------------------------------------------- control
    def abort(self, bagua_ddp: Any) -> None:
        """Stop the background rounds (collective: every rank calls it).

        Rounds go on until every rank has called ``abort``, then stop at the same round on
        all ranks. Safe to call again; :meth:`resume` starts the rounds anew.

        Raises:
            RuntimeError: a round failed (its error is the cause).
        """
        _engine(bagua_ddp)
        if self.status in (_AsyncInternalState.SCHEDULED, _AsyncInternalState.STARTED):
            barrier(comm=self.process_group.get_global_communicator())
            self._op.abort()
            self._release()  # a round may be waiting for the lock
            assert self._loop is not None
            self._loop.wake()
            self._loop.join()
            self.status = _AsyncInternalState.STOPPED
            self._raise_loop_error()

    def resume(self, bagua_ddp: Any) -> None:
        """Start the background rounds again after :meth:`abort` (collective)."""
        _engine(bagua_ddp)
        if (
            self.status in (_AsyncInternalState.NEW, _AsyncInternalState.STOPPED)
            and self._op is not None
        ):
            barrier(comm=self.process_group.get_global_communicator())
            self._start()


class AsyncModelAverageAlgorithm(Algorithm):
    """Asynchronous model averaging on a background thread.

    Args:
        peer_selection_mode (str): ``"all"`` (average over all ranks) or, beyond Bagua,
            ``"shift_one"`` (one rotating peer per round, any number of ranks) or
            ``"moshpit"`` (a Moshpit grid line per round, one dimension after another).
        sync_interval_ms (int): pause between rounds, in milliseconds (0: no rounds).
        warmup_steps (int): synchronous gradient allreduce for this many steps first.
    """

    def __init__(
        self, peer_selection_mode: str = "all", sync_interval_ms: int = 500, warmup_steps: int = 0
    ) -> None:
        _check(peer_selection_mode, sync_interval_ms, warmup_steps)
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps

    def reify(self, process_group: BaguaProcessGroup) -> AsyncModelAverageAlgorithmImpl:
        """The implementation for ``process_group`` (creates its gloo group: collective)."""
        return AsyncModelAverageAlgorithmImpl(
            process_group, self.peer_selection_mode, self.sync_interval_ms, self.warmup_steps
        )
