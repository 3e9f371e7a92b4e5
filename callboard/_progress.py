"""Progress and the closing summary of ``callboard run``.

On a terminal: a live ``rich`` progress bar (done/total, rate, ETA, cost so
far, errors). Elsewhere (CI logs, pipes): one plain line every few seconds.
At the end, a per-model table: count, ok, failed, p50/p95 latency, tokens,
cost. Everything here is fed from the CLI's writer thread; nothing touches
an actor.

rich was chosen because one well-kept library gives both the live bar with
our own columns (cost, errors) and the summary table, and degrades to plain
text when stderr is not a terminal.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from decimal import Decimal
from typing import IO, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from callboard.core.pricing import usd_text
from callboard.core.stats import Reservoir, percentiles
from callboard.messages import Result
from callboard.messages._results import NANO

PLAIN_EVERY_S = 5.0


@dataclass(slots=True)
class _ModelRow:
    count: int = 0
    ok: int = 0
    latencies: Reservoir = field(default_factory=Reservoir)
    """A sample of its latencies: a list of every one grew a run's memory by a float a
    line and its sort by a line each refresh (a hunt: 300 B a line in all)."""
    tokens: int = 0
    cost_nusd: int = 0


class RunProgress:
    """Counts results as they are written and shows them."""

    def __init__(
        self, total: int, *, stream: IO[str] | None = None, unpriced: frozenset[str] = frozenset()
    ) -> None:
        self.total = total
        self.unpriced = unpriced
        """Models with no price: their cost shows as unknown, never as $0."""
        self.cost_unknown = False
        """A result of an unpriced model was counted: the total cost is a lower bound."""
        self.stream = stream or sys.stderr
        self.console = Console(file=self.stream, stderr=self.stream is sys.stderr)
        self.live = self.console.is_terminal
        self.done = 0
        """Lines written by this run."""
        self.skipped = 0
        """Lines whose result an earlier run wrote (a resume): counted done, not in the
        rate. Written by the thread that reads the input, read where shown."""
        self.errors = 0
        self.cost_nusd = 0
        self.models: dict[str, _ModelRow] = {}
        self._started = time.monotonic()
        self._last_plain = self._started
        self._first: float | None = None
        """When this run wrote its first line: its rate is timed from there (timed from
        the start, a resume's reading of a large output and ledger, 18 s at 300,000
        lines, showed 0.1/s and an ETA of three weeks; a hunt)."""
        self._bar: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> RunProgress:
        if self.live:
            self._bar = Progress(
                TextColumn("[bold]callboard"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:>7.1f}/s"),
                TimeElapsedColumn(),
                TextColumn("ETA {task.fields[eta]}"),
                TextColumn("${task.fields[cost]}"),
                TextColumn("[red]{task.fields[errors]} errors"),
                console=self.console,
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(
                "run", total=self.total, rate=0.0, eta=_clock(None), cost="0", errors=0
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._show()  # the lines skipped since the last result (a resume with nothing left)
            self._bar.stop()

    def skip(self) -> None:
        """One line whose result an earlier run wrote: done, though not by this run (a
        resumed run's bar stopped short of N/N by as many; found by a hunt)."""
        self.skipped += 1

    def add(self, result: Result | None, *, recovered: bool = False) -> None:
        """One line written: a result, or None for an invalid input line; ``recovered``:
        an earlier run's result from the ledger, not this run's spend (it was counted as
        this run's cost, tokens and latency; found by a hunt)."""
        self.done += 1
        if self._first is None:
            self._first = time.monotonic()
        if result is None or not result.ok:
            self.errors += 1
        if result is not None and not recovered:
            self._account(result)
        self._show()

    def spent(self, result: Result) -> None:
        """A result that is no line's (a task the stop cancelled: it runs again next
        time): what its calls cost, and nothing else. Added as a line, it was a failure
        in the table (a hunt); left out, the calls a stop cut, paid for, were not in the
        run's cost (a review)."""
        self._charge(result, counted=False)
        self._show()

    def _account(self, r: Result) -> None:
        row = self._charge(r, counted=True)
        assert row is not None  # counted: it has its row
        row.count += 1
        row.ok += r.ok
        row.latencies.add(r.latency_s)

    def _charge(self, r: Result, *, counted: bool) -> _ModelRow | None:
        """What ``r``'s calls cost and used, each on the model it ran on; ``r``'s row
        (made if it is ``counted`` or spent something)."""
        self.cost_nusd += r.cost_nusd
        for billed in r.billed_before:  # on the model that billed it, as stats() counts
            elsewhere = self.models.setdefault(billed.model, _ModelRow())
            elsewhere.tokens += billed.usage.total_tokens
            elsewhere.cost_nusd += billed.cost_nusd
        prompt, completion, cost = r.own_share()
        if not counted and not (prompt or completion or cost):
            return None
        self.cost_unknown |= r.model in self.unpriced
        row = self.models.setdefault(r.model or "(none)", _ModelRow())
        row.tokens += prompt + completion
        row.cost_nusd += cost
        return row

    def _show(self) -> None:
        now = time.monotonic()
        # this run's lines since its first (skipped lines took none); none before two
        first = self._first
        rate = 0.0 if first is None else (self.done - 1) / max(now - first, 1e-9)
        done = self.done + self.skipped
        left = max(self.total - done, 0)
        eta = left / rate if rate > 0 else None
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=done,
                rate=rate,
                eta=_clock(eta),
                cost=self._cost(),
                errors=self.errors,
            )
        elif now - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = now
            print(
                f"callboard: {done}/{self.total} done, {rate:.1f}/s, "
                f"ETA {'-' if eta is None else f'{eta:.0f}'} s, "
                f"${self._cost()}, {self.errors} errors",
                file=self.stream,
                flush=True,
            )

    def _cost(self) -> str:
        """The cost so far; "+?" when some of it is unknown (a model with no price)."""
        return _usd(self.cost_nusd) + ("+?" if self.cost_unknown else "")

    def summary(self) -> None:
        """The per-model table."""
        if not self.models:
            return
        table = Table(title="callboard run: per model")
        for col in ("model", "count", "ok", "failed", "p50 s", "p95 s", "tokens", "cost $"):
            table.add_column(col, justify="left" if col == "model" else "right")
        for name, row in sorted(self.models.items()):
            p = percentiles(row.latencies.values)
            table.add_row(
                Text(name),  # as is: a model name may hold [brackets] rich reads as markup
                str(row.count),
                str(row.ok),
                str(row.count - row.ok),
                f"{p.p50:.3f}" if p.p50 is not None else "-",
                f"{p.p95:.3f}" if p.p95 is not None else "-",
                str(row.tokens),
                "unknown" if name in self.unpriced else _usd(row.cost_nusd),
            )
        self.console.print(table)


def _clock(seconds: float | None) -> str:
    """``seconds`` as rich shows a time left: H:MM:SS, dashes when unknown."""
    if seconds is None:
        return "-:--:--"
    whole = round(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def _usd(nusd: int) -> str:
    return usd_text(Decimal(nusd) / NANO)
