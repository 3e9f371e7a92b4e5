"""A flag set once, from any thread, and awaited on any event loop.

``asyncio.Event`` belongs to one loop and is set on it; a thread that is not the
loop's cannot set it, and a coroutine on another loop cannot wait for it. A
``Flag`` is set from anywhere (an actor's thread, a signal handler's loop) and
each waiter is woken on its own loop: ``AsyncSystem.failed`` (the supervisor gave
up, on its thread) and a gateway's hurried stop (a second signal on the main
loop, waited for on the I/O loop where its server runs).

What must hold: every waiter on a loop still running is woken exactly once, on
its loop, once the flag is set (at once if it was); a waiter given up leaves
nothing behind; ``set`` never blocks on a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Literal

__all__ = ["Flag", "resolve", "soon", "wake"]


class Flag:
    """Set once, from any thread; awaitable on any loop (``await flag.wait()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._waiters: list[asyncio.Future[None]] = []
        """Each on the loop it was made on (``get_loop``)."""

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            if self._set:
                return
            self._set = True
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            wake(waiter)

    async def wait(self) -> Literal[True]:
        """Return once set (at once if it is)."""
        with self._lock:
            if self._set:
                return True
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
        try:
            await waiter
        finally:
            with self._lock:
                if waiter in self._waiters:  # given up (cancelled) before it was set
                    self._waiters.remove(waiter)
        return True


def wake(waiter: asyncio.Future[None] | None) -> None:
    """Resolve ``waiter`` on its own loop, from any thread, if it still waits; nothing
    once that loop has closed (nobody waits there)."""
    if waiter is not None:
        soon(waiter.get_loop(), resolve, waiter)


def soon(
    loop: asyncio.AbstractEventLoop,
    callback: Callable[..., object],
    *args: object,
    context: contextvars.Context | None = None,
) -> None:
    """``callback(*args)`` on ``loop``, from any thread; nothing once that loop has
    closed (nobody is there to be told)."""
    if loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # closed between the check and the call
        loop.call_soon_threadsafe(callback, *args, context=context)


def resolve(waiter: asyncio.Future[None]) -> None:
    """On its loop: ``waiter`` resolved, unless it is done already (given up)."""
    if not waiter.done():
        waiter.set_result(None)
