"""The gateway scenario (bench/gateway.py): the figures pair the gateway's run with the
direct one and the bare proxy's of the same round, and a small run through a real
``callboard serve``, a real bare proxy and a real provider, each in its own process with
the load generator in a fourth, answers every request all three ways, measures the
gateway's CPU and leaves no process behind."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from callboard.bench.gateway import gateway_figures, run_gateway
from callboard.bench.measure import Percentiles, Run, ScenarioResult
from callboard.bench.plan import Options, Scale
from callboard.bench.targets import evaluate
from support import alive, cmdline, proc_stat

_OURS = ("callboard.bench.gateway", "callboard.bench.bare_proxy", "callboard.provider.server")


def _children() -> set[int]:
    """Our live child processes that the scenario starts (gateway, generator, provider)."""
    me = os.getpid()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            stat = proc_stat(pid)
            if stat and stat[1] == me and alive(pid) and any(m in cmdline(pid) for m in _OURS):
                found.add(pid)
    return found


def _run(system: str, rnd: int, *, ok: int, wall_s: float, p50: float, cpu: float | None) -> Run:
    run = Run(scenario="gateway", system=system, label="C8", tasks=ok, ok=ok, wall_s=wall_s)
    run.latency = Percentiles(count=ok, p50=p50, p95=p50 + 1, p99=p50 + 2, max=p50 + 3)
    run.round = rnd
    if cpu is not None:
        run.extra["gateway_cpu_ms_per_request"] = cpu
        run.extra["gateway_loop_cpu_ms_per_request"] = cpu / 2
    return run


def test_figures_pair_each_gateway_run_with_the_direct_and_proxy_runs_of_its_round() -> None:
    runs = [
        _run("gateway", 0, ok=100, wall_s=1.0, p50=52.0, cpu=1.5),
        _run("proxy", 0, ok=100, wall_s=0.8, p50=51.5, cpu=None),
        _run("aiohttp", 0, ok=100, wall_s=0.5, p50=51.0, cpu=None),
        _run("aiohttp", 1, ok=100, wall_s=1.0, p50=60.0, cpu=None),
        _run("proxy", 1, ok=100, wall_s=1.0, p50=60.5, cpu=None),
        _run("gateway", 1, ok=100, wall_s=1.25, p50=62.0, cpu=1.1),
        _run(
            "gateway", 2, ok=100, wall_s=2.0, p50=70.0, cpu=1.3
        ),  # its direct and proxy runs are missing: not paired
    ]
    f = gateway_figures(runs)["C8"]
    assert f["throughput_ratio"] == pytest.approx((0.5 + 0.8) / 2)
    assert f["added_p50_ms"] == pytest.approx((1.0 + 2.0) / 2)
    assert f["added_p99_ms"] == pytest.approx((1.0 + 2.0) / 2)
    assert f["proxy"]["throughput_ratio"] == pytest.approx((0.625 + 1.0) / 2)
    assert f["proxy"]["added_p50_ms"] == pytest.approx((0.5 + 0.5) / 2)
    assert f["over_proxy"]["throughput_ratio"] == pytest.approx((0.8 + 0.8) / 2)
    assert f["over_proxy"]["added_p50_ms"] == pytest.approx((0.5 + 1.5) / 2)
    assert f["gateway_cpu_ms_per_request"] == pytest.approx((1.5 + 1.1) / 2)
    assert f["gateway_loop_cpu_ms_per_request"] == pytest.approx((1.5 + 1.1) / 4)
    assert f["failed"] == 0


def test_litellm_s_runs_give_its_figures_and_the_gateway_s_over_it() -> None:
    runs = [
        _run("gateway", 0, ok=100, wall_s=1.0, p50=52.0, cpu=1.5),
        _run("proxy", 0, ok=100, wall_s=0.8, p50=51.5, cpu=None),
        _run("aiohttp", 0, ok=100, wall_s=0.5, p50=51.0, cpu=None),
        _run("litellm", 0, ok=50, wall_s=2.0, p50=131.0, cpu=None),  # under its time cap
    ]
    f = gateway_figures(runs)["C8"]
    assert f["litellm"]["throughput_ratio"] == pytest.approx(25 / 200)
    assert f["litellm"]["added_p50_ms"] == pytest.approx(80.0)
    assert f["over_litellm"]["throughput_ratio"] == pytest.approx(100 / 25)
    assert f["throughput"]["litellm"] == pytest.approx(25.0)
    verdicts = {t.name: t.verdict for t in evaluate({"gateway": _result(runs)}, [])}
    assert verdicts["C8 LiteLLM proxy: throughput / direct"] == "MISS"
    assert verdicts["C8 gateway throughput / LiteLLM proxy"] == "PASS"
    without = gateway_figures([r for r in runs if r.system != "litellm"])["C8"]
    assert "litellm" not in without
    assert "litellm" not in without["throughput"]  # no column for a peer that did not run
    verdicts = {t.name for t in evaluate({"gateway": _result(runs[:3])}, [])}
    assert not any("LiteLLM" in name for name in verdicts)


def _result(runs: list[Run]) -> ScenarioResult:
    result = ScenarioResult(name="gateway", runs=runs)
    result.figures = gateway_figures(runs)
    return result


@pytest.mark.timeout(90)
def test_a_small_run_answers_every_request_through_the_gateway_and_straight() -> None:
    scale = dataclasses.replace(
        Scale.small(), gateway_levels=(8,), gateway_tasks=40, gateway_rounds=2
    )
    before = _children()
    result = run_gateway(Options(scale=scale, scenarios=("gateway",)))
    assert [(r.system, r.round) for r in result.runs] == [
        ("gateway", 0),
        ("proxy", 0),
        ("aiohttp", 0),
        ("aiohttp", 1),
        ("proxy", 1),
        ("gateway", 1),
    ]
    for run in result.runs:
        assert (run.tasks, run.ok, run.failed) == (40, 40, 0)
        assert run.server["requests"] == 40  # the gateway's and proxy's calls reached it
        assert run.server["max_in_flight"] <= 8
        assert run.latency.p50 is not None
        assert run.latency.p50 >= 1000 * scale.latency_s  # nothing answered before its time
    for run in (r for r in result.runs if r.system == "gateway"):
        everything = run.extra["gateway_cpu_ms_per_request"]
        assert 0 <= run.extra["gateway_loop_cpu_ms_per_request"] <= everything
    figures = result.figures["C8"]
    assert figures["throughput_ratio"] > 0
    assert figures["added_p50_ms"] is not None
    assert figures["failed"] == 0
    assert figures["proxy"]["throughput_ratio"] > 0
    assert figures["over_proxy"]["added_p50_ms"] is not None
    verdicts = {t.name: t.verdict for t in evaluate({"gateway": result}, [])}
    assert verdicts["C8 failed requests"] == "PASS"
    assert verdicts["C8 throughput / direct"] in {"PASS", "MISS"}
    assert verdicts["C8 added p50 latency ms"] in {"PASS", "MISS"}
    assert verdicts["C8 bare proxy: added p50 ms"] in {"PASS", "MISS"}
    assert _children() <= before  # provider, gateway and generators all stopped
