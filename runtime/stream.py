"""The channel between a stream's call on the I/O loop and its reader on any thread.

Theory of operation
-------------------
A streamed call's deltas are produced on the I/O loop (``runtime.http``) and read
by the caller: by a thread iterating a ``ChatStream``, or by a task of the
caller's own asyncio loop. ``StreamChannel`` carries them across, bounded:

* ``offer`` (on the I/O loop) appends a delta unless ``limit`` deltas wait unread;
  ``put`` (a coroutine) offers, and while they do, waits for the reader to take
  some. A call offers first and awaits ``put`` only when the channel is full, so
  a delta costs no coroutine of its own. A full channel's ``put`` is woken once
  the reader has taken it down to ``limit // 4`` (``low_water``), as asyncio's
  transports resume writing at a quarter of their high-water mark, so a reader
  slower than its provider costs a wake-up per ``3/4 limit`` deltas rather than
  per delta (a thread hand-off each: under a loaded test run, a reader of 3,000
  deltas from a full channel took 54 s). Waiting there, the call
  stops reading its socket, so the provider's bytes wait in the kernel's
  buffers and TCP's window, not in ours: a slow reader costs memory bounded by
  ``limit`` deltas.
* A reader waiting on its own loop is woken by one wake-up for every delta put
  for that loop's readers until it has run: while one is on its way
  (``call_soon_threadsafe`` sent, not yet run), a put to another of its streams
  only adds that stream's waiter to it. A stream's first delta (its time to
  first token) and its end send a wake-up at once if none is on its way; a
  later delta with none on its way waits for the I/O loop's next turn (one
  ``call_soon`` there sends a single wake-up for every reader of that loop
  woken meanwhile). Each wake-up costs the reader's thread the GIL and the I/O
  loop a wait to get it back: at 200 streams a wake per delta made the reader's
  thread take the GIL from the I/O loop about 2,000 times a second, and every
  stream's start waited behind those hand-offs; holding every wake-up to the
  loop's next turn, first deltas too, made a first token wait behind a whole
  iteration of the loop (docs/bench.md).
* ``get`` (blocking, any thread) and ``aget`` (a coroutine, on the reader's
  loop) take the next delta, or ``END`` once the channel is closed and drained;
  ``next_or_waiter`` is ``aget`` without the coroutine (a delta, ``END``, or a
  future to await before asking again), for a reader with a coroutine of its own.
* ``close`` (whoever ends the task) lets the reader finish; ``abandon`` (the
  reader) says nobody will read: ``offer`` and ``put`` then raise ``Abandoned``, and the
  call's task, if the call gave it (``attach``), is cancelled wherever it waits
  (on its socket, through a provider's pings or a long think, where no
  ``put`` would come to notice), so the call ends there instead of reading a
  stream into the void.

What must hold: never more than ``limit`` deltas held; a waiting ``put`` or
reader is woken by every change that concerns it (a take that leaves at most
``low_water`` deltas, a put, close, abandon), a stream's first delta and its
end at once, a later delta by the producer loop's next turn; an attached task
is cancelled once if the reader left, whichever of ``attach`` and ``abandon``
came first; no callback runs under the lock.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Final

from callboard.messages import StreamDelta, UsageError
from callboard.runtime.flag import resolve, soon, wake

__all__ = ["END", "Abandoned", "DeltasDroppedError", "StreamChannel"]


class DeltasDroppedError(UsageError):
    """A reader asked for a delta of a stream whose deltas were dropped: its result was
    asked with nobody reading, so the call ran on to its end without them. Ending the
    iteration instead, as it did, gave a reader an empty stream beside a whole result:
    a silent truncation."""

    def __init__(self) -> None:
        super().__init__(
            "this stream's deltas were dropped: its result was asked (result()) while "
            "nobody read it, so the call went on to its end without them; iterate before "
            "(or beside) asking for the result, or read the result's text"
        )


END: Final = None
"""What ``get``/``aget`` return once the channel is closed and every delta read."""

LIMIT = 256
"""Deltas held for a reader at most, by default (a few KiB of text)."""


def low_water(limit: int) -> int:
    """How few deltas may wait before a producer waiting for room is woken."""
    return limit // 4


class Abandoned(Exception):  # noqa: N818 - a state, not an error of the caller's
    """The reader left: nobody will read what the call would put."""


class StreamChannel:
    """One stream's bounded channel (see the module docstring)."""

    __slots__ = (
        "_abandoned",
        "_blocked",
        "_closed",
        "_cut",
        "_deltas",
        "_lock",
        "_producer",
        "_readable",
        "_reader",
        "_reader_wakes",
        "_room",
        "_said",
        "_unread",
        "_wanted",
        "_with_reader",
        "limit",
        "model",
        "received",
    )

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._deltas: collections.deque[StreamDelta] = collections.deque()
        self._lock = threading.Lock()
        self._readable: threading.Condition | None = None
        """A blocking reader waits on this (made by the first ``get``: an async reader,
        the common one, never needs it)."""
        self._room: asyncio.Future[None] | None = None
        """The producer waits on this for room (on the I/O loop)."""
        self._reader: asyncio.Future[None] | None = None
        """An async reader waits on this for a delta (on its own loop)."""
        self._reader_wakes: _Wakes | None = None
        """The wake-ups of that reader's loop (looked up by the reader, not by ``put``)."""
        self._blocked = 0
        """Readers blocked in ``get`` (``put`` notifies only when there are some)."""
        self._producer: asyncio.Task[Any] | None = None
        """The call's task, cancelled if the reader leaves (on the I/O loop)."""
        self._closed = False
        self._cut = False
        """Its call was cut off it (``cut``): a delta offered now is refused."""
        self._abandoned = False
        self._unread = False
        """Nobody reads the deltas, but the answer is wanted: they are dropped."""
        self._wanted = False
        """The result was asked for (``want_result``)."""
        self._with_reader = False
        """A reader has asked for a delta (``get``, ``next_or_waiter``)."""
        self.received = False
        """A delta has arrived: the stream started (it is no longer retried)."""
        self.model = ""
        """The model whose call feeds it (``DeltaSink.model``): once a delta has arrived,
        the one that said it."""
        self._said: list[str] = []
        """The text of every delta taken: what a stream cut off its call had said (``cut``)."""

    # -- the producer (the I/O loop) ----------------------------------------------------

    def offer(self, delta: StreamDelta) -> bool:
        """Append ``delta`` if fewer than ``limit`` wait unread; False if that many do
        (``put`` waits for room then); ``Abandoned`` if the reader left. On the
        producer's loop: the common case of ``put`` without a coroutine for each delta."""
        with self._lock:
            if self._abandoned or self._cut:
                raise Abandoned
            if self._unread:
                self.received = True
                self._said.append(delta.result_text)
                return True
            deltas = self._deltas
            if len(deltas) >= self.limit:
                if self._with_reader or not self._wanted:
                    return False
                self._drop_unread()  # full, its result asked, and nobody reads
                self.received = True
                self._said.append(delta.result_text)
                return True
            deltas.append(delta)
            self._said.append(delta.result_text)
            first, self.received = not self.received, True
            if self._blocked:
                assert self._readable is not None  # made by the blocked get
                self._readable.notify()
            reader, self._reader = self._reader, None
            wakes = self._reader_wakes
        if reader is not None:
            assert wakes is not None  # set with the reader
            if first:
                wakes.wake(reader)
            else:
                wakes.wake_soon(reader, asyncio.get_running_loop())
        return True

    async def put(self, delta: StreamDelta) -> None:
        """Append ``delta``, waiting while ``limit`` wait unread; ``Abandoned`` if the
        reader left."""
        while not self.offer(delta):
            with self._lock:
                if self._abandoned or len(self._deltas) < self.limit:
                    continue  # changed since the offer: offer again
                room = self._room = asyncio.get_running_loop().create_future()
            await room

    def attach(self, task: asyncio.Task[Any]) -> None:
        """The call's ``task`` (on its loop) is to be cancelled if the reader leaves; at
        once if it has left already."""
        with self._lock:
            self._producer = task
            left = self._abandoned
        if left:
            _cancel(task)

    @property
    def abandoned(self) -> bool:
        """The reader left."""
        return self._abandoned

    def cut(self) -> str:
        """Cut the channel off its call, whose actor died: a delta it offers now is
        refused (``Abandoned``: the call ends), those taken stay for the reader. The
        text of choice 0 in the deltas taken (what ``Result.text`` would have been), all
        the reader will have of it (the successor ends the task with it)."""
        with self._lock:
            self._cut = True
            return "".join(self._said)

    # -- whoever ends the task --------------------------------------------------------

    def close(self) -> None:
        """No more deltas: the reader takes what is left, then ``END``."""
        with self._lock:
            self._closed = True
            self._producer = None  # the task has ended
            if self._readable is not None:
                self._readable.notify_all()
            reader, self._reader = self._reader, None
            wakes = self._reader_wakes
        if reader is not None:
            assert wakes is not None  # set with the reader
            wakes.wake(reader)

    def close_on(self, done: Future[Any]) -> None:
        """``close``, as a done-callback of the task's future; a future cancelled (its
        caller gave it up) abandons the channel first, so the call stops reading."""
        if done.cancelled():
            self.abandon()
        self.close()

    # -- the reader ---------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> StreamDelta | None:
        """The next delta (blocking), ``END`` when closed and drained; ``TimeoutError``
        after ``timeout`` seconds with neither."""
        with self._lock:
            self._with_reader = True
            if self._unread:
                raise DeltasDroppedError
            if self._readable is None:
                self._readable = threading.Condition(self._lock)
            self._blocked += 1
            try:
                arrived = self._readable.wait_for(lambda: self._deltas or self._closed, timeout)
            finally:
                self._blocked -= 1
            if not arrived:
                raise TimeoutError("no delta arrived in time")
            delta = self._deltas.popleft() if self._deltas else END
            room = self._room_if_low()
        wake(room)
        return delta

    async def aget(self) -> StreamDelta | None:
        """The next delta (awaiting it on the reader's loop), ``END`` when closed and
        drained."""
        got = self.next_or_waiter()
        while isinstance(got, asyncio.Future):
            await got
            got = self.next_or_waiter()
        return got

    def next_or_waiter(self) -> StreamDelta | asyncio.Future[None] | None:
        """The next delta, ``END`` when closed and drained, or else a future of the
        reader's running loop that resolves when either may have come (then ask
        again). What ``aget`` awaits, for a reader that takes a delta without a
        coroutine of its own for each (``AsyncChatStream``)."""
        with self._lock:
            self._with_reader = True
            if self._unread:
                raise DeltasDroppedError
            if self._deltas or self._closed:
                delta = self._deltas.popleft() if self._deltas else END
                room = self._room_if_low()
            else:
                loop = asyncio.get_running_loop()
                wakes = self._reader_wakes
                if wakes is None or not wakes.serves(loop):  # the first wait: looked up once
                    wakes = self._reader_wakes = _Wakes.of(loop)
                waiter = self._reader
                if waiter is None or waiter.done() or waiter.get_loop() is not loop:
                    waiter = self._reader = loop.create_future()  # else shared: a second
                return waiter  # reader's own replaced the first's, which then waited for ever
        wake(room)
        return delta

    def want_result(self) -> None:
        """The caller asked for the result: if nobody has asked for a delta by the time
        ``limit`` of them wait (now, or later), nobody will; they are dropped then,
        and every one after, so the call goes on to its whole answer instead of
        waiting for a reader. A reader that starts first (a task started beside the
        wait for the result) reads every delta."""
        with self._lock:
            self._wanted = True
            if self._with_reader or len(self._deltas) < self.limit:
                return
            room = self._drop_unread()
        wake(room)

    def _room_if_low(self) -> asyncio.Future[None] | None:
        """Under the lock: the producer's wait for room, taken to wake, if no more than
        ``low_water`` deltas wait; else None."""
        room = self._room
        if room is None or len(self._deltas) > low_water(self.limit):
            return None
        self._room = None
        return room

    def _drop_unread(self) -> asyncio.Future[None] | None:
        """Under the lock: nobody reads, from now on (``want_result``): what waits is
        dropped, and the producer's wait for room, if any, is given back to wake."""
        self._unread = True
        self._deltas.clear()
        room, self._room = self._room, None
        return room

    def abandon(self) -> None:
        """The reader leaves: what waits is dropped, and the call's next ``put`` raises
        ``Abandoned``."""
        with self._lock:
            self._abandoned = True
            self._deltas.clear()
            room, self._room = self._room, None
            producer, self._producer = self._producer, None
        wake(room)
        if producer is not None:
            _cancel(producer)


