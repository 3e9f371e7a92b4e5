"""What a finished call teaches a model's guards (core/learn.py), on a fake clock: the
breaker records the verdict against the call's permit, the limiter settles and reads
the rate-limit headers, the health book takes the latency and the error; the lesson
carries what ``attempt.judge`` needs."""

from __future__ import annotations

import pytest
from callboard.core.breaker import Allow, BreakerConfig, CircuitBreaker
from callboard.core.health import LIMITED_RUN, HealthBook
from callboard.core.learn import Lesson, learn
from callboard.core.limiter import Admit, LimiterConfig, RateLimiter
from callboard.core.outcome import Signal
from callboard.messages import BreakerState, CallResult, FailureReason, Usage

NOW = 100.0
WALL = 1_800_000_000.0


def guards() -> tuple[CircuitBreaker, RateLimiter, HealthBook, Allow, Admit]:
    breaker = CircuitBreaker(BreakerConfig(consecutive_failures=1, cooldown_s=5))
    limiter = RateLimiter(LimiterConfig(rpm=60, tpm=None), NOW)
    permit = breaker.before_call(NOW)
    admit = limiter.try_acquire(NOW, 10)
    assert isinstance(permit, Allow)
    assert isinstance(admit, Admit)
    return breaker, limiter, HealthBook(), permit, admit


def call(status: int, **fields: object) -> CallResult:
    return CallResult(
        task_id=1, attempt=1, started_at=NOW - 0.25, ended_at=NOW, status_code=status, **fields
    )


def test_an_answer_closes_nothing_and_teaches_the_latency() -> None:
    breaker, limiter, health, permit, admit = guards()
    r = call(200, usage=Usage(prompt_tokens=4, completion_tokens=2))
    lesson = learn(
        r, permit, admit.reservation, now=NOW, now_epoch=WALL,
        breaker=breaker, limiter=limiter, health=health,
    )  # fmt: skip
    assert lesson.verdict.ok
    assert lesson.verdict.breaker is Signal.SUCCESS
    assert lesson.error == ""
    assert breaker.state is BreakerState.CLOSED
    assert health.latency_ewma == 0.25
    assert limiter.outstanding == 0  # the reservation is settled


def test_a_429_pauses_the_limiter_for_its_retry_after_and_says_why() -> None:
    breaker, limiter, health, permit, admit = guards()
    r = call(429, headers=(("retry-after", "7"),), detail="slow down")
    lesson = learn(
        r, permit, admit.reservation, now=NOW, now_epoch=WALL,
        breaker=breaker, limiter=limiter, health=health,
    )  # fmt: skip
    assert lesson.verdict.reason is FailureReason.RATE_LIMITED
    assert lesson.headers.retry_after_s == 7.0
    assert "slow down" in lesson.error
    assert limiter.available_at(NOW) >= NOW + 7.0


@pytest.mark.parametrize(
    ("status", "said", "retryable"),
    [
        (502, "false", False),  # final, says the server
        (429, "false", False),  # a request it will never take
        (400, "true", True),  # worth sending again, says the server
        (401, "true", False),  # a refused key is the account's, whatever is said
        (502, "maybe", True),  # unreadable: the status decides
    ],
)
def test_the_servers_x_should_retry_decides_a_retry_as_the_sdks_obey_it(
    status: int, said: str, retryable: bool
) -> None:
    breaker, limiter, health, permit, admit = guards()
    r = call(status, headers=(("x-should-retry", said),))
    lesson = learn(
        r, permit, admit.reservation, now=NOW, now_epoch=WALL,
        breaker=breaker, limiter=limiter, health=health,
    )  # fmt: skip
    assert lesson.verdict.retryable is retryable
    if status == 502:  # the breaker records the status's word either way
        assert breaker.state is BreakerState.OPEN


def test_a_429_the_server_says_never_to_retry_pauses_no_other_call() -> None:
    breaker, limiter, health, permit, admit = guards()
    r = call(429, headers=(("x-should-retry", "false"), ("retry-after", "30")))
    learn(
        r, permit, admit.reservation, now=NOW, now_epoch=WALL,
        breaker=breaker, limiter=limiter, health=health,
    )  # fmt: skip
    assert limiter.paused_until is None
    assert limiter.available_at(NOW) <= NOW + 1.0  # its pace (60 rpm), no 30 s pause


def test_a_server_error_opens_a_breaker_that_allows_one_failure() -> None:
    breaker, limiter, health, permit, admit = guards()
    lesson = learn(
        call(500, detail="boom"), permit, admit.reservation, now=NOW, now_epoch=WALL,
        breaker=breaker, limiter=limiter, health=health,
    )  # fmt: skip
    assert lesson.verdict.reason is FailureReason.PROVIDER_ERROR
    assert breaker.state is BreakerState.OPEN
    assert health.last_error == "provider_error (HTTP 500)"
    assert lesson.error == "provider_error (HTTP 500): boom"  # the task's own words
    assert health.error_rate > 0


