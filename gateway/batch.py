"""Requests handed to callboard together: the ones the gateway's handlers submit during
one turn of the server's event loop go in one ``submit_many`` (one ``Submit``
message, one ledger announcement, one wake-up of the ingest actor), but the first.

Why: under load the gateway's loop reads many requests per turn (the answers that
woke it let their clients send the next ones at once). One ``submit`` each is one
message through ingest, router and queue each, and one ledger announcement; a
batch is one of each for all of them, as the library's own bulk submit is.

A handler builds its ``Request`` first (an invalid one is refused at once, to its own
client), then awaits ``submit``. The first request of a turn goes at once, alone
(``submit`` returns without suspending the handler: a lone request never waits for
anything, which matters at low load, where each extra turn of the loop may hand the
interpreter lock to callboard's threads); the ones that come during the same turn
wait for its end (``call_soon``) and go together: a turn costs two submissions
however many requests it read. A batch that callboard refuses as a whole (one
request a policy refuses; the system stopping) is submitted again one request at a
time, so each gets its own answer. A handler cancelled before its batch went is
left out of it: nothing was sent.

Not for requests with an ``Idempotency-Key`` (the gateway records the first
request's answer the moment it is submitted, so a retry finds it) nor for streams:
they are submitted on their own.

What must hold: every request handed to ``submit`` is submitted exactly once, or
refused with its own exception, or left out because its handler was cancelled
first; requests go to callboard in the order of their ``submit`` calls.
Runs on the server's loop only (no lock).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from callboard.messages import Request, Result

from callboard import System

__all__ = ["Batch"]


class Batch:
    """The requests of one turn of the loop, submitted together to ``system``."""

    def __init__(self, system: System) -> None:
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
            loop.call_soon(self._flush)  # the turn's end: what joined it goes then
            return self._system.submit(request)  # returns without suspending the handler
        sent: asyncio.Future[Future[Result]] = loop.create_future()
        self._waiting.append((request, sent))
        return await sent

    def _flush(self) -> None:
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
            sent.set_result(future)

    def _one(self, request: Request, sent: asyncio.Future[Future[Result]]) -> None:
        try:
            sent.set_result(self._system.submit(request))
        except Exception as exc:  # noqa: BLE001 - the handler raises it, as submit would
            sent.set_exception(exc)
