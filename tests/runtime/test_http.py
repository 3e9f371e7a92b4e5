"""The HTTP client (runtime/http.py): what callboard sends to an OpenAI-compatible
endpoint, how it reads the answers, its transports, and that the API key never leaves.

Every call goes through a real ``System`` to a real HTTP server on 127.0.0.1:
``WireServer`` (tests/loopback.py), a small aiohttp server whose handler the
test writes, so it can answer what real servers and proxies answer (gzip,
chunked, a 200 carrying an ``error`` object, HTML error pages, stalled bodies,
closed keep-alive connections...). The server records what arrived: path,
query, headers and body.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import queue
import socket
import threading
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from callboard.core.breaker import BreakerConfig
from callboard.core.retry import RetryConfig
from callboard.messages import CallResult, CallsDone, ConfigError
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.http import UNSENT, ModelClient
from callboard.runtime.io_loop import IoLoop
from loopback import USAGE, Arrival, Gate, WireServer, answer, completion_body, echo
from support import WAIT_S, LogCollector, running

from callboard import (
    Completed,
    Failed,
    FailureReason,
    ModelSettings,
    Request,
    System,
    SystemConfig,
    Timeouts,
)
from callboard.batch import parse_line

NEVER_OPEN = BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000)
ONE_TRY = RetryConfig(max_attempts=1)
KEY = "sk-test-Wire/Slash+key_0123456789abcdef"
"""An API key with a '/' and a '+' (base64-style keys have them)."""
TRANSPORTS = ["aiohttp", "httpx"]


def model(base_url: str, **kw: Any) -> ModelSettings:
    fields: dict[str, Any] = {
        "name": "m",
        "base_url": base_url,
        "max_concurrency": 4,
        "breaker": NEVER_OPEN,
        "retry": ONE_TRY,
        **kw,
    }
    return ModelSettings(**fields)


@pytest.fixture
def run() -> Iterator[Callable[..., Any]]:
    """``run(settings, prompt="hi", **submit)`` -> the result of one call on a real System."""
    systems: list[System] = []

    def go(settings: ModelSettings, prompt: Any = "hi", **submit: Any) -> Any:
        system = System(SystemConfig(models=(settings,)))
        systems.append(system)
        if not isinstance(prompt, Request):
            submit.setdefault("model", settings.name)
        return system.submit(prompt, **submit).result(WAIT_S)

    yield go
    for system in systems:
        system.stop(timeout=10)


# -- what callboard sends ------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_request_is_a_post_to_chat_completions_with_bearer_key_and_json(
    run: Callable[..., Any], transport: str
) -> None:
    with WireServer(answer()) as srv:
        settings = model(srv.base_url, api_key=KEY, transport=transport)
        result = run(settings, max_tokens=9, temperature=0)
    assert isinstance(result, Completed), result
    (a,) = srv.arrivals
    assert (a.method, a.path, a.query) == ("POST", "/v1/chat/completions", "")
    assert a.headers["authorization"] == f"Bearer {KEY}"
    assert a.headers["content-type"].startswith("application/json")
    assert a.json == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 9,
        "temperature": 0,  # 0 is a value, not "unset"
    }


def test_no_key_sends_no_authorization_header(run: Callable[..., Any]) -> None:
    with WireServer(answer()) as srv:
        result = run(model(srv.base_url + "/", provider_model="org/llama-3"))
    assert isinstance(result, Completed), result
    (a,) = srv.arrivals
    assert a.path == "/v1/chat/completions"  # a trailing slash on base_url is joined once
    assert "authorization" not in a.headers
    assert a.json["model"] == "org/llama-3"


def test_non_ascii_content_goes_as_valid_json_and_comes_back_intact(
    run: Callable[..., Any],
) -> None:
    text = 'Grüße, 你好, emoji 🎉, quote " and backslash \\ and \u2028 line sep'
    reply = 'Antwort: ÄÖÜ 你好 🎉 "quoted"'

    async def echo(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        body = json.dumps(completion_body(content=reply, usage=USAGE), ensure_ascii=False)
        return web.Response(body=body.encode("utf-8"), content_type="application/json")

    with WireServer(echo) as srv:
        result = run(model(srv.base_url), text)
    assert isinstance(result, Completed), result
    assert srv.arrivals[0].json["messages"][0]["content"] == text
    assert result.content == reply


# -- URL joining ---------------------------------------------------------------


def test_a_base_url_with_a_query_string_keeps_the_path_before_the_query(
    run: Callable[..., Any],
) -> None:
    """Azure OpenAI deployments take ``?api-version=...``; whatever callboard does with
    such a base_url, it must not append ``/chat/completions`` to the query string."""
    base = "/openai/deployments/gpt4o"
    with WireServer(answer()) as srv:
        try:
            settings = model(f"{srv.root}{base}?api-version=2024-10-21")
        except ValueError:  # a ConfigError refusing it at once would be fine too
            return
        run(settings)
    (a,) = srv.arrivals
    assert a.path == f"{base}/chat/completions"
    assert a.query == "api-version=2024-10-21"


# -- how answers are read ------------------------------------------------------


def test_content_null_with_tool_calls_completes_with_empty_text(run: Callable[..., Any]) -> None:
    body = completion_body(content=None, finish_reason="tool_calls", usage=USAGE)
    body["choices"][0]["message"]["tool_calls"] = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]
    with WireServer(answer(body)) as srv:
        result = run(model(srv.base_url))
    assert isinstance(result, Completed), result
    assert (result.content, result.finish_reason) == ("", "tool_calls")


def test_usage_details_and_unknown_fields_are_read_and_ignored(run: Callable[..., Any]) -> None:
    usage = {
        "prompt_tokens": 2006,
        "completion_tokens": 300,
        "total_tokens": 2306,
        "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 256,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
    body = completion_body(
        finish_reason="length", usage=usage, system_fingerprint="fp_x", service_tier="default"
    )
    body["choices"][0]["logprobs"] = None
    body["choices"][0]["message"]["refusal"] = None
    body["choices"][0]["message"]["annotations"] = []
    del body["id"], body["object"], body["created"]
    with WireServer(answer(body)) as srv:
        result = run(model(srv.base_url))
    assert isinstance(result, Completed), result
    assert result.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (2006, 300)
    assert result.usage.cached_tokens == 1920
    assert not result.usage.estimated


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_answer_is_decoded(
    run: Callable[..., Any], encoding: str, transport: str
) -> None:
    raw = json.dumps(completion_body(content="squeezed", usage=USAGE)).encode()
    packed = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.Response(
            body=packed,
            headers={"content-type": "application/json", "content-encoding": encoding},
        )

    with WireServer(handle) as srv:
        result = run(model(srv.base_url, transport=transport))
    assert isinstance(result, Completed), result
    assert result.content == "squeezed"


def test_an_undecodable_compressed_answer_is_a_malformed_response(
    run: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.Response(
            body=b"not gzip at all",
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )

    with WireServer(handle) as srv:
        result = run(model(srv.base_url))
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.MALFORMED_RESPONSE
    assert "unexpectedly" not in caplog.text


def test_a_chunked_answer_in_pieces_is_read_whole(run: Callable[..., Any]) -> None:
    raw = json.dumps(completion_body(content="x" * 50_000, usage=USAGE)).encode()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(raw), 777):
            await resp.write(raw[i : i + 777])
        await resp.write_eof()
        return resp

    with WireServer(handle) as srv:
        result = run(model(srv.base_url))
    assert isinstance(result, Completed), result
    assert result.content == "x" * 50_000


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_very_large_answer_is_read_whole(run: Callable[..., Any], transport: str) -> None:
    text = "ab" * 4_000_000  # 8 MB of content
    with WireServer(answer(completion_body(content=text, usage=USAGE))) as srv:
        result = run(model(srv.base_url, transport=transport))
    assert isinstance(result, Completed), result
    assert len(result.content) == len(text)


def test_a_200_with_an_error_object_says_what_the_provider_said(run: Callable[..., Any]) -> None:
    body = {
        "error": {
            "message": "This model's maximum context length is 8192 tokens",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
    }
    with WireServer(answer(body)) as srv:
        result = run(model(srv.base_url))
    assert isinstance(result, Failed), result
    assert "maximum context length" in result.detail


@pytest.mark.parametrize(
    ("status", "body", "reason"),
    [
        (502, b"<html><body><h1>502 Bad Gateway</h1></body></html>", FailureReason.PROVIDER_ERROR),
        (503, b"", FailureReason.PROVIDER_ERROR),
        (400, b"", FailureReason.REQUEST_ERROR),
        (401, b"<html>Unauthorized</html>", FailureReason.AUTHENTICATION),
    ],
)
def test_an_error_status_with_an_html_or_empty_body_fails_typed(
    run: Callable[..., Any], status: int, body: bytes, reason: FailureReason
) -> None:
    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.Response(status=status, body=body, content_type="text/html")

    with WireServer(handle) as srv:
        result = run(model(srv.base_url))
    assert isinstance(result, Failed), result
    assert (result.reason, result.status_code) == (reason, status)
    assert len(result.detail) <= 300


def test_a_201_with_a_completion_is_read_like_a_200(run: Callable[..., Any]) -> None:
    with WireServer(answer(status=201)) as srv:
        result = run(model(srv.base_url))
    assert isinstance(result, Completed), result
    assert result.content == "hi"
    assert not result.usage.estimated


def test_a_body_that_stalls_is_cut_by_the_read_timeout_not_the_total(
    run: Callable[..., Any],
) -> None:
    release = asyncio.Event()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"choices": [')
        with contextlib.suppress(TimeoutError):  # until the client gives up and hangs up
            await asyncio.wait_for(release.wait(), WAIT_S)
        return resp

    with WireServer(handle) as srv:
        settings = model(srv.base_url, timeout=Timeouts(connect=5, read=0.3, total=WAIT_S * 2))
        result = run(settings)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.TIMEOUT
    assert result.latency_s < WAIT_S / 2


def test_calls_reuse_one_keep_alive_connection() -> None:
    with WireServer(answer()) as srv:
        system = System(SystemConfig(models=(model(srv.base_url),)))
        try:
            results = [system.submit("hi", model="m").result(WAIT_S) for _ in range(5)]
        finally:
            system.stop(timeout=10)
    assert all(isinstance(r, Completed) for r in results), results
    assert len(srv.connections) == 1, srv.connections


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_connection_the_server_closed_while_idle_is_not_reused(transport: str) -> None:
    closed = threading.Event()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        conn = request.transport
        assert conn is not None
        resp = web.Response(
            body=json.dumps(completion_body(usage=USAGE)).encode(),
            content_type="application/json",
        )
        await resp.prepare(request)
        await resp.write_eof()

        def close_idle() -> None:
            # the server's idle timeout: close the kept-alive connection after answering
            # (without a Connection: close header, as nginx / uvicorn do at
            # keepalive_timeout). shutdown() sends the FIN before ``closed`` is set;
            # transport.close() alone would leave the socket open until a later turn
            # of the server's loop, and a request sent meanwhile would be reset.
            conn.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
            conn.close()
            closed.set()

        asyncio.get_running_loop().call_later(0.05, close_idle)
        return resp

    with WireServer(handle) as srv:
        system = System(SystemConfig(models=(model(srv.base_url, transport=transport),)))
        try:
            first = system.submit("hi", model="m").result(WAIT_S)
            assert closed.wait(WAIT_S)
            second = system.submit("hi", model="m").result(WAIT_S)
        finally:
            system.stop(timeout=10)
    assert isinstance(first, Completed), first
    assert isinstance(second, Completed), second
    assert second.attempts == 1
    assert len(srv.connections) == 2, "the second call went on a new connection"


# -- transports ------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_httpx_transport_goes_through_the_configured_proxy(run: Callable[..., Any]) -> None:
    with WireServer(answer(completion_body(content="via proxy", usage=USAGE))) as proxy:
        unreachable = f"http://127.0.0.1:{_closed_port()}/v1"
        result = run(model(unreachable, transport="httpx", proxy=proxy.root))
    assert isinstance(result, Completed), result
    assert result.content == "via proxy"


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
def test_a_refused_connection_says_so_not_connect_timeout(
    run: Callable[..., Any], transport: str
) -> None:
    result = run(model(f"http://127.0.0.1:{_closed_port()}/v1", transport=transport))
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.CONNECTION
    assert result.detail.startswith("connection refused: "), result.detail
    assert "Timeout" not in result.detail


# -- the key never leaves ------------------------------------------------------


@pytest.mark.parametrize(
    "echo",
    [
        pytest.param(lambda k: json.dumps({"error": {"message": f"bad key {k}"}}), id="plain"),
        pytest.param(
            lambda k: json.dumps({"error": {"message": f"Authorization: Bearer {k}"}}),
            id="header",
        ),
        pytest.param(
            lambda k: json.dumps({"error": {"message": f"bad key {k}"}}).replace("/", "\\/"),
            id="json-escaped-slash",
        ),
    ],
)
def test_an_error_body_echoing_the_key_never_reaches_the_result(
    run: Callable[..., Any], echo: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    with WireServer(answer(echo(KEY).encode(), status=401)) as srv:
        result = run(model(srv.base_url, api_key=KEY))
    assert isinstance(result, Failed), result
    assert result.status_code == 401
    everything = repr(result) + result.detail + caplog.text
    assert "Wire" not in everything, result.detail
    assert "0123456789abcdef" not in everything, result.detail


# -- the batch file --------------------------------------------------------------


def test_a_batch_line_with_max_completion_tokens_is_sent_as_max_tokens(
    run: Callable[..., Any],
) -> None:
    """Documents what happens today (see the report: a judgement call)."""
    line = json.dumps(
        {
            "custom_id": "r1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 40,
            },
        }
    )
    parsed = parse_line(line, 1)
    assert not hasattr(parsed, "message"), parsed
    with WireServer(answer()) as srv:
        result = run(model(srv.base_url), parsed.request)  # type: ignore[union-attr]
    assert isinstance(result, Completed), result
    sent = srv.arrivals[0].json
    assert sent["max_tokens"] == 40
    assert "max_completion_tokens" not in sent


def test_a_model_that_wants_max_completion_tokens_gets_the_cap_in_that_field(
    run: Callable[..., Any],
) -> None:
    with WireServer(answer()) as srv:
        result = run(model(srv.base_url, max_tokens_param="max_completion_tokens"), max_tokens=40)
    assert isinstance(result, Completed), result
    sent = srv.arrivals[0].json
    assert sent["max_completion_tokens"] == 40
    assert "max_tokens" not in sent


def test_usage_with_null_counts_is_charged_as_estimated(run: Callable[..., Any]) -> None:
    usage = {"prompt_tokens": None, "completion_tokens": None, "total_tokens": None}
    with WireServer(answer(completion_body(content="paid for", usage=usage))) as srv:
        result = run(model(srv.base_url), max_tokens=30)
    assert isinstance(result, Completed), result
    assert result.content == "paid for"
    assert result.usage.estimated
    assert result.usage.completion_tokens == 30


def test_a_200_error_object_refusing_the_request_is_not_retried(run: Callable[..., Any]) -> None:
    body = {"error": {"message": "bad", "type": "invalid_request_error", "code": None}}
    with WireServer(answer(body)) as srv:
        result = run(model(srv.base_url, retry=RetryConfig(max_attempts=4, initial_s=0.01)))
        sent = len(srv.arrivals)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.REQUEST_ERROR
    assert sent == 1


def test_a_usage_of_infinity_is_a_malformed_response() -> None:
    text = json.dumps(completion_body())  # JSON that json.dumps would not write: Infinity
    raw = (text[:-1] + ', "usage": {"prompt_tokens": Infinity, "completion_tokens": 1}}').encode()
    with WireServer(answer(raw)) as rogue:
        m = ModelSettings(name="m", base_url=rogue.base_url, retry=RetryConfig(max_attempts=1))
        with running(m) as system:
            result = system.submit("hello").result(WAIT_S)
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.MALFORMED_RESPONSE


# -- logs: ids and secrets ---------------------------------------------------------


class _BrokenTransport(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise RuntimeError("transport bug")


def test_unexpected_transport_error_record_carries_task_id(debug_logs: LogCollector) -> None:
    settings = ModelSettings(name="alpha", base_url="http://127.0.0.1:9/v1")
    delivered: list[CallsDone] = []

    async def run() -> None:
        client = ModelClient(
            settings, incarnation=1, deliver=delivered.append, transport=_BrokenTransport()
        )
        client.start([(42, 1, b"{}", None, 0, None)])
        for _ in range(1000):
            if delivered:
                break
            await asyncio.sleep(0)
        await client.aclose()

    asyncio.run(asyncio.wait_for(run(), WAIT_S))
    assert delivered
    assert delivered[0].results[0].task_id == 42
    recs = [r for r in debug_logs.records if "failed unexpectedly" in r.getMessage()]
    assert recs
    assert getattr(recs[0], "task_id", None) == 42


LOG_KEY = "sk-hunt-0bs3rvab1l1ty-K3Y-9f8e7d6c5b4a"
PROXY_PASSWORD = "pr0xyPa55w0rdZQX"  # noqa: S105 - a test value


def _no_retry_breaker() -> BreakerConfig:
    return BreakerConfig(consecutive_failures=10_000, min_calls=10_000)


def _fast_retry(attempts: int) -> RetryConfig:
    return RetryConfig(max_attempts=attempts, initial_s=0.01, max_s=0.02, jitter_s=0.0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_debug_logs_never_show_the_api_key(debug_logs: LogCollector, transport: str) -> None:
    behaviours = {
        "good": ModelBehaviour(latency_s=0.002),
        "bad": ModelBehaviour(latency_s=0.002, status=500),
    }
    key = LOG_KEY
    with SimulatedProvider(models=behaviours, api_key=key) as p:
        models = (
            ModelSettings(name="good", base_url=p.base_url, api_key=key, transport=transport),  # type: ignore[arg-type]
            ModelSettings(
                name="bad",
                base_url=p.base_url,
                api_key=key,  # type: ignore[arg-type]
                transport=transport,  # type: ignore[arg-type]
                retry=_fast_retry(2),
                breaker=_no_retry_breaker(),
            ),
            ModelSettings(  # the wrong key: answered 401
                name="wrong",
                provider_model="good",
                base_url=p.base_url,
                api_key=key[::-1],  # type: ignore[arg-type]
                transport=transport,  # type: ignore[arg-type]
                retry=_fast_retry(2),
                breaker=_no_retry_breaker(),
            ),
        )
        with System(SystemConfig(models=models)) as cb:
            rs = [
                f.result(WAIT_S)
                for m in ("good", "bad", "wrong")
                for f in cb.submit_many(["x", "y"], model=m)
            ]
            stats = cb.stats()
            text = repr(stats) + str(stats) + repr(cb)
    assert [r.ok for r in rs] == [True, True, False, False, False, False]
    assert debug_logs.lines  # DEBUG was on
    debug_logs.assert_no_secret(key, key[::-1], key[3:])
    assert key not in text
    assert key[::-1] not in text
    for r in rs:
        assert key not in repr(r)
        assert key[::-1] not in repr(r)


def test_debug_logs_never_show_proxy_credentials(debug_logs: LogCollector) -> None:
    with SimulatedProvider(models={"alpha": ModelBehaviour(latency_s=0.002)}) as p:
        proxy = f"http://hunter:{PROXY_PASSWORD}@127.0.0.1:{p.port}"  # the provider as proxy
        dead = f"http://hunter:{PROXY_PASSWORD}@127.0.0.1:9"  # nobody listens
        models = (
            ModelSettings(name="alpha", base_url=p.base_url, transport="httpx", proxy=proxy),  # type: ignore[arg-type]
            ModelSettings(
                name="beta",
                provider_model="alpha",
                base_url=p.base_url,
                transport="httpx",
                proxy=dead,  # type: ignore[arg-type]
                retry=_fast_retry(2),
                breaker=_no_retry_breaker(),
            ),
        )
        with System(SystemConfig(models=models)) as cb:
            rs = [
                f.result(WAIT_S) for m in ("alpha", "beta") for f in cb.submit_many(["x"], model=m)
            ]
            text = repr(cb.stats()) + repr(models)
    assert not rs[1].ok
    for r in rs:
        assert PROXY_PASSWORD not in repr(r)
    assert PROXY_PASSWORD not in text
    debug_logs.assert_no_secret(PROXY_PASSWORD)


# -- secrets echoed back: a server that repeats the request in every answer ----------

SECRET = "sk-cb-SECRET-7f3a9"  # noqa: S105 - a test value
"""A distinctive key, looked for in every form (``_forms_of``)."""


def _forms_of(secret: str, user: str | None = None) -> list[str]:
    """``secret`` as is, URL-quoted and in Base64 (of ``user:secret`` when a user is
    given: a Basic header), Base64 padded or not."""
    pair = secret if user is None else f"{user}:{secret}"
    b64 = base64.b64encode(pair.encode()).decode()
    return [secret, urllib.parse.quote(secret, safe=""), b64, b64.rstrip("=")]


def _assert_hidden(found: list[str], *texts: str) -> None:
    for text in texts:
        for form in found:
            assert form not in text, text[:400]


def _echoed(settings: ModelSettings) -> tuple[list[Any], str]:
    """The results of ``ok`` (echoed as a completion) and ``bad`` (as an error), and
    every text callboard shows of them and of its config."""
    config = SystemConfig(models=(settings,))
    with System(config) as cb:
        rs = [f.result(WAIT_S) for f in cb.submit_many(["ok", "bad"], model=settings.name)]
        shown = repr(config) + str(config) + repr(cb.stats()) + repr(cb)
    return rs, shown + "".join(repr(r) + str(getattr(r, "detail", "")) for r in rs)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("where", ["api_key", "query", "userinfo"])
def test_a_secret_the_server_echoes_back_never_leaves(
    debug_logs: LogCollector, transport: str, where: str
) -> None:
    with WireServer(echo) as srv:
        user, fields = {
            "api_key": (None, {"base_url": srv.base_url, "api_key": SECRET}),
            "query": (None, {"base_url": f"{srv.base_url}?api-version=1&key={SECRET}"}),
            "userinfo": ("bob", {"base_url": f"http://bob:{SECRET}@127.0.0.1:{srv.port}/v1"}),
        }[where]
        rs, shown = _echoed(model(transport=transport, **fields))
        sent = srv.arrivals[0]
    assert [r.ok for r in rs] == [True, False]
    assert "***" in rs[0].content
    assert rs[1].status_code == 400
    if where == "userinfo":  # sent as a Basic header, on either transport, never in the URL
        assert sent.headers["authorization"] == "Basic " + _forms_of(SECRET, "bob")[2]
        assert "@" not in str(sent.path)
    elif where == "query":
        assert urllib.parse.parse_qs(sent.query) == {"api-version": ["1"], "key": [SECRET]}
    found = _forms_of(SECRET, user)
    _assert_hidden(found, shown, *debug_logs.lines)
    if transport == "httpx":  # httpcore's DEBUG records of the headers were made, redacted
        assert any("x-echo" in line for line in debug_logs.lines)


def test_proxy_credentials_echoed_by_the_proxy_never_leave(debug_logs: LogCollector) -> None:
    password = "pr0xy-PW-c0ffee"  # noqa: S105 - a test value
    with WireServer(echo) as proxy:
        url = f"http://hunter:{password}@127.0.0.1:{proxy.port}"
        settings = model(base_url="http://api.example.invalid/v1", transport="httpx", proxy=url)
        rs, shown = _echoed(settings)
        sent = proxy.arrivals[0]
    assert [r.ok for r in rs] == [True, False]
    assert sent.headers["proxy-authorization"] == "Basic " + _forms_of(password, "hunter")[2]
    _assert_hidden(_forms_of(password, "hunter"), shown, *debug_logs.lines)
    assert "Basic ***" in rs[0].content


@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        ({"base_url": f"http://[::1/v1?key={SECRET}"}, "'http://[::1/v1?key=***'"),
        (
            {"base_url": "http://h/v1", "transport": "httpx", "proxy": f"http://u:{SECRET}@h:x"},
            "proxy 'http://u:***@h:x'",
        ),
    ],
)
def test_a_url_httpx_cannot_read_is_a_config_error_that_shows_it_masked(
    fields: dict[str, str], shown: str
) -> None:
    with pytest.raises(ConfigError, match="not a URL httpx can read") as info:
        System(SystemConfig(models=(model(**fields),)))
    assert shown in str(info.value)
    assert SECRET not in str(info.value)


def test_a_dead_endpoint_with_a_key_in_its_url_fails_without_showing_it(
    debug_logs: LogCollector,
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rs, shown = _echoed(model(base_url=f"http://127.0.0.1:{port}/v1?key={SECRET}"))
    assert not any(r.ok for r in rs)
    assert all("connection refused" in r.detail for r in rs)
    _assert_hidden(_forms_of(SECRET), shown, *debug_logs.lines)


# -- the window: calls granted ahead wait on the loop and start as slots free --------


class _Window:
    """A real ModelClient on a real I/O loop, with a cap of ``cap`` calls on the wire."""

    def __init__(self, base_url: str, cap: int) -> None:
        self.io = IoLoop(name="test-io")
        self.io.start()
        self.done: queue.Queue[CallResult] = queue.Queue()
        settings = ModelSettings(name="m", base_url=base_url, max_concurrency=cap)
        self.client = ModelClient(settings, incarnation=1, deliver=self._deliver)

    def _deliver(self, msg: CallsDone) -> None:
        for r in msg.results:
            self.done.put(r)

    def send(self, *calls: tuple[int, float | None, int]) -> None:
        """(task id, seconds left, rank) each."""
        batch = [
            (
                task_id,
                1,
                json.dumps({"messages": [{"content": str(task_id)}]}).encode(),
                left,
                rank,
                None,
            )
            for task_id, left, rank in calls
        ]
        self.io.call_soon(self.client.start, batch)

    def take(self, n: int) -> list[CallResult]:
        return [self.done.get(timeout=WAIT_S) for _ in range(n)]

    def close(self) -> None:
        self.io.run(self.client.aclose(close_transport=True))
        self.io.stop()


@pytest.fixture
def gate() -> Iterator[tuple[Gate, WireServer]]:
    g = Gate()
    with WireServer(g.handler) as server:
        yield g, server


def test_the_window_never_runs_more_than_the_cap_and_refills_best_rank_first(
    gate: tuple[Gate, WireServer],
) -> None:
    g, server = gate
    w = _Window(server.base_url, cap=2)
    try:
        w.send((1, None, 3), (2, None, 3), (3, None, 3))
        server.wait_for(2)
        w.send((4, None, 0))  # a CRITICAL call granted later goes to the front of the window
        g.release()
        server.wait_for(3)
        g.release(3)
        results = w.take(4)
        order = [int(a.json["messages"][0]["content"]) for a in server.arrivals]
        assert sorted(order[:2]) == [1, 2]  # started together: either may arrive first
        assert order[2] == 4, "the freed slot went to the best waiting call"
        assert sorted(r.task_id for r in results) == [1, 2, 3, 4]
        assert all(r.error is None for r in results)
        assert g.most == 2
    finally:
        g.release(4)
        w.close()


def test_revoke_takes_back_only_the_calls_still_waiting(gate: tuple[Gate, WireServer]) -> None:
    g, server = gate
    w = _Window(server.base_url, cap=1)
    try:
        w.send((1, None, 0), (2, None, 0), (3, None, 0))
        server.wait_for(1)
        w.io.call_soon(w.client.revoke, frozenset({2}))
        revoked = w.take(1)[0]
        assert (revoked.task_id, revoked.error, revoked.detail) == (2, UNSENT, "revoked")
        g.release(2)
        rest = w.take(2)
        assert sorted(r.task_id for r in rest) == [1, 3]
        assert all(r.error is None for r in rest)
        assert server.count() == 2, "the revoked call never reached the server"
    finally:
        g.release(3)
        w.close()


def test_a_call_whose_deadline_passes_in_the_window_is_not_sent(
    gate: tuple[Gate, WireServer],
) -> None:
    g, server = gate
    w = _Window(server.base_url, cap=1)
    try:
        w.send((1, None, 0), (2, 1e-6, 0))  # its deadline passes while call 1 holds the slot
        server.wait_for(1)
        g.release()
        results = {r.task_id: r for r in w.take(2)}
        assert results[1].error is None
        assert (results[2].error, results[2].detail) == (UNSENT, "deadline")
        assert server.count() == 1
    finally:
        g.release(2)
        w.close()


@pytest.mark.parametrize("status", [429, 401, 503])
def test_an_answer_that_may_change_admission_sends_the_waiting_calls_back(status: int) -> None:
    with WireServer(answer({"error": {"message": "no"}}, status=status)) as server:
        w = _Window(server.base_url, cap=1)
        try:
            w.send((1, None, 0), (2, None, 0), (3, None, 0))
            results = {r.task_id: r for r in w.take(3)}
        finally:
            w.close()
    assert results[1].status_code == status
    assert [(results[i].error, results[i].detail) for i in (2, 3)] == [(UNSENT, "revoked")] * 2
    assert server.count() == 1, "nothing waiting started after the bad news"
