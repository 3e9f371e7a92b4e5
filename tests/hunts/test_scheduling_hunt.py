"""Hunting scheduling bugs end to end: budgets, deadlines, rate limits, breakers, routing.

Every test runs a real ``System`` over loopback HTTP against the simulated
provider (or a pure core directly) and synchronises on futures with timeouts.
Tests marked ``xfail(strict=True)`` expose a bug named in their reason.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from callboard.actors.base import CrashPlan
from callboard.core.breaker import BreakerConfig
from callboard.core.limiter import LimiterConfig
from callboard.core.pricing import Price, estimate_nusd
from callboard.core.retry import RetryConfig
from callboard.messages import GetState
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S

from callboard import (
    Completed,
    Failed,
    FailureReason,
    ModelSettings,
    SchedulerSettings,
    System,
    SystemConfig,
)
from callboard.config import BudgetSettings


@pytest.fixture
def sim() -> Iterator[SimulatedProvider]:
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.01), seed=3) as p:
        yield p


def _until(predicate: Any, timeout: float = WAIT_S, what: str = "condition") -> None:
    """Wait for ``predicate()`` by re-asking it (each ask is a round trip, not a sleep)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.005)


def _breaker(system: System, model: str) -> str:
    return str(system.ask(f"model:{model}", GetState())["breaker"])


def _server_requests(sim: SimulatedProvider, model: str) -> int:
    return int(sim.stats()["models"].get(model, {}).get("requests", 0))


def _arrivals_monotonic(sim: SimulatedProvider, model: str) -> list[float]:
    """Server-side arrival times of ``model``'s requests, on ``time.monotonic``'s clock."""
    started = sim._core._started
    return [started + t for t in sim.stats()["models"].get(model, {}).get("arrivals", [])]


