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
import concurrent.futures
import contextlib
import email.utils
import errno
import gzip
import json
import logging
import queue
import re
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
import zlib
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import anthropic.types as an
import httpx
import openai.types.chat as oa
import pydantic
import pytest
import trustme
from aiohttp import web
from aiohttp.client_reqrep import ClientRequest
from callboard.core.breaker import BreakerConfig
from callboard.core.limiter import LimiterConfig
from callboard.core.pricing import cost_nusd
from callboard.core.retry import RetryConfig
from callboard.core.secret import Secret
from callboard.messages import CallResult, CallsDone, ConfigError
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime import http, redact
from callboard.runtime.http import (
    ACCEPT_ENCODING,
    HEAVY_ANSWER,
    MAX_ANSWER_BYTES,
    STREAM_PART,
    UNSENT,
    ModelClient,
    _AiohttpReply,
    _error_detail,
    _rate_headers,
    make_transport,
)
from callboard.runtime.io_loop import IoLoop
from callboard.wire.sse import EventStream
from httpx_aiohttp import AiohttpTransport
from hypothesis import given, settings
from hypothesis import strategies as st
from loopback import (
    ANTHROPIC_USAGE,
    SSE_HEADERS,
    USAGE,
    Arrival,
    Cue,
    Gate,
    Reply,
    WireServer,
    answer,
    anthropic_error,
    anthropic_rate_headers,
    chunk,
    completion_body,
    echo,
    message_body,
    message_events,
    open_stream,
    openai_error,
    openai_stream,
    replying,
    sending,
    sse,
    text_block,
    tool_use_block,
)
from support import WAIT_S, LogCollector, fresh, running, wait_until

from callboard import (
    Completed,
    Failed,
    FailureReason,
    ModelSettings,
    Price,
    Request,
    System,
    SystemConfig,
    Timeouts,
)
from callboard._stream import StreamFailedError
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


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("server", ["xai", "deepseek"])
def test_usage_as_xai_and_deepseek_count_it_is_charged_as_they_bill(
    server: str, streamed: bool
) -> None:
    """xAI counts reasoning beside ``completion_tokens`` (its ``total_tokens`` is all
    three; sub2api#5771's usage, billed $0.0232856), DeepSeek its cache hits in
    ``prompt_cache_hit_tokens`` (100,000 prompt tokens of which 99,000 hits, billed
    $0.003472). Read as OpenAI counts, the first was charged 30% short and the second
    8x over (found by a hunt)."""
    if server == "xai":
        usage: dict[str, Any] = {
            "prompt_tokens": 10120,
            "completion_tokens": 1499,
            "total_tokens": 14428,
            "prompt_tokens_details": {"cached_tokens": 128},
            "completion_tokens_details": {"reasoning_tokens": 2809},
        }
        price, billed = Price("1.25", "2.5", "0.2"), Decimal("0.0232856")
    else:
        usage = {
            "prompt_tokens": 100_000,
            "completion_tokens": 1000,
            "total_tokens": 101_000,
            "prompt_cache_hit_tokens": 99_000,
            "prompt_cache_miss_tokens": 1000,
        }
        price, billed = Price("0.28", "0.42", "0.028"), Decimal("0.003472")
    answered = (
        sending(openai_stream(["ok"], usage=usage))
        if streamed
        else answer(completion_body(usage=usage))
    )
    with WireServer(answered) as srv, running(model(srv.base_url, price=price)) as cb:
        asked = cb.stream("hi", model="m") if streamed else cb.submit("hi", model="m")
        result = asked.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert result.cost_usd == billed
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


_DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    ("status", "content_type", "body", "reason"),
    [
        (200, "application/json", b'{"choices":' + _DEEP + b"}", "MALFORMED_RESPONSE"),
        (200, "text/event-stream", b'data: {"choices":' + _DEEP + b"}\n\n", "MALFORMED_RESPONSE"),
        (
            400,
            "application/json",
            b'{"error":{"x":' + _DEEP[99_000:-99_000] + b"}}",
            "REQUEST_ERROR",
        ),
    ],
    ids=["answer", "stream", "error"],
)
def test_json_nested_past_the_parsers_depth_is_malformed_not_a_broken_connection(
    caplog: pytest.LogCaptureFixture,
    status: int,
    content_type: str,
    body: bytes,
    reason: str,
) -> None:
    """A ``RecursionError`` is no ``ValueError``: it fell to the catch-all, and the call
    ended ``connection`` (sent again, the breaker told of an outage), logged as a crash;
    a 400 of it was retried (found by a hunt)."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.Response(status=status, body=body, headers={"content-type": content_type})

    with WireServer(handle) as srv, running(model(srv.base_url)) as cb:
        streamed = content_type == "text/event-stream"
        result = (cb.stream("hi") if streamed else cb.submit("hi")).result(WAIT_S)
        calls = len(srv.arrivals)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason[reason]
    assert "unexpectedly" not in caplog.text
    if status == 400:
        assert calls == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_only_encodings_the_client_decodes_are_offered(
    run: Callable[..., Any], transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp offers zstd wherever it could decode it (Python 3.14), though callboard
    decodes through httpx: a server taking the offer made every answer malformed."""
    monkeypatch.setitem(ClientRequest.DEFAULT_HEADERS, "Accept-Encoding", "gzip, deflate, zstd")

    async def handle(request: web.Request, arrival: Arrival) -> web.Response:
        body = json.dumps(completion_body(content="ok")).encode()
        if "zstd" in request.headers.get("accept-encoding", ""):  # taken: bytes httpx cannot read
            headers = {"content-type": "application/json", "content-encoding": "zstd"}
            return web.Response(body=b"\x28\xb5\x2f\xfd" + body, headers=headers)
        return web.Response(body=body, content_type="application/json")

    with WireServer(handle) as srv:
        result = run(model(srv.base_url, transport=transport))
        (arrival,) = srv.arrivals
    assert isinstance(result, Completed), result
    assert arrival.headers["accept-encoding"] == ACCEPT_ENCODING.decode()  # gzip, deflate here


def _announcing_4_gb(request: web.Request) -> tuple[web.StreamResponse, bool]:
    headers = {"content-type": "application/json", "content-length": str(4 * 2**30)}
    return web.StreamResponse(headers=headers), False


def _chunked_for_ever(request: web.Request) -> tuple[web.StreamResponse, bool]:
    resp = web.StreamResponse(headers={"content-type": "application/json"})
    resp.enable_chunked_encoding()
    return resp, False


def _gzip_bomb(request: web.Request) -> tuple[web.StreamResponse, bool]:
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    return web.Response(body=gzip.compress(b" " * (80 * 2**20)), headers=headers), True


def _double_gzip_bomb(request: web.Request) -> tuple[web.StreamResponse, bool]:
    """Two codings: 10 KB that inflates to 80 MB, through each layer in turn (it went
    whole through httpx's decoders: 1.6 GB for 3 KB; found by a hunt)."""
    headers = {"content-type": "application/json", "content-encoding": "gzip, gzip"}
    body = gzip.compress(gzip.compress(b" " * (80 * 2**20), compresslevel=9))
    return web.Response(body=body, headers=headers), True


@pytest.mark.parametrize(
    "serve", [_announcing_4_gb, _chunked_for_ever, _gzip_bomb, _double_gzip_bomb]
)
def test_an_answer_larger_than_the_cap_is_malformed_not_held(
    run: Callable[..., Any], serve: Callable[[web.Request], tuple[web.StreamResponse, bool]]
) -> None:
    """A server that announced 4 GB and sent on held 2.6 GB for one call until its
    total timeout; a gzip bomb decodes to whatever it likes."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp, whole = serve(request)
        if whole:
            return resp
        await resp.prepare(request)
        chunk = b" " * 2**20
        with contextlib.suppress(ConnectionError):
            for _ in range(MAX_ANSWER_BYTES // len(chunk) + 64):
                await resp.write(chunk)
        return resp

    with WireServer(handle) as srv:
        result = run(model(srv.base_url, timeout=Timeouts(total=WAIT_S)))
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.MALFORMED_RESPONSE
    assert "the answer is larger than 64 MB" in result.detail


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_compressed_stream_that_inflates_far_leaves_the_loop_to_other_calls(
    transport: str,
) -> None:
    """300 KB of gzip inflating to 300 MB of blank lines was decoded a read at a time on
    the I/O loop: 35 s in which no call of any model moved (found by a hunt). It is read
    in bounded pieces, other calls running between them: another model's call ends
    while this stream is still being read."""
    events = openai_stream(["x", "y"])
    body = gzip.compress(b"".join(events[:2]) + b"\n" * (2 * 2**20) + b"".join(events[2:]))

    async def bomb(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.Response(body=body, headers={**SSE_HEADERS, "content-encoding": "gzip"})

    ended: list[str] = []
    with WireServer(bomb) as slow, WireServer(answer()) as quick:
        a = model(slow.base_url, name="a", transport=transport)
        b = model(quick.base_url, name="b", transport=transport)
        with running(a, b) as system:
            stream = system.stream("hi", model="a")
            deltas = iter(stream)
            assert next(d.text for d in deltas if d.text) == "x"  # the rest is being read

            def read_on() -> None:
                texts = [d.text for d in deltas]
                ended.append("a:" + "".join(texts))

            reader = threading.Thread(target=read_on)
            reader.start()
            assert isinstance(system.submit("hi", model="b").result(WAIT_S), Completed)
            ended.append("b")
            reader.join(WAIT_S)
    assert ended == ["b", "a:y"]


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


def _logprobs(tokens: int, alternatives: int) -> dict[str, Any]:
    """A choice's logprobs: ``tokens`` entries, each with ``alternatives`` ranked."""
    ranked = [{"token": "b", "logprob": -1.5, "bytes": [98]}] * alternatives
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": ranked}
    return {"content": [entry] * tokens, "refusal": None}


