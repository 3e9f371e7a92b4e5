"""The bench's figures (bench/measure.py): nearest-rank percentiles, and ratios that pair
each row with the same label and round only, never dividing by zero."""

from __future__ import annotations

import dataclasses

import pytest
from callboard.bench.measure import Run, percentiles, summarise
from support import steady_run


def test_percentiles_are_nearest_rank_in_milliseconds() -> None:
    p = percentiles([i / 1000 for i in range(1, 101)])
    assert (p.count, p.p50, p.p95, p.p99, p.max) == (100, 50.0, 95.0, 99.0, 100.0)
    assert percentiles([]).p50 is None


def test_ratios_pair_runs_of_the_same_round() -> None:
    def run(system: str, rnd: int, ok: int) -> Run:
        return Run(scenario="s", system=system, label="C1", tasks=ok, ok=ok, wall_s=1.0, round=rnd)

    runs = [
        run("callboard", 0, 90),
        run("base", 0, 100),
        run("callboard", 1, 40),
        run("base", 1, 50),
    ]
    rows = {r["system"]: r for r in summarise(runs, ["base"])}
    assert rows["callboard"]["ratio"]["base"] == pytest.approx((0.9 + 0.8) / 2)
    assert rows["callboard"]["rounds"] == 2


def test_ratios_pair_each_row_with_the_same_label_and_round_only() -> None:
    runs = [
        steady_run("callboard", "C50", 0, 90),
        steady_run("callboard", "C50", 1, 80),
        steady_run("callboard", "C200", 0, 300, conc=200),
        steady_run("aiohttp", "C50", 0, 100),
        steady_run("aiohttp", "C50", 1, 100),
        steady_run("aiohttp", "C200", 0, 400, conc=200),
        steady_run("httpx", "C50", 0, 10),  # once per level, round 0 only
        steady_run("serial", "", 0, 20, conc=1),
    ]
    rows = {(r["label"], r["system"]): r for r in summarise(runs, ["aiohttp", "httpx", "serial"])}
    c50, c200 = rows["C50", "callboard"], rows["C200", "callboard"]
    assert c50["ratio"]["aiohttp"] == pytest.approx((0.9 + 0.8) / 2)
    assert c200["ratio"]["aiohttp"] == pytest.approx(0.75)
    assert c50["ratio"]["httpx"] == pytest.approx((9.0 + 8.0) / 2)
    assert "httpx" not in c200["ratio"]  # no C200 httpx run: no ratio, not C50's
    assert c50["ratio"]["serial"] == pytest.approx((4.5 + 4.0) / 2)
    assert c200["ratio"]["serial"] == pytest.approx(15.0)
    assert rows["", "serial"]["ratio"] == {}
    assert c50["cycle_ms"] == pytest.approx((1000 * 50 / 90 + 1000 * 50 / 80) / 2)


def test_the_p95_ratio_pairs_runs_of_the_same_round() -> None:
    """Each system's median round, on a machine whose speed drifts, were two different
    rounds: a slow round's p95 over a fast one's (found by a review)."""

    def run(system: str, rnd: int, ok: int, p95_s: float) -> Run:
        r = steady_run(system, "C200", rnd, ok, conc=200)
        return dataclasses.replace(r, latency=percentiles([p95_s] * ok))

    runs = [  # round 0 slow for both, round 1 fast for both; callboard 1.1x in each
        run("callboard", 0, 100, 0.110),
        run("base", 0, 90, 0.100),
        run("callboard", 1, 80, 0.055),
        run("base", 1, 120, 0.050),
        run("callboard", 2, 90, 0.088),
        run("base", 2, 100, 0.080),
    ]
    rows = {r["system"]: r for r in summarise(runs, ["base"])}
    assert rows["callboard"]["p95_ratio"]["base"] == pytest.approx(1.1)


def test_an_empty_or_instant_run_never_divides_by_zero() -> None:
    empty = Run(scenario="x", system="callboard")
    assert (empty.throughput, empty.cpu_ms_per_request) == (0.0, 0.0)
    rows = summarise(
        [steady_run("callboard", "C50", 0, 0), steady_run("aiohttp", "C50", 0, 0)], ["aiohttp"]
    )
    by_system = {r["system"]: r for r in rows}
    assert by_system["callboard"]["ratio"]["aiohttp"] is None
    assert by_system["callboard"]["cycle_ms"] is None
    p = percentiles([])
    assert (p.count, p.p50, p.p99) == (0, None, None)
    p = percentiles([0.003, 0.001, 0.002])
    assert (p.p50, p.p95, p.p99, p.max) == (2.0, 3.0, 3.0, 3.0)
