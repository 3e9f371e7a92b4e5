"""Recurring jobs: submit one request every interval, within a run count and a budget.

    job = every(cb, "30m", "Summarise the overnight tickets", max_runs=48, max_cost="0.50")
    job.pause(); job.resume(); job.cancel(); jobs(cb)  # each JobInfo: runs, cost, next run

Runs of one job never overlap; ticks stay on the grid ``start + k * interval``
(ticks missed while late are skipped, not caught up); a job stops after
``max_runs`` runs, or once its runs cost ``max_cost`` (the run crossing the
line is the last). Each decision is ``JobSchedule``'s, in ``core.schedule``,
whose docstring says what must hold; ``JobsActor`` (``actors.jobs``) carries
the decisions out, and the ``JobTable`` (``runtime.job_table``) holds every
job's state outside the actor, so a restarted actor loses nothing.

This module is the face (``every``, ``jobs``, ``JobHandle``, ``stop_jobs``)
and re-exports the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from callboard._submitter import NO_PROMPT, checked_fields, checked_seconds, request_of
from callboard.actors.jobs import (
    JOBS,
    AddJob,
    ControlJob,
    JobAction,
    JobDue,
    JobsActor,
    RunEnded,
    StopAllJobs,
)
from callboard.core.schedule import (
    JobSchedule,
    JobStatus,
    RunNow,
    SkipTick,
    StopReason,
    parse_cost,
    parse_interval,
)
from callboard.messages import ConfigError, Request, SystemStoppedError, UsageError, unprintable
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.job_table import JobInfo, JobSpec, JobTable

if TYPE_CHECKING:
    from callboard._system import System

__all__ = [
    "JOBS",
    "AddJob",
    "AsyncJobHandle",
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
    "StopAllJobs",
    "StopReason",
    "every",
    "job_spec",
    "jobs",
    "parse_cost",
    "parse_interval",
    "stop_jobs",
]

log = guarded_logger(__name__)

# -- the face ---------------------------------------------------------------------------------

_names = itertools.count(1)


def stop_jobs(system: System, timeout: float = 10.0) -> None:
    """Stop every job of ``system``: none starts another run (runs in flight end as usual).

    ``System.stop`` does this first; a jobs actor that does not answer within
    ``timeout`` is logged, and the stop goes on.
    """
    ref = system.book.resolve(JOBS)
    if ref is None:
        return
    try:
        ref.ask(StopAllJobs(), timeout=timeout)
    except Exception:  # a stop goes on whatever the jobs actor does
        log.warning("the jobs actor did not stop its jobs", exc_info=True)


def _as_request(system: System, request: Any, timeout: float | None) -> Request:
    if isinstance(request, Mapping):
        fields = dict(request)
        if "trace_id" in fields:
            raise UsageError("a job gives each run its own trace_id; do not set one")
        checked_fields(fields, "every", ("prompt", "messages"))
        req = request_of(NO_PROMPT, fields)
    else:
        req = request_of(request, {})
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
    if name is not None and (not isinstance(name, str) or not name.strip() or unprintable(name)):
        raise ConfigError(
            "a job name must be a non-empty string without control characters or line "
            f"separators (it is logged); got {name!r}"
        )
    if not isinstance(run_immediately, bool):  # "no" ran it at once
        raise ConfigError(f"run_immediately must be True or False; got {run_immediately!r}")
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
        info = self._system.rt.jobs.info(self.name, self._system.rt.clock())
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

    def poke(self) -> None:
        """Have every ``wait`` on this job check its condition again."""
        self._system.rt.jobs.apply(self.name, _unchanged)

    def wait(
        self, until: Callable[[JobInfo], bool] | None = None, *, timeout: float | None = 60.0
    ) -> JobInfo:
        """Block until ``until(info)`` holds (default: the job stopped), up to ``timeout``
        seconds (None: however long)."""
        wait_s = checked_seconds(timeout, "timeout")  # NaN waited for ever, a whole core
        check = until or _stopped
        return self._system.rt.jobs.wait_for(self.name, check, self._system.rt.clock, wait_s)

    def __repr__(self) -> str:
        return f"<JobHandle {self.name!r}>"


class AsyncJobHandle:
    """``JobHandle`` for asyncio (``AsyncSystem.every``): its asks and its wait are
    awaited on a worker thread, never on the loop (the sync handle's ``wait`` held the
    host's loop for up to its timeout; found by a hunt). ``info`` reads the job table
    and never blocks."""

    def __init__(self, handle: JobHandle) -> None:
        self._handle = handle
        self.name = handle.name

    def info(self) -> JobInfo:
        return self._handle.info()

    async def pause(self) -> JobInfo:
        """``JobHandle.pause``, awaited."""
        return await asyncio.to_thread(self._handle.pause)

    async def resume(self) -> JobInfo:
        """``JobHandle.resume``, awaited."""
        return await asyncio.to_thread(self._handle.resume)

    async def cancel(self) -> JobInfo:
        """``JobHandle.cancel``, awaited."""
        return await asyncio.to_thread(self._handle.cancel)

    async def wait(
        self, until: Callable[[JobInfo], bool] | None = None, *, timeout: float | None = 60.0
    ) -> JobInfo:
        """``JobHandle.wait``, awaited; a caller cancelled meanwhile frees its thread at
        once."""
        wait_s = checked_seconds(timeout, "timeout")
        check = until or _stopped
        given_up = threading.Event()

        def awaited(info: JobInfo) -> bool:
            return given_up.is_set() or check(info)

        try:
            return await asyncio.to_thread(self._handle.wait, awaited, timeout=wait_s)
        except asyncio.CancelledError:
            given_up.set()
            self._handle.poke()  # the waiting thread checks again, and ends
            raise

    def __repr__(self) -> str:
        return f"<AsyncJobHandle {self.name!r}>"


def _stopped(info: JobInfo) -> bool:
    """What a wait waits for unless told otherwise: the job stopped."""
    return info.status is JobStatus.STOPPED


def _unchanged(_entry: Any) -> None:
    """A change of nothing (``JobHandle.poke``): the table's waiters look again."""


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
    answer = system.ask(JOBS, AddJob(spec=spec))
    if isinstance(answer, ConfigError):
        raise answer
    return JobHandle(system, spec.name)


def jobs(system: System) -> list[JobInfo]:
    """Every job of ``system`` (stopped ones too, until evicted), oldest first."""
    if system.failure is not None:
        raise SystemStoppedError(str(system.failure))
    return system.rt.jobs.infos(system.rt.clock())
