"""Streams as callers hold them (callboard/_stream.py): ``System.stream`` and
``AsyncSystem.stream`` against servers written from the providers' API references
(tests/loopback.py), not the simulator.

What is proved, each against a server whose own state says what happened: deltas
reach the reader while the server still holds the rest of the answer; the result
is the deltas joined (text, tool calls, usage); the answer ends at the stream's
last event, not at the connection's end; a failure before the first delta is
retried and the reader sees one clean stream; a break after it fails ``STREAM_CUT``
with the text received, after exactly one call; closing, dropping or a deadline
ends the call and the server sees its connection end; the asyncio reader leaves
its loop free; streams are charged like calls and the stats balance. Servers pace
or hold their streams on ``Cue``s the test sets; nothing waits on a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import pickle
import threading
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from aiohttp import web
from callboard.core.breaker import BreakerConfig
from callboard.core.pricing import cost_nusd
from callboard.core.retry import RetryConfig
from callboard.messages import StreamDelta
from callboard.runtime import http
from callboard.runtime.stream import DeltasDroppedError
from loopback import (
    ANTHROPIC_USAGE,
    USAGE,
    Arrival,
    Cue,
    Handler,
    WireServer,
    anthropic_error,
    chunk,
    completion_body,
    message_body,
    message_events,
    open_stream,
    openai_error,
    openai_stream,
    sending,
    sse,
    text_block,
    tool_use_block,
)
from support import WAIT_S, running, wait_until

from callboard import (
    AsyncChatStream,
    AsyncSystem,
    BudgetSettings,
    Cancelled,
    Completed,
    Expired,
    Failed,
    FailureReason,
    ModelSettings,
    Price,
    StreamFailedError,
    System,
    SystemConfig,
    Timeouts,
    Usage,
)

DIALECTS = ["openai", "anthropic"]
NEVER_OPEN = BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000)
RETRY = RetryConfig(max_attempts=3, initial_s=0.01, max_s=0.02, jitter_s=0.0)
TEXT = ["Hel", "lo", " world"]


def model(srv: WireServer, api: str = "openai", **kw: Any) -> ModelSettings:
    """Model ``m`` on ``srv``, speaking ``api`` (Azure: deployment ``dep``)."""
    fields: dict[str, Any] = {"breaker": NEVER_OPEN, "retry": RETRY, "max_concurrency": 4, **kw}
    base_url = srv.base_url
    if api == "azure":
        base_url, fields["provider_model"] = srv.root, "dep"
    fields.setdefault("name", "m")
    return ModelSettings(base_url=base_url, api=api, api_key="sk-x", **fields)  # type: ignore[arg-type]


def events_of(api: str, pieces: list[str] = TEXT) -> list[bytes]:
    """A whole streamed text answer in ``api``'s events."""
    if api == "anthropic":
        return message_events(message_body(text_block("".join(pieces))), pieces=pieces)
    return openai_stream(pieces)


def before_text(api: str) -> int:
    """How many of ``events_of(api)`` come before the first text: OpenAI's role chunk;
    Anthropic's message_start, ping and content_block_start."""
    return 3 if api == "anthropic" else 1


def texts(deltas: list[StreamDelta]) -> str:
    return "".join(d.text for d in deltas)


class Hold:
    """What a stream's server records: whether its reader let it go on, whether it saw
    the connection end."""

    def __init__(self) -> None:
        self.go = Cue()
        self.released: list[bool] = []
        self.gone = threading.Event()

    async def until_released(self) -> None:
        self.released.append(await self.go.wait())

    async def until_gone(self, resp: web.StreamResponse, ping: bytes | None = None) -> None:
        """Wait (sending ``ping`` every 10 ms if given) until the client hangs up: aiohttp
        cancels the handler then."""
        try:
            if ping is None:
                await self.go.wait()
            while ping is not None:
                await resp.write(ping)
                await asyncio.sleep(0.01)  # the provider's keep-alive pace
        except (asyncio.CancelledError, ConnectionResetError):
            self.gone.set()
            raise


# -- deltas as they arrive, and the answer they make ----------------------------------------


@pytest.mark.parametrize("api", ["openai", "azure", "anthropic"])
def test_deltas_reach_the_reader_while_the_server_holds_the_rest(api: str) -> None:
    hold = Hold()
    events = events_of(api)
    cut = before_text(api) + 1  # up to the first text

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events[:cut]))
        await hold.until_released()  # the rest waits for the reader to have the first
        for event in events[cut:]:
            await resp.write(event)
        return resp

    with WireServer(handle) as srv, running(model(srv, api)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas = iter(stream)
        first = next(deltas)
        hold.go.set()
        rest = list(deltas)
        result = stream.result(WAIT_S)
        sent, path = srv.arrivals[0].json, srv.arrivals[0].path
    assert (
        path
        == {
            "openai": "/v1/chat/completions",
            "azure": "/openai/deployments/dep/chat/completions",
            "anthropic": "/v1/messages",
        }[api]
    )
    assert hold.released == [True], "the server went on only once the reader had a delta"
    assert first.text == "Hel"
    assert isinstance(result, Completed), result
    assert texts([first, *rest]) == result.content == "Hello world"
    assert rest[-1].finish_reason == result.finish_reason == "stop"
    assert result.ttft_s is not None
    assert 0 < result.ttft_s <= result.latency_s
    assert sent["stream"] is True
    if api == "anthropic":
        counted = ANTHROPIC_USAGE["input_tokens"], ANTHROPIC_USAGE["output_tokens"]
    else:  # the usage asked for, in its own last chunk
        assert sent["stream_options"] == {"include_usage": True}
        counted = USAGE["prompt_tokens"], USAGE["completion_tokens"]
    assert result.usage == Usage(prompt_tokens=counted[0], completion_tokens=counted[1])


CALLS = [
    ("call_0", "get_weather", {"city": "Paris"}),
    ("call_1", "get_time", {"zone": "Europe/Paris", "24h": True}),
]


@pytest.mark.parametrize("api", DIALECTS)
def test_tool_call_fragments_assemble_into_the_results_calls(api: str) -> None:
    if api == "anthropic":
        blocks = [tool_use_block(*c) for c in CALLS]
        events = message_events(
            message_body(text_block("Checking."), *blocks, stop_reason="tool_use")
        )
    else:
        calls = [{"id": i, "name": n, "arguments": json.dumps(a)} for i, n, a in CALLS]
        events = openai_stream(["Checking."], tool_calls=calls)

    with WireServer(sending(events)) as srv, running(model(srv, api)) as cb:
        stream = cb.stream("weather and time?", max_tokens=50)
        deltas = list(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert (result.content, result.finish_reason) == ("Checking.", "tool_calls")
    fragments = [f for d in deltas for f in d.tool_calls]
    for index, (call_id, name, arguments) in enumerate(CALLS):
        mine = [f for f in fragments if f.index == index]
        assert (mine[0].id, mine[0].name) == (call_id, name)
        assert all(f.id is None and f.name is None for f in mine[1:])
        assert len(mine) > 2, "the arguments came in fragments"
        call = result.tool_calls[index]
        assert (call.id, call.name) == (call_id, name)
        assert json.loads("".join(f.arguments for f in mine)) == arguments
        assert call.parsed_arguments() == arguments
        if api == "openai":  # the text as written (Anthropic's: see the test below)
            assert "".join(f.arguments for f in mine) == call.arguments
    assert deltas[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize("numbering", ["none", "zero"])
def test_parallel_calls_a_server_numbers_wrongly_reach_the_reader_apart(numbering: str) -> None:
    """Gemini's OpenAI-compatible endpoint sends each call whole with no ``index``; some
    adapters number every call 0: the reader's fragments and the result still hold
    each call apart, as the same answer unstreamed does."""
    events = [sse(chunk({"role": "assistant", "content": ""}))]
    for call_id, name, arguments in CALLS:
        call = {"id": call_id, "type": "function"}
        call["function"] = {"name": name, "arguments": json.dumps(arguments)}
        if numbering == "zero":
            call["index"] = 0
        events.append(sse(chunk({"tool_calls": [call]})))
    events += [sse(chunk({}, finish_reason="tool_calls")), sse("[DONE]")]

    with WireServer(sending(events)) as srv, running(model(srv, "openai")) as cb:
        stream = cb.stream("weather and time?", max_tokens=50)
        deltas = list(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    fragments = [f for d in deltas for f in d.tool_calls]
    assert [(f.index, f.id, f.name) for f in fragments] == [
        (i, call_id, name) for i, (call_id, name, _) in enumerate(CALLS)
    ]
    assert [(c.id, c.name, c.parsed_arguments()) for c in result.tool_calls] == CALLS


def test_anthropics_streamed_arguments_and_json_are_the_text_the_reader_got() -> None:
    spaced = {"city": "Paris", "temp": 21}  # json.dumps writes ", " and ": "
    blocks = [tool_use_block("toolu_1", "get_weather", spaced)]
    events = message_events(message_body(*blocks, stop_reason="tool_use"))
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": {}}}
    json_events = message_events(
        message_body(tool_use_block("toolu_2", "report", spaced), stop_reason="tool_use")
    )

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(json_events if arrival.index else events))
        return resp

    with WireServer(handle) as srv, running(model(srv, "anthropic")) as cb:
        calling = cb.stream("weather?", max_tokens=50)
        fragments = "".join(f.arguments for d in calling for f in d.tool_calls)
        answering = cb.stream("report", response_format=fmt, max_tokens=50)
        text = texts(list(answering))
        called, answered = calling.result(WAIT_S), answering.result(WAIT_S)
    assert isinstance(called, Completed), called
    assert isinstance(answered, Completed), answered
    assert fragments == called.tool_calls[0].arguments == json.dumps(spaced)
    assert text == answered.content == json.dumps(spaced)


def test_a_json_schema_streamed_through_anthropics_forced_tool_is_parsed() -> None:
    report = {"city": "Paris", "temp": 21}
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": schema}}
    events = message_events(
        message_body(tool_use_block("toolu_1", "report", report), stop_reason="tool_use")
    )

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events))
        return resp

    with WireServer(handle) as srv, running(model(srv, "anthropic")) as cb:
        stream = cb.stream("report", response_format=fmt, max_tokens=50)
        deltas = list(stream)
        result = stream.result(WAIT_S)
        sent = srv.arrivals[0].json
    assert sent["tool_choice"] == {"type": "tool", "name": "report"}
    assert isinstance(result, Completed), result
    assert len(deltas) > 2
    assert json.loads(texts(deltas)) == result.parsed == report
    assert (result.finish_reason, result.tool_calls) == ("stop", ())


def test_a_stream_without_usage_is_charged_its_estimate_marked() -> None:
    events = openai_stream(TEXT, usage=None)  # a server that ignores include_usage

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events))
        return resp

    with WireServer(handle) as srv, running(model(srv)) as cb:
        stream = cb.stream("hi", max_tokens=30)
        assert texts(list(stream)) == "Hello world"
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert result.usage.estimated
    assert result.usage.completion_tokens == 30


