"""The simulated provider's HTTP face (provider/app.py), checked with the official SDKs.

The ``openai`` and ``anthropic`` SDKs talk to the real server on loopback and
parse its answers and stream events with their own types; the shapes are also
validated strictly (``model_validate``), since the SDKs build responses without
validation. Faults and rate limits are checked on every endpoint."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import json
import logging
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from callboard.provider.app import _BATCH, _Events, check_loopback, host_arg
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.wire.anthropic import StreamAssembler
from callboard.wire.openai import ChunkAssembler
from callboard.wire.sse import EventStream
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, TypeAdapter
from support import WAIT_S, LogCollector, accepted_as_it_stops, wait_until

KEY = "sk-test-4242"
FAST = ModelBehaviour(latency_s=0.0)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]

Factory = Callable[..., SimulatedProvider]
"""What the ``make_provider`` fixture (conftest.py) gives."""


@pytest.fixture
def make_provider(make_provider: Factory) -> Factory:
    """Providers that check the test key, unless a test says ``api_key=None``."""
    return lambda **kwargs: make_provider(**{"api_key": KEY, **kwargs})


@pytest.fixture
def sim(make_provider: Factory) -> SimulatedProvider:
    return make_provider()


@pytest.fixture
def oai(sim: SimulatedProvider) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=sim.base_url, api_key=KEY, max_retries=0) as client:
        yield client


def claude_for(provider: SimulatedProvider, **kwargs: Any) -> anthropic.Anthropic:
    root = provider.base_url.removesuffix("/v1")
    kwargs.setdefault("api_key", KEY)
    return anthropic.Anthropic(base_url=root, max_retries=0, **kwargs)


@pytest.fixture
def claude(sim: SimulatedProvider) -> Iterator[anthropic.Anthropic]:
    with claude_for(sim) as client:
        yield client


@pytest.mark.parametrize("host", ["127.0.0.1.5", "127.300.0.1"])
def test_loopback_check_refuses_what_is_not_an_ip_literal(host: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        check_loopback(host)


# --- OpenAI: chat completions -----------------------------------------------------------


def test_chat_with_every_field_parses_as_the_sdk_types(
    oai: openai.OpenAI, sim: SimulatedProvider
) -> None:
    messages: Any = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "name": "ann",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": png_url(512, 512), "detail": "high"}},
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                {"type": "file", "file": {"file_id": "file-1"}},
            ],
        },
    ]
    raw = oai.chat.completions.with_raw_response.create(
        model="m",
        messages=messages,
        max_completion_tokens=12,
        temperature=0.5,
        top_p=0.9,
        frequency_penalty=0.1,
        presence_penalty=0.1,
        logit_bias={"50256": -100},
        logprobs=True,
        top_logprobs=2,
        n=2,
        seed=7,
        stop=["\n\n"],
        user="u-1",
        service_tier="auto",
        reasoning_effort="low",
        metadata={"k": "v"},
        store=False,
    )
    completion = raw.parse()
    ChatCompletion.model_validate(json.loads(raw.content))
    assert raw.headers["x-request-id"].startswith("req_")
    assert [c.index for c in completion.choices] == [0, 1]
    usage = completion.usage
    assert usage is not None
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 2 * 12  # low effort: 32 > cap
    assert all(c.finish_reason == "length" for c in completion.choices)
    assert usage.prompt_tokens > 255  # the 512x512 image: 170 * 1 tile + 85
    assert completion.service_tier == "default"
    assert sim.stats()["models"]["m"]["prompt_tokens"] == usage.prompt_tokens


def test_logprobs_follow_the_tokens_of_the_content(oai: openai.OpenAI) -> None:
    completion = oai.chat.completions.create(
        model="m", messages=USER, logprobs=True, top_logprobs=3, max_tokens=5
    )
    choice = completion.choices[0]
    assert choice.logprobs is not None
    content = choice.logprobs.content
    assert content is not None
    assert "".join(t.token for t in content) == choice.message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)


def test_a_bad_field_is_a_400_naming_the_param(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model="m", messages=USER, temperature=3)
    assert bad.value.param == "temperature"
    ours = oai.chat.completions.create(model="m", messages=USER, extra_body={"top_k": 5})
    assert ours.choices[0].message.content  # a provider-specific field: accepted
    bad_part: Any = [{"role": "user", "content": [{"type": "video", "video": {}}]}]
    with pytest.raises(openai.BadRequestError) as part:
        oai.chat.completions.create(model="m", messages=bad_part)
    assert part.value.param == "messages[0].content[0].type"


def test_tool_choice_auto_calls_the_first_tool_then_answers_after_its_result(
    oai: openai.OpenAI,
) -> None:
    first = oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER, TIME])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert len(call.id) == len("call_") + 24
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "example", "unit": "celsius", "days": 1}
    history: Any = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    second = oai.chat.completions.create(model="m", messages=history, tools=[WEATHER, TIME])
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content


@pytest.mark.parametrize(
    ("choice", "names", "finish"),
    [
        ("none", [], "stop"),
        ("required", ["get_weather"], "tool_calls"),
        ({"type": "function", "function": {"name": "get_time"}}, ["get_time"], "tool_calls"),
    ],
)
def test_tool_choice_is_honoured(
    oai: openai.OpenAI, choice: Any, names: list[str], finish: str
) -> None:
    completion = oai.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER, TIME], tool_choice=choice
    )
    calls = completion.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == names
    assert completion.choices[0].finish_reason == finish


def test_parallel_tool_calls_call_every_tool_with_distinct_ids(oai: openai.OpenAI) -> None:
    completion = oai.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER, TIME], parallel_tool_calls=True
    )
    calls = completion.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2
    assert json.loads(calls[1].function.arguments) == {}


class Address(BaseModel):
    street: str
    zip_code: int


class Person(BaseModel):
    name: str
    age: int
    tags: list[str]
    home: Address
    nickname: str | None


def test_json_schema_answers_validate_with_the_sdk_parse(oai: openai.OpenAI) -> None:
    parsed = oai.chat.completions.parse(model="m", messages=USER, response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person)
    assert person.home.zip_code == 0
    assert parsed.choices[0].finish_reason == "stop"


def test_a_pydantic_tool_gets_arguments_its_model_parses(oai: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(Person)
    parsed = oai.chat.completions.parse(model="m", messages=USER, tools=[tool])
    (call,) = parsed.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Person)


def test_json_object_answers_a_json_object(oai: openai.OpenAI) -> None:
    completion = oai.chat.completions.create(
        model="m", messages=USER, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(completion.choices[0].message.content or ""), dict)


def test_an_unsatisfiable_schema_is_a_400(oai: openai.OpenAI) -> None:
    fmt: Any = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
    }
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model="m", messages=USER, response_format=fmt)
    assert bad.value.param == "response_format.json_schema.schema"


def test_a_stop_sequence_cuts_the_filler(oai: openai.OpenAI) -> None:
    completion = oai.chat.completions.create(model="m", messages=USER, stop=["fox"], max_tokens=50)
    assert completion.choices[0].message.content == "the quick brown "
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 3


def test_a_long_conversation_sent_again_reads_its_prefix_from_the_cache(
    oai: openai.OpenAI,
) -> None:
    history: Any = [
        {"role": "system", "content": "You answer from this document. " + "x" * 6000},
        {"role": "user", "content": "First question?"},
    ]
    first = oai.chat.completions.create(model="m", messages=history)
    second = oai.chat.completions.create(model="m", messages=history)
    assert first.usage is not None
    assert second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == 1024  # 1132 + 4 + 3 tokens before the last message, in steps of 128
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    short = oai.chat.completions.create(model="m", messages=USER)
    assert short.usage is not None
    assert short.usage.prompt_tokens_details is not None
    assert short.usage.prompt_tokens_details.cached_tokens == 0


# --- OpenAI: streams --------------------------------------------------------------------


def test_a_stream_parses_as_chunks_and_assembles_into_the_unstreamed_answer(
    make_provider: Factory,
) -> None:
    provider = make_provider(default=ModelBehaviour(latency_s=0.0, completion_tokens=9))
    with openai.OpenAI(base_url=provider.base_url, api_key=KEY, max_retries=0) as client:
        plain = client.chat.completions.create(model="m", messages=USER)
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=USER, stream=True, stream_options={"include_usage": True}
        )
        assert raw.headers["content-type"].startswith("text/event-stream")
        chunks = list(raw.parse())
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert len(chunks) == 1 + 9 + 1 + 1  # role, a token per chunk, finish, usage


def test_stream_tool_call_deltas_assemble_to_the_call(oai: openai.OpenAI) -> None:
    plain = oai.chat.completions.create(model="m", messages=USER, tools=[WEATHER])
    with oai.chat.completions.stream(model="m", messages=USER, tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(deltas) > 3
    (call,) = final.choices[0].message.tool_calls or []
    (expected,) = plain.choices[0].message.tool_calls or []
    assert call.function.arguments == expected.function.arguments
    assert final.choices[0].finish_reason == "tool_calls"


def test_callboards_assembler_rebuilds_the_unstreamed_body(
    make_provider: Factory, client: httpx.Client
) -> None:
    provider = make_provider(
        default=ModelBehaviour(latency_s=0.0, completion_tokens=12), api_key=None
    )
    for extra in ({}, {"tools": [WEATHER, TIME], "parallel_tool_calls": True}, {"n": 2}):
        body = {"model": "m", "messages": USER, "max_tokens": 20, **extra}
        url = f"{provider.base_url}/chat/completions"
        plain = client.post(url, json=body).json()
        streamed = client.post(url, json={**body, "stream": True}).content
        assembler = ChunkAssembler(choices=extra.get("n", 1))
        for event in EventStream().feed(streamed):
            if event.data != "[DONE]":
                assembler.feed(json.loads(event.data))
        rebuilt = assembler.completion()
        for got, want in zip(rebuilt["choices"], plain["choices"], strict=True):
            assert got["message"]["content"] == want["message"]["content"]
            assert calls(got) == calls(want)  # their ids differ: two answers
            assert got["finish_reason"] == want["finish_reason"]


def test_time_to_first_token_and_gap_pace_the_stream(make_provider: Factory) -> None:
    slow = ModelBehaviour(latency_s=0.0, ttft_s=0.2, token_gap_s=0.02, completion_tokens=10)
    provider = make_provider(default=slow)
    with openai.OpenAI(base_url=provider.base_url, api_key=KEY, max_retries=0) as client:
        began = time.monotonic()
        stream = client.chat.completions.create(model="m", messages=USER, stream=True)
        arrivals = [
            time.monotonic() - began
            for chunk in stream
            if chunk.choices and chunk.choices[0].delta.content
        ]
    assert len(arrivals) == 10
    assert arrivals[0] >= 0.2
    assert arrivals[-1] - arrivals[0] >= 9 * 0.02 * 0.9


def test_a_cut_stream_closes_after_k_events(make_provider: Factory) -> None:
    cut = ModelBehaviour(latency_s=0.0, cut_rate=1.0, cut_after=3, completion_tokens=20)
    provider = make_provider(default=cut)
    with openai.OpenAI(base_url=provider.base_url, api_key=KEY, max_retries=0) as client:
        stream = client.chat.completions.create(model="m", messages=USER, stream=True)
        got: list[ChatCompletionChunk] = []
        with pytest.raises(openai.APIConnectionError):  # the SDK's word for a cut
            got.extend(stream)
    assert len(got) == 3
    assert got[0].choices[0].delta.role == "assistant"
    assert provider.stats()["total"]["cut"] == 1
    assert wait_until(lambda: provider.stats()["total"]["in_flight"] == 0)


def test_a_cut_in_error_mode_ends_with_openais_error_event(make_provider: Factory) -> None:
    cut = ModelBehaviour(latency_s=0.0, cut_rate=1.0, cut_after=2, cut_mode="error")
    provider = make_provider(default=cut)
    with openai.OpenAI(base_url=provider.base_url, api_key=KEY, max_retries=0) as client:
        stream = client.chat.completions.create(model="m", messages=USER, stream=True)
        got: list[ChatCompletionChunk] = []
        with pytest.raises(openai.APIError, match="server had an error"):
            got.extend(stream)
    assert len(got) == 2


def test_a_cut_answer_that_is_not_streamed_stops_halfway(
    make_provider: Factory, client: httpx.Client
) -> None:
    provider = make_provider(default=ModelBehaviour(latency_s=0.0, cut_rate=1.0), api_key=None)
    with pytest.raises(httpx.RemoteProtocolError):
        client.post(f"{provider.base_url}/chat/completions", json={"model": "m", "messages": USER})
    assert provider.stats()["total"]["responses"] == {"200": 1}


def test_faults_come_before_the_first_byte_of_a_stream(make_provider: Factory) -> None:
    provider = make_provider(default=ModelBehaviour(latency_s=0.0, unavailable_rate=1.0))
    with (
        openai.OpenAI(base_url=provider.base_url, api_key=KEY, max_retries=0) as client,
        pytest.raises(openai.InternalServerError) as failed,
    ):
        client.chat.completions.create(model="m", messages=USER, stream=True)
    assert failed.value.status_code == 503


def test_a_stream_is_pulled_no_faster_than_its_reader_takes_it() -> None:
    """While a write waits (aiohttp's write waits for the transport to drain when the
    reader is slow), no more than one batch of events is made: the server never holds
    a whole stream."""

    async def run() -> tuple[int, int]:
        made = 0

        def endless() -> Iterator[bytes]:
            nonlocal made
            while True:
                made += 1
                yield b"data: x\n\n"

        gate = asyncio.Event()
        written: list[int] = []

        class Blocked:
            async def write(self, data: bytes) -> None:
                written.append(len(data))
                await gate.wait()

        events = _Events(None, Blocked(), None, None)  # type: ignore[arg-type]
        task = asyncio.create_task(events.pace(endless(), 0.0))
        while not written:
            await asyncio.sleep(0)
        made_while_blocked = made
        for _ in range(100):  # the loop turns; the writer stays blocked
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return made_while_blocked, made

    before, after = asyncio.run(run())
    assert before == after  # nothing more was made while the write waited
    assert after * len(b"data: x\n\n") <= _BATCH + len(b"data: x\n\n")


def test_a_reader_that_goes_away_mid_stream_ends_the_request(make_provider: Factory) -> None:
    big = ModelBehaviour(latency_s=0.0, completion_tokens=200_000)
    provider = make_provider(default=big, api_key=None)
    body = json.dumps({"model": "m", "messages": USER, "stream": True}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", provider.port), timeout=10) as raw:
        raw.sendall(head + body)
        received = raw.recv(1 << 16)
        assert received.startswith(b"HTTP/1.1 200")
        while len(received) < 1_000_000:  # a megabyte of a 30 MB stream, read as it comes
            chunk = raw.recv(1 << 16)
            assert chunk
            received += chunk
        assert provider.stats()["total"]["in_flight"] == 1
    assert wait_until(lambda: provider.stats()["total"]["in_flight"] == 0)
    assert provider.stats()["total"]["completion_tokens"] == 0  # not served: cut by the reader


# --- OpenAI: embeddings -----------------------------------------------------------------


def test_embeddings_parse_as_the_sdk_types(oai: openai.OpenAI) -> None:
    texts = ["alpha", "beta", "alpha"]
    result = oai.embeddings.create(model="e", input=texts, dimensions=64)  # base64 by default
    assert [d.index for d in result.data] == [0, 1, 2]
    vectors = [d.embedding for d in result.data]
    assert all(len(v) == 64 for v in vectors)
    assert vectors[0] == vectors[2] != vectors[1]
    assert all(abs(sum(x * x for x in v) - 1.0) < 1e-5 for v in vectors)
    assert result.usage.prompt_tokens == result.usage.total_tokens == 2 + 1 + 2
    floats = oai.embeddings.create(model="e", input="alpha", dimensions=64, encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(vectors[0])
    raw = oai.embeddings.with_raw_response.create(
        model="e", input=[[1, 2, 3]], encoding_format="float"
    )
    CreateEmbeddingResponse.model_validate(json.loads(raw.content))
    assert len(raw.parse().data[0].embedding) == 1536  # the model's default


@pytest.mark.parametrize(
    "bad",
    [[""], "", ["x"] * 2049, [], [["a"]]],
    ids=["empty-item", "empty", "2049", "none", "nested"],
)
def test_embeddings_refuse_what_openai_refuses(oai: openai.OpenAI, bad: Any) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.embeddings.create(model="e", input=bad)
    assert refused.value.param == "input"


def test_embeddings_share_the_limits_and_faults(make_provider: Factory) -> None:
    provider = make_provider(default=ModelBehaviour(latency_s=0.0, tpm=60, burst_s=1.0))
    with openai.OpenAI(base_url=provider.base_url, api_key=KEY, max_retries=0) as client:
        raw = client.embeddings.with_raw_response.create(model="e", input="x" * 4)
        assert raw.headers["x-ratelimit-limit-tokens"] == "60"
        with pytest.raises(openai.RateLimitError) as limited:
            client.embeddings.create(model="e", input="x" * 40)
    assert limited.value.response.headers["retry-after"]
    provider.configure("e", ModelBehaviour(error_rate=1.0))
    with pytest.raises(openai.InternalServerError):
        openai.OpenAI(base_url=provider.base_url, api_key=KEY, max_retries=0).embeddings.create(
            model="e", input="x"
        )


# --- Anthropic: messages ----------------------------------------------------------------


def test_messages_parse_as_the_sdk_types(claude: anthropic.Anthropic) -> None:
    raw = claude.messages.with_raw_response.create(
        model="claude",
        max_tokens=5,
        system="Be brief.",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": PNG_750},
                    },
                ],
            }
        ],
        metadata={"user_id": "u"},
    )
    message = raw.parse()
    Message.model_validate(raw.json())
    assert raw.headers["request-id"].startswith("req_")
    assert message.id.startswith("msg_")
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.input_tokens >= 750  # the 750x750 image: 750 tokens
    assert message.content[0].type == "text"
    assert message.content[0].text.split() == ["the", "quick", "brown", "fox", "jumps"]


def test_count_tokens_says_what_usage_will_report(claude: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "How many tokens is this?"}]
    tools: Any = [{"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
    counted = claude.messages.count_tokens(model="c", system="Be brief.", messages=ask, tools=tools)
    answer = claude.messages.create(
        model="c", max_tokens=5, system="Be brief.", messages=ask, tools=tools
    )
    assert counted.input_tokens == answer.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="messages: Field required"):
        claude.post("/v1/messages/count_tokens", body={"model": "c"}, cast_to=object)


def test_messages_cache_what_cache_control_marks(claude: anthropic.Anthropic) -> None:
    system: Any = [
        {"type": "text", "text": "x" * 6000, "cache_control": {"type": "ephemeral"}},
    ]
    ask: Any = [{"role": "user", "content": "hi"}]
    first = claude.messages.create(model="c", max_tokens=5, system=system, messages=ask)
    second = claude.messages.create(model="c", max_tokens=5, system=system, messages=ask)
    assert (
        first.usage.cache_creation_input_tokens == 1126
    )  # "x" * 6000: a system prompt is bare text
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens == 1126
    assert second.usage.cache_creation_input_tokens == 0
    assert first.usage.input_tokens == second.usage.input_tokens == 3 + 1 + 4  # the rest
    plain = claude.messages.create(model="c", max_tokens=5, system="x" * 6000, messages=ask)
    assert plain.usage.cache_read_input_tokens == plain.usage.cache_creation_input_tokens == 0


def test_messages_tools_follow_tool_choice(claude: anthropic.Anthropic) -> None:
    tools: Any = [
        {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]},  # type: ignore[index]
        {"name": "get_time", "input_schema": {"type": "object", "properties": {}}},
    ]
    ask: Any = [{"role": "user", "content": "Weather?"}]
    auto = claude.messages.create(model="c", max_tokens=100, messages=ask, tools=tools)
    assert auto.stop_reason == "tool_use"
    (use,) = auto.content
    assert use.type == "tool_use"
    assert use.id.startswith("toolu_")
    assert use.input == {"city": "example", "unit": "celsius", "days": 1}
    named = claude.messages.create(
        model="c",
        max_tokens=100,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_time"},
    )
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    none = claude.messages.create(
        model="c", max_tokens=100, messages=ask, tools=tools, tool_choice={"type": "none"}
    )
    assert none.stop_reason == "end_turn"
    after: Any = [
        *ask,
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21C"}],
        },
    ]
    answer = claude.messages.create(model="c", max_tokens=100, messages=after, tools=tools)
    assert answer.stop_reason == "end_turn"
    both = claude.messages.create(
        model="c",
        max_tokens=100,
        messages=ask,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": False},
    )
    assert [b.name for b in both.content if b.type == "tool_use"] == ["get_weather", "get_time"]


def test_messages_stop_sequences_say_which(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model="c",
        max_tokens=100,
        messages=[{"role": "user", "content": "hi"}],
        stop_sequences=["lazy", "brown"],
    )
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == "brown"
    assert message.content[0].type == "text"
    assert message.content[0].text == "the quick "


def test_messages_stream_parses_as_the_sdk_events(make_provider: Factory) -> None:
    provider = make_provider(default=ModelBehaviour(latency_s=0.0, completion_tokens=6))
    tools: Any = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]  # type: ignore[index]
    ask: Any = [{"role": "user", "content": "hi"}]
    with claude_for(provider) as client:
        plain = client.messages.create(model="c", max_tokens=100, messages=ask)
        with client.messages.stream(model="c", max_tokens=100, messages=ask) as stream:
            events = list(stream)
            final = stream.get_final_message()
        with client.messages.stream(model="c", max_tokens=100, messages=ask, tools=tools) as stream:
            tool_events = list(stream)
            tool_final = stream.get_final_message()
        raw = httpx.post(
            f"{provider.base_url}/messages",
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
            json={"model": "c", "max_tokens": 100, "messages": ask, "stream": True},
        ).content
    kinds = [e.type for e in events]
    assert (
        kinds[:3] == ["message_start", "content_block_start", "ping"] or kinds[0] == "message_start"
    )
    assert {
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    } <= set(kinds)
    assert [b.model_dump(exclude={"parsed_output"}) for b in final.content] == [
        b.model_dump() for b in plain.content
    ]
    assert final.usage.output_tokens == plain.usage.output_tokens == 6
    assert final.stop_reason == "end_turn"
    json_deltas = [e for e in tool_events if e.type == "input_json"]
    assert len(json_deltas) > 3
    assert tool_final.stop_reason == "tool_use"
    assert tool_final.content[0].type == "tool_use"
    assert tool_final.content[0].input == {"city": "example", "unit": "celsius", "days": 1}
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    sent = [e for e in EventStream().feed(raw) if e.event != "ping"]  # not in the SDK's union
    parsed = [adapter.validate_python(json.loads(e.data)) for e in sent]
    assert [p.type for p in parsed] == [e.event for e in sent]
    assembler = StreamAssembler()
    for event in EventStream().feed(raw):
        list(assembler.feed(json.loads(event.data)))
    assert assembler.completion()["choices"][0]["message"]["content"] == plain.content[0].text  # type: ignore[union-attr]


def test_messages_cut_in_error_mode_sends_an_error_event(make_provider: Factory) -> None:
    cut = ModelBehaviour(latency_s=0.0, cut_rate=1.0, cut_after=4, cut_mode="error")
    provider = make_provider(default=cut)
    ask: Any = [{"role": "user", "content": "hi"}]
    with (
        claude_for(provider) as client,
        pytest.raises(anthropic.APIStatusError) as failed,
        client.messages.stream(model="c", max_tokens=100, messages=ask) as stream,
    ):
        list(stream)
    assert "overloaded_error" in str(failed.value)


def test_messages_headers_and_key_as_anthropic_checks_them(
    sim: SimulatedProvider, client: httpx.Client
) -> None:
    url = f"{sim.base_url}/messages"
    body = {"model": "c", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    no_version = client.post(url, json=body, headers={"x-api-key": KEY})
    assert no_version.status_code == 400
    assert no_version.json()["error"] == {
        "type": "invalid_request_error",
        "message": "anthropic-version: header is required",
    }
    version = {"anthropic-version": "2023-06-01"}
    wrong = client.post(url, json=body, headers={**version, "x-api-key": "sk-nope"})
    assert wrong.status_code == 401
    assert wrong.json()["type"] == "error"
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert KEY not in wrong.text
    missing = client.post(
        url, json={**body, "max_tokens": None} | {}, headers={**version, "x-api-key": KEY}
    )
    assert missing.status_code == 400
    no_max = {k: v for k, v in body.items() if k != "max_tokens"}
    refused = client.post(url, json=no_max, headers={**version, "x-api-key": KEY})
    assert refused.json()["error"]["message"] == "max_tokens: Field required"
    with (
        claude_for(sim, api_key="sk-nope") as bad_key,
        pytest.raises(anthropic.AuthenticationError),
    ):
        bad_key.messages.create(
            model="c", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )


def test_messages_limits_and_overload_speak_anthropic(make_provider: Factory) -> None:
    limited = ModelBehaviour(latency_s=0.0, rpm=6, burst_s=10.0)  # one request, then 1 per 10 s
    provider = make_provider(models={"c": limited, "busy": ModelBehaviour(unavailable_rate=1.0)})
    ask: Any = [{"role": "user", "content": "hi"}]
    with claude_for(provider) as client:
        ok = client.messages.with_raw_response.create(model="c", max_tokens=5, messages=ask)
        assert ok.headers["anthropic-ratelimit-requests-limit"] == "6"
        assert ok.headers["anthropic-ratelimit-requests-remaining"] == "0"
        reset = ok.headers["anthropic-ratelimit-requests-reset"]
        assert datetime.datetime.fromisoformat(reset).tzinfo is not None  # RFC 3339
        with pytest.raises(anthropic.RateLimitError) as limited_error:
            client.messages.create(model="c", max_tokens=5, messages=ask)
        assert limited_error.value.response.headers["retry-after"] in {"9", "10"}
        assert limited_error.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
        with pytest.raises(anthropic.APIStatusError) as overloaded:
            client.messages.create(model="busy", max_tokens=5, messages=ask)
    assert overloaded.value.status_code == 529
    assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert provider.stats()["models"]["busy"]["responses"] == {"529": 1}


# --- helpers ----------------------------------------------------------------------------


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10.0) as c:
        yield c


def calls(choice: dict[str, Any]) -> list[tuple[str, str, str]]:
    """A choice's tool calls without their ids: (id prefix, name, arguments)."""
    return [
        (c["id"][:5], c["function"]["name"], c["function"]["arguments"])
        for c in choice["message"].get("tool_calls") or ()
    ]


