"""Scenario ``priority``: 5x overload with mixed priorities; queue wait and inversions.

Two models (``max_concurrency`` C/2 each, one route, so every task may go to
either) serve C calls at a time at 50 ms each on average: capacity = C / 0.05
tasks/s. Tasks arrive open-loop at 5x that for ``priority_overload_s`` (a
burst every ``TICK_S``), with priorities drawn (seeded) 10% CRITICAL, 20%
HIGH, 30% NORMAL, 40% LOW; then the backlog drains.

It runs twice, on the same tasks:

- ``varied``, the target's run: each call takes 50 ms +/- 25 ms (uniform), as
  a real provider's calls differ in length. The target bounds CRITICAL's p99
  queue wait by one service time: the median time a call of this run holds
  its slot, from the queue's dispatch to the parsed answer (the provider's
  time plus the HTTP round trip; ``service_time_ms``).
- ``lockstep``: every call takes exactly 50 ms. Under overload each freed slot
  is refilled at once, so the slots stay in step and free in waves, one slot
  cycle apart (``slot_cycle_ms``: the provider's 50 ms plus the refill gap
  between an answer and the next call on that slot, from the provider's
  arrival times). A CRITICAL task that arrives just after a wave waits for
  the next one whatever the scheduler does, so here its p99 wait is about one
  cycle, a little more than one service time (``critical_p99_wait_over_cycle``
  is reported, not judged: one slow wave moves it by a few percent).

Inversions and lost tasks are counted in both runs.

Inversion, precisely. Number the tasks in submission order (one submitting
thread, so this is also the order the queue receives them). Task B, first
sent by model m at time d_B, is *inverted* if some task A with

    A submitted before B,  priority(A) strictly more urgent than priority(B),
    A first sent by the same model m, and after B (d_A > d_B),

exists. ``inversions[m]`` counts the inverted tasks sent by m. Aging cannot
excuse one: A is older and more urgent, so it is ahead of B in the aged order
too, and an aged turn takes the aged order's first level's first task (one
tenant here). A model sends in the order the queue hands it work (a more urgent
task can only overtake), so A sent after B by the same model means A was
still in the queue when B was handed over: the queue chose B over it. Two
models send independently (each its own actor and window), so a task sent by
one is not compared with a task sent by the other: their send times say
nothing of the queue's order. Send times come from the results, d =
submitted_at + queue_wait_s (the queue wait ends at the first call sent),
and submitted_at is known only to within its burst (the ``submit_many``
call's [began, ended], both on callboard's monotonic clock), so an inversion
counts only when it is certain: began_A + wait_A > ended_B + wait_B. An
inversion in which B went less than one burst's submit time (reported as
``clock_uncertainty_ms``) before A cannot be seen this way.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from callboard.bench.clients import Workload
from callboard.bench.measure import Meter, Run, ScenarioResult, arrival_rate
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.subject import Submitter, bench_model, collect, one_route, results_run
from callboard.core.settings import ModelSettings
from callboard.messages import Priority

from callboard import System

__all__ = ["MIX", "Dispatch", "count_inversions", "run_priority"]

NAME = "priority"
OVERLOAD = 5.0
TICK_S = 0.01
VARIED_JITTER = 0.5
"""The target's run: each call takes the provider's latency +/- this share of it."""
MIX = (
    (Priority.CRITICAL, 0.1),
    (Priority.HIGH, 0.2),
    (Priority.NORMAL, 0.3),
    (Priority.LOW, 0.4),
)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One dispatched task, in submission order: its priority, model and dispatch-time bounds."""

    priority: int
    model: str
    earliest: float
    latest: float


def count_inversions(dispatches: Sequence[Dispatch]) -> dict[str, int]:
    """Inverted sends per model (see the module docstring); O(n * levels)."""
    levels = 1 + max((d.priority for d in dispatches), default=0)
    latest_wait: dict[str, list[float]] = {}
    """Per model, per priority: the latest certain send time of a task submitted so far."""
    counts: Counter[str] = Counter({d.model: 0 for d in dispatches})
    for d in dispatches:
        latest = latest_wait.setdefault(d.model, [-math.inf] * levels)
        if any(latest[p] > d.latest for p in range(d.priority)):
            counts[d.model] += 1
        latest[d.priority] = max(latest[d.priority], d.earliest)
    return dict(counts)


