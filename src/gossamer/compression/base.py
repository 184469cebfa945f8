"""The `Compressor` strategy interface and the `Payload` it produces: one flat byte buffer."""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gossamer.compression._common import format_value

__all__ = ["Compressor", "Payload"]

#: The dtypes every compressor but ``none`` encodes (float8 has no arithmetic to quantize with).
FLOATING_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclass(frozen=True, eq=False)
class Payload:
    """A compressed tensor: one contiguous byte buffer plus the shape and dtype to restore.

    ``buffer`` holds everything needed to decode (headers such as norms, min/max pairs or
    random-stream positions, then packed codes and indices), so a transport sends exactly
    ``nbytes`` bytes and rebuilds the payload on the other side with
    ``Payload(buffer, shape, dtype)``; the shape and dtype are what both sides already agree
    on (the same parameter or bucket). The buffer may share memory with the compressed tensor
    (:class:`NoCompression`, or a cast to the dtype the tensor already has): send it before
    modifying the tensor in place.

    Args:
        buffer: 1-D contiguous ``torch.uint8`` tensor, on the device of the tensor it encodes.
        shape: Shape of the original tensor.
        dtype: Dtype of the original tensor.

    Raises:
        TypeError: ``buffer`` is not a ``torch.uint8`` tensor, ``shape`` is not a sequence
            of ints, or ``dtype`` is not a ``torch.dtype``.
        ValueError: ``buffer`` is not 1-D and contiguous, or ``shape`` has a negative size.
    """

    buffer: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    def __post_init__(self) -> None:
        buf = self.buffer
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8:
            got = buf.dtype if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise TypeError(f"buffer must be a torch.uint8 tensor; got {got}")
        if buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(
                f"buffer must be 1-D and contiguous; got shape {tuple(buf.shape)}, "
                f"stride {buf.stride()}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype; got {self.dtype!r}")
        try:
            shape = torch.Size(self.shape)
        except TypeError:
            raise TypeError(f"shape must be a sequence of ints; got {self.shape!r}") from None
        if any(size < 0 for size in shape):
            raise ValueError(f"shape must have non-negative sizes; got {tuple(shape)}")
        # Frozen dataclass: normalise a tuple or list to torch.Size past __setattr__.
        object.__setattr__(self, "shape", shape)

    def __repr__(self) -> str:
        return f"Payload(nbytes={self.nbytes}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @property
    def nbytes(self) -> int:
        """Exact number of bytes a transport sends: ``buffer.numel()``."""
        return self.buffer.numel()

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)