def test_a_heavy_answer_is_read_on_a_worker_thread_not_the_io_loop(
    run: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 150-byte request for 128 choices with 20 logprobs a token made a 57 MB answer,
    decoded, redacted, parsed and looked through on the I/O loop, which every other
    call (and a gateway's requests) shares: 4-5 s with nothing else served (found by a
    hunt). One of ``HEAVY_ANSWER`` bytes or more is read on a worker thread; an
    ordinary one where it arrives, with no hand-over."""
    readers: list[tuple[str, int]] = []
    received = http._received

    def spy(raw: bytes, **options: Any) -> Any:
        readers.append((threading.current_thread().name, len(raw)))
        return received(raw, **options)

    monkeypatch.setattr(http, "_received", spy)
    small = completion_body(content="hi", usage=USAGE)
    heavy = completion_body(content="hi", usage=USAGE)
    heavy["choices"] = [
        {**heavy["choices"][0], "index": i, "logprobs": _logprobs(100, 20)} for i in range(24)
    ]
    assert len(json.dumps(heavy)) >= HEAVY_ANSWER
    with WireServer(
        replying(lambda n, _: (200, {}, json.dumps([small, heavy][n]).encode()))
    ) as srv:
        settings = model(srv.base_url, api_key=KEY)  # a key registered: logprobs looked through
        system = System(SystemConfig(models=(settings,)))
        try:
            first = system.submit("hi", model="m").result(WAIT_S)
            second = system.submit("hi", model="m", n=4, logprobs=True, top_logprobs=20)
            result = second.result(WAIT_S)
        finally:
            system.stop(timeout=10)
    assert isinstance(first, Completed), first
    assert isinstance(result, Completed), result
    assert [len(c.logprobs["content"]) for c in result.choices if c.logprobs] == [100] * 24
    assert result.choices[3].logprobs == heavy["choices"][3]["logprobs"]
    (loop, _), (worker, size) = readers
    assert loop == "callboard-io"  # the small one: where it arrived
    assert size >= HEAVY_ANSWER
    assert worker != "callboard-io"


def test_a_heavy_answer_all_here_is_not_cut_by_a_timeout_while_it_is_read(
    run: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2xx read whole, billed, was parsed within the call's timeout: a total timeout
    or deadline landing in a parse of seconds made it ``Failed(timeout)``, and a retry
    paid for it again (a review). Once it is all here, its read is not cut."""
    received = http._received

    def slow(raw: bytes, **options: Any) -> Any:
        threading.Event().wait(1.5)  # a 57 MB parse on a busy machine: seconds
        return received(raw, **options)

    monkeypatch.setattr(http, "_received", slow)
    heavy = completion_body(content="hi", usage=USAGE)
    heavy["choices"] = [
        {**heavy["choices"][0], "index": i, "logprobs": _logprobs(100, 20)} for i in range(24)
    ]
    body = json.dumps(heavy).encode()
    assert len(body) >= HEAVY_ANSWER
    with WireServer(replying(lambda n, _: (200, {}, body))) as srv:
        settings = model(srv.base_url, timeout=Timeouts(total=1.0))
        system = System(SystemConfig(models=(settings,)))
        try:
            result = system.submit("hi", model="m", n=4).result(WAIT_S)
        finally:
            system.stop(timeout=10)
    assert isinstance(result, Completed), result
    assert result.attempts == 1


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(value=JSON_VALUES, spaced=st.booleans())
def test_a_heavy_answer_read_a_piece_at_a_time_is_the_same_json(value: Any, spaced: bool) -> None:
    """``_piecewise`` reads the containers near the top itself and each value below
    them in one call into C (a whole parse in C keeps every other thread waiting for
    its end): the same value as one parse, whatever the nesting and the spacing."""
    text = json.dumps(value, indent=1 if spaced else None)
    assert http._piecewise(text) == http._JSON.decode(text)
    assert http._piecewise(f" \n{text}\t ") == http._JSON.decode(text)


@pytest.mark.parametrize(
    "text",
    ['{"a":[1,2', '{"a":[{"b":NaN}]}', '[{"a":1}] x', "", " ", '{"a" 1}', '[[{"a":1},]]', "[{]"],
)
def test_a_heavy_answer_that_is_not_json_fails_as_one_parse_does(text: str) -> None:
    with pytest.raises(ValueError, match=r".") as whole:
        http._JSON.decode(text)
    with pytest.raises(ValueError, match=r".") as pieces:
        http._piecewise(text)
    assert str(pieces.value) == str(whole.value)


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


LONG_CONTEXT = (
    "This model's maximum context length is 128000 tokens. However, your messages "
    "resulted in 150011 tokens (149000 in the messages, 1011 in the functions). "
    "Please reduce the length of the messages or functions."
)
QUOTA = (
    "You exceeded your current quota, please check your plan and billing details. "
    "For more information on this error, read the docs: "
    "https://platform.openai.com/docs/guides/error-codes/api-errors."
)


@pytest.mark.parametrize(
    ("status", "error", "reason"),
    [
        (
            400,
            openai_error(LONG_CONTEXT, "invalid_request_error", "context_length_exceeded")["error"]
            | {"param": "messages"},
            FailureReason.REQUEST_ERROR,
        ),
        (
            429,
            openai_error(QUOTA, "insufficient_quota", "insufficient_quota")["error"],
            FailureReason.QUOTA_EXCEEDED,
        ),
    ],
    ids=["context_length_exceeded", "insufficient_quota"],
)
def test_a_long_pretty_printed_error_body_keeps_its_code_and_param(
    run: Callable[..., Any], status: int, error: dict[str, Any], reason: FailureReason
) -> None:
    """OpenAI's error bodies come indented: cut as text at the detail's 300 characters,
    one lost its code and param (the gateway then answered ``provider_refused_request``
    with a JSON fragment as its message; found by a hunt), and a quota refusal whose
    mark fell past the cut would be retried as a rate limit. The detail is the error
    object, compact, its message cut to fit."""
    body = json.dumps({"error": error}, indent=4).encode()
    assert len(body) > 300

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.Response(status=status, body=body, content_type="application/json")

    with WireServer(handle) as srv:
        result = run(model(srv.base_url))
    assert isinstance(result, Failed), result
    assert result.reason is reason
    assert len(result.detail) <= 300
    said = json.loads(result.detail)["error"]
    assert {k: said.get(k) for k in ("type", "param", "code")} == {
        k: error.get(k) for k in ("type", "param", "code")
    }
    assert error["message"].startswith(said["message"])
    assert len(said["message"]) > 100


@pytest.mark.parametrize(
    ("message", "kept"),
    [
        ('"' * 1000, 100),  # each escapes to two characters: half the room, not nothing
        ("\\" * 1000, 100),
        ("é" * 1000, 200),  # not escaped (the detail is text, not ASCII)
        ("a\nb\u2028c\ud800d" * 100, 200),  # unprintable, a lone surrogate: spaces
    ],
    ids=["quotes", "backslashes", "accents", "unprintable"],
)
def test_an_error_messages_head_is_kept_as_long_as_it_fits_escaped(message: str, kept: int) -> None:
    """The cut took off what the escaped text was over by, in characters of the
    message: a message of quotes came out empty (found by a review)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"}})
    detail = _error_detail(body)
    assert len(detail) <= 300
    said = json.loads(detail)["error"]["message"]
    assert len(said) >= kept
    assert said.encode("utf-8")  # no lone surrogate
    assert "\n" not in said


@pytest.mark.parametrize(
    "body",
    [
        '{"error": "a string"}',
        '{"error": {"message": 3}}',
        '["error"]',
        '{"error": {"message": "m", "code": "' + "c" * 400 + '"}}',
    ],
    ids=["error-string", "message-number", "list", "code-too-long"],
)
def test_an_error_body_that_is_not_an_error_object_that_fits_is_cut_as_text(body: str) -> None:
    assert _error_detail(body) == body[:300]


def test_a_long_error_bodys_detail_is_its_head_with_a_key_there_hidden_whole() -> None:
    """Only the head of a long body is read (a 60 MB one, redacted whole to keep 300
    characters, held the I/O loop for 15 s; found by a hunt), but far enough past the
    cut that a key it cuts through is still hidden, not shown in part."""
    redact.register([KEY])
    body = "x" * 290 + KEY + " sk-" * 5_000_000
    detail = _error_detail(body)
    assert detail == ("x" * 290 + "***" + " sk-" * 2)[:300]
    assert KEY[:5] not in detail


def test_a_key_in_an_error_bodys_message_or_code_is_hidden(run: Callable[..., Any]) -> None:
    said = {"error": {"message": f"bad key {KEY}", "type": "invalid_request_error", "code": KEY}}

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.json_response(said, status=400)

    with WireServer(handle) as srv:
        result = run(model(srv.base_url, api_key=KEY))
    assert isinstance(result, Failed), result
    assert KEY not in result.detail
    assert json.loads(result.detail)["error"]["message"].startswith("bad key ")


def test_an_anthropic_error_body_keeps_its_shape_in_the_detail(run: Callable[..., Any]) -> None:
    body = json.dumps(anthropic_error("overloaded_error", "Overloaded " * 40), indent=2).encode()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.Response(status=400, body=body, content_type="application/json")

    with WireServer(handle) as srv:
        result = run(model(srv.base_url))
    assert isinstance(result, Failed), result
    said = json.loads(result.detail)
    assert said["type"] == "error"
    assert said["error"]["type"] == "overloaded_error"
    assert said["error"]["message"].startswith("Overloaded Overloaded")


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


async def _stalling_2xx(request: web.Request, arrival: Arrival) -> web.StreamResponse:
    """A 200 whose body starts, then stalls until its client hangs up (``WAIT_S`` at most)."""
    resp = web.StreamResponse(headers={"content-type": "application/json"})
    await resp.prepare(request)
    await resp.write(b'{"choices": [')
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.Event().wait(), WAIT_S)
    return resp


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_body_that_stalls_is_cut_by_the_read_timeout_not_the_total(
    run: Callable[..., Any], transport: str
) -> None:
    """On the default transport aiohttp's read timeout comes as is (it is a
    ``TimeoutError`` too): a read timeout, not the total's."""
    with WireServer(_stalling_2xx) as srv:
        timeout = Timeouts(connect=5, read=0.3, total=WAIT_S * 2)
        result = run(model(srv.base_url, timeout=timeout, transport=transport))
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.TIMEOUT
    assert "total timeout" not in result.detail, result.detail
    assert result.latency_s < WAIT_S / 2


@pytest.mark.parametrize("cut_by", ["read", "total"])
def test_a_2xx_whose_body_stalls_past_a_timeout_is_charged_as_answered(
    run: Callable[..., Any], cut_by: str
) -> None:
    """A completion's 2xx comes once it is made: billed. Its body stalled past the read
    timeout, or the total's, was charged nothing and sent again (found by a hunt)."""
    read, total = (0.3, WAIT_S * 2) if cut_by == "read" else (WAIT_S * 2, 0.5)
    with WireServer(_stalling_2xx) as srv:
        timeout = Timeouts(connect=5, read=read, total=total)
        result = run(model(srv.base_url, timeout=timeout, price=Price(1, 2)), max_tokens=30)
    assert isinstance(result, Failed), result
    assert (result.reason, result.status_code) == (FailureReason.TIMEOUT, 200)
    assert result.usage.estimated
    assert result.usage.completion_tokens == 30
    assert result.cost_usd > 0


@pytest.mark.parametrize("streamed", [False, True])
def test_a_json_answer_whose_body_breaks_off_is_charged_as_answered(streamed: bool) -> None:
    """A server that ignores ``stream`` answers a whole JSON completion: cut halfway, its
    200 stands and it is charged its estimate, streamed or not (streamed, once such a
    body was read as a stream's, it was a bare connection error, charged nothing; a
    review)."""
    body = json.dumps(completion_body(content="x" * 5000, usage=USAGE)).encode()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[: len(body) // 2])
        conn = request.transport
        assert conn is not None
        conn.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        conn.close()
        return resp

    with WireServer(handle) as srv, running(model(srv.base_url, price=Price(1, 2))) as cb:
        asked = (cb.stream if streamed else cb.submit)("hi", model="m", max_tokens=100)
        result = asked.result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.status_code == 200
    assert "broke off" in result.detail
    assert result.cost_usd > 0


@pytest.mark.parametrize("cut_by", ["read", "total"])
def test_a_stream_that_stalls_before_its_first_token_is_not_charged(cut_by: str) -> None:
    """A stream's head comes before its first token is made: one cut then was not billed.
    Charged at the total timeout (and not at the read's) by the fix for plain answers
    that stall (found by a review)."""

    async def stall(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), WAIT_S)
        return resp

    read, total = (0.3, WAIT_S * 2) if cut_by == "read" else (WAIT_S * 2, 0.5)
    with WireServer(stall) as srv:
        timeout = Timeouts(connect=5, read=read, total=total)
        with running(model(srv.base_url, timeout=timeout, price=Price(1, 2))) as cb:
            result = cb.stream("hello", model="m", max_tokens=30).result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.TIMEOUT
    assert result.cost_usd == 0, result


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_event_stream_labelled_json_is_read_as_it_arrives_and_ends_at_its_last_event(
    transport: str,
) -> None:
    """A proxy that labels a stream ``application/json``: its deltas reach the reader as
    they come, the total timeout stops at the first, and the stream ends at ``[DONE]``
    though the server holds the body open. It was read to the body's end before its
    first delta: a stream longer than the total timeout failed on every retry, each
    billed, and one held open failed at the read timeout (found by a hunt)."""
    first_read = Cue()
    events = openai_stream(["Hel", "lo"])

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request, {"content-type": "application/json"})
        await resp.write(events[0] + events[1])
        if await first_read.wait():  # the rest only once the reader has the first delta
            for event in events[2:]:
                await resp.write(event)
            await asyncio.sleep(WAIT_S)  # and the body held open after [DONE]
        return resp

    timeout = Timeouts(connect=5, read=WAIT_S, total=0.5)
    with WireServer(handle) as srv:
        settings = model(srv.base_url, transport=transport, timeout=timeout, price=Price(1, 2))
        with running(settings) as cb:
            stream = cb.stream("hi", model="m", max_tokens=20)
            deltas = [next(iter(stream))]
            time.sleep(0.6)  # past the total timeout: it stopped counting at the delta
            first_read.set()
            deltas += list(stream)
            result = stream.result(WAIT_S)
            sent = srv.count()
    assert isinstance(result, Completed), result
    assert "".join(d.text for d in deltas) == result.content == "Hello"
    assert result.latency_s < WAIT_S / 2, "ended at [DONE], not at the body's end"
    assert sent == 1


@pytest.mark.parametrize(
    ("body", "label", "said"),
    [
        (b"", "text/event-stream", "not an event stream (Content-Type: text/event-stream)"),
        (b"<html>502 Bad Gateway</html>", "text/html", "(Content-Type: text/html)"),
        (sse(chunk({"role": "assistant"})), "text/event-stream", "before its last event"),
    ],
    ids=["empty", "html", "role-only"],
)
def test_a_stream_that_ends_before_its_first_token_is_retried_and_not_charged(
    body: bytes, label: str, said: str
) -> None:
    """A 200 to a streamed call that ends before any token: an empty body, a proxy's
    page, a stream with its role chunk alone. Nothing was made, as for a stream cut or
    stalled then: it is not charged (each of 3 calls was charged all of ``max_tokens``),
    and the detail says what came."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.Response(body=body, headers={"Content-Type": label})

    retry = RetryConfig(max_attempts=3, initial_s=0.01, max_s=0.01, jitter_s=0)
    with (
        WireServer(handle) as srv,
        running(model(srv.base_url, price=Price(1, 2), retry=retry)) as cb,
    ):
        result = cb.stream("hello", model="m", max_tokens=30).result(WAIT_S)
        sent = srv.count()
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.MALFORMED_RESPONSE
    assert said in result.detail, result.detail
    assert result.cost_usd == 0, result
    assert sent == 3


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


def _served_over_tls(ca: trustme.CA) -> ssl.SSLContext:
    """A loopback server's TLS context: a certificate of ``ca`` for 127.0.0.1."""
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(served)
    return served


