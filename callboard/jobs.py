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
import contextlib
import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Never

from callboard._submitter import (
    NO_PROMPT,
    checked_fields,
    checked_seconds,
    refuse_keywords,
    request_of,
)
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
    "start_job",
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
    **unknown: Never,
) -> JobSpec:
    """Check every argument of ``every`` and build its ``JobSpec`` (nothing is started);
    a keyword it does not take is an ``InvalidRequestError`` naming the one meant."""
    refuse_keywords(unknown, "every", job_spec)
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
        info = self._found()
        if info is None:
            raise UsageError(f"no job named {self.name!r}")
        return info

    def _found(self) -> JobInfo | None:
        """The job now, or None if there is no job of this name."""
        return self._system.rt.jobs.info(self.name, self._system.rt.clock())

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


Asked = Callable[[Callable[[], JobInfo]], Awaitable[JobInfo]]
"""How an ``AsyncJobHandle`` runs a short ask of the jobs actor off the loop
(``AsyncSystem``'s own few threads for them)."""


class AsyncJobHandle:
    """``JobHandle`` for asyncio (``AsyncSystem.every``): nothing it does blocks the loop
    (the sync handle's ``wait`` held the host's loop for up to its timeout; found by a
    hunt). Its asks run on ``asked``'s threads, never the host's default executor, and
    its wait holds no thread at all. ``info`` reads the job table and never blocks."""

    def __init__(self, handle: JobHandle, asked: Asked) -> None:
        self._handle = handle
        self._asked = asked
        self.name = handle.name

    def info(self) -> JobInfo:
        return self._handle.info()

    async def pause(self) -> JobInfo:
        """``JobHandle.pause``, awaited."""
        return await self._asked(self._handle.pause)

    async def resume(self) -> JobInfo:
        """``JobHandle.resume``, awaited."""
        return await self._asked(self._handle.resume)

    async def cancel(self) -> JobInfo:
        """``JobHandle.cancel``, awaited."""
        return await self._asked(self._handle.cancel)

    async def wait(
        self, until: Callable[[JobInfo], bool] | None = None, *, timeout: float | None = 60.0
    ) -> JobInfo:
        """``JobHandle.wait``, awaited, holding no thread: each change to the job has the
        loop look again (``until`` runs on the loop), and the loop keeps the timeout.

        Each wait held a thread of the host's default executor while it waited: six of
        them on two cores took every one, and the host's ``getaddrinfo``, ``cb.stats()``
        and the very ``cancel`` that would end the waits waited for ever (found by a
        hunt)."""
        wait_s = checked_seconds(timeout, "timeout")
        check = until or _stopped
        loop = asyncio.get_running_loop()
        reached: asyncio.Future[JobInfo] = loop.create_future()
        news = _News()

        def look() -> None:  # on the loop
            news.told = False  # first: a change from now on asks for another look
            if reached.done():
                return
            try:
                info = self._handle._found()
                if info is not None and check(info):
                    reached.set_result(info)
            except Exception as exc:  # noqa: BLE001 - the caller's ``until`` raised: theirs
                reached.set_exception(exc)

        def changed() -> None:  # on the table writer's thread: hand over, never block
            if news.told:  # a look is due already, and sees this change too
                return
            news.told = True
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits
                loop.call_soon_threadsafe(look)

        unwatch = self._handle._system.rt.jobs.watch(self.name, changed)
        try:
            look()  # after the watch begins: no change falls between the two
            done, _ = await asyncio.wait((reached,), timeout=wait_s)
            if not done:
                raise TimeoutError(
                    f"job {self.name!r} did not reach the awaited state in {timeout}s"
                )
            return reached.result()
        finally:
            unwatch()
            reached.cancel()  # a look still due finds it done and does nothing

    def __repr__(self) -> str:
        return f"<AsyncJobHandle {self.name!r}>"


def _stopped(info: JobInfo) -> bool:
    """What a wait waits for unless told otherwise: the job stopped."""
    return info.status is JobStatus.STOPPED


def _unchanged(_entry: Any) -> None:
    """A change of nothing (``JobHandle.poke``): the table's waiters look again."""


class _News:
    """Whether an ``AsyncJobHandle.wait`` was told of a change it has not looked at yet:
    the changes that come meanwhile ask the loop for no other look."""

    __slots__ = ("told",)

    def __init__(self) -> None:
        self.told = False


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
    **unknown: Never,
) -> JobHandle:
    """Submit ``request`` (a prompt, a ``Request`` or a dict of fields) every ``interval``.

    ``max_runs``: stop after that many runs; ``max_cost``: stop once the runs
    cost that many USD; ``timeout``: each run's deadline in seconds;
    ``run_immediately``: the first run now rather than one interval from now.
    Misuse raises a ``UsageError`` (``ConfigError`` for a bad interval or limit, an
    ``InvalidRequestError`` for a keyword it does not take, naming the one meant).
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
        **unknown,
    )
    return start_job(system, spec)


def start_job(system: System, spec: JobSpec) -> JobHandle:
    """Have the jobs actor start the job ``spec`` (checked by ``job_spec``): it asks."""
    answer = system.ask(JOBS, AddJob(spec=spec))
    if isinstance(answer, ConfigError):
        raise answer
    return JobHandle(system, spec.name)


def jobs(system: System) -> list[JobInfo]:
    """Every job of ``system`` (stopped ones too, until evicted), oldest first."""
    if system.failure is not None:
        raise SystemStoppedError(str(system.failure))
    return system.rt.jobs.infos(system.rt.clock())
