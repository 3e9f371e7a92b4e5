"""End to end over real loopback HTTP: System -> actors -> simulated provider.

Also the task lifecycle under concurrency: cancels, stops, drains and crashes
race the pipeline, and every future still resolves exactly once; the ledger's
counts balance; a stop or a drain never reopens admission; a spent budget stops
the system when asked; a stopped system refuses every call with
``SystemStoppedError``. Races are forced, not hoped for: an actor is held down
by a crash and a supervisor backoff, or a gated ledger pauses one thread at a
chosen line. Waits are on futures and events with timeouts; ``wait_until``
polls a condition with a deadline where no event exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, wait
from decimal import Decimal
from pathlib import Path
from typing import Any

import pykka
import pytest
from callboard.actors.base import CrashPlan
from callboard.core.pricing import Price, estimate_nusd
from callboard.core.retry import RetryConfig
from callboard.messages import Call, Crash, GetState, RejectReason, Request
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.ledger import Ledger
from callboard.runtime.sqlite_ledger import SqliteLedger
from callboard.supervisor.address_book import UnknownActorError
from callboard.supervisor.supervisor import SupervisorConfig
from loopback import Gate, WireServer, answer
from support import (
    ROUTER_ROUTES,
    WAIT_S,
    accepted_by_a_dead_process,
    hold_down,
    interrupted_taking,
    kinds,
    one_model,
    running,
    served,
    settle,
    threads_since,
    two_models,
    wait_until,
)

from callboard import (
    AsyncSystem,
    Cancelled,
    Completed,
    ConfigError,
    Failed,
    FailureReason,
    InvalidRequestError,
    ModelSettings,
    Priority,
    QueueFullError,
    Rejected,
    Result,
    SchedulerSettings,
    System,
    SystemConfig,
    SystemStoppedError,
    UnknownModelError,
    UsageError,
    messages,
)
from callboard.config import BudgetSettings


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


def test_submit_many_names_the_bad_prompt_and_sends_nothing(
    make_system: Callable[..., System],
) -> None:
    """Among thousands, the error said which was bad only by its message (a bad message
    in prompt 500 read as messages[0] of the first; found by a hunt)."""
    system = make_system()
    prompts: list[Any] = [f"q{i}" for i in range(1000)]
    prompts[500] = [{"role": "user", "content": "hi", "name": ""}]
    with pytest.raises(InvalidRequestError, match=r"^prompts\[500\]: messages\[0\]\.name"):
        system.submit_many(prompts, model="alpha")
    prompts[500] = "   "
    with pytest.raises(InvalidRequestError, match=r"^prompts\[500\]: .*empty"):
        system.submit_many(prompts, model="alpha")
    assert system.stats().ledger["accepted"] == 0


def test_submit_many_gives_each_prompt_its_own_idempotency_key(
    make_system: Callable[..., System],
) -> None:
    """One key for all had every prompt after the first refused as its duplicate (found
    by a hunt); as a race's and a chain's, each gets ``key:i``, and the same burst sent
    again is refused, each prompt as the duplicate of its own first."""
    system = make_system()
    first = [f.result(WAIT_S) for f in system.submit_many(["a", "b", "c"], idempotency_key="b42")]
    assert all(r.ok for r in first), first
    again = [f.result(WAIT_S) for f in system.submit_many(["a", "b", "c"], idempotency_key="b42")]
    assert all(isinstance(r, Rejected) for r in again), again
    assert [r.reason for r in again] == [RejectReason.DUPLICATE] * 3
    assert [str(r.task_id) in d.detail for r, d in zip(first, again, strict=True)] == [True] * 3
    with pytest.raises(InvalidRequestError, match="idempotency_key"):  # "   :0" passed
        system.submit_many(["a"], idempotency_key="   ")


def test_a_crashed_actor_comes_back_and_the_system_keeps_working(
    make_system: Callable[..., System],
) -> None:
    system = make_system()
    assert system.submit("before", model="alpha").result(WAIT_S).ok
    for name in ("router", "queue", "model:alpha", "aggregator"):
        system.tell(name, Crash(reason="test"))
        futures = system.submit_many([f"after {name} {i}" for i in range(20)], model="alpha")
        unservable = system.submit("x", metadata={"capabilities": ["telepathy"]})  # the router's
        results = [f.result(WAIT_S) for f in futures]
        assert all(r.ok for r in results), [r for r in results if not r.ok]
        no_route = unservable.result(WAIT_S)
        assert isinstance(no_route, Failed), no_route
        assert no_route.reason is FailureReason.NO_ROUTE
    restarts = system.supervision()
    for name in ("router", "queue", "model:alpha", "aggregator"):
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
        crashes = dict.fromkeys(("model:alpha", "model:beta"), 1)  # on every Call: before
        only = dict.fromkeys(crashes, (Call,))  # any call starts, so no task can complete
        async with AsyncSystem(config, crash_plan=CrashPlan(crashes, only=only)) as cb:
            results = await asyncio.wait_for(cb.submit_many(["a", "b", "c"]), WAIT_S)
            assert not any(r.ok for r in results)
            await asyncio.wait_for(cb.failed.wait(), WAIT_S)
            return str(cb.failure)

    assert "model:" in asyncio.run(main())


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


def test_a_system_holds_the_collector_steady_only_when_asked_and_puts_it_back(
    provider: SimulatedProvider,
) -> None:
    import gc

    from callboard.runtime.collector import YOUNG_COLLECTION_EVERY

    before = gc.get_threshold()
    models = two_models(provider.base_url)
    with System(SystemConfig(models=models, steady_heap=True)) as system:
        assert gc.get_threshold()[0] == YOUNG_COLLECTION_EVERY
        assert gc.get_freeze_count() > 0
        assert system.submit("hi").result(timeout=WAIT_S).ok
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    with System(SystemConfig(models=models)):
        assert gc.get_threshold() == before  # not asked: left alone


def test_a_resumed_task_this_config_cannot_serve_ends_failed_and_the_others_resume(
    provider: SimulatedProvider, tmp_path: Path
) -> None:
    """One unfinished task naming a model no longer configured made ``resume`` raise
    ``UnknownModelError`` and resume none of the others (found by a hunt)."""
    path = tmp_path / "gone.db"
    asked = [Request.of(f"q{i}", model="gone" if i == 1 else "alpha") for i in range(4)]
    accepted_by_a_dead_process(path, *asked)
    with System(SystemConfig(models=two_models(provider.base_url)), ledger=path) as cb:
        results = {f.result(WAIT_S).task_id: f.result(WAIT_S) for f in cb.resume()}
        assert cb.resume() == []  # each ended for good: nothing to answer twice
    failed = results.pop(2)
    assert isinstance(failed, Failed), failed
    assert failed.reason is FailureReason.REQUEST_ERROR
    assert "unknown model 'gone'" in failed.detail
    assert sorted(results) == [1, 3, 4]
    assert all(r.ok for r in results.values())
    with System(SystemConfig(models=two_models(provider.base_url)), ledger=path) as cb:
        assert cb.resume() == []  # the failure is in the file


def test_a_resumed_task_that_cannot_be_served_and_whose_key_is_taken_is_answered(
    provider: SimulatedProvider, tmp_path: Path
) -> None:
    """Its idempotency key held by a retry made before the resume, the ledger did not
    accept it, and the future ``resume`` returned for it never resolved (a review)."""
    path = tmp_path / "taken.db"
    accepted_by_a_dead_process(path, Request.of("old", model="gone", idempotency_key="K"))
    with System(SystemConfig(models=two_models(provider.base_url)), ledger=path) as cb:
        retried = cb.submit("old, retried", model="alpha", idempotency_key="K")
        resumed = cb.resume()  # (once the retry's acceptance is in the file, its row is
        results = [f.result(WAIT_S) for f in resumed]  # the retry's: nothing to resume)
        assert retried.result(WAIT_S).ok
    assert all(isinstance(r, Rejected) and r.reason is RejectReason.DUPLICATE for r in results), (
        results
    )
    ledger = SqliteLedger(path)
    try:
        assert ledger.unfinished() == []  # the retry answered the key
    finally:
        ledger.close()


def test_resume_waits_for_room_rather_than_refusing_what_was_accepted(
    provider: SimulatedProvider, tmp_path: Path
) -> None:
    """More unfinished tasks than the queue holds came back ``Rejected(queue_full)`` while
    the file kept them unfinished, and the next resume answered them again (a hunt)."""
    path = tmp_path / "crowd.db"
    accepted_by_a_dead_process(path, *(Request.of(f"q{i}", model="alpha") for i in range(12)))
    small = SystemConfig(
        models=two_models(provider.base_url), scheduler=SchedulerSettings(capacity=4)
    )
    with System(small, ledger=path) as cb:
        results = [f.result(WAIT_S) for f in cb.resume()]
        assert cb.resume() == []
    assert sorted(r.task_id for r in results) == list(range(1, 13))
    assert all(r.ok for r in results), [r for r in results if not r.ok]


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
@contextlib.contextmanager
def _alarm_once_in_flight(
    provider: SimulatedProvider, handler: Callable[[int, object], None]
) -> Iterator[None]:
    """``handler`` for SIGALRM, rung 0.2 s into the body, which begins once the
    provider (another process: polled) has a call in flight."""
    before = signal.signal(signal.SIGALRM, handler)
    try:
        deadline = time.monotonic() + WAIT_S
        while provider.stats()["total"]["in_flight"] == 0:
            assert time.monotonic() < deadline, "the call never reached the provider"
            time.sleep(0.005)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_a_stop_cut_short_by_ctrl_c_is_finished_by_the_next_stop() -> None:
    """Ctrl-C lands while ``stop`` waits for a call in flight; ``stop(timeout=0)`` then
    ends the call Cancelled and stops every thread at once."""
    threads = set(threading.enumerate())
    with SimulatedProvider(default=ModelBehaviour(latency_s=5.0), seed=1) as slow:
        system = System(SystemConfig(models=two_models(slow.base_url)))
        future = system.submit("a slow call", model="alpha")

        def interrupt(_signum: int, _frame: object) -> None:
            raise KeyboardInterrupt

        with _alarm_once_in_flight(slow, interrupt), pytest.raises(KeyboardInterrupt):
            system.stop(timeout=WAIT_S)
        assert not future.done()  # the cut-short stop ended nothing
        system.stop(timeout=0.0)
        assert isinstance(future.result(WAIT_S), Cancelled)
    left = {t for t in set(threading.enumerate()) - threads if t.is_alive()}
    assert not {t.name for t in left if t.name.startswith("callboard")}, left


def test_a_stop_past_its_timeout_charges_the_call_on_the_wire_and_not_the_queued_one() -> None:
    """A stop that ends a call its model had sent charges it the most it could have used
    (marked estimated) with the attempt counted, as a deadline's cut does; a task still
    queued ends with nothing sent and nothing charged. The sweep ended both with 0
    attempts and no cost, so a gateway gave back the sent one's reservation and its
    budget never heard of it (found by a hunt)."""
    price = Price("3", "15")
    with SimulatedProvider(default=ModelBehaviour(latency_s=30.0), seed=1) as slow:
        model = ModelSettings(name="alpha", base_url=slow.base_url, max_concurrency=1, price=price)
        system = System(SystemConfig(models=(model,)))
        sent = system.submit("a slow call", max_tokens=100)
        queued = system.submit("waits behind it", max_tokens=100)
        assert wait_until(lambda: slow.stats()["total"]["in_flight"] == 1)
        system.stop(timeout=0.0)
        on_wire, behind = sent.result(WAIT_S), queued.result(WAIT_S)
    assert isinstance(on_wire, Cancelled)
    assert on_wire.attempts == 1
    assert on_wire.usage.estimated
    assert on_wire.usage.completion_tokens == 100  # all of its max_tokens
    assert on_wire.usage.prompt_tokens > 0
    assert on_wire.cost_nusd == estimate_nusd(price, on_wire.usage.prompt_tokens, 100)
    assert isinstance(behind, Cancelled)
    assert (behind.attempts, behind.cost_nusd, behind.usage.total_tokens) == (0, 0, 0)


def test_a_stop_charges_only_the_calls_the_loop_started() -> None:
    """Calls in the loop's window (admitted, not started) and tasks queued behind end
    with nothing sent and nothing charged; only the calls at the provider are charged
    (the window's were charged too, each with an attempt; found by a review)."""
    price = Price("3", "15")
    with SimulatedProvider(default=ModelBehaviour(latency_s=30.0), seed=1) as slow:
        model = ModelSettings(name="alpha", base_url=slow.base_url, max_concurrency=4, price=price)
        system = System(SystemConfig(models=(model,)))
        futures = [system.submit(f"slow call {i}", max_tokens=100) for i in range(8)]
        assert wait_until(lambda: slow.stats()["total"]["in_flight"] == 4)
        assert wait_until(lambda: system.stats().ledger["in_flight"] >= 5)  # one in the window
        system.stop(timeout=0.0)
        results = [f.result(WAIT_S) for f in futures]
        sent = slow.stats()["total"]["requests"]
    assert sent == 4
    charged = [r for r in results if r.cost_nusd]
    assert len(charged) == 4
    assert all(r.attempts == 1 and r.usage.estimated for r in charged)
    assert all((r.attempts, r.cost_nusd) == (0, 0) for r in results if not r.cost_nusd)


def test_a_stop_during_a_retrys_wait_counts_the_call_and_charges_what_it_paid() -> None:
    """A job waiting to be retried is not on the wire: its attempt counts and what it
    paid stays, and nothing more is charged (its ledger record said sent, and the stop
    charged all of max_tokens again: twice the call for a paid retry; a review)."""
    price = Price("3", "15")
    with WireServer(answer(b'{"choices": [')) as rogue:  # a 200 that does not read: paid
        retry = RetryConfig(max_attempts=3, initial_s=30.0, max_s=60.0, jitter_s=0.0)
        model = ModelSettings(name="m", base_url=rogue.base_url, price=price, retry=retry)
        system = System(SystemConfig(models=(model,)))
        future = system.submit("hello", max_tokens=100)
        assert wait_until(lambda: len(rogue.arrivals) == 1)

        def waiting_to_retry() -> bool:  # the model judged the answer: its job waits there
            ((_, job, handed_to),) = system.ledger.live_entries()
            return job is not None and job.attempt == 1 and handed_to is None

        assert wait_until(waiting_to_retry)
        system.stop(timeout=0.0)
        result = future.result(WAIT_S)
    assert isinstance(result, Cancelled), result
    assert result.attempts == 1
    assert result.cost_nusd == estimate_nusd(price, result.usage.prompt_tokens, 100)  # once


def test_a_ctrl_c_as_stop_takes_its_lock_does_not_leave_it_taken(
    provider: SimulatedProvider,
) -> None:
    """A SIGINT handled just as ``stop``'s Python-level ``acquire()`` returned left the
    stop lock held by the main thread for good: every other thread's stop, and the
    failure path's teardown, would then wait for it for ever. Taken by ``with`` now."""
    system = System(SystemConfig(models=two_models(provider.base_url)))
    try:
        interrupted_taking(system._stop_lock, {"stop"}, lambda: system.stop(timeout=WAIT_S))
    finally:
        system.stop(timeout=0.0)
    with pytest.raises(SystemStoppedError):
        system.submit("after the stop")


def test_a_stop_asked_as_another_thread_takes_the_stop_lock_is_still_hurried_by_it(
    provider: SimulatedProvider,
) -> None:
    """Thread B holds the stop lock for its ``stop(timeout=None)`` and has not yet said
    it stops when the main thread asks ``stop(cancel=True, timeout=0.5)``: the main
    thread saw no stop under way, hurried nothing, and waited out B's call of a minute
    (found by a review). It hurries whatever stop comes first now."""
    provider.configure("stuck", ModelBehaviour(latency_s=60.0))
    system = System(SystemConfig(models=(ModelSettings(name="stuck", base_url=provider.base_url),)))
    future = system.submit("x", model="stuck")
    assert wait_until(lambda: provider.stats()["total"]["in_flight"] == 1)
    lock, held = system._stop_lock, system._stop_held
    b_holds, main_waits = threading.Event(), threading.Event()

    class Noting:
        """The stop lock, saying when the main thread waits for it."""

        def __enter__(self) -> bool:
            if threading.current_thread() is threading.main_thread():
                main_waits.set()
            return lock.__enter__()

        def __exit__(self, *exc: object) -> None:
            lock.__exit__(*exc)

    def late(**kw: Any) -> None:  # B, the lock held, says it stops only once main waits
        if threading.current_thread().name == "B":
            b_holds.set()
            assert main_waits.wait(WAIT_S)
        held(**kw)

    system._stop_lock = Noting()  # type: ignore[assignment]
    system._stop_held = late  # type: ignore[method-assign]
    b = threading.Thread(target=lambda: system.stop(timeout=None), name="B")
    b.start()
    assert b_holds.wait(WAIT_S)
    started = time.monotonic()
    system.stop(cancel=True, timeout=0.5)
    took = time.monotonic() - started
    b.join(WAIT_S)
    assert not b.is_alive()
    assert isinstance(future.result(0), Cancelled)
    assert took < 5.0, f"the stop took {took:.1f} s"


def test_a_signal_handler_that_stops_during_a_stop_hurries_it_instead_of_hanging() -> None:
    """SIGTERM lands while ``stop`` (the ``with`` block's exit) waits for a call in
    flight, and its handler calls ``stop(cancel=True, timeout=0)``: the handler waited
    for the stop lock its own thread held, for good (found by a hunt). It returns at
    once now, and the stop under way ends the call ``Cancelled`` without waiting."""
    with SimulatedProvider(default=ModelBehaviour(latency_s=5.0), seed=1) as slow:
        system = System(SystemConfig(models=two_models(slow.base_url)))
        future = system.submit("a slow call", model="alpha")
        returned: list[float] = []

        def stop_now(_signum: int, _frame: object) -> None:
            system.stop(cancel=True, timeout=0.0)
            returned.append(time.monotonic())

        with _alarm_once_in_flight(slow, stop_now):
            started = time.monotonic()
            system.stop(timeout=WAIT_S)
            took = time.monotonic() - started
        assert returned, "the handler's stop never returned"
        assert isinstance(future.result(0), Cancelled)
        assert took < 5.0, "the stop waited for the call it was told to cancel"


def test_a_callback_that_stops_while_another_thread_stops_does_not_hold_it(
    provider: SimulatedProvider,
) -> None:
    """A done-callback calls ``stop()`` while the main thread stops: it waited for the
    stop lock while that stop waited (``CALLBACKS_AT_STOP_S``, 5 s) for the callbacks
    to run (found by a hunt). It returns at once; the stop ends as soon as its tasks."""
    provider.configure("paced", ModelBehaviour(latency_s=0.5))
    system = System(SystemConfig(models=(ModelSettings(name="paced", base_url=provider.base_url),)))
    first = system.submit("a", model="paced")
    second = system.submit("b", model="paced")
    stopped_in_callback = threading.Event()

    def stop_too(_: object) -> None:
        system.stop()
        stopped_in_callback.set()

    first.add_done_callback(stop_too)
    started = time.monotonic()
    system.stop(timeout=WAIT_S)
    took = time.monotonic() - started
    assert stopped_in_callback.wait(WAIT_S)
    assert isinstance(second.result(0), Completed)
    assert took < 3.0, f"stop took {took:.1f} s"


def test_a_second_threads_stop_hurries_the_stop_under_way_by_its_own_cancel_and_timeout(
    provider: SimulatedProvider,
) -> None:
    """Thread A stops with no timeout while a call hangs; thread B's
    ``stop(cancel=True, timeout=0)`` waited for A's lock for ever (20 s and counting,
    found by a hunt): it ignored its own cancel and timeout."""
    provider.configure("stuck", ModelBehaviour(latency_s=60.0))
    system = System(SystemConfig(models=(ModelSettings(name="stuck", base_url=provider.base_url),)))
    future = system.submit("hangs", model="stuck")
    assert wait_until(lambda: provider.stats()["total"]["in_flight"] >= 1)
    first = threading.Thread(target=system.stop, kwargs={"timeout": None})
    first.start()
    assert wait_until(lambda: not system.admission.is_open)  # A's stop is under way
    started = time.monotonic()
    system.stop(cancel=True, timeout=0)
    took = time.monotonic() - started
    first.join(WAIT_S)
    assert not first.is_alive()
    assert isinstance(future.result(0), Cancelled)
    assert took < 5.0, f"the second stop took {took:.1f} s"


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


# -- the task lifecycle under concurrency --------------------------------------------------


def _server_requests(provider: SimulatedProvider, model: str) -> int:
    return int(served(provider, model).get("requests", 0))


GENEROUS = SupervisorConfig(max_restarts=10_000, within_s=1.0, backoff_max_s=0.002)


HELD_DOWN = SupervisorConfig(backoff_min_s=0.5, backoff_max_s=0.5, backoff_jitter=0.0)
"""A crashed actor stays down for exactly 0.5 s: what is told to it meanwhile is held."""


def test_cancel_right_after_submit_ends_each_task_exactly_once(provider: SimulatedProvider) -> None:
    config = SystemConfig(models=(one_model(provider, max_concurrency=2),))
    with System(config) as system:
        by_id: list[Future[Result]] = []
        by_future: list[Future[Result]] = []
        for i in range(150):
            f = system.submit(f"by id {i}")
            system.cancel(f.task_id)
            by_id.append(f)
            g = system.submit(f"by future {i}")
            assert g.cancel()
            by_future.append(g)
        results = settle(by_id)
        assert system.drain(WAIT_S)
        counts = system.ledger.counts()
    assert set(kinds(results)) <= {"Cancelled", "Completed"}
    assert kinds(results)["Cancelled"] >= len(by_id) // 2
    assert all(r.attempts == 0 for r in results if isinstance(r, Cancelled))
    assert all(g.cancelled() for g in by_future)
    assert counts.balanced
    assert counts.accepted == counts.finished == 300


def test_cancel_storm_racing_dispatch_retries_and_fallbacks(provider: SimulatedProvider) -> None:
    provider.configure("p", ModelBehaviour(latency_s=0.005, error_rate=0.3, unavailable_rate=0.1))
    provider.configure("b", ModelBehaviour(latency_s=0.005))
    retry = RetryConfig(max_attempts=2, initial_s=0.002, max_s=0.01, jitter_s=0.002)
    primary = ModelSettings(
        name="p", base_url=provider.base_url, max_concurrency=8, fallbacks=("b",), retry=retry
    )
    backup = ModelSettings(name="b", base_url=provider.base_url, max_concurrency=8)
    rng = random.Random(11)
    with System(SystemConfig(models=(primary, backup))) as system:
        futures = system.submit_many([f"q{i}" for i in range(600)], model="p")
        victims = rng.sample(futures, 300)
        go = threading.Event()

        def canceller() -> None:
            go.wait(WAIT_S)
            for n, f in enumerate(victims):
                if n % 2:
                    f.cancel()
                else:
                    system.cancel(f.task_id)

        thread = threading.Thread(target=canceller)
        thread.start()
        futures[5].add_done_callback(lambda _: go.set())  # once dispatch is under way
        results = settle(futures)
        thread.join(WAIT_S)
        assert system.drain(WAIT_S)
        counts = system.ledger.counts()
    assert set(kinds(results)) <= {"Completed", "Cancelled", "Failed"}
    assert len({r.task_id for r in results}) == len(results)
    assert counts.balanced
    assert counts.accepted == counts.finished == 600


def test_cancel_racing_deadlines_and_escalation_ends_each_task_once(
    provider: SimulatedProvider,
) -> None:
    provider.configure("slow", ModelBehaviour(latency_s=0.05))
    provider.configure("fast", ModelBehaviour(latency_s=0.005))
    slow = ModelSettings(name="slow", base_url=provider.base_url, max_concurrency=1)
    fast = ModelSettings(name="fast", base_url=provider.base_url, max_concurrency=2)
    config = SystemConfig(
        models=(slow, fast),
        escalate_to="fast",
        scheduler=SchedulerSettings(escalate_margin_s=0.1),
    )
    rng = random.Random(5)
    with System(config) as system:
        futures = system.submit_many([f"d{i}" for i in range(120)], model="slow", deadline_s=0.25)
        for f in rng.sample(futures, 60):
            system.cancel(f.task_id)
        results = settle(futures)
        assert system.drain(WAIT_S)
        counts = system.ledger.counts()
    assert set(kinds(results)) <= {"Completed", "Cancelled", "Expired"}
    assert counts.balanced
    assert counts.accepted == counts.finished == 120


def _submitters(
    system: System, n_threads: int, *, wait_s: float | None = None, started: int = 20
) -> tuple[list[threading.Thread], list[Future[Result]], list[BaseException], threading.Event]:
    """Threads that submit until refused; returns them, their futures and their errors."""
    futures: list[Future[Result]] = []
    errors: list[BaseException] = []
    enough = threading.Event()
    lock = threading.Lock()

    def run(k: int) -> None:
        for i in range(300):
            try:
                f = system.submit(f"t{k} q{i}", wait_s=wait_s)
            except (SystemStoppedError, QueueFullError) as exc:
                with lock:
                    errors.append(exc)
                if isinstance(exc, QueueFullError) or system._stopped.is_set():
                    return
                system._stopped.wait(0.001)  # draining or stopping: admitted again or stopped
                continue
            with lock:
                futures.append(f)
                if len(futures) >= started:
                    enough.set()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    return threads, futures, errors, enough


def test_stop_cancel_while_threads_submit_resolves_every_future(
    provider: SimulatedProvider,
) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.002))
    system = System(SystemConfig(models=(one_model(provider, max_concurrency=64),)))
    threads, futures, errors, enough = _submitters(system, 4)
    assert enough.wait(WAIT_S)
    system.stop(cancel=True, timeout=WAIT_S)
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()
    results = settle(futures)
    assert len(results) == len(futures)
    assert set(kinds(results)) <= {"Completed", "Cancelled", "Rejected"}
    assert all(isinstance(e, SystemStoppedError) for e in errors)
    assert len({r.task_id for r in results}) == len(results)


