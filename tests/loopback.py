"""A small aiohttp server on 127.0.0.1 whose handler the test writes: the misbehaving
provider or proxy a test needs when the simulated provider cannot play it (a
completion without usage, gzip that is not gzip, a 200 carrying an error...).

It records what arrived (path, query, headers, body, time, order). What must
hold: it is stopped by its ``with`` block, and every request is recorded before
the handler answers it.

Below it, the providers' own wires as their API references show them (OpenAI's
chunks and errors, Anthropic's messages, errors, rate-limit headers and stream
events), for handlers that play a provider we did not write; ``Cue`` lets such a
handler wait for the test's reader before it goes on.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from callboard.runtime.accepting import stop_accepting
from support import WAIT_S

__all__ = [
    "ANTHROPIC_USAGE",
    "SSE_HEADERS",
    "USAGE",
    "Arrival",
    "Cue",
    "Flood",
    "Gate",
    "Handler",
    "Reply",
    "WireServer",
    "answer",
    "anthropic_error",
    "anthropic_rate_headers",
    "chunk",
    "completion_body",
    "echo",
    "message_body",
    "message_events",
    "open_stream",
    "openai_error",
    "openai_stream",
    "replying",
    "sse",
    "text_block",
    "thirds",
    "tool_use_block",
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

    def __init__(
        self, handler: Handler, *, ssl_context: ssl.SSLContext | None = None, **runner_kw: Any
    ) -> None:
        self.handler = handler
        self._ssl_context = ssl_context
        """TLS, if given: the server's certificate and key (``root`` is then https)."""
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
        scheme = "http" if self._ssl_context is None else "https"
        return f"{scheme}://127.0.0.1:{self.port}"

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
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=self._ssl_context)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await stop_accepting(runner.sites)
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


class Cue:
    """A signal the test's thread sets and a handler on the server's loop awaits (for a
    stream that must wait for its reader before it goes on)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def set(self) -> None:
        with self._lock:
            self._set = True
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    async def wait(self, timeout: float = WAIT_S) -> bool:
        """True once set; False if ``timeout`` seconds passed first."""
        event = asyncio.Event()
        with self._lock:
            if self._set:
                return True
            self._waiters.append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return True


# -- the providers' own wires, as their API references show them ----------------------------
#
# OpenAI's Chat Completions stream: ``data: {chat.completion.chunk}`` events, the first
# delta carrying the role, the last choice delta the finish_reason, with
# ``stream_options.include_usage`` one more chunk whose ``choices`` is empty and whose
# ``usage`` is the request's, then ``data: [DONE]``; an error mid-stream is a
# ``data: {"error": {...}}`` event. Anthropic's Messages API: a ``message`` body with
# content blocks, ``stop_reason`` and ``usage``; errors as ``{"type": "error", "error":
# {"type", "message"}, "request_id"}`` (401 authentication_error, 429 rate_limit_error,
# 529 overloaded_error); a stream of named events (message_start, content_block_start,
# content_block_delta with text_delta or input_json_delta, content_block_stop,
# message_delta with the stop_reason and the output usage, message_stop; ping between;
# ``event: error`` mid-stream).

SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: ``data`` as compact JSON (a str as is), named ``event``."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {text}\n\n".encode()


async def open_stream(request: web.Request, headers: dict[str, str] | None = None) -> Any:
    """A 200 event stream whose headers are sent (``web.StreamResponse``)."""
    resp = web.StreamResponse(headers={**SSE_HEADERS, **(headers or {})})
    await resp.prepare(request)
    return resp


def sending(events: list[bytes], headers: dict[str, str] | None = None) -> Handler:
    """A handler that answers every request with ``events``, as one event stream."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request, headers)
        for event in events:
            await resp.write(event)
        return resp

    return handle


def chunk(
    delta: dict[str, Any] | None = None,
    *,
    finish_reason: str | None = None,
    usage: Any = None,
    choices: bool = True,
) -> dict[str, Any]:
    """A ``chat.completion.chunk``; ``choices=False``: the usage chunk (no choices)."""
    body: dict[str, Any] = {
        "id": "chatcmpl-loopback",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "m",
        "system_fingerprint": "fp_loopback",
        "choices": [],
        "usage": usage,
    }
    if choices:
        body["choices"] = [
            {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}
        ]
    return body


def openai_stream(
    pieces: list[str],
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    usage: Any = USAGE,
    finish_reason: str | None = None,
) -> list[bytes]:
    """Every event of a streamed answer: the role, each text piece, each tool call (its
    name, then its ``arguments`` in three fragments), the finish, the usage (None: not
    asked for) and ``[DONE]``."""
    events = [sse(chunk({"role": "assistant", "content": "", "refusal": None}))]
    events += [sse(chunk({"content": p})) for p in pieces]
    for i, call in enumerate(tool_calls or ()):
        head = {"index": i, "id": call["id"], "type": "function"}
        head["function"] = {"name": call["name"], "arguments": ""}
        events.append(sse(chunk({"tool_calls": [head]})))
        for part in thirds(call["arguments"]):
            piece = {"index": i, "function": {"arguments": part}}
            events.append(sse(chunk({"tool_calls": [piece]})))
    finish = finish_reason or ("tool_calls" if tool_calls else "stop")
    events.append(sse(chunk({}, finish_reason=finish)))
    if usage is not None:
        events.append(sse(chunk(usage=usage, choices=False)))
    events.append(sse("[DONE]"))
    return events


