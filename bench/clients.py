"""The baselines: the same workload sent without callboard, to measure callboard against.

- ``aiohttp``: one shared ``aiohttp.ClientSession`` and a semaphore; the
  ceiling for a Python client on this machine.
- ``httpx-aiohttp``: exactly the client path callboard's model actors use on
  the default transport (``runtime.http.ModelClient._post_direct``): the
  aiohttp session of an ``httpx_aiohttp.AiohttpTransport``, each call made
  on it with the options callboard gives it (no redirects, the body read as
  sent, aiohttp's timeouts) and the body parsed the same way, driven by a
  semaphore and no actors: callboard's ratio to it is the actors' own cost.
  (It was the transport's ``handle_async_request`` with an ``httpx.Request``
  until callboard stopped making httpx objects for a call, then a third of
  its CPU on the I/O loop: a baseline paying what callboard no longer did,
  which made a review find three C200 targets passed against a slower path.)
- ``httpx``: ``httpx.AsyncClient`` with its default transport and a semaphore.
- ``serial``: a scheduler that sends one request at a time (a priority heap
  and a blocking ``httpx.Client``), like the naive schedulers callboard
  replaces; bounded to a small count.
- ``litellm``: LiteLLM's ``Router`` pointed at the provider, only when
  ``litellm`` is importable.

Every asyncio client runs on the loop implementation callboard's I/O thread
uses (uvloop when installed), encodes each body with ``json.dumps`` and
parses each answer with ``json.loads``, as callboard does. Each request is
retried up to ``attempts`` times (Retry-After honoured, else exponential
backoff), holding its semaphore slot, which is what a naive client does.

What must hold: every client, session and loop is closed before a function
returns; at its deadline (``time_cap_s``) a run stops issuing requests and
cancels those in flight (they count as not done), so it is bounded in count
and time.
"""

from __future__ import annotations

import asyncio
import heapq
import importlib
import importlib.util
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import yarl
from callboard.bench.measure import BENCH_KEY, Meter, Run, percentiles, usage_cost_nusd
from callboard.runtime.http import RATE_HEADERS
from callboard.runtime.io_loop import new_event_loop

__all__ = ["BASELINES", "Outcome", "Workload", "litellm_available", "run_baseline"]

log = logging.getLogger(__name__)

