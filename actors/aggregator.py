"""Aggregator: accounts every result and answers stats.

Results reach callers without passing through here (the ledger's ``finish``
resolves each caller's future where the task ends); the aggregator gets them
afterwards in batches (``Finished``) and keeps the statistics, and the latest
``Health`` of each model. It answers ``GetStats`` asks with a frozen
``Stats`` record. A restarted aggregator loses only its statistics window,
never a result.
"""

from __future__ import annotations

from typing import Any

from callboard.messages import Finished, Health
from callboard.messages._stats import GetStats, Stats

from ._base import Actor, Runtime
from .stats import StatsBook


class AggregatorActor(Actor):
    def __init__(self, rt: Runtime, name: str, incarnation: int) -> None:
        super().__init__(rt, name, incarnation)
        self.book = StatsBook()
        self.health: dict[str, Health] = {}

    def handle(self, message: Any) -> Stats | None:
        kind = type(message)
        if kind is Finished:
            self.book.add(message.results)
            for observer in self.rt.extras.get("observers", ()):
                observer.observe_results(message.results)
        elif kind is Health:
            self.health[message.model] = message
            for observer in self.rt.extras.get("observers", ()):
                observer.observe_health(message)
        elif kind is GetStats:
            return self.snapshot()
        return None

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