def test_drain_while_threads_submit_resolves_every_future(provider: SimulatedProvider) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.002))
    with System(SystemConfig(models=(one_model(provider, max_concurrency=64),))) as system:
        before = system.submit_many([f"b{i}" for i in range(100)])
        threads, futures, errors, enough = _submitters(system, 3, started=10)
        assert enough.wait(WAIT_S)
        assert system.drain(WAIT_S)
        assert all(f.done() for f in before)
        # submitters refused while draining were refused with the typed error
        assert all(isinstance(e, SystemStoppedError) for e in errors)
        system.stop(cancel=True, timeout=WAIT_S)
        for t in threads:
            t.join(WAIT_S)
            assert not t.is_alive()
        results = settle(futures) + settle(before)
    # a submit that passed the front door as the drain or the stop shut it is refused at
    # the ingest instead: its future says so (as in the stop's test above)
    assert set(kinds(results)) <= {"Completed", "Cancelled", "Rejected"}
    refused = [r for r in results if isinstance(r, Rejected)]
    assert all(r.reason is RejectReason.STOPPING for r in refused), refused


def test_backpressured_submitters_during_stop_never_hang(provider: SimulatedProvider) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.05))
    config = SystemConfig(
        models=(one_model(provider, max_concurrency=2),), scheduler=SchedulerSettings(capacity=6)
    )
    system = System(config)
    threads, futures, errors, enough = _submitters(system, 6, wait_s=WAIT_S, started=6)
    assert enough.wait(WAIT_S)
    assert wait_until(lambda: system.ledger.counts().live == 6)  # full: the others block in submit
    system.stop(cancel=True, timeout=WAIT_S)
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()
    results = settle(futures)
    assert set(kinds(results)) <= {"Completed", "Cancelled"}
    assert errors
    assert all(isinstance(e, SystemStoppedError | QueueFullError) for e in errors)


