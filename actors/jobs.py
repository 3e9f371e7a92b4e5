"""The jobs actor and its messages: it carries out each job's ``JobSchedule`` decisions.

The actor decides nothing itself: it asks the schedule (through the
``JobTable``) and acts on the answer. Its timers are messages (``rt.after``
tells it ``JobDue``), never a thread sleeping per job; a run's result comes
back as a ``RunEnded`` message sent by the result future's done-callback;
callers ``ask`` it ``AddJob`` and ``ControlJob``.

What must hold: the actor is the table's only writer; it arms a timer for
every next tick the schedule returns and watches every run it launches, so a
new incarnation re-arms every timer and re-watches every run from the table;
a done-callback only tells the actor, never blocks; messages are immutable.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from callboard.actors.base import Actor, Runtime
from callboard.core.schedule import RunNow, StopReason
from callboard.messages import CallboardError, ConfigError, Request, Result, on_done
from callboard.runtime.job_table import JobInfo, JobSpec, _Entry
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


@dataclass(frozen=True, slots=True)
class StopAllJobs:
    """System -> Jobs (``ask``), as a stop begins: no job starts another run."""


def _report(book: AddressBook, address: str, name: str, run: int, f: Future[Result]) -> None:
    """Done-callback of a run's future (on whichever thread resolved it): tell, never block."""
    result = None if f.cancelled() else f.result()
    error = "the run's future was cancelled" if result is None else None
    book.try_tell(address, RunEnded(name=name, run=run, result=result, error=error))


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
            self._finish(message.name, message.run, message.result, message.error)
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
        spec, instance = self.table.spec(name), self.table.instance(name)
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
            self._finish(name, run, None, f"{type(exc).__name__}: {exc}")
            return

        def remember(e: _Entry) -> None:
            e.running = future

        self.table.apply(name, remember)
        self._watch(name, run, future)

    def _watch(self, name: str, run: int, future: Future[Result]) -> None:
        on_done(future, functools.partial(_report, self.rt.book, self.name, name, run))

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
