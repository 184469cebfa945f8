"""Error feedback: a compressor wrapper that carries each tensor's compression error forward."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from gossamer.compression.base import Compressor, Payload

__all__ = ["ErrorFeedback", "default_error_feedback"]


def default_error_feedback(compressor: Compressor) -> bool:
    """Return whether ``compressor`` should run under :class:`ErrorFeedback` by default.

    True exactly for biased compressors (``not compressor.unbiased``): their errors do not
    average out, so without feedback they bias the iterates (top-k, sign, STC, MinMaxUInt8's
    deterministic rounding, the 16-bit casts). Unbiased ones (QSGD, natural compression,
    unbiased random-k) and :class:`NoCompression` need no residual memory.

    Raises:
        TypeError: ``compressor`` is not a :class:`Compressor`.
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a Compressor; got {type(compressor).__name__}")
    return not compressor.unbiased


class ErrorFeedback:
    """Compress ``x + e`` instead of ``x`` and keep the new error ``e`` for the next call.

    For each tensor key (a parameter, a bucket), with residual ``e_0 = 0``:

    ``x'_t = x_t + e_{t-1}``,  ``p_t = C(x'_t)``,  ``e_t = x'_t - D(p_t)``,

    so nothing is lost, only delayed: ``sum_t D(p_t) + e_T = sum_t x_t`` exactly in exact
    arithmetic. This is what makes biased compressors (top-k, sign, STC) converge like SGD
    (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019). The receiver decodes
    payloads with the plain compressor (or :meth:`decompress`); only the sender keeps
    residuals, one per key, of the tensor's shape, dtype and device.

    Args:
        compressor: The compressor to wrap.

    Raises:
        TypeError: ``compressor`` is not a :class:`Compressor`.

    Example:
        >>> ef = ErrorFeedback(TopK(0.5))
        >>> p = ef.compress(torch.tensor([1.0, -3.0, 0.5, 2.0]), key="w")
        >>> ef.decompress(p), ef.residual("w")
        (tensor([ 0., -3.,  0.,  2.]), tensor([1.0000, 0.0000, 0.5000, 0.0000]))
    """

    def __init__(self, compressor: Compressor) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a Compressor; got {type(compressor).__name__}")
        self.compressor = compressor
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compressor!r}, residuals={len(self._residuals)})"

    def compress(self, tensor: torch.Tensor, *, key: Hashable) -> Payload:
        """Compress ``tensor`` plus the residual of ``key``, and store the new residual.

        Args:
            tensor: Floating tensor; not modified.
            key: Identifies the tensor across calls (e.g. a parameter name).

        Returns:
            ``C(tensor + e)``.

        Raises:
            TypeError: ``tensor`` is not a floating tensor, or as :meth:`Compressor.compress`.
            ValueError: ``tensor``'s shape, dtype or device differs from the residual
                already held for ``key``.
        """
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
            # The residual x - D(C(x)) needs real arithmetic (a bool cannot be subtracted).
            raise TypeError(f"ErrorFeedback: tensor must be a floating tensor; got {tensor.dtype}")
        residual = self._residuals.get(key)
        if residual is None:
            corrected = tensor
        else:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensor must be a torch.Tensor; got {type(tensor).__name__}")
            if (tensor.shape, tensor.dtype, tensor.device) != (
                residual.shape,
                residual.dtype,
                residual.device,
            ):
                raise ValueError(
                    f"tensor for key={key!r} must match its residual "
                    f"({tuple(residual.shape)}, {residual.dtype}, {residual.device}); got "
                    f"({tuple(tensor.shape)}, {tensor.dtype}, {tensor.device})"
                )
            corrected = tensor.detach() + residual
        payload = self.compressor.compress(corrected)
        # A new tensor each step, never updated in place: a state_dict taken earlier stays valid.
        self._residuals[key] = corrected.detach() - self.compressor.decompress(payload)
        return payload

    def decompress(self, payload: Payload) -> torch.Tensor:
        """Decode ``payload`` with the wrapped compressor (receivers keep no residual)."""
        return self.compressor.decompress(payload)

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """Return the residual held for ``key``, or None before its first compression."""
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        """Drop the residual of ``key``, or all residuals when ``key`` is None."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"compressor": ..., "residuals": {key: tensor}}``.

        The residual tensors are the live ones, not copies (like ``Module.state_dict``);
        later calls replace them rather than modify them, so the snapshot stays valid.
        """
        return {"compressor": self.compressor.state_dict(), "residuals": dict(self._residuals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (residuals are copied).

        Raises:
            ValueError: ``state`` lacks ``"compressor"`` or ``"residuals"``, or a residual is
                not a tensor.
        """
        if not isinstance(state, dict) or set(state) != {"compressor", "residuals"}:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state must hold 'compressor' and 'residuals'; got {got}")
        residuals = state["residuals"]
        if not isinstance(residuals, dict):
            raise ValueError(f"state['residuals'] must be a dict; got {type(residuals).__name__}")
        bad = [key for key, value in residuals.items() if not isinstance(value, torch.Tensor)]
        if bad:
            raise ValueError(f"state['residuals'] must map keys to tensors; got {bad[0]!r}")
        self.compressor.load_state_dict(state["compressor"])
        self._residuals = {key: value.detach().clone() for key, value in residuals.items()}