class _BudgetWatch:
    """Wraps a system's ``Budgets`` to record the peak of spent + reserved after every
    reserve and settle (the invariant must hold at every moment, not only at the end)."""

    def __init__(self, system: System) -> None:
        assert system.rt.budget is not None
        self.budgets = system.rt.budget._budgets
        self.peak_total = 0
        self.peak_tag: dict[str, int] = {}
        for name in ("reserve", "settle", "release"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        inner = getattr(self.budgets, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            b = self.budgets
            self.peak_total = max(self.peak_total, b.spent + b.reserved)
            for tag, led in b._tags.items():
                self.peak_tag[tag] = max(self.peak_tag.get(tag, 0), led.spent + led.reserved)
            return out

        setattr(self.budgets, name, wrapped)


# -- escalation ignores the plan's constraints --------------------------------------------


def _escalation_config(sim: SimulatedProvider, **spare: Any) -> SystemConfig:
    sim.configure("busy", ModelBehaviour(latency_s=0.4, completion_tokens=50))
    sim.configure("spare", ModelBehaviour(latency_s=0.01, completion_tokens=50))
    busy = ModelSettings(
        name="busy",
        base_url=sim.base_url,
        max_concurrency=1,
        price=Price(1, 1),
        capabilities=frozenset({"vision"}),
    )
    spare_model = ModelSettings(name="spare", base_url=sim.base_url, max_concurrency=8, **spare)
    return SystemConfig(
        models=(busy, spare_model),
        default_route=("busy",),
        escalate_to="spare",
        scheduler=SchedulerSettings(escalate_margin_s=0.3),
    )


def test_escalation_never_takes_spending_over_the_budget(sim: SimulatedProvider) -> None:
    config = _escalation_config(sim, price=Price(100, 100))
    one_busy = estimate_nusd(Price(1, 1), 8, 50)  # prompt "dN" ~ 8 tokens
    budget_nusd = 10 * one_busy  # room for ten busy calls; a spare call (100x) never fits
    config = SystemConfig(
        models=config.models,
        default_route=config.default_route,
        escalate_to=config.escalate_to,
        scheduler=config.scheduler,
        budget=BudgetSettings(total_usd=Decimal(budget_nusd) / 10**9),
    )
    with System(config) as system:
        watch = _BudgetWatch(system)
        futures = system.submit_many([f"d{i}" for i in range(6)], deadline_s=0.6, max_tokens=50)
        results = [f.result(WAIT_S) for f in futures]
        assert system.drain(WAIT_S)
    assert all(r.attempts <= 1 for r in results)
    spent = sum(r.cost_nusd for r in results)
    assert spent <= budget_nusd, (spent, budget_nusd, Counter(r.model for r in results))
    assert watch.peak_total <= budget_nusd


@pytest.mark.parametrize(
    ("spare", "metadata"),
    [
        pytest.param({}, {"capabilities": ["vision"]}, id="missing-capability"),
        pytest.param({"context_window": 20}, {}, id="context-too-small"),
    ],
)
def test_escalation_respects_capabilities_and_context(
    sim: SimulatedProvider, spare: dict[str, Any], metadata: dict[str, Any]
) -> None:
    config = _escalation_config(sim, **spare)
    with System(config) as system:
        futures = system.submit_many(
            [f"d{i}" for i in range(6)], deadline_s=0.6, max_tokens=50, metadata=metadata
        )
        results = [f.result(WAIT_S) for f in futures]
    served = Counter(r.model for r in results if isinstance(r, Completed))
    assert served["busy"] >= 1
    assert "spare" not in served, served  # spare cannot serve these requests


# -- a router restart with a budget -------------------------------------------------------


def test_a_router_restart_with_a_budget_loses_no_task_and_no_money(
    sim: SimulatedProvider,
) -> None:
    price = Price(1, 1)
    models = (ModelSettings(name="m", base_url=sim.base_url, max_concurrency=8, price=price),)
    config = SystemConfig(models=models, budget=BudgetSettings(total_usd=Decimal(100)))
    with System(config, crash_plan=CrashPlan({"router": 3})) as system:
        futures = []
        for batch in range(8):
            futures += system.submit_many([f"b{batch} t{i}" for i in range(5)], max_tokens=16)
        results = [f.result(WAIT_S) for f in futures]
        assert system.drain(WAIT_S)
        snapshot = system.rt.budget.snapshot() if system.rt.budget else {}
        restarts = system.supervision()["router"]["restarts"]
    assert restarts >= 1
    failed = [r for r in results if not r.ok]
    assert not failed, Counter((type(r).__name__, getattr(r, "reason", None)) for r in failed)
    assert snapshot["reserved_nusd"] == 0
    assert snapshot["spent_nusd"] == sum(r.cost_nusd for r in results)


# -- every candidate open: wait for the earliest half-open ---------------------------------


def test_when_every_candidate_is_open_the_earliest_half_open_serves(
    sim: SimulatedProvider,
) -> None:
    sim.configure("a", ModelBehaviour(latency_s=0.005, status=503))
    sim.configure("b", ModelBehaviour(latency_s=0.005, status=503))
    once = RetryConfig(max_attempts=1)
    a = ModelSettings(
        name="a",
        base_url=sim.base_url,
        max_concurrency=1,
        fallbacks=("b",),
        retry=once,
        breaker=BreakerConfig(consecutive_failures=1, cooldown_s=0.3, max_cooldown_s=0.3),
    )
    b = ModelSettings(
        name="b",
        base_url=sim.base_url,
        max_concurrency=1,
        retry=once,
        breaker=BreakerConfig(consecutive_failures=1, cooldown_s=20, max_cooldown_s=20),
    )
    with System(SystemConfig(models=(a, b))) as system:
        futures = system.submit_many([f"q{i}" for i in range(8)], model="a", deadline_s=4.0)
        _until(lambda: _breaker(system, "b") == "open", what="b open")
        sim.configure("a", ModelBehaviour(latency_s=0.005))  # a recovers; b stays down
        t0 = time.monotonic()
        results = [f.result(WAIT_S) for f in futures]
        waited = time.monotonic() - t0
    late = Counter(type(r).__name__ for r in results)
    # a half-opens 0.3 s after it opened and then serves everything; b reopens in 20 s
    assert late["Completed"] + late["Failed"] == 8, late
    assert waited < 3.0
    assert all(r.model == "a" for r in results if isinstance(r, Completed))


# -- tokens per minute --------------------------------------------------------------------


def _tpm_models(sim: SimulatedProvider, **small: Any) -> tuple[ModelSettings, ModelSettings]:
    sim.configure("small", ModelBehaviour(latency_s=0.5, completion_tokens=8))
    sim.configure("big", ModelBehaviour(latency_s=0.01, completion_tokens=8))
    return (
        ModelSettings(
            name="small",
            base_url=sim.base_url,
            max_concurrency=1,
            limiter=LimiterConfig(rpm=None, tpm=1000),
            **small,
        ),
        ModelSettings(name="big", base_url=sim.base_url, max_concurrency=4),
    )


def test_a_request_above_the_tpm_limit_fails_typed_and_at_once(sim: SimulatedProvider) -> None:
    with System(SystemConfig(models=_tpm_models(sim))) as system:
        first = system.submit("occupies the only slot", model="small", max_tokens=16)
        _until(lambda: _server_requests(sim, "small") == 1, what="the first call")
        t0 = time.monotonic()
        huge = system.submit("needs more than a minute of tokens", model="small", max_tokens=4000)
        result = huge.result(WAIT_S)
        took = time.monotonic() - t0
        assert first.result(WAIT_S).ok
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.REQUEST_ERROR
    assert result.attempts == 0
    assert _server_requests(sim, "small") <= 1
    assert took < 0.3, took  # the slot frees only after 0.5 s


def test_a_request_above_one_models_tpm_goes_to_a_fallback_that_admits_it(
    sim: SimulatedProvider,
) -> None:
    with System(SystemConfig(models=_tpm_models(sim, fallbacks=("big",)))) as system:
        result = system.submit("too big for small", model="small", max_tokens=4000).result(WAIT_S)
    assert isinstance(result, Completed), result
    assert result.model == "big"


# -- latency-aware expiry on one candidate of several --------------------------------------


def _queue_latency(system: System) -> dict[str, float]:
    ref = system.book.resolve("queue")
    assert ref is not None
    actor = ref._actor_weakref()
    assert actor is not None
    return dict(actor._latency)  # a read-only peek at the queue actor's health view


def test_a_deadline_the_slow_candidate_cannot_meet_goes_to_the_fast_one(
    sim: SimulatedProvider,
) -> None:
    sim.configure("slow", ModelBehaviour(latency_s=0.4))
    sim.configure("fast", ModelBehaviour(latency_s=0.01))
    slow = ModelSettings(name="slow", base_url=sim.base_url, max_concurrency=4)
    fast = ModelSettings(name="fast", base_url=sim.base_url, max_concurrency=2)
    config = SystemConfig(models=(slow, fast), routes={"pool": ("slow", "fast")})
    with System(config) as system:
        for i in range(4):  # teach the queue slow's latency (health is reported ~1/s)
            assert system.submit(f"warm {i}", model="slow").result(WAIT_S).ok
            if _queue_latency(system).get("slow", 0.0) > 0.3:
                break
        _until(lambda: _queue_latency(system).get("slow", 0.0) > 0.3, what="slow's latency")
        futures = system.submit_many([f"p{i}" for i in range(6)], route="pool", deadline_s=0.3)
        results = [f.result(WAIT_S) for f in futures]
    kinds = Counter(type(r).__name__ for r in results)
    assert kinds == {"Completed": 6}, kinds
    assert {r.model for r in results} == {"fast"}


# -- probes found sound ---------------------------------------------------------------------


def test_budget_holds_at_every_moment_under_load_with_retries_fallbacks_429s_cancels(
    sim: SimulatedProvider,
) -> None:
    """60 concurrent calls; 500s (retried), server-side 429s (Retry-After), fallbacks to a
    dearer model, cancels, hopeless deadlines, a per-tag budget: spent + reserved never
    exceeds any limit, every reservation is released, and the books match the results."""
    sim.configure("cheap", ModelBehaviour(latency_s=0.01, jitter_s=0.005, error_rate=0.5))
    sim.configure("dear", ModelBehaviour(latency_s=0.01, rpm=1200, burst_s=0.1))
    retry = RetryConfig(max_attempts=2, initial_s=0.01, jitter_s=0.01)
    never_open = BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000)
    cheap = ModelSettings(
        name="cheap",
        base_url=sim.base_url,
        max_concurrency=60,
        price=Price(1, 2),
        fallbacks=("dear",),
        retry=retry,
        breaker=never_open,
    )
    dear = ModelSettings(
        name="dear",
        base_url=sim.base_url,
        max_concurrency=60,
        price=Price(10, 20),
        retry=RetryConfig(max_attempts=3, initial_s=0.01, jitter_s=0.01),
        breaker=never_open,
    )
    one_dear = estimate_nusd(Price(10, 20), 9, 64)
    total, tag_limit = 40 * one_dear, 6 * one_dear
    budget = BudgetSettings(
        total_usd=Decimal(total) / 10**9, per_tag_usd={"team": Decimal(tag_limit) / 10**9}
    )
    config = SystemConfig(models=(cheap, dear), budget=budget)
    with System(config) as system:
        watch = _BudgetWatch(system)
        results = []
        for wave in range(5):  # waves, so that settled refunds make room again
            futures = []
            for i in range(wave * 40, wave * 40 + 40):
                fields: dict[str, Any] = {"max_tokens": 64}
                if i % 5 == 0:
                    fields["budget_tag"] = "team"
                if i % 11 == 0:
                    fields["deadline_s"] = 0.001
                futures.append(system.submit(f"task {i:04d}", **fields))
                if i % 7 == 0:
                    system.cancel(futures[-1].task_id)
            results += [f.result(WAIT_S) for f in futures]
        assert system.drain(WAIT_S)
        snapshot = system.rt.budget.snapshot() if system.rt.budget else {}
        team = system.rt.budget._budgets.account("team") if system.rt.budget else None
    kinds = Counter(type(r).__name__ for r in results)
    assert kinds["Completed"] >= 20, kinds
    assert kinds["Cancelled"] >= 1, kinds
    assert kinds["Expired"] >= 1, kinds
    assert Counter(r.model for r in results)["dear"] >= 1  # fallbacks took load
    refused = [r for r in results if getattr(r, "reason", None) is FailureReason.BUDGET_EXCEEDED]
    assert refused, kinds
    assert all(r.attempts == 0 for r in refused)
    assert watch.peak_total <= total
    assert watch.peak_tag.get("team", 0) <= tag_limit
    assert snapshot["reserved_nusd"] == 0
    assert snapshot["spent_nusd"] == sum(r.cost_nusd for r in results) <= total
    assert team is not None
    assert team.reserved == 0
    assert team.spent <= tag_limit


def test_downgrade_to_a_cheaper_plan_member_or_refuse_when_asked(sim: SimulatedProvider) -> None:
    dear_price, cheap_price = Price(100, 100), Price(1, 1)
    dear_cost = estimate_nusd(dear_price, 9, 32)
    for downgrade in (True, False):
        models = (
            ModelSettings(name="dear", base_url=sim.base_url, price=dear_price, tiers=("t",)),
            ModelSettings(name="cheap", base_url=sim.base_url, price=cheap_price, tiers=("t",)),
        )
        budget = BudgetSettings(
            total_usd=Decimal(dear_cost - 1) / 10**9, downgrade_when_tight=downgrade
        )
        config = SystemConfig(models=models, order="config", budget=budget)
        with System(config) as system:
            result = system.submit("task 0000", route="t", max_tokens=32).result(WAIT_S)
            assert system.drain(WAIT_S)
            snapshot = system.rt.budget.snapshot() if system.rt.budget else {}
        if downgrade:
            assert isinstance(result, Completed), result
            assert result.model == "cheap"
        else:
            assert isinstance(result, Failed)
            assert result.reason is FailureReason.BUDGET_EXCEEDED
            assert result.attempts == 0
        assert snapshot["reserved_nusd"] == 0


def _stop_when_spent(
    sim: SimulatedProvider, behaviour: ModelBehaviour, wait_s: float
) -> tuple[list[Any], bool, int]:
    """200 tasks against a budget of five calls, ``stop_when_spent``: (results, whether the
    system stopped itself, the budget in nUSD)."""
    sim.configure("m", behaviour)
    price = Price(1000, 1000)
    one = estimate_nusd(price, 10, 32)  # "task NNNN" is 10 prompt tokens
    model = ModelSettings(name="m", base_url=sim.base_url, max_concurrency=4, price=price)
    budget = BudgetSettings(total_usd=Decimal(5 * one) / 10**9, stop_when_spent=True)
    system = System(SystemConfig(models=(model,), budget=budget))
    try:
        futures = system.submit_many([f"task {i:04d}" for i in range(200)], max_tokens=32)
        results = [f.result(WAIT_S) for f in futures]
        stopped = system._stopped.wait(wait_s)
    finally:
        system.stop(timeout=10)
    completed = [r for r in results if isinstance(r, Completed)]
    assert 1 <= len(completed) <= 5
    assert sum(r.cost_nusd for r in results) <= 5 * one
    assert _server_requests(sim, "m") == len(completed)
    return results, stopped, 5 * one


def test_stop_when_spent_stops_once_spending_reaches_the_total(sim: SimulatedProvider) -> None:
    # every call costs exactly its estimate (completion == max_tokens), so five reach the total
    _, stopped, _ = _stop_when_spent(
        sim, ModelBehaviour(latency_s=0.01, completion_tokens=32), WAIT_S
    )
    assert stopped


def test_stop_when_spent_stops_when_the_budget_can_take_no_more_calls(
    sim: SimulatedProvider,
) -> None:
    # realistic: replies shorter than max_tokens, so each call costs less than its estimate
    results, stopped, _ = _stop_when_spent(
        sim, ModelBehaviour(latency_s=0.01, completion_tokens=20), 1.0
    )
    refused = [r for r in results if isinstance(r, Failed)]
    assert all(r.reason is FailureReason.BUDGET_EXCEEDED for r in refused)
    assert len(refused) >= 190  # the budget is used up: nothing more can be afforded
    assert stopped


def test_no_call_starts_after_its_deadline_across_queueing_and_retries(
    sim: SimulatedProvider,
) -> None:
    sim.configure("flaky", ModelBehaviour(latency_s=0.02, error_rate=0.5))
    model = ModelSettings(
        name="flaky",
        base_url=sim.base_url,
        max_concurrency=2,
        retry=RetryConfig(max_attempts=10, initial_s=0.05, jitter_s=0.02),
        breaker=BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000),
    )
    with System(SystemConfig(models=(model,))) as system:
        futures = system.submit_many([f"task {i:04d}" for i in range(30)], deadline_s=0.4)
        submitted = time.monotonic()  # every task's deadline is at most this + 0.4
        results = [f.result(WAIT_S) for f in futures]
    kinds = Counter(type(r).__name__ for r in results)
    assert kinds["Completed"] >= 1, kinds
    assert kinds["Expired"] + kinds["Failed"] >= 1, kinds
    arrivals = _arrivals_monotonic(sim, "flaky")
    assert arrivals
    assert max(arrivals) <= submitted + 0.4, max(arrivals) - submitted
    assert all(r.latency_s <= 0.4 + 1.0 for r in results if not isinstance(r, Completed))