def test_a_submit_waiting_for_room_when_a_stop_begins_raises_system_stopped(
    provider: SimulatedProvider,
) -> None:
    """The room a stop makes (the task it waits for ends) is not for new work: the waiting
    submit raises, whether it wakes before the stop tears down or after, never a
    ``Rejected`` future one time and ``SystemStoppedError`` the next."""
    provider.configure("m", ModelBehaviour(latency_s=0.3))
    config = SystemConfig(
        models=(one_model(provider, max_concurrency=1),), scheduler=SchedulerSettings(capacity=1)
    )
    system = System(config)
    first = system.submit("takes the only room")
    assert wait_until(lambda: system.ledger.counts().live == 1)
    waited: Future[Future[Result]] = Future()

    def wait() -> None:
        try:
            waited.set_result(system.submit("waits", wait_s=WAIT_S))
        except Exception as exc:  # noqa: BLE001 (handed to the test thread)
            waited.set_exception(exc)

    threading.Thread(target=wait).start()
    assert wait_until(lambda: system.ledger._idle._waiters)  # type: ignore[attr-defined]
    system.stop(timeout=WAIT_S)  # no cancel: the first ends, and its room opens mid-stop
    assert type(first.result(WAIT_S)).__name__ == "Completed"
    with pytest.raises(SystemStoppedError, match="waited for room"):
        waited.result(WAIT_S)


