"""The retry policy: after a failed call, retry after a delay, or give up.

Theory of operation
-------------------
``RetryPolicy.decide`` is a decision object in tenacity's sense: it answers
``Retry(delay_s)`` or ``GiveUp(why)`` and the model actor carries it out (a
timer, never a sleep). The computation is tenacity's own strategies,
evaluated on a ``tenacity.RetryCallState`` built for the failed attempt, in
the order ``BaseRetrying.iter`` runs them -- retry?, then wait, then stop:

* retry:  ``retry_if_result`` on the attempt's ``Verdict``: a non-retryable
  verdict gives up at once;
* wait:   ``WaitAtLeastRetryAfter(wait_exponential(initial_s, max_s, exp_base)
  + WaitSeededJitter(rng, jitter_s))``: exponential backoff capped at
  ``max_s``, plus ``uniform(0, jitter_s)`` from the injected ``random.Random``
  (tenacity's own jitter strategies use the global ``random``), and never less
  than the provider's Retry-After;
* stop:   ``stop_after_attempt(max_attempts) | StopBeforeDeadline()``: no more
  than ``max_attempts`` calls in all, and no retry that would start at or
  after the task's deadline.

A 429 (RATE_LIMITED) is not an attempt: the provider refused the call before
doing any work, and the limiter paces the model after it. 429s are counted
apart (``refused``), their backoff grows with that count, the deadline rule
holds, and a task without a deadline stops at ``max_rate_limited``. A 429 that
says when to come back (a Retry-After over 0 and at most ``TRUSTED_RETRY_AFTER_S``,
OpenAI's SDK's bound) is retried at once (``Retry(0)``), unless that time passes
its deadline: its model's limiter pauses that long for every task (``core.attempt``),
so it is called again no sooner, and meanwhile it waits in the queue, where
priority decides who goes first when the pause ends (or another model of its route
takes it). A backoff of its own only let the tasks that were never refused go
first: a CRITICAL task refused once waited its 1 s of backoff while LOW tasks took
the room the 200 ms pause freed. A Retry-After of 0, or of more than that, keeps
the backoff, at least the Retry-After.

The attempt's facts (verdict, Retry-After, deadline) travel as the state's
outcome value, read by each strategy as ``wait_exception`` reads an exception.
``BaseRetrying.iter`` itself is not called (it keeps thread-local statistics,
reads ``time.monotonic()`` and raises ``RetryError``): the three strategy
calls are its decision without those effects; ``start_time`` and
``outcome_timestamp`` are overwritten with ``now``, so no result reads the clock.

What always holds: ``attempt`` counts calls already made (>= 1); a
non-retryable verdict never retries; ``delay_s`` is 0 after a 429 with a trusted
Retry-After (``now`` + it before the deadline), else at least Retry-After and in
``[min(initial_s * exp_base**(attempt-1), max_s), that + jitter_s]``;
``now + delay_s < deadline`` for every ``Retry``; equal seeds give equal delays.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Final

import tenacity
from callboard.core.outcome import Verdict
from callboard.messages import ConfigError, FailureReason, is_number
from tenacity.stop import stop_base
from tenacity.wait import wait_base

__all__ = [
    "TRUSTED_RETRY_AFTER_S",
    "AttemptFacts",
    "GiveUp",
    "Retry",
    "RetryConfig",
    "RetryPolicy",
    "StopBeforeDeadline",
    "WaitAtLeastRetryAfter",
    "WaitSeededJitter",
]


TRUSTED_RETRY_AFTER_S: Final = 60.0
"""The longest Retry-After after which a 429 is retried at once, its model's pause
holding it (OpenAI's SDK waits out at most this long a Retry-After too)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryConfig:
    """How often and how patiently a model actor retries."""

    max_attempts: int = 4
    """Calls in all, the first included (1 = never retry)."""
    initial_s: float = 0.25
    """The backoff before the first retry (before jitter)."""
    max_s: float = 20.0
    """The cap on the exponential part of the backoff."""
    exp_base: float = 2.0
    """Each retry multiplies the backoff by this (>= 1)."""
    jitter_s: float = 0.25
    """A uniform random [0, jitter_s) added to every backoff."""
    max_rate_limited: int = 20
    """429s a task without a deadline may meet at one model before it gives up there
    (429s do not count against ``max_attempts``; a task with a deadline waits for
    room until its deadline)."""

    def __post_init__(self) -> None:
        for name in ("max_attempts", "max_rate_limited"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {n!r}")
        for name in ("initial_s", "max_s", "exp_base", "jitter_s"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.exp_base < 1:
            raise ConfigError(f"exp_base must be >= 1, got {self.exp_base!r}")
        if self.max_s < self.initial_s:
            raise ConfigError(
                f"max_s must be >= initial_s ({self.initial_s!r}), got {self.max_s!r}"
            )


@dataclass(frozen=True, slots=True)
class Retry:
    """Call again after ``delay_s`` seconds."""

    delay_s: float


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Do not call again; ``why`` says which rule stopped it."""

    why: str


@dataclass(frozen=True, slots=True)
class AttemptFacts:
    """What the strategies need to know about the failed attempt (the outcome value)."""

    verdict: Verdict
    retry_after_s: float | None
    deadline: float | None


def facts_of(retry_state: tenacity.RetryCallState) -> AttemptFacts:
    """The ``AttemptFacts`` a state built by ``RetryPolicy`` carries as its outcome."""
    if retry_state.outcome is None:
        raise RuntimeError("retry state has no outcome yet")
    facts = retry_state.outcome.result()
    if not isinstance(facts, AttemptFacts):
        raise TypeError(f"retry state outcome is {type(facts).__name__}, not AttemptFacts")
    return facts


class WaitSeededJitter(wait_base):
    """``uniform(0, jitter_s)`` from an injected ``random.Random`` (not the global one)."""

    def __init__(self, rng: random.Random, jitter_s: float) -> None:
        self.rng = rng
        self.jitter_s = jitter_s

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:  # noqa: ARG002 - tenacity's signature
        return self.rng.uniform(0.0, self.jitter_s)


class WaitAtLeastRetryAfter(wait_base):
    """The inner wait, but never less than the attempt's Retry-After."""

    def __init__(self, inner: wait_base) -> None:
        self.inner = inner

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        floor = facts_of(retry_state).retry_after_s or 0.0
        return max(self.inner(retry_state), floor)


class StopBeforeDeadline(stop_base):
    """Stop when the retry would start at or after the attempt's deadline."""

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        deadline = facts_of(retry_state).deadline
        if deadline is None:
            return False
        if retry_state.outcome_timestamp is None:
            raise RuntimeError("retry state has no outcome timestamp")
        return retry_state.outcome_timestamp + retry_state.upcoming_sleep >= deadline


def _retryable(facts: Any) -> bool:
    return isinstance(facts, AttemptFacts) and facts.verdict.retryable


def _never_sleep(seconds: float) -> None:
    raise AssertionError(f"the retry policy decides, it never sleeps (asked for {seconds}s)")


class RetryPolicy:
    """Decides, after a failed call, whether and when to call again."""

    def __init__(self, config: RetryConfig, rng: random.Random) -> None:
        self.config = config
        backoff = tenacity.wait_exponential(
            multiplier=config.initial_s, max=config.max_s, exp_base=config.exp_base
        )
        self.retry = tenacity.retry_if_result(_retryable)
        self.wait = WaitAtLeastRetryAfter(backoff + WaitSeededJitter(rng, config.jitter_s))
        self.stop_attempts = tenacity.stop_after_attempt(config.max_attempts)
        self.stop_deadline = StopBeforeDeadline()
        self.retrying = tenacity.Retrying(
            retry=self.retry,
            wait=self.wait,
            stop=self.stop_attempts | self.stop_deadline,
            sleep=_never_sleep,
        )
        """The strategies as one tenacity object (the state's ``retry_object``)."""

    def decide(
        self,
        *,
        attempt: int,
        verdict: Verdict,
        retry_after_s: float | None,
        now: float,
        deadline: float | None,
        refused: int = 0,
    ) -> Retry | GiveUp:
        """After the ``attempt``-th call failed with ``verdict``: retry, or give up?
        ``refused`` counts the 429s met so far, this one included if it is one."""
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
            raise ValueError(f"attempt must be an integer >= 1 (calls made), got {attempt!r}")
        if retry_after_s is not None and not (math.isfinite(retry_after_s) and retry_after_s >= 0):
            raise ValueError(f"retry_after_s must be a finite number >= 0, got {retry_after_s!r}")
        rate_limited = verdict.reason is FailureReason.RATE_LIMITED
        n = max(1, refused) if rate_limited else attempt
        state = self._state(n, AttemptFacts(verdict, retry_after_s, deadline), now)
        what = verdict.reason.value if verdict.reason is not None else "success"
        if not self.retry(state):
            return GiveUp(f"{what} is not retryable")
        said = retry_after_s if rate_limited else None  # a 429's word on when to come back
        if said is not None and 0.0 < said <= TRUSTED_RETRY_AFTER_S:
            state.upcoming_sleep = said  # sent no sooner: the deadline rule reads it
            delay = 0.0  # to the queue now: the model's pause holds every task till then
        else:
            state.upcoming_sleep = delay = self.wait(state)
        if rate_limited:  # with a deadline, only the deadline ends a wait for room
            if deadline is None and refused >= self.config.max_rate_limited:
                return GiveUp(f"rate limited {refused} times (max_rate_limited)")
        elif self.stop_attempts(state):
            return GiveUp(f"{what} after {attempt} of {self.config.max_attempts} attempts")
        if self.stop_deadline(state):
            return GiveUp(f"{what}: a retry in {delay:.3f}s would pass the deadline")
        return Retry(delay)

    def _state(self, attempt: int, facts: AttemptFacts, now: float) -> tenacity.RetryCallState:
        state = tenacity.RetryCallState(self.retrying, fn=None, args=(), kwargs={})
        state.start_time = now
        state.attempt_number = attempt
        state.outcome = tenacity.Future.construct(attempt, facts, has_exception=False)
        state.outcome_timestamp = now
        return state
