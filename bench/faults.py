"""Scenarios ``rate-limited`` and ``faulty``: a provider that refuses or fails some calls.

``rate-limited``: the provider enforces ``rpm`` per model (token bucket of one
second's worth) and callboard's model is configured with the same ``rpm``.
Figures: server-side 429s (from ``/stats``) and the achieved rate over the
limit. The achieved rate is the sustained one, measured at the server:
``(k - 1) / (t_k - t_1)`` over the k arrivals after the first second (the
first second holds the buckets' initial burst, which any client gets for
free). The baseline, raw aiohttp with a semaphore and retries that honour
Retry-After, has no limiter: its 429 count is what callboard saves.

``misconfigured-limit``: the provider enforces ``rpm`` but callboard is
configured with four times that (the operator read the wrong tier). The
provider's ``x-ratelimit-*`` headers say the real limit: callboard must adopt
it, every task must complete, the server's 429s stay at most 10% of the tasks,
and after the first ``skip_s`` the achieved rate is at least 90% of the real
limit (measured at the server, as above).

``faulty``: 10% of calls answer 500 (at once: a failure costs no latency).
Both callboard and the baseline retry (at most ``ATTEMPTS`` calls per task).
Figures: success ratio, calls sent per task as the server counted them
(ideal: 1 / 0.9 = 1.11), the breaker's openings (a healthy 90% provider
should not open it; each opening stalls the model for its cooldown) and
throughput over the baseline's.

Each system gets its own model name on the provider, so buckets and
counters never mix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from callboard.bench.clients import Workload, run_baseline
from callboard.bench.measure import Run, ScenarioResult, arrival_rate
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.subject import BreakerWatch, bench_model, run_callboard
from callboard.core.breaker import BreakerConfig
from callboard.core.limiter import LimiterConfig
from callboard.core.retry import RetryConfig

from callboard import SystemConfig

__all__ = [
    "MISCONFIGURED_BY",
    "run_faulty",
    "run_misconfigured_limit",
    "run_rate_limited",
    "sustained_rate",
]

CONCURRENCY = 50
ERROR_RATE = 0.10
ATTEMPTS = 6
"""Calls per task at most in ``faulty``: P(a task fails 6 times) = 1e-6."""
SKIP_S = 1.0
COOLDOWN_S = 1.0
"""The breaker's first cooldown in ``faulty`` (default 5 s), to keep the run bounded."""
COMPLETION_TOKENS = 24
MISCONFIGURED_BY = 4
"""``misconfigured-limit`` configures callboard at this multiple of the provider's rpm."""


def sustained_rate(arrivals: Sequence[float], skip_s: float = SKIP_S) -> float | None:
    """Arrivals per second after the first ``skip_s`` (None if too few to tell)."""
    return arrival_rate(arrivals, skip_s)


def run_rate_limited(opts: Options) -> ScenarioResult:
    rpm, tasks = opts.scale.rate_rpm, opts.scale.rate_tasks
    limiter = LimiterConfig(rpm=rpm, tpm=None)
    result = ScenarioResult(name="rate-limited")
    result.settings = {
        "rpm": rpm,
        "server_burst_s": 1.0,
        "client_limiter": {"rpm": rpm, "burst_s": limiter.burst_s},
        "tasks": tasks,
        "concurrency": CONCURRENCY,
        "skip_s": SKIP_S,
    }
    with _provider(opts, "rl", {"rpm": rpm}) as prov:
        measured = _runs(opts, prov, "rate-limited", "rl", tasks=tasks, attempts=4, limiter=limiter)
    for run, arrivals in measured:
        # the sustained rate from the server's arrival times (admitted calls only)
        rate = sustained_rate(arrivals) if run.server.get("rate_limited") == 0 else None
        run.extra["achieved_rate"] = rate
        run.extra["achieved_over_limit"] = None if rate is None else rate / (rpm / 60.0)
        run.extra["completed_per_s_over_limit"] = run.throughput / (rpm / 60.0)
    result.runs = [run for run, _ in measured]
    cb = result.runs[0]
    result.figures = {
        "server_429": cb.server.get("rate_limited"),
        "achieved_over_limit": cb.extra["achieved_over_limit"],
        "achieved_rate": cb.extra["achieved_rate"],
        "ok": cb.ok,
        "tasks": cb.tasks,
    }
    return result