def _trust(ca: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``SSL_CERT_FILE`` naming a file of ``ca``'s certificate alone; the file."""
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    return ca_file


def _one_call(settings: ModelSettings) -> Any:
    """The result of one call on a system of its own, stopped before this returns (a
    TLS connection left open as its loopback server's loop ended leaked its socket)."""
    system = System(SystemConfig(models=(settings,)))
    try:
        return system.submit("hi", model=settings.name).result(WAIT_S)
    finally:
        system.stop(timeout=10)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_server_over_tls_is_verified_by_the_cas_the_environment_names(
    transport: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The aiohttp transports of the process share one TLS context (each made its own,
    and loading the CAs was 90% of starting a system), made again when the environment
    names other CAs; an httpx transport makes its own. A server whose certificate no CA
    vouches for is refused; once ``SSL_CERT_FILE`` names its CA, it is served."""
    ca = trustme.CA()
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # certifi's CAs: none of them
    answering = answer(completion_body(content="over tls"))
    with WireServer(answering, ssl_context=_served_over_tls(ca)) as srv:
        refused = _one_call(model(srv.base_url, transport=transport))
        assert isinstance(refused, Failed), refused
        assert "certificate verify failed" in refused.detail, refused.detail
        assert srv.arrivals == []
        _trust(ca, tmp_path, monkeypatch)
        served = _one_call(model(srv.base_url, transport=transport))
    assert isinstance(served, Completed), served
    assert served.content == "over tls"


def test_an_httpx_transports_context_is_not_the_one_aiohttp_connects_with(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """httpcore sets the ALPN protocols of its context at each connection it makes,
    ``h2`` too for an HTTP/2 model: shared with aiohttp's sessions, the context would
    have them offer ``h2``, and a server that prefers it chose it for a connection
    aiohttp then spoke HTTP/1.1 on (a review). Here an httpx transport's context
    offers it, as httpcore leaves it for an HTTP/2 model, and an aiohttp model is
    still served by such a server."""
    ca = trustme.CA()
    prefers_h2 = _served_over_tls(ca)
    prefers_h2.set_alpn_protocols(["h2", "http/1.1"])
    _trust(ca, tmp_path, monkeypatch)
    httpx_transport = make_transport(model("http://127.0.0.1:9/v1", transport="httpx"))
    assert isinstance(httpx_transport, httpx.AsyncHTTPTransport)
    httpx_tls = httpx_transport._pool._ssl_context  # what httpcore connects with
    assert httpx_tls is not None
    assert httpx_tls is not http.verified_tls()
    httpx_tls.set_alpn_protocols(["http/1.1", "h2"])  # as httpcore does for HTTP/2

    async def as_h2_servers_do(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        """An HTTP/1.1 request on a connection that chose ``h2`` is a protocol error to
        such a server (nginx closes it): the connection is cut, nothing answered."""
        tls = request.transport.get_extra_info("ssl_object") if request.transport else None
        if tls is None or tls.selected_alpn_protocol() == "h2":
            assert request.transport is not None
            request.transport.abort()
            raise ConnectionResetError("h2 was chosen: an HTTP/1.1 request is an error")
        return web.json_response(completion_body(content="http/1.1"))

    with WireServer(as_h2_servers_do, ssl_context=prefers_h2) as srv:
        result = _one_call(model(srv.base_url))
    assert isinstance(result, Completed), result
    assert result.content == "http/1.1"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("damage", ["missing", "garbage", "a folder"])
def test_cas_that_cannot_be_loaded_are_a_config_error_naming_where(
    transport: str, damage: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A missing or damaged ``SSL_CERT_FILE`` raised a bare ``FileNotFoundError`` (or
    ``SSLError``) out of a system's start, naming neither the variable nor the file;
    the CLI printed a traceback (a hunt)."""
    where = tmp_path / "ca.pem"
    if damage == "garbage":
        where.write_text("not a certificate\n")
    elif damage == "a folder":
        where.mkdir()
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", str(where))
    with pytest.raises(ConfigError, match="SSL_CERT_FILE") as raised:
        System(SystemConfig(models=(model("https://127.0.0.1:9/v1", transport=transport),)))
    assert str(where) in str(raised.value)


def test_an_ssl_cert_dir_that_is_no_folder_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A missing ``SSL_CERT_DIR`` was taken without a word, and every https call then
    failed to verify its server (a hunt)."""
    missing = tmp_path / "no-such-certs"
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv("SSL_CERT_DIR", str(missing))
    with pytest.raises(ConfigError, match="SSL_CERT_DIR") as raised:
        System(SystemConfig(models=(model("https://127.0.0.1:9/v1"),)))
    assert str(missing) in str(raised.value)


def test_systems_started_at_once_on_many_threads_share_one_tls_context(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Made without a lock, eight threads' first transports made eight (a hunt)."""
    _trust(trustme.CA(), tmp_path, monkeypatch)  # a path of its own: no context made yet
    at_once = threading.Barrier(8)

    def first() -> ssl.SSLContext:
        at_once.wait(WAIT_S)
        return http.verified_tls()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: first(), range(8)))
    assert len({id(context) for context in made}) == 1


def test_the_transports_of_a_process_share_its_tls_context() -> None:
    first = make_transport(model("http://127.0.0.1:9/v1"))
    second = make_transport(model("http://127.0.0.1:9/v1", name="other"))
    assert isinstance(first, AiohttpTransport)
    assert isinstance(second, AiohttpTransport)
    assert first.ssl_context is second.ssl_context is http.verified_tls()
    assert first.ssl_context.verify_mode is ssl.CERT_REQUIRED
    assert first.ssl_context.check_hostname


def test_the_httpx_transport_goes_through_the_configured_proxy(run: Callable[..., Any]) -> None:
    with WireServer(answer(completion_body(content="via proxy", usage=USAGE))) as proxy:
        unreachable = f"http://127.0.0.1:{_closed_port()}/v1"
        result = run(model(unreachable, transport="httpx", proxy=proxy.root))
    assert isinstance(result, Completed), result
    assert result.content == "via proxy"


def test_an_aiohttp_transport_passed_in_with_a_proxy_goes_through_it() -> None:
    """Calls on the default transport skip ``handle_async_request``, which is where
    httpx-aiohttp applies a proxy: one passed in with a proxy still goes through it."""
    with WireServer(answer(completion_body(content="via proxy", usage=USAGE))) as proxy:
        unreachable = f"http://127.0.0.1:{_closed_port()}/v1"

        async def run() -> CallResult:
            done: asyncio.Future[CallResult] = asyncio.get_running_loop().create_future()

            def deliver(msg: CallsDone) -> None:
                if not done.done():
                    done.set_result(msg.results[0])

            transport = AiohttpTransport(proxy=httpx.Proxy(proxy.root))
            settings = ModelSettings(name="m", base_url=unreachable)
            client = ModelClient(settings, incarnation=1, deliver=deliver, transport=transport)
            try:
                client.start([(1, 1, b"{}", None, 0, None)])
                return await asyncio.wait_for(done, WAIT_S)
            finally:
                await client.aclose(close_transport=True)

        result = asyncio.run(run())
    assert (result.error, result.content) == (None, "via proxy")


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
def test_a_refused_connection_says_so_not_connect_timeout(
    run: Callable[..., Any], transport: str
) -> None:
    result = run(model(f"http://127.0.0.1:{_closed_port()}/v1", transport=transport))
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.CONNECTION
    assert result.detail.startswith("connection refused: "), result.detail
    assert "Timeout" not in result.detail


_OUT_OF_DESCRIPTORS = """
import json, os, resource
from callboard import Completed, Failed, ModelSettings, RetryConfig, System, SystemConfig
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # a hard limit: nothing to raise
m = ModelSettings(name="m", base_url=BASE_URL, retry=RetryConfig(max_attempts=1))
with System(SystemConfig(models=(m,))) as cb:
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    failed = [cb.submit(f"call {i}", model="m").result(60) for i in range(8)]
    breaker = cb.stats().models["m"]["breaker"]
    for fd in held:
        os.close(fd)
    after = cb.submit("after", model="m").result(60)
ended = [(type(r).__name__, getattr(r, "reason", None), getattr(r, "detail", "")) for r in failed]
print(json.dumps({"failed": ended, "breaker": breaker, "after": type(after).__name__}, default=str))
"""


def test_out_of_file_descriptors_fails_the_calls_and_leaves_the_breaker_closed() -> None:
    """A process out of descriptors cannot open a connection: its calls fail, retried as
    any connection (here: not), but the provider is not taken for down (eight such
    failures opened the breaker of a healthy one; found by a hunt)."""
    with WireServer(answer(completion_body(usage=USAGE))) as srv:
        printed = fresh(_OUT_OF_DESCRIPTORS.replace("BASE_URL", repr(srv.base_url)))
    said = json.loads(printed.strip().splitlines()[-1])
    assert said["breaker"] == "closed", said
    for kind, reason, detail in said["failed"]:
        assert (kind, reason) == ("Failed", "FailureReason.LOCAL_RESOURCES"), said
        assert "out of file descriptors" in detail, detail
    assert said["after"] == "Completed"


def _connect_error(attempts: ExceptionGroup[OSError]) -> httpx.ConnectError:
    """httpx's own transport's error for a host of several addresses: anyio's one
    error, the attempts' errors in a group under it."""
    anyio_error = OSError("All connection attempts failed")
    anyio_error.__cause__ = attempts
    error = httpx.ConnectError("All connection attempts failed")
    error.__cause__ = anyio_error
    return error


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (httpx.ConnectTimeout(""), "ConnectTimeout: no connection within the connect timeout"),
        (httpx.ReadTimeout(""), "ReadTimeout: no answer within the read timeout"),
        (httpx.ConnectError(""), "ConnectError: no more said"),
        (httpx.ConnectTimeout("timed out"), "ConnectTimeout: timed out"),
    ],
)
def test_a_transport_error_that_says_nothing_still_says_what_it_was(
    error: httpx.TransportError, said: str
) -> None:
    """httpx's own transport raised ``ConnectTimeout('')``: the call's detail read
    ``ConnectTimeout: `` (a hunt)."""
    assert http.transport_error(error)[1] == said


def test_out_of_descriptors_for_every_address_of_a_host_is_this_process_s_failure() -> None:
    """Under httpx's own transport the attempts' EMFILEs were in a group the walk down
    the chain did not look into: read as the provider's failure (a review)."""
    emfile = OSError(errno.EMFILE, "Too many open files")
    kind, said = http.transport_error(_connect_error(ExceptionGroup("", [emfile, emfile])))
    assert kind == "local"
    assert "out of file descriptors" in said
    refused = OSError(errno.ECONNREFUSED, "Connection refused")
    mixed = _connect_error(ExceptionGroup("", [emfile, refused]))
    assert http.transport_error(mixed)[0] == "connection"  # not all of them this process's


# -- the key never leaves ------------------------------------------------------


