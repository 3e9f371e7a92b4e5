"""Scheduling end to end: priorities under saturation, fallbacks, deadlines, backpressure."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
from callboard.core.breaker import BreakerConfig
from callboard.core.retry import RetryConfig
from callboard.messages import GetState, Redelivered, Submit
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S

from callboard import (
    Cancelled,
    Completed,
    Expired,
    ModelSettings,
    Priority,
    QueueFullError,
    Rejected,
    RejectReason,
    SchedulerSettings,
    System,
    SystemConfig,
)


@pytest.fixture
def sim() -> Iterator[SimulatedProvider]:
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.02), seed=1) as p:
        yield p


def test_critical_behind_a_thousand_low_goes_next(sim: SimulatedProvider) -> None:
    cap = 2
    settings = ModelSettings(name="m", base_url=sim.base_url, max_concurrency=cap)
    with System(SystemConfig(models=(settings,))) as system:
        t0 = time.monotonic()
        lows = system.submit_many([f"low {i}" for i in range(1000)], priority=Priority.LOW)
        assert lows[20].result(WAIT_S).ok  # saturated: the backlog is being served
        t_critical = time.monotonic()
        critical = system.submit("urgent", priority=Priority.CRITICAL).result(WAIT_S)
        system.cancel(*range(1, 1001))  # the rest of the backlog is not needed
        low_results = [f.result(WAIT_S) for f in lows]
    assert critical.ok
    critical_dispatch = t_critical + critical.queue_wait_s
    overtaking = [
        r
        for r in low_results
        if r.attempts and t_critical < t0 + r.queue_wait_s < critical_dispatch - 1e-3
    ]
    # only calls already granted when the CRITICAL task arrived may start before it
    assert len(overtaking) <= cap, len(overtaking)
    assert critical.queue_wait_s < 0.5


def test_open_breaker_moves_work_to_the_fallback_and_back_after_recovery(
    sim: SimulatedProvider,
) -> None:
    sim.configure("primary", ModelBehaviour(latency_s=0.005, status=503))
    breaker = BreakerConfig(consecutive_failures=3, cooldown_s=0.2, max_cooldown_s=0.4)
    primary = ModelSettings(
        name="primary",
        base_url=sim.base_url,
        max_concurrency=4,
        fallbacks=("backup",),
        breaker=breaker,
        retry=RetryConfig(max_attempts=1),
    )
    backup = ModelSettings(name="backup", base_url=sim.base_url, max_concurrency=4)
    with System(SystemConfig(models=(primary, backup))) as system:
        results = [
            f.result(WAIT_S)
            for f in system.submit_many([f"q{i}" for i in range(30)], model="primary")
        ]
        assert all(isinstance(r, Completed) for r in results)
        assert Counter(r.model for r in results) == {"backup": 30}
        primary_calls = sim.stats()["models"]["primary"]["requests"]
        # the first calls in flight, then one half-open probe per cool-down: the
        # other tasks never went to the failing model
        assert primary_calls < 10
        sim.configure("primary", ModelBehaviour(latency_s=0.005))
        served_by = ""
        for i in range(200):  # until a half-open probe succeeds and closes the breaker
            served_by = system.submit(f"after {i}", model="primary").result(WAIT_S).model or ""
            if served_by == "primary":
                break
        assert served_by == "primary"
        again = [
            f.result(WAIT_S)
            for f in system.submit_many([f"r{i}" for i in range(10)], model="primary")
        ]
    assert Counter(r.model for r in again) == {"primary": 10}


def test_tasks_whose_deadline_passes_in_the_queue_never_reach_the_server(
    sim: SimulatedProvider,
) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.3))
    settings = ModelSettings(name="m", base_url=sim.base_url, max_concurrency=1)
    with System(SystemConfig(models=(settings,))) as system:
        first = system.submit("occupies the only slot")
        hurried = system.submit_many([f"h{i}" for i in range(20)], deadline_s=0.1)
        results = [f.result(WAIT_S) for f in hurried]
        assert first.result(WAIT_S).ok
    assert all(isinstance(r, Expired) for r in results)
    assert all(r.attempts == 0 for r in results)
    assert sim.stats()["models"]["m"]["requests"] == 1


def test_full_queue_rejects_or_blocks_when_asked(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.05))
    settings = ModelSettings(name="m", base_url=sim.base_url, max_concurrency=2)
    config = SystemConfig(models=(settings,), scheduler=SchedulerSettings(capacity=10))
    with System(config) as system:
        burst = system.submit_many([f"b{i}" for i in range(30)])
        outcomes = [f.result(WAIT_S) for f in burst]
        rejected = [r for r in outcomes if isinstance(r, Rejected)]
        assert len(rejected) == 20
        assert all(r.reason is RejectReason.QUEUE_FULL for r in rejected)
        more = system.submit_many([f"w{i}" for i in range(10)])
        waited = system.submit("waits for room", wait_s=WAIT_S)  # blocks, then is admitted
        assert waited.result(WAIT_S).ok
        assert all(f.result(WAIT_S).ok for f in more)
        system.submit_many([f"x{i}" for i in range(10)])
        with pytest.raises(QueueFullError):
            system.submit("no room soon enough", wait_s=0.001)


def test_a_budget_is_never_exceeded_under_fifty_concurrent_calls(sim: SimulatedProvider) -> None:
    from decimal import Decimal

    from callboard import Failed, FailureReason, Price
    from callboard.config import BudgetSettings

    price = Price(input_per_mtok=Decimal(1000), output_per_mtok=Decimal(2000))
    settings = ModelSettings(name="m", base_url=sim.base_url, max_concurrency=50, price=price)
    budget = Decimal("0.50")
    config = SystemConfig(models=(settings,), budget=BudgetSettings(total_usd=budget))
    with System(config) as system:
        futures = system.submit_many([f"spend {i}" for i in range(400)], max_tokens=64)
        results = [f.result(WAIT_S) for f in futures]
        spent = system.rt.budget.snapshot() if system.rt.budget else {}
    completed = [r for r in results if isinstance(r, Completed)]
    refused = [r for r in results if isinstance(r, Failed)]
    assert completed
    assert refused
    assert all(r.reason is FailureReason.BUDGET_EXCEEDED for r in refused)
    assert all(r.attempts == 0 for r in refused)  # refused before any call
    total = sum(r.cost_usd for r in completed)
    assert total <= budget
    assert spent["spent_nusd"] == sum(r.cost_nusd for r in completed)
    assert spent["reserved_nusd"] == 0
    assert sim.stats()["models"]["m"]["requests"] == len(completed)


def test_tasks_that_cannot_get_a_slot_before_their_deadline_escalate(
    sim: SimulatedProvider,
) -> None:
    sim.configure("busy", ModelBehaviour(latency_s=0.4))
    sim.configure("spare", ModelBehaviour(latency_s=0.01))
    busy = ModelSettings(name="busy", base_url=sim.base_url, max_concurrency=1)
    spare = ModelSettings(name="spare", base_url=sim.base_url, max_concurrency=8)
    config = SystemConfig(
        models=(busy, spare),
        default_route=("busy",),
        escalate_to="spare",
        scheduler=SchedulerSettings(escalate_margin_s=0.3),
    )
    with System(config) as system:
        futures = system.submit_many([f"d{i}" for i in range(6)], deadline_s=0.6)
        results = [f.result(WAIT_S) for f in futures]
    assert all(isinstance(r, Completed) for r in results), results
    models = Counter(r.model for r in results)
    assert models["busy"] >= 1  # the first took the only slot
    assert models["spare"] >= 4  # the rest escalated instead of expiring


def test_a_redelivered_submit_at_full_capacity_is_not_refused(sim: SimulatedProvider) -> None:
    """A Submit handed again to ingest (its incarnation crashed after accepting) finds
    its own tasks live: they must not be refused as QUEUE_FULL, or they end twice."""
    sim.configure("m", ModelBehaviour(latency_s=0.05))
    settings = ModelSettings(name="m", base_url=sim.base_url, max_concurrency=1)
    config = SystemConfig(models=(settings,), scheduler=SchedulerSettings(capacity=4))
    with System(config) as system:
        tasks = tuple(system._task(f"t{i}", {}) for i in range(4))
        system._send(tasks)
        system._send(tasks)  # the redelivery
        results = [t.future.result(WAIT_S) for t in tasks if t.future is not None]
        assert [r.ok for r in results] == [True] * 4
        assert system.drain(WAIT_S)
        counts = system.ledger.counts()
        assert (counts.accepted, counts.rejected, counts.finished) == (4, 0, 4)


def test_a_cancel_that_overtakes_its_submit_still_cancels(sim: SimulatedProvider) -> None:
    """``cancel(id)`` right after ``submit`` can reach the queue while the task is still
    in the front door's mailbox (announced, not yet accepted): it must not be dropped."""
    settings = ModelSettings(name="m", base_url=sim.base_url)
    with System(SystemConfig(models=(settings,))) as system:
        tasks = tuple(system._task(f"t{i}", {}) for i in range(5))
        system.ledger.announce(tasks)  # what submit does before it tells ingest
        system.cancel(*(t.task_id for t in tasks))
        system.ask("queue", GetState())  # the queue has handled the Cancel
        system.tell("ingest", Submit(tasks=tasks))
        results = [t.future.result(WAIT_S) for t in tasks if t.future is not None]
        assert system.drain(WAIT_S)
    assert [type(r) for r in results] == [Cancelled] * 5
    assert sim.stats()["models"].get("m", {}).get("requests", 0) == 0


