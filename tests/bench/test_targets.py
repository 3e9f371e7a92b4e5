"""The bench's targets (bench/targets.py): a target without its figure is n/a, never a
PASS or a MISS."""

from __future__ import annotations

import dataclasses

from callboard.bench.measure import ScenarioResult, percentiles
from callboard.bench.targets import Target, evaluate
from support import steady_run


def test_the_priority_target_is_na_without_a_measured_service_time() -> None:
    figures = {
        "service_time_ms": None,
        "critical_p99_wait_ms": 3.0,
        "inversions_total": 0,
        "lost": 0,
    }
    targets = evaluate({"priority": ScenarioResult(name="priority", figures=figures)}, [])
    wait = next(t for t in targets if t.name.startswith("CRITICAL"))
    assert wait.verdict == "n/a"
    assert wait.value is None


def _steady(
    callboard_ok: int, bare_ok: int, raw_ok: int, *, slow_p95: bool = False
) -> ScenarioResult:
    runs = []
    for system, ok in (
        ("callboard", callboard_ok),
        ("httpx-aiohttp", bare_ok),
        ("aiohttp", raw_ok),
    ):
        run = steady_run(system, "C200", 0, ok, conc=200)
        if slow_p95 and system == "callboard":
            run = dataclasses.replace(run, latency=percentiles([0.05] * (ok - 10) + [0.07] * 10))
        runs.append(run)
    return ScenarioResult(name="steady", runs=runs)


def _by_name(result: ScenarioResult) -> dict[str, Target]:
    return {t.name: t for t in evaluate({"steady": result}, ["httpx-aiohttp", "aiohttp"])}


def test_steady_at_200_is_judged_by_issue_18s_bounds() -> None:
    """0.95x the bare transport, 0.85x raw aiohttp: 0.9x and 0.8x miss both (the bench
    issue's looser 0.90x and 0.70x would have passed them)."""
    targets = _by_name(_steady(90, 100, 112))
    assert targets["C200 throughput / httpx-aiohttp"].goal == ">= 0.95"
    assert targets["C200 throughput / httpx-aiohttp"].verdict == "MISS"
    assert targets["C200 throughput / aiohttp"].goal == ">= 0.85"
    assert targets["C200 throughput / aiohttp"].verdict == "MISS"
    met = _by_name(_steady(96, 100, 110))
    assert met["C200 throughput / httpx-aiohttp"].verdict == "PASS"
    assert met["C200 throughput / aiohttp"].verdict == "PASS"


def test_the_p95_service_latency_is_judged_against_the_bare_transports() -> None:
    name = "C200 p95 service latency / httpx-aiohttp"
    same = _by_name(_steady(100, 100, 100))[name]
    assert (same.value, same.verdict) == (1.0, "PASS")
    slow = _by_name(_steady(100, 100, 100, slow_p95=True))[
        "C200 p95 service latency / httpx-aiohttp"
    ]
    assert slow.value == 1.4
    assert slow.verdict == "MISS"
    unmeasured = evaluate({"steady": _steady(100, 100, 100)}, ["aiohttp"])
    assert next(t for t in unmeasured if "p95" in t.name).verdict == "n/a"


def test_the_gateway_is_judged_at_c50_and_c200_and_c10_is_a_check() -> None:
    """Issue 16 sets its bounds at C50 and C200; C10 was reported as a MISS of it."""
    level = {"added_p50_ms": 4.0, "throughput_ratio": 0.9, "failed": 0}
    figures = {label: dict(level) for label in ("C10", "C50", "C200")}
    targets = evaluate({"gateway": ScenarioResult(name="gateway", figures=figures)}, [])
    kinds = {t.name: t.kind for t in targets if "added p50 latency" in t.name}
    assert kinds == {
        "C10 added p50 latency ms": "check",
        "C50 added p50 latency ms": "performance",
        "C200 added p50 latency ms": "performance",
    }


def test_the_cluster_scenario_is_judged_by_issue_17s_bounds() -> None:
    figures = {
        "shared": {"server_429s": 0, "rate_over_limit": 1.0},
        "priority": {"p99_over_service": 0.997},
        "crash": {"lost": 0, "not_completed": 0, "duplicated": 0},
        "overhead": {"added_p50_ms": 7.3},
    }
    targets = evaluate({"cluster": ScenarioResult(name="cluster", figures=figures)}, [])
    verdicts = {t.name: t.verdict for t in targets}
    assert verdicts.pop("added p50 ms, Ray path over local") == "MISS"
    assert set(verdicts.values()) == {"PASS"}
    assert len(verdicts) == 6
