"""Scenario ``streaming``: time to first token and tokens delivered, against raw aiohttp.

The provider streams every answer as server-sent events: its first token
``ttft_s`` after the request, then one token every ``gap_s``, ``tokens`` in
all. ``streams`` streams go through each system in ``concurrency`` lanes: a
lane opens its next stream when its last one ends, so ``concurrency`` streams
are open at once, and neither system ever queues one. The lanes start spread
evenly over one stream's length, so streams open at a steady rate, as a
service's users open them, not in waves of ``concurrency`` at once: a wave of
200 requests queues in any server, and time to first token would measure
that queue.

- ``callboard``: an ``AsyncSystem`` with one model (``max_concurrency`` =
  ``concurrency``); each stream is ``cb.stream(prompt)`` read with ``async for``
  on the caller's loop.
- ``aiohttp`` (when that baseline is selected): one shared
  ``aiohttp.ClientSession`` posting the very body callboard sends (``stream``
  and ``stream_options.include_usage``) and reading the event stream line by
  line (``data:`` lines, each chunk parsed with ``json.loads``).

Both readers run on the same kind of loop (uvloop when installed) in the
bench's main thread and take their clocks there: a stream's time to first
token is from just before it is opened (``cb.stream``, ``session.post``) to
its first text delta in the reader's hands; a token is a delta with text.
The two run in rounds of alternating order, each after a warm-up of one
stream per lane that opens its connections.

Figures: time to first token p50/p95/p99 for each system (medians over
rounds), the overhead (callboard's percentile minus raw aiohttp's in the same
round; the median over rounds), tokens delivered per second of the measured
section and its ratio (same-round pairs, median), and where callboard's
extra time goes: ``inner_ttft_ms`` (its own ``Completed.ttft_s``: the call's
start to its first delta on the I/O loop), ``handover_ms`` (the reader's time
to first token less that: getting a stream to its call, and its first delta
to the reader) and ``dispatch_ms`` (``Completed.queue_wait_s``: submitted to
the call's start on the I/O loop, through the front door, router, queue, the model
actor and the loop's own queue). ``overhead_split_ms`` splits the p50 overhead
along a stream's path (``overhead_split_p99_ms`` the p99's, each part at its own
p99): ``dispatch`` (as above), ``io_read`` (the I/O loop's call start to first
delta less the raw client's whole time to first token in the same round: what
reading the same bytes costs the I/O loop more than the raw client's loop) and
``to_reader`` (a stream's time to first token less its dispatch and inner time:
the first delta crossing to the reader's loop).
``cpu_ms_by_thread``: callboard's client CPU per stream by kind of thread
(``callboard-io``, ``MainThread`` (the reader), each actor), medians over rounds.
``gc_pause_ms``: for each system, the garbage collector's pauses over the
measured part (count, total and longest, by generation; medians over rounds): a
collection holds the GIL, so every thread of the client waits it out, and a full
one lands on the time to first token of the streams that were about to get it.
The provider's CPU share over each measured run is kept beside it (near a
whole core, the server, not the client, would bind the run). The table's
latency columns are time to first token here; ``req/s`` is streams per second.

What must hold: every stream is read to its end or counted failed; a run is
bounded by its time cap (streams still open then are cancelled and counted
not done); every session, system and loop is closed before a run returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from callboard.bench.measure import (
    Meter,
    Run,
    ScenarioResult,
    median,
    percentiles,
    usage_cost_nusd,
)
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.subject import bench_model, thread_cpu_s
from callboard.messages import Completed
from callboard.runtime.io_loop import new_event_loop

from callboard import AsyncSystem, StreamFailedError, SystemConfig

__all__ = ["GcPauses", "StreamLoad", "read_sse", "run_streaming", "streaming_figures", "watch_gc"]

log = logging.getLogger(__name__)

NAME = "streaming"
MODEL = "streamer"
SYSTEMS = ("callboard", "aiohttp")
QUANTILES = ("p50", "p95", "p99")
_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamLoad:
    """What each system is asked to stream in one measurement."""

    base_url: str
    streams: int
    concurrency: int
    tokens: int
    """Tokens per answer (the provider's fixed completion size)."""
    ttft_s: float
    gap_s: float
    time_cap_s: float = 120.0

    @property
    def ideal_stream_s(self) -> float:
        """How long one stream lasts at the provider's pace, with no client cost."""
        return self.ttft_s + (self.tokens - 1) * self.gap_s

    def prompt(self, i: int) -> str:
        return f"bench stream {i}: tell the story of ticket #{i}, one word at a time."

    @property
    def max_tokens(self) -> int:
        return self.tokens + 8  # room above the answer's fixed size: it is never cut

    def body(self, i: int) -> bytes:
        """The body callboard sends for ``cb.stream(prompt(i), max_tokens=...)``."""
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": self.prompt(i)}],
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return json.dumps(chat, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Seen:
    """One stream as its reader saw it."""

    ok: bool
    ttft_s: float | None = None
    """Opened to the first text delta in the reader's hands."""
    duration_s: float = 0.0
    """Opened to the end of the stream."""
    tokens: int = 0
    """Text deltas read."""
    completion_tokens: int = 0
    """What the provider's usage said."""
    prompt_tokens: int = 0
    inner_ttft_s: float | None = None
    """callboard's own ``Completed.ttft_s`` (its call's start to its first delta)."""
    dispatch_s: float | None = None
    """callboard's ``Completed.queue_wait_s``: submitted to the call's start on the I/O
    loop."""
    cost_nusd: int = 0


_NOT_DONE = Seen(ok=False)
OpenOne = Callable[[int], Awaitable[Seen]]


def run_streaming(opts: Options) -> ScenarioResult:
    scale = opts.scale
    result = ScenarioResult(name=NAME)
    result.settings = {
        "streams": scale.stream_count,
        "concurrency": scale.stream_concurrency,
        "tokens_per_stream": scale.stream_tokens,
        "ttft_s": scale.stream_ttft_s,
        "token_gap_s": scale.stream_gap_s,
        "rounds": scale.stream_rounds,
        "ideal_stream_s": round(
            scale.stream_ttft_s + (scale.stream_tokens - 1) * scale.stream_gap_s, 4
        ),
    }
    extra = [
        "--ttft",
        repr(scale.stream_ttft_s),
        "--token-gap",
        repr(scale.stream_gap_s),
        "--completion-tokens",
        str(scale.stream_tokens),
    ]
    systems = [s for s in SYSTEMS if s == "callboard" or s in opts.baselines]
    with ProviderProcess(latency_s=scale.stream_ttft_s, seed=opts.seed, extra_args=extra) as prov:
        load = StreamLoad(
            base_url=prov.base_url,
            streams=scale.stream_count,
            concurrency=scale.stream_concurrency,
            tokens=scale.stream_tokens,
            ttft_s=scale.stream_ttft_s,
            gap_s=scale.stream_gap_s,
        )
        for rnd in range(scale.stream_rounds):
            order = systems if rnd % 2 == 0 else systems[::-1]
            for name in order:
                log.info("streaming round %d: %s", rnd, name)
                gc.collect()
                result.runs.append(_measured_with_server(prov, name, load, rnd))
    result.figures = streaming_figures(result.runs)
    result.notes.append(
        "the table's latency columns are time to first token at the reader; "
        "req/s is streams per second"
    )
    return result


def _measured_with_server(prov: ProviderProcess, name: str, load: StreamLoad, rnd: int) -> Run:
    """``measure``, with the provider's counters and its CPU share over the measured part
    (near a whole core, the server would bind the run, not the client)."""
    began: list[float | None] = []

    def on_start() -> None:
        prov.reset_stats()
        began.append(prov.cpu_s())

    run = measure(name, load, on_start=on_start)
    run.take_server(prov.stats())
    run.round = rnd
    ended = prov.cpu_s()
    if began and began[0] is not None and ended is not None and run.wall_s > 0:
        run.extra["server_cpu_share"] = (ended - began[0]) / run.wall_s
    return run


def measure(name: str, load: StreamLoad, on_start: Callable[[], object] | None = None) -> Run:
    """One system (``callboard`` or ``aiohttp``) on ``load``, on a fresh loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        if name == "callboard":
            return runner.run(_callboard(load, on_start))
        return runner.run(_raw(load, on_start))


async def _callboard(load: StreamLoad, on_start: Callable[[], object] | None) -> Run:
    config = SystemConfig(models=(bench_model(MODEL, load.base_url, load.concurrency),))
    async with AsyncSystem(config) as cb:

        async def one(i: int) -> Seen:
            opened = time.perf_counter()
            stream = cb.stream(load.prompt(i), max_tokens=load.max_tokens)
            first: float | None = None
            tokens = 0
            try:
                async for delta in stream:
                    if delta.text:
                        if first is None:
                            first = time.perf_counter()
                        tokens += 1
            except StreamFailedError:
                return Seen(ok=False, duration_s=time.perf_counter() - opened, tokens=tokens)
            ended = time.perf_counter()
            answer = await stream.result()
            assert isinstance(answer, Completed)  # a stream that did not complete raised
            return Seen(
                ok=True,
                ttft_s=None if first is None else first - opened,
                duration_s=ended - opened,
                tokens=tokens,
                completion_tokens=answer.usage.completion_tokens,
                prompt_tokens=answer.usage.prompt_tokens,
                inner_ttft_s=answer.ttft_s,
                dispatch_s=answer.queue_wait_s,
                cost_nusd=answer.cost_nusd,
            )

        return await _measured(one, load, "callboard", on_start)


async def _raw(load: StreamLoad, on_start: Callable[[], object] | None) -> Run:
    connector = aiohttp.TCPConnector(limit=load.concurrency)
    url = load.base_url.rstrip("/") + "/chat/completions"
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> Seen:
            opened = time.perf_counter()
            async with session.post(url, data=load.body(i), headers=_HEADERS) as resp:
                if resp.status != 200:
                    await resp.read()
                    return Seen(ok=False, duration_s=time.perf_counter() - opened)
                return await read_sse(resp.content, opened)

        return await _measured(one, load, "aiohttp", on_start)


async def read_sse(lines: AsyncIterable[bytes], opened: float) -> Seen:
    """Read an OpenAI event stream line by line as a raw client does: ``data:`` lines,
    each chunk parsed, a token per text delta, the usage from the last chunk, to the
    body's end (which frees the connection for the next stream); ok if ``[DONE]`` came."""
    first: float | None = None
    ended: float | None = None
    tokens = prompt = completion = 0
    async for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            ended = time.perf_counter()
            continue
        chunk = json.loads(data)
        for choice in chunk.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                if first is None:
                    first = time.perf_counter()
                tokens += 1
        usage = chunk.get("usage")
        if usage:
            prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    if ended is None:
        return Seen(ok=False, duration_s=time.perf_counter() - opened, tokens=tokens)
    return Seen(
        ok=True,
        ttft_s=None if first is None else first - opened,
        duration_s=ended - opened,
        tokens=tokens,
        completion_tokens=completion,
        prompt_tokens=prompt,
        cost_nusd=usage_cost_nusd(prompt, completion),
    )


async def _measured(
    one: OpenOne, load: StreamLoad, system: str, on_start: Callable[[], object] | None
) -> Run:
    """Warm up (one stream per lane: every connection opened), then the measured streams."""
    await _drive(one, load, range(load.concurrency))
    if on_start is not None:
        on_start()
    start = load.concurrency
    before = thread_cpu_s()
    with Meter() as meter, watch_gc() as pauses:
        seen = await _drive(one, load, range(start, start + load.streams))
    run = _as_run(load, seen, meter, system)
    run.extra["gc_pause_ms"] = pauses.summary()
    if system == "callboard":
        run.extra["cpu_ms_by_thread"] = _per_stream_ms(before, thread_cpu_s(), len(seen))
    return run


@dataclass(slots=True)
class GcPauses:
    """The collector's pauses seen while it was watched: (generation, seconds) each."""

    pauses: list[tuple[int, float]] = field(default_factory=list)
    _began: float = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks``' hook: the start and the end of each collection."""
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._began))

    def summary(self) -> dict[str, dict[str, float]]:
        """By generation (``gen0``...): ``count``, ``total`` and ``max`` (ms)."""
        by: dict[int, list[float]] = {}
        for generation, took in self.pauses:
            by.setdefault(generation, []).append(took)
        return {
            f"gen{g}": {
                "count": len(took),
                "total": round(1e3 * sum(took), 3),
                "max": round(1e3 * max(took), 3),
            }
            for g, took in sorted(by.items())
        }