def _lower_hex(text: str) -> str:
    """``text`` percent-escaped as .NET's ``HttpUtility.UrlEncode`` writes it."""
    quoted = urllib.parse.quote(text, safe="")
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), quoted)


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
        pytest.param(  # .NET's HttpUtility.UrlEncode: lower-case hex
            lambda k: json.dumps({"error": {"message": f"bad key {_lower_hex(k)}"}}),
            id="percent-lower-case",
        ),
        pytest.param(  # Go's url.PathEscape: ``/`` escaped, ``+`` and ``=`` not
            lambda k: json.dumps(
                {"error": {"message": f"bad key {urllib.parse.quote(k, safe='+=')}"}}
            ),
            id="percent-some",
        ),
        pytest.param(  # Go's html/template: ``+`` as ``&#43;``
            lambda k: json.dumps({"error": {"message": f"bad key {k.replace('+', '&#43;')}"}}),
            id="html-reference",
        ),
        pytest.param(  # a query value's ``+`` decoded as a space
            lambda k: json.dumps({"error": {"message": f"bad key {k.replace('+', ' ')}"}}),
            id="plus-as-space",
        ),
        pytest.param(  # a server wrapping its text broke the key (found by a hunt)
            lambda k: json.dumps({"error": {"message": f"bad key {k[:12]}\n{k[12:]}"}}),
            id="wrapped",
        ),
        pytest.param(
            lambda k: json.dumps({"error": {"message": f"bad key {k[:9]}\r\n    {k[9:]}"}}),
            id="wrapped-crlf-indented",
        ),
        pytest.param(
            lambda k: json.dumps({"error": {"message": f"BAD KEY {k.upper()}"}}),
            id="upper-cased",
        ),
        pytest.param(  # made one line after it was hidden, the break became a space (a review)
            lambda k: json.dumps({"error": {"message": f"bad key {k[:12]}\u2028{k[12:]}"}}),
            id="line-separator",
        ),
        pytest.param(
            lambda k: json.dumps({"error": {"message": "bad", "code": f"{k[:12]}\x0c{k[12:]}"}}),
            id="form-feed-in-the-code",
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
    everything = (repr(result) + result.detail + caplog.text).lower()
    assert "wire" not in everything, result.detail
    assert "0123456789abcdef" not in everything, result.detail


def test_an_error_body_with_line_breaks_and_escapes_is_one_line_in_the_result_and_the_log(
    run: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A provider's error body echoing the prompt is written in log lines: a line break
    in it began a forged record, and a terminal escape could rewrite the screen."""
    forged = "2026-12-03 09:00:00,000 CRITICAL callboard.gateway.server FORGED"
    body = f"<html>\n{forged}\r\n\x1b[2Jcleared\u2028next</html>".encode()
    with caplog.at_level(logging.DEBUG), WireServer(answer(body, status=400)) as srv:
        result = run(model(srv.base_url))
    assert isinstance(result, Failed), result
    assert forged in result.detail
    assert not set("\n\r\x1b\u2028") & set(result.detail), result.detail
    for record in caplog.records:
        assert not record.getMessage().count(forged) or "\n" not in record.getMessage()


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


AZURE_FILTERED = {
    "error": {
        "message": "The response was filtered",
        "type": None,
        "param": "prompt",
        "code": "content_filter",
        "status": 400,
    }
}
"""Azure's content filter's error object (its docs: a guardrail error instead of the
content), whose status is in the object itself."""


@pytest.mark.parametrize("streamed", [False, True])
def test_azures_content_filter_in_a_200_or_a_stream_is_a_refused_request(
    streamed: bool,
) -> None:
    """As its unstreamed 400 is: the request's fault, sent once, the breaker untouched.
    Read as a malformed answer it was sent four times and opened the breaker, one
    caller's filtered prompt taking the model from everyone (found by a hunt)."""
    handler = sending([sse(AZURE_FILTERED)]) if streamed else answer(AZURE_FILTERED)
    breaker = BreakerConfig(consecutive_failures=1)
    with WireServer(handler) as srv:
        settings = model(
            srv.base_url, retry=RetryConfig(max_attempts=4, initial_s=0.01), breaker=breaker
        )
        with running(settings) as cb:
            results = [  # the second is sent too: the breaker (one outage opens it) stayed
                (cb.stream if streamed else cb.submit)("hello", max_tokens=30).result(WAIT_S)
                for _ in range(2)
            ]
        sent = len(srv.arrivals)
    for result in results:
        assert isinstance(result, Failed), result
        assert result.reason is FailureReason.REQUEST_ERROR, result
        assert "filtered" in result.detail
    assert sent == 2  # once each, never retried


@pytest.mark.parametrize("streamed", [False, True])
def test_a_mistral_reasoning_models_content_parts_are_its_answer(streamed: bool) -> None:
    """Magistral answers ``content`` as ``text`` and ``thinking`` parts: every answer
    failed malformed, sent four times, each an outage (found by a hunt)."""
    thinking = {"type": "thinking", "thinking": [{"type": "text", "text": "2+2 is 4."}]}
    parts = [thinking, {"type": "text", "text": "It is 4."}]
    body = {**completion_body(usage=USAGE)}
    body["choices"] = [
        {"index": 0, "message": {"role": "assistant", "content": parts}, "finish_reason": "stop"}
    ]
    events = [sse(chunk({"role": "assistant", "content": [thinking]}))]
    events += [sse(chunk({"content": [parts[1]]})), sse(chunk({}, finish_reason="stop"))]
    events += [sse(chunk(usage=USAGE, choices=False)), sse("[DONE]")]
    with WireServer(sending(events) if streamed else answer(body)) as srv:
        with running(model(srv.base_url)) as cb:
            result = (cb.stream if streamed else cb.submit)("2+2?").result(WAIT_S)
        sent = len(srv.arrivals)
    assert isinstance(result, Completed), result
    assert result.content == "It is 4."
    assert sent == 1
    assert result.raw is not None
    if streamed:  # the assembled answer; unstreamed, the body as received
        assert result.raw["choices"][0]["message"]["reasoning_content"] == "2+2 is 4."
    else:
        assert result.raw["choices"][0]["message"]["content"] == parts


def _openrouter_error(code: int) -> dict[str, Any]:
    """OpenRouter's error after its stream has begun (its docs, "Errors during
    streaming"): a chunk with the error beside a choice that ends ``"error"``."""
    return {
        **chunk({"content": ""}, finish_reason="error"),
        "error": {"code": code, "message": "Provider disconnected unexpectedly"},
    }


@pytest.mark.parametrize("text_first", [False, True])
def test_an_error_beside_a_streams_choice_ends_the_call_as_the_openai_sdk_reads_it(
    text_first: bool,
) -> None:
    """Any truthy ``error`` in an event is the provider's error, as the openai SDK reads
    it, beside ``choices`` too (OpenRouter's): read as a chunk, the partial text came
    back ``Completed`` as the whole answer, finish ``error`` (found by a hunt). Before
    any text: its code (502) says retry; after: cut, the text the reader got kept."""
    events = [sse(chunk({"role": "assistant", "content": ""}))]
    events += [sse(chunk({"content": "The first half"}))] if text_first else []
    events += [sse(_openrouter_error(502)), sse("[DONE]")]
    with WireServer(sending(events)) as srv:
        settings = model(srv.base_url, retry=RetryConfig(max_attempts=2, initial_s=0.01))
        with running(settings) as cb:
            result = cb.stream("hello").result(WAIT_S)
        sent = len(srv.arrivals)
    assert isinstance(result, Failed), result
    if text_first:
        assert result.reason is FailureReason.STREAM_CUT, result
        assert result.partial_text == "The first half"
        assert sent == 1
    else:
        assert result.reason is FailureReason.PROVIDER_ERROR, result
        assert sent == 2  # retried, as a 502 is
    assert "Provider disconnected" in result.detail


@pytest.mark.parametrize("failed", [False, True])
def test_a_whole_bodys_error_beside_its_choices_fails_it_only_where_a_choice_says_so(
    failed: bool,
) -> None:
    """The openai SDK does not look for ``error`` in a whole body: a good answer with an
    ``error`` field besides was failed and sent again once any truthy one was read as
    the provider's error (a review). OpenRouter's, whose choice ends ``"error"``, is."""
    body = {
        **completion_body(usage=USAGE),
        "error": {"code": 502, "message": "Provider disconnected"},
    }
    if failed:
        body["choices"] = [
            {"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "error"}
        ]
    with WireServer(answer(body)) as srv:
        settings = model(srv.base_url, retry=RetryConfig(max_attempts=2, initial_s=0.01))
        with running(settings) as cb:
            result = cb.submit("hello").result(WAIT_S)
        sent = len(srv.arrivals)
    assert result.ok is not failed, result
    assert sent == (2 if failed else 1)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize(
    ("error", "reason", "sent"),
    [
        # vLLM's and llama.cpp's: the status as an integer code (read as malformed:
        # sent 4 times, each an outage; two long prompts had the model given up on)
        (
            {"object": "error", "type": "BadRequestError", "code": 400, "message": "too long"},
            FailureReason.REQUEST_ERROR,
            1,
        ),
        ({"type": "exceed_context_size_error", "code": 400, "message": "too long"}, None, 1),
        ({"type": "NotFoundError", "message": "no such model"}, FailureReason.REQUEST_ERROR, 1),
        # plain words: its own (were "KeyError: 'choices'"), overloaded a server error
        ("model is overloaded, try again later", FailureReason.PROVIDER_ERROR, 3),
    ],
    ids=["vllm", "llama.cpp", "sdk-class", "words"],
)
def test_an_error_objects_status_is_read_as_compatible_servers_write_it(
    streamed: bool, error: Any, reason: FailureReason | None, sent: int
) -> None:
    body = {"error": error}
    handler = sending([sse(body), sse("[DONE]")]) if streamed else answer(body)
    breaker = BreakerConfig(consecutive_failures=2)
    with WireServer(handler) as srv:
        settings = model(
            srv.base_url, retry=RetryConfig(max_attempts=3, initial_s=0.01), breaker=breaker
        )
        with running(settings) as cb:
            result = (cb.stream if streamed else cb.submit)("hello").result(WAIT_S)
            breaker_state = cb.stats().models["m"]["breaker"]
        arrived = len(srv.arrivals)
    assert isinstance(result, Failed), result
    assert result.reason is (reason or FailureReason.REQUEST_ERROR), result
    assert arrived == sent
    said = error if isinstance(error, str) else error["message"]
    assert said in result.detail
    if result.reason is FailureReason.REQUEST_ERROR:
        assert breaker_state == "closed"  # the request's fault, not the model's


@pytest.mark.parametrize(
    ("status", "body"),
    [(200, completion_body(usage=USAGE)), (500, {"error": {"message": "oops"}})],
    ids=["completed", "failed"],
)
def test_a_result_carries_the_providers_request_id(status: int, body: Any) -> None:
    """What OpenAI's support asks for (its ``x-request-id``; the openai SDK's
    ``_request_id``); a failed call had nothing to quote to them."""
    headers = {"x-request-id": "req_7f3e0c2a9b"}
    with (
        WireServer(answer(body, status=status, headers=headers)) as srv,
        running(model(srv.base_url)) as cb,
    ):
        result = cb.submit("hello").result(WAIT_S)
    assert result.ok is (status == 200), result
    assert result.request_id == "req_7f3e0c2a9b"


@pytest.mark.parametrize(
    "said",
    [f"{KEY} " + "x" * 1_000, "x" * 185 + KEY],
    ids=["echoed", "across-the-cut"],
)
def test_a_request_id_is_the_providers_words_bounded_and_redacted(said: str) -> None:
    """A header the server writes: a key it echoes there is hidden (hidden before the
    cut at 200 characters: one across it kept its head, a review)."""
    reply = answer(completion_body(usage=USAGE), headers={"request-id": said})
    with WireServer(reply) as srv, running(model(srv.base_url, api_key=KEY)) as cb:
        result = cb.submit("hello").result(WAIT_S)
    assert result.ok, result
    assert result.request_id is not None
    assert KEY[:12] not in result.request_id
    assert len(result.request_id) <= 200
    assert result.request_id.isprintable(), result.request_id


QUOTA_SPENT = {
    "error": {
        "message": "You exceeded your current quota, please check your plan.",
        "type": "insufficient_quota",
        "code": "insufficient_quota",
    }
}
"""OpenAI's answer for an account out of credit (a 429 that no wait changes)."""


def test_a_request_id_holds_no_control_character() -> None:
    """aiohttp's client takes them in a header (an escape, a DEL), and a gateway writing
    one in its own answer's header answered 500 for a call served and paid (a review)."""
    headers = [(b"X-Request-Id", b"req_\x1b[31mred\x7fdel")]
    _, request_id = _rate_headers(headers)
    assert request_id == "req_ [31mred del"


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"error": {"message": "slow down", "type": "requests", "status": 429}}, "RATE_LIMITED"),
        (QUOTA_SPENT, "QUOTA_EXCEEDED"),  # its detail lacked the type: a rate limit, retried
    ],
    ids=["rate-limit", "quota"],
)
def test_a_200_error_object_is_judged_by_the_status_it_says(
    streamed: bool, body: Any, reason: str
) -> None:
    """A whole 200 body (what a server that ignores ``stream`` answers too) holding a
    429's error object was malformed, an outage helping open the breaker, where the
    same object in an event stream is a rate limit (a review)."""
    retry = RetryConfig(max_attempts=1, max_rate_limited=1)
    with WireServer(answer(body)) as srv, running(model(srv.base_url, retry=retry)) as cb:
        result = (cb.stream if streamed else cb.submit)("hello").result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason[reason], result
    assert body["error"]["message"][:10] in result.detail