@pytest.mark.parametrize(("version", "asks"), [("2024-06-01", False), ("2024-10-21", True)])
def test_an_azure_version_older_than_stream_options_streams_with_its_usage_estimated(
    version: str, asks: bool
) -> None:
    """Azure's versions before 2024-09-01 (the GA 2024-06-01 among them) refuse a body
    with ``stream_options``: every stream of a model pinned to one failed (found by a
    hunt). It is left out for them, the usage then estimated and marked."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        if "stream_options" in arrival.json and request.query["api-version"] < "2024-09-01":
            said = openai_error("Unrecognized request argument supplied: stream_options")
            return web.json_response(said, status=400)
        resp = await open_stream(request)
        usage = USAGE if "stream_options" in arrival.json else None
        await resp.write(b"".join(openai_stream(TEXT, usage=usage)))
        return resp

    with WireServer(handle) as srv:
        root = f"{srv.root}?api-version={version}"
        settings = dataclasses.replace(model(srv, "azure"), base_url=root)
        with running(settings) as cb:
            stream = cb.stream("hi", max_tokens=30)
            assert texts(list(stream)) == "Hello world"
            result = stream.result(WAIT_S)
        sent = srv.arrivals[0]
    assert sent.query == f"api-version={version}"
    assert ("stream_options" in sent.json) is asks
    assert isinstance(result, Completed), result
    assert result.usage.estimated is not asks


@pytest.mark.parametrize("api", DIALECTS)
def test_a_stream_ends_at_its_last_event_though_the_server_holds_the_connection(
    api: str,
) -> None:
    """As the SDKs read it: ``[DONE]`` / ``message_stop`` ends the answer, whether or not
    the body ends there (a proxy may keep it open)."""
    hold = Hold()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events_of(api)))
        await hold.until_gone(resp)
        return resp

    with WireServer(handle) as srv, running(model(srv, api)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas = list(stream)
        result = stream.result(WAIT_S)
        assert hold.gone.wait(WAIT_S), "the client hung up once the answer was whole"
    assert isinstance(result, Completed), result
    assert texts(deltas) == result.content == "Hello world"


def test_a_done_line_with_more_after_it_ends_the_stream_as_the_sdk_reads_it() -> None:
    """``data: [DONE] `` (a trailing space): the openai SDK ends at any data beginning
    ``[DONE]``; it was parsed as JSON and the whole answer failed ``stream_cut``, charged
    an estimate."""
    events = [*events_of("openai")[:-1], b"data: [DONE] \r\n\r\n"]
    with WireServer(sending(events)) as srv, running(model(srv, "openai")) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas = list(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert texts(deltas) == result.content == "Hello world"
    assert not result.usage.estimated


def test_a_body_that_ends_after_its_last_event_gives_its_connection_to_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The answer is whole at ``[DONE]``: the reader has its result while the server still
    holds the body's end. When the end comes, the connection goes back to the pool, and
    the next stream is sent on it (closing it at ``[DONE]`` made every such stream open a
    new one). ``DRAIN_S`` is lengthened so the test's own pace cannot outrun it."""
    monkeypatch.setattr(http, "DRAIN_S", WAIT_S)
    hold = Hold()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events_of("openai")))
        if arrival.index == 0:
            await hold.until_released()
        return resp  # the body ends here

    with WireServer(handle) as srv, running(model(srv, max_concurrency=1)) as cb:
        first = cb.stream("hi", max_tokens=20)
        assert texts(list(first)) == "Hello world"
        assert isinstance(first.result(WAIT_S), Completed), "whole before the body's end"
        hold.go.set()
        (client,) = cb._assembly.clients._clients.values()
        assert wait_until(lambda: not client._drains)  # the end read: the connection is back
        second = cb.stream("again", max_tokens=20)
        assert texts(list(second)) == "Hello world"
    assert hold.released == [True]
    assert srv.count() == 2
    assert len(srv.connections) == 1, "the second stream went on the first's connection"


