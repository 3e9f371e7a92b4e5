"""Health: a model's recent latency and error rate, whether it is given up on,
and when to report them.

``HealthBook`` folds each attempt into two exponentially weighted averages
(weight ``HEALTH_ALPHA``): the latency of successful calls and the rate of
outage signals. It keeps the last failed attempt's words (``last_error``) and
whether the provider refused us until someone acts (our key, our quota).

``given_up`` says whether tasks should stop waiting for this model: while its
breaker is OPEN, at once if the provider refused us, else once it has been
down for the breaker's ``give_up_s``. Half-open it is not, so a task can be
its probe.

``due`` says whether a ``Health`` report goes out now: when forced, when the
breaker moved, the model was given up on (or back) or began or ended resting
(``RESTING_S``) since the last report,
and otherwise at most every ``HEALTH_EVERY_S``, or once the model has stood idle
for ``IDLE_REPORT_S`` (its last figures are the ones that stay); ``report``
builds it. A report that comes due while the model is refilling (a call just
ended, its slot is free and the queue holds the model's credit for it) waits for
the refill, for ``IDLE_REPORT_S`` at most: taken before it, it would count the
slot as empty, and a busy model of one or two slots would say ``in_flight 0``.

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
from callboard.messages import BreakerState, CallResult, FailureReason, Health

__all__ = [
    "HEALTH_ALPHA",
    "HEALTH_EVERY_S",
    "IDLE_REPORT_S",
    "LIMITED_RUN",
    "RESTING_S",
    "Due",
    "HealthBook",
    "RecentLatency",
    "resting",
]

HEALTH_ALPHA = 0.1
"""Weight of the newest attempt in the latency and error-rate averages."""
HEALTH_EVERY_S = 1.0
"""Health is reported on every breaker change, and otherwise at most this often."""
IDLE_REPORT_S = 0.05
"""A model idle this long reports at once. Not at the instant it goes idle: a model of
one or two slots refilled from its queue is idle for a few milliseconds between calls,
and reporting then said ``in_flight 0`` of a model that was never idle."""


RESTING_S = 5.0
"""A model paused by a Retry-After (a 429's, a 503's or a 529's: ``core.attempt``)
for longer than this is *resting*: out, as if
its breaker were open, for tasks that have a fallback (which then serves them), until
its pause has this long left (its work comes back to it as it resumes). A shorter
pause (the usual per-minute limit's) is waited out: the limiter paces the model, and
a fallback, often dearer, is not worth it. A daily limit spent answers for hours."""


LATENCY_HALF_LIFE_S = 5.0
"""How fast a model's latency, as the queue weighs deadlines by it, fades once no new
answer moves it."""


class RecentLatency:
    """Each model's latency as its health reports say, for deciding that a job cannot
    finish before its deadline there: faded by half every ``LATENCY_HALF_LIFE_S``
    since the reported value last changed.

    The average moves only when an answer comes. One slow answer (a long essay, 3 s)
    made every later task with a 2 s deadline expire unsent, and as none was sent, no
    answer ever brought the average down (found by a hunt). Faded, it lets a job
    through once the evidence is old; that call's answer sets the average anew."""

    __slots__ = ("_falling", "_seen")

    def __init__(self, *, falling_fades_on: bool = False) -> None:
        self._seen: dict[str, tuple[float, float]] = {}
        """model -> (the latency reported, when its fading began)."""
        self._falling = falling_fades_on
        """A lower value fades on from when the last one began to (the average falls:
        its newest answers are quicker than it), not from now: ranking models by their
        latency, a model back from a slow spell was tried once every fade, and each
        answer moved its average a tenth of the way down, then faded it anew from there
        (minutes before it was first again; found by a hunt). Not for deadlines: there
        a value faded too far sends a job that cannot finish in time."""

    def observe(self, model: str, latency_s: float, now: float) -> None:
        seen = self._seen.get(model)
        if seen is not None and seen[0] == latency_s:
            return  # the same value reported again: its fading goes on
        falling = seen is not None and self._falling and latency_s < seen[0]
        self._seen[model] = (latency_s, seen[1] if falling and seen is not None else now)

    def get(self, model: str, now: float) -> float:
        seen = self._seen.get(model)
        if seen is None:
            return 0.0
        latency, since = seen
        return float(latency * 0.5 ** (max(0.0, now - since) / LATENCY_HALF_LIFE_S))

    def view(self, now: float) -> dict[str, float]:
        """Every model's, at ``now``."""
        return {model: self.get(model, now) for model in self._seen}


def resting(paused_until: float | None, now: float) -> bool:
    """Whether a pause until ``paused_until`` makes a model resting at ``now``."""
    return paused_until is not None and paused_until - now > RESTING_S


class Due(enum.Enum):
    """Why a health report goes out now."""

    FORCED = "forced"
    MOVED = "moved"
    """The breaker changed state since the last report."""
    PERIODIC = "periodic"


LIMITED_RUN = 3
"""The 429s a run of refusals needs before its length counts (``limited_for``)."""


class HealthBook:
    """One model's health averages and the last report made of them."""

    __slots__ = (
        "_idle_since",
        "_limited_last",
        "_limited_n",
        "_limited_since",
        "_news",
        "_owed",
        "_refill_since",
        "_refused",
        "_reported",
        "_reported_at",
        "error_rate",
        "last_error",
        "latency_ewma",
    )

    def __init__(self) -> None:
        self.latency_ewma: float | None = None
        self.error_rate = 0.0
        self.last_error = ""
        """The last failed attempt: its reason, status and detail."""
        self._refused: FailureReason | None = None
        """The provider refused us until someone acts (key, quota): since a call was
        last served with the breaker closed (a served probe closes it)."""
        self._reported: tuple[BreakerState, FailureReason | None, bool] | None = None
        self._reported_at = 0.0
        self._owed = False
        self._news = False
        """A call has ended since the last report."""
        self._idle_since: float | None = None
        """When the model was first seen idle with news unreported, or None."""
        self._refill_since: float | None = None
        """When the model was first seen refilling (see ``due``), or None."""
        self._limited_since: float | None = None
        """When a run of calls refused with 429 began, none served since; or None."""
        self._limited_last = 0.0
        """When the run's last 429 came."""
        self._limited_n = 0
        """The run's 429s."""

    def observe(
        self,
        r: CallResult,
        *,
        ok: bool,
        outage: bool,
        error: str = "",
        refused: FailureReason | None = None,
        closed: bool = False,
    ) -> None:
        """Fold one attempt into the latency and error-rate EWMAs; a failed one's
        ``error`` is the last error, and ``refused`` says the provider refused us;
        ``closed``: the breaker is closed, the attempt learnt."""
        self._news = True
        if ok and closed:  # served, and the breaker closed: the key or quota works
            self._refused = None  # again, whoever asks next (a refusal outlived a close
            # seen by no report, and a new outage was given up on at once, as a refused
            # key; found by a hunt). A late answer of a call sent before the refusal,
            # the breaker still open, says nothing of now (a review)
        elif not ok:
            self.last_error = error
            if refused is not None:
                self._refused = refused
        a = HEALTH_ALPHA
        if ok:
            took, last = r.ended_at - r.started_at, self.latency_ewma
            self.latency_ewma = took if last is None else last + a * (took - last)
        self.error_rate += a * ((1.0 if outage else 0.0) - self.error_rate)

    def limited_for(self, now: float, *, limited: bool, served: bool, gap_s: float) -> float:
        """After a call that was rate ``limited`` (a 429) or ``served``: how long the
        model has refused every call with 429, none served (0 when it has not), counted
        only once the run holds ``LIMITED_RUN`` 429s with none more than ``gap_s``
        apart (one 429 before an idle hour and one after it are no run of refusals, nor
        two 429s whose Retry-After was long; found by a review)."""
        if served:
            self._limited_since = None
        elif limited:
            since = self._limited_since
            if since is None or now - self._limited_last > gap_s:
                self._limited_since, self._limited_n = now, 0
            self._limited_last = now
            self._limited_n += 1
        since = self._limited_since
        if since is None or self._limited_n < LIMITED_RUN:
            return 0.0
        return now - since

    @property
    def limited_calls(self) -> int:
        """The 429s of the run ``limited_for`` counts (0 once a call was served)."""
        return 0 if self._limited_since is None else self._limited_n

    def given_up(self, now: float, breaker: CircuitBreaker) -> FailureReason | None:
        """Why tasks should stop waiting for this model now, or None (module docstring)."""
        state = breaker.state
        if state is BreakerState.CLOSED:
            self._refused = None
            return None
        if state is not BreakerState.OPEN:
            return None
        if self._refused is not None:
            return self._refused
        at = breaker.given_up_at()
        return FailureReason.PROVIDER_DOWN if at is not None and now >= at else None

    def give_up_due(self, now: float, breaker: CircuitBreaker) -> float | None:
        """When ``given_up`` will next change of itself (a timer for it), or None."""
        at = breaker.given_up_at()
        if at is None or at <= now or self._refused is not None:
            return None
        return at

    def due(
        self,
        now: float,
        state: BreakerState,
        *,
        in_flight: int,
        force: bool = False,
        given_up: FailureReason | None = None,
        refilling: bool = False,
        paused_until: float | None = None,
    ) -> Due | None:
        """Whether to report now, and why; a report due is recorded as made. A model
        seen idle for ``IDLE_REPORT_S`` reports (its last figures are the ones that
        stay); a report otherwise held back (the last went out less than a second
        ago, or the model is ``refilling``: a free slot whose credit the queue holds,
        for ``IDLE_REPORT_S`` at most) is owed: see ``owed_at``."""
        seen = (state, given_up, resting(paused_until, now))
        changed = seen != self._reported
        if in_flight > 0 or not self._news:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        if not refilling:
            self._refill_since = None
        elif self._refill_since is None:
            self._refill_since = now
        if force:
            why = Due.FORCED
        elif changed:
            why = Due.MOVED
        elif (
            now - self._reported_at >= HEALTH_EVERY_S or self._idle_for(now)
        ) and not self._awaiting_refill(now):
            why = Due.PERIODIC
        else:
            self._owed = True
            return None
        self._reported, self._reported_at, self._owed, self._news = seen, now, False, False
        self._idle_since = self._refill_since = None
        return why

    def _awaiting_refill(self, now: float) -> bool:
        return self._refill_since is not None and now < self._refill_since + IDLE_REPORT_S

    def _idle_for(self, now: float) -> bool:
        return self._idle_since is not None and now >= self._idle_since + IDLE_REPORT_S

    @property
    def owed_at(self) -> float | None:
        """When the report held back may go (so an idle model's last figures reach
        the router and the stats), or None if none is owed."""
        if not self._owed:
            return None
        at = self._reported_at + HEALTH_EVERY_S
        if self._idle_since is not None:
            at = min(at, self._idle_since + IDLE_REPORT_S)
        if self._refill_since is not None:  # not before the refill has had its time
            at = max(at, self._refill_since + IDLE_REPORT_S)
        return at

    def report(
        self,
        model: str,
        now: float,
        breaker: CircuitBreaker,
        limiter: RateLimiter,
        *,
        in_flight: int,
        cap: int,
        given_up: FailureReason | None = None,
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
            resting=resting(room.paused_until, now),
            given_up=given_up,
            last_error=self.last_error,
        )