def test_the_models_shared_last_error_never_holds_what_the_provider_answered() -> None:
    """A provider's error body may echo the prompt (proxies and HTML error pages do):
    it stays in that task's own words, while the model's last error, which every
    caller sees (stats, the dashboard, another tenant's "given up on" refusal), says
    only the reason and status; a transport error's detail is callboard's own and
    stays."""
    breaker, limiter, health, permit, admit = guards()
    echoed = call(400, detail="<html>prompt=tenant A: patient has HIV</html>")
    lesson = learn(
        echoed, permit, admit.reservation, now=NOW, now_epoch=WALL,
        breaker=breaker, limiter=limiter, health=health,
    )  # fmt: skip
    assert "HIV" in lesson.error
    assert "HIV" not in health.last_error
    assert health.last_error == "request_error (HTTP 400)"
    refused = CallResult(
        task_id=2, attempt=1, started_at=NOW, ended_at=NOW, error="connection",
        detail="connection refused by 127.0.0.1:9",
    )  # fmt: skip
    breaker, limiter, health, permit, admit = guards()
    learn(
        refused, permit, admit.reservation, now=NOW, now_epoch=WALL,
        breaker=breaker, limiter=limiter, health=health,
    )  # fmt: skip
    assert health.last_error.endswith("connection refused by 127.0.0.1:9")


def _taught(breaker: CircuitBreaker, health: HealthBook, status: int, at: float) -> Lesson:
    """One call at ``at`` answered ``status`` (its own limiter: a 429 pauses one)."""
    permit = breaker.before_call(at)
    assert isinstance(permit, Allow)
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=None), at)
    admit = limiter.try_acquire(at, 10)
    assert isinstance(admit, Admit)
    r = CallResult(task_id=1, attempt=1, started_at=at - 0.1, ended_at=at, status_code=status)
    return learn(
        r, permit, admit.reservation, now=at, now_epoch=WALL,
        breaker=breaker, limiter=limiter, health=health,
    )  # fmt: skip


def test_a_model_that_refuses_every_call_with_429_for_give_up_s_is_down() -> None:
    """A 429 is no outage, so a provider answering 429 to everything never opened the
    breaker: a run against it waited for weeks (20 429s a task at the limiter's floor;
    found by a hunt). After ``give_up_s`` of nothing but 429s it opens, and its probes
    find when it serves again; one call served in between starts the count afresh."""
    config = BreakerConfig(consecutive_failures=1, cooldown_s=5, give_up_s=30)
    breaker, health = CircuitBreaker(config), HealthBook()
    for at in (NOW, NOW + 10, NOW + 29):
        _taught(breaker, health, 429, at)
        assert breaker.state is BreakerState.CLOSED
    _taught(breaker, health, 200, NOW + 29.5)  # served: the refusals start over
    _taught(breaker, health, 429, NOW + 30)
    _taught(breaker, health, 429, NOW + 59)
    assert breaker.state is BreakerState.CLOSED
    _taught(breaker, health, 429, NOW + 60)
    assert breaker.state is BreakerState.OPEN
    assert health.given_up(NOW + 60, breaker) is None  # down, not yet given up on
    _taught(breaker, health, 429, NOW + 66)  # a half-open probe's 429 answers nothing:
    assert breaker.state is BreakerState.OPEN  # open again (it stayed half-open for good)
    assert health.given_up(NOW + 90, breaker) is FailureReason.PROVIDER_DOWN


def test_a_model_never_given_up_on_is_never_opened_by_429s() -> None:
    config = BreakerConfig(consecutive_failures=1, give_up_s=float("inf"))
    breaker, health = CircuitBreaker(config), HealthBook()
    for k in range(10):
        _taught(breaker, health, 429, NOW + 1000 * k)
    assert breaker.state is BreakerState.CLOSED


def test_two_429s_an_idle_hour_apart_are_no_run_of_refusals() -> None:
    """One 429 before an idle hour and one after it opened the breaker, nothing sent
    between them; and two 429s with a long Retry-After did too (found by a review). A
    run needs three 429s, none more than twice give_up_s after the one before."""
    config = BreakerConfig(consecutive_failures=1, cooldown_s=5, give_up_s=60)
    breaker, health = CircuitBreaker(config), HealthBook()
    _taught(breaker, health, 429, NOW)
    _taught(breaker, health, 429, NOW + 3600)  # an hour later: a new run
    _taught(breaker, health, 429, NOW + 3661)  # two in this run, 61 s
    assert breaker.state is BreakerState.CLOSED
    _taught(breaker, health, 429, NOW + 3662)  # three: the run counts, and is 62 s long
    assert breaker.state is BreakerState.OPEN


def test_a_run_of_429s_is_said_once_as_it_becomes_one() -> None:
    """A provider that answered 429 to everything let 5,000 tasks expire with no warning
    at the default level (found by a hunt): the lesson that makes a run says so, once;
    a call served ends the run, and the next run is said again."""
    breaker, health = CircuitBreaker(BreakerConfig(consecutive_failures=1000)), HealthBook()
    said = [_taught(breaker, health, 429, NOW + k).limited_run for k in range(LIMITED_RUN + 3)]
    assert said == [k == LIMITED_RUN - 1 for k in range(LIMITED_RUN + 3)]
    assert not _taught(breaker, health, 200, NOW + 10).limited_run
    again = [_taught(breaker, health, 429, NOW + 11 + k).limited_run for k in range(LIMITED_RUN)]
    assert again == [k == LIMITED_RUN - 1 for k in range(LIMITED_RUN)]
