"""Scenario ``backlog``: what a queued task costs, from 10^3 to 10^6 of them.

Two views:

- the queue core (``callboard.core.pqueue.TaskQueue``): push n tasks (mixed
  priorities, arrival order) then pop them all in batches of 64; user CPU per
  task (``getrusage``, median over at least three repetitions), the kernel's
  CPU beside it (see below), and memory per task (``tracemalloc``, the queue's
  own bookkeeping plus the task's key); beside it, the same fill and drain
  through a bare dict and deque (the floor: what the memory hierarchy alone
  adds as n grows);
- the whole system: a ``System`` whose only model takes one call at a time
  from a provider that answers after ``SLOW_S``, so what is submitted stays
  queued. CPU per task from the first ``submit_many`` until the queue actor
  holds every task (front door, router and queue included); memory per task
  with ``tracemalloc`` in a separate pass (it slows everything down), beyond
  the prompt strings, which exist before the measured section and are shared,
  not copied; resident memory (RSS) growth per task as a cross-check. The traced pass also
  counts the objects the collector tracks per task, by type (what a queued task
  holds: its future, request, task and job, the queue's entry).

"Flat" means per-task user CPU at the largest n within 20% of that at the
smallest. The whole-system figure is split three ways: the CPU inside
CPython's cyclic collector during the timed section (each collection timed
on its own thread: ``gc.callbacks``, ``time.thread_time``); the kernel's CPU,
nearly all page faults for fresh memory, reported with the faults per task
and the cost per fault; and the rest of the user CPU, callboard's own work,
which must stay flat. Faults per task and tracked objects per task are what
callboard controls (through its bytes and objects per task); what a fault or
a full collection costs, and why both are near zero at 10^3, is explained in
docs/bench.md. The collector is neither switched off nor tuned. The queue
core is split alike.

What must hold: every ``System`` is stopped (queued tasks end ``Cancelled``),
tracemalloc is stopped and the collector callback removed whatever happens.
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
import tracemalloc
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

from callboard.actors.base import QUEUE
from callboard.bench.measure import ScenarioResult
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.subject import bench_model
from callboard.core.pqueue import TaskQueue
from callboard.messages import GetState, Priority

from callboard import SchedulerSettings, System, SystemConfig

__all__ = ["run_backlog"]

NAME = "backlog"
MODEL = "backlog"
SLOW_S = 0.3
CHUNK = 1000
"""Tasks per ``submit_many`` call."""
POP_BATCH = 64
MIN_TASKS_TIMED = 50_000
"""Small sizes are repeated until at least this many tasks were timed."""
MAX_REPEATS = 20
MIN_REPEATS = 3
"""Even the largest core size is timed this often (median taken)."""
SMALL = 10_000
"""System sizes up to this are repeated (``Scale.backlog_repeats``)."""
TOP_SITES = 12
"""Allocation sites reported per traced size."""
TOP_TYPES = 8
"""Types of tracked objects reported per traced size."""
ASK_S = 30.0
"""The most the queue actor may take to answer how many tasks it holds."""


def run_backlog(opts: Options) -> ScenarioResult:
    scale = opts.scale
    result = ScenarioResult(name=NAME)
    result.settings = {
        "core_sizes": list(scale.backlog_core_sizes),
        "system_sizes": list(scale.backlog_system_sizes),
        "traced_sizes": list(scale.backlog_traced_sizes),
        "chunk": CHUNK,
        "pop_batch": POP_BATCH,
        "provider_latency_s": SLOW_S,
    }
    core = {n: _core(n) for n in scale.backlog_core_sizes}
    system: dict[int, dict[str, Any]] = {}
    with ProviderProcess(latency_s=SLOW_S, seed=opts.seed) as prov:
        for n in scale.backlog_system_sizes:
            repeats = scale.backlog_repeats if n <= SMALL else 1
            system[n] = _system_cpu(prov.base_url, n, repeats)
        for n in scale.backlog_traced_sizes:
            system.setdefault(n, {}).update(_system_memory(prov.base_url, n))
    result.figures = {
        "core": core,
        "system": system,
        "core_flatness": _flatness(core, "user_us_per_task"),
        "core_flatness_with_kernel": _flatness(core, "cpu_us_per_task"),
        "core_floor_flatness": _flatness(core, "floor_us_per_task"),
        "system_flatness": _flatness(system, "own_user_us_per_task"),
        "system_flatness_with_kernel": _flatness(system, "own_cpu_us_per_task"),
        "page_faults_flatness_from_1e5": _flatness(
            system, "page_faults_per_task", smallest=100_000
        ),
        "system_flatness_with_collector": _flatness(system, "cpu_us_per_task"),
        "system_flatness_with_collector_from_1e5": _flatness(
            system, "cpu_us_per_task", smallest=100_000
        ),
        "bytes_per_task": _largest(system, "traced_bytes_per_task"),
        "tracked_objects_per_task": _largest(system, "tracked_objects_per_task"),
    }
    return result


def _flatness(table: dict[int, dict[str, Any]], key: str, smallest: int = 0) -> float | None:
    """Per-task figure at the largest size over that at the smallest (at least ``smallest``)."""
    sizes = sorted(n for n, row in table.items() if row.get(key) and n >= smallest)
    if len(sizes) < 2:
        return None
    return float(table[sizes[-1]][key] / table[sizes[0]][key])


def _largest(table: dict[int, dict[str, Any]], key: str) -> float | None:
    sizes = sorted(n for n, row in table.items() if row.get(key) is not None)
    return None if not sizes else float(table[sizes[-1]][key])


# -- the queue core -----------------------------------------------------------


def _core(n: int) -> dict[str, Any]:
    repeats = min(MAX_REPEATS, max(MIN_REPEATS, MIN_TASKS_TIMED // n))
    samples = [(*_core_cpu(n), _floor_cpu(n)) for _ in range(repeats)]
    columns = zip(*samples, strict=True)
    push_us, pop_us, kernel_us, floor_us = (statistics.median(col) for col in columns)
    return {
        "repeats": repeats,
        "push_us_per_task": round(push_us, 3),
        "pop_us_per_task": round(pop_us, 3),
        "user_us_per_task": round(push_us + pop_us, 3),
        "kernel_us_per_task": round(kernel_us, 3),
        "cpu_us_per_task": round(push_us + pop_us + kernel_us, 3),
        "floor_us_per_task": round(floor_us, 3),
        "traced_bytes_per_task": round(_core_memory(n), 1),
    }


def _floor_cpu(n: int) -> float:
    """The same fill and drain through the least a cancellable FIFO needs (a dict of
    live entries and a deque), timed alike: how per-task cost grows from memory
    alone once n entries no longer fit in the caches. Not a queue: no priorities."""
    gc.collect()
    u0 = _usage()
    live: dict[int, tuple[int, int, float]] = {}
    order: deque[tuple[int, int, float]] = deque()
    for i in range(n):
        entry = (i, i, i * 1e-6)
        live[i] = entry
        order.append(entry)
    while order:
        entry = order.popleft()
        if live.get(entry[0]) is entry:
            del live[entry[0]]
    return (_usage().user - u0.user) / n * 1e6


def _fill(n: int) -> TaskQueue[int]:
    queue: TaskQueue[int] = TaskQueue(capacity=n, aging_step_s=10.0, epoch=0.0)
    cands = (MODEL,)
    for i in range(n):
        queue.push(i, i, priority=(i * 7) % 4, candidates=cands, arrival=i * 1e-6)
    return queue


def _core_cpu(n: int) -> tuple[float, float, float]:
    """User CPU per task of the fill and of the drain, and the kernel's for both (us)."""
    gc.collect()
    u0 = _usage()
    queue = _fill(n)
    u1 = _usage()
    now = n * 1e-6
    while len(queue):
        queue.pop_for(MODEL, now, POP_BATCH)
    u2 = _usage()
    return (
        (u1.user - u0.user) / n * 1e6,
        (u2.user - u1.user) / n * 1e6,
        (u2.kernel - u0.kernel) / n * 1e6,
    )