BASELINES = ("aiohttp", "httpx-aiohttp", "httpx", "serial", "litellm")
_HEADERS = {
    "content-type": "application/json",
    "accept": "application/json",
    "authorization": f"Bearer {BENCH_KEY}",
}
_TIMEOUT_S = 30.0
_PRIORITIES = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What every system is asked to do in one measurement."""

    base_url: str
    model: str
    tasks: int
    concurrency: int
    max_tokens: int = 32
    attempts: int = 1
    """Calls per task at most (1 = no retry)."""
    time_cap_s: float = 60.0
    warmup: int = 0
    """Requests sent before the measured section (opens the connections)."""

    def prompt(self, i: int) -> str:
        return f"bench task {i}: summarise the state of ticket #{i} in one line."

    def body(self, i: int) -> bytes:
        chat = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompt(i)}],
            "max_tokens": self.max_tokens,
        }
        return json.dumps(chat, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Outcome:
    """One task as a baseline saw it."""

    ok: bool
    latency_s: float
    attempts: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ended_at: float = 0.0
    """``time.perf_counter()`` when the task ended."""


_SKIPPED = Outcome(ok=False, latency_s=0.0, attempts=0)
Send = Callable[[int], Awaitable[tuple[int, bytes, dict[str, str]]]]
Hook = Callable[[], object]


def litellm_available() -> bool:
    return importlib.util.find_spec("litellm") is not None


def run_baseline(
    name: str, scenario: str, label: str, work: Workload, on_start: Hook | None = None
) -> Run:
    """Measure baseline ``name`` on ``work``; ``on_start`` runs after the warm-up."""
    if name == "serial":
        return _serial(scenario, label, work, on_start)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(_run_async(name, scenario, label, work, on_start))


async def _run_async(
    name: str, scenario: str, label: str, work: Workload, on_start: Hook | None
) -> Run:
    send, close = _CLIENTS[name](work)
    try:
        half = work.warmup // 2  # half, then all: see subject.warm_up
        for span in (range(half), range(half, half + work.warmup)):
            await _drive(send, work, span, time.perf_counter() + work.time_cap_s)
        if on_start is not None:
            on_start()
        with Meter() as meter:
            deadline = time.perf_counter() + work.time_cap_s
            span = range(work.warmup, work.warmup + work.tasks)
            outcomes = await _drive(send, work, span, deadline)
    finally:
        await close()
    return _as_run(work, outcomes, meter, scenario=scenario, system=name, label=label)


async def _drive(send: Send, work: Workload, span: range, deadline: float) -> list[Outcome]:
    sem = asyncio.Semaphore(work.concurrency)
    rng = random.Random(span.start)

    async def one(i: int) -> Outcome:
        async with sem:
            if time.perf_counter() > deadline:
                return _SKIPPED
            return await _attempts(send, i, work.attempts, rng)

    tasks = [asyncio.ensure_future(one(i)) for i in span]
    if not tasks:
        return []
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    for task in pending:  # in flight at the time cap: not counted
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [_SKIPPED if t.cancelled() else t.result() for t in tasks]


async def _attempts(send: Send, i: int, attempts: int, rng: random.Random) -> Outcome:
    started = time.perf_counter()
    for attempt in range(1, attempts + 1):
        try:
            status, raw, headers = await send(i)
        except (OSError, TimeoutError, aiohttp.ClientError, httpx.HTTPError):
            status, raw, headers = 0, b"", {}
        if status == 200:
            prompt, completion = _usage(raw)
            now = time.perf_counter()
            return Outcome(True, now - started, attempt, prompt, completion, now)
        if attempt < attempts and (status == 429 or status >= 500 or status == 0):
            await asyncio.sleep(_backoff(attempt, headers, rng))
    now = time.perf_counter()
    return Outcome(False, now - started, attempts, ended_at=now)


def _backoff(attempt: int, headers: dict[str, str], rng: random.Random) -> float:
    """Retry-After if the server sent one, else 0.25 s doubling, plus up to 0.25 s jitter."""
    after_ms = headers.get("retry-after-ms")
    if after_ms is not None:
        return float(after_ms) / 1000.0
    return min(0.25 * 2.0 ** (attempt - 1), 20.0) + rng.uniform(0.0, 0.25)


def _usage(raw: bytes) -> tuple[int, int]:
    """Parse an answer as callboard does: the content, then the usage."""
    data = json.loads(raw)
    if not isinstance(data["choices"][0]["message"].get("content"), str):
        return 0, 0
    usage = data.get("usage") or {}
    return int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))


def _aiohttp_client(work: Workload) -> tuple[Send, Callable[[], Awaitable[object]]]:
    connector = aiohttp.TCPConnector(limit=work.concurrency)
    session = aiohttp.ClientSession(connector=connector)
    url = work.base_url.rstrip("/") + "/chat/completions"

    async def send(i: int) -> tuple[int, bytes, dict[str, str]]:
        async with session.post(url, data=work.body(i), headers=_HEADERS) as resp:
            raw = await resp.read()
            headers = {} if resp.status == 200 else {k.lower(): v for k, v in resp.headers.items()}
            return resp.status, raw, headers

    return send, session.close


def _httpx_aiohttp_client(work: Workload) -> tuple[Send, Callable[[], Awaitable[object]]]:
    from httpx_aiohttp import AiohttpTransport

    n = work.concurrency
    transport = AiohttpTransport(
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)
    )
    url = yarl.URL(work.base_url.rstrip("/") + "/chat/completions")
    timeout = aiohttp.ClientTimeout(sock_connect=5.0, sock_read=_TIMEOUT_S, connect=_TIMEOUT_S)
    session: aiohttp.ClientSession | None = None

    async def send(i: int) -> tuple[int, bytes, dict[str, str]]:
        nonlocal session
        if session is None:  # made on the loop, once, as callboard's is
            session = transport.client = transport.get_client()
        async with await session.request(
            "POST",
            url,
            headers=_HEADERS,
            data=work.body(i),
            allow_redirects=False,
            auto_decompress=False,
            compress=False,
            timeout=timeout,
        ) as resp:
            raw = await resp.read()
            headers = {} if resp.status == 200 else {k.lower(): v for k, v in resp.headers.items()}
            return resp.status, raw, headers

    return send, transport.aclose


def _httpx_client(work: Workload) -> tuple[Send, Callable[[], Awaitable[object]]]:
    n = work.concurrency
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n), timeout=_TIMEOUT_S
    )
    url = work.base_url.rstrip("/") + "/chat/completions"

    async def send(i: int) -> tuple[int, bytes, dict[str, str]]:
        response = await client.post(url, content=work.body(i), headers=_HEADERS)
        return response.status_code, response.content, _rate_headers(response.headers)

    return send, client.aclose


def _litellm_client(work: Workload) -> tuple[Send, Callable[[], Awaitable[object]]]:
    litellm: Any = importlib.import_module("litellm")
    params = {"model": f"openai/{work.model}", "api_base": work.base_url, "api_key": "bench"}
    router = litellm.Router(model_list=[{"model_name": work.model, "litellm_params": params}])

    async def send(i: int) -> tuple[int, bytes, dict[str, str]]:
        messages = [{"role": "user", "content": work.prompt(i)}]
        try:
            answer = await router.acompletion(
                model=work.model, messages=messages, max_tokens=work.max_tokens
            )
        except Exception:  # any LiteLLM error is a failed call here; say which
            log.exception("litellm call failed")
            return 0, b"", {}
        usage = answer.usage
        body = {
            "choices": [{"message": {"content": answer.choices[0].message.content}}],
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
            },
        }
        return 200, json.dumps(body).encode(), {}

    async def close() -> None:
        return None

    return send, close


def _rate_headers(headers: httpx.Headers) -> dict[str, str]:
    return {h: v for h in RATE_HEADERS if (v := headers.get(h)) is not None}


_CLIENTS: dict[str, Callable[[Workload], tuple[Send, Callable[[], Awaitable[object]]]]] = {
    "aiohttp": _aiohttp_client,
    "httpx-aiohttp": _httpx_aiohttp_client,
    "httpx": _httpx_client,
    "litellm": _litellm_client,
}
"""Each asyncio baseline: ``send(i) -> (status, body, headers)`` and what closes it."""


def _serial(scenario: str, label: str, work: Workload, on_start: Hook | None) -> Run:
    """One request at a time, most urgent first (priority = task number mod 4)."""
    url = work.base_url.rstrip("/") + "/chat/completions"
    heap = [(i % _PRIORITIES, i) for i in range(work.warmup, work.warmup + work.tasks)]
    heapq.heapify(heap)
    outcomes: list[Outcome] = []
    with httpx.Client(timeout=_TIMEOUT_S) as client:
        for i in range(work.warmup):
            client.post(url, content=work.body(i), headers=_HEADERS)
        if on_start is not None:
            on_start()
        with Meter() as meter:
            deadline = time.perf_counter() + work.time_cap_s
            while heap and time.perf_counter() < deadline:
                _, i = heapq.heappop(heap)
                started = time.perf_counter()
                response = client.post(url, content=work.body(i), headers=_HEADERS)
                ok = response.status_code == 200
                prompt, completion = _usage(response.content) if ok else (0, 0)
                now = time.perf_counter()
                outcomes.append(Outcome(ok, now - started, 1, prompt, completion, now))
    outcomes += [_SKIPPED] * len(heap)
    return _as_run(work, outcomes, meter, scenario=scenario, system="serial", label=label)


def _as_run(
    work: Workload, outcomes: list[Outcome], meter: Meter, *, scenario: str, system: str, label: str
) -> Run:
    done = [o for o in outcomes if o.attempts]
    ok = [o for o in done if o.ok]
    prompt = sum(o.prompt_tokens for o in ok)
    completion = sum(o.completion_tokens for o in ok)
    return Run(
        scenario=scenario,
        system=system,
        label=label,
        concurrency=1 if system == "serial" else work.concurrency,
        tasks=len(done),
        ok=len(ok),
        failed=len(done) - len(ok),
        wall_s=meter.wall_s,
        cpu_s=meter.cpu_s,
        latency=percentiles(o.latency_s for o in ok),
        end_to_end=percentiles(o.ended_at - meter.started for o in ok),
        prompt_tokens=prompt,
        completion_tokens=completion,
        cost_nusd=usage_cost_nusd(prompt, completion),
        extra={
            "skipped_at_time_cap": len(outcomes) - len(done),
            "calls_sent": sum(o.attempts for o in done),
        },
    )
