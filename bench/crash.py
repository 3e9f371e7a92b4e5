"""Scenario ``crash``: actors crash every N messages; nothing may be lost or doubled.

A ``CrashPlan`` makes every actor of the pipeline raise on every N-th message
it receives (router, queue and aggregator every N, each model actor
every 2N), under a supervisor generous enough never to give up. Tasks go in
bursts through one route over two models.

Figures: ``lost`` = futures unresolved at the time cap + accepted tasks the
ledger never finished; ``duplicated`` = task ids answered twice; outcomes;
crashes injected and restarts per actor; calls the server received per task
(re-sent calls are allowed: delivery to the provider is at-least-once, the
results are exactly-once).
"""

from __future__ import annotations

from typing import Any

from callboard.actors.base import AGGREGATOR, QUEUE, ROUTER, CrashPlan, model_address
from callboard.bench.clients import Workload
from callboard.bench.measure import ScenarioResult
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.subject import bench_model, quiet, run_callboard
from callboard.supervisor.supervisor import SupervisorConfig

from callboard import System, SystemConfig

__all__ = ["run_crash"]

NAME = "crash"
MODELS = ("crash-a", "crash-b")
CONCURRENCY = 50
LATENCY_S = 0.02
BURST = 50
NOISY = ("pykka", "callboard.actors.base", "callboard.supervisor", "callboard.actors.model")
"""Loggers that report each injected crash and restart: expected here, so silenced."""
GENEROUS = SupervisorConfig(max_restarts=100_000, within_s=1.0, backoff_max_s=0.05)


def crash_plan(every: int) -> CrashPlan:
    plan = dict.fromkeys((ROUTER, QUEUE, AGGREGATOR), every)
    plan |= {model_address(m): 2 * every for m in MODELS}
    return CrashPlan(plan)


def run_crash(opts: Options) -> ScenarioResult:
    tasks, every = opts.scale.crash_tasks, opts.scale.crash_every
    plan = crash_plan(every)
    settings = {
        "tasks": tasks,
        "crash_every": {"pipeline": every, "models": 2 * every},
        "latency_s": LATENCY_S,
        "concurrency": CONCURRENCY,
        "burst": BURST,
    }
    with ProviderProcess(latency_s=LATENCY_S, seed=opts.seed) as prov:
        models = tuple(bench_model(m, prov.base_url, CONCURRENCY // 2) for m in MODELS)
        config = SystemConfig(models=models, default_route=MODELS, supervisor=GENEROUS)
        work = Workload(
            base_url=prov.base_url,
            model=MODELS[0],
            tasks=tasks,
            concurrency=CONCURRENCY,
            time_cap_s=120.0,
        )
        with quiet(*NOISY):
            run = run_callboard(
                config,
                work,
                scenario=NAME,
                burst=BURST,
                on_start=prov.reset_stats,
                crash_plan=plan,
                inspect=_inspect,
            )
        run.take_server(prov.stats())
    ledger = run.extra["ledger"]
    run.lost = max(run.lost or 0, ledger["accepted"] - ledger["finished"])
    figures = {
        "lost": run.lost,
        "duplicated": run.duplicated,
        "outcomes": run.extra["outcomes"],
        "injected": plan.injected,
        "restarts": run.extra["restarts"],
        "ledger": ledger,
        "server_calls_per_task": run.server.get("requests", 0) / run.tasks if run.tasks else None,
    }
    return ScenarioResult(name=NAME, settings=settings, runs=[run], figures=figures)


def _inspect(system: System) -> dict[str, Any]:
    counts = system.ledger.counts()
    supervision = system.supervision()
    return {
        "ledger": {
            "accepted": counts.accepted,
            "finished": counts.finished,
            "live": counts.live,
            "balanced": counts.balanced,
        },
        "restarts": {
            name: state["restarts"]
            for name, state in supervision.items()
            if isinstance(state, dict) and "restarts" in state
        },
    }
