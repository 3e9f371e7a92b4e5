"""A small aiohttp server on 127.0.0.1 whose handler the test writes: the misbehaving
provider or proxy a test needs when the simulated provider cannot play it (a
completion without usage, gzip that is not gzip, a 200 carrying an error...).

It records what arrived (path, query, headers, body, time, order). What must
hold: it is stopped by its ``with`` block, and every request is recorded before
the handler answers it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from support import WAIT_S

__all__ = [
    "USAGE",
    "Arrival",
    "Gate",
    "Handler",
    "Reply",
    "WireServer",
    "answer",
    "completion_body",
    "echo",
    "replying",
]

Handler = Callable[[web.Request, "Arrival"], Awaitable[web.StreamResponse]]
Reply = tuple[int, dict[str, str], bytes]
"""What a handler answers: status, headers, body."""
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
"""A usage object as OpenAI reports it."""


@dataclass
class Arrival:
    """One request as the server saw it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    raw: bytes
    peer: Any = None
    json: Any = field(default=None)
    index: int = 0
    """Its place in arrival order, from 0."""
    at: float = 0.0
    """When it arrived (``time.monotonic``)."""


class WireServer:
    """An aiohttp server on loopback; ``handler(request, arrival)`` answers every path."""

    def __init__(self, handler: Handler, **runner_kw: Any) -> None:
        self.handler = handler
        self.arrivals: list[Arrival] = []
        self.connections: set[Any] = set()
        self.arrived = threading.Event()
        self._runner_kw = runner_kw
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="wire-server", daemon=True)
        self.port = 0

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def __enter__(self) -> WireServer:
        self._thread.start()
        assert self._ready.wait(WAIT_S), "the wire server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(WAIT_S)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._any)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, **self._runner_kw)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    async def _any(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        arrival = Arrival(
            method=request.method,
            path=request.path,
            query=request.query_string,
            headers={k.lower(): v for k, v in request.headers.items()},
            raw=raw,
            peer=request.transport.get_extra_info("peername") if request.transport else None,
            at=time.monotonic(),
        )
        try:
            arrival.json = json.loads(raw)
        except ValueError:
            arrival.json = None
        with self._lock:
            arrival.index = len(self.arrivals)
            self.arrivals.append(arrival)
            self.connections.add(arrival.peer)
        self.arrived.set()
        return await self.handler(request, arrival)

    def wait_for(self, n: int) -> None:
        """Block until ``n`` requests have arrived (fails the test after ``WAIT_S``)."""
        deadline = time.monotonic() + WAIT_S
        while self.count() < n:
            self.arrived.wait(0.05)
            self.arrived.clear()
            assert time.monotonic() < deadline, f"{self.count()} of {n} requests arrived"

    def count(self) -> int:
        with self._lock:
            return len(self.arrivals)


def completion_body(
    *,
    content: Any = "hi",
    finish_reason: str | None = "stop",
    usage: Any = None,
    **extra: Any,
) -> dict[str, Any]:
    """A ``chat.completion`` object; ``usage`` None leaves the field out, ``extra`` adds
    top-level fields."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    body: dict[str, Any] = {
        "id": "chatcmpl-loopback",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = usage
    body.update(extra)
    return body


def replying(reply: Callable[[int, Any], Reply]) -> Handler:
    """A handler that answers the n-th request (from 0) with ``reply(n, its JSON body)``
    (JSON unless the headers say otherwise)."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        status, headers, raw = reply(arrival.index, arrival.json)
        h = {"content-type": "application/json", **headers}
        return web.Response(status=status, body=raw, headers=h)

    return handle


def answer(
    body: Any = None, *, status: int = 200, headers: dict[str, str] | None = None
) -> Handler:
    """A handler that answers every request with ``body`` (a dict as JSON, bytes as is;
    None: a completion with ``USAGE``)."""
    if body is None:
        body = completion_body(usage=USAGE)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return replying(lambda n, request: (status, headers or {}, raw))


async def echo(request: web.Request, arrival: Arrival) -> web.StreamResponse:
    """Repeats what it was sent (URL, headers) in its answer's body and headers: as the
    content of a completion for the prompt ``ok``, as a 400 error body for any other
    (a secret must not leave by any of them)."""
    said = json.dumps({"url": str(request.url), "headers": dict(request.headers)})
    echoed = {"x-echo": said}
    prompt = (arrival.json or {}).get("messages", [{}])[0].get("content")
    if prompt == "ok":
        return web.json_response(completion_body(content=said, usage=USAGE), headers=echoed)
    return web.json_response({"error": {"message": said}}, status=400, headers=echoed)


class Gate:
    """Holds every request at the server until the test lets it through, one by one."""

    def __init__(self) -> None:
        self.sem: asyncio.Semaphore | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.running = 0
        self.most = 0

    async def handler(self, request: web.Request, arrival: Arrival) -> web.StreamResponse:
        if self.sem is None:
            self.sem, self.loop = asyncio.Semaphore(0), asyncio.get_running_loop()
        self.running += 1
        self.most = max(self.most, self.running)
        await self.sem.acquire()
        self.running -= 1
        return web.json_response(completion_body(usage=USAGE))

    def release(self, n: int = 1) -> None:
        if self.loop is None or self.sem is None:
            return  # nothing arrived: nothing to let through
        for _ in range(n):
            self.loop.call_soon_threadsafe(self.sem.release)
