"""Tensor fusion: flat buckets of parameters or gradients."""

from __future__ import annotations

from gossamer.fusion.buckets import Bucket, bucketize

__all__ = ["Bucket", "bucketize"]
