"""Races (hedging): one prompt sent to several models at once, the first ok result wins.

What must hold:

* Every entrant shares one ``trace_id``.
* The winner is the first ok result; if none succeeded, the last to fail.
* When the race is decided (or the caller's ``timeout`` passes) the losers
  not yet sent are cancelled; those already sent run to their end, their
  cost is counted, and their real results arrive in ``RaceResult.losers``.
* Only misuse raises a ``UsageError``, before anything is sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from callboard._futures import _collect, _Decider, _sync, cancel_unsent, new_trace_id
from callboard.messages import Request, Result, UsageError
from callboard.messages._results import NANO

if TYPE_CHECKING:
    from callboard._async import AsyncSystem
    from callboard._system import System


@dataclass(frozen=True, slots=True, kw_only=True)
class RaceResult:
    """How a race ended: the winner now, the losers' results when they end."""

    result: Result
    """The first successful result; if none succeeded, the last to fail."""
    trace_id: str
    losers: Future[tuple[Result, ...]] = field(repr=False, compare=False)
    """Every other entrant's result, in ``models`` order, once all have ended:
    ``Cancelled`` if it was never sent, else its real result (and cost)."""

    @property
    def ok(self) -> bool:
        return self.result.ok

    @property
    def text(self) -> str | None:
        return self.result.text

    @property
    def model(self) -> str | None:
        return self.result.model

    def total_cost_usd(self, timeout: float | None = None) -> Decimal:
        """The winner's cost plus every loser's (waits for the losers to end)."""
        losers = self.losers.result(timeout)
        return Decimal(self.result.cost_nusd + sum(r.cost_nusd for r in losers)) / NANO


class _Race:
    def __init__(
        self, system: System, prompt: Any, models: Sequence[str], fields: dict[str, Any]
    ) -> None:
        if isinstance(models, str) or not models:
            raise UsageError("race needs a non-empty list of models")
        if "model" in fields or "route" in fields:
            raise UsageError("race chooses the model: pass models=[...], not model= or route=")
        self.trace_id = fields.pop("trace_id", None) or new_trace_id("race")
        key = fields.pop("idempotency_key", None)  # one per entrant, or they refuse each other
        requests = [
            Request.of(
                prompt, model=m, idempotency_key=None if key is None else f"{key}:{m}", **fields
            )
            for m in models
        ]
        self.futures = system.submit_many(requests, trace_id=self.trace_id)
        self.decider = _Decider(self.futures, lambda r: r.ok)

    def outcome(self, winner: Result) -> RaceResult:
        index = self.decider.index
        losers = [f for i, f in enumerate(self.futures) if i != index]
        return RaceResult(result=winner, trace_id=self.trace_id, losers=_collect(losers))


def race(
    system: System | AsyncSystem,
    prompt: Any,
    /,
    models: Sequence[str],
    *,
    timeout: float | None = None,
    **fields: Any,
) -> RaceResult:
    """Hedge: send ``prompt`` to every model at once; the first ok result wins.

    The losers are cancelled if not yet sent; those already sent run to their
    end (their cost is accounted) and show up in ``RaceResult.losers``.
    """
    sync = _sync(system)
    entrants = _Race(sync, prompt, models, dict(fields))
    try:
        winner = entrants.decider.decided.result(timeout)
    finally:
        cancel_unsent(sync, entrants.futures)
    return entrants.outcome(winner)


async def arace(
    system: System | AsyncSystem,
    prompt: Any,
    /,
    models: Sequence[str],
    *,
    timeout: float | None = None,
    **fields: Any,
) -> RaceResult:
    """``race`` for asyncio."""
    sync = _sync(system)
    entrants = _Race(sync, prompt, models, dict(fields))
    try:
        decided = asyncio.wrap_future(entrants.decider.decided)
        winner = await asyncio.wait_for(decided, timeout)
    finally:
        cancel_unsent(sync, entrants.futures)
    return entrants.outcome(winner)
