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
import threading
from typing import Literal

__all__ = ["Flag"]


class Flag:
    """Set once, from any thread; awaitable on any loop (``await flag.wait()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            if self._set:
                return
            self._set = True
            waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits on it
                loop.call_soon_threadsafe(_wake, waiter)

    async def wait(self) -> Literal[True]:
        """Return once set (at once if it is)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._set:
                return True
            waiter: asyncio.Future[None] = loop.create_future()
            entry = (loop, waiter)
            self._waiters.append(entry)
        try:
            await waiter
        finally:
            with self._lock:
                if entry in self._waiters:  # given up (cancelled) before it was set
                    self._waiters.remove(entry)
        return True


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
