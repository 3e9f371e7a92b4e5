"""The simulated provider's HTTP face: aiohttp handlers that carry out core plans.

Each endpoint reads its request with its wire (``wire``: chat completions,
``embeddings``, ``anthropic``: messages), asks the engine for a plan, and sends
what its dialect (``dialects``) makes of the plan: a body, an error, or a
stream of events paced by the plan's time to first token and gap.

Everything here runs on one event loop, the server's. Invariants:
- the server listens on loopback only;
- every request that reaches a model is counted on arrival and leaves
  ``in_flight`` exactly once, however it ends (answer, drop, hang, cut,
  client disconnect, shutdown);
- a hang ends at ``hang_s``, when the client disconnects (the handler is
  cancelled) or when `ProviderApp.close` starts, whichever is first;
- a stream is written event by event as each is due, each write awaited, so
  a slow reader slows the stream rather than filling the server's memory;
- the API key, if any, is compared in constant time and never echoed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import itertools
import json
import socket
import time
from collections.abc import Iterator
from http import HTTPStatus
from typing import Protocol

from aiohttp import web
from callboard.provider.anthropic import check_headers, count_tokens_body, parse_messages
from callboard.provider.behaviour import behaviour_from_json
from callboard.provider.counters import Counters
from callboard.provider.dialects import (
    ANTHROPIC,
    CHAT,
    EMBEDDINGS,
    Answer,
    Dialect,
    Served,
    request_id,
)
from callboard.provider.embeddings import parse_embeddings
from callboard.provider.engine import Ask, ModelState, Outcome, ProviderCore
from callboard.provider.sse import compact_bytes
from callboard.provider.wire import BadRequestError, error_body, models_body, parse_chat
from callboard.runtime.accepting import stop_accepting
from callboard.runtime.server_log import quiet_answers, server_log

__all__ = ["ProviderApp", "check_loopback", "check_port", "host_arg", "port_arg"]

_GRACE_S = 0.5
"""How long close() lets in-flight requests finish before cancelling them."""
_MAX_BODY = 16 * 1024 * 1024
_MAX_PORT = 65535


class Asked(Protocol):
    """A parsed request of any endpoint, as the app needs it."""

    @property
    def model(self) -> str: ...
    @property
    def ask(self) -> Ask: ...


def check_loopback(host: str) -> str:
    """``host`` as an IP literal, or `ValueError` if it is not a loopback address.

    ``localhost`` means 127.0.0.1 and ``[::1]`` means ::1; anything else must be
    an IP literal that is loopback (``127.0.0.1.5`` and ``127.300.0.1`` are not).
    """
    if host == "localhost":
        return "127.0.0.1"
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(literal)
    except ValueError:
        address = None
    if address is None or not address.is_loopback:
        raise ValueError(f"the simulated provider listens on loopback only, not {host!r}")
    return str(address)


def check_port(port: int) -> int:
    """``port`` if it is 0 (any free port) to 65535, else `ValueError`."""
    if not 0 <= port <= _MAX_PORT:
        raise ValueError(f"port must be 0 (any free port) to {_MAX_PORT}, not {port}")
    return port


def port_arg(text: str) -> int:
    """``--port``'s argparse type: a port from 0 (any free one) to 65535, else a usage
    error naming it (a port past the range bound some other port, in silence)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    try:
        return check_port(port)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def host_arg(text: str) -> str:
    """``--host``'s argparse type: a name or an address to listen on, an IPv6 one with or
    without its brackets (``[::1]`` is ``::1``); a port in it is refused (``--port``
    says the port), not taken for a name that resolves nowhere."""
    host = text.strip()
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if not bare or ":" in bare or "/" in bare or " " in bare:
        raise argparse.ArgumentTypeError(
            f"not a host: {text!r} (give the address or name alone, the port with --port)"
        )
    return bare


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, reuse_port=False)


