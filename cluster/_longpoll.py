"""One owner's long poll parked on a shared actor's event loop.

An owner's ``collect`` waits here until there is news for it or its wait is
over. The waiter is a bare future that ``wake`` resolves, so the poll
resumes in the very loop iteration the news came in (``asyncio.wait_for``
on an ``asyncio.Event``, in Python 3.11, runs the wait as a task of its own:
two more iterations, during which whatever else the loop runs goes first).

What must hold: at most one poll parked per owner; a wake with nobody parked
is harmless (the next poll finds the news and does not park).
"""

from __future__ import annotations

import asyncio

__all__ = ["LongPoll"]


class LongPoll:
    """Where one owner's ``collect`` waits (see the module docstring)."""

    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    async def park(self, wait_s: float) -> None:
        """Wait until ``wake`` or ``wait_s``, whichever comes first."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(wait_s, _settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            if self._waiter is waiter:
                self._waiter = None

    def wake(self) -> None:
        """News came: the parked poll (if any) answers in this loop iteration."""
        if self._waiter is not None:
            _settle(self._waiter)


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