class Compressor(abc.ABC):
    """Strategy that turns a tensor into a :class:`Payload` and back; never communicates.

    A compressor ``C`` with decompressor ``D`` maps ``x`` to a byte buffer and back to
    ``D(C(x))``, which has the shape, dtype and device of ``x``. It is *unbiased* when
    ``E[D(C(x))] = x`` over its internal randomness; biased compressors (top-k, sign,
    deterministic rounding) should run under :class:`~gossamer.compression.ErrorFeedback`.

    Concrete compressors are frozen dataclasses: their fields are the configuration, they
    compare and hash by it, and ``name`` is the registry string that rebuilds an equal one
    through :func:`~gossamer.compression.get_compressor`. Stochastic compressors also keep a
    step counter, which is state (``state_dict``), not configuration.

    Every compressor accepts floating tensors of any dtype (float16, bfloat16, float32,
    float64), any shape (0-d and empty included) and any device; an empty tensor compresses
    to an empty buffer. Non-finite inputs give unspecified (but finite-sized) payloads.

    Subclasses implement ``_encode``, ``_decode`` and ``_nbytes`` on flat, non-empty,
    contiguous tensors and set ``spec_name`` and ``unbiased``; they may override
    ``_decode_add`` and ``_encode_add`` (the in-place sums of :meth:`decompress_add_` and
    :meth:`compress_add_`) with fused versions.
    """

    spec_name: ClassVar[str]
    """Registry name (the part of ``name`` before the first colon)."""
    unbiased: ClassVar[bool] = False
    """Whether ``E[D(C(x))] = x`` for every ``x``."""
    exact_nbytes: ClassVar[bool] = True
    """Whether :meth:`payload_nbytes` is exact (False: an upper bound, for variable codes)."""

    def __repr__(self) -> str:
        params = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in spec_fields(self))
        return f"{type(self).__name__}({params})"

    @property
    def name(self) -> str:
        """Registry string, e.g. ``"topk:0.01"``; ``get_compressor(c.name) == c``."""
        parts = [self.spec_name]
        for index, spec_field in enumerate(spec_fields(self)):
            value = getattr(self, spec_field.name)
            if value == spec_field.default:
                continue
            text = format_value(value)
            positional = index == 0 and not spec_field.kw_only
            parts.append(text if positional else f"{spec_field.name}={text}")
        return ":".join(parts)

    def compress(self, tensor: torch.Tensor) -> Payload:
        """Encode ``tensor`` into a :class:`Payload`.

        Args:
            tensor: Floating tensor of any shape, dtype and device. It is not modified.

        Returns:
            The payload; ``payload.nbytes == payload_nbytes(tensor.numel(), tensor.dtype)``
            (at most that for variable-size codes).

        Raises:
            TypeError: ``tensor`` is not a tensor, or its dtype is not floating.
        """
        self._check_tensor(tensor)
        flat = _dense(tensor)
        if flat.numel() == 0:
            buffer = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        else:
            buffer = self._encode(flat)
        return Payload(buffer, tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        """Decode ``payload`` into a tensor of its shape and dtype, on its buffer's device.

        Args:
            payload: What :meth:`compress` returned, or ``Payload(buffer, shape, dtype)``
                rebuilt from the bytes a peer sent with the same compressor configuration.

        Returns:
            ``D(C(x))``: a new tensor, except that it may share memory with
            ``payload.buffer`` (and so with ``x``) for :class:`NoCompression` and for a cast
            to the tensor's own dtype (``fp16`` of a float16 tensor, ``bf16`` of bfloat16).

        Raises:
            TypeError: ``payload`` is not a :class:`Payload`, or its dtype is not floating.
            ValueError: ``payload.nbytes`` does not fit this compressor and shape.
        """
        numel = self._check_payload(payload)
        if numel == 0:
            return torch.empty(payload.shape, dtype=payload.dtype, device=payload.buffer.device)
        return self._decode(payload.buffer, numel, payload.dtype).view(payload.shape)

    def compress_add_(self, tensor: torch.Tensor, target: torch.Tensor) -> Payload:
        """:meth:`compress` ``tensor``, and add what the payload decodes to into ``target``.

        ``target += D(C(tensor))``, bit for bit what :meth:`decompress_add_` of the payload
        adds (CHOCO's public copies and compressed window puts track what receivers decode). Some
        compressors fuse the two, without a model-sized decoded tensor.

        Raises:
            TypeError, ValueError: as :meth:`compress`, or ``target`` has another shape,
                dtype or device than ``tensor``.
        """
        self._check_tensor(tensor)
        self._check_target(target, tensor.shape, tensor.dtype, tensor.device)
        flat = _dense(tensor)
        if flat.numel() == 0:
            return self.compress(tensor)
        if not target.is_contiguous():
            payload = self.compress(tensor)
            self.decompress_add_(payload, target)
            return payload
        with torch.no_grad():
            buffer = self._encode_add(flat, target.view(-1))
        return Payload(buffer, tensor.shape, tensor.dtype)

    def decompress_add_(self, payload: Payload, target: torch.Tensor) -> torch.Tensor:
        """``target += D(payload)`` in place; returns ``target``.

        The same sum as ``target.add_(decompress(payload))``; sparse and 8-bit payloads add
        their values without a model-sized decoded tensor.

        Raises:
            TypeError, ValueError: as :meth:`decompress`, or ``target`` has another shape,
                dtype or device than the payload.
        """
        numel = self._check_payload(payload)
        self._check_target(target, payload.shape, payload.dtype, payload.buffer.device)
        if numel == 0:
            return target
        if not target.is_contiguous():
            with torch.no_grad():  # a view of a leaf that requires grad, like the fused path
                return target.add_(self.decompress(payload))
        with torch.no_grad():
            self._decode_add(payload.buffer, numel, payload.dtype, target.view(-1))
        return target

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Return the size in bytes of the payload of a tensor with ``numel`` elements.

        Exact for every compressor except those whose ``exact_nbytes`` is false
        (:class:`STC`), for which it is an upper bound and :attr:`Payload.nbytes` is exact.

        Args:
            numel: Number of elements, ``>= 0``.
            dtype: Floating dtype of the tensor.

        Raises:
            TypeError: ``numel`` is not an int, or ``dtype`` is not a floating dtype.
            ValueError: ``numel`` is negative.
        """
        if isinstance(numel, bool) or not isinstance(numel, int):
            raise TypeError(f"numel must be an int; got {numel!r}")
        if numel < 0:
            raise ValueError(f"numel must be >= 0; got {numel}")
        self._check_dtype(dtype, "dtype")
        return 0 if numel == 0 else self._nbytes(numel, dtype)

    def state_dict(self) -> dict[str, Any]:
        """Return the state that is not configuration ({} for deterministic compressors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: ``state`` holds keys this compressor does not have.
        """
        if state:
            raise ValueError(f"state must be empty for {self.name!r}; got keys {sorted(state)}")

    def _check_payload(self, payload: object) -> int:
        """The payload's element count, once its type and size fit this compressor."""
        if not isinstance(payload, Payload):
            raise TypeError(f"payload must be a Payload; got {type(payload).__name__}")
        numel = payload.numel
        expected = self.payload_nbytes(numel, payload.dtype)
        fits = payload.nbytes == expected if self.exact_nbytes else payload.nbytes <= expected
        if not fits:
            relation = "" if self.exact_nbytes else "at most "
            raise ValueError(
                f"payload.nbytes must be {relation}{expected} for {self.name!r}, "
                f"{numel} elements of {payload.dtype}; got {payload.nbytes}"
            )
        return numel

    @staticmethod
    def _check_target(target: object, shape, dtype: torch.dtype, device) -> None:
        if not isinstance(target, torch.Tensor):
            raise TypeError(f"target must be a torch.Tensor; got {type(target).__name__}")
        if (target.shape, target.dtype, target.device) != (torch.Size(shape), dtype, device):
            raise ValueError(
                f"target must be a {dtype} tensor of shape {tuple(shape)} on {device}; got "
                f"{target.dtype} of shape {tuple(target.shape)} on {target.device}"
            )

    def _check_tensor(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor; got {type(tensor).__name__}")
        self._check_dtype(tensor.dtype, "tensor")

    def _check_dtype(self, dtype: object, argument: str) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{argument} must be a torch.dtype; got {dtype!r}")
        if dtype not in FLOATING_DTYPES:
            raise TypeError(
                f"{argument} must have a floating dtype (float16, bfloat16, float32 or "
                f"float64) for {self.name!r}; got {dtype}"
            )

    @abc.abstractmethod
    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        """Return the uint8 buffer of a flat, contiguous, non-empty tensor."""

    @abc.abstractmethod
    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Return the flat tensor of ``numel`` elements of ``dtype`` that ``buffer`` encodes."""

    def _encode_add(self, flat: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``_encode(flat)``, and add its decoded value into the flat ``target``."""
        buffer = self._encode(flat)
        self._decode_add(buffer, flat.numel(), flat.dtype, target)
        return buffer

    def _decode_add(
        self, buffer: torch.Tensor, numel: int, dtype: torch.dtype, target: torch.Tensor
    ) -> None:
        """Add the flat tensor that ``buffer`` encodes into the flat ``target``."""
        target.add_(self._decode(buffer, numel, dtype))

    @abc.abstractmethod
    def _nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Return the payload size for ``numel > 0`` elements (upper bound if not exact)."""


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` flattened, with stride 1.

    torch calls a one-element tensor of any stride contiguous; ``view(torch.uint8)`` refuses it.
    """
    flat = tensor.detach().reshape(-1)
    return flat.as_strided((1,), (1,)) if flat.numel() == 1 else flat.contiguous()


def spec_fields(compressor: Compressor | type[Compressor]) -> list[dataclasses.Field[Any]]:
    """Return the configuration fields of a compressor: the positional one, then keywords."""
    fields = [f for f in dataclasses.fields(compressor) if f.init]  # type: ignore[arg-type]
    return sorted(fields, key=lambda f: bool(f.kw_only))
