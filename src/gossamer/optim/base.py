"""The base of every decentralized optimizer: wrap a torch optimizer, add communication.

An optimizer here owns no update rule. It holds the user's ``torch.optim`` optimizer, the
model's trainable parameters packed into fusion buckets, and a :class:`Communicator` that
says what one communication round does (which operation, which weights). Subclasses decide
*when* to communicate relative to ``optimizer.step()``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from gossamer import context
from gossamer.communicators import COMMUNICATIONS, Communicator, Pending, make
from gossamer.compression import Compressor
from gossamer.fusion import Bucket, bucketize
from gossamer.optim.agreement import agreed
from gossamer.profiling import timeline
from gossamer.topology import Step, Topology

__all__ = ["COMMUNICATIONS", "Communicator", "DecentralizedOptimizer", "evaluate"]

DEFAULT_FUSION_BYTES = 8 * 2**20
TIMELINE_ROW = "optimizer"  # the timeline row of the optimizers' own spans


# the optimizers not closed yet (their hooks and buckets drive their parameters)
_LIVE: weakref.WeakSet = weakref.WeakSet()


def live_optimizers(params: Sequence[torch.Tensor]) -> list[DecentralizedOptimizer]:
    """The optimizers, not closed yet, that drive any of ``params`` (their hooks are on)."""
    mine = set(params)
    return [o for o in _LIVE if not mine.isdisjoint(o.params)]


def _models(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    try:
        models = [model] if isinstance(model, nn.Module) else list(model)
    except TypeError:  # not iterable
        models = []
    if not models or not all(isinstance(m, nn.Module) for m in models):
        raise TypeError(f"model must be an nn.Module or a list of them; got {model!r}")
    return models


class DecentralizedOptimizer(torch.optim.Optimizer):
    """Common machinery: parameters, buckets, the communicator, counters, state.

    It is a ``torch.optim.Optimizer`` to the code that checks (learning-rate schedulers
    refuse anything else), without being one itself: ``param_groups``, ``state`` and
    ``defaults`` are the wrapped optimizer's, and its update is the wrapped ``step()``.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer whose ``step()`` does the update.
        model (nn.Module | Sequence[nn.Module]): the model(s) owning the optimizer's parameters.
        communicator (Communicator, optional): what a communication round does; default:
            built from the four options below by :func:`gossamer.communicators.make`.
        communication (str): a name of :data:`COMMUNICATIONS` (default
            ``"neighbor_allreduce"``); topology, schedule, global_average_every: its options.
        compression (str | Compressor, optional): compress what travels: neighbour
            averaging becomes CHOCO-gossip, ``allreduce`` a compressed allreduce (see
            :func:`gossamer.communicators.make`); error_feedback: for the latter.
        elastic (bool): train on when neighbours die: rounds complete with the survivors
            and later rounds leave the dead out (neighbour averaging, plain or CHOCO; see
            :class:`gossamer.communicators.NeighborAllreduce` and docs/fault-tolerance.md).
            Default False: a dead rank makes every survivor raise ``RankLostError``.
        num_steps_per_communication (int): communicate once every this many steps.
        fusion_threshold_bytes (int | None): bucket size; ``None`` or 0 sends every tensor
            on its own.
    """

    #: whether the parameters move into the buckets (:meth:`gossamer.fusion.Bucket.adopt`):
    #: each parameter's ``.data`` becomes a view of its bucket's flat buffer, so a round
    #: reads them without a copy and writes its result into them in place
    params_in_buckets = False

    #: ``torch.amp.GradScaler`` hands the step its scale and whether it found an inf
    #: (``grad_scale``, ``found_inf``) instead of skipping ``step()``: a rank that skipped
    #: its step would skip its round too, and pair its rounds with its peers' next ones
    _step_supports_amp_scaling = True
    _in_step = False  # a step() is running (a subclass's step calls its base's)
    _skip_update = False  # the loss scaler found an inf: communicate, but do not update

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Sequence[nn.Module],
        *,
        communicator: Communicator | None = None,
        communication: str | None = None,
        topology: Topology | None = None,
        schedule: Iterator[Step] | None = None,
        global_average_every: int | None = None,
        compression: str | Compressor | None = None,
        error_feedback: bool | None = None,
        elastic: bool = False,
        num_steps_per_communication: int = 1,
        fusion_threshold_bytes: int | None = DEFAULT_FUSION_BYTES,
    ) -> None:
        check_torch_optimizer(optimizer)
        if (
            isinstance(num_steps_per_communication, bool)
            or not isinstance(num_steps_per_communication, int)
            or num_steps_per_communication < 1
        ):
            raise ValueError(
                "num_steps_per_communication must be an int >= 1; got "
                f"{num_steps_per_communication!r}"
            )
        if fusion_threshold_bytes is not None and (
            isinstance(fusion_threshold_bytes, bool)
            or not isinstance(fusion_threshold_bytes, int)
            or fusion_threshold_bytes < 0
        ):
            # Checked here, not only by bucketize, so that the message names this argument.
            raise ValueError(
                "fusion_threshold_bytes must be an int >= 0 or None; got "
                f"{fusion_threshold_bytes!r}"
            )
        context.rank()  # NotInitializedError before gossamer.init()
        self.optimizer = optimizer
        self.models = _models(model)
        names = {p: n for m in self.models for n, p in m.named_parameters()}
        every = [p for g in optimizer.param_groups for p in g["params"]]
        params = [p for p in every if p.requires_grad]
        # Neither stepped nor averaged: training them later needs a new optimizer.
        self._frozen = {p: names.get(p, "?") for p in every if not p.requires_grad}
        self._param_count = len(every)
        strangers = [tuple(p.shape) for p in params if p not in names]
        if strangers:
            raise ValueError(
                f"the optimizer has parameters that are not in the model (shapes {strangers})"
            )
        lazy = [names[p] for p in params if isinstance(p, nn.parameter.UninitializedParameter)]
        if lazy:
            raise ValueError(
                f"parameters {lazy} of the model are not initialized yet (lazy modules such "
                "as nn.LazyLinear): run one forward pass before building the optimizer"
            )
        self.param_names = {p: names[p] for p in params}
        # Where the model holds each parameter: a module attribute given a new Parameter
        # after building would no longer be stepped or averaged (see _check_usable).
        self._slots = [
            (module._parameters, key, p, names[p])
            for m in self.models
            for module in m.modules()
            for key, p in module._parameters.items()
            if p in self.param_names
        ]
        # Reverse registration order approximates the order gradients become ready.
        self.params = list(reversed(params))
        self.buckets: list[Bucket] = bucketize(self.params, fusion_threshold_bytes)
        if not isinstance(elastic, bool):
            raise TypeError(f"elastic must be a bool; got {elastic!r}")
        options = {
            "communication": communication,
            "topology": topology,
            "schedule": schedule,
            "global_average_every": global_average_every,
            "compression": compression,
            "error_feedback": error_feedback,
            # None unless asked for, so that communicator= with elastic=True is a clash
            "elastic": elastic or None,
        }
        self.communicator = _communicator(communicator, options)
        self._hooks: list = []
        self._closed = False
        self._take_over()
        if self.params_in_buckets:
            if getattr(self.communicator, "in_place", False):
                raise ValueError(
                    f"communicator={type(self.communicator).__name__}(in_place=True) writes "
                    f"into its input while the round is in flight; {type(self).__name__} "
                    "keeps the parameters in its buckets, which forward and backward read "
                    "meanwhile: give it a communicator without in_place"
                )
            # Parameters over one memory (tied weights) stay there, or they would untie.
            uses = collections.Counter(p.untyped_storage().data_ptr() for p in self.params)
            shared = {ptr for ptr, count in uses.items() if count > 1}
            for bucket in self.buckets:
                bucket.adopt(skip=shared)
        try:
            self.communicator.bind(self.buckets)
        except BaseException:
            _LIVE.discard(self)  # a failed build leaves nothing that a new optimizer closes
            raise
        self.num_steps_per_communication = num_steps_per_communication
        self.steps = 0
        # (bucket, handle, finish): finish maps the operation's result to the new values.
        self._pending: list[tuple[Bucket, Pending | None, Callable | None]] = []
        self._warned = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:
            cls.step = _checked(cls.__dict__["step"])
        if "__init__" in cls.__dict__:
            cls.__init__ = agreed(close=True)(cls.__dict__["__init__"])

    def settings(self) -> dict[str, object]:
        """The settings every rank must build this optimizer with (checked when built).

        Subclasses add theirs. Compression is checked at the first round instead, where
        its error names the codecs.
        """
        return {"num_steps_per_communication": self.num_steps_per_communication}

    # -------------------------------------------------------------- torch.optim look-alike
    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's parameter groups (learning-rate schedulers use these)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        """The wrapped optimizer's default hyper-parameters."""
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (as ``torch.optim.Optimizer.zero_grad``)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Refused: the buckets and the communication are fixed when the optimizer is built."""
        raise RuntimeError(
            f"{type(self).__name__} cannot take a parameter group after it was built; build "
            "the torch optimizer with every group, then this one over it"
        )

    def _hook_refused(self, *args: object, **kwargs: object) -> None:
        """Refused: an update here is several ``step()`` calls of the wrapped optimizer."""
        raise RuntimeError(
            f"{type(self).__name__} takes no optimizer hooks; register them on the torch "
            "optimizer it wraps (.optimizer), knowing that ATC-style optimizers step it "
            "once per bucket"
        )

    register_step_pre_hook = register_step_post_hook = _hook_refused
    register_state_dict_pre_hook = register_state_dict_post_hook = _hook_refused
    register_load_state_dict_pre_hook = register_load_state_dict_post_hook = _hook_refused

    @property
    def step_in_progress(self) -> bool:
        """Whether a step's communication has started and :meth:`step` has not ended it.

        True from the forward pass (or backward pass) that starts a step's communication
        until ``step()`` returns. A state saved then is not a point to resume from:
        :func:`gossamer.checkpoint.save` refuses it.
        """
        return False

    def state_dict(self) -> dict:
        """Everything the next steps depend on besides the parameters.

        ``{"optimizer": <the wrapped optimizer's state dict>, "communication": {"algorithm",
        "steps", "compression_config", **communicator.state_dict(), ...}}``: the algorithm's
        class name, step counter, the compression (compressor, error feedback), round
        counter, schedule position, generator state, window slots and push-sum weights,
        exact diffusion's previous local step. Communication in flight is
        finished first, so take the model's state after this one.
        """
        self.synchronize()
        return {"optimizer": self.optimizer.state_dict(), "communication": self._comm_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: ``state`` is not such a dict, it was saved by another algorithm
                (another ``gossamer.optim`` class; the BlueFog facade's classes count as the
                class they wrap) or with another compression (compressor, error feedback),
                or its communication state has keys this optimizer does not know (another
                communicator or pattern).
        """
        if not isinstance(state, dict) or {"optimizer", "communication"} - set(state):
            raise ValueError("state must be a dict from DecentralizedOptimizer.state_dict()")
        # A combine still in flight would overwrite what is loaded when it lands.
        self.synchronize()
        saved, mine = state["communication"].get("algorithm"), self._algorithm()
        if saved is not None and saved != mine:  # states saved by earlier versions carry no name
            raise ValueError(
                f"state was saved by {saved}; this optimizer runs {mine} ({type(self).__name__})"
            )
        saved = state["communication"].get("compression_config")
        mine = self.communicator.compression_config()
        if saved is not None and saved != mine:  # not saved by earlier versions
            raise ValueError(
                f"state was saved with {saved}; this {type(self).__name__} runs {mine}"
            )
        unknown = sorted(set(state["communication"]) - set(self._comm_state()))
        if unknown:
            raise ValueError(
                f"state['communication'] has keys {unknown} that {type(self).__name__} over "
                f"{type(self.communicator).__name__} does not save: was it saved from another "
                "optimizer or communicator?"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_comm_state(state["communication"])

    def _comm_state(self) -> dict:
        return {
            "algorithm": self._algorithm(),
            "steps": self.steps,
            "compression_config": self.communicator.compression_config(),
            **self.communicator.state_dict(),
        }

    def _algorithm(self) -> str:
        """The gossamer.optim class this optimizer runs (a facade's own class is a wrapper)."""
        for cls in type(self).__mro__:
            if cls.__module__.startswith("gossamer.optim."):
                return cls.__name__
        return type(self).__name__

    def _load_comm_state(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.communicator.load_state_dict(state)

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Finish the communication in flight, remove the hooks, release the communicator.

        The communicator's release is collective for window patterns. The wrapped optimizer
        stays usable on its own.
        """
        self.synchronize()
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()
        self._closed = True
        _LIVE.discard(self)
        self.communicator.close()

    def _take_over(self) -> None:
        """Close the optimizers still driving these parameters: their hooks would fire too."""
        for old in live_optimizers(self.params):
            warnings.warn(
                f"{old!r} still drove parameters of this model; it is closed now (call "
                "close() before building another optimizer on the same parameters)",
                stacklevel=4,
            )
            old.close()
        _LIVE.add(self)

    def _check_usable(self) -> None:
        """Raise if this optimizer was closed or its parameters changed since it was built."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} was closed; build a new optimizer")
        thawed = [name for p, name in self._frozen.items() if p.requires_grad]
        if thawed:
            raise RuntimeError(
                f"parameters {thawed} had requires_grad=False when {type(self).__name__} was "
                "built, so it neither steps nor averages them: build the optimizer after "
                "unfreezing them (close() this one first)"
            )
        replaced = [name for slots, key, p, name in self._slots if slots.get(key) is not p]
        if replaced:
            raise RuntimeError(
                f"parameters {replaced} of the model are not the ones "
                f"{type(self).__name__} was built over (a new nn.Parameter or module "
                "assigned, or load_state_dict(assign=True), after building?), so it "
                "would neither step nor average them: build the optimizer after replacing "
                "them (close() this one first)"
            )
        changed = [
            f"{self.param_names.get(p, '?')} ({b.flat.dtype} -> {p.dtype})"
            for b in self.buckets
            for p in b.tensors
            if p.dtype != b.flat.dtype
        ]
        if changed:
            raise RuntimeError(
                f"parameters changed dtype since {type(self).__name__} was built: "
                f"{', '.join(changed)} (model.to(dtype) after building?); its buckets keep "
                "the old dtype: build the optimizer after converting the model"
            )
        count = sum(len(g["params"]) for g in self.optimizer.param_groups)
        if count != self._param_count:
            raise RuntimeError(
                f"the wrapped optimizer has {count} parameters, {self._param_count} when "
                f"{type(self).__name__} was built (add_param_group?): build a new one over "
                "all of them (close() this one first)"
            )

    def __enter__(self) -> DecentralizedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- communication
    def _is_round(self) -> bool:
        """Whether the step now under way ends with communication."""
        return (self.steps + 1) % self.num_steps_per_communication == 0

    def _start_rounds(self) -> None:
        self.communicator.next_round()
        for index, bucket in enumerate(self.buckets):
            # The packing buffer is refilled before every round: the result may go into it.
            handle = self.communicator.start(bucket.pack(), index, in_place=True)
            self._pending.append((bucket, handle, None))

    def synchronize(self) -> None:
        """Wait for the communication in flight and write its results into the parameters."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        with timeline.activity(TIMELINE_ROW, "waiting for combine"):
            for bucket, handle, finish in pending:
                if handle is not None:
                    result = handle.wait()
                    bucket.unpack(result if finish is None else finish(result), lambda p: p.data)

    def _take_loss_scale(self) -> None:
        """Follow a loss scaler's request (see :func:`take_loss_scale`), once per step."""
        if getattr(self, "found_inf", None) is not None:
            self._check_loss_scaler()
        self._skip_update = take_loss_scale(self, self.params)

    def _check_loss_scaler(self) -> None:
        """Raise if this optimizer cannot follow a loss scaler (subclasses refine)."""

    def _update(self, closure=None):
        """The wrapped optimizer's step, unless the loss scaler found an inf."""
        return None if self._skip_update else self.optimizer.step(closure)

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"Unexpected behavior: {message}", stacklevel=3)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self.optimizer).__name__}, "
            f"{self.communicator.name}, {len(self.buckets)} buckets)"
        )


