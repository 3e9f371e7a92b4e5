"""Scenario ``steady``: throughput and client CPU against the baselines.

The provider answers every request after 50 ms. At each concurrency level C
(50 and 200), the same N tasks go through each system: callboard with one
model (``max_concurrency`` = C), callboard with two models of C/2 each behind
one route, and each selected baseline with a semaphore of C. Priorities are
mixed (task i has priority i mod 4). Each measurement is repeated in rounds,
in a rotated order, so that drift on a shared machine hits every system
alike; ratios are medians over rounds of same-round ratios.

The slow baselines (raw httpx, LiteLLM) run once per level under a time cap
and without a warm-up (their connection set-up falls in the measured part),
and ``serial`` runs once per scenario with a small count: their throughput
does not depend on the level (serial) or would take minutes to measure fully.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import replace

from callboard.bench.clients import Workload, run_baseline
from callboard.bench.measure import Run, ScenarioResult
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.subject import bench_model, one_route, run_callboard

__all__ = ["run_steady"]

log = logging.getLogger(__name__)

NAME = "steady"
MODEL = "steady"
BURST = 100
"""Tasks per ``submit_many`` call."""
COMPLETION_TOKENS = 24
SLOW = ("httpx", "litellm")
"""Baselines too slow to measure fully: once per level, under the time cap."""
Measure = Callable[[ProviderProcess], Run]


def run_steady(opts: Options) -> ScenarioResult:
    scale = opts.scale
    result = ScenarioResult(name=NAME)
    result.settings = {
        "latency_s": scale.latency_s,
        "levels": list(scale.steady_levels),
        "tasks": scale.steady_tasks,
        "rounds": scale.steady_rounds,
        "burst": BURST,
        "completion_tokens": COMPLETION_TOKENS,
        "serial_tasks": scale.serial_tasks,
        "slow_baselines_cap_s": scale.slow_cap_s,
        "provider": opts.provider,
    }
    extra = ["--completion-tokens", str(COMPLETION_TOKENS)]
    with ProviderProcess(
        latency_s=scale.latency_s, seed=opts.seed, extra_args=extra, server=opts.provider
    ) as prov:
        for level in scale.steady_levels:
            result.runs += _level(prov, opts, level)
        if "serial" in opts.baselines:
            work = Workload(
                base_url=prov.base_url, model=MODEL, tasks=scale.serial_tasks, concurrency=1
            )
            result.runs.append(_measured(prov, _baseline("serial", "", work)))
    return result


def _level(prov: ProviderProcess, opts: Options, level: int) -> list[Run]:
    scale = opts.scale
    label = f"C{level}"
    work = Workload(
        base_url=prov.base_url,
        model=MODEL,
        tasks=scale.steady_tasks,
        concurrency=level,
        warmup=level,
        time_cap_s=120.0,
    )
    systems: list[tuple[str, Measure]] = [
        ("callboard", lambda prov: _callboard(prov, work, label, 1)),
        ("callboard-2m", lambda prov: _callboard(prov, work, label, 2)),
    ]
    systems += [
        (name, _baseline(name, label, work))
        for name in opts.baselines
        if name not in (*SLOW, "serial")
    ]
    runs: list[Run] = []
    for rnd in range(scale.steady_rounds):
        shift = rnd % len(systems)
        for name, measure_one in systems[shift:] + systems[:shift]:
            log.info("steady %s round %d: %s", label, rnd, name)
            run = _measured(prov, measure_one)
            run.round = rnd
            runs.append(run)
    capped = replace(work, warmup=0, time_cap_s=scale.slow_cap_s)
    runs += [
        _measured(prov, _baseline(name, label, capped)) for name in opts.baselines if name in SLOW
    ]
    return runs


def _baseline(name: str, label: str, work: Workload) -> Measure:
    return lambda prov: run_baseline(name, NAME, label, work, on_start=prov.reset_stats)


def _measured(prov: ProviderProcess, measure_one: Measure) -> Run:
    """One measurement; the provider's counters are reset when its measured part starts."""
    gc.collect()
    run = measure_one(prov)
    run.take_server(prov.stats())
    return run


def _callboard(prov: ProviderProcess, work: Workload, label: str, n_models: int) -> Run:
    share = max(1, work.concurrency // n_models)
    models = tuple(
        bench_model(f"{MODEL}-{k}" if n_models > 1 else MODEL, work.base_url, share)
        for k in range(n_models)
    )
    name = "callboard" if n_models == 1 else f"callboard-{n_models}m"
    return run_callboard(
        one_route(models, work.tasks),
        work,
        scenario=NAME,
        system_name=name,
        label=label,
        burst=BURST,
        on_start=prov.reset_stats,
    )
