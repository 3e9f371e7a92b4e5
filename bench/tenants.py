"""Scenario ``tenants``: a tenant that floods cannot starve a light one, and one alone
still gets every slot.

One model (``max_concurrency`` C) on the provider, each call L +/- L/2
(uniform, seeded; L = ``tenants_latency_s``, 200 ms in the full plan; see
``plan``): capacity = C / L tasks/s. Every task is NORMAL; a task's tenant is its
``budget_tag``, the two tenants weigh the same, and each task is charged its
estimated tokens.

- ``shared``: tenants A and B arrive open loop together at 5x capacity for
  ``tenants_overload_s`` (a burst every ``TICK_S``), A at 20x B's rate: of
  every 21 tasks 20 are A's. B's tasks come at a steady pace between A's. The
  backlog (A's) then drains. Target: B's p99 queue wait <= one service time
  (the median time a call of this run holds its slot, dispatch to parsed
  answer, as in ``priority``) while A's tasks wait seconds (its p50 is
  reported beside it).
- ``long``: as ``shared``, but B's requests allow answers of ``LONG_MAX_TOKENS``
  (what the gateway asks for a request that names no ``max_tokens``) and get
  answers as short as ever. A call is charged its prompt when sent and settled
  to its usage when it ends; charged ``max_tokens`` too, B paid for ~40 of A's
  calls with each of its own and its backlog grew (17-20 s at p99 through the
  gateway, found by a hunt; 3.8 s here with the charge settled at the end).
  Target: as ``shared``.
- ``alone``: A's tasks alone, at the same rate. Target: A uses >= 95% of
  capacity: calls started per second at the provider while the backlog lasts
  (its arrival times, the first and last half second left out), over C / L.
  A queue that held work back for a tenant that is not there (a reservation,
  a rate cap per tenant) would show here.

B is light only while its rate stays well under its share (half of what the
model serves, the two weighing the same): fairness gives it a share, not
precedence. Under a 5x flood the client's own CPU is busy with the flood's
submissions, and on a loaded machine the model may serve well under its
capacity; ``light_rate_over_its_share`` says how close B came to its share (at
1 or above it queues behind its own tasks, and its wait grows with them).

In process, not through the gateway: the gateway maps a key to a tenant and
submits (it holds no scheduling logic); the wait a tenant sees is decided by
the queue, and through the gateway the gateway's own CPU under a 5x flood
(about 1.5 ms per request on one of two shared cores) would be measured with
it. The ``gateway`` scenario measures the gateway.

Queue wait is callboard's own ``Result.queue_wait_s``: submitted to handed to
the I/O loop by the model actor (the front door, router and queue hops with it).

What must hold: every task ends (none lost, none answered twice); every
``System`` and provider process is stopped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from callboard.bench.clients import Workload
from callboard.bench.measure import Meter, Run, ScenarioResult, arrival_rate, percentiles
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.subject import bench_model, collect, one_route, results_run
from callboard.messages import Priority, Request, Result

from callboard import System

__all__ = ["FLOOD", "TENANTS", "arrivals", "run_tenants"]

NAME = "tenants"
MODEL = "shared"
OVERLOAD = 5.0
FLOOD = 20
"""A's rate over B's."""
TICK_S = 0.01
JITTER = 0.5
"""Each call takes the provider's latency +/- this share of it."""
TENANTS = ("tenant-a", "tenant-b")
LONG_MAX_TOKENS = 4096
"""B's ``max_tokens`` in ``long``."""
SKIP_S = 0.5
"""The start and end of the backlog left out of the sustained rate."""


def arrivals(total: int, flood: int = FLOOD) -> list[str]:
    """The tenant of each task in submission order: B's every ``flood + 1``-th task,
    in the middle of each run of A's, so B keeps a steady pace between A's."""
    a, b = TENANTS
    half = (flood + 1) // 2
    return [b if i % (flood + 1) == half else a for i in range(total)]


