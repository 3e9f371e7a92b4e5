"""Driving callboard itself: a ``System`` on the provider process, tasks in bursts.

``Submitter`` sends a workload through ``System.submit_many`` in bursts of
``Request`` objects with mixed priorities (task ``i`` has priority
``i mod 4`` unless told otherwise) and remembers when each burst went in;
``results_run`` turns the futures into a ``Run``.

``thread_cpu_s`` reads the CPU each live thread has used, by kind
(``ModelActor``, ``callboard-io``, ``MainThread``...): ``run_callboard`` keeps
the measured part's share of each, per task, in ``run.extra["cpu_ms_by_thread"]``,
so a run says which hop a call's CPU went to.

Figures taken from the results: service latency is dispatch to the answer in
the caller's hands (what the baselines call latency: their clock stops when
the parsed answer is in the coroutine that asked), end-to-end is submission
to the same; ``run_callboard`` stamps each future as it resolves (the result
on its way from the actors to the caller, 1.6 ms p50 and 7.5 ms p95 at C200,
was left out: found by a review), and a task's submission is placed within
its burst's ``submit_many`` call; where nothing stamps the futures,
``latency_s - queue_wait_s`` and ``latency_s`` (stamped as the actors end the
task). Queue wait is grouped by priority. ``lost`` is a future not resolved
within the time cap plus any accepted task the ledger has not finished;
``duplicated`` is a task id answered more than once.

What must hold: every ``System`` made here is stopped by its ``with`` block;
the measured section starts after start-up and warm-up.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import re
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from callboard.actors.base import CrashPlan
from callboard.bench.clients import Workload
from callboard.bench.measure import BENCH_KEY, BENCH_PRICE, Meter, Percentiles, Run, percentiles
from callboard.core.secret import Secret
from callboard.core.settings import ModelSettings
from callboard.messages import Completed, Priority, Request, Result, TaskFuture

from callboard import SchedulerSettings, System, SystemConfig

__all__ = [
    "BreakerWatch",
    "Burst",
    "Submitter",
    "bench_model",
    "collect",
    "one_route",
    "quiet",
    "results_run",
    "run_callboard",
    "thread_cpu_s",
    "warm_up",
]

PRIORITY_CYCLE = tuple(Priority)


def bench_model(name: str, base_url: str, concurrency: int, **overrides: Any) -> ModelSettings:
    """A model on the provider process, priced like the baselines, with the bench's key."""
    return ModelSettings(
        name=name,
        base_url=base_url,
        max_concurrency=concurrency,
        price=BENCH_PRICE,
        api_key=Secret(BENCH_KEY),
        **overrides,
    )


def one_route(models: tuple[ModelSettings, ...], tasks: int) -> SystemConfig:
    """Every task may go to every model (one route over all of them), with queue room
    for twice ``tasks``."""
    return SystemConfig(
        models=models,
        default_route=tuple(m.name for m in models),
        scheduler=SchedulerSettings(capacity=max(100_000, 2 * tasks)),
    )


@dataclass(frozen=True, slots=True)
class Burst:
    """One ``submit_many`` call: which tasks, and the clock around it."""

    first: int
    """Index (in submission order) of the burst's first task."""
    count: int
    began: float
    """``time.monotonic()`` before the call (callboard stamps tasks on that clock)."""
    ended: float