def check_torch_optimizer(optimizer: object) -> None:
    """Raise unless ``optimizer`` is a torch optimizer that is not a gossamer one."""
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(
        optimizer, DecentralizedOptimizer
    ):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (not a gossamer one); got {optimizer!r}"
        )


def take_loss_scale(optimizer: object, params: Sequence[torch.Tensor]) -> bool:
    r"""Unscale ``params``' gradients as a loss scaler asks; whether to skip the update.

    ``torch.amp.GradScaler.step(opt)``, for an ``opt`` that declares
    ``_step_supports_amp_scaling``, sets ``opt.found_inf`` (nonzero when this rank's
    gradients hold an inf or a NaN) and ``opt.grad_scale`` :math:`s` (None after
    ``scaler.unscale_(opt)``) and calls ``opt.step()`` instead of skipping it. The gradients
    become :math:`g / s`, multiplied by the float32 :math:`1/s` as the scaler does; with an
    inf the update is skipped while the round still runs (:math:`x^+ = W x`), so that every
    rank keeps taking part in every round. Without a scaler: nothing, False.
    """
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return False
    scale = getattr(optimizer, "grad_scale", None)
    if scale is not None:
        inverse = scale.double().reciprocal().float()
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inverse.to(p.grad.device))
    return bool(found_inf.item())


