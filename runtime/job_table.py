"""The job table: every job of one system, with its spec, schedule and run in flight.

Like the ledger for tasks, the ``JobTable`` is the truth: a thread-safe store
outside the jobs actor (the runtime's ``rt.jobs``), so a restarted incarnation
of the actor re-arms every timer from it, and listing jobs (``JobInfo``
snapshots) never needs the actor.

What must hold: only the jobs actor writes the table (``add``, ``apply``),
and once a stop has stopped it for good, the stop's sweep, which accounts the
runs still in flight (``actors.jobs.settle_runs``); anyone may read it; every
read and write holds one condition, notified on every change, so ``wait_for``
re-checks after each, and each change to a job tells its watchers (``watch``:
a wait that holds no thread) once the lock is let go; job names are unique,
and the table holds at most ``max_jobs`` jobs (a new one evicts the oldest
stopped job, or is refused).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TypeVar

from callboard.core.schedule import JobSchedule, JobStatus, StopReason
from callboard.messages import ConfigError, Request, Result
from callboard.messages._results import NANO

T = TypeVar("T")


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
    """Seconds to the next run; None while paused or stopped."""
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
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    """This job's own, unlike any other's (one made again under its name included)."""


def _info(entry: _Entry, now: float, wall: datetime) -> JobInfo:
    s = entry.schedule
    # none while paused: no run comes until a resume (which picks the next grid time)
    due = s.next_run_at if s.status is JobStatus.ACTIVE else None
    next_in = None if due is None else max(0.0, due - now)
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
        self._lock = threading.RLock()
        """Held for every read and change, by ``with self._lock`` (C): never ``with
        self._changed``, whose Python ``__enter__`` a Ctrl-C can leave holding it."""
        self._changed = threading.Condition(self._lock)
        self._entries: dict[str, _Entry] = {}
        self._max_jobs = max_jobs
        self._watchers: dict[str, list[Callable[[], object]]] = {}
        """Job name -> what to call after each change to it (``watch``)."""

    def add(self, spec: JobSpec, now: float) -> float | ConfigError:
        """Add a job; returns its first tick, or the error (a name taken, the table full)."""
        with self._lock:
            if spec.name in self._entries:
                return ConfigError(f"a job named {spec.name!r} exists already")
            evicted = None
            if len(self._entries) >= self._max_jobs:
                evicted = self._evict_one()
                if evicted is None:
                    return ConfigError(f"at most {self._max_jobs} jobs; cancel some first")
            schedule = JobSchedule(
                interval_s=spec.interval_s, max_runs=spec.max_runs, max_cost_nusd=spec.max_cost_nusd
            )
            self._entries[spec.name] = _Entry(spec, schedule)
            first = schedule.start(now, run_immediately=spec.run_immediately)
            self._changed.notify_all()
            told = self._watching(spec.name, evicted)
        _tell(told)
        return first

    def _evict_one(self) -> str | None:
        """Drop the oldest stopped job; its name, or None if no job is stopped."""
        for name, entry in self._entries.items():  # oldest first
            if entry.schedule.status is JobStatus.STOPPED:
                del self._entries[name]
                return name
        return None

    def apply(
        self, name: str, change: Callable[[_Entry], T], *, instance: str | None = None
    ) -> T | None:
        """Run ``change`` on a job's entry under the lock (None if no such job). Given an
        ``instance``, only on that very job: None if the job of that name is another."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or (instance is not None and entry.instance != instance):
                return None
            out = change(entry)
            self._changed.notify_all()
            told = self._watching(name)
        _tell(told)
        return out

    def watch(self, name: str, changed: Callable[[], object]) -> Callable[[], None]:
        """Call ``changed()`` after each change to job ``name`` (its making and eviction
        too), on the writer's thread once the lock is let go: it must only hand the news
        on, at once, and never raise. Returns what ends the watch."""
        with self._lock:
            self._watchers.setdefault(name, []).append(changed)

        def unwatch() -> None:
            with self._lock:
                watchers = self._watchers.get(name, [])
                if changed in watchers:
                    watchers.remove(changed)
                if not watchers:
                    self._watchers.pop(name, None)

        return unwatch

    def _watching(self, *names: str | None) -> list[Callable[[], object]]:
        """The watchers of ``names`` (lock held): told once it is let go."""
        return [w for name in names if name is not None for w in self._watchers.get(name, ())]

    def pending(
        self,
    ) -> list[tuple[str, str, float | None, Future[Result] | None, int | None]]:
        """Per job: name, instance, next tick if active, run future and run number if in
        flight."""
        with self._lock:
            return [
                (
                    name,
                    e.instance,
                    e.schedule.next_run_at if e.schedule.status is JobStatus.ACTIVE else None,
                    e.running,
                    e.schedule.in_flight,
                )
                for name, e in self._entries.items()
            ]

    def spec(self, name: str) -> JobSpec | None:
        with self._lock:
            entry = self._entries.get(name)
            return None if entry is None else entry.spec

    def instance(self, name: str) -> str | None:
        """The job's own id (``_Entry.instance``): None if there is no such job."""
        with self._lock:
            entry = self._entries.get(name)
            return None if entry is None else entry.instance

    def info(self, name: str, now: float) -> JobInfo | None:
        with self._lock:
            entry = self._entries.get(name)
            return None if entry is None else _info(entry, now, datetime.now(UTC))

    def infos(self, now: float) -> list[JobInfo]:
        wall = datetime.now(UTC)
        with self._lock:
            return [_info(e, now, wall) for e in self._entries.values()]

    def wait_for(
        self,
        name: str,
        until: Callable[[JobInfo], bool],
        clock: Callable[[], float],
        timeout: float | None,
    ) -> JobInfo:
        """Block until ``until(info)`` holds for job ``name`` (``timeout`` None: however
        long); ``TimeoutError`` otherwise."""

        def check() -> JobInfo | None:
            info = self.info(name, clock())
            return info if info is not None and until(info) else None

        with self._lock:
            found = self._changed.wait_for(check, timeout)
        if found is None:
            raise TimeoutError(f"job {name!r} did not reach the awaited state in {timeout}s")
        return found


def _tell(watchers: list[Callable[[], object]]) -> None:
    """Tell each watcher of a change (the lock let go: a watcher never waits on it)."""
    for changed in watchers:
        changed()
