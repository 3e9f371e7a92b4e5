"""The load harness (bench/harness.py): its quick run as a smoke test of the wiring
(every report written, the exit code, the targets judged, no thread left behind) on two
cheap scenarios, its command line (``--provider asgi`` refused with a scenario only the
simulated provider can play), and a failing scenario reported beside the rest.

``main(["--quick", ...])`` runs once for the module, on ``crash`` and ``rate-limited``;
the tests read its ``bench.json``. Each scenario's own figures are checked by a small
run of that scenario in its own test (below for those whose module's test file does
not hold one yet). Speed targets are reported PASS/MISS by the bench and never asserted
here: this machine is shared and small. SIGTERM to a running bench leaves no provider
process behind.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from callboard.bench import harness
from callboard.bench.harness import main
from callboard.bench.measure import ScenarioResult
from callboard.bench.plan import SCENARIOS, Options, Scale
from support import (
    alive,
    assert_nothing_lost_or_doubled,
    kill_stray_provider,
    listening_ports,
    providers_of,
    refused,
    threads_since,
    wait_until,
)

QUICK = ("crash", "rate-limited")
"""The quick run's scenarios: cheap, and between them every part of the report."""


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    before = set(threading.enumerate())
    code = main(["--quick", "--quiet", "--scenarios", ",".join(QUICK), "--out", str(out)])
    left = threads_since(before)
    data: dict[str, Any] = json.loads((out / "bench.json").read_text())
    data["_exit_code"] = code
    data["_threads_left"] = left
    data["_files"] = sorted(p.name for p in Path(out).iterdir())
    return data


@pytest.mark.timeout(120)
def test_quick_bench_runs_its_scenarios_and_writes_its_reports(quick: dict[str, Any]) -> None:
    assert quick["_exit_code"] == 0, quick["errors"]
    assert quick["errors"] == {}
    assert set(quick["scenarios"]) == set(QUICK)
    assert {"bench.json", "bench.md"} <= set(quick["_files"])
    assert quick["environment"]["python"]
    pressure = quick["environment"]["cpu_pressure_start"]  # None where Linux has no PSI
    assert pressure is None or 0.0 <= pressure["avg60"] <= 100.0
    assert quick["_threads_left"] == []
    assert quick["targets"]
    assert all(t["verdict"] in {"PASS", "MISS", "n/a"} for t in quick["targets"])


@pytest.mark.timeout(120)
def test_no_task_is_lost_or_answered_twice_in_the_quick_run(quick: dict[str, Any]) -> None:
    for scenario in quick["scenarios"].values():
        assert_nothing_lost_or_doubled(scenario)


@pytest.mark.timeout(120)
def test_crashing_actors_lose_and_double_nothing(quick: dict[str, Any]) -> None:
    crash = quick["scenarios"]["crash"]["figures"]
    assert crash["lost"] == 0
    assert crash["duplicated"] == 0
    assert crash["injected"] > 0
    assert crash["ledger"]["balanced"]
    assert crash["ledger"]["accepted"] == crash["ledger"]["finished"]
    assert crash["outcomes"] == {"Completed": quick["options"]["scale"]["crash_tasks"]}


