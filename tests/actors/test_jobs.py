"""The jobs actor (actors/jobs.py): a run's report and a timer reach only the very job
they are for, and a run the stop cut short is still accounted.

Every test runs a real ``System`` against the simulated provider on loopback, and
waits on futures, on the job table (``JobHandle.wait``) and on the actor's mailbox
(an ``ask`` answered after what was told before it). The schedule itself is tested on
a fake clock in tests/core/test_schedule.py, the face in tests/face/test_jobs.py.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest
from callboard.actors.jobs import JOBS, settle_runs
from callboard.core.schedule import RunNow
from callboard.messages import Completed, GetState, on_done
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.job_table import JobSpec, JobTable
from support import WAIT_S, served, wait_until

from callboard import (
    Cancelled,
    ModelSettings,
    Request,
    Result,
    System,
    SystemConfig,
)
from callboard.jobs import JobStatus, StopReason, every

LONG_S = 60.0
"""A call that outlasts the test: the stop at its end cuts it (``timeout=0``)."""


def _running(system: System, name: str) -> Future[Result]:
    """The result future of job ``name``'s run in flight, as the job table holds it
    (once it does: the run is marked in flight as it starts, its future a moment after,
    when its submit has made one; a fresh-clone run read it in between)."""

    def future() -> Future[Result] | None:
        (running,) = [p[-2] for p in system.rt.jobs.pending() if p[0] == name]
        return running

    assert wait_until(lambda: future() is not None)
    running = future()
    assert running is not None
    return running


def test_a_late_report_of_an_evicted_job_never_lands_on_a_new_job_of_its_name(
    provider: SimulatedProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's report named only the job and the run number: the run of a job cancelled,
    then evicted, ended as run 1 of a new job made under its name, which then started
    run 2 while run 1 went on, and counted the old run's cost as its own (found by a
    hunt). Here the old run waits unsent behind a call that holds its model, so the
    test ends it (a cancel) once the new job's run 1 is on the wire."""
    provider.configure("old", ModelBehaviour(latency_s=LONG_S))
    provider.configure("new", ModelBehaviour(latency_s=LONG_S))
    models = (
        ModelSettings(name="old", base_url=provider.base_url, max_concurrency=1),
        ModelSettings(name="new", base_url=provider.base_url),
    )
    system = System(SystemConfig(models=models))
    try:
        monkeypatch.setattr(system.rt.jobs, "_max_jobs", 1)  # a new job evicts a stopped one
        system.submit("hold the model", model="old")
        assert wait_until(lambda: served(provider, "old").get("in_flight") == 1)
        old = every(system, "1h", Request.of("tick", model="old"), run_immediately=True, name="x")
        old.wait(lambda i: i.in_flight, timeout=WAIT_S)
        old_run = _running(system, "x")  # queued behind the call holding "old"
        old.cancel()
        every(system, "1h", "idle", name="y").cancel()  # evicts the old "x"
        new = every(system, 0.05, Request.of("tick", model="new"), run_immediately=True, name="x")
        new.wait(lambda i: i.in_flight, timeout=WAIT_S)  # evicted "y"
        assert wait_until(lambda: served(provider, "new").get("in_flight") == 1)  # run 1 sent

        reported = threading.Event()  # after the jobs actor's own callback, which reports
        on_done(old_run, lambda _: reported.set())
        system.cancel(old_run.task_id)  # type: ignore[attr-defined]
        assert isinstance(old_run.result(WAIT_S), Cancelled)
        assert reported.wait(WAIT_S)
        system.ask(JOBS, GetState())  # answered after the old run's report was handled

        info = new.info()
        assert (info.runs, info.in_flight) == (1, True), "the old run's report ended run 1"
        assert (info.successes, info.failures, info.last_result) == (0, 0, None)
        assert served(provider, "new")["max_in_flight"] == 1  # runs never overlap
    finally:
        system.stop(cancel=True, timeout=0)


def test_a_run_the_stop_cut_short_is_accounted(provider: SimulatedProvider) -> None:
    """A run still going when ``stop``'s timeout ran out ended ``Cancelled`` in the stop's
    sweep, but its report found no jobs actor: the job stayed in flight for good, its run
    neither a success nor a failure (found by a hunt)."""
    provider.configure("slow", ModelBehaviour(latency_s=LONG_S))
    system = System(SystemConfig(models=(ModelSettings(name="slow", base_url=provider.base_url),)))
    try:
        job = every(system, "1h", Request.of("ping", model="slow"), run_immediately=True)
        job.wait(lambda i: i.in_flight, timeout=WAIT_S)
    finally:
        system.stop(timeout=0)
    info = job.wait(lambda i: not i.in_flight, timeout=WAIT_S)
    assert (info.status, info.stop_reason) == (JobStatus.STOPPED, StopReason.SYSTEM_STOPPED)
    assert (info.runs, info.successes, info.failures) == (1, 0, 1)
    assert isinstance(info.last_result, Cancelled)


def test_settling_the_runs_left_accounts_each_when_its_future_ends() -> None:
    """``settle_runs`` (the stop's sweep, once the jobs actor is gone): a run whose future
    has not ended yet is accounted when it does, once, and only on its own job."""
    table = JobTable()
    spec = JobSpec(name="nightly", interval_s=3600.0, request=Request.of("ping"))
    first = table.add(spec, 0.0)
    assert first == 3600.0
    running: Future[Result] = Future()

    def launch(e: Any) -> None:
        assert e.schedule.due(first, first) == RunNow(1, first + 3600.0)
        e.running = running

    table.apply("nightly", launch)
    settle_runs(table)
    before = table.info("nightly", first)
    assert before is not None
    assert before.in_flight
    running.set_result(Completed(task_id=1, trace_id="job:nightly:1", content="ok"))
    settle_runs(table)  # the sweep run again: the run is not counted twice
    info = table.info("nightly", first)
    assert info is not None
    assert (info.in_flight, info.runs, info.successes, info.failures) == (False, 1, 1, 0)