def thirds(text: str) -> list[str]:
    """``text`` in three fragments (the way a stream splits JSON, mid-token)."""
    a, b = len(text) // 3, 2 * len(text) // 3
    return [text[:a], text[a:b], text[b:]]


def openai_error(message: str, kind: str = "server_error", code: str | None = None) -> Any:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


ANTHROPIC_USAGE = {
    "input_tokens": 21,
    "output_tokens": 9,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
}
"""A Messages usage object."""


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_use_block(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def message_body(
    *blocks: dict[str, Any], stop_reason: str = "end_turn", usage: Any = None
) -> dict[str, Any]:
    """A Messages API answer (a ``message``) with ``blocks`` as its content."""
    return {
        "id": "msg_01LoopbackXyz",
        "type": "message",
        "role": "assistant",
        "model": "claude-loopback",
        "content": list(blocks),
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage or ANTHROPIC_USAGE,
    }


def anthropic_error(kind: str, message: str) -> dict[str, Any]:
    """Anthropic's error body (and the data of its ``error`` stream event)."""
    return {
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": "req_011LoopbackAbc",
    }


def message_events(message: dict[str, Any], *, pieces: int | list[str] = 3) -> list[bytes]:
    """Every event of ``message`` streamed: ``message_start`` (no content, the input
    usage), a ``ping``, each block started, its text or its input's JSON in ``pieces``
    deltas (or, for a text block, in the fragments ``pieces`` lists), stopped, then
    ``message_delta`` (stop reason, output usage) and ``message_stop``."""
    usage = dict(message["usage"])
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    events = [
        sse({"type": "message_start", "message": start}, "message_start"),
        sse({"type": "ping"}, "ping"),
    ]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            opened: dict[str, Any] = {"type": "text", "text": ""}
            whole, kind, key = block["text"], "text_delta", "text"
        else:
            opened = {**block, "input": {}}
            whole, kind, key = json.dumps(block["input"]), "input_json_delta", "partial_json"
        events.append(
            sse(
                {"type": "content_block_start", "index": i, "content_block": opened},
                "content_block_start",
            )
        )
        parts = _split(whole, pieces) if isinstance(pieces, int) else pieces
        if kind == "input_json_delta" or "".join(parts) != whole:
            parts = _split(whole, len(parts))
        for part in parts:
            delta = {"type": "content_block_delta", "index": i, "delta": {"type": kind, key: part}}
            events.append(sse(delta, "content_block_delta"))
        events.append(sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
    end = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    out = {"output_tokens": usage["output_tokens"]}
    events.append(sse({"type": "message_delta", "delta": end, "usage": out}, "message_delta"))
    events.append(sse({"type": "message_stop"}, "message_stop"))
    return events


def _split(text: str, n: int) -> list[str]:
    size = max(1, -(-len(text) // n))
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def anthropic_rate_headers(*, requests: int = 50, remaining: int = 49) -> dict[str, str]:
    """Anthropic's ``anthropic-ratelimit-*`` headers (resets as RFC 3339 times)."""
    reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))
    return {
        "anthropic-ratelimit-requests-limit": str(requests),
        "anthropic-ratelimit-requests-remaining": str(remaining),
        "anthropic-ratelimit-requests-reset": reset,
        "anthropic-ratelimit-tokens-limit": "80000",
        "anthropic-ratelimit-tokens-remaining": "79000",
        "anthropic-ratelimit-tokens-reset": reset,
        "request-id": "req_011LoopbackAbc",
    }


class Flood:
    """An OpenAI stream of ``n`` text deltas of ``size`` characters (each starting with
    its index, ``%08d``), written as fast as the connection takes them; the server's
    own record of how far it got.

    ``blocked()`` says the server's writes wait on its reader: it is inside a write
    while its transport holds more than its high-water mark, which asyncio buffers
    only once the kernel refuses more (the socket's send buffer, made small here,
    and the peer's receive window are full)."""

    def __init__(self, n: int, size: int = 1024) -> None:
        self.n = n
        self.size = size
        self.written = 0
        """Deltas whose write returned."""
        self.in_write = False
        self.transport: asyncio.Transport | None = None
        self.done = threading.Event()

    async def handler(self, request: web.Request, arrival: Arrival) -> web.StreamResponse:
        transport = request.transport
        assert isinstance(transport, asyncio.Transport)
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        self.transport = transport
        events = openai_stream([])
        resp = await open_stream(request)
        await resp.write(events[0])
        pad = "x" * (self.size - 8)
        for i in range(self.n):
            self.in_write = True
            await resp.write(sse(chunk({"content": f"{i:08d}{pad}"})))
            self.in_write = False
            self.written += 1
        await resp.write(b"".join(events[1:]))
        self.done.set()
        return resp

    def blocked(self) -> bool:
        t = self.transport
        if t is None or not self.in_write:
            return False
        return t.get_write_buffer_size() > t.get_write_buffer_limits()[1]

    def indices(self, texts: list[str]) -> list[int]:
        """The indices the deltas ``texts`` carry, in order."""
        return [int(t[:8]) for t in texts if t]
