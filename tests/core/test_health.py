"""Health (core/health.py, pure): a model's latency and error-rate averages, and when a
``Health`` report goes out; on a fake clock (times are arguments)."""

from __future__ import annotations

import pytest
from callboard.core.breaker import BreakerConfig, CircuitBreaker
from callboard.core.health import (
    HEALTH_ALPHA,
    HEALTH_EVERY_S,
    IDLE_REPORT_S,
    LATENCY_HALF_LIFE_S,
    RESTING_S,
    Due,
    HealthBook,
    RecentLatency,
    resting,
)
from callboard.core.limiter import LimiterConfig, RateLimiter
from callboard.core.outcome import Signal
from callboard.messages import BreakerState, CallResult, FailureReason
from hypothesis import given
from hypothesis import strategies as st

CLOSED, OPEN = BreakerState.CLOSED, BreakerState.OPEN


def took(seconds: float) -> CallResult:
    return CallResult(task_id=1, attempt=1, started_at=10.0, ended_at=10.0 + seconds)


# -- the averages ---------------------------------------------------------------------------


def test_latency_is_unknown_until_the_first_success_and_only_successes_move_it() -> None:
    book = HealthBook()
    book.observe(took(5.0), ok=False, outage=True)
    assert book.latency_ewma is None
    book.observe(took(0.2), ok=True, outage=False)
    assert book.latency_ewma == pytest.approx(0.2)
    book.observe(took(9.0), ok=False, outage=True)
    assert book.latency_ewma == pytest.approx(0.2)
    book.observe(took(1.2), ok=True, outage=False)
    assert book.latency_ewma == pytest.approx(0.2 + HEALTH_ALPHA * (1.2 - 0.2))


def test_the_error_rate_moves_toward_the_share_of_outages() -> None:
    book = HealthBook()
    book.observe(took(0.1), ok=False, outage=True)
    assert book.error_rate == pytest.approx(HEALTH_ALPHA)
    book.observe(took(0.1), ok=False, outage=False)  # a failure that is not the provider's
    assert book.error_rate == pytest.approx(HEALTH_ALPHA * (1 - HEALTH_ALPHA))


@given(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=200))
def test_the_error_rate_stays_within_zero_and_one(outcomes: list[tuple[bool, bool]]) -> None:
    book = HealthBook()
    for ok, outage in outcomes:
        book.observe(took(0.1), ok=ok, outage=outage)
        assert 0.0 <= book.error_rate <= 1.0


# -- when to report ------------------------------------------------------------------------


def test_the_first_report_is_forced_or_moved() -> None:
    assert HealthBook().due(0.0, CLOSED, in_flight=3, force=True) is Due.FORCED
    assert HealthBook().due(0.0, CLOSED, in_flight=3) is Due.MOVED


def test_a_breaker_that_moved_reports_at_once() -> None:
    book = HealthBook()
    assert book.due(0.0, CLOSED, in_flight=3, force=True) is Due.FORCED
    assert book.due(0.1, OPEN, in_flight=3) is Due.MOVED
    assert book.due(0.2, CLOSED, in_flight=3) is Due.MOVED


def test_a_pause_long_enough_to_rest_reports_at_once_both_ways() -> None:
    """A Retry-After pause longer than ``RESTING_S`` takes the model out for tasks with a
    fallback: the queue hears it at once, not up to a second later, and hears it at
    once again when the pause has ``RESTING_S`` left (its work comes back)."""
    book = HealthBook()
    assert book.due(0.0, CLOSED, in_flight=3, force=True) is Due.FORCED
    assert book.due(0.1, CLOSED, in_flight=3, paused_until=2.0) is None  # short: waited out
    until = 0.2 + RESTING_S + 30
    assert book.due(0.2, CLOSED, in_flight=3, paused_until=until) is Due.MOVED
    assert book.due(0.3, CLOSED, in_flight=3, paused_until=until) is None
    assert book.due(until - RESTING_S, CLOSED, in_flight=3, paused_until=until) is Due.MOVED
    assert resting(until, 0.2)
    assert not resting(until, until - RESTING_S)
    assert not resting(None, 0.0)


