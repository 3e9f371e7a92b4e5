"""Recurring jobs: submit one request every interval, within a run count and a budget.

    job = every(cb, "30m", "Summarise the overnight tickets", max_runs=48, max_cost="0.50")
    job.pause(); job.resume(); job.cancel(); jobs(cb)  # each JobInfo: runs, cost, next run

Theory of operation. ``JobSchedule`` is the pure core of one job: given
``now`` it decides whether a due tick starts a run, is skipped (the previous
run is still in flight: runs of one job never overlap) or is stale (paused,
cancelled, or superseded), when the next tick is due, and when the job stops
(``max_runs`` reached, budget spent, cancelled). Ticks stay on the grid
``start + k * interval``; ticks missed while late are skipped, not caught up.

``JobsActor`` carries the decisions out. Its timers are messages
(``rt.after`` tells it ``JobDue``), never a thread sleeping per job; a run's
result comes back as a ``RunEnded`` message sent by the result future's
done-callback. Like the ledger for tasks, the ``JobTable`` is the truth: a
thread-safe store outside the actor (kept in ``rt.extras``), written only by
the actor, so a restarted incarnation re-arms every timer from it, and
listing jobs never needs the actor.

What must hold: at most one run of a job in flight, and ``runs <= max_runs``;
a job stops once ``cost >= max_cost`` (the run crossing the line is the last,
so the overshoot is at most one run's cost); a tick starts a run only if its
due time is the job's current ``next_run_at``, so a stale timer (after
pause/resume/cancel, or from a dead incarnation) never does; intervals are
parsed strictly ("45s", "30m", "2h", "1d", "hourly", "daily", or seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import math
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, TypeVar

import pykka

from callboard.actors._base import Actor, Runtime
from callboard.actors.pricing import usd_to_nusd
from callboard.messages import (
    CallboardError,
    ConfigError,
    Request,
    Result,
    SystemStoppedError,
    UsageError,
)
from callboard.messages._results import NANO
from callboard.supervisor.address_book import AddressBook

if TYPE_CHECKING:
    from ._system import System

__all__ = [
    "JOBS",
    "AddJob",
    "ControlJob",
    "JobAction",
    "JobDue",
    "JobHandle",
    "JobInfo",
    "JobSchedule",
    "JobSpec",
    "JobStatus",
    "JobTable",
    "JobsActor",
    "RunEnded",
    "RunNow",
    "SkipTick",
    "StopReason",
    "ensure_started",
    "every",
    "job_spec",
    "jobs",
    "parse_cost",
    "parse_interval",
    "stop_jobs",
    "table_of",
]

JOBS = "jobs"
"""The jobs actor's name in the address book."""
T = TypeVar("T")

# -- parsing --------------------------------------------------------------------------------

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NAMED = {"hourly": 3600.0, "daily": 86400.0}
_INTERVAL = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_FORMS = "seconds as a number, '<n>s', '<n>m', '<n>h', '<n>d', 'hourly' or 'daily'"