def test_matching_rpm_sends_no_429_and_keeps_the_rate(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.01, rpm=1200, burst_s=0.5))
    model = ModelSettings(
        name="m",
        base_url=sim.base_url,
        max_concurrency=16,
        limiter=LimiterConfig(rpm=1200, tpm=None, burst_s=0.5),
    )
    with System(SystemConfig(models=(model,))) as system:
        t0 = time.monotonic()
        results = [f.result(WAIT_S) for f in system.submit_many([f"t{i}" for i in range(50)])]
        took = time.monotonic() - t0
    assert all(r.ok for r in results)
    stats = sim.stats()["models"]["m"]
    assert stats["rate_limited"] == 0
    assert stats["requests"] == 50
    assert took < 6, took  # 50 at 20/s after a burst of 10: ~2 s


def test_matching_tpm_with_large_max_tokens_sends_no_429_and_is_not_starved(
    sim: SimulatedProvider,
) -> None:
    """Reservations of prompt + max_tokens (512) far above the real use (~20) must be
    refunded at settlement, or the model would run at 1/25 of its token rate."""
    sim.configure("m", ModelBehaviour(latency_s=0.01, tpm=12000, completion_tokens=12))
    model = ModelSettings(
        name="m",
        base_url=sim.base_url,
        max_concurrency=8,
        limiter=LimiterConfig(rpm=None, tpm=12000),
    )
    with System(SystemConfig(models=(model,))) as system:
        t0 = time.monotonic()
        futures = system.submit_many([f"t{i}" for i in range(40)], max_tokens=512)
        results = [f.result(WAIT_S) for f in futures]
        took = time.monotonic() - t0
    assert all(r.ok for r in results)
    assert sim.stats()["models"]["m"]["rate_limited"] == 0
    # 40 x ~20 tokens at 200 tokens/s: ~4 s; charged at 512 each it would take ~100 s
    assert took < 10, took


