"""Fallback: every rewrite of where a task may go, checked directly (pure, no clock:
times and latencies are arguments, as the queue and the model actor pass them)."""

from __future__ import annotations

from typing import Any

import pytest
from callboard.core.fallback import (
    Availability,
    escalate,
    escalation_at,
    leave,
    place,
    stranded,
    too_late,
    within,
)
from callboard.messages import BreakerState, FailureReason, Health, Job, Request, Task
from hypothesis import given
from hypothesis import strategies as st

OPEN, HALF_OPEN, CLOSED = BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED


def job(
    candidates: tuple[str, ...],
    fallbacks: tuple[str, ...] = (),
    *,
    deadline_at: float | None = None,
    **fields: Any,
) -> Job:
    task = Task(
        task_id=1, trace_id="t1", request=Request.of("x"), submitted_at=0.0, deadline_at=deadline_at
    )
    return Job(task=task, candidates=candidates, fallbacks=fallbacks, **fields)


def down(*models: str, state: BreakerState = OPEN) -> Availability:
    view = Availability()
    for m in models:
        view.observe(Health(model=m, breaker=state))
    return view


def plan(j: Job | None) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    return None if j is None else (j.candidates, j.fallbacks)


# -- the view of what is down -----------------------------------------------------------


def test_a_model_is_down_while_open_or_half_open_and_up_once_closed() -> None:
    view = Availability()
    assert "a" not in view
    assert not view  # nothing down: place() takes its fast path
    assert view.observe(Health(model="a", breaker=OPEN))  # went down
    assert "a" in view
    assert not view.observe(Health(model="a", breaker=HALF_OPEN))  # still down: no change
    assert "a" in view
    assert view.observe(Health(model="a", breaker=CLOSED))  # came back
    assert "a" not in view
    assert not view.observe(Health(model="a", breaker=CLOSED))
    assert list(down("b", "a")) == ["a", "b"]


def test_a_model_resting_out_a_long_pause_is_down_until_it_nears_its_end() -> None:
    """A long Retry-After (a daily limit spent) keeps the breaker closed, but the
    model is out for jobs with a fallback, as if open (found by a hunt: its work
    waited the pause out, up to hours, while the fallback stood idle)."""
    view = Availability()
    assert view.observe(Health(model="a", breaker=CLOSED, paused_until=40.0, resting=True))
    assert "a" in view
    assert view.observe(Health(model="a", breaker=CLOSED, paused_until=40.0, resting=False))
    assert "a" not in view


# -- where a job may go now ---------------------------------------------------------------


def test_with_nothing_down_a_job_goes_to_its_candidates_only() -> None:
    j = job(("a", "b"), ("c",))
    assert place(j, Availability()) is j.candidates  # the same (shared) tuple


def test_a_group_with_a_model_up_keeps_the_down_one_for_when_it_recovers() -> None:
    assert place(job(("a", "b"), ("c",)), down("a")) == ("a", "b")


@pytest.mark.parametrize("state", [OPEN, HALF_OPEN])
def test_a_down_candidate_keeps_its_job_and_the_first_fallback_up_takes_it_too(
    state: BreakerState,
) -> None:
    # ``a`` stays in the placement: its half-open probe takes a job from it, and once it
    # is closed the job goes back to it alone.
    j = job(("a",), ("b", "c", "d"))
    assert place(j, down("a", state=state)) == ("a", "b")
    assert place(j, down("a", "b")) == ("a", "b", "c")
    view = down("a", "b")
    view.observe(Health(model="a", breaker=CLOSED))
    assert place(j, view) == ("a",)


def test_when_every_model_of_the_plan_is_down_the_job_waits_on_all_of_them() -> None:
    j = job(("a",), ("b",))
    assert place(j, down("a", "b")) == ("a", "b")
    assert place(job(("a",)), down("a")) == ("a",)


# -- a model gives up on a job -----------------------------------------------------------


def test_a_model_that_gives_up_leaves_the_group_and_the_count_starts_again() -> None:
    j = job(("a", "b"), ("c",), attempt=5, model_attempt=3)
    moved = leave(j, "a")
    assert plan(moved) == (("b",), ("c",))
    assert moved is not None
    assert (moved.attempt, moved.model_attempt) == (5, 0)  # the total goes on


def test_the_last_of_the_group_hands_over_to_the_first_fallback() -> None:
    assert plan(leave(job(("a",), ("b", "c")), "a")) == (("b",), ("c",))


def test_a_fallback_that_gives_up_leaves_the_plan_and_the_candidates_stay() -> None:
    # served by ``b`` while ``a`` was down: ``a`` is still wanted
    assert plan(leave(job(("a",), ("b", "c")), "b")) == (("a",), ("c",))


def test_nothing_left_means_nowhere_to_go() -> None:
    assert leave(job(("a",)), "a") is None


# -- too late for a model ---------------------------------------------------------------


def test_too_late_drops_the_model_and_every_model_as_slow() -> None:
    j = job(("slow", "slower", "fast"), ("fb",), deadline_at=10.0)
    latency = {"slow": 2.0, "slower": 3.0, "fast": 0.1}
    assert plan(too_late(j, "slow", 1.5, latency)) == (("fast",), ("fb",))