class ProviderApp:
    """The aiohttp server for one `ProviderCore`; create and use it on the server loop."""

    def __init__(self, core: ProviderCore, *, host: str, port: int, api_key: str | None) -> None:
        self.core = core
        self.host = check_loopback(host)
        self.port = check_port(port)
        self._auth = None if api_key is None else f"Bearer {api_key}".encode()
        self._key = None if api_key is None else api_key.encode()
        self._closing = asyncio.Event()
        self._holds: dict[str, asyncio.Event] = {}
        """The models whose answers wait until their event is set (``hold``)."""
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None

    async def start(self) -> int:
        """Listen; return the bound port."""
        app = web.Application(client_max_size=_MAX_BODY)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/stats/reset", self._reset)
        app.router.add_post("/admin/models/{name}", self._admin)
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            logger=server_log(),  # a client's bad bytes (its key?) are not logged
            shutdown_timeout=_GRACE_S,
        )
        await runner.setup()
        quiet_answers(runner)  # a client's bad bytes are not answered back
        self._runner = runner
        self.core.mark_started()
        await self.resume()
        return self.port

    async def resume(self) -> None:
        """Listen (again) on ``self.port``; 0 picks a free port once."""
        if self._site is not None or self._runner is None:
            return
        sock = _listening_socket(self.host, self.port)
        try:
            site = web.SockSite(self._runner, sock)
            await site.start()
        except BaseException:
            sock.close()
            raise
        self._site = site
        self.port = sock.getsockname()[1]

    async def pause(self) -> None:
        """Stop listening (new connections are refused); drop open ones, busy or idle."""
        if self._site is None:
            return
        site, self._site = self._site, None
        await stop_accepting([site])  # what it accepted is in server.connections below
        await site.stop()
        server = self._runner.server if self._runner is not None else None
        for connection in server.connections if server is not None else ():
            connection.force_close()

    async def hold(self, model: str) -> None:
        """Hold ``model``'s answers (200s, streams too) before their latency, until
        ``release``: a call that must still be in flight while a test looks is held
        for as long as the test looks, however slow the machine (a latency is not)."""
        self._holds.setdefault(model, asyncio.Event())

    async def release(self, model: str) -> None:
        """Let ``model``'s held answers and those after them go."""
        held = self._holds.pop(model, None)
        if held is not None:
            held.set()

    async def close(self) -> None:
        """End hangs and holds, stop listening, and shut the server down."""
        self._closing.set()
        for model in list(self._holds):
            await self.release(model)
        self._site = None
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await stop_accepting(runner.sites)  # cleanup() closes all it accepted
            await runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        seq = next(self._ids)
        if self._auth is not None and not self._authorized(request):
            missing = "Authorization" not in request.headers
            return self._refuse(CHAT.unauthorized(missing=missing, seq=seq))
        try:
            chat = parse_chat(await request.read())
        except BadRequestError as exc:
            return self._refuse(CHAT.bad_request(exc, seq))
        return await self._serve(request, CHAT, self.core.state(chat.model), chat, seq)

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        seq = next(self._ids)
        if self._auth is not None and not self._authorized(request):
            missing = "Authorization" not in request.headers
            return self._refuse(EMBEDDINGS.unauthorized(missing=missing, seq=seq))
        try:
            embed = parse_embeddings(await request.read())
        except BadRequestError as exc:
            return self._refuse(EMBEDDINGS.bad_request(exc, seq))
        state = self.core.state(embed.model)
        if embed.dimensions is None:
            embed = dataclasses.replace(embed, dimensions=state.behaviour.dimensions)
        return await self._serve(request, EMBEDDINGS, state, embed, seq)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        seq = next(self._ids)
        refused = self._anthropic_refusal(request, seq)
        if refused is not None:
            return self._refuse(refused)
        try:
            messages = parse_messages(await request.read())
        except BadRequestError as exc:
            return self._refuse(ANTHROPIC.bad_request(exc, seq))
        return await self._serve(request, ANTHROPIC, self.core.state(messages.model), messages, seq)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        seq = next(self._ids)
        answer = self._anthropic_refusal(request, seq)
        if answer is None:
            try:
                count = count_tokens_body(await request.read())
                answer = Answer(
                    HTTPStatus.OK, {"request-id": request_id(seq)}, compact_bytes(count)
                )
            except BadRequestError as exc:
                answer = ANTHROPIC.bad_request(exc, seq)
        return self._refuse(answer)

    def _anthropic_refusal(self, request: web.Request, seq: int) -> Answer | None:
        """The 400 or 401 Anthropic answers a request's headers with, if any."""
        try:
            check_headers(request.headers)
        except BadRequestError as exc:
            return ANTHROPIC.bad_request(exc, seq)
        if self._key is not None and not self._authorized(request):
            given = request.headers.get("x-api-key")
            if given is None or not _same(given, self._key):
                missing = given is None and "Authorization" not in request.headers
                return ANTHROPIC.unauthorized(missing=missing, seq=seq)
        return None

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "")
        return self._auth is not None and _same(given, self._auth)

    def _refuse(self, answer: Answer) -> web.Response:
        """Answer at once, before any model sees the request (counted in the total)."""
        counters = self.core.total
        counters.arrive(self.core.elapsed())
        counters.respond(answer.status)
        counters.leave()
        return _response(answer)

    async def _serve(
        self, request: web.Request, dialect: Dialect, state: ModelState, asked: Asked, seq: int
    ) -> web.StreamResponse:
        """Plan ``asked`` for ``state``'s model and carry the plan out, counted throughout."""
        counters = state.counters
        arrived = self.core.elapsed()
        counters.arrive(arrived)
        try:
            plan = self.core.plan(state, asked.ask)
            served = Served(asked.model, plan, asked, seq, time.time())
            return await self._carry_out(request, dialect, served, counters, arrived)
        finally:
            counters.leave()

    async def _carry_out(
        self,
        request: web.Request,
        dialect: Dialect,
        served: Served,
        counters: Counters,
        arrived: float,
    ) -> web.StreamResponse:
        plan = served.plan
        outcome = plan.outcome
        if outcome is Outcome.DROP:
            counters.fault(dropped=True)
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=204)
        if outcome is Outcome.HANG:
            counters.fault(dropped=False)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), plan.delay_s)
        if plan.status != HTTPStatus.OK:
            answer = dialect.refusal(served)
            counters.respond(answer.status, arrived)
            return _response(answer)
        held = self._holds.get(served.model)
        if held is not None:
            await held.wait()
        if plan.delay_s > 0.0 and not served.request.ask.stream:
            await asyncio.sleep(plan.delay_s)
            served = dataclasses.replace(served, wall_now=time.time())
        if served.request.ask.stream:
            return await _stream(request, dialect, served, counters)
        headers = dialect.headers(served)
        body = dialect.malformed if outcome is Outcome.MALFORMED else dialect.body(served)
        counters.respond(HTTPStatus.OK)
        if outcome is Outcome.CUT:
            counters.cut_short()
            return await _cut_body(request, headers, body)
        if outcome is Outcome.OK:
            counters.served(plan.prompt_tokens, plan.output_tokens)
        return web.Response(body=body, headers=headers, content_type="application/json")

    async def _models(self, request: web.Request) -> web.Response:
        if self._auth is not None and not self._authorized(request):
            missing = "Authorization" not in request.headers
            return _response(CHAT.unauthorized(missing=missing, seq=next(self._ids)))
        return web.json_response(models_body(self.core.model_names()))

    async def _stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.core.stats())

    async def _reset(self, _request: web.Request) -> web.Response:
        self.core.reset_stats()
        return web.json_response({"reset": True})

    async def _admin(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            fields = json.loads(await request.read())
            behaviour = behaviour_from_json(fields, self.core.behaviour(name))
            self.core.configure(name, behaviour)  # ValueError past MAX_MODELS
        except (TypeError, ValueError) as exc:
            body = error_body(str(exc), "invalid_request_error")
            return web.json_response(body, status=400)
        return web.json_response({"model": name, "behaviour": dataclasses.asdict(behaviour)})


async def _stream(
    request: web.Request, dialect: Dialect, served: Served, counters: Counters
) -> web.StreamResponse:
    """Send the answer as server-sent events: the head at once, the body after the time
    to first token and a gap per event, then the tail (see `_Events`)."""
    plan = served.plan
    stream = dialect.stream(served)
    response = web.StreamResponse(headers=dialect.headers(served))
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    counters.respond(HTTPStatus.OK)
    cut = plan.cut_after if plan.outcome is Outcome.CUT else None
    events = _Events(request, response, cut, stream.error if plan.cut_error else None)
    try:
        await response.prepare(request)
        if plan.outcome is Outcome.MALFORMED:
            await events.send([*stream.head, dialect.malformed_event])
            await events.close()
            return response
        done = (
            await events.send(stream.head)
            and await _sleep(plan.delay_s)
            and await events.pace(stream.body, plan.gap_s)
            and await events.send(stream.tail, last=True)
        )
        if not done:
            counters.cut_short()
            return await events.cut()
    except ConnectionError:  # the client went away
        return response
    counters.served(plan.prompt_tokens, plan.output_tokens)
    return response


async def _sleep(seconds: float) -> bool:
    await asyncio.sleep(seconds)
    return True


def _same(given: str, expected: bytes) -> bool:
    """Constant-time comparison of a header with a secret."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected)


def _response(answer: Answer) -> web.Response:
    return web.Response(
        status=answer.status,
        headers=answer.headers,
        body=answer.body,
        content_type="application/json",
    )


async def _cut_body(
    request: web.Request, headers: dict[str, str], body: bytes
) -> web.StreamResponse:
    """Send the headers and half of ``body`` (its full length announced), then close."""
    response = web.StreamResponse(headers=headers)
    response.content_type = "application/json"
    response.content_length = len(body)
    await response.prepare(request)
    await response.write(body[: len(body) // 2])
    if request.transport is not None:
        request.transport.close()
    return response


class _Events:
    """Writes one stream's events: in batches of up to `_BATCH` bytes when they are all
    due at once, else each as it is due; awaiting each write, so a slow reader holds
    the stream back instead of letting it pile up here. A cut fault ends the stream
    after ``cut`` events (with its error event, or by closing the connection), and at
    the latest before its last event, so a cut stream is never whole."""

    __slots__ = ("_cut", "_error", "_pending", "_request", "_response", "_sent")

    def __init__(
        self,
        request: web.Request,
        response: web.StreamResponse,
        cut: int | None,
        error: bytes | None,
    ) -> None:
        self._request = request
        self._response = response
        self._cut = cut
        self._error = error
        self._pending: list[bytes] = []
        self._sent = 0

    async def send(self, events: list[bytes], *, last: bool = False) -> bool:
        """Write ``events`` now; False if the stream is to be cut here."""
        for i, event in enumerate(events):
            if not self._add(event, final=last and i == len(events) - 1):
                return False
        await self._flush()
        return True

    async def pace(self, events: Iterator[bytes], gap_s: float) -> bool:
        """Write ``events`` ``gap_s`` apart (0: batched); False if the stream is to be cut."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        size = 0
        for n, event in enumerate(events):
            if gap_s > 0.0 and n:
                await self._flush()
                delay = start + n * gap_s - loop.time()
                if delay > 0.0:
                    await asyncio.sleep(delay)
            if not self._add(event, final=False):
                return False
            size += len(event)
            if size >= _BATCH:
                await self._flush()
                size = 0
        await self._flush()
        return True

    def _add(self, event: bytes, *, final: bool) -> bool:
        if self._cut is not None and (self._sent >= self._cut or final):
            return False
        self._pending.append(event)
        self._sent += 1
        return True

    async def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            await self._response.write(data)

    async def cut(self) -> web.StreamResponse:
        """End the stream here: its error event and a proper end, or a closed connection."""
        if self._error is not None:
            self._pending.append(self._error)
            await self._flush()
            return self._response
        await self.close()
        return self._response

    async def close(self) -> None:
        """What was sent goes out; then the connection closes, the body unfinished."""
        await self._flush()
        if self._request.transport is not None:
            self._request.transport.close()


_BATCH = 16 * 1024
"""How many bytes of events that are due together go out in one write."""
