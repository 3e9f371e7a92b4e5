"""What the bench measures about one run, and the arithmetic on it.

A ``Run`` is one system (callboard or a baseline) on one workload: counts,
wall time, client CPU (``time.process_time`` of the whole bench process, so
every client-side thread is included and the provider, another process, is
not), service-latency percentiles, queue wait by priority, the provider's
own counters, tokens and cost. ``Meter`` takes the two clocks around the
measured section only (system start-up and warm-up are outside it).

What must hold: percentiles are nearest-rank over every sample (no window);
``throughput`` counts successful tasks only; a run never divides by zero
(an empty or instantaneous run reports 0).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any, Self

from callboard.core.pricing import Price, cost_nusd
from callboard.messages import Usage

__all__ = [
    "BENCH_PRICE",
    "Meter",
    "Percentiles",
    "Run",
    "arrival_rate",
    "median",
    "percentiles",
    "usage_cost_nusd",
]

BENCH_PRICE = Price(input_per_mtok=Decimal("0.15"), output_per_mtok=Decimal("0.60"))
"""The price every system is charged at (so costs compare)."""

BENCH_KEY = "sk-bench-0123456789abcdefghijklmnopqrstuvwxyzABCDEF"
"""The API key every system sends (the simulated provider takes any): callboard
registers it and hides it in every answer, as it does a real key, so the bench
measures what a production call pays for that."""


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Nearest-rank percentiles in milliseconds (None when there is no sample)."""

    count: int = 0
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None


def percentiles(samples_s: Iterable[float]) -> Percentiles:
    """Percentiles (ms) of ``samples_s`` (seconds), over every sample."""
    ordered = sorted(samples_s)
    n = len(ordered)
    if n == 0:
        return Percentiles()

    def at(q: float) -> float:
        return round(ordered[max(0, math.ceil(q * n) - 1)] * 1000.0, 3)

    return Percentiles(count=n, p50=at(0.50), p95=at(0.95), p99=at(0.99), max=at(1.0))


def arrival_rate(
    arrivals: Sequence[float], skip_start_s: float, skip_end_s: float = 0.0
) -> float | None:
    """Arrivals per second between ``first + skip_start_s`` and ``last - skip_end_s``.

    ``(k - 1) / (t_k - t_1)`` over the k arrivals in that window; None if fewer than two.
    """
    if not arrivals:
        return None
    lo, hi = arrivals[0] + skip_start_s, arrivals[-1] - skip_end_s
    window = [t for t in arrivals if lo <= t <= hi]
    if len(window) < 2 or window[-1] <= window[0]:
        return None
    return (len(window) - 1) / (window[-1] - window[0])


def usage_cost_nusd(prompt_tokens: int, completion_tokens: int) -> int:
    """What ``BENCH_PRICE`` charges for this usage, in nano-dollars."""
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    return cost_nusd(BENCH_PRICE, usage)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass(slots=True, kw_only=True)
class Run:
    """One system on one workload."""

    scenario: str
    system: str
    label: str = ""
    """The workload variant, e.g. ``C50``."""
    concurrency: int = 0
    tasks: int = 0
    ok: int = 0
    failed: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    latency: Percentiles = field(default_factory=Percentiles)
    """Service latency: call start to parsed answer (queue wait excluded)."""
    end_to_end: Percentiles = field(default_factory=Percentiles)
    """Submission to result (callboard: includes the queue wait)."""
    queue_wait: dict[str, Percentiles] = field(default_factory=dict)
    """By priority name (callboard only)."""
    server: dict[str, Any] = field(default_factory=dict)
    """The provider's counters for this run: requests, rate_limited, max_in_flight..."""
    lost: int | None = None
    duplicated: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_nusd: int = 0
    round: int = 0
    """Which round of a repeated measurement this is (0-based)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Successful tasks per second of wall time."""
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_ms_per_request(self) -> float:
        """Client CPU per task, in milliseconds."""
        return 1000.0 * self.cpu_s / self.tasks if self.tasks else 0.0

    @property
    def cost_usd(self) -> float:
        return self.cost_nusd / 1e9

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["throughput"] = round(self.throughput, 2)
        data["cpu_ms_per_request"] = round(self.cpu_ms_per_request, 4)
        data["cost_usd"] = self.cost_usd
        return data

    def take_server(self, stats: Mapping[str, Any], model: str | None = None) -> None:
        """Keep the provider's counters (total, or one model's) without the arrival list."""
        part = stats["total"] if model is None else stats["models"].get(model, {})
        self.server = {k: v for k, v in part.items() if k not in ("arrivals", "refused_arrivals")}