@dataclass(slots=True)
class Submitter:
    """Submits tasks in bursts and keeps the futures in submission order."""

    system: Any
    """A running ``callboard.System``."""
    work: Workload
    priority_of: Callable[[int], Priority] = lambda i: PRIORITY_CYCLE[i % 4]
    futures: list[TaskFuture] = field(default_factory=list)
    bursts: list[Burst] = field(default_factory=list)
    stamped: bool = False
    """Stamp each future as it resolves (``resolved``), for ``in_hand``."""
    resolved: list[float] = field(default_factory=list)
    """``time.monotonic()`` as each future resolved (NaN: not yet, or not stamped)."""

    def submit(self, indices: Sequence[int]) -> None:
        """Submit the tasks ``indices`` (workload task numbers) as one burst."""
        work = self.work
        requests = [
            Request.of(work.prompt(i), priority=self.priority_of(i), max_tokens=work.max_tokens)
            for i in indices
        ]
        began = time.monotonic()
        futures = self.system.submit_many(requests)
        ended = time.monotonic()
        first = len(self.futures)
        self.bursts.append(Burst(first, len(requests), began, ended))
        self.futures += futures
        if self.stamped:
            self.resolved += [math.nan] * len(futures)
            for k, future in enumerate(futures, first):  # stamped as the result is handed
                future.on_done(functools.partial(self._stamp, k))  # over, on that thread

    def _stamp(self, k: int, _: object) -> None:
        self.resolved[k] = time.monotonic()

    def in_hand(self) -> tuple[list[float], list[float]]:
        """Each completed task's service latency and end-to-end latency, to the
        answer in the caller's hands (``stamped``; see the module docstring)."""
        service: list[float] = []
        end_to_end: list[float] = []
        for burst in self.bursts:
            step = (burst.ended - burst.began) / burst.count
            for j in range(burst.count):
                k = burst.first + j
                future, at = self.futures[k], self.resolved[k]
                if math.isnan(at) or not future.done() or future.cancelled():
                    continue
                result = future.result()
                if isinstance(result, Completed):
                    total = at - (burst.began + (j + 0.5) * step)
                    end_to_end.append(total)
                    service.append(total - result.queue_wait_s)
        return service, end_to_end

    def submit_range(self, start: int, stop: int, burst: int) -> None:
        for first in range(start, stop, burst):
            self.submit(range(first, min(stop, first + burst)))