def parse_interval(value: str | float) -> float:
    """Seconds from ``45``, ``"45s"``, ``"30m"``, ``"2h"``, ``"1d"``, ``"hourly"``, ``"daily"``."""
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        match = _INTERVAL.fullmatch(value)
        if value in _NAMED:
            seconds = _NAMED[value]
        elif match is not None:
            seconds = float(match[1]) * _UNITS[match[2]]
    if seconds is None:
        raise ConfigError(f"interval must be {_FORMS}; got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"interval must be a positive, finite time; got {value!r}")
    return seconds


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

    def cancel(self) -> bool:
        """Stop for good (a run in flight still ends and is accounted)."""
        if self.status is JobStatus.STOPPED:
            return False
        self._stop(StopReason.CANCELLED)
        return True


def _describe(result: Result) -> str:
    reason = getattr(result, "reason", None)
    detail = getattr(result, "detail", "")
    kind = type(result).__name__
    what = f"{kind}({reason.value})" if isinstance(reason, enum.Enum) else kind
    return f"{what}: {detail}"[:300] if detail else what


# -- snapshots and the table ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """What a job submits and within which limits (validated by ``every``)."""

    name: str
    interval_s: float
    request: Request
    max_runs: int | None = None
    max_cost_nusd: int | None = None
    run_immediately: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo:
    """One job at one instant, as ``jobs()`` lists it."""

    name: str
    status: JobStatus
    stop_reason: StopReason | None
    interval_s: float
    runs: int
    """Runs started (each one submitted request)."""
    successes: int
    failures: int
    """Runs that did not end ok, including runs the system refused (draining, stopping)."""
    skipped: int
    """Ticks that passed without a run (the previous run still in flight, or a late timer)."""
    cost_nusd: int
    max_runs: int | None
    max_cost_nusd: int | None
    in_flight: bool
    last_result: Result | None
    last_error: str | None
    next_run_in_s: float | None
    next_run_at: datetime | None
    """Wall-clock time (UTC) of the next run, as estimated when the snapshot was taken."""

    @property
    def cost_usd(self) -> Decimal:
        return Decimal(self.cost_nusd) / NANO

    @property
    def max_cost_usd(self) -> Decimal | None:
        return None if self.max_cost_nusd is None else Decimal(self.max_cost_nusd) / NANO


@dataclass(slots=True)
class _Entry:
    spec: JobSpec
    schedule: JobSchedule
    running: Future[Result] | None = None


def _info(entry: _Entry, now: float, wall: datetime) -> JobInfo:
    s = entry.schedule
    next_in = None if s.next_run_at is None else max(0.0, s.next_run_at - now)
    return JobInfo(
        name=entry.spec.name,
        status=s.status,
        stop_reason=s.stop_reason,
        interval_s=s.interval_s,
        runs=s.runs,
        successes=s.successes,
        failures=s.failures,
        skipped=s.skipped,
        cost_nusd=s.cost_nusd,
        max_runs=s.max_runs,
        max_cost_nusd=s.max_cost_nusd,
        in_flight=s.in_flight is not None,
        last_result=s.last_result,
        last_error=s.last_error,
        next_run_in_s=next_in,
        next_run_at=None if next_in is None else wall + timedelta(seconds=next_in),
    )


class JobTable:
    """The jobs of one system; thread-safe. Written by the jobs actor only, read by anyone."""

    def __init__(self, *, max_jobs: int = 1000) -> None:
        self._changed = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._max_jobs = max_jobs

    def add(self, spec: JobSpec, now: float) -> float | ConfigError:
        """Add a job; returns its first tick, or the error (a name taken, the table full)."""
        with self._changed:
            if spec.name in self._entries:
                return ConfigError(f"a job named {spec.name!r} exists already")
            if len(self._entries) >= self._max_jobs and not self._evict_one():
                return ConfigError(f"at most {self._max_jobs} jobs; cancel some first")
            schedule = JobSchedule(
                interval_s=spec.interval_s,
                max_runs=spec.max_runs,
                max_cost_nusd=spec.max_cost_nusd,
            )
            self._entries[spec.name] = _Entry(spec, schedule)
            first = schedule.start(now, run_immediately=spec.run_immediately)
            self._changed.notify_all()
            return first

    def _evict_one(self) -> bool:
        for name, entry in self._entries.items():  # oldest first
            if entry.schedule.status is JobStatus.STOPPED:
                del self._entries[name]
                return True
        return False

    def apply(self, name: str, change: Callable[[_Entry], T]) -> T | None:
        """Run ``change`` on a job's entry under the lock (None if no such job)."""
        with self._changed:
            entry = self._entries.get(name)
            if entry is None:
                return None
            out = change(entry)
            self._changed.notify_all()
            return out

    def pending(self) -> list[tuple[str, float | None, Future[Result] | None, int | None]]:
        """Per job: name, next tick if active, run future and run number if in flight."""
        with self._changed:
            return [
                (
                    name,
                    e.schedule.next_run_at if e.schedule.status is JobStatus.ACTIVE else None,
                    e.running,
                    e.schedule.in_flight,
                )
                for name, e in self._entries.items()
            ]

    def spec(self, name: str) -> JobSpec | None:
        with self._changed:
            entry = self._entries.get(name)
            return None if entry is None else entry.spec

    def info(self, name: str, now: float) -> JobInfo | None:
        with self._changed:
            entry = self._entries.get(name)
            return None if entry is None else _info(entry, now, datetime.now(UTC))

    def infos(self, now: float) -> list[JobInfo]:
        wall = datetime.now(UTC)
        with self._changed:
            return [_info(e, now, wall) for e in self._entries.values()]

    def wait_for(
        self,
        name: str,
        until: Callable[[JobInfo], bool],
        clock: Callable[[], float],
        timeout: float,
    ) -> JobInfo:
        """Block until ``until(info)`` holds for job ``name``; ``TimeoutError`` otherwise."""

        def check() -> JobInfo | None:
            info = self.info(name, clock())
            return info if info is not None and until(info) else None

        with self._changed:
            found = self._changed.wait_for(check, timeout)
        if found is None:
            raise TimeoutError(f"job {name!r} did not reach the awaited state in {timeout}s")
        return found


def table_of(rt: Runtime) -> JobTable:
    """The jobs table of a system (created on first use, kept in ``rt.extras``)."""
    table: JobTable = rt.extras.setdefault("callboard.jobs.table", JobTable())
    return table


# -- the actor ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AddJob:
    """Caller -> Jobs (``ask``): start a job; answers its ``JobInfo`` or a ``ConfigError``."""

    spec: JobSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class JobDue:
    """Timer -> Jobs: the tick of job ``name`` due at clock time ``at``."""

    name: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEnded:
    """A run's result future -> Jobs: run ``run`` of job ``name`` ended."""

    name: str
    run: int
    result: Result | None
    error: str | None = None


class JobAction(enum.Enum):
    PAUSE = "pause"
    RESUME = "resume"
    CANCEL = "cancel"


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlJob:
    """Caller -> Jobs (``ask``): pause, resume or cancel; answers the ``JobInfo`` or None."""

    name: str
    action: JobAction


def _report(book: AddressBook, address: str, name: str, run: int, f: Future[Result]) -> None:
    """Done-callback of a run's future (on whichever thread resolved it): tell, never block."""
    result = None if f.cancelled() else f.result()
    error = "the run's future was cancelled" if result is None else None
    book.try_tell(address, RunEnded(name=name, run=run, result=result, error=error))


class JobsActor(Actor):
    """Starts each job's runs on time; the schedule decisions are ``JobSchedule``'s."""

    def __init__(self, rt: Runtime, name: str, incarnation: int, *, system: System) -> None:
        super().__init__(rt, name, incarnation)
        self.system = system
        self.table = table_of(rt)

    def setup(self) -> None:
        """A new incarnation re-arms every timer and re-watches every run from the table."""
        if self.incarnation == 1:
            return
        for name, next_at, running, run in self.table.pending():
            if next_at is not None:
                self._arm(name, next_at)
            if running is not None and run is not None:
                self._watch(name, run, running)

    def handle(self, message: Any) -> Any:
        kind = type(message)
        if kind is JobDue:
            self._due(message)
        elif kind is RunEnded:
            self._ended(message)
        elif kind is AddJob:
            return self._add(message.spec)
        elif kind is ControlJob:
            return self._control(message)
        return None

    def _add(self, spec: JobSpec) -> JobInfo | ConfigError:
        now = self.rt.clock()
        first = self.table.add(spec, now)
        if isinstance(first, ConfigError):
            return first
        self._arm(spec.name, first)
        info = self.table.info(spec.name, now)
        assert info is not None
        return info

    def _due(self, msg: JobDue) -> None:
        now = self.rt.clock()
        decision = self.table.apply(msg.name, lambda e: e.schedule.due(now, msg.at))
        if decision is None:
            return
        if decision.next_at is not None:
            self._arm(msg.name, decision.next_at)
        if isinstance(decision, RunNow):
            self._launch(msg.name, decision.run)

    def _launch(self, name: str, run: int) -> None:
        spec = self.table.spec(name)
        assert spec is not None
        try:
            future = self.system.submit(spec.request, trace_id=f"job:{name}:{run}")
        except CallboardError as exc:  # unavailable (draining, stopping) or a model gone
            self._finish(name, run, None, f"{type(exc).__name__}: {exc}")
            return

        def remember(e: _Entry) -> None:
            e.running = future

        self.table.apply(name, remember)
        self._watch(name, run, future)

    def _watch(self, name: str, run: int, future: Future[Result]) -> None:
        future.add_done_callback(functools.partial(_report, self.rt.book, self.name, name, run))

    def _ended(self, msg: RunEnded) -> None:
        self._finish(msg.name, msg.run, msg.result, msg.error)

    def _finish(self, name: str, run: int, result: Result | None, error: str | None) -> None:
        def finish(e: _Entry) -> None:
            if e.schedule.in_flight == run:
                e.running = None
            e.schedule.ended(run, result, error)

        self.table.apply(name, finish)

    def _control(self, msg: ControlJob) -> JobInfo | None:
        now = self.rt.clock()
        if msg.action is JobAction.RESUME:
            next_at = self.table.apply(msg.name, lambda e: e.schedule.resume(now))
            if next_at is not None:
                self._arm(msg.name, next_at)
        elif msg.action is JobAction.PAUSE:
            self.table.apply(msg.name, lambda e: e.schedule.pause())
        else:
            self.table.apply(msg.name, lambda e: e.schedule.cancel())
        return self.table.info(msg.name, now)

    def _arm(self, name: str, at: float) -> None:
        self.rt.after(at - self.rt.clock(), self.name, JobDue(name=name, at=at))

    def state(self) -> dict[str, Any]:
        now = self.rt.clock()
        return super().state() | {
            "jobs": {i.name: (i.status.value, i.runs) for i in self.table.infos(now)}
        }


# -- the face ---------------------------------------------------------------------------------

_start_lock = threading.Lock()
_names = itertools.count(1)
_OWNED = "callboard.jobs.owned"


def ensure_started(system: System) -> None:
    """Start the jobs actor unless the system supervises one (or it is running already).

    A system whose supervisor starts ``JobsActor`` under the name ``jobs``
    needs nothing here; otherwise the actor is started (and restarted, if it
    died) on first use, and ``stop_jobs`` must stop it before ``system.stop``.
    """
    if system.book.closed:
        raise SystemStoppedError("callboard is stopped: no jobs can start")
    with _start_lock:
        owned: tuple[int, pykka.ActorRef[Any]] | None = system.rt.extras.get(_OWNED)
        if owned is None and JOBS in system.book.names():
            return  # supervised by the system
        if owned is not None and owned[1].is_alive():
            return
        incarnation = 1 if owned is None else owned[0] + 1
        system.book.add(JOBS)
        ref = JobsActor.start(system.rt, JOBS, incarnation, system=system)
        system.book.register(JOBS, ref)
        system.rt.extras[_OWNED] = (incarnation, ref)


def stop_jobs(system: System, timeout: float = 10.0) -> None:
    """Stop the jobs actor ``ensure_started`` started (a supervised one stops with its system)."""
    with _start_lock:
        owned = system.rt.extras.get(_OWNED)
        if owned is None:
            return
        ref = system.book.detach(JOBS) or owned[1]
        with contextlib.suppress(pykka.ActorDeadError):
            ref.stop(block=True, timeout=timeout)


def _as_request(system: System, request: Any, timeout: float | None) -> Request:
    if isinstance(request, Mapping):
        fields = dict(request)
        if "trace_id" in fields:
            raise UsageError("a job gives each run its own trace_id; do not set one")
        prompt = fields.pop("prompt", None) or fields.pop("messages", None)
        if prompt is None:
            raise UsageError("a job's request fields need a prompt or messages")
        req = Request.of(prompt, **fields)
    else:
        req = Request.of(request)
    if timeout is not None:
        if req.deadline_s is not None:
            raise UsageError("give a job either timeout or a request deadline_s, not both")
        req = dataclasses.replace(req, deadline_s=timeout)
    system.policy.check(req)
    return req


def job_spec(
    system: System,
    interval: str | float,
    request: Any,
    *,
    run_immediately: bool = False,
    max_runs: int | None = None,
    max_cost: Decimal | str | float | None = None,
    timeout: float | None = None,
    name: str | None = None,
) -> JobSpec:
    """Check every argument of ``every`` and build its ``JobSpec`` (nothing is started)."""
    if max_runs is not None and (
        isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1
    ):
        raise ConfigError(f"max_runs must be a positive integer or None; got {max_runs!r}")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"a job name must be a non-empty string; got {name!r}")
    return JobSpec(
        name=name or f"job-{next(_names)}",
        interval_s=parse_interval(interval),
        request=_as_request(system, request, timeout),
        max_runs=max_runs,
        max_cost_nusd=None if max_cost is None else parse_cost(max_cost),
        run_immediately=run_immediately,
    )


