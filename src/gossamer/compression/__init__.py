"""Compression: pure tensor transforms to a flat byte payload and back; never communicates.

A :class:`Compressor` turns a floating tensor into a :class:`Payload` (one contiguous
``uint8`` buffer, what a transport sends) and back. :class:`ErrorFeedback` wraps one and
keeps per-tensor residuals; :func:`get_compressor` builds one from a string such as
``"topk:0.01"``; :func:`quantize_model` prepares a model for 8-bit quantization-aware
training. The communication layers (compressed allreduce, CHOCO gossip, window puts)
build on this package; nothing here talks to other ranks.
"""

from __future__ import annotations

from gossamer.compression._random import for_rank, rank_seed
from gossamer.compression.base import Compressor, Payload
from gossamer.compression.casts import BF16, FP16, NoCompression
from gossamer.compression.error_feedback import ErrorFeedback, default_error_feedback
from gossamer.compression.minmax import MinMaxUInt8
from gossamer.compression.qat import fake_quant_modules, qat_qconfig, quantize_model
from gossamer.compression.quality import compression_quality
from gossamer.compression.quantization import QSGD, Natural, NaturalDithering
from gossamer.compression.registry import available_compressors, get_compressor
from gossamer.compression.sign import Sign
from gossamer.compression.sparsification import STC, RandomK, TopK

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "STC",
    "Compressor",
    "ErrorFeedback",
    "MinMaxUInt8",
    "Natural",
    "NaturalDithering",
    "NoCompression",
    "Payload",
    "RandomK",
    "Sign",
    "TopK",
    "available_compressors",
    "compression_quality",
    "default_error_feedback",
    "fake_quant_modules",
    "for_rank",
    "get_compressor",
    "qat_qconfig",
    "quantize_model",
    "rank_seed",
]
