r"""Dynamic schedules among the survivors: dead ranks drop out of every step.

:func:`skip_dead` wraps a per-rank schedule (e.g. ``one_peer_exponential``) so that no
survivor sends to or waits for a dead rank. Two policies for a survivor whose scheduled
peer is dead:

- ``"bridge"`` (default): a message addressed to a dead rank goes where the dead rank would
  have sent it, hop after hop through dead ranks, until it reaches a survivor (dropped if it
  comes back to its sender). When a step is a permutation (each rank sends to one rank and
  receives from one, e.g. ``one_peer_exponential(exponential_two(n))`` for a power of two
  ``n``), the bridged step is the permutation's *first return* to the survivors, again a
  permutation, so the step stays doubly stochastic on the survivors and keeps their mean.
  Weights are re-made uniform (``Step.uniform``).
- ``"keep"``: dead ranks are removed from the step's lists; a survivor whose only peer is
  dead keeps its value that round. The receive weights left are scaled to sum 1 (the step
  stays column stochastic) but a survivor that would have sent to the dead rank sends
  nothing, so the survivors' mean is in general not kept.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

from gossamer.topology.dynamic import Step
from gossamer.topology.survivors import dead_set
from gossamer.topology.topology import check_int, check_rank

__all__ = ["SKIP_MODES", "drop_dead", "skip_dead"]

#: the policies of :func:`skip_dead` for a survivor whose scheduled peer is dead
SKIP_MODES = ("bridge", "keep")

_IDLE = Step((), (), 1.0, {}, {})


class _Steps:
    """Step ``k`` of every rank that asks, each rank's schedule started on first need."""

    def __init__(self, schedule: Callable[[int], Iterator[Step]]) -> None:
        self._schedule = schedule
        self._iterators: dict[int, Iterator[Step]] = {}
        self._current: dict[int, Step] = {}
        self.step = -1

    def advance(self) -> None:
        self.step += 1
        for rank, iterator in self._iterators.items():
            self._current[rank] = _next_step(iterator, rank)

    def of(self, rank: int) -> Step:
        if rank not in self._iterators:
            # A rank's steps are needed from its death on: catch its schedule up to now.
            iterator = self._iterators[rank] = self._schedule(rank)
            for _ in range(self.step):
                _next_step(iterator, rank)
            self._current[rank] = _next_step(iterator, rank)
        return self._current[rank]


def _next_step(iterator: Iterator[Step], rank: int) -> Step:
    step = next(iterator)
    if not isinstance(step, Step):
        raise TypeError(f"schedule({rank}) must yield topology.Step; got {step!r}")
    return step


def _one_send(steps: _Steps, dead: int) -> tuple[int, ...]:
    sends = steps.of(dead).send_ranks
    if len(sends) > 1:
        raise ValueError(
            f"mode='bridge' needs dead ranks to send to at most one rank per step; dead rank "
            f"{dead} sends to {sends} at step {steps.step}: use mode='keep'"
        )
    return sends


def _forward(steps: _Steps, sender: int, target: int, dead: frozenset[int]) -> int | None:
    """The survivor that ``sender``'s message to ``target`` reaches by hops through the dead."""
    seen = {sender}
    while target in dead:
        if target in seen:
            return None  # a cycle of dead ranks swallows it
        seen.add(target)
        sends = _one_send(steps, target)
        if not sends:
            return None
        target = sends[0]
    return None if target == sender else target


def _backward(steps: _Steps, receiver: int, dead: frozenset[int]) -> set[int]:
    """The survivors whose messages reach ``receiver`` directly or through dead ranks."""
    found: set[int] = set()
    todo = list(steps.of(receiver).recv_ranks)
    seen = {receiver}
    while todo:
        source = todo.pop()
        if source in seen:
            continue
        seen.add(source)
        if source not in dead:
            found.add(source)
            continue
        _one_send(steps, source)
        todo.extend(steps.of(source).recv_ranks)
    return found


def _bridged(steps: _Steps, rank: int, dead: frozenset[int]) -> Step:
    own = steps.of(rank)
    reached = (_forward(steps, rank, d, dead) for d in own.send_ranks)
    sends = sorted({s for s in reached if s is not None})
    return Step.uniform(sends, sorted(_backward(steps, rank, dead)))


def _kept(step: Step, dead: frozenset[int]) -> Step:
    recv = tuple(r for r in step.recv_ranks if r not in dead)
    send = tuple(d for d in step.send_ranks if d not in dead)
    total = step.self_weight + sum(step.src_weights[r] for r in recv)
    if total <= 0:
        return Step(send, (), 1.0, {}, {d: step.dst_weights[d] for d in send})
    return Step(
        send,
        recv,
        step.self_weight / total,
        {r: step.src_weights[r] / total for r in recv},
        {d: step.dst_weights[d] for d in send},
    )


