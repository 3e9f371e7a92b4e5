"""Review hunt over the commits since 21cb163: the problems it confirmed, fixed since.

Every test runs a real ``System`` against the simulated provider on 127.0.0.1.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from callboard.actors.base import CrashPlan
from callboard.core.breaker import BreakerConfig
from callboard.core.retry import RetryConfig
from callboard.messages import Crash
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.supervisor.supervisor import SupervisorConfig
from support import WAIT_S

from callboard import Failed, ModelSettings, System, SystemConfig


@pytest.fixture
def sim() -> Iterator[SimulatedProvider]:
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.005), seed=13) as p:
        yield p


def until(predicate: Callable[[], Any], what: str) -> Any:
    """Wait (bounded by WAIT_S) for ``predicate`` to answer something truthy."""
    deadline = time.monotonic() + WAIT_S
    tick = threading.Event()
    while (value := predicate()) is None or value is False:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        tick.wait(0.005)
    return value


def kept_breaker(system: System, model: str) -> Any:
    return system.rt.extras["model-limits"][model][1]


def test_a_restarted_model_actor_keeps_its_breakers_backed_off_cooldown(
    sim: SimulatedProvider,
) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.002, status=500))
    m = ModelSettings(
        name="m",
        base_url=sim.base_url,
        retry=RetryConfig(max_attempts=1),
        breaker=BreakerConfig(
            consecutive_failures=1, cooldown_s=0.1, backoff=10.0, max_cooldown_s=100.0
        ),
    )
    system = System(SystemConfig(models=(m,)))
    try:
        assert isinstance(system.submit("opens the breaker").result(WAIT_S), Failed)
        # waits for the half-open probe (0.1 s), which fails: reopened for 0.1 * 10 s
        assert isinstance(system.submit("the failed probe").result(WAIT_S), Failed)
        old = kept_breaker(system, "m")
        backed_off = old.statistics(system.rt.clock()).cooldown_s
        assert backed_off == pytest.approx(1.0)
        system.tell("model:m", Crash(reason="restart while backed off"))
        new = until(
            lambda: kept_breaker(system, "m") is not old and kept_breaker(system, "m"),
            "the restarted incarnation",
        )
        stats = new.statistics(system.rt.clock())
    finally:
        system.stop(cancel=True, timeout=5)
    assert stats.state.value == "open"
    assert stats.cooldown_s == pytest.approx(backed_off), (
        f"the next failed probe reopens for {stats.cooldown_s * 10:g} s, not {backed_off * 10:g} s"
    )


def test_stats_after_a_poisoned_submit_answers_at_once(sim: SimulatedProvider) -> None:
    m = ModelSettings(name="m", base_url=sim.base_url)
    config = SystemConfig(
        models=(m,),
        supervisor=SupervisorConfig(max_restarts=10, within_s=60.0, backoff_max_s=0.01),
    )
    # ingest crashes on every message: the one Submit crashes it twice and is poison
    system = System(config, crash_plan=CrashPlan({"ingest": 1}))
    try:
        result = system.submit("poison").result(WAIT_S)
        assert isinstance(result, Failed), result
        assert system.failure is None
        t0 = time.monotonic()
        stats = system.stats()
        took = time.monotonic() - t0
    finally:
        system.stop(cancel=True, timeout=5)
    assert stats.ledger["rejected"] == 1
    assert took < 0.5, f"stats() was held {took:.2f} s for a result never told to it"
