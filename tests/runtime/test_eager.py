"""A task whose first step runs in the callback that creates it."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import sys
import weakref
from typing import Any

import pytest
from callboard.runtime.eager import start_task
from callboard.runtime.io_loop import new_event_loop

where: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="outside")


@pytest.fixture(params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> Any:
    made = asyncio.new_event_loop() if request.param == "asyncio" else new_event_loop()
    yield made
    made.close()


def in_callback(loop: asyncio.AbstractEventLoop, fn: Any) -> Any:
    """``fn()`` run as a plain loop callback (no task running), its return value."""
    got: asyncio.Future[Any] = loop.create_future()

    def callback() -> None:
        assert asyncio.current_task(loop) is None
        got.set_result(fn())

    loop.call_soon(callback)
    return loop.run_until_complete(asyncio.wait_for(got, 5))


def cancelled_at_once(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
    """``coro`` started eagerly, its task cancelled before its first scheduled step."""
    task = start_task(loop, coro)
    task.cancel()
    return task


def test_the_first_step_runs_before_the_task_is_returned(loop: asyncio.AbstractEventLoop) -> None:
    steps: list[str] = []
    gate = loop.create_future()

    async def call() -> str:
        steps.append("first")
        await gate
        steps.append("rest")
        return "done"

    def start() -> tuple[asyncio.Task[str], list[str]]:
        task = start_task(loop, call())
        return task, list(steps)

    task, seen = in_callback(loop, start)
    assert seen == ["first"]
    gate.set_result(None)
    assert loop.run_until_complete(asyncio.wait_for(task, 5)) == "done"
    assert steps == ["first", "rest"]


def test_the_first_step_runs_inside_its_task(loop: asyncio.AbstractEventLoop) -> None:
    """Timeouts look for their task: they work from the very first step."""
    seen: list[object] = []

    async def call() -> str:
        seen.append(asyncio.current_task())
        async with asyncio.timeout(5):
            await asyncio.sleep(0)
        seen.append(asyncio.current_task())
        return "ok"

    task = in_callback(loop, lambda: start_task(loop, call()))
    assert loop.run_until_complete(asyncio.wait_for(task, 5)) == "ok"
    assert seen == [task, task]


def test_the_task_runs_in_its_own_context(loop: asyncio.AbstractEventLoop) -> None:
    async def call() -> str:
        where.set("inside")
        await asyncio.sleep(0)
        return where.get()

    def start() -> tuple[asyncio.Task[str], str]:
        return start_task(loop, call()), where.get()

    task, after = in_callback(loop, start)
    assert after == "outside"
    assert loop.run_until_complete(asyncio.wait_for(task, 5)) == "inside"


def test_started_from_another_task_that_task_stays_current(
    loop: asyncio.AbstractEventLoop,
) -> None:
    async def inner() -> object:
        return asyncio.current_task()

    async def outer() -> tuple[bool, bool]:
        me = asyncio.current_task()
        child = start_task(loop, inner())
        still_me = asyncio.current_task() is me
        return still_me, await child is child

    assert loop.run_until_complete(asyncio.wait_for(outer(), 5)) == (True, True)


def test_cancelled_before_its_next_step_the_cancel_lands_at_its_await(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """As for any task: the future it waits on is cancelled, its ``finally`` runs."""
    gate: asyncio.Future[None] = loop.create_future()
    cleaned: list[str] = []

    async def call() -> None:
        try:
            await gate
        finally:
            cleaned.append("finally")

    task = in_callback(loop, lambda: cancelled_at_once(loop, call()))
    with pytest.raises(asyncio.CancelledError):
        loop.run_until_complete(asyncio.wait_for(task, 5))
    assert gate.cancelled()
    assert cleaned == ["finally"]


def test_cancelled_before_its_next_step_it_waits_for_what_it_awaited(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """An awaited task that swallows the cancel is waited for, and its answer taken."""

    async def absorbs() -> str:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return "absorbed"
        return "slept"

    inner = loop.create_task(absorbs())
    loop.run_until_complete(asyncio.sleep(0.01))  # it waits in its sleep

    async def call() -> str:
        return await inner

    task = in_callback(loop, lambda: cancelled_at_once(loop, call()))
    assert loop.run_until_complete(asyncio.wait_for(task, 5)) == "absorbed"


@pytest.mark.skipif(
    sys.version_info >= (3, 12),
    reason="3.12's own eager start: the failed coroutine's frame keeps its starter's as "
    "f_back until the collector runs (CPython's, measured on 3.12.1 and 3.13.0)",
)
def test_an_error_in_the_first_step_keeps_no_frame_alive(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """The error's traceback does not hold the step's frame (which holds the error):
    the starter's frames are freed without the collector."""

    class Marker:
        pass

    async def raises() -> None:
        raise ValueError("bad body")

    def start() -> tuple[asyncio.Task[None], weakref.ref[Marker]]:
        marker = Marker()
        return start_task(loop, raises()), weakref.ref(marker)

    gc.disable()
    try:
        task, marker = in_callback(loop, start)
        with pytest.raises(ValueError, match="bad body"):
            loop.run_until_complete(asyncio.wait_for(task, 5))
        del task
        assert marker() is None
    finally:
        gc.enable()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's task ends with the interrupt")
