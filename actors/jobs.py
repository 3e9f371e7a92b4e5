"""The jobs actor and its messages: it carries out each job's ``JobSchedule`` decisions.

The actor decides nothing itself: it asks the schedule (through the
``JobTable``) and acts on the answer. Its timers are messages (``rt.after``
tells it ``JobDue``), never a thread sleeping per job; a run's result comes
back as a ``RunEnded`` message sent by the result future's done-callback;
callers ``ask`` it ``AddJob`` and ``ControlJob``.

What must hold: the actor is the table's only writer while it runs (after the
system's stop has stopped it, the stop's sweep accounts the runs still in
flight: ``settle_runs``); it arms a timer for every next tick the schedule
returns and watches every run it launches, so a new incarnation re-arms every
timer and re-watches every run from the table; a timer and a run's report name
the job's instance (``_Entry.instance``), so one for a job since evicted never
changes another made under its name; a done-callback only tells the actor,
never blocks; messages are immutable.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from callboard.actors.base import Actor, Runtime
from callboard.core.schedule import RunNow, StopReason
from callboard.messages import CallboardError, ConfigError, Request, Result, on_done
from callboard.runtime.job_table import JobInfo, JobSpec, JobTable, _Entry
from callboard.supervisor.address_book import AddressBook

JOBS = "jobs"
"""The jobs actor's name in the address book."""


class SubmitRun(Protocol):
    """How the actor submits a run: ``System.submit`` (a full queue answers with a
    ``Rejected`` result, misuse or a stopped system raises a ``CallboardError``)."""

    def __call__(self, request: Request, /, *, trace_id: str) -> Future[Result]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class AddJob:
    """Caller -> Jobs (``ask``): start a job; answers its ``JobInfo`` or a ``ConfigError``."""

    spec: JobSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class JobDue:
    """Timer -> Jobs: the tick of job ``name`` (its ``instance``) due at clock time ``at``."""

    name: str
    instance: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEnded:
    """A run's result future -> Jobs: run ``run`` of job ``name`` (its ``instance``) ended.

    The instance, not the name alone: a run of a job cancelled, then evicted, ended as
    run 1 of a new job of the same name, which started run 2 while run 1 went on and
    counted the old run's cost against its own budget (found by a hunt)."""

    name: str
    instance: str
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


@dataclass(frozen=True, slots=True)
class StopAllJobs:
    """System -> Jobs (``ask``), as a stop begins: no job starts another run."""


def _outcome(f: Future[Result]) -> tuple[Result | None, str | None]:
    """A run's ended future: its result, or why it has none."""
    result = None if f.cancelled() else f.result()
    return result, "the run's future was cancelled" if result is None else None


def _report(
    book: AddressBook, address: str, f: Future[Result], *, name: str, instance: str, run: int
) -> None:
    """Done-callback of a run's future (on whichever thread resolved it): tell, never block.

    A report refused (the system stopped) is the stop's to account: ``settle_runs``."""
    result, error = _outcome(f)
    message = RunEnded(name=name, instance=instance, run=run, result=result, error=error)
    book.try_tell(address, message)


def _ended(run: int, result: Result | None, error: str | None) -> Callable[[_Entry], None]:
    """The table change for run ``run`` ended (a late or duplicate one changes nothing)."""

    def ended(e: _Entry) -> None:
        if e.schedule.in_flight == run:
            e.running = None
        e.schedule.ended(run, result, error)

    return ended


def settle_runs(table: JobTable) -> None:
    """Account each run still in flight from its future, once the jobs actor is stopped
    for good (the system's stop calls it as it sweeps, after every actor stopped and the
    book closed): its report to the actor was refused, or held and never taken, so the
    job stayed in flight for ever (found by a hunt). A future not done yet is accounted
    when it is, by whichever thread resolves it; the table's lock orders the writes."""
    for name, instance, _, running, run in table.pending():
        if running is not None and run is not None:
            on_done(running, functools.partial(_settle, table, name, instance, run))


def _settle(table: JobTable, name: str, instance: str, run: int, f: Future[Result]) -> None:
    table.apply(name, _ended(run, *_outcome(f)), instance=instance)


