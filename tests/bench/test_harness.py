"""The load bench: its quick run as a smoke test (correctness figures only, never speed).

``main(["--quick", ...])`` runs once for the module; the tests read its
``bench.json``. Speed targets are reported PASS/MISS by the bench and never
asserted here: this machine is shared and small. The pure pieces (inversion
count, percentiles, sustained rate, ratio pairing) are tested directly.
"""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from callboard.bench.backlog import _collector_time
from callboard.bench.faults import sustained_rate
from callboard.bench.harness import main
from callboard.bench.measure import Run, percentiles, summarise
from callboard.bench.plan import SCENARIOS
from callboard.bench.priority import Dispatch, count_inversions


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    before = set(threading.enumerate())
    code = main(["--quick", "--quiet", "--out", str(out)])
    left = [t.name for t in threading.enumerate() if t.is_alive() and t not in before]
    data: dict[str, Any] = json.loads((out / "bench.json").read_text())
    data["_exit_code"] = code
    data["_threads_left"] = left
    data["_files"] = sorted(p.name for p in Path(out).iterdir())
    return data


def _callboard_runs(quick: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        run
        for scenario in quick["scenarios"].values()
        for run in scenario["runs"]
        if run["system"].startswith("callboard")
    ]


@pytest.mark.timeout(300)
def test_quick_bench_runs_every_scenario_and_writes_its_reports(quick: dict[str, Any]) -> None:
    assert quick["_exit_code"] == 0, quick["errors"]
    assert quick["errors"] == {}
    assert set(quick["scenarios"]) == set(SCENARIOS)
    assert {"bench.json", "bench.md"} <= set(quick["_files"])
    assert quick["environment"]["python"]
    assert quick["_threads_left"] == []
    assert all(t["verdict"] in {"PASS", "MISS", "n/a"} for t in quick["targets"])


@pytest.mark.timeout(300)
def test_no_task_is_lost_or_answered_twice_in_any_scenario(quick: dict[str, Any]) -> None:
    runs = _callboard_runs(quick)
    assert runs
    for run in runs:
        assert run["lost"] == 0, (run["scenario"], run["system"], run["label"])
        assert run["duplicated"] == 0, (run["scenario"], run["system"], run["label"])
        assert run["tasks"] > 0


@pytest.mark.timeout(300)
def test_crashing_actors_lose_and_double_nothing(quick: dict[str, Any]) -> None:
    crash = quick["scenarios"]["crash"]["figures"]
    assert crash["lost"] == 0
    assert crash["duplicated"] == 0
    assert crash["injected"] > 0
    assert crash["ledger"]["balanced"]
    assert crash["ledger"]["accepted"] == crash["ledger"]["finished"]
    assert crash["outcomes"] == {"Completed": quick["options"]["scale"]["crash_tasks"]}


@pytest.mark.timeout(300)
def test_matching_rate_limits_draw_no_429(quick: dict[str, Any]) -> None:
    figures = quick["scenarios"]["rate-limited"]["figures"]
    assert figures["server_429"] == 0
    assert figures["ok"] == figures["tasks"]


@pytest.mark.timeout(300)
def test_faulty_provider_every_task_succeeds(quick: dict[str, Any]) -> None:
    figures = quick["scenarios"]["faulty"]["figures"]
    assert figures["success_ratio"] == 1.0
    assert figures["failed"] == 0


@pytest.mark.timeout(300)
def test_overload_serves_no_task_before_an_older_more_urgent_one(quick: dict[str, Any]) -> None:
    figures = quick["scenarios"]["priority"]["figures"]
    lockstep = figures["lockstep"]
    assert figures["dispatched"] > 0
    assert lockstep["dispatched"] > 0
    assert figures["inversions_total"] == 0  # both runs
    assert lockstep["inversions_total"] == 0
    assert figures["lost"] == 0
    assert lockstep["lost"] == 0
    runs = [r["label"] for r in quick["scenarios"]["priority"]["runs"]]
    assert runs == ["varied", "lockstep"]


