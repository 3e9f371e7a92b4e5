"""The I/O thread's loop (runtime/io_loop.py): callbacks handed in from other threads."""

from __future__ import annotations

import asyncio
import contextvars
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from callboard.runtime.io_loop import IoLoop
from support import WAIT_S, threads_since, wait_until

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


@pytest.fixture
def io() -> Iterator[IoLoop]:
    loop = IoLoop(name="test-io")
    loop.start()
    yield loop
    loop.stop()


def test_callbacks_run_on_the_loops_thread_in_its_own_context_not_the_senders(io: IoLoop) -> None:
    """Neither a callback nor a timer copies the sender's context (a new object each:
    the loop has one of its own), and one after another they share it without error."""
    seen: queue.Queue[tuple[str, str, str]] = queue.Queue()

    def note(what: str) -> None:
        seen.put((what, threading.current_thread().name, VAR.get()))
        VAR.set(what)  # in the loop's context: the next callback sees it, no sender does

    VAR.set("the sender's")
    io.call_soon(note, "soon")
    io.call_later(0.001, note, "later")
    io.call_soon(note, "soon again")
    got = [seen.get(timeout=WAIT_S) for _ in range(3)]
    # in the order they ran (the timer comes before "soon again" when the sender is
    # slow between the two: a CI run's), each saw the one before it, none the sender's
    assert sorted(what for what, _, _ in got) == ["later", "soon", "soon again"]
    assert all(thread == "test-io" for _, thread, _ in got)
    assert [before for _, _, before in got] == ["unset", got[0][0], got[1][0]]
    assert VAR.get() == "the sender's"


def test_nothing_runs_once_stopped(io: IoLoop) -> None:
    ran = threading.Event()
    io.stop()
    io.call_soon(ran.set)
    io.call_later(0.0, ran.set)
    assert io.closed
    assert not ran.wait(0.05)


def test_a_spawned_coroutine_runs_on_the_loop_and_is_awaited_from_another(io: IoLoop) -> None:
    """What the gateway's server does to run on the I/O loop: a coroutine spawned there
    from another loop, its outcome (value or error) awaited across; cancelled from
    there, it is cancelled where it runs."""
    cancelled = threading.Event()

    async def where() -> str:
        return threading.current_thread().name

    async def fails() -> None:
        raise ValueError("on the loop")

    async def hangs() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main() -> None:
        assert await asyncio.wrap_future(io.spawn(where())) == "test-io"
        with pytest.raises(ValueError, match="on the loop"):
            await asyncio.wrap_future(io.spawn(fails()))
        waiter = asyncio.wrap_future(io.spawn(hangs()))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await asyncio.to_thread(cancelled.wait, WAIT_S)  # there too

    asyncio.run(main())


def test_spawn_once_stopped_raises_and_closes_the_coroutine(io: IoLoop) -> None:
    async def never() -> None:  # pragma: no cover - closed unrun
        raise AssertionError

    coro = never()
    io.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        io.spawn(coro)
    assert coro.cr_frame is None  # closed: no "never awaited" warning


def test_a_timer_never_fires_before_its_delay_on_the_callers_clock(io: IoLoop) -> None:
    """uvloop counts a timer from its loop's clock, cached in whole milliseconds at the
    start of an iteration: unchecked, one fired up to a millisecond early (a stats
    question's one-second grace answered after 0.9997 s)."""
    fired: queue.Queue[tuple[float, float]] = queue.Queue()

    def note(asked: float, delay: float) -> None:
        fired.put((time.monotonic() - asked, delay))

    for i in range(40):
        delay = 0.0005 + i * 0.00037  # across millisecond boundaries, sub-millisecond parts
        io.call_later(delay, note, time.monotonic(), delay)
    early = [(e, d) for e, d in (fired.get(timeout=WAIT_S) for _ in range(40)) if e < d]
    assert early == []


FORKED = """
import asyncio, os, sys
from callboard.runtime.io_loop import IoLoop
async def resolve(host):
    return await asyncio.get_running_loop().getaddrinfo(host, 80)
io = IoLoop()
io.start()
for host in ("127.0.0.1", "localhost"):  # an address read, a name looked up
    assert io.spawn(resolve(host)).result(30)
io.stop()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit, as a gunicorn worker's
print(os.waitpid(pid, 0)[1])
"""


def test_a_process_forked_after_the_loop_resolved_names_exits_cleanly() -> None:
    """uvloop resolved every address on libuv's thread pool, and a process forked after
    that pool had run died of SIGSEGV as it exited normally (libuv's exit handler joins
    threads the child does not have): every gunicorn ``--preload`` worker of a host
    that had used callboard (found by a hunt)."""
    pytest.importorskip("uvloop")
    ran = subprocess.run(  # noqa: S603 - our own interpreter and code
        [sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=60, check=True
    )
    assert ran.stdout.strip() == "0", ran.stdout + ran.stderr  # not 11: SIGSEGV


def test_a_loop_that_looked_names_up_leaves_no_thread_once_stopped() -> None:
    """Names are looked up on threads of their own (not libuv's pool, above): each ends
    with its lookup."""

    async def resolve() -> list[Any]:
        return await asyncio.get_running_loop().getaddrinfo("localhost", 80)

    before = set(threading.enumerate())
    io = IoLoop()
    io.start()
    assert io.run(resolve())
    io.stop()
    assert wait_until(lambda: threads_since(before) == [])


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_a_lookup_a_resolver_holds_does_not_hold_the_stop(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Looked up on the loop's executor, a name a resolver held past the stop held the
    stop too: it waited for the executor, ``did not stop within 5.0 s``, and left the
    I/O thread alive (asyncio's loop and uvloop, Python 3.11 and 3.12; found by a
    hunt)."""
    if kind == "uvloop":
        pytest.importorskip("uvloop")
    else:
        monkeypatch.setitem(sys.modules, "uvloop", None)  # asyncio's own loop
    held, asked = threading.Event(), threading.Event()
    getaddrinfo = socket.getaddrinfo

    def resolver(*args: Any) -> Any:
        asked.set()
        held.wait(WAIT_S)
        return getaddrinfo("127.0.0.1", 80)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)

    async def resolve() -> list[Any]:
        return await asyncio.get_running_loop().getaddrinfo("example.invalid", 80)

    io = IoLoop()
    io.start()
    try:
        looking = io.spawn(resolve())
        assert asked.wait(WAIT_S)
        io.stop()
        assert not io._thread.is_alive()  # the thread the stop must end
        assert not held.is_set(), "the lookup is still held: the stop did not wait for it"
        assert looking.cancelled()
    finally:
        held.set()


class _Stopped(BaseException):
    """Not an ``Exception``: a resolver's ``KeyboardInterrupt`` or ``SystemExit``."""


def test_whatever_a_lookup_raises_reaches_its_caller(
    io: IoLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only an ``Exception`` reached the caller: any other left its lookup unsettled and
    the caller waiting for good (found by a review)."""

    def resolver(*args: Any) -> Any:
        raise _Stopped

    monkeypatch.setattr(socket, "getaddrinfo", resolver)

    async def resolve() -> list[Any]:
        return await asyncio.get_running_loop().getaddrinfo("example.invalid", 80)

    with pytest.raises(_Stopped):
        io.spawn(resolve()).result(WAIT_S)
