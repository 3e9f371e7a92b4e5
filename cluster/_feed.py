"""A streamed task's deltas from the cluster into its reader's channel, in the owning
process.

Theory of operation. The link hears a streamed call's deltas in batches, in its
model's news (``Deltas``), on its own actor thread, which must never wait for a
reader. It hands each batch to the task's ``StreamFeed`` on the process's I/O
loop (one ``call_soon`` a batch), which puts them to the task's ``DeltaSink``
(the ``StreamChannel`` the caller reads) one by one, waiting there while the
channel is full. Meanwhile batches wait here, in order; once ``limit`` wait,
the feed asks the model actor to ``pause`` the call (its deltas then wait on
the actor, whose call stops reading the provider once its own spool is full),
and to go on once every waiting delta is in the channel: a slow reader costs
two Ray hops, never unbounded memory, and a fast one none.

The end of the task (its ``Result``) is delivered by the feed once every delta
before it is in the channel (``end``): the channel closes when the task's
future is done, and a reader must not see the end before the last delta. A
reader that left (``put`` raises ``Abandoned``) drops what waits; the link
tells the model actor (its ``Cancel``). An end that cannot wait for the reader
(``cut``: the process gives up the cluster, and a local queue is about to
take the task over) drops what waits and tells how many deltas went in: the
task's end says exactly what its reader gets.

What must hold: deltas reach the channel in the order heard, each once; at most
``limit`` deltas and one batch wait here; ``then`` runs once, after the last
delta went in (or the reader left, or at once for a ``cut``). Everything but
``__init__`` runs on the I/O loop.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence

from callboard.messages import DeltaSink, StreamDelta
from callboard.runtime.stream import LIMIT as CHANNEL_LIMIT
from callboard.runtime.stream import Abandoned

__all__ = ["StreamFeed"]

LIMIT = CHANNEL_LIMIT
"""Deltas waiting here at most before the model actor is asked to pause the call: what
the reader's channel itself holds."""


class StreamFeed:
    """One streamed task's deltas on their way into its channel (module docstring)."""

    __slots__ = (
        "_asks",
        "_cut",
        "_drain",
        "_pause",
        "_paused",
        "_pending",
        "_sink",
        "_then",
        "limit",
        "put",
    )

    def __init__(
        self, sink: DeltaSink, pause: Callable[[bool, int], object], limit: int = LIMIT
    ) -> None:
        self._sink = sink
        self._pause = pause
        """Ask the model actor to pause the call (True) or go on (False); the second
        argument numbers the asks (the latest holds)."""
        self.limit = limit
        self._pending: collections.deque[StreamDelta] = collections.deque()
        self._drain: asyncio.Task[None] | None = None
        self._paused = False
        self._asks = 0
        self._then: Callable[[], object] | None = None
        self.put = 0
        """Deltas that went into the channel."""
        self._cut = False

    def push(self, deltas: Sequence[StreamDelta]) -> None:
        """A batch heard from the call: into the channel, in order."""
        if self._sink.abandoned or self._cut:
            return
        self._pending.extend(deltas)
        if not self._paused and len(self._pending) >= self.limit:
            self._paused = True
            self._ask(True)
        self._feed()

    def end(self, then: Callable[[], object]) -> None:
        """The task's end: ``then`` (its delivery) once every delta is in the channel."""
        if self._cut:
            return  # the cut was the end
        self._then = then
        self._feed()

    def cut(self, then: Callable[[int], object]) -> None:
        """End now, not waiting for the reader: what waits here is dropped and
        ``then(deltas that went into the channel)`` runs at once; nothing more goes in."""
        self._cut = True
        self._pending.clear()
        self._then = None
        drain, self._drain = self._drain, None
        if drain is not None:
            drain.cancel()  # it waits for room in the channel: nothing of it went in
        then(self.put)

    def _ask(self, paused: bool) -> None:
        """Pause the call or let it go on: each ask numbered, as Ray runs an async
        actor's calls in no set order (a go-on that overtook its pause left the call
        paused for good, and the stream hung)."""
        self._asks += 1
        self._pause(paused, self._asks)

    def _feed(self) -> None:
        if self._drain is not None:
            return  # the running drain takes it
        if self._pending:
            loop = asyncio.get_running_loop()
            self._drain = loop.create_task(self._run())
        else:
            self._finish()

    async def _run(self) -> None:
        pending, sink = self._pending, self._sink
        try:
            while pending:
                await sink.put(pending.popleft())
                self.put += 1
                if self._paused and not pending:
                    self._paused = False
                    self._ask(False)
        except Abandoned:  # the reader left: the link cancels the call (its Cancel)
            pending.clear()
        finally:
            self._drain = None
        self._finish()

    def _finish(self) -> None:
        then, self._then = self._then, None
        if then is not None:
            then()
