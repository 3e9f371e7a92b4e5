"""Scenario ``embeddings``: many short texts through ``cb.embed`` against raw aiohttp.

``texts`` short texts (a few tokens each) are embedded by each system, the
provider answering every call after ``latency_s``:

- ``callboard``: a ``System`` with one model (``max_concurrency`` =
  ``concurrency``, ``embedding_batch_size`` = ``batch``); one
  ``cb.embed(texts, model=..., dimensions=...)`` call, which splits the texts
  into calls of ``batch``, sends them, and gives the vectors back in input
  order (as floats, asked for as base64 on the wire, the way ``embed`` does).
- ``aiohttp`` (when that baseline is selected): one shared
  ``aiohttp.ClientSession`` sending the same batches (the same ``batch``
  texts per call, the same body: ``encoding_format`` base64 and the
  ``dimensions``) with a semaphore of ``concurrency``, reading each answer as
  the official SDK does (``json.loads``, each vector's base64 decoded to
  floats) and putting the vectors in input order.

The measured section runs from the first call to every vector in the caller's
hands. The two run in rounds of alternating order, each after a warm-up of
``concurrency`` batches that opens its connections. The provider's request
count and its most calls in flight confirm both sent the same batches at the
same concurrency.

Figures: texts per second for each (medians over rounds) and their ratio
(same-round pairs, median); calls sent; failures; and a check of the vectors
each system handed back against the provider's own rule (a sample across the
input, so order and completeness are checked without keeping both systems'
vectors at once). ``req/s`` in the table is texts per second here.

What must hold: every system and session is closed before a run returns; a
run is bounded by its time cap; one system's vectors are dropped before the
next system runs (100k vectors of floats take hundreds of MB).
"""

from __future__ import annotations

import array
import asyncio
import base64
import dataclasses
import gc
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from callboard.bench.measure import (
    BENCH_KEY,
    BENCH_PRICE,
    Meter,
    Run,
    ScenarioResult,
    median,
    percentiles,
    usage_cost_nusd,
)
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.subject import thread_cpu_s
from callboard.core.secret import Secret
from callboard.core.settings import ModelSettings
from callboard.provider.embeddings import vector
from callboard.runtime.io_loop import new_event_loop

from callboard import System, SystemConfig

__all__ = ["EmbedLoad", "check_vectors", "run_embeddings"]

log = logging.getLogger(__name__)

