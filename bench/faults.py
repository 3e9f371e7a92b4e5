"""Scenarios ``rate-limited`` and ``faulty``: a provider that refuses or fails some calls.

``rate-limited``: the provider enforces ``rpm`` per model (token bucket of one
second's worth) and callboard's model is configured with the same ``rpm``.
Figures: server-side 429s (from ``/stats``) and the achieved rate over the
limit. The achieved rate is the sustained one, measured at the server:
``(k - 1) / (t_k - t_1)`` over the k arrivals after the first second (the
first second holds the buckets' initial burst, which any client gets for
free). The baseline, raw aiohttp with a semaphore and retries that honour
Retry-After, has no limiter: its 429 count is what callboard saves.

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

import logging
from collections.abc import Sequence
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

__all__ = ["run_faulty", "run_rate_limited", "sustained_rate"]

log = logging.getLogger(__name__)

CONCURRENCY = 50
ERROR_RATE = 0.10
ATTEMPTS = 6
"""Calls per task at most in ``faulty``: P(a task fails 6 times) = 1e-6."""
SKIP_S = 1.0
COOLDOWN_S = 1.0
"""The breaker's first cooldown in ``faulty`` (default 5 s), to keep the run bounded."""
COMPLETION_TOKENS = 24


def sustained_rate(arrivals: Sequence[float], skip_s: float = SKIP_S) -> float | None:
    """Arrivals per second after the first ``skip_s`` (None if too few to tell)."""
    return arrival_rate(arrivals, skip_s)


def run_rate_limited(opts: Options) -> ScenarioResult:
    rpm = opts.scale.rate_rpm
    result = ScenarioResult(name="rate-limited")
    names = {"callboard": "rl-callboard", "aiohttp": "rl-aiohttp"}
    result.settings = {
        "rpm": rpm,
        "server_burst_s": 1.0,
        "client_limiter": {"rpm": rpm, "burst_s": LimiterConfig(rpm=rpm, tpm=None).burst_s},
        "tasks": opts.scale.rate_tasks,
        "concurrency": CONCURRENCY,
        "skip_s": SKIP_S,
    }
    models = {name: {"rpm": rpm} for name in names.values()}
    with _provider(opts, models) as prov:
        work = _work(prov, names["callboard"], opts.scale.rate_tasks, attempts=4)
        config = SystemConfig(
            models=(
                bench_model(
                    names["callboard"],
                    prov.base_url,
                    CONCURRENCY,
                    limiter=LimiterConfig(rpm=rpm, tpm=None),
                ),
            )
        )
        run, arrivals = _callboard(prov, config, work, "rate-limited")
        _achieved(run, arrivals, rpm)
        runs = [run]
        if "aiohttp" in opts.baselines:
            base = _work(prov, names["aiohttp"], opts.scale.rate_tasks, attempts=4)
            run, arrivals = _baseline(prov, base, "rate-limited")
            _achieved(run, arrivals, rpm)
            runs.append(run)
    result.runs = runs
    result.figures = _rate_figures(runs[0])
    return result


def _achieved(run: Run, arrivals: Sequence[float], rpm: int) -> None:
    """The sustained rate from the server's arrival times (admitted calls only)."""
    rate = sustained_rate(arrivals) if run.server.get("rate_limited") == 0 else None
    run.extra["achieved_rate"] = rate
    run.extra["achieved_over_limit"] = None if rate is None else rate / (rpm / 60.0)
    run.extra["completed_per_s_over_limit"] = run.throughput / (rpm / 60.0)


def _rate_figures(run: Run) -> dict[str, Any]:
    return {
        "server_429": run.server.get("rate_limited"),
        "achieved_over_limit": run.extra["achieved_over_limit"],
        "achieved_rate": run.extra["achieved_rate"],
        "ok": run.ok,
        "tasks": run.tasks,
    }


