"""The I/O thread: one asyncio event loop that runs every HTTP call.

Actors never block on the network. Model actors hand batches of calls to this
loop (one ``call_soon_threadsafe`` per batch) and get completions back as
messages. The loop also serves as the timer service: ``call_later`` sends a
message at a clock time, so no actor ever sleeps.

What must hold: every callback scheduled here is short and never blocks;
nothing here touches actor state (callbacks only start coroutines, or tell
actors); ``stop`` leaves no thread and no pending task behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from callboard.runtime.guarded_log import guarded_logger

log = guarded_logger(__name__)
T = TypeVar("T")
EXECUTOR_JOIN_S = 1.0
"""How long a stopping loop waits for its executor's threads to end (heavy answers read
off the loop; names are looked up elsewhere: ``_Resolving``)."""


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh loop: uvloop's when installed (measured +8%), else asyncio's; either
    looks names up as ``_Resolving`` says."""
    try:
        import uvloop
    except ImportError:
        return _AsyncioLoop()
    return _uvloop_resolving_in_python(uvloop)()


class _Resolving:
    """``getaddrinfo`` as the I/O loop does it: an address read at once, a name looked
    up on a daemon thread of its own, not on an executor the loop must join as it
    stops (a lookup a resolver held past its stop held the stop with it, and the I/O
    thread was left alive; found by a hunt) nor on libuv's pool (``_uvloop_...``)."""

    async def getaddrinfo(
        self,
        host: bytes | str | None,
        port: bytes | str | int | None,
        *,
        family: int = 0,
        type: int = 0,  # noqa: A002 - asyncio's name
        proto: int = 0,
        flags: int = 0,
    ) -> list[Any]:
        lookup = functools.partial(socket.getaddrinfo, host, port, family, type, proto, flags)
        if _is_address(host) and (port is None or isinstance(port, int)):
            return list(lookup())  # no lookup: the numbers are read
        return await _looked_up(asyncio.get_running_loop(), lookup)


async def _looked_up(loop: asyncio.AbstractEventLoop, lookup: Callable[[], list[Any]]) -> list[Any]:
    """``lookup()`` on a daemon thread; its answer on ``loop``. A lookup still running
    as the loop stops is left to its resolver: its answer goes nowhere."""
    answer: asyncio.Future[list[Any]] = loop.create_future()

    def settle(found: list[Any] | None, exc: BaseException | None) -> None:
        if answer.done():  # the caller was cancelled meanwhile
            return
        if exc is not None:
            answer.set_exception(exc)
        else:
            answer.set_result(found or [])

    def run() -> None:
        found: list[Any] | None = None
        error: BaseException | None = None
        try:
            found = list(lookup())
        except BaseException as exc:  # noqa: BLE001 - the caller's to see, on the loop
            error = exc  # (any: one left unsettled held its caller for good; a review)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, found, error)

    threading.Thread(target=run, name="callboard-lookup", daemon=True).start()
    return await answer


class _AsyncioLoop(_Resolving, asyncio.SelectorEventLoop):
    """asyncio's own loop, looking names up as ``_Resolving`` says."""


@functools.cache
def _uvloop_resolving_in_python(uvloop: Any) -> type[asyncio.AbstractEventLoop]:
    """uvloop's loop, its names resolved off libuv's thread pool.

    Once libuv's pool has run (uvloop resolves every address there, an IP address too,
    for each connection aiohttp opens), a process forked from this one dies of SIGSEGV
    as it exits normally: libuv's exit handler joins pool threads the child does not
    have (libuv#4443). That is every gunicorn ``--preload`` worker, every fork of a
    host that had used callboard (found by a hunt). An address is read here, at once;
    a name is looked up on a thread of its own (``_Resolving``)."""

    class Loop(_Resolving, uvloop.Loop):  # type: ignore[misc]
        pass

    return Loop


def _is_address(host: bytes | str | None) -> bool:
    """Whether ``host`` is an IP address (or None), not a name to look up."""
    if host is None:
        return True
    try:
        ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host.partition("%")[0])
    except (ValueError, UnicodeDecodeError):
        return False
    return True


class IoLoop:
    """An event loop on a daemon thread, with thread-safe entry points."""

    def __init__(self, *, name: str = "callboard-io") -> None:
        self._loop = new_event_loop()
        self._context = contextvars.Context()
        """What the callbacks handed in run in: each would copy the sender's otherwise (a
        new object a batch of calls and two a timer). Entered only on the loop's thread,
        one callback at a time, as a context must be."""
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False

    def start(self, timeout: float = 5.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the I/O loop did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            self._finish()

    def _finish(self) -> None:
        loop = self._loop
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        with contextlib.suppress(TimeoutError):  # the executor's threads (a heavy answer
            # read off the loop) are gone with the loop; a name's lookup has its own
            ending = loop.shutdown_default_executor()
            loop.run_until_complete(asyncio.wait_for(ending, EXECUTOR_JOIN_S))
        loop.close()

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop; safe from any thread. Dropped once closed."""
        if self._closed:
            return
        with contextlib.suppress(RuntimeError):  # closed between the check and the call
            self._loop.call_soon_threadsafe(fn, *args, context=self._context)

    def call_later(self, delay: float, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop ``delay`` seconds from now (``time.monotonic``),
        never sooner; safe from any thread."""
        self.call_soon(self._at, time.monotonic() + max(0.0, delay), fn, args)

    def _at(self, due: float, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        # uvloop's timers count from the loop's clock, cached at the start of an
        # iteration in whole milliseconds: one can fire up to a millisecond before
        # ``delay`` has passed on the caller's clock. Early, it waits out the rest.
        left = due - time.monotonic()
        if left > 0:
            self._loop.call_later(left, self._at, due, fn, args, context=self._context)
        else:
            fn(*args)

    @property
    def running(self) -> bool:
        """Started and not stopped: what is handed in runs."""
        return self._thread.is_alive() and not self._closed

    @property
    def closed(self) -> bool:
        """``stop`` has been called: nothing more runs on the loop."""
        return self._closed

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the loop; its outcome as a future, for a caller on another
        thread or loop (``asyncio.wrap_future``: cancelling that cancels ``coro``).
        ``RuntimeError`` once the loop is stopped (``coro`` is closed, never run)."""
        if self._closed:
            coro.close()
            raise RuntimeError("the I/O loop is stopped")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # closed between the check and the call
            coro.close()
            raise

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 10.0) -> T:
        """Run a coroutine on the loop and wait for it (edges only: start-up, shutdown)."""
        return self.spawn(coro).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the I/O loop did not stop within %.1f s", timeout)