class JobHandle:
    """A running job: read it, pause, resume or cancel it, or wait for a state."""

    def __init__(self, system: System, name: str) -> None:
        self._system = system
        self.name = name

    def info(self) -> JobInfo:
        info = table_of(self._system.rt).info(self.name, self._system.rt.clock())
        if info is None:
            raise UsageError(f"no job named {self.name!r}")
        return info

    def _control(self, action: JobAction) -> JobInfo:
        info = self._system.ask(JOBS, ControlJob(name=self.name, action=action))
        if info is None:
            raise UsageError(f"no job named {self.name!r}")
        assert isinstance(info, JobInfo)
        return info

    def pause(self) -> JobInfo:
        """Stop starting runs until ``resume`` (a run in flight ends normally)."""
        return self._control(JobAction.PAUSE)

    def resume(self) -> JobInfo:
        """Start runs again from the next tick after now (missed ticks are dropped)."""
        return self._control(JobAction.RESUME)

    def cancel(self) -> JobInfo:
        """Stop for good; a run in flight still ends and is accounted."""
        return self._control(JobAction.CANCEL)

    def wait(
        self, until: Callable[[JobInfo], bool] | None = None, *, timeout: float = 60.0
    ) -> JobInfo:
        """Block until ``until(info)`` holds (default: the job stopped)."""
        check = until or (lambda info: info.status is JobStatus.STOPPED)
        return table_of(self._system.rt).wait_for(self.name, check, self._system.rt.clock, timeout)

    def __repr__(self) -> str:
        return f"<JobHandle {self.name!r}>"


