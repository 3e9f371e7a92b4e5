"""The retry policy: tenacity's strategies as a decision object, with a seeded rng."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import tenacity
from callboard.core.outcome import ErrorKind, Verdict, classify
from callboard.core.retry import (
    TRUSTED_RETRY_AFTER_S,
    GiveUp,
    Retry,
    RetryConfig,
    RetryPolicy,
    StopBeforeDeadline,
    WaitAtLeastRetryAfter,
)
from hypothesis import given, settings
from hypothesis import strategies as st

SERVER = classify(503, None)
RATE = classify(429, None)


def policy(seed: int = 0, **config: float) -> RetryPolicy:
    return RetryPolicy(RetryConfig(**config), random.Random(seed))  # type: ignore[arg-type]


def decide(
    p: RetryPolicy,
    attempt: int = 1,
    verdict: Verdict = SERVER,
    *,
    retry_after_s: float | None = None,
    now: float = 100.0,
    deadline: float | None = None,
) -> Retry | GiveUp:
    return p.decide(
        attempt=attempt, verdict=verdict, retry_after_s=retry_after_s, now=now, deadline=deadline
    )


def delay(decision: Retry | GiveUp) -> float:
    assert isinstance(decision, Retry), decision
    return decision.delay_s


def test_exponential_backoff_with_bounded_jitter() -> None:
    p = policy(max_attempts=10)
    for attempt, base in [(1, 0.25), (2, 0.5), (3, 1.0), (4, 2.0), (8, 20.0), (9, 20.0)]:
        d = delay(decide(p, attempt))
        assert base <= d <= base + 0.25


def test_retry_after_is_honoured() -> None:
    p = policy()
    assert delay(decide(p, 1, SERVER, retry_after_s=7.0)) == 7.0
    assert delay(decide(policy(max_s=1.0), 1, RATE, retry_after_s=90.0)) == 90.0  # not capped
    d = delay(decide(p, 1, SERVER, retry_after_s=0.1))  # shorter than the backoff: backoff wins
    assert 0.25 <= d <= 0.5


def test_a_429_that_says_when_goes_back_at_once_whatever_its_backoff() -> None:
    """The model pauses for the Retry-After for every task, so the refused one is sent no
    sooner; waiting a backoff of its own only let the tasks that were never refused go
    first when the pause ended. Its deadline still reads the Retry-After."""
    p = RetryPolicy(RetryConfig(max_rate_limited=50), random.Random(0))

    def after(refused: int, retry_after_s: float | None) -> float:
        return delay(
            p.decide(
                attempt=1,
                verdict=RATE,
                retry_after_s=retry_after_s,
                now=0.0,
                deadline=None,
                refused=refused,
            )
        )

    assert after(1, 0.1) == 0.0  # the first backoff is 0.25-0.5 s
    assert after(6, 1.0) == 0.0  # the sixth 429's is 8-8.25 s
    assert after(6, TRUSTED_RETRY_AFTER_S) == 0.0
    assert 8.0 <= after(6, 0.0) <= 8.25  # "now" says nothing: the backoff
    assert 8.0 <= after(6, None) <= 8.25
    assert after(12, TRUSTED_RETRY_AFTER_S + 1) == TRUSTED_RETRY_AFTER_S + 1  # at least it
    late = p.decide(
        attempt=1, verdict=RATE, retry_after_s=5.0, now=100.0, deadline=104.0, refused=1
    )
    assert isinstance(late, GiveUp), "a Retry-After past the deadline ends it now"


def test_attempts_run_out() -> None:
    p = policy(max_attempts=3)
    assert isinstance(decide(p, 1), Retry)
    assert isinstance(decide(p, 2), Retry)
    gave_up = decide(p, 3)
    assert isinstance(gave_up, GiveUp)
    assert "3 of 3 attempts" in gave_up.why
    assert isinstance(decide(policy(max_attempts=1), 1), GiveUp)


def test_no_retry_would_pass_the_deadline() -> None:
    p = policy(jitter_s=0.0)
    assert delay(decide(p, 1, now=100.0, deadline=100.26)) == 0.25
    late = decide(p, 1, now=100.0, deadline=100.25)
    assert isinstance(late, GiveUp)
    assert "deadline" in late.why
    assert isinstance(decide(p, 1, RATE, retry_after_s=5.0, now=100.0, deadline=104.0), GiveUp)
    assert isinstance(decide(p, 1, now=100.0, deadline=99.0), GiveUp)


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_non_retryable_verdicts_give_up_at_once(status: int) -> None:
    rng = random.Random(0)
    p = RetryPolicy(RetryConfig(), rng)
    before = rng.getstate()
    gave_up = decide(p, 1, classify(status, None), retry_after_s=1.0)
    assert gave_up == GiveUp("request_error is not retryable")
    assert rng.getstate() == before  # decided before any wait was computed


def test_a_success_is_not_retried() -> None:
    assert decide(policy(), 1, classify(200, None)) == GiveUp("success is not retryable")


UNFINISHED = (ErrorKind.DEADLINE, ErrorKind.CUT, ErrorKind.ABANDONED)
"""Calls that end their task unfinished: a deadline, a stream cut after its first
delta (the reader has part of an answer), a stream whose reader left."""


@pytest.mark.parametrize("kind", [k for k in ErrorKind if k not in UNFINISHED])
def test_transport_failures_are_retried(kind: ErrorKind) -> None:
    assert isinstance(decide(policy(), 1, classify(None, kind)), Retry)


@pytest.mark.parametrize("kind", UNFINISHED)
def test_an_unfinished_call_is_never_retried(kind: ErrorKind) -> None:
    assert isinstance(decide(policy(), 1, classify(None, kind)), GiveUp)


def test_a_call_cut_at_its_deadline_is_not_retried() -> None:
    assert isinstance(decide(policy(), 1, classify(None, ErrorKind.DEADLINE)), GiveUp)


def test_jitter_is_seeded_and_leaves_global_random_alone() -> None:
    random.seed(1234)
    before = random.getstate()
    a = [delay(decide(policy(seed=7), n)) for n in (1, 2, 3)]
    b = [delay(decide(policy(seed=7), n)) for n in (1, 2, 3)]
    c = [delay(decide(policy(seed=8), n)) for n in (1, 2, 3)]
    assert a == b
    assert a != c
    assert random.getstate() == before


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    attempt=st.integers(1, 40),
    retry_after=st.one_of(st.none(), st.floats(0, 100)),
    now=st.floats(0, 1e6),
    budget=st.one_of(st.none(), st.floats(0, 50)),
)
def test_every_retry_is_bounded_and_before_the_deadline(
    seed: int, attempt: int, retry_after: float | None, now: float, budget: float | None
) -> None:
    cfg = RetryConfig(max_attempts=50, max_rate_limited=50)
    deadline = None if budget is None else now + budget
    got = RetryPolicy(cfg, random.Random(seed)).decide(
        attempt=1,
        verdict=RATE,
        retry_after_s=retry_after,
        now=now,
        deadline=deadline,
        refused=attempt,  # a 429's backoff grows with the 429s met
    )
    if isinstance(got, GiveUp):
        assert deadline is not None
        return
    base = min(cfg.initial_s * cfg.exp_base ** (attempt - 1), cfg.max_s)
    if retry_after is not None and 0 < retry_after <= TRUSTED_RETRY_AFTER_S:
        assert got.delay_s == 0.0  # the model's pause holds it, every task's
        assert deadline is None or now + retry_after < deadline
    else:
        low = max(base, retry_after or 0.0)
        assert low <= got.delay_s <= max(base + cfg.jitter_s, retry_after or 0.0)
        assert deadline is None or now + got.delay_s < deadline


def test_built_from_tenacity_strategies_and_never_sleeps() -> None:
    p = policy()
    assert isinstance(p.wait, WaitAtLeastRetryAfter)
    assert isinstance(p.wait.inner, tenacity.wait.wait_combine)
    assert isinstance(p.stop_attempts, tenacity.stop_after_attempt)
    assert isinstance(p.stop_deadline, StopBeforeDeadline)
    assert isinstance(p.retrying.stop, tenacity.stop.stop_any)
    with pytest.raises(AssertionError, match="never sleeps"):
        p.retrying.sleep(1.0)


def test_bad_arguments_are_rejected() -> None:
    p = policy()
    with pytest.raises(ValueError, match="attempt"):
        decide(p, 0)
    with pytest.raises(ValueError, match="retry_after_s"):
        decide(p, 1, RATE, retry_after_s=-1.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_attempts", 0),
        ("max_attempts", 2.0),
        ("initial_s", -0.1),
        ("max_s", 0.1),
        ("exp_base", 0.5),
        ("jitter_s", float("inf")),
        ("jitter_s", "0.1"),
    ],
)
def test_config_names_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        replace(RetryConfig(), **{field: value})  # type: ignore[arg-type]


def test_a_429_is_not_an_attempt_and_429s_stop_at_max_rate_limited() -> None:
    """Issue 14: 429s counted toward max_attempts, so a limit lower than configured
    failed a quarter of the tasks. They are counted apart."""
    p = RetryPolicy(RetryConfig(max_attempts=2, max_rate_limited=3), random.Random(0))

    def after(refused: int) -> Retry | GiveUp:
        return p.decide(
            attempt=2, verdict=RATE, retry_after_s=0.1, now=0.0, deadline=None, refused=refused
        )

    assert isinstance(after(1), Retry)
    assert isinstance(after(2), Retry)
    assert after(3) == GiveUp("rate limited 3 times (max_rate_limited)")
    with_deadline = p.decide(
        attempt=2, verdict=RATE, retry_after_s=0.1, now=0.0, deadline=3600.0, refused=50
    )
    assert isinstance(with_deadline, Retry), "a deadline, not a count, ends a wait for room"
