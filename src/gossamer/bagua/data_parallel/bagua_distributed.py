"""The engine behind ``with_bagua``: hooks that drive an algorithm's operations.

:class:`BaguaDistributedDataParallel` follows Bagua's: forward pre-hooks on the module count
training steps, re-initialize the algorithm when it asks (``need_reset``) and run the
algorithm's forward pre-hook; a gradient hook per parameter runs its backward hook; a
callback at the end of the backward pass runs its post-backward hook; a step hook on each
optimizer runs its post-step hook. Marking a tensor ready hands its bucket, once complete,
to gossamer's communication thread; buckets start in order, so every rank issues its
collectives in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gossamer import checkpoint, ops, transport
from gossamer.bagua import env
from gossamer.bagua._collectives import rejecting
from gossamer.bagua._groups import BaguaProcessGroup, resolve
from gossamer.bagua._state import state
from gossamer.bagua.bucket import BaguaBucket
from gossamer.bagua.communication import broadcast, broadcast_object
from gossamer.errors import PeerArgumentError
from gossamer.optim import DecentralizedOptimizer
from gossamer.optim.agreement import agree

__all__ = ["BaguaDistributedDataParallel"]

logger = logging.getLogger(__name__)


class _Backend:
    """Starts complete buckets, in order, as jobs of gossamer's communication thread.

    A bucket's operation list is one job: it is queued in program order with every other
    gossamer operation of the process (so collectives pair up across ranks even when the
    forward pass itself communicates), and the operations inside it run in place.
    """

    def __init__(self) -> None:
        self.buckets: list[BaguaBucket] = []
        self._next = 0
        self._pending: list[transport.Handle] = []

    def register_ordered_buckets(self, buckets: list[BaguaBucket]) -> None:
        """Use ``buckets`` from now on, in this order."""
        self.wait_pending_comm_ops()
        self.buckets = list(buckets)
        self._next = 0

    def mark_communication_ready(self, tensor: torch.Tensor) -> None:
        """Mark ``tensor`` ready and start every bucket, in order, that is complete."""
        bucket = getattr(tensor, "_bagua_bucket", None)
        if bucket is None or not any(bucket is b for b in self.buckets):
            raise RuntimeError(
                f"tensor {getattr(tensor, 'bagua_tensor_name', '')!r} is in none of the "
                "model's buckets"
            )
        bucket.mark_ready(tensor)
        while self._next < len(self.buckets) and self.buckets[self._next].all_ready():
            ready = self.buckets[self._next]
            ready.reset_ready()
            if ready.runs_inline():  # it only posts: no job queued behind earlier waits
                ready.execute()
            else:
                self._pending.append(transport.submit(f"bagua_bucket_{ready.name}", ready.execute))
            self._next += 1
        if self._next == len(self.buckets):
            self._next = 0  # every bucket started: the next marks begin a new round

    def wait_pending_comm_ops(self) -> None:
        """Wait for every started bucket's operations (re-raising their errors)."""
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()


def _check_optimizers(optimizers: object) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    if not isinstance(optimizers, list | tuple) or not all(
        isinstance(o, torch.optim.Optimizer) and not isinstance(o, DecentralizedOptimizer)
        for o in optimizers
    ):
        raise TypeError(
            "optimizers must be a list of torch.optim.Optimizer (not gossamer ones, which "
            f"communicate themselves); got {optimizers!r}"
        )
    return list(optimizers)


def _agree(process_group: object, checks: Callable[[], None], caller: str = "with_bagua") -> None:
    """Run the wrap's argument ``checks``, then meet the group's ranks (a barrier).

    A rank whose checks raise ``TypeError``/``ValueError`` takes part in that barrier with
    its reason (:func:`~gossamer.bagua._collectives.rejecting`), so every other rank raises
    ``PeerArgumentError`` naming it, instead of waiting in the wrap's first collective.
    A bad ``process_group`` itself cannot be met on: that rank raises alone.

    Raises:
        PeerArgumentError: on the other ranks, prefixed ``caller:``.
    """
    if not isinstance(process_group, BaguaProcessGroup):
        checks()
        raise TypeError(f"process_group must be a BaguaProcessGroup; got {process_group!r}")
    comm = resolve(process_group.get_global_communicator())
    if comm is None:  # not a member: the group's collectives skip this rank
        checks()
        return
    with rejecting("barrier", comm.group):
        checks()
    try:
        ops.barrier(group=comm.group)
    except PeerArgumentError as err:
        raise PeerArgumentError(f"{caller}: {err}", err.ranks) from err