def png_url(width: int, height: int) -> str:
    return f"data:image/png;base64,{png_b64(width, height)}"


def png_b64(width: int, height: int) -> str:
    """A PNG header (signature and IHDR): all a size reader needs."""
    ihdr = struct.pack(">II5B", width, height, 8, 2, 0, 0, 0)
    head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + b"\0\0\0\0"
    return base64.b64encode(head).decode()


PNG_750 = png_b64(750, 750)


def test_a_malformed_request_carrying_the_key_is_logged_without_it(
    make_provider: Callable[..., SimulatedProvider], debug_logs: LogCollector
) -> None:
    """aiohttp logs a request it cannot parse at ERROR with the offending bytes (with
    no logging set up, to stderr through Python's last resort): ``callboard mock
    --api-key`` printed the key of a client whose ``Authorization`` line held a stray
    control byte. One line at INFO now, without the bytes, as the gateway's."""
    provider = make_provider(api_key=KEY)
    host, port = provider.base_url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
    head += f"Authorization: Bearer {KEY}\x01\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
        conn.sendall(head.encode())
        answer = conn.recv(65536)
        assert answer.startswith(b"HTTP/1.0 400")
        assert KEY.encode() not in answer  # aiohttp's answer quoted the line back
    debug_logs.assert_no_secret(KEY)
    refused = [r for r in debug_logs.records if r.name == "aiohttp.server"]
    assert len(refused) == 1
    assert refused[0].levelno == logging.INFO
    assert refused[0].exc_info is None