def test_retry_after_is_honoured_without_a_configured_limit(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.005, rpm=60, burst_s=1.0))
    model = ModelSettings(
        name="m",
        base_url=sim.base_url,
        max_concurrency=4,
        retry=RetryConfig(max_attempts=6, initial_s=0.01, jitter_s=0.01),
    )
    with System(SystemConfig(models=(model,))) as system:
        results = [f.result(WAIT_S) for f in system.submit_many(["a", "b", "c"])]
    assert all(r.ok for r in results), results
    stats = sim.stats()["models"]["m"]
    arrivals = sorted(stats["arrivals"])
    # one per second is served; the client waits out each Retry-After (~1 s) instead of
    # retrying after its own 10 ms backoff
    assert stats["rate_limited"] <= 4, stats["rate_limited"]
    first = arrivals[0]
    assert not [a for a in arrivals if 0.1 < a - first < 0.9], [a - first for a in arrivals]


def test_a_fallback_retries_its_own_429s(sim: SimulatedProvider) -> None:
    sim.configure("primary", ModelBehaviour(latency_s=0.005, status=500))
    sim.configure("backup", ModelBehaviour(latency_s=0.005, rpm=1200, burst_s=0.1))
    retry = RetryConfig(max_attempts=3, initial_s=0.01, jitter_s=0.01)
    never_open = BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000)
    primary = ModelSettings(
        name="primary",
        base_url=sim.base_url,
        max_concurrency=20,
        fallbacks=("backup",),
        retry=retry,
        breaker=never_open,
    )
    backup = ModelSettings(name="backup", base_url=sim.base_url, max_concurrency=20, retry=retry)
    with System(SystemConfig(models=(primary, backup))) as system:
        futures = system.submit_many([f"t{i}" for i in range(20)], model="primary")
        results = [f.result(WAIT_S) for f in futures]
    assert sim.stats()["models"]["backup"]["rate_limited"] >= 1  # the probe bites
    failed = Counter(getattr(r, "reason", None) for r in results if not r.ok)
    assert not failed, failed


