r"""QAdam: Adam whose first moment is averaged in 8 bits after a warm-up.

With step :math:`t`, gradient :math:`g`, :math:`\hat\beta_k = 1 - \beta_k^t`:

- warm-up (:math:`t \le T_w`, ``warmup_steps``): the gradients are averaged in full
  precision (:math:`\bar g`) and the step is Adam's:
  :math:`m \leftarrow \beta_1 m + (1-\beta_1)\bar g`,
  :math:`v \leftarrow \beta_2 v + (1-\beta_2)\bar g^2`;
- compression (:math:`t > T_w`): :math:`v` is frozen; the momentum every rank holds (the
  same on all) takes the average of the ranks' local gradients, averaged with ByteGrad's
  8-bit scatter-reduce-gather (MinMaxUInt8, no error feedback):
  :math:`m \leftarrow \beta_1 m + (1-\beta_1)\,D(C(\frac1n \sum_i D(C(g_i))))`;

and in both stages :math:`x \leftarrow x - \frac{\eta}{\hat\beta_1}\,
\frac{m}{\sqrt{v}/\sqrt{\hat\beta_2} + \epsilon}`.

Differences from Bagua:

- **What is quantized.** Bagua updates each rank's momentum first,
  :math:`m_i = \beta_1 m + (1-\beta_1) g_i`, and averages the :math:`m_i` in 8 bits. In
  exact arithmetic that is the same average, :math:`\beta_1 m + (1-\beta_1)\bar g`,
  because :math:`m` is the same on every rank; but the shared part :math:`\beta_1 m` then
  sets each chunk's min-max range, so the new information :math:`(1-\beta_1) g_i` gets
  about a tenth of the 256 levels, twice (before the reduce and again after it). Divided
  by a small frozen :math:`\sqrt v`, that error reaches 5-8 % of a step on the test
  problem of ``tests/bagua/test_bagua_compressed.py``. Here only the part that differs
  between ranks, the gradient, is quantized, and :math:`\beta_1 m` is added after
  decoding: the same bytes on the wire, the same result up to quantization, about ten
  times less quantization error (under 1 % of a step on that problem).
- **The last warm-up step.** Bagua's optimizer updates the moments only while
  :math:`t < T_w`, while the switch to compression happens after step :math:`T_w`, so
  that step reuses the previous moments and its averaged gradient is lost; here step
  :math:`T_w` is a full warm-up step.
- **Weight decay.** Bagua accepts ``weight_decay`` and ignores it; here it is an L2
  penalty added to the (averaged) gradient in both stages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

from gossamer.bagua._groups import BaguaProcessGroup
from gossamer.bagua.algorithms.base import Algorithm, AlgorithmImpl
from gossamer.bagua.algorithms.gradient_allreduce import check_bool
from gossamer.bagua.bucket import BaguaBucket

__all__ = ["QAdamAlgorithm", "QAdamAlgorithmImpl", "QAdamOptimizer"]

logger = logging.getLogger(__name__)


class QAdamOptimizer(torch.optim.Optimizer):
    """The optimizer of :class:`QAdamAlgorithm` (Adam that freezes its second moment).

    Args:
        params (iterable): parameters or parameter groups.
        lr (float): learning rate.
        warmup_steps (int): steps of full-precision Adam before compression (> 0).
        betas (tuple[float, float]): moment decay rates.
        eps (float): added to the denominator.
        weight_decay (float): L2 penalty, added to the averaged gradient in both stages
            (Bagua ignores it).

    Raises:
        ValueError: a negative ``lr`` or ``eps``, betas outside ``[0, 1)``, or
            ``warmup_steps <= 0``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number; got {value!r}")
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not weight_decay >= 0.0:  # as torch's Adam
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise TypeError(f"betas must be a pair of numbers; got {betas!r}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int):
            raise TypeError(f"warmup_steps must be an int; got {warmup_steps!r}")
        if warmup_steps <= 0:
            raise ValueError(
                f"Invalid warmup_steps parameter, must be larger than 0: {warmup_steps}"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps

    # torch.amp.GradScaler then calls step() with its verdict instead of skipping it, so a
    # loss scaler is refused here: the compressed stage took the scaled gradients into the
    # momentum during backward(), before the scaler could unscale or check them.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One QAdam step (see the module docstring).

        Raises:
            RuntimeError: called by a loss scaler (``torch.amp.GradScaler.step``).
        """
        if getattr(self, "found_inf", None) is not None:
            raise RuntimeError(
                "QAdamOptimizer cannot follow a loss scaler (torch.amp.GradScaler): after "
                "its warm-up QAdam averages the gradients into its momentum during "
                "backward(), before the scaler can unscale or check them; train it without "
                "one (bfloat16 autocast needs none)"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
                state["step"] += 1
                step = state["step"]
                if step <= self.warmup_steps:
                    grad = param.grad
                    if group["weight_decay"] != 0:
                        grad = grad.add(param, alpha=group["weight_decay"])
                    state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(
                    group["eps"]
                )
                param.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias_correction1)
        return loss


class QAdamAlgorithmImpl(AlgorithmImpl):
    """:class:`QAdamAlgorithm` bound to a process group."""

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        q_adam_optimizer: QAdamOptimizer,
        hierarchical: bool = True,
    ) -> None:
        super().__init__(process_group)
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise TypeError(f"q_adam_optimizer must be a QAdamOptimizer; got {q_adam_optimizer!r}")
        self.hierarchical = check_bool(hierarchical, "hierarchical")
        self.optimizer = q_adam_optimizer
        self.warmup_steps = q_adam_optimizer.warmup_steps

    @property
    def optimizer_step_id(self) -> int:
        """Steps the optimizer has taken."""
        param = self.optimizer.param_groups[0]["params"][0]
        return int(self.optimizer.state[param].get("step", 0))

    def _warming_up(self) -> bool:
        return self.optimizer_step_id < self.warmup_steps

    def need_reset(self) -> bool:
        """True when the buckets' operations are those of the other stage.

        At the first step after warm-up (switch to compressed momenta), and after loading
        an optimizer state of the other stage (Bagua checks for that one step only, so a
        checkpoint loaded after ``with_bagua`` kept the warm-up's operations, and momenta
        that no stage updated).
        """
        built = getattr(self, "_built_warming_up", None)
        if built is None or built == self._warming_up():
            return False
        logger.info("QAdam switches stage at step %d", self.optimizer_step_id + 1)
        return True

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        """The gradients of the optimizer's parameters, in backward order (both stages).

        Bagua registers the momenta ``exp_avg`` after warm-up; here the gradients stay
        registered and the momentum is updated from their 8-bit average (see the module
        docstring).
        """
        parameters = bagua_ddp.bagua_build_params()
        index = {id(p): (i, name) for i, (name, p) in enumerate(reversed(parameters))}
        tensors = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in index:
                    continue
                param.bagua_ensure_grad()
                param.ensure_bagua_tensor(
                    index[id(param)][1],
                    bagua_ddp.bagua_module_name,
                    getter_closure=lambda p: p.grad,
                    setter_closure=lambda p, t: setattr(p, "grad", t),
                )
                tensors.append(param)
        tensors.sort(key=lambda p: index[id(p)][0])
        self._communication_tensor_names = {name for name, _ in parameters}
        return tensors

    def tensors_to_buckets(self, tensors: list[list[Any]], do_flatten: bool) -> list[BaguaBucket]:
        """Buckets padded to a multiple of the number of ranks."""
        n = len(self.process_group.ranks)
        return [
            BaguaBucket(group, flatten=do_flatten, name=str(i), alignment=n)
            for i, group in enumerate(tensors)
        ]

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        """Warm-up: gradient allreduce. Then: 8-bit gradient averaging, momentum update."""
        bucket.clear_ops()
        self._built_warming_up = self._warming_up()
        if self._built_warming_up:
            bucket.append_centralized_synchronous_op(
                hierarchical=False, average=True, group=self.process_group
            )
            return
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical,
            average=True,
            scattergather=True,
            compression="MinMaxUInt8",
            group=self.process_group,
        )
        bucket.append_python_op(lambda _: self._update_momenta(bucket), group=self.process_group)

    def _update_momenta(self, bucket: BaguaBucket) -> None:
        """``m <- beta1 m + (1 - beta1) (g + weight_decay x)`` with the averaged ``g``."""
        mine = {id(t) for t in bucket.tensors}
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                beta1 = group["betas"][0]
                for param in group["params"]:
                    if id(param) not in mine:
                        continue
                    momentum = self.optimizer.state[param].get("exp_avg")
                    if momentum is None:  # never stepped: Adam's first step will start it
                        continue
                    momentum.mul_(beta1)
                    if param.grad is None:
                        continue
                    grad = param.grad
                    if group["weight_decay"] != 0:
                        grad = grad.add(param, alpha=group["weight_decay"])
                    momentum.add_(grad, alpha=1 - beta1)

    def init_backward_hook(self, bagua_ddp: Any):
        """Mark a parameter's gradient ready."""

        def hook(parameter_name: str, parameter: torch.Tensor) -> None:
            if parameter.is_bagua_tensor() and parameter_name in self._communication_tensor_names:
                parameter.bagua_mark_communication_ready()

        return hook


class QAdamAlgorithm(Algorithm):
    """QAdam: 8-bit averaged Adam momentum after a full-precision warm-up.

    Args:
        q_adam_optimizer (QAdamOptimizer): the optimizer of the model's parameters.
        hierarchical (bool): average inside machines first (compression stage).
    """

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True) -> None:
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise TypeError(f"q_adam_optimizer must be a QAdamOptimizer; got {q_adam_optimizer!r}")
        self.hierarchical = check_bool(hierarchical, "hierarchical")
        self.optimizer = q_adam_optimizer

    def reify(self, process_group: BaguaProcessGroup) -> QAdamAlgorithmImpl:
        """The implementation for ``process_group``."""
        return QAdamAlgorithmImpl(process_group, self.optimizer, self.hierarchical)

    def check_optimizers(self, optimizers: list[Any]) -> None:
        """Its QAdamOptimizer must be one of ``optimizers``: QAdam steps through it."""
        if not any(o is self.optimizer for o in optimizers):
            raise ValueError(
                "QAdamAlgorithm's q_adam_optimizer must be one of the optimizers given to "
                f"with_bagua; got {[type(o).__name__ for o in optimizers]}"
            )