def warm_up(system: Any, work: Workload, timeout: float = 30.0) -> None:
    """Open the connections: ``work.warmup`` tasks, waited for, not measured.

    In two steps (half, then all), so that no more than half the connections
    are opened at once: the provider's listen backlog is 128, and a dropped
    SYN costs a one-second retransmit.
    """
    done = 0
    for size in (work.warmup // 2, work.warmup):
        if size:
            sub = Submitter(system, work)
            sub.submit_range(done, done + size, size)
            wait(sub.futures, timeout=timeout)
            done += size


def collect(futures: Sequence[Future[Result]], timeout: float) -> tuple[list[Result], int]:
    """The results that arrived within ``timeout``, and how many did not."""
    done, pending = wait(futures, timeout=timeout)
    return [f.result() for f in futures if f in done], len(pending)


def results_run(
    work: Workload,
    results: Sequence[Result],
    lost: int,
    meter: Meter,
    *,
    scenario: str,
    system_name: str = "callboard",
    label: str = "",
    in_hand: tuple[list[float], list[float]] | None = None,
) -> Run:
    """A ``Run`` from callboard's results (see the module docstring for each figure);
    ``in_hand``: the service and end-to-end latencies ``Submitter.in_hand`` gives."""
    done = [r for r in results if isinstance(r, Completed)]
    ids = Counter(r.task_id for r in results)
    prompt = sum(r.usage.prompt_tokens for r in done)
    completion = sum(r.usage.completion_tokens for r in done)
    return Run(
        scenario=scenario,
        system=system_name,
        label=label,
        concurrency=work.concurrency,
        tasks=len(results) + lost,
        ok=len(done),
        failed=len(results) - len(done),
        wall_s=meter.wall_s,
        cpu_s=meter.cpu_s,
        latency=percentiles(
            (r.latency_s - r.queue_wait_s for r in done) if in_hand is None else in_hand[0]
        ),
        end_to_end=percentiles((r.latency_s for r in done) if in_hand is None else in_hand[1]),
        queue_wait=_queue_waits(results),
        lost=lost,
        duplicated=sum(n - 1 for n in ids.values()),
        prompt_tokens=prompt,
        completion_tokens=completion,
        cost_nusd=sum(r.cost_nusd for r in results),
        extra={
            "outcomes": dict(Counter(type(r).__name__ for r in results)),
            "calls_sent": sum(r.attempts for r in results),
            "by_model": dict(Counter(r.model or "-" for r in results)),
        },
    )


def _queue_waits(results: Sequence[Result]) -> dict[str, Percentiles]:
    """Queue wait by priority, over the tasks that were dispatched at least once."""
    waits: dict[str, list[float]] = defaultdict(list)
    for r in results:
        if r.attempts:
            waits[r.priority.name].append(r.queue_wait_s)
    return {p.name: percentiles(waits[p.name]) for p in Priority if p.name in waits}


def run_callboard(
    config: SystemConfig,
    work: Workload,
    *,
    scenario: str,
    system_name: str = "callboard",
    label: str = "",
    burst: int = 100,
    on_start: Callable[[], object] | None = None,
    crash_plan: CrashPlan | None = None,
    inspect: Callable[[System], dict[str, Any]] | None = None,
) -> Run:
    """Start a ``System``, warm it up, measure ``work`` through it, stop it.

    ``inspect`` runs on the live system after the results (ledger counts,
    supervision...); what it returns goes into ``run.extra``.
    """
    with System(config, crash_plan=crash_plan) as system:
        warm_up(system, work)
        sub = Submitter(system, work, stamped=True)
        gc.collect()
        if on_start is not None:
            on_start()
        before = thread_cpu_s()
        with Meter() as meter:
            sub.submit_range(work.warmup, work.warmup + work.tasks, burst)
            results, lost = collect(sub.futures, work.time_cap_s)
        spent = _per_task_ms(before, thread_cpu_s(), work.tasks)
        seen = inspect(system) if inspect is not None else {}
    run = results_run(
        work,
        results,
        lost,
        meter,
        scenario=scenario,
        system_name=system_name,
        label=label,
        in_hand=sub.in_hand(),
    )
    run.extra |= seen
    if spent:
        run.extra["cpu_ms_by_thread"] = spent
    return run


_NUMBERED = re.compile(r"-\d+$")


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) the live threads of this process have used, summed
    by kind: a thread's name without its number (``ModelActor-2`` and ``ModelActor-7``
    are ``ModelActor``). Read from ``/proc`` (Linux, in clock ticks); empty elsewhere."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    used: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text("ascii")
            fields = stat.rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # not Linux, or the thread has just ended
            continue
        kind = _NUMBERED.sub("", thread.name)
        used[kind] = used.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return used


def _per_task_ms(before: dict[str, float], after: dict[str, float], tasks: int) -> dict[str, float]:
    """What each kind of thread spent between two ``thread_cpu_s`` readings, in
    milliseconds per task (threads that ended between them are not counted)."""
    if not tasks:
        return {}
    return {
        kind: round(1e3 * (cpu - before.get(kind, 0.0)) / tasks, 4)
        for kind, cpu in sorted(after.items(), key=lambda kv: -kv[1])
    }


class BreakerWatch(logging.Handler):
    """Counts breaker openings, from the model actors' ``"<model>: breaker open"`` warnings.

    Use as a context manager around a run; ``openings`` maps model -> count.
    While it watches, those warnings go to it only (expected, and counted).
    """

    LOGGER = "callboard.actors.model"

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.openings: Counter[str] = Counter()
        self._propagate = True

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.endswith(": breaker open"):
            self.openings[text.removesuffix(": breaker open")] += 1

    def __enter__(self) -> BreakerWatch:
        logger = logging.getLogger(self.LOGGER)
        logger.addHandler(self)
        self._propagate, logger.propagate = logger.propagate, False
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.propagate = self._propagate


@contextmanager
def quiet(*loggers: str, level: int = logging.CRITICAL) -> Iterator[None]:
    """Raise these loggers' level for the block (expected noise: injected crashes)."""
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in loggers]
    for logger, _ in saved:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in saved:
            logger.setLevel(old)