def test_cancelling_at_once_after_submitting_never_leaves_a_future_pending(
    sim: SimulatedProvider,
) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.05))
    settings = ModelSettings(name="m", base_url=sim.base_url, max_concurrency=1)
    with System(SystemConfig(models=(settings,))) as system:
        futures = []
        for r in range(20):
            batch = system.submit_many([f"r{r} t{i}" for i in range(100)], priority=Priority.LOW)
            system.cancel(*(f.task_id for f in batch))
            futures += batch
        results = [f.result(WAIT_S) for f in futures]
    outcomes = Counter(type(r) for r in results)
    assert set(outcomes) <= {Cancelled, Completed}, outcomes
    assert outcomes[Cancelled] >= len(futures) - 20  # at most a call per round got out first


def test_a_submit_redelivered_after_its_tasks_ended_calls_nobody_again(
    sim: SimulatedProvider,
) -> None:
    """Ingest crashed after accepting (its Submit is handed to the next incarnation),
    and the tasks ended meanwhile: the redelivery must not accept them again."""
    settings = ModelSettings(name="m", base_url=sim.base_url)
    config = SystemConfig(models=(settings,), scheduler=SchedulerSettings(capacity=3))
    with System(config) as system:
        tasks = tuple(system._task(f"t{i}", {}) for i in range(4))  # the 4th is refused: full
        system._send(tasks)
        results = [t.future.result(WAIT_S) for t in tasks if t.future is not None]
        assert system.drain(WAIT_S)
        system.tell("ingest", Redelivered(message=Submit(tasks=tasks), count=1))
        system.ask("ingest", GetState())
        assert system.drain(WAIT_S)
        counts = system.ledger.counts()
    assert [type(r) for r in results].count(Completed) == 3
    assert (counts.accepted, counts.rejected, counts.finished) == (3, 1, 3)
    assert sim.stats()["models"]["m"]["requests"] == 3
