"""argparse ``type=`` checkers shared by the benchmark scripts.

Scripts run as files (``gossamer run ... benchmarks/x.py``, this folder then on
``sys.path``) import it as ``argtypes``; those run as modules (``python -m benchmarks.x``)
as ``benchmarks.argtypes``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def checked(kind: Callable[[str], Any], test: Callable[[Any], bool], rule: str):
    """``kind(text)``, refused unless ``test(value)`` ("must be ``rule``; got ...")."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {rule}; got {text}")
        return value

    return parse


def at_least(least: int):
    """An int >= ``least``."""
    return checked(int, lambda n: n >= least, f">= {least}")


POSITIVE = at_least(1)