def test_a_submit_with_wait_s_made_after_a_stop_began_is_refused_as_any_submit(
    provider: SimulatedProvider,
) -> None:
    """A submit made once the stop shut the door, with room there, is refused as one
    without ``wait_s`` is: the same ``SystemStoppedError``."""
    provider.configure("m", ModelBehaviour(latency_s=0.5))
    system = System(SystemConfig(models=(one_model(provider),)))
    first = system.submit("keeps the stop waiting")
    assert wait_until(lambda: system.ledger.counts().live == 1)
    stopping = threading.Thread(target=system.stop, kwargs={"timeout": WAIT_S})
    stopping.start()
    assert wait_until(lambda: system.stop_begun and not system.admission.is_open)
    for wait_s in (None, 1.0):
        with pytest.raises(SystemStoppedError, match="not admitting"):
            system.submit("after the stop began", wait_s=wait_s)
    assert type(first.result(WAIT_S)).__name__ == "Completed"
    stopping.join(WAIT_S)


@pytest.mark.parametrize("victim", ["router", "queue", "model:m", "aggregator"])
def test_crashes_during_cancel_storms_lose_and_duplicate_nothing(
    provider: SimulatedProvider, victim: str
) -> None:
    plan = CrashPlan({victim: 9})
    # with a budget every task is routed by the router (not by the front door), as a
    # crashing router must be seen to lose and duplicate nothing
    budget = ROUTER_ROUTES if victim == "router" else BudgetSettings()
    config = SystemConfig(
        models=(one_model(provider, max_concurrency=8),), supervisor=GENEROUS, budget=budget
    )
    rng = random.Random(victim)
    with System(config, crash_plan=plan) as system:
        futures: list[Future[Result]] = []
        for burst in range(30):
            batch = system.submit_many([f"b{burst} q{i}" for i in range(10)])
            for f in rng.sample(batch, 4):
                system.cancel(f.task_id)
            batch[0].cancel()
            futures += batch
        results = settle(futures)
        assert system.drain(WAIT_S)
        counts = system.ledger.counts()
    assert plan.injected > 0
    assert set(kinds(results)) <= {"Completed", "Cancelled"}
    assert len({r.task_id for r in results}) == len(results)
    assert counts.balanced
    assert counts.accepted == counts.finished == 300


