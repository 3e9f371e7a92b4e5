"""Room for request bodies: the bytes of the bodies the gateway keeps, bounded.

``max_body_mb`` bounds one request; nothing bounded them all. A request's body is
in memory from its read to its task's end (the bytes, what they parse into, the
body encoded for the provider), and a request whose client left with an
``Idempotency-Key`` stays queued for its retry: a thousand 32 MB requests were
32 GB, whoever sent them. ``max_held_mb`` bounds the sum.

A request takes room for its body as the body arrives: its bytes as they come
(a piece at a time, ``Hold.grow``), and, once it has come whole, for a heavy one
what its JSON values cost once read (``app.VALUE_BYTES``, all of the room at most).
It keeps that room until both its handler and everything that outlived the handler
with its body (a heavy body's work on the reader thread, the task of a client that
left) have ended. A body that finds no room, or whose room cannot grow as more of
it comes, is answered at once, 429 with ``Retry-After`` (``gateway_full``), and its
connection closed if some of it is still to come: the gateway sheds load, as an
HTTP proxy under memory pressure does, rather than keep one more body while it
waits. One declared larger than the room left is refused before any of it is read.

Why not take room for the declared length before the body is read, and wait for
it there? Because room taken for a body declared and never sent is an attack:
sixteen connections that declare 32 MB each and then stall would hold a room of
512 MB, and every other request, for ``body_timeout_s``, again and again (as four
places for large bodies did, reverted in 1ad3ebc). Counted as it comes, a body
holds what its sender actually sent: eight connections that each sent 31 MB of
a 32 MB body and stalled held 250 MB uncounted while the room said 0 (found by a
hunt); now they hold the room, and a ninth is refused.

What must hold: ``held <= capacity`` at every moment; every ``Hold`` gives its
room back exactly once, whether its request ends, fails or is cancelled, and not
before whatever was handed it in the same turn of the loop took its part.
Everything here runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Hold", "Room"]


class Room:
    """``capacity`` bytes of request bodies, shared by the gateway's requests."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a room's capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.held = 0
        """Bytes taken and not given back."""
        self.most = 0
        """The most bytes held at once since the gateway started."""
        self.refused = 0
        """Bodies that found no room."""

    def take(self, size: int) -> Hold | None:
        """Room for a body of ``size`` bytes, or None if there is not that much left."""
        if size < 0:
            raise ValueError(f"a body has no negative size, got {size}")
        if self.held + size > self.capacity:
            self.refused += 1
            return None
        self.held += size
        self.most = max(self.most, self.held)
        return Hold(self, size)

    def turns_away(self, size: int) -> bool:
        """Whether a body of ``size`` bytes finds no room now (then counted as refused);
        nothing is taken: asked of a length declared before any of the body is read."""
        if self.held + size > self.capacity:
            self.refused += 1
            return True
        return False

    def statistics(self) -> dict[str, int]:
        """The room as it stands, for ``/v1/callboard/stats``."""
        return {
            "capacity_bytes": self.capacity,
            "held_bytes": self.held,
            "most_bytes": self.most,
            "refused": self.refused,
        }


class Hold:
    """One request's room: given back once its handler is ``done`` and every future it
    was ``kept_until`` has resolved.

    The last holder letting go gives the room back at the next turn of the loop, not
    at once: a future's done callbacks run in the order they were added, so one that
    hands the body on (a reader's work, done, handed to the callback that follows the
    task it made) may come after the hold's own, and must find the hold still there."""

    __slots__ = ("_given", "_handling", "_holders", "_room", "size")

    def __init__(self, room: Room, size: int) -> None:
        self._room = room
        self.size = size
        self._holders = 1  # the handler
        self._handling = True
        self._given = False

    def grow(self, size: int) -> bool:
        """Take ``size`` bytes more (a body's next piece, or what it parses into), or
        False, taking nothing, if the room has not that much left (a refusal)."""
        if size < 0:
            raise ValueError(f"a hold grows by no negative size, got {size}")
        if self._given:
            raise RuntimeError("a hold given back cannot grow")
        room = self._room
        if room.held + size > room.capacity:
            room.refused += 1
            return False
        room.held += size
        room.most = max(room.most, room.held)
        self.size += size
        return True

    def keep_until(self, outcome: asyncio.Future[Any]) -> None:
        """The body outlives the handler until ``outcome`` resolves (the task's result, a
        heavy body's work on the reader thread)."""
        if not self._given and not outcome.done():
            self._holders += 1
            outcome.add_done_callback(self._let_go)

    def done(self) -> None:
        """The handler has ended (answered, refused, or its client left)."""
        if self._handling:
            self._handling = False
            self._let_go(None)

    def _let_go(self, _outcome: object) -> None:
        self._holders -= 1
        if self._holders == 0:
            asyncio.get_running_loop().call_soon(self._give_back)

    def _give_back(self) -> None:
        if self._holders == 0 and not self._given:  # nobody took it up meanwhile
            self._given = True
            room = self._room
            room.held -= self.size