def test_a_busy_model_reports_at_most_every_interval_and_owes_the_held_one() -> None:
    book = HealthBook()
    assert book.due(0.0, CLOSED, in_flight=3, force=True) is Due.FORCED
    assert book.owed_at is None
    book.observe(took(0.1), ok=True, outage=False)
    assert book.due(0.5, CLOSED, in_flight=3) is None
    assert book.owed_at == HEALTH_EVERY_S
    assert book.due(HEALTH_EVERY_S, CLOSED, in_flight=3) is Due.PERIODIC
    assert book.owed_at is None


def test_a_model_that_stays_idle_reports_its_last_figures_soon() -> None:
    book = HealthBook()
    assert book.due(0.0, CLOSED, in_flight=1, force=True) is Due.FORCED
    book.observe(took(0.1), ok=True, outage=False)
    assert book.due(0.2, CLOSED, in_flight=0) is None, "idle for an instant: not yet"
    assert book.owed_at == pytest.approx(0.2 + IDLE_REPORT_S), "a timer for it"
    assert book.due(0.2 + IDLE_REPORT_S, CLOSED, in_flight=0) is Due.PERIODIC
    assert book.due(0.5, CLOSED, in_flight=0) is None, "nothing new since: nothing to say"


def test_a_model_refilled_between_calls_is_not_reported_idle() -> None:
    """One slot refilled from the queue: idle a few milliseconds between calls, busy
    when the timer comes. It reports once a second, never ``in_flight 0``."""
    book = HealthBook()
    assert book.due(0.0, CLOSED, in_flight=1, force=True) is Due.FORCED
    for tenth in range(1, 10):
        now = tenth / 10
        book.observe(took(0.1), ok=True, outage=False)
        assert book.due(now, CLOSED, in_flight=0) is None
        owed = book.owed_at
        assert owed is not None
        assert book.due(owed, CLOSED, in_flight=1) is None, "busy again by then"
    assert book.owed_at == HEALTH_EVERY_S
    assert book.due(HEALTH_EVERY_S, CLOSED, in_flight=1) is Due.PERIODIC


def test_a_report_due_while_a_freed_slot_refills_waits_for_the_refill() -> None:
    """One slot, always busy: at the second a call ends, its slot's credit is with the
    queue. The report waits for the next call, and says ``in_flight 1``."""
    book = HealthBook()
    assert book.due(0.0, CLOSED, in_flight=1, force=True) is Due.FORCED
    book.observe(took(0.1), ok=True, outage=False)
    assert book.due(HEALTH_EVERY_S, CLOSED, in_flight=0, refilling=True) is None
    assert book.owed_at == pytest.approx(HEALTH_EVERY_S + IDLE_REPORT_S), "a timer for it"
    assert book.due(HEALTH_EVERY_S + 0.002, CLOSED, in_flight=1) is Due.PERIODIC


def test_a_refill_that_does_not_come_holds_the_report_no_longer_than_idle() -> None:
    book = HealthBook()
    assert book.due(0.0, CLOSED, in_flight=2, force=True) is Due.FORCED
    book.observe(took(0.1), ok=True, outage=False)
    assert book.due(HEALTH_EVERY_S, CLOSED, in_flight=1, refilling=True) is None
    late = HEALTH_EVERY_S + IDLE_REPORT_S
    assert book.due(late - 0.001, CLOSED, in_flight=1, refilling=True) is None
    assert book.due(late, CLOSED, in_flight=1, refilling=True) is Due.PERIODIC


def test_a_breaker_that_moved_reports_at_once_even_while_refilling() -> None:
    book = HealthBook()
    assert book.due(0.0, CLOSED, in_flight=1, force=True) is Due.FORCED
    assert book.due(0.1, OPEN, in_flight=0, refilling=True) is Due.MOVED


