"""Statistics (pure): counts, bounded latency samples, tokens and cost.

A ``StatsBook`` outlives the aggregator incarnation that writes it: the
runtime holds one per system (``Runtime.stats``) and each incarnation takes
it over, so a restart loses no count. A batch its predecessor crashed while
handling is handed to the successor again (``Redelivered``): ``add`` knows
the very batch it counted last, and does not count it twice.

The queue's depth by priority and by tenant is not counted here: ``queue_depth``
reads it from the ledger's own count of the jobs waiting (its ``depth()``), kept
where they come and go, so it never drifts from the ledger's ``queued``.

What must hold: memory is bounded (a fixed window of samples per series,
whatever the number of results; at most ``TENANTS_SHOWN`` tenants named in a
snapshot); every result is counted exactly once in ``total``, once under its
model (if any) and once under its priority.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from callboard.messages import (
    Billed,
    Cancelled,
    Completed,
    Failed,
    GroupStats,
    Health,
    Percentiles,
    Priority,
    Result,
    Stats,
)

WINDOW = 10_000
TENANTS_SHOWN = 20
"""The most tenants a snapshot names in ``queued_by_tenant``; the rest are summed."""
OTHER_TENANTS = "*"
"""``queued_by_tenant``'s key for the tenants beyond ``TENANTS_SHOWN``."""


class Reservoir:
    """A uniform sample of at most ``size`` of the values added (Vitter's algorithm R):
    each value added is in it with the same chance, so its percentiles estimate the
    whole stream's in bounded memory; exact while no more than ``size`` were added."""

    __slots__ = ("_random", "added", "size", "values")

    def __init__(self, size: int = WINDOW, seed: int = 0) -> None:
        if size < 1:
            raise ValueError(f"a reservoir holds at least one value, not {size}")
        self.size = size
        self.values: list[float] = []
        self.added = 0
        self._random = random.Random(seed)

    def add(self, value: float) -> None:
        self.added += 1
        if len(self.values) < self.size:
            self.values.append(value)
            return
        slot = self._random.randrange(self.added)
        if slot < self.size:
            self.values[slot] = value


def percentiles(samples: Iterable[float]) -> Percentiles:
    ordered = sorted(samples)
    n = len(ordered)
    if not n:
        return Percentiles()

    def at(q: float) -> float:  # nearest rank: the smallest sample with q of them at or below
        return ordered[max(0, math.ceil(q * n - 1e-9) - 1)]

    return Percentiles(count=n, p50=at(0.50), p95=at(0.95), p99=at(0.99), max=ordered[-1])


@dataclass(slots=True)
class _Group:
    finished: int = 0
    ok: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_nusd: int = 0
    attempts: int = 0
    estimated: int = 0
    estimated_cost_nusd: int = 0
    latency: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    queue_wait: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    ttft: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, r: Result, *, own_share: bool = False) -> None:
        """Count ``r``; ``own_share``: less its calls ``billed_before`` (counted on the
        models that billed them, with ``charge``)."""
        self.finished += 1
        self.ok += r.ok
        self.cancelled += type(r) is Cancelled
        if own_share:
            prompt, completion, cost = r.own_share()
        else:
            prompt, completion = r.usage.prompt_tokens, r.usage.completion_tokens
            cost = r.cost_nusd
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.cost_nusd += cost
        self.attempts += r.attempts
        last_estimated = _last_call_estimated(r)
        if last_estimated:
            self.estimated += 1
        billed = r.billed_before
        own_cost = r.own_share()[2] if billed and not own_share else cost
        self.estimated_cost_nusd += own_cost if last_estimated else 0
        if not own_share:  # the calls billed before, here too (by model: ``charge``)
            self.estimated_cost_nusd += sum(b.cost_nusd for b in billed if b.usage.estimated)
        if r.attempts:  # refusals and unsent ends would drag the percentiles toward 0
            self.latency.append(r.latency_s)
            self.queue_wait.append(r.queue_wait_s)
            ttft = getattr(r, "ttft_s", None)  # a streamed answer's
            if ttft is not None:
                self.ttft.append(ttft)

    def charge(self, billed: Billed) -> None:
        """Count a call another model's result holds (``Result.billed_before``)."""
        self.prompt_tokens += billed.usage.prompt_tokens
        self.completion_tokens += billed.usage.completion_tokens
        self.cost_nusd += billed.cost_nusd
        if billed.usage.estimated:
            self.estimated_cost_nusd += billed.cost_nusd

    def freeze(self) -> GroupStats:
        return GroupStats(
            finished=self.finished,
            ok=self.ok,
            failed=self.finished - self.ok - self.cancelled,
            cancelled=self.cancelled,
            latency=percentiles(self.latency),
            queue_wait=percentiles(self.queue_wait),
            ttft=percentiles(self.ttft),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cost_nusd=self.cost_nusd,
            attempts=self.attempts,
            estimated=self.estimated,
            estimated_cost_nusd=self.estimated_cost_nusd,
        )