@contextlib.contextmanager
def watch_gc() -> Iterator[GcPauses]:
    """Record the collector's pauses (every thread's) while the block runs."""
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(pauses)


def _per_stream_ms(
    before: dict[str, float], after: dict[str, float], streams: int
) -> dict[str, float]:
    """CPU milliseconds per stream each kind of thread spent between two readings."""
    if not streams:
        return {}
    return {
        kind: round(1e3 * (cpu - before.get(kind, 0.0)) / streams, 4)
        for kind, cpu in sorted(after.items(), key=lambda kv: -kv[1])
    }


async def _drive(one: OpenOne, load: StreamLoad, span: range) -> list[Seen]:
    """Stream ``span`` through ``concurrency`` lanes, until the time cap.

    Each lane opens its next stream when its last one ends; the lanes start spread
    evenly over one stream's ideal length, so streams open at a steady rate, not in
    waves of ``concurrency`` at once (a wave queues in any server, and time to first
    token would measure that queue). Streams not read by the time cap count not done.
    """
    deadline = time.perf_counter() + load.time_cap_s
    stagger = load.ideal_stream_s / load.concurrency
    todo = iter(span)
    seen: dict[int, Seen] = {}

    async def lane(k: int) -> None:
        await asyncio.sleep(k * stagger)
        for i in todo:  # shared by the lanes: each takes the next stream
            if time.perf_counter() > deadline:
                return
            seen[i] = await one(i)

    lanes = [asyncio.ensure_future(lane(k)) for k in range(min(load.concurrency, len(span)))]
    if not lanes:
        return []
    _, pending = await asyncio.wait(lanes, timeout=load.time_cap_s)
    for task in pending:  # a stream still open at the time cap: not counted
        task.cancel()
    await asyncio.gather(*lanes, return_exceptions=True)
    for task in lanes:
        if not task.cancelled() and (error := task.exception()) is not None:
            raise error  # a bug in a reader, not a stream's outcome
    return [seen.get(i, _NOT_DONE) for i in span]


