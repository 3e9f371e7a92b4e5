"""Statistics (pure): counts, bounded latency samples, tokens and cost.

What must hold: memory is bounded (a fixed window of samples per series,
whatever the number of results); every result is counted exactly once in
``total``, once under its model (if any) and once under its priority.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from callboard.messages import Completed, Failed, GroupStats, Percentiles, Result

WINDOW = 10_000


def percentiles(samples: Iterable[float]) -> Percentiles:
    ordered = sorted(samples)
    n = len(ordered)
    if not n:
        return Percentiles()

    def at(q: float) -> float:
        return ordered[min(n - 1, int(q * n))]

    return Percentiles(count=n, p50=at(0.50), p95=at(0.95), p99=at(0.99), max=ordered[-1])


@dataclass(slots=True)
class _Group:
    finished: int = 0
    ok: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_nusd: int = 0
    attempts: int = 0
    latency: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    queue_wait: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, r: Result) -> None:
        self.finished += 1
        self.ok += r.ok
        self.prompt_tokens += r.usage.prompt_tokens
        self.completion_tokens += r.usage.completion_tokens
        self.cost_nusd += r.cost_nusd
        self.attempts += r.attempts
        if r.attempts:  # refusals and unsent ends would drag the percentiles toward 0
            self.latency.append(r.latency_s)
            self.queue_wait.append(r.queue_wait_s)

    def freeze(self) -> GroupStats:
        return GroupStats(
            finished=self.finished,
            ok=self.ok,
            failed=self.finished - self.ok,
            latency=percentiles(self.latency),
            queue_wait=percentiles(self.queue_wait),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cost_nusd=self.cost_nusd,
            attempts=self.attempts,
        )


class StatsBook:
    """Accumulates results; ``snapshot`` parts are frozen records."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.total = _Group()
        self.by_model: dict[str, _Group] = {}
        self.by_priority: dict[str, _Group] = {}

    def add(self, results: Iterable[Result]) -> None:
        for r in results:
            self.outcomes[_outcome(r)] += 1
            if isinstance(r, Failed):
                self.failures[r.reason.value] += 1
            self.total.add(r)
            if r.model is not None:
                self.by_model.setdefault(r.model, _Group()).add(r)
            self.by_priority.setdefault(r.priority.name, _Group()).add(r)


def _outcome(r: Result) -> str:
    return "completed" if isinstance(r, Completed) else type(r).__name__.lower()
