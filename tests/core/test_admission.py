"""Admission: how many credits a model grants, with the breaker and the limiter (pure)."""

from __future__ import annotations

from callboard.core.admission import Grant, Hold, to_grant
from callboard.core.breaker import Allow, BreakerConfig, CircuitBreaker
from callboard.core.limiter import LimiterConfig, RateLimiter
from callboard.core.outcome import Signal

UNLIMITED = LimiterConfig(rpm=None, tpm=None)


def opened(now: float = 0.0, probes: int = 1) -> CircuitBreaker:
    cfg = BreakerConfig(consecutive_failures=1, cooldown_s=5.0, half_open_probes=probes)
    b = CircuitBreaker(cfg)
    permit = b.before_call(now)
    assert isinstance(permit, Allow)
    b.record(now, Signal.OUTAGE, permit)
    return b


def test_a_closed_breaker_grants_every_free_slot() -> None:
    limiter = RateLimiter(UNLIMITED, 0.0)
    assert to_grant(0.0, 8, CircuitBreaker(), limiter, 100.0, granted=3) == Grant(8)


def test_an_open_breaker_grants_nothing_before_its_reopen_time() -> None:
    limiter = RateLimiter(UNLIMITED, 0.0)
    assert to_grant(1.0, 8, opened(), limiter, 100.0) == Hold(5.0)


def test_a_half_open_breaker_grants_its_probe_slots_once() -> None:
    # Credits out may each come back as a call: a probe slot promised to one is not
    # granted again, however often the model looks (it used to grant one per look).
    limiter = RateLimiter(UNLIMITED, 0.0)
    b = opened(probes=2)
    assert b.advance(5.0)
    assert to_grant(5.0, 8, b, limiter, 100.0) == Grant(2)
    assert to_grant(5.0, 6, b, limiter, 100.0, granted=1) == Grant(1)
    assert to_grant(5.0, 6, b, limiter, 100.0, granted=2) == Hold(None)