def test_model_crash_with_calls_in_flight_then_stop_cancel(provider: SimulatedProvider) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.1))
    config = SystemConfig(models=(one_model(provider, max_concurrency=4),), supervisor=GENEROUS)
    system = System(config)
    futures = system.submit_many([f"q{i}" for i in range(40)])
    assert wait_until(
        lambda: system.ledger.counts().in_flight >= 4
    )  # 4 on the wire (+1 granted ahead)
    system.tell("model:m", Crash())
    system.stop(cancel=True, timeout=WAIT_S)
    results = settle(futures)
    assert len(results) == 40
    assert set(kinds(results)) <= {"Completed", "Cancelled"}
    assert kinds(results)["Cancelled"] >= 30, kinds(results)


def test_escalation_while_threads_submit_resolves_every_future(provider: SimulatedProvider) -> None:
    plan = CrashPlan({"queue": 15})
    supervisor = SupervisorConfig(max_restarts=3, within_s=60.0, backoff_max_s=0.001)
    config = SystemConfig(models=(one_model(provider, max_concurrency=8),), supervisor=supervisor)
    system = System(config, crash_plan=plan)
    try:
        threads, futures, errors, _ = _submitters(system, 4, started=1)
        for t in threads:
            t.join(WAIT_S)
            assert not t.is_alive()
        results = settle(futures)
        assert wait_until(lambda: system.failure is not None)
    finally:
        system.stop()
    assert "restart intensity" in str(system.failure)
    assert len(results) == len(futures)
    assert len({r.task_id for r in results}) == len(results)
    assert all(isinstance(e, SystemStoppedError) for e in errors)


def test_cancel_by_id_before_routing_survives_a_queue_restart(
    provider: SimulatedProvider, make_system: Callable[..., System]
) -> None:
    config = SystemConfig(models=(one_model(provider),), supervisor=HELD_DOWN, budget=ROUTER_ROUTES)
    system = make_system(config)
    hold_down(system, "router")  # the task waits for routing while the cancel goes ahead
    by_id = system.submit("cancelled by id")
    by_future = system.submit("cancelled by its future")
    assert wait_until(lambda: system.ledger.counts().routing == 2)
    system.cancel(by_id.task_id)
    assert by_future.cancel()
    system.ask("queue", GetState())  # the queue has taken the cancel (asks come in order)
    hold_down(system, "queue")
    assert system.supervision()["router"]["incarnation"] == 1, "router back too early"
    with pytest.raises(CancelledError):
        by_future.result(WAIT_S)
    assert isinstance(by_id.result(WAIT_S), Cancelled)


def test_stop_cancel_cancels_tasks_still_being_routed(
    provider: SimulatedProvider, make_system: Callable[..., System]
) -> None:
    config = SystemConfig(models=(one_model(provider),), supervisor=HELD_DOWN, budget=ROUTER_ROUTES)
    system = make_system(config)
    hold_down(system, "router")
    futures = system.submit_many([f"q{i}" for i in range(3)])
    assert wait_until(lambda: system.ledger.counts().routing == 3)
    system.stop(cancel=True, timeout=WAIT_S)
    results = settle(futures)
    assert kinds(results) == {"Cancelled": 3}


