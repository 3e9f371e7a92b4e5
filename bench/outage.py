"""Scenario ``outage``: one model goes down for a while and comes back.

Two models on the provider, ``primary`` (the default route, with ``backup``
as its fallback) and ``backup``. Tasks arrive open-loop at a fixed rate
(a burst every ``TICK_S``) through three phases: before, during and after
the outage. The outage is ``POST /admin/models/primary {"status": 503}``,
ended by ``{"status": null}``. Every tick the driver also asks the primary's
model actor for its breaker state, which gives a timeline.

Figures: time from outage start to the breaker leaving ``closed``; time
from outage end to the breaker ``closed`` again; per phase (by submission
time) the tasks, successes, the share served by ``backup`` and the
end-to-end latency; the primary's 503s at the server (calls spent on a
dead model); failures and lost tasks overall.

The breaker's cooldown is shortened (``COOLDOWN_S``, capped at
``MAX_COOLDOWN_S``) so that recovery fits in a bounded run.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from callboard.bench.clients import Workload
from callboard.bench.measure import Meter, ScenarioResult, percentiles
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.subject import BreakerWatch, Submitter, bench_model, collect, results_run
from callboard.core.breaker import BreakerConfig
from callboard.messages import Completed, GetState, Priority, Result

from callboard import System, SystemConfig

__all__ = ["run_outage"]

NAME = "outage"
PRIMARY, BACKUP = "primary", "backup"
CONCURRENCY = 50
TICK_S = 0.05
COOLDOWN_S = 0.5
MAX_COOLDOWN_S = 1.0
PHASES = ("before", "during", "after")


@dataclass(slots=True)
class _Timeline:
    """What the driver saw: breaker states over time, and when each task went in."""

    t0: float
    down_at: float = 0.0
    up_at: float = 0.0
    states: list[tuple[float, str]] = field(default_factory=list)
    phase_of_task: list[str] = field(default_factory=list)

    def first(self, after: float, pred: str, *, equal: bool) -> float | None:
        """Seconds after ``after`` until a state (==/!= ``pred``) was first seen."""
        for t, state in self.states:
            if t >= after and (state == pred) is equal:
                return t - after
        return None


def run_outage(opts: Options) -> ScenarioResult:
    scale = opts.scale
    before, during, after = scale.outage_phases_s
    result = ScenarioResult(name=NAME)
    result.settings = {
        "phases_s": list(scale.outage_phases_s),
        "rate_per_s": scale.outage_rate,
        "tick_s": TICK_S,
        "concurrency": CONCURRENCY,
        "breaker": {"cooldown_s": COOLDOWN_S, "max_cooldown_s": MAX_COOLDOWN_S},
        "outage": {"status": 503},
    }
    with ProviderProcess(latency_s=scale.latency_s, seed=opts.seed) as prov:
        config = _config(prov.base_url)
        total = int(scale.outage_rate * (before + during + after))
        work = Workload(base_url=prov.base_url, model=PRIMARY, tasks=total, concurrency=CONCURRENCY)
        with System(config) as system:
            prov.reset_stats()
            sub = Submitter(system, work, priority_of=lambda _i: Priority.NORMAL)
            with Meter() as meter, BreakerWatch() as watch:
                line = _drive(system, sub, prov, opts)
                results, lost = collect(sub.futures, 120.0)
        server = prov.stats()
    run = results_run(work, results, lost, meter, scenario=NAME)
    run.take_server(server)
    run.extra["primary_503"] = server["models"].get(PRIMARY, {}).get("responses", {}).get("503", 0)
    result.runs = [run]
    result.figures = _figures(line, sub, lost) | {
        "primary_503": run.extra["primary_503"],
        "breaker_openings": watch.openings.get(PRIMARY, 0),
    }
    return result


def _config(base_url: str) -> SystemConfig:
    """``primary`` (the default route) falls back to ``backup``."""
    breaker = BreakerConfig(cooldown_s=COOLDOWN_S, max_cooldown_s=MAX_COOLDOWN_S)
    return SystemConfig(
        models=(
            bench_model(PRIMARY, base_url, CONCURRENCY, fallbacks=(BACKUP,), breaker=breaker),
            bench_model(BACKUP, base_url, CONCURRENCY),
        ),
        default_route=(PRIMARY,),
    )


def _drive(system: System, sub: Submitter, prov: ProviderProcess, opts: Options) -> _Timeline:
    """Submit at a fixed rate through the three phases; flip the primary down and up."""
    before, during, after = opts.scale.outage_phases_s
    per_tick = max(1, round(opts.scale.outage_rate * TICK_S))
    line = _Timeline(t0=time.monotonic())
    down_at, up_at, stop_at = before, before + during, before + during + after
    tick, i = 0, 0
    while (now := time.monotonic() - line.t0) < stop_at and i < sub.work.tasks:
        if now >= down_at and not line.down_at:
            prov.configure(PRIMARY, status=503)
            line.down_at = time.monotonic() - line.t0
        if now >= up_at and not line.up_at:
            prov.configure(PRIMARY, status=None)
            line.up_at = time.monotonic() - line.t0
        phase = "before" if not line.down_at else "during" if not line.up_at else "after"
        n = min(per_tick, sub.work.tasks - i)
        sub.submit(range(i, i + n))
        line.phase_of_task += [phase] * n
        i += n
        state = system.ask(f"model:{PRIMARY}", GetState(), timeout=5.0)
        line.states.append((time.monotonic() - line.t0, str(state.get("breaker"))))
        tick += 1
        time.sleep(max(0.0, line.t0 + tick * TICK_S - time.monotonic()))
    return line


def _figures(line: _Timeline, sub: Submitter, lost: int) -> dict[str, Any]:
    by_phase: dict[str, list[Result]] = {phase: [] for phase in PHASES}
    for future, phase in zip(sub.futures, line.phase_of_task, strict=True):
        if future.done():
            by_phase[phase].append(future.result())
    phases: dict[str, dict[str, Any]] = {}
    for phase, mine in by_phase.items():
        done = [r for r in mine if isinstance(r, Completed)]
        served = Counter(r.model for r in done)
        phases[phase] = {
            "tasks": len(mine),
            "ok": len(done),
            "backup_share": served[BACKUP] / len(done) if done else None,
            "end_to_end_ms": percentiles(r.latency_s for r in done),
        }
    opened = line.first(line.down_at, "closed", equal=False) if line.down_at else None
    closed = line.first(line.up_at, "closed", equal=True) if line.up_at else None
    return {
        "time_to_open_s": opened,
        "time_to_close_s": closed,
        "phases": phases,
        "failed": sum(not r.ok for mine in by_phase.values() for r in mine),
        "lost": lost,
        "breaker_timeline": _transitions(line.states),
    }


def _transitions(states: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """The state changes only: (seconds since start, new state)."""
    out: list[tuple[float, str]] = []
    for t, state in states:
        if not out or out[-1][1] != state:
            out.append((round(t, 3), state))
    return out
