"""The bench's reports (bench/report.py): the JSON holds every figure the table shows and
the environment; a plot needs matplotlib and a stale one goes; a long figure is shown
whole or marked as cut."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from callboard.bench import harness
from callboard.bench.measure import ScenarioResult
from callboard.bench.report import (
    Report,
    render_markdown,
    render_table,
    table_rows,
    write_outputs,
)
from support import steady_run


def _report(results: dict[str, ScenarioResult]) -> Report:
    return Report(
        environment=harness.environment(),
        options={"seed": 7},
        results=results,
        targets=[],
        baselines=["aiohttp"],
    )


def test_the_json_holds_every_figure_the_table_shows_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = ScenarioResult(
        name="steady",
        runs=[steady_run("callboard", "C50", 0, 90), steady_run("aiohttp", "C50", 0, 100)],
        figures={"answer": 42},
    )
    report = _report({"steady": result})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the extra is not installed
    paths = write_outputs(report, tmp_path)
    assert "plot" not in paths
    assert not (tmp_path / "bench.png").exists()
    data = json.loads((tmp_path / "bench.json").read_text())
    assert any("matplotlib" in n for n in data["notes"])
    assert "matplotlib" in (tmp_path / "bench.md").read_text()
    env = data["environment"]
    assert env["packages"]["httpx"]
    assert env["usable_cores"] >= 1
    assert "loadavg_start" in env
    summary = data["scenarios"]["steady"]["summary"]
    assert data["scenarios"]["steady"]["figures"] == {"answer": 42}
    for shown, row in zip(table_rows(report), summary, strict=True):
        assert shown[2] == row["system"]
        assert shown[6] == f"{row['throughput']:.0f}"
        assert shown[7] == (
            "-" if "aiohttp" not in row["ratio"] else f"{row['ratio']['aiohttp']:.2f}"
        )
    cb = next(r for r in summary if r["system"] == "callboard")
    assert cb["ratio"]["aiohttp"] == pytest.approx(0.9)
    assert cb["latency"]["p99"] == 50.0


def test_a_stale_plot_is_removed_when_matplotlib_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bench.png").write_bytes(b"an earlier run's plot")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = write_outputs(_report({"crash": ScenarioResult(name="crash")}), tmp_path)
    assert "plot" not in paths
    assert not (tmp_path / "bench.png").exists()


def test_the_markdown_shows_a_long_figure_whole_or_marks_the_cut() -> None:
    sites = [{"site": f"callboard/actors/queue.py:{i}", "bytes_per_task": 1.5} for i in range(40)]
    result = ScenarioResult(name="backlog", figures={"top_sites": sites})
    md = render_markdown(_report({"backlog": result}))
    line = next(x for x in md.splitlines() if x.startswith("- **top_sites**"))
    shown = line.split("`")[1]
    try:
        assert json.loads(shown) == sites
    except json.JSONDecodeError:
        assert shown.endswith(("...", "\u2026")), shown[-40:]
    report = _report({"backlog": result})
    terminal = next(x for x in render_table(report).splitlines() if "top_sites:" in x)
    assert terminal.endswith("\u2026")  # cut, and marked as cut
