"""Timing several implementations of one call against each other."""

from __future__ import annotations

from typing import Callable, Sequence


def alternating_rounds(fns: Sequence[Callable[[], object]], rounds: int,
                       time_one: Callable[[Callable[[], object]], float]) -> list[list[float]]:
    """Each of ``fns`` timed once per round by ``time_one`` (e.g. a median of repeated timings), in ``rounds``
    rounds that alternate the order, so that a drift of the device's speed during the measurement (clocks
    rising after the idle seconds of a compile, a neighbour's load) falls on every one alike. Returns each
    one's timings, one per round, in the order of ``fns``."""
    if rounds < 1:
        raise ValueError(f"rounds: expected at least 1, got {rounds}")
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            times[i].append(time_one(fns[i]))
    return times
