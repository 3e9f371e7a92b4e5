"""The HTTP side of a model actor: runs on the I/O loop, never on an actor thread.

One ``ModelClient`` per model deployment owns one httpx transport (aiohttp's by
default: measured ~7x cheaper per request than httpx's own pool at 50 in flight).
The URL, the encoded headers (``Host`` included) and the timeouts are prepared
once; per call only the JSON body and its length change. With the default
transport (httpx-aiohttp's ``AiohttpTransport``, exactly that class, with no proxy
of its own: ours never has one, one passed in may) a call goes
to the transport's own aiohttp session (its pool, limits and TLS context) without
an ``httpx.Request`` and ``httpx.Response`` around it: those wrappers, and the
header and URL conversions between them and aiohttp, were a third of a call's CPU
on the I/O loop (measured on loopback at 200 in flight: 0.29-0.32 ms a call
through ``handle_async_request``, 0.19-0.21 ms on the session, raw aiohttp
0.21-0.25). A body that comes encoded goes back through httpx for its decoders.
Any other transport (``transport = "httpx"``, or one passed in) gets an
``httpx.Request`` straight to ``handle_async_request`` (no cookies, redirects,
auth flows or event hooks: 0.73x raw aiohttp at 200 in flight against 0.45x
through ``AsyncClient.send``).
Completions are delivered to the actor in batches: at the end of the loop iteration
they ended in when the window is empty, else within ``FLUSH_S`` (the freed slots
have taken waiting calls already, so the actor's answer can wait for more).

The window. The actor may hand the loop more calls than ``max_concurrency``: the
rest wait here in a heap by (rank, arrival), and the moment a call ends the best
waiting one starts, in the same loop iteration. Every call in the window was
admitted by the actor (breaker permit, limiter reservation); the loop only carries
out grants, and only while the answers are good: an answer that may change what
the actor admits (a 429, 401/403, a 5xx, a failed transport) sends every waiting
call back first, so the actor decides again knowing it. Calls sent back, revoked
(a cancel, a breaker that opened) or past their deadline before they start (a
timer watches the window's first deadline) end as ``CallResult(error="unsent")``,
settled by the actor as never sent.

Streams. A streamed call (its shape has a sink) reads server-sent events, OpenAI's
chunks or Anthropic's events, and puts each delta to its sink as it arrives. Its
total timeout stops counting at the first delta (the task's deadline does not);
its answer ends at the stream's last event (``[DONE]``, ``message_stop`` or the
``message_delta`` with the stop reason before it), not at the body's end; a whole
JSON body (a server that ignored ``stream``) is read as one delta. A failure before
the first delta is an ordinary one (retried); after it, ``cut``, with the text the
reader has. A reader who leaves cancels the call where it waits
(``StreamChannel.attach``): it ends ``abandoned``.

This is the one place httpx/aiohttp exceptions are mapped to callboard's terms
(``timeout`` / ``connection`` / ``malformed``). Secrets: a model's
(``model_secrets``) are registered with ``runtime/redact.py`` when its transport
or client is made, before anything is sent, and a URL httpx cannot read is a
``ConfigError`` showing it masked; every text a call brings back passes
``redact`` before it leaves the loop. A base URL's ``user:pass@`` goes out as a
Basic ``Authorization`` header on both transports, never in the URL.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import errno
import functools
import heapq
import itertools
import json
import math
import os
import re
import ssl
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence, Set
from pathlib import Path
from typing import Any, Final

import aiohttp
import httpx
from callboard.core.admission import Send
from callboard.core.secret import Secret, reveal, shown, url_credentials
from callboard.core.settings import ModelSettings
from callboard.messages import (
    CallResult,
    CallsDone,
    CallShape,
    ConfigError,
    DeltaSink,
    FrozenMap,
    StreamDelta,
    ToolCallDelta,
    Usage,
)
from callboard.runtime import redact
from callboard.runtime.collector import paused_collector
from callboard.runtime.eager import start_task
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.inflate import Decoder, InflateError, coding_of, decodes
from callboard.runtime.stream import Abandoned
from callboard.wire import anthropic, azure
from callboard.wire.errors import error_body
from callboard.wire.openai import ChunkAssembler, normal_completion, reasoning_of, thinks
from callboard.wire.sse import Event, EventStream, SSEError
from httpx_aiohttp import AiohttpTransport
from httpx_aiohttp.transport import AiohttpResponseStream
from multidict import CIMultiDict
from yarl import URL

log = guarded_logger(__name__)

RATE_HEADERS = (
    "retry-after",
    "retry-after-ms",
    "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
    "anthropic-ratelimit-requests-limit",
    "anthropic-ratelimit-requests-remaining",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-tokens-limit",
    "anthropic-ratelimit-tokens-remaining",
    "anthropic-ratelimit-tokens-reset",
    "anthropic-ratelimit-input-tokens-limit",
    "anthropic-ratelimit-input-tokens-remaining",
    "anthropic-ratelimit-input-tokens-reset",
    "anthropic-ratelimit-output-tokens-limit",
    "anthropic-ratelimit-output-tokens-remaining",
    "anthropic-ratelimit-output-tokens-reset",
    "x-should-retry",
)
_RATE_NAMES = frozenset(h.encode() for h in RATE_HEADERS)
REQUEST_ID_HEADERS = ("x-request-id", "request-id")
"""Where a provider names a call (OpenAI and Azure; Anthropic), for its support."""
_ID_NAMES = frozenset(h.encode() for h in REQUEST_ID_HEADERS)
_ID_LIMIT = 200
"""The most of a request id kept: a server's header, not ours to store unbounded."""
DETAIL_LIMIT = 300
_OWN_TARGETS = 64
"""How many sets of a request's own headers a model keeps prepared."""


def make_transport(settings: ModelSettings) -> httpx.AsyncBaseTransport:
    """A model's transport. Its secrets are registered first (the system is being
    built: nothing can log them before), and a base URL or a proxy that httpx cannot
    read is a ``ConfigError`` here, showing neither."""
    redact.register(model_secrets(settings))
    endpoint(settings)
    limits = httpx.Limits(
        max_connections=settings.max_concurrency,
        max_keepalive_connections=settings.max_concurrency,
    )
    if settings.transport == "httpx":  # its own TLS context: httpcore changes it (ALPN)
        proxy = None if settings.proxy is None else settings.proxy.reveal()
        try:
            return httpx.AsyncHTTPTransport(limits=limits, http2=settings.http2, proxy=proxy)
        except httpx.InvalidURL as exc:
            raise _unreadable(settings, "proxy", exc) from None
        except OSError as exc:  # the CAs: an SSLError is one
            raise _no_cas(exc) from None
    return AiohttpTransport(verify=verified_tls(), limits=limits)


def verified_tls() -> ssl.SSLContext:
    """The TLS context, verifying servers, of every aiohttp transport of the process, as
    httpx makes one (the CAs of ``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` where set, else
    certifi's), made once for the CAs these name (a CA file replaced at the same path
    is read by the next process): every transport made its own, and loading the CAs was
    90% of starting a system (54 ms a model here, of 59). Shared because nothing changes
    it once made: aiohttp only reads it, from any thread. httpx's own transports keep a
    context each: httpcore sets a context's ALPN protocols at every connection it
    makes (``h2`` too for an HTTP/2 model), which on a shared one would have aiohttp
    offer ``h2`` (a server that prefers it chooses it, and aiohttp speaks HTTP/1.1 on
    it), and would change it under another thread's handshake (a review). Made under a
    lock: systems started at once on eight threads made eight (a hunt). CAs that cannot
    be loaded are a ``ConfigError`` naming where they were looked for."""
    key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    context = _VERIFIED_TLS.get(key)
    if context is None:
        with _VERIFIED_TLS_LOCK:
            context = _VERIFIED_TLS.get(key)
            if context is None:
                cert_file, cert_dir = key
                if not cert_file and cert_dir and not Path(cert_dir).is_dir():
                    raise _no_cas(NotADirectoryError(f"no such folder: {cert_dir!r}"))
                try:  # (a missing folder is not refused there: every call then failed)
                    context = httpx.create_ssl_context(verify=True, trust_env=True)
                except OSError as exc:  # an SSLError is one
                    raise _no_cas(exc) from None
                context.set_alpn_protocols(["http/1.1"])  # as aiohttp's own contexts say
                _VERIFIED_TLS[key] = context
    return context


_VERIFIED_TLS: dict[tuple[str | None, str | None], ssl.SSLContext] = {}
"""``verified_tls``'s contexts, by the values of ``SSL_CERT_FILE`` and ``SSL_CERT_DIR``
(httpx reads them from the environment)."""
_VERIFIED_TLS_LOCK = threading.Lock()


def _no_cas(exc: OSError) -> ConfigError:
    """A ``ConfigError`` for CAs that cannot be loaded (``exc``), naming where from: a
    missing or damaged ``SSL_CERT_FILE`` raised a bare ``FileNotFoundError`` out of a
    system's start, naming neither the variable nor the file (a hunt)."""
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR"):  # httpx's order
        if os.environ.get(name):
            where = f"{name}={os.environ[name]!r}"
            break
    else:
        where = "certifi's CA bundle"
    return ConfigError(f"the CA certificates of {where} cannot be loaded to verify servers: {exc}")


def chat_url(base_url: str) -> httpx.URL:
    """The chat-completions endpoint under ``base_url``, keeping its query after the
    path."""
    url = httpx.URL(base_url)
    return url.copy_with(path=url.path.rstrip("/") + "/chat/completions")


def endpoint(settings: ModelSettings) -> tuple[httpx.URL, dict[str, str]]:
    """Where a model's calls go and the headers they carry, by its dialect (``api``):
    OpenAI's key as a Bearer token, Azure's in ``api-key`` at the deployment's URL,
    Anthropic's in ``x-api-key`` with ``anthropic-version`` at ``/messages``; or the
    base URL's credentials as a Basic one (``ModelSettings`` allows one or the other),
    taken out of the URL so no transport sends or quotes them there. The model's own
    ``headers`` go last, over these."""
    base = reveal(settings.base_url)
    key = None if settings.api_key is None else settings.api_key.reveal()
    headers = {"content-type": "application/json", "accept": "application/json"}
    try:
        if settings.api == "azure":
            version = settings.api_version or azure.API_VERSION
            url = httpx.URL(azure.chat_url(base, settings.wire_model, version))
            if key is not None:
                headers.update(azure.headers(key))
        elif settings.api == "anthropic":
            url = httpx.URL(base)
            url = url.copy_with(path=url.path.rstrip("/") + "/messages")
            headers["anthropic-version"] = settings.api_version or anthropic.ANTHROPIC_VERSION
            if key is not None:
                headers["x-api-key"] = key
        else:
            url = chat_url(base)
            if key is not None:
                headers["authorization"] = f"Bearer {key}"
    except httpx.InvalidURL as exc:
        raise _unreadable(settings, "base_url", exc) from None
    credentials = url_credentials(base)
    if credentials is not None:
        pair = ":".join(credentials).encode("utf-8")
        headers["authorization"] = f"Basic {base64.b64encode(pair).decode('ascii')}"
        url = url.copy_with(userinfo=b"")
    for name, value in settings.headers.items():
        headers[name.lower()] = reveal(value)
    return url, headers