def _core_memory(n: int) -> float:
    gc.collect()
    with _traced() as used:
        before = used()
        queue = _fill(n)
        grown = used() - before
    del queue
    return grown / n


@contextmanager
def _traced() -> Iterator[Callable[[], int]]:
    """tracemalloc on for the block; yields a function reading the traced bytes."""
    tracemalloc.start()
    try:
        yield lambda: tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


# -- the whole system ---------------------------------------------------------


def _config(base_url: str, n: int) -> SystemConfig:
    return SystemConfig(
        models=(bench_model(MODEL, base_url, 1),), scheduler=SchedulerSettings(capacity=n + CHUNK)
    )


def _prompts(n: int) -> list[str]:
    return [f"backlog task {i}: summarise ticket #{i} in one line." for i in range(n)]


def _submit_all(system: System, prompts: list[str]) -> list[Any]:
    futures: list[Any] = []
    for k, first in enumerate(range(0, len(prompts), CHUNK)):
        chunk = prompts[first : first + CHUNK]
        futures += system.submit_many(chunk, priority=Priority(k % 4), max_tokens=16)
    return futures


def _wait_queued(system: System, n: int, timeout: float = 600.0) -> None:
    """Until every one of ``n`` tasks is routed and in the queue actor (waiting
    there, or handed on to the model).

    The ledger counts a task routed when it is handed on, before the queue has
    taken it: at 10^3 (one ``Enqueue``) the queue's whole share of the work came after
    that, outside the measured span, while at 10^5 most of it fell inside. So the ledger
    is watched until nothing is routing, then the queue is asked (once, as a rule: its
    mailbox is behind the last ``Enqueue`` by then) until it has taken all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = system.ledger.counts()
        if c.accepted >= n and c.routing == 0:
            break
        time.sleep(0.002)
    while time.monotonic() < deadline:
        queue = system.book.resolve(QUEUE)  # None while it restarts: ask again
        if queue is not None:
            state = cast(dict[str, Any], queue.ask(GetState(), timeout=ASK_S))
            if state["waiting"] + state["dispatched"] >= n:
                return
        time.sleep(0.002)
    raise TimeoutError(f"{n} tasks were not all queued within {timeout} s")


class _CollectorTime:
    """CPU seconds spent in the cyclic collector while installed, and full collections.

    ``seconds`` is the collecting thread's CPU from the collector's start to
    its stop: what is taken out of callboard's figure. ``process_seconds`` is
    the whole process's CPU over the same spans, reported beside it; it is not
    taken out, because it also holds other threads' work (the callbacks are
    Python code, so the GIL may change hands around a collection).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.process_seconds = 0.0
        self.full = 0
        self._began: dict[int, tuple[float, float]] = {}

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        me = threading.get_ident()  # a collection starts and stops on one thread
        if phase == "start":
            self._began[me] = (time.thread_time(), time.process_time())
            return
        began = self._began.pop(me, None)
        if began is not None:
            self.seconds += time.thread_time() - began[0]
            self.process_seconds += time.process_time() - began[1]
        if info.get("generation") == 2:
            self.full += 1