def drop_dead(step: Step, dead: Collection[int]) -> Step:
    """``step`` with the ranks in ``dead`` removed, as ``skip_dead(..., mode="keep")`` does.

    Needs only this rank's own step: dead ranks leave the send and receive lists and the
    remaining receive weights (self weight included) are scaled to sum 1; with no weight
    left the rank keeps its value (self weight 1). Every survivor-to-survivor edge of the
    step is kept, so a rank whose step touches no dead rank gets its step back unchanged.

    Raises:
        TypeError: ``step`` is not a :class:`Step`, or ``dead`` not a collection of ints.
        ValueError: a negative rank in ``dead``.

    Example:
        >>> drop_dead(Step((2,), (2,), 0.5, {2: 0.5}, {2: 1.0}), {2}).self_weight
        1.0
    """
    if not isinstance(step, Step):
        raise TypeError(f"step must be a topology.Step; got {step!r}")
    if isinstance(dead, str | bytes) or not isinstance(dead, Collection):
        raise TypeError(f"dead must be a collection of ranks; got {dead!r}")
    # The world size is unknown here: a rank the step does not name changes nothing.
    return _kept(step, frozenset(check_int(r, "dead entries", minimum=0) for r in dead))


def _skipping(
    steps: _Steps, size: int, rank: int, dead: Collection[int], mode: str
) -> Iterator[Step]:
    while True:
        steps.advance()
        now = frozenset(dead_set(dead, size, "dead"))
        if rank in now:
            yield _IDLE
        elif mode == "keep":
            yield _kept(steps.of(rank), now)
        else:
            yield _bridged(steps, rank, now)


def skip_dead(
    schedule: Callable[[int], Iterator[Step]],
    size: int,
    rank: int,
    dead: Collection[int],
    *,
    mode: str = "bridge",
) -> Iterator[Step]:
    """Return ``rank``'s steps of ``schedule`` with the ranks in ``dead`` left out.

    ``dead`` is read again at every step, so a set that the caller grows as ranks die takes
    effect from the next step on; every survivor must see the same ``dead`` at the same
    step (agreeing on it is failure detection, not done here). A dead rank's own iterator
    yields idle steps (self weight 1, no peers), so positions stay aligned.

    With ``mode="bridge"`` (default) a message meant for a dead rank is forwarded along the
    dead rank's own schedule to the first survivor it reaches; the result is uniform-weight
    steps, doubly stochastic on the survivors when the original step is a permutation. With
    ``mode="keep"`` dead ranks are removed from each step and the remaining receive weights
    scaled to sum 1: a survivor whose peer is dead keeps its value that round. See the module
    docstring for the math.

    Args:
        schedule: ``schedule(r)`` returns a fresh iterator of rank ``r``'s steps from step 0,
            the same on every rank, e.g.
            ``functools.partial(one_peer_exponential, exponential_two(8))``. ``"bridge"``
            also starts the schedules of dead ranks (to know where they would have sent).
        size: Number of ranks.
        rank: The rank whose schedule is returned, in ``[0, size)``.
        dead: The dead ranks (a collection, read at every step).
        mode: ``"bridge"`` or ``"keep"``.

    Returns:
        An infinite iterator of ``Step``.

    Raises:
        TypeError: ``schedule`` is not callable, ``size`` or ``rank`` not an int, ``mode``
            not a str; later, a dead entry that is not an int or a schedule yielding
            something other than a ``Step``.
        ValueError: ``size < 1``, ``rank`` out of range, an unknown ``mode``; later, a dead
            rank out of range or repeated, or (``"bridge"``) a dead rank that sends to more
            than one rank in a step.

    Example:
        >>> from functools import partial
        >>> from gossamer.topology import exponential_two, one_peer_exponential
        >>> steps = skip_dead(partial(one_peer_exponential, exponential_two(8)), 8, 0, {1})
        >>> [next(steps).send_ranks for _ in range(3)]
        [(2,), (2,), (4,)]
    """
    if not callable(schedule):
        raise TypeError(f"schedule must be a callable rank -> Iterator[Step]; got {schedule!r}")
    size = check_int(size, "size", minimum=1)
    rank = check_rank(rank, size)
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, one of {SKIP_MODES}; got {mode!r}")
    if mode not in SKIP_MODES:
        raise ValueError(f"mode must be one of {SKIP_MODES}; got {mode!r}")
    dead_set(dead, size, "dead")
    return _skipping(_Steps(schedule), size, rank, dead, mode)
