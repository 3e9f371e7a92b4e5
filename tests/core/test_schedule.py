"""Recurring jobs' pure schedule (core/schedule.py): strict parsing of intervals and
budgets, and ``JobSchedule`` on a fake clock (``now`` is an argument: no threads, no
sleeps)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from callboard.core.schedule import (
    JobSchedule,
    JobStatus,
    RunNow,
    SkipTick,
    StopReason,
    parse_cost,
    parse_interval,
)
from callboard.messages import Completed, ConfigError, Failed, FailureReason
from hypothesis import given, settings
from hypothesis import strategies as st

# -- parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_value", "seconds"),
    [
        (45, 45.0),
        (0.5, 0.5),
        ("45s", 45.0),
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("1.5h", 5400.0),
        ("1d", 86400.0),
        ("hourly", 3600.0),
        ("daily", 86400.0),
    ],
)
def test_intervals_parse(given_value: Any, seconds: float) -> None:
    assert parse_interval(given_value) == seconds


@pytest.mark.parametrize(
    "bad",
    ["30", "30 m", "30M", "m", "1h30m", "", "-5s", "0s", "weekly", " 5s", 0, -1,
     float("inf"), float("nan"), True, None, [5], 1e-4, 1e300, "99999999999d"],
)  # fmt: skip
def test_bad_intervals_are_refused_naming_the_accepted_forms(bad: Any) -> None:
    with pytest.raises(ConfigError, match="interval must be"):
        parse_interval(bad)


@pytest.mark.parametrize("power", [400, 5000])
def test_an_interval_past_any_float_is_refused_as_a_config_error(power: int) -> None:
    """An int too large for a float (``10**400``) raised a bare ``OverflowError`` (found
    by a hunt); past 4300 digits even its ``repr`` raises, so the message cuts it short."""
    with pytest.raises(ConfigError, match="interval must be from") as refused:
        parse_interval(10**power)
    assert len(str(refused.value)) < 200


def test_costs_parse_exactly_to_nano_dollars() -> None:
    assert parse_cost(Decimal("0.5")) == 500_000_000
    assert parse_cost("0.000000001") == 1
    assert parse_cost(0.1) == 100_000_000
    assert parse_cost(2) == 2_000_000_000


@pytest.mark.parametrize("bad", [0, -1, "abc", "nan", "inf", True, "1e-12", None])
def test_bad_costs_are_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match="max_cost"):
        parse_cost(bad)


# -- the schedule on a fake clock -----------------------------------------------------------


def ok(cost: int = 0) -> Completed:
    return Completed(task_id=1, trace_id="t", content="fine", cost_nusd=cost)


def failed(cost: int = 0) -> Failed:
    return Failed(
        task_id=1, trace_id="t", reason=FailureReason.TIMEOUT, detail="slow", cost_nusd=cost
    )


def test_the_first_tick_is_one_interval_away_unless_run_immediately() -> None:
    assert JobSchedule(interval_s=10).start(100.0) == 110.0
    assert JobSchedule(interval_s=10).start(100.0, run_immediately=True) == 100.0


def test_a_due_tick_runs_and_places_the_next_on_the_grid() -> None:
    job = JobSchedule(interval_s=10)
    at = job.start(0.0)
    assert job.due(10.0, at) == RunNow(1, 20.0)
    assert job.in_flight == 1
    assert not job.ended(1, ok())
    assert (job.runs, job.successes, job.failures) == (1, 1, 0)
    assert job.due(20.3, 20.0) == RunNow(2, 30.0), "late by 0.3 s: the grid does not drift"


def test_a_stale_tick_does_nothing() -> None:
    job = JobSchedule(interval_s=10)
    job.start(0.0)
    assert job.due(5.0, 5.0) is None
    assert job.due(10.0, 10.0) == RunNow(1, 20.0)
    assert job.due(10.0, 10.0) is None, "a second timer for the same tick is stale"
    assert job.runs == 1


def test_runs_never_overlap_a_tick_during_a_run_is_skipped() -> None:
    job = JobSchedule(interval_s=10)
    job.start(0.0)
    assert job.due(10.0, 10.0) == RunNow(1, 20.0)
    assert job.due(20.0, 20.0) == SkipTick(30.0)
    assert (job.runs, job.skipped, job.in_flight) == (1, 1, 1)
    job.ended(1, ok())
    assert job.due(30.0, 30.0) == RunNow(2, 40.0)


def test_ticks_missed_while_late_are_skipped_not_caught_up() -> None:
    job = JobSchedule(interval_s=10)
    job.start(0.0)
    assert job.due(35.0, 10.0) == RunNow(1, 40.0)
    assert job.skipped == 2


def test_max_runs_stops_the_job_when_the_last_run_ends() -> None:
    job = JobSchedule(interval_s=10, max_runs=2)
    job.start(0.0, run_immediately=True)
    assert job.due(0.0, 0.0) == RunNow(1, 10.0)
    job.ended(1, ok())
    assert job.due(10.0, 10.0) == RunNow(2, None)
    assert job.status is JobStatus.ACTIVE
    assert job.ended(2, failed())
    assert (job.status, job.stop_reason) == (JobStatus.STOPPED, StopReason.MAX_RUNS)
    assert job.due(20.0, 20.0) is None


def test_the_budget_stops_the_job_once_spent() -> None:
    job = JobSchedule(interval_s=10, max_cost_nusd=100)
    job.start(0.0)
    job.due(10.0, 10.0)
    assert not job.ended(1, ok(cost=60))
    job.due(20.0, 20.0)
    assert job.ended(2, failed(cost=60)), "a failed call that cost money counts too"
    assert (job.status, job.stop_reason, job.cost_nusd) == (
        JobStatus.STOPPED,
        StopReason.BUDGET,
        120,
    )
    assert job.next_run_at is None
    assert job.due(30.0, 30.0) is None


def test_pause_ignores_ticks_and_resume_picks_the_next_slot_after_now() -> None:
    job = JobSchedule(interval_s=10)
    job.start(0.0)
    assert job.pause()
    assert not job.pause()
    assert job.due(10.0, 10.0) is None
    assert job.resume(47.0) == 50.0
    assert job.resume(47.0) is None, "not paused any more"
    assert job.due(50.0, 50.0) == RunNow(1, 60.0)
    assert job.skipped == 0, "ticks missed while paused are not skips"


def test_resume_before_the_next_tick_keeps_it() -> None:
    job = JobSchedule(interval_s=10)
    job.start(0.0)
    job.pause()
    assert job.resume(3.0) == 10.0


def test_cancel_stops_for_good_but_the_run_in_flight_is_accounted() -> None:
    job = JobSchedule(interval_s=10)
    job.start(0.0)
    job.due(10.0, 10.0)
    assert job.cancel()
    assert not job.cancel()
    assert not job.ended(1, ok(cost=5)), "already stopped: cancelling is not undone"
    assert (job.stop_reason, job.cost_nusd, job.successes) == (StopReason.CANCELLED, 5, 1)
    assert job.due(20.0, 20.0) is None
    assert job.resume(20.0) is None


def test_duplicate_or_late_reports_change_nothing() -> None:
    job = JobSchedule(interval_s=10)
    job.start(0.0)
    job.due(10.0, 10.0)
    job.ended(1, ok(cost=5))
    assert not job.ended(1, ok(cost=5))
    assert (job.successes, job.cost_nusd) == (1, 5)


def test_failures_keep_the_reason() -> None:
    job = JobSchedule(interval_s=10)
    job.start(0.0)
    job.due(10.0, 10.0)
    job.ended(1, failed())
    assert job.last_error == "Failed(timeout): slow"
    job.due(20.0, 20.0)
    job.ended(2, None, "SystemStoppedError: draining")
    assert (job.failures, job.last_error) == (2, "SystemStoppedError: draining")


@settings(max_examples=200, deadline=None)
@given(
    max_runs=st.none() | st.integers(1, 5),
    max_cost=st.none() | st.integers(1, 50),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["tick", "stale", "end", "pause", "resume", "cancel"]),
            st.floats(0, 25),
            st.integers(0, 20),
        ),
        max_size=40,
    ),
)
def test_schedule_invariants_hold_for_any_sequence(
    max_runs: int | None, max_cost: int | None, steps: list[tuple[str, float, int]]
) -> None:
    job = JobSchedule(interval_s=10, max_runs=max_runs, max_cost_nusd=max_cost)
    now = 0.0
    job.start(now)
    for op, late, cost in steps:
        if op == "tick" and job.next_run_at is not None:
            now = max(now, job.next_run_at + late)
            decision = job.due(now, job.next_run_at)
            assert decision is None or decision.next_at is None or decision.next_at > now
        elif op == "stale":
            assert job.due(now, -1.0) is None
        elif op == "end" and job.in_flight is not None:
            job.ended(job.in_flight, ok(cost))
        elif op == "pause":
            job.pause()
        elif op == "resume":
            job.resume(now)
        elif op == "cancel":
            job.cancel()
        assert job.in_flight in (None, job.runs)
        assert job.max_runs is None or job.runs <= job.max_runs
        assert job.successes + job.failures == job.runs - (job.in_flight is not None)
        if max_cost is not None and job.cost_nusd >= max_cost:
            assert job.status is JobStatus.STOPPED
        if job.status is JobStatus.STOPPED:
            assert job.next_run_at is None