def run_priority(opts: Options) -> ScenarioResult:
    scale = opts.scale
    conc = scale.priority_concurrency
    capacity = conc / scale.latency_s
    rate = OVERLOAD * capacity
    total = int(rate * scale.priority_overload_s)
    rng = random.Random(opts.seed)
    prios = rng.choices([p for p, _ in MIX], weights=[w for _, w in MIX], k=total)
    result = ScenarioResult(name=NAME)
    result.settings = {
        "concurrency": conc,
        "provider_latency_s": scale.latency_s,
        "varied_jitter_s": VARIED_JITTER * scale.latency_s,
        "capacity_per_s": capacity,
        "offered_per_s": rate,
        "overload_s": scale.priority_overload_s,
        "tasks": total,
        "mix": {p.name: w for p, w in MIX},
    }
    varied, figures = _overload(opts, prios, rate, jitter_s=VARIED_JITTER * scale.latency_s)
    lockstep, in_step = _overload(opts, prios, rate, jitter_s=0.0)
    result.runs = [varied, lockstep]
    cycle = in_step["slot_cycle_ms"]
    p99 = in_step["critical_p99_wait_ms"]
    in_step["critical_p99_wait_over_cycle"] = (
        None if cycle is None or p99 is None else round(p99 / cycle, 3)
    )
    result.figures = figures | {
        "lost": figures["lost"] + in_step["lost"],
        "inversions_total": figures["inversions_total"] + in_step["inversions_total"],
        "lockstep": in_step,
    }
    return result


def _overload(
    opts: Options, prios: Sequence[Priority], rate: float, *, jitter_s: float
) -> tuple[Run, dict[str, Any]]:
    """One overload and drain on a provider whose latency varies by +/- ``jitter_s``."""
    scale = opts.scale
    conc, total = scale.priority_concurrency, len(prios)
    capacity = conc / scale.latency_s
    label = "varied" if jitter_s else "lockstep"
    with ProviderProcess(latency_s=scale.latency_s, jitter_s=jitter_s, seed=opts.seed) as prov:
        models = tuple(bench_model(f"prio-{k}", prov.base_url, conc // 2) for k in range(2))
        work = Workload(base_url=prov.base_url, model="prio", tasks=total, concurrency=conc)
        with System(one_route(models, total)) as system:
            prov.reset_stats()
            sub = Submitter(system, work, priority_of=prios.__getitem__)
            with Meter() as meter:
                _drive(sub, rate)
                results, lost = collect(sub.futures, total / capacity + 60.0)
        server = prov.stats()
    run = results_run(work, results, lost, meter, scenario=NAME, label=label)
    run.take_server(server)
    gap = _refill_gap_ms(server, models, conc, scale.latency_s)
    return run, _figures(sub, run, scale.latency_s) | {
        "lost": lost,
        "refill_gap_ms": gap,
        "slot_cycle_ms": None if gap is None else round(scale.latency_s * 1000.0 + gap, 2),
    }


def _drive(sub: Submitter, rate: float) -> None:
    """Submit ``sub.work.tasks`` tasks at ``rate`` per second, a burst per tick."""
    per_tick = max(1, round(rate * TICK_S))
    t0 = time.monotonic()
    for tick, first in enumerate(range(0, sub.work.tasks, per_tick)):
        time.sleep(max(0.0, t0 + tick * TICK_S - time.monotonic()))
        sub.submit(range(first, min(sub.work.tasks, first + per_tick)))


def dispatches(sub: Submitter) -> list[Dispatch]:
    """The dispatched tasks, in submission order, with their dispatch-time bounds."""
    out = []
    for burst in sub.bursts:
        for k in range(burst.first, burst.first + burst.count):
            future = sub.futures[k]
            if not future.done():
                continue
            r = future.result()
            if r.attempts and r.model is not None:
                w = r.queue_wait_s
                out.append(Dispatch(int(r.priority), r.model, burst.began + w, burst.ended + w))
    return out


def _refill_gap_ms(
    server: dict[str, Any], models: tuple[ModelSettings, ...], conc: int, service_s: float
) -> float | None:
    """How long a call slot stood empty between an answer and the next call, on average.

    From the provider's arrival times while the backlog lasted (the first and
    last half second left out): each slot's cycle is ``conc / rate``; the part
    above the service time is the client's refill gap.
    """
    arrivals = sorted(
        t for m in models for t in server["models"].get(m.name, {}).get("arrivals", [])
    )
    rate = arrival_rate(arrivals, 0.5, 0.5)
    return None if not rate else round(1000.0 * (conc / rate - service_s), 2)


def _figures(sub: Submitter, run: Run, latency_s: float) -> dict[str, Any]:
    found = dispatches(sub)
    inversions = count_inversions(found)
    uncertainty = max((b.ended - b.began for b in sub.bursts), default=0.0)
    critical = run.queue_wait.get(Priority.CRITICAL.name)
    return {
        "inversions": inversions,
        "inversions_total": sum(inversions.values()),
        "dispatched": len(found),
        "clock_uncertainty_ms": round(uncertainty * 1000.0, 3),
        "provider_latency_ms": latency_s * 1000.0,
        "service_time_ms": run.latency.p50 if run.latency.count else None,
        "critical_p99_wait_ms": None if critical is None else critical.p99,
        "queue_wait_ms": run.queue_wait,
        "throughput_over_capacity": run.throughput * latency_s / run.concurrency,
    }