class JobsActor(Actor):
    """Starts each job's runs on time; the schedule decisions are ``JobSchedule``'s."""

    def __init__(self, rt: Runtime, name: str, incarnation: int, *, submit: SubmitRun) -> None:
        super().__init__(rt, name, incarnation)
        self.submit = submit
        self.table = rt.jobs

    def setup(self) -> None:
        """A new incarnation re-arms every timer and re-watches every run from the table."""
        if self.incarnation == 1:
            return
        for name, instance, next_at, running, run in self.table.pending():
            if next_at is not None:
                self._arm(name, instance, next_at)
            if running is not None and run is not None:
                self._watch(name, instance, run, running)

    def handle(self, message: Any) -> Any:
        kind = type(message)
        if kind is JobDue:
            self._due(message)
        elif kind is RunEnded:
            self._finish(message.name, message.instance, message.run, message.result, message.error)
        elif kind is AddJob:
            return self._add(message.spec)
        elif kind is ControlJob:
            return self._control(message)
        elif kind is StopAllJobs:
            for name, *_ in self.table.pending():
                self.table.apply(name, lambda e: e.schedule.cancel(StopReason.SYSTEM_STOPPED))
        return None

    def _add(self, spec: JobSpec) -> JobInfo | ConfigError:
        now = self.rt.clock()
        first = self.table.add(spec, now)
        if isinstance(first, ConfigError):
            return first
        instance = self.table.instance(spec.name)
        assert instance is not None
        self._arm(spec.name, instance, first)
        info = self.table.info(spec.name, now)
        assert info is not None
        return info

    def _due(self, msg: JobDue) -> None:
        now = self.rt.clock()
        decision = self.table.apply(
            msg.name, lambda e: e.schedule.due(now, msg.at), instance=msg.instance
        )
        if decision is None:  # stale, or the timer of a job since evicted
            return
        if decision.next_at is not None:
            self._arm(msg.name, msg.instance, decision.next_at)
        if isinstance(decision, RunNow):
            self._launch(msg.name, msg.instance, decision.run)

    def _launch(self, name: str, instance: str, run: int) -> None:
        spec = self.table.spec(name)
        assert spec is not None
        request = spec.request
        if request.idempotency_key is not None:  # one per run of this job, or each run
            # refused the next; and a job made again (to change its interval, say) or
            # another with the same request had every run refused as the first's
            # (found by a hunt)
            key = f"{request.idempotency_key}:job:{len(name)}:{name}:{instance}:{run}"
            request = dataclasses.replace(request, idempotency_key=key)
        try:
            future = self.submit(request, trace_id=f"job:{name}:{run}")
        except CallboardError as exc:  # unavailable (draining, stopping) or a model gone
            self._finish(name, instance, run, None, f"{type(exc).__name__}: {exc}")
            return

        def remember(e: _Entry) -> None:
            e.running = future

        self.table.apply(name, remember, instance=instance)
        self._watch(name, instance, run, future)

    def _watch(self, name: str, instance: str, run: int, future: Future[Result]) -> None:
        report = functools.partial(
            _report, self.rt.book, self.name, name=name, instance=instance, run=run
        )
        on_done(future, report)

    def _finish(
        self, name: str, instance: str, run: int, result: Result | None, error: str | None
    ) -> None:
        """Run ``run`` of job ``name`` ended; a report for another job of that name (one
        since evicted) changes nothing."""
        self.table.apply(name, _ended(run, result, error), instance=instance)

    def _control(self, msg: ControlJob) -> JobInfo | None:
        now = self.rt.clock()
        if msg.action is JobAction.RESUME:
            next_at = self.table.apply(msg.name, lambda e: e.schedule.resume(now))
            instance = self.table.instance(msg.name)
            if next_at is not None and instance is not None:
                self._arm(msg.name, instance, next_at)
        elif msg.action is JobAction.PAUSE:
            self.table.apply(msg.name, lambda e: e.schedule.pause())
        else:
            self.table.apply(msg.name, lambda e: e.schedule.cancel())
        return self.table.info(msg.name, now)

    def _arm(self, name: str, instance: str, at: float) -> None:
        self.rt.after(at - self.rt.clock(), self.name, JobDue(name=name, instance=instance, at=at))

    def state(self) -> dict[str, Any]:
        now = self.rt.clock()
        return super().state() | {
            "jobs": {i.name: (i.status.value, i.runs) for i in self.table.infos(now)}
        }
