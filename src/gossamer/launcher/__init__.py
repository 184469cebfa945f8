"""``gossamer run``: start a gossamer program on one or several machines through torchrun."""

from __future__ import annotations

from gossamer.launcher.cli import main

__all__ = ["main"]