def _prepared(url: httpx.URL, headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """The headers every call to ``url`` carries, encoded once and in the order httpx
    sends them (``Host`` first); a call adds its ``Content-Length``. Built per call by
    ``httpx.Request(content=...)`` they were half the request's client CPU: normalised
    from the dict, then looked up one by one to add the automatic ones (measured 90
    against 40 us a request on a loaded machine)."""
    probe = httpx.Request("POST", url, headers=headers, content=b"")
    raw = [(name, value) for name, value in probe.headers.raw if name.lower() != b"content-length"]
    if all(name.lower() != b"accept-encoding" for name, _ in raw):
        raw.append((b"Accept-Encoding", ACCEPT_ENCODING))
    return raw


ACCEPT_ENCODING = b"gzip, deflate"
"""The encodings a body may come in: those ``runtime.inflate`` decodes in bounded pieces
(a body in a coding a model's own headers asked for, such as ``br``, is httpx's to
decode). Said on every call: aiohttp's own default offers zstd wherever it could decode
it (Python 3.14), and a server that took the offer sent bytes httpx passed on
undecoded, every answer malformed and the breaker opened."""


def _unreadable(settings: ModelSettings, what: str, exc: Exception) -> ConfigError:
    url = settings.base_url if what == "base_url" else settings.proxy
    said = redact.hide(str(exc))
    return ConfigError(
        f"model {settings.name!r}: {what} {shown(url or '')!r} is not a URL httpx can read: {said}"
    )


def model_secrets(settings: ModelSettings) -> set[str]:
    """What ``redact`` must hide for a model: its key, and the secret parts of its proxy
    and base URLs (``user:password`` among them, whose Base64 a Basic header carries);
    see ``redact.secrets_of``."""
    urls = [u for u in (settings.base_url, settings.proxy) if u is not None]
    secret_headers = [v for v in settings.headers.values() if isinstance(v, Secret)]
    return redact.secrets_of(settings.api_key, *secret_headers, urls=urls)


def _detail(text: str) -> str:
    """An error's detail as a ``CallResult`` carries it: on one line, redacted, then
    cut. What a provider answered is written in log lines as it is: a line break in it
    (an error body echoing the prompt) began a forged line of the log, and a terminal's
    escape could rewrite what an operator sees. Only its head is read (``_DETAIL_READ``):
    a 60 MB error body, redacted whole to keep 300 characters, held the I/O loop every
    model shares for 15 s, each attempt (found by a hunt)."""
    return redact.hide_cut(_UNPRINTABLE.sub(" ", text[:_DETAIL_READ]), DETAIL_LIMIT)


_DETAIL_READ = DETAIL_LIMIT + 64 * 1024
"""How much of a text its detail reads: the detail's own length and far more than any
form of a secret that could begin inside it (so every one that does is hidden whole)."""


def error_detail(exc: BaseException) -> str:
    """An error in words (its type, what it says) as a call's detail carries it
    (``_detail``): a failed call's, and a call whose body could not be made."""
    return _detail(f"{type(exc).__name__}: {exc}")


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]+")
"""Control characters, line separators, and lone surrogates (a JSON body's ``\\ud800``
decodes to one, which no UTF-8 writer can write)."""


def _error_detail(said: str) -> str:
    """An error answer's body as a detail. A provider's JSON error object (OpenAI's
    ``{"error": {"message", "type", "param", "code"}}``, Anthropic's ``{"type": "error",
    "error": {"type", "message"}}``) is written compact, with only those fields and its
    message cut to fit, so that it stays JSON: cut as text, a pretty-printed body
    (OpenAI's own are indented) lost its ``code`` and ``param`` to the cut, and with
    them what the gateway passes on to an SDK and the quota mark ``classify`` looks
    for. Anything else is cut as text."""
    read = _error_fields(said)
    if read is None:
        return _detail(said)
    kind, error = read
    message = redact.hide(_UNPRINTABLE.sub(" ", error.pop("message")))  # on one line first:
    # a key broken by a separator was hidden as broken, then the break made a space
    body: dict[str, Any] = {"type": kind} if kind is not None else {}
    body["error"] = fields = {"message": "", **error}
    if DETAIL_LIMIT - len(_compact(body)) < 16:  # the other fields nearly fill it:
        return _detail(said)  # not worth keeping as JSON
    lo, hi = 0, min(len(message), DETAIL_LIMIT)  # the longest head that fits, escaped
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fields["message"] = message[:mid]
        if len(_compact(body)) <= DETAIL_LIMIT:
            lo = mid
        else:
            hi = mid - 1
    fields["message"] = message[:lo]
    return _compact(body)


def _error_fields(said: str) -> tuple[str | None, dict[str, Any]] | None:
    """The body's own ``type`` (Anthropic's ``"error"``) and its error object's fields
    (strings redacted), whose ``message`` is a string; None if ``said`` is not one."""
    read = error_body(said) if said.startswith("{") and len(said) <= _ERROR_BODY_READ else None
    if read is None or not isinstance(read[1].get("message"), str):
        return None
    data, error = read
    fields: dict[str, Any] = {"message": error["message"]}
    for key in ("type", "param", "code"):
        value = error.get(key, ...)
        if isinstance(value, str):
            fields[key] = redact.hide(_UNPRINTABLE.sub(" ", value))
        elif value is None or (isinstance(value, int) and not isinstance(value, bool)):
            fields[key] = value
    return ("error" if data.get("type") == "error" else None), fields


_ERROR_BODY_READ = 64 * 1024
"""The longest error body read as JSON for its fields (longer ones are cut as text)."""


def _compact(body: Any) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


FLUSH_S = 0.001
"""How long what ended may wait on the loop for more to end with it, while the window
holds calls for the freed slots (so the actor's answer is not on a call's path): each
delivery wakes the model actor, and a wake costs more CPU than the call it carries
once calls end one or two per loop iteration. A result reaches its caller that much
later at most; with the window empty it goes at the end of the loop iteration."""

UNSENT = "unsent"
"""``CallResult.error`` of a call the window never started (``detail`` says why:
``UNSENT_DEADLINE`` or ``UNSENT_REVOKED``)."""
UNSENT_DEADLINE = "deadline"
UNSENT_REVOKED = "revoked"
EXPIRY_SLACK_S = 0.002
"""A call waiting in the window whose deadline is this close has passed it (a timer
of uvloop's fires up to a millisecond early; the actor ends it ``Expired`` by its own
word, whatever its clock says)."""

_Waiting = tuple[int, int, int, int, bytes, float | None, float, CallShape | None]
"""A call in the window: rank, arrival seq, task id, attempt, body, seconds left
when it arrived, the loop's clock when it arrived, its shape."""