@pytest.mark.parametrize(
    ("given", "host"),
    [("127.0.0.1", "127.0.0.1"), ("[::1]", "::1"), ("::1", "::1"), ("localhost", "localhost")],
)
def test_host_arg_takes_a_name_or_an_address_bracketed_or_not(given: str, host: str) -> None:
    """``[::1]`` (as URLs write it) was looked up as a name: exit 1, "not known"."""
    assert host_arg(given) == host


@pytest.mark.parametrize("given", ["127.0.0.1:8080", "localhost:8080", "", "http://x/"])
def test_host_arg_refuses_a_port_or_a_url_naming_the_port_flag(given: str) -> None:
    """``--host 127.0.0.1:8080`` was told it is no loopback address, the port unmentioned."""
    with pytest.raises(argparse.ArgumentTypeError, match="--port"):
        host_arg(given)


@pytest.mark.parametrize("how", ["stop", "pause"])
def test_a_connection_accepted_as_the_provider_stops_is_closed_not_left_open(how: str) -> None:
    """Accepted in the loop turn the stop (or the pause) closed the listening server,
    a connection never reached aiohttp, and only the garbage collector found it, in a
    later test (``ResourceWarning: unclosed transport``; CPython gh-109564; found by a
    hunt after a CI run failed so)."""
    provider = SimulatedProvider()
    provider.start()
    try:
        loop = provider._loop
        stop = provider.stop if how == "stop" else provider.pause
        accepted_as_it_stops(loop, provider.port, stop)
    finally:
        provider.stop()
