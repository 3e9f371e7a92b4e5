"""Supervision under fire: crashes injected into every actor lose nothing."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import wait
from typing import Any

import pytest
from callboard.actors.base import CrashPlan
from callboard.provider.server import SimulatedProvider
from callboard.supervisor.supervisor import SupervisorConfig
from support import WAIT_S, two_models

from callboard import Completed, System, SystemConfig, SystemStoppedError

GENEROUS = SupervisorConfig(max_restarts=10_000, within_s=1.0, backoff_max_s=0.002)


@pytest.mark.parametrize(
    "victim", ["ingest", "router", "queue", "model:alpha", "model:beta", "aggregator"]
)
def test_crash_every_n_messages_loses_nothing(provider: SimulatedProvider, victim: str) -> None:
    plan = CrashPlan({victim: 25})
    models = two_models(provider.base_url, max_concurrency=64)
    config = SystemConfig(models=models, supervisor=GENEROUS)
    with System(config, crash_plan=plan) as system:
        futures: list[Any] = []
        for burst in range(40):
            futures += system.submit_many(
                [f"b{burst} q{i}" for i in range(50)], model="alpha" if burst % 2 else "beta"
            )
        _, pending = wait(futures, timeout=60)
        assert not pending
        results = [f.result() for f in futures]
        counts = system.ledger.counts()
        restarts = system.supervision()[victim]["restarts"]
    assert len(results) == 2000
    assert len({r.task_id for r in results}) == 2000
    assert Counter(type(r).__name__ for r in results) == {"Completed": 2000}
    assert counts.balanced
    assert counts.accepted == counts.finished == 2000
    assert plan.injected > 0
    # the last crash may still be restarting (accounting trails the results)
    assert plan.injected - 1 <= restarts <= plan.injected


def test_restart_intensity_exceeded_stops_the_system_with_a_clear_error(
    provider: SimulatedProvider,
) -> None:
    before = set(threading.enumerate())
    # ingest crashes on every message; it hears only from submit, so nothing can
    # exhaust the intensity before the test submits (health reports reach the queue)
    plan = CrashPlan({"ingest": 1})
    config = SystemConfig(
        models=two_models(provider.base_url),
        supervisor=SupervisorConfig(max_restarts=3, within_s=60.0, backoff_max_s=0.01),
    )
    system = System(config, crash_plan=plan)
    futures = []
    for i in range(10):  # one message each: each crashes ingest twice (then it is poison)
        try:
            futures.append(system.submit(f"q{i}"))
        except SystemStoppedError:
            break  # the supervisor gave up meanwhile: the typed error, at once
    results = [f.result(WAIT_S) for f in futures]  # every future resolves, none hangs
    assert all(not r.ok for r in results)
    assert system.failure is not None
    assert "ingest" in str(system.failure)
    assert "InjectedCrash" in str(system.failure)
    with pytest.raises(SystemStoppedError, match="restart intensity"):
        system.submit("after")
    system.stop()
    after = {t for t in threading.enumerate() if t.is_alive()}
    assert after <= before, [t.name for t in after - before]


def test_drain_and_stop_leave_no_future_unresolved_and_no_thread(
    provider: SimulatedProvider,
) -> None:
    before = set(threading.enumerate())
    system = System(SystemConfig(models=two_models(provider.base_url)))
    futures = system.submit_many([f"q{i}" for i in range(300)])
    assert system.drain(timeout=WAIT_S)
    assert all(f.done() and isinstance(f.result(), Completed) for f in futures)
    more = system.submit_many([f"r{i}" for i in range(300)])
    system.stop(cancel=True, timeout=WAIT_S)
    assert all(f.done() for f in more)
    kinds = Counter(type(f.result()).__name__ for f in more)
    assert set(kinds) <= {"Completed", "Cancelled"}
    after = {t for t in threading.enumerate() if t.is_alive()}
    assert after <= before, [t.name for t in after - before]
