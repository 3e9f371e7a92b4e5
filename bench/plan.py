"""How big each scenario runs: the full plan (~15 min) and ``--quick`` (a minute or two).

Every count and duration the scenarios use is here, so a run is bounded in
count and time by construction and the report can print the plan it ran.
What must hold: ``quick`` keeps every scenario small enough that the whole
quick bench stays within about two minutes on a 2-core machine (90 s for the
eleven scenarios before ``tenants`` and ``gateway``, measured under a load
average of 1-5).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SCENARIOS", "Options", "Scale"]

SCENARIOS = (
    "steady",
    "rate-limited",
    "misconfigured-limit",
    "faulty",
    "outage",
    "dead-provider",
    "priority",
    "backlog",
    "crash",
    "streaming",
    "embeddings",
    "tenants",
    "gateway",
    "cluster",
    "redaction",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scale:
    """Sizes and durations of every scenario."""

    quick: bool
    steady_tasks: int
    steady_levels: tuple[int, ...] = (50, 200)
    steady_rounds: int
    """Interleaved repetitions of each steady measurement (ratios are medians over rounds)."""
    latency_s: float = 0.05
    serial_tasks: int
    slow_cap_s: float
    """Time cap for the slow baselines (raw httpx, LiteLLM): they stop issuing then."""
    rate_rpm: int
    rate_tasks: int
    misconfigured_rpm: int
    """The provider's real limit in ``misconfigured-limit`` (callboard is told 4x)."""
    misconfigured_tasks: int
    misconfigured_skip_s: float
    """The start the achieved rate leaves out (the first burst, the limit's discovery)."""
    faulty_tasks: int
    outage_phases_s: tuple[float, float, float]
    """Before, during and after the outage."""
    outage_rate: int
    """Tasks submitted per second, open loop, during the outage scenario."""
    priority_concurrency: int
    priority_overload_s: float
    backlog_core_sizes: tuple[int, ...]
    backlog_system_sizes: tuple[int, ...]
    backlog_traced_sizes: tuple[int, ...]
    """System backlog sizes measured again under tracemalloc (memory per task)."""
    backlog_repeats: int
    """Repetitions of the system backlog sizes up to 10^4 (median taken)."""
    crash_tasks: int
    crash_every: int
    dead_tasks: int
    dead_give_up_s: float
    """The breaker's ``give_up_s`` in ``dead-provider``: every task ends by then."""
    stream_count: int
    """Streams measured per system per round in ``streaming``."""
    stream_concurrency: int
    stream_tokens: int
    """Tokens per streamed answer."""
    stream_ttft_s: float
    """The provider's time to first token."""
    stream_gap_s: float
    """The provider's pause between tokens. The full plan's 50 ms (200 streams at 20
    tokens a second, 4,000 tokens a second in all) leaves the raw client keeping the
    provider's pace on two shared cores; at 20 ms the raw client and the provider alone
    saturate them, and every client's time to first token measures that queue."""
    stream_rounds: int
    embed_texts: int
    """Texts embedded per system per round in ``embeddings``."""
    embed_batch: int
    """Texts per embeddings request (callboard's batch size, and the baseline's)."""
    embed_concurrency: int
    embed_dimensions: int
    embed_rounds: int
    tenants_concurrency: int
    tenants_latency_s: float
    """The provider's mean call time in ``tenants``: long enough that the flood's
    submissions (5x capacity, about a millisecond of client CPU each) leave the
    model's calls their share of two cores (at 50 ms and C20 they did not: the model
    served half its capacity, and the light tenant came to 0.92 of its share)."""
    tenants_overload_s: float
    gateway_tasks: int
    """Requests per system per round per level in ``gateway``."""
    gateway_levels: tuple[int, ...] = (10, 50, 200)
    """C10 shows what the gateway adds to a call when it is not CPU-bound; at 50 and
    200 (the issue's levels) one core of Python bounds it."""
    gateway_rounds: int
    redaction_rounds: int
    redaction_share_s: float
    """CPU seconds each ``redaction`` measurement repeats for, a round."""
    redaction_hostile_repeats: int
    """Repetitions of ``sk-proj `` in ``redaction``'s hostile answer."""

    @classmethod
    def full(cls) -> Scale:
        return cls(
            quick=False,
            steady_tasks=3000,
            steady_rounds=5,
            serial_tasks=60,
            slow_cap_s=6.0,
            rate_rpm=6000,
            rate_tasks=1000,
            misconfigured_rpm=600,
            misconfigured_tasks=300,
            misconfigured_skip_s=10.0,
            faulty_tasks=2000,
            outage_phases_s=(1.5, 3.0, 3.5),
            outage_rate=200,
            priority_concurrency=20,
            priority_overload_s=1.5,
            backlog_core_sizes=(1_000, 100_000, 1_000_000),
            backlog_system_sizes=(1_000, 100_000, 1_000_000),
            backlog_traced_sizes=(1_000, 10_000),
            backlog_repeats=3,
            crash_tasks=2000,
            crash_every=40,
            dead_tasks=1000,
            dead_give_up_s=20.0,
            stream_count=1000,
            stream_concurrency=200,
            stream_tokens=20,
            stream_ttft_s=0.1,
            stream_gap_s=0.05,
            stream_rounds=5,
            embed_texts=100_000,
            embed_batch=256,
            embed_concurrency=8,
            embed_dimensions=256,
            embed_rounds=3,
            tenants_concurrency=20,
            tenants_latency_s=0.2,
            tenants_overload_s=2.0,
            gateway_tasks=3000,
            gateway_rounds=5,
            redaction_rounds=3,
            redaction_share_s=0.2,
            redaction_hostile_repeats=200_000,
        )

    @classmethod
    def small(cls) -> Scale:
        return cls(
            quick=True,
            steady_tasks=300,
            steady_rounds=1,
            serial_tasks=8,
            slow_cap_s=0.5,
            rate_rpm=12000,
            rate_tasks=400,
            misconfigured_rpm=3000,
            misconfigured_tasks=120,
            misconfigured_skip_s=1.0,
            faulty_tasks=300,
            outage_phases_s=(0.4, 1.2, 1.4),
            outage_rate=100,
            priority_concurrency=10,
            priority_overload_s=0.5,
            backlog_core_sizes=(1_000, 10_000, 30_000),
            backlog_system_sizes=(1_000, 5_000),
            backlog_traced_sizes=(1_000,),
            backlog_repeats=1,
            crash_tasks=400,
            crash_every=25,
            dead_tasks=200,
            dead_give_up_s=3.0,
            stream_count=60,
            stream_concurrency=20,
            stream_tokens=10,
            stream_ttft_s=0.05,
            stream_gap_s=0.005,
            stream_rounds=1,
            embed_texts=2000,
            embed_batch=100,
            embed_concurrency=4,
            embed_dimensions=64,
            embed_rounds=1,
            tenants_concurrency=10,
            tenants_latency_s=0.1,
            tenants_overload_s=0.6,
            gateway_tasks=300,
            gateway_rounds=1,
            redaction_rounds=1,
            redaction_share_s=0.02,
            redaction_hostile_repeats=20_000,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """What the command line asked for."""

    scale: Scale
    scenarios: tuple[str, ...] = SCENARIOS
    baselines: tuple[str, ...] = ()
    """The baselines to run (LiteLLM only if importable)."""
    seed: int = 7
    provider: str = "sim"
    """The server the load runs against: ``sim`` (ours) or ``asgi`` (uvicorn, steady only)."""
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """Everything but the notes (the report lists those on their own)."""
        return {k: v for k, v in asdict(self).items() if k != "notes"}