def test_a_report_is_recorded_as_made_only_when_due() -> None:
    book = HealthBook()
    book.due(0.0, CLOSED, in_flight=2, force=True)
    for now in (0.2, 0.4, 0.6, 0.8):
        assert book.due(now, CLOSED, in_flight=2) is None
    assert book.owed_at == HEALTH_EVERY_S  # from the last report made, not the last asked


# -- the report -------------------------------------------------------------------------------


def test_the_report_carries_the_figures_the_breaker_and_the_limiters_room() -> None:
    book = HealthBook()
    book.observe(took(0.25), ok=True, outage=False)
    book.observe(took(0.25), ok=False, outage=True)
    breaker = CircuitBreaker(BreakerConfig(consecutive_failures=1, cooldown_s=5.0))
    permit = breaker.before_call(0.0)
    breaker.record(0.0, Signal.OUTAGE, permit)  # type: ignore[arg-type]
    limiter = RateLimiter(LimiterConfig(rpm=60, tpm=None), 0.0)
    limiter.pause_until(2.0)
    health = book.report("m", 1.0, breaker, limiter, in_flight=2, cap=8)
    assert health.model == "m"
    assert (health.breaker, health.reopen_at) == (OPEN, 5.0)
    assert health.latency_ewma_s == pytest.approx(0.25)
    assert health.error_rate == round(HEALTH_ALPHA, 4)
    assert (health.in_flight, health.max_concurrency) == (2, 8)
    assert health.requests_headroom is not None
    assert health.tokens_headroom is None  # no token limit
    assert health.paused_until == 2.0
    assert not health.resting  # 1 s left: waited out


# -- given up on ------------------------------------------------------------------------


def failing_breaker(give_up_s: float | None = 10.0) -> CircuitBreaker:
    breaker = CircuitBreaker(
        BreakerConfig(consecutive_failures=1, cooldown_s=1.0, give_up_s=give_up_s)
    )
    breaker.record(0.0, Signal.OUTAGE, breaker.before_call(0.0))  # type: ignore[arg-type]
    return breaker


def test_a_model_down_longer_than_give_up_s_is_given_up_on_while_open() -> None:
    book, breaker = HealthBook(), failing_breaker()
    assert book.given_up(9.9, breaker) is None
    assert book.give_up_due(9.9, breaker) == 10.0, "a timer for the moment it changes"
    breaker.trip(10.0)
    assert book.given_up(10.0, breaker) is FailureReason.PROVIDER_DOWN
    breaker.advance(11.0)  # half-open: a task may be its probe
    assert book.given_up(11.0, breaker) is None
    assert book.given_up(1e9, failing_breaker(give_up_s=None)) is None, "None: never"


def test_a_refusal_gives_up_at_once_until_the_breaker_closes() -> None:
    book, breaker = HealthBook(), failing_breaker()
    book.observe(
        took(0.1),
        ok=False,
        outage=True,
        error="authentication (HTTP 401): no",
        refused=FailureReason.AUTHENTICATION,
    )
    assert book.given_up(0.0, breaker) is FailureReason.AUTHENTICATION
    assert book.give_up_due(0.0, breaker) is None
    breaker.advance(1.0)
    probe = breaker.before_call(1.0)
    breaker.record(1.0, Signal.SUCCESS, probe)  # type: ignore[arg-type]
    assert book.given_up(1.0, breaker) is None
    breaker.record(2.0, Signal.OUTAGE, breaker.before_call(2.0))  # type: ignore[arg-type]
    assert book.given_up(2.0, breaker) is None, "the refusal was forgotten when it closed"
    report = book.report(
        "m", 2.0, breaker, RateLimiter(LimiterConfig(None, None), 0.0), in_flight=0, cap=1
    )
    assert report.last_error == "authentication (HTTP 401): no"


