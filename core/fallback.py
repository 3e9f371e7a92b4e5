"""Fallback: every rewrite of where a task may go, in one place.

Theory of operation
-------------------
A job carries its *plan*, written once by the router (``routing``):
``candidates``, a group (any of them will do, the first preferred), then
``fallbacks``, one at a time, in order. Call the group and each fallback a
*tier*. Two things decide where the job goes, kept apart:

* **What the task wants** is the plan. It changes only for reasons that hold
  for the rest of the task's life, one function each: ``leave`` (a model gave
  up on the job: attempts spent, refused, can never admit it), ``too_late``
  (a model cannot finish before the deadline, nor can any as slow),
  ``escalate`` (the deadline is near and the job still waits) and ``within``
  (the budget allows only some models). Each drops models or (escalation)
  reorders them, never adds one; a tier left empty hands over to the next.

* **Where it may go now** is ``place(job, down)``, derived each time from the
  plan and the models whose breaker is open or half-open, or that rest out a
  long Retry-After pause (``Availability``):
  the plan up to and including the first tier with a model up. A model that
  is down keeps its place in the plan, so its half-open probe takes a job
  from it and, once closed, the work goes back to it and off the fallback. If
  no model of the plan is up the job waits on all of them. A job whose every
  model is *given up on* (``Health.given_up``) waits for none: ``stranded``
  says why it ends, naming each model's last error.

  Neither a model being down nor a model handing a job back unsent (limiter,
  breaker, cap, new incarnation) rewrites the plan: the job goes back to the
  queue unchanged and is placed again.

What must hold: ``place`` is never empty, names only models of the plan, in
plan order, and includes every candidate; with nothing down it is the
candidates. A rewritten plan names no model twice, and ``leave`` and
``too_late`` never return a plan that still names the model left, or no plan
at all when a model remains. Pure: times and latencies come in as arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Container, Iterator, Mapping

from callboard.messages import BreakerState, FailureReason, Health, Job

__all__ = [
    "Availability",
    "escalate",
    "escalation_at",
    "leave",
    "place",
    "stranded",
    "too_late",
    "within",
]

Plan = tuple[tuple[str, ...], tuple[str, ...]]
"""(candidates, fallbacks)."""


class Availability:
    """Which models are down (breaker open or half-open, or resting), and which of them are given
    up on, from their ``Health`` reports. A model never reported is up: it grants no
    credit while its breaker is open, so trusting it loses nothing."""

    __slots__ = ("_down", "given_up")

    def __init__(self) -> None:
        self._down: set[str] = set()
        self.given_up: dict[str, tuple[FailureReason, str]] = {}
        """Model -> (why it is given up on, its last error)."""

    def observe(self, health: Health) -> bool:
        """Learn ``health``; True if the model went down or came back up. Down: its
        breaker open or half-open, or resting (a long Retry-After pause)."""
        model = health.model
        if health.given_up is None:
            self.given_up.pop(model, None)
        else:
            self.given_up[model] = (health.given_up, health.last_error)
        if health.breaker is BreakerState.CLOSED and not health.resting:
            if model in self._down:
                self._down.discard(model)
                return True
            return False
        if model in self._down:
            return False
        self._down.add(model)
        return True

    def __contains__(self, model: object) -> bool:
        return model in self._down

    def __bool__(self) -> bool:
        return bool(self._down)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._down))

    def __repr__(self) -> str:
        return f"Availability(down={sorted(self._down)})"


def place(job: Job, down: Container[str]) -> tuple[str, ...]:
    """The models ``job`` may be handed to now: its plan up to and including the
    first tier with a model up (every model of the plan if none is up)."""
    candidates = job.candidates
    if not down:  # the common case: nothing is down
        return candidates
    for model in candidates:
        if model not in down:
            return candidates
    placed = list(candidates)
    for model in job.fallbacks:
        placed.append(model)
        if model not in down:
            break
    return tuple(placed)


def stranded(job: Job, available: Availability) -> tuple[FailureReason, str] | None:
    """Why ``job`` ends now rather than wait, if every model of its plan is given up
    on: the first one's reason, and each one's last error; else None."""
    given_up = available.given_up
    if not given_up:  # the common case
        return None
    plan = (*job.candidates, *job.fallbacks)
    if any(m not in given_up for m in plan):
        return None
    words = [f"{m} is given up on ({given_up[m][1] or given_up[m][0].value})" for m in plan]
    return given_up[plan[0]][0], "; ".join(words)


def leave(job: Job, model: str) -> Job | None:
    """``job`` after ``model`` gave up on it for good; None if no model is left.
    Its count of calls at one model starts again from 0; the total goes on."""
    plan = _without(job.candidates, job.fallbacks, (model,))
    if plan is None:
        return None
    return dataclasses.replace(
        job, candidates=plan[0], fallbacks=plan[1], model_attempt=0, rate_limited=0
    )


def too_late(job: Job, model: str, left: float, latency: Mapping[str, float]) -> Job | None:
    """``job`` after ``model`` found it cannot finish in the ``left`` seconds to the
    deadline: without ``model`` and every model whose recent ``latency`` is as long.
    None if none is left, or no time is (the job expires)."""
    if left <= 0:
        return None
    slow = [model]
    slow += [m for m in (*job.candidates, *job.fallbacks) if latency.get(m, 0.0) >= left]
    plan = _without(job.candidates, job.fallbacks, slow)
    if plan is None:
        return None
    return dataclasses.replace(job, candidates=plan[0], fallbacks=plan[1])


def escalation_at(
    job: Job, target: str | None, *, margin_s: float, target_latency_s: float
) -> float | None:
    """When ``job``, still waiting then, escalates to ``target``: its deadline less the
    margin (at least twice the target's latency). None if it never does: no target, no
    deadline, or the plan does not hold ``target`` as a fallback (the router left it
    out for this task: capabilities, context window, budget)."""
    deadline = job.task.deadline_at
    if target is None or deadline is None or target not in job.fallbacks:
        return None
    return deadline - max(margin_s, 2 * target_latency_s)


def escalate(job: Job, target: str) -> Job | None:
    """``job`` with ``target`` heading its plan and the rest in order after it; None if
    the plan no longer holds ``target`` as a fallback (it left it, or heads it)."""
    if target not in job.fallbacks:
        return None
    rest = tuple(m for m in (*job.candidates, *job.fallbacks) if m != target)
    return dataclasses.replace(job, candidates=(target,), fallbacks=rest)


def within(
    candidates: tuple[str, ...], fallbacks: tuple[str, ...], allowed: Collection[str]
) -> Plan | None:
    """The plan keeping only the ``allowed`` models; None if it keeps none."""
    return _without(
        candidates, fallbacks, [m for m in (*candidates, *fallbacks) if m not in allowed]
    )


def _without(
    candidates: tuple[str, ...], fallbacks: tuple[str, ...], gone: Collection[str]
) -> Plan | None:
    """The plan without ``gone``; the first fallback left heads it if no candidate is."""
    if not gone:
        return candidates, fallbacks
    kept = tuple(m for m in candidates if m not in gone)
    rest = tuple(m for m in fallbacks if m not in gone)
    if not kept:
        if not rest:
            return None
        kept, rest = rest[:1], rest[1:]
    return kept, rest
