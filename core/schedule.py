"""The pure core of one recurring job: its interval and budget, parsed, and its schedule.

``JobSchedule`` is plain state with ``now`` passed in: it decides whether a due
tick starts a run (``RunNow``), is skipped (``SkipTick``: the previous run is
still in flight) or is stale (None: paused, cancelled, superseded), when the
next tick is due, and when the job stops (``max_runs``, budget, cancel). Ticks
stay on the grid ``start + k * interval``; ticks missed while late are skipped.

What must hold: at most one run of a job in flight, and ``runs <= max_runs``;
a job stops once ``cost >= max_cost`` (the run crossing the line is the last,
so the overshoot is at most one run's cost); a tick starts a run only if its
due time is the job's current ``next_run_at``, so a stale timer (after
pause/resume/cancel, or from a dead incarnation) never does; a late or
duplicate run report changes nothing; intervals are parsed strictly ("45s",
"30m", "2h", "1d", "hourly", "daily", or seconds) and a budget is a positive
USD amount of at least one nano-dollar.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from callboard.core.pricing import usd_to_nusd
from callboard.messages import ConfigError, Result, is_number

# -- parsing --------------------------------------------------------------------------------

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NAMED = {"hourly": 3600.0, "daily": 86400.0}
_INTERVAL = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_FORMS = "seconds as a number, '<n>s', '<n>m', '<n>h', '<n>d', 'hourly' or 'daily'"


def parse_interval(value: str | float) -> float:
    """Seconds from ``45``, ``"45s"``, ``"30m"``, ``"2h"``, ``"1d"``, ``"hourly"``, ``"daily"``."""
    seconds: float | None = None
    if is_number(value):
        try:
            seconds = float(value)
        except OverflowError:  # an int past any float (10**400): refused below as too long
            seconds = math.inf
    elif isinstance(value, str):
        match = _INTERVAL.fullmatch(value)
        if value in _NAMED:
            seconds = _NAMED[value]
        elif match is not None:
            seconds = float(match[1]) * _UNITS[match[2]]
    if seconds is None:
        raise ConfigError(f"interval must be {_FORMS}; got {_shown(value)}")
    if not math.isfinite(seconds) or not MIN_INTERVAL_S <= seconds <= MAX_INTERVAL_S:
        raise ConfigError(
            f"interval must be from {MIN_INTERVAL_S:g} s to {MAX_INTERVAL_S / 86400:.0f} days, "
            f"got {_shown(value)}"
        )
    return seconds


def _shown(value: object) -> str:
    """``value`` for an error message, cut short: an int of 10**400 has 401 digits, and
    past 4300 digits ``repr`` raises ``ValueError`` itself."""
    try:
        text = repr(value)
    except ValueError:
        return f"an {type(value).__name__} too long to show"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


SHOWN_CHARS = 40
"""How much of a refused value an error message shows."""


MIN_INTERVAL_S = 0.01
"""The shortest interval: a job ticking every 0.1 ms only skipped ticks (its run still
under way), each on a timer of its own, a core's worth of them (found by a hunt)."""
MAX_INTERVAL_S = 3650 * 86400.0
"""The longest, ten years: a next run past what a date can hold broke every later
``jobs()`` with an ``OverflowError`` (found by a hunt)."""


def parse_cost(value: Decimal | str | float) -> int:
    """A positive USD amount (``Decimal``, ``str``, ``int`` or ``float``) in nano-dollars."""
    amount = None
    if isinstance(value, Decimal | str | int | float) and not isinstance(value, bool):
        try:
            amount = Decimal(str(value)) if isinstance(value, float) else Decimal(value)
        except InvalidOperation:
            amount = None
    if amount is None or not amount.is_finite() or amount <= 0:
        raise ConfigError(f"max_cost must be a positive amount in USD; got {value!r}")
    nusd = usd_to_nusd(amount)
    if nusd <= 0:
        raise ConfigError(f"max_cost is below one nano-dollar; got {value!r}")
    return nusd


# -- the pure core --------------------------------------------------------------------------


class JobStatus(enum.Enum):
    ACTIVE = "active"
    PAUSED = "paused"
    STOPPED = "stopped"


class StopReason(enum.Enum):
    MAX_RUNS = "max_runs"
    BUDGET = "budget"
    CANCELLED = "cancelled"
    SYSTEM_STOPPED = "system_stopped"


@dataclass(frozen=True, slots=True)
class RunNow:
    """Decision: start run number ``run``; the next tick is at ``next_at`` (None: no more)."""

    run: int
    next_at: float | None