class GatedLedger(Ledger):
    """A real in-memory ledger that can pause a submitter in ``next_id`` (after the
    submit's running check) and the stopping thread in ``close`` (after the sweep,
    before the address book closes)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_ids = False
        self.in_next_id, self.next_id_go = threading.Event(), threading.Event()
        self.in_close, self.close_go = threading.Event(), threading.Event()

    def next_id(self) -> int:
        if self.gate_ids and threading.current_thread().name == "late-submitter":
            self.in_next_id.set()
            assert self.next_id_go.wait(WAIT_S)
        return super().next_id()

    def close(self, timeout: float = 10.0) -> None:
        self.in_close.set()
        assert self.close_go.wait(WAIT_S)
        super().close(timeout)


def test_a_submit_racing_the_end_of_stop_never_leaves_a_pending_future(
    provider: SimulatedProvider,
) -> None:
    ledger = GatedLedger()
    system = System(SystemConfig(models=(one_model(provider),)), ledger=ledger)
    out: list[Future[Result] | BaseException] = []

    def submit() -> None:
        try:
            out.append(system.submit("late"))
        except SystemStoppedError as exc:
            out.append(exc)

    ledger.gate_ids = True
    submitter = threading.Thread(target=submit, name="late-submitter")
    submitter.start()
    assert ledger.in_next_id.wait(WAIT_S)  # past the running check
    stopper = threading.Thread(target=system.stop)
    stopper.start()
    assert ledger.in_close.wait(WAIT_S)  # the sweep is done; the book is still open
    ledger.next_id_go.set()
    submitter.join(WAIT_S)
    ledger.close_go.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    assert len(out) == 1
    outcome = out[0]
    if isinstance(outcome, Future):  # refused at the door, or swept: never pending
        assert isinstance(outcome.result(0.5), Cancelled | Rejected)  # pending: TimeoutError
    else:
        assert isinstance(outcome, SystemStoppedError)


def test_a_drain_ending_during_stop_does_not_reopen_admission(
    provider: SimulatedProvider,
) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.5))
    system = System(SystemConfig(models=(one_model(provider),)))
    slow = system.submit("keeps stop waiting")
    stopper = threading.Thread(target=system.stop, kwargs={"timeout": WAIT_S})
    stopper.start()
    try:
        assert wait_until(lambda: system.admission.reason == "stopping")
        assert not system.drain(timeout=0.05)  # ends while stop still waits
        with pytest.raises(SystemStoppedError):
            system.submit("after stop began")
    finally:
        stopper.join(WAIT_S)
    assert isinstance(slow.result(WAIT_S), Completed)


def _stop_when_spent(
    provider: SimulatedProvider, behaviour: ModelBehaviour, wait_s: float
) -> tuple[list[Any], bool, int]:
    """200 tasks against a budget of five calls, ``stop_when_spent``: (results, whether the
    system stopped itself, the budget in nUSD)."""
    provider.configure("m", behaviour)
    price = Price(1000, 1000)
    one = estimate_nusd(price, 10, 32)  # "task NNNN" is 10 prompt tokens
    model = ModelSettings(name="m", base_url=provider.base_url, max_concurrency=4, price=price)
    budget = BudgetSettings(total_usd=Decimal(5 * one) / 10**9, stop_when_spent=True)
    system = System(SystemConfig(models=(model,), budget=budget))
    try:
        futures = system.submit_many([f"task {i:04d}" for i in range(200)], max_tokens=32)
        results = [f.result(WAIT_S) for f in futures]
        stopped = system._stopped.wait(wait_s)
    finally:
        system.stop(timeout=10)
    completed = [r for r in results if isinstance(r, Completed)]
    assert len(completed) >= 1  # more than five when calls cost less than their estimate
    assert sum(r.cost_nusd for r in results) <= 5 * one
    assert _server_requests(provider, "m") == len(completed)
    return results, stopped, 5 * one


def test_stop_when_spent_stops_once_spending_reaches_the_total(provider: SimulatedProvider) -> None:
    # every call costs exactly its estimate (completion == max_tokens), so five reach the total
    _, stopped, _ = _stop_when_spent(
        provider, ModelBehaviour(latency_s=0.01, completion_tokens=32), WAIT_S
    )
    assert stopped


def test_stop_when_spent_stops_when_the_budget_can_take_no_more_calls(
    provider: SimulatedProvider,
) -> None:
    # realistic: replies shorter than max_tokens, so each call costs less than its estimate
    results, stopped, _ = _stop_when_spent(
        provider, ModelBehaviour(latency_s=0.01, completion_tokens=20), 1.0
    )
    refused = [r for r in results if isinstance(r, Failed)]
    assert all(r.reason is FailureReason.BUDGET_EXCEEDED for r in refused)
    ended = Counter(type(r).__name__ for r in results)
    # the budget is used up: nothing more can be afforded (refused, or waiting for
    # refunds when the system stopped itself, and cancelled by the stop)
    assert ended["Failed"] + ended["Cancelled"] >= 190, ended
    assert stopped


def test_a_large_request_refused_late_in_the_budget_leaves_room_to_small_ones(
    provider: SimulatedProvider,
) -> None:
    """A service: one large request the budget cannot take any more closed admission for
    good, with a fifth of the budget left for every small request after it."""
    provider.configure("m", ModelBehaviour(latency_s=0.01, completion_tokens=400))
    price = Price(1000, 1000)
    large = estimate_nusd(price, 10, 400)
    model = ModelSettings(name="m", base_url=provider.base_url, price=price)
    budget = BudgetSettings(total_usd=Decimal(large * 5 // 2) / 10**9)  # two and a half
    with System(SystemConfig(models=(model,), budget=budget)) as system:
        for i in range(2):
            assert isinstance(
                system.submit(f"large {i:04d}", max_tokens=400).result(WAIT_S), Completed
            )
        refused = system.submit("large 0002", max_tokens=400).result(WAIT_S)
        small = system.submit("small 0003", max_tokens=4).result(WAIT_S)
    assert isinstance(refused, Failed), refused
    assert refused.reason is FailureReason.BUDGET_EXCEEDED
    assert isinstance(small, Completed), small


@pytest.mark.parametrize("call", ["supervision", "tell"])
def test_reading_or_telling_after_stop_raises_system_stopped(
    provider: SimulatedProvider, call: str
) -> None:
    system = System(SystemConfig(models=(one_model(provider),)))
    system.stop()
    act: Callable[[], object] = (
        system.supervision if call == "supervision" else lambda: system.tell("queue", Crash())
    )
    with pytest.raises(SystemStoppedError):
        act()


def test_asking_an_unknown_actor_is_a_misuse_error_not_a_stopped_system(
    assorted_system: System,
) -> None:
    with pytest.raises(UnknownActorError):
        assorted_system.tell("model:alfa", messages.GetState())
    with pytest.raises((UnknownActorError, UsageError)):
        assorted_system.ask("model:alfa", messages.GetState())


@pytest.mark.parametrize(
    "message",
    [messages.StopChildren(), messages.StartChildren(), messages.ReplaceChildren(specs=())],
)
def test_the_supervisors_start_and_stop_are_the_systems_not_a_callers(
    assorted_system: System, message: object
) -> None:
    """``StopChildren`` told by hand stopped every actor, and submits were accepted
    that nothing would ever take (found by a hunt)."""
    with pytest.raises(UsageError, match=r"System\.stop\(\)"):
        assorted_system.tell("supervisor", message)
    with pytest.raises(UsageError, match=r"System\.stop\(\)"):
        assorted_system.ask("supervisor", message)
    assert assorted_system.submit("still served", model="alpha").result(WAIT_S).ok


def _kill_the_root(system: System, how: str) -> None:
    """End the root supervisor the ways it can really end."""
    if how == "escalation":  # a child that keeps crashing, past the restart intensity
        for _ in range(2):
            system.tell("router", Crash(reason="a bug, on purpose"))
    elif how == "stopped":  # pykka's stop, from outside the system
        root = system.book.resolve("supervisor")
        assert root is not None
        root.stop()
    else:  # a host that stops every pykka actor (pykka does too, on a BaseException)
        pykka.ActorRegistry.stop_all()


@pytest.mark.parametrize("how", ["escalation", "stopped", "stop_all"])
def test_a_dead_root_is_a_stopped_system_that_still_answers_stats(how: str) -> None:
    gate = Gate()  # the server holds every call: none ends before the root dies
    with WireServer(gate.handler) as server:
        before = set(threading.enumerate())
        config = SystemConfig(
            models=(ModelSettings(name="m", base_url=server.base_url, max_concurrency=2),),
            supervisor=SupervisorConfig(max_restarts=1, within_s=60.0, backoff_max_s=0.01),
        )
        system = System(config)
        heard: Future[Any] = Future()
        system.on_failure(heard.set_result)
        try:
            futures = system.submit_many([f"q{i}" for i in range(6)])  # 2 sent, 4 queued
            server.wait_for(2)
            t0 = time.monotonic()
            _kill_the_root(system, how)
            escalation = heard.result(WAIT_S)  # told once every task has ended
            results = [f.result(0) for f in futures]
            took = time.monotonic() - t0
            with pytest.raises(SystemStoppedError, match="system stopped"):
                system.submit("after")
            stats = system.stats()
        finally:
            system.stop(timeout=1.0)
        assert threads_since(before) == []
    assert took < 10.0, f"tasks waited {took:.1f} s for a dead root"
    assert all(isinstance(r, Failed) and r.reason is FailureReason.INTERNAL for r in results), (
        results
    )
    assert escalation is system.failure
    # stop_all stops the children first: the root may give up on them before it dies
    causes = {"escalation": ("restart intensity",), "stopped": ("the root supervisor died",)}
    cause = causes.get(how, ("restart intensity", "the root supervisor died"))
    assert str(escalation).startswith(cause)
    assert results[0].detail == str(escalation)
    assert "failed" in repr(system)
    assert stats.outcomes == {"failed": 6}
    assert stats.failures == {"internal": 6}
    assert stats.ledger["finished"] == stats.ledger["accepted"] == 6


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"config": 5}, "config must be a SystemConfig (callboard.toml_config.load_config"),
        ({"config": {"models": []}}, "config must be a SystemConfig"),
        ({"ledger": 5}, "ledger must be a Ledger or a file path, got int"),
        ({"ledger": ""}, "ledger must name a file, got ''"),
        ({"ledger": "data/.."}, "ledger must name a file, got 'data/..'"),
        # these two failed deep inside with an AttributeError (found by a hunt)
        ({"io_loop": asyncio.AbstractEventLoop()}, "io_loop must be a started callboard.runtime"),
        ({"provider": "http://127.0.0.1:9/v1"}, "provider must be a running simulated provider"),
    ],
)
def test_a_system_is_built_from_a_config_and_a_ledger(
    arguments: dict[str, Any], error: str
) -> None:
    before = set(threading.enumerate())
    with pytest.raises(ConfigError) as caught:
        System(**arguments)
    assert str(caught.value).startswith(error)
    assert threads_since(before) == []  # refused before anything started


def test_a_prompt_is_reserved_by_the_larger_count_of_the_dialects_its_models_speak() -> None:
    from callboard.core.tokens import count_chat_tokens

    from callboard._system import _prompt_tokens

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    request = Request.of("weather?", tools=[tool])
    turns = [m.wire() for m in request.messages]
    each = {d: count_chat_tokens(turns, tools=[tool], dialect=d) for d in ("openai", "anthropic")}
    assert _prompt_tokens(request, ("openai",)) == each["openai"]
    assert _prompt_tokens(request, ("anthropic", "openai")) == max(each.values())
    assert each["anthropic"] > each["openai"]  # its tool prompt: the reason for the max


def test_a_prompt_with_an_image_is_reserved_by_the_costliest_image_rule_of_its_models() -> None:
    """gpt-4o-mini bills an image 33 times what GPT-4o does; every model counted it as
    GPT-4o, so a budget reserved a thirtieth of what the call then cost (found by a hunt:
    $0.0115 spent against a $0.002 budget)."""
    from callboard.core.tokens import GPT_4O_IMAGES, image_rule_of, image_tokens

    from callboard._system import _prompt_tokens

    url = "https://example.com/cat.png"  # size unknown: the most each rule allows
    pictured = Request.of(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    )
    mini = image_rule_of("gpt-4o-mini")
    alone = _prompt_tokens(pictured, ("openai",), (GPT_4O_IMAGES,))
    both = _prompt_tokens(pictured, ("openai",), (GPT_4O_IMAGES, mini))
    assert both - alone == image_tokens(None, images=mini) - image_tokens(None)
    plain = Request.of("no image here")
    assert _prompt_tokens(plain, ("openai",), (GPT_4O_IMAGES, mini)) == _prompt_tokens(
        plain, ("openai",)
    )


def test_a_budget_reserves_an_image_at_what_the_model_serving_it_bills(
    provider: SimulatedProvider,
) -> None:
    """The hunt's case: the README's gpt-4o-mini with a $0.002 budget took three image
    requests and spent $0.0115 on them. Counted by gpt-4o-mini's rule, one image by URL
    may cost up to 48,169 tokens ($0.0072 at $0.15 a million): the budget refuses it."""
    price = Price(Decimal("0.15"), Decimal("0.60"))
    url = "https://example.com/cat.png"  # its size unknown: the most the rule allows
    pictured = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    budget = BudgetSettings(total_usd=Decimal("0.002"))
    for wire_model, admitted in (("gpt-4o-mini", False), ("gpt-4o", True)):
        model = ModelSettings(
            name="m", base_url=provider.base_url, price=price, provider_model=wire_model
        )
        with System(SystemConfig(models=(model,), budget=budget)) as system:
            result = system.submit(pictured, max_tokens=10).result(WAIT_S)
        assert isinstance(result, Completed) is admitted, (wire_model, result)
        if not admitted:
            assert isinstance(result, Failed)
            assert result.reason is FailureReason.BUDGET_EXCEEDED


NO_RAY = """
import sys
from callboard import System
with System() as system:
    assert system.submit("hello").result(timeout=30).ok
