"""Hunting bugs in the asyncio face (``AsyncSystem``) and in embedding callboard in a host.

Every test runs real parts: a real ``System`` (actor threads, the I/O loop, the
ledger) over loopback HTTP to the simulated provider; only the provider's
behaviour (latency) is configured. Waits are on futures and events with
timeouts; ``wait_until`` polls a condition with a deadline where no event exists.

A test marked ``xfail(strict=True)`` pins a bug: its reason names the cause.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from callboard.actors.base import CrashPlan
from callboard.core.retry import RetryConfig
from callboard.messages import Crash
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.supervisor.supervisor import SupervisorConfig
from support import WAIT_S

from callboard import (
    AsyncSystem,
    Cancelled,
    Completed,
    ConfigError,
    ModelSettings,
    QueueFullError,
    SchedulerSettings,
    Secret,
    Stats,
    System,
    SystemConfig,
    SystemStoppedError,
)
from callboard._async import ROOM_WAITERS

KEY = "sk-hunt-0123456789-SECRETVALUE"


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Poll ``condition`` until it holds; False after ``timeout`` (for states with no event)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def running_systems() -> set[System]:
    """Every ``System`` in the process that has not been stopped."""
    return {o for o in gc.get_objects() if isinstance(o, System) and "running" in repr(o)}


@pytest.fixture
def sim() -> Iterator[SimulatedProvider]:
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.01, jitter_s=0.002), seed=11) as p:
        yield p


@pytest.fixture
def strays() -> Iterator[set[System]]:
    """The systems running before the test; any other one still running after it is stopped."""
    before = running_systems()
    yield before
    for system in running_systems() - before:
        system.stop(cancel=True, timeout=0.2)


def one_model(sim: SimulatedProvider, **fields: Any) -> ModelSettings:
    return ModelSettings(name="m", base_url=sim.base_url, **{"max_concurrency": 4, **fields})


def full_queue(sim: SimulatedProvider) -> SystemConfig:
    """One slot, room for one task; the provider answers after 2 s (the slot stays taken)."""
    sim.configure("m", ModelBehaviour(latency_s=2.0))
    return SystemConfig(
        models=(one_model(sim, max_concurrency=1),), scheduler=SchedulerSettings(capacity=1)
    )


async def fill(cb: AsyncSystem) -> None:
    cb.system.submit("takes the only room")
    assert wait_until(lambda: cb.system.ledger.live_count() == 1, timeout=5.0)


# -- start-up ---------------------------------------------------------------------------------


def test_concurrent_starts_build_one_system(sim: SimulatedProvider, strays: set[System]) -> None:
    config = SystemConfig(models=(one_model(sim),))

    async def main() -> None:
        cb = AsyncSystem(config)
        await asyncio.gather(cb.start(), cb.start())  # e.g. a lazy start from two requests
        assert (await cb.submit("hi")).ok
        await cb.stop()

    asyncio.run(main())
    assert running_systems() - strays == set()


def test_a_cancelled_start_leaves_no_system_running(
    sim: SimulatedProvider, strays: set[System]
) -> None:
    config = SystemConfig(models=(one_model(sim),))

    async def main() -> None:
        cb = AsyncSystem(config)
        start = asyncio.ensure_future(cb.start())
        await asyncio.sleep(0)  # the start has handed the build to a thread
        start.cancel()  # e.g. the host's startup is interrupted
        with pytest.raises(asyncio.CancelledError):
            await start

    asyncio.run(main())  # joins the default executor: the build has ended
    assert wait_until(lambda: not running_systems() - strays, timeout=2.0)


def test_failed_is_set_when_the_system_is_used_from_a_later_loop(sim: SimulatedProvider) -> None:
    config = SystemConfig(
        models=(one_model(sim),),
        supervisor=SupervisorConfig(max_restarts=1, within_s=60.0, backoff_max_s=0.01),
    )
    cb = AsyncSystem(config, crash_plan=CrashPlan({"ingest": 1}))
    asyncio.run(cb.start())  # e.g. a sync wrapper, or a fixture's own loop

    async def main() -> bool:
        results = await asyncio.wait_for(cb.submit_many(["a", "b", "c"]), WAIT_S)
        assert not any(r.ok for r in results)
        assert wait_until(lambda: cb.failure is not None, timeout=5.0)
        try:
            await asyncio.wait_for(cb.failed.wait(), 1.0)
        except TimeoutError:
            return False
        return True

    try:
        assert asyncio.run(main())
    finally:
        asyncio.run(cb.stop())


# -- drain, backpressure and stop -------------------------------------------------------------


def test_a_timed_out_async_drain_admits_again(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=2.0))
    config = SystemConfig(models=(one_model(sim, max_concurrency=1),))

    async def main() -> None:
        async with AsyncSystem(config) as cb:
            cb.system.submit("keeps the system busy for 2 s")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(cb.drain(), 0.05)
            try:
                cb.system.submit("the drain was given up: admitted again")
            finally:
                await cb.stop(cancel=True, timeout=0.1)

    asyncio.run(main())


def test_wait_s_bounds_every_async_submit_even_past_the_waiter_pool(
    sim: SimulatedProvider,
) -> None:
    wait_s = 0.4
    config = full_queue(sim)

    async def main() -> list[float]:
        async with AsyncSystem(config) as cb:
            await fill(cb)

            async def one(i: int) -> float:
                started = time.monotonic()
                with pytest.raises(QueueFullError):
                    await cb.submit(f"waits for room {i}", wait_s=wait_s)
                return time.monotonic() - started

            waited = await asyncio.gather(*(one(i) for i in range(ROOM_WAITERS + 8)))
            await cb.stop(cancel=True, timeout=0.1)
            return waited

    waited = asyncio.run(main())
    assert max(waited) < 1.75 * wait_s, sorted(waited)[-3:]


def test_a_backpressured_submit_after_stop_leaves_no_thread(sim: SimulatedProvider) -> None:
    config = SystemConfig(models=(one_model(sim),))

    async def main() -> None:
        cb = AsyncSystem(config)
        await cb.start()
        await cb.stop()
        before = set(threading.enumerate())
        try:
            with pytest.raises(SystemStoppedError):
                await cb.submit("too late", wait_s=1.0)
            assert wait_until(
                lambda: not [t for t in threading.enumerate() if t not in before and t.is_alive()],
                timeout=1.0,
            ), [t.name for t in threading.enumerate() if t not in before]
        finally:  # what a fixed stop would have done: leave no idle pool behind the test
            if cb._room_waiters is not None:
                cb._room_waiters.shutdown(wait=True)

    asyncio.run(main())


def test_async_stop_leaves_no_room_waiter_thread_alive(sim: SimulatedProvider) -> None:
    config = full_queue(sim)

    async def main() -> list[str]:
        async with AsyncSystem(config) as cb:
            await fill(cb)
            waiting = [asyncio.ensure_future(cb.submit(f"w{i}", wait_s=WAIT_S)) for i in range(2)]
            await asyncio.sleep(0)  # both submits wait on the pool
            await cb.stop(cancel=True, timeout=0.05)
            alive = [t.name for t in threading.enumerate() if t.name.startswith("callboard-wait")]
            outcomes = await asyncio.gather(*waiting, return_exceptions=True)
            assert all(isinstance(o, SystemStoppedError) for o in outcomes), outcomes
            return alive

    assert asyncio.run(main()) == []


def test_submits_queued_past_the_waiter_pool_at_stop_raise_system_stopped(
    sim: SimulatedProvider,
) -> None:
    """Those waiting on a thread and those queued for one alike: a typed error, not a
    bare ``CancelledError`` the caller would take for its own cancellation."""
    config = full_queue(sim)

    async def main() -> list[Any]:
        async with AsyncSystem(config) as cb:
            await fill(cb)
            waiting = [
                asyncio.ensure_future(cb.submit(f"w{i}", wait_s=WAIT_S))
                for i in range(ROOM_WAITERS + 4)
            ]
            await asyncio.sleep(0)  # each has found no room and handed its wait on
            await cb.stop(cancel=True, timeout=0.05)
            return await asyncio.gather(*waiting, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert all(isinstance(o, SystemStoppedError) for o in outcomes), outcomes


def test_a_cancelled_async_stop_still_stops_everything(sim: SimulatedProvider) -> None:
    config = full_queue(sim)

    async def main() -> AsyncSystem:
        cb = AsyncSystem(config)
        await cb.start()
        await fill(cb)
        waiting = asyncio.ensure_future(cb.submit("w", wait_s=WAIT_S))
        await asyncio.sleep(0)
        stop = asyncio.ensure_future(cb.stop(cancel=True, timeout=0.05))
        await asyncio.sleep(0)  # the stop has begun
        stop.cancel()  # e.g. a second Ctrl-C in the host
        with pytest.raises(asyncio.CancelledError):
            await stop
        with pytest.raises(SystemStoppedError):
            await waiting
        return cb

    cb = asyncio.run(main())  # joins the default executor: the stop has ended
    assert "stopped" in repr(cb.system)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("callboard-wait")]


def test_stop_while_coroutines_await_resolves_each_without_loop_warnings(
    sim: SimulatedProvider, caplog: pytest.LogCaptureFixture
) -> None:
    """Awaiting callers get a result (or their own cancel); the loop logs nothing."""
    sim.configure("m", ModelBehaviour(latency_s=0.3))
    config = SystemConfig(
        models=(one_model(sim, max_concurrency=1),), scheduler=SchedulerSettings(capacity=3)
    )
    caplog.set_level(logging.WARNING, logger="asyncio")

    async def main() -> list[Any]:
        async with AsyncSystem(config) as cb:
            sent = asyncio.ensure_future(cb.submit("sent"))
            queued = asyncio.ensure_future(cb.submit("queued"))
            given_up = asyncio.ensure_future(cb.submit("given up"))
            backpressured = asyncio.ensure_future(cb.submit("room", wait_s=WAIT_S))
            given_up_waiting = asyncio.ensure_future(cb.submit("room 2", wait_s=WAIT_S))
            await asyncio.sleep(0)
            assert wait_until(lambda: cb.system.ledger.live_count() == 3, timeout=5.0)
            given_up.cancel()
            given_up_waiting.cancel()
            await cb.stop(cancel=True, timeout=WAIT_S)
            return await asyncio.gather(
                sent, queued, given_up, backpressured, given_up_waiting, return_exceptions=True
            )

    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    try:
        outcomes = loop.run_until_complete(main())
    finally:
        loop.close()
    gc.collect()
    sent, queued, given_up, backpressured, given_up_waiting = outcomes
    assert isinstance(sent, Completed)
    assert isinstance(queued, Cancelled)
    assert isinstance(given_up, asyncio.CancelledError)
    assert isinstance(backpressured, Cancelled | SystemStoppedError)
    assert isinstance(given_up_waiting, asyncio.CancelledError)
    noise = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert not [m for m in noise if "never retrieved" in m or "destroyed" in m], noise


def test_many_loops_in_many_threads_share_one_async_system(sim: SimulatedProvider) -> None:
    """Each thread runs its own loop; every awaited result arrives on its own loop."""
    config = SystemConfig(models=(one_model(sim, max_concurrency=8),))
    cb = AsyncSystem(config)
    asyncio.run(cb.start())
    answers: dict[int, list[Any]] = {}
    errors: list[BaseException] = []

    async def client(n: int) -> list[Any]:
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(cb.submit(f"t{n}.{i}") for i in range(20)))
        assert asyncio.get_running_loop() is loop
        cancelled = asyncio.ensure_future(cb.submit(f"t{n} cancelled"))
        await asyncio.sleep(0)
        cancelled.cancel()
        gathered = await cb.gather([f"t{n}.g{i}" for i in range(5)], timeout=WAIT_S)
        return [*results, *gathered]

    def run(n: int) -> None:
        try:
            answers[n] = asyncio.run(client(n))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not errors, errors
        assert sorted(answers) == [0, 1, 2, 3]
        assert all(r.ok for rs in answers.values() for r in rs)
        assert cb.system.drain(WAIT_S)
        counts = cb.system.ledger.counts()
        assert counts.balanced
        assert counts.accepted == counts.finished == 4 * 26
    finally:
        asyncio.run(cb.stop())


# -- reading while running; typed errors ---------------------------------------------------


def test_stats_are_readable_while_the_aggregator_restarts(sim: SimulatedProvider) -> None:
    config = SystemConfig(
        models=(one_model(sim),),
        supervisor=SupervisorConfig(backoff_min_s=0.3, backoff_max_s=0.3, backoff_jitter=0.0),
    )

    async def main() -> Stats:
        async with AsyncSystem(config) as cb:
            assert (await cb.submit("one")).ok
            cb.system.tell("aggregator", Crash(reason="a bug, on purpose"))
            assert wait_until(lambda: cb.system.book.resolve("aggregator") is None, timeout=5.0)
            return await asyncio.wait_for(cb.stats(), WAIT_S)  # e.g. GET /stats meanwhile

    assert isinstance(asyncio.run(main()), Stats)


def test_stats_read_after_a_result_count_it(sim: SimulatedProvider) -> None:
    """The caller holds a result, so ``stats()`` must count it.

    The race is forced, not hoped for: a done-callback holds the resolving thread
    for at most 0.5 s (the window that a GIL switch opens by chance; about one
    request in five in a loop of submit, await, stats).
    """
    go = threading.Event()
    with System(SystemConfig(models=(one_model(sim),))) as system:
        future = system.submit("hi")
        future.add_done_callback(lambda _: go.wait(0.5))
        assert future.result(WAIT_S).ok
        try:
            stats = system.stats()
        finally:
            go.set()
    assert stats.ledger["finished"] == 1
    assert stats.outcomes == {"completed": 1}


@pytest.mark.parametrize("call", ["supervision", "tell"])
def test_reading_or_telling_after_stop_raises_system_stopped(
    sim: SimulatedProvider, call: str
) -> None:
    system = System(SystemConfig(models=(one_model(sim),)))
    system.stop()
    act: Callable[[], object] = (
        system.supervision if call == "supervision" else lambda: system.tell("queue", Crash())
    )
    with pytest.raises(SystemStoppedError):
        act()


def test_every_async_call_after_stop_raises_system_stopped(sim: SimulatedProvider) -> None:
    config = SystemConfig(models=(one_model(sim),))

    async def main() -> None:
        cb = AsyncSystem(config)
        with pytest.raises(SystemStoppedError):
            await cb.submit("before start")
        async with cb:
            pass
        calls = [
            lambda: cb.submit("x"),
            lambda: cb.submit("x", wait_s=0.1),
            lambda: cb.submit_many(["x", "y"]),
            lambda: cb.gather(["x"]),
            lambda: cb.race("x", models=["m"]),
            lambda: cb.chain(["{input}"], "x"),
            cb.stats,
            lambda: cb.every(60, "x"),
        ]
        for call in calls:
            with pytest.raises(SystemStoppedError):
                await call()

    asyncio.run(main())


# -- secrets ------------------------------------------------------------------------------------


def test_an_unsendable_api_key_never_reaches_a_log_record(
    sim: SimulatedProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    try:
        settings = one_model(
            sim,
            api_key=Secret(KEY + "\n"),  # a trailing newline from a .env file
            transport="httpx",
            retry=RetryConfig(max_attempts=1),
        )
    except ConfigError as exc:  # refusing it is fine, if the refusal does not show it
        refusal: str | None = str(exc)
    else:
        refusal = None
    if refusal is not None:
        assert "SECRETVALUE" not in refusal
        return
    with System(SystemConfig(models=(settings,))) as system:
        result = system.submit("hi").result(WAIT_S)
    assert not result.ok
    assert "SECRETVALUE" not in repr(result) + str(getattr(result, "detail", ""))
    leaks = [r.name for r in caplog.records if "SECRETVALUE" in r.getMessage()]
    assert leaks == []
