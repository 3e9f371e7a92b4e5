"""The gateway's HTTP face: aiohttp handlers that turn OpenAI's and Anthropic's
requests into submits.

Each handler reads a request (``openai_api``, ``anthropic_api``), learns who sends
it (``keys``), submits it to the ``AsyncSystem`` it fronts and turns the ``Result``
(or the stream of deltas) back into the API's response, or into an ``ApiError``
(``errors``). It decides nothing about scheduling: priority, tenant and deadline
travel on the request, and the queue does the rest.

    POST /v1/chat/completions   plain, or ``stream: true`` (SSE chunks, ``[DONE]``)
    POST /v1/messages           Anthropic's Messages API, plain or ``stream: true``
                                (its event sequence), for the ``anthropic`` SDK
    POST /v1/messages/count_tokens  a message's prompt tokens, as callboard counts them
    POST /v1/embeddings         ``cb.embed``; float or base64 vectors
    GET  /v1/models             the models and routes the key may use (Anthropic's
                                shape for a request with ``anthropic-version``)
    GET  /v1/models/{name}      one of them (the SDKs' models.retrieve)
    GET  /v1/callboard/stats    the stats snapshot as JSON, with each key's and
                                tenant's quotas (``quotas``: room, budget, spend,
                                the budget's period and when it renews) and the
                                request bodies held (``bodies``: ``room``) and
                                whether it serves (``gateway``: ready, draining or
                                failed), for an operator's key; another key's own
                                quotas only
    GET  /healthz  /readyz      liveness (the system has not failed); readiness
                                (started, not shutting down)
    GET  /metrics, /            ``observe``: Prometheus, the dashboard

The two conversation endpoints are one handler (``_converse``) over a ``_Door``
each: what differs between the APIs (reading the body, the answer's shape, the
stream's events, the error body) is the door's; everything else (who calls,
priority, deadline, idempotency, a client that leaves) is shared.

The crossings into callboard and back are few: a plain chat request (no stream,
no ``Idempotency-Key``) is submitted with the others of its turn of the loop
(``runtime.batch``: one admission and one ``Route`` for all), and the answers that finish together
wake the loop once (``runtime.handoff``).

Request headers: ``Authorization: Bearer <key>`` (or ``x-api-key``, with
Anthropic's ``anthropic-version``, accepted and not needed),
``X-Callboard-Priority`` (a name or 0-3; else the body's ``priority``, else the
key's default; never above the key's ``max_priority``), ``X-Callboard-Deadline``
(seconds), ``Idempotency-Key`` (chat completions and messages, scoped to the
endpoint; see ``replays``), ``anthropic-beta`` (the anthropic SDK's ``betas``: passed
on in the request's ``extra_headers``, so the model's calls say it). Response
headers: ``X-Callboard-Task-Id``, ``-Queue-Wait`` (seconds), ``-Model``,
``-Attempts``, ``-Cost`` (USD, exact), ``-Priority`` (what the request got), and
``x-request-id`` and ``request-id`` (the trace id; the SDKs show it as
``_request_id``). A stream's headers go before
its answer is known: it carries the task id and priority only.

What must hold: a client that leaves before its answer cancels its task if it
was not sent yet (unless it sent an ``Idempotency-Key``: its retry is to get the
answer); a stream whose client leaves is closed (the call stops reading the
provider); no key is ever logged or echoed; every error body is the API's shape
(Anthropic's on ``/v1/messages``, OpenAI's everywhere else); a caller holds a
connection no longer than ``idle_s`` without a request head (``server``) and
``body_timeout_s`` for its body (408); the bodies held at once, those still
arriving included, stay within ``max_held_mb`` (``room``: a body is counted as it
comes, and is a 429 once it cannot be); a request that can never be served is its
400 before a key's quotas see it (``_asked``); a body too large to read in a
moment is read, counted and submitted off the loop (``_read``), so only its JSON
parse (C, which keeps the interpreter: about 15 ms a MB, up to 50 ms a MB of tiny
objects) holds other requests, and so is an answer too large to make in one
(``_answered``: made and encoded a piece at a time, as the provider's body was
parsed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import math
import re
import secrets
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

import yarl
from aiohttp import HttpVersion11, hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from callboard.core.pricing import usd_text
from callboard.core.routing import AUTO
from callboard.core.settings import FREE
from callboard.gateway.anthropic_api import (
    MessageEvents,
    error_event,
    message_body,
    message_id,
    messages_call,
    model_info,
    models_page,
    provider_stop,
)
from callboard.gateway.connections import (
    FEW_CONNECTIONS,
    ConnectionCap,
    auto_capacity,
    open_file_limit,
)
from callboard.gateway.errors import (
    INVALID,
    SERVER,
    ApiError,
    back_in,
    error_for_exception,
    error_for_result,
    stopping_error,
)
from callboard.gateway.keys import ANONYMOUS, Caller, KeyRing, TwoKeysError, presented_key
from callboard.gateway.observe import install as observe
from callboard.gateway.openai_api import (
    ChatCall,
    EmbedCall,
    chat_call,
    chunk,
    completion_body,
    embed_call,
    embeddings_body,
    embeddings_json,
    encode,
    encode_pieces,
    models_body,
    plain,
    usage_chunk,
)
from callboard.gateway.quota import (
    Estimate,
    OverQuota,
    Quotas,
    Ticket,
    chat_estimate,
    embed_estimate,
    reachable_prices,
)
from callboard.gateway.replays import Replay, Replays, digest, scoped
from callboard.gateway.room import Hold, Room
from callboard.gateway.settings import GatewaySettings, is_loopback
from callboard.gateway.spend import SpendStore
from callboard.messages import (
    CallboardError,
    Cancelled,
    Choice,
    Completed,
    ConfigError,
    EmbeddingResult,
    Failed,
    FailureReason,
    InvalidRequestError,
    MalformedOutputError,
    Priority,
    Request,
    Result,
    StreamDelta,
    SystemStoppedError,
    TaskFuture,
    ToolCallDelta,
    UnavailableError,
    UsageError,
)
from callboard.runtime.batch import Batch
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.handoff import Handoff
from callboard.runtime.inflate import CODINGS, InflateError, Inflater, coding_of
from callboard.wire.anthropic import message_usage
from callboard.wire.openai import reasoning_of

from callboard import AsyncChatStream, AsyncSystem, ChatStream, StreamFailedError
from callboard._embed import EmbedFuture, embedding_request, texts_of

__all__ = ["Front", "Refusal"]

if sys.platform != "win32":  # the socket's send queue, for ``_unsent``
    import fcntl
    import termios

log = guarded_logger(__name__)

PRIORITY_HEADER = "X-Callboard-Priority"
DEADLINE_HEADER = "X-Callboard-Deadline"
IDEMPOTENCY_HEADER = "Idempotency-Key"
BETA_HEADER = "anthropic-beta"
"""Passed on to the model (Anthropic's betas; another provider ignores it)."""
TIMEOUT_HEADERS = ("x-stainless-read-timeout", "x-stainless-timeout")
"""Where a client's SDK says its timeout, in seconds: the Python SDKs' read timeout
(openai, anthropic), the Anthropic TypeScript SDK's whole seconds (0 for less than one:
taken as the least). openai-node sends none (a hunt: its 6 s streams timed out behind a
15 s head wait, three calls each): such a client needs ``stream_keepalive_s`` below its
timeout."""
QUIET_LEAST_S = 0.25
"""A stream's keep-alives come no more often than this, whatever a client says."""
_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx in front: pass each event on at once
}
_DONE = b"data: [DONE]\n\n"
_MESSAGES = "/v1/messages"
_OPENAI_WIRES = frozenset({"openai", "azure"})
HEAVY_BODY = 64 * 1024
"""A request body of at least this many bytes is read off the server's loop (``_read``)."""
VALUE_BYTES = 64
"""What one JSON value of a body costs in memory once read (parsed, checked and frozen;
measured: 31 MB of empty arrays, twenty million values with their commas, peaked at
1.1 GB; of floats or short strings, 400-490 MB): each counts this much against
``max_held_mb`` beside the body's bytes."""
MAX_VALUES = 2_000_000
"""The most JSON values a body may hold (a 413 past it), counted as its objects,
arrays and commas: each costs Python work to read, up to a few microseconds, on the
reader thread, and 31 KB sent gzipped inflated to ten million empty arrays, 18 s of a
core and 1.1 GB (found by a hunt; 31 KB of floats, 17 s: a review). A legal body of
200,000 content parts holds about 600,000; an embeddings call of OpenAI's most
tokens, 300,000 token ids."""
HEAVY_ANSWER_FLOATS = 65_536
"""An embeddings answer of at least this many floats is written on the reader thread,
a vector at a time (``embeddings_json``): its JSON takes about 1 us a float."""
HEAVY_ANSWER = 256 * 1024
"""A chat answer of about this many bytes or more (``_weight``) is made and encoded on
the reader thread (``_answered``); a provider's body of ``runtime.http.HEAVY_ANSWER``
or more was parsed off the loop too."""
LOGPROB_BYTES = 64
"""What one token of a choice's logprobs, or one of its alternatives, takes in an
answer's JSON (measured: 56 bytes, with its ``bytes``)."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HOLD = web.RequestKey("callboard_hold", Hold)
"""A request's room for its body (``room``), given back by ``_errors`` for the handler."""
_MIB = 1024 * 1024
_T = TypeVar("_T")


