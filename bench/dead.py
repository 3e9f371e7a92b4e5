"""Scenario ``dead-provider``: a model whose endpoint nothing listens on, and no fallback.

Tasks go to a loopback port with nothing behind it. The first calls fail at
once (connection refused), the breaker opens, and the rest wait. While they
wait the model must cost nothing: the process's CPU share and its resident
memory are sampled across the open stretch (from one second in to one second
before the give-up). At the breaker's ``give_up_s`` the model is given up on
and every task ends ``Failed(PROVIDER_DOWN)`` naming the refused connection.

Figures: the CPU share while open (CPU seconds per wall second, all threads),
the resident-memory growth over it, the tasks left unended, when the last one
ended (from submission) beside ``give_up_s``, and the outcomes by reason.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from concurrent.futures import wait
from pathlib import Path

from callboard.bench.measure import Run, ScenarioResult
from callboard.bench.plan import Options
from callboard.bench.subject import bench_model, quiet
from callboard.core.breaker import BreakerConfig
from callboard.messages import Failed

from callboard import System, SystemConfig

__all__ = ["run_dead_provider"]

CONCURRENCY = 50
MARGIN_S = 1.0
"""The open stretch sampled leaves this much out at each end."""
NOISY = ("callboard.actors.model", "callboard.actors.queue")
"""They warn of the breaker and the give-up: expected here."""


def run_dead_provider(opts: Options) -> ScenarioResult:
    tasks, give_up_s = opts.scale.dead_tasks, opts.scale.dead_give_up_s
    port = _dead_port()
    breaker = BreakerConfig(give_up_s=give_up_s)
    model = bench_model("dead", f"http://127.0.0.1:{port}/v1", CONCURRENCY, breaker=breaker)
    result = ScenarioResult(name="dead-provider")
    result.settings = {
        "tasks": tasks,
        "give_up_s": give_up_s,
        "port": port,
        "sampled": "1 s in to 1 s before the give-up",
    }
    with quiet(*NOISY), System(SystemConfig(models=(model,))) as system:
        began, cpu0 = time.perf_counter(), time.process_time()
        futures = system.submit_many([f"are you there {i}" for i in range(tasks)])
        time.sleep(MARGIN_S)  # the breaker opens on the first refusals
        wall_a, cpu_a, rss_a = time.perf_counter(), time.process_time(), _rss_kib()
        time.sleep(max(0.0, give_up_s - 2 * MARGIN_S))
        wall_b, cpu_b, rss_b = time.perf_counter(), time.process_time(), _rss_kib()
        done, pending = wait(futures, timeout=give_up_s + 30.0)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu0
    results = [f.result() for f in done]
    reasons = Counter(
        r.reason.value if isinstance(r, Failed) else type(r).__name__ for r in results
    )
    run = Run(scenario="dead-provider", system="callboard", concurrency=CONCURRENCY, tasks=tasks)
    run.ok, run.failed, run.wall_s, run.cpu_s = sum(r.ok for r in results), len(results), wall, cpu
    run.lost = len(pending)
    run.duplicated = len(results) - len({r.task_id for r in results})
    last_s = max((r.latency_s for r in results), default=None)
    result.runs = [run]
    result.figures = {
        "open_cpu_share": (cpu_b - cpu_a) / (wall_b - wall_a),
        "open_rss_growth_kib": rss_b - rss_a,
        "unended": len(pending),
        "last_ended_s": last_s,
        "give_up_s": give_up_s,
        "ended_after_give_up_s": None if last_s is None else last_s - give_up_s,
        "outcomes": dict(reasons),
    }
    return result


def _dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_kib() -> int:
    """This process's resident memory now, in KiB (Linux: /proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * (_PAGE_SIZE // 1024)


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