def run_tenants(opts: Options) -> ScenarioResult:
    scale = opts.scale
    conc = scale.tenants_concurrency
    capacity = conc / scale.tenants_latency_s
    rate = OVERLOAD * capacity
    total = int(rate * scale.tenants_overload_s)
    shared = arrivals(total)
    alone = [t for t in shared if t == TENANTS[0]]
    result = ScenarioResult(name=NAME)
    result.settings = {
        "concurrency": conc,
        "provider_latency_s": scale.tenants_latency_s,
        "jitter_s": JITTER * scale.tenants_latency_s,
        "capacity_per_s": capacity,
        "offered_per_s": rate,
        "flood": FLOOD,
        "overload_s": scale.tenants_overload_s,
        "tasks": total,
        "priority": Priority.NORMAL.name,
        "in_process": True,
    }
    jitter = JITTER * scale.tenants_latency_s
    with ProviderProcess(
        latency_s=scale.tenants_latency_s, jitter_s=jitter, seed=opts.seed
    ) as prov:
        run_shared, fig_shared = _overload(prov, opts, shared, rate, "shared")
        run_long, fig_long = _overload(
            prov, opts, shared, rate, "long", b_max_tokens=LONG_MAX_TOKENS
        )
        run_alone, fig_alone = _overload(prov, opts, alone, rate * FLOOD / (FLOOD + 1), "alone")
    runs = result.runs = [run_shared, run_long, run_alone]
    service = run_shared.latency.p50 if run_shared.latency.count else None
    b_wait, a_wait = fig_shared["wait_ms"][TENANTS[1]], fig_shared["wait_ms"][TENANTS[0]]
    b_long = fig_long["wait_ms"][TENANTS[1]]
    used = fig_alone["calls_per_s"]
    result.figures = {
        "service_time_ms": service,
        "b_p99_wait_ms": b_wait.p99,
        "b_p99_wait_over_service": _over(b_wait.p99, service),
        "b_long_p99_wait_ms": b_long.p99,
        "b_long_p99_wait_over_service": _over(b_long.p99, service),
        "a_p50_wait_ms": a_wait.p50,
        "a_alone_capacity_share": None if used is None else round(used / capacity, 4),
        "shared_capacity_share": None
        if fig_shared["calls_per_s"] is None
        else round(fig_shared["calls_per_s"] / capacity, 4),
        "light_rate_over_its_share": _over_share(rate / (FLOOD + 1), fig_shared["calls_per_s"]),
        "lost": fig_shared["lost"] + fig_long["lost"] + fig_alone["lost"],
        "duplicated": sum(run.duplicated or 0 for run in runs),
        "shared": fig_shared,
        "long": fig_long,
        "alone": fig_alone,
    }
    return result


def _over(wait_ms: float | None, service_ms: float | None) -> float | None:
    return None if service_ms is None or wait_ms is None else round(wait_ms / service_ms, 3)


def _over_share(light_rate: float, calls_per_s: float | None) -> float | None:
    """B's arrival rate over its share of what the model served (half: two tenants of
    equal weight). Near 1 or above, B is not light on this machine: it queues behind
    its own tasks, as fairness (a share, not precedence) says it should."""
    return None if not calls_per_s else round(light_rate / (calls_per_s / 2), 3)


def _overload(
    prov: ProviderProcess,
    opts: Options,
    tenants: Sequence[str],
    rate: float,
    label: str,
    *,
    b_max_tokens: int | None = None,
) -> tuple[Run, dict[str, Any]]:
    """One overload (tasks arriving at ``rate``, tenant ``tenants[i]``; B's asking
    ``b_max_tokens``, if given) and its drain, on a fresh system."""
    scale = opts.scale
    conc, total = scale.tenants_concurrency, len(tenants)
    capacity = conc / scale.tenants_latency_s
    model = bench_model(MODEL, prov.base_url, conc)
    work = Workload(base_url=prov.base_url, model=MODEL, tasks=total, concurrency=conc)
    with System(one_route((model,), total)) as system:
        prov.reset_stats()
        with Meter() as meter:
            futures = _drive(system, work, tenants, rate, b_max_tokens or work.max_tokens)
            results, lost = collect(futures, total / capacity + 60.0)
    server = prov.stats()
    run = results_run(work, results, lost, meter, scenario=NAME, label=label)
    run.take_server(server)
    waits: dict[str, list[float]] = {t: [] for t in TENANTS if t in tenants}
    for tenant, future in zip(tenants, futures, strict=True):
        if future.done() and not future.cancelled() and future.result().attempts:
            waits[tenant].append(future.result().queue_wait_s)
    calls = server["models"].get(MODEL, {}).get("arrivals", [])
    return run, {
        "tasks": {t: tenants.count(t) for t in waits},
        "wait_ms": {t: percentiles(w) for t, w in waits.items()},
        "calls_per_s": arrival_rate(sorted(calls), SKIP_S, SKIP_S),
        "lost": lost,
    }


def _drive(
    system: System, work: Workload, tenants: Sequence[str], rate: float, b_max_tokens: int
) -> list[Future[Result]]:
    """Submit ``tenants``' tasks at ``rate`` per second, a burst per tick, B's asking
    ``b_max_tokens``; the futures in submission order."""
    per_tick = max(1, round(rate * TICK_S))
    futures: list[Future[Result]] = []
    t0 = time.monotonic()
    for tick, first in enumerate(range(0, len(tenants), per_tick)):
        time.sleep(max(0.0, t0 + tick * TICK_S - time.monotonic()))
        burst = range(first, min(len(tenants), first + per_tick))
        requests = [
            Request.of(
                work.prompt(i),
                priority=Priority.NORMAL,
                max_tokens=b_max_tokens if tenants[i] == TENANTS[1] else work.max_tokens,
                budget_tag=tenants[i],
            )
            for i in burst
        ]
        futures += system.submit_many(requests)
    return futures