@pytest.mark.parametrize("streamed", [False, True])
def test_a_call_is_charged_at_the_service_tier_its_answer_says_served_it(streamed: bool) -> None:
    """OpenAI bills the tier that served a call (its answer's ``service_tier``): a
    priority call was charged the standard price, half its bill (found by a hunt)."""
    usage = {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100}
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    tier = {"service_tier": "priority"}
    events = [
        sse({**head, **tier, "choices": [{"index": 0, "delta": {"content": "hi"}}]}),
        sse({**head, **tier, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        sse({**head, **tier, "choices": [], "usage": usage}),
        b"data: [DONE]\n\n",
    ]
    handler = sending(events) if streamed else answer(completion_body(usage=usage, **tier))
    price = Price("1.25", "10", service_tiers={"priority": Price("2.5", "20")})
    with WireServer(handler) as srv, running(model(srv.base_url, price=price)) as cb:
        send = cb.stream if streamed else cb.submit
        result = send("hello", max_tokens=100, service_tier="priority").result(WAIT_S)
    assert isinstance(result, Completed), result
    assert result.cost_usd == Decimal("0.0045")  # 1,000 in at $2.50, 100 out at $20


UNREADABLE_USAGE = [
    ({"prompt_tokens": 10**23, "completion_tokens": 1}, "prompt_tokens"),  # 10^17 USD a call
    ({"prompt_tokens": 1_000_000_001, "completion_tokens": 1}, "prompt_tokens"),
    ({"prompt_tokens": 10.5, "completion_tokens": 1}, "prompt_tokens"),
    ({"prompt_tokens": "10", "completion_tokens": 1}, "prompt_tokens"),
    ({"prompt_tokens": 10, "completion_tokens": -4}, "completion_tokens"),
    ("twelve", "usage is not an object"),
]


@pytest.mark.parametrize(("usage", "named"), UNREADABLE_USAGE)
def test_an_unreadable_usage_is_charged_the_estimate_and_the_answer_kept(
    usage: Any, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The answer came, so it was billed: failing it ``malformed`` sent it again, each
    attempt billed and none charged; believing ``1e23`` prompt tokens priced one call at
    10^17 USD and spent its budget for good. The answer stays, charged its upper bound
    (prompt and all of ``max_tokens``), marked estimated, and the log says why."""
    body = completion_body(content="paid for", usage=usage)
    retry = RetryConfig(max_attempts=3, initial_s=0.01)
    name = f"m-{uuid.uuid4().hex[:8]}"  # its first unreadable usage: said at once
    with (
        WireServer(answer(body)) as rogue,
        running(model(rogue.base_url, name=name, retry=retry)) as cb,
    ):
        result = cb.submit("hello", max_tokens=30).result(WAIT_S)
        sent = rogue.count()
    assert isinstance(result, Completed), result
    assert result.content == "paid for"
    assert result.usage.estimated
    assert result.usage.completion_tokens == 30
    assert sent == 1
    warned = [r.getMessage() for r in caplog.records if "usage is unreadable" in r.getMessage()]
    assert len(warned) == 1
    assert named in warned[0]
    assert warned[0].startswith(f"{name}: ")


def test_a_model_whose_usage_never_reads_is_said_once_in_a_while_not_once_a_call(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 calls to a server that says its counts as strings made 2,000 warnings,
    none naming the model (found by a hunt)."""
    monkeypatch.setattr(http, "UNREADABLE_USAGE_EVERY", 5)
    body = completion_body(content="ok", usage={"prompt_tokens": "5", "completion_tokens": 1})
    name = f"m-{uuid.uuid4().hex[:8]}"
    with WireServer(answer(body)) as rogue, running(model(rogue.base_url, name=name)) as cb:
        for f in [cb.submit("hello", max_tokens=3) for _ in range(12)]:
            assert isinstance(f.result(WAIT_S), Completed)
    warned = [r.getMessage() for r in caplog.records if "usage is unreadable" in r.getMessage()]
    assert [w.split("(")[-1] for w in warned] == [
        f"{n} answers so far; the stats count each model's estimated calls)" for n in (1, 5, 10)
    ]
    assert all(w.startswith(f"{name}: ") for w in warned)


def test_a_usage_without_completion_tokens_is_charged_the_estimate() -> None:
    """A missing count is an unknown one, as a null one is: as 0 it made the answer free."""
    body = completion_body(content="a long answer " * 50, usage={"prompt_tokens": 10})
    with WireServer(answer(body)) as rogue, running(model(rogue.base_url)) as cb:
        result = cb.submit("hello", max_tokens=700).result(WAIT_S)
    assert isinstance(result, Completed), result
    assert result.usage.estimated
    assert result.usage.completion_tokens == 700


@pytest.mark.parametrize(
    "usage",
    [
        None,
        {},
        {"input_tokens": None, "output_tokens": None},
        {"input_tokens": 10},
        {"input_tokens": 10.7, "output_tokens": 3},
        {"input_tokens": "10", "output_tokens": 3},
        {"input_tokens": -100, "output_tokens": 3, "cache_read_input_tokens": 200},
    ],
)
@pytest.mark.parametrize("streamed", [False, True])
def test_an_anthropic_answer_without_readable_usage_is_charged_its_estimate(
    usage: Any, streamed: bool
) -> None:
    """Read as zeros (or summed, a negative ``input_tokens`` and a cache read), such an
    answer cost nothing, and neither its budget nor its model's tokens-per-minute counted
    it; an OpenAI answer without counts is charged its estimate."""
    message = message_body(text_block("paid for"))
    events = message_events(message)  # then each usage in them made ``usage``'s
    start, delta = (json.loads(events[i].split(b"data: ", 1)[1]) for i in (0, -2))
    start["message"]["usage"] = message["usage"] = usage
    delta["usage"] = {k: v for k, v in (usage or {}).items() if k == "output_tokens"}
    events[0], events[-2] = sse(start, "message_start"), sse(delta, "message_delta")

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        if not streamed:
            return web.json_response(message)
        resp = await open_stream(request)
        for event in events:
            await resp.write(event)
        return resp

    price = Price(1, 2)
    with WireServer(handle) as srv:
        settings = dialect_model("anthropic", srv.base_url, price=price)
        with running(settings) as cb:
            if streamed:
                stream = cb.stream("hello", max_tokens=30)
                assert "".join(d.text for d in stream) == "paid for"
                result = stream.result(WAIT_S)
            else:
                result = cb.submit("hello", max_tokens=30).result(WAIT_S)
    assert isinstance(result, Completed), result
    assert result.usage.estimated
    assert result.usage.completion_tokens == 30
    assert result.cost_usd >= Decimal(60) / 10**6


@pytest.mark.parametrize("ends", ["dropped", "error event"])
def test_an_anthropic_stream_cut_after_its_start_is_charged_the_prompt_it_said(ends: str) -> None:
    """``message_start`` counts the input (cache reads and writes too); a stream cut
    after it was charged callboard's estimate of the prompt instead (8 tokens for
    3,000 said; found by a hunt). Its output stays the most it could have been."""
    message = message_body(text_block("Hel"))
    events = message_events(message)
    start = json.loads(events[0].split(b"data: ", 1)[1])
    start["message"]["usage"] = {
        "input_tokens": 3000,
        "cache_read_input_tokens": 1000,
        "cache_creation_input_tokens": 500,
        "output_tokens": 1,
    }
    head = [sse(start, "message_start"), *events[1:4]]  # then the first text delta
    assert b"text_delta" in head[-1]
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(head))
        if ends == "error event":
            await resp.write(sse(overloaded, "error"))
            return resp
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return resp

    price = Price(1, 2)
    with (
        WireServer(handle) as srv,
        running(dialect_model("anthropic", srv.base_url, price=price, retry=ONE_TRY)) as cb,
    ):
        stream = cb.stream("hello", max_tokens=30)
        with contextlib.suppress(StreamFailedError):
            list(stream)
        result = stream.result(WAIT_S)
        priced = cb.config.models[0].price  # with Anthropic's cache rates filled in
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.STREAM_CUT
    used = result.usage
    assert (used.prompt_tokens, used.cached_tokens, used.cache_write_tokens) == (4500, 1000, 500)
    assert (used.completion_tokens, used.estimated) == (30, True)
    assert result.cost_nusd == cost_nusd(priced, used) > 3000 * 1000


def test_an_anthropic_stream_dropped_after_its_stop_reason_is_whole_at_its_usage() -> None:
    """Everything came, ``message_delta`` with the stop reason and the usage last, then
    the connection dropped before ``message_stop``: the answer is whole, as the SDK reads
    it (it ended ``STREAM_CUT``, charged an estimate, where OpenAI's stream dropped after
    its usage chunk was whole; a hunt)."""
    message = message_body(text_block("all of it"))
    events = message_events(message)
    assert b"message_stop" in events[-1]

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        for event in events[:-1]:
            await resp.write(event)
        transport = request.transport
        assert transport is not None
        transport.abort()  # reset: no message_stop, no end of the chunked body
        return resp

    with WireServer(handle) as srv, running(dialect_model("anthropic", srv.base_url)) as cb:
        stream = cb.stream("hello", max_tokens=30)
        assert "".join(d.text for d in stream) == "all of it"
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert not result.usage.estimated
    assert result.usage.completion_tokens == message["usage"]["output_tokens"]


def _args_of_type(arguments: object) -> dict[str, Any]:
    """A streamed tool call whose ``arguments`` are not text (with a key registered, the
    guard against spelled secrets raised on them outside the shape's check)."""
    return {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": arguments}}


@pytest.mark.parametrize(
    ("api", "events"),
    [
        ("openai", [b'data: "hello"\n\n']),
        ("openai", [b"data: [1, 2]\n\n"]),
        ("openai", [b'data: {"choices": 5}\n\n']),
        ("openai", [sse({"choices": [{"index": 0, "delta": {"content": 5}}]})]),
        ("openai", [sse({"choices": [{"index": 0, "delta": {"tool_calls": {"index": 0}}}]})]),
        (
            "openai",
            [sse({"choices": [{"index": 0, "delta": {"tool_calls": [_args_of_type(5)]}}]})],
        ),
        (  # (an object is read as its JSON text, as some servers write arguments)
            "openai",
            [sse({"choices": [{"index": 0, "delta": {"tool_calls": [_args_of_type([1])]}}]})],
        ),
        ("anthropic", [b"event: ping\ndata: [1]\n\n"]),
        (
            "anthropic",
            [
                message_events(message_body(text_block("x")))[0],
                sse({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}}),
            ],
        ),
    ],
)
def test_a_stream_event_of_the_wrong_shape_is_a_malformed_response_not_a_bug(
    api: str, events: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    """JSON that is not the object the API documents (a string, a list, a number for a
    text, a delta with no index) fails the call as the malformed answer it is, as the
    same body unstreamed does, not as a transport failure with an error's traceback."""
    with WireServer(sending(events)) as srv:
        settings = dialect_model(api, srv.base_url, retry=RetryConfig(max_attempts=1))
        with running(settings) as cb:
            result = cb.stream("hello", max_tokens=30).result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.MALFORMED_RESPONSE, result
    assert "wrong shape" in result.detail
    assert "unexpectedly" not in caplog.text


def test_an_unreadable_answer_given_up_on_is_charged_its_estimate() -> None:
    """A 2xx whose body cannot be read was served, so billed: the last attempt's cost is
    its estimate, as the docs say (only the attempts retried are not charged)."""
    price = Price(1, 2)
    with (
        WireServer(answer(b'{"choices": [')) as rogue,
        running(model(rogue.base_url, price=price)) as cb,
    ):
        result = cb.submit("hello", max_tokens=30).result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.MALFORMED_RESPONSE
    assert result.usage.estimated
    assert result.usage.completion_tokens == 30
    assert result.cost_usd > 0


def test_a_200_error_object_given_up_on_costs_nothing() -> None:
    """The provider refused in a 2xx body: nothing was served, nothing is charged."""
    body = openai_error("overloaded", "server_error")
    with WireServer(answer(body)) as rogue, running(model(rogue.base_url, price=Price(1, 2))) as cb:
        result = cb.submit("hello", max_tokens=30).result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.cost_usd == 0


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("where", ["usage", "logprob"])
def test_a_number_json_has_not_is_a_malformed_response(number: str, where: str) -> None:
    """Python's ``json`` reads ``NaN`` and ``Infinity``; RFC 8259, JavaScript and Go do
    not: an answer holding one would reach a results file or a gateway's client as
    JSON no other reader takes."""
    body = completion_body(usage=USAGE)
    body["choices"][0]["logprobs"] = {
        "content": [{"token": "Hi", "logprob": -0.5, "bytes": None, "top_logprobs": []}],
        "refusal": None,
    }
    text = json.dumps(body)
    said = '"completion_tokens": 3' if where == "usage" else '"logprob": -0.5'
    raw = text.replace(said, said.split(":", maxsplit=1)[0] + f": {number}").encode()
    assert raw != text.encode()
    with WireServer(answer(raw)) as rogue, running(model(rogue.base_url)) as system:
        result = system.submit("hello", logprobs=True).result(WAIT_S)
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.MALFORMED_RESPONSE
    assert f"{number} is not a JSON number" in result.detail


def test_an_answer_that_says_the_key_loses_its_logprobs(run: Callable[..., Any]) -> None:
    """Its content is hidden whole; its logprobs, token by token, spelled the key."""
    pieces = [KEY[i : i + 12] for i in range(0, len(KEY), 12)]
    body = completion_body(content=f"your key: {KEY}", usage=USAGE)
    tokens = [{"token": p, "logprob": -0.1, "bytes": None, "top_logprobs": []} for p in pieces]
    body["choices"][0]["logprobs"] = {"content": tokens, "refusal": None}
    with WireServer(answer(body)) as srv:
        result = run(model(srv.base_url, api_key=KEY), logprobs=True)
    assert isinstance(result, Completed), result
    assert result.content == "your key: ***"
    assert result.logprobs is None


def test_a_stream_whose_server_holds_the_connection_after_its_usage_is_whole() -> None:
    """The usage chunk, after every choice finished, is the last OpenAI sends before
    ``[DONE]``: a server that sent no ``[DONE]`` and held the connection open held the
    call to its read timeout, and it ended cut."""
    held = threading.Event()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        for event in openai_stream(["all ", "there"])[:-1]:  # no [DONE]
            await resp.write(event)
        await asyncio.get_running_loop().run_in_executor(None, held.wait, 4 * WAIT_S)
        return resp

    never = Timeouts(connect=5.0, read=3600.0, total=3600.0)
    with WireServer(handle) as srv:
        try:
            with running(model(srv.base_url, timeout=never)) as cb:
                stream = cb.stream("hello")
                result = stream.result(WAIT_S)  # its two deltas wait for the reader
                assert "".join(d.text for d in stream) == "all there"
        finally:
            held.set()  # the handler ends: the server can stop
    assert isinstance(result, Completed), result
    assert result.usage.total_tokens == USAGE["total_tokens"]


def _spelling(text: str, **token: Any) -> list[dict[str, Any]]:
    """Logprobs entries a character each of ``text``, each as ``token`` says."""
    return [{"token": c, "logprob": -0.1, "bytes": None, "top_logprobs": [], **token} for c in text]


@pytest.mark.parametrize("where", ["tokens", "second-best", "bytes"])
def test_logprobs_that_spell_the_key_alone_are_dropped(run: Callable[..., Any], where: str) -> None:
    """The text said nothing; its tokens, a character each, spelled the key: each was
    hidden where it stood, and the key reached the result, and the gateway's clients
    through it (found by a hunt)."""
    said = "h" * len(KEY)
    entries = _spelling(said)
    for entry, char in zip(entries, KEY, strict=True):
        if where == "tokens":
            entry["token"] = char
        elif where == "second-best":
            entry["top_logprobs"] = [{"token": "h", "logprob": -0.1, "bytes": None}]
            entry["top_logprobs"].append({"token": char, "logprob": -3.0, "bytes": None})
        else:
            entry["bytes"] = list(char.encode())
    body = completion_body(content=said, usage=USAGE)
    body["choices"][0]["logprobs"] = {"content": entries, "refusal": None}
    with WireServer(answer(body)) as srv:
        result = run(model(srv.base_url, api_key=KEY), logprobs=True, top_logprobs=2)
    assert isinstance(result, Completed), result
    assert result.content == said
    assert result.logprobs is None
    assert KEY not in json.dumps(result.raw)


def test_logprobs_that_spell_nothing_are_kept_whole(run: Callable[..., Any]) -> None:
    said = "a perfectly ordinary answer"
    body = completion_body(content=said, usage=USAGE)
    entries = _spelling(said)
    for entry in entries:
        entry["bytes"] = list(entry["token"].encode())
    body["choices"][0]["logprobs"] = {"content": entries, "refusal": None}
    with WireServer(answer(body)) as srv:
        result = run(model(srv.base_url, api_key=KEY), logprobs=True)
    assert isinstance(result, Completed), result
    assert result.logprobs == {"content": entries, "refusal": None}


def _streamed_with_logprobs(chunks: list[tuple[str, str]]) -> tuple[list[Any], Any]:
    """A stream, through a system whose model has the key, of a chunk for each
    (text, what its logprobs' tokens spell, a character a token): its deltas and
    result (completed)."""
    events = [sse(chunk({"role": "assistant", "content": ""}))]
    for text, spelt in chunks:
        one = chunk({"content": text})
        one["choices"][0]["logprobs"] = {"content": _spelling(spelt), "refusal": None}
        events.append(sse(one))
    events += [sse(chunk({}, finish_reason="stop")), sse(chunk(usage=USAGE, choices=False))]
    events.append(sse("[DONE]"))
    with WireServer(sending(events)) as srv, running(model(srv.base_url, api_key=KEY)) as cb:
        stream = cb.stream("hello", logprobs=True)
        deltas = list(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    return deltas, result


@pytest.mark.parametrize(
    "pieces",
    [
        ["The area is ", " \\", "frac", "{1}{2}", " done"],  # a token ending in a backslash
        ["C:", "\\", "Users", "\\", "me"],
        ["use ", "sk-", "learn", "ing", " now"],  # a key's public head, then none
    ],
)
def test_a_streams_logprobs_of_ordinary_text_reach_the_reader_whole(pieces: list[str]) -> None:
    """With a key registered, a delta whose tokens the guard held back (a backslash, a
    key's public head) lost its logprobs, and so did the next (a review): they wait,
    and go with the next delta, every token once, in order."""
    deltas, _ = _streamed_with_logprobs([(piece, piece) for piece in pieces])
    tokens = [e["token"] for d in deltas if d.logprobs for e in d.logprobs["content"]]
    assert "".join(tokens) == "".join(pieces)
    assert "".join(d.text for d in deltas) == "".join(pieces)


def test_a_stream_whose_logprobs_spell_the_key_gives_none_of_it() -> None:
    """Four characters of the key a chunk, in the tokens of a text that says nothing."""
    deltas, result = _streamed_with_logprobs(
        [("w ", KEY[i : i + 4]) for i in range(0, len(KEY), 4)]
    )
    tokens = "".join(
        entry["token"] for d in deltas if d.logprobs for entry in d.logprobs["content"]
    )
    assert tokens == KEY[: len(tokens)]
    assert len(tokens) <= redact.SHOWN_AT_MOST + 4  # its start at most, as a text's
    assert result.logprobs is None
    assert KEY not in json.dumps(result.raw)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_redirect_is_not_followed_and_says_where_it_pointed(
    run: Callable[..., Any], transport: str
) -> None:
    """The key would go wherever it points; the detail said only the status."""

    async def handle(request: web.Request, arrival: Arrival) -> web.Response:
        where = f"http://elsewhere.example/v1/chat/completions?key={KEY}"
        return web.Response(status=307, headers={"location": where})

    with WireServer(handle) as srv:
        result = run(model(srv.base_url, api_key=KEY, transport=transport))
        calls = len(srv.arrivals)
    assert isinstance(result, Failed), result
    assert "redirected to 'http://elsewhere.example/v1/chat/completions?key=" in result.detail
    assert KEY not in result.detail
    assert calls == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_json_answer_after_a_byte_order_mark_is_read(
    run: Callable[..., Any], transport: str
) -> None:
    """``json.loads`` of the bytes, and so the SDKs, skip it; it was a malformed answer,
    retried and counted against the breaker."""
    raw = "\ufeff".encode() + json.dumps(completion_body(content="ok")).encode()
    with WireServer(answer(raw)) as srv:
        result = run(model(srv.base_url, transport=transport))
    assert isinstance(result, Completed), result
    assert result.content == "ok"


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
    ("fields", "said", "shown"),
    [
        (  # refused by the settings already: no host to be read
            {"base_url": f"http://[::1/v1?key={SECRET}"},
            "needs a host",
            "'http://[::1/v1?key=***'",
        ),
        (  # so is a proxy's (it was refused only when its transport was made)
            {"base_url": "http://h/v1", "transport": "httpx", "proxy": f"http://u:{SECRET}@h:x"},
            "proxy needs a host",
            "'http://u:***@h:x'",
        ),
    ],
)
def test_a_url_httpx_cannot_read_is_a_config_error_that_shows_it_masked(
    fields: dict[str, str], said: str, shown: str
) -> None:
    with pytest.raises(ConfigError, match=said) as info:
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


def test_a_call_whose_deadline_passes_in_the_window_ends_then_not_when_a_slot_frees(
    gate: tuple[Gate, WireServer],
) -> None:
    """Seen only as a slot freed, a call behind slots held by long calls (or streams
    nobody read) outlived its deadline by as long: 2 s deadlines ended 29 s on (found
    by a hunt). It ends at its deadline while the slot is still held."""
    g, server = gate
    w = _Window(server.base_url, cap=1)
    try:
        w.send((1, None, 0))
        server.wait_for(1)
        w.send((2, 0.2, 0), (3, None, 0))  # 2's deadline passes while call 1 holds the slot
        expired = w.take(1)[0]  # the gate still holds call 1
        assert (expired.task_id, expired.error, expired.detail) == (2, UNSENT, "deadline")
        g.release(2)
        rest = {r.task_id: r for r in w.take(2)}
        assert rest[1].error is None
        assert rest[3].error is None
        assert server.count() == 2, "the expired call never reached the server"
    finally:
        g.release(3)
        w.close()


def test_the_windows_deadline_timer_fires_about_once_a_deadline(
    gate: tuple[Gate, WireServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvloop's timers fire up to a millisecond early: the timer found nothing due and
    set itself again at once, 46 to 923 times for what one firing ends (a review)."""
    fired: list[float] = []
    expire = ModelClient._expire

    def counted(self: ModelClient) -> None:
        fired.append(time.monotonic())
        expire(self)

    monkeypatch.setattr(ModelClient, "_expire", counted)
    g, server = gate
    w = _Window(server.base_url, cap=1)
    try:
        w.send((1, None, 0))
        server.wait_for(1)
        w.send(*[(task_id, 0.05 + task_id / 2000, 0) for task_id in range(2, 22)])
        expired = w.take(20)
        assert {r.detail for r in expired} == {"deadline"}
        assert len(fired) <= 25, len(fired)  # about one a deadline, 0.5 ms apart
    finally:
        g.release(1)
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


class _RefusingAtOnce(httpx.AsyncBaseTransport):
    """Fails in the call's first step, with nothing awaited: as a process out of file
    descriptors fails ``socket()`` (found by a hunt: ``EMFILE``)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("out of file descriptors")


def _all_results(transport: httpx.AsyncBaseTransport, cap: int, calls: int) -> list[CallResult]:
    """``calls`` calls handed at once to a real ModelClient over ``transport`` on a real
    I/O loop with ``cap`` slots: every ``CallResult`` it delivers, the first ``calls``
    waited for, then whatever came with or after them until it closed."""
    io = IoLoop(name="test-io")
    io.start()
    done: queue.Queue[CallResult] = queue.Queue()
    settings = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1", max_concurrency=cap)
    client = ModelClient(
        settings,
        incarnation=1,
        deliver=lambda msg: [done.put(r) for r in msg.results],
        transport=transport,
    )
    try:
        io.call_soon(client.start, [(i, 1, b"{}", None, 0, None) for i in range(1, calls + 1)])
        results = [done.get(timeout=WAIT_S) for _ in range(calls)]
        io.run(client.aclose(close_transport=True))  # whatever was still to come is delivered
    finally:
        io.stop()
    return results + [done.get_nowait() for _ in range(done.qsize())]


def test_a_call_failing_in_its_first_step_sends_the_window_back_each_call_ending_once() -> None:
    """The call starts eagerly inside the refill, and its bad news revokes the window
    there: the refill must not then start the calls it revoked (each had two results)."""
    results = _all_results(_RefusingAtOnce(), cap=2, calls=6)
    assert sorted(r.task_id for r in results) == [1, 2, 3, 4, 5, 6], "one result a call"
    by_id = {r.task_id: r for r in results}
    assert by_id[1].error == "connection"
    assert {(by_id[i].error, by_id[i].detail) for i in range(2, 7)} == {(UNSENT, "revoked")}


def test_calls_answered_in_their_first_step_refill_without_nesting() -> None:
    """A transport that answers without waiting (httpx's ``MockTransport``): each call
    ends in its eager first step, inside the refill; 300 waiting calls on one slot went
    300 refills deep, and a ``RecursionError`` lost the rest of the window."""
    body = json.dumps(completion_body(content="ok")).encode()
    answering = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    results = _all_results(answering, cap=1, calls=300)
    assert sorted(r.task_id for r in results) == list(range(1, 301)), "one result a call"
    assert all(r.error is None for r in results), {r.error for r in results}


# -- dialects end to end: servers speaking OpenAI's, Azure's and Anthropic's wires ----------
#
# Each server below is written from the provider's API reference (tests/loopback.py),
# not the simulator; what it answers is shaped by the dialect it speaks, and the caller
# uses the same request and the same result whichever serves it.

DIALECTS = ["openai", "azure", "anthropic"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "Weather in Paris?"}
CALL_ID = {"openai": "call_Lb9x2TQ", "azure": "call_Az7y1RP", "anthropic": "toolu_01A09q90qw"}
REPORT = {
    "type": "json_schema",
    "json_schema": {
        "name": "weather_report",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
            "required": ["city", "temp"],
            "additionalProperties": False,
        },
    },
}


def in_dialect(api: str, answer: tuple[str, Any]) -> Any:
    """A dialect's body for a neutral answer: ``("text", str)``, ``("tool", (id, name,
    arguments))`` or ``("json", (tool name, object))``."""
    kind, what = answer
    if api == "anthropic":
        if kind == "text":
            return message_body(text_block(what))
        if kind == "tool":
            call_id, name, arguments = what
            return message_body(tool_use_block(call_id, name, arguments), stop_reason="tool_use")
        return message_body(tool_use_block("toolu_01Json", *what), stop_reason="tool_use")
    if kind == "text":
        return completion_body(content=what, usage=USAGE)
    if kind == "json":
        return completion_body(content=json.dumps(what[1]), usage=USAGE)
    call_id, name, arguments = what
    body = completion_body(content=None, finish_reason="tool_calls", usage=USAGE)
    call = {"id": call_id, "type": "function"}
    call["function"] = {"name": name, "arguments": json.dumps(arguments)}
    body["choices"][0]["message"]["tool_calls"] = [call]
    return body


def speaking(api: str, *answers: tuple[str, Any]) -> Any:
    """A handler answering the n-th request with ``answers[n]`` in ``api``'s shape."""
    return replying(lambda n, body: (200, {}, json.dumps(in_dialect(api, answers[n])).encode()))


def dialect_model(api: str, base_url: str, **kw: Any) -> ModelSettings:
    """Model ``m`` speaking ``api``: Azure's deployment ``dep`` at the resource, a Claude
    model at ``/v1``."""
    fields: dict[str, Any] = {"api": api, "api_key": KEY, **kw}
    if api == "azure":
        fields.setdefault("provider_model", "dep")
        base_url = base_url.removesuffix("/v1")
    return model(base_url, **fields)


def test_the_loopback_wires_are_the_sdks_own_types() -> None:
    """What the servers below answer parses with the official SDKs' types."""
    calls = [{"id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}]
    for event in EventStream().feed(b"".join(openai_stream(["Hel", "lo"], tool_calls=calls))):
        if event.data != "[DONE]":
            oa.ChatCompletionChunk.model_validate_json(event.data)
    oa.ChatCompletion.model_validate(in_dialect("openai", ("tool", ("c", "f", {}))))
    message = in_dialect("anthropic", ("tool", ("toolu_1", "get_weather", {"city": "Paris"})))
    an.Message.model_validate(message)
    an.ErrorResponse.model_validate(anthropic_error("overloaded_error", "Overloaded"))
    events = EventStream().feed(b"".join(message_events(message_body(text_block("hi")))))
    events += EventStream().feed(b"".join(message_events(message)))
    assert {e.event for e in events} >= {"message_start", "content_block_delta", "message_stop"}
    for event in events:
        if event.event != "ping":
            pydantic.TypeAdapter(an.RawMessageStreamEvent).validate_json(event.data)


@pytest.mark.parametrize(
    "case",
    [
        ("openai", None, "/v1/chat/completions", "", ("authorization", f"Bearer {KEY}")),
        (
            "azure",
            None,
            "/openai/deployments/dep/chat/completions",
            "api-version=2024-10-21",
            ("api-key", KEY),
        ),
        (
            "azure",
            "2025-01-01-preview",
            "/openai/deployments/dep/chat/completions",
            "api-version=2025-01-01-preview",
            ("api-key", KEY),
        ),
        ("anthropic", None, "/v1/messages", "", ("x-api-key", KEY)),
        ("anthropic", "2023-01-01", "/v1/messages", "", ("x-api-key", KEY)),
    ],
)
def test_each_dialect_sends_its_url_and_headers_and_the_models_own(
    run: Callable[..., Any], case: tuple[str, str | None, str, str, tuple[str, str]]
) -> None:
    api, api_version, path, query, auth = case
    with WireServer(speaking(api, ("text", "hello"))) as srv:
        settings = dialect_model(
            api, srv.base_url, api_version=api_version, headers={"X-Title": "callboard tests"}
        )
        result = run(settings, [SYSTEM, {"role": "user", "content": "hi"}], max_tokens=20)
    assert isinstance(result, Completed), result
    assert (result.content, result.finish_reason) == ("hello", "stop")
    (a,) = srv.arrivals
    assert (a.method, a.path, a.query) == ("POST", path, query)
    name, value = auth
    assert a.headers[name] == value
    others = {"authorization", "api-key", "x-api-key"} - {name}
    assert not others & set(a.headers), "the key goes in the dialect's header only"
    assert a.headers["x-title"] == "callboard tests"
    if api == "anthropic":
        assert a.headers["anthropic-version"] == (api_version or "2023-06-01")
        assert a.json == {
            "model": "m",
            "system": "You are terse.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 20,
        }
        usage = ANTHROPIC_USAGE
        assert result.usage.prompt_tokens == usage["input_tokens"]
        assert result.usage.completion_tokens == usage["output_tokens"]
    else:
        assert "anthropic-version" not in a.headers
        assert a.json["messages"] == [SYSTEM, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_key_spelled_across_an_anthropic_answers_text_blocks_is_hidden(
    run: Callable[..., Any], stream: bool
) -> None:
    """Each block of the body is hidden alone; the answer's text joins them (Anthropic
    splits text around citations). A whole answer to a stream request (``_replay``)
    reaches its reader as one delta, hidden too."""
    key = f"sk-blocks-{uuid.uuid4().hex}"
    body = message_body(text_block("you sent: " + key[:10]), text_block(key[10:] + " ok"))
    with WireServer(answer(body)) as srv:
        settings = dialect_model("anthropic", srv.base_url, api_key=key)
        if stream:
            with System(SystemConfig(models=(settings,))) as cb:
                reading = cb.stream("hi", model="m", max_tokens=20)
                got = "".join(d.text for d in reading)
                result = reading.result(WAIT_S)
            assert got == "you sent: *** ok"
        else:
            result = run(settings, max_tokens=20)
    assert isinstance(result, Completed), result
    assert result.content == "you sent: *** ok"


def test_an_anthropic_answers_cache_writes_are_charged_at_their_own_price(
    run: Callable[..., Any],
) -> None:
    """Anthropic's prompt-caching pricing: a write to the 5-minute cache costs 1.25 times
    the input price, one to the 1-hour cache 2 times. 10 input, 100,000 written (60,000
    for 5 minutes, 40,000 for an hour), 10 output tokens at $3 / $15 cost $0.46518;
    callboard charged $0.30018, the writes as plain input."""
    counts = {
        "input_tokens": 10,
        "output_tokens": 10,
        "cache_creation_input_tokens": 100_000,
        "cache_read_input_tokens": 0,
        "cache_creation": {
            "ephemeral_5m_input_tokens": 60_000,
            "ephemeral_1h_input_tokens": 40_000,
        },
    }
    with WireServer(answer(message_body(text_block("ok"), usage=counts))) as srv:
        settings = dialect_model("anthropic", srv.base_url, price=Price("3", "15"))
        result = run(settings, max_tokens=20)
    assert isinstance(result, Completed), result
    assert result.usage.prompt_tokens == 100_010
    assert result.usage.cache_write_tokens == 100_000
    assert result.usage.cache_write_1h_tokens == 40_000
    assert result.cost_usd == Decimal("0.46518")


@pytest.mark.parametrize("streamed", [False, True])
def test_an_anthropic_call_served_at_its_priority_tier_is_charged_that_tiers_price(
    streamed: bool,
) -> None:
    """Anthropic says the tier that served a call in its usage (``service_tier``), not
    where OpenAI says it; a call served at the priority tier was charged the standard
    price: 1,000 input and 100 output tokens at $6 / $30 cost $0.009, callboard charged
    $0.0045 (found by a hunt)."""
    counts = {**ANTHROPIC_USAGE, "input_tokens": 1000, "output_tokens": 100}
    message = message_body(text_block("ok"), usage={**counts, "service_tier": "priority"})
    handler = sending(message_events(message)) if streamed else answer(message)
    price = Price("3", "15", service_tiers={"priority": Price("6", "30")})
    with WireServer(handler) as srv:
        settings = dialect_model("anthropic", srv.base_url, price=price)
        with running(settings) as cb:
            result = (cb.stream if streamed else cb.submit)("hello").result(WAIT_S)
    assert isinstance(result, Completed), result
    assert result.cost_usd == Decimal("0.009")


@pytest.mark.parametrize("api", DIALECTS)
def test_a_tool_call_goes_round_trip_in_every_dialect(run: Callable[..., Any], api: str) -> None:
    """The model asks for a tool; the caller answers with the assistant's tool call and a
    tool turn, in OpenAI's shape whatever the dialect; the model then answers in text."""
    call = (CALL_ID[api], "get_weather", {"city": "Paris"})
    with WireServer(speaking(api, ("tool", call), ("text", "21 C in Paris."))) as srv:
        settings = dialect_model(api, srv.base_url)
        first = run(settings, [SYSTEM, ASK], tools=[WEATHER], tool_choice="auto", max_tokens=50)
        assert isinstance(first, Completed), first
        assert (first.content, first.finish_reason) == ("", "tool_calls")
        (asked,) = first.tool_calls
        assert (asked.id, asked.name) == (CALL_ID[api], "get_weather")
        assert asked.parsed_arguments() == {"city": "Paris"}
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": asked.id,
                    "type": "function",
                    "function": {"name": asked.name, "arguments": asked.arguments},
                }
            ],
        }
        told = {"role": "tool", "tool_call_id": asked.id, "content": '{"temp": 21}'}
        history = [SYSTEM, ASK, assistant, told]
        second = run(settings, history, tools=[WEATHER], max_tokens=50)
    assert isinstance(second, Completed), second
    assert (second.content, second.finish_reason, second.tool_calls) == (
        "21 C in Paris.",
        "stop",
        (),
    )
    sent_first, sent_second = (a.json for a in srv.arrivals)
    if api != "anthropic":
        assert sent_first["tools"] == [WEATHER]
        assert sent_first["tool_choice"] == "auto"
        assert sent_second["messages"] == history
        return
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
    }
    assert sent_first["tools"] == [tool]
    assert sent_first["tool_choice"] == {"type": "auto"}
    assert sent_second["system"] == "You are terse."
    assert sent_second["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [tool_use_block(*call)]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": CALL_ID[api], "content": '{"temp": 21}'}
            ],
        },
    ]


