"""Learn: what one finished call teaches the guards of the model it went to.

A model's guards are its circuit breaker, its rate limiter and its health
book. Every finished call is classified once (``outcome.classify``); the
breaker records the verdict against the permit the call held, the health
book takes in the call's latency and error, and the limiter settles the
call's reservation and reads the response's rate-limit headers
(``attempt.learn_limits``). What the call means for its *task* (retry, move
on, end) is decided apart from this, by ``attempt.judge``, from the
``Lesson`` returned here: the model actor of this process decides both at
once, while on a cluster the shared model actor learns and the process that
owns the task judges.

A 429 is no outage (the breaker hears it as neutral), but a model that has refused
every call with 429 for the breaker's ``give_up_s``, none served, is down as far as
its callers go: its breaker opens (``trip``), so its probes find when it serves
again and its waiting tasks give up ``give_up_s`` later, as for any outage.

What must hold: the breaker, the limiter and the health book each hear of a
call exactly once, in this order (the breaker before the limiter, so a 429
that opens the breaker also pauses the limiter), and only here. Pure: the
clocks are arguments.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Final

from callboard.core.attempt import NO_HEADERS, learn_limits, said
from callboard.core.breaker import Allow, CircuitBreaker
from callboard.core.health import LIMITED_RUN, HealthBook
from callboard.core.limiter import RateLimiter, RateLimitHeaders, Reservation, read_headers
from callboard.core.outcome import ErrorKind, Signal, Verdict, classify
from callboard.messages import BreakerState, CallResult, FailureReason

__all__ = ["Lesson", "learn", "lesson_of"]


RATE_LIMITED_RUN: Final = (
    "%s: rate limited: %d calls in a row refused (%s), none served since; its calls wait "
    "for the provider's limit"
)
"""What a model's shell logs when a ``Lesson`` says ``limited_run`` (model, count, the
last refusal's words)."""


@dataclass(frozen=True, slots=True)
class Lesson:
    """What a finished call said, as ``attempt.judge`` needs it."""

    verdict: Verdict
    headers: RateLimitHeaders
    """The rate-limit headers it carried (``NO_HEADERS`` when none)."""
    error: str
    """Its reason and detail in one line when it failed; "" when it succeeded."""
    limited_run: bool = False
    """This call's 429 made a run of them (``LIMITED_RUN`` in a row, none served): the
    model's shell says so, once a run (a provider that answered 429 to everything let
    5,000 tasks expire with no warning at the default level; found by a hunt)."""


def learn(
    r: CallResult,
    permit: Allow,
    reservation: Reservation,
    *,
    now: float,
    now_epoch: float,
    breaker: CircuitBreaker,
    limiter: RateLimiter,
    health: HealthBook,
) -> Lesson:
    """Record call ``r`` (admitted with ``permit`` and ``reservation``) in the model's
    guards at ``now`` (monotonic; ``now_epoch`` is the wall clock, for the headers'
    dates) and return what it said."""
    verdict = _verdict(r)
    breaker.record(now, verdict.breaker, permit)
    limited = verdict.reason is FailureReason.RATE_LIMITED
    give_up_s = breaker.config.give_up_s
    gap_s = math.inf if give_up_s is None else 2.0 * give_up_s  # 429s further apart: no run
    refused_for = health.limited_for(now, limited=limited, served=verdict.ok, gap_s=gap_s)
    # a 429 is no outage, but a provider that has refused every call for give_up_s is
    # down as far as its callers go: open, its probes find when it serves again, and
    # its tasks stop waiting give_up_s later (a run against one waited for weeks, 20
    # 429s a task at the limiter's floor of one call a minute; found by a hunt); a
    # half-open one's probe too: a 429 answers nothing, and it stayed half-open for good
    if (
        limited
        and give_up_s is not None
        and refused_for >= give_up_s
        and breaker.state is not BreakerState.OPEN
    ):
        breaker.trip(now)
    error = _error(r, verdict)
    shared = error  # the model's last error, which every caller sees: an answer's body
    if r.status_code is not None and not verdict.ok:  # (the provider's, which may echo
        shared = said(verdict.reason, r.status_code, "")  # the prompt) stays the task's
    health.observe(
        r,
        ok=verdict.ok,
        outage=verdict.breaker is not Signal.NEUTRAL and not verdict.ok,
        error=shared,
        refused=verdict.reason if verdict.breaker is Signal.FATAL else None,
        closed=breaker.state is BreakerState.CLOSED,
    )
    headers = _headers(r, now_epoch)
    learn_limits(limiter, now, reservation, r, headers)
    run = limited and health.limited_calls == LIMITED_RUN
    return Lesson(obeyed(verdict, headers), headers, error, run)


def lesson_of(r: CallResult, *, now_epoch: float) -> Lesson:
    """What call ``r`` says for its task, as ``learn`` returns it, without recording it
    in any guard: a call an owner made on a lease (``cluster``) is judged there and
    learnt by its model's shared actor, which says when a run of 429s is one."""
    verdict = _verdict(r)
    headers = _headers(r, now_epoch)
    return Lesson(obeyed(verdict, headers), headers, _error(r, verdict))


def _verdict(r: CallResult) -> Verdict:
    return classify(r.status_code, ErrorKind(r.error) if r.error else None, r.detail)


def _error(r: CallResult, verdict: Verdict) -> str:
    return "" if verdict.ok else said(verdict.reason, r.status_code, r.detail)


def _headers(r: CallResult, now_epoch: float) -> RateLimitHeaders:
    return read_headers(r.headers, now_epoch, r.heard_epoch) if r.headers else NO_HEADERS


def obeyed(verdict: Verdict, headers: RateLimitHeaders) -> Verdict:
    """``verdict`` as the server's ``x-should-retry`` has it, as OpenAI's and Anthropic's
    SDKs obey it before the status: ``false`` is not retried (a 429 the server will
    never take, a 5xx it says is final: callboard sent them again until the deadline,
    one refused 11 times; found by a hunt), ``true`` is, unless the account itself was
    refused (a key or quota: the breaker's, not one request's). What the breaker
    records is the status's, either way."""
    word = headers.should_retry
    if word is None or verdict.ok or word == verdict.retryable:
        return verdict
    if word and verdict.breaker is Signal.FATAL:
        return verdict
    return dataclasses.replace(verdict, retryable=word)