NAME = "embeddings"
MODEL = "embedder"
SYSTEMS = ("callboard", "aiohttp")
SAMPLE = 64
"""Vectors checked per run against the provider's rule, spread across the input."""
_HEADERS = {
    "content-type": "application/json",
    "accept": "application/json",
    "authorization": f"Bearer {BENCH_KEY}",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbedLoad:
    """What each system is asked to embed in one measurement."""

    base_url: str
    texts: int
    batch: int
    concurrency: int
    dimensions: int
    time_cap_s: float = 300.0

    def text(self, i: int) -> str:
        return f"ticket #{i}: printer on floor {i % 7} jams"

    def body(self, texts: Sequence[str]) -> bytes:
        """The body ``cb.embed`` sends for one batch."""
        call = {
            "model": MODEL,
            "input": list(texts),
            "dimensions": self.dimensions,
            "encoding_format": "base64",
        }
        return json.dumps(call, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Embedded:
    """What one system handed back for one measured input."""

    vectors: list[list[float]] = field(repr=False)
    """In input order (empty if the input failed). Kept out of the repr: asyncio may
    format the result of the task that returned it, and 100k vectors take a minute."""
    failed_batches: int
    prompt_tokens: int
    cost_nusd: int
    batch_latency_s: list[float]
    """Each call's time, where the system shows it (the raw client)."""
    cpu_ms_by_thread: dict[str, float] = field(default_factory=dict)
    """The measured section's CPU per 1,000 texts, by kind of thread (``thread_cpu_s``)."""


def run_embeddings(opts: Options) -> ScenarioResult:
    scale = opts.scale
    result = ScenarioResult(name=NAME)
    result.settings = {
        "texts": scale.embed_texts,
        "batch": scale.embed_batch,
        "concurrency": scale.embed_concurrency,
        "dimensions": scale.embed_dimensions,
        "latency_s": scale.latency_s,
        "rounds": scale.embed_rounds,
        "encoding_format": "base64",
    }
    systems = [s for s in SYSTEMS if s == "callboard" or s in opts.baselines]
    with ProviderProcess(latency_s=scale.latency_s, seed=opts.seed) as prov:
        load = EmbedLoad(
            base_url=prov.base_url,
            texts=scale.embed_texts,
            batch=scale.embed_batch,
            concurrency=scale.embed_concurrency,
            dimensions=scale.embed_dimensions,
        )
        for rnd in range(scale.embed_rounds):
            order = systems if rnd % 2 == 0 else systems[::-1]
            for name in order:
                log.info("embeddings round %d: %s", rnd, name)
                gc.collect()
                run = measure(name, load, on_start=prov.reset_stats)
                run.take_server(prov.stats())
                run.round = rnd
                result.runs.append(run)
    result.figures = embeddings_figures(result.runs, load.texts, load.batch)
    result.notes.append("req/s in the table is texts per second; tasks are texts")
    return result


def measure(name: str, load: EmbedLoad, on_start: Callable[[], object] | None = None) -> Run:
    """One system (``callboard`` or ``aiohttp``) embedding ``load``'s texts."""
    texts = [load.text(i) for i in range(load.texts)]
    warm = [f"warm-up {i}" for i in range(load.batch * load.concurrency)]
    if name == "callboard":
        embedded, meter = _callboard(load, texts, warm, on_start)
    else:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            embedded, meter = runner.run(_raw(load, texts, warm, on_start))
    run = _as_run(name, load, embedded, meter)
    run.extra["vectors_checked"], run.extra["vectors_wrong"] = check_vectors(
        embedded.vectors, texts, load.dimensions
    )
    return run


def _callboard(
    load: EmbedLoad, texts: list[str], warm: list[str], on_start: Callable[[], object] | None
) -> tuple[Embedded, Meter]:
    model = ModelSettings(
        name=MODEL,
        base_url=load.base_url,
        max_concurrency=load.concurrency,
        price=BENCH_PRICE,
        api_key=Secret(BENCH_KEY),
        embedding_batch_size=load.batch,
    )
    with System(SystemConfig(models=(model,))) as cb:
        cb.embed(warm, model=MODEL, dimensions=load.dimensions).result(load.time_cap_s)
        gc.collect()
        if on_start is not None:
            on_start()
        before = thread_cpu_s()
        with Meter() as meter:
            answer = cb.embed(texts, model=MODEL, dimensions=load.dimensions).result(
                load.time_cap_s
            )
        spent = _per_1k_texts(before, thread_cpu_s(), len(texts))
    embedded = Embedded(
        vectors=answer.vectors if answer.ok else [],
        failed_batches=0 if answer.ok else 1,
        prompt_tokens=answer.usage.prompt_tokens,
        cost_nusd=answer.cost_nusd,
        batch_latency_s=[],
        cpu_ms_by_thread=spent,
    )
    return embedded, meter


async def _raw(
    load: EmbedLoad, texts: list[str], warm: list[str], on_start: Callable[[], object] | None
) -> tuple[Embedded, Meter]:
    connector = aiohttp.TCPConnector(limit=load.concurrency)
    url = load.base_url.rstrip("/") + "/embeddings"
    async with aiohttp.ClientSession(connector=connector) as session:
        await _raw_embed(session, url, load, warm)
        gc.collect()
        if on_start is not None:
            on_start()
        before = thread_cpu_s()
        with Meter() as meter:
            embedded = await asyncio.wait_for(
                _raw_embed(session, url, load, texts), timeout=load.time_cap_s
            )
        spent = _per_1k_texts(before, thread_cpu_s(), len(texts))
    return dataclasses.replace(embedded, cpu_ms_by_thread=spent), meter


def _per_1k_texts(
    before: dict[str, float], after: dict[str, float], texts: int
) -> dict[str, float]:
    """CPU milliseconds per 1,000 texts each kind of thread spent between two readings."""
    return {
        kind: round(1e6 * (cpu - before.get(kind, 0.0)) / texts, 2)
        for kind, cpu in sorted(after.items(), key=lambda kv: -kv[1])
        if texts and cpu > before.get(kind, 0.0)
    }


async def _raw_embed(
    session: aiohttp.ClientSession, url: str, load: EmbedLoad, texts: Sequence[str]
) -> Embedded:
    """Every batch of ``texts``, ``concurrency`` at a time; the vectors in input order."""
    sem = asyncio.Semaphore(load.concurrency)
    starts = range(0, len(texts), load.batch)

    async def one(start: int) -> tuple[list[list[float]], int, float] | None:
        async with sem:
            began = time.perf_counter()
            async with session.post(
                url, data=load.body(texts[start : start + load.batch]), headers=_HEADERS
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    return None
            answer = json.loads(raw)
            data = sorted(answer["data"], key=lambda item: item["index"])
            vectors = [_floats(item["embedding"]) for item in data]
            return vectors, int(answer["usage"]["prompt_tokens"]), time.perf_counter() - began

    answers = await asyncio.gather(*(one(s) for s in starts))
    vectors: list[list[float]] = []
    failed = tokens = 0
    latencies: list[float] = []
    for got in answers:
        if got is None:
            failed += 1
            continue
        vectors += got[0]
        tokens += got[1]
        latencies.append(got[2])
    if failed:
        vectors = []
    return Embedded(vectors, failed, tokens, usage_cost_nusd(tokens, 0), latencies)


def _floats(encoded: str) -> list[float]:
    """A base64 vector (little-endian float32) as floats, as the official SDK reads it."""
    values = array.array("f")
    values.frombytes(base64.b64decode(encoded))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def check_vectors(
    vectors: Sequence[Sequence[float]], texts: Sequence[str], dimensions: int
) -> tuple[int, int]:
    """(checked, wrong): a sample of ``vectors`` against the provider's rule for their
    texts. A missing vector (too few handed back) counts wrong."""
    if not texts:
        return 0, 0
    step = max(1, len(texts) // SAMPLE)
    picks = sorted({*range(0, len(texts), step), len(texts) - 1})
    if len(vectors) != len(texts):  # none may be where it belongs
        return len(picks), len(picks)
    wrong = sum(list(vectors[i]) != vector(texts[i].encode(), dimensions) for i in picks)
    return len(picks), wrong


def _as_run(name: str, load: EmbedLoad, embedded: Embedded, meter: Meter) -> Run:
    done = len(embedded.vectors)
    return Run(
        scenario=NAME,
        system=name,
        label=f"B{load.batch}xC{load.concurrency}",
        concurrency=load.concurrency,
        tasks=load.texts,
        ok=done,
        failed=load.texts - done,
        wall_s=meter.wall_s,
        cpu_s=meter.cpu_s,
        latency=percentiles(embedded.batch_latency_s),
        lost=0,
        duplicated=0,
        prompt_tokens=embedded.prompt_tokens,
        cost_nusd=embedded.cost_nusd,
        extra={
            "failed_batches": embedded.failed_batches,
            "cpu_ms_by_thread": embedded.cpu_ms_by_thread,
        },
    )


def embeddings_figures(runs: Sequence[Run], texts: int, batch: int) -> dict[str, Any]:
    """The scenario's figures from its runs (see the module docstring)."""
    by: dict[str, dict[int, Run]] = {}
    for run in runs:
        by.setdefault(run.system, {})[run.round] = run
    cb, raw = by.get("callboard", {}), by.get("aiohttp", {})
    pairs = [(cb[k], raw[k]) for k in sorted(cb) if k in raw]
    return {
        "texts_per_s": {
            name: median([r.throughput for r in mine.values()]) for name, mine in by.items()
        },
        "throughput_ratio": median(
            [c.throughput / r.throughput for c, r in pairs if r.throughput > 0]
        ),
        "calls_expected": -(-texts // batch),
        "server_requests": {
            name: [r.server.get("requests") for r in mine.values()] for name, mine in by.items()
        },
        "server_max_in_flight": {
            name: max((r.server.get("max_in_flight") or 0) for r in mine.values())
            for name, mine in by.items()
        },
        "failed_texts": sum(r.failed for r in cb.values()),
        "vectors_wrong": sum(r.extra["vectors_wrong"] for r in cb.values()),
        "vectors_checked": sum(r.extra["vectors_checked"] for r in cb.values()),
        "cpu_ms_per_1k_texts": {
            name: median([1e6 * r.cpu_s / r.tasks for r in mine.values() if r.tasks])
            for name, mine in by.items()
        },
        "cpu_ms_per_1k_texts_by_thread": {
            name: _median_by_kind([r.extra.get("cpu_ms_by_thread", {}) for r in mine.values()])
            for name, mine in by.items()
        },
    }


def _median_by_kind(readings: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each kind of thread's median over the runs that saw it."""
    kinds = dict.fromkeys(kind for reading in readings for kind in reading)
    return {k: round(median([r[k] for r in readings if k in r]) or 0.0, 2) for k in kinds}
