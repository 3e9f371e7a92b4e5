"""Results settled on callboard's threads, handed to an event loop in batches: one
wake-up of the loop for every run of futures that finish together.

A coroutine waits for its task's ``concurrent.futures.Future``, which a model actor
(or the aggregator) resolves on its own thread. ``asyncio.wrap_future`` or one
``call_soon_threadsafe`` per future wakes the loop once per request: a write to
the loop's wake-up descriptor on the actor's thread and one more turn of the
loop, for every answer. Here the first future of a run schedules the delivery
and the others join it while it has not run; the delivery settles each waiter.
Under load the actors finish calls in batches (the I/O loop hands completions
over once per iteration, and the ledger resolves a batch's futures in one go),
so a batch costs one wake-up, not one per call.

One ``Handoff`` serves one loop: the gateway keeps one for its server's loop,
``AsyncSystem`` one for each loop it is awaited from (with ``after``: its batch
opens a turn there, so the callers a delivery wakes submit together, see
``runtime.batch``). It holds its loop weakly, so
a table of handoffs keyed by loop lets a loop go once nothing waits on it (a
waiter holds its loop, and a watched future holds its waiter, until it settles).

What must hold: every watched future's waiter settles (its result, or cancelled
when the future was), on the loop, exactly once, unless the loop has closed
(then nobody waits); cancelling a waiter leaves its future alone (a caller that
is cancelled must not cancel a task that may have been sent: it decides that
itself, and ``settled`` is for the callers that decide to). The lock guards only
the list of settled futures, a few instructions on either side.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TypeVar

from callboard.messages import on_done

__all__ = ["Handoff"]

T = TypeVar("T")


class Handoff:
    """Waiters on one event loop for futures settled on other threads."""

    def __init__(self, after: Callable[[], object] | None = None) -> None:
        self._after = after
        """Called on the loop after each delivery, once its waiters are settled."""
        self._loop: weakref.ref[asyncio.AbstractEventLoop] | None = None
        self._lock = threading.Lock()
        self._settled: list[tuple[asyncio.Future[object], Future[object]]] = []

    def watch(self, future: Future[T]) -> asyncio.Future[T]:
        """A future on the running loop (the same loop at every call) that follows
        ``future``; cancelling it does not cancel ``future``."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = weakref.ref(loop)
        elif loop is not self._loop():
            raise RuntimeError("a Handoff serves one event loop: it was first used on another")
        waiter: asyncio.Future[T] = loop.create_future()
        on_done(future, partial(self._done, waiter))
        return waiter

    async def settled(self, future: Future[T]) -> T:
        """``future``'s outcome, awaited through ``watch``; a caller cancelled meanwhile
        cancels ``future`` (its task, if not sent yet)."""
        waiter = self.watch(future)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.cancelled():  # the caller's cancel reached the waiter
                future.cancel()
            raise

    def _done(self, waiter: asyncio.Future[T], settled: Future[T]) -> None:
        """On the thread that settled ``settled``: join the pending delivery, or
        schedule one."""
        loop = waiter.get_loop()  # alive (if perhaps closed) while a future is watched
        with self._lock:
            if loop.is_closed():  # nobody waits: nothing is kept for it (a delivery
                self._settled.clear()  # scheduled before it closed never ran, and what
                return  # was added to it held the loop and its results for good)
            self._settled.append((waiter, settled))  # type: ignore[arg-type]
            if len(self._settled) > 1:
                return  # a delivery is scheduled and has not taken the list yet
        try:
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop closed: nobody waits, and nothing is kept for it
            with self._lock:
                self._settled.clear()

    def _deliver(self) -> None:
        """On the loop: settle every waiter whose future finished since the last
        delivery."""
        with self._lock:
            settled, self._settled = self._settled, []
        for waiter, done in settled:
            _settle(waiter, done)
        if self._after is not None:
            self._after()


def wrapped(future: Future[T], *, cancels: bool = True) -> asyncio.Future[T]:
    """``asyncio.wrap_future(future)`` for callboard's own waits on a task's (or a
    pattern's) future: a caller's ``add_done_callback`` runs on the callback thread
    (``messages._callback_thread``), a hop more than the loop needs; this one is
    callboard's own (``on_done``), so the resolving thread wakes the loop itself.
    As ``wrap_future``: cancelling the returned future cancels ``future``, unless not
    ``cancels`` (a wait that others share, as a stream's result: giving up the wait
    is not giving up the stream)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def ended(done: Future[T]) -> None:  # on the thread that settled it
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(_settle, waiter, done)

    def given_up(w: asyncio.Future[T]) -> None:
        if w.cancelled():
            future.cancel()

    if cancels:
        waiter.add_done_callback(given_up)
    on_done(future, ended)
    return waiter


def _settle(waiter: asyncio.Future[T], done: Future[T]) -> None:
    """On the loop: ``waiter`` as ``done`` ended, unless its caller gave it up."""
    if waiter.done():
        return  # its caller was cancelled: nobody waits
    if done.cancelled():
        waiter.cancel()
        return
    exc = done.exception()
    if exc is None:
        waiter.set_result(done.result())
    else:
        waiter.set_exception(exc)