@dataclass(frozen=True, slots=True)
class SkipTick:
    """Decision: the previous run is still in flight; the next tick is at ``next_at``."""

    next_at: float


class JobSchedule:
    """When one job runs and when it stops; plain state, ``now`` passed in, no I/O."""

    def __init__(
        self, *, interval_s: float, max_runs: int | None = None, max_cost_nusd: int | None = None
    ) -> None:
        if not interval_s > 0:
            raise ConfigError(f"interval_s must be positive, got {interval_s!r}")
        self.interval_s = interval_s
        self.max_runs = max_runs
        self.max_cost_nusd = max_cost_nusd
        self.status = JobStatus.ACTIVE
        self.stop_reason: StopReason | None = None
        self.next_run_at: float | None = None
        self.runs = self.successes = self.failures = self.skipped = 0
        self.cost_nusd = 0
        self.in_flight: int | None = None
        self.last_result: Result | None = None
        self.last_error: str | None = None

    def start(self, now: float, *, run_immediately: bool = False) -> float:
        """Place the first tick; returns its time."""
        self.next_run_at = now if run_immediately else now + self.interval_s
        return self.next_run_at

    def _slot_after(self, at: float, now: float) -> tuple[float, int]:
        """The first grid time after both ``at`` and ``now``, and the grid steps to it."""
        steps = max(1, math.floor((now - at) / self.interval_s) + 1)
        return at + steps * self.interval_s, steps

    def due(self, now: float, at: float) -> RunNow | SkipTick | None:
        """A tick for ``at`` fired at ``now``: run, skip, or None when the tick is stale."""
        if self.status is not JobStatus.ACTIVE or at != self.next_run_at:
            return None
        next_at, steps = self._slot_after(at, now)
        self.skipped += steps - 1  # grid ticks that passed while the timer was late
        if self.in_flight is not None:
            self.skipped += 1
            self.next_run_at = next_at
            return SkipTick(next_at)
        self.runs += 1
        self.in_flight = self.runs
        last = self.max_runs is not None and self.runs >= self.max_runs
        self.next_run_at = None if last else next_at
        return RunNow(self.runs, self.next_run_at)

    def ended(self, run: int, result: Result | None, error: str | None = None) -> bool:
        """Run ``run`` ended (with a result, or an ``error`` if it never got one).

        Returns True if the job stopped because of it. A duplicate or late
        report (not the run in flight) changes nothing.
        """
        if run != self.in_flight:
            return False
        self.in_flight = None
        if result is not None:
            self.last_result = result
            self.cost_nusd += result.cost_nusd
        if result is not None and result.ok:
            self.successes += 1
            self.last_error = None
        else:
            self.failures += 1
            self.last_error = error if result is None else _describe(result)
        return self._maybe_stop()

    def _maybe_stop(self) -> bool:
        if self.status is JobStatus.STOPPED:
            return False
        if self.max_cost_nusd is not None and self.cost_nusd >= self.max_cost_nusd:
            self._stop(StopReason.BUDGET)
            return True
        if self.max_runs is not None and self.runs >= self.max_runs and self.in_flight is None:
            self._stop(StopReason.MAX_RUNS)
            return True
        return False

    def _stop(self, reason: StopReason) -> None:
        self.status, self.stop_reason, self.next_run_at = JobStatus.STOPPED, reason, None

    def pause(self) -> bool:
        if self.status is not JobStatus.ACTIVE:
            return False
        self.status = JobStatus.PAUSED
        return True

    def resume(self, now: float) -> float | None:
        """Back to active; returns the next tick to arm (ticks missed while paused are dropped)."""
        if self.status is not JobStatus.PAUSED:
            return None
        self.status = JobStatus.ACTIVE
        if self.next_run_at is not None and self.next_run_at <= now:
            self.next_run_at = self._slot_after(self.next_run_at, now)[0]
        return self.next_run_at

    def cancel(self, reason: StopReason = StopReason.CANCELLED) -> bool:
        """Stop for good (a run in flight still ends and is accounted)."""
        if self.status is JobStatus.STOPPED:
            return False
        self._stop(reason)
        return True


def _describe(result: Result) -> str:
    reason = getattr(result, "reason", None)
    detail = getattr(result, "detail", "")
    kind = type(result).__name__
    what = f"{kind}({reason.value})" if isinstance(reason, enum.Enum) else kind
    return f"{what}: {detail}"[:300] if detail else what
