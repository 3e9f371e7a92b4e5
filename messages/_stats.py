"""The stats snapshot: a frozen record, answered to ``GetStats``."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from callboard.messages._frozen import FrozenMap
from callboard.messages._results import NANO


@dataclass(frozen=True, slots=True, kw_only=True)
class GetStats:
    """Anyone -> Aggregator: a ``Stats`` snapshot. Asked (``ask``) with no ``reply``,
    answered at once; told with a ``reply``, set on that future once ``finished``
    results are accounted (see ``actors.aggregator``)."""

    finished: int = 0
    """Answer once at least this many results (finished and rejected) are accounted."""
    reply: Future[Stats] | None = field(default=None, compare=False, repr=False)
    """Where the snapshot goes (told, not asked); set once, by the aggregator."""

    def __post_init__(self) -> None:
        if self.finished < 0:
            raise ValueError(f"GetStats.finished must be >= 0, got {self.finished}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsOverdue:
    """Aggregator -> itself (via the timer): a held ``GetStats`` has waited its grace."""

    finished: int
    """The count it waited for: the results not heard of by now are taken as lost."""
    reply: Future[Stats] = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Percentiles:
    """Seconds; over the most recent samples (bounded window)."""

    count: int = 0
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupStats:
    """Counts and figures for one model or one priority."""

    finished: int = 0
    ok: int = 0
    failed: int = 0
    """Every result that is neither ``Completed`` nor ``Cancelled``: failed, expired,
    refused."""
    cancelled: int = 0
    """Cancelled by their callers (a gateway client that left, ``stop(cancel=True)``):
    not failures of the service."""
    latency: Percentiles = field(default_factory=Percentiles)
    """Submit to result, over the tasks that made at least one call (a burst of
    queue-full refusals or unsent cancels does not pull it toward 0)."""
    queue_wait: Percentiles = field(default_factory=Percentiles)
    """Submit to dispatch, over the same tasks."""
    ttft: Percentiles = field(default_factory=Percentiles)
    """Time to first token of the streamed answers (``Completed.ttft_s``: the call's
    start to its first delta)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_nusd: int = 0
    attempts: int = 0
    estimated: int = 0
    """Results charged an estimate of their usage (the provider said none: the most the
    call could have used, ``Usage.estimated``); their tokens and cost are in the figures
    above."""
    estimated_cost_nusd: int = 0
    """The part of ``cost_nusd`` that is those estimates."""

    @property
    def cost_usd(self) -> Decimal:
        return Decimal(self.cost_nusd) / NANO


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats:
    """Everything ``System.stats()`` reports, at one instant."""

    outcomes: Mapping[str, int]
    """Results by type: completed, failed, expired, cancelled, rejected."""
    failures: Mapping[str, int]
    """Failed results by reason."""
    total: GroupStats
    by_model: Mapping[str, GroupStats]
    by_priority: Mapping[str, GroupStats]
    ledger: Mapping[str, int]
    """accepted, routing, queued, in_flight, finished (accepted = the other four)."""
    models: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per model, from its latest health report: ``breaker`` (closed, half_open, open),
    ``reopen_at`` and ``reopens_in_s`` (an open breaker's probes: clock time, and seconds
    from this snapshot), ``in_flight`` of ``max_concurrency``, ``requests_headroom`` and
    ``tokens_headroom`` (what the limiter admits now; None: no limit), ``paused_until``
    and ``paused_for_s`` (a 429's Retry-After), ``latency_ewma_s``, ``error_rate``,
    ``given_up`` (the reason its waiting tasks end with while it is given up on, else
    None) and ``last_error`` (its last failed attempt's reason and detail)."""
    restarts: Mapping[str, int] = field(default_factory=dict)
    budget: Mapping[str, int | None] = field(default_factory=dict)
    """spent_nusd, reserved_nusd, remaining_nusd (empty when no budget is set)."""
    queued: Mapping[str, int] = field(default_factory=dict)
    """Tasks waiting in the queue by priority name, every level named (0 when none
    waits), highest first. Read just after ``ledger``: a task moving between the two
    reads may make their sums differ by a few."""
    queued_by_tenant: Mapping[str, int] = field(default_factory=dict)
    """Tasks waiting in the queue by tenant (the request's ``budget_tag``; ``""`` for
    untagged ones): the deepest few by name, the rest summed under ``"*"`` (bounded)."""

    def __post_init__(self) -> None:
        names = ("outcomes", "failures", "by_model", "by_priority", "ledger", "restarts")
        for name in (*names, "queued", "queued_by_tenant"):
            object.__setattr__(self, name, FrozenMap(getattr(self, name)))
        object.__setattr__(self, "budget", FrozenMap(self.budget))
        models = {m: FrozenMap(view) for m, view in self.models.items()}
        object.__setattr__(self, "models", FrozenMap(models))

    @property
    def cost_usd(self) -> Decimal:
        return self.total.cost_usd
