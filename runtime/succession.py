"""Succession: what a model actor's new incarnation takes over from the one before.

A restart is a new actor, and the old one's limits must not die with it, or
invariant 2 (never more than rpm/tpm in any window, nothing sent while the
breaker is open) would break at every restart. So each model's live limiter
and breaker are kept by model name in the runtime's ``rt.kept_limits``, and
``inherit_limits`` hands a new incarnation its predecessor's limiter (what it
sent still in the windows, its calls in flight charged in full) and breaker
state (``CircuitBreaker.inherit``). ``reclaim_predecessors`` takes back from
the ledger the calls older incarnations left in flight, to be queued again.

What must hold: after ``inherit_limits`` the table holds the new
incarnation's limiter and breaker for its model; it is called on the new
actor's thread once the predecessor is dead, so only that thread touches
them from then on. No pykka here, and no locks but the ledger's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from callboard.core.breaker import CircuitBreaker
from callboard.core.limiter import RateLimiter
from callboard.messages import BreakerState, Job
from callboard.runtime.ledger import Ledger

__all__ = ["KeptLimits", "inherit_limits", "reclaim_predecessors"]


class KeptLimits(NamedTuple):
    """The limits of a model's live incarnation, kept for the next one."""

    limiter: RateLimiter
    breaker: CircuitBreaker


def inherit_limits(
    kept: dict[str, KeptLimits],
    model: str,
    limiter: RateLimiter,
    breaker: CircuitBreaker,
    clock: Callable[[], float],
) -> tuple[RateLimiter, int]:
    """Take over the limits ``kept`` for ``model``'s incarnation before into ``breaker``,
    and return the limiter to use with the count of its calls left charged in flight.
    ``kept`` is the runtime's table (``rt.kept_limits``); it then holds this incarnation's."""
    before = kept.get(model)
    abandoned = 0
    if before is not None:
        limiter, old = before
        abandoned = limiter.abandon_held()
        if old.state is not BreakerState.CLOSED:
            breaker.inherit(old, clock())
    kept[model] = KeptLimits(limiter, breaker)
    return limiter, abandoned


def reclaim_predecessors(ledger: Ledger, model: str, incarnation: int) -> list[Job]:
    """The calls in flight at ``model``'s incarnations before ``incarnation``, taken
    back in the ledger (those it still had there)."""
    return [
        job
        for job, inc in ledger.in_flight_of(model, below=incarnation)
        if ledger.reclaim(job, model, inc)
    ]
