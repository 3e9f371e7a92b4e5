"""Handoff: futures settled on other threads reach waiters on the loop, a run of them in
one delivery; cancelling a waiter never cancels its future."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from concurrent.futures import Future

import pytest
from callboard.runtime.handoff import Handoff
from support import WAIT_S


def _settle_on_thread(futures: list[Future[int]], started: threading.Event) -> threading.Thread:
    def run() -> None:
        started.wait(WAIT_S)
        for i, future in enumerate(futures):
            future.set_result(i)

    thread = threading.Thread(target=run, name="settler")
    thread.start()
    return thread


def test_each_waiter_gets_its_futures_result_from_another_thread() -> None:
    async def main() -> list[int]:
        handoff = Handoff()
        futures: list[Future[int]] = [Future() for _ in range(100)]
        waiters = [handoff.watch(f) for f in futures]
        started = threading.Event()
        thread = _settle_on_thread(futures, started)
        started.set()
        results = await asyncio.wait_for(asyncio.gather(*waiters), WAIT_S)
        thread.join(WAIT_S)
        return results

    assert asyncio.run(main()) == list(range(100))


def test_futures_settled_while_the_loop_is_busy_arrive_in_one_delivery() -> None:
    """The loop is held (a blocking section of its own) while a thread settles 50
    futures: when the first waiter wakes, every other one is settled already."""

    async def main() -> list[bool]:
        handoff = Handoff()
        futures: list[Future[int]] = [Future() for _ in range(50)]
        waiters = [handoff.watch(f) for f in futures]
        seen: list[bool] = []
        waiters[0].add_done_callback(lambda _: seen.extend(w.done() for w in waiters))
        started = threading.Event()
        thread = _settle_on_thread(futures, started)
        started.set()
        thread.join(WAIT_S)  # the loop does nothing until all 50 are settled
        assert not any(w.done() for w in waiters)  # each is settled on the loop, later
        await asyncio.wait_for(asyncio.gather(*waiters), WAIT_S)
        return seen

    seen = asyncio.run(main())
    assert seen == [True] * 50


def test_a_cancelled_future_cancels_its_waiter_and_a_failed_one_raises() -> None:
    async def main() -> None:
        handoff = Handoff()
        cancelled: Future[int] = Future()
        failed: Future[int] = Future()
        waiters = handoff.watch(cancelled), handoff.watch(failed)
        threading.Thread(target=cancelled.cancel).start()
        threading.Thread(target=failed.set_exception, args=(LookupError("gone"),)).start()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiters[0], WAIT_S)
        with pytest.raises(LookupError, match="gone"):
            await asyncio.wait_for(waiters[1], WAIT_S)

    asyncio.run(main())


def test_cancelling_a_waiter_leaves_its_future_alone() -> None:
    async def main() -> tuple[Future[int], asyncio.Future[int], asyncio.Future[int]]:
        handoff = Handoff()
        left: Future[int] = Future()
        other: Future[int] = Future()
        gone, kept = handoff.watch(left), handoff.watch(other)
        gone.cancel()
        go = threading.Event()
        go.set()
        thread = _settle_on_thread([left, other], go)
        await asyncio.wait_for(kept, WAIT_S)  # settled with the cancelled one's run
        thread.join(WAIT_S)
        return left, gone, kept

    left, gone, kept = asyncio.run(main())
    assert left.result() == 0
    assert gone.cancelled()
    assert kept.result() == 1


def test_a_handoff_serves_one_loop() -> None:
    handoff = Handoff()

    async def watch() -> None:
        handoff.watch(Future())

    asyncio.run(watch())
    with pytest.raises(RuntimeError, match="one event loop"):
        asyncio.run(watch())


def test_a_future_settled_after_its_loop_closed_is_dropped() -> None:
    handoff = Handoff()
    future: Future[int] = Future()

    async def watch() -> None:
        handoff.watch(future)

    asyncio.run(watch())
    future.set_result(1)  # the loop is closed: nobody waits, nothing raises
    assert future.result() == 1


def test_a_handoff_lets_its_closed_loop_go() -> None:
    """A handoff kept in a table keyed by loop must not keep the loop alive: once the
    loop closed and its futures settled, nothing of ours holds it."""
    handoff = Handoff()
    held: list[Future[int]] = [Future()]
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def watch() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        handoff.watch(held[0] if held else Future())

    asyncio.run(watch())
    held.pop().set_result(1)  # the delivery finds the loop closed
    gc.collect()  # (a standard Future keeps its callbacks, and so its waiter: it is gone)
    assert loops[0]() is None
    with pytest.raises(RuntimeError, match="one event loop"):
        asyncio.run(watch())  # still bound to the loop it served, gone or not


def test_a_loop_closed_with_a_delivery_scheduled_is_let_go_too() -> None:
    """A host running its own loop (``run_until_complete``, then ``close``): a future
    settled while the loop was not running scheduled a delivery that never ran, and
    every later one was added to it, holding the loop and its results for good (20
    closed loops kept by an ``AsyncSystem``; found by a hunt)."""
    handoff = Handoff()
    held: list[Future[int]] = [Future() for _ in range(3)]
    loop = asyncio.new_event_loop()
    loop.run_until_complete(_watch_all(handoff, held))
    held[0].set_result(0)  # a delivery is scheduled: the loop is not running
    loop.close()
    gone = weakref.ref(loop)
    del loop
    held.pop(1).set_result(1)  # the loop has closed since
    held.pop(1).set_result(2)
    held.clear()  # (a standard Future keeps its callbacks, and so its waiter)
    gc.collect()
    assert gone() is None


async def _watch_all(handoff: Handoff, futures: list[Future[int]]) -> None:
    for future in futures:
        handoff.watch(future)


def test_after_runs_on_the_loop_once_a_delivery_has_settled_its_waiters() -> None:
    async def main() -> tuple[list[list[bool]], bool]:
        loop = asyncio.get_running_loop()
        seen: list[list[bool]] = []
        on_loop = True
        waiters: list[asyncio.Future[int]] = []

        def after() -> None:
            nonlocal on_loop
            on_loop = on_loop and asyncio.get_running_loop() is loop
            seen.append([w.done() for w in waiters])

        handoff = Handoff(after)
        futures: list[Future[int]] = [Future() for _ in range(10)]
        waiters.extend(handoff.watch(f) for f in futures)
        started = threading.Event()
        thread = _settle_on_thread(futures, started)
        started.set()
        thread.join(WAIT_S)  # all ten settle before the loop runs again: one delivery
        await asyncio.wait_for(asyncio.gather(*waiters), WAIT_S)
        return seen, on_loop

    seen, on_loop = asyncio.run(main())
    assert seen == [[True] * 10]
    assert on_loop