@pytest.mark.parametrize("api", DIALECTS)
def test_a_json_schema_answer_is_parsed_in_every_dialect(run: Callable[..., Any], api: str) -> None:
    report = {"city": "Paris", "temp": 21}
    with WireServer(speaking(api, ("json", ("weather_report", report)))) as srv:
        result = run(dialect_model(api, srv.base_url), [ASK], response_format=REPORT, max_tokens=50)
    assert isinstance(result, Completed), result
    assert result.parsed == report
    assert json.loads(result.content) == report
    assert (result.finish_reason, result.tool_calls) == ("stop", ())
    (sent,) = (a.json for a in srv.arrivals)
    if api != "anthropic":
        assert sent["response_format"] == REPORT
        return
    # Anthropic's tool-use guide: the schema as one tool's input, that tool forced
    assert "response_format" not in sent
    assert sent["tools"] == [
        {
            "name": "weather_report",
            "description": "Answer with this JSON object.",
            "input_schema": REPORT["json_schema"]["schema"],  # type: ignore[index]
            "strict": True,  # the schema's strict: Anthropic's strict tool use
        }
    ]
    assert sent["tool_choice"] == {"type": "tool", "name": "weather_report"}


def test_anthropics_529_overloaded_is_retried(run: Callable[..., Any]) -> None:
    overloaded = json.dumps(anthropic_error("overloaded_error", "Overloaded")).encode()
    answered = json.dumps(message_body(text_block("made it"))).encode()

    def reply(n: int, body: Any) -> Reply:
        return (529, {}, overloaded) if n == 0 else (200, {}, answered)

    with WireServer(replying(reply)) as srv:
        settings = dialect_model("anthropic", srv.base_url, retry=_fast_retry(3))
        result = run(settings)
    assert isinstance(result, Completed), result
    assert (result.content, result.attempts) == ("made it", 2)
    assert srv.count() == 2


