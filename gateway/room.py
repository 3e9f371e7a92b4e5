"""Room for request bodies: the bytes the gateway holds at once, bounded.

``max_body_mb`` bounds one request; nothing bounded them all. A request's body is
in memory from its read to its task's end (the bytes, what they parse into, the
body encoded for the provider), and a request whose client left with an
``Idempotency-Key`` stays queued for its retry: a thousand 32 MB requests were
32 GB, whoever sent them. ``max_held_mb`` bounds the sum.

A request takes its body's room before the body is read (the size its head
declares; ``max_body_mb`` for a chunked body, given back down to its size once it
has come), and keeps it until both its handler and everything that outlived the
handler with its body (a heavy body's work on the reader thread, the task of a
client that left) have ended. A request that finds no room waits for it, first
come first served (but a body under 64 KiB that fits goes in at once: a chat
request does not queue behind a flood of images), before a byte of its body is
read: meanwhile the body stays in the client's socket and aiohttp's read buffer
(at most 128 KiB a connection), so a waiting request holds a connection, not
memory. Past its deadline (its
``X-Callboard-Deadline``, else ``max_wait_s``) it is a ``NoRoom`` (a 429 with
``Retry-After``), as a request over its key's rpm is.

What must hold: ``held <= capacity`` at every moment; every ``take`` that returns a
``Hold`` gives its room back exactly once, whether its request ends, fails or is
cancelled; a waiter that leaves (cancelled, timed out) takes nothing and lets the
next one in; waiters are served in arrival order (a large body is not passed over
for ever by small ones). Everything here runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Hold", "NoRoom", "Room"]


class NoRoom(Exception):  # noqa: N818 - an answer (a 429), not a failure of ours
    """No room for a body came within the request's deadline."""

    def __init__(self, size: int, waited_s: float) -> None:
        super().__init__(f"no room for a body of {size} bytes within {waited_s:g} s")
        self.size = size
        self.waited_s = waited_s


@dataclass(eq=False, slots=True)
class _Waiter:
    size: int
    granted: asyncio.Future[None] = field(repr=False)


class Room:
    """``capacity`` bytes of request bodies, shared by the gateway's requests."""

    def __init__(self, capacity: int, *, small: int = 0) -> None:
        if capacity <= 0:
            raise ValueError(f"a room's capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.small = small
        """A body smaller than this that fits goes in even while larger ones wait (an
        ordinary chat request does not queue behind a flood of images)."""
        self.held = 0
        """Bytes taken and not given back."""
        self.most = 0
        """The most bytes held at once since the gateway started."""
        self.waited = 0
        """Requests that had to wait for room (they may have got it since)."""
        self.refused = 0
        """Requests that found no room within their deadline."""
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for room now."""
        return len(self._waiters)

    def statistics(self) -> dict[str, int]:
        """The room as it stands, for ``/v1/callboard/stats``."""
        return {
            "capacity_bytes": self.capacity,
            "held_bytes": self.held,
            "most_bytes": self.most,
            "waiting": self.waiting,
            "waited": self.waited,
            "refused": self.refused,
        }

    def fits(self, size: int) -> bool:
        """Whether a body of ``size`` bytes would get its room at once."""
        return self.held + size <= self.capacity and (not self._waiters or size < self.small)

    async def take(self, size: int, *, within_s: float) -> Hold:
        """Room for a body of ``size`` bytes, at once or when the requests before it
        give theirs back; ``NoRoom`` if that takes longer than ``within_s``."""
        if not 0 <= size <= self.capacity:
            raise ValueError(f"a body of {size} bytes can never fit a room of {self.capacity}")
        if self.fits(size):
            self._grant(size)
            return Hold(self, size)
        waiter = _Waiter(size, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self.waited += 1
        try:
            async with asyncio.timeout(within_s):
                await waiter.granted
        except TimeoutError:
            self._leave(waiter)
            self.refused += 1
            raise NoRoom(size, within_s) from None
        except asyncio.CancelledError:
            self._leave(waiter)
            raise
        return Hold(self, size)

    def _grant(self, size: int) -> None:
        self.held += size
        self.most = max(self.most, self.held)

    def _leave(self, waiter: _Waiter) -> None:
        """``waiter`` gives up: its room back if it was granted in the meantime, else
        its place; either may let the next ones in."""
        if waiter.granted.done() and not waiter.granted.cancelled():
            self._give_back(waiter.size)
            return
        waiter.granted.cancel()
        with contextlib.suppress(ValueError):  # _admit dropped it already (cancelled)
            self._waiters.remove(waiter)
        self._admit()

    def _give_back(self, size: int) -> None:
        self.held -= size
        self._admit()

    def _admit(self) -> None:
        """Let in the waiters at the front that now fit, in their order."""
        waiters = self._waiters
        while waiters:
            waiter = waiters[0]
            if waiter.granted.cancelled():  # its take was cancelled, and leaves next turn
                waiters.popleft()
                continue
            if self.held + waiter.size > self.capacity:
                return
            waiters.popleft()
            self._grant(waiter.size)
            waiter.granted.set_result(None)


class Hold:
    """One request's room: given back once its handler is ``done`` and every future it
    was ``kept_until`` has resolved."""

    __slots__ = ("_holders", "_room", "size")

    def __init__(self, room: Room, size: int) -> None:
        self._room = room
        self.size = size
        self._holders = 1  # the handler

    def shrink(self, size: int) -> None:
        """The body came: keep room for ``size`` bytes only (a chunked body takes room
        for ``max_body_mb`` before it is read)."""
        if 0 <= size < self.size and self._holders:
            surplus, self.size = self.size - size, size
            self._room._give_back(surplus)  # the room's own Hold

    def keep_until(self, outcome: asyncio.Future[Any]) -> None:
        """The body outlives the handler until ``outcome`` resolves (the task's result, a
        heavy body's work on the reader thread)."""
        if self._holders and not outcome.done():
            self._holders += 1
            outcome.add_done_callback(self._let_go)

    def done(self) -> None:
        """The handler has ended (answered, refused, or its client left)."""
        self._let_go(None)

    def _let_go(self, _outcome: object) -> None:
        if self._holders == 0:
            return
        self._holders -= 1
        if self._holders == 0:
            self._room._give_back(self.size)  # the room's own Hold
