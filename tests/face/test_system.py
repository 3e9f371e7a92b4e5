"""End to end over real loopback HTTP: System -> actors -> simulated provider."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, wait
from decimal import Decimal

import pytest
from callboard.messages import Crash
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S, two_models

from callboard import (
    AsyncSystem,
    Cancelled,
    Completed,
    InvalidRequestError,
    Priority,
    System,
    SystemConfig,
    SystemStoppedError,
    UnknownModelError,
)


def test_two_hundred_mixed_priorities_end_to_end(provider: SimulatedProvider) -> None:
    before = set(threading.enumerate())
    system = System(SystemConfig(models=two_models(provider.base_url)))
    priorities = list(Priority)
    futures = [
        system.submit(
            f"question {i}",
            priority=priorities[i % 4],
            model="alpha" if i % 2 else "beta",
            max_tokens=32,
        )
        for i in range(200)
    ]
    _, pending = wait(futures, timeout=WAIT_S)
    assert not pending
    results = [f.result() for f in futures]
    assert all(isinstance(r, Completed) for r in results), Counter(type(r) for r in results)
    for i, r in enumerate(results):
        assert r.model == ("alpha" if i % 2 else "beta")
        assert r.usage.prompt_tokens > 0
        assert r.usage.completion_tokens > 0
        assert r.text
        assert r.cost_usd >= 0
        assert r.attempts == 1
        assert r.priority is priorities[i % 4]
    server = provider.stats()
    assert server["models"]["alpha"]["requests"] == 100
    assert server["models"]["beta"]["requests"] == 100
    stats = system.stats()
    assert stats.outcomes == {"completed": 200}
    assert stats.ledger["accepted"] == stats.ledger["finished"] == 200
    system.stop()
    after = {t for t in threading.enumerate() if t.is_alive()}
    assert after <= before, [t.name for t in after - before]


def test_cost_is_computed_from_usage(provider: SimulatedProvider) -> None:
    from decimal import Decimal

    from callboard import ModelSettings, Price

    priced = ModelSettings(
        name="alpha",
        base_url=provider.base_url,
        price=Price(input_per_mtok=Decimal("1.00"), output_per_mtok=Decimal("2.00")),
    )
    with System(SystemConfig(models=(priced,))) as system:
        r = system.submit("price me", max_tokens=16).result(WAIT_S)
    assert r.ok
    expected = (Decimal(r.usage.prompt_tokens) * 1 + Decimal(r.usage.completion_tokens) * 2) / 10**6
    assert r.cost_usd == expected


def test_misuse_raises_at_once(make_system: Callable[..., System]) -> None:
    system = make_system()
    with pytest.raises(InvalidRequestError, match="empty"):
        system.submit("   ")
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        system.submit("hi", max_tokens=-1)
    with pytest.raises(UnknownModelError, match="nope"):
        system.submit("hi", model="nope")
    with pytest.raises(InvalidRequestError, match="priority"):
        system.submit("hi", priority="urgent")
    system.stop()
    with pytest.raises(SystemStoppedError):
        system.submit("hi")


def test_a_crashed_actor_comes_back_and_the_system_keeps_working(
    make_system: Callable[..., System],
) -> None:
    system = make_system()
    assert system.submit("before", model="alpha").result(WAIT_S).ok
    for name in ("ingest", "router", "queue", "model:alpha", "aggregator"):
        system.tell(name, Crash(reason="test"))
        futures = system.submit_many([f"after {name} {i}" for i in range(20)], model="alpha")
        results = [f.result(WAIT_S) for f in futures]
        assert all(r.ok for r in results), [r for r in results if not r.ok]
    restarts = system.supervision()
    for name in ("ingest", "router", "queue", "model:alpha", "aggregator"):
        assert restarts[name]["restarts"] >= 1, restarts
        assert restarts[name]["alive"]
    assert system.stats().restarts["queue"] >= 1


def test_default_system_runs_on_the_simulated_provider() -> None:
    with System() as system:
        assert set(system.models) == {"sim-fast", "sim-smart"}
        fast = system.submit("hello", route="fast").result(WAIT_S)
        smart = system.submit("hello", route="accurate").result(WAIT_S)
    assert fast.ok
    assert fast.model == "sim-fast"
    assert smart.ok
    assert smart.model == "sim-smart"
    assert smart.cost_usd > fast.cost_usd


def test_async_system_never_blocks_the_loop(provider: SimulatedProvider) -> None:
    async def main() -> tuple[int, int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        tick_task = asyncio.create_task(ticker())
        async with AsyncSystem(SystemConfig(models=two_models(provider.base_url))) as cb:
            results = await asyncio.wait_for(
                cb.submit_many([f"q{i}" for i in range(500)], model="alpha"), WAIT_S
            )
            one = await asyncio.wait_for(cb.submit("single", model="beta"), WAIT_S)
        stop.set()
        await tick_task
        assert one.ok
        return sum(r.ok for r in results), ticks

    ok, ticks = asyncio.run(main())
    assert ok == 500
    assert ticks > 10  # the ticker kept running while results were awaited


def test_failures_are_logged_with_task_and_trace_ids(
    make_system: Callable[..., System], caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from callboard import TaskLogFilter

    caplog.set_level(logging.INFO, logger="callboard")
    system = make_system()
    result = system.submit("too late", deadline_s=1e-9, trace_id="trace-xyz").result(WAIT_S)
    assert not result.ok
    system.stop()  # joins the actor threads: their log records are all in
    records = [r for r in caplog.records if getattr(r, "trace_id", None) == "trace-xyz"]
    assert records
    assert records[0].task_id == result.task_id
    plain = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    assert TaskLogFilter().filter(plain)
    assert plain.task_id == "-"


def test_auto_route_sends_hard_prompts_to_the_strong_model() -> None:
    with System() as system:
        easy = system.submit("hi there", route="auto").result(WAIT_S)
        hard = system.submit(
            "Prove step by step that the square root of 2 is irrational, then analyze "
            "why the proof generalises to every prime.",
            route="auto",
        ).result(WAIT_S)
    assert easy.model == "sim-fast"
    assert hard.model == "sim-smart"


def test_async_system_sets_an_event_when_the_supervisor_gives_up(
    provider: SimulatedProvider,
) -> None:
    from callboard.actors.base import CrashPlan
    from callboard.supervisor.supervisor import SupervisorConfig

    async def main() -> str:
        config = SystemConfig(
            models=two_models(provider.base_url),
            supervisor=SupervisorConfig(max_restarts=1, within_s=60.0, backoff_max_s=0.01),
        )
        async with AsyncSystem(config, crash_plan=CrashPlan({"ingest": 1})) as cb:
            results = await asyncio.wait_for(cb.submit_many(["a", "b", "c"]), WAIT_S)
            assert not any(r.ok for r in results)
            await asyncio.wait_for(cb.failed.wait(), WAIT_S)
            return str(cb.failure)

    assert "ingest" in asyncio.run(main())


def test_cancelling_an_awaiting_caller_cancels_its_unsent_task() -> None:
    from callboard.provider.server import ModelBehaviour

    from callboard import ModelSettings

    async def main(base_url: str) -> None:
        slow = ModelSettings(name="m", base_url=base_url, max_concurrency=1)
        async with AsyncSystem(SystemConfig(models=(slow,))) as cb:
            first = asyncio.create_task(cb.submit("occupies the only slot"))
            waiting = asyncio.create_task(cb.submit("never sent"))
            await asyncio.sleep(0)  # let both submits run (scheduling, not synchronisation)
            waiting.cancel()
            assert (await asyncio.wait_for(first, WAIT_S)).ok
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert await cb.drain(WAIT_S)

    with SimulatedProvider(default=ModelBehaviour(latency_s=0.2)) as sim:
        asyncio.run(main(sim.base_url))
        assert sim.stats()["models"]["m"]["requests"] == 1


def test_a_system_sets_the_switch_interval_it_was_given_and_restores_it(
    provider: SimulatedProvider,
) -> None:
    before = sys.getswitchinterval()
    wanted = 0.0007 if before != 0.0007 else 0.0008
    config = SystemConfig(models=two_models(provider.base_url), switch_interval_s=wanted)
    with System(config) as system:
        assert sys.getswitchinterval() == wanted
        assert system.submit("hi").result(timeout=WAIT_S).ok
    assert sys.getswitchinterval() == before
    with System(SystemConfig(models=two_models(provider.base_url))):
        assert sys.getswitchinterval() == before  # not asked: left alone


def test_overlapping_systems_give_the_switch_interval_back_when_the_last_stops(
    provider: SimulatedProvider,
) -> None:
    before = sys.getswitchinterval()
    models = two_models(provider.base_url)
    first = System(SystemConfig(models=models, switch_interval_s=0.001))
    second = System(SystemConfig(models=models, switch_interval_s=0.0001234))  # CPython rounds
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0001234, abs=1e-6)
        first.stop()
        assert sys.getswitchinterval() == pytest.approx(0.0001234, abs=1e-6)  # still held
    finally:
        first.stop()
        second.stop()
    assert sys.getswitchinterval() == before


def test_admission_opens_only_when_the_last_drain_ends_and_nothing_closed_it_for_good() -> None:
    from callboard.actors.ingest import Admission

    door = Admission(capacity=10)
    door.hold("draining")
    door.hold("draining")  # two drains overlap
    door.release()
    assert not door.is_open  # the other drain still waits
    door.release()
    assert door.is_open
    assert door.reason == ""
    door.hold("draining")
    door.close("the total budget is spent")
    door.release()  # the drain ends: the budget still holds the door
    assert not door.is_open
    assert door.reason == "the total budget is spent"
    door.stop("stopped")
    assert door.stopped
    assert door.reason == "stopped"
    door.release()  # an unmatched release changes nothing
    assert not door.is_open


def test_cancel_after_stop_is_a_typed_error(provider: SimulatedProvider) -> None:
    system = System(SystemConfig(models=two_models(provider.base_url)))
    system.stop()
    with pytest.raises(SystemStoppedError):
        system.cancel(1)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
def test_a_stop_cut_short_by_ctrl_c_is_finished_by_the_next_stop() -> None:
    """Ctrl-C lands while ``stop`` waits for a call in flight; ``stop(timeout=0)`` then
    ends the call Cancelled and stops every thread at once."""
    threads = set(threading.enumerate())
    with SimulatedProvider(default=ModelBehaviour(latency_s=5.0), seed=1) as slow:
        system = System(SystemConfig(models=two_models(slow.base_url)))
        future = system.submit("a slow call", model="alpha")

        def interrupt(_signum: int, _frame: object) -> None:
            raise KeyboardInterrupt

        before = signal.signal(signal.SIGALRM, interrupt)
        try:
            deadline = time.monotonic() + WAIT_S
            while slow.stats()["total"]["in_flight"] == 0:  # another process: poll it
                assert time.monotonic() < deadline, "the call never reached the provider"
                time.sleep(0.005)
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(KeyboardInterrupt):
                system.stop(timeout=WAIT_S)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
        assert not future.done()  # the cut-short stop ended nothing
        system.stop(timeout=0.0)
        assert isinstance(future.result(WAIT_S), Cancelled)
    left = {t for t in set(threading.enumerate()) - threads if t.is_alive()}
    assert not {t.name for t in left if t.name.startswith("callboard")}, left


def test_a_stats_question_whose_results_never_come_is_answered_after_its_grace(
    provider: SimulatedProvider, caplog: pytest.LogCaptureFixture
) -> None:
    """The aggregator holds a told ``GetStats`` until it has accounted the results
    asked for; results that never come (lost with a crashed sender) hold it for
    ``STATS_GRACE_S`` at most, and are then counted, so later reads do not wait."""
    from callboard.actors.aggregator import STATS_GRACE_S
    from callboard.messages import GetState, GetStats, Stats

    with System(SystemConfig(models=two_models(provider.base_url))) as system:
        assert system.submit("one").result(WAIT_S).ok
        reply: Future[Stats] = Future()
        asked = time.monotonic()
        system.tell("aggregator", GetStats(finished=1_000, reply=reply))
        assert reply.result(WAIT_S).outcomes == {"completed": 1}
        assert time.monotonic() - asked >= STATS_GRACE_S
        assert "999 results ended but were never accounted" in caplog.text
        assert system.stats().outcomes == {"completed": 1}
        again: Future[Stats] = Future()
        system.tell("aggregator", GetStats(finished=1, reply=again))
        system.ask("aggregator", GetState())  # handled in order: the question came first
        assert again.done(), "a question for results accounted already waited"


def test_stats_are_readable_while_the_system_drains() -> None:
    with SimulatedProvider(default=ModelBehaviour(latency_s=1.0), seed=1) as slow:
        system = System(SystemConfig(models=two_models(slow.base_url)))
        try:
            future = system.submit("a slow call", model="alpha")
            deadline = time.monotonic() + WAIT_S
            while system.ledger.counts().accepted == 0:  # on its way to the front door
                assert time.monotonic() < deadline, "the task was never accepted"
                time.sleep(0.002)
            drained: Future[bool] = Future()
            drainer = threading.Thread(target=lambda: drained.set_result(system.drain(WAIT_S)))
            drainer.start()
            deadline = time.monotonic() + WAIT_S
            while system.admission.is_open:  # no event marks the hold: poll it
                assert time.monotonic() < deadline, "the drain never held admission"
                time.sleep(0.002)
            assert not drained.done()
            assert system.stats().ledger["accepted"] == 1  # e.g. GET /stats during a deploy
            assert drained.result(WAIT_S)
            assert future.result(WAIT_S).ok
            drainer.join(WAIT_S)
        finally:
            system.stop(cancel=True, timeout=0.1)


def test_asking_a_stopped_actor_raises_system_stopped(provider: SimulatedProvider) -> None:
    from callboard.messages import GetState

    system = System(SystemConfig(models=two_models(provider.base_url)))
    system.stop()
    with pytest.raises(SystemStoppedError):
        system.ask("queue", GetState())
    with pytest.raises(SystemStoppedError):
        system.stats()


def test_every_public_name_is_importable_from_callboard() -> None:
    import callboard

    missing = [name for name in callboard.__all__ if not hasattr(callboard, name)]
    assert missing == []
    assert callboard.BudgetSettings(total_usd=Decimal(1)).enabled