class _Wakes:
    """The wake-ups of one reader's loop: at most one on its way at a time, carrying
    every waiter added before it runs (see the module docstring)."""

    __slots__ = ("_context", "_due", "_lock", "_loop", "_sent", "_waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the table's key: not held from its value
        self._context = contextvars.Context()
        """What the wake-ups run in on the reader's loop (only there: a context runs on
        one thread at a time). Without it each would copy the producer's."""
        self._lock = threading.Lock()
        self._waiters: list[asyncio.Future[None]] = []
        self._sent = False
        """A wake-up is on its way (sent, not yet run on the reader's loop)."""
        self._due: asyncio.AbstractEventLoop | None = None
        """The producer's loop that will send one at its next turn (``wake_soon``)."""

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Wakes:
        """``loop``'s (made on first use, from whichever thread)."""
        wakes = _WAKES.get(loop)
        if wakes is None:
            with _WAKES_MADE:
                wakes = _WAKES.setdefault(loop, cls(loop))
        return wakes

    def serves(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether these are ``loop``'s wake-ups."""
        return self._loop() is loop

    def wake(self, waiter: asyncio.Future[None]) -> None:
        """Resolve ``waiter`` on its loop: with the wake-up on its way, or a new one."""
        with self._lock:
            self._waiters.append(waiter)
            if self._sent:
                return
            self._sent = True
        self._send()

    def wake_soon(self, waiter: asyncio.Future[None], producer: asyncio.AbstractEventLoop) -> None:
        """Resolve ``waiter`` on its loop: with the wake-up on its way, or with one sent
        at the ``producer`` loop's next turn (on that loop)."""
        with self._lock:
            self._waiters.append(waiter)
            if self._sent or self._due is producer:
                return
            self._due = producer  # not another's: that loop may be gone before its turn
        producer.call_soon(self._send_due)

    def _send_due(self) -> None:
        """On a producer's loop, a turn after ``wake_soon``: one wake-up for every waiter
        added meanwhile, unless one on its way took them."""
        with self._lock:
            self._due = None
            if self._sent or not self._waiters:
                return
            self._sent = True
        self._send()

    def _send(self) -> None:
        loop = self._loop()
        if loop is not None:
            soon(loop, self._run, context=self._context)

    def _run(self) -> None:
        """On the reader's loop: resolve every waiter added so far."""
        with self._lock:
            waiters, self._waiters = self._waiters, []
            self._sent = False
        _resolve_all(waiters)


_WAKES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Wakes] = weakref.WeakKeyDictionary()
"""Each reader's loop's wake-ups (its entry goes with the loop)."""
_WAKES_MADE = threading.Lock()


def _resolve_all(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        resolve(waiter)


def _cancel(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` on its own loop (from any thread), if the loop still runs."""
    soon(task.get_loop(), task.cancel, "the stream's reader left")