def test_anthropics_401_is_authentication_and_not_retried(run: Callable[..., Any]) -> None:
    body = anthropic_error("authentication_error", "invalid x-api-key")
    with WireServer(answer(body, status=401)) as srv:
        settings = dialect_model("anthropic", srv.base_url, retry=_fast_retry(3))
        result = run(settings)
    assert isinstance(result, Failed), result
    assert (result.reason, result.status_code) == (FailureReason.AUTHENTICATION, 401)
    assert "invalid x-api-key" in result.detail
    assert srv.count() == 1


@pytest.mark.parametrize(
    ("kind", "reason", "status"),
    [
        ("authentication_error", "AUTHENTICATION", 401),
        ("billing_error", "QUOTA_EXCEEDED", 402),
        ("not_found_error", "REQUEST_ERROR", 404),
    ],
)
def test_anthropics_error_types_in_a_200_are_read_as_in_a_stream(
    run: Callable[..., Any], kind: str, reason: str, status: int
) -> None:
    """A whole 200 body read Anthropic's types as OpenAI's words (malformed: an outage,
    retried) where the same event in a stream is the status Anthropic's docs give it:
    a refused key or an empty account did not open the breaker at once (a review)."""
    body = {"type": "error", "error": {"type": kind, "message": "no"}}
    with WireServer(answer(body)) as srv:
        result = run(dialect_model("anthropic", srv.base_url, retry=_fast_retry(3)))
        sent = srv.count()
    assert isinstance(result, Failed), result
    assert (result.reason, result.status_code) == (FailureReason[reason], status)
    assert sent == 1


@pytest.mark.parametrize("streamed", [False, True])
def test_anthropics_out_of_credit_in_a_200_or_a_stream_is_a_spent_quota(streamed: bool) -> None:
    """A 400 saying so is read as an empty account (its body's words); in a 200 or a
    stream's error event the detail was prose, and it was a bad request, sent by every
    task (a review)."""
    error = anthropic_error("invalid_request_error", "Your credit balance is too low to ...")
    handler = sending([sse(error, event="error")]) if streamed else answer(error)
    with WireServer(handler) as srv:
        settings = dialect_model("anthropic", srv.base_url, retry=_fast_retry(3))
        with running(settings) as cb:
            result = (cb.stream if streamed else cb.submit)("hello").result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.QUOTA_EXCEEDED, result


def test_anthropics_rate_limit_headers_are_learned() -> None:
    """A limit Anthropic's headers advertise below the configured one is the model's
    limit from then on, once two answers in a row said it
    (``anthropic-ratelimit-requests-limit`` 5 against rpm 1000). After one answer the
    test read only ``remaining`` lowering the bucket, which refills at the configured
    1000 rpm: on a loaded machine the bucket was back above 5 before the stats were read
    (it failed 4 runs in 6 beside three busy processes)."""
    body = json.dumps(message_body(text_block("ok"))).encode()
    headers = anthropic_rate_headers(requests=5, remaining=4)
    with WireServer(replying(lambda n, b: (200, headers, body))) as srv:
        settings = dialect_model(
            "anthropic", srv.base_url, limiter=LimiterConfig(rpm=1000, tpm=None)
        )
        with running(settings) as system:
            for _ in range(2):  # one said it, the second confirms it
                assert system.submit("hi").result(WAIT_S).ok
            # the 60 s window now holds 2 of the 5: at most 3 more, however long it takes
            assert wait_until(lambda: _headroom(system) <= 3)