def evaluate(closure: Callable[[], object] | None) -> object:
    """``closure()`` with gradients enabled, as torch's optimizers call it (None: None).

    The optimizers evaluate a ``step(closure)``'s closure *before* their step, once: its
    forward and backward passes then start the step's communication exactly as a forward
    and backward before ``step()`` would, and the wrapped optimizer steps without it. So
    optimizers that evaluate the closure several times (LBFGS) need their forward and
    backward before ``step()`` instead.
    """
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _checked(step: Callable) -> Callable:
    """``step`` after ``_check_usable`` and, once per step, ``_take_loss_scale``."""

    @functools.wraps(step)
    def checked(self: DecentralizedOptimizer, *args: object, **kwargs: object) -> object:
        self._check_usable()
        if self._in_step:
            return step(self, *args, **kwargs)
        self._in_step = True
        try:
            self._take_loss_scale()
            return step(self, *args, **kwargs)
        finally:
            self._in_step = self._skip_update = False

    return checked


def _communicator(communicator: object, options: dict) -> Communicator:
    if communicator is None:
        # Only None means the default: "" is an unknown name, not a request for it.
        name = options.pop("communication")
        options["elastic"] = bool(options["elastic"])  # None: not asked for
        return make("neighbor_allreduce" if name is None else name, **options)
    if not isinstance(communicator, Communicator):
        raise TypeError(
            f"communicator must be a gossamer.communicators.Communicator; got {communicator!r}"
        )
    clash = [name for name, value in options.items() if value is not None]
    if clash:
        raise ValueError(
            f"give either communicator= or {', '.join(clash)}, not both: {clash[0]} is an "
            "option of the communicator"
        )
    return communicator


class NoSync:
    """``no_sync()`` for optimizers that communicate from the backward pass (as DDP's)."""

    _no_sync = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients locally, without communication."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous


# Subclasses that define no __init__ of their own are built by this one.
DecentralizedOptimizer.__init__ = agreed(close=True)(DecentralizedOptimizer.__init__)  # type: ignore[method-assign]
