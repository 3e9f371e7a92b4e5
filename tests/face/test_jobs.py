"""Recurring jobs through the public face (callboard/jobs.py): real jobs end to end.

The pure schedule is tested on a fake clock in tests/core/test_schedule.py. These
tests run real jobs with 20-50 ms intervals on the loopback provider and wait on the
job table's condition (``JobHandle.wait``): a job runs to its limits, pauses, resumes
without piling up, is cancelled mid-run (that run accounted, no other started), and
stops before its system waits for the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from callboard.messages import Crash, GetState
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import PRICE, WAIT_S, two_models

from callboard import (
    ConfigError,
    InvalidRequestError,
    ModelSettings,
    Request,
    System,
    SystemConfig,
    UnknownModelError,
    UsageError,
)
from callboard.jobs import JOBS, JobStatus, StopReason, every, job_spec, jobs, stop_jobs

# -- end to end ---------------------------------------------------------------------------------


@pytest.fixture
def priced(make_system: Callable[..., System], provider: Any) -> System:
    return make_system(SystemConfig(models=two_models(provider.base_url, price=PRICE)))


def test_a_job_runs_on_its_interval_until_max_runs(priced: System) -> None:
    job = every(priced, 0.03, "ping", max_runs=3, run_immediately=True, name="pinger")
    info = job.wait(timeout=WAIT_S)
    assert (info.status, info.stop_reason) == (JobStatus.STOPPED, StopReason.MAX_RUNS)
    assert (info.runs, info.successes, info.failures) == (3, 3, 0)
    assert info.next_run_at is None
    assert info.last_result is not None
    assert info.last_result.trace_id == "job:pinger:3"
    assert info.cost_nusd > 0
    assert priced.drain(WAIT_S)
    stats = priced.stats()
    assert stats.outcomes == {"completed": 3}
    assert stats.total.cost_nusd == info.cost_nusd
    assert [i.name for i in jobs(priced)] == ["pinger"]


def test_a_job_stops_itself_when_its_budget_is_spent(priced: System) -> None:
    job = every(priced, 0.02, {"prompt": "ping", "max_tokens": 8}, max_cost="0.000000001")
    info = job.wait(timeout=WAIT_S)
    assert (info.stop_reason, info.runs) == (StopReason.BUDGET, 1)
    assert info.cost_usd >= info.max_cost_usd  # type: ignore[operator]


def test_pause_resume_and_cancel_a_running_job(priced: System) -> None:
    job = every(priced, 0.02, Request.of("ping", model="beta"))
    job.wait(lambda i: i.runs >= 1, timeout=WAIT_S)
    assert job.pause().status is JobStatus.PAUSED
    paused = job.wait(lambda i: not i.in_flight, timeout=WAIT_S)
    assert (paused.next_run_in_s, paused.next_run_at) == (None, None)  # none until a resume
    resumed = job.resume()
    assert resumed.status is JobStatus.ACTIVE
    assert resumed.next_run_in_s is not None
    job.wait(lambda i: i.runs >= paused.runs + 2, timeout=WAIT_S)
    info = job.cancel()
    assert (info.status, info.stop_reason) == (JobStatus.STOPPED, StopReason.CANCELLED)
    final = job.wait(lambda i: not i.in_flight, timeout=WAIT_S)
    assert final.runs == final.successes
    assert final.last_result is not None
    assert final.last_result.model == "beta"


def test_timers_are_messages_not_threads(priced: System) -> None:
    before = threading.active_count()
    handles = [every(priced, "1h", "later") for _ in range(20)]
    assert threading.active_count() <= before, "no thread per job"
    assert all(h.info().next_run_in_s is not None for h in handles)
    infos = {i.name: i for i in jobs(priced)}
    assert all(infos[h.name].status is JobStatus.ACTIVE for h in handles)
    assert priced.ask(JOBS, GetState())["jobs"][handles[0].name] == ("active", 0)


def test_a_restarted_jobs_actor_rearms_every_job_from_the_table(priced: System) -> None:
    job = every(priced, 0.02, "ping")
    before = job.wait(lambda i: i.runs >= 1, timeout=WAIT_S)
    first = priced.book.resolve(JOBS)
    assert first is not None
    priced.tell(JOBS, Crash(reason="test"))
    assert first.actor_stopped.wait(WAIT_S)
    # the supervisor starts a new incarnation, same name and table
    after = job.wait(lambda i: i.runs >= before.runs + 2, timeout=WAIT_S)
    assert priced.ask(JOBS, GetState())["incarnation"] == 2
    assert after.status is JobStatus.ACTIVE


def test_jobs_run_on_the_jobs_actor_the_system_supervises(priced: System) -> None:
    supervised = priced.book.resolve(JOBS)
    assert supervised is not None
    info = every(priced, 0.02, "ping", max_runs=2).wait(timeout=WAIT_S)
    assert (info.runs, info.successes) == (2, 2)
    assert priced.book.resolve(JOBS) is supervised  # no second jobs actor was started
    assert priced.supervision()[JOBS]["incarnation"] == 1


def test_stop_jobs_stops_every_job_and_a_run_in_flight_still_ends(priced: System) -> None:
    job = every(priced, 0.02, "ping", run_immediately=True)
    job.wait(lambda i: i.runs >= 1, timeout=WAIT_S)
    stop_jobs(priced)
    info = job.wait(lambda i: not i.in_flight, timeout=WAIT_S)
    assert (info.status, info.stop_reason) == (JobStatus.STOPPED, StopReason.SYSTEM_STOPPED)
    assert (info.next_run_at, info.successes) == (None, info.runs)


def test_every_checks_its_arguments_before_starting_anything(priced: System) -> None:
    """An interval past what a date holds raised ``OverflowError`` with the job already
    in the table, and every later ``jobs()`` with it; ``run_immediately="no"`` ran it at
    once; ``wait(timeout=nan)`` spun a core for ever (found by a hunt)."""
    with pytest.raises(ConfigError, match="interval must be"):
        every(priced, 1e300, "ping")
    with pytest.raises(ConfigError, match="run_immediately"):
        every(priced, "30m", "ping", run_immediately="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="interval"):
        every(priced, "30 minutes", "ping")
    with pytest.raises(ConfigError, match="max_runs"):
        every(priced, "30m", "ping", max_runs=0)
    with pytest.raises(UnknownModelError):
        every(priced, "30m", {"prompt": "ping", "model": "gamma"})
    with pytest.raises(UsageError, match="trace_id"):
        every(priced, "30m", {"prompt": "ping", "trace_id": "x"})
    with pytest.raises(ConfigError, match="without control characters"):  # it is logged
        every(priced, "30m", "ping", name="nightly\nINFO callboard: forged")
    with pytest.raises(UsageError, match="not both"):
        every(priced, "30m", {"prompt": "ping", "deadline_s": 5}, timeout=3)
    with pytest.raises(UsageError, match="did you mean 'priority'"):  # was a raw TypeError
        every(priced, "30m", {"prompt": "ping", "priorty": "high"})
    with pytest.raises(InvalidRequestError, match=r"every\(\) .* 'max_run' \(did you mean 'max_r"):
        every(priced, "30m", "ping", max_run=3)  # type: ignore[arg-type]  # was a TypeError too
    with pytest.raises(InvalidRequestError, match=r"every\(\) .* 'max_run' \(did you mean 'max_r"):
        priced.every("30m", "ping", max_run=3)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="metadata cannot be stored as JSON"):  # at once
        every(priced, "30m", {"prompt": "ping", "metadata": {"when": object()}})
    with pytest.raises(UsageError, match="give one prompt"):
        every(priced, "30m", {"model": "alpha"})
    assert jobs(priced) == []  # nothing was scheduled by the refused calls
    once = every(priced, "30m", "ping", name="once")
    with pytest.raises(ConfigError, match="exists already"):
        every(priced, "30m", "pong", name="once")
    with pytest.raises(InvalidRequestError, match="timeout"):
        once.wait(timeout=float("nan"))


def test_a_timeout_becomes_each_runs_deadline(priced: System) -> None:
    spec = job_spec(priced, "hourly", "ping", timeout=2.5, max_cost=Decimal("0.25"))
    assert spec.request.deadline_s == 2.5
    assert (spec.interval_s, spec.max_cost_nusd) == (3600.0, 250_000_000)


# -- cancelling, pausing and stopping running jobs -----------------------------------------


SHORT_S = 5.0
"""How long a future that should resolve promptly is given."""


def test_job_cancelled_mid_run_accounts_the_run_and_never_runs_again(
    provider: SimulatedProvider,
) -> None:
    provider.configure("beta", ModelBehaviour(latency_s=0.3))  # a run outlasts the interval
    with System(SystemConfig(models=two_models(provider.base_url))) as own:
        job = own.every(0.05, Request.of("tick", model="beta"), run_immediately=True)
        job.wait(lambda i: i.in_flight and i.skipped > 0, timeout=SHORT_S)
        assert job.cancel().status.name == "STOPPED"
        after = job.wait(lambda i: not i.in_flight, timeout=SHORT_S)
        assert after.runs == after.successes + after.failures
        assert provider.stats()["models"]["beta"]["max_in_flight"] == 1  # runs never overlap
        probe = own.submit("after", model="beta").result(SHORT_S)  # a full interval later
        assert probe.ok
        assert job.info().runs == after.runs


def test_stop_stops_jobs_before_waiting_for_the_rest(provider: SimulatedProvider) -> None:
    provider.configure("beta", ModelBehaviour(latency_s=0.3))
    own = System(SystemConfig(models=two_models(provider.base_url)))
    job = own.every(0.05, Request.of("tick", model="alpha"), run_immediately=True)
    slow = own.submit("slow", model="beta")  # keeps the stop waiting ~0.3 s
    started = job.wait(lambda i: i.successes >= 1, timeout=SHORT_S)
    own.stop(timeout=SHORT_S)
    assert slow.result(0).ok
    (info,) = own.jobs()
    assert not info.in_flight
    assert info.runs == info.successes + info.failures
    assert info.runs <= started.runs + 1, f"{info.runs - started.runs} runs during the stop"
    assert (info.status, info.stop_reason) == (JobStatus.STOPPED, StopReason.SYSTEM_STOPPED)


def test_a_recurring_job_with_an_idempotency_key_runs_every_time(assorted_system: System) -> None:
    request = {"prompt": "ping", "model": "alpha", "idempotency_key": "nightly"}
    job = assorted_system.every(0.05, request, max_runs=3, run_immediately=True)
    info = job.wait(timeout=WAIT_S)  # each run's key is its own (the job's and its run's)
    assert info.runs == 3
    assert info.failures == 0, info.last_error
    assert info.successes == 3


def test_a_job_made_again_with_an_idempotency_key_runs_as_the_first_did(
    assorted_system: System,
) -> None:
    """Made again (the way to change its interval), or made twice from one request, its
    runs were refused as duplicates of the first job's, counted as failures and nothing
    more (found by a hunt)."""
    request = {"prompt": "digest", "model": "alpha", "idempotency_key": "digest"}
    for name in ("digest-v1", "digest-v2", "digest-v3"):
        job = assorted_system.every(0.05, request, max_runs=2, run_immediately=True, name=name)
        info = job.wait(timeout=WAIT_S)
        assert (info.runs, info.successes) == (2, 2), info.last_error


def test_a_job_pauses_resumes_and_ends_at_stop_without_piling_up(
    provider: SimulatedProvider,
) -> None:
    system = System(SystemConfig(models=(ModelSettings(name="alpha", base_url=provider.base_url),)))
    try:
        job = system.every(0.05, {"prompt": "tick", "model": "alpha"}, run_immediately=True)
        job.wait(lambda i: i.runs >= 2, timeout=WAIT_S)
        paused = job.pause()
        assert paused.status is JobStatus.PAUSED
        settled = job.wait(lambda i: not i.in_flight, timeout=WAIT_S)
        resumed = job.resume()
        assert resumed.status is JobStatus.ACTIVE
        assert resumed.runs == settled.runs
        job.wait(lambda i: i.runs >= settled.runs + 2, timeout=WAIT_S)
    finally:
        system.stop(timeout=WAIT_S)
    (info,) = system.jobs()
    assert info.status is JobStatus.STOPPED
    assert info.stop_reason is StopReason.SYSTEM_STOPPED
    assert not info.in_flight
    assert info.runs == info.successes + info.failures
    assert info.failures == 0, info.last_error
