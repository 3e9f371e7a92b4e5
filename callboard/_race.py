"""Races (hedging): one prompt sent to several models at once, the first ok result wins.

``racing`` is the pattern, once (see ``_futures``): ``race`` waits on it
blocking, ``arace`` awaits it.

What must hold:

* Every entrant shares one ``trace_id``.
* The winner is the first ok result; if none succeeded, the last to fail.
* When the race is decided (or the caller's ``timeout`` passes) the losers
  not yet sent are cancelled; those already sent run to their end, their
  cost is counted, and their real results arrive in ``RaceResult.losers``.
* Only misuse raises a ``UsageError``, before anything is sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from callboard._futures import Decider, Steps, await_steps, collect, wait_steps
from callboard._submitter import (
    Face,
    cancel_unsent,
    checked_fields,
    checked_trace_id,
    new_trace_id,
    request_of,
    submitter_of,
)
from callboard.messages import Result, UsageError
from callboard.messages._results import NANO


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


def racing(
    face: Face, prompt: Any, models: Sequence[str], fields: dict[str, Any]
) -> Steps[RaceResult]:
    """Send ``prompt`` to every model at once (one trace id); the first ok result wins."""
    submitter = submitter_of(face)
    if isinstance(models, str) or not models:
        raise UsageError("race needs a non-empty list of models")
    if "model" in fields or "route" in fields:
        raise UsageError("race chooses the model: pass models=[...], not model= or route=")
    checked_fields(fields, "race", ("trace_id",))
    fields = dict(fields)
    trace_id = checked_trace_id(fields.pop("trace_id", None)) or new_trace_id("race")
    key = fields.pop("idempotency_key", None)  # one per entrant, or they refuse each other
    allowed = fields.pop("models_allowed", None)
    requests = [  # keyed by place: the same model twice would refuse its twin
        request_of(
            prompt,
            {
                **fields,
                "model": m,
                "idempotency_key": None if key is None else f"{key}:{i}",
                # each entrant its own model: one failing over to its fallback sent the
                # prompt to another entrant's model a second time, both paid for
                "models_allowed": (m,) if allowed is None else _within(allowed, m),
            },
        )
        for i, m in enumerate(models)
    ]
    futures = submitter.submit_many(requests, trace_id=trace_id)
    decider = Decider(futures, lambda r: r.ok)
    try:
        winner: Result = yield decider.decided
    finally:
        cancel_unsent(submitter, futures)
    losers = [f for i, f in enumerate(futures) if i != decider.index]
    return RaceResult(result=winner, trace_id=trace_id, losers=collect(losers))


def _within(allowed: Any, model: str) -> Any:
    """The caller's ``models_allowed`` narrowed to ``model`` (as it came, if it is not a
    collection of names: the request refuses it by name)."""
    if isinstance(allowed, str) or not isinstance(allowed, Iterable):
        return allowed
    names = list(allowed)
    return (model,) if model in names else names  # not allowed: the router says so


def race(
    face: Face,
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
    return wait_steps(racing(face, prompt, models, fields), timeout)


async def arace(
    face: Face,
    prompt: Any,
    /,
    models: Sequence[str],
    *,
    timeout: float | None = None,
    **fields: Any,
) -> RaceResult:
    """``race`` for asyncio."""
    return await await_steps(racing(face, prompt, models, fields), timeout)
