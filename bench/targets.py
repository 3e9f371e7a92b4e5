"""The targets the report compares against, each judged PASS or MISS (never asserted).

A ``Target`` names a figure, the bound it must meet and the value measured;
``passed`` is None when the figure was not measured in this run (scenario or
baseline not selected, LiteLLM not installed). Performance targets come from
the issue; correctness checks (nothing lost or doubled, no inversion, no
failure under an outage) are listed with them so one table tells all.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from callboard.bench.measure import ScenarioResult

__all__ = ["Target", "evaluate"]

Compare = Callable[[float, float], bool]


@dataclass(frozen=True, slots=True)
class Target:
    scenario: str
    name: str
    goal: str
    """The bound, as the report prints it (``>= 0.90``)."""
    value: float | None
    passed: bool | None
    kind: str = "performance"
    """``performance`` (a target from the issue), ``correctness`` (an invariant), or
    ``check`` (the bench's own expectation: outage timings and fallback share)."""

    @property
    def verdict(self) -> str:
        return "n/a" if self.passed is None else "PASS" if self.passed else "MISS"


Row = tuple[str, Any, float | None, Compare, str]
"""A judge's row: the target's name, the value measured, the bound, the comparison, the kind."""
PERF, CORRECT, CHECK = "performance", "correctness", "check"
GE, LE, EQ = operator.ge, operator.le, operator.eq


def _target(scenario: str, row: Row) -> Target:
    """The target; n/a when the value or the bound (a measured one) is unknown."""
    name, value, bound, op, kind = row
    symbol = ">=" if op is GE else "<=" if op is LE else "=="
    goal = f"{symbol} {'(not measured)' if bound is None else f'{bound:g}'}"
    if value is None or bound is None:
        return Target(scenario, name, goal, None, None, kind)
    number = float(value)
    return Target(scenario, name, goal, number, bool(op(number, bound)), kind)


def evaluate(results: Mapping[str, ScenarioResult], baselines: list[str]) -> list[Target]:
    out: list[Target] = []
    for scenario, judge in _JUDGES.items():
        if scenario in results:
            out += [_target(scenario, row) for row in judge(results[scenario], baselines)]
    return out


def _row(result: ScenarioResult, baselines: list[str], label: str) -> dict[str, Any]:
    for row in result.rows(baselines):
        if row["system"] == "callboard" and row["label"] == label:
            return row
    return {"ratio": {}, "cpu_delta_ms": {}}


def _steady(result: ScenarioResult, baselines: list[str]) -> list[Row]:
    """Issue 18's targets: at 50 in flight >= 0.95x raw aiohttp; at 200 >= 0.95x the
    same transport without actors (``httpx-aiohttp``) and >= 0.85x raw aiohttp, a p95
    service latency within 1.25x the bare transport's, and no more than 0.08 ms of CPU
    a call over it. (The bench issue's looser bounds, 0.85x and 0.70x raw aiohttp and
    0.15 ms over the bare transport, stand where issue 18 sets none.)"""
    out: list[Row] = []
    for c, raw, bare, cpu in (("C50", 0.95, 0.90, 0.15), ("C200", 0.85, 0.95, 0.08)):
        row = _row(result, baselines, c)
        ratio, delta = row["ratio"], row["cpu_delta_ms"]
        out += [
            (f"{c} throughput / httpx-aiohttp", ratio.get("httpx-aiohttp"), bare, GE, PERF),
            (f"{c} CPU ms/req over httpx-aiohttp", delta.get("httpx-aiohttp"), cpu, LE, PERF),
            (f"{c} throughput / aiohttp", ratio.get("aiohttp"), raw, GE, PERF),
            (f"{c} throughput / litellm", ratio.get("litellm"), 10.0, GE, PERF),
        ]
    p95 = _p95_over(result, baselines, "C200", "httpx-aiohttp")
    out.append(("C200 p95 service latency / httpx-aiohttp", p95, 1.25, LE, PERF))
    return out


def _p95_over(result: ScenarioResult, baselines: list[str], label: str, base: str) -> float | None:
    """callboard's p95 service latency over baseline ``base``'s, at ``label``, paired
    by round as throughput is (None when either was not measured)."""
    if base not in baselines:
        return None
    ratio: float | None = _row(result, baselines, label).get("p95_ratio", {}).get(base)
    return ratio


def _outage(result: ScenarioResult, _baselines: list[str]) -> list[Row]:
    f = result.figures
    during = f.get("phases", {}).get("during", {})
    return [
        ("failed tasks", f.get("failed"), 0, EQ, CORRECT),
        ("lost tasks", f.get("lost"), 0, EQ, CORRECT),
        ("breaker opened (s after start)", f.get("time_to_open_s"), 1.0, LE, CHECK),
        ("breaker closed (s after end)", f.get("time_to_close_s"), 2.0, LE, CHECK),
        ("share served by fallback, during", during.get("backup_share"), 0.5, GE, CHECK),
    ]


def _priority(result: ScenarioResult, _baselines: list[str]) -> list[Row]:
    f = result.figures
    service = f.get("service_time_ms")  # None when no call was served: no bound, n/a
    bound = None if service is None else float(service)
    return [
        ("CRITICAL p99 queue wait ms", f.get("critical_p99_wait_ms"), bound, LE, PERF),
        ("inversions (all models)", f.get("inversions_total"), 0, EQ, CORRECT),
        ("lost tasks", f.get("lost"), 0, EQ, CORRECT),
    ]


def _tenants(result: ScenarioResult, _baselines: list[str]) -> list[Row]:
    f = result.figures
    service = f.get("service_time_ms")  # None when no call was served: no bound, n/a
    bound = None if service is None else float(service)
    return [
        ("light tenant's p99 queue wait ms", f.get("b_p99_wait_ms"), bound, LE, PERF),
        (
            "light tenant's p99 queue wait ms, its max_tokens 128x",
            f.get("b_long_p99_wait_ms"),
            bound,
            LE,
            PERF,
        ),
        (
            "flooding tenant alone: share of capacity",
            f.get("a_alone_capacity_share"),
            0.95,
            GE,
            PERF,
        ),
        ("lost tasks", f.get("lost"), 0, EQ, CORRECT),
        ("duplicated results", f.get("duplicated"), 0, EQ, CORRECT),
    ]


def _gateway(result: ScenarioResult, _baselines: list[str]) -> list[Row]:
    """Issue 16's targets at C50 and C200; the other levels (C10) the same bounds, as
    checks: the issue sets none there."""
    out: list[Row] = []
    for label, f in result.figures.items():
        kind = PERF if label in ("C50", "C200") else CHECK
        out += [
            (f"{label} added p50 latency ms", f.get("added_p50_ms"), 1.0, LE, kind),
            (f"{label} throughput / direct", f.get("throughput_ratio"), 0.80, GE, kind),
            (f"{label} failed requests", f.get("failed"), 0, EQ, CORRECT),
        ]
        # the same bounds for the hop alone (can any gateway?) and for the peer, if it ran
        out += _beside(label, "bare proxy", f.get("proxy", {}))
        if "litellm" in f:
            out += _beside(label, "LiteLLM proxy", f["litellm"])
            out.append(
                (
                    f"{label} gateway throughput / LiteLLM proxy",
                    f["over_litellm"].get("throughput_ratio"),
                    1.0,
                    GE,
                    CHECK,
                )
            )
    return out


def _beside(label: str, name: str, f: dict[str, Any]) -> list[Row]:
    """The gateway's two bounds, as checks, for another proxy run beside it."""
    return [
        (f"{label} {name}: added p50 ms", f.get("added_p50_ms"), 1.0, LE, CHECK),
        (f"{label} {name}: throughput / direct", f.get("throughput_ratio"), 0.80, GE, CHECK),
    ]


def _streaming(result: ScenarioResult, _baselines: list[str]) -> list[Row]:
    f = result.figures
    over = f.get("overhead_ms", {})
    return [
        ("TTFT p50 overhead ms over aiohttp", over.get("p50"), 1.0, LE, PERF),
        ("TTFT p99 overhead ms over aiohttp", over.get("p99"), 5.0, LE, PERF),
        ("tokens/s delivered / aiohttp", f.get("tokens_per_s_ratio"), 0.90, GE, PERF),
        ("failed streams", f.get("failed"), 0, EQ, CORRECT),
        ("streams short of tokens", f.get("short_streams"), 0, EQ, CORRECT),
    ]


def _cluster(result: ScenarioResult, _baselines: list[str]) -> list[Row]:
    """Issue 17's targets: the shared limit kept across client processes, a CRITICAL
    task's p99 wait within one service time, the Ray path's added p50 within 2 ms, and
    nothing lost or doubled when the model actor is killed."""
    f = result.figures
    shared, urgent, crash = f.get("shared", {}), f.get("priority", {}), f.get("crash", {})
    added = f.get("overhead", {}).get("added_p50_ms")
    return [
        ("server 429s, 4 processes sharing a limit", shared.get("server_429s"), 0, EQ, PERF),
        ("combined rate / limit", shared.get("rate_over_limit"), 0.95, GE, PERF),
        ("CRITICAL p99 queue wait / service time", urgent.get("p99_over_service"), 1.0, LE, PERF),
        ("added p50 ms, Ray path over local", added, 2.0, LE, PERF),
        ("lost tasks, model actor killed", crash.get("lost"), 0, EQ, CORRECT),
        ("tasks not completed, model actor killed", crash.get("not_completed"), 0, EQ, CORRECT),
        ("duplicated results, model actor killed", crash.get("duplicated"), 0, EQ, CORRECT),
    ]


TRACKED_PER_TASK = 5.5
"""What the collector walks per queued task: the caller's future, the request, the task,
its job, the queue entry (5: the future makes its lock only when somebody waits on it, a
request of a bare prompt holds no message and no messages tuple; the backlog reports them
by type). The collector's share of the backlog figure scales with it."""

Judge = Callable[[ScenarioResult, list[str]], list[Row]]


def _figures(*rows: tuple[str, str, float, Compare, str]) -> Judge:
    """A judge of scenario figures: (target name, figure key, bound, comparison, kind)."""
    return lambda result, _baselines: [
        (name, result.figures.get(key), bound, op, kind) for name, key, bound, op, kind in rows
    ]


_JUDGES: dict[str, Judge] = {
    "steady": _steady,
    "rate-limited": _figures(
        ("server 429s", "server_429", 0, EQ, PERF),
        ("achieved / limit", "achieved_over_limit", 0.95, GE, PERF),
    ),
    "misconfigured-limit": _figures(
        ("tasks completed / tasks", "ok_ratio", 1.0, GE, CORRECT),
        ("server 429s / task", "server_429_per_task", 0.10, LE, PERF),
        ("achieved / real limit, after the start", "achieved_over_limit", 0.90, GE, PERF),
    ),
    "dead-provider": _figures(
        ("tasks never ended", "unended", 0, EQ, CORRECT),
        ("last task ended, s after give_up_s", "ended_after_give_up_s", 2.0, LE, PERF),
        ("CPU share while the breaker is open", "open_cpu_share", 0.02, LE, PERF),
        ("memory growth while open, KiB", "open_rss_growth_kib", 1024, LE, PERF),
    ),
    "faulty": _figures(
        ("success ratio", "success_ratio", 1.0, GE, PERF),
        ("calls sent / task", "server_calls_per_task", 1.12, LE, PERF),
    ),
    "outage": _outage,
    "priority": _priority,
    "backlog": _figures(
        ("system user CPU/task, max/min n, collector out", "system_flatness", 1.2, LE, PERF),
        ("system page faults/task, 10^6/10^5", "page_faults_flatness_from_1e5", 1.2, LE, CHECK),
        (
            "system CPU/task with collector, 10^6/10^5",
            "system_flatness_with_collector_from_1e5",
            1.2,
            LE,
            CHECK,
        ),
        (
            "tracked objects per queued task",
            "tracked_objects_per_task",
            TRACKED_PER_TASK,
            LE,
            CHECK,
        ),
        ("queue core CPU/task, largest / smallest n", "core_flatness", 1.2, LE, PERF),
        ("bytes per queued task (traced)", "bytes_per_task", 1024, LE, PERF),
    ),
    "crash": _figures(
        ("lost tasks", "lost", 0, EQ, CORRECT),
        ("duplicated results", "duplicated", 0, EQ, CORRECT),
    ),
    "streaming": _streaming,
    "tenants": _tenants,
    "gateway": _gateway,
    "cluster": _cluster,
    "redaction": _figures(
        ("CPU an answer, 1,000 keys / 1 key", "answer_flatness", 5.0, LE, PERF),
        ("CPU a streamed delta, 1,000 keys / 1 key", "delta_flatness", 3.0, LE, PERF),
        ("CPU s, 1.6 MB repeating 100 keys' public start", "hostile_cpu_s", 1.0, LE, PERF),
    ),
    "embeddings": _figures(
        ("texts/s / aiohttp", "throughput_ratio", 0.90, GE, PERF),
        ("texts without a vector", "failed_texts", 0, EQ, CORRECT),
        ("vectors wrong or out of order (sampled)", "vectors_wrong", 0, EQ, CORRECT),
    ),
}