def run_misconfigured_limit(opts: Options) -> ScenarioResult:
    scale = opts.scale
    rpm, tasks, skip_s = (
        scale.misconfigured_rpm,
        scale.misconfigured_tasks,
        scale.misconfigured_skip_s,
    )
    limiter = LimiterConfig(rpm=rpm * MISCONFIGURED_BY, tpm=None)
    result = ScenarioResult(name="misconfigured-limit")
    result.settings = {
        "server_rpm": rpm,
        "server_burst_s": 1.0,
        "client_limiter": {"rpm": limiter.rpm, "burst_s": limiter.burst_s},
        "tasks": tasks,
        "concurrency": CONCURRENCY,
        "skip_s": skip_s,
    }
    with _provider(opts, "low", {"rpm": rpm}) as prov:
        measured = _runs(
            opts, prov, "misconfigured-limit", "low", tasks=tasks, attempts=4, limiter=limiter
        )
    for run, arrivals in measured:
        rate = sustained_rate(arrivals, skip_s)
        run.extra["achieved_over_limit"] = None if rate is None else rate / (rpm / 60.0)
        run.extra["server_429_per_task"] = (run.server.get("rate_limited") or 0) / run.tasks
    result.runs = [run for run, _ in measured]
    cb = result.runs[0]
    result.figures = {
        "ok_ratio": cb.ok / cb.tasks if cb.tasks else None,
        "server_429": cb.server.get("rate_limited"),
        "server_429_per_task": cb.extra["server_429_per_task"],
        "achieved_over_limit": cb.extra["achieved_over_limit"],
        "tasks": cb.tasks,
    }
    return result


def run_faulty(opts: Options) -> ScenarioResult:
    tasks = opts.scale.faulty_tasks
    result = ScenarioResult(name="faulty")
    result.settings = {
        "error_rate": ERROR_RATE,
        "attempts": ATTEMPTS,
        "tasks": tasks,
        "concurrency": CONCURRENCY,
        "ideal_calls_per_task": round(1 / (1 - ERROR_RATE), 4),
    }
    retry = RetryConfig(max_attempts=ATTEMPTS)
    breaker = BreakerConfig(cooldown_s=COOLDOWN_S)
    with _provider(opts, "flaky", {"error_rate": ERROR_RATE}) as prov, BreakerWatch() as watch:
        measured = _runs(
            opts,
            prov,
            "faulty",
            "flaky",
            tasks=tasks,
            attempts=ATTEMPTS,
            retry=retry,
            breaker=breaker,
        )
    result.runs = [run for run, _ in measured]
    for run in result.runs:
        sent = run.server.get("requests", 0)
        run.extra["server_calls_per_task"] = sent / run.tasks if run.tasks else None
        run.extra["success_ratio"] = run.ok / run.tasks if run.tasks else None
    cb = result.runs[0]
    base = result.runs[1].throughput if len(result.runs) > 1 else 0.0
    result.figures = {
        "success_ratio": cb.extra["success_ratio"],
        "server_calls_per_task": cb.extra["server_calls_per_task"],
        "server_500": cb.server.get("responses", {}).get("500", 0),
        "breaker_openings": sum(watch.openings.values()),
        "throughput_over_aiohttp": cb.throughput / base if base else None,
        "failed": cb.failed,
        "tasks": cb.tasks,
    }
    return result


def _provider(opts: Options, prefix: str, behaviour: dict[str, Any]) -> ProviderProcess:
    """The provider, with ``behaviour`` for ``<prefix>-callboard`` and ``<prefix>-aiohttp``."""
    return ProviderProcess(
        latency_s=opts.scale.latency_s,
        models={f"{prefix}-{system}": behaviour for system in ("callboard", "aiohttp")},
        seed=opts.seed,
        extra_args=["--completion-tokens", str(COMPLETION_TOKENS)],
    )


def _runs(
    opts: Options,
    prov: ProviderProcess,
    scenario: str,
    prefix: str,
    *,
    tasks: int,
    attempts: int,
    **overrides: Any,
) -> list[tuple[Run, list[float]]]:
    """callboard on model ``<prefix>-callboard`` (with ``overrides``), then the aiohttp
    baseline on ``<prefix>-aiohttp`` if selected; each with its model's arrival times."""
    work = Workload(
        base_url=prov.base_url,
        model=f"{prefix}-callboard",
        tasks=tasks,
        concurrency=CONCURRENCY,
        attempts=attempts,
        time_cap_s=120.0,
    )
    model = bench_model(work.model, prov.base_url, CONCURRENCY, **overrides)
    config = SystemConfig(models=(model,))
    run = run_callboard(config, work, scenario=scenario, on_start=prov.reset_stats)
    out = [_server(run, prov, work.model)]
    if "aiohttp" in opts.baselines:
        work = replace(work, model=f"{prefix}-aiohttp")
        run = run_baseline("aiohttp", scenario, "", work, on_start=prov.reset_stats)
        out.append(_server(run, prov, work.model))
    return out


def _server(run: Run, prov: ProviderProcess, model: str) -> tuple[Run, list[float]]:
    """The provider's counters for ``model`` into ``run``; beside it, the arrival times
    of the requests it did not answer 429 (counted in the achieved rate, found by a
    review).

    The arrivals (thousands of floats) are an input of a figure, not a figure:
    they stay out of the run, so out of bench.json and bench.md.
    """
    stats = prov.stats()
    run.take_server(stats, model=model)
    counters = stats["models"].get(model, {})
    refused = Counter(counters.get("refused_arrivals", []))
    arrivals: list[float] = []  # those it served: a 429's arrival is no rate achieved
    for at in counters.get("arrivals", []):
        if refused[at]:
            refused[at] -= 1
        else:
            arrivals.append(at)
    return run, arrivals
