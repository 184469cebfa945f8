"""Compressors by name: ``get_compressor("topk:0.01")``, the form optimizer options take."""

from __future__ import annotations

import dataclasses

from gossamer.compression.base import Compressor, spec_fields
from gossamer.compression.casts import BF16, FP16, NoCompression
from gossamer.compression.minmax import MinMaxUInt8
from gossamer.compression.quantization import QSGD, Natural, NaturalDithering
from gossamer.compression.sign import Sign
from gossamer.compression.sparsification import STC, RandomK, TopK

__all__ = ["available_compressors", "get_compressor"]

_CLASSES: dict[str, type[Compressor]] = {
    cls.spec_name: cls
    for cls in (
        NoCompression,
        FP16,
        BF16,
        MinMaxUInt8,
        QSGD,
        Natural,
        NaturalDithering,
        TopK,
        RandomK,
        STC,
        Sign,
    )
}


def available_compressors() -> tuple[str, ...]:
    """Return the usage of every registered compressor, e.g. ``"topk:<ratio>"``, sorted."""
    return tuple(_usage(_CLASSES[name]) for name in sorted(_CLASSES))


def get_compressor(
    spec: str | Compressor | None = None, *, argument: str = "compression"
) -> Compressor:
    """Return the compressor that ``spec`` names.

    A spec is ``name``, then colon-separated parameters: first the main one by position,
    then any as ``key=value`` (booleans: ``true``/``false``). Each compressor's ``name``
    spells it back, so ``get_compressor(c.name) == c``.

    ========================================  =========================================
    spec                                      compressor
    ========================================  =========================================
    ``None``, ``"none"``                      :class:`NoCompression`
    ``"fp16"``, ``"bf16"``                    :class:`FP16`, :class:`BF16`
    ``"uint8"``, ``"uint8:32"``               :class:`MinMaxUInt8` (1 or 32 chunks)
    ``"qsgd:16"``, ``"qsgd:16:seed=3"``       :class:`QSGD`
    ``"natural"``                             :class:`Natural`
    ``"natural_dithering:8"``                 :class:`NaturalDithering`
    ``"topk:0.01"``                           :class:`TopK`
    ``"randomk:0.01"``                        :class:`RandomK` (``:unbiased=true``)
    ``"stc:0.01"``                            :class:`STC`
    ``"sign"``                                :class:`Sign`
    ========================================  =========================================

    Args:
        spec: A spec string, a :class:`Compressor` (returned as is) or None.
        argument: Name of the caller's argument, used in error messages.

    Raises:
        TypeError: ``spec`` is neither a str, a Compressor nor None.
        ValueError: unknown name, or a parameter that is missing, unknown or out of range;
            the message names ``argument``, the spec and the valid forms.

    Example:
        >>> get_compressor("topk:0.01")
        TopK(ratio=0.01)
        >>> get_compressor("randomk:0.1:unbiased=true").name
        'randomk:0.1:unbiased=true'
    """
    if spec is None:
        return NoCompression()
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"{argument} must be a str, a Compressor or None; got {type(spec).__name__}"
        )
    name, *params = spec.strip().split(":")
    cls = _CLASSES.get(name.strip().lower())
    if cls is None:
        raise ValueError(
            f"{argument}={spec!r}: unknown compressor {name!r}; valid: "
            + ", ".join(available_compressors())
            + " ('powersgd[:<rank>]', torch's PowerSGD hook, is for gradient allreduce only)"
        )
    try:
        return cls(**_parse(cls, params))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{argument}={spec!r}: {exc}; usage: {_usage(cls)}") from None


def _usage(cls: type[Compressor]) -> str:
    """Spell how a spec for ``cls`` is written, e.g. ``"randomk:<ratio>[:unbiased=<bool>]"``."""
    parts = [cls.spec_name]
    for spec_field in spec_fields(cls):
        if spec_field.kw_only:
            parts.append(f"[:{spec_field.name}=<{spec_field.type}>]")
        elif spec_field.default is dataclasses.MISSING:
            parts.append(f":<{spec_field.name}>")
        else:
            parts.append(f"[:<{spec_field.name}>]")
    return "".join(parts)


def _parse(cls: type[Compressor], params: list[str]) -> dict[str, object]:
    """Turn ``["0.01", "seed=3"]`` into keyword arguments of ``cls``, typed by its fields."""
    by_name = {f.name: f for f in spec_fields(cls)}
    positional = [f.name for f in by_name.values() if not f.kw_only]
    kwargs: dict[str, object] = {}
    for index, text in enumerate(params):
        key, sep, value = text.partition("=")
        if not sep:
            if index > 0 or not positional:
                raise ValueError(f"unexpected parameter {text!r}")
            key, value = positional[0], text
        key = key.strip()
        if key not in by_name:
            raise ValueError(f"unknown parameter {key!r}")
        if key in kwargs:
            raise ValueError(f"parameter {key!r} given twice")
        kwargs[key] = _convert(value.strip(), str(by_name[key].type), key)
    return kwargs


def _convert(text: str, kind: str, key: str) -> object:
    """Parse ``text`` as the field type ``kind`` (``float``, ``int`` or ``bool``)."""
    try:
        if "_" in text:  # int() and float() take "1_6"; a spec means what it shows
            raise ValueError(text)
        if kind == "bool":
            return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
        if kind == "int":
            return int(text)
        return float(text)
    except (KeyError, ValueError):
        raise ValueError(f"{key} must be {_KINDS[kind]}; got {text!r}") from None


_KINDS = {"float": "a float", "int": "an int", "bool": "a bool (true/false)"}