class ModelClient:
    """Owned by one model actor; every method but ``__init__`` runs on the I/O loop.

    What must hold: at most ``max_concurrency`` calls run at once; a waiting call
    starts in the loop iteration a running one ends in (best rank, then first come);
    every call handed over ends in exactly one ``CallResult`` (``aclose`` aside)."""

    def __init__(
        self,
        settings: ModelSettings,
        *,
        incarnation: int,
        deliver: Callable[[CallsDone], object],
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._incarnation = incarnation
        self._cap = settings.max_concurrency
        self._running = 0
        self._window: list[_Waiting] = []
        self._seq = itertools.count()
        self._deliver = deliver
        self._transport = transport or make_transport(settings)
        redact.register(model_secrets(settings))
        self._url, headers = endpoint(settings)
        self._embeddings_url = self._url.copy_with(
            path=self._url.path.removesuffix("/chat/completions") + "/embeddings"
        )
        self._anthropic = settings.api == "anthropic"
        self._name = settings.name
        self._headers = headers
        self._chat = _Target.of(self._url, headers)
        self._embeddings = _Target.of(self._embeddings_url, headers)
        self._own_targets: dict[tuple[bool, tuple[tuple[str, str], ...]], _Target] = {}
        t = settings.timeout
        self._timeout_ext = {"connect": t.connect, "read": t.read, "write": t.read, "pool": t.total}
        self._aiohttp_timeout = aiohttp.ClientTimeout(  # as httpx-aiohttp maps httpx's
            sock_connect=t.connect, sock_read=t.read, connect=t.total
        )
        self._direct = (  # the session path sends none of the transport's proxy options
            type(self._transport) is AiohttpTransport and self._transport.proxy is None
        )
        """Calls go to the default transport's aiohttp session (module docstring)."""
        self._total_s = t.total
        self._read_s = t.read
        self._buffer: list[CallResult] = []
        self._flush_now = False
        self._flush_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.on_wire: set[int] = set()
        """The tasks whose call has started and whose result has not reached the model
        actor (a stop charges each: it may be billed); a call waiting in the window has
        not started."""
        self._drains: dict[asyncio.Task[None], _Reply] = {}
        """Streams' bodies being read past their last event (``_finish_body``), oldest
        first: each holds a connection of the pool, which has ``max_concurrency``."""
        self._closed = False
        self._filling = False
        """In ``_fill``: a call ending in its first step fills nothing itself."""
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = math.inf
        """When the window's first deadline passes (``_arm_expiry``)."""

    def start(self, calls: Sequence[Send]) -> None:
        """Take a batch of admitted calls: each starts now if a slot is free, else
        waits in the window for the next one. On the loop."""
        if self._closed:
            return
        now = time.monotonic()
        window = self._window
        soonest = math.inf
        for task_id, attempt, body, left_s, rank, shape in calls:
            heapq.heappush(
                window, (rank, next(self._seq), task_id, attempt, body, left_s, now, shape)
            )
            if left_s is not None and now + left_s < soonest:
                soonest = now + left_s
        self._fill()
        if window and soonest < self._expiry_at:
            self._arm_expiry(soonest)

    def _arm_expiry(self, at: float) -> None:
        """A timer for ``at``, the first deadline among the calls waiting in the window
        (a timer is always set at or before each: the new calls' are looked at as they
        come, the rest when it fires): past it a call ends there, unsent. It was seen
        only as a slot freed, so calls behind slots held by long calls (or by streams
        nobody read) outlived their deadline by as long (2 s deadlines ended 29 s on;
        found by a hunt)."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_at = at
        delay = max(0.0, at - time.monotonic())
        self._expiry = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        """End the waiting calls whose deadline has passed (or is within ``EXPIRY_SLACK_S``:
        uvloop's timers fire up to a millisecond early, and looked at again at once, the
        timer spun until the clock caught up; a review); set the timer for the next."""
        self._expiry, self._expiry_at = None, math.inf
        now = time.monotonic() + EXPIRY_SLACK_S
        window = self._window
        kept: list[_Waiting] = []
        soonest = math.inf
        for waiting in window:
            left_s, arrived = waiting[5], waiting[6]
            if left_s is None:
                kept.append(waiting)
            elif arrived + left_s <= now:
                self._push(_unsent(waiting, UNSENT_DEADLINE))
            else:
                kept.append(waiting)
                soonest = min(soonest, arrived + left_s)
        if len(kept) < len(window):
            heapq.heapify(kept)
            window[:] = kept  # in place, as ``revoke`` does
        if soonest < math.inf:
            self._arm_expiry(soonest)

    def revoke(self, task_ids: frozenset[int] | None) -> None:
        """Take back the waiting calls of ``task_ids`` (None: all of them); each ends as
        ``unsent``/``revoked``. Calls already running are not touched. On the loop."""
        if not self._window:
            return
        kept: list[_Waiting] = []
        for waiting in self._window:
            if task_ids is None or waiting[2] in task_ids:
                self._push(_unsent(waiting, UNSENT_REVOKED))
            else:
                kept.append(waiting)
        heapq.heapify(kept)
        self._window[:] = kept  # in place: a ``_fill`` it cut short holds the same list
        self._schedule_flush()

    def _fill(self) -> None:
        """Start waiting calls, best first, while slots are free.

        A call starts eagerly (its first step runs here), and one that ends in it runs
        its tail here too, which fills again: that inner fill does nothing, and this
        loop takes the slot it freed (nested, a transport that answers without waiting
        went one level deeper a call, until a ``RecursionError`` lost the window;
        found by a review)."""
        window = self._window
        if not window or self._closed or self._filling:
            return
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        self._filling = True
        try:
            while window and self._running < self._cap:
                waiting = heapq.heappop(window)
                _, _, task_id, attempt, body, left_s, arrived, shape = waiting
                if left_s is not None:
                    left_s -= now - arrived
                    if left_s <= 0:
                        self._push(_unsent(waiting, UNSENT_DEADLINE))
                        continue
                self._running += 1
                self.on_wire.add(task_id)
                t = start_task(loop, self._call(task_id, attempt, body, left_s, shape))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
        finally:
            self._filling = False
        self._make_room()

    def _make_room(self) -> None:
        """Close the oldest drains until every running call can have a connection: a
        drain only uses a connection no call needs (a server holding each body open past
        its last event held the pool, the model's streams at ``max_concurrency`` per
        ``DRAIN_S``; found by a hunt)."""
        drains = self._drains
        while drains and self._running + len(drains) > self._cap:
            oldest = next(iter(drains))
            del drains[oldest]
            oldest.cancel()  # it closes its body, and the connection with it

    async def _call(
        self,
        task_id: int,
        attempt: int,
        body: bytes,
        left_s: float | None,
        shape: CallShape | None,
    ) -> None:
        """One call, cut at the total timeout or at the task's deadline, the sooner (a
        stream's total timeout stops counting at its first delta: ``_Cutoff``)."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        begun = loop.time()
        deadline = None if left_s is None else begun + left_s
        sink = None if shape is None else shape.stream
        if sink is not None:  # a reader who leaves ends the call where it is
            sink.model = self._name
            sink.attach(_this_task())
        heard: list[str] = []  # a stream's text so far
        cutoff: _Cutoff | None = None
        try:
            async with asyncio.timeout_at(_sooner(deadline, begun + self._total_s)) as scope:
                cutoff = _Cutoff(scope, deadline, self._read_s)
                result = await self._send(
                    task_id, attempt, body, started, shape=shape, cutoff=cutoff, heard=heard
                )
        except Abandoned:
            result = _ended(task_id, attempt, started, error="abandoned")
        except (aiohttp.ClientError, httpx.TransportError) as exc:  # aiohttp's read timeout
            kind, said = transport_error(exc)  # is a TimeoutError too: it is this one
            result = _ended(task_id, attempt, started, error=kind, detail=_detail(said))
        except asyncio.CancelledError:
            if self._closed or sink is None or not sink.abandoned:
                raise
            _this_task().uncancel()  # our own cancellation: the reader left
            result = _ended(task_id, attempt, started, error="abandoned")
        except TimeoutError:
            kind, said = self._timed_out(cutoff)
            answered = cutoff.answered if cutoff is not None and kind == "timeout" else None
            result = _ended(
                task_id, attempt, started, status_code=answered, error=kind, detail=said
            )
        except StreamEventError as exc:  # as the status it stands for, before any delta
            unsaid = exc.status is None or (sink is not None and sink.received)
            result = _ended(  # after one, a cut that keeps the status the event stood for
                task_id,
                attempt,
                started,
                status_code=exc.status,
                error="malformed" if unsaid else None,
                detail=str(exc),
            )
        except (
            SSEError,
            ValueError,
            RecursionError,
            httpx.DecodingError,
            StreamTooLargeError,
        ) as exc:
            # a bad stream (RecursionError: JSON nested past the parser's depth, which
            # was taken for the transport's failure: sent again, the breaker told)
            result = self._failed(task_id, attempt, started, "malformed", exc)
        except Exception as exc:  # noqa: BLE001 - a transport bug must still end the call
            result = self._other_failure(task_id, attempt, started, exc)
        result = self._as_heard(result, sink, heard, cutoff)
        self._running -= 1
        self._push(result)
        if _bad_news(result):
            self.revoke(None)  # the actor decides again, knowing this
        self._fill()  # the freed slot refills here, not after a trip through the actors
        self._schedule_flush()  # at once if that emptied the window

    def _as_heard(
        self,
        result: CallResult,
        sink: DeltaSink | None,
        heard: list[str],
        cutoff: _Cutoff | None,
    ) -> CallResult:
        """How a call ended, with what its stream's reader and its usage heard: a
        stream whose reader had part of it failing is cut, with that part; one without
        usage carries its prompt's count if the provider said it (``_Cutoff``)."""
        if sink is not None and sink.received and result.error not in (None, "cut", "abandoned"):
            said = result.detail or result.error or "the call failed"  # the reader has part
            result = dataclasses.replace(result, error="cut", detail=said, content="".join(heard))
        if result.usage is None and cutoff is not None and cutoff.said_usage is not None:
            prompt = _prompt_said(cutoff.said_usage())
            if prompt is not None:
                result = dataclasses.replace(result, prompt_heard=prompt)
        return result

    async def _send(
        self,
        task_id: int,
        attempt: int,
        body: bytes,
        started: float,
        *,
        shape: CallShape | None,
        cutoff: _Cutoff,
        heard: list[str],
    ) -> CallResult:
        target = self._embeddings if shape is not None and shape.embeddings else self._chat
        if shape is not None and shape.headers:
            target = self._target_with(shape.embeddings, shape.headers)
        post = self._post_direct if self._direct else self._post
        reply = await post(target, body)
        status = reply.status
        rate, request_id = _rate_headers(reply.headers)
        ended = functools.partial(
            _ended,
            task_id,
            attempt,
            started,
            status_code=status,
            headers=rate,
            heard_epoch=time.time() if rate and rate[-1][0] == "date" else None,
            request_id=request_id,
        )
        sink = None if shape is None else shape.stream
        if sink is None:  # a stream's head comes before anything is made: not billed yet
            cutoff.answered = status
        raw = await self._body(reply, status, ended=ended, shape=shape, cutoff=cutoff, heard=heard)
        if isinstance(raw, CallResult):  # read as a stream: its body's rest is being drained
            return raw
        await reply.aclose()
        if not 200 <= status < 300:
            said = raw.decode("utf-8", "replace")
            if 300 <= status < 400:  # not followed: the key would go where it points
                said = (
                    f"redirected to {_header(reply.headers, b'location')!r} (not followed) {said}"
                )
            return ended(detail=_error_detail(said))
        if len(raw) < HEAVY_ANSWER:
            result = self._parsed(raw, ended, shape)
        else:  # off the loop: it serves every other call (and a gateway's requests)
            cutoff.scope.reschedule(None)  # all here, and billed: its read is not cut (a
            # deadline landing in a parse of seconds threw the answer away; a review)
            loop = asyncio.get_running_loop()
            parse = functools.partial(self._parsed, raw, ended, shape, piecewise=True)
            result = await loop.run_in_executor(None, parse)
        if sink is not None and result.answer is not None:  # a stream answered in one body
            return await _replay(result, sink, heard)
        return result

    async def _body(
        self,
        reply: _Reply,
        status: int,
        *,
        ended: Callable[..., CallResult],
        shape: CallShape | None,
        cutoff: _Cutoff,
        heard: list[str],
    ) -> bytes | CallResult:
        """The answer's body, whole (a 2xx to a streamed call: read as its stream,
        ``_streamed``, whatever its label), or how the call ended if it could not be read."""
        sink = None if shape is None else shape.stream
        streamed = sink is not None and 200 <= status < 300
        try:
            if streamed:
                assert shape is not None
                return await self._streamed(reply, ended, shape, cutoff, heard)
            return await reply.whole()
        except (httpx.DecodingError, InflateError, AnswerTooLargeError) as exc:  # or too large
            await reply.aclose()
            said = str(exc) if isinstance(exc, AnswerTooLargeError) else f"undecodable body: {exc}"
            return ended(error="malformed", detail=_detail(said))
        except (aiohttp.ClientError, httpx.TransportError) as exc:
            await reply.aclose()
            if streamed or not 200 <= status < 300:
                raise
            return _broke_off(ended, exc)
        except BaseException:
            await reply.aclose()
            raise

    async def _streamed(
        self,
        reply: _Reply,
        ended: Callable[..., CallResult],
        shape: CallShape,
        cutoff: _Cutoff,
        heard: list[str],
    ) -> CallResult | bytes:
        """A 2xx answer to a streamed call: read as an event stream (the rest of its body
        then drained, ``_finish_body``), or, when it begins with ``{``, its whole JSON
        body, whatever either is labelled. A proxy's label misleads both ways: an event
        stream labelled ``text/event-stream`` that was JSON ended malformed, after 3
        calls, an ``insufficient_quota`` too; one labelled ``application/json`` that was
        an event stream was read to its end before its first delta, so a stream longer
        than the total timeout failed on every retry, each billed (found by hunts)."""
        parts = reply.parts()
        first = await _first_parts(parts)
        if _whole_json(first):
            try:
                return await _at_most(_chained(first, parts))
            except (aiohttp.ClientError, httpx.TransportError) as exc:  # as unstreamed: as a
                await reply.aclose()  # connection error it went free (a review)
                return _broke_off(ended, exc)
        label = _header(reply.headers, b"content-type")
        result = await self._stream(
            _chained(first, parts), ended, shape, cutoff, heard, label=label
        )
        self._finish_body(reply, parts)
        return result

    def _parsed(
        self,
        raw: bytes,
        ended: Callable[..., CallResult],
        shape: CallShape | None,
        *,
        piecewise: bool = False,
    ) -> CallResult:
        """A 2xx JSON body: embeddings, or a completion in the model's dialect;
        ``piecewise`` for a heavy one, on a worker thread (``_received``)."""
        if shape is not None and shape.embeddings:
            return _parse_embeddings(raw, ended, self._name, piecewise=piecewise)
        if self._anthropic:
            json_tool = None if shape is None else shape.json_tool
            translate = functools.partial(anthropic.completion, json_tool=json_tool)
            return _parse_completion(raw, ended, self._name, translate, piecewise=piecewise)
        return _parse_completion(raw, ended, self._name, piecewise=piecewise)

    def _target_with(self, embeddings: bool, extra: Mapping[str, str]) -> _Target:
        """The endpoint with a request's own headers over the model's (Anthropic's
        ``anthropic-beta`` lists both: betas add up), prepared once for each set seen
        (a gateway's clients send a few sets over and over)."""
        key = (embeddings, tuple(extra.items()))
        target = self._own_targets.get(key)
        if target is None:
            headers = dict(self._headers)
            for name, value in extra.items():
                mine = headers.get(name)
                said = value
                if name == "anthropic-beta" and mine:
                    betas = [b.strip() for b in f"{mine},{value}".split(",") if b.strip()]
                    said = ",".join(dict.fromkeys(betas))
                headers[name] = said
            url = self._embeddings_url if embeddings else self._url
            if len(self._own_targets) >= _OWN_TARGETS:
                self._own_targets.clear()
            target = self._own_targets[key] = _Target.of(url, headers)
        return target

    def _timed_out(self, cutoff: _Cutoff | None) -> tuple[str, str]:
        """What a call cut by its scope ran out of: the task's deadline, a stream's
        silence, or the total timeout."""
        if cutoff is not None and cutoff.at_deadline():
            return "deadline", "the task's deadline passed before the answer ended"
        if cutoff is not None and cutoff.flows:
            return "timeout", f"the stream sent nothing for {self._read_s:g} s or more"
        return "timeout", f"no answer within the total timeout ({self._total_s:g} s)"

    async def _post(self, target: _Target, body: bytes) -> _Reply:
        """``body`` to ``target`` through the transport's ``handle_async_request``."""
        request = httpx.Request(
            "POST",
            target.url,
            headers=[*target.raw, (b"Content-Length", str(len(body)).encode())],
            stream=httpx.ByteStream(body),
            extensions={"timeout": self._timeout_ext},
        )
        request.read()  # the body is in memory: the transport takes it as bytes
        return _HttpxReply(await self._transport.handle_async_request(request))

    async def _post_direct(self, target: _Target, body: bytes) -> _Reply:
        """``body`` to ``target`` on the default transport's aiohttp session, with the
        options httpx-aiohttp gives it (no redirects, the body as sent); its errors are
        aiohttp's own (``transport_error`` reads both)."""
        transport = self._transport
        assert isinstance(transport, AiohttpTransport)
        session = transport.client
        if not isinstance(session, aiohttp.ClientSession):  # made on the loop, once
            session = transport.client = transport.get_client()
        response = await session.request(
            "POST",
            target.aiohttp_url,
            headers=target.aiohttp_headers,
            data=body,
            allow_redirects=False,
            auto_decompress=False,
            compress=False,
            timeout=self._aiohttp_timeout,
        )
        coding = _coding(response.raw_headers)
        if coding is None or decodes(coding):
            return _AiohttpReply(response, coding)
        wrapped = httpx.Response(  # httpx decodes it, as on the other path
            response.status,
            headers=response.raw_headers,
            stream=AiohttpResponseStream(response),
        )
        return _HttpxReply(wrapped)

    async def _stream(
        self,
        parts: AsyncIterator[bytes],
        ended: Callable[..., CallResult],
        shape: CallShape,
        cutoff: _Cutoff,
        heard: list[str],
        *,
        label: str = "",
    ) -> CallResult:
        """Read a 2xx event stream (``label``: its ``Content-Type``): each delta to
        ``sink`` as it arrives (waiting while the reader is behind: the socket waits
        with it), the whole answer assembled at the end. The total timeout stops
        counting at the first delta (a stream runs as long as it sends; the read timeout
        still bounds each wait), or at the model's first thinking (Anthropic's
        ``thinking_delta``, a ``reasoning_content`` delta), which is progress though the
        reader may have no text yet; a task's deadline does not. The answer ends at the
        stream's last event (OpenAI's ``[DONE]``, or the usage chunk before it once
        every choice has finished; Anthropic's ``message_stop``, or the
        ``message_delta`` before it that says why the message stopped and its usage),
        as the SDKs read it, whether or not the body ends there: a server or proxy
        holding the connection open after it does not hold the call, and one that drops
        it there does not cut a whole answer (an Anthropic stream reset after its
        ``message_delta`` ended ``STREAM_CUT``, charged an estimate; found by a hunt)."""
        sink = shape.stream
        assert sink is not None  # a streamed call's shape has one
        events = EventStream()
        chunks = ChunkAssembler(choices=shape.choices)
        messages = anthropic.StreamAssembler(json_tool=shape.json_tool) if self._anthropic else None
        cutoff.said_usage = None if messages is None else messages.usage_so_far
        offer = getattr(sink, "offer", None)  # StreamChannel's: no coroutine a delta
        clock = asyncio.get_running_loop().time
        guard = redact.SpelledGuard()
        spelled = _LogprobGuard()
        first_at: float | None = None
        finished = last = evented = False
        size = 0
        async for part in parts:
            size += len(part)
            if size > MAX_STREAM_BYTES:
                raise StreamTooLargeError
            got = events.feed(part)
            if got or events.building:  # a comment alone is a keep-alive, not news
                cutoff.heard(clock())
                evented = evented or bool(got)
            for event in got:
                made = _read_event(event, messages, cutoff, clock)
                for chunk in made:
                    if chunk is None:  # [DONE]
                        finished = last = True
                        break
                    for delta in _guarded(_folded(chunks, chunk), guard, spelled):
                        if first_at is None:
                            first_at = time.monotonic()
                            cutoff.flowing(clock())
                        heard.append(delta.result_text)
                        if offer is None or not offer(delta):
                            cutoff.waiting()  # the reader is behind: not the provider's silence
                            await sink.put(delta)  # waits while the reader is behind
                            cutoff.caught_up(clock())
                last = last or (
                    (messages.done or messages.stopped) if messages is not None else chunks.ended
                )
                if last:
                    break
            if last:
                break
        finished = (  # an Anthropic body may end after the stop reason, before message_stop
            (messages.done or messages.stopped)
            if messages is not None
            else (finished or chunks.finished)
        )
        answer = messages.completion() if messages is not None else chunks.completion()
        answer = await _release(guard, spelled, answer, heard, sink if finished else None)
        if not finished:
            return _unfinished(ended, heard, received=sink.received, evented=evented, label=label)
        return _completion_of(answer, answer, ended, self._name, first_token_at=first_at)

    def _finish_body(self, reply: _Reply, parts: AsyncIterator[bytes]) -> None:
        """Read what a stream's body holds after its last event, off the call's path,
        then close it: a body read to its end gives its connection back to the pool
        for the next call. The provider ends the body right after its last event; a
        server that holds it open past ``DRAIN_S`` loses the connection instead."""
        task = asyncio.get_running_loop().create_task(_drain(reply, parts))
        self._tasks.add(task)
        self._drains[task] = reply  # the call's own slot frees as this begins: no room
        task.add_done_callback(functools.partial(self._drained, reply))  # is made here

    def _drained(self, reply: _Reply, task: asyncio.Task[None]) -> None:
        """A drain ended. One cancelled before its first step never ran its
        ``finally``: its reply is closed here (its connection leaked, and once the
        pool's were all gone every call waited; found by a review)."""
        self._tasks.discard(task)
        self._drains.pop(task, None)
        if task.cancelled() and not self._closed:
            closing = asyncio.get_running_loop().create_task(reply.aclose())
            self._tasks.add(closing)
            closing.add_done_callback(self._tasks.discard)

    def _other_failure(
        self, task_id: int, attempt: int, started: float, exc: Exception
    ) -> CallResult:
        """A call ended by what no transport error says (in its ``except``): a socket this
        process could not make, unwrapped (``local``), else a bug, logged with its
        traceback (``connection``)."""
        local = _local_cause(exc, exc)
        if local is not None:
            return _ended(task_id, attempt, started, error="local", detail=local)
        log.error(
            "model call for task %d failed unexpectedly:\n%s",
            task_id,
            redact.hide(traceback.format_exc()),
            extra={"task_id": task_id},
        )
        return self._failed(task_id, attempt, started, "connection", exc)

    def _failed(
        self, task_id: int, attempt: int, started: float, kind: str, exc: BaseException
    ) -> CallResult:
        return _ended(task_id, attempt, started, error=kind, detail=error_detail(exc))

    def _push(self, result: CallResult) -> None:
        self._buffer.append(result)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        """Deliver what ended: in this loop iteration's end when the window is empty (the
        actor's answer is then on the path of the next call), else within ``FLUSH_S``
        (the freed slots took waiting calls already; more results ride along)."""
        if not self._buffer or self._flush_now:
            return
        loop = asyncio.get_running_loop()
        if self._window:
            if self._flush_timer is None:
                self._flush_timer = loop.call_later(FLUSH_S, self._flush)
            return
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self._flush_now = True
        loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_now = False
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        batch, self._buffer = self._buffer, []
        if not batch:
            return
        done = CallsDone(incarnation=self._incarnation, results=tuple(batch))
        if self._deliver(done) is not False:  # only a refusal says False (None: taken)
            on_wire = self.on_wire  # the actor has them (or its successor will): judged
            for r in batch:  # there; refused (a stop), they stay for the stop to charge
                on_wire.discard(r.task_id)

    async def aclose(self, *, close_transport: bool = False) -> None:
        """Cancel calls still running, drop the window; close the transport only if asked
        (it may be shared)."""
        self._closed = True
        self._window.clear()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if close_transport:
            await self._transport.aclose()


@dataclasses.dataclass(slots=True)
class _Cutoff:
    """When a call is cut: ``scope`` ends it at its total timeout or its task's
    ``deadline`` (the loop's time), the sooner. Once a stream flows the total timeout
    no longer counts (a stream runs as long as it sends): it is cut at its deadline,
    or once it has sent nothing for between ``silence_s`` (the read timeout) and
    twice that. The transport's read timeout should end such a stream first, but
    one does not: aiohttp's parser, given a malformed chunk size in the middle of a
    body, drops what follows and never times out (3.14.5), which held a stream
    without a deadline, and its slot, for good. The reader's own waits (it is
    behind: ``waiting``) are not the provider's silence."""

    scope: asyncio.Timeout
    deadline: float | None
    silence_s: float
    flows: bool = False
    """The first delta has come."""
    answered: int | None = None
    """The status of the answer whose body is being read, not a stream's: a call cut
    then was answered (a 2xx: billed, so charged). A stream's head comes before its
    first token is made: one cut before it is not (a review)."""
    said_usage: Callable[[], Mapping[str, Any] | None] | None = None
    """What a stream's usage is as it has said it so far (an Anthropic stream's input
    comes in its ``message_start``): a call cut after that is charged its prompt as
    the provider counted it, not callboard's estimate (``CallResult.prompt_heard``)."""

    def flowing(self, now: float) -> None:
        """The first delta arrived (at the loop's ``now``): from here, silence cuts."""
        self.flows = True
        self._watch(now)

    def heard(self, now: float) -> None:
        """A flowing stream sent something (before the first delta: nothing to do): its
        silence starts again. The scope moves only once its end is nearer than
        ``silence_s``: one move a read timeout at most, not one a delta."""
        if not self.flows:
            return
        when = self.scope.when()
        if when is None or (when - now < self.silence_s and when != self.deadline):
            self._watch(now)

    def waiting(self) -> None:
        """The call waits for its reader: only the deadline counts meanwhile."""
        self.scope.reschedule(self.deadline)

    def caught_up(self, now: float) -> None:
        """The reader took what waited: the provider's silence counts again from now."""
        self._watch(now)

    def _watch(self, now: float) -> None:
        self.scope.reschedule(_sooner(self.deadline, now + 2 * self.silence_s))

    def at_deadline(self) -> bool:
        """Whether ``scope`` ends at the task's deadline (so its expiry is the deadline's,
        not the total timeout's). Read from the scope, not the clock: uvloop's clock
        and timers run in milliseconds, so its time at expiry may read just before."""
        return self.deadline is not None and self.scope.when() == self.deadline


DRAIN_S = 0.25
"""How long a stream's body may go on after its last event before its connection is
closed rather than kept. The provider's own end comes at once, but the I/O loop's
timers run before its reads in an iteration: after a stall of the loop the end, though
arrived, is read after the timer (at 50 ms, 44 of 600 streams lost their connection
at 200 streams on a loaded machine)."""


async def _drain(reply: _Reply, parts: AsyncIterator[bytes]) -> None:
    """Read ``parts`` to their end within ``DRAIN_S``, then close ``reply``."""
    try:
        async with asyncio.timeout(DRAIN_S):
            async for _ in parts:
                pass
    except (TimeoutError, httpx.HTTPError, aiohttp.ClientError, InflateError) as exc:  # closed
        log.debug("a stream's body did not end after its last event: %r", exc)
    finally:
        await reply.aclose()


Headers = Sequence[tuple[bytes, bytes]]
"""A response's headers as received: raw (name, value) pairs."""


class _Reply:
    """A response as a call reads it, from either path."""

    __slots__ = ("headers", "status")

    def __init__(self, status: int, headers: Headers) -> None:
        self.status = status
        self.headers = headers

    def parts(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""
        raise NotImplementedError

    async def whole(self) -> bytes:
        """The whole body."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Done with it: a body read to its end gives its connection back to the pool;
        one cut short closes it."""
        raise NotImplementedError


MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""The largest answer body read (decoded) that is not a stream: a chat completion is
kilobytes, 2,048 embeddings of 3,072 dimensions in base64 about 33 MB. A server that
sent on and on (announced 4 GB) held 2.6 GB for one call until its timeout; past this
the call ends ``malformed``."""


STREAM_PART = 16 * 1024
"""The most bytes of a body read from its connection at once (``_AiohttpReply.parts``;
a body in a coding is then inflated a ``runtime.inflate.PIECE`` at most at a time).
A stream's events are parsed a part at a time, and a part's wait while its reader is
behind: whole reads of what aiohttp had buffered (half a megabyte from a provider
sending fast) made thousands of parsed events wait beside the 256 deltas the channel
holds: 4.4 MB of the gateway's memory for each stream whose client read nothing
(found by a hunt); Python's own allocations for five such streams 11.2 MB, 4.7 MB in
16 KB parts (most of the rest aiohttp's buffer). Small reads cost a stream of tokens
nothing: its events come a few hundred bytes at a time."""

MAX_STREAM_BYTES = 4 * MAX_ANSWER_BYTES
"""The most bytes a stream is read for (its events say more than its answer: a delta's
few characters come in a JSON chunk of a hundred or more bytes). A server streaming
deltas for ever, past ``max_tokens``, held 800 MB in 12 s, and no timeout ends a stream
that keeps sending; past this the call ends ``malformed`` (``cut`` once its reader
has some)."""


class StreamTooLargeError(Exception):
    """A stream past ``MAX_STREAM_BYTES``."""

    def __init__(self) -> None:
        super().__init__(f"the stream is larger than {MAX_STREAM_BYTES // 2**20} MB")


class AnswerTooLargeError(Exception):
    """An answer body past ``MAX_ANSWER_BYTES``."""

    def __init__(self, size: int | None = None) -> None:
        said = "" if size is None else f" ({size} bytes announced)"
        super().__init__(f"the answer is larger than {MAX_ANSWER_BYTES // 2**20} MB{said}")


async def _at_most(parts: AsyncIterator[bytes]) -> bytes:
    """``parts`` joined, or ``AnswerTooLargeError`` once they pass ``MAX_ANSWER_BYTES``."""
    got: list[bytes] = []
    size = 0
    async for part in parts:
        size += len(part)
        if size > MAX_ANSWER_BYTES:
            raise AnswerTooLargeError
        got.append(part)
    return got[0] if len(got) == 1 else b"".join(got)


class _AiohttpReply(_Reply):
    """An aiohttp response whose body comes as sent, or in a coding ``runtime.inflate``
    decodes."""

    __slots__ = ("_coding", "_response")

    def __init__(self, response: aiohttp.ClientResponse, coding: str | None = None) -> None:
        super().__init__(response.status, response.raw_headers)
        self._response = response
        self._coding = coding

    def parts(self) -> AsyncIterator[bytes]:
        read = self._response.content.iter_chunked(STREAM_PART)  # each as soon as any came
        if self._coding is not None:
            return _inflating(read, self._coding)
        return read

    async def whole(self) -> bytes:
        response = self._response
        if self._coding is not None:
            return await _at_most(self.parts())
        declared = response.content_length
        if declared is not None and declared <= MAX_ANSWER_BYTES:
            return await response.read()  # the common case: read whole, at once
        if declared is not None:
            raise AnswerTooLargeError(declared)
        return await _at_most(response.content.iter_any())

    async def aclose(self) -> None:
        self._response.release()


class _HttpxReply(_Reply):
    """An ``httpx.Response``, read straight from its transport's stream when the body is
    not encoded (``aiter_bytes`` adds two generators and a decoder per read; ``aread``
    goes through ``aiter_bytes``, ``aiter_raw``, a decoder and a chunker for the one or
    two parts a completion comes in: 7% of the I/O loop's CPU at 200 calls in flight,
    measured with py-spy, against 3% for the transport's own reads), else decoded."""

    __slots__ = ("_coding", "_plain", "_response")

    def __init__(self, response: httpx.Response) -> None:
        raw = response.headers.raw
        super().__init__(response.status_code, raw)
        self._response = response
        stream = response.stream
        self._plain: httpx.AsyncByteStream | None = None
        self._coding = _coding(raw)
        if isinstance(stream, httpx.AsyncByteStream) and (
            self._coding is None or decodes(self._coding)
        ):
            self._plain = stream  # as sent: decoded here, if at all

    def parts(self) -> AsyncIterator[bytes]:
        if self._plain is None:
            return self._response.aiter_bytes()  # a coding the model's headers asked for
        if self._coding is not None:
            return _inflating(aiter(self._plain), self._coding)
        return aiter(self._plain)

    async def whole(self) -> bytes:
        return await _at_most(self.parts())  # decoded: a bomb stops too

    async def aclose(self) -> None:
        await self._response.aclose()


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """An endpoint as each path sends to it, prepared once."""

    url: httpx.URL
    raw: list[tuple[bytes, bytes]]
    """The headers, encoded, as ``_prepared`` gives them."""
    aiohttp_url: URL
    aiohttp_headers: CIMultiDict[str]

    @classmethod
    def of(cls, url: httpx.URL, headers: dict[str, str]) -> _Target:
        raw = _prepared(url, headers)
        decoded = CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in raw)
        return cls(url, raw, URL(str(url), encoded=True), decoded)


def _header(headers: Headers, name: bytes) -> str:
    """The first ``name`` header's value ("" for none)."""
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _coding(headers: Headers) -> str | None:
    """The coding a body comes in (``coding_of`` its ``Content-Encoding``), None for a
    body as sent: one pass over the raw list."""
    for name, value in headers:
        if name.lower() == b"content-encoding":
            return coding_of(value.decode("latin-1"))
    return None


async def _inflating(parts: AsyncIterator[bytes], coding: str) -> AsyncIterator[bytes]:
    """``parts`` decoded, in pieces of at most ``inflate.PIECE`` bytes, the loop free to
    run other calls between the pieces of one part: a small compressed read may inflate
    a thousandfold, and the reader's bound (``MAX_STREAM_BYTES``, ``MAX_ANSWER_BYTES``)
    stops the decoding where it stops reading."""
    inflater = Decoder(coding)
    async for part in parts:
        for n, piece in enumerate(inflater.feed(part)):
            if n:
                await asyncio.sleep(0)
            yield piece
    inflater.end()


def _sooner(a: float | None, b: float) -> float:
    return b if a is None else min(a, b)


def _this_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    assert task is not None  # a call runs in its own task
    return task


def transport_error(exc: httpx.TransportError | aiohttp.ClientError) -> tuple[str, str]:
    """A failed transport in callboard's terms (``timeout``, ``connection``, or ``local``
    for a connection this process could not open) and what
    it says, judged by the root cause: aiohttp's own error (raised as is on the direct
    path; httpx-aiohttp wraps it, mapping a refused connection to ``ConnectTimeout``,
    so the aiohttp exception underneath decides the kind), and the detail says
    ``connection refused`` where the socket did."""
    cause = exc if isinstance(exc, aiohttp.ClientError) else exc.__cause__
    root: BaseException = cause if isinstance(cause, Exception) else exc
    local = _local_cause(exc, root)
    if local is not None:
        return "local", local
    if isinstance(cause, aiohttp.ClientError):
        kind = "timeout" if isinstance(cause, aiohttp.ServerTimeoutError) else "connection"
    elif isinstance(cause, TimeoutError) or isinstance(exc, httpx.TimeoutException):
        kind = "timeout"
    else:
        kind = "connection"
    link: BaseException | None = exc
    for _ in range(8):  # the chain down to the socket's own error, however it was wrapped
        if link is None:
            break
        if getattr(link, "errno", None) == errno.ECONNREFUSED:
            return kind, f"connection refused: {root}"
        link = link.__cause__ or link.__context__
    said = str(root) or _UNSAID.get(type(root).__name__, "no more said")
    return kind, f"{type(root).__name__}: {said}"


_UNSAID: Final = {
    "ConnectTimeout": "no connection within the connect timeout",
    "ReadTimeout": "no answer within the read timeout",
    "WriteTimeout": "the request was not sent within the write timeout",
    "PoolTimeout": "no connection of the pool came free within the pool timeout",
    "TimeoutError": "no answer within the timeout",
}
"""What an error that says nothing (httpx's ``ConnectTimeout('')``: a failed call's
detail was ``ConnectTimeout: ``; a hunt) is said as."""


_LOCAL_ERRNOS: Final = {
    errno.EMFILE: "out of file descriptors: raise its open-file limit, ulimit -n",
    errno.ENFILE: "the system is out of file descriptors",
    errno.ENOBUFS: "out of socket buffers",
}
"""The socket errors that are this process's, not the provider's (``ErrorKind.LOCAL``)."""


def _local_cause(exc: BaseException, shown: BaseException) -> str | None:
    """What ``exc`` says, naming ``shown``, if it is a connection this process could not
    open: an errno of ``_LOCAL_ERRNOS`` down its chain, however wrapped, or on every
    error of a group in it (each address's attempt: anyio's, under httpx's own
    transport); None for another failure."""
    link: BaseException | None = exc
    for _ in range(8):  # the chain down to the socket's own error
        if link is None:
            return None
        numbers: list[Any] = [
            getattr(e, "errno", None) for e in getattr(link, "exceptions", (link,))
        ]
        if numbers and all(n in _LOCAL_ERRNOS for n in numbers):
            why = _LOCAL_ERRNOS[numbers[0]]
            return f"this process could not open a connection ({why}): {shown}"
        link = link.__cause__ or link.__context__
    return None


def _parse_completion(
    raw: bytes,
    ended: Callable[..., CallResult],
    model: str,
    translate: Callable[[Any], Any] | None = None,
    *,
    piecewise: bool = False,
) -> CallResult:
    """A 2xx body as a completion (``ended`` makes the call's result; ``translate``
    turns a dialect's answer into a ``chat.completion``); redacted first (a server may
    echo the request), and a translated answer again: joining Anthropic's text blocks
    may spell a secret that no one block held."""
    try:
        received = _received(raw, piecewise=piecewise)
        refused = _refused(received, ended)
        if refused is not None:
            return refused
        data = (
            normal_completion(received)
            if translate is None
            else redact.hide_json(translate(received))
        )
    except _UNREADABLE as exc:
        return ended(error="malformed", detail=_unreadable_answer(exc))
    return _completion_of(data, received, ended, model)


_UNREADABLE = (ValueError, RecursionError, KeyError, IndexError, TypeError, AttributeError)
"""What reading an answer's JSON raises when it is not what its API documents: bad JSON,
JSON nested past the parser's depth (a ``RecursionError``, which was taken for the
transport's failure: sent again, logged as a crash; found by a hunt), the wrong shape."""


def _unreadable_answer(exc: Exception) -> str:
    """What was wrong with a 2xx body (its type and message: ``usage.prompt_tokens``
    out of range, the JSON error's place), as a detail."""
    return _detail(f"unreadable completion: {type(exc).__name__}: {exc}")


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_JSON = json.JSONDecoder(parse_constant=_not_json)
"""A provider's JSON as RFC 8259 has it: ``NaN`` and ``Infinity`` (which ``json.loads``
takes) refused, so no answer carries a number no other JSON reader takes."""


def _received(raw: bytes, *, piecewise: bool = False) -> Any:
    """A 2xx body's JSON, redacted first (a server may echo the request); a leading byte
    order mark is not text (``json.loads`` of the bytes, and so the SDKs, skip it). An
    answer that said a secret loses its logprobs: token by token, they spell it; and so
    does one whose logprobs alone spell one. ``piecewise``: parsed a piece at a time
    (``_piecewise``), on a worker thread."""
    text = raw.decode("utf-8-sig")
    hidden = redact.hide(text)
    if piecewise and len(raw) >= PAUSE_COLLECTOR_AT:
        with paused_collector():
            received = _piecewise(hidden)
    elif piecewise:
        received = _piecewise(hidden)
    else:
        received = _JSON.decode(hidden)
    if hidden is not text and hidden != text:
        _without_logprobs(received)
    elif redact.active():  # none registered: nothing to spell
        _without_logprobs(received, spelling=True)
    return received


HEAVY_ANSWER = 2 * 1024 * 1024
"""An answer body of at least this many bytes is read (decoded, redacted, parsed, its
logprobs looked through) on a worker thread, its JSON a piece at a time: on the I/O
loop, which a gateway's requests share, a 150-byte request for 128 choices with 20
logprobs a token (a 57 MB answer) held every other call and request for 4-5 s (found
by a hunt). Below it an answer is read where it arrives, in C, in a few milliseconds
at most: at 256 KiB, the bench's batches of 256 embeddings (350 KB each) went to the
worker and were read in pieces, and embeddings fell from 0.96x raw aiohttp's rate to
0.87x (38.6 ms of CPU a thousand texts against 33.9)."""

PAUSE_COLLECTOR_AT = 8 * 1024 * 1024
"""An answer of at least this many bytes is parsed with the cyclic collector paused
(``paused_collector``): 57 MB took 4.2 s with it, 1.6 s without. Below it the
collector runs: paused for every heavy answer, three overlapping 300 KB ones kept it
off nearly all the time, with a million objects waiting for it (a review)."""

_SHALLOW = 5
"""How deep ``_piecewise`` reads a heavy answer's containers itself; below that each
value is one short call into C: one of a choice's logprobs (a token and its
alternatives), an embedding's vector."""

_OBJECT: Callable[..., tuple[Any, int]] = json.decoder.JSONObject  # type: ignore[attr-defined]
_ARRAY: Callable[..., tuple[Any, int]] = json.decoder.JSONArray  # type: ignore[attr-defined]
_SPACE = re.compile(r"[ \t\n\r]*")
_LEAF: Callable[[str, int], tuple[Any, int]] = _JSON.scan_once  # type: ignore[attr-defined]
"""The C reader of one JSON value at a place in a text (``_JSON``'s)."""


def _skip(text: str, idx: int) -> int:
    """Where the next thing that is not JSON whitespace is in ``text`` from ``idx``."""
    found = _SPACE.match(text, idx)
    return idx if found is None else found.end()


def _piecewise(text: str) -> Any:
    """``_JSON.decode(text)``, the same value and the same errors, but with the
    containers down to ``_SHALLOW`` read in Python (the json module's own readers)
    and only what lies below each read whole in C: the C parser keeps the
    interpreter's lock for as long as it reads, so 57 MB read in one call held every
    other thread for seconds; a piece at a time, they run between the pieces. An
    array of plain values (a vector) is one piece whatever its depth."""
    leaf = _LEAF
    strict = _JSON.strict
    memo: dict[str, str] = {}

    def at(depth: int) -> Callable[[str, int], tuple[Any, int]]:
        if depth >= _SHALLOW:
            return leaf
        deeper: list[Callable[[str, int], tuple[Any, int]]] = []

        def scan(s: str, idx: int) -> tuple[Any, int]:
            first = s[idx : idx + 1]
            if first not in ("{", "["):
                return leaf(s, idx)
            if first == "[":
                after = _skip(s, idx + 1)
                if s[after : after + 1] not in ("{", "["):  # plain values (or none): one piece
                    return leaf(s, idx)
            if not deeper:
                deeper.append(at(depth + 1))
            if first == "{":
                return _OBJECT((s, idx + 1), strict, deeper[0], None, None, memo)
            return _ARRAY((s, idx + 1), deeper[0])

        return scan

    begin = _skip(text, 0)
    try:
        value, end = at(0)(text, begin)
    except StopIteration as exc:
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None
    end = _skip(text, end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _without_logprobs(answer: Any, *, spelling: bool = False) -> None:
    """``answer``'s choices without their logprobs (in place); ``spelling``: only those
    whose tokens spell a secret (``_logprob_texts``)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict) or not choice.get("logprobs"):
            continue
        if not spelling or any(
            redact.hide(text) != text for _, text in _logprob_texts(choice["logprobs"])
        ):
            choice["logprobs"] = None


def _logprob_texts(logprobs: Any) -> list[tuple[tuple[str, int, str], str]]:
    """What a choice's logprobs spell, token by token, as texts a secret can be found in:
    for its content and its refusal, the chosen tokens joined, and each rank of the
    alternatives joined, each as text and as its ``bytes`` (by (part, rank, form)).
    Each token was hidden where it stood, but a provider that echoed a key a
    character a token spelled it in none of them (found by a hunt)."""
    if not isinstance(logprobs, dict):
        return []
    texts: dict[tuple[str, int], list[str]] = {}
    utf8: dict[tuple[str, int], bytearray] = {}
    for part in ("content", "refusal"):
        entries = logprobs.get(part)
        for entry in entries if isinstance(entries, list) else ():
            if not isinstance(entry, dict):
                continue
            alternatives = entry.get("top_logprobs")
            ranked = [entry, *(alternatives if isinstance(alternatives, list) else ())]
            for rank, token in enumerate(ranked):
                if not isinstance(token, dict):
                    continue
                text, raw = token.get("token"), token.get("bytes")
                texts.setdefault((part, rank), []).append(text if isinstance(text, str) else "")
                if isinstance(raw, list) and all(type(b) is int and 0 <= b < 256 for b in raw):
                    utf8.setdefault((part, rank), bytearray()).extend(raw)
    return [((*at, "token"), "".join(t)) for at, t in texts.items()] + [
        ((*at, "bytes"), b.decode("utf-8", "replace")) for at, b in utf8.items()
    ]


def _refused(received: Any, ended: Callable[..., CallResult]) -> CallResult | None:
    """The call's result when a 2xx body is the provider's error object (some proxies
    answer so), else None: the status the object stands for (a 429's a rate limit, as
    the same object in a stream is), or none when it names none (malformed: nothing was
    served; a 2xx that was is charged even when unreadable)."""
    status = _error_status(received)
    if status == _NOT_AN_ERROR:
        return None
    said = _answered(received)
    if status is not None:  # judged as the status it stands for, as in a stream: a 429's
        return ended(status_code=status, detail=said)  # a rate limit, not an outage
    return ended(error="malformed", status_code=None, detail=said)


def _completion_of(
    data: Any, received: Any, ended: Callable[..., CallResult], model: str, **more: Any
) -> CallResult:
    """The call's result for the ``chat.completion`` ``data`` (the provider sent
    ``received``)."""
    try:
        choice = data["choices"][0]
        content = _text(choice["message"].get("content"))
        finish_reason = choice.get("finish_reason")
        usage = _read_usage(data.get("usage"), model)
    except _UNREADABLE as exc:
        return ended(error="malformed", detail=_unreadable_answer(exc))
    return ended(
        content=content,
        finish_reason=finish_reason,
        usage=usage,
        answer=data,
        raw=received,
        **more,
    )


def _parse_embeddings(
    raw: bytes, ended: Callable[..., CallResult], model: str, *, piecewise: bool = False
) -> CallResult:
    """A 2xx embeddings body: a ``list`` of ``embedding`` objects, one per input, and
    the usage (prompt tokens only)."""
    try:
        received = _received(raw, piecewise=piecewise)
        refused = _refused(received, ended)
        if refused is not None:
            return refused
        vectors = [item["embedding"] for item in received["data"]]  # each has one
        if not all(isinstance(v, list | str) for v in vectors):  # str: base64
            return ended(error="malformed", detail="unreadable embeddings: not vectors")
        u = received.get("usage")
        usage = None
        if isinstance(u, dict) and u.get("prompt_tokens") is not None:
            usage = _read_usage({**u, "completion_tokens": 0}, model)  # no output
    except _UNREADABLE as exc:
        return ended(error="malformed", detail=f"unreadable embeddings: {type(exc).__name__}")
    return ended(usage=usage, raw=received)


def _chunks_of(
    event: Event, messages: anthropic.StreamAssembler | None
) -> list[dict[str, Any] | None]:
    """The ``chat.completion.chunk`` objects one event makes (None: the stream's end,
    OpenAI's ``[DONE]``); redacted first. A provider's error event raises
    ``StreamEventError`` (the call ends there)."""
    data = event.data
    if messages is None and data.startswith("[DONE]"):  # as the openai SDK reads it
        return [None]
    parsed: Any = _JSON.decode(redact.hide(data))
    if messages is not None:
        try:
            return list(messages.feed(parsed))
        except anthropic.StreamError as exc:  # its event's error object, as a 200's reads
            said = _answered({"type": "error", "error": {"type": exc.kind, "message": exc.message}})
            raise StreamEventError(said, _STATUS_OF.get(exc.kind)) from None
    status = _error_status(parsed, event=True)
    if status != _NOT_AN_ERROR:
        raise StreamEventError(_answered(parsed), status)
    return [parsed]


class StreamEventError(Exception):
    """A stream's provider sent an error event mid-stream; ``status`` is the HTTP status
    the same error has unstreamed (None: unknown), which judges it before any delta (an
    ``overloaded_error`` event is the 529 Anthropic's docs say it stands for)."""

    def __init__(self, detail: str, status: int | None) -> None:
        super().__init__(detail)
        self.status = status


_STATUS_OF: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "conflict_error": 409,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
"""Anthropic's error types and their statuses (its API reference, "Errors")."""


def _status_of(said: str) -> int | None:
    """The status an OpenAI-style error object's ``type`` and ``code`` stand for."""
    if "invalid_request" in said or "content_filter" in said:  # Azure's filter: a 400
        return 400
    if "insufficient_quota" in said or "rate_limit" in said:
        return 429  # the detail tells a spent quota apart (core/outcome.py)
    if "server_error" in said or "overloaded" in said:
        return 500
    return None


_WRONG_SHAPE = (KeyError, IndexError, TypeError, AttributeError)
"""What reading a stream's event raises when its JSON is not of the shape its API
documents (a string or a list where an object belongs, a number for a text): the
malformed event it is, not a transport's failure."""


def _wrong_shape(exc: Exception) -> MalformedEventError:
    return MalformedEventError(f"a stream event of the wrong shape ({type(exc).__name__}: {exc})")


def _read_event(
    event: Event,
    messages: anthropic.StreamAssembler | None,
    cutoff: _Cutoff,
    clock: Callable[[], float],
) -> list[dict[str, Any] | None]:
    """``_chunks_of`` the event, its thinking noted (``_note_thinking``); an event of
    the wrong shape raises ``MalformedEventError``."""
    try:
        made = _chunks_of(event, messages)
        _note_thinking(cutoff, made, messages, clock)
    except _WRONG_SHAPE as exc:
        raise _wrong_shape(exc) from None
    return made


def _folded(chunks: ChunkAssembler, chunk: dict[str, Any]) -> list[StreamDelta]:
    """``chunk`` folded into the answer being assembled; the deltas it carries (a
    chunk of the wrong shape raises ``MalformedEventError``)."""
    try:
        chunks.feed(chunk)
        return _deltas_of(chunk)
    except _WRONG_SHAPE as exc:
        raise _wrong_shape(exc) from None


class MalformedEventError(ValueError):
    """A stream's event is JSON, but not of the shape its API documents."""


def _deltas_of(chunk: dict[str, Any]) -> list[StreamDelta]:
    """The deltas a chunk carries for the reader (a chunk with nothing to read, such
    as the role's or the usage's, makes none; a choice's finish makes one)."""
    found = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or _NO_DELTA
        wanted = delta.get("tool_calls")
        calls = tuple(_call_delta(c) for c in wanted) if wanted else ()
        text = delta.get("content") or ""
        refusal = delta.get("refusal") or ""
        reasoning = reasoning_of(delta) or ""
        finish = choice.get("finish_reason")
        if not isinstance(text, str) or not isinstance(refusal, str):
            raise TypeError("a delta's content and refusal are text")
        if not isinstance(reasoning, str):
            raise TypeError("a delta's reasoning is text")
        signed = delta.get("thinking_blocks")
        blocks = _thinking_blocks(signed) if signed else ()
        if text or calls or refusal or reasoning or finish or blocks:
            found.append(
                StreamDelta(
                    text=text,
                    tool_calls=calls,
                    refusal=refusal,
                    reasoning=reasoning,
                    finish_reason=finish,
                    choice=int(choice.get("index", 0)),
                    logprobs=choice.get("logprobs"),
                    thinking_blocks=blocks,
                )
            )
    return found


def _thinking_blocks(blocks: object) -> tuple[FrozenMap, ...]:
    """A delta's finished thinking blocks (a Claude model's, signed), whole, with any
    secret they spell hidden (their text reached the reader as reasoning, through the
    guard; a block is a few a stream, so it is hidden whole here)."""
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        raise TypeError("a delta's thinking blocks are objects")
    return tuple(FrozenMap(redact.hide_json(b)) for b in blocks)


_NO_DELTA: dict[str, Any] = {}


def _guarded(
    deltas: list[StreamDelta], guard: redact.SpelledGuard, spelled: _LogprobGuard
) -> list[StreamDelta]:
    """``deltas`` as the reader may have them: a secret the stream spells across them
    hidden (``redact.SpelledGuard``), what may begin one held back until the next
    delta of the same text says (or the choice moves on to another of its texts, or
    finishes: then it goes, first); a delta left with nothing is dropped; logprobs
    that spell (or may begin) one dropped (``spelled``)."""
    if not guard:
        return deltas
    kept = _guarded_texts(deltas, guard, spelled)
    return [
        spelled.kept(d)
        if d.logprobs is not None or (d.finish_reason and spelled.waits(d.choice))
        else d
        for d in kept
    ]


class _LogprobGuard:
    """A stream's logprobs as a reader may have them. The texts a delta's tokens add to,
    across the stream (``_logprob_texts``), go through a ``SpelledGuard``: while one
    holds back what may begin a secret, the delta's logprobs wait, and go with the
    choice's next delta that holds nothing back (the tokens of both, in order); if one
    spells a secret, they are dropped, those waiting too. A provider that spelled a key
    a character a token, its text plain, had the tokens spell it to the reader (found
    by a hunt)."""

    __slots__ = ("_guard", "_waiting")

    def __init__(self) -> None:
        self._guard = redact.SpelledGuard()
        self._waiting: dict[int, list[Mapping[str, Any]]] = {}
        """Each choice's logprobs held back, in order."""

    @property
    def hid(self) -> bool:
        """A secret was spelled: the answer's logprobs go too."""
        return self._guard.hid

    def kept(self, delta: StreamDelta) -> StreamDelta:
        guard, choice = self._guard, delta.choice
        hid, held = guard.hid, False
        for where, text in _logprob_texts(delta.logprobs):
            guard.through((choice, where), text, raw=True)
            held = held or guard.holds((choice, where))
        waiting = self._waiting.pop(choice, [])
        if guard.hid and not hid:  # spelled here: none of it goes
            return dataclasses.replace(delta, logprobs=None)
        if delta.logprobs is not None:
            waiting.append(delta.logprobs)
        if held and not delta.finish_reason:
            self._waiting[choice] = waiting
            return dataclasses.replace(delta, logprobs=None)
        if len(waiting) == 1 and waiting[0] is delta.logprobs:
            return delta
        return dataclasses.replace(delta, logprobs=_joined(waiting) if waiting else None)

    def waits(self, choice: int) -> bool:
        """Whether logprobs of ``choice`` wait for its next delta."""
        return choice in self._waiting

    def defer(self, choice: int, logprobs: Mapping[str, Any] | None, *, hidden: bool) -> None:
        """The logprobs of a delta of ``choice`` whose texts were held back (or, if
        ``hidden``, hid a secret: then they are dropped, with those waiting) go with
        its next delta."""
        if hidden:
            self._waiting.pop(choice, None)
        elif logprobs is not None:
            out = self.kept(StreamDelta(choice=choice, logprobs=logprobs))  # read them
            if out.logprobs is not None:
                self._waiting[choice] = [out.logprobs]  # with those that waited


def _joined(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Several deltas' logprobs as one: each list's entries in order."""
    joined: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            if isinstance(value, list):
                joined[name] = [*(joined.get(name) or ()), *value]
            else:
                joined.setdefault(name, value)
    return joined


def _guarded_texts(
    deltas: list[StreamDelta], guard: redact.SpelledGuard, spelled: _LogprobGuard
) -> list[StreamDelta]:
    """``_guarded``'s texts: content, refusal and tool calls. A delta whose texts were
    changed loses its logprobs: to the choice's next delta if only held back (a
    backslash, a key's public head: they went, a review found), for good if a secret
    was hidden (token by token, they spell it)."""
    kept = []
    for delta in deltas:
        c = delta.choice
        hid = guard.hid
        if (
            not (delta.tool_calls or delta.refusal or delta.reasoning or delta.finish_reason)
            and not guard.held()
        ):
            text = guard.through((c, "text"), delta.text)  # nearly every delta: text alone
            if text == delta.text:
                kept.append(delta)
                continue
            spelled.defer(c, delta.logprobs, hidden=guard.hid and not hid)
            if text:
                kept.append(dataclasses.replace(delta, text=text, logprobs=None))
            continue
        texts: set[tuple[int, Any]] = {(c, t.index) for t in delta.tool_calls if t.arguments}
        texts |= {(c, (f, t.index)) for t in delta.tool_calls if t.name for f in ("id", "name")}
        texts |= {(c, "text")} if delta.text else set()
        texts |= {(c, "refusal")} if delta.refusal else set()
        texts |= {(c, "reasoning")} if delta.reasoning else set()
        kept += _held_back(guard, c, but=texts)  # in the order the provider sent them
        text = guard.through((c, "text"), delta.text)
        refusal = guard.through((c, "refusal"), delta.refusal)
        reasoning = guard.through((c, "reasoning"), delta.reasoning)
        calls = [_guarded_call(guard, c, t) for t in delta.tool_calls]
        if delta.finish_reason:  # the choice ends: what it held back is no secret
            (rest,) = _held_back(guard, c) or (_NOTHING,)
            text, refusal = text + rest.text, refusal + rest.refusal
            reasoning += rest.reasoning
            calls += rest.tool_calls
        calls = [t for t in calls if t.arguments or t.id or t.name]
        if (
            text == delta.text
            and refusal == delta.refusal
            and reasoning == delta.reasoning
            and calls == list(delta.tool_calls)
        ):
            kept.append(delta)  # nearly always: nothing held back, nothing hidden
            continue
        spelled.defer(c, delta.logprobs, hidden=guard.hid and not hid)
        if text or refusal or reasoning or calls or delta.finish_reason:
            kept.append(
                dataclasses.replace(
                    delta,
                    text=text,
                    refusal=refusal,
                    reasoning=reasoning,
                    tool_calls=tuple(calls),
                    logprobs=None,
                )
            )
    return kept


_NOTHING = StreamDelta()


def _guarded_call(guard: redact.SpelledGuard, choice: int, call: ToolCallDelta) -> ToolCallDelta:
    """``call``'s arguments through ``guard``; its name (and the id beside it) held
    whole until its arguments begin (or the call ends), then let go hidden whole: a
    provider that spelled a key across a name's pieces had it reach the reader (found
    by a hunt), and a name let go in pieces reaches a reader as its first (a review)."""
    if not call.name:
        arguments = guard.through((choice, call.index), call.arguments)
        return (
            call if arguments == call.arguments else dataclasses.replace(call, arguments=arguments)
        )
    named, ided = (choice, ("name", call.index)), (choice, ("id", call.index))
    guard.hold_whole(named, call.name)
    if call.id:
        guard.hold_whole(ided, call.id)
    if not call.arguments:
        return dataclasses.replace(call, id=None, name=None)  # held: nothing to give yet
    name = redact.hide(guard.rest(named))
    arguments = guard.through((choice, call.index), call.arguments)
    return dataclasses.replace(call, id=guard.rest(ided) or None, name=name, arguments=arguments)


async def _release(
    guard: redact.SpelledGuard,
    spelled: _LogprobGuard,
    answer: Any,
    heard: list[str],
    sink: DeltaSink | None,
) -> Any:
    """A stream has ended: ``answer`` with any secret it spells hidden (its logprobs
    gone if they or its texts spelled one), and what ``guard`` held back given to
    ``sink`` and ``heard`` (``sink`` None: the call ends cut, and what was held, which
    may be a key's beginning, goes to neither: the text the cut result carries is what
    the reader got)."""
    if not guard:
        return answer
    if sink is not None:
        for delta in _held_back(guard):
            heard.append(delta.result_text)
            await sink.put(delta)
    answer = redact.hide_json(answer)
    _without_logprobs(answer, spelling=not (guard.hid or spelled.hid))
    return answer


def _held_back(
    guard: redact.SpelledGuard, choice: int | None = None, *, but: Set[Any] = frozenset()
) -> list[StreamDelta]:
    """What ``guard`` holds back (of ``choice``, None: of every choice; not of the
    texts ``but`` names), taken from it: a delta per choice."""
    by_choice: dict[int, list[Any]] = {}
    for key in guard.held():
        if (choice is None or key[0] == choice) and key not in but:
            by_choice.setdefault(key[0], []).append(key)
    return [
        StreamDelta(
            text=guard.rest((c, "text")) if (c, "text") in keys else "",
            refusal=guard.rest((c, "refusal")) if (c, "refusal") in keys else "",
            reasoning=guard.rest((c, "reasoning")) if (c, "reasoning") in keys else "",
            tool_calls=_calls_held(guard, keys),
            choice=c,
        )
        for c, keys in sorted(by_choice.items())
    ]


def _calls_held(guard: redact.SpelledGuard, keys: list[Any]) -> tuple[ToolCallDelta, ...]:
    """What ``guard`` holds of the tool calls among ``keys`` (one choice's), taken from
    it: a fragment per call, its id, name (hidden whole) and arguments as held (None,
    "": not held)."""
    held: dict[str, dict[int, str]] = {"id": {}, "name": {}, "arguments": {}}
    for key in keys:
        what = key[1]
        if type(what) is int:
            held["arguments"][what] = guard.rest(key)
        elif type(what) is tuple:
            held[what[0]][what[1]] = guard.rest(key)
    ids, names, arguments = held["id"], held["name"], held["arguments"]
    return tuple(
        ToolCallDelta(
            index=i,
            id=ids.get(i),
            name=redact.hide(names[i]) if i in names else None,
            arguments=arguments.get(i, ""),
        )
        for i in sorted({*names, *arguments})
    )


def _note_thinking(
    cutoff: _Cutoff,
    chunks: list[dict[str, Any] | None],
    messages: anthropic.StreamAssembler | None,
    clock: Callable[[], float],
) -> None:
    """A stream whose model has begun thinking (Anthropic's extended thinking; a
    chunk's ``reasoning_content`` or ``reasoning``, as OpenAI-compatible servers of
    reasoning models stream it before any text) is under way, though its reader has no
    text yet: from here silence cuts it, not the total timeout."""
    if cutoff.flows:
        return
    thinks = messages.thinking if messages is not None else any(map(_reasons, chunks))
    if thinks:
        cutoff.flowing(clock())


def _reasons(chunk: dict[str, Any] | None) -> bool:
    for choice in (chunk or _NO_DELTA).get("choices") or ():
        if thinks(choice.get("delta") or _NO_DELTA):  # Mistral's parts too (a review: a
            return True  # long think was cut at the total timeout, as no progress)
    return False


def _call_delta(call: dict[str, Any]) -> ToolCallDelta:
    function = call.get("function") or _NO_DELTA
    call_id, name = call.get("id"), function.get("name")
    arguments = function.get("arguments") or ""
    if not isinstance(call_id, str | None) or not isinstance(name, str | None):
        raise TypeError("a tool call's id and name are text")
    if not isinstance(arguments, str):
        raise TypeError("a tool call's arguments are text")
    return ToolCallDelta(
        index=int(call.get("index", 0)), id=call_id, name=name, arguments=arguments
    )


def _broke_off(
    ended: Callable[..., CallResult], exc: aiohttp.ClientError | httpx.TransportError
) -> CallResult:
    """A 2xx whose body broke off: answered, so billed; it keeps its status (and is
    charged its estimate): as a bare connection error it was charged nothing, and a
    budget's calls were billed twice the cap (found by a hunt)."""
    kind, said = transport_error(exc)
    return ended(error=kind, detail=_detail(f"the answer's body broke off: {said}"))


def _prompt_said(said: Mapping[str, Any] | None) -> Usage | None:
    """The prompt's counts in a stream's usage ``said`` so far (an Anthropic stream's
    ``message_start``: input, cache reads and writes), the output's left at nothing;
    None if it said none, or none that reads (the answer's own usage says so in the
    log, once: not again here)."""
    try:
        heard = None if said is None else _usage(said)
    except (ValueError, TypeError):
        return None
    if heard is None:
        return None
    return dataclasses.replace(heard, completion_tokens=0, reasoning_tokens=0, estimated=True)


def _unfinished(
    ended: Callable[..., CallResult], heard: list[str], *, received: bool, evented: bool, label: str
) -> CallResult:
    """A stream that ended before its last event: cut, once its reader had a delta;
    before that nothing was made, so nothing is billed, as for a cut or a stall then (it
    kept its 200, and an empty body or a proxy's page in HTML was charged all of
    ``max_tokens`` at each of 3 calls; found by a hunt)."""
    content = "".join(heard)
    if received:
        return ended(error="cut", detail="the stream ended before its last event", content=content)
    said = (
        "the stream ended before its last event"
        if evented
        else f"the answer is not an event stream (Content-Type: {label or 'none'})"
    )
    return ended(error="malformed", status_code=None, detail=_detail(said), content=content)


_LEADING: Final = b"\xef\xbb\xbf \t\r\n"
"""What a body may begin with before what tells a stream from JSON: a BOM's bytes and
white space."""


PEEK_BYTES = 64 * 1024
"""How much white space a streamed body may begin with before it is taken for a stream
without a look at what follows (``_first_parts``)."""


async def _first_parts(parts: AsyncIterator[bytes]) -> list[bytes]:
    """The parts of a body up to its first byte that is not white space (or a BOM), or
    to ``PEEK_BYTES``, or to its end: what tells a stream from a JSON body."""
    first: list[bytes] = []
    size = 0
    async for part in parts:
        first.append(part)
        size += len(part)
        if part.strip(_LEADING) or size > PEEK_BYTES:
            break
    return first


def _whole_json(first: list[bytes]) -> bool:
    """Whether a body that begins with ``first`` is a JSON object (no event stream line
    begins with ``{``)."""
    return b"".join(first).lstrip(_LEADING).startswith(b"{")


class _Chained:
    """``first``, then the rest of ``parts``: past ``first``, each step is the step of
    ``parts`` itself (an async generator here cost a frame resumed for every part of
    every stream)."""

    __slots__ = ("_first", "_parts")

    def __init__(self, first: list[bytes], parts: AsyncIterator[bytes]) -> None:
        self._first = first[::-1]
        self._parts = parts

    def __aiter__(self) -> _Chained:
        return self

    def __anext__(self) -> Awaitable[bytes]:
        if self._first:
            return _now(self._first.pop())
        return self._parts.__anext__()


async def _now(part: bytes) -> bytes:
    return part


def _chained(first: list[bytes], parts: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``first``, then the rest of ``parts``."""
    return _Chained(first, parts) if first else parts


async def _replay(result: CallResult, sink: DeltaSink, heard: list[str]) -> CallResult:
    """A streamed call answered with a whole completion: the reader gets it as one delta
    per choice, its first token when the body came."""
    answer = result.answer
    assert answer is not None  # a completed call's
    choices = [
        {
            "index": c.get("index", 0),
            "delta": _as_delta(c),
            "finish_reason": c.get("finish_reason"),
            "logprobs": c.get("logprobs"),
        }
        for c in answer.get("choices") or ()
    ]
    for delta in _deltas_of({"choices": choices}):
        heard.append(delta.result_text)
        await sink.put(delta)
    return dataclasses.replace(result, first_token_at=time.monotonic())


def _as_delta(choice: Any) -> dict[str, Any]:
    """A whole answer's choice as one chunk's delta (tool calls numbered)."""
    message = choice.get("message") or {}
    calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or ())]
    return {**message, "tool_calls": calls}


def _rate_headers(headers: Headers) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """The rate-limit headers of a response, names lower-cased, with its ``Date`` last
    where there are any (a reset's time of day is the provider's clock), and the
    provider's id of the call (redacted: a server may echo anything): one pass over the
    raw list (``Headers.get`` per name scans it once per name: measured 20 us a response
    against 2 us)."""
    rate: list[tuple[str, str]] = []
    request_id = None
    date = None
    for name, value in headers:
        lower = name.lower()
        if lower in _RATE_NAMES:
            rate.append((lower.decode("latin-1"), value.decode("latin-1")))
        elif lower == b"date" and date is None:
            date = value.decode("latin-1")
        elif lower in _ID_NAMES and request_id is None:  # hidden before it is cut (a key
            # across the cut kept its head), on one line (a gateway passes it on: a
            # control character in a header it writes made its answer a 500; a review)
            request_id = redact.hide_cut(_UNPRINTABLE.sub(" ", value.decode("latin-1")), _ID_LIMIT)
    if rate and date is not None:
        rate.append(("date", date))
    return tuple(rate), request_id


def _bad_news(result: CallResult) -> bool:
    """Whether an answer may change what the actor would admit: a 429 (a pause), an
    authentication error, a server error or a failed transport (the breaker). The
    calls waiting in the window were admitted before it was known, so they go back."""
    status = result.status_code
    if status is None:
        return result.error not in (None, "deadline", "abandoned")
    return status in (401, 403, 429) or status >= 500


def _unsent(waiting: _Waiting, why: str) -> CallResult:
    """The result of a call the window never started."""
    now = time.monotonic()
    return CallResult(
        task_id=waiting[2],
        attempt=waiting[3],
        started_at=now,
        ended_at=now,
        error=UNSENT,
        detail=why,
    )


def _ended(task_id: int, attempt: int, started: float, **fields: Any) -> CallResult:
    """The ``CallResult`` of an attempt that ends now."""
    return CallResult(
        task_id=task_id, attempt=attempt, started_at=started, ended_at=time.monotonic(), **fields
    )


_NOT_AN_ERROR: Final = -1
"""What ``_error_status`` says of a body that is no error object."""


def _error_status(data: Any, *, event: bool = False) -> int | None:
    """The status a body's (or, ``event``, a stream event's) error object stands for.
    In a stream, as the openai SDK tells one: any truthy ``error`` is the provider's
    error, beside ``choices`` too (OpenRouter's mid-stream error ends its choice
    ``finish_reason: "error"``) and as plain text (``{"error": "upstream connection
    reset"}``); the SDK raises on each, and callboard answered them ``Completed``, the
    partial text as the whole (found by a hunt). In a whole body (which the SDK does not
    look into) beside ``choices`` only where a choice ends ``"error"`` (OpenRouter's):
    a good answer with an ``error`` field besides was failed and sent again (a review).

    The status: the object's own ``status`` (Azure's), else an integer ``code`` that is
    one (vLLM's, llama.cpp's, OpenRouter's), else its type's (Anthropic's as its events
    are read, the openai SDK's class names vLLM sends, else OpenAI's words), None if it
    names none; ``_NOT_AN_ERROR`` for a body with no error. Azure's content filter
    (``"type": null, "code": "content_filter", "status": 400``) in a stream or a 200 was
    malformed: retried three times and the breaker opened, one caller's filtered prompt
    taking the model from every other (found by a hunt); so was vLLM's ``"code": 400``
    for a prompt too long, and two such prompts had the model given up on."""
    if not isinstance(data, dict):
        return _NOT_AN_ERROR
    error = data.get("error")
    if not error or (not event and not _failed_choice(data)):
        return _NOT_AN_ERROR
    if isinstance(error, str):
        return _status_of(error.lower())
    if not isinstance(error, dict):
        return None
    for field in ("status", "code"):
        given = error.get(field)
        if type(given) is int and 400 <= given <= 599:
            return given
    kind = str(error.get("type"))
    said = " ".join(str(error.get(k) or "") for k in ("type", "code")).lower()
    return _STATUS_OF.get(kind) or _SDK_CLASSES.get(kind) or _status_of(said)


def _failed_choice(body: Mapping[str, Any]) -> bool:
    """Whether a whole body's error stands for the answer: it has no choices, or one of
    them ends ``"error"``."""
    choices = body.get("choices")
    if choices is None:
        return True
    return isinstance(choices, list) and any(
        isinstance(c, Mapping) and c.get("finish_reason") == "error" for c in choices
    )


_SDK_CLASSES: dict[str, int] = {
    "BadRequestError": 400,
    "AuthenticationError": 401,
    "PermissionDeniedError": 403,
    "NotFoundError": 404,
    "ConflictError": 409,
    "UnprocessableEntityError": 422,
    "RateLimitError": 429,
    "InternalServerError": 500,
}
"""The openai SDK's exception classes by the status each stands for: vLLM's error
objects name their ``type`` so (``"BadRequestError"``)."""


def _answered(body: Any) -> str:
    """An error object a 2xx body or a stream's event held, as a call's detail: as an
    error answer's is (``_error_detail``: compact JSON of its message, type, param and
    code), so ``core.outcome`` reads a spent quota or credit in it and the gateway
    passes its fields on. In words, a 200 body's lacked the type that tells a spent
    quota from a rate limit (retried where it should stop at once), and Anthropic's
    out-of-credit 400 was not read as such in either (a review)."""
    return _error_detail(_compact(body))


def _text(content: Any) -> str:
    """The message's content: a string, or none (null, as with tool calls)."""
    if content is None:
        return ""
    if not isinstance(content, str):
        raise TypeError("message.content is not a string")
    return content


def _read_usage(u: Any, model: str) -> Usage | None:
    """The completion's token counts; None when it has none, or none that can be read:
    the call is then charged its estimate (its prompt and all of ``max_tokens``, marked
    estimated), the answer kept. An unreadable count is the server's fault, not the
    answer's: failing the call had it sent again, each attempt billed, none charged."""
    try:
        return _usage(u)
    except (ValueError, TypeError) as exc:
        told = _UNREADABLE_USAGE[model] = _UNREADABLE_USAGE.get(model, 0) + 1
        if told == 1 or told % UNREADABLE_USAGE_EVERY == 0:  # one a call was a flood (a hunt)
            log.warning(
                "%s: an answer's usage is unreadable (%s): it is charged its estimate "
                "(%d answers so far; the stats count each model's estimated calls)",
                model,
                exc,
                told,
            )
        return None


UNREADABLE_USAGE_EVERY = 100
"""After the first, one warning per this many answers of a model whose usage did not
read: a server that never says it readably said so once a call (2,000 warnings for
2,000 calls, none naming the model; found by a hunt)."""
_UNREADABLE_USAGE: dict[str, int] = {}
"""Answers of each model (by name) whose usage did not read, this process."""


def _usage(u: Any) -> Usage | None:
    """The completion's token counts; None when it has none (the model actor then
    charges the call its reservation). Raises ValueError/TypeError for counts that
    are not whole numbers >= 0 (negative, fractional, NaN, Infinity, booleans).

    Two OpenAI-compatible servers count otherwise than OpenAI, both read as billed
    (each found by a hunt): xAI counts reasoning beside ``completion_tokens``, not in
    it (its ``total_tokens`` is prompt, completion and reasoning: the reasoning was
    charged nothing, 30% short of its bill), and DeepSeek says its cache hits in
    ``prompt_cache_hit_tokens`` (they were charged the whole input price, 8x its bill
    for a prompt mostly cached)."""
    if u is None:
        return None
    if not isinstance(u, dict):
        raise TypeError("usage is not an object")
    if u.get("prompt_tokens") is None or u.get("completion_tokens") is None:
        return None  # no counts, or null or missing ones (some servers): estimated
    details = u.get("prompt_tokens_details") or {}
    out_details = u.get("completion_tokens_details") or {}
    if not isinstance(details, dict) or not isinstance(out_details, dict):
        raise TypeError("usage.*_tokens_details is not an object")
    prompt = _count(u["prompt_tokens"], "prompt_tokens")
    completion = _count(u["completion_tokens"], "completion_tokens")
    reasoning = _count(out_details.get("reasoning_tokens") or 0, "reasoning_tokens")
    total = u.get("total_tokens")
    if reasoning and type(total) is int and total == prompt + completion + reasoning:
        completion += reasoning  # xAI's: beside the completion, not in it
    cached = details.get("cached_tokens")
    if cached is None:  # DeepSeek's
        cached = u.get("prompt_cache_hit_tokens")
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=_count(cached or 0, "cached_tokens"),
        reasoning_tokens=reasoning,
        cache_write_tokens=_count(details.get("cache_write_tokens") or 0, "cache_write_tokens"),
        cache_write_1h_tokens=_count(
            details.get("cache_write_1h_tokens") or 0, "cache_write_1h_tokens"
        ),
    )


MOST_TOKENS_COUNTED = 10**9
"""More tokens than any one call uses (context windows hold a few million): a count
past it is a broken answer, not a bill (``1e23`` prompt tokens priced a call at
10^17 USD, and its budget was spent for good)."""


def _count(value: Any, name: str) -> int:
    if type(value) is int and 0 <= value <= MOST_TOKENS_COUNTED:
        return value
    if type(value) is float and value.is_integer() and 0 <= value <= MOST_TOKENS_COUNTED:
        return int(value)  # 12.0: whole, finite
    raise ValueError(
        f"usage.{name} is not a whole number from 0 to {MOST_TOKENS_COUNTED:,}: {value!r:.40}"
    )