def test_an_interrupt_in_the_first_step_reaches_the_starter_and_cancels_the_task(
    loop: asyncio.AbstractEventLoop,
) -> None:
    async def interrupted() -> None:
        raise KeyboardInterrupt

    def start() -> set[asyncio.Task[Any]] | None:
        before = asyncio.all_tasks(loop)
        try:
            start_task(loop, interrupted())
        except KeyboardInterrupt:
            return asyncio.all_tasks(loop) - before
        return None

    started = in_callback(loop, start)
    assert started is not None, "the interrupt reached the starter"
    (left,) = started
    with pytest.raises(asyncio.CancelledError):
        loop.run_until_complete(asyncio.wait_for(left, 5))


def test_a_coroutine_that_ends_in_its_first_step(loop: asyncio.AbstractEventLoop) -> None:
    async def returns() -> int:
        return 7

    async def raises() -> None:
        raise ValueError("bad body")

    done = in_callback(loop, lambda: start_task(loop, returns()))
    failed = in_callback(loop, lambda: start_task(loop, raises()))
    assert loop.run_until_complete(asyncio.wait_for(done, 5)) == 7
    with pytest.raises(ValueError, match="bad body"):
        loop.run_until_complete(asyncio.wait_for(failed, 5))


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's eager task is done at once")
def test_ended_in_its_first_step_then_cancelled_it_ends_cancelled(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """On 3.11 the task is not done until its first scheduled step: a cancel before it
    has nothing to throw into, and the task ends cancelled, as any task cancelled
    before its last step does."""

    async def returns() -> int:
        return 7

    task = in_callback(loop, lambda: cancelled_at_once(loop, returns()))
    with pytest.raises(asyncio.CancelledError):
        loop.run_until_complete(asyncio.wait_for(task, 5))


def test_values_and_errors_of_later_steps_reach_the_coroutine(
    loop: asyncio.AbstractEventLoop,
) -> None:
    first: asyncio.Future[int] = loop.create_future()
    second: asyncio.Future[int] = loop.create_future()

    async def call() -> tuple[int, str]:
        got = await first
        try:
            await second
        except KeyError as exc:
            return got, str(exc)
        return got, "no error"

    task = in_callback(loop, lambda: start_task(loop, call()))
    first.set_result(3)
    loop.run_until_complete(asyncio.sleep(0.01))
    second.set_exception(KeyError("gone"))
    assert loop.run_until_complete(asyncio.wait_for(task, 5)) == (3, "'gone'")