class Refusal(Exception):  # noqa: N818 - an answer, not a failure of ours
    """A request answered with ``error`` before anything was submitted."""

    def __init__(self, error: ApiError, *, close: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.close = close
        """Close the connection after the answer (what is left of the request unread)."""


class Front:
    """The handlers of one gateway, over the ``AsyncSystem`` it fronts (started)."""

    def __init__(
        self, cb: AsyncSystem, settings: GatewaySettings, *, spend: SpendStore | None = None
    ) -> None:
        self.cb = cb
        self.settings = settings
        self.keys = KeyRing(settings.keys)
        self.replays = Replays(
            settings.idempotency_entries, math.ceil(settings.idempotency_mb * _MIB)
        )
        self._handoff = Handoff()
        """Task futures followed on the server's loop, one wake-up per batch."""
        self._batch = Batch(cb.system)
        """Plain chat requests, submitted together per turn of the server's loop."""
        self._max_body = math.ceil(settings.max_body_mb * _MIB)
        """The largest body taken, in bytes (``max_body_mb``): a larger one is a 413."""
        self.room = Room(math.ceil(settings.max_held_mb * _MIB))
        """Room for the bodies held at once (``max_held_mb``)."""
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="callboard-gateway-reader")
        """Reads heavy bodies (``_read``)."""
        self.connections = ConnectionCap(_connection_bound(cb, settings))
        """The client connections open at once, bounded (``max_connections``)."""
        self.ready = False
        """Serving: set once started, cleared when a shutdown begins (``/readyz``)."""
        system = cb.system
        self._wires = {name: m.api for name, m in system.models.items()}
        self._longest_cooldown_s = max(
            (m.breaker.max_cooldown_s for m in system.models.values()), default=0.0
        )
        """The longest a model's breaker stays open here (``_back_in``'s bound)."""
        self._routes = frozenset(system.policy.routes) | {AUTO}
        self._members = dict(system.policy.routes)
        for key in settings.keys:  # a name that is neither: the key could use nothing
            unknown = sorted((key.models or frozenset()) - set(self._wires) - self._routes)
            if unknown:
                raise ConfigError(
                    f"gateway.keys.{key.name}.models: {unknown[0]!r} is no model or route "
                    f"of this configuration (models: {', '.join(sorted(self._wires))}; "
                    f"routes: {', '.join(sorted(self._routes))})"
                )
        for doubt in (*settings.doubts(), *self._doubts()):
            log.warning("%s", doubt)
        self._allowed_by: dict[frozenset[str], frozenset[str]] = {}
        """A key's ``models`` -> the models that may serve it (``_allowed``)."""
        self.quotas = Quotas(
            settings,
            prices=reachable_prices(system.models, system.policy.routes, system.config.escalate_to),
            spend=spend,
        )
        """Each key's and tenant's rpm, tpm and budget (``quota``), the budgets' settled
        spend kept in ``spend`` (the spend file) when there is one."""

    def _error_for(self, result: Result) -> ApiError:
        """The answer to a request whose ``result`` is not ``Completed``."""
        return error_for_result(
            result, self.settings.retry_after_s, back_in_s=self._back_in(result)
        )

    def _back_in(self, result: Result) -> float | None:
        """``PROVIDER_DOWN``'s wait (``errors.back_in``), by the models' latest health."""
        if not isinstance(result, Failed) or result.reason is not FailureReason.PROVIDER_DOWN:
            return None
        rt = self.cb.system.rt
        health = dict(rt.stats.health)  # the aggregator's: copied at once
        return back_in(health, result.model, rt.clock(), self._longest_cooldown_s)

    def _doubts(self) -> list[str]:
        """What in the configuration is legal but likely a mistake (said at start): a
        budget over models without a price never spends (50 of 50 calls on a $0.01
        budget, nothing spent; found by a hunt); a tenant's weight naming no key's
        tenant is never used (a typo: found by a hunt)."""
        system, settings = self.cb.system, self.settings
        doubts: list[str] = []
        unpriced = sorted(name for name, m in system.models.items() if m.price == FREE)
        for key in settings.keys:
            tenant = settings.tenants.get(key.tenant)
            budgeted = key.limits.budget_usd is not None or (
                tenant is not None and tenant.budget_usd is not None
            )
            names = key.models or frozenset(system.models)
            if AUTO in names:  # auto may pick any model
                names = frozenset(system.models)
            reach = {m for n in names for m in self._members.get(n, (n,))}
            free = [m for m in unpriced if m in reach]
            if budgeted and free:
                doubts.append(
                    f"gateway.keys.{key.name}: a budget applies, but {', '.join(free)} "
                    "has no price (models.<name>.price): its calls cost nothing to it"
                )
        tenants = {k.tenant for k in settings.keys}
        weights = system.config.scheduler.tenant_weights
        strays = sorted(set(weights) - tenants) if settings.keys else []
        doubts.extend(
            f"scheduler.tenant_weights.{name}: no gateway key belongs to this tenant "
            f"(tenants: {', '.join(sorted(tenants))}): the weight is never used"
            for name in strays
        )
        return doubts

    def app(self) -> web.Application:
        """The aiohttp application: the routes, and every error in its API's shape."""
        app = web.Application(
            middlewares=[self._bounded, self._errors], client_max_size=self._max_body
        )
        app.router.add_post("/v1/chat/completions", self.chat, expect_handler=self._expect)
        app.router.add_post(_MESSAGES, self.messages, expect_handler=self._expect)
        app.router.add_post(
            f"{_MESSAGES}/count_tokens", self.count_tokens, expect_handler=self._expect
        )
        app.router.add_post("/v1/embeddings", self.embeddings, expect_handler=self._expect)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{name}", self.model)
        app.router.add_get("/v1/callboard/stats", self.stats)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        self._observatory = observe(  # /metrics, /
            app,
            self.cb,
            self.quotas.statistics,
            self.room.statistics,
            self.connections.statistics,
            guard=self._operator if self.settings.metrics == "operator" else None,
        )
        app.on_response_prepare.append(self._last_on_its_connection)
        return app

    async def _last_on_its_connection(
        self, _request: web.Request, response: web.StreamResponse
    ) -> None:
        """Once draining (unready), every answer says ``Connection: close``, as nginx's
        do in a graceful stop: without it a keep-alive client sent its next request on
        the connection the stop then closed, and got no answer (a POST its SDK or an
        upstream nginx does not retry; found by a hunt)."""
        if not self.ready:  # the hook runs after the headers are made: both set here
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"

    # -- endpoints -----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._converse(request, _OPENAI)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._converse(request, _ANTHROPIC)

    async def _converse(self, request: web.Request, door: _Door) -> web.StreamResponse:
        """A chat completion or a message: submitted (or streamed), answered in
        ``door``'s shape; a retry with a known ``Idempotency-Key`` gets the first
        request's answer."""
        caller = self._caller(request)
        raw, hold = await self._body(request)
        heavy = len(raw) >= HEAVY_BODY
        call = await self._read(raw, hold, lambda: door.read(_json(raw)))
        fields = {**call.fields, **self._scheduling(request, caller, call.name, call.priority)}
        allowed = self._allowed(caller)
        if allowed is not None:  # a fallback may not serve the key a model it may not ask for
            fields["models_allowed"] = allowed
        _capped(fields, self.settings.default_max_tokens)
        betas = request.headers.getall(BETA_HEADER, ())
        if betas:  # the anthropic SDK's betas=[...]: what the call is, so the call says it
            fields["extra_headers"] = {BETA_HEADER: ",".join(betas)}
        given = _one_header(request, IDEMPOTENCY_HEADER)
        key = None  # scoped to the tenant, the models the key may use, and the endpoint
        sent = b""  # a key's body, scoped to its endpoint (not copied without a key)
        if given is not None:
            key = scoped(caller.tenant, f"{request.path} {_idempotency_key(given)}", allowed)
            sent = request.path.encode() + b"\n" + await self._read(raw, hold, _canonical(raw))
            replay = await self.replays.first(key)  # another with the key may be on its way
            if replay is not None:
                return await self._replay(request, replay, sent, call, door, hold=hold)
            fields["idempotency_key"] = key
        left: _TakeOver[Any] | None = None
        try:
            # checked whole before the quotas see it: one that can never be served is its
            # 400, whatever the key's limits (it waited its turn, then was a retryable 429;
            # found by a hunt), and the one made is the one submitted
            asked = await self._read(raw, hold, functools.partial(self._asked, call, fields))
            estimate: Callable[[], Estimate] = functools.partial(
                chat_estimate, call.messages, fields, image_rules=self.cb.system.image_rules
            )
            if heavy and self.quotas.limited(caller):  # counted off the loop too, if need be
                counted = await self._read(raw, hold, estimate)
                estimate = functools.partial(_same, counted)
            ticket = await self._admit(caller, call.name, fields, estimate)
            then: Callable[..., object] = (
                self._left_streaming if call.stream else self._left_submitting
            )
            left = self._taken_over(ticket, functools.partial(then, ticket, key, sent, hold), key)
            if call.stream:
                return await self._stream(
                    request,
                    call,
                    asked,
                    fields=fields,
                    estimate=estimate,
                    key=key,
                    sent=sent,
                    door=door,
                    ticket=ticket,
                    hold=hold,
                    heavy=heavy,
                    left=left,
                )
            with self._submitting(ticket, heavy=heavy):
                future = await self._submit(
                    asked, fields, batched=key is None, left=left, hold=hold, heavy=heavy
                )
            self._follow(self._handoff.watch(future), ticket, key, sent, hold)
            # the handler's own waiter, settled in the same delivery: cancelling it (the
            # client left) leaves the one followed alone, as a shield around that one
            # would, but a shield's outer future woke the handler a loop turn later
            try:
                result = await self._handoff.watch(future)
            except asyncio.CancelledError:  # the client left
                if key is None:
                    self._withdraw(future)
                raise
            log.debug("task %d for key %s: %s", result.task_id, caller.name, type(result).__name__)
            return await self._answered(result, call, door, hold)
        finally:
            if key is not None and (left is None or not left.taken):
                self.replays.let_go(key)  # added, or never will be: the next goes on
            # else the reader's submit goes on without this handler, and its take-over
            # lets the key go once it is added (the next request with it waits till then:
            # let go here, it went on, was refused as a duplicate by the ledger, and that
            # refusal replaced the first's answer for every retry; found by a hunt)

    async def _submit(
        self,
        asked: Request,
        fields: dict[str, Any],
        *,
        batched: bool,
        left: _TakeOver[Future[Result]],
        hold: Hold,
        heavy: bool,
    ) -> Future[Result]:
        """Submit ``asked`` (admitted with ``fields``): with the other requests of this
        turn of the loop when ``batched`` (``batch``), else on its own (a request with
        an idempotency key); a ``heavy`` one on the reader thread (its prompt is
        counted as it is submitted), ``left`` taking over if the client leaves
        meanwhile."""
        if not batched or heavy:
            self._batch.flush()  # it goes on its own: not before what this turn holds
        if heavy:
            return await self._on_reader(
                lambda: self.cb.system.submit(_admitted(asked, fields)), hold, left
            )
        if not batched:
            return self.cb.system.submit(_admitted(asked, fields))
        return await self._batch.submit(_admitted(asked, fields))

    def _asked(self, call: ChatCall, fields: Mapping[str, Any]) -> Request:
        """The ``Request`` of ``call`` with ``fields``, checked as ``submit`` checks it
        (``InvalidRequestError`` naming the field: a 400), and its model or route by
        the system's policy."""
        asked = Request.of(call.messages, **fields)
        self.cb.system.policy.check(asked)
        return asked

    async def _body(self, request: web.Request) -> tuple[bytes, Hold]:
        """The request's body, whole, and the room it holds (``room``); a 408 (the
        connection then closed) when it has not come within ``body_timeout_s``, a 429
        when the gateway holds all the bodies it may: at once for a body declared
        larger than the room left, else as soon as the room cannot take what came.

        A body still coming holds room for what has come (``_arriving``): read whole
        first and counted after, eight bodies stalled a megabyte short of 32 MB held
        250 MB that the room never saw (found by a hunt)."""
        self._room_for(request)
        hold: Hold | None = None
        limit = self.settings.body_timeout_s
        try:
            if request.content.is_eof():  # here whole (it came with its head): no timer
                raw = await request.read()
            else:
                hold = self.room.take(0)
                assert hold is not None  # nothing fits any room
                request[_HOLD] = hold  # given back for the handler by _errors
                async with asyncio.timeout(limit):
                    raw = await self._arriving(request, hold)
        except TimeoutError:
            raise Refusal(
                ApiError(
                    status=408,
                    message=f"the request body did not arrive whole within {limit:g} s",
                    code="request_timeout",
                ),
                close=True,
            ) from None
        except (RequestPayloadError, HttpProcessingError) as exc:  # a broken chunked body
            raise Refusal(
                ApiError(status=400, message=f"the request body is malformed: {exc}"),
                close=True,
            ) from None
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "")
        if encoding:  # inflated on the reader thread: up to max_body_mb of it holds no one
            inflate = functools.partial(inflated, raw, encoding, self._max_body)
            raw = await asyncio.get_running_loop().run_in_executor(self._reader, inflate)
        # a bound on what it parses into, counted in C: a brace, bracket or comma inside
        # a string counts too, an overestimate that only a body of little else notices
        values = _values(raw) if len(raw) >= HEAVY_BODY else 0
        if values > MAX_VALUES:
            raise Refusal(
                ApiError(
                    status=413,
                    message=f"the request body holds about {values} JSON values (objects, "
                    f"arrays and commas): more than the gateway reads in one ({MAX_VALUES})",
                    code="request_entity_too_large",
                )
            )
        # all of the room at most: max_body_mb's bodies always fit a room that holds one
        size = min(len(raw) + VALUE_BYTES * values, self.room.capacity)
        if hold is None:
            hold = self.room.take(size)
            if hold is None:
                raise Refusal(self._no_room())
            request[_HOLD] = hold  # given back for the handler by _errors
        elif size > hold.size and not hold.grow(size - hold.size):
            raise Refusal(self._no_room())
        return raw, hold

    def _room_for(self, request: web.Request) -> None:
        """A 429 (``gateway_full``) for a body declared larger than the room left, before
        any of it is read (the connection then closed if some of it is still to come:
        it is not read on)."""
        declared = request.content_length
        if declared is not None and self.room.turns_away(declared):
            raise Refusal(self._no_room())

    async def _arriving(self, request: web.Request, hold: Hold) -> bytes:
        """The body as it comes, a piece at a time, ``hold`` grown by each piece before
        the next is read: a 429 (the connection closed) once the room cannot take one,
        a 413 past ``max_body_mb`` (a chunked body declares no length). aiohttp keeps
        at most its read buffer (128 KiB) of a body that is not being read."""
        content = request.content
        pieces: list[bytes] = []
        size = 0
        while piece := await content.readany():
            size += len(piece)
            if size > self._max_body:
                raise web.HTTPRequestEntityTooLarge(max_size=self._max_body, actual_size=size)
            if not hold.grow(len(piece)):
                raise Refusal(self._no_room(), close=True)
            pieces.append(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def _read(self, raw: bytes, hold: Hold, read: Callable[[], _T]) -> _T:
        """``read()``: at once for a small body, on the reader thread for one of
        ``HEAVY_BODY`` bytes or more. Reading a request is mostly Python (every message,
        part and tool checked, frozen and counted: about 9 us a part), and a legal 13 MB
        body of tiny parts held the loop, and every other request, for 3.5 s (8.8 MB of
        tools: 3 s); on a thread the loop runs between the reader's turns of the GIL.
        What still holds the loop is the JSON parse (C, which keeps the GIL: 0.2-0.5 s
        for those bodies). One thread: heavy bodies wait for each other, not the loop
        for them."""
        if len(raw) < HEAVY_BODY:
            return read()
        return await self._on_reader(read, hold)

    async def _on_reader(
        self,
        work: Callable[[], _T],
        hold: Hold,
        left: _TakeOver[_T] | None = None,
    ) -> _T:
        """``work()`` on the reader thread. If the caller leaves meanwhile, ``work`` still
        ends, and ``left`` gets it, done (on the loop): what it made must not be lost;
        the body's ``hold`` lasts until then."""
        job = asyncio.get_running_loop().run_in_executor(self._reader, work)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            if left is not None:
                left.taken = True
                job.add_done_callback(left)  # first: it may keep the hold for what it gets
            hold.keep_until(job)
            raise

    @contextlib.contextmanager
    def _submitting(self, ticket: Ticket, *, heavy: bool) -> Iterator[None]:
        """Around a submit: one refused releases ``ticket`` (nothing was sent), and so
        does a client that leaves, but from a heavy submit, whose ticket is then its
        ``left``'s (the reader's submit goes on without the handler)."""
        try:
            yield
        except asyncio.CancelledError:
            if not heavy:
                self.quotas.release(ticket)
            raise
        except BaseException:
            self.quotas.release(ticket)
            raise

    def _follow(
        self,
        outcome: asyncio.Future[Result],
        ticket: Ticket,
        key: str | None,
        sent: bytes,
        hold: Hold,
    ) -> asyncio.Future[Result]:
        """A submitted task's ``outcome`` (a task's waiter, a stream's result), followed
        on this loop: its quota ticket settled by it, its body's room kept until it
        (the task holds the request), and it recorded as its ``Idempotency-Key``'s
        answer."""
        self.quotas.follow(ticket, outcome)
        hold.keep_until(outcome)
        if key is not None:
            self.replays.add(key, sent, outcome)
        return outcome

    def _taken_over(
        self, ticket: Ticket, then: Callable[[_T], object], key: str | None = None
    ) -> _TakeOver[_T]:
        """``_on_reader``'s ``left`` for a submit whose client left: ``then`` gets what
        the reader made; if it made nothing (refused), ``ticket`` is released and the
        Idempotency-Key ``key`` let go."""

        def release() -> None:
            self.quotas.release(ticket)
            if key is not None:
                self.replays.let_go(key)

        return _TakeOver(then, release)

    def _left_submitting(
        self, ticket: Ticket, key: str | None, sent: bytes, hold: Hold, future: Future[Result]
    ) -> None:
        """A heavy request's client left while the reader submitted it: its task is
        followed as its handler would have (with a key it runs on: the retry is for its
        answer; without one it is cancelled)."""
        self._follow(self._handoff.watch(future), ticket, key, sent, hold)
        if key is None:
            self._withdraw(future)

    def _withdraw(self, future: Future[Result]) -> None:
        """A client left: its task is cancelled where it waits unsent (it ends
        ``Cancelled``), and runs to its end if its call was sent. Either way its future
        resolves, and the quota is settled by what the task cost: cancelling the future
        itself always succeeded, so a call already sent was released as never sent (a
        client hanging up after each send spent 14 times its key's budget)."""
        assert isinstance(future, TaskFuture)  # submit's, as every chat's here
        with contextlib.suppress(SystemStoppedError):  # stopped: every task has ended
            self.cb.system.cancel(future.task_id)

    def _left_streaming(
        self, ticket: Ticket, key: str | None, sent: bytes, hold: Hold, made: ChatStream
    ) -> None:
        """``_left_submitting`` for a stream: it is opened and closed at once (a stream
        without a reader ends ``Cancelled``, also with a key, as when its client leaves
        mid-stream)."""
        stream = AsyncChatStream.of(made)
        self._follow(asyncio.ensure_future(stream.result()), ticket, key, sent, hold)
        stream.close()

    def _left_embedding(self, ticket: Ticket, future: EmbedFuture) -> None:
        """``_left_submitting`` for embeddings: the calls not sent yet are cancelled, and
        the quota is settled by what the ones sent cost."""
        future.cancel()
        self.quotas.follow(ticket, self._handoff.watch(future.spent))

    async def last_word(self) -> None:
        """The grace is over: what is still waiting gets its answer now, not a closed
        connection: a request waiting for its quotas a 503 (``stopping``, with
        ``Retry-After``), and every task still live ends ``Cancelled`` (the system stops,
        not waiting): a plain request's answer is then a 503 with ``Retry-After``, a
        stream's the API's error event and its end (found by a hunt)."""
        said = "the gateway is shutting down: send this request again"
        turned = self.quotas.turn_away(stopping_error(said, self.settings.retry_after_s))
        if turned:
            log.info("shutting down: %d requests waiting for their quotas answered 503", turned)
        await self.cb.stop(cancel=True, timeout=0)

    def close(self) -> None:
        """Stop the reader thread (once the server no longer takes requests)."""
        self._reader.shutdown(wait=False, cancel_futures=True)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        raw, hold = await self._body(request)
        heavy = len(raw) >= HEAVY_BODY
        call = await self._read(raw, hold, lambda: embed_call(_json(raw)))
        fields = {**call.fields, **self._scheduling(request, caller, call.name, call.priority)}
        estimate: Callable[[], Estimate] = functools.partial(embed_estimate, call.input)
        if self.quotas.limited(caller):  # what embed refuses, refused before the quotas
            await self._read(raw, hold, functools.partial(self._embeddable, call, fields))
            if heavy:  # counted off the loop too
                counted = await self._read(raw, hold, estimate)
                estimate = functools.partial(_same, counted)
        ticket = await self._admit(caller, call.name, fields, estimate)
        embed = functools.partial(self.cb.system.embed, call.input, keep_base64=call.base64)
        with self._submitting(ticket, heavy=heavy):
            self._batch.flush()  # it goes on its own: not before what this turn holds
            if heavy:
                left = self._taken_over(ticket, functools.partial(self._left_embedding, ticket))
                future = await self._on_reader(lambda: embed(**fields), hold, left)
            else:
                future = embed(**fields)
        try:
            result = await self._handoff.settled(future)
        except asyncio.CancelledError:  # the client left: the calls not sent are cancelled
            self.quotas.follow(ticket, self._handoff.watch(future.spent))  # by what was
            raise
        except BaseException:
            self.quotas.release(ticket)  # refused: nothing was sent
            raise
        self.quotas.settle(ticket, result)
        return await self._embedded_answer(result, name=call.name, hold=hold)

    def _embeddable(self, call: EmbedCall, fields: Mapping[str, Any]) -> None:
        """What ``System.embed`` refuses before it sends anything (a field out of range, a
        text no call of the model can carry), refused before a key's quotas see the
        request, as a chat's is (``_asked``): an unlimited key's is refused by the
        embed itself, with no wait between."""
        texts, _ = texts_of(call.input, "input")
        own = {"encoding_format": "base64", **fields}  # as embed sends them
        system = self.cb.system
        system.policy.check(embedding_request(texts[:1], own))
        system.batching.chunks(texts, own.get("model"), own.get("route"), own)

    async def _embedded_answer(
        self, result: EmbeddingResult, *, name: str, hold: Hold
    ) -> web.Response:
        """The vectors in OpenAI's list, or the error that ended them. A large answer
        of floats is written on the reader thread (``embeddings_json``)."""
        headers = {"X-Callboard-Cost": usd_text(result.cost_usd)}
        if result.model is not None:
            headers["X-Callboard-Model"] = result.model
        if result.trace_id:  # the SDKs' ``_request_id``, as a chat answer has it
            headers["x-request-id"] = headers["request-id"] = result.trace_id
        if result.ok:
            if result.vectors_base64 is None and _floats(result) >= HEAVY_ANSWER_FLOATS:
                payload = await self._on_reader(
                    functools.partial(embeddings_json, result, name=name), hold
                )
            else:
                payload = encode(embeddings_body(result, name=name))
            return web.Response(body=payload, headers=headers, content_type="application/json")
        failure = result.failure
        if failure is not None and not failure.ok:
            error = self._error_for(failure)
        else:
            message = result.detail or "the provider's embeddings could not be used"
            error = ApiError(  # the same answer again: the SDK is not to pay for it twice
                status=502, message=message, type=SERVER, code="embedding_failed", retry=False
            )
        return _error_response(error, headers)

    async def models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models``: the models and routes the key may use, in OpenAI's shape,
        or Anthropic's (paged) for a client that says ``anthropic-version``, as the
        anthropic SDK does: its ``ModelInfo`` needs ``type``, ``display_name`` and
        ``created_at``, which OpenAI's list has not."""
        caller = self._caller(request)
        names = [(n, "callboard") for n in sorted(self._wires) if caller.may_use(n)]
        names += [(r, "callboard:route") for r in sorted(self._routes) if caller.may_use(r)]
        if ANTHROPIC_VERSION in request.headers:
            page = models_page([n for n, _ in names], request.query)
            return _identified(_json_response(page))
        return _identified(_json_response(models_body(names, created=0)))

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/messages/count_tokens`` (the ``anthropic`` SDK's
        ``messages.count_tokens``): the prompt's tokens as callboard counts them for its
        reservations, by Anthropic's rules (an estimate, as Anthropic says its own is).
        The body is a message's, ``max_tokens`` not needed; the model must be one the
        key may use. It takes none of the key's rpm, tpm or budget: it calls no model,
        and Anthropic limits it apart from messages too (a rate of its own), so an SDK
        that counts before each message does not halve the key's rate. What bounds it
        is the body's (``max_body_mb``, ``max_held_mb``) and the one reader thread its
        heavy bodies are read and counted on."""
        caller = self._caller(request)
        raw, hold = await self._body(request)
        call = await self._read(raw, hold, lambda: messages_call(_countable(_json(raw))))
        self._target(caller, call.name)
        # counted on the reader for a heavy body, as a message's reservation is: on the
        # loop, 17 MB of text parts held every other request for 2-3 s (found by a hunt)
        count = functools.partial(chat_estimate, call.messages, call.fields, dialect="anthropic")
        counted = await self._read(raw, hold, count)
        return _identified(_json_response({"input_tokens": counted.prompt_tokens}))

    async def model(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models/{name}`` (the SDKs' ``models.retrieve``): one model or route
        the key may use, as the list gives it; 404 or 403 as a request naming it gets."""
        name = request.match_info["name"]
        kind = self._target(self._caller(request), name)
        if ANTHROPIC_VERSION in request.headers:
            return _identified(_json_response(model_info(name)))
        owner = "callboard" if "model" in kind else "callboard:route"
        (one,) = models_body([(name, owner)], created=0)["data"]
        return _identified(_json_response(one))

    async def stats(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        if not caller.operator:  # another tenant's names, money and load are not its to read
            quotas = plain(self.quotas.statistics(caller))
            return _json_response({"key": caller.name, "tenant": caller.tenant, "quotas": quotas})
        stats = await self.cb.stats()
        body = plain(stats)
        body["cost_usd"] = usd_text(stats.cost_usd)
        body["quotas"] = plain(self.quotas.statistics())
        body["bodies"] = self.room.statistics()
        body["connections"] = self.connections.statistics()
        body["gateway"] = {"status": self._serving()}
        return _json_response(body)

    def _serving(self) -> str:
        """``ready``, ``draining`` (a shutdown began: no new connection is taken) or
        ``failed`` (the system failed: every request is answered 503)."""
        if self.cb.failed.is_set():
            return "failed"
        return "ready" if self.ready else "draining"

    async def healthz(self, _request: web.Request) -> web.StreamResponse:
        if self.cb.failed.is_set():
            return _json_response({"status": "failed"}, status=503)
        return _json_response({"status": "ok"})

    async def readyz(self, _request: web.Request) -> web.StreamResponse:
        if not self.ready or self.cb.failed.is_set():
            return _json_response({"status": "unready"}, status=503)
        return _json_response({"status": "ready"})

    # -- who, where, how urgent --------------------------------------------------------

    def _caller(self, request: web.Request) -> Caller:
        # two keys: which one is meant is not ours to guess (the first won: a good one
        # first let a bad second through), so neither is taken
        for name in _KEY_HEADERS:
            _one_header(request, name, "one key")
        if self.keys.open:  # no keys: whatever an SDK sends (both of Anthropic's, say)
            return ANONYMOUS  # is no key of ours (two refused it a 400; found by a review)
        try:
            presented = presented_key(request.headers)
        except TwoKeysError as exc:
            raise Refusal(ApiError(status=400, message=str(exc))) from None
        caller = self.keys.caller(presented)
        if caller is None:
            raise Refusal(
                ApiError(
                    status=401,
                    message="Incorrect or missing API key: send one of this gateway's keys "
                    "as 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    code="invalid_api_key",
                )
            )
        return caller

    def _operator(self, request: web.Request) -> None:
        """Refuse (401, 403) a caller without an ``operator`` key."""
        if not self._caller(request).operator:
            raise Refusal(
                ApiError(
                    status=403,
                    message="GET /metrics is for an operator key only (gateway.metrics = "
                    '"operator")',
                    code="operator_only",
                )
            )

    def _scheduling(
        self, request: web.Request, caller: Caller, name: str, asked: Priority | None
    ) -> dict[str, Any]:
        """``submit``'s fields for where the request goes, how urgent it is, whose
        budget pays and when it expires."""
        fields: dict[str, Any] = self._target(caller, name)
        header = _one_header(request, PRIORITY_HEADER)
        if header is not None:
            asked = _header_priority(header)
        fields["priority"] = caller.priority_for(asked)
        if caller.tenant is not None:
            fields["budget_tag"] = caller.tenant
        deadline = _one_header(request, DEADLINE_HEADER)
        if deadline is not None:
            fields["deadline_s"] = _deadline(deadline)
        elif self.settings.deadline_s is not None:  # as if the request had named it
            fields["deadline_s"] = self.settings.deadline_s
        return fields

    async def _admit(
        self,
        caller: Caller,
        name: str,
        fields: dict[str, Any],
        estimate: Callable[[], Estimate],
    ) -> Ticket:
        """Wait until the caller's key and tenant quotas take the request (``OverQuota``,
        a 429, when they cannot); what is left of its deadline goes on with it. Its
        budget reservation is priced at the models that may serve it (``models_allowed``)."""
        ticket = await self.quotas.admit(
            caller,
            model=name,
            estimate=estimate,
            deadline_s=fields.get("deadline_s"),
            allowed=fields.get("models_allowed"),
        )
        if "deadline_s" in fields and self.quotas.limited(caller):  # it may have waited
            fields["deadline_s"] = self.quotas.time_left(ticket)
        return ticket

    def _allowed(self, caller: Caller) -> frozenset[str] | None:
        """The models that may serve ``caller``'s chats: those its key names and the
        members of the routes it names, never another one's fallback (None: any; a key
        that may use ``auto`` may be served by any model auto picks)."""
        names = caller.models
        if names is None or AUTO in names:
            return None
        found = self._allowed_by.get(names)
        if found is None:
            found = frozenset(m for n in names for m in self._members.get(n, (n,)))
            self._allowed_by[names] = found
        return found

    def _target(self, caller: Caller, name: str) -> dict[str, Any]:
        """``{"model": name}`` or ``{"route": name}``; 404 for neither, 403 for a name
        the caller's key may not use."""
        kind = "model" if name in self._wires else "route" if name in self._routes else None
        if kind is None:
            names = (*sorted(self._wires), *sorted(self._routes))
            known = ", ".join(n for n in names if caller.may_use(n))
            raise Refusal(
                ApiError(
                    status=404,
                    message=f"The model {name!r} does not exist (models and routes: {known})",
                    code="model_not_found",
                    param="model",
                )
            )
        if not caller.may_use(name):
            raise Refusal(
                ApiError(
                    status=403,
                    message=f"the key {caller.name!r} may not use {name!r}",
                    type="permission_error",
                    code="model_not_allowed",
                    param="model",
                )
            )
        return {kind: name}

    def _no_room(self) -> ApiError:
        """The 429 of a request whose body found no room."""
        return ApiError(
            status=429,
            message="the gateway holds all the request bodies it may "
            f"(max_held_mb = {self.settings.max_held_mb:g}): try again later",
            type="requests",
            code="gateway_full",
            retry_after_s=self.settings.retry_after_s,
            retry=True,
        )

    # -- answers ---------------------------------------------------------------------------

    def _answer(self, result: Result, call: ChatCall, door: _Door) -> web.Response:
        headers = _result_headers(result)
        if isinstance(result, Completed):
            try:
                body = door.body(result, call, self._wires.get(result.model or ""))
            except MalformedOutputError as exc:
                return door.error_response(_malformed(exc), headers)
            return _json_response(body, headers)
        return door.error_response(self._error_for(result), headers)

    async def _answered(
        self, result: Result, call: ChatCall, door: _Door, hold: Hold
    ) -> web.Response:
        """``_answer``, but an answer of ``HEAVY_ANSWER`` bytes or more (``_weight``) is
        made and encoded on the reader thread, a piece at a time (``encode_pieces``), as
        a large embeddings answer is: on the loop, the 57 MB answer to a 150-byte request
        (128 choices, 20 logprobs a token) held every other request for seconds (found
        by a hunt). An ordinary answer is made here, with no hand-over."""
        if not isinstance(result, Completed) or _weight(result) < HEAVY_ANSWER:
            return self._answer(result, call, door)
        wire = self._wires.get(result.model or "")
        headers = _result_headers(result)
        try:
            payload = await self._on_reader(
                lambda: encode_pieces(door.body(result, call, wire)), hold
            )
        except MalformedOutputError as exc:
            return door.error_response(_malformed(exc), headers)
        return web.Response(body=payload, headers=headers, content_type="application/json")

    async def _replay(
        self,
        request: web.Request,
        replay: Replay,
        sent: bytes,
        call: ChatCall,
        door: _Door,
        *,
        hold: Hold,
    ) -> web.StreamResponse:
        """The answer to a retry: the first request's, once it has one."""
        if replay.body_sha256 != digest(sent):
            raise Refusal(
                ApiError(
                    status=422,
                    message="this Idempotency-Key was sent before with another body: use a "
                    "new key for a new request",
                    code="idempotency_key_mismatch",
                )
            )
        result = await asyncio.shield(replay.result)
        if isinstance(result, Cancelled):
            error = ApiError(
                status=409,
                message="the first request with this Idempotency-Key was cancelled before it "
                "was answered (its client left mid-stream, or callboard stopped): send the "
                "request again (the key is free once it has ended)",
                code="idempotency_key_cancelled",
                retry=False,
            )
            return door.error_response(error, _result_headers(result))
        if call.stream and isinstance(result, Completed):
            return await self._replayed_stream(request, result, call, door)
        response = await self._answered(result, call, door, hold)
        response.headers["Idempotent-Replayed"] = "true"
        return response

    async def _stream(
        self,
        request: web.Request,
        call: ChatCall,
        asked: Request,
        *,
        fields: dict[str, Any],
        estimate: Callable[[], Estimate],
        key: str | None,
        sent: bytes,
        door: _Door,
        ticket: Ticket,
        hold: Hold,
        heavy: bool,
        left: _TakeOver[ChatStream],
    ) -> web.StreamResponse:
        """An SSE answer to ``asked`` (``call``, checked), its events written as each
        delta arrives. A stream that ends before its first delta is answered like a
        plain request (a real status); one cut after it ends with the API's error
        event. A ``heavy`` one is submitted on the reader thread (as ``_submit``),
        ``left`` taking over if the client leaves meanwhile."""
        with self._submitting(ticket, heavy=heavy):
            if heavy:
                self._batch.flush()  # it goes on its own: not before what this turn holds
                made = await self._on_reader(
                    lambda: self.cb.system.stream(_admitted(asked, fields)), hold, left
                )
                stream = AsyncChatStream.of(made)
            else:
                stream = self.cb.stream(_admitted(asked, fields))
        quiet_s = _quiet_s(request, self.settings.stream_keepalive_s)
        deltas = aiter(stream)
        # its reader first: a result asked for before any delta was, with a full
        # channel's deltas waiting, dropped them (``DeltasDroppedError``; a review)
        coming = asyncio.ensure_future(_first(deltas))
        coming.add_done_callback(_seen)  # a failure no one awaits (a client gone) is no log
        self._follow(asyncio.ensure_future(stream.result()), ticket, key, sent, hold)
        try:
            # the head waits for the first delta, so a stream that fails before it is
            # answered with a real status, but no longer than a client's patience: held
            # back through the queue's wait and the provider's first token, it timed
            # out SDKs whose retries were calls of their own, each billed (a hunt)
            await asyncio.wait({coming}, timeout=quiet_s)
            if coming.done() and (failed := _failure(coming)) is not None:
                return self._answer(failed.result, call, door)
            heard = coming.done() and coming.result() is not None
            response = web.StreamResponse(
                headers=_stream_headers(stream, fields, call, heard=heard)
            )
            out = _Out(request, response, self.settings.idle_s)

            def writer() -> _Writer:  # the model that says it, as a whole answer
                model = stream.model or call.name
                prompt_tokens = lambda: estimate().prompt_tokens  # noqa: E731
                return door.writer(out, call, stream.task_id, prompt_tokens, model=model)

            await self._write_stream(
                request,
                out,
                stream,
                coming=coming,
                deltas=deltas,
                writer=writer,
                door=door,
                quiet_s=quiet_s,
            )
            return response
        finally:
            coming.cancel()
            stream.close()  # a stream still going stops reading its provider

    async def _write_stream(
        self,
        request: web.Request,
        out: _Out,
        stream: AsyncChatStream,
        *,
        coming: asyncio.Future[StreamDelta | None],
        deltas: AsyncIterator[StreamDelta],
        writer: Callable[[], _Writer],
        door: _Door,
        quiet_s: float,
    ) -> None:
        """The stream's head, then its events (``writer()`` makes their writer)
        as its deltas come (the first is ``coming``), and the API's keep-alive whenever
        it has been quiet for ``quiet_s``."""
        events: _Writer | None = None
        pinging: asyncio.Task[None] | None = None
        try:
            await out.prepare(request)  # a client may leave as its head goes
            pinging = asyncio.ensure_future(_keep_alive(out, door.keep_alive, quiet_s))
            pinging.add_done_callback(_seen)
            first = await coming
            events = writer()
            if first is not None:
                await events.delta(first)
            async for delta in deltas:
                await events.delta(delta)
            await events.end(await stream.result())
        except StreamFailedError as exc:  # cut, or failed after its head went
            error = self._error_for(exc.result)
            try:
                await (events or writer()).failed(error)
            except ConnectionResetError:  # gone as the provider cut it: no error of ours
                log.debug("task %d: the stream's client left at its cut", stream.task_id)
        except _StalledError as exc:
            log.info("task %d: stream closed: %s", stream.task_id, exc)
        except ConnectionResetError:
            log.debug("task %d: the stream's client left", stream.task_id)
        finally:
            if pinging is not None:
                pinging.cancel()

    async def _replayed_stream(
        self, request: web.Request, result: Completed, call: ChatCall, door: _Door
    ) -> web.StreamResponse:
        """A stream's retry, answered from the whole result: each choice (``n`` > 1: every
        one) its text in one delta, each tool call whole, then its finish."""
        headers = {**_SSE_HEADERS, **_result_headers(result), "Idempotent-Replayed": "true"}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        out = _Out(request, response, self.settings.idle_s)
        u = result.usage  # Anthropic's input_tokens: the prompt less what the cache held
        said = message_usage(u.prompt_tokens, 0, u.cached_tokens, u.cache_write_tokens, 0)
        model = result.model or call.name
        events = door.writer(out, call, result.task_id, lambda: said["input_tokens"], model=model)
        choices = result.choices or (
            Choice(
                index=0,
                content=result.content,
                tool_calls=result.tool_calls,
                finish_reason=result.finish_reason,
                refusal=result.refusal,
                logprobs=result.logprobs,
            ),
        )
        with contextlib.suppress(ConnectionResetError):
            for c in choices:
                calls = tuple(
                    ToolCallDelta(index=i, id=t.id, name=t.name, arguments=t.arguments)
                    for i, t in enumerate(c.tool_calls)
                )
                text, refusal = c.content or "", c.refusal or ""
                await events.delta(
                    StreamDelta(
                        text=text,
                        tool_calls=calls,
                        refusal=refusal,
                        choice=c.index,
                        logprobs=c.logprobs,
                        reasoning=_reasoning_of(result, c.index),
                        thinking_blocks=result.thinking_blocks if c.index == 0 else (),
                    )
                )
                finish = c.finish_reason or "stop"
                await events.delta(StreamDelta(finish_reason=finish, choice=c.index))
            await events.end(result)
        return response

    # -- errors ----------------------------------------------------------------------------

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: a body declared too large (413), a key that is not
        one of the gateway's (401) or a body the room has no room for (429) is answered
        at once, without the ``100 Continue`` that would invite the client to send a
        body only to refuse it (as nginx does); an expectation other than
        ``100-continue`` is a 417; else the client is asked to go on."""
        door = _door_of(request)
        try:
            _fits(request, self._max_body)
            self._caller(request)
            self._room_for(request)
        except Refusal as refusal:
            error = refusal.error
        except web.HTTPException as exc:
            error = _http_error(request, exc)
        else:
            expect = request.headers.get("Expect", "")
            if request.version != HttpVersion11:
                return None
            if expect.lower() == "100-continue":
                if request.transport is not None:
                    request.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                return None
            error = ApiError(
                status=417,
                message=f"Expect: only 100-continue is understood, not {expect[:100]!r}",
                code="expectation_failed",
            )
        response = door.error_response(error)
        await _closing(request, response)  # the body it declared is not to come
        return response

    @web.middleware
    async def _bounded(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every plain answer (not a stream: that writes itself through ``_Out``) written
        here, as a stream's is: aiohttp writes one whole into the connection's buffer and
        waits for its client to take it, for as long as the socket stays open (two
        embeddings of 2,048 texts, never read, held 630 MB; found by a hunt). A client
        that takes none of it for ``idle_s`` loses the connection, and the gateway what
        it buffered; a slow one that takes some is waited for. A client gone before its
        answer is written is no error (aiohttp logged each at ERROR with a traceback:
        one closing its sending side, as ``shutdown(SHUT_WR)`` does, flooded the log
        with no key; found by a hunt)."""
        response = await handler(request)
        if not response.prepared:
            try:
                await _written(request, response, self.settings.idle_s)
            except ConnectionError as exc:  # the client left, or half-closed its side
                log.debug("%s %s: the client went away: %r", request.method, request.path, exc)
        return response

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error as the API's error body (Anthropic's under ``/v1/messages``,
        OpenAI's elsewhere): refusals, misuse, a system that cannot take the call,
        aiohttp's own (404, 405, 413), and a bug (500, logged)."""
        door = _door_of(request)
        try:
            if self.settings.open:
                _for_this_machine(request)
            _fits(request, self._max_body)
            return await handler(request)
        except asyncio.CancelledError:  # its client left (aiohttp cancels its handler)
            self._observatory.left(request)
            raise
        except (Refusal, OverQuota) as refusal:
            response = _identified(door.error_response(refusal.error))
            if (isinstance(refusal, Refusal) and refusal.close) or _body_to_come(request):
                await _closing(request, response)
            return response
        except (UsageError, UnavailableError) as exc:
            error = error_for_exception(exc, self.settings.retry_after_s)
            return _identified(door.error_response(error))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error = _http_error(request, exc)
            response = _identified(door.error_response(error, dict(_allowed(exc))))
            if _body_to_come(request):
                await _closing(request, response)
            return response
        except CallboardError as exc:
            said = _request_id()
            log.exception("%s %s failed (request %s)", request.method, request.path, said)
            error = ApiError(status=500, message=str(exc), type=SERVER)
            return _identified(door.error_response(error), said)
        except Exception:
            said = _request_id()
            log.exception("%s %s failed (request %s)", request.method, request.path, said)
            error = ApiError(
                status=500, message="internal error in callboard's gateway", type=SERVER
            )
            return _identified(door.error_response(error), said)
        finally:
            hold = request.get(_HOLD)
            if hold is not None:
                hold.done()  # the handler's part: what outlives it keeps its own


SMALL_ANSWER = 16 * 1024
"""An answer of at most this many bytes, to a connection with nothing left to send, is
written without a watch: the transport takes it whole (it waits on its client only past
its high-water mark, 64 KiB), so it cannot wait on a client that does not read. A task
and a wait for each answer cost the gateway's loop 4-5% of its time at 50 in flight."""


async def _written(request: web.Request, response: web.StreamResponse, idle_s: float) -> None:
    """Write ``response`` whole; abort the connection once its client has taken nothing
    of it for ``idle_s`` (looked at each half of it: what is unsent did not shrink)."""
    transport = request.transport
    body = response.body if isinstance(response, web.Response) else None
    if (
        transport is not None
        and isinstance(body, bytes)
        and len(body) <= SMALL_ANSWER
        and transport.get_write_buffer_size() == 0
    ):
        await _prepared_and_ended(request, response)
        return
    writing = asyncio.ensure_future(_prepared_and_ended(request, response))
    writing.add_done_callback(_seen)
    loop = asyncio.get_running_loop()
    waiting, since = -1, loop.time()
    try:
        while True:
            done, _ = await asyncio.wait({writing}, timeout=idle_s / 2)
            if done:
                writing.result()
                return
            left = _unsent(transport)
            now = loop.time()
            if left != waiting:  # some taken (or the first look)
                waiting, since = left, now
            elif now - since >= idle_s:
                break
    finally:
        if not writing.done():
            writing.cancel()
    if transport is not None:
        transport.abort()  # aiohttp then finds the connection gone
    log.info(
        "%s %s: the client took none of its answer for %g s; dropped",
        request.method,
        request.path,
        idle_s,
    )


def _connection_bound(cb: AsyncSystem, settings: GatewaySettings) -> int | None:
    """``max_connections``, else the bound the open-file limit leaves (``connections``),
    warned of when small."""
    if settings.max_connections is not None:
        return settings.max_connections
    system = cb.system
    local = system.config.cluster is None  # a cluster's actors make its models' calls
    models = [m.max_concurrency for m in system.models.values()] if local else []
    limit = open_file_limit()
    bound = auto_capacity(limit, models)
    if bound is not None and bound < FEW_CONNECTIONS:
        log.warning(
            "gateway: at most %d client connections: the open-file limit (%d) less what "
            "the models' connections may take (%d); raise the limit (ulimit -n, systemd's "
            "LimitNOFILE) or set gateway.max_connections",
            bound,
            limit,
            sum(models),
        )
    return bound


def _seen(writing: asyncio.Future[Any]) -> None:
    """Read a write's end: a client that hung up as its handler was cancelled failed the
    write (``ConnectionError``) that nobody then awaited, and asyncio logged it at ERROR
    with its traceback, one a request (a caller could flood the log; found by a hunt)."""
    if not writing.cancelled():
        writing.exception()


def _unsent(transport: asyncio.Transport | None) -> int:
    """What the connection has not yet seen its client take: the transport's buffer and,
    on Linux, the socket's send queue (``TIOCOUTQ``). The buffer alone does not move
    while the kernel's queue, megabytes on loopback, drains into a slow reader: one
    reading 200 KB a second was taken as stalled (found by a review)."""
    if transport is None:
        return 0
    left = transport.get_write_buffer_size()
    if sys.platform == "win32":
        return left
    sock = transport.get_extra_info("socket")
    outq = getattr(termios, "TIOCOUTQ", None)
    if sock is not None and outq is not None:
        with contextlib.suppress(OSError, ValueError):  # closed meanwhile
            left += int.from_bytes(fcntl.ioctl(sock.fileno(), outq, bytes(4)), sys.byteorder)
    return left


async def _prepared_and_ended(request: web.Request, response: web.StreamResponse) -> None:
    await response.prepare(request)
    await response.write_eof()


def _request_id() -> str:
    """An id for an answer no task stands behind (a refusal, the models list): what
    the SDKs show as ``_request_id`` and an operator finds in the log."""
    return f"req_{secrets.token_hex(12)}"


def _identified(response: web.Response, said: str | None = None) -> web.Response:
    """``response`` with ``x-request-id`` and ``request-id``: a task's trace id where
    one answered, else ``said`` or a new id."""
    if "x-request-id" not in response.headers:
        said = said or _request_id()
        response.headers["x-request-id"] = response.headers["request-id"] = said
    return response


def _door_of(request: web.Request) -> _Door:
    """Whose error shape ``request`` gets: Anthropic's under ``/v1/messages``, else
    OpenAI's."""
    return _ANTHROPIC if request.path.startswith(_MESSAGES) else _OPENAI


def _http_error(request: web.Request, exc: web.HTTPException) -> ApiError:
    """aiohttp's own refusal (404, 405, 413...) as an API error."""
    return ApiError(
        status=exc.status,
        message=exc.reason if exc.status != 404 else f"no such endpoint: {request.path}",
        type=INVALID if exc.status < 500 else SERVER,
        code=exc.reason.lower().replace(" ", "_"),
    )


def _canonical(raw: bytes) -> Callable[[], bytes]:
    """What compares a retry's body with the first's (a JSON body, read before): its
    JSON with keys sorted and no spaces, so a client that writes the same request with
    its keys in another order or spaced otherwise is the same request, not a 422."""
    return lambda: json.dumps(_json(raw), sort_keys=True, separators=(",", ":")).encode()


ANTHROPIC_VERSION = "anthropic-version"
"""The header every anthropic SDK request carries: the models list answers it in
Anthropic's shape."""
_KEY_HEADERS = ("Authorization", "x-api-key", "api-key")
"""The headers a client's key may come in (``keys.presented_key``)."""


def _body_to_come(request: web.Request) -> bool:
    """Whether some of ``request``'s body has not arrived: answered before it (a 401,
    a 413 on its declared length), the connection is closed, not kept to read on
    (aiohttp reads what is left for up to 10 s before it takes the next request)."""
    return request.body_exists and not request.content.is_eof()


async def _closing(request: web.Request, response: web.Response) -> None:
    """Send ``response``, then close the connection at once: what is left of the
    request is not waited for (aiohttp would read on for ``lingering_time``, 10 s,
    what a stalled caller never sends)."""
    response.force_close()
    with contextlib.suppress(ConnectionResetError):  # the client is gone already
        await response.prepare(request)
        await response.write_eof()
    if request.transport is not None:
        request.transport.close()  # after what was written has gone


def inflated(raw: bytes, encoding: str, limit: int) -> bytes:
    """``raw`` as its ``Content-Encoding`` says it was compressed, inflated to at most
    ``limit`` bytes: a 413 past that, a 400 for a body that is not what its header says,
    a 415 for an encoding other than gzip and deflate (each closing the connection).

    aiohttp would inflate a body itself, on the loop, as it arrives, with no bound but
    the inflated size's: 2 MB of gzip that inflate to 2 GB held the loop for seconds,
    and went on after the 401 or 413 was sent (found by a hunt). Here it is inflated
    once the body has come (within ``max_body_mb``, as sent), by the request's handler
    (after its key was checked), piece by piece (``runtime.inflate``), never past
    ``limit``."""
    coding = coding_of(encoding)
    if coding is None:
        return raw
    if coding not in CODINGS:
        raise Refusal(
            ApiError(
                status=415,
                message=f"Content-Encoding {encoding[:100]!r} is not understood: gzip, "
                "deflate or none",
                code="unsupported_content_encoding",
            ),
            close=True,
        )
    inflater = Inflater(coding)
    out: list[bytes] = []
    size = 0
    try:
        for piece in inflater.feed(raw):
            size += len(piece)
            if size > limit:
                raise Refusal(
                    ApiError(
                        status=413,
                        message=f"the request body inflates to more than {limit} bytes",
                        code="request_entity_too_large",
                    ),
                    close=True,
                )
            out.append(piece)
        inflater.end()
    except InflateError:
        raise Refusal(_not_encoded(coding), close=True) from None
    return b"".join(out)


def _not_encoded(coding: str) -> ApiError:
    return ApiError(
        status=400,
        message=f"the request body is not valid {coding} (Content-Encoding: {coding})",
        code="invalid_content_encoding",
    )


def _fits(request: web.Request, limit: int) -> None:
    """A body declared larger than ``limit`` bytes is a 413 at once, before any of it is
    read (aiohttp refuses one only once ``limit`` bytes came: a caller that declares
    100 GB and sends nothing held its handler until it hung up)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=declared)


def _allowed(exc: web.HTTPException) -> dict[str, str]:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else {}


class _StalledError(ConnectionResetError):
    """A stream's client took none of what was written for ``idle_s``: taken as gone."""


class _Out:
    """A stream's response, each write bounded: a client that does not take what a
    write waits for within ``within`` seconds (its socket's buffers full: the span
    between asyncio's write-buffer marks, 48 KB) has its connection closed and is taken
    as gone, so its call ends and frees its slot. A slow reader is waited for down to
    about 48 KB in ``within`` (650 bytes a second at the default 75 s); a stalled one
    held a model's slot for as long as it kept its socket open. Watching the buffers
    shrink instead was tried: on loopback TCP opens its window only as half the
    receive buffer is read, so progress shows no more often than that either."""

    __slots__ = ("_loop", "_request", "_response", "_within", "ended", "last_write", "writing")

    def __init__(self, request: web.Request, response: web.StreamResponse, within: float) -> None:
        self._request = request
        self._response = response
        self._within = within
        self._loop = asyncio.get_running_loop()
        self.last_write = self._loop.time()
        """When the last write began (the loop's clock): the head's, at first."""
        self.writing = 0
        """Writes under way (a keep-alive waits for none)."""
        self.ended = False
        """Its end written: nothing more may be."""

    async def write(self, data: bytes) -> None:
        self.last_write = self._loop.time()
        self.writing += 1
        try:
            await self._bounded(self._response.write(data))
        finally:
            self.writing -= 1

    async def prepare(self, request: web.Request) -> None:
        """Send the head."""
        await self._response.prepare(request)
        self.last_write = self._loop.time()

    async def write_eof(self) -> None:
        self.ended = True
        await self._bounded(self._response.write_eof())

    async def _bounded(self, step: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self._within):
                await step
        except TimeoutError:
            if self._request.transport is not None:
                self._request.transport.abort()  # what is buffered will never be read
            raise _StalledError(f"the client read nothing for {self._within:g} s") from None


async def _first(deltas: AsyncIterator[StreamDelta]) -> StreamDelta | None:
    """A stream's first delta; None if it ends without one."""
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        return None


def _failure(coming: asyncio.Future[Any]) -> StreamFailedError | None:
    """How the first delta's wait (done) failed, if as a stream fails; another error
    is raised."""
    exc = coming.exception()
    if exc is None or isinstance(exc, StreamFailedError):
        return exc
    raise exc


def _stream_headers(
    stream: AsyncChatStream, fields: Mapping[str, Any], call: ChatCall, *, heard: bool
) -> dict[str, str]:
    """A stream's head: the model that answers once a delta was ``heard``, else the
    name asked (a model or a route): before a delta, the model called last may be one
    that failed and whose fallback answers (a hunt: the head named it, every chunk its
    fallback)."""
    headers = {
        **_SSE_HEADERS,
        "X-Callboard-Task-Id": str(stream.task_id),
        "X-Callboard-Priority": Priority(fields["priority"]).name.lower(),
        "X-Callboard-Model": (stream.model if heard else None) or call.name,
    }
    if stream.trace_id:  # the SDKs' ``_request_id``, as a whole answer has it
        headers["x-request-id"] = headers["request-id"] = stream.trace_id
    return headers


def _quiet_s(request: web.Request, keepalive_s: float) -> float:
    """How long a stream may stay silent: ``keepalive_s``, or half the timeout the
    client's SDK says it has if that is shorter (``TIMEOUT_HEADERS``), ``QUIET_LEAST_S``
    at least."""
    timeout = math.inf
    for name in TIMEOUT_HEADERS:
        said = request.headers.get(name)
        try:
            seconds = float(said) if said is not None else math.inf
        except ValueError:
            continue
        if seconds >= 0:  # nan or below 0: not a timeout an SDK sends
            timeout = min(timeout, seconds)
    return max(QUIET_LEAST_S, min(keepalive_s, timeout / 2))


async def _keep_alive(out: _Out, ping: bytes, quiet_s: float) -> None:
    """Write ``ping`` (the API's keep-alive) on ``out`` whenever nothing has been
    written for ``quiet_s`` and no write is under way; until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        # a write under way (a client slow to take it) is waited for a whole quiet_s:
        # timed from its start, the wait was 0 each turn, a core spun for ``idle_s``
        # by every stalled stream (a review)
        quiet_for = loop.time() - out.last_write
        await asyncio.sleep(quiet_s if out.writing else max(0.0, quiet_s - quiet_for))
        if out.ended:
            return
        if not out.writing and loop.time() - out.last_write >= quiet_s:
            await out.write(ping)


class _Writer(Protocol):
    """Writes one stream's events, in its API's shape."""

    async def delta(self, delta: StreamDelta) -> None: ...

    async def end(self, result: Result) -> None:
        """The stream's last events, from its result; then the end of the body."""
        ...

    async def failed(self, error: ApiError) -> None:
        """A stream cut after it began: the API's error event, then the end."""
        ...


class _Door(Protocol):
    """What one API's conversation endpoint does its own way."""

    keep_alive: bytes
    """What a stream writes to keep a quiet connection alive: an event the API's
    SDKs skip."""

    def read(self, body: object) -> ChatCall:
        """The request body, read (``InvalidRequestError`` naming what is wrong)."""
        ...

    def body(self, result: Completed, call: ChatCall, wire: str | None) -> Any:
        """The answer to ``call`` (served by a model whose dialect is ``wire``)."""
        ...

    def writer(
        self,
        response: _Out,
        call: ChatCall,
        task_id: int,
        prompt_tokens: Callable[[], int],
        *,
        model: str,
    ) -> _Writer:
        """The stream's events; ``prompt_tokens``: its prompt's size, as known when it
        starts (Anthropic's ``message_start`` says it; asked only there, a count);
        ``model``: the model that answers (each event names it, as a whole answer's
        body does; the SDKs' ``model`` of a stream)."""
        ...

    def error_response(
        self, error: ApiError, headers: Mapping[str, str] | None = None
    ) -> web.Response: ...


class _OpenAIDoor:
    """``POST /v1/chat/completions``: OpenAI's bodies, chunks and errors."""

    keep_alive = b": keep-alive\n\n"  # an SSE comment, as OpenAI's own API sends

    def read(self, body: object) -> ChatCall:
        return chat_call(body)

    def body(self, result: Completed, call: ChatCall, wire: str | None) -> Any:
        del call
        return completion_body(
            result, call_id=_call_id(result), created=int(time.time()), raw_ok=wire in _OPENAI_WIRES
        )

    def writer(
        self,
        response: _Out,
        call: ChatCall,
        task_id: int,
        prompt_tokens: Callable[[], int],
        *,
        model: str,
    ) -> _Writer:
        del prompt_tokens  # OpenAI's chunks say it with the usage, at the end: not counted
        return _Events(response, call, f"chatcmpl-{task_id}", model)

    def error_response(
        self, error: ApiError, headers: Mapping[str, str] | None = None
    ) -> web.Response:
        return _error_response(error, dict(headers or {}))


class _AnthropicDoor:
    """``POST /v1/messages``: Anthropic's bodies, events and errors. A message served
    by a model that speaks Anthropic is answered with the provider's body as received
    (unless the request asked a JSON format: that answer came through a tool)."""

    keep_alive = b'event: ping\ndata: {"type": "ping"}\n\n'  # Anthropic's own

    def read(self, body: object) -> ChatCall:
        return messages_call(body)

    def body(self, result: Completed, call: ChatCall, wire: str | None) -> Any:
        raw = result.raw
        if (
            wire == "anthropic"
            and "response_format" not in call.fields
            and isinstance(raw, Mapping)
            and raw.get("type") == "message"
        ):
            return raw
        return message_body(result, model=call.name)

    def writer(
        self,
        response: _Out,
        call: ChatCall,
        task_id: int,
        prompt_tokens: Callable[[], int],
        *,
        model: str,
    ) -> _Writer:
        del call  # its events say what the result and the model say
        events = MessageEvents(
            message_id=message_id(task_id), model=model, input_tokens=prompt_tokens()
        )
        return _MessageWriter(response, events)

    def error_response(
        self, error: ApiError, headers: Mapping[str, str] | None = None
    ) -> web.Response:
        return _json_response(
            error.anthropic_body(),
            {**(headers or {}), **error.headers()},
            status=error.anthropic_status(),
        )


_OPENAI: _Door = _OpenAIDoor()
_ANTHROPIC: _Door = _AnthropicDoor()


class _MessageWriter:
    """Writes one message's events (``anthropic_api.MessageEvents``) as named SSE."""

    def __init__(self, response: _Out, events: MessageEvents) -> None:
        self._response = response
        self._events = events

    async def delta(self, delta: StreamDelta) -> None:
        await self._write(self._events.delta(delta))

    async def end(self, result: Result) -> None:
        finish = getattr(result, "finish_reason", None)
        await self._write(self._events.end(result.usage, finish, provider_stop(result)))
        await self._response.write_eof()

    async def failed(self, error: ApiError) -> None:
        await self._write([error_event(error.anthropic_body())])
        await self._response.write_eof()

    async def _write(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        if events:
            await self._response.write(
                b"".join(
                    b"event: " + name.encode() + b"\ndata: " + encode(data) + b"\n\n"
                    for name, data in events
                )
            )


def _reasoning_of(result: Completed, index: int) -> str:
    """Choice ``index``'s reasoning in an answer, "" for none: a stream's replay lost
    what the stream had sent (a review)."""
    if index == 0:
        return result.reasoning or ""
    raw = result.raw
    choices = raw.get("choices") if isinstance(raw, Mapping) else None
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, Mapping) and choice.get("index", 0) == index:
            message = choice.get("message")
            said = reasoning_of(message) if isinstance(message, Mapping) else None
            return said if isinstance(said, str) else ""
    return ""


class _TakeOver(Generic[_T]):
    """``_on_reader``'s ``left``: what becomes of a heavy submit on the reader thread
    whose client left meanwhile. ``then`` gets what it made; if it made nothing
    (refused), ``release`` runs. ``taken`` once it was handed the work: what the
    handler would have done with the outcome (follow it, record it as its
    Idempotency-Key's answer, let that key go) is then its."""

    __slots__ = ("_release", "_then", "taken")

    def __init__(self, then: Callable[[_T], object], release: Callable[[], None]) -> None:
        self._then = then
        self._release = release
        self.taken = False

    def __call__(self, job: asyncio.Future[_T]) -> None:
        if job.cancelled() or job.exception() is not None:
            self._release()
        else:
            self._then(job.result())


class _Events:
    """Writes one stream's chunks: the role on each choice's first, usage at the end."""

    def __init__(self, response: _Out, call: ChatCall, call_id: str, model: str) -> None:
        self._response = response
        self._call = call
        self._id = call_id
        self._model = model
        self._created = int(time.time())
        self._started: set[int] = set()

    async def delta(self, delta: StreamDelta) -> None:
        first = delta.choice not in self._started
        self._started.add(delta.choice)
        event = chunk(
            delta,
            call_id=self._id,
            created=self._created,
            model=self._model,
            first=first,
            include_usage=self._call.include_usage,
        )
        await self._response.write(_sse(event))

    async def end(self, result: Result) -> None:
        """The stream's end: a last chunk if nothing was said (an empty answer), the
        usage chunk if asked, ``[DONE]``."""
        if not self._started:
            finish = getattr(result, "finish_reason", None) or "stop"
            await self.delta(StreamDelta(finish_reason=finish))
        if self._call.include_usage:
            event = usage_chunk(
                result.usage, call_id=self._id, created=self._created, model=self._model
            )
            await self._response.write(_sse(event))
        await self._response.write(_DONE)
        await self._response.write_eof()

    async def failed(self, error: ApiError) -> None:
        """A stream cut after it began: OpenAI's mid-stream error event (the SDK raises
        ``APIError`` on it), then the end."""
        await self._response.write(_sse(error.body()))
        await self._response.write_eof()


def _one_header(request: web.Request, name: str, send: str = "one") -> str | None:
    """The value of a header there may be one of (RFC 9110 5.3: not a list), or None; a
    400 naming it when it comes twice. The first one was taken and a second ignored,
    so a proxy that adds its own after the client's left the client's in force, and
    a second ``Origin`` passed an open gateway's check (found by a hunt)."""
    values = request.headers.getall(name, ())
    if len(values) > 1:
        raise Refusal(ApiError(status=400, message=f"more than one {name} header: send {send}"))
    return values[0] if values else None


def _for_this_machine(request: web.Request) -> None:
    """An open gateway (no keys: loopback only) answers only requests made for this
    machine by a client on it: a ``Host`` that is loopback, and no ``Origin`` of
    another site. Any web page the operator visited could post to it (its calls paid
    with the operator's provider keys), and one behind DNS rebinding could read its
    answers (found by a hunt)."""
    origin = _one_header(request, "Origin")
    if not _loopback_at(f"http://{request.host}") or (
        origin is not None and not _loopback_at(origin)
    ):
        raise Refusal(
            ApiError(
                status=403,
                message="an open gateway (no keys) answers only requests made for a loopback "
                "address, from no other site's page: configure keys to serve others",
                type="permission_error",
                code="foreign_origin",
            )
        )


def _malformed(exc: MalformedOutputError) -> ApiError:
    return ApiError(status=502, message=str(exc), type=SERVER, code="malformed_output", retry=False)


def _weight(result: Completed) -> int:
    """About how many bytes ``result``'s answer takes as JSON, from what makes one large:
    its texts, its tool calls' arguments and its logprobs (``LOGPROB_BYTES`` a token and
    each of its alternatives); a few attribute reads for an ordinary answer."""
    size = 0
    for answer in result.choices or (result,):
        size += len(answer.content or "")
        for made in answer.tool_calls:
            size += len(made.arguments)
        logprobs = answer.logprobs
        if logprobs:
            for part in ("content", "refusal"):
                entries = logprobs.get(part)
                if isinstance(entries, list | tuple) and entries:
                    first = entries[0]
                    ranked = first.get("top_logprobs") if isinstance(first, Mapping) else None
                    alternatives = len(ranked) if isinstance(ranked, list | tuple) else 0
                    size += len(entries) * (1 + alternatives) * LOGPROB_BYTES
    return size


def _countable(body: object) -> object:
    """A count_tokens body as a message's (``max_tokens`` is not a field of it)."""
    if isinstance(body, dict) and "max_tokens" not in body:
        return {**body, "max_tokens": 1}
    return body


def _admitted(asked: Request, fields: Mapping[str, Any]) -> Request:
    """``asked`` with what is left of its deadline once the quotas took it (``_admit``
    sets it in ``fields``)."""
    left = fields.get("deadline_s")
    if left is None or left == asked.deadline_s:
        return asked
    return dataclasses.replace(asked, deadline_s=left)


def _capped(fields: dict[str, Any], default: int) -> None:
    """``fields`` with a null cap taken as none given, as OpenAI's API reads it (the quota's
    estimate must see the cap the call is sent with: a null ``max_tokens`` beside a real
    ``max_completion_tokens`` reserved the default; a review), and the gateway's default
    where none is given (see ``GatewaySettings.default_max_tokens``)."""
    for cap in ("max_tokens", "max_completion_tokens"):
        if cap in fields and fields[cap] is None:
            del fields[cap]
    if "max_tokens" not in fields and "max_completion_tokens" not in fields:
        fields["max_tokens"] = default


@functools.lru_cache(maxsize=64)
def _loopback_at(url: str) -> bool:
    """Whether ``url`` (a ``Host`` made a URL, or an ``Origin``) names a loopback host;
    one that does not parse does not. Remembered for the few a gateway sees (its own
    address, as each client writes it): parsed per request, it was 2.6% of the I/O
    loop's time serving 200 requests at once."""
    try:
        host = yarl.URL(url).host
    except ValueError:
        return False
    return host is not None and is_loopback(host)


def _sse(event: Any) -> bytes:
    return b"data: " + encode(event) + b"\n\n"


def _same(value: _T) -> _T:
    return value


def _floats(result: EmbeddingResult) -> int:
    vectors = result.vectors
    return len(vectors) * len(vectors[0]) if vectors else 0


def _json(raw: bytes) -> Any:
    if json.detect_encoding(raw) not in _UTF8:  # UTF-16 or -32, which json.loads takes
        raise InvalidRequestError(  # (and there a lone surrogate went unseen: a review)
            "the body is not UTF-8, as JSON sent between systems must be (RFC 8259)"
        )
    try:
        if len(raw) < HEAVY_BODY:
            body = json.loads(raw)
        else:  # on the reader thread (``_read``), the only one that turns it off
            with _collector_off():
                body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError(f"the body is not JSON: {exc}") from None
    except RecursionError:  # [[[[... deeper than the parser goes
        raise InvalidRequestError("the body is JSON nested too deeply to read") from None
    if _may_hold_surrogate(raw) and _SURROGATE.search(raw) is not None and not _unicode(body):
        raise InvalidRequestError(
            "the body holds a lone surrogate (an escape from \\ud800 to \\udfff that is "
            "not half of a pair): that is not Unicode text"
        )
    return body


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """The cyclic collector paused while a heavy body is parsed: a parse makes no cycles,
    and its millions of new containers set off collection after collection (a 31 MB
    body of tiny objects parsed in 4.9 s with it, 1.4 s without; the parse holds the
    interpreter either way)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _values(raw: bytes) -> int:
    """About how many JSON values ``raw`` holds: its objects, arrays and commas (every
    value after a container's first follows one), counted in C."""
    return raw.count(b"{") + raw.count(b"[") + raw.count(b",")


_UTF8 = frozenset(("utf-8", "utf-8-sig"))


def _may_hold_surrogate(raw: bytes) -> bool:
    """Whether ``raw`` has anything ``_SURROGATE`` looks for: two searches by a literal
    first, as the whole expression took 0.6 s, holding the interpreter, to find nothing
    in 31 MB of plain text (a hunt), and 0.7 s in 31 MB of Korean (a review)."""
    return _ESCAPED_HALF.search(raw) is not None or _RAW_HALF.search(raw) is not None


_ESCAPED_HALF = re.compile(rb"\\u[dD][89a-fA-F]")
_RAW_HALF = re.compile(rb"\xed[\xa0-\xbf]")


_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"  # a high half, no low one after
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]"  # a low half, no high one before
    rb"|\xed[\xa0-\xbf]"  # a surrogate's own bytes (which ``json.loads`` lets through)
)
"""Where a parsed body may hold a lone surrogate; ``_unicode`` decides (an escaped
backslash before a ``u`` looks the same here). A pair (an emoji a client escaped)
matches none, so its body is not encoded again to be checked."""


def _unicode(body: Any) -> bool:
    """Whether ``body`` is Unicode text throughout: no lone surrogate in a key or a
    value (UTF-8 has no form for one, so the provider would get none)."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _header_priority(value: str) -> Priority:
    text = value.strip()
    try:  # digits: ASCII ones only, and few (int() refuses "²", and 4,300 digits or more)
        number = text.isascii() and text.isdigit() and len(text) <= 3
        return Priority.parse(int(text) if number else text)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{PRIORITY_HEADER}: {exc}") from None


_SECONDS = re.compile(r"\s*(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*", re.ASCII)
"""A number of seconds as a header writes one (``float`` also takes "١٢" and "1_0")."""


def _deadline(value: str) -> float:
    try:
        seconds = float(value) if _SECONDS.fullmatch(value) else math.nan
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequestError(f"{DEADLINE_HEADER}: must be a positive number of seconds")
    return seconds


IDEMPOTENCY_KEY_CHARS = 255
"""The longest ``Idempotency-Key`` taken (Stripe's limit too)."""


def _idempotency_key(value: str) -> str:
    if not value.strip() or len(value) > IDEMPOTENCY_KEY_CHARS:
        raise InvalidRequestError(
            f"{IDEMPOTENCY_HEADER}: must be 1 to {IDEMPOTENCY_KEY_CHARS} characters, "
            f"not blank (got {len(value)})"
        )
    return value


def _call_id(result: Result) -> str:
    return f"chatcmpl-{result.task_id}"


def _result_headers(result: Result) -> dict[str, str]:
    headers = {
        "X-Callboard-Task-Id": str(result.task_id),
        "X-Callboard-Queue-Wait": f"{result.queue_wait_s:.6f}",
        "X-Callboard-Attempts": str(result.attempts),
        "X-Callboard-Cost": usd_text(result.cost_usd),
        "X-Callboard-Priority": result.priority.name.lower(),
        "x-request-id": result.trace_id,
        "request-id": result.trace_id,
    }
    if result.model is not None:
        headers["X-Callboard-Model"] = result.model
    said = result.request_id  # the provider's, for its support (ours: x-request-id); a
    if said is not None and said.isascii() and said.isprintable():  # header it may write
        headers["X-Callboard-Provider-Request-Id"] = said
    return headers


def _json_response(
    body: Any, headers: dict[str, str] | None = None, *, status: int = 200
) -> web.Response:
    return web.Response(
        body=encode(body), status=status, headers=headers, content_type="application/json"
    )


def _error_response(error: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    """``error`` in OpenAI's shape."""
    return _json_response(error.body(), {**(headers or {}), **error.headers()}, status=error.status)