def test_a_refusal_is_forgotten_once_a_call_is_served_though_none_asked_meanwhile() -> None:
    """It was forgotten only when ``given_up`` was asked while the breaker was closed:
    a served probe and two failing calls judged in one batch left it, and the new
    outage was given up on at once, as a refused key (found by a hunt)."""
    book, breaker = HealthBook(), failing_breaker()
    book.observe(
        took(0.1), ok=False, outage=True, error="401", refused=FailureReason.AUTHENTICATION
    )
    assert book.given_up(0.0, breaker) is FailureReason.AUTHENTICATION
    breaker.advance(1.0)
    breaker.record(1.0, Signal.SUCCESS, breaker.before_call(1.0))  # type: ignore[arg-type]
    book.observe(took(0.1), ok=True, outage=False, closed=True)
    breaker.record(1.5, Signal.OUTAGE, breaker.before_call(1.5))  # type: ignore[arg-type]
    assert breaker.state is BreakerState.OPEN  # open again before anyone asked
    assert book.given_up(1.5, breaker) is None  # an outage 0 s old: not given up on


def test_a_late_answer_while_the_breaker_is_open_keeps_the_refusal() -> None:
    """A call sent before the account ran out of quota, answered after: the breaker
    stays open (it ignores the late answer), and so does the refusal (a review)."""
    book, breaker = HealthBook(), failing_breaker()
    book.observe(
        took(0.1), ok=False, outage=True, error="429", refused=FailureReason.QUOTA_EXCEEDED
    )
    book.observe(took(0.1), ok=True, outage=False, closed=breaker.state is BreakerState.CLOSED)
    assert book.given_up(0.5, breaker) is FailureReason.QUOTA_EXCEEDED


def test_being_given_up_on_is_reported_at_once() -> None:
    book = HealthBook()
    assert book.due(0.0, OPEN, in_flight=0, force=True) is Due.FORCED
    assert book.due(0.1, OPEN, in_flight=0) is None
    assert book.due(0.2, OPEN, in_flight=0, given_up=FailureReason.PROVIDER_DOWN) is Due.MOVED


def test_a_latency_no_answer_has_moved_fades_so_a_deadline_job_goes_again() -> None:
    """One 3 s answer, then only tasks with 2 s deadlines: each expired unsent, and as
    none was sent no answer brought the average down (found by a hunt). The latency the
    queue weighs fades by half every ``LATENCY_HALF_LIFE_S`` since its value last
    changed; a report of the same value does not renew it, a new one does."""
    seen = RecentLatency()
    assert seen.get("a", 0.0) == 0.0
    seen.observe("a", 3.0, 100.0)
    seen.observe("a", 3.0, 100.0 + LATENCY_HALF_LIFE_S)  # the same average, reported again
    assert seen.get("a", 100.0) == 3.0
    assert seen.get("a", 100.0 + LATENCY_HALF_LIFE_S) == pytest.approx(1.5)
    assert seen.view(100.0 + 2 * LATENCY_HALF_LIFE_S) == {"a": pytest.approx(0.75)}
    seen.observe("a", 0.2, 200.0)  # an answer moved it
    assert seen.get("a", 200.0) == 0.2


def test_a_falling_latency_fades_on_where_ranking_asks_it_to() -> None:
    """For ranking (``falling_fades_on``), a lower value fades on from when the last one
    began to, and a higher one from now; for deadlines (the default) any new value
    fades from now."""
    ranking, deadlines = RecentLatency(falling_fades_on=True), RecentLatency()
    for seen in (ranking, deadlines):
        seen.observe("a", 0.8, 0.0)
        seen.observe("a", 0.4, 2 * LATENCY_HALF_LIFE_S)  # its answers got quicker
    assert ranking.get("a", 2 * LATENCY_HALF_LIFE_S) == pytest.approx(0.1)
    assert deadlines.get("a", 2 * LATENCY_HALF_LIFE_S) == pytest.approx(0.4)
    ranking.observe("a", 0.5, 2 * LATENCY_HALF_LIFE_S)  # slower again: from now
    assert ranking.get("a", 2 * LATENCY_HALF_LIFE_S) == pytest.approx(0.5)