@contextmanager
def _collector_time() -> Iterator[_CollectorTime]:
    meter = _CollectorTime()
    gc.callbacks.append(meter)
    try:
        yield meter
    finally:
        gc.callbacks.remove(meter)


def _system_cpu(base_url: str, n: int, repeats: int) -> dict[str, Any]:
    rows: list[dict[str, float]] = []
    full, rss = [], []
    for _ in range(repeats):
        prompts = _prompts(n)
        with System(_config(base_url, n)) as system:
            gc.collect()
            with _collector_time() as gct:
                r0, u0 = _rss_bytes(), _usage()
                futures = _submit_all(system, prompts)
                _wait_queued(system, n)
                u1, r1 = _usage(), _rss_bytes()
            used = _Usage(u1.user - u0.user, u1.kernel - u0.kernel, u1.faults - u0.faults)
            rows.append(
                {
                    "cpu": (used.user + used.kernel) / n * 1e6,
                    "collector": gct.seconds / n * 1e6,
                    "process_in_collections": gct.process_seconds / n * 1e6,
                    "kernel": used.kernel / n * 1e6,
                    "faults": used.faults / n,
                }
            )
            full.append(gct.full)
            if r0 is not None and r1 is not None:
                rss.append((r1 - r0) / n)
            system.stop(cancel=True, timeout=60.0)
        del futures

    def median(key: str, digits: int = 3) -> float:
        return round(statistics.median(row[key] for row in rows), digits)

    kernel, faults = median("kernel"), median("faults")
    own = median("cpu") - median("collector")
    return {
        "repeats": repeats,
        "cpu_us_per_task": median("cpu"),
        "collector_us_per_task": median("collector"),
        "process_cpu_in_collections_us_per_task": median("process_in_collections"),
        "kernel_us_per_task": kernel,
        "page_faults_per_task": faults,
        "kernel_us_per_fault": round(kernel / faults, 2) if faults >= 0.05 else None,
        "own_cpu_us_per_task": round(own, 3),
        "own_user_us_per_task": round(own - kernel, 3),
        "full_collections": statistics.median(full),
        "rss_bytes_per_task": round(statistics.median(rss), 1) if rss else None,
    }