def test_breaker_opens_probes_are_limited_fallback_takes_the_load_then_recovery(
    sim: SimulatedProvider,
) -> None:
    sim.configure("primary", ModelBehaviour(latency_s=0.005, status=503))
    primary = ModelSettings(
        name="primary",
        base_url=sim.base_url,
        max_concurrency=8,
        fallbacks=("backup",),
        retry=RetryConfig(max_attempts=1),
        breaker=BreakerConfig(
            consecutive_failures=3, cooldown_s=0.2, max_cooldown_s=0.2, half_open_probes=2
        ),
    )
    backup = ModelSettings(name="backup", base_url=sim.base_url, max_concurrency=8)
    with System(SystemConfig(models=(primary, backup))) as system:
        t0 = time.monotonic()
        waves = []
        for w in range(6):  # ~0.6 s of outage, in waves
            futures = system.submit_many([f"w{w} t{i}" for i in range(10)], model="primary")
            waves += [f.result(WAIT_S) for f in futures]
        outage_s = time.monotonic() - t0
        assert all(isinstance(r, Completed) for r in waves)
        served = Counter(r.model for r in waves)
        assert served == {"backup": 60}
        calls = _server_requests(sim, "primary")
        # the calls in flight when it opened (<= cap), then <= 2 probes per cool-down
        assert calls <= 8 + 2 * (outage_s / 0.2 + 1), (calls, outage_s)
        sim.configure("primary", ModelBehaviour(latency_s=0.005))
        served_by = ""
        for i in range(200):
            served_by = system.submit(f"after {i}", model="primary").result(WAIT_S).model or ""
            if served_by == "primary":
                break
        assert served_by == "primary"
        again = [f.result(WAIT_S) for f in system.submit_many(["x", "y", "z"], model="primary")]
        assert _breaker(system, "primary") == "closed"
    assert {r.model for r in again} == {"primary"}


