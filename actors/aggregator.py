"""Aggregator: accounts every result and answers stats.

Results reach callers without passing through here (the ledger's ``finish_all``
resolves each caller's future where the task ends); the aggregator gets them
afterwards in batches (``Finished``) and keeps the statistics, and the latest
``Health`` of each model. It answers ``GetStats`` with a frozen ``Stats``
record. A restarted aggregator loses only its statistics window, never a
result.

What must hold: stats read after a result count it. A result reaches its
caller before its ``Finished`` reaches the aggregator, so ``System.stats``
passes the ledger's count of ended tasks and the aggregator holds its answer
until it has accounted that many (each ``Finished`` is told through the
address book, so it arrives, to this incarnation or the next). A count that
is never reached (a ``Finished`` lost with a crashed sender) holds the
answer for ``STATS_GRACE_S`` at most. A new incarnation starts its count at
the ledger's, having lost its window anyway: it may answer early, never late.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future, InvalidStateError
from typing import Any

from callboard.actors.base import Actor, Runtime
from callboard.core.stats import StatsBook
from callboard.messages import Finished, GetStats, Health, Stats, StatsOverdue

log = logging.getLogger(__name__)


STATS_GRACE_S = 1.0
"""The longest a told ``GetStats`` waits for the results it expects."""


class AggregatorActor(Actor):
    def __init__(self, rt: Runtime, name: str, incarnation: int) -> None:
        super().__init__(rt, name, incarnation)
        self.book = StatsBook()
        self.health: dict[str, Health] = {}
        self.accounted = 0
        """Results accounted, counted as the ledger counts them (finished + rejected)."""
        self._waiting: list[tuple[int, Future[Stats]]] = []
        """Told ``GetStats`` held until ``accounted`` reaches their count."""

    def setup(self) -> None:
        c = self.rt.ledger.counts()
        self.accounted = c.finished + c.rejected  # what ended before this incarnation

    def handle(self, message: Any) -> Stats | None:
        kind = type(message)
        if kind is Finished:
            self.book.add(message.results)
            self.accounted += len(message.results)
            for observer in self.rt.observers:
                observer.observe_results(message.results)
            if self._waiting:
                self._answer_due()
        elif kind is Health:
            self.health[message.model] = message
            for observer in self.rt.observers:
                observer.observe_health(message)
        elif kind is GetStats:
            if message.reply is None:
                return self.snapshot()
            self._get_stats(message.finished, message.reply)
        elif kind is StatsOverdue:
            self._overdue(message.finished, message.reply)
        return None

    def _get_stats(self, finished: int, reply: Future[Stats]) -> None:
        if reply.done():  # answered already (a question asked again)
            return
        if finished <= self.accounted:
            _answer(reply, self.snapshot())
            return
        self._waiting.append((finished, reply))
        self.rt.after(STATS_GRACE_S, self.name, StatsOverdue(finished=finished, reply=reply))

    def _overdue(self, finished: int, reply: Future[Stats]) -> None:
        """Results that should have come by now were lost (their sender crashed between
        ending them and telling us): count them, or every later question would wait."""
        if reply.done() or finished <= self.accounted:
            return
        log.warning("stats: %d results ended but were never accounted", finished - self.accounted)
        self.accounted = finished
        self._answer_due()

    def _answer_due(self) -> None:
        due = [reply for finished, reply in self._waiting if finished <= self.accounted]
        if not due:
            return
        self._waiting = [(f, r) for f, r in self._waiting if f > self.accounted]
        stats = self.snapshot()
        for reply in due:
            _answer(reply, stats)

    def snapshot(self) -> Stats:
        b = self.book
        c = self.rt.ledger.counts()
        return Stats(
            outcomes=dict(b.outcomes),
            failures=dict(b.failures),
            total=b.total.freeze(),
            by_model={m: g.freeze() for m, g in sorted(b.by_model.items())},
            by_priority={p: g.freeze() for p, g in b.by_priority.items()},
            ledger={
                "accepted": c.accepted,
                "rejected": c.rejected,
                "routing": c.routing,
                "queued": c.queued,
                "in_flight": c.in_flight,
                "finished": c.finished,
            },
            models={m: _health_view(h) for m, h in sorted(self.health.items())},
        )


def _answer(reply: Future[Stats], stats: Stats) -> None:
    with contextlib.suppress(InvalidStateError):  # answered meanwhile (asked twice)
        reply.set_result(stats)


def _health_view(h: Health) -> dict[str, Any]:
    return {
        "breaker": h.breaker.value,
        "reopen_at": h.reopen_at,
        "latency_ewma_s": h.latency_ewma_s,
        "error_rate": h.error_rate,
        "in_flight": h.in_flight,
        "max_concurrency": h.max_concurrency,
        "requests_headroom": h.requests_headroom,
        "tokens_headroom": h.tokens_headroom,
        "paused_until": h.paused_until,
    }