def _same_algorithm(algorithm: Any, process_group: BaguaProcessGroup, caller: str) -> None:
    """Raise on every rank of the group when ranks wrap with other algorithms or settings.

    The settings are a built-in algorithm's plain attributes (numbers, strings, flags):
    ranks that differ there would run other collectives, or the same ones on other tensors.
    Of an algorithm of the user's own, only the class is compared (its attributes may be
    per rank).
    """
    comm = resolve(process_group.get_global_communicator())
    if comm is None:
        return
    plain = (bool, int, float, str, type(None))
    ours = type(algorithm).__module__.startswith("gossamer.bagua.algorithms")
    fields = sorted((k, v) for k, v in vars(algorithm).items() if ours and isinstance(v, plain))
    agree(caller, {"algorithm": type(algorithm).__name__, **dict(fields)}, group=comm.group)


class BaguaDistributedDataParallel:
    """Bagua's engine for one module, one algorithm and its optimizers.

    Args:
        module (nn.Module): the model (its parameters are broadcast from rank 0 here).
        optimizers (list[torch.optim.Optimizer]): the optimizers stepping its parameters.
        algorithm (Algorithm): what to communicate; reified for ``process_group``.
        process_group (BaguaProcessGroup): the ranks taking part.
        bagua_module_name (str, optional): the module's name (how tensors find it).
        gradient_as_bucket_view (bool): Bagua's ``do_flatten``: the communicated tensors
            become slices of their bucket's flat buffer (no packing copy).
        find_unused_parameters (bool): accepted; parameters without a gradient in a step
            are always communicated as zeros at the end of the backward pass.
        extra_checks (Callable[[], None], optional): the caller's own argument checks
            (raising ``TypeError``/``ValueError``), run with the engine's before the one
            meeting of the group's ranks, so that peers of a rejecting rank fail fast too.
        caller (str): the name that prefixes the peers' ``PeerArgumentError``.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        algorithm: Any,
        process_group: BaguaProcessGroup,
        bagua_module_name: str | None = None,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        *,
        extra_checks: Callable[[], None] | None = None,
        caller: str = "with_bagua",
    ) -> None:
        from gossamer.bagua.algorithms.base import Algorithm

        def checks() -> None:
            if not isinstance(module, nn.Module):
                raise TypeError(f"module must be a torch.nn.Module; got {module!r}")
            if not isinstance(algorithm, Algorithm):
                raise TypeError(
                    f"algorithm must be a gossamer.bagua.algorithms.Algorithm; got {algorithm!r}"
                )
            _check_optimizers(optimizers)
            algorithm.check_optimizers(optimizers)
            if not isinstance(gradient_as_bucket_view, bool):
                name = "do_flatten" if caller == "with_bagua" else "gradient_as_bucket_view"
                raise TypeError(f"{name} must be a bool; got {gradient_as_bucket_view!r}")
            if not any(p.requires_grad for p in module.parameters()):
                raise ValueError(
                    f"{caller} is not needed when a module has no parameter that requires a "
                    "gradient"
                )
            if extra_checks is not None:
                extra_checks()

        # Every rank's arguments are checked before the first collective of the wrap.
        _agree(process_group, checks, caller)
        _same_algorithm(algorithm, process_group, caller)
        self.module = module
        self.bagua_module_name = bagua_module_name or f"{type(module).__name__}_{id(module)}"
        self.bagua_optimizers = _check_optimizers(optimizers)
        self.process_group = process_group
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.parameters_to_ignore: list[str] = []
        for attr in ("_bagua_params_and_buffers_to_ignore", "_ddp_params_and_buffers_to_ignore"):
            self.parameters_to_ignore.extend(getattr(module, attr, []))
        self.bagua_train_step_counter = 0
        self.bagua_buckets: list[BaguaBucket] = []
        self.require_backward_grad_sync = True
        self._bagua_backend = _Backend()
        self._callback_queued = False
        self._seen: set[str] = set()  # parameters whose gradient arrived this backward
        self._reset_pending = False  # asked for by an evaluation forward: the next training one
        self._saved_buckets: list[list[dict]] | None = None  # loaded, waiting for a rebuild
        self._unstepped: set[int] = set()  # optimizers (by index) not stepped since backward
        previous = module.__dict__.get("_bagua_engine")
        if previous is not None:  # wrapped again: the previous engine lets go of the module
            previous.detach()
        self.bagua_algorithm = algorithm.reify(process_group)
        state().models[self.bagua_module_name] = self
        # Eager under torch.compile: the hooks drive communication, not tensor math.
        self._framework_hooks = [
            module.register_forward_pre_hook(torch.compiler.disable(hook))
            for hook in (self._count_step, self._maybe_reset, self._algorithm_forward_pre_hook)
        ]
        self._autograd_hooks: list[Any] = []
        self._optimizer_hooks: list[Any] = []
        module.__dict__["_bagua_engine"] = self
        checkpoint.attach(module, "bagua", self)  # the step counter and replicas resume too
        self._bagua_init_algorithm()

    # ------------------------------------------------------------------ parameters
    def bagua_build_params(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of the parameters to communicate, in registration order.

        Those that require a gradient and are not ignored, without duplicates.
        """
        seen: set[int] = set()
        params = []
        for mod_name, mod in self.module.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                if p.requires_grad and name not in self.parameters_to_ignore and id(p) not in seen:
                    seen.add(id(p))
                    params.append((name, p))
        return params

    def _bagua_broadcast_parameters(self) -> None:
        """Rank 0's parameters (frozen ones too, as torch DDP), buffers and optimizer state."""
        comm = self.process_group.get_global_communicator()
        for name, param in self.module.named_parameters():
            if name not in self.parameters_to_ignore:
                broadcast(param.data, src=0, comm=comm)
        for name, buf in self.module.named_buffers():
            if name not in self.parameters_to_ignore:
                broadcast(buf, src=0, comm=comm)
        for optimizer in self.bagua_optimizers:
            theirs = broadcast_object(optimizer.state_dict(), src=0, comm=comm)
            if env.get_rank() != self.process_group.ranks[0]:
                optimizer.load_state_dict(theirs)

    # ------------------------------------------------------------------ algorithm
    def _split(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Consecutive tensors of one dtype and device, up to the default bucket size."""
        limit = env.get_default_bucket_size()
        groups: dict[tuple, list[list[torch.Tensor]]] = {}
        for t in tensors:
            eff = t.bagua_getter_closure()
            eff = t if eff is None else eff
            runs = groups.setdefault((eff.dtype, eff.device), [[]])
            size = sum(x.numel() * x.element_size() for x in runs[-1])
            if runs[-1] and size + eff.numel() * eff.element_size() > limit:
                runs.append([])
            runs[-1].append(t)
        return [run for runs in groups.values() for run in runs]

    def _bagua_init_algorithm(self) -> None:
        self._bagua_backend.wait_pending_comm_ops()
        self._bagua_broadcast_parameters()
        self._bagua_tensors = self.bagua_algorithm.init_tensors(self)
        self._reset_buckets()
        self._register_autograd_hooks()
        self._register_optimizer_hooks()

    def _reset_buckets(self) -> None:
        for t in self._bagua_tensors:
            t._bagua_bucket = None
        self.bagua_buckets = self.bagua_algorithm.tensors_to_buckets(
            self._split(self._bagua_tensors), self.gradient_as_bucket_view
        )
        for bucket in self.bagua_buckets:
            self.bagua_algorithm.init_operations(self, bucket)
        self._bagua_backend.register_ordered_buckets(self.bagua_buckets)
        self._load_buckets()

    # ------------------------------------------------------------------ hooks
    def _count_step(self, module: nn.Module, inputs: Any) -> None:
        self._finish_skipped_steps()
        self._callback_queued = False
        self._seen.clear()
        if module.training:
            self.bagua_train_step_counter += 1

    def _maybe_reset(self, module: nn.Module, inputs: Any) -> None:
        # need_reset() runs on every forward (algorithms count calls), as in Bagua; a reset
        # asked for in an evaluation forward waits for the next training one (Bagua drops it,
        # and its asynchronous averaging then never starts).
        self._reset_pending |= self.bagua_algorithm.need_reset()
        if self._reset_pending and module.training:
            self._reset_pending = False
            self._bagua_init_algorithm()

    def _algorithm_forward_pre_hook(self, module: nn.Module, inputs: Any) -> None:
        if module.training:
            self.bagua_algorithm.init_forward_pre_hook(self)(inputs)

    def _register_autograd_hooks(self) -> None:
        for handle in self._autograd_hooks:
            handle.remove()
        self._autograd_hooks = [
            param.register_post_accumulate_grad_hook(self._grad_hook(name))
            for name, param in self.module.named_parameters()
            if param.requires_grad
        ]

    def _grad_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if not self.require_backward_grad_sync:
                return
            self._seen.add(name)
            self.bagua_algorithm.init_backward_hook(self)(name, param)
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)

        return hook

    def _post_backward(self) -> None:
        # Parameters that got no gradient this pass are handed over now, so their buckets
        # still complete (Bagua needs find_unused_parameters=True for this).
        hook = self.bagua_algorithm.init_backward_hook(self)
        for name, param in self.bagua_build_params():
            if name not in self._seen:
                hook(name, param)
        self._seen.clear()
        self.bagua_algorithm.init_post_backward_hook(self)()
        self._unstepped = set(range(len(self.bagua_optimizers)))

    def _register_optimizer_hooks(self) -> None:
        for handle in self._optimizer_hooks:
            handle.remove()
        self._post_step = self.bagua_algorithm.init_post_optimizer_step_hook(self)

        def stepped(index: int, opt: torch.optim.Optimizer) -> None:
            self._unstepped.discard(index)
            self._post_step(opt)

        self._optimizer_hooks = [
            opt.register_step_post_hook(lambda opt, args, kwargs, index=index: stepped(index, opt))
            for index, opt in enumerate(self.bagua_optimizers)
        ]

    def _finish_skipped_steps(self) -> None:
        """Run the post-step hook of an optimizer whose step was skipped.

        A loss scaler (``torch.amp.GradScaler``) skips ``optimizer.step()`` on a rank whose
        gradients overflowed, and so its post-step hook: the low-precision ring would then
        pair this rank's round with its peers' next one. An optimizer not stepped since the
        last backward pass whose gradients were cleared since (``zero_grad()``) skipped its
        step, rather than accumulating gradients: its round runs now, on the weights
        as they are, as it would have after an update of zero.
        """
        for index in sorted(self._unstepped):
            opt = self.bagua_optimizers[index]
            params = [p for group in opt.param_groups for p in group["params"]]
            if all(p.grad is None or not p.grad.any() for p in params):
                self._unstepped.discard(index)
                self._post_step(opt)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        r"""What exact resume needs beyond the module's and optimizers' states.

        The train step counter (it decides the communication steps) and each bucket's
        communication state (the round that picks ``shift_one``'s peer, the low-precision
        replicas :math:`\hat w, \hat x_l, \hat x_r`). :func:`with_bagua` attaches it to the
        module for :mod:`gossamer.checkpoint`.
        """
        self._bagua_backend.wait_pending_comm_ops()
        buckets = [bucket.state_dict() for bucket in self.bagua_buckets]
        return {
            "algorithm": self._algorithm_name(),
            "step": self.bagua_train_step_counter,
            "buckets": buckets,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (same algorithm and buckets).

        Raises:
            ValueError: ``state`` is not from :meth:`state_dict`, or from another algorithm
                (or peer selection mode), or has other buckets.
        """
        if not isinstance(state, dict) or {"algorithm", "step", "buckets"} - set(state):
            raise ValueError("state must be a dict from BaguaDistributedDataParallel.state_dict()")
        if state["algorithm"] != self._algorithm_name():
            raise ValueError(
                f"state was saved by {state['algorithm']}; this module runs "
                f"{self._algorithm_name()}"
            )
        if len(state["buckets"]) != len(self.bagua_buckets):
            raise ValueError(
                f"state holds {len(state['buckets'])} buckets; this module has "
                f"{len(self.bagua_buckets)}"
            )
        self._bagua_backend.wait_pending_comm_ops()
        self.bagua_train_step_counter = int(state["step"])
        self._saved_buckets = state["buckets"]
        self._load_buckets()

    def rebind(self) -> None:
        """Start the buckets' communication state anew from the module's weights.

        :func:`gossamer.checkpoint.load` calls it after a resized load (the average of
        another number of ranks), where no saved rank's replicas fit.
        """
        self._bagua_backend.wait_pending_comm_ops()
        self._reset_buckets()

    def _algorithm_name(self) -> str:
        mode = getattr(self.bagua_algorithm, "peer_selection_mode", None)
        name = type(self.bagua_algorithm).__name__
        return name if mode is None else f"{name}(peer_selection_mode={mode!r})"

    def _load_buckets(self) -> None:
        """Load the saved bucket states once the buckets have the saved operations.

        An algorithm that rebuilds its buckets at a later step (QAdam after its warm-up)
        gets them at that rebuild.
        """
        saved = self._saved_buckets
        if saved is None or [len(s) for s in saved] != [len(b._ops) for b in self.bagua_buckets]:
            return
        for bucket, ours in zip(self.bagua_buckets, saved, strict=True):
            bucket.load_state_dict(ours)
        self._saved_buckets = None

    def detach(self) -> None:
        """Wait for pending operations and remove every hook this engine installed."""
        self._bagua_backend.wait_pending_comm_ops()
        for handle in [*self._framework_hooks, *self._autograd_hooks, *self._optimizer_hooks]:
            handle.remove()
        self._framework_hooks, self._autograd_hooks, self._optimizer_hooks = [], [], []

    def __repr__(self) -> str:
        return (
            f"BaguaDistributedDataParallel({self.bagua_module_name!r}, "
            f"{type(self.bagua_algorithm).__name__}, {len(self.bagua_buckets)} buckets)"
        )
