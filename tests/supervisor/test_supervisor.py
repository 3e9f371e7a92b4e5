"""Supervisor semantics: strategies, start failures, liveness, backoff, restart types."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from callboard.actors.base import CrashPlan
from callboard.messages import Crash
from callboard.provider.server import SimulatedProvider
from callboard.supervisor.address_book import AddressBook
from callboard.supervisor.supervisor import (
    ChildSpec,
    Strategy,
    Supervisor,
    SupervisorConfig,
    _Child,
)
from support import WAIT_S, two_models

from callboard import System, SystemConfig

ORDER = ["aggregator", "model:alpha", "model:beta", "queue", "router", "ingest"]


def works(system: System, n: int = 10) -> bool:
    return all(f.result(WAIT_S).ok for f in system.submit_many([f"q{i}" for i in range(n)]))


def incarnations(system: System) -> dict[str, int]:
    return {
        name: state["incarnation"] for name, state in system.supervision().items() if name in ORDER
    }


@pytest.mark.parametrize(
    ("strategy", "victim", "restarted"),
    [
        (Strategy.ONE_FOR_ONE, "queue", {"queue"}),
        (Strategy.ONE_FOR_ALL, "queue", set(ORDER)),
        (Strategy.REST_FOR_ONE, "queue", {"queue", "router", "ingest"}),
    ],
)
def test_strategies_restart_what_erlang_says(
    provider: SimulatedProvider, strategy: Strategy, victim: str, restarted: set[str]
) -> None:
    config = SystemConfig(
        models=two_models(provider.base_url), supervisor=SupervisorConfig(strategy=strategy)
    )
    with System(config) as system:
        assert works(system)
        before = incarnations(system)
        system.tell(victim, Crash())
        assert works(system)  # the crash is handled before later messages are served
        after = incarnations(system)
    changed = {name for name in ORDER if after[name] != before[name]}
    assert changed == restarted


def test_a_failure_while_starting_is_detected_and_retried(
    make_system: Callable[..., System], provider: SimulatedProvider
) -> None:
    plan = CrashPlan({}, fail_starts={"router": 2})
    system = make_system(SystemConfig(models=two_models(provider.base_url)), crash_plan=plan)
    system.tell("router", Crash())
    assert works(system)
    state = system.supervision()["router"]
    assert state["restarts"] == 3  # the crash, then two failed starts
    assert any("while starting" in e for e in state["last_errors"])
    assert state["alive"]


def test_an_actor_that_dies_without_reporting_is_found_and_restarted(
    make_system: Callable[..., System],
) -> None:
    system = make_system()
    ref = system.book.resolve("router")
    assert ref is not None
    ref.stop(block=True)  # no failure hook runs: only the liveness check can notice
    assert works(system)  # held while dead, delivered to the new incarnation
    assert system.supervision()["router"]["restarts"] >= 1


def test_backoff_grows_with_jitter_caps_and_resets_after_a_quiet_period() -> None:
    config = SupervisorConfig(
        backoff_min_s=0.1,
        backoff_max_s=1.0,
        backoff_factor=2.0,
        backoff_jitter=0.0,
        reset_after_s=5.0,
    )
    sup = Supervisor(
        book=AddressBook(),
        specs=[],
        config=config,
        clock=lambda: 0.0,
        timer=lambda delay, msg: None,
        on_escalate=lambda esc: None,
        on_poison=lambda msg, why: None,
        rng=random.Random(1),
    )
    child = _Child(spec=ChildSpec(name="x", start=lambda n: None))  # type: ignore[arg-type, return-value]
    delays = []
    now = 0.0
    for _ in range(6):
        delays.append(sup._next_backoff(child, now))
        child.last_failure_at = now
        now += 0.5
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert sup._next_backoff(child, now + 10.0) == 0.1  # quiet for longer than reset_after_s


@pytest.mark.parametrize("field", ["reset_after_s", "liveness_every_s"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_supervisor_config_refuses_a_bad_period(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SupervisorConfig(**{field: value})