class _Usage(NamedTuple):
    user: float
    kernel: float
    faults: int


def _usage() -> _Usage:
    """The process's user and kernel CPU seconds, and its minor page faults so far.

    ``getrusage`` where there is one (microseconds); ``os.times`` elsewhere
    (no fault count there).
    """
    try:
        import resource  # Unix only

        r = resource.getrusage(resource.RUSAGE_SELF)
    except ImportError:
        t = os.times()
        return _Usage(t.user, t.system, 0)
    return _Usage(r.ru_utime, r.ru_stime, r.ru_minflt)


def _system_memory(base_url: str, n: int) -> dict[str, Any]:
    """Traced bytes per queued task, the allocation sites that hold the most, and the
    objects the collector tracks per task, by type (counted outside the traced span,
    with no snapshot alive, so that neither counts the other)."""
    prompts = _prompts(n)
    with System(_config(base_url, n)) as system:
        gc.collect()
        kinds = _tracked_by_type()
        with _traced():
            before = tracemalloc.take_snapshot()
            futures = _submit_all(system, prompts)
            _wait_queued(system, n)
            gc.collect()  # also untracks what holds no container (CPython does so lazily)
            after = tracemalloc.take_snapshot()
        diff = after.compare_to(before, "lineno")
        grown = sum(d.size_diff for d in diff)
        top = [
            {"site": str(d.traceback[0]), "bytes_per_task": round(d.size_diff / n, 1)}
            for d in diff[:TOP_SITES]
        ]
        del before, after, diff
        gc.collect()
        grew = _tracked_by_type()
        grew.subtract(kinds)
        system.stop(cancel=True, timeout=60.0)
    del futures
    by_type = sorted(grew.items(), key=lambda kv: -kv[1])[:TOP_TYPES]
    return {
        "traced_bytes_per_task": round(grown / n, 1),
        "tracked_objects_per_task": round(grew.total() / n, 2),
        "tracked_per_task_by_type": {kind: round(count / n, 2) for kind, count in by_type},
        "top_sites": top,
    }


def _tracked_by_type() -> Counter[str]:
    """The objects the cyclic collector tracks now, counted by type name."""
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def _rss_bytes() -> int | None:
    """Resident set size of this process (Linux ``/proc``), or None elsewhere."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:  # noqa: PTH123 - a /proc read
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
