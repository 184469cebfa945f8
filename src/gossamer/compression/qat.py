"""8-bit training: torch's quantization-aware training (QAT) fake-quant modules on a model.

:func:`quantize_model` prepares a model with ``torch.ao.quantization.prepare_qat``: every
``Linear`` and ``Conv`` layer (and the fused and recurrent kinds torch's QAT mappings know)
is swapped for its QAT twin, whose weights pass through a fake quantizer (int8, symmetric,
per output channel) on every forward pass, and whose outputs pass through another (uint8,
affine, per tensor, ranges tracked by moving averages). The model still trains in float32,
but it learns weights and activations that survive rounding to 8 bits, and
``torch.ao.quantization.convert`` turns it into a real int8 model afterwards.

This is torch's own machinery, not a rewrite; what this module adds is the 8-bit
configuration and the checks. Combined with 8-bit gossip (``AdaptWithCombine(...,
compression="uint8")``: CHOCO-gossip of ``MinMaxUInt8`` differences), everything a rank
computes with and everything it sends is 8-bit ("8-bit decentralized training").

The observers' state (the fake quantizers' scales, zero points and ranges) is in the model's
buffers, not its parameters: each rank keeps its own, and optimizers communicate only
parameters.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["fake_quant_modules", "qat_qconfig", "quantize_model"]


def _ao():
    # torch 2.13 marks torch.ao.quantization deprecated (for torchao) but ships it whole;
    # the warning on import says nothing a caller can act on here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch.ao.quantization as ao
    return ao


def qat_qconfig(*, per_channel: bool = True, averaging: float = 0.1):
    """The 8-bit QAT configuration: int8 symmetric weights, uint8 affine activations.

    Weights: ``qint8`` in ``[-128, 127]``, symmetric, per output channel (per tensor if
    ``per_channel`` is False); activations: ``quint8`` in ``[0, 255]`` (the full range:
    torch's default ``reduce_range`` keeps 7 bits for old x86 kernels), affine, per tensor.
    Ranges are moving averages of the observed min and max with weight ``averaging`` for
    each new batch. torch's default, 0.01, suits fine-tuning a trained model; trained from
    scratch the ranges then lag the growing activations by hundreds of steps and clip them:
    SmallCNN on the digits, 200 Adam steps, reached 68.8 % test accuracy with 0.01 and
    96.4 % with 0.1 or 1.0 (full precision: 96.7 %).

    Args:
        per_channel (bool): one weight scale per output channel (False: per tensor).
        averaging (float): the moving averages' weight of a new batch, in (0, 1].

    Returns:
        torch.ao.quantization.QConfig

    Raises:
        TypeError: ``per_channel`` is not a bool.
        ValueError: ``averaging`` outside (0, 1].
    """
    if not isinstance(per_channel, bool):
        raise TypeError(f"per_channel must be a bool; got {per_channel!r}")
    if isinstance(averaging, bool) or not isinstance(averaging, int | float):
        raise ValueError(f"averaging must be a number in (0, 1]; got {averaging!r}")
    if not 0 < averaging <= 1:
        raise ValueError(f"averaging must be a number in (0, 1]; got {averaging!r}")
    ao = _ao()
    fake = ao.FusedMovingAvgObsFakeQuantize
    weight_observer = (
        ao.MovingAveragePerChannelMinMaxObserver if per_channel else ao.MovingAverageMinMaxObserver
    )
    scheme = torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric
    return ao.QConfig(
        activation=fake.with_args(
            observer=ao.MovingAverageMinMaxObserver,
            averaging_constant=averaging,
            quant_min=0,
            quant_max=255,
            dtype=torch.quint8,
            qscheme=torch.per_tensor_affine,
        ),
        weight=fake.with_args(
            observer=weight_observer,
            averaging_constant=averaging,
            quant_min=-128,
            quant_max=127,
            dtype=torch.qint8,
            qscheme=scheme,
        ),
    )


def quantize_model(
    model: nn.Module, *, per_channel: bool = True, averaging: float = 0.1
) -> nn.Module:
    """Prepare ``model`` in place for 8-bit quantization-aware training; return it.

    Sets ``model.qconfig`` to :func:`qat_qconfig` and calls
    ``torch.ao.quantization.prepare_qat(model, inplace=True)``. Call it before creating the
    optimizer (the QAT layers keep the original parameter tensors, but build the optimizer
    on the prepared model's ``parameters()`` to be safe) and after materialising lazy
    layers (run one forward pass first).

    To evaluate, turn the observers off (with ``torch.ao.quantization``:
    ``model.apply(disable_observer)``, then ``model.apply(enable_observer)`` after):
    ``model.eval()`` alone does not stop them, so the evaluation data would move the
    quantization ranges (the ``accuracy`` of ``examples/train_digits.py`` does this).

    Args:
        model (nn.Module): the model; put in training mode.
        per_channel (bool): per-output-channel weight scales (False: one per tensor).
        averaging (float): see :func:`qat_qconfig`.

    Returns:
        nn.Module: ``model``, with fake-quant modules inserted.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``per_channel`` not a bool.
        ValueError: ``model`` has uninitialised lazy parameters, or no layer that QAT
            can quantize (nothing would be 8-bit), or ``averaging`` is outside (0, 1].

    Example:
        >>> model = quantize_model(SmallCNN())  # doctest: +SKIP
        >>> opt = AdaptWithCombine(torch.optim.SGD(model.parameters(), lr=0.1), model,
        ...                        compression="uint8")  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    uninitialised = nn.parameter.UninitializedParameter
    lazy = [n for n, p in model.named_parameters() if isinstance(p, uninitialised)]
    if lazy:
        raise ValueError(
            f"model has uninitialised lazy parameters {lazy}; run one forward pass before "
            "quantize_model"
        )
    ao = _ao()
    qconfig = qat_qconfig(per_channel=per_channel, averaging=averaging)
    before = {m: getattr(m, "qconfig", _NONE) for m in model.modules()}
    was_training = model.training
    model.train()
    model.qconfig = qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # see _ao
        ao.prepare_qat(model, inplace=True)
    if not fake_quant_modules(model):
        # Nothing was quantized: leave the model as it was given (prepare_qat only
        # spread the qconfig over the submodules).
        for module, old in before.items():
            if old is _NONE:
                module.__dict__.pop("qconfig", None)
            else:
                module.qconfig = old
        model.train(was_training)
        raise ValueError(
            f"model has no layer that quantization-aware training can quantize (Linear, "
            f"Conv...); got {type(model).__name__}"
        )
    return model


_NONE = object()  # a module without a qconfig attribute


def fake_quant_modules(model: nn.Module) -> list[str]:
    """Names of the fake quantizers in ``model`` (empty if it was not prepared)."""
    base = _ao().FakeQuantizeBase
    return [name for name, m in model.named_modules() if isinstance(m, base)]