def every(
    system: System,
    interval: str | float,
    request: Any,
    *,
    run_immediately: bool = False,
    max_runs: int | None = None,
    max_cost: Decimal | str | float | None = None,
    timeout: float | None = None,
    name: str | None = None,
) -> JobHandle:
    """Submit ``request`` (a prompt, a ``Request`` or a dict of fields) every ``interval``.

    ``max_runs``: stop after that many runs; ``max_cost``: stop once the runs
    cost that many USD; ``timeout``: each run's deadline in seconds;
    ``run_immediately``: the first run now rather than one interval from now.
    Misuse raises a ``UsageError`` (``ConfigError`` for a bad interval or limit).
    """
    spec = job_spec(
        system,
        interval,
        request,
        run_immediately=run_immediately,
        max_runs=max_runs,
        max_cost=max_cost,
        timeout=timeout,
        name=name,
    )
    ensure_started(system)
    answer = system.ask(JOBS, AddJob(spec=spec))
    if isinstance(answer, ConfigError):
        raise answer
    return JobHandle(system, spec.name)


def jobs(system: System) -> list[JobInfo]:
    """Every job of ``system`` (stopped ones too, until evicted), oldest first."""
    if system.failure is not None:
        raise SystemStoppedError(str(system.failure))
    return table_of(system.rt).infos(system.rt.clock())