def _as_run(load: StreamLoad, seen: Sequence[Seen], meter: Meter, system: str) -> Run:
    ok = [s for s in seen if s.ok]
    delivered = sum(s.tokens for s in ok)
    inner = [s.inner_ttft_s for s in ok if s.inner_ttft_s is not None]
    handover = [
        s.ttft_s - s.inner_ttft_s for s in ok if s.ttft_s is not None and s.inner_ttft_s is not None
    ]
    dispatch = [s.dispatch_s for s in ok if s.dispatch_s is not None]
    to_reader = [
        s.ttft_s - s.inner_ttft_s - s.dispatch_s
        for s in ok
        if s.ttft_s is not None and s.inner_ttft_s is not None and s.dispatch_s is not None
    ]
    return Run(
        scenario=NAME,
        system=system,
        label=f"C{load.concurrency}",
        concurrency=load.concurrency,
        tasks=len(seen),
        ok=len(ok),
        failed=len(seen) - len(ok),
        wall_s=meter.wall_s,
        cpu_s=meter.cpu_s,
        latency=percentiles(s.ttft_s for s in ok if s.ttft_s is not None),
        end_to_end=percentiles(s.duration_s for s in ok),
        lost=sum(s is _NOT_DONE for s in seen),
        duplicated=0,
        prompt_tokens=sum(s.prompt_tokens for s in ok),
        completion_tokens=sum(s.completion_tokens for s in ok),
        cost_nusd=sum(s.cost_nusd for s in ok),
        extra={
            "tokens_delivered": delivered,
            "tokens_per_s": delivered / meter.wall_s if meter.wall_s > 0 else 0.0,
            "short_streams": sum(s.tokens != load.tokens for s in ok),
            "inner_ttft": percentiles(inner) if inner else None,
            "handover": percentiles(handover) if handover else None,
            "dispatch": percentiles(dispatch) if dispatch else None,
            "to_reader": percentiles(to_reader) if to_reader else None,
        },
    )


