"""Hunting bugs in the REPL face: the shell, the one-line start, the patterns, jobs and stats.

Everything runs on real parts: a real ``System`` with its actor threads, the
simulated provider over 127.0.0.1. Stats are checked against what was actually
done (the provider's own counters, prices times usage). Tests wait on futures,
events or polled conditions with deadlines, never on bare sleeps.

A test marked ``xfail(strict=True)`` pins a bug: its reason names the cause.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
from callboard.core.pricing import cost_nusd
from callboard.messages import Cancelled, Completed, Rejected, Usage
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.supervisor.address_book import UnknownActorError
from support import WAIT_S

from callboard import (
    ModelSettings,
    Price,
    Request,
    SchedulerSettings,
    System,
    SystemConfig,
    SystemStoppedError,
    UsageError,
    messages,
)
from callboard.jobs import JobStatus, StopReason
from callboard.shell import main, make_console, short_repr

PRICE = Price(input_per_mtok=Decimal("1.00"), output_per_mtok=Decimal("2.00"))


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Poll ``condition`` (a state with no event to wait on) until it holds or ``timeout``."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            return False
        pause.wait(0.003)
    return True


@pytest.fixture
def sim() -> Iterator[SimulatedProvider]:
    with SimulatedProvider(
        models={
            "alpha": ModelBehaviour(latency_s=0.01),
            "beta": ModelBehaviour(latency_s=0.02),
            "slow": ModelBehaviour(latency_s=0.4, completion_tokens=20),
            "timer": ModelBehaviour(latency_s=1.05),
            "single": ModelBehaviour(latency_s=0.3),
            "bad": ModelBehaviour(latency_s=0.0, status=400),
        },
        seed=11,
    ) as provider:
        yield provider


@pytest.fixture
def cb(sim: SimulatedProvider) -> Iterator[System]:
    models = tuple(
        ModelSettings(
            name=name,
            base_url=sim.base_url,
            price=PRICE,
            max_concurrency=1 if name == "single" else 16,
        )
        for name in ("alpha", "beta", "slow", "timer", "single", "bad")
    )
    system = System(SystemConfig(models=models))
    try:
        yield system
    finally:
        system.stop(timeout=WAIT_S)


def served(sim: SimulatedProvider, model: str) -> dict[str, Any]:
    counters: dict[str, Any] = sim.stats()["models"].get(model, {})
    return counters


# -- stats against what was actually done ------------------------------------------------


def test_stats_match_the_providers_counters_and_the_price_table(
    cb: System, sim: SimulatedProvider
) -> None:
    futures = cb.submit_many([f"question {i}" for i in range(12)], model="alpha")
    futures += cb.submit_many([f"other {i}" for i in range(5)], model="beta", priority="high")
    results = [f.result(WAIT_S) for f in futures]
    assert cb.drain(WAIT_S)
    assert all(r.ok for r in results)
    stats = cb.stats()
    assert stats.outcomes == {"completed": 17}
    for model, n in (("alpha", 12), ("beta", 5)):
        counters = served(sim, model)
        group = stats.by_model[model]
        assert counters["requests"] == n == group.finished == group.attempts
        assert group.prompt_tokens == counters["prompt_tokens"]
        assert group.completion_tokens == counters["completion_tokens"]
        billed = cost_nusd(
            PRICE,
            Usage(
                prompt_tokens=counters["prompt_tokens"],
                completion_tokens=counters["completion_tokens"],
            ),
        )
        assert group.cost_nusd == billed
    assert stats.total.cost_nusd == sum(r.cost_nusd for r in results)
    assert stats.by_priority["HIGH"].finished == 5
    assert stats.by_priority["NORMAL"].finished == 12
    for group in (*stats.by_model.values(), *stats.by_priority.values(), stats.total):
        lat = group.latency
        assert lat.count == group.finished
        assert lat.p50 is not None
        assert lat.p95 is not None
        assert lat.p99 is not None
        assert lat.max is not None
        assert 0 <= lat.p50 <= lat.p95 <= lat.p99 <= lat.max
    assert stats.ledger["accepted"] == stats.ledger["finished"] == 17


def test_a_race_bills_every_entrant_sent_and_cancels_the_unsent_one(
    cb: System, sim: SimulatedProvider
) -> None:
    race = cb.race("hello", models=["alpha", "slow"], timeout=WAIT_S)
    assert race.ok
    assert race.model == "alpha"
    (loser,) = race.losers.result(WAIT_S)
    assert isinstance(loser, Completed)
    assert loser.model == "slow"
    assert race.total_cost_usd(WAIT_S) == Decimal(race.result.cost_nusd + loser.cost_nusd) / (10**9)
    blocker = cb.submit("hold the single slot", model="single")
    assert wait_until(lambda: served(sim, "single").get("in_flight", 0) == 1)
    second = cb.race("again", models=["alpha", "single"], timeout=WAIT_S)
    assert second.model == "alpha"
    (unsent,) = second.losers.result(WAIT_S)
    assert isinstance(unsent, Cancelled)
    assert unsent.cost_nusd == 0
    assert blocker.result(WAIT_S).ok
    assert cb.drain(WAIT_S)
    stats = cb.stats()
    assert stats.outcomes == {"completed": 4, "cancelled": 1}
    assert served(sim, "single")["requests"] == 1  # the cancelled loser was never sent
    assert served(sim, "slow")["requests"] == 1
    expected = race.result.cost_nusd + loser.cost_nusd + second.result.cost_nusd
    expected += blocker.result().cost_nusd
    assert stats.total.cost_nusd == expected
    assert len({race.trace_id, second.trace_id}) == 2


def test_attempts_count_the_call_sent_again_after_a_model_restart(
    cb: System, sim: SimulatedProvider
) -> None:
    future = cb.submit("hello there", model="slow")
    assert wait_until(lambda: served(sim, "slow").get("in_flight", 0) == 1)
    cb.tell("model:slow", messages.Crash())
    result = future.result(WAIT_S)
    assert result.ok
    assert cb.drain(WAIT_S)
    sent = served(sim, "slow")["requests"]
    assert sent == 2  # the dead incarnation's call, and the one sent again
    assert result.attempts == sent
    assert cb.stats().total.attempts == sent


def test_the_models_view_in_stats_is_current_once_a_model_is_idle(cb: System) -> None:
    assert cb.submit("wait about a second", model="timer").result(WAIT_S).ok
    result = cb.submit("hi", model="alpha").result(WAIT_S)
    assert result.ok
    assert cb.drain(WAIT_S)
    state = cb.ask("model:alpha", messages.GetState())
    assert state["in_flight"] == 0
    assert state["latency_ewma_s"] is not None
    view = cb.stats().models["alpha"]
    assert view["in_flight"] == 0
    assert view["latency_ewma_s"] is not None


# -- patterns: misuse, errors, fields --------------------------------------------------------


def test_gather_refuses_a_bare_string_before_sending_anything(cb: System) -> None:
    before = cb.stats().ledger["accepted"]
    with pytest.raises(UsageError):
        cb.gather("hi")
    assert cb.stats().ledger["accepted"] == before


def test_a_chain_stage_returning_a_request_does_not_drop_the_chains_fields(cb: System) -> None:
    try:
        out = cb.chain(["first: {input}", Request.of], "go", model="beta")
    except UsageError:
        return  # refusing the mix, as Request.of does, would be fine too
    assert out.ok
    assert [r.model for r in out.results] == ["beta", "beta"]


def test_a_chain_with_an_idempotency_key_runs_every_stage(cb: System) -> None:
    try:
        out = cb.chain(["a {input}", "b {input}"], "x", model="alpha", idempotency_key="k")
    except UsageError:
        return  # refusing the key would be fine too
    assert out.ok, out.result
    assert len(out.results) == 2


def test_chain_stops_at_a_failure_and_shares_one_trace_id(cb: System) -> None:
    out = cb.chain(["a {input}", "b {input}", "c {input}"], "x", model="alpha")
    assert out.ok
    assert len(out.results) == 3
    assert {r.trace_id for r in out.results} == {out.trace_id}
    failed = cb.chain(
        ["a {input}", lambda t: {"prompt": t, "model": "bad"}, "never {input}"], "x", model="alpha"
    )
    assert not failed.ok
    assert failed.failed_stage == 1
    assert len(failed.results) == 2


def test_gather_first_returns_one_result_and_cancels_the_unsent_rest(
    cb: System, sim: SimulatedProvider
) -> None:
    first = cb.gather(["one", "two", "three"], return_when="first", model="single")
    assert first.ok
    assert cb.drain(WAIT_S)
    outcomes = cb.stats().outcomes
    # a freed slot is refilled before its result is delivered: the next may be sent already
    assert outcomes.get("cancelled", 0) >= 1
    assert outcomes["completed"] + outcomes["cancelled"] == 3
    assert served(sim, "single")["requests"] == outcomes["completed"]


def test_asking_an_unknown_actor_is_a_misuse_error_not_a_stopped_system(cb: System) -> None:
    with pytest.raises(UnknownActorError):
        cb.tell("model:alfa", messages.GetState())
    with pytest.raises((UnknownActorError, UsageError)):
        cb.ask("model:alfa", messages.GetState())


# -- recurring jobs -----------------------------------------------------------------------


def test_a_recurring_job_with_an_idempotency_key_runs_every_time(cb: System) -> None:
    request = {"prompt": "ping", "model": "alpha", "idempotency_key": "nightly"}
    try:
        job = cb.every(0.05, request, max_runs=3, run_immediately=True)
    except UsageError:
        return  # refusing the key, as every() refuses a trace_id, would be fine too
    info = job.wait(timeout=WAIT_S)
    assert info.runs == 3
    assert info.failures == 0, info.last_error
    assert info.successes == 3


def test_a_job_pauses_resumes_and_ends_at_stop_without_piling_up(
    sim: SimulatedProvider,
) -> None:
    system = System(SystemConfig(models=(ModelSettings(name="alpha", base_url=sim.base_url),)))
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


# -- the REPL -------------------------------------------------------------------------------


def test_the_shell_over_a_pipe_exits_on_eof_leaving_no_thread_behind(
    monkeypatch: pytest.MonkeyPatch, sim: SimulatedProvider
) -> None:
    started: list[System] = []

    def make(config: SystemConfig | None) -> System:
        assert config is None
        system = System(
            SystemConfig(
                models=(
                    ModelSettings(name="alpha", base_url=sim.base_url),
                    ModelSettings(name="beta", base_url=sim.base_url),
                )
            )
        )
        started.append(system)
        return system

    before = set(threading.enumerate())
    lines = [
        'job = every(cb, 0.05, "ping", run_immediately=True)',
        "job.wait(lambda i: i.runs >= 2, timeout=30).runs >= 2",
        'patterns.race(cb, "hi", models=["alpha", "beta"], timeout=30).ok',
        'cb.gather(["a", "b"], timeout=30)[1].ok',
        'cb.submit("left in flight at EOF")',
    ]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([], make_system=make)
    assert status == 0
    assert "Traceback" not in err.getvalue(), err.getvalue()
    assert out.getvalue().count("True") == 3
    (system,) = started
    assert "stopped" in repr(system)
    with pytest.raises(SystemStoppedError):
        system.submit("after EOF")
    assert wait_until(lambda: not (set(threading.enumerate()) - before), timeout=5)


def test_console_echoes_bounded_lines_without_secrets(sim: SimulatedProvider) -> None:
    key = "sk-very-secret-0123456789"
    system = System(
        SystemConfig(models=(ModelSettings(name="alpha", base_url=sim.base_url, api_key=key),))
    )
    try:
        console = make_console(system)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            for line in (
                "cb",
                "cb.models",
                "cb.config",
                'cb.ask("model:alpha", messages.GetState())',
            ):
                assert not console.push(line)
        echoed = out.getvalue()
        assert key not in echoed
        assert all(len(line) <= 600 for line in echoed.splitlines())
        assert key not in short_repr(system.models)
        assert key not in repr(system.config)
    finally:
        system.stop(timeout=WAIT_S)


def test_a_full_queue_is_reported_as_rejected_in_the_stats(sim: SimulatedProvider) -> None:
    models = (ModelSettings(name="single", base_url=sim.base_url, max_concurrency=1),)
    system = System(SystemConfig(models=models, scheduler=SchedulerSettings(capacity=2)))
    try:
        results = [f.result(WAIT_S) for f in system.submit_many([f"q{i}" for i in range(6)])]
        assert system.drain(WAIT_S)
        rejected = sum(isinstance(r, Rejected) for r in results)
        assert rejected >= 1
        stats = system.stats()
        assert stats.outcomes.get("rejected", 0) == rejected
        assert stats.outcomes.get("completed", 0) == len(results) - rejected
        assert stats.ledger["rejected"] == rejected
    finally:
        system.stop(timeout=WAIT_S)
