"""Health: a model's recent latency and error rate, and when to report them.

``HealthBook`` folds each attempt into two exponentially weighted averages
(weight ``HEALTH_ALPHA`` for the newest): the latency of successful calls, and
the rate of calls that said the provider is failing (an outage signal).
``due`` says whether a ``Health`` report goes out now: always when forced (a
new incarnation's first), when the breaker moved since the last report, and
otherwise at most every ``HEALTH_EVERY_S``; ``report`` builds it.

What must hold: ``error_rate`` stays within [0, 1]; ``latency_ewma`` is None
until the first successful call and only successes move it; a report is
recorded as made when ``due`` answers that it is due, never otherwise. Pure:
the clock, the breaker and the limiter are the caller's, read but not
changed.
"""

from __future__ import annotations

import enum

from callboard.core.breaker import CircuitBreaker
from callboard.core.limiter import RateLimiter
from callboard.messages import BreakerState, CallResult, Health

__all__ = ["HEALTH_ALPHA", "HEALTH_EVERY_S", "Due", "HealthBook"]

HEALTH_ALPHA = 0.1
"""Weight of the newest attempt in the latency and error-rate averages."""
HEALTH_EVERY_S = 1.0
"""Health is reported on every breaker change, and otherwise at most this often."""


class Due(enum.Enum):
    """Why a health report goes out now."""

    FORCED = "forced"
    MOVED = "moved"
    """The breaker changed state since the last report."""
    PERIODIC = "periodic"


class HealthBook:
    """One model's health averages and the last report made of them."""

    __slots__ = ("_news", "_owed", "_reported", "_reported_at", "error_rate", "latency_ewma")

    def __init__(self) -> None:
        self.latency_ewma: float | None = None
        self.error_rate = 0.0
        self._reported: BreakerState | None = None
        self._reported_at = 0.0
        self._owed = False
        self._news = False
        """A call has ended since the last report."""

    def observe(self, r: CallResult, *, ok: bool, outage: bool) -> None:
        """Fold one attempt into the latency and error-rate EWMAs."""
        self._news = True
        a = HEALTH_ALPHA
        if ok:
            took = r.ended_at - r.started_at
            self.latency_ewma = (
                took
                if self.latency_ewma is None
                else self.latency_ewma + a * (took - self.latency_ewma)
            )
        self.error_rate += a * ((1.0 if outage else 0.0) - self.error_rate)

    def due(
        self, now: float, state: BreakerState, *, in_flight: int, force: bool = False
    ) -> Due | None:
        """Whether to report now, and why; a report due is recorded as made. A model
        that has just gone idle reports at once (its last figures are the ones that
        stay); a report otherwise held back (the last went out less than a second
        ago) is owed: see ``owed_at``."""
        changed = state is not self._reported
        if force:
            why = Due.FORCED
        elif changed:
            why = Due.MOVED
        elif now - self._reported_at >= HEALTH_EVERY_S or (in_flight == 0 and self._news):
            why = Due.PERIODIC
        else:
            self._owed = True
            return None
        self._reported, self._reported_at, self._owed, self._news = state, now, False, False
        return why

    @property
    def owed_at(self) -> float | None:
        """When the report held back may go (so an idle model's last figures reach
        the router and the stats), or None if none is owed."""
        return self._reported_at + HEALTH_EVERY_S if self._owed else None

    def report(
        self,
        model: str,
        now: float,
        breaker: CircuitBreaker,
        limiter: RateLimiter,
        *,
        in_flight: int,
        cap: int,
    ) -> Health:
        """The ``Health`` message for ``model`` as it stands at ``now``."""
        room = limiter.headroom(now)
        return Health(
            model=model,
            breaker=breaker.state,
            reopen_at=breaker.reopen_at,
            latency_ewma_s=self.latency_ewma,
            error_rate=round(self.error_rate, 4),
            in_flight=in_flight,
            max_concurrency=cap,
            requests_headroom=room.requests,
            tokens_headroom=room.tokens,
            paused_until=room.paused_until,
        )