def test_work_conservation_across_two_models_with_overlapping_candidates(
    sim: SimulatedProvider,
) -> None:
    sim.configure("x", ModelBehaviour(latency_s=0.05))
    sim.configure("y", ModelBehaviour(latency_s=0.05))
    x = ModelSettings(name="x", base_url=sim.base_url, max_concurrency=2)
    y = ModelSettings(name="y", base_url=sim.base_url, max_concurrency=2)
    config = SystemConfig(models=(x, y), routes={"pool": ("x", "y")}, order="config")
    with System(config) as system:
        only_x = system.submit_many([f"x{i}" for i in range(12)], model="x")
        pool = system.submit_many([f"p{i}" for i in range(12)], route="pool")
        pool_results = [f.result(WAIT_S) for f in pool]
        x_results = [f.result(WAIT_S) for f in only_x]
    assert all(r.ok for r in pool_results + x_results)
    # x is busy with its own backlog, so y (idle otherwise) must take the pool's work
    assert Counter(r.model for r in pool_results)["y"] >= 10
    assert sim.stats()["models"]["y"]["max_in_flight"] == 2
    assert sim.stats()["models"]["x"]["max_in_flight"] == 2


def test_context_window_and_capabilities_route_end_to_end(sim: SimulatedProvider) -> None:
    small = ModelSettings(name="small", base_url=sim.base_url, context_window=100, tiers=("t",))
    large = ModelSettings(name="large", base_url=sim.base_url, tiers=("t",))
    seeing = ModelSettings(name="seeing", base_url=sim.base_url, capabilities=frozenset({"vision"}))
    config = SystemConfig(models=(small, large, seeing), order="config")
    with System(config) as system:
        fits = system.submit("short", route="t", max_tokens=16).result(WAIT_S)
        too_big = system.submit("short", route="t", max_tokens=200).result(WAIT_S)
        vision = system.submit(
            "look", route="t", max_tokens=16, metadata={"capabilities": ["vision"]}
        ).result(WAIT_S)
        explicit = system.submit("look", model="seeing", metadata={"capabilities": ["vision"]})
        nothing = system.submit("x", model="small", max_tokens=500).result(WAIT_S)
        assert explicit.result(WAIT_S).model == "seeing"
    assert fits.model in {"small", "large"}  # both fit: whichever grants first
    assert too_big.model == "large"  # 9 + 200 tokens do not fit small's window of 100
    assert isinstance(vision, Failed)
    assert vision.reason is FailureReason.NO_ROUTE
    assert vision.attempts == 0
    assert isinstance(nothing, Failed)
    assert nothing.reason is FailureReason.NO_ROUTE
    assert _server_requests(sim, "small") <= 1