class Meter:
    """Wall and client-CPU clocks around a measured section (``with Meter() as m``)."""

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self.started = 0.0
        """``time.perf_counter()`` at entry."""
        self._c0 = 0.0

    def __enter__(self) -> Self:
        self.started = time.perf_counter()
        self._c0 = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s = time.process_time() - self._c0
        self.wall_s = time.perf_counter() - self.started


@dataclass(slots=True, kw_only=True)
class ScenarioResult:
    """Everything one scenario measured."""

    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    """Provider and workload settings, as run."""
    runs: list[Run] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    """Scenario-specific figures (rates, inversions, per-size overheads...)."""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time the whole scenario took, set-up included."""

    def rows(self, baselines: Sequence[str]) -> list[dict[str, Any]]:
        return summarise(self.runs, baselines)

    def as_json(self, baselines: Sequence[str]) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "summary": self.rows(baselines),
            "figures": self.figures,
            "notes": self.notes,
            "seconds": round(self.seconds, 2),
            "runs": [r.as_json() for r in self.runs],
        }


def summarise(runs: Sequence[Run], baselines: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (variant, system): medians over rounds, ratios paired by round.

    A ratio to baseline ``b`` is the median over rounds of ``throughput /
    throughput of b in the same round and variant`` (a baseline run once, like
    ``serial``, pairs with every round). ``cpu_delta_ms`` is the same pairing
    for client CPU per request, as a difference, and ``p95_ratio`` for the p95
    service latency (each system's own median round, on a machine whose speed
    drifts, were two different rounds: found by a review).
    """
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.label, run.system), []).append(run)
    rows = []
    for (label, system), group in groups.items():
        ordered = sorted(group, key=lambda r: r.throughput)
        rep = ordered[len(ordered) // 2]
        row: dict[str, Any] = {
            "label": label,
            "system": system,
            "rounds": len(group),
            "throughput": median([r.throughput for r in group]),
            "cpu_ms_per_request": median([r.cpu_ms_per_request for r in group]),
            "cycle_ms": _cycle_ms(group),
            "ratio": {},
            "cpu_delta_ms": {},
            "p95_ratio": {},
        } | _representative(rep)
        for base in baselines:
            if base != system:
                _pair(row, group, runs, base)
        rows.append(row)
    return rows


def _cycle_ms(group: Sequence[Run]) -> float | None:
    """Milliseconds per call slot per task: concurrency / throughput (median over rounds).

    With every slot busy this is the service time; what exceeds it is the time a
    slot stood empty between one answer and the next call (the client's refill gap).
    """
    if group[0].scenario != "steady":  # elsewhere a limit or the arrivals bind, not the slots
        return None
    cycles = [1000.0 * r.concurrency / r.throughput for r in group if r.throughput > 0]
    return median(cycles)


def _representative(rep: Run) -> dict[str, Any]:
    return {
        "tasks": rep.tasks,
        "ok": rep.ok,
        "failed": rep.failed,
        "latency": asdict(rep.latency),
        "end_to_end": asdict(rep.end_to_end),
        "queue_wait": {p: asdict(q) for p, q in rep.queue_wait.items()},
        "server_429": rep.server.get("rate_limited"),
        "server_max_in_flight": rep.server.get("max_in_flight"),
        "server_requests": rep.server.get("requests"),
        "lost": rep.lost,
        "duplicated": rep.duplicated,
        "cost_usd": rep.cost_usd,
        "tokens": rep.prompt_tokens + rep.completion_tokens,
    }


def _pair(row: dict[str, Any], group: Sequence[Run], runs: Sequence[Run], base: str) -> None:
    candidates = [r for r in runs if r.system == base and r.label in (row["label"], "")]
    if not candidates:
        return
    ratios, deltas, p95s = [], [], []
    for run in group:
        same = [r for r in candidates if r.round == run.round] or candidates
        tput = median([r.throughput for r in same]) or 0.0
        cpu = median([r.cpu_ms_per_request for r in same]) or 0.0
        if tput > 0:
            ratios.append(run.throughput / tput)
        deltas.append(run.cpu_ms_per_request - cpu)
        theirs = median([r.latency.p95 for r in same if r.latency.p95])
        if run.latency.p95 and theirs:
            p95s.append(run.latency.p95 / theirs)
    row["ratio"][base] = median(ratios)
    row["cpu_delta_ms"][base] = median(deltas)
    if p95s:
        row["p95_ratio"][base] = median(p95s)