def _last_call_estimated(r: Result) -> bool:
    """Whether the call that ended ``r`` was charged an estimate. Its usage says so for
    any of its calls (``Usage.plus``): an unreadable first answer made a fallback's real
    one count whole as estimated (41.7 of 0.8 m nUSD; found by a hunt). Taken as its own
    when no call billed before was an estimate; when one was, as not (two unreadable
    answers in a row, the rarer case, count the last one short)."""
    return r.usage.estimated and not any(b.usage.estimated for b in r.billed_before)


def _group(groups: dict[str, _Group], name: str) -> _Group:
    """``groups[name]``, made the first time (``setdefault`` built a group, three deques
    of ``WINDOW``, for every result and threw it away: a third of the aggregator's time)."""
    group = groups.get(name)
    if group is None:
        group = groups[name] = _Group()
    return group


class StatsBook:
    """Counts results and keeps each model's latest health; ``snapshot`` freezes both."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.total = _Group()
        self.by_model: dict[str, _Group] = {}
        self.by_priority: dict[str, _Group] = {}
        self.health: dict[str, Health] = {}
        self.accounted = 0
        """Results counted, as the ledger counts them (finished + rejected); the
        aggregator also counts here the results it learns were lost on the way."""
        self._last: Iterable[Result] | None = None

    def add(self, results: Iterable[Result]) -> bool:
        """Count ``results``; False, counting nothing, if this very batch was the last counted."""
        if not self.begin(results):
            return False
        for r in results:
            self.count(r)
        return True

    def begin(self, results: Iterable[Result]) -> bool:
        """Start counting the batch ``results`` (each with ``count``); False if this very
        batch was the last begun (redelivered after a handler crashed past it)."""
        if results is self._last:
            return False
        self._last = results
        return True

    def count(self, r: Result) -> None:
        """Count one result (of the batch begun)."""
        self.total.add(r)
        if r.billed_before:  # each billed call on the model that billed it (a hunt
            for billed in r.billed_before:  # found them all on the model that ended it)
                _group(self.by_model, billed.model).charge(billed)
            if r.model is not None:
                _group(self.by_model, r.model).add(r, own_share=True)
        elif r.model is not None:
            _group(self.by_model, r.model).add(r)
        _group(self.by_priority, r.priority.name).add(r)
        self.accounted += 1  # last: a result that raised on the way is not one here
        self.outcomes[_outcome(r)] += 1
        if isinstance(r, Failed):
            self.failures[r.reason.value] += 1

    def snapshot(
        self,
        ledger: Mapping[str, int],
        *,
        now: float = 0.0,
        waiting: Mapping[tuple[Priority, str | None], int] | None = None,
    ) -> Stats:
        """The frozen record of what is counted, with the ledger's own counts beside it,
        the depth of the queue from the jobs ``waiting`` in it (by priority and budget
        tag), and the models' health as it stands at clock time ``now``."""
        queued, by_tenant = queue_depth(waiting or {})
        return Stats(
            outcomes=dict(self.outcomes),
            failures=dict(self.failures),
            total=self.total.freeze(),
            by_model={m: g.freeze() for m, g in sorted(self.by_model.items())},
            by_priority={p: g.freeze() for p, g in self.by_priority.items()},
            ledger=ledger,
            models={m: _health_view(h, now) for m, h in sorted(self.health.items())},
            queued=queued,
            queued_by_tenant=by_tenant,
        )


def queue_depth(
    pairs: Mapping[tuple[Priority, str | None], int],
) -> tuple[dict[str, int], dict[str, int]]:
    """Jobs waiting (counted by priority and budget tag) by priority name (every level,
    highest first) and by tenant (the ``TENANTS_SHOWN`` deepest, ties by name; the rest
    summed under ``OTHER_TENANTS``)."""
    by_priority: Counter[Priority] = Counter()
    by_tenant: Counter[str] = Counter()
    for (priority, tag), n in pairs.items():
        by_priority[priority] += n
        by_tenant[tag or ""] += n
    levels = {p.name: by_priority[p] for p in sorted(Priority)}  # 0 (critical) first
    ranked = sorted(by_tenant.items(), key=lambda item: (-item[1], item[0]))
    tenants = dict(ranked[:TENANTS_SHOWN])
    rest = sum(n for _, n in ranked[TENANTS_SHOWN:])
    if rest:
        tenants[OTHER_TENANTS] = tenants.get(OTHER_TENANTS, 0) + rest
    return levels, tenants


def _outcome(r: Result) -> str:
    return "completed" if isinstance(r, Completed) else type(r).__name__.lower()


def _health_view(h: Health, now: float) -> dict[str, Any]:
    return {
        "breaker": h.breaker.value,
        "reopen_at": h.reopen_at,
        "reopens_in_s": _seconds_until(h.reopen_at, now),
        "paused_for_s": _seconds_until(h.paused_until, now),
        "latency_ewma_s": h.latency_ewma_s,
        "error_rate": h.error_rate,
        "in_flight": h.in_flight,
        "max_concurrency": h.max_concurrency,
        "requests_headroom": h.requests_headroom,
        "tokens_headroom": h.tokens_headroom,
        "paused_until": h.paused_until,
        "given_up": None if h.given_up is None else h.given_up.value,
        "last_error": h.last_error,
    }


def _seconds_until(at: float | None, now: float) -> float | None:
    return None if at is None else max(0.0, at - now)