def test_priorities_under_a_saturated_model_serve_critical_first(sim: SimulatedProvider) -> None:
    from callboard import Priority

    sim.configure("m", ModelBehaviour(latency_s=0.1))
    model = ModelSettings(name="m", base_url=sim.base_url, max_concurrency=1)
    with System(SystemConfig(models=(model,))) as system:
        blocker = system.submit("blocker", priority=Priority.LOW)
        _until(lambda: _server_requests(sim, "m") == 1, what="the blocker's call")
        order = [Priority.LOW, Priority.NORMAL, Priority.HIGH, Priority.CRITICAL] * 2
        submitted = []
        for i, p in enumerate(order):
            submitted.append((time.monotonic(), system.submit(f"p{i}", priority=p)))
        results = [(t, f.result(WAIT_S)) for t, f in submitted]
        assert blocker.result(WAIT_S).ok
        assert _server_requests(sim, "m") == 9
    assert all(r.ok for _, r in results)
    by_dispatch = sorted(results, key=lambda tr: tr[0] + tr[1].queue_wait_s)
    prios = [int(r.priority) for _, r in by_dispatch]
    assert prios == sorted(prios), prios
    ties = [r.task_id for _, r in by_dispatch]
    for p in set(prios):  # ties in arrival order
        same = [t for t, q in zip(ties, prios, strict=True) if q == p]
        assert same == sorted(same)
