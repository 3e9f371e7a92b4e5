"""The progress display of ``callboard run`` (callboard/_progress.py): plain lines in a
pipe, a live bar on a terminal, any model name shown as it is, and a summary even of
nothing."""

from __future__ import annotations

import io
import types

import pytest
from callboard.core.stats import WINDOW
from callboard.messages import Cancelled, Completed, Usage

from callboard._progress import RunProgress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _completed(model: str | None, task_id: int = 1) -> Completed:
    return Completed(
        task_id=task_id, trace_id="t", model=model, content="", latency_s=0.25, cost_nusd=1_500
    )


@pytest.mark.parametrize("stream_cls", [io.StringIO, _Tty])
def test_progress_zero_lines(stream_cls: type[io.StringIO]) -> None:
    stream = stream_cls()
    with RunProgress(0, stream=stream) as progress:
        pass
    progress.summary()  # nothing to summarise: must not crash


@pytest.mark.parametrize("stream_cls", [io.StringIO, _Tty])
def test_progress_long_model_name_and_plain_lines(
    stream_cls: type[io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    import callboard._progress as prog

    monkeypatch.setattr(prog, "PLAIN_EVERY_S", 0.0)
    stream = stream_cls()
    name = "m" * 400
    with RunProgress(3, stream=stream) as progress:
        progress.add(_completed(name))
        progress.add(None)
        progress.add(_completed(None, 2))
    progress.summary()
    out = stream.getvalue()
    assert "3/3" in out
    if stream_cls is io.StringIO:
        assert "\x1b[" not in out  # no escape codes in a pipe
    assert progress.errors == 1


def test_progress_summary_with_bracketed_model_name() -> None:
    stream = io.StringIO()
    with RunProgress(2, stream=stream) as progress:
        progress.add(_completed("llama[/x]"))
        progress.add(_completed("gpt[red]", 2))
    progress.summary()
    out = stream.getvalue()
    assert "llama[/x]" in out
    assert "gpt[red]" in out


@pytest.mark.parametrize("stream_cls", [io.StringIO, _Tty])
def test_a_resumed_run_reaches_n_of_n_with_its_skipped_lines(
    stream_cls: type[io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed run's bar stopped at (N - skipped)/N: the lines an earlier run had
    finished were never counted (found by a hunt)."""
    import callboard._progress as prog

    monkeypatch.setattr(prog, "PLAIN_EVERY_S", 0.0)
    stream = stream_cls()
    with RunProgress(3, stream=stream) as progress:
        progress.skip()
        progress.skip()
        progress.add(_completed("m"))
    out = stream.getvalue()
    assert "3/3" in out
    assert progress.done == 1  # this run's count (and rate) has only what it wrote


def test_a_resume_with_nothing_left_shows_n_of_n_on_a_terminal() -> None:
    stream = _Tty()
    with RunProgress(2, stream=stream) as progress:
        progress.skip()
        progress.skip()
    assert "2/2" in stream.getvalue()
    assert "ETA -:--:--" in stream.getvalue()  # no rate yet: no time left made up


def test_the_rate_is_timed_from_the_runs_first_line_not_its_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A resume reads its output and ledger before its first line (18 s at 300,000
    lines): timed from its start, its first line showed 0.1/s and an ETA of three weeks
    (a hunt). The rate counts from the first line this run writes."""
    import callboard._progress as prog

    monkeypatch.setattr(prog, "PLAIN_EVERY_S", 0.0)
    now = [1000.0]
    monkeypatch.setattr(prog, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    stream = io.StringIO()
    with RunProgress(1000, stream=stream) as progress:
        now[0] += 18.0  # reading what an earlier run left
        progress.add(_completed("m"))
        assert "ETA - s" in stream.getvalue().splitlines()[-1]  # one line: no rate yet
        for _ in range(10):
            now[0] += 0.1
            progress.add(_completed("m"))
    assert "10.0/s" in stream.getvalue().splitlines()[-1]


def test_a_call_billed_before_a_fallback_shows_on_the_model_that_billed_it() -> None:
    """The run's per-model table put a task's whole cost on the model that answered it
    (found by a review)."""
    from callboard.messages import Billed, Usage

    at_a = Billed(model="a", usage=Usage(prompt_tokens=100, completion_tokens=10), cost_nusd=1_000)
    answered = Completed(
        task_id=1,
        trace_id="t",
        model="b",
        content="",
        usage=Usage(prompt_tokens=5, completion_tokens=10).plus(at_a.usage),
        cost_nusd=1_050,
        billed_before=(at_a,),
    )
    with RunProgress(1, stream=io.StringIO()) as progress:
        progress.add(answered)
    rows = {name: (row.count, row.tokens, row.cost_nusd) for name, row in progress.models.items()}
    assert rows == {"a": (0, 110, 1_000), "b": (1, 15, 50)}


def test_a_cancelled_task_is_no_line_but_its_calls_cost_counts() -> None:
    """A call a stop cut on the wire is charged its estimate: its result is no line
    (it runs again next time) and no failure in the table (a hunt), and its cost is the
    run's (a review). One that cost nothing leaves no row."""
    cut = Cancelled(
        task_id=1,
        trace_id="t",
        model="m",
        usage=Usage(prompt_tokens=10, completion_tokens=100, estimated=True),
        cost_nusd=29_000,
    )
    queued = Cancelled(task_id=2, trace_id="u")
    with RunProgress(2, stream=io.StringIO()) as progress:
        progress.spent(cut)
        progress.spent(queued)
    assert (progress.done, progress.errors, progress.cost_nusd) == (0, 0, 29_000)
    rows = {name: (row.count, row.tokens, row.cost_nusd) for name, row in progress.models.items()}
    assert rows == {"m": (0, 110, 29_000)}


def test_a_long_run_keeps_a_bounded_sample_of_its_latencies() -> None:
    """Every latency was kept for the table's percentiles: a float a line, and a sort of
    them all at each refresh (a hunt: a run's memory grew 300 B a line)."""
    with RunProgress(20_000, stream=io.StringIO()) as progress:
        for _ in range(20_000):
            progress.add(_completed("m"))
    row = progress.models["m"]
    assert row.count == 20_000
    assert len(row.latencies.values) == WINDOW