def test_anthropics_output_token_limit_does_not_refuse_a_call_within_both_limits() -> None:
    """Tier 1 (50 rpm, 30,000 input and 8,000 output tokens a minute): its combined
    ``tokens-limit`` shows the output's 8,000, and taken as the limit of prompt and
    output together it refused for good a 5,000-token prompt with 4,096 ``max_tokens``,
    which both limits allow (found by a hunt)."""
    body = json.dumps(message_body(text_block("ok"))).encode()
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))
    headers = {
        **anthropic_rate_headers(requests=50, remaining=49),
        "anthropic-ratelimit-tokens-limit": "8000",
        "anthropic-ratelimit-tokens-remaining": "8000",
        "anthropic-ratelimit-input-tokens-limit": "30000",
        "anthropic-ratelimit-input-tokens-remaining": "29000",
        "anthropic-ratelimit-input-tokens-reset": at,
        "anthropic-ratelimit-output-tokens-limit": "8000",
        "anthropic-ratelimit-output-tokens-remaining": "8000",
        "anthropic-ratelimit-output-tokens-reset": at,
    }
    with WireServer(replying(lambda n, b: (200, headers, body))) as srv:
        settings = dialect_model(
            "anthropic", srv.base_url, limiter=LimiterConfig(rpm=50, tpm=30000)
        )
        with running(settings) as system:
            assert system.submit("hi").result(WAIT_S).ok
            big = system.submit("hello " * 4600, max_tokens=4096).result(WAIT_S)
    assert big.ok, big
    assert srv.count() == 2


def test_anthropics_input_token_limit_holds_input_heavy_calls_on_its_own() -> None:
    """Anthropic limits input and output tokens a minute apart (ITPM, OTPM). Taken as
    one limit of their sum (here 3,000 + 100,000), input-heavy calls went past the
    input limit while the sum had room and drew 429s (a third of them; found by a
    hunt). A server built from its docs: it counts each request's input as it comes
    and refuses past 3,000 in any minute; callboard holds the fourth ~900-token prompt
    itself, until its deadline."""
    window: list[int] = []
    refused: list[int] = []

    def reply(n: int, body: Any) -> tuple[int, dict[str, str], bytes]:
        said = len(json.dumps(body["messages"]).split())
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))
        headers = {
            **anthropic_rate_headers(requests=1000, remaining=999),
            "anthropic-ratelimit-input-tokens-limit": "3000",
            "anthropic-ratelimit-input-tokens-remaining": str(max(0, 3000 - sum(window))),
            "anthropic-ratelimit-input-tokens-reset": at,
            "anthropic-ratelimit-output-tokens-limit": "100000",
            "anthropic-ratelimit-output-tokens-remaining": "100000",
            "anthropic-ratelimit-output-tokens-reset": at,
        }
        if sum(window) + said > 3000:
            refused.append(n)
            error = anthropic_error("rate_limit_error", "input tokens per minute")
            return 429, {**headers, "retry-after": "60"}, json.dumps(error).encode()
        window.append(said)
        usage = {"input_tokens": said, "output_tokens": 5}
        return 200, headers, json.dumps(message_body(text_block("ok"), usage=usage)).encode()

    with WireServer(replying(reply)) as srv:
        settings = dialect_model("anthropic", srv.base_url, retry=RetryConfig(max_attempts=1))
        with running(settings) as system:
            assert system.submit("hi", max_tokens=10).result(WAIT_S).ok  # the limits said
            heavy = [system.submit("word " * 900, max_tokens=10, deadline_s=2) for _ in range(4)]
            results = [f.result(WAIT_S) for f in heavy]
    assert [type(r).__name__ for r in results] == ["Completed"] * 3 + ["Expired"]
    assert refused == []
    assert srv.count() == 4


def _headroom(system: System) -> float:
    room = system.stats().models.get("m", {}).get("requests_headroom")
    return float("inf") if room is None else float(room)


@pytest.mark.parametrize("api", DIALECTS)
def test_a_secret_header_never_shows_in_any_log_or_result(
    debug_logs: LogCollector, api: str
) -> None:
    """A ``headers`` value given as a ``Secret`` goes out as is and is hidden everywhere
    else, even when the server echoes every header back, in its answer and its error."""

    async def echo_headers(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        said = json.dumps({"url": str(request.url), "headers": dict(request.headers)})
        if (arrival.json or {}).get("max_tokens") == 7:
            return web.json_response(in_dialect(api, ("text", said)), headers={"x-echo": said})
        error = (
            anthropic_error("invalid_request_error", said)
            if api == "anthropic"
            else {"error": {"message": said}}
        )
        return web.json_response(error, status=400, headers={"x-echo": said})

    with WireServer(echo_headers) as srv:
        settings = dialect_model(api, srv.base_url, headers={"x-gateway-key": Secret(SECRET)})
        config = SystemConfig(models=(settings,))
        with System(config) as cb:
            rs = [f.result(WAIT_S) for f in (cb.submit("a", max_tokens=7), cb.submit("b"))]
            shown = repr(config) + repr(cb.stats()) + repr(cb)
        sent = srv.arrivals[0]
    assert sent.headers["x-gateway-key"] == SECRET  # it went out
    assert [r.ok for r in rs] == [True, False]
    assert "***" in rs[0].content
    texts = [shown, *debug_logs.lines, *(repr(r) + str(getattr(r, "detail", "")) for r in rs)]
    _assert_hidden(_forms_of(SECRET) + _forms_of(KEY), *texts)


def test_a_token_in_a_secret_base_urls_path_is_hidden_when_a_404_echoes_the_path(
    debug_logs: Any,
) -> None:
    """A base URL marked secret whose token is in its path (``https://host/<token>/v1``,
    as proxies and tunnels give them): a 404 ``Cannot POST /<token>/v1/...`` put the
    token in the result, the logs and the gateway's clients (found by a hunt)."""
    token = f"tok{uuid.uuid4().hex}"

    async def not_here(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.json_response({"error": {"message": f"Cannot POST {request.path}"}}, status=404)

    with WireServer(not_here) as srv:
        settings = ModelSettings(name="m", base_url=Secret(f"{srv.root}/{token}/v1"))
        with System(SystemConfig(models=(settings,))) as cb:
            result = cb.submit("hi").result(WAIT_S)
            shown = repr(cb.stats())
        sent = srv.arrivals[0]
    assert sent.path == f"/{token}/v1/chat/completions"  # it went there
    assert isinstance(result, Failed), result
    assert "Cannot POST /***/v1/chat/completions" in result.detail, result.detail
    _assert_hidden([token], shown, result.detail, repr(result), *debug_logs.lines)


@pytest.mark.parametrize("api", DIALECTS)
def test_a_requests_own_headers_go_over_the_models_and_betas_add_up(
    run: Callable[..., Any], api: str
) -> None:
    """``extra_headers`` (the SDKs' word) reach the provider on that call only, over
    the model's own; Anthropic's ``anthropic-beta`` lists the model's betas and the
    request's. Streams and plain calls alike."""
    own = {"anthropic-beta": "context-1m-2025-08-07", "x-title": "model's"}
    with WireServer(speaking(api, ("text", "hello"), ("text", "hello"))) as srv:
        settings = dialect_model(api, srv.base_url, headers=own)
        asked = {"Anthropic-Beta": "output-128k-2025-02-19", "X-Title": "request's", "x-trace": "7"}
        results = [run(settings, "a", extra_headers=asked), run(settings, "b")]
    assert all(isinstance(r, Completed) for r in results), results
    with_own, without = srv.arrivals
    assert with_own.headers["anthropic-beta"] == "context-1m-2025-08-07,output-128k-2025-02-19"
    assert (with_own.headers["x-title"], with_own.headers["x-trace"]) == ("request's", "7")
    assert with_own.headers[{"openai": "authorization", "azure": "api-key"}.get(api, "x-api-key")]
    assert without.headers["anthropic-beta"] == "context-1m-2025-08-07"  # that call only
    assert (without.headers["x-title"], "x-trace" in without.headers) == ("model's", False)


def test_a_tool_call_falls_back_from_an_openai_model_to_a_claude_one_and_back() -> None:
    """``gpt`` (OpenAI's wire) fails; its fallback ``claude`` (Anthropic's) answers the
    same tool-calling request with a tool call; the conversation then goes on at
    ``gpt`` with Claude's tool call id, in OpenAI's shape."""
    failing = json.dumps(openai_error("The server had an error")).encode()
    done = json.dumps(completion_body(content="21 C in Paris.", usage=USAGE)).encode()

    def gpt_reply(n: int, body: Any) -> Reply:
        return (500, {}, failing) if n == 0 else (200, {}, done)

    call = (CALL_ID["anthropic"], "get_weather", {"city": "Paris"})
    with (
        WireServer(replying(gpt_reply)) as gpt_srv,
        WireServer(speaking("anthropic", ("tool", call))) as claude_srv,
    ):
        gpt = model(gpt_srv.base_url, name="gpt", fallbacks=("claude",))
        claude = dialect_model("anthropic", claude_srv.base_url, name="claude")
        with running(gpt, claude) as system:
            first = system.submit([ASK], model="gpt", tools=[WEATHER], max_tokens=50)
            asked = first.result(WAIT_S)
            assert isinstance(asked, Completed), asked
            assert asked.model == "claude"
            (tool_call,) = asked.tool_calls
            assistant = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": tool_call.id,
                        "type": "function",
                        "function": {"name": tool_call.name, "arguments": tool_call.arguments},
                    }
                ],
            }
            told = {"role": "tool", "tool_call_id": tool_call.id, "content": '{"temp": 21}'}
            second = system.submit([ASK, assistant, told], model="gpt", tools=[WEATHER])
            answered = second.result(WAIT_S)
    assert (tool_call.id, tool_call.name) == (CALL_ID["anthropic"], "get_weather")
    assert tool_call.parsed_arguments() == {"city": "Paris"}
    assert claude_srv.arrivals[0].json["tools"][0]["name"] == "get_weather"
    assert isinstance(answered, Completed), answered
    assert (answered.model, answered.content) == ("gpt", "21 C in Paris.")
    resumed = gpt_srv.arrivals[-1].json["messages"]
    assert resumed[1]["tool_calls"][0]["id"] == CALL_ID["anthropic"]
    assert resumed[2] == told


def test_a_body_is_read_a_bounded_part_at_a_time() -> None:
    """A stream's events are parsed a part at a time and wait while its reader is behind:
    reading all aiohttp had buffered (half a megabyte from a provider sending fast) kept
    thousands of parsed events beside the channel's deltas, 4.4 MB for each stream
    whose client read nothing (found by a hunt). Each part is at most ``STREAM_PART``."""
    sent = b"".join(sse({"n": i, "pad": "x" * 200}) for i in range(5000))  # ~1.2 MB

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(sent)  # at once
        return resp

    async def read(url: str) -> list[bytes]:
        async with aiohttp.ClientSession() as session, session.post(url, json={}) as response:
            await asyncio.sleep(0)  # a turn for the buffer to fill
            return [part async for part in _AiohttpReply(response).parts()]

    with WireServer(handle) as srv:
        parts = asyncio.run(asyncio.wait_for(read(f"{srv.base_url}/chat/completions"), WAIT_S))
    assert b"".join(parts) == sent
    assert max(map(len, parts)) <= STREAM_PART


def _clock_off_by(
    offset_s: float, *, remaining: int, reset_in_s: float, requests: int = 1000
) -> dict[str, str]:
    """Anthropic's request headers from a server whose clock is ``offset_s`` from ours:
    its ``Date`` and its reset (``reset_in_s`` after its now) are its own times of day."""
    theirs = time.time() + offset_s
    return {
        **anthropic_rate_headers(requests=requests, remaining=remaining),
        "anthropic-ratelimit-requests-reset": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(theirs + reset_in_s)
        ),
        "Date": email.utils.formatdate(theirs, usegmt=True),
    }


def test_a_spent_window_is_held_when_the_providers_clock_is_behind_ours() -> None:
    """A reset is the provider's time of day. From a server whose clock was an hour
    behind, a window spent (remaining 0, reset 30 s after its now) was read as reset
    59 minutes ago, stale, and ignored: callboard went on sending into the spent window
    at its configured rate. Its ``Date`` says how far its clock is from ours."""
    body = json.dumps(message_body(text_block("ok"))).encode()
    headers = _clock_off_by(-3600, remaining=0, reset_in_s=30)
    with WireServer(replying(lambda n, b: (200, headers, body))) as srv:
        settings = dialect_model(
            "anthropic", srv.base_url, limiter=LimiterConfig(rpm=600, tpm=None, burst_s=10)
        )
        with running(settings) as system:
            assert system.submit("hi").result(WAIT_S).ok
            # the bucket (100 requests) lowered to none, refilling at 10 a second: half
            # of it 5 s later (ignored, it stayed full)
            assert wait_until(lambda: _headroom(system) < 50), _headroom(system)


def test_a_429_pauses_to_the_reset_when_the_providers_clock_is_ahead_of_ours() -> None:
    """A 429 with no Retry-After pauses the model until its spent limit has refilled
    what the next call needs: at 1 request a minute, the whole reset. From a server an
    hour ahead, its reset 30 s away was read as 3,630 s away and paused the model for
    the longest wait there is (600 s), not 30."""
    error = json.dumps(anthropic_error("rate_limit_error", "requests per minute")).encode()
    headers = _clock_off_by(3600, remaining=0, reset_in_s=30, requests=1)
    with (
        WireServer(replying(lambda n, b: (429, headers, error))) as srv,
        running(dialect_model("anthropic", srv.base_url)) as system,
    ):
        system.submit("hi")  # paused, it waits to be sent again

        def paused() -> float | None:
            return system.stats().models["m"]["paused_for_s"]  # type: ignore[no-any-return]

        assert wait_until(lambda: paused() is not None)
        held = paused()
    assert held is not None
    assert 20 < held <= 31, held