print(sorted(m for m in sys.modules if m == "ray" or m.startswith(("ray.", "callboard.cluster"))))
"""


def test_the_local_runtime_never_imports_ray() -> None:
    done = subprocess.run(  # noqa: S603 - our own script, on this interpreter
        [sys.executable, "-c", NO_RAY], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_forks_child_is_told_the_system_is_its_parents_at_once() -> None:
    """gunicorn's ``--preload`` and a ``multiprocessing`` pool fork a process whose
    System object has no actor threads: a submit there was accepted and never
    answered, and its stop took 51 s to raise a pykka error."""
    read, write = os.pipe()
    with System() as system:
        assert system.submit("before").result(WAIT_S).ok
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running anything of the parent's
            said = []
            started = time.monotonic()
            for use in (lambda: system.submit("x"), system.stats, lambda: system.cancel(1)):
                try:
                    use()
                    said.append("answered")
                except SystemStoppedError as exc:
                    said.append("a fork" in str(exc) and "build a System" in str(exc))
            system.stop(timeout=5)
            said.append(time.monotonic() - started < 2)
            os.write(write, json.dumps(said).encode())
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read) as pipe:
            said = json.loads(pipe.read())
        assert os.WIFEXITED(status)
        assert os.WEXITSTATUS(status) == 0
        assert said == [True, True, True, True]
        assert system.submit("after").result(WAIT_S).ok, "the parent's system goes on"


def test_an_io_loop_lent_to_a_system_is_used_and_left_running(provider: SimulatedProvider) -> None:
    """``io_loop``: the owner's loop (the gateway's, its server on it) makes the calls
    and outlives the system's stop; one not running is refused (it drops every call)."""
    from callboard.runtime.io_loop import IoLoop

    lent = IoLoop(name="lent-io")
    with pytest.raises(UsageError, match="io_loop must be started"):
        System(SystemConfig(models=(one_model(provider),)), io_loop=lent)
    lent.start()
    try:
        with System(SystemConfig(models=(one_model(provider),)), io_loop=lent) as system:
            assert isinstance(system.submit("on the lent loop").result(WAIT_S), Completed)
        assert lent.running  # the system's stop left it to its owner
    finally:
        lent.stop()
    with pytest.raises(UsageError, match="io_loop must be started"):
        System(SystemConfig(models=(one_model(provider),)), io_loop=lent)