@pytest.mark.timeout(120)
def test_matching_rate_limits_draw_no_429(quick: dict[str, Any]) -> None:
    figures = quick["scenarios"]["rate-limited"]["figures"]
    assert figures["server_429"] == 0
    assert figures["ok"] == figures["tasks"]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("nope", "unknown scenario(s) 'nope'; choose from steady,"),
        ("steady,nope", "unknown scenario(s) 'nope';"),
        (",", "no scenario named in ','; choose from steady,"),  # it said "unknown ... []"
    ],
)
def test_unknown_scenario_is_a_usage_error(
    value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--scenarios", value, "--out", "unused"])
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


# -- the command line -------------------------------------------------------------------


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_an_unusable_out_is_a_usage_error_before_any_scenario(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    blocker = tmp_path / "bench-report"
    blocker.write_text("not a directory\n")
    out = blocker if where == "file" else blocker / "sub"
    ran: list[Options] = []
    monkeypatch.setattr(harness, "run_scenarios", lambda opts: (ran.append(opts), ({}, {}))[1])
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--quiet", "--scenarios", "crash", "--out", str(out)])
    assert exc.value.code == 2
    assert ran == []  # refused before minutes of load are spent
    assert blocker.read_text() == "not a directory\n"


def test_a_report_that_cannot_be_written_still_shows_its_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The files were written before the table was printed: a directory in the way of
    ``bench.json`` (a full disk, after a 17-minute run) gave a traceback and nothing
    else (found by a hunt)."""
    out = tmp_path / "bench-report"
    (out / "bench.json").mkdir(parents=True)  # in the way of the file
    monkeypatch.setattr(harness, "run_scenarios", lambda opts: ({}, {}))
    code = main(["--quick", "--quiet", "--scenarios", "crash", "--out", str(out)])
    said = capsys.readouterr()
    assert code == 1
    assert "scenario variant" in said.out  # the table
    assert f"cannot write the report to {out}" in said.err
    assert "Traceback" not in said.err


@pytest.mark.parametrize("other", [s for s in SCENARIOS if s != "steady"])
def test_the_asgi_provider_with_a_scenario_it_cannot_play_is_a_usage_error_before_any_load(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    other: str,
) -> None:
    out = tmp_path / "bench-report"
    ran: list[Options] = []
    monkeypatch.setattr(harness, "run_scenarios", lambda opts: (ran.append(opts), ({}, {}))[1])
    with pytest.raises(SystemExit) as exc:
        main(["--provider", "asgi", "--scenarios", f"steady,{other}", "--out", str(out)])
    assert exc.value.code == 2
    assert f"cannot play {other} " in capsys.readouterr().err
    assert ran == []  # refused before any load
    assert not out.exists()


def test_the_asgi_provider_runs_the_steady_scenario() -> None:
    args = ["--provider", "asgi", "--scenarios", "steady", "--baselines", "none"]
    opts = harness._options(harness._parser().parse_args(args))
    assert (opts.provider, opts.scenarios) == ("asgi", ("steady",))
    assert opts.as_json()["provider"] == "asgi"


def test_duplicate_scenarios_and_baselines_are_not_run_twice() -> None:
    args = harness._parser().parse_args(
        ["--scenarios", "crash,crash", "--baselines", "aiohttp,aiohttp"]
    )
    try:
        opts = harness._options(args)
    except ValueError:
        return  # refusing duplicates is fine too
    assert opts.scenarios == ("crash",)
    assert opts.baselines == ("aiohttp",)


def test_litellm_is_noted_only_when_all_asked_and_refused_when_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(harness, "litellm_available", lambda: False)

    def options(baselines: str) -> Options:
        return harness._options(harness._parser().parse_args(["--baselines", baselines]))

    assert options("none").notes == []
    assert options("aiohttp").notes == []
    assert any("LiteLLM" in n for n in options("all").notes)
    assert "litellm" not in options("all").baselines
    with pytest.raises(ValueError, match="litellm is not importable"):
        options("aiohttp,litellm")


def test_unknown_or_empty_baseline_is_a_usage_error() -> None:
    for value in ("nope", "", "aiohttp,nope"):
        with pytest.raises(SystemExit) as exc:
            main(["--baselines", value, "--scenarios", "crash", "--out", "unused"])
        assert exc.value.code == 2


def test_a_failing_scenario_is_reported_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def boom(_opts: Options) -> ScenarioResult:
        raise RuntimeError("injected")

    ran: list[str] = []

    def fine(_opts: Options) -> ScenarioResult:
        ran.append("crash")
        return ScenarioResult(name="crash")

    monkeypatch.setitem(harness.RUNNERS, "faulty", boom)
    monkeypatch.setitem(harness.RUNNERS, "crash", fine)
    opts = Options(scale=Scale.small(), scenarios=("faulty", "crash"))
    results, errors = harness.run_scenarios(opts)
    assert list(results) == ["crash"]
    assert ran == ["crash"]
    assert errors == {"faulty": "RuntimeError: injected"}


@pytest.mark.timeout(90)
def test_sigterm_to_the_bench_leaves_no_provider_process(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "callboard.bench", "--quick", "--quiet"]
    argv += ["--scenarios", "outage", "--baselines", "none", "--out", str(tmp_path)]
    bench = subprocess.Popen(  # noqa: S603 - our own module
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    provider: list[int] = []
    try:

        def listening() -> bool:
            kids = providers_of(bench.pid)
            if kids and listening_ports(kids[0]):
                provider[:] = kids[:1]
                return True
            return bench.poll() is not None

        assert wait_until(listening, 60.0)
        assert provider, "the bench ended before its provider listened"
        port = listening_ports(provider[0])[0]
        bench.send_signal(signal.SIGTERM)
        bench.wait(30)
        gone = wait_until(lambda: not alive(provider[0]), 5.0)
        assert gone, f"provider pid {provider[0]} outlived the bench"
        assert refused(port)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
        for pid in provider:  # the orphan this test caused, by its own pid
            kill_stray_provider(pid)