def test_too_late_for_the_whole_group_goes_on_to_a_fallback_that_can_make_it() -> None:
    j = job(("slow",), ("fast",), deadline_at=10.0)
    assert plan(too_late(j, "slow", 1.0, {"slow": 2.0, "fast": 0.2})) == (("fast",), ())


def test_a_model_not_measured_yet_counts_as_fast_enough() -> None:
    assert plan(too_late(job(("slow", "new")), "slow", 1.0, {"slow": 2.0})) == (("new",), ())


def test_too_late_everywhere_or_past_the_deadline_expires() -> None:
    latency = {"a": 2.0, "b": 2.0}
    assert too_late(job(("a",), ("b",)), "a", 1.0, latency) is None
    assert too_late(job(("a", "b")), "a", 0.0, {}) is None  # no time left at all
    assert too_late(job(("a", "b")), "a", -1.0, {}) is None


# -- escalation near the deadline -------------------------------------------------------


def test_escalation_is_due_the_margin_before_the_deadline() -> None:
    j = job(("busy",), ("spare",), deadline_at=10.0)
    assert escalation_at(j, "spare", margin_s=0.5, target_latency_s=0.1) == 9.5
    # at least twice the target's own latency before it
    assert escalation_at(j, "spare", margin_s=0.5, target_latency_s=1.0) == 8.0


@pytest.mark.parametrize(
    ("j", "target"),
    [
        (job(("busy",), ("spare",)), "spare"),  # no deadline
        (job(("busy",), ("spare",), deadline_at=10.0), None),  # no target
        (job(("busy",), ("other",), deadline_at=10.0), "spare"),  # the plan left it out
        (job(("spare",), ("busy",), deadline_at=10.0), "spare"),  # it heads the plan already
    ],
)
def test_no_escalation_without_a_deadline_or_a_target_the_plan_holds(
    j: Job, target: str | None
) -> None:
    assert escalation_at(j, target, margin_s=0.5, target_latency_s=0.0) is None


def test_escalation_puts_the_target_first_and_keeps_the_rest_in_order() -> None:
    j = job(("a", "b"), ("c", "spare", "d"), deadline_at=10.0)
    assert plan(escalate(j, "spare")) == (("spare",), ("a", "b", "c", "d"))
    assert escalate(job(("a",), ("b",)), "spare") is None  # it left the plan meanwhile


# -- the budget narrows a plan ----------------------------------------------------------


def test_the_budget_keeps_the_models_it_allows() -> None:
    assert within(("a", "b"), ("c", "d"), {"b", "d"}) == (("b",), ("d",))
    assert within(("a",), ("c", "d"), ("d", "c")) == (("c",), ("d",))  # plan order stays
    assert within(("a",), ("b",), ()) is None


# -- what always holds --------------------------------------------------------------------

_MODELS = ("a", "b", "c", "d", "e")


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    models = draw(st.permutations(_MODELS))
    n = draw(st.integers(1, len(models)))
    split = draw(st.integers(1, n))
    return job(tuple(models[:split]), tuple(models[split:n]))


@given(j=jobs(), gone=st.sets(st.sampled_from(_MODELS)))
def test_placement_is_never_empty_and_follows_the_plan(j: Job, gone: set[str]) -> None:
    lanes = place(j, down(*gone))
    everything = (*j.candidates, *j.fallbacks)
    assert lanes
    assert lanes == tuple(m for m in everything if m in lanes)  # plan order, no repeats
    assert set(j.candidates) <= set(lanes)  # a down candidate keeps its work
    up = [m for m in lanes if m not in gone]
    if any(m not in gone for m in everything):
        assert up  # some model that is up may take it
        assert up[-1] == lanes[-1] or up[-1] in j.candidates  # nothing past the first one up
    else:
        assert lanes == everything  # all down: it waits on all


@given(j=jobs(), model=st.sampled_from(_MODELS), left=st.floats(-1.0, 5.0))
def test_a_rewrite_only_drops_models_never_adds_or_repeats_one(
    j: Job, model: str, left: float
) -> None:
    everything = (*j.candidates, *j.fallbacks)
    latency = {m: float(i) for i, m in enumerate(_MODELS)}
    for rewritten in (leave(j, model), too_late(j, model, left, latency)):
        if rewritten is None:
            continue
        after = (*rewritten.candidates, *rewritten.fallbacks)
        assert rewritten.candidates
        assert model not in after
        assert len(set(after)) == len(after)
        assert after == tuple(m for m in everything if m in after)  # order kept
    if set(everything) - {model}:
        assert leave(j, model) is not None  # a model remains: somewhere to go


# -- given up on: a job with no model left to wait for ----------------------------------


def test_a_job_is_stranded_only_when_every_model_of_its_plan_is_given_up_on() -> None:
    view = Availability()
    j = job(("a",), ("b",))
    down = FailureReason.PROVIDER_DOWN
    view.observe(Health(model="a", breaker=OPEN, given_up=down, last_error="connection: refused"))
    assert stranded(j, view) is None, "b may still serve it"
    view.observe(Health(model="b", breaker=OPEN, given_up=FailureReason.AUTHENTICATION))
    reason, detail = stranded(j, view) or (None, "")
    assert reason is down, "the first model's reason"
    assert detail == "a is given up on (connection: refused); b is given up on (authentication)"
    view.observe(Health(model="a", breaker=HALF_OPEN))
    assert stranded(j, view) is None, "half-open, a waits for a probe"