@pytest.mark.parametrize("dialects", [("openai",), ("anthropic",), ("openai", "anthropic")])
def test_a_bursts_prompts_are_estimated_as_each_alone(dialects: tuple[str, ...]) -> None:
    """``submit_many`` counts its chats' texts together (``_prompts_tokens``): each
    request keeps the estimate ``submit`` gives it, whatever its neighbours are."""
    from callboard.messages import ChatMessage

    from callboard._system import _prompt_tokens, _prompts_tokens

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    requests = [
        Request.of("Summarise item 1234, briefly."),
        Request.of(
            [
                ChatMessage(role="system", content="Be terse."),
                ChatMessage(role="user", content="hi"),
            ]
        ),
        Request.of("it's a tool's turn", tools=[tool]),  # options: counted alone
        Request.of("x" * 70_000),  # longer than a piece
        *(Request.of(f"ticket #{i}: the printer on floor {i % 7} jams") for i in range(50)),
    ]
    alone = [_prompt_tokens(r, dialects) for r in requests]
    assert _prompts_tokens(requests, dialects) == alone
    assert _prompts_tokens(requests[:1], dialects) == alone[:1]
    assert _prompts_tokens([], dialects) == []


def test_a_poison_routes_tasks_its_successor_routed_are_served_and_charged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router crashed on one ``Route`` twice (its delivery, then its redelivery to
    the next incarnation): poison, its tasks failed. But the successor's setup routes
    every task still accepted, those included, and their calls went out: 10 answered
    and billed calls ended ``Failed(internal)``, none counted by the stats or the
    budget (3 runs of 3; found by a hunt)."""
    from callboard.actors.router import RouterActor

    handle, crashes = RouterActor.handle, Counter[str]()

    def crashing(self: RouterActor, message: Any) -> Any:
        if type(message) is messages.Route and crashes["route"] < 2:
            crashes["route"] += 1
            raise RuntimeError(f"a router bug on this Route ({crashes['route']})")
        return handle(self, message)

    monkeypatch.setattr(RouterActor, "handle", crashing)
    price = Price(input_per_mtok=Decimal(1000), output_per_mtok=Decimal(1000))
    with SimulatedProvider(models={"m": ModelBehaviour(latency_s=0.05)}, seed=1) as p:
        model = ModelSettings(name="m", base_url=p.base_url, price=price, max_concurrency=64)
        budget = BudgetSettings(total_usd=Decimal(1000))
        with System(SystemConfig(models=(model,), budget=budget)) as system:
            results = [f.result(WAIT_S) for f in system.submit_many([f"q{i}" for i in range(10)])]
            stats = system.stats()
        sent = served(p, "m")["requests"]
    assert crashes["route"] == 2
    assert Counter(type(r).__name__ for r in results) == {"Completed": 10}
    assert sent == 10
    assert stats.total.cost_nusd == sum(r.cost_nusd for r in results) > 0
    assert stats.budget["spent_nusd"] == stats.total.cost_nusd


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_a_claude_thinking_tool_loop_sends_its_signed_thinking_back_and_goes_on(
    provider: SimulatedProvider, streamed: bool
) -> None:
    """Anthropic refuses a thinking tool loop whose last assistant turn does not start
    with its signed thinking (the simulator as its docs say): the answer's ``message``,
    sent back, carries it there."""
    claude = ModelSettings(name="claude", base_url=provider.base_url, api="anthropic")
    think = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    with running(claude) as system:
        if streamed:
            stream = system.stream(ask, max_tokens=2048, tools=[WEATHER_TOOL], **think)
            deltas = list(stream)
            first = stream.result(WAIT_S)
        else:
            first = system.submit(ask, max_tokens=2048, tools=[WEATHER_TOOL], **think).result(
                WAIT_S
            )
        assert isinstance(first, Completed), first
        assert first.finish_reason == "tool_calls"
        said = first.message
        (block,) = first.thinking_blocks
        assert said["thinking_blocks"] == [block]
        assert block["type"] == "thinking"
        assert block["signature"]
        assert first.reasoning == block["thinking"]
        if streamed:  # the thinking's text as it came, then the block whole, signed
            assert "".join(d.reasoning for d in deltas) == block["thinking"]
            assert [b for d in deltas for b in d.thinking_blocks] == [block]
        (call,) = first.tool_calls
        result = {"role": "tool", "tool_call_id": call.id, "content": "18C"}
        after = system.submit([*ask, said, result], max_tokens=2048, tools=[WEATHER_TOOL], **think)
        answered = after.result(WAIT_S)
        unthought = {k: v for k, v in said.items() if k != "thinking_blocks"}
        bare = system.submit(
            [*ask, unthought, result], max_tokens=2048, tools=[WEATHER_TOOL], **think
        ).result(WAIT_S)
    assert isinstance(answered, Completed), answered
    assert answered.finish_reason == "stop"
    assert isinstance(bare, Failed)  # the rule the blocks are there for
    assert "Expected `thinking` or `redacted_thinking`" in bare.detail
