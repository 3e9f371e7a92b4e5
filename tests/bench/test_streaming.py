"""The streaming scenario (bench/streaming.py): the raw client reads an event stream as a
raw client does (a token per text delta, the usage, ``[DONE]`` or not ok), the overhead
and the tokens/s ratio pair the two systems round by round, and a small run through a
real provider reports every figure the targets read."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest
from callboard.bench.measure import Percentiles, Run, ScenarioResult
from callboard.bench.plan import Options, Scale
from callboard.bench.streaming import (
    read_sse,
    run_streaming,
    streaming_figures,
    watch_gc,
)
from callboard.bench.targets import evaluate

_ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n'
_TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"word "}}]}\n'
_LAST = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n'
_USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3}}\n'
_DONE = b"data: [DONE]\n"


async def _lines(*lines: bytes) -> AsyncIterator[bytes]:
    for line in lines:
        yield line
        yield b"\n"  # the blank line after each event


def test_raw_reader_counts_text_deltas_and_takes_the_usage() -> None:
    events = (_ROLE, _TOKEN, _TOKEN, _TOKEN, _LAST, _USAGE, _DONE)
    seen = asyncio.run(read_sse(_lines(*events), opened=0.0))
    assert seen.ok
    assert seen.tokens == 3  # the role's empty delta and the finish are no tokens
    assert (seen.prompt_tokens, seen.completion_tokens) == (12, 3)
    assert seen.ttft_s is not None
    assert seen.ttft_s <= seen.duration_s


def test_raw_reader_calls_a_stream_without_done_not_ok() -> None:
    seen = asyncio.run(read_sse(_lines(_ROLE, _TOKEN, _TOKEN), opened=0.0))
    assert not seen.ok
    assert seen.tokens == 2


def _run(system: str, rnd: int, p50: float, p99: float, tokens_per_s: float, **extra: Any) -> Run:
    return Run(
        scenario="streaming",
        system=system,
        label="C4",
        round=rnd,
        latency=Percentiles(count=10, p50=p50, p95=p99, p99=p99, max=p99),
        extra={"tokens_per_s": tokens_per_s, "short_streams": 0, **extra},
    )


def _p(p50: float) -> Percentiles:
    return Percentiles(count=10, p50=p50, p95=p50, p99=p50, max=p50)


def test_overhead_and_ratio_pair_the_systems_round_by_round() -> None:
    runs = [
        _run("callboard", 0, 101.0, 110.0, 900.0),
        _run("aiohttp", 0, 100.0, 104.0, 1000.0),
        _run("callboard", 1, 150.0, 160.0, 950.0),  # a slow round for both
        _run("aiohttp", 1, 148.0, 150.0, 1000.0),
        _run("callboard", 2, 100.5, 103.0, 1000.0),
        _run("aiohttp", 2, 100.0, 102.0, 1000.0),
    ]
    figures = streaming_figures(runs)
    assert figures["overhead_ms"]["p50"] == pytest.approx(1.0)  # median of 1, 2, 0.5
    assert figures["overhead_ms"]["p99"] == pytest.approx(6.0)  # median of 6, 10, 1
    assert figures["tokens_per_s_ratio"] == pytest.approx(0.95)
    assert figures["ttft_ms"]["aiohttp"]["p50"] == pytest.approx(100.0)
    verdicts = {t.name: t.verdict for t in evaluate({"streaming": _result(figures)}, [])}
    assert verdicts["TTFT p50 overhead ms over aiohttp"] == "PASS"
    assert verdicts["TTFT p99 overhead ms over aiohttp"] == "MISS"
    assert verdicts["tokens/s delivered / aiohttp"] == "PASS"


def test_the_overhead_splits_along_the_path_round_by_round() -> None:
    def cb(rnd: int, dispatch: float, inner: float, to_reader: float, io_ms: float) -> Run:
        return _run(
            "callboard",
            rnd,
            dispatch + inner + to_reader,
            200.0,
            900.0,
            dispatch=_p(dispatch),
            inner_ttft=_p(inner),
            to_reader=_p(to_reader),
            cpu_ms_by_thread={"callboard-io": io_ms, "MainThread": 0.5},
        )

    runs = [
        cb(0, dispatch=3.0, inner=110.0, to_reader=1.0, io_ms=2.0),
        _run("aiohttp", 0, 104.0, 110.0, 1000.0),
        cb(1, dispatch=5.0, inner=130.0, to_reader=2.0, io_ms=2.4),
        _run("aiohttp", 1, 120.0, 130.0, 1000.0),  # a slow round for both
        cb(2, dispatch=4.0, inner=108.0, to_reader=9.0, io_ms=2.2),
        _run("aiohttp", 2, 104.0, 110.0, 1000.0),
    ]
    figures = streaming_figures(runs)
    split = figures["overhead_split_ms"]
    assert split["dispatch"] == pytest.approx(4.0)
    assert split["io_read"] == pytest.approx(6.0)  # median of 6, 10, 4: paired by round
    assert split["to_reader"] == pytest.approx(2.0)
    tail = figures["overhead_split_p99_ms"]  # _p: each part's p99 is its p50 here
    assert tail["dispatch"] == pytest.approx(4.0)
    assert tail["io_read"] == pytest.approx(0.0)  # median of 0, 0, -2: against raw's p99
    assert figures["cpu_ms_by_thread"] == {"callboard-io": 2.2, "MainThread": 0.5}


def test_the_collectors_pauses_are_counted_by_generation_while_watched() -> None:
    with watch_gc() as pauses:
        gc.collect(2)
        gc.collect(0)
    gc.collect(2)  # no longer watched
    summary = pauses.summary()
    assert summary["gen2"]["count"] == 1
    assert summary["gen0"]["count"] >= 1  # the one asked, and any the test's garbage made
    assert 0 <= summary["gen2"]["max"] <= summary["gen2"]["total"]


def test_the_pauses_figure_is_each_systems_median_over_rounds() -> None:
    def pauses(total: float) -> dict[str, dict[str, float]]:
        return {"gen2": {"count": 1, "total": total, "max": total}}

    runs = [
        _run("callboard", 0, 101.0, 110.0, 900.0, gc_pause_ms=pauses(60.0)),
        _run("callboard", 1, 101.0, 110.0, 900.0, gc_pause_ms={}),  # none in this round
        _run("callboard", 2, 101.0, 110.0, 900.0, gc_pause_ms=pauses(80.0)),
        _run("aiohttp", 0, 100.0, 104.0, 1000.0, gc_pause_ms={}),
    ]
    figures = streaming_figures(runs)
    assert figures["gc_pause_ms"]["callboard"]["gen2"] == {"count": 1, "total": 60.0, "max": 60.0}
    assert figures["gc_pause_ms"]["aiohttp"] == {}


def test_without_the_raw_client_the_comparisons_are_not_measured() -> None:
    figures = streaming_figures([_run("callboard", 0, 101.0, 110.0, 900.0)])
    assert figures["overhead_ms"] == {"p50": None, "p95": None, "p99": None}
    assert figures["tokens_per_s_ratio"] is None
    verdicts = {t.name: t.verdict for t in evaluate({"streaming": _result(figures)}, [])}
    assert verdicts["TTFT p50 overhead ms over aiohttp"] == "n/a"


def _result(figures: dict[str, Any]) -> ScenarioResult:
    return ScenarioResult(name="streaming", figures=figures)


@pytest.mark.timeout(90)
def test_a_small_run_streams_every_answer_whole_through_both_systems() -> None:
    scale = dataclasses.replace(
        Scale.small(), stream_count=16, stream_concurrency=4, stream_tokens=5, stream_rounds=2
    )
    result = run_streaming(Options(scale=scale, scenarios=("streaming",), baselines=("aiohttp",)))
    assert [(r.system, r.round) for r in result.runs] == [
        ("callboard", 0),
        ("aiohttp", 0),
        ("aiohttp", 1),
        ("callboard", 1),
    ]
    for run in result.runs:
        assert (run.tasks, run.ok, run.failed, run.lost) == (16, 16, 0, 0)
        assert run.extra["tokens_delivered"] == 16 * 5
        assert run.completion_tokens == 16 * 5  # the provider's usage agrees
        assert run.server["requests"] == 16
        assert run.server["max_in_flight"] <= 4
        assert run.latency.count == 16
        assert run.latency.p50 is not None
        assert run.latency.p50 >= 1000 * scale.stream_ttft_s  # no token before its time
    figures = result.figures
    for q in ("p50", "p95", "p99"):
        assert figures["overhead_ms"][q] is not None
        assert figures["inner_ttft_ms"][q] is not None
    assert figures["tokens_per_s_ratio"] > 0
    assert (figures["failed"], figures["lost"], figures["short_streams"]) == (0, 0, 0)
    assert figures["handover_ms"]["p50"] >= 0  # the reader sees a delta after the call does
    assert figures["to_reader_ms"]["p50"] is not None
    assert all(v is not None for v in figures["overhead_split_ms"].values())
    assert figures["cpu_ms_by_thread"]["callboard-io"] > 0  # the I/O loop read every stream
    assert set(figures["gc_pause_ms"]) == {"callboard", "aiohttp"}
