"""The bench's outputs: a terminal table, ``bench.json``, ``bench.md`` and ``bench.png``.

The JSON holds every figure (each run of each round, the summaries, the
scenario figures, the targets) and the environment; the table and the
Markdown are views of it. The plot is drawn only when matplotlib is
importable (it is optional); otherwise the report says so.

What must hold: the outputs are written even when some scenario failed (its
error is reported in its place); nothing here measures anything.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from callboard.bench.measure import ScenarioResult
from callboard.bench.targets import Target

__all__ = ["Report", "prepare_out", "render_table", "write_outputs"]

_RATIO_COLS = ("aiohttp", "httpx-aiohttp", "httpx", "serial", "litellm")
_SHORT = {"aiohttp": "aio", "httpx-aiohttp": "hx-aio", "httpx": "httpx", "serial": "serial"}


@dataclasses.dataclass(slots=True, kw_only=True)
class Report:
    environment: dict[str, Any]
    options: dict[str, Any]
    results: dict[str, ScenarioResult]
    targets: list[Target]
    baselines: list[str]
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "environment": self.environment,
            "options": self.options,
            "seconds": round(self.seconds, 2),
            "scenarios": {n: r.as_json(self.baselines) for n, r in self.results.items()},
            "targets": [dataclasses.asdict(t) | {"verdict": t.verdict} for t in self.targets],
            "errors": self.errors,
            "notes": self.notes,
        }


def _jsonable(obj: object) -> object:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    return str(obj)


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


# -- the table -----------------------------------------------------------------

Cell = Callable[[Mapping[str, Any]], str]


def _key(key: str, digits: int = 1) -> Cell:
    return lambda row: _fmt(row[key], digits)


def _ratio(base: str) -> Cell:
    return lambda row: _fmt(row["ratio"].get(base), 2)


def _latency(q: str) -> Cell:
    return lambda row: _fmt(row["latency"][q])


_COLUMNS: tuple[tuple[str, int, Cell], ...] = (
    ("variant", 7, lambda row: row["label"] or "-"),
    ("system", 13, lambda row: str(row["system"])),
    ("tasks", 6, _key("tasks")),
    ("ok", 6, _key("ok")),
    ("fail", 4, _key("failed")),
    ("req/s", 7, _key("throughput", 0)),
    *((f"x{_SHORT.get(b, b)}", 7, _ratio(b)) for b in _RATIO_COLS),
    ("cpu ms", 6, _key("cpu_ms_per_request", 3)),
    ("cycle", 6, _key("cycle_ms")),
    *((f"{q} ms", 7, _latency(q)) for q in ("p50", "p95", "p99")),
    ("429s", 5, _key("server_429")),
    ("inflt", 5, _key("server_max_in_flight")),
    ("lost", 4, _key("lost")),
    ("dup", 3, _key("duplicated")),
    ("cost $", 8, lambda row: f"{row['cost_usd']:.5f}"),
    ("tokens", 7, _key("tokens")),
)
_HEAD = (("scenario", 12), *((head, width) for head, width, _ in _COLUMNS))


def table_rows(report: Report) -> list[list[str]]:
    return [
        [name, *(cell(row) for _, _, cell in _COLUMNS)]
        for name, result in report.results.items()
        for row in result.rows(report.baselines)
    ]


def render_table(report: Report) -> str:
    """The main table, the targets and the scenario figures, for a terminal."""
    widths = [w for _, w in _HEAD]
    lines = [" ".join(h.rjust(w) for h, w in _HEAD)]
    lines.append(" ".join("-" * w for w in widths))
    lines += [
        " ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in table_rows(report)
    ]
    lines += ["", "Targets:"]
    lines += [_target_line(t) for t in report.targets]
    for name, result in report.results.items():
        lines += ["", f"{name} ({result.seconds:.1f} s):"]
        lines += [
            f"  {k}: {_compact(v, _TERMINAL_FIGURE_CHARS)}" for k, v in result.figures.items()
        ]
        lines += [f"  note: {n}" for n in result.notes]
    lines += [f"ERROR in {n}: {e}" for n, e in report.errors.items()]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def _target_line(t: Target) -> str:
    value = _fmt(t.value, 3)
    return f"  {t.verdict:5} {t.scenario:12} {t.name:44} {value:>10}  (goal {t.goal}; {t.kind})"


_TERMINAL_FIGURE_CHARS = 600
"""Longer figures are cut on the terminal, marked; bench.md and bench.json hold them whole."""


def _compact(value: Any, limit: int | None = None) -> str:
    text = json.dumps(value, default=_jsonable, separators=(", ", ": "))
    if limit is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "\u2026"


# -- Markdown --------------------------------------------------------------------


def render_markdown(report: Report) -> str:
    env = report.environment
    out = ["# callboard bench", ""]
    out += [f"- {k}: {_compact(v)}" for k, v in env.items()]
    out += [f"- options: {_compact(report.options)}", f"- total: {report.seconds:.1f} s", ""]
    out += ["## Results", "", _md_table([h for h, _ in _HEAD], table_rows(report)), ""]
    out += [
        "Ratios: the row's throughput over the baseline's, median of same-round ratios.",
        "Latency is service latency (dispatch to answer); `cpu ms` is client CPU per task;",
        "`cycle` is concurrency / throughput in ms: the service time plus the time a call",
        "slot stood empty between an answer and the next call.",
        "",
    ]
    out += ["## Targets", ""]
    out += [
        _md_table(
            ["verdict", "scenario", "figure", "value", "goal", "kind"],
            [
                [t.verdict, t.scenario, t.name, _fmt(t.value, 3), t.goal, t.kind]
                for t in report.targets
            ],
        ),
        "",
    ]
    for name, result in report.results.items():
        out += [f"## {name}", "", f"Settings: `{_compact(result.settings)}`", ""]
        out += [f"- **{k}**: `{_compact(v)}`" for k, v in result.figures.items()]
        out += [f"- note: {n}" for n in result.notes]
        out.append("")
    if report.errors:
        out += ["## Errors", ""] + [f"- {n}: {e}" for n, e in report.errors.items()] + [""]
    if report.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    return "\n".join(out)


def _md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# -- the plot -----------------------------------------------------------------------


def plot(report: Report, path: Path) -> str | None:
    """Draw throughput and latency by scenario and system; a note instead if impossible."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        return "plot skipped: matplotlib is not importable (pip install matplotlib)"
    matplotlib.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    rows = [(n, row) for n, r in report.results.items() for row in r.rows(report.baselines)]
    rows = [(n, row) for n, row in rows if row["throughput"]]
    labels = [f"{n} {row['label']} {row['system']}".replace("  ", " ") for n, row in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 9), sharex=True)
    xs = range(len(rows))
    colors = [
        "tab:blue" if row["system"].startswith("callboard") else "tab:gray" for _, row in rows
    ]
    top.bar(xs, [row["throughput"] for _, row in rows], color=colors)
    top.set_ylabel("throughput (tasks/s)")
    top.set_title("callboard bench: throughput (blue: callboard, grey: baselines) and latency")
    for q, color in (("p50", "tab:green"), ("p99", "tab:red")):
        bottom.plot(xs, [row["latency"][q] or 0 for _, row in rows], "o", color=color, label=q)
    bottom.set_ylabel("latency (ms)")
    bottom.set_yscale("log")
    bottom.legend()
    bottom.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def prepare_out(out: Path) -> Path:
    """Create ``out`` if need be; `ValueError` unless it is a writable directory.

    The bench calls it before any scenario runs, so a bad ``--out`` costs no load.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r}: cannot create the directory: {exc}") from exc
    if not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is not a directory")
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {str(out)!r}: the directory is not writable")
    return out


def write_outputs(report: Report, out: Path) -> dict[str, Path]:
    """Write bench.json, bench.md and (if possible) bench.png under ``out``.

    Without matplotlib, a bench.png an earlier run left there is removed, so
    the directory never pairs this run's figures with another run's plot.
    """
    prepare_out(out)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md", "plot": out / "bench.png"}
    note = plot(report, paths["plot"])
    if note is not None:
        paths["plot"].unlink(missing_ok=True)
        report.notes.append(note)
        del paths["plot"]
    paths["json"].write_text(json.dumps(report.as_json(), indent=2, default=_jsonable) + "\n")
    paths["markdown"].write_text(render_markdown(report) + "\n")
    return paths