def run_faulty(opts: Options) -> ScenarioResult:
    result = ScenarioResult(name="faulty")
    names = {"callboard": "flaky-callboard", "aiohttp": "flaky-aiohttp"}
    result.settings = {
        "error_rate": ERROR_RATE,
        "attempts": ATTEMPTS,
        "tasks": opts.scale.faulty_tasks,
        "concurrency": CONCURRENCY,
        "ideal_calls_per_task": round(1 / (1 - ERROR_RATE), 4),
    }
    models = {name: {"error_rate": ERROR_RATE} for name in names.values()}
    with _provider(opts, models) as prov:
        work = _work(prov, names["callboard"], opts.scale.faulty_tasks, attempts=ATTEMPTS)
        retry = RetryConfig(max_attempts=ATTEMPTS)
        breaker = BreakerConfig(cooldown_s=COOLDOWN_S)
        model = bench_model(
            names["callboard"], prov.base_url, CONCURRENCY, retry=retry, breaker=breaker
        )
        with BreakerWatch() as watch:
            run, _ = _callboard(prov, SystemConfig(models=(model,)), work, "faulty")
        run.extra["breaker_openings"] = sum(watch.openings.values())
        runs = [run]
        if "aiohttp" in opts.baselines:
            base = _work(prov, names["aiohttp"], opts.scale.faulty_tasks, attempts=ATTEMPTS)
            runs.append(_baseline(prov, base, "faulty")[0])
    for run in runs:
        sent = run.server.get("requests", 0)
        run.extra["server_calls_per_task"] = sent / run.tasks if run.tasks else None
        run.extra["success_ratio"] = run.ok / run.tasks if run.tasks else None
    result.runs = runs
    result.figures = _faulty_figures(runs[0], runs[1:])
    return result


def _faulty_figures(cb: Run, baselines: Sequence[Run]) -> dict[str, Any]:
    return {
        "success_ratio": cb.extra["success_ratio"],
        "server_calls_per_task": cb.extra["server_calls_per_task"],
        "server_500": cb.server.get("responses", {}).get("500", 0),
        "breaker_openings": cb.extra["breaker_openings"],
        "throughput_over_aiohttp": _ratio(cb, baselines),
        "failed": cb.failed,
        "tasks": cb.tasks,
    }


def _ratio(run: Run, others: Sequence[Run]) -> float | None:
    base = next((r for r in others if r.system == "aiohttp"), None)
    return None if base is None or not base.throughput else run.throughput / base.throughput


def _provider(opts: Options, models: dict[str, dict[str, Any]]) -> ProviderProcess:
    return ProviderProcess(
        latency_s=opts.scale.latency_s,
        models=models,
        seed=opts.seed,
        extra_args=["--completion-tokens", str(COMPLETION_TOKENS)],
    )


def _work(prov: ProviderProcess, model: str, tasks: int, *, attempts: int) -> Workload:
    return Workload(
        base_url=prov.base_url,
        model=model,
        tasks=tasks,
        concurrency=CONCURRENCY,
        attempts=attempts,
        time_cap_s=120.0,
    )


def _callboard(
    prov: ProviderProcess, config: SystemConfig, work: Workload, scenario: str
) -> tuple[Run, list[float]]:
    run = run_callboard(
        config, work, scenario=scenario, system_name="callboard", on_start=prov.reset_stats
    )
    return run, _server(run, prov, work.model)


def _baseline(prov: ProviderProcess, work: Workload, scenario: str) -> tuple[Run, list[float]]:
    run = run_baseline("aiohttp", scenario, "", work, on_start=prov.reset_stats)
    return run, _server(run, prov, work.model)


def _server(run: Run, prov: ProviderProcess, model: str) -> list[float]:
    """The provider's counters for ``model`` into ``run``; its arrival times, returned.

    The arrivals (thousands of floats) are an input of a figure, not a figure:
    they stay out of the run, so out of bench.json and bench.md.
    """
    stats = prov.stats()
    run.take_server(stats, model=model)
    arrivals: list[float] = stats["models"].get(model, {}).get("arrivals", [])
    return arrivals
