"""Shared pieces of the fuzz tests: argument strategies tagged valid or bad, and the verdicts.

A fuzzed argument is an :class:`Arg`: the value and, when the value breaks the documented
contract, the reason. A call whose arguments are all valid must succeed and match the
reference computed in the test; a call with a bad argument must raise ``TypeError`` or
``ValueError`` (gossamer's documented errors, ``TopologyError`` included, subclass these)
whose message names one of the bad arguments. :func:`verdict` checks both.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

__all__ = [
    "EXAMPLES",
    "FUZZ",
    "Arg",
    "bad",
    "bad_bool",
    "bad_float",
    "bad_int",
    "call",
    "flag",
    "good",
    "mostly",
    "verdict",
]

# Reproducible and cheap: the same examples on every run, no example database on disk, no
# per-example deadline (the ranks share two cores with other tests). 60 examples unless a
# fuzzer asks for more or fewer.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# Examples run per fuzzer in this process: the fuzzers that run inside rank processes
# report it back, so a test can check that the search really ran.
EXAMPLES: Counter[str] = Counter()


@dataclass(frozen=True)
class Arg:
    """One fuzzed argument: its value, and why it is bad (None when it is valid)."""

    value: Any
    bad: str | None = None

    def __repr__(self) -> str:
        tag = "" if self.bad is None else f" <bad: {self.bad}>"
        return f"{self.value!r}{tag}"


def good(strategy: st.SearchStrategy) -> st.SearchStrategy[Arg]:
    """Valid values."""
    return strategy.map(Arg)


def bad(strategy: st.SearchStrategy, why: str) -> st.SearchStrategy[Arg]:
    """Values that break the contract for the reason ``why``."""
    return strategy.map(lambda v: Arg(v, why))


def mostly(
    valid: st.SearchStrategy[Arg], invalid: st.SearchStrategy[Arg], bad_one_in: int = 6
) -> st.SearchStrategy[Arg]:
    """``valid`` most of the time, ``invalid`` about once in ``bad_one_in`` draws.

    With several arguments per call, an even choice would almost never give a call whose
    arguments are all valid, so the accepted paths would go untested.
    """
    return st.integers(0, bad_one_in - 1).flatmap(lambda i: invalid if i == 0 else valid)


# Values of the wrong type that every kind of argument gets among its bad ones.
_WRONG_TYPE = st.sampled_from([None, "1", b"1", [1], (1,), {1: 1}, object(), 1j])


def bad_int(
    minimum: int | None = None, maximum: int | None = None, *, none_ok: bool = False
) -> st.SearchStrategy[Arg]:
    """Not an int (bools and floats included), or an int outside ``[minimum, maximum]``.

    ``none_ok``: None is a valid value of the argument, so it is not drawn here.
    """
    wrong = _WRONG_TYPE.filter(lambda v: v is not None) if none_ok else _WRONG_TYPE
    options = [
        bad(wrong | st.booleans(), "not an int"),
        bad(st.floats(allow_nan=True) | st.just(2.0), "not an int"),
    ]
    if minimum is not None:
        options.append(bad(st.integers(max_value=minimum - 1), f"below {minimum}"))
    if maximum is not None:
        options.append(bad(st.integers(min_value=maximum + 1), f"above {maximum}"))
    return st.one_of(options)


def bad_float(*, none_ok: bool = False) -> st.SearchStrategy[Arg]:
    """Not a real number (bools included), or not finite; ``none_ok`` as for :func:`bad_int`."""
    wrong = _WRONG_TYPE.filter(lambda v: v is not None) if none_ok else _WRONG_TYPE
    return st.one_of(
        bad(wrong | st.booleans(), "not a real number"),
        bad(st.sampled_from([math.nan, math.inf, -math.inf]), "not finite"),
    )


def bad_bool() -> st.SearchStrategy[Arg]:
    """Not a bool (0 and 1 included)."""
    return bad(_WRONG_TYPE | st.sampled_from([0, 1, 1.0, np.bool_(True)]), "not a bool")


def flag() -> st.SearchStrategy[Arg]:
    """A bool, or (sometimes) a value that is not one."""
    return mostly(good(st.booleans()), bad_bool())


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, BaseException | None]:
    """``(result, None)``, or ``(None, the exception)``: what the verdict judges."""
    try:
        return fn(*args, **kwargs), None
    except Exception as err:
        return None, err


def verdict(
    outcome: tuple[Any, BaseException | None],
    args: Mapping[str, Arg],
    *,
    names: Mapping[str, tuple[str, ...]] | None = None,
    extra_bad: Mapping[str, str] | None = None,
) -> Any:
    """Judge one call; return its result when every argument was valid.

    Args:
        outcome: from :func:`call`.
        args: the fuzzed arguments by name.
        names: other words that count as naming an argument in a message (e.g. an option's
            own name for a key of a dict argument); the argument's name always counts.
        extra_bad: reasons, by argument name, that the test worked out from combinations of
            arguments (each valid alone).

    Raises:
        AssertionError: a valid call raised, a bad call was accepted, or it raised something
            other than TypeError/ValueError, or a message that names no bad argument.
    """
    result, error = outcome
    bad_args = {name: a.bad for name, a in args.items() if a.bad is not None}
    bad_args.update(extra_bad or {})
    if not bad_args:
        if error is not None:
            raise AssertionError(f"valid arguments were rejected: {error!r}") from error
        return result
    if error is None:
        raise AssertionError(f"bad arguments {bad_args} were accepted; got {result!r:.200}")
    if not isinstance(error, TypeError | ValueError):
        raise AssertionError(
            f"bad arguments {bad_args} raised {type(error).__name__}, not TypeError or "
            f"ValueError: {error}"
        ) from error
    message = str(error)
    words = {name: (name, *(names or {}).get(name, ())) for name in bad_args}
    if not any(word in message for name in bad_args for word in words[name]):
        raise AssertionError(
            f"the message names none of the bad arguments {sorted(bad_args)}: "
            f"{type(error).__name__}: {message}"
        ) from error
    return None
