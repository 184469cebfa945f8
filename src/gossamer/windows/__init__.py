"""Asynchronous one-sided windows (put / get / accumulate / update, mutex, push-sum)."""

from __future__ import annotations

from gossamer.windows.window import Window, live_windows

__all__ = ["Window", "live_windows"]
