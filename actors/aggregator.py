"""Aggregator: accounts every result and answers stats.

Results reach callers without passing through here (the ledger's ``finish_all``
resolves each caller's future where the task ends); the aggregator gets them
afterwards in batches (``Finished``) and keeps the statistics, and the latest
``Health`` of each model, in the runtime's ``StatsBook`` (``Runtime.stats``),
which every incarnation takes over: a restart loses no count and no result.
It answers ``GetStats`` with a frozen ``Stats`` record; ``snapshot`` builds
the same record from the runtime alone, for a system whose aggregator is gone.

What must hold: stats read after a result count it. A result reaches its
caller before its ``Finished`` reaches the aggregator, so ``System.stats``
passes the ledger's count of ended tasks and the aggregator holds its answer
until it has accounted that many (``Finished`` goes through the address book,
so it arrives, to this incarnation or the next); a count never reached (a
``Finished`` lost with a crashed sender) holds it ``STATS_GRACE_S`` at most.
The first incarnation starts the count at the ledger's (a durable ledger may
hold results of an earlier process).
"""

from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import Future, InvalidStateError
from typing import Any

from callboard.actors.base import Actor, Runtime, account, note_health
from callboard.messages import Finished, GetStats, Health, Stats, StatsOverdue
from callboard.runtime.guarded_log import guarded_logger

log = guarded_logger(__name__)


STATS_GRACE_S = 1.0
"""The longest a told ``GetStats`` waits for the results it expects."""


class AggregatorActor(Actor):
    def __init__(self, rt: Runtime, name: str, incarnation: int) -> None:
        super().__init__(rt, name, incarnation)
        self.book = rt.stats
        self._waiting: list[tuple[int, Future[Stats]]] = []
        """Told ``GetStats`` held until the book has accounted their count."""

    def setup(self) -> None:
        if self.incarnation == 1:
            c = self.rt.ledger.counts()
            self.book.accounted = c.finished + c.rejected  # ended before this system began

    def handle(self, message: Any) -> Stats | None:
        kind = type(message)
        if kind is Finished:
            account(self.rt, message.results)
            if self._waiting:
                self._answer_due()
        elif kind is Health:
            note_health(self.rt, message)
        elif kind is GetStats:
            if message.reply is None:
                return snapshot(self.rt)
            self._get_stats(message.finished, message.reply)
        elif kind is StatsOverdue:
            self._overdue(message.finished, message.reply)
        return None

    def _get_stats(self, finished: int, reply: Future[Stats]) -> None:
        if reply.done():  # answered already (a question asked again)
            return
        if finished <= self.book.accounted:
            _answer(reply, snapshot(self.rt))
            return
        self._waiting.append((finished, reply))
        self.rt.after(STATS_GRACE_S, self.name, StatsOverdue(finished=finished, reply=reply))

    def _overdue(self, finished: int, reply: Future[Stats]) -> None:
        """Results that should have come by now were lost (their sender crashed between
        ending them and telling us): count them, or every later question would wait."""
        if reply.done() or finished <= self.book.accounted:
            return
        log.warning(
            "stats: %d results ended but were never accounted", finished - self.book.accounted
        )
        self.book.accounted = finished
        self._answer_due()

    def _answer_due(self) -> None:
        due = [reply for finished, reply in self._waiting if finished <= self.book.accounted]
        if not due:
            return
        self._waiting = [(f, r) for f, r in self._waiting if f > self.book.accounted]
        stats = snapshot(self.rt)
        for reply in due:
            _answer(reply, stats)


def snapshot(rt: Runtime) -> Stats:
    """The stats of ``rt``'s system: its book, and the ledger's counts and the queue's
    depth now (both kept by the ledger as tasks move: O(tenants), not O(queued))."""
    ledger = rt.ledger
    counts = dataclasses.asdict(ledger.counts())
    return rt.stats.snapshot(counts, now=rt.clock(), waiting=ledger.depth())


def _answer(reply: Future[Stats], stats: Stats) -> None:
    with contextlib.suppress(InvalidStateError):  # answered meanwhile (asked twice)
        reply.set_result(stats)