def streaming_figures(runs: Sequence[Run]) -> dict[str, Any]:
    """The scenario's figures from its runs (see the module docstring)."""
    by: dict[str, dict[int, Run]] = {}
    for run in runs:
        by.setdefault(run.system, {})[run.round] = run
    cb, raw = by.get("callboard", {}), by.get("aiohttp", {})
    figures: dict[str, Any] = {
        "ttft_ms": {
            name: {q: _median_of(mine.values(), q) for q in QUANTILES} for name, mine in by.items()
        },
        "tokens_per_s": {
            name: median([r.extra["tokens_per_s"] for r in mine.values()])
            for name, mine in by.items()
        },
        "failed": sum(r.failed for r in cb.values()),
        "lost": sum(r.lost or 0 for r in cb.values()),
        "short_streams": sum(r.extra["short_streams"] for r in cb.values()),
        "inner_ttft_ms": _inner(cb.values(), "inner_ttft"),
        "handover_ms": _inner(cb.values(), "handover"),
        "dispatch_ms": _inner(cb.values(), "dispatch"),
        "to_reader_ms": _inner(cb.values(), "to_reader"),
        "cpu_ms_by_thread": _cpu_by_thread(cb.values()),
        "gc_pause_ms": {name: _gc_by_generation(mine.values()) for name, mine in by.items()},
    }
    pairs = [(cb[k], raw[k]) for k in sorted(cb) if k in raw]
    figures["overhead_ms"] = {
        q: median(
            [
                a - b
                for c, r in pairs
                if (a := _quantile(c.latency, q)) is not None
                and (b := _quantile(r.latency, q)) is not None
            ]
        )
        for q in QUANTILES
    }
    figures["overhead_split_ms"] = _overhead_split(pairs, "p50")
    figures["overhead_split_p99_ms"] = _overhead_split(pairs, "p99")
    figures["tokens_per_s_ratio"] = median(
        [
            c.extra["tokens_per_s"] / r.extra["tokens_per_s"]
            for c, r in pairs
            if r.extra["tokens_per_s"]
        ]
    )
    return figures


