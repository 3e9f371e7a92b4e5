"""A streamed call's deltas on a model actor, waiting for their owner's next poll.

Theory of operation. A model actor makes a streamed call with the same
``ModelClient`` path as a process does locally; the call's sink is a
``DeltaSpool`` on the actor's own event loop. ``put`` appends a delta and,
if it is the first the owner has not been woken for, wakes the owner's long
poll (``wake``): the deltas of every call an owner has here travel in that
poll's answer, in a batch, never one Ray hop each. ``take`` (the poll) hands
over what waits. When ``limit`` deltas wait untaken (an owner that is behind,
or that asked to be ``paused`` because its reader is), ``put`` waits for room:
the call stops reading its socket, and the provider's bytes wait in the
kernel's buffers and TCP's window, not here. ``abandon`` (the owner's reader
left, or the owner is taken for dead) makes the next ``put`` raise
``Abandoned`` and cancels the call where it waits (``attach``): the call ends
there, its slot comes back.

The deltas are numbered as they are put (``count``), and ``handed`` says how
many were taken: a batch taken starts at number ``handed`` before it, so the
owner can tell a batch lost on the way (``Deltas.seq``).

What must hold: never more than ``limit`` deltas held; deltas taken in the
order put, each once, and ``handed`` + ``waiting`` == ``count`` until
``abandon``; a waiting ``put`` is woken by every ``take`` and by ``abandon``;
the call's task cancelled once if the reader left, whichever of ``attach`` and
``abandon`` came first. Everything runs on the actor's one loop: no lock.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from callboard.messages import StreamDelta
from callboard.runtime.stream import LIMIT as CHANNEL_LIMIT
from callboard.runtime.stream import Abandoned

__all__ = ["LIMIT", "DeltaSpool"]

LIMIT = CHANNEL_LIMIT
"""Deltas a call holds for its owner at most (a few KiB of text): what a local stream's
``StreamChannel`` holds."""


class DeltaSpool:
    """One streamed call's deltas for its owner (see the module docstring)."""

    __slots__ = (
        "_abandoned",
        "_asked",
        "_deltas",
        "_producer",
        "_room",
        "_wake",
        "attempt",
        "call",
        "count",
        "ended",
        "handed",
        "limit",
        "model",
        "paused",
        "received",
        "task_id",
    )

    def __init__(
        self, *, task_id: int, attempt: int, call: int, wake: Callable[[], None], limit: int = LIMIT
    ) -> None:
        self.task_id = task_id
        """The owner's task id."""
        self.attempt = attempt
        self.call = call
        """The actor's number for the call."""
        self.limit = limit
        self._wake = wake
        self._deltas: collections.deque[StreamDelta] = collections.deque()
        self._room: asyncio.Future[None] | None = None
        self._producer: asyncio.Task[Any] | None = None
        self._abandoned = False
        self.received = False
        """A delta has arrived: the stream started (it is no longer retried)."""
        self.model = ""
        """The model whose call feeds it (the owner names it from the news it came in)."""
        self.count = 0
        """Deltas sent or waiting to be sent to the owner: the whole stream's once the
        call ended (what ``abandon`` dropped was never sent, and is not counted)."""
        self.handed = 0
        """Deltas taken by the owner so far: the next batch's first is number ``handed``."""
        self.paused = False
        """The owner asked for no more for now (its reader is behind): ``take`` gives
        nothing until it asks again, unless the call has ended."""
        self._asked = 0
        """The number of the latest pause or go-on heard from the owner."""
        self.ended = False
        """The call has ended: what waits is its last, handed over even if paused
        (they come before its answer)."""

    # -- the call (``DeltaSink``) -------------------------------------------------------

    async def put(self, delta: StreamDelta) -> None:
        """Append ``delta``, waiting while ``limit`` wait untaken; ``Abandoned`` if the
        owner's reader left."""
        while not self.offer(delta):
            room = self._room = asyncio.get_running_loop().create_future()
            await room

    def offer(self, delta: StreamDelta) -> bool:
        """Append ``delta`` if fewer than ``limit`` wait untaken; False if that many do
        (``put`` waits for room then); ``Abandoned`` if the owner's reader left. The
        common case of ``put`` without a coroutine (nor the call's timer moves: the
        I/O loop treats a ``put`` as a wait for the reader)."""
        if self._abandoned:
            raise Abandoned
        if len(self._deltas) >= self.limit:
            return False
        self._deltas.append(delta)
        self.count += 1
        self.received = True
        if len(self._deltas) == 1 and not self.paused:
            self._wake()
        return True

    def close(self) -> None:
        """The call ended (its answer follows in the owner's news)."""
        self.ended = True

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def attach(self, task: asyncio.Task[Any]) -> None:
        """The call's ``task``, cancelled if the reader leaves (at once if it has)."""
        self._producer = task
        if self._abandoned:
            task.cancel("the stream's reader left")

    # -- the owner ----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Deltas held for the owner."""
        return len(self._deltas)

    @property
    def due(self) -> bool:
        """Whether the owner's next poll takes deltas from here."""
        return bool(self._deltas) and (self.ended or not self.paused)

    def take(self) -> tuple[StreamDelta, ...]:
        """What waits, in order (nothing while paused, unless the call ended)."""
        if not self.due:
            return ()
        deltas = tuple(self._deltas)
        self._deltas.clear()
        self.handed += len(deltas)
        self._let_in()
        return deltas

    def pause(self, paused: bool, ask: int) -> None:
        """The owner's reader is behind (True) or has caught up (False), as its ``ask``-th
        ask said; an ask older than the last one heard changes nothing."""
        if ask <= self._asked:
            return
        self._asked = ask
        self.paused = paused
        if not paused and self._deltas:
            self._wake()

    def abandon(self) -> None:
        """Nobody will read: what waits is dropped, the call ends where it waits."""
        self._abandoned = True
        self.count -= len(self._deltas)  # never sent: the answer does not count them
        self._deltas.clear()
        self._let_in()
        producer, self._producer = self._producer, None
        if producer is not None and not producer.done():
            producer.cancel("the stream's reader left")

    def _let_in(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)