def test_a_body_held_open_after_its_last_event_gives_way_to_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that holds every body open after ``[DONE]``: reading on for its end used
    a connection of the pool's ``max_concurrency`` for ``DRAIN_S``, and the next call
    waited for it (40 streams at ``max_concurrency=4`` took 2.5 s, found by a hunt).
    The drain gives its connection up the moment a call needs it. ``DRAIN_S`` is made
    longer than the test waits, so only giving way lets the next streams through."""
    monkeypatch.setattr(http, "DRAIN_S", 3 * WAIT_S)
    holds = [Hold() for _ in range(3)]

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events_of("openai")))
        await holds[arrival.index].until_gone(resp)
        return resp

    with WireServer(handle) as srv, running(model(srv, max_concurrency=1)) as cb:
        for _ in holds:
            stream = cb.stream("hi", max_tokens=20)
            assert texts(list(stream)) == "Hello world"
            assert isinstance(stream.result(WAIT_S), Completed)
        assert holds[0].gone.wait(WAIT_S)
        assert holds[1].gone.wait(WAIT_S)
    assert srv.count() == 3


def test_drains_closed_before_they_began_give_their_connections_back() -> None:
    """Many streams at once on a server that holds every body open after ``[DONE]``:
    a drain closed to make room in the loop turn it was made in never ran, and kept
    its connection; once the pool's were gone every call waited (7 of 40 streams in
    10 s; found by a review)."""
    hold = Hold()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events_of("openai")))
        await hold.until_gone(resp)
        return resp

    with WireServer(handle) as srv, running(model(srv, max_concurrency=4)) as cb:
        streams = [cb.stream(f"hi {i}", max_tokens=20) for i in range(40)]
        for stream in streams:
            assert texts(list(stream)) == "Hello world"
            assert isinstance(stream.result(WAIT_S), Completed)
    assert srv.count() == 40


@pytest.mark.parametrize("api", DIALECTS)
def test_a_server_that_answers_a_stream_in_one_body_gives_one_delta(api: str) -> None:
    """A server that ignores ``stream`` (and answers a whole JSON body): the reader gets
    the answer as one delta, the result as usual."""
    calls = [("call_0", "get_weather", {"city": "Paris"})]
    if api == "anthropic":
        blocks = [text_block("Checking."), tool_use_block(*calls[0])]
        body: Any = message_body(*blocks, stop_reason="tool_use")
    else:
        body = completion_body(content="Checking.", finish_reason="tool_calls", usage=USAGE)
        call = {"id": "call_0", "type": "function"}
        call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        body["choices"][0]["message"]["tool_calls"] = [call]
        body["choices"][0]["logprobs"] = {"content": [], "refusal": None}

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.json_response(body)

    with WireServer(handle) as srv, running(model(srv, api)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas = list(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    (whole,) = deltas
    assert (
        (whole.text, whole.finish_reason)
        == ("Checking.", "tool_calls")
        == (
            result.content,
            result.finish_reason,
        )
    )
    (fragment,) = whole.tool_calls
    (asked,) = result.tool_calls
    assert (fragment.index, fragment.id, fragment.name) == (0, asked.id, asked.name)
    assert fragment.arguments == asked.arguments
    assert not result.usage.estimated
    assert result.ttft_s is not None
    assert whole.logprobs == result.logprobs, "the delta carries what the answer holds"


def test_an_event_stream_labelled_json_is_read_as_the_stream_it_is() -> None:
    """A proxy that labels a stream ``application/json``: the ``openai`` SDK reads a
    stream whatever its ``Content-Type``; read as one JSON body, it failed malformed and
    was sent again, each attempt billed."""

    labelled = sending(openai_stream(TEXT), {"content-type": "application/json"})
    with WireServer(labelled) as srv, running(model(srv, "openai")) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas = list(stream)
        result = stream.result(WAIT_S)
        sent = srv.count()
    assert isinstance(result, Completed), result
    assert texts(deltas) == result.content == "".join(TEXT)
    assert result.usage == Usage(
        prompt_tokens=USAGE["prompt_tokens"], completion_tokens=USAGE["completion_tokens"]
    )
    assert sent == 1


@pytest.mark.parametrize("answer", ["completion", "insufficient_quota"])
def test_a_json_body_labelled_an_event_stream_is_read_as_the_json_it_is(answer: str) -> None:
    """A proxy that labels a whole JSON answer ``text/event-stream``: read as a stream it
    held no event, ended malformed and was sent three times; an ``insufficient_quota``
    error object so was retried and never stopped the model (found by a hunt)."""
    if answer == "completion":
        body: Any = completion_body(content="Hello world", usage=USAGE)
    else:
        body = openai_error("You exceeded your current quota", "insufficient_quota")
        body["error"]["code"] = "insufficient_quota"

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        raw = b"\n  " + json.dumps(body).encode()  # white space first, as some servers send
        return web.Response(body=raw, headers={"Content-Type": "text/event-stream"})

    with WireServer(handle) as srv, running(model(srv, "openai")) as cb:
        stream = cb.stream("hi", max_tokens=20)
        result = stream.result(WAIT_S)
        sent = srv.count()
    assert sent == 1
    if answer == "completion":
        assert isinstance(result, Completed), result
        assert result.content == "Hello world"
    else:
        assert isinstance(result, Failed), result
        assert result.reason is FailureReason.QUOTA_EXCEEDED


def test_an_event_holding_a_number_json_has_not_cuts_the_stream() -> None:
    """``NaN`` in a chunk (Python's ``json`` reads it; RFC 8259 does not): what the reader
    got stays, the stream ends cut, nothing with the NaN reaches the result."""
    bad = json.dumps(chunk({"content": "x"})).replace('"logprobs": null', '"logprobs": NaN')
    events = openai_stream(TEXT)
    events.insert(2, f"data: {bad}\n\n".encode())
    deltas: list[StreamDelta] = []
    with WireServer(sending(events)) as srv, running(model(srv, "openai")) as cb:
        stream = cb.stream("hi", max_tokens=20)
        with pytest.raises(StreamFailedError):
            deltas.extend(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.STREAM_CUT
    assert "NaN is not a JSON number" in result.detail
    assert result.partial_text == texts(deltas) == TEXT[0]


def test_a_2xx_error_object_for_a_stream_says_what_the_provider_said() -> None:
    """Some proxies answer 200 with the provider's error object: a request refused is
    not sent again, and the provider's words reach the caller."""
    refused = openai_error("max_tokens is too large", "invalid_request_error", "bad_max")

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        return web.json_response(refused)

    with WireServer(handle) as srv, running(model(srv)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        with pytest.raises(StreamFailedError, match="max_tokens is too large"):
            list(stream)
        result = stream.result(WAIT_S)
        calls = srv.count()
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.REQUEST_ERROR
    assert calls == 1


# -- failures: before the first delta retried, after it a typed cut ---------------------------


async def _drop(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """Hang up without ending the body (a connection reset mid-stream)."""
    assert request.transport is not None
    request.transport.abort()
    return resp


def _failing_first(how: str) -> Callable[[web.Request], Any]:
    """A first answer that fails before any text, ``how``."""

    async def fail(request: web.Request) -> web.StreamResponse:
        if how == "500":
            return web.json_response(openai_error("The server had an error"), status=500)
        if how == "529":
            return web.json_response(anthropic_error("overloaded_error", "Overloaded"), status=529)
        resp = await open_stream(request)
        if how == "dropped":  # the role, then the connection goes
            await resp.write(openai_stream(TEXT)[0])
            return await _drop(request, resp)
        start = events_of("anthropic")[0]  # message_start, then an error event
        error = sse(anthropic_error("overloaded_error", "Overloaded"), "error")
        await resp.write(start + error)
        return resp

    return fail


@pytest.mark.parametrize(
    ("api", "how"),
    [("openai", "500"), ("openai", "dropped"), ("anthropic", "529"), ("anthropic", "event")],
)
def test_a_failure_before_the_first_delta_is_retried_and_the_reader_sees_one_stream(
    api: str, how: str
) -> None:
    fail = _failing_first(how)

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        if arrival.index == 0:
            return await fail(request)
        resp = await open_stream(request)
        await resp.write(b"".join(events_of(api)))
        return resp

    with WireServer(handle) as srv, running(model(srv, api)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas = list(stream)
        result = stream.result(WAIT_S)
        calls = srv.count()
    assert isinstance(result, Completed), result
    assert texts(deltas) == result.content == "Hello world"  # nothing twice
    assert (result.attempts, calls) == (2, 2)


def test_a_stream_names_the_model_whose_words_it_reads() -> None:
    """``stream.model``: the model that answered, here the fallback of one that failed
    before a word (what the gateway names in each chunk and its ``X-Callboard-Model``)."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        if (await request.json())["model"] == "first":
            return web.json_response(openai_error("down", "server_error"), status=500)
        resp = await open_stream(request)
        await resp.write(b"".join(events_of("openai")))
        return resp

    with WireServer(handle) as srv:
        once = RetryConfig(max_attempts=1)
        first = model(srv, name="first", retry=once, fallbacks=("second",))
        with running(first, model(srv, name="second")) as cb:
            stream = cb.stream("hi", model="first", max_tokens=20)
            assert texts(list(stream)) == "Hello world"
            assert stream.result(WAIT_S).model == stream.model == "second"


def test_a_stream_failed_error_crosses_to_another_process_as_it_was() -> None:
    failed = Failed(task_id=7, trace_id="t", reason=FailureReason.STREAM_CUT, detail="cut")
    error = pickle.loads(pickle.dumps(StreamFailedError(failed)))  # noqa: S301 - our own bytes
    assert (str(error), error.result) == (str(StreamFailedError(failed)), failed)


@pytest.mark.parametrize(
    ("api", "error", "reason", "calls"),
    [
        ("anthropic", "overloaded_error", FailureReason.PROVIDER_ERROR, 3),
        ("anthropic", "api_error", FailureReason.PROVIDER_ERROR, 3),
        ("anthropic", "invalid_request_error", FailureReason.REQUEST_ERROR, 1),
        ("anthropic", "billing_error", FailureReason.QUOTA_EXCEEDED, 1),
        ("openai", "insufficient_quota", FailureReason.QUOTA_EXCEEDED, 1),
        ("openai", "server_error", FailureReason.PROVIDER_ERROR, 3),
    ],
)
def test_an_error_event_before_any_delta_is_judged_as_the_status_it_stands_for(
    api: str, error: str, reason: FailureReason, calls: int
) -> None:
    """Anthropic's streaming docs: an ``overloaded_error`` event mid-stream "would
    normally correspond to an HTTP 529 in a non-streaming context". Such an event was
    a malformed answer whatever it said; it is judged as its status now: retried or
    not, held against the provider's health or not, as that status would be."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        if api == "anthropic":
            failure = sse(anthropic_error(error, "it went wrong"), "error")
            await resp.write(events_of("anthropic")[0] + failure)
        else:
            body = {"error": {"message": "it went wrong", "type": error, "code": error}}
            await resp.write(openai_stream(TEXT)[0] + sse(body))
        return resp

    with WireServer(handle) as srv, running(model(srv, api)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        with pytest.raises(StreamFailedError):
            list(stream)
        result = stream.result(WAIT_S)
        assert srv.count() == calls
    assert isinstance(result, Failed), result
    assert result.reason is reason


def _cut_after_text(api: str, how: str) -> Callable[..., Any]:
    """A stream that breaks, ``how``, after its first two text deltas."""
    events = events_of(api)
    head = b"".join(events[: before_text(api) + 2])

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(head)
        if how == "dropped":
            return await _drop(request, resp)
        if how == "error" and api == "anthropic":
            await resp.write(sse(anthropic_error("overloaded_error", "Overloaded"), "error"))
        elif how == "error":
            await resp.write(sse(openai_error("The model is overloaded", "server_error")))
        return resp  # "ended": the body ends without [DONE] / message_stop

    return handle


@pytest.mark.parametrize("how", ["dropped", "ended", "error"])
@pytest.mark.parametrize("api", DIALECTS)
def test_a_break_after_the_first_delta_fails_stream_cut_with_the_text_received(
    api: str, how: str
) -> None:
    with WireServer(_cut_after_text(api, how)) as srv, running(model(srv, api)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas: list[StreamDelta] = []
        with pytest.raises(StreamFailedError) as failed:
            deltas.extend(stream)
        result = stream.result(WAIT_S)
        calls = srv.count()
    assert texts(deltas) == "Hello"
    assert failed.value.result is result
    assert isinstance(result, Failed), result
    assert (result.reason, result.partial_text) == (FailureReason.STREAM_CUT, "Hello")
    assert calls == 1, "a stream the reader has part of is not sent again"
    if how == "error":
        assert "overloaded" in result.detail
        assert result.status_code == (529 if api == "anthropic" else 500), "what it stood for"
    else:
        assert result.status_code is None
    assert "stream_cut" in str(failed.value)


def test_an_anthropic_stream_that_ends_after_its_stop_reason_is_whole() -> None:
    """Its body ends after ``message_delta`` (the stop reason and the usage) without
    ``message_stop``: every block came, and the ``anthropic`` SDK's final message is
    whole; an OpenAI stream without ``[DONE]`` is read so too. It was cut."""
    events = [e for e in events_of("anthropic") if b"message_stop" not in e]
    with WireServer(sending(events)) as srv, running(model(srv, "anthropic")) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas = list(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert texts(deltas) == result.content == "".join(TEXT)
    assert not result.usage.estimated


def test_each_delta_carries_its_chunks_logprobs() -> None:
    lp = {"content": [{"token": "Hel", "logprob": -0.1, "bytes": None, "top_logprobs": []}]}
    said = chunk({"content": "Hel"})
    said["choices"][0]["logprobs"] = lp
    events = [sse(chunk({"role": "assistant", "content": ""})), sse(said), *openai_stream([])[1:]]

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events))
        return resp

    with WireServer(handle) as srv, running(model(srv)) as cb:
        stream = cb.stream("hi", max_tokens=20, logprobs=True)
        deltas = list(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert deltas[0].logprobs == lp
    assert result.logprobs == {**lp, "refusal": None}  # as the unstreamed answer says it


def test_an_n_stream_cut_after_its_first_choice_finished_is_cut_not_completed() -> None:
    """One choice's finish is not the stream's end: the other choice was still talking."""

    def said(index: int, text: str, finish: str | None = None) -> bytes:
        event = chunk({"content": text}, finish_reason=finish)
        event["choices"][0]["index"] = index
        return sse(event)

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(said(0, "A1", "stop") + said(1, "B1 and then"))
        return resp  # the body ends: no finish for choice 1, no usage, no [DONE]

    with WireServer(handle) as srv, running(model(srv)) as cb:
        stream = cb.stream("hi", n=2, max_tokens=20)
        with pytest.raises(StreamFailedError):
            list(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.STREAM_CUT
    assert result.partial_text == "A1"  # choice 0's, as ``Result.text`` is (it was both
    # choices' text in the order it came, nobody's answer; found by a hunt)


# -- leaving: close, drop, deadline --------------------------------------------------------------


@pytest.mark.parametrize("server", ["idle", "pinging", "flooding", "silent"])
def test_close_mid_stream_cancels_the_task_and_the_server_sees_the_connection_end(
    server: str,
) -> None:
    """Whatever the server does after the first delta: waits, sends only keep-alives
    (no delta to put), or writes faster than anyone reads; or, silent, it has sent
    no delta yet."""
    hold = Hold()
    ping = sse({"type": "ping"}, "ping") if server == "pinging" else None

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        if server == "silent":
            await hold.until_gone(resp)
        await resp.write(b"".join(events_of("openai")[:2]))
        if server == "flooding":
            try:
                for _ in range(100_000):
                    await resp.write(sse(chunk({"content": "more "})))
            except (asyncio.CancelledError, ConnectionResetError):
                hold.gone.set()
                raise
        await hold.until_gone(resp, ping)
        return resp

    with WireServer(handle) as srv, running(model(srv)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas = iter(stream)
        if server == "silent":
            srv.wait_for(1)
        else:
            assert next(deltas).text == "Hel"
        stream.close()
        result = stream.result(WAIT_S)
        with pytest.raises(StreamFailedError):
            list(deltas)  # nothing more: the task did not complete
        assert hold.gone.wait(WAIT_S), "the server saw the connection end"
        stats = cb.stats()
    assert isinstance(result, Cancelled), result
    assert stats.outcomes == {"cancelled": 1}


def _first_delta_then_held(hold: Hold, *, flood: bool = False) -> Handler:
    """A server whose stream sends its first delta (``Hel``), then (``flood``) as much
    as the client takes, and holds the connection until the client leaves; a request
    whose prompt is ``next`` is answered plainly."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        if arrival.json["messages"][0]["content"] == "next":
            return web.json_response(completion_body(content="next", usage=USAGE))
        resp = await open_stream(request)
        await resp.write(b"".join(events_of("openai")[:2]))
        if flood:
            try:
                for _ in range(100_000):
                    await resp.write(sse(chunk({"content": "more "})))
            except (asyncio.CancelledError, ConnectionResetError):
                hold.gone.set()
                raise
        await hold.until_gone(resp)
        return resp

    return handle


@pytest.mark.parametrize("server", ["idle", "flooding"])
def test_a_stream_dropped_unread_does_not_hold_its_call(server: str) -> None:
    """A reader that drops its stream (garbage) frees the call and its slot: the one slot
    of a one-call model serves the next request."""
    hold = Hold()
    handle = _first_delta_then_held(hold, flood=server == "flooding")
    with WireServer(handle) as srv, running(model(srv, max_concurrency=1)) as cb:
        stream = cb.stream("first", max_tokens=20)
        assert next(iter(stream)).text == "Hel"
        srv.wait_for(1)
        del stream
        gc.collect()
        assert hold.gone.wait(WAIT_S), "the server saw the connection end"
        after = cb.submit("next").result(WAIT_S)
        stats = cb.stats()
    assert isinstance(after, Completed), after
    assert stats.outcomes == {"cancelled": 1, "completed": 1}


def test_an_async_stream_dropped_unread_does_not_hold_its_call() -> None:
    """The async handle leaves when it is dropped, and only then: the sync one it was
    made from (``AsyncChatStream.of``) is dropped at once and must not end the stream."""
    hold = Hold()
    handle = _first_delta_then_held(hold)

    async def main(settings: ModelSettings) -> tuple[str, Any, bool]:
        async with AsyncSystem(SystemConfig(models=(settings,))) as cb:
            stream = cb.stream("first", max_tokens=20)
            gc.collect()  # the sync handle is gone: the stream is not
            first = await asyncio.wait_for(anext(aiter(stream)), WAIT_S)
            del stream
            gc.collect()
            gone = await asyncio.to_thread(hold.gone.wait, WAIT_S)
            after = await asyncio.wait_for(asyncio.wrap_future(cb.system.submit("next")), WAIT_S)
            return first.text, after, gone

    with WireServer(handle) as srv:
        first, after, gone = asyncio.run(main(model(srv, max_concurrency=1)))
    assert first == "Hel"
    assert gone, "the server saw the connection end"
    assert isinstance(after, Completed), after


def test_a_cancelled_reader_of_a_stream_it_alone_held_does_not_hold_its_call() -> None:
    """``async for delta in cb.stream(...)`` in a task that is cancelled: the stream was
    the loop's alone, so it is dropped, and its call ends. The cancelled wait's error,
    kept by the channel's waiter and the task, held the reading frame and the stream
    in it, and the call went on for as long as the provider sent (found by a hunt)."""
    hold = Hold()
    handle = _first_delta_then_held(hold)

    async def main(settings: ModelSettings) -> tuple[bool, Any]:
        async with AsyncSystem(SystemConfig(models=(settings,))) as cb:
            first = asyncio.Event()

            async def read() -> None:
                async for _ in cb.stream("first", max_tokens=20):
                    first.set()

            reader = asyncio.ensure_future(read())
            await asyncio.wait_for(first.wait(), WAIT_S)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            gc.collect()  # the reader task is still held here, and its error with it
            gone = await asyncio.to_thread(hold.gone.wait, WAIT_S)
            after = await asyncio.wait_for(asyncio.wrap_future(cb.system.submit("next")), WAIT_S)
            assert reader.cancelled()
            return gone, after

    with WireServer(handle) as srv:
        gone, after = asyncio.run(main(model(srv, max_concurrency=1)))
    assert gone, "the server saw the connection end"
    assert isinstance(after, Completed), after


@pytest.mark.parametrize("text_first", [True, False])
def test_a_deadline_mid_stream_ends_the_call(text_first: bool) -> None:
    """After a delta the task fails ``STREAM_CUT`` with the text (the reader has part of
    an answer); before any, it is ``Expired``. Either way the server sees the end."""
    hold = Hold()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events_of("openai")[: 2 if text_first else 1]))
        await hold.until_gone(resp)
        return resp

    with WireServer(handle) as srv, running(model(srv)) as cb:
        stream = cb.stream("hi", max_tokens=20, deadline_s=0.3)
        deltas: list[StreamDelta] = []
        with pytest.raises(StreamFailedError):
            deltas.extend(stream)
        result = stream.result(WAIT_S)
        assert hold.gone.wait(WAIT_S)
        calls = srv.count()
    assert result.latency_s < WAIT_S / 2
    assert calls == 1
    if text_first:
        assert isinstance(result, Failed), result
        assert (result.reason, result.partial_text) == (FailureReason.STREAM_CUT, "Hel")
        assert texts(deltas) == "Hel"
        assert "deadline" in result.detail
    else:
        assert isinstance(result, Expired), result
        assert deltas == []


@pytest.mark.parametrize("first_delta_late", [False, True])
def test_the_total_timeout_stops_counting_at_the_first_delta(first_delta_late: bool) -> None:
    """A stream may run longer than the total timeout while it sends; its first delta
    may not come later than it."""
    events = openai_stream(["a", "b", "c", "d", "e", "f"])

    gaps = [0.3, 0, 0, 0, 0, 0] if first_delta_late else [0, 0.06, 0.06, 0.06, 0.06, 0.06]

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(events[0])
        for gap, event in zip(gaps, events[1:7], strict=True):
            await asyncio.sleep(gap)  # the provider's time to first token, its token gap
            await resp.write(event)
        await resp.write(b"".join(events[7:]))
        return resp

    timeout = Timeouts(connect=5, read=5, total=0.2)
    settings = model_with(retry=RetryConfig(max_attempts=1), timeout=timeout)
    with WireServer(handle) as srv, running(settings(srv)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        with pytest.raises(StreamFailedError) if first_delta_late else contextlib.nullcontext():
            list(stream)
        result = stream.result(WAIT_S)
    if first_delta_late:
        assert isinstance(result, Failed), result
        assert result.reason is FailureReason.TIMEOUT
    else:
        assert isinstance(result, Completed), result
        assert result.content == "abcdef"
        assert result.latency_s > 0.2


def _streamed_with_key(api: str, events: list[bytes], key: str) -> tuple[list[StreamDelta], Any]:
    """``events`` streamed by a model of ``api`` whose key is ``key`` (registered: the
    guard against secrets spelled across deltas is on): the deltas and the result."""
    with WireServer(sending(events)) as srv:
        settings = dataclasses.replace(model(srv, api), api_key=key)
        with running(settings) as cb:
            stream = cb.stream("hi", max_tokens=20)
            return list(stream), stream.result(WAIT_S)


@pytest.mark.parametrize("api", DIALECTS)
def test_a_key_the_provider_spells_across_events_never_reaches_the_reader(api: str) -> None:
    """Each event is hidden alone; a provider echoing the key three characters an event
    spells it in none of them, yet the reader joining the deltas (and the result, and
    the gateway replaying it) would have it whole. The reader gets ``***``."""
    key = f"sk-spelled-{uuid.uuid4().hex}"
    pieces = ["you sent: ", *(key[i : i + 3] for i in range(0, len(key), 3)), " - ok"]
    deltas, result = _streamed_with_key(api, events_of(api, pieces), key)
    assert isinstance(result, Completed), result
    assert texts(deltas) == result.content == "you sent: *** - ok"
    assert key not in json.dumps(result.raw)


def test_a_key_spelled_across_a_tool_calls_name_never_reaches_the_reader() -> None:
    """Text, refusal and arguments were guarded; a tool call's name sent in pieces
    spelled the key to a reader joining them, and to the gateway's clients (found by a
    hunt). (An id in pieces is no such vector: each new id starts a call of its own.)"""
    key = f"sk-spelled-{uuid.uuid4().hex}"
    pieces = [key[i : i + 4] for i in range(0, len(key), 4)]
    head = {"index": 0, "id": "call_1", "type": "function"}
    head["function"] = {"name": pieces[0], "arguments": ""}
    events = [sse(chunk({"role": "assistant", "content": None}))]
    events.append(sse(chunk({"tool_calls": [head]})))
    named = ({"tool_calls": [{"index": 0, "function": {"name": p}}]} for p in pieces[1:])
    events += [sse(chunk(more)) for more in named]
    events.append(sse(chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})))
    events += [sse(chunk({}, finish_reason="tool_calls")), sse(chunk(usage=USAGE, choices=False))]
    deltas, result = _streamed_with_key("openai", [*events, sse("[DONE]")], key)
    assert isinstance(result, Completed), result
    joined = "".join(t.name or "" for d in deltas for t in d.tool_calls)
    assert key not in joined
    assert "***" in joined
    assert key not in json.dumps(result.raw)


@pytest.mark.parametrize("api", DIALECTS)
def test_a_tool_name_holding_a_keys_public_head_reaches_the_reader_whole(api: str) -> None:
    """A name guarded as text is held from a key's public head (``sk-``): ``ask-user``
    went out as ``a``, then ``sk-user``, and a reader taking a call's name from its
    first fragment (the gateway's Anthropic door) named the tool ``a`` (a review)."""
    key = f"sk-proj-{uuid.uuid4().hex}"
    call = {"id": "call_1", "name": "ask-user", "arguments": '{"q": "hi"}'}
    if api == "anthropic":
        body = message_body(
            tool_use_block(call["id"], call["name"], {"q": "hi"}), stop_reason="tool_use"
        )
        events = message_events(body, pieces=3)
    else:
        events = openai_stream([], tool_calls=[call])
    deltas, result = _streamed_with_key(api, events, key)
    assert isinstance(result, Completed), result
    named = [(t.id, t.name) for d in deltas for t in d.tool_calls if t.name or t.id]
    assert named == [("call_1", "ask-user")]
    first = next(t for d in deltas for t in d.tool_calls)
    assert first.name == "ask-user", "a call's first fragment names it"


def test_a_stream_cut_inside_a_key_keeps_the_begun_key_out_of_its_partial_text() -> None:
    """Text that may begin the key is held for the next piece; the body ended there. The
    reader never got it, and ``partial_text`` (which a results file, the ledger and the
    gateway's client get) held it: the text received so far is what the reader got."""
    key = f"sk-spelled-{uuid.uuid4().hex}"
    events = [sse(chunk({"role": "assistant", "content": ""}))]
    events += [sse(chunk({"content": "Hello "})), sse(chunk({"content": key[:14]}))]

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events))
        return resp  # the body ends: no finish, no [DONE]

    with WireServer(handle) as srv, running(dataclasses.replace(model(srv), api_key=key)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas: list[StreamDelta] = []
        with pytest.raises(StreamFailedError):
            deltas.extend(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Failed), result
    assert (result.reason, result.partial_text) == (FailureReason.STREAM_CUT, texts(deltas))
    assert texts(deltas) == "Hello "


def test_a_key_spelled_across_events_is_not_spelled_by_their_logprobs() -> None:
    """Each chunk's logprobs name its tokens: those of a key's pieces spelled it past the
    guard's ``***``, to the reader, the gateway's clients and ``Result.logprobs``."""
    key = f"sk-spelled-{uuid.uuid4().hex}"
    pieces = ["you sent: ", *(key[i : i + 12] for i in range(0, len(key), 12)), " ok"]
    events = [sse(chunk({"role": "assistant", "content": ""}))]
    for piece in pieces:
        said = chunk({"content": piece})
        token = {"token": piece, "logprob": -0.1, "bytes": list(piece.encode()), "top_logprobs": []}
        said["choices"][0]["logprobs"] = {"content": [token], "refusal": None}
        events.append(sse(said))
    deltas, result = _streamed_with_key("openai", [*events, *openai_stream([])[1:]], key)
    assert isinstance(result, Completed), result
    assert result.content == "you sent: *** ok"
    # tokens of the text around the key, each at most once, in order; none of the key's.
    # A token whose text may begin a secret waits for the next delta (dropped if what
    # follows spells one): which delta carries it, and whether it goes, depends on the
    # secrets registered (this test asked that each delta's tokens be its text, and
    # failed when the suite had registered one whose head is " ok")
    shown = [t["token"] for d in deltas for t in (d.logprobs or {}).get("content") or ()]
    around = ["you sent: ", " ok"]
    assert [t for t in around if t in shown] == shown, shown
    assert " ok" in shown
    assert result.logprobs is None


@pytest.mark.parametrize("api", DIALECTS)
def test_text_held_back_for_a_key_goes_before_the_tool_call_that_follows(api: str) -> None:
    """With a key known (every real deployment) a text whose end may begin it (``sk-``,
    past ``SHOWN_AT_MOST`` characters) is held for the next piece; a tool call coming
    next ends that text, and the held end goes first, not after the call (the
    gateway's Anthropic door opened a third block for it)."""
    key = f"sk-held-{uuid.uuid4().hex}"
    call = {"id": "call_1", "name": "search", "arguments": '{"q": "news"}'}
    if api == "anthropic":
        body = message_body(
            text_block("Let me look up keys like sk-"),
            tool_use_block(call["id"], call["name"], {"q": "news"}),
            stop_reason="tool_use",
        )
        events = message_events(body, pieces=["Let me look", " up keys like sk-"])
    else:
        events = openai_stream(["Let me look", " up keys like sk-"], tool_calls=[call])
    deltas, result = _streamed_with_key(api, events, key)
    assert isinstance(result, Completed), result
    kinds = ["text" if d.text else "call" if d.tool_calls else "end" for d in deltas]
    assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "text"), kinds
    assert texts(deltas) == result.content == "Let me look up keys like sk-"


def _thinking_first(api: str) -> tuple[bytes, list[bytes], list[bytes]]:
    """A streamed answer ``abc`` whose model thinks first: the events up to its first
    thought, then the other thoughts (four deltas) and the rest. Anthropic's extended thinking is a
    ``thinking`` block of ``thinking_delta``s and a ``signature_delta``; an
    OpenAI-compatible server of a reasoning model streams ``reasoning_content``."""
    if api == "anthropic":
        text = message_events(message_body(text_block("abc")), pieces=["a", "b", "c"])
        text = [e.replace(b'"index":0', b'"index":1') for e in text]
        block = {"type": "thinking", "thinking": "", "signature": ""}
        started = {"type": "content_block_start", "index": 0, "content_block": block}
        thought = [
            sse({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
            for delta in [{"type": "thinking_delta", "thinking": f"step {k}. "} for k in range(4)]
            + [{"type": "signature_delta", "signature": "EqQBCgIYAhIM"}]
        ]
        head = b"".join([*text[:2], sse(started, "content_block_start"), thought[0]])
        stop = sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
        return head, thought[1:], [stop, *text[2:]]
    text = openai_stream(["a", "b", "c"])
    if api == "mistral":  # its reasoning models: thinking as content parts (a review)
        said = [[{"type": "text", "text": f"step {k}. "}] for k in range(5)]
        thought = [sse(chunk({"content": [{"type": "thinking", "thinking": t}]})) for t in said]
    else:
        thought = [sse(chunk({"reasoning_content": f"step {k}. "})) for k in range(5)]
    return text[0] + thought[0], thought[1:], text[1:]


@pytest.mark.parametrize("shape", ["reasoning_content", "reasoning", "mistral"])
def test_a_reasoning_models_thinking_reaches_the_reader_apart_from_its_text(shape: str) -> None:
    """DeepSeek's and vLLM's ``reasoning_content``, OpenRouter's ``reasoning``, Mistral's
    thinking parts: the reader got none of it, and the answer assembled from the stream
    lost what the unstreamed answer keeps (found by a hunt). It comes as the deltas'
    ``reasoning``, never in their text; the answer keeps it as the provider named it."""

    def thought(k: int) -> dict[str, Any]:
        said = f"step {k}. "
        if shape == "mistral":
            return {"content": [{"type": "thinking", "thinking": [{"type": "text", "text": said}]}]}
        return {shape: said}

    text = openai_stream(["a", "b", "c"])
    events = [text[0], *(sse(chunk(thought(k))) for k in range(3)), *text[1:]]
    with WireServer(sending(events)) as srv, running(model(srv)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas = list(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert texts(deltas) == result.content == "abc"
    assert "".join(d.reasoning for d in deltas) == "step 0. step 1. step 2. "
    named = "reasoning" if shape == "reasoning" else "reasoning_content"
    assert result.raw is not None
    assert result.raw["choices"][0]["message"][named] == "step 0. step 1. step 2. "


def test_a_key_spelled_across_reasoning_deltas_never_reaches_the_reader() -> None:
    """The reasoning is guarded as the text is: a provider echoing the key in pieces of
    its thinking spells it in none of them."""
    key = f"sk-spelled-{uuid.uuid4().hex}"
    pieces = ["you sent: ", *(key[i : i + 5] for i in range(0, len(key), 5)), " - ok"]
    text = openai_stream(["fine"])
    events = [text[0], *(sse(chunk({"reasoning_content": p})) for p in pieces), *text[1:]]
    deltas, result = _streamed_with_key("openai", events, key)
    assert isinstance(result, Completed), result
    assert "".join(d.reasoning for d in deltas) == "you sent: *** - ok"
    assert key not in json.dumps(result.raw)


@pytest.mark.parametrize("api", [*DIALECTS, "mistral"])
def test_a_model_thinking_before_its_text_is_under_way_not_late(api: str) -> None:
    """Thinking (extended thinking, a reasoning model's ``reasoning_content``) comes
    before any text, for longer than a total timeout may allow a silent provider: the
    stream is under way from its first thought, so the total timeout stops counting
    there, as at a first delta (before, it was cut and tried again from the start,
    each attempt billed). The reader's text holds none of the thinking."""
    head, thoughts, rest = _thinking_first(api)

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(head)
        for event in thoughts:
            await asyncio.sleep(0.12)  # the model's pace of thought: 0.48 s in all
            await resp.write(event)
        await resp.write(b"".join(rest))
        return resp

    timeout = Timeouts(connect=5, read=5, total=0.25)
    dialect = "openai" if api == "mistral" else api
    settings = model_with(api=dialect, retry=RetryConfig(max_attempts=1), timeout=timeout)
    with WireServer(handle) as srv, running(settings(srv)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        got = texts(list(stream))
        result = stream.result(WAIT_S)
        assert len(srv.arrivals) == 1
    assert isinstance(result, Completed), result
    assert got == result.content == "abc"
    assert result.latency_s > 0.45


def test_a_stream_whose_body_breaks_mid_chunk_is_cut_once_silent_for_its_read_timeout() -> None:
    """A malformed chunk size after the first delta: aiohttp's parser drops the rest and
    its own read timeout never fires, so without a deadline the stream, and its slot,
    were held for good. It ends ``STREAM_CUT`` with the text read, between one and two
    read timeouts after its last byte."""
    hold, heard = Hold(), Cue()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)  # chunked: the body's chunks are ours to break
        await resp.write(b"".join(events_of("openai")[:2]))
        assert await heard.wait()  # apart from the good bytes, or they break with them
        assert request.transport is not None
        request.transport.write(b"zz\r\n")  # not a chunk size
        await hold.until_gone(resp)
        return resp

    timeout = Timeouts(connect=5, read=0.2, total=WAIT_S * 2)
    with WireServer(handle) as srv, running(model(srv, timeout=timeout)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        reading = iter(stream)
        deltas = [next(reading)]
        heard.set()
        with pytest.raises(StreamFailedError):
            deltas.extend(reading)
        result = stream.result(WAIT_S)
        assert hold.gone.wait(WAIT_S)
        calls = srv.count()
    assert isinstance(result, Failed), result
    assert (result.reason, result.partial_text) == (FailureReason.STREAM_CUT, "Hel")
    assert "sent nothing for 0.2 s" in result.detail
    assert 0.2 <= result.latency_s < WAIT_S / 2
    assert (texts(deltas), calls) == ("Hel", 1)


@pytest.mark.parametrize("api", DIALECTS)
def test_keep_alives_after_the_first_delta_do_not_hold_off_the_silence_cut(api: str) -> None:
    """A proxy sends ``: keep-alive`` while its upstream has stalled: a stream that had
    begun was never cut, and held its slot for good."""
    hold = Hold()
    ping = b": keep-alive\n\n"

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events_of(api)[: before_text(api) + 1]))
        await hold.until_gone(resp, ping=ping)
        return resp

    timeout = Timeouts(connect=5, read=0.2, total=WAIT_S * 2)
    with WireServer(handle) as srv, running(model(srv, api, timeout=timeout)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        with pytest.raises(StreamFailedError):
            list(stream)
        result = stream.result(WAIT_S)
        assert hold.gone.wait(WAIT_S)
    assert isinstance(result, Failed), result
    assert (result.reason, result.partial_text) == (FailureReason.STREAM_CUT, "Hel")
    assert "sent nothing for 0.2 s" in result.detail


@pytest.mark.parametrize("between", ["pings", "an event read slowly"])
def test_the_providers_pings_and_an_event_coming_slowly_are_not_silence(between: str) -> None:
    """Anthropic pings while a tool's input is written; a long event may come over many
    reads. Neither is the silence the read timeout cuts."""
    events = events_of("anthropic")
    head, text, rest = events[:3], events[3], events[4:]

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(head) + text)
        if between == "pings":
            for _ in range(16):  # 0.8 s of pings against a read timeout of 0.3 s
                await resp.write(sse({"type": "ping"}, "ping"))
                await asyncio.sleep(0.05)
        else:
            slow = events[4]
            assert len(slow) >= 100  # over 0.3 s in all
            for i in range(0, len(slow), 8):  # 8 bytes every 30 ms
                await resp.write(slow[i : i + 8])
                await asyncio.sleep(0.03)
            rest.pop(0)
        await resp.write(b"".join(rest))
        return resp

    # each gap a sixth of the read timeout or less: a loaded machine's stall of 70 ms
    # between two of a server's writes was taken for silence, against a timeout of 0.1 s
    timeout = Timeouts(connect=5, read=0.3, total=WAIT_S * 2)
    with WireServer(handle) as srv, running(model(srv, "anthropic", timeout=timeout)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        deltas = list(stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert texts(deltas) == "".join(TEXT)


def test_a_stream_sending_past_its_cap_is_cut_not_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server streaming deltas for ever, past ``max_tokens``, held 800 MB in 12 s."""
    monkeypatch.setattr(http, "MAX_STREAM_BYTES", 64 * 1024)
    hold, heard = Hold(), Cue()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events_of("openai")[:2]))
        assert await heard.wait()  # the reader has the first delta: the stream began
        with contextlib.suppress(ConnectionError):
            while not hold.gone.is_set():
                await resp.write(sse(chunk({"content": "x" * 100})) * 16)
                await asyncio.sleep(0)
        return resp

    with WireServer(handle) as srv, running(model(srv)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        reading = iter(stream)
        assert next(reading).text == TEXT[0]
        heard.set()
        with pytest.raises(StreamFailedError):
            for _ in reading:
                pass
        result = stream.result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.STREAM_CUT
    assert "larger than" in result.detail


def test_a_stream_whose_compression_breaks_is_malformed_not_a_transport_bug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"content-type": "text/event-stream", "content-encoding": "gzip"}
        )
        await resp.prepare(request)
        await resp.write(b"not gzip at all" * 10)
        return resp

    with WireServer(handle) as srv, running(model(srv, retry=RetryConfig(max_attempts=1))) as cb:
        result = cb.stream("hi", max_tokens=20).result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.MALFORMED_RESPONSE
    assert "unexpectedly" not in caplog.text


def test_a_reader_behind_for_longer_than_the_read_timeout_is_not_the_providers_silence() -> None:
    """The call waits for its reader (the channel full) far longer than the read timeout:
    the stream is not cut for it, and reads on to its end when the reader comes back."""
    pieces = [f"{i:04d}" for i in range(600)]  # more than a channel holds

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(openai_stream(pieces)))
        return resp

    timeout = Timeouts(connect=5, read=0.1, total=WAIT_S * 2)
    with WireServer(handle) as srv, running(model(srv, timeout=timeout)) as cb:
        stream = cb.stream("hi", max_tokens=600)
        reading = iter(stream)
        first = next(reading)
        away = threading.Event()
        assert not away.wait(1.0)  # the reader away for ten read timeouts (nothing to await)
        rest = list(reading)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert texts([first, *rest]) == "".join(pieces) == result.content


def model_with(**kw: Any) -> Callable[[WireServer], ModelSettings]:
    return lambda srv: model(srv, **kw)


# -- asyncio ------------------------------------------------------------------------------------


def test_an_async_stream_leaves_its_loop_free_while_it_waits() -> None:
    """The reader awaits the second delta; meanwhile another task of the same loop lets
    the server go on: had the reader blocked the loop, the server would never be let."""
    hold = Hold()
    events = events_of("openai")

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events[:2]))
        await hold.until_released()
        for event in events[2:]:
            await resp.write(event)
        return resp

    async def main(settings: ModelSettings) -> tuple[list[StreamDelta], Any]:
        first_seen = asyncio.Event()

        async def release() -> None:
            await first_seen.wait()
            hold.go.set()

        async with AsyncSystem(SystemConfig(models=(settings,))) as cb:
            releaser = asyncio.create_task(release())
            deltas = []
            async with cb.stream("hi", max_tokens=20) as stream:
                async for delta in stream:
                    deltas.append(delta)
                    first_seen.set()
                result = await stream.result()
            await releaser
        return deltas, result

    with WireServer(handle) as srv:
        deltas, result = asyncio.run(asyncio.wait_for(main(model(srv)), WAIT_S))
    assert hold.released == [True]
    assert isinstance(result, Completed), result
    assert texts(deltas) == result.content == "Hello world"


def test_an_async_stream_cut_raises_and_one_closed_early_is_cancelled() -> None:
    hold = Hold()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        if arrival.json["messages"][0]["content"] == "cut":
            return await _cut_after_text("openai", "dropped")(request, arrival)
        resp = await open_stream(request)
        await resp.write(b"".join(events_of("openai")[:2]))
        await hold.until_gone(resp)
        return resp

    async def main(settings: ModelSettings) -> tuple[str, Any, Any]:
        async with AsyncSystem(SystemConfig(models=(settings,))) as cb:
            got: list[str] = []
            cut = cb.stream("cut", max_tokens=20)
            with pytest.raises(StreamFailedError):
                await _read(cut, got)
            async with cb.stream("leave", max_tokens=20) as left:
                async for _ in left:
                    break  # leaves the with block: closed
            return "".join(got), await cut.result(), await left.result()

    with WireServer(handle) as srv:
        got, cut, left = asyncio.run(asyncio.wait_for(main(model(srv)), WAIT_S))
        assert hold.gone.wait(WAIT_S)
    assert got == "Hello"
    assert isinstance(cut, Failed), cut
    assert (cut.reason, cut.partial_text) == (FailureReason.STREAM_CUT, "Hello")
    assert isinstance(left, Cancelled), left


LONG = [f"w{i} " for i in range(400)]  # more deltas than a channel holds unread (256)


def _long_answer() -> Handler:
    """A stream of ``LONG``, sent as fast as the socket takes it."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(openai_stream(LONG)))
        return resp

    return handle


def test_the_result_asked_before_any_delta_is_read_comes_however_long_the_stream() -> None:
    """``stream.result()`` with no reader: the call waited for room for its 257th delta,
    and the result never came (found by a hunt). Asked first, the deltas are dropped
    and the answer assembled; the sync and the async stream alike."""

    async def asked(settings: ModelSettings) -> Any:
        async with AsyncSystem(SystemConfig(models=(settings,))) as cb:
            return await cb.stream("hi", max_tokens=500).result()

    with WireServer(_long_answer()) as srv:
        settings = model(srv)
        with running(settings) as cb:
            result = cb.stream("hi", max_tokens=500).result(WAIT_S)
        later = asyncio.run(asyncio.wait_for(asked(settings), WAIT_S))
    for got in (result, later):
        assert isinstance(got, Completed), got
        assert got.content == "".join(LONG)


def test_giving_up_a_wait_for_the_result_leaves_the_stream_to_its_reader() -> None:
    """One task reads the stream, another waits for its result with a timeout: the
    timeout cancelled the task's future, the reader got a bare ``CancelledError`` in
    the middle and the call stayed in flight, its slot and reservation held (found by
    a hunt). Giving up the wait now gives up nothing else."""
    go = Cue()
    events = openai_stream(LONG)

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events[:100]))
        await go.wait()  # the rest once the wait for the result was given up
        await resp.write(b"".join(events[100:]))
        return resp

    async def main(settings: ModelSettings) -> tuple[str, Any]:
        async with AsyncSystem(SystemConfig(models=(settings,))) as cb:
            stream = cb.stream("hi", max_tokens=500)
            got: list[str] = []
            reader = asyncio.ensure_future(_read(stream, got))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(stream.result(), 0.05)
            go.set()
            await reader
            return "".join(got), await stream.result()

    with WireServer(handle) as srv:
        got, result = asyncio.run(asyncio.wait_for(main(model(srv)), WAIT_S))
    assert isinstance(result, Completed), result
    assert got == result.content == "".join(LONG)


def test_a_reader_after_the_deltas_were_dropped_is_told_not_given_an_empty_stream() -> None:
    """``stream.result(timeout=0)`` timed out, then ``for d in stream`` ended at once
    with no delta while the result held the whole text: a silent truncation (found by
    a hunt). The deltas dropped for the result stay dropped; the reader is told."""
    with WireServer(_long_answer()) as srv, running(model(srv)) as cb:
        stream = cb.stream("hi", max_tokens=500)
        with pytest.raises(TimeoutError):
            stream.result(timeout=0)
        result = stream.result(WAIT_S)
        with pytest.raises(DeltasDroppedError, match="deltas were dropped"):
            list(stream)
    assert isinstance(result, Completed), result
    assert result.content == "".join(LONG)


def test_a_reader_started_beside_the_wait_for_the_result_reads_every_delta() -> None:
    """``reader = ensure_future(read(stream)); await stream.result()``: the result is
    asked before the reader's first step; the deltas are dropped only once the
    channel is full and nobody has asked for one (found by review: asked first, they
    were dropped at once, and the reader got none)."""

    async def main(settings: ModelSettings) -> tuple[str, Any]:
        async with AsyncSystem(SystemConfig(models=(settings,))) as cb:
            stream = cb.stream("hi", max_tokens=500)
            got: list[str] = []
            reader = asyncio.ensure_future(_read(stream, got))
            result = await stream.result()
            await reader
            return "".join(got), result

    with WireServer(_long_answer()) as srv:
        got, result = asyncio.run(asyncio.wait_for(main(model(srv)), WAIT_S))
    assert isinstance(result, Completed), result
    assert got == result.content == "".join(LONG)


def test_two_tasks_reading_one_stream_share_it_and_both_end() -> None:
    """A second task's wait replaced the first's, which then waited for ever, the
    stream long ended (found by a hunt); and a third reader cancelled while it waits
    ends only itself."""
    go = Cue()
    events = openai_stream(LONG)

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events[:3]))
        await go.wait()  # every reader is waiting now
        for event in events[3:]:
            await resp.write(event)
        return resp

    async def main(settings: ModelSettings) -> tuple[list[str], Any]:
        async with AsyncSystem(SystemConfig(models=(settings,))) as cb:
            stream = cb.stream("hi", max_tokens=500)
            a: list[str] = []
            b: list[str] = []
            c: list[str] = []
            readers = [asyncio.ensure_future(_read(stream, got)) for got in (a, b, c)]
            await asyncio.sleep(0.2)  # all three wait for the held rest
            readers[2].cancel()
            go.set()
            await asyncio.wait_for(asyncio.gather(*readers[:2]), WAIT_S)
            assert readers[2].cancelled()
            return a + b + c, await stream.result()

    with WireServer(handle) as srv:
        read, result = asyncio.run(asyncio.wait_for(main(model(srv)), WAIT_S))
    assert isinstance(result, Completed), result
    assert sorted(t for t in read if t) == sorted(t for t in LONG if t)  # each once


def test_a_streams_future_cancelled_by_hand_stops_the_call_and_its_reader() -> None:
    """``future.cancel()`` is how a caller gives up any task; a stream's call went on
    reading (the channel closed, not abandoned). The call stops, and the reader ends
    with ``StreamFailedError`` carrying a ``Cancelled``."""
    hold = Hold()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(b"".join(events_of("openai")[:2]))
        await hold.until_gone(resp, ping=b": keep-alive\n\n")
        return resp

    with WireServer(handle) as srv, running(model(srv)) as cb:
        stream = cb.stream("hi", max_tokens=20)
        first = next(iter(stream))
        assert stream._future.cancel()
        with pytest.raises(StreamFailedError) as ended:
            list(stream)
        assert hold.gone.wait(WAIT_S), "the call still reads"
    assert first.text == "Hel"
    assert isinstance(ended.value.result, Cancelled)


async def _read(stream: AsyncChatStream, into: list[str]) -> None:
    """Read ``stream`` to its end, each delta's text into ``into`` as it comes."""
    async for delta in stream:
        into.append(delta.text)  # noqa: PERF401 - kept as it comes, before a raise


# -- the books ------------------------------------------------------------------------------------


def test_a_stream_is_charged_its_final_usage_and_a_cut_one_its_estimate() -> None:
    """Budgets hold for streams: a whole one is charged from the usage its last chunk
    reported; one cut after a delta, which reports none, at the most it could have
    used (marked estimated), as an unstreamed call without usage is."""
    price = Price(input_per_mtok=Decimal("1.00"), output_per_mtok=Decimal("2.00"))

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        if arrival.json["messages"][0]["content"] == "cut":
            return await _cut_after_text("openai", "dropped")(request, arrival)
        resp = await open_stream(request)
        await resp.write(b"".join(events_of("openai")))
        return resp

    with WireServer(handle) as srv:
        config = SystemConfig(
            models=(model(srv, price=price),),
            budget=BudgetSettings(total_usd=Decimal("1.00")),
        )
        with System(config) as cb:
            whole, cut = cb.stream("whole", max_tokens=30), cb.stream("cut", max_tokens=30)
            list(whole)
            with pytest.raises(StreamFailedError):
                list(cut)
            results = [whole.result(WAIT_S), cut.result(WAIT_S)]
            assert cb.drain(WAIT_S)
            stats = cb.stats()
    paid, broken = results
    assert isinstance(paid, Completed), paid
    assert isinstance(broken, Failed), broken
    assert paid.usage == Usage(prompt_tokens=7, completion_tokens=3)
    assert paid.cost_nusd == cost_nusd(price, paid.usage) > 0
    assert broken.usage.estimated
    assert broken.usage.completion_tokens == 30
    assert broken.cost_nusd == cost_nusd(price, broken.usage) > paid.cost_nusd
    assert stats.total.cost_nusd == paid.cost_nusd + broken.cost_nusd


def test_the_stats_balance_over_streams_that_end_every_way() -> None:
    hold = Hold()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        prompt = arrival.json["messages"][0]["content"]
        if prompt == "cut":
            return await _cut_after_text("openai", "dropped")(request, arrival)
        if not arrival.json.get("stream"):
            return web.json_response(completion_body(content="plain", usage=USAGE))
        resp = await open_stream(request)
        if prompt == "leave":
            await resp.write(b"".join(events_of("openai")[:2]))
            await hold.until_gone(resp)
            return resp
        await resp.write(b"".join(events_of("openai")))
        return resp

    with WireServer(handle) as srv, running(model(srv)) as cb:
        whole = [cb.stream(f"whole {i}", max_tokens=20) for i in range(3)]
        cut = cb.stream("cut", max_tokens=20)
        left = cb.stream("leave", max_tokens=20)
        plain = cb.submit("plain", max_tokens=20)
        assert [texts(list(s)) for s in whole] == ["Hello world"] * 3
        with pytest.raises(StreamFailedError):
            list(cut)
        assert next(iter(left)).text == "Hel"
        left.close()
        results = [s.result(WAIT_S) for s in (*whole, cut, left)] + [plain.result(WAIT_S)]
        assert cb.drain(WAIT_S)
        stats = cb.stats()
    assert [type(r).__name__ for r in results] == ["Completed"] * 3 + [
        "Failed",
        "Cancelled",
        "Completed",
    ]
    assert stats.outcomes == {"completed": 4, "failed": 1, "cancelled": 1}
    assert stats.failures == {"stream_cut": 1}
    assert stats.ledger["accepted"] == stats.ledger["finished"] == 6
    assert stats.total.ttft.count == 3, "a time to first token per completed stream"
    assert stats.by_model["m"].ttft.count == stats.by_priority["NORMAL"].ttft.count == 3
    ttfts = sorted(r.ttft_s for r in results[:3] if isinstance(r, Completed) and r.ttft_s)
    assert stats.total.ttft.max == ttfts[-1]
    assert stats.total.completion_tokens == sum(r.usage.completion_tokens for r in results)