@pytest.mark.timeout(300)
def test_outage_fails_no_task(quick: dict[str, Any]) -> None:
    figures = quick["scenarios"]["outage"]["figures"]
    assert figures["failed"] == 0
    assert figures["lost"] == 0
    assert figures["time_to_open_s"] is not None


@pytest.mark.timeout(300)
def test_backlog_splits_the_collector_out_of_the_system_figure(quick: dict[str, Any]) -> None:
    figures = quick["scenarios"]["backlog"]["figures"]
    timed = [row for row in figures["system"].values() if row.get("cpu_us_per_task")]
    assert timed
    for row in timed:
        assert row["collector_us_per_task"] >= 0
        own = row["cpu_us_per_task"] - row["collector_us_per_task"]
        assert row["own_cpu_us_per_task"] == pytest.approx(own, abs=0.01)
        assert 0 <= row["kernel_us_per_task"] <= row["cpu_us_per_task"]
        assert row["page_faults_per_task"] >= 0
        user = row["own_cpu_us_per_task"] - row["kernel_us_per_task"]
        assert row["own_user_us_per_task"] == pytest.approx(user, abs=0.01)
    for row in figures["core"].values():
        user = row["push_us_per_task"] + row["pop_us_per_task"]
        assert row["user_us_per_task"] == pytest.approx(user, abs=0.01)
        assert row["cpu_us_per_task"] >= row["user_us_per_task"]
    assert figures["tracked_objects_per_task"] > 0
    assert not any(type(cb).__name__ == "_CollectorTime" for cb in gc.callbacks)


def test_collector_time_counts_full_collections_and_removes_its_callback() -> None:
    before = list(gc.callbacks)
    with _collector_time() as meter:
        gc.collect()
        gc.collect(0)
    assert meter.full == 1
    assert meter.process_seconds >= 0
    assert meter.seconds >= 0
    assert gc.callbacks == before


# -- the pure pieces --------------------------------------------------------------


def test_inversion_counted_when_an_older_more_urgent_task_waits_longer() -> None:
    found = [
        Dispatch(priority=0, model="a", earliest=1.0, latest=1.001),  # CRITICAL, first
        Dispatch(priority=3, model="a", earliest=0.5, latest=0.501),  # LOW, went earlier
        Dispatch(priority=3, model="b", earliest=2.0, latest=2.001),  # LOW, after it: fine
    ]
    assert count_inversions(found) == {"a": 1, "b": 0}


def test_no_inversion_for_newer_urgent_tasks_ties_or_unclear_clocks() -> None:
    found = [
        Dispatch(priority=3, model="a", earliest=0.3, latest=0.4),
        Dispatch(priority=3, model="a", earliest=0.1, latest=0.2),  # same level: not judged
        Dispatch(priority=0, model="a", earliest=0.5, latest=0.6),  # newer: may wait
        Dispatch(priority=1, model="b", earliest=0.7, latest=0.9),
        Dispatch(priority=2, model="b", earliest=0.65, latest=0.75),  # overlaps: not certain
    ]
    assert count_inversions(found) == {"a": 0, "b": 0}
    assert count_inversions([]) == {}


def test_percentiles_are_nearest_rank_in_milliseconds() -> None:
    p = percentiles([i / 1000 for i in range(1, 101)])
    assert (p.count, p.p50, p.p95, p.p99, p.max) == (100, 50.0, 95.0, 99.0, 100.0)
    assert percentiles([]).p50 is None


def test_sustained_rate_skips_the_first_second() -> None:
    burst = [0.0] * 50
    steady = [1.0 + k / 100 for k in range(301)]
    assert sustained_rate(burst + steady) == pytest.approx(100.0)
    assert sustained_rate([0.0, 0.1]) is None


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


def test_unknown_scenario_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--scenarios", "nope", "--out", "unused"])
    assert exc.value.code == 2