def _overhead_split(pairs: Sequence[tuple[Run, Run]], q: str) -> dict[str, float | None]:
    """The overhead's percentile ``q`` along a stream's path, medians over same-round
    pairs (see the module docstring): ``dispatch``, ``io_read`` and ``to_reader``, each
    at ``q`` (at p99 the parts need not add up: the slowest streams of one part are not
    those of another; each says how far its part reaches)."""

    def at(run: Run, key: str) -> float | None:
        found = run.extra.get(key)
        return None if found is None else _quantile(found, q)

    io_read = [
        inner - raw
        for c, r in pairs
        if (inner := at(c, "inner_ttft")) is not None and (raw := _quantile(r.latency, q))
    ]
    return {
        "dispatch": median([v for c, _ in pairs if (v := at(c, "dispatch")) is not None]),
        "io_read": median(io_read),
        "to_reader": median([v for c, _ in pairs if (v := at(c, "to_reader")) is not None]),
    }


def _cpu_by_thread(runs: Any) -> dict[str, float | None]:
    """Medians over rounds of callboard's CPU ms per stream, by kind of thread."""
    found = [r.extra["cpu_ms_by_thread"] for r in runs if r.extra.get("cpu_ms_by_thread")]
    kinds = sorted({k for f in found for k in f}, key=lambda k: -max(f.get(k, 0.0) for f in found))
    return {k: median([f[k] for f in found if k in f]) for k in kinds}


def _gc_by_generation(runs: Any) -> dict[str, dict[str, float | None]]:
    """Medians over rounds of one system's collector pauses, by generation (a round
    without a collection of a generation counts none)."""
    found = [r.extra.get("gc_pause_ms") or {} for r in runs]
    kinds = sorted({g for f in found for g in f})
    zero = {"count": 0.0, "total": 0.0, "max": 0.0}
    return {
        g: {k: median([f.get(g, zero)[k] for f in found]) for k in ("count", "total", "max")}
        for g in kinds
    }


def _median_of(runs: Any, q: str) -> float | None:
    """The median over ``runs`` of their time-to-first-token percentile ``q``."""
    return median([v for r in runs if (v := _quantile(r.latency, q)) is not None])


def _quantile(p: Any, q: str) -> float | None:
    value: float | None = getattr(p, q)
    return value


def _inner(runs: Any, key: str) -> dict[str, float | None]:
    """Medians over rounds of callboard's own percentiles under ``extra[key]``."""
    found = [r.extra[key] for r in runs if r.extra.get(key) is not None]
    return {q: median([v for p in found if (v := getattr(p, q)) is not None]) for q in QUANTILES}
