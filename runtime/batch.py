"""Requests handed to callboard together: the ones submitted from one event loop during
one turn of it go in one ``submit_many`` (one admission under one hold of the ledger,
one ``Enqueue`` message, one wake-up of the queue), but the first.

Why: a loop that serves many callers (the gateway's server, a web app awaiting
``AsyncSystem.submit`` in each handler) runs many of them per turn under load: the
answers that woke it let their clients send the next requests at once. One ``submit``
each is one admission and one message to the queue each; a batch is one of each
for all of them, as the library's own bulk submit is.

A caller builds its ``Request`` first (an invalid one is refused at once, to that
caller), then awaits ``submit``. The first request of a turn goes at once, alone
(``submit`` returns without suspending the caller: a lone request never waits for
anything, which matters at low load, where each extra turn of the loop may hand the
interpreter lock to callboard's threads); the ones that come during the same turn
wait for its end (``call_soon``) and go together: a turn costs two submissions
however many requests it read. Whoever is about to wake many callers at once (the
results a ``Handoff`` delivers) may ``open_turn`` first: the callers' submits, made
in the loop's next iteration, then all go at its end, with no iteration of the loop
just for the batch. A batch that callboard refuses as a whole (one
request a policy refuses; the system stopping) is submitted again one request at a
time, so each gets its own answer. A caller cancelled before its batch went is
left out of it: nothing was sent; one cancelled after its batch went, before it
resumed with its task's future, cancels that task (it goes unsent if it still
can), for nobody else holds its future.

Only for requests that may share a ``submit_many``: one whose submit takes more
than its ``Request`` (a ``trace_id`` of its own, a ``wait_s``) or whose caller must
know it was submitted before its turn ends (the gateway records an
``Idempotency-Key``'s first answer at once) is submitted on its own, after
``flush`` hands over what waits, so it does not overtake requests made before it.

What must hold: every request handed to ``submit`` is submitted exactly once, or
refused with its own exception, or left out because its caller was cancelled
first; requests go to callboard in the order of their ``submit`` calls (and of
``flush``: requests wait only while the turn is open, and a flush closes it).
A ``Batch`` serves one loop and runs on it only (no lock).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

from callboard.messages import Request, Result

__all__ = ["Batch", "Submits"]


class Submits(Protocol):
    """What a batch submits to (a ``System``): one request, or several in one burst."""

    def submit(self, request: Request, /) -> Future[Result]: ...

    def submit_many(self, requests: list[Request], /) -> Sequence[Future[Result]]: ...


class Batch:
    """The requests of one turn of the loop, submitted together to ``system``."""

    def __init__(self, system: Submits) -> None:
        self._system = system
        self._turn_open = False
        """A request went during this turn of the loop: the next ones join the batch."""
        self._waiting: list[tuple[Request, asyncio.Future[Future[Result]]]] = []

    async def submit(self, request: Request) -> Future[Result]:
        """Submit ``request``: at once if it is the turn's first, else with the others
        of this turn; its task's future (or the exception that refused it, as
        ``System.submit`` raises it)."""
        loop = asyncio.get_running_loop()
        if not self._turn_open:
            self._turn_open = True
            loop.call_soon(self.flush)  # the turn's end: what joined it goes then
            return self._system.submit(request)  # returns without suspending the caller
        sent: asyncio.Future[Future[Result]] = loop.create_future()
        self._waiting.append((request, sent))
        try:
            return await sent
        except asyncio.CancelledError:  # its batch may have gone in the same turn
            if sent.done() and not sent.cancelled() and sent.exception() is None:
                sent.result().cancel()  # nobody holds its future: its caller gave up
            raise

    def open_turn(self) -> None:
        """On the loop: open a turn that ends after the callbacks the loop holds now;
        what is submitted until then goes in one batch, its first request too."""
        if not self._turn_open:
            self._turn_open = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Submit the requests waiting for the turn's end now (on the loop). The turn's
        end does it; a request submitted on its own calls it first, so that requests
        from this loop reach callboard in the order they were submitted."""
        self._turn_open = False
        waiting = [(r, s) for r, s in self._waiting if not s.cancelled()]
        self._waiting = []
        if not waiting:
            return
        try:
            futures = self._system.submit_many([r for r, _ in waiting])
        except Exception:  # noqa: BLE001 - refused as a whole: each gets its own answer
            for request, sent in waiting:
                self._one(request, sent)
            return
        for (_, sent), future in zip(waiting, futures, strict=True):
            _hand(sent, future)

    def _one(self, request: Request, sent: asyncio.Future[Future[Result]]) -> None:
        if sent.done():  # its caller was cancelled meanwhile: nothing is sent for it
            return
        try:
            future = self._system.submit(request)
        except Exception as exc:  # noqa: BLE001 - the caller raises it, as submit would
            if not sent.done():
                sent.set_exception(exc)
            return
        _hand(sent, future)


def _hand(sent: asyncio.Future[Future[Result]], future: Future[Result]) -> None:
    """Give a caller its task's future; one cancelled while its batch went (Ctrl-C under
    ``asyncio.run`` cancels the main task in the signal's handler, which runs inside
    ``submit_many``) holds none: its task is cancelled (unsent, it is never sent). Set
    regardless, it raised ``InvalidStateError`` and the rest of the batch got no future,
    their callers waiting for ever (found by a hunt)."""
    try:
        sent.set_result(future)
    except asyncio.InvalidStateError:  # its caller is gone: nobody holds the future
        future.cancel()
