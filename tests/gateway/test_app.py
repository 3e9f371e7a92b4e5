"""The gateway end to end, with the official ``openai`` and ``anthropic`` SDKs (sync
and async) as clients: a real gateway on loopback in front of the simulated
provider (see conftest). Each test reads the figures it checks as differences, since the
module shares one gateway."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import gc
import gzip
import hashlib
import json
import logging
import math
import re
import socket
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from decimal import Decimal
from typing import Any

import anthropic
import httpx
import openai
import pytest
from aiohttp.test_utils import make_mocked_request
from callboard.core.breaker import BreakerConfig
from callboard.core.retry import RetryConfig
from callboard.core.settings import FREE, SchedulerSettings
from callboard.gateway import ClientKey, Gateway, GatewayConfig, GatewaySettings
from callboard.gateway import app as gateway_app
from callboard.gateway.app import HEAVY_ANSWER_FLOATS, HEAVY_BODY, VALUE_BYTES, Front
from callboard.gateway.replays import Replays
from callboard.gateway.settings import Limits
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from loopback import (
    USAGE,
    WireServer,
    answer,
    chunk,
    message_body,
    openai_stream,
    replying,
    sending,
    sse,
    text_block,
)
from loopback import completion_body as wire_completion
from pydantic import BaseModel
from support import WAIT_S, LogCollector, dead_port, held_at, served, wait_until

from callboard import ModelSettings, Request, System, SystemConfig

HI = [{"role": "user", "content": "Say hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


Sdk = Callable[..., openai.OpenAI]


@pytest.fixture(scope="module")
def sdk(gateway: Gateway, keys: dict[str, str]) -> Iterator[Sdk]:
    """``sdk(key="admin", at=gateway, **options)``: an ``openai.OpenAI`` client of the
    gateway ``at`` (the module's by default) with the key of that name; no retries.
    Made once per arguments (a client's first connection costs more than a request)."""
    made: dict[tuple[Any, ...], openai.OpenAI] = {}

    def make(key: str = "admin", at: Gateway | None = None, **options: Any) -> openai.OpenAI:
        url = (at or gateway).url
        options = {"max_retries": 0, "timeout": WAIT_S, **options}
        known = (key, url, *sorted(options.items()))
        if known not in made:
            made[known] = openai.OpenAI(base_url=f"{url}/v1", api_key=keys[key], **options)
        return made[known]

    yield make
    for client in made.values():
        client.close()


@pytest.fixture(scope="module")
def http(gateway: Gateway) -> Iterator[httpx.Client]:
    """A plain HTTP client of the module's gateway, for what the SDK does not send."""
    with httpx.Client(base_url=gateway.url, timeout=WAIT_S) as client:
        yield client


@pytest.fixture(scope="module")
def admin(keys: dict[str, str]) -> dict[str, str]:
    """The admin key's header, for requests made without the SDK."""
    return {"Authorization": f"Bearer {keys['admin']}"}


@pytest.fixture(scope="module")
def read_stats(http: httpx.Client, admin: dict[str, str]) -> Callable[[], dict[str, Any]]:
    """``GET /v1/callboard/stats`` of the module's gateway."""

    def read() -> dict[str, Any]:
        answer = http.get("/v1/callboard/stats", headers=admin)
        answer.raise_for_status()
        body: dict[str, Any] = answer.json()
        return body

    return read


def calls_to(upstream: SimulatedProvider, model: str) -> int:
    return int(served(upstream, model).get("requests", 0))


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for requests that must be in flight while the test does something else."""
    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


@dataclasses.dataclass(frozen=True)
class Blocker:
    """A call of ``gate`` held upstream until ``release`` (``result`` releases it first)."""

    call: Future[Any]
    release: Callable[[], None]

    def done(self) -> bool:
        return self.call.done()

    def result(self, timeout: float) -> Any:
        self.release()
        return self.call.result(timeout)


@pytest.fixture
def occupy(
    sdk: Sdk, pool: ThreadPoolExecutor, upstream: SimulatedProvider
) -> Iterator[Callable[..., Blocker]]:
    """``occupy(at=gateway)``: hold ``gate`` (one call at a time) with a call held
    upstream until the test lets it go (``Blocker``); returned once that call is
    upstream. A hold for a time was a race: on a loaded machine it ended before the
    test had looked at what it held up (a test run beside three others)."""
    with contextlib.ExitStack() as holds:

        def hold(at: Gateway | None = None) -> Blocker:
            create = sdk(at=at).chat.completions.create
            hold_me = [{"role": "user", "content": "hold"}]
            held = holds.enter_context(contextlib.ExitStack())
            send = functools.partial(pool.submit, create, model="gate", messages=hold_me)
            return Blocker(held.enter_context(held_at(upstream, "gate", send)), held.close)

        yield hold


# -- answers --------------------------------------------------------------------------------


def test_a_chat_is_answered_in_openai_shape_with_what_callboard_did_in_headers(sdk: Sdk) -> None:
    raw = sdk().chat.completions.with_raw_response.create(model="fast", messages=HI)
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 0
    headers = raw.headers
    assert int(headers["X-Callboard-Task-Id"]) > 0
    assert headers["X-Callboard-Model"] == "fast"
    assert headers["X-Callboard-Attempts"] == "1"
    assert headers["X-Callboard-Priority"] == "normal"
    assert Decimal(headers["X-Callboard-Cost"]) > 0
    assert float(headers["X-Callboard-Queue-Wait"]) >= 0
    assert completion._request_id == headers["x-request-id"]  # the trace id, as the SDK reads it
    assert headers["X-Callboard-Provider-Request-Id"].startswith("req_")  # the provider's own


def test_a_route_or_tier_name_is_served_by_its_models(sdk: Sdk) -> None:
    raw = sdk().chat.completions.with_raw_response.create(model="quick", messages=HI)
    assert raw.headers["X-Callboard-Model"] == "fast"
    assert raw.parse().choices[0].message.content


def test_a_stream_sends_chunks_then_the_usage_chunk(sdk: Sdk) -> None:
    chunks = list(
        sdk().chat.completions.create(
            model="fast", messages=HI, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) > 3
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    assert set(finishes[:-1]) == {None}
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_a_stream_names_the_model_that_serves_it_as_a_whole_answer_does(sdk: Sdk) -> None:
    """Asked of a route, every chunk and the ``X-Callboard-Model`` header name the model
    that answered, as the same request unstreamed does (OpenAI's chunks name the model
    that generated them; they named the route, and the header was missing: a hunt)."""
    plain = sdk().chat.completions.with_raw_response.create(model="quick", messages=HI)
    raw = sdk().chat.completions.with_raw_response.create(model="quick", messages=HI, stream=True)
    chunks = list(raw.parse())
    assert raw.headers["X-Callboard-Model"] == plain.headers["X-Callboard-Model"] == "fast"
    assert {c.model for c in chunks} == {plain.parse().model} == {"fast"}


def test_a_stream_its_model_failed_before_a_word_names_the_fallback(
    base_config: GatewayConfig, make_gateway: Callable[..., Gateway], sdk: Sdk
) -> None:
    system = base_config.system
    models = tuple(
        dataclasses.replace(m, fallbacks=("slow",)) if m.name == "broken" else m
        for m in system.models
    )
    at = make_gateway(
        dataclasses.replace(base_config, system=dataclasses.replace(system, models=models))
    )
    raw = sdk(at=at).chat.completions.with_raw_response.create(
        model="broken", messages=HI, stream=True
    )
    chunks = list(raw.parse())
    assert raw.headers["X-Callboard-Model"] == "slow"
    assert {c.model for c in chunks} == {"slow"}


def test_a_stream_ends_with_done_and_names_its_task(
    http: httpx.Client, admin: dict[str, str]
) -> None:
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "fast", "messages": HI, "stream": True},
        headers=admin,
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert int(response.headers["X-Callboard-Task-Id"]) > 0
    assert response.headers["x-request-id"] == response.headers["request-id"] != ""  # the SDKs'
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_tool_calls_reach_the_client_as_the_sdk_types_them(sdk: Sdk) -> None:
    completion = sdk().chat.completions.create(
        model="fast",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_the_guides_tool_loop_sends_the_answers_message_back_as_it_came(sdk: Sdk) -> None:
    """OpenAI's function-calling guide appends ``completion.choices[0].message`` to the
    next turn's messages; the SDK sends it as it came, ``annotations`` and all, and the
    gateway refused that second turn with a 400 (found by a hunt)."""
    client = sdk()
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model="fast", messages=messages, tools=[WEATHER], tool_choice="required"
    )
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message)
    messages += [
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"} for call in message.tool_calls
    ]
    second = client.chat.completions.create(model="fast", messages=messages, tools=[WEATHER])
    assert second.choices[0].message.content is not None or second.choices[0].message.tool_calls


def test_streamed_tool_calls_assemble_in_the_sdk(sdk: Sdk) -> None:
    with sdk().chat.completions.stream(
        model="fast",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls
    assert calls[0].function.name == "get_weather"
    assert "city" in json.loads(calls[0].function.arguments)


class Capital(BaseModel):
    country: str
    capital: str
    population: int


def test_a_json_schema_answer_parses_into_the_callers_model(sdk: Sdk) -> None:
    completion = sdk().chat.completions.parse(
        model="fast",
        messages=[{"role": "user", "content": "The capital of France, as JSON"}],
        response_format=Capital,
    )
    assert isinstance(completion.choices[0].message.parsed, Capital)
    asked = [{"role": "user", "content": "The capital of France, as JSON"}]
    with warnings.catch_warnings():  # the SDK's own, serializing a parsed message back
        warnings.simplefilter("ignore", UserWarning)
        again = sdk().chat.completions.create(  # its message, parsed and all, sent back
            model="fast",
            messages=[*asked, completion.choices[0].message, {"role": "user", "content": "Peru?"}],
        )
    assert again.choices[0].message.content


def test_embeddings_come_back_in_input_order_as_floats_or_base64(sdk: Sdk) -> None:
    texts = ["one", "two", "three"]
    by_default = sdk().embeddings.create(model="fast", input=texts)  # the SDK asks base64
    as_floats = sdk().embeddings.create(model="fast", input=texts, encoding_format="float")
    assert [d.index for d in by_default.data] == [0, 1, 2]
    for decoded, floats in zip(by_default.data, as_floats.data, strict=True):
        assert decoded.embedding == pytest.approx(floats.embedding)
    assert len({tuple(d.embedding) for d in as_floats.data}) == 3
    short = sdk().embeddings.create(
        model="fast", input="one", dimensions=8, encoding_format="float"
    )
    assert len(short.data[0].embedding) == 8
    assert as_floats.usage.prompt_tokens > 0
    many = [f"text {i}" for i in range(64)]  # 64 x 1,024 floats: written on the reader
    large = sdk().embeddings.create(
        model="fast", input=many, dimensions=1024, encoding_format="float"
    )
    assert HEAVY_ANSWER_FLOATS <= 64 * 1024
    encoded = sdk().embeddings.create(model="fast", input=many, dimensions=1024)
    assert [d.index for d in large.data] == list(range(64))
    for decoded, floats in zip(encoded.data, large.data, strict=True):
        assert decoded.embedding == pytest.approx(floats.embedding)


def test_an_embeddings_answer_carries_its_request_id(sdk: Sdk) -> None:
    """The SDKs' ``_request_id`` was None for embeddings, as a chat answer has it."""
    answer = sdk().embeddings.with_raw_response.create(model="fast", input=["one"])
    assert answer.headers["x-request-id"]
    assert answer.headers["request-id"] == answer.headers["x-request-id"]


def test_embeddings_of_token_ids_as_the_reference_allows(sdk: Sdk) -> None:
    """LangChain's ``OpenAIEmbeddings`` sends token ids: they were a 400 naming ``texts[0]``."""
    ids = sdk().embeddings.create(
        model="fast", input=[[1820, 374], [9906]], encoding_format="float"
    )
    assert [d.index for d in ids.data] == [0, 1]
    assert ids.usage.prompt_tokens == 3
    one = sdk().embeddings.create(model="fast", input=[1820, 374], encoding_format="float")
    assert one.data[0].embedding == pytest.approx(ids.data[0].embedding)
    with pytest.raises(openai.BadRequestError, match=r"input\[1\]"):
        sdk().embeddings.create(model="fast", input=[[1820], [1.5]])


def test_the_async_sdk_chats_and_streams(gateway: Gateway, keys: dict[str, str]) -> None:
    async def run() -> tuple[str, str]:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1", api_key=keys["team"], max_retries=0, timeout=WAIT_S
        ) as client:
            completion = await client.chat.completions.create(model="fast", messages=HI)
            stream = await client.chat.completions.create(model="fast", messages=HI, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            return completion.choices[0].message.content or "", text

    plain, streamed = asyncio.run(run())
    assert plain
    assert streamed


def test_models_lists_what_the_key_may_use(sdk: Sdk) -> None:
    everything = {m.id for m in sdk().models.list()}
    assert {"fast", "slow", "broken", "quick", "auto"} <= everything
    assert {m.id for m in sdk("limited").models.list()} == {"fast"}


def test_every_answer_and_refusal_carries_a_request_id(sdk: Sdk, claude: Claude) -> None:
    """What the SDKs show as ``_request_id`` / ``request_id``, for an operator to find:
    a task's trace id where one answered, a fresh id where none did (a refusal before
    any task, the models list), never the same twice."""
    listed = sdk().models.with_raw_response.list()
    hi = [{"role": "user", "content": "Hi"}]
    refused = []
    for _ in range(2):
        with pytest.raises(openai.NotFoundError) as missing:
            sdk().chat.completions.create(model="gpt-9", messages=hi)
        refused.append(missing.value.request_id)
    with pytest.raises(anthropic.NotFoundError) as not_there:
        claude().messages.create(model="gpt-9", max_tokens=8, messages=hi)
    answered = sdk().chat.completions.with_raw_response.create(model="fast", messages=hi)
    ids = [listed.request_id, *refused, not_there.value.request_id, answered.request_id]
    assert all(ids), ids
    assert len(set(ids)) == len(ids), ids
    assert answered.request_id == answered.headers["request-id"]
    assert all(i.startswith("req_") for i in ids[:-1]), ids


def test_one_model_is_retrieved_as_the_list_gives_it(sdk: Sdk) -> None:
    """The SDKs' ``models.retrieve`` was a 404 "no such endpoint" for a listed model."""
    listed = {m.id: m for m in sdk().models.list()}
    assert sdk().models.retrieve("fast") == listed["fast"]
    assert sdk().models.retrieve("auto") == listed["auto"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk().models.retrieve("nope")
    with pytest.raises(openai.PermissionDeniedError):
        sdk("limited").models.retrieve("slow")


def test_stats_are_json_and_need_a_key(
    http: httpx.Client, read_stats: Callable[[], dict[str, Any]]
) -> None:
    body = read_stats()
    wanted = {"outcomes", "failures", "total", "by_model", "by_priority", "ledger", "models"}
    assert wanted <= set(body)
    assert body["total"]["finished"] >= 0
    assert isinstance(body["cost_usd"], str)
    assert body["gateway"] == {"status": "ready"}
    refused = http.get("/v1/callboard/stats")
    assert refused.status_code == 401


def test_a_key_not_an_operators_reads_its_own_quotas_and_nothing_of_the_others(
    http: httpx.Client, keys: dict[str, str]
) -> None:
    answer = http.get("/v1/callboard/stats", headers={"Authorization": f"Bearer {keys['team']}"})
    assert answer.status_code == 200
    assert answer.json() == {
        "key": "team",
        "tenant": "team",
        "quotas": {"waiting": 0, "scopes": []},
    }


def test_health_and_readiness_answer_without_a_key(http: httpx.Client) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json() == {"status": "ready"}


# -- errors, as the SDK's own classes ----------------------------------------------------------


def test_a_wrong_key_is_an_authentication_error_that_never_echoes_the_key(
    gateway: Gateway, keys: dict[str, str]
) -> None:
    wrong = "sk-not-a-key-of-ours-424242"
    with (
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=wrong, max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as caught,
    ):
        client.chat.completions.create(model="fast", messages=HI)
    assert caught.value.code == "invalid_api_key"
    text = caught.value.response.text
    assert wrong not in text
    assert all(k not in text for k in keys.values())


def test_no_key_reaches_a_log_record(
    sdk: Sdk, gateway: Gateway, keys: dict[str, str], debug_logs: LogCollector
) -> None:
    wrong = "sk-wrong-5555555555"
    sdk().chat.completions.create(model="fast", messages=HI)
    with (
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=wrong, max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()
    assert debug_logs.callboard_records()  # the gateway did log, at debug
    debug_logs.assert_no_secret(wrong, *keys.values())


def test_a_model_the_key_may_not_use_is_permission_denied(sdk: Sdk) -> None:
    with pytest.raises(openai.PermissionDeniedError) as caught:
        sdk("limited").chat.completions.create(model="slow", messages=HI)
    assert caught.value.code == "model_not_allowed"


def test_a_fallback_never_serves_a_key_a_model_it_may_not_ask_for(
    sdk: Sdk,
    keys: dict[str, str],
    make_gateway: Callable[..., Gateway],
    base_config: GatewayConfig,
) -> None:
    """``broken`` (always a 500) falls back to ``slow``. A key that may use ``broken``
    but not ``slow`` gets ``broken``'s failure, not ``slow``'s answer charged at its
    price (a key's ``models`` are the models that serve it, fallbacks too, as LiteLLM's
    proxy now checks them); a key that may use both is served by the fallback. Both
    keys are one tenant's, and the narrow one's retry of the wide one's request (the
    same body and ``Idempotency-Key``) is not given the wide one's answer."""
    system = base_config.system
    models = tuple(
        dataclasses.replace(m, fallbacks=("slow",)) if m.name == "broken" else m
        for m in system.models
    )

    def key(name: str, *allowed: str) -> ClientKey:
        digest = hashlib.sha256(keys[name].encode()).digest()
        return ClientKey(name=name, digest=digest, tenant="t", models=frozenset(allowed))

    at = make_gateway(
        GatewayConfig(
            system=dataclasses.replace(system, models=models),
            gateway=GatewaySettings(keys=(key("limited", "broken"), key("team", "broken", "slow"))),
        )
    )
    once = {"Idempotency-Key": "same-request-1"}
    served = sdk("team", at=at).chat.completions.with_raw_response.create(
        model="broken", messages=HI, extra_headers=once
    )
    assert served.headers["X-Callboard-Model"] == "slow"
    with pytest.raises(openai.APIStatusError) as failed:
        sdk("limited", at=at).chat.completions.create(
            model="broken", messages=HI, extra_headers=once
        )
    assert failed.value.status_code >= 500
    assert failed.value.response.headers.get("X-Callboard-Model") != "slow"


def test_an_unknown_model_is_not_found_naming_what_there_is(sdk: Sdk) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        sdk().chat.completions.create(model="gpt-9", messages=HI)
    assert caught.value.code == "model_not_found"
    assert "fast" in caught.value.message
    with pytest.raises(openai.NotFoundError) as limited:
        sdk("limited").chat.completions.create(model="gpt-9", messages=HI)
    assert "fast" in limited.value.message
    assert "slow" not in limited.value.message  # what that key may not use goes unnamed


@pytest.mark.parametrize(
    ("fields", "headers", "param"),
    [
        ({"temperature": 5}, {}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, {}, "messages[0].role"),
        ({}, {"X-Callboard-Priority": "urgent"}, None),
        ({}, {"X-Callboard-Deadline": "soon"}, None),
        ({}, {"X-Callboard-Deadline": "1_0"}, None),  # float() takes it
        ({}, {"Idempotency-Key": ""}, None),
        ({}, {"Idempotency-Key": "k" * 256}, None),
        ({"extra_body": {"stream": {}}}, {}, "stream"),  # not taken as false
        ({"extra_body": {"priority": "gold"}}, {}, "priority"),
    ],
)
def test_an_invalid_request_is_a_bad_request_naming_the_field(
    sdk: Sdk, fields: dict[str, Any], headers: dict[str, str], param: str | None
) -> None:
    body: dict[str, Any] = {"model": "fast", "messages": HI, **fields}
    extra = body.pop("extra_body", None)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk().chat.completions.create(**body, extra_headers=headers, extra_body=extra)
    assert caught.value.param == param
    assert caught.value.type == "invalid_request_error"


def test_a_body_that_is_not_json_is_a_bad_request(
    http: httpx.Client, admin: dict[str, str]
) -> None:
    answer = http.post("/v1/chat/completions", content=b"{not json", headers=admin)
    assert answer.status_code == 400
    assert "not JSON" in answer.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_body_nested_deeper_than_json_reads_is_a_bad_request_not_a_crash(
    http: httpx.Client, admin: dict[str, str], path: str
) -> None:
    answer = http.post(path, content=b"[" * 100_000, headers=admin)  # was a 500
    assert answer.status_code == 400
    assert "nested too deeply" in answer.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            '{"model":"fast","messages":[{"role":"user","content":"x\\ud800"}]}',
        ),
        (
            "/v1/chat/completions",
            '{"model":"fast","messages":[{"role":"user","content":"x","\\udfff":1}]}',
        ),
        (
            "/v1/messages",
            '{"model":"fast","max_tokens":5,"messages":[{"role":"user","content":"x"}],"\\ud800":1}',
        ),
        ("/v1/embeddings", '{"model":"fast","input":"\\ud800"}'),
    ],
)
def test_a_lone_surrogate_is_a_bad_request_in_the_apis_shape(
    http: httpx.Client, admin: dict[str, str], path: str, body: str
) -> None:
    """It was a 500 in plain text (the error named the key, which UTF-8 cannot carry),
    or was sent on to the provider."""
    answer = http.post(path, content=body.encode(), headers=admin)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert "lone surrogate" in error["message"]


def test_a_body_not_in_utf_8_is_a_bad_request(http: httpx.Client, admin: dict[str, str]) -> None:
    """JSON between systems is UTF-8 (RFC 8259); ``json.loads`` takes UTF-16 and -32 too,
    and a lone surrogate in one went on unseen (a review)."""
    body = '{"model":"fast","messages":[{"role":"user","content":"x\ud800"}]}'
    raw = body.encode("utf-16-le", "surrogatepass")
    answer = http.post("/v1/chat/completions", content=raw, headers=admin)
    assert answer.status_code == 400
    assert "not UTF-8" in answer.json()["error"]["message"]


def test_an_emoji_escaped_as_a_surrogate_pair_is_text(
    http: httpx.Client, admin: dict[str, str]
) -> None:
    body = (
        '{"model":"fast","max_tokens":4,"messages":[{"role":"user","content":"hi \\ud83d\\ude00"}]}'
    )
    answer = http.post("/v1/chat/completions", content=body.encode(), headers=admin)
    assert answer.status_code == 200, answer.text


def test_a_deadline_of_unicode_digits_is_a_bad_request(
    http: httpx.Client, admin: dict[str, str]
) -> None:
    """``float()`` reads "١٢" as 12; a header's number is ASCII."""
    headers: dict[str, str | bytes] = {**admin, "X-Callboard-Deadline": "١٢".encode()}
    answer = http.post(
        "/v1/chat/completions", json={"model": "fast", "messages": HI}, headers=headers
    )
    assert answer.status_code == 400
    assert "X-Callboard-Deadline" in answer.json()["error"]["message"]


@pytest.mark.parametrize("header", ["²".encode(), b"9" * 5000, b"-1"])
def test_a_priority_header_that_is_no_priority_is_a_bad_request(
    http: httpx.Client, admin: dict[str, str], header: bytes
) -> None:
    """Unicode digits and 5,000 of them passed ``isdigit`` but not ``int()``: a 500."""
    headers: dict[str, str | bytes] = {**admin, "X-Callboard-Priority": header}
    body = {"model": "fast", "messages": HI}
    answer = http.post("/v1/chat/completions", json=body, headers=headers)
    assert answer.status_code == 400
    assert "X-Callboard-Priority" in answer.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_body_declared_over_the_limit_is_refused_before_any_of_it_comes(
    gateway: Gateway, admin: dict[str, str], path: str
) -> None:
    """100 GB declared and nothing sent: 413 at once (the handler
    waited for the body until the caller hung up)."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in admin.items()]
    head.append("Content-Length: 100000000000")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer:  # a timeout here: it waited for the body
            got = conn.recv(65536)
            assert got, "the connection closed without an answer"
            answer += got
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 413"), status_line


def _chat_body(**more: Any) -> bytes:
    return json.dumps({"model": "fast", "messages": HI, "max_tokens": 5, **more}).encode()


@pytest.mark.parametrize(
    ("coding", "compress"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda b: zlib.compress(b, wbits=-zlib.MAX_WBITS)),  # no zlib header
        ("gzip", lambda b: gzip.compress(b[:20]) + gzip.compress(b[20:])),  # two members
    ],
    ids=["gzip", "deflate", "raw-deflate", "gzip-members"],
)
def test_a_compressed_body_is_read_as_its_content_encoding_says(
    gateway: Gateway, admin: dict[str, str], coding: str, compress: Callable[[bytes], bytes]
) -> None:
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=compress(_chat_body()),
        headers={**admin, "Content-Type": "application/json", "Content-Encoding": coding},
        timeout=WAIT_S,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]


def test_a_body_of_millions_of_tiny_objects_is_refused_before_it_is_read(
    gateway: Gateway, admin: dict[str, str], read_stats: Callable[[], dict[str, Any]]
) -> None:
    """31 KB sent gzipped inflated to ten million empty arrays in a pass-through field:
    18 s of a core and 1.1 GB to read, while its room counted 31 MB (found by a hunt);
    of floats, 17 s (a review). Its values are counted (in C) and refused past
    ``MAX_VALUES``."""
    junk = b"[" + b"1.5," * 2_500_000 + b"1.5]"
    body = _chat_body()[:-1] + b',"junk":' + junk + b"}"
    began = time.perf_counter()
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=gzip.compress(body),
        headers={**admin, "Content-Type": "application/json", "Content-Encoding": "gzip"},
        timeout=WAIT_S,
    )
    assert answer.status_code == 413, answer.text
    said = re.search(r"holds about (\d+) JSON values", answer.json()["error"]["message"])
    assert said is not None
    assert int(said[1]) > 2_500_000
    assert time.perf_counter() - began < WAIT_S / 3  # refused, not read
    assert read_stats()["bodies"]["held_bytes"] == 0


@pytest.mark.parametrize(
    "case",
    [
        ("/v1/chat/completions", "gzip", b"not gzip at all", 400, "invalid_content_encoding"),
        ("/v1/messages", "deflate", b"not deflate at all", 400, None),  # Anthropic: no code
        ("/v1/embeddings", "gzip", b"\x1f\x8b\x08\x00", 400, "invalid_content_encoding"),
        ("/v1/chat/completions", "br", b"{}", 415, "unsupported_content_encoding"),
        ("/v1/chat/completions", "gzip, gzip", b"{}", 415, "unsupported_content_encoding"),
        ("/v1/chat/completions", "gzip", gzip.compress(bytes(8 << 20)), 413, None),
        (
            "/v1/chat/completions",
            "gzip",
            gzip.compress(b"") * 5000,
            400,
            "invalid_content_encoding",
        ),
    ],
    ids=["bad-gzip", "bad-deflate", "cut-gzip", "br", "twice", "bomb", "members"],
)
def test_a_body_that_is_not_what_its_encoding_says_is_refused_typed_and_closed(
    make_gateway: Callable[..., Gateway],
    admin: dict[str, str],
    case: tuple[str, str, bytes, int, str | None],
) -> None:
    """A corrupt gzip body was a 500 (and the SDKs retry a 500); a small body that
    inflates past max_body_mb was inflated on the loop as it came, holding every other
    request, and went on after the answer (found by a hunt). Each is a typed 4xx in the
    API's shape, and the connection is closed."""
    path, coding, body, status, code = case
    gateway = make_gateway(settings={"max_body_mb": 1, "max_held_mb": 1})
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    head = _raw_head(gateway, path, {**admin, "Content-Encoding": coding}, len(body))
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
        conn.sendall(head + body)
        received = _read_to_close(conn)
    head_part, _, answer = received.partition(b"\r\n\r\n")
    assert head_part.startswith(f"HTTP/1.1 {status}".encode()), head_part
    error = json.loads(answer)["error"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error.get("code") == code


@pytest.mark.parametrize("name", ["Authorization", "x-api-key"])
@pytest.mark.parametrize("good_first", [True, False])
def test_two_keys_in_one_request_are_refused_whichever_comes_first(
    gateway: Gateway, keys: dict[str, str], name: str, good_first: bool
) -> None:
    """The first of two ``Authorization`` headers was taken: a good key followed by a bad
    one was served, the other order refused (found by a hunt)."""
    good, bad = keys["admin"], "sk-not-a-key-0123456789"
    values = [good, bad] if good_first else [bad, good]
    if name == "Authorization":
        values = [f"Bearer {v}" for v in values]
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=_chat_body(),
        headers=[("Content-Type", "application/json")] + [(name, v) for v in values],
        timeout=WAIT_S,
    )
    assert answer.status_code == 400, answer.text
    assert f"more than one {name} header" in answer.json()["error"]["message"]


def test_a_key_is_read_beside_a_proxys_own_basic_credential(
    gateway: Gateway, keys: dict[str, str]
) -> None:
    """nginx's ``auth_basic`` in front passes its ``Authorization: Basic`` on: that hid
    the ``x-api-key`` beside it, and every request was refused 401 (found by a hunt)."""
    hi = {"model": "fast", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    answer = httpx.post(
        f"{gateway.url}/v1/messages",
        json=hi,
        headers={"Authorization": "Basic dXNlcjpwYXNz", "x-api-key": keys["admin"]},
        timeout=WAIT_S,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["type"] == "message"


@pytest.mark.parametrize("second", ["sk-not-a-key-0123456789", "other"])
def test_a_key_and_a_different_key_in_another_header_are_refused(
    gateway: Gateway, keys: dict[str, str], second: str
) -> None:
    """``Authorization: Bearer <good>`` with ``x-api-key: <another>``: the bearer token
    won, so a wrong second credential passed and the first decided whose budget paid
    (found by a hunt). The same key in both is served."""
    good = keys["admin"]
    other = keys[next(k for k in keys if k != "admin")] if second == "other" else second
    for x_api_key, status in ((other, 400), (good, 200)):
        answer = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            content=_chat_body(),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {good}",
                "x-api-key": x_api_key,
            },
            timeout=WAIT_S,
        )
        assert answer.status_code == status, answer.text
        if status == 400:
            assert "two different keys" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("name", "values"),
    [
        ("X-Callboard-Priority", ["low", "critical"]),
        ("X-Callboard-Deadline", ["30", "1"]),
        ("Idempotency-Key", ["a", "b"]),
    ],
)
def test_a_header_there_is_one_of_given_twice_is_refused(
    gateway: Gateway, admin: dict[str, str], name: str, values: list[str]
) -> None:
    """The first of two was taken and the second ignored: a proxy adding its own after
    the client's left the client's in force (found by a hunt). Neither is taken."""
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=_chat_body(),
        headers=[("Content-Type", "application/json"), *admin.items()]
        + [(name, v) for v in values],
        timeout=WAIT_S,
    )
    assert answer.status_code == 400, answer.text
    assert f"more than one {name} header" in answer.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/healthz", "/v1/chat/completions"])
def test_a_client_that_half_closes_its_socket_logs_no_error(
    gateway: Gateway, debug_logs: LogCollector, path: str
) -> None:
    """A request, then the client's sending side closed (``shutdown(SHUT_WR)``): aiohttp
    closes the connection, and writing the answer failed; each such request was logged
    at ERROR with a traceback, by any client and with no key (found by a hunt)."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    body = _chat_body()
    if path == "/healthz":
        request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    else:  # no key: refused 401
        request = _raw_head(gateway, path, {}, len(body)) + body
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
            conn.sendall(request)
            conn.shutdown(socket.SHUT_WR)
            _read_to_close(conn)
    assert httpx.get(f"{gateway.url}/healthz", timeout=WAIT_S).status_code == 200
    assert not [r for r in debug_logs.records if r.levelno >= logging.ERROR]


def test_a_refusal_before_the_body_came_closes_the_connection(gateway: Gateway) -> None:
    """A 401 sent while most of a large body is still to come: the connection is closed
    at once, not kept for aiohttp to read (and, compressed, inflate) the rest for 10 s."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    head = _raw_head(gateway, "/v1/chat/completions", {"Authorization": "Bearer nope"}, 1 << 20)
    with socket.create_connection((host, int(port)), timeout=3.0) as conn:
        conn.sendall(head + b"{")  # and no more
        received = _read_to_close(conn)  # a timeout: the connection was kept
    assert received.startswith(b"HTTP/1.1 401"), received[:100]


def _raw_head(gateway: Gateway, path: str, headers: dict[str, str], length: int) -> bytes:
    host = gateway.url.removeprefix("http://").rsplit(":", 1)[0]
    head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    head.append(f"Content-Length: {length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode()


def _read_to_close(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes (a timeout: it kept the connection)."""
    received = b""
    while got := conn.recv(65536):
        received += got
    return received


def _first_status(conn: socket.socket) -> bytes:
    """The status line of the first response on ``conn`` (100 Continue included)."""
    received = b""
    while b"\r\n" not in received:
        got = conn.recv(65536)
        assert got, "closed before any answer"
        received += got
    return received.split(b"\r\n", 1)[0]


@pytest.mark.parametrize(
    ("keyed", "length", "expect", "status"),
    [
        (False, 100, "100-continue", b"401"),
        (True, 100_000_000_000, "100-continue", b"413"),
        (True, None, "a-pony", b"417"),
        (True, None, "100-continue", b"100"),
    ],
    ids=["no-key", "too-large", "unknown", "welcome"],
)
def test_expect_100_continue_is_refused_before_the_body_when_it_would_be_refused(
    gateway: Gateway,
    admin: dict[str, str],
    *,
    keyed: bool,
    length: int | None,
    expect: str,
    status: bytes,
) -> None:
    """No ``100 Continue`` (the client would send its body only to have it refused):
    a wrong key, a body declared too large or an unknown expectation gets its answer,
    in the API's shape, at once."""
    body = json.dumps({"model": "fast", "messages": HI, "max_tokens": 4}).encode()
    head = _raw_head(gateway, "/v1/chat/completions", admin if keyed else {}, length or len(body))
    head = head.replace(b"\r\n\r\n", f"\r\nExpect: {expect}\r\n\r\n".encode())
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
        conn.sendall(head)
        conn.settimeout(5)  # a refusal closes at once: not after 10 s of lingering reads
        if status != b"100":
            answer = _read_to_close(conn)
            assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == status
            assert b'"error"' in answer  # the API's error body, then closed
        else:
            assert _first_status(conn).split(b" ")[1] == status
            conn.sendall(body)
            answer = b""
            while b'"choices"' not in answer:
                got = conn.recv(65536)
                assert got, answer
                answer += got
            assert b"HTTP/1.1 200" in answer


@pytest.mark.parametrize(
    ("keyed", "expect", "status"), [(False, "100-continue", b"401"), (True, "x" * 300, b"417")]
)
def test_count_tokens_refuses_an_expectation_before_its_body_as_messages_does(
    gateway: Gateway, admin: dict[str, str], *, keyed: bool, expect: str, status: bytes
) -> None:
    """``/v1/messages/count_tokens`` invited a keyless body with ``100 Continue`` and
    answered an unknown expectation with aiohttp's own text, echoing it whole."""
    head = _raw_head(gateway, "/v1/messages/count_tokens", admin if keyed else {}, 100)
    head = head.replace(b"\r\n\r\n", f"\r\nExpect: {expect}\r\n\r\n".encode())
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
        conn.sendall(head)
        conn.settimeout(5)
        answer = _read_to_close(conn)
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == status
    assert b'"type":"error"' in answer.replace(b" ", b"")  # Anthropic's shape
    assert expect.encode() not in answer


def test_a_body_that_does_not_come_in_time_is_a_408_and_the_connection_closes(
    make_gateway: Callable[..., Gateway], admin: dict[str, str]
) -> None:
    """A caller that sends its head and part of its body holds a handler only for
    ``body_timeout_s`` (it held one for as long as it kept the connection)."""
    gateway = make_gateway(settings={"body_timeout_s": 0.3})
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
        conn.sendall(_raw_head(gateway, "/v1/chat/completions", admin, 1000) + b'{"model"')
        conn.settimeout(5)  # closed at once: not after aiohttp's 10 s of lingering reads
        answer = _read_to_close(conn)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"
    assert "0.3 s" in body["error"]["message"]
    bodies = _bodies(gateway, admin)  # what came was held while it waited, and given back
    assert (bodies["held_bytes"], bodies["most_bytes"]) == (0, len(b'{"model"'))


def test_a_heavy_body_is_read_while_the_gateway_answers_others(
    http: httpx.Client, admin: dict[str, str], pool: ThreadPoolExecutor
) -> None:
    """A legal body of 200,000 tiny parts takes seconds of Python to check; it is read
    off the server's loop, so other requests are answered meanwhile (it held the loop,
    and every other request, for all of it)."""
    parts = [{"type": "text", "text": "hi"}] * 200_000
    body = {"model": "fast", "messages": [{"role": "user", "content": parts}], "max_tokens": 1}
    raw = json.dumps(body).encode()
    start = time.perf_counter()
    heavy = pool.submit(http.post, "/v1/chat/completions", content=raw, headers=admin, timeout=120)
    slowest = 0.0
    while not heavy.done():
        sent = time.perf_counter()
        assert http.get("/healthz").status_code == 200
        slowest = max(slowest, time.perf_counter() - sent)
    took = time.perf_counter() - start
    assert heavy.result().status_code in (200, 400)  # answered, or too long for any model
    assert slowest < took / 4, (slowest, took)


def test_a_heavy_request_is_served_whole_plain_and_streamed(sdk: Sdk) -> None:
    """A body past ``HEAVY_BODY`` (submitted from the reader thread) is answered as any
    other: a plain answer, and a stream with its usage."""
    parts = [{"type": "text", "text": f"part {i}"} for i in range(4000)]
    assert len(json.dumps(parts)) > HEAVY_BODY
    messages: Any = [{"role": "user", "content": parts}]
    plain = sdk().chat.completions.create(model="fast", messages=messages, max_tokens=8)
    assert plain.choices[0].message.content
    assert plain.usage is not None
    assert plain.usage.prompt_tokens > 4000
    chunks = list(
        sdk().chat.completions.create(
            model="fast",
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens > 4000


def test_an_unknown_path_is_not_found_in_openais_shape(http: httpx.Client) -> None:
    answer = http.get("/v1/assistants")
    assert answer.status_code == 404
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_a_spent_budget_is_a_rate_limit_error_saying_insufficient_quota(sdk: Sdk) -> None:
    with pytest.raises(openai.RateLimitError) as caught:
        sdk("broke").chat.completions.create(model="fast", messages=HI)
    assert caught.value.type == "insufficient_quota"
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_a_full_queue_is_a_rate_limit_error_with_retry_after(
    sdk: Sdk, make_gateway: Callable[..., Gateway], occupy: Callable[..., Future[Any]]
) -> None:
    small = make_gateway(capacity=1)
    blocker = occupy(at=small)
    with pytest.raises(openai.RateLimitError) as caught:
        sdk(at=small).chat.completions.create(model="fast", messages=HI)
    headers = caught.value.response.headers
    assert caught.value.code == "queue_full"
    assert headers["Retry-After"] == "1"
    assert headers["retry-after-ms"] == "1000"
    assert headers["x-should-retry"] == "true"
    assert blocker.result(WAIT_S).choices[0].message.content


def test_a_provider_failure_is_an_internal_server_error_not_to_retry(sdk: Sdk) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        sdk().chat.completions.create(model="broken", messages=HI)
    assert caught.value.status_code == 502
    assert caught.value.code == "provider_error"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert caught.value.response.headers["X-Callboard-Attempts"] == "1"
    assert caught.value.response.headers["X-Callboard-Provider-Request-Id"].startswith("req_")


def test_a_model_given_up_on_says_when_its_breaker_takes_a_probe_again(
    make_gateway: Callable[..., Gateway],
) -> None:
    """A ``PROVIDER_DOWN`` 503 said ``x-should-retry: false`` and no ``Retry-After``: the
    SDKs gave up for good on a model whose breaker would take a probe seconds later."""
    breaker = BreakerConfig(consecutive_failures=1, cooldown_s=30.0, give_up_s=0.05)
    down = ModelSettings(
        name="m",
        base_url=f"http://127.0.0.1:{dead_port()}/v1",  # nothing listens
        retry=RetryConfig(max_attempts=1),
        breaker=breaker,
    )
    url = make_gateway(GatewayConfig(system=SystemConfig(models=(down,)))).url
    with (
        openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as client,
        anthropic.Anthropic(base_url=url, api_key="-", max_retries=0) as claude,
        httpx.Client(base_url=url, timeout=WAIT_S) as http,
    ):
        with pytest.raises(openai.InternalServerError) as refused:  # opens the breaker
            client.chat.completions.create(model="m", messages=HI)
        assert refused.value.code == "provider_connection"

        def given_up() -> bool:
            health = http.get("/v1/callboard/stats").json()["models"]["m"]
            return bool(health["given_up"] == "provider_down")

        assert wait_until(given_up)
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model="m", messages=HI)
        with pytest.raises(anthropic.InternalServerError) as overloaded:
            claude.messages.create(model="m", max_tokens=8, messages=HI)
    error, headers = caught.value, caught.value.response.headers
    assert (error.status_code, error.code) == (503, "provider_down")
    assert headers["x-should-retry"] == "true"
    assert 20 < int(headers["Retry-After"]) <= 30  # the breaker's 30 s cooldown, less a moment
    assert 20_000 < int(headers["retry-after-ms"]) <= 30_000
    assert overloaded.value.status_code == 529  # Anthropic's overloaded_error, same headers
    assert 20 < int(overloaded.value.response.headers["Retry-After"]) <= 30


def test_a_passed_deadline_is_a_504_deadline_exceeded(
    sdk: Sdk, occupy: Callable[..., Future[Any]]
) -> None:
    blocker = occupy()
    with pytest.raises(openai.InternalServerError) as caught:
        sdk().chat.completions.create(
            model="gate", messages=HI, extra_headers={"X-Callboard-Deadline": "0.05"}
        )
    assert caught.value.status_code == 504
    assert caught.value.code == "deadline_exceeded"
    blocker.result(WAIT_S)


def test_the_gateways_deadline_is_that_of_a_request_that_names_none(
    sdk: Sdk,
    slowed: Callable[[str, float], AbstractContextManager[None]],
    make_gateway: Callable[..., Gateway],
) -> None:
    """``[gateway] deadline_s``: without it a request naming no deadline was served for
    as long as its client waited (a provider's long Retry-After held one for minutes;
    a hunt); with it, as if the request had said ``X-Callboard-Deadline``. A request's
    own deadline still wins."""
    at = make_gateway(settings={"deadline_s": 0.1})
    with slowed("gate", 0.5):
        with pytest.raises(openai.InternalServerError) as caught:
            sdk(at=at).chat.completions.create(model="gate", messages=HI)
        assert caught.value.status_code == 504
        assert caught.value.code == "deadline_exceeded"
        waited = sdk(at=at).chat.completions.create(
            model="gate", messages=HI, extra_headers={"X-Callboard-Deadline": str(WAIT_S)}
        )
    assert waited.choices[0].message.content


def test_a_stream_that_fails_before_its_first_delta_gets_a_real_status(sdk: Sdk) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        sdk().chat.completions.create(model="broken", messages=HI, stream=True)
    assert caught.value.status_code == 502


def test_a_stream_cut_after_it_began_ends_with_an_error_event(sdk: Sdk) -> None:
    stream = sdk().chat.completions.create(model="cut", messages=HI, stream=True)
    received: list[str] = []
    with pytest.raises(openai.APIError) as caught:
        received.extend(c.choices[0].delta.content or "" for c in stream)
    assert "stream_cut" in str(caught.value.body)
    assert "".join(received)


def _sse_lines(answer: httpx.Response) -> Iterator[str]:
    """The lines of a stream's body as they come, blank ones left out."""
    return (line for line in answer.iter_lines() if line)


def test_a_stream_held_up_sends_its_head_then_keep_alives_until_its_first_delta(
    gateway: Gateway, admin: dict[str, str], upstream: SimulatedProvider, pool: ThreadPoolExecutor
) -> None:
    """The head waited for the first delta, through the queue's wait and the provider's
    first token: an SDK whose read timeout passed meanwhile retried, and each retry was
    a call of its own, billed (three calls, three charges; found by a hunt). Once the
    stream has been quiet half the client's read timeout (``x-stainless-read-timeout``,
    sent by both SDKs) the head goes, then a keep-alive whenever it stays quiet."""
    body = {"model": "gate", "messages": HI, "stream": True}
    headers = {**admin, "x-stainless-read-timeout": "0.5"}
    with httpx.Client(base_url=gateway.url, timeout=WAIT_S) as client:
        request = client.build_request("POST", "/v1/chat/completions", json=body, headers=headers)
        send = functools.partial(pool.submit, client.send, request, stream=True)
        with held_at(upstream, "gate", send) as sending:
            answer = sending.result(WAIT_S)  # the head, while the call is held upstream
            assert answer.status_code == 200
            assert answer.headers["X-Callboard-Model"] == "gate"
            lines = _sse_lines(answer)
            assert [next(lines), next(lines)] == [": keep-alive", ": keep-alive"]
        rest = list(lines)
        answer.close()
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in rest[:-1] if line[0] != ":"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.mark.parametrize(
    ("headers", "quiet_s"),
    [
        ({}, 15.0),  # no word from the client: stream_keepalive_s
        ({"x-stainless-read-timeout": "6.0"}, 3.0),  # the Python SDKs
        ({"X-Stainless-Timeout": "6"}, 3.0),  # the Anthropic TypeScript SDK (a hunt)
        ({"X-Stainless-Timeout": "0"}, gateway_app.QUIET_LEAST_S),  # under a second
        ({"x-stainless-read-timeout": "600", "x-stainless-timeout": "4"}, 2.0),  # the least
        ({"x-stainless-read-timeout": "soon"}, 15.0),
        ({"x-stainless-read-timeout": "nan"}, 15.0),
        ({"x-stainless-read-timeout": "-5"}, 15.0),
    ],
)
def test_a_stream_is_quiet_no_longer_than_half_the_timeout_its_client_says(
    headers: dict[str, str], quiet_s: float
) -> None:
    request = make_mocked_request("POST", "/v1/chat/completions", headers=headers)
    assert gateway_app._quiet_s(request, 15.0) == quiet_s


def test_a_head_sent_before_a_delta_names_what_was_asked_not_the_model_called_last() -> None:
    """Before a delta the model called last may be one that failed, whose fallback then
    answered: the early head named it, and every chunk its fallback (a hunt)."""
    stream = dataclasses.make_dataclass("Stream", ["task_id", "trace_id", "model"])(7, "", "oa")
    call = dataclasses.make_dataclass("Call", ["name"])("fast")
    fields = {"priority": 2}
    early = gateway_app._stream_headers(stream, fields, call, heard=False)  # type: ignore[arg-type]
    assert early["X-Callboard-Model"] == "fast"
    heard = gateway_app._stream_headers(stream, fields, call, heard=True)  # type: ignore[arg-type]
    assert heard["X-Callboard-Model"] == "oa"


def test_a_keep_alive_waits_out_a_write_under_way_without_spinning() -> None:
    """A write a client does not take (it stopped reading) began more than ``quiet_s``
    ago: the keep-alive's wait, timed from its start, was 0 every turn, and the loop
    spun a core until ``idle_s`` ended the write (a review: 241,000 turns in 2 s)."""

    class Stalled:
        """A stream whose one write has been under way for a second."""

        ended = False

        def __init__(self) -> None:
            self.last_write = asyncio.get_running_loop().time() - 1.0
            self.looks = 0

        @property
        def writing(self) -> int:
            self.looks += 1
            return 1

    async def main() -> int:
        out = Stalled()
        keeping = asyncio.ensure_future(gateway_app._keep_alive(out, b"", 0.05))  # type: ignore[arg-type]
        await asyncio.wait({keeping}, timeout=0.3)
        keeping.cancel()
        return out.looks

    assert asyncio.run(main()) <= 20  # about 2 a wait of 0.05 s; thousands when it spun


def test_sdks_with_a_read_timeout_shorter_than_the_wait_read_the_stream_whole(
    gateway: Gateway, keys: dict[str, str], upstream: SimulatedProvider, pool: ThreadPoolExecutor
) -> None:
    """Both SDKs, each with a read timeout shorter than their stream's wait (one held at
    the provider, the other queued behind it), and no retries: each reads its answer
    whole, from one call each. (Both closed at its end: left to the collector, their
    connections' sockets warned "unclosed" in whichever test it then ran, and failed it.)"""
    with (
        openai.OpenAI(
            base_url=f"{gateway.url}/v1", api_key=keys["admin"], timeout=3.0, max_retries=0
        ) as openai_sdk,
        anthropic.Anthropic(
            base_url=gateway.url, api_key=keys["admin"], timeout=3.0, max_retries=0
        ) as anthropic_sdk,
    ):

        def chat() -> str:
            stream = openai_sdk.chat.completions.create(model="gate", messages=HI, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        def message() -> str:
            with anthropic_sdk.messages.stream(model="gate", max_tokens=16, messages=HI) as stream:
                return stream.get_final_text()

        before = calls_to(upstream, "gate")
        with held_at(upstream, "gate", functools.partial(pool.submit, chat)) as chatting:
            messaging = pool.submit(message)
            # the provider takes its time (the fault): over twice their read timeout (a
            # keep-alive each 1.5 s leaves a loaded machine 1.5 s of slack)
            assert not threading.Event().wait(6.5)
        assert chatting.result(WAIT_S)
        assert messaging.result(WAIT_S)
    assert calls_to(upstream, "gate") == before + 2


def test_a_stream_that_fails_after_its_head_went_ends_with_the_apis_error_event(
    http: httpx.Client, admin: dict[str, str], occupy: Callable[..., Blocker]
) -> None:
    """Its status was sent with the head: the failure is the API's error event."""
    blocker = occupy()
    body = {"model": "gate", "messages": HI, "stream": True}
    headers = {**admin, "x-stainless-read-timeout": "0.5", "X-Callboard-Deadline": "4"}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as answer:
        assert answer.status_code == 200
        events = [line for line in _sse_lines(answer) if line[0] != ":"]
    blocker.result(WAIT_S)
    (event,) = events
    assert json.loads(event.removeprefix("data: "))["error"]["code"] == "deadline_exceeded"


def test_a_stream_whose_client_leaves_before_the_cut_ends_cancelled_without_an_error(
    sdk: Sdk, upstream: SimulatedProvider, debug_logs: LogCollector
) -> None:
    """A client that leaves a stream the provider is about to cut: its task ends
    cancelled (its reader closed it), and the gateway logs no error of its own. (A soak
    saw the narrower race, the cut read first and the connection found closing as the
    error event was written, logged at ERROR with two tracebacks 4 times in 6,000
    requests; ``_stream`` now takes a client gone there as gone.)"""
    cut = {"latency_s": 0.0, "ttft_s": 0.0, "cut_rate": 1.0, "cut_mode": "error"}  # conftest's
    upstream.configure("cut", ModelBehaviour(**cut, cut_after=2, token_gap_s=0.3))
    try:
        stream = sdk().chat.completions.create(model="cut", messages=HI, stream=True)
        next(iter(stream))
        stream.close()  # gone before the cut, 0.3 s on

        def ended() -> bool:
            return any("reader closed it" in line for line in debug_logs.lines)

        assert wait_until(ended, 5)
    finally:
        upstream.configure("cut", ModelBehaviour(**cut, cut_after=3))
    errors = [r for r in debug_logs.callboard_records() if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


# -- priorities ---------------------------------------------------------------------------------


def test_priority_comes_from_the_header_or_the_body_capped_by_the_key(sdk: Sdk) -> None:
    def priority(key: str, header: str | None = None, body: str | None = None) -> str:
        raw = sdk(key).chat.completions.with_raw_response.create(
            model="fast",
            messages=HI,
            extra_headers={} if header is None else {"X-Callboard-Priority": header},
            extra_body=None if body is None else {"priority": body},
        )
        return raw.headers["X-Callboard-Priority"]

    assert priority("admin") == "normal"
    assert priority("admin", header="critical") == "critical"
    assert priority("admin", header="0") == "critical"
    assert priority("admin", body="low") == "low"
    assert priority("admin", header="high", body="low") == "high"  # the header wins
    assert priority("team", header="critical") == "high"  # its ceiling
    assert priority("limited") == "low"  # its default


def test_a_high_priority_request_overtakes_a_low_one_waiting_for_the_same_model(
    sdk: Sdk,
    pool: ThreadPoolExecutor,
    occupy: Callable[..., Future[Any]],
    read_stats: Callable[[], dict[str, Any]],
) -> None:
    order: list[str] = []
    lock = threading.Lock()

    def ask(priority: str) -> None:
        sdk().chat.completions.create(
            model="gate", messages=HI, extra_headers={"X-Callboard-Priority": priority}
        )
        with lock:
            order.append(priority)

    blocker = occupy()
    low = pool.submit(ask, "low")
    assert wait_until(lambda: read_stats()["ledger"]["queued"] == 1)
    high = pool.submit(ask, "high")
    assert wait_until(lambda: read_stats()["ledger"]["queued"] == 2)
    for done in (blocker, low, high):
        done.result(WAIT_S)
    assert order == ["high", "low"]


# -- idempotency --------------------------------------------------------------------------------


def test_a_key_whose_first_request_expired_unsent_is_free_for_its_retry(
    sdk: Sdk, occupy: Callable[..., Future[Any]], upstream: SimulatedProvider
) -> None:
    """The first request's deadline passed in the queue, no call made: its 504 was
    replayed to every retry, the one without the deadline too, and the key was lost
    for good (found by a hunt). A request that never ran keeps no answer (as Stripe's
    API): the retry is a new request, answered."""
    key = {"Idempotency-Key": "expired-then-retried"}
    create = sdk().chat.completions.with_raw_response.create
    blocker = occupy()
    with pytest.raises(openai.InternalServerError) as caught:
        create(model="gate", messages=HI, extra_headers={**key, "X-Callboard-Deadline": "0.05"})
    assert caught.value.code == "deadline_exceeded"
    assert caught.value.response.headers["X-Callboard-Attempts"] == "0"
    blocker.result(WAIT_S)
    before = calls_to(upstream, "gate")
    again = create(model="gate", messages=HI, extra_headers=key)
    assert "Idempotent-Replayed" not in again.headers
    assert again.parse().choices[0].message.content
    assert calls_to(upstream, "gate") == before + 1
    replayed = create(model="gate", messages=HI, extra_headers=key)  # that one it keeps
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.headers["X-Callboard-Task-Id"] == again.headers["X-Callboard-Task-Id"]


def test_a_key_whose_every_call_was_refused_429_is_free_for_its_retry(
    make_gateway: Callable[..., Gateway],
) -> None:
    """Every call of the first request was refused by the provider's rate limit (no
    work done, nothing billed): its 429 was replayed to every retry, long after the
    limit had passed, and the provider never called again (found by a hunt)."""
    refused = (429, {"retry-after-ms": "1"}, b'{"error": {"message": "slow down"}}')
    answer = json.dumps(wire_completion(content="hi", usage=USAGE)).encode()
    with WireServer(replying(lambda n, _: refused if n < 2 else (200, {}, answer))) as server:
        retry = RetryConfig(max_rate_limited=2)
        model = ModelSettings(name="m", base_url=server.base_url, retry=retry)
        system = SystemConfig(models=(model,))
        url = f"{make_gateway(GatewayConfig(system=system)).url}/v1"
        key = {"Idempotency-Key": "refused-then-retried"}
        with openai.OpenAI(base_url=url, api_key="-", max_retries=0) as client:
            create = client.chat.completions.with_raw_response.create
            with pytest.raises(openai.RateLimitError) as caught:
                create(model="m", messages=HI, extra_headers=key)
            assert caught.value.response.headers["X-Callboard-Attempts"] == "2"
            again = create(model="m", messages=HI, extra_headers=key)
            assert "Idempotent-Replayed" not in again.headers
            assert again.parse().choices[0].message.content == "hi"
            replayed = create(model="m", messages=HI, extra_headers=key)  # that one it keeps
        assert replayed.headers["Idempotent-Replayed"] == "true"
        assert len(server.arrivals) == 3


def test_a_retry_with_the_same_idempotency_key_gets_the_first_answer(
    sdk: Sdk, upstream: SimulatedProvider
) -> None:
    key = {"Idempotency-Key": "order-17"}
    messages = [{"role": "user", "content": "idempotent hello"}]
    create = sdk().chat.completions.with_raw_response.create
    before = calls_to(upstream, "fast")
    first = create(model="fast", messages=messages, extra_headers=key)
    again = create(model="fast", messages=messages, extra_headers=key)
    assert calls_to(upstream, "fast") == before + 1
    assert again.headers["X-Callboard-Task-Id"] == first.headers["X-Callboard-Task-Id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content
    other_tenant = sdk("team").chat.completions.with_raw_response.create(
        model="fast", messages=messages, extra_headers=key
    )
    assert other_tenant.headers["X-Callboard-Task-Id"] != first.headers["X-Callboard-Task-Id"]


def test_concurrent_requests_with_one_idempotency_key_make_one_call(
    sdk: Sdk, upstream: SimulatedProvider, pool: ThreadPoolExecutor
) -> None:
    key = {"Idempotency-Key": "together-1"}
    before = calls_to(upstream, "slow")
    create = sdk().chat.completions.with_raw_response.create
    both = [pool.submit(create, model="slow", messages=HI, extra_headers=key) for _ in range(2)]
    answers = [f.result(WAIT_S) for f in both]
    assert calls_to(upstream, "slow") == before + 1
    assert len({a.headers["X-Callboard-Task-Id"] for a in answers}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_concurrent_heavy_requests_with_one_key_all_get_the_one_answer_and_so_do_retries(
    http: httpx.Client,
    admin: dict[str, str],
    upstream: SimulatedProvider,
    pool: ThreadPoolExecutor,
    *,
    stream: bool,
) -> None:
    """Looked up, then submitted after an await (a heavy body's reader thread, a quota's
    wait), five requests with one key went on together: the ledger refused four, 409,
    and a refusal replaced the first's answer for every later retry."""
    key = f"heavy-together-{stream}"
    body = json.loads(_heavy_chat(key))
    body["stream"] = stream
    raw = json.dumps(body).encode()
    headers = {**admin, "Idempotency-Key": key, "Content-Type": "application/json"}
    before = calls_to(upstream, "gate")

    def post() -> httpx.Response:
        return http.post("/v1/chat/completions", content=raw, headers=headers)

    answers = [f.result(WAIT_S) for f in [pool.submit(post) for _ in range(5)]]
    answers.append(post())  # a retry after them all
    assert [a.status_code for a in answers] == [200] * 6, [a.text[:200] for a in answers]
    assert calls_to(upstream, "gate") == before + 1
    assert len({a.headers["X-Callboard-Task-Id"] for a in answers}) == 1


def test_one_idempotency_key_on_two_endpoints_is_two_requests(sdk: Sdk, claude: Claude) -> None:
    """The docs scope a key to its endpoint; the same key on /v1/messages after
    /v1/chat/completions was refused as 'sent before with another body'."""
    key = {"Idempotency-Key": "two-doors"}
    chat = sdk().chat.completions.with_raw_response.create(
        model="fast", messages=HI, extra_headers=key
    )
    message = claude().messages.with_raw_response.create(
        model="fast", max_tokens=16, messages=HI, extra_headers=key
    )
    assert chat.headers["X-Callboard-Task-Id"] != message.headers["X-Callboard-Task-Id"]


def test_an_idempotency_key_reused_with_another_body_is_refused(sdk: Sdk) -> None:
    key = {"Idempotency-Key": "order-18"}
    sdk().chat.completions.create(model="fast", messages=HI, extra_headers=key)
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        sdk().chat.completions.create(
            model="fast", messages=[{"role": "user", "content": "else"}], extra_headers=key
        )
    assert caught.value.code == "idempotency_key_mismatch"


def test_an_idempotency_key_retried_with_the_same_request_written_otherwise_is_a_replay(
    gateway: Gateway, admin: dict[str, str]
) -> None:
    """The bodies were compared byte for byte: a client that writes its retry's keys in
    another order, or spaced otherwise, got 422 (found by a hunt)."""
    url = f"{gateway.url}/v1/chat/completions"
    headers = {**admin, "Content-Type": "application/json", "Idempotency-Key": "order-19"}
    first = httpx.post(url, content=_chat_body(), headers=headers, timeout=WAIT_S)
    call = json.loads(_chat_body())
    again = json.dumps(dict(reversed(call.items())), indent=2).encode()
    retry = httpx.post(url, content=again, headers=headers, timeout=WAIT_S)
    assert (first.status_code, retry.status_code) == (200, 200), retry.text
    assert retry.headers["X-Callboard-Task-Id"] == first.headers["X-Callboard-Task-Id"]


def test_a_stream_retried_with_its_idempotency_key_replays_the_whole_answer(sdk: Sdk) -> None:
    key = {"Idempotency-Key": "stream-1"}

    def streamed() -> str:
        chunks = sdk().chat.completions.create(
            model="fast", messages=HI, stream=True, extra_headers=key
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    first = streamed()
    assert first
    assert streamed() == first


def test_a_stream_replayed_keeps_its_logprobs(sdk: Sdk) -> None:
    """A replayed stream of one choice lost its logprobs (found by a hunt)."""
    key = {"Idempotency-Key": "stream-logprobs"}

    def streamed() -> list[str]:
        chunks = sdk().chat.completions.create(
            model="fast", messages=HI, stream=True, logprobs=True, extra_headers=key
        )
        tokens = []
        for c in chunks:
            for choice in c.choices:
                if choice.logprobs is not None and choice.logprobs.content:
                    tokens += [t.token for t in choice.logprobs.content]
        return tokens

    first = streamed()
    assert first
    assert "".join(streamed()) == "".join(first)


def test_a_stream_of_several_choices_replays_every_one(sdk: Sdk) -> None:
    """``n`` = 3: the replay carried only the first choice."""
    key = {"Idempotency-Key": "stream-n-3"}

    def streamed() -> tuple[dict[int, str], dict[int, str]]:
        chunks = sdk().chat.completions.create(
            model="fast", messages=HI, n=3, stream=True, extra_headers=key
        )
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        for c in chunks:
            for choice in c.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
        return texts, finishes

    first = streamed()
    assert sorted(first[0]) == sorted(first[1]) == [0, 1, 2]
    assert streamed() == first


# -- clients that leave ---------------------------------------------------------------------------


def test_a_client_that_leaves_before_its_call_is_sent_cancels_it(
    sdk: Sdk,
    upstream: SimulatedProvider,
    occupy: Callable[..., Future[Any]],
    read_stats: Callable[[], dict[str, Any]],
) -> None:
    cancelled = read_stats()["outcomes"].get("cancelled", 0)
    before = calls_to(upstream, "gate")
    blocker = occupy()
    with pytest.raises(openai.APITimeoutError):
        sdk(timeout=0.3).chat.completions.create(model="gate", messages=HI)
    assert wait_until(lambda: read_stats()["outcomes"].get("cancelled", 0) == cancelled + 1)
    blocker.result(WAIT_S)
    assert wait_until(lambda: read_stats()["ledger"]["in_flight"] == 0)
    assert calls_to(upstream, "gate") == before + 1  # only the blocker was ever sent


def _heavy_chat(tag: str) -> bytes:
    """A chat body over ``HEAVY_BODY`` (read, counted and submitted on the reader
    thread), for ``gate``. (Sent as bytes: the SDK takes a second to build it.)"""
    parts = [{"type": "text", "text": f"{tag} {i}"} for i in range(6000)]
    body = {"model": "gate", "messages": [{"role": "user", "content": parts}], "max_tokens": 4}
    raw = json.dumps(body).encode()
    assert len(raw) > HEAVY_BODY
    return raw


LEAVING_AFTER_S = (0.02, 0.05, 0.1, 0.2, 0.4)
"""When a test's clients leave: before, while and after a heavy request is submitted."""


def test_a_heavy_request_whose_client_leaves_at_any_moment_is_never_sent(
    http: httpx.Client,
    admin: dict[str, str],
    upstream: SimulatedProvider,
    *,
    occupy: Callable[..., Future[Any]],
    read_stats: Callable[[], dict[str, Any]],
    debug_logs: LogCollector,
) -> None:
    """Wherever its client leaves (the body being read, the request being submitted
    on the reader thread, the task queued), a heavy request is not sent, and nothing
    is logged as an error. (One that left while the reader submitted it ran: its
    cancel raised in a callback.)"""
    before = calls_to(upstream, "gate")
    blocker = occupy()
    for after_s in LEAVING_AFTER_S:
        with pytest.raises(httpx.TimeoutException):
            http.post(
                "/v1/chat/completions",
                content=_heavy_chat(f"leaving {after_s}"),
                headers=admin,
                timeout=after_s,
            )
    assert not blocker.done(), "the gate opened before every client had left"
    blocker.result(WAIT_S)
    assert wait_until(lambda: read_stats()["ledger"]["in_flight"] == 0)
    assert calls_to(upstream, "gate") == before + 1  # only the blocker was ever sent
    assert not [r for r in debug_logs.records if r.levelno >= logging.ERROR]
    assert wait_until(lambda: read_stats()["bodies"]["held_bytes"] == 0)  # all given back


def test_a_heavy_request_with_an_idempotency_key_is_answered_to_its_retry_wherever_it_left(
    http: httpx.Client,
    admin: dict[str, str],
    upstream: SimulatedProvider,
    *,
    occupy: Callable[..., Future[Any]],
    read_stats: Callable[[], dict[str, Any]],
) -> None:
    """A client that leaves while its heavy request is submitted on the reader thread
    gets the answer on its retry (it got 409 "key already used": the first task ran,
    unrecorded)."""
    before = calls_to(upstream, "gate")
    blocker = occupy()
    keys = [f"heavy-leaving-{after_s}" for after_s in LEAVING_AFTER_S]
    for after_s, key in zip(LEAVING_AFTER_S, keys, strict=True):
        with pytest.raises(httpx.TimeoutException):
            http.post(
                "/v1/chat/completions",
                content=_heavy_chat(key),
                headers={**admin, "Idempotency-Key": key},
                timeout=after_s,
            )
    blocker.result(WAIT_S)
    for key in keys:
        retried = http.post(
            "/v1/chat/completions",
            content=_heavy_chat(key),
            headers={**admin, "Idempotency-Key": key},
        )
        assert retried.status_code == 200, retried.text
        assert retried.json()["choices"][0]["message"]["content"]
    assert calls_to(upstream, "gate") == before + 1 + len(keys)  # each once
    assert wait_until(lambda: read_stats()["bodies"]["held_bytes"] == 0)  # all given back


def test_a_heavy_request_that_leaves_as_it_is_submitted_keeps_its_key_for_its_own_answer(
    gateway: Gateway,
    http: httpx.Client,
    admin: dict[str, str],
    upstream: SimulatedProvider,
    *,
    pool: ThreadPoolExecutor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A's client left while its heavy body was submitted on the reader thread, and its
    handler let the key go as it left: B, another request with the key, waiting for A's
    entry, was taken as the key's first and sent, and its answer replaced A's for every
    retry, though A's task ran and was paid (found by a hunt). B must wait for A's entry.

    The order is made certain by holding the reader's submit of A until A's handler has
    been cancelled and B is waiting for the key (each seen through a wrapper that only
    observes)."""
    key = "heavy-leaves-as-submitted"
    raw = _heavy_chat(key)
    submitting, proceed, a_left, b_waits = (threading.Event() for _ in range(4))
    real_submit, real_on_reader, real_first = System.submit, Front._on_reader, Replays.first

    def submit(self: System, prompt: Any, /, **fields: Any) -> Any:
        asked = prompt.idempotency_key if isinstance(prompt, Request) else None
        if str(asked or "").endswith(key) and not submitting.is_set():
            submitting.set()
            assert proceed.wait(WAIT_S)  # the reader's submit of A, held
        return real_submit(self, prompt, **fields)

    async def on_reader(self: Front, work: Any, hold: Any, left: Any = None) -> Any:
        try:
            return await real_on_reader(self, work, hold, left)
        except asyncio.CancelledError:
            if left is not None:
                a_left.set()
            raise

    async def first(self: Replays, scoped_key: str) -> Any:
        if scoped_key.endswith(key) and a_left.is_set():
            b_waits.set()
        return await real_first(self, scoped_key)

    monkeypatch.setattr(System, "submit", submit)
    monkeypatch.setattr(Front, "_on_reader", on_reader)
    monkeypatch.setattr(Replays, "first", first)
    before = calls_to(upstream, "gate")
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: {admin['Authorization']}\r\nIdempotency-Key: {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as a:
        a.sendall(head.encode() + raw)
        assert submitting.wait(WAIT_S)
    assert a_left.wait(WAIT_S)  # A's handler is gone; its submit goes on, held
    other = {"model": "gate", "messages": HI, "max_tokens": 4}  # the key with another body
    b = pool.submit(
        http.post, "/v1/chat/completions", json=other, headers={**admin, "Idempotency-Key": key}
    )
    assert b_waits.wait(WAIT_S)
    proceed.set()
    assert b.result(WAIT_S).status_code == 422  # A's body is the key's: not B's
    retried = http.post(
        "/v1/chat/completions", content=raw, headers={**admin, "Idempotency-Key": key}
    )
    assert retried.status_code == 200, retried.text
    assert retried.headers["Idempotent-Replayed"] == "true"
    assert calls_to(upstream, "gate") == before + 1  # A's task, once


METERED = "sk-metered-0123456789"


def _metered(
    make_gateway: Callable[..., Gateway], base_config: GatewayConfig, **limits: Any
) -> Gateway:
    """A gateway of the module's configuration with one more key, ``METERED``, of
    ``limits``, whose requests wait for them 2 s at most."""
    key = ClientKey(
        name="metered",
        digest=hashlib.sha256(METERED.encode()).digest(),
        tenant="metered",
        limits=Limits(**limits),
    )
    keys = (*base_config.gateway.keys, key)
    settings = dataclasses.replace(base_config.gateway, keys=keys, max_wait_s=2.0)
    return make_gateway(dataclasses.replace(base_config, gateway=settings))


@pytest.mark.parametrize(
    "limits",
    [{"rpm": 1}, {"tpm": 1000}, {"budget_usd": Decimal("0.000001")}],
    ids=["rpm", "tpm", "budget"],
)
def test_a_request_that_can_never_be_served_is_its_400_whatever_the_keys_limits(
    make_gateway: Callable[..., Gateway], base_config: GatewayConfig, limits: dict[str, Any]
) -> None:
    """On a key with an rpm, a tpm or a budget, an invalid request waited its turn for
    the quotas and was answered 429 (retryable, ``Retry-After``; or
    ``insufficient_quota``; or "more than the tokens per minute"): the quotas took it
    before anything checked it, and a client retried it for ever (found by a hunt). It
    is its 400, as OpenAI answers it, whatever the key's limits. A valid request that
    can never fit the key's tpm stays a 429 that says not to retry, as OpenAI's
    "Request too large" is."""
    gateway = _metered(make_gateway, base_config, **limits)
    with httpx.Client(
        base_url=gateway.url, headers={"Authorization": f"Bearer {METERED}"}, timeout=WAIT_S
    ) as client:
        if "rpm" in limits:  # the minute's one request
            assert client.post("/v1/chat/completions", content=_chat_body()).status_code == 200
        for bad, param in [
            ({"temperature": 9}, "temperature"),
            ({"logprobs": "yes"}, "logprobs"),
            ({"n": 1000}, "n"),
            ({"max_tokens": 10**7}, "max_tokens"),
        ]:
            answer = client.post("/v1/chat/completions", content=_chat_body(**bad))
            assert answer.status_code == 400, (bad, answer.status_code, answer.text)
            assert answer.json()["error"]["param"] == param
        embedding = {"model": "fast", "input": "hi", "dimensions": 0}
        answer = client.post("/v1/embeddings", json=embedding)
        assert answer.status_code == 400, answer.text
        assert "dimensions" in answer.json()["error"]["message"]
        if "tpm" in limits:
            answer = client.post("/v1/chat/completions", content=_chat_body(max_tokens=5000))
            assert answer.status_code == 429, answer.text
            assert answer.json()["error"]["code"] == "rate_limit_exceeded"
            assert answer.headers["x-should-retry"] == "false"
            assert "Retry-After" not in answer.headers


def test_what_is_legal_but_likely_a_mistake_is_said_at_start(
    gateway: Gateway, make_gateway: Callable[..., Gateway], caplog: pytest.LogCaptureFixture
) -> None:
    """A budget over a model without a price never spent (50 of 50 calls on a $0.01
    budget), and a tenant's weight naming no key's tenant was never used: both in
    silence (found by a hunt)."""
    base = gateway.config
    assert base.system is not None
    fast = next(m for m in base.system.models if m.name == "fast")
    free = dataclasses.replace(fast, name="free", price=FREE, tiers=())
    weights = SchedulerSettings(tenant_weights={"teem": 2.0})
    system = dataclasses.replace(base.system, models=(*base.system.models, free), scheduler=weights)
    key = ClientKey(
        name="capped",
        digest=hashlib.sha256(b"capped-key").digest(),
        tenant="team",
        limits=Limits(budget_usd=Decimal("0.01")),
        models=frozenset({"free"}),
    )
    auto = dataclasses.replace(  # auto may pick any model (missed: found by a review)
        key, name="auto-capped", digest=hashlib.sha256(b"auto").digest(), models=frozenset({"auto"})
    )
    settings = dataclasses.replace(base.gateway, keys=(*base.gateway.keys, key, auto))
    with caplog.at_level(logging.WARNING, logger="callboard.gateway"):
        make_gateway(GatewayConfig(system=system, gateway=settings))
    said = caplog.text
    assert "gateway.keys.capped: a budget applies, but free has no price" in said
    assert "gateway.keys.auto-capped: a budget applies, but free has no price" in said
    assert "scheduler.tenant_weights.teem: no gateway key belongs to this tenant" in said


def test_an_open_gateway_answers_this_machine_only(
    gateway: Gateway, make_gateway: Callable[..., Gateway]
) -> None:
    """Open (no keys), it answered a page of any site the operator visited: a simple
    cross-site POST made a paid call, and a page behind DNS rebinding (a foreign
    ``Host``) could read the answers (found by a hunt)."""
    base = gateway.config
    at = make_gateway(GatewayConfig(system=base.system, gateway=GatewaySettings()))
    body = json.dumps({"model": "fast", "messages": HI, "max_tokens": 4})
    with httpx.Client(base_url=at.url, timeout=WAIT_S) as http:
        assert http.post("/v1/chat/completions", content=body).status_code == 200
        # keys an SDK sends (the anthropic SDK with both of its) are no keys of an open
        # gateway's: two different ones were a 400 (found by a review)
        two = {"Authorization": "Bearer sk-a", "x-api-key": "sk-b"}
        assert http.post("/v1/chat/completions", content=body, headers=two).status_code == 200
        same = {"Origin": at.url}
        assert http.post("/v1/chat/completions", content=body, headers=same).status_code == 200
        refused = [
            http.post("/v1/chat/completions", content=body, headers=headers)
            for headers in (
                {"Origin": "https://attacker.example", "Content-Type": "text/plain"},
                {"Origin": "null"},
                {"Host": "attacker.example"},
            )
        ]
        stats = http.get("/v1/callboard/stats", headers={"Host": "rebound.example:8080"})
        both = [("Origin", at.url), ("Origin", "https://attacker.example")]  # the first
        twice = http.post("/v1/chat/completions", content=body, headers=both)  # was taken
    assert twice.status_code == 400, twice.text
    assert [r.status_code for r in refused] == [403, 403, 403]
    assert refused[0].json()["error"]["code"] == "foreign_origin"
    assert stats.status_code == 403


def test_a_stream_whose_client_leaves_stops_reading_the_provider(
    sdk: Sdk, upstream: SimulatedProvider, read_stats: Callable[[], dict[str, Any]]
) -> None:
    cancelled = read_stats()["outcomes"].get("cancelled", 0)
    stream = sdk().chat.completions.create(model="drip", messages=HI, stream=True)
    assert next(iter(stream)).choices[0].delta.role == "assistant"
    assert served(upstream, "drip")["in_flight"] == 1
    stream.close()  # 200 tokens 50 ms apart: ~10 s still to send
    assert wait_until(lambda: read_stats()["outcomes"].get("cancelled", 0) == cancelled + 1, 5)
    assert wait_until(lambda: served(upstream, "drip")["in_flight"] == 0, 5)


def test_a_key_whose_stream_was_left_mid_way_is_free_for_its_retry(
    sdk: Sdk, upstream: SimulatedProvider, read_stats: Callable[[], dict[str, Any]]
) -> None:
    """The first stream's client left after a call was made: its task ended
    ``Cancelled``, which frees its key in the ledger, and the gateway answered every
    retry with the key 409 for good (the two disagreed). The retry is a new request."""
    key = {"Idempotency-Key": "left-mid-stream"}
    cancelled = read_stats()["outcomes"].get("cancelled", 0)
    create = sdk().chat.completions.create
    asked: dict[str, Any] = {"model": "drip", "messages": HI, "stream": True, "max_tokens": 20}
    stream = create(**asked, extra_headers=key)
    assert next(iter(stream)).choices[0].delta.role == "assistant"
    stream.close()
    assert wait_until(lambda: read_stats()["outcomes"].get("cancelled", 0) == cancelled + 1)
    before = calls_to(upstream, "drip")
    again = sdk().chat.completions.with_raw_response.create(**asked, extra_headers=key)
    assert "Idempotent-Replayed" not in again.headers
    text = "".join(c.choices[0].delta.content or "" for c in again.parse() if c.choices)
    assert text
    assert calls_to(upstream, "drip") == before + 1


def test_a_stream_whose_client_reads_nothing_is_closed_and_its_slot_freed(
    make_gateway: Callable[..., Gateway], upstream: SimulatedProvider, admin: dict[str, str]
) -> None:
    """A client that keeps its socket open and reads nothing held the model's slot for
    good (its call waits for the reader): past ``idle_s`` without a byte taken, the
    gateway closes the connection and the call ends (found by a hunt)."""
    gateway = make_gateway(settings={"idle_s": 0.5})
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    call = {"model": "flood", "messages": HI, "stream": True, "max_tokens": 100_000}
    body = json.dumps(call).encode()
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.settimeout(WAIT_S)
        conn.connect((host, int(port)))
        conn.sendall(_raw_head(gateway, "/v1/chat/completions", admin, len(body)) + body)
        assert wait_until(lambda: served(upstream, "flood")["in_flight"] == 1)
        assert wait_until(lambda: served(upstream, "flood")["in_flight"] == 0)  # never read
        after = httpx.post(  # the slot is free: the next call is served
            f"{gateway.url}/v1/chat/completions",
            json={"model": "flood", "messages": HI, "max_tokens": 5},
            headers=admin,
            timeout=WAIT_S,
        )
        assert after.status_code == 200, after.text
        with contextlib.suppress(ConnectionResetError):  # aborted: the buffered dropped
            _read_to_close(conn)  # closed by the gateway: no timeout here


def test_a_plain_answer_whose_client_reads_nothing_is_dropped_after_idle_s(
    make_gateway: Callable[..., Gateway], admin: dict[str, str], debug_logs: LogCollector
) -> None:
    """A plain answer (not a stream) went whole into the connection's buffer and was
    written for as long as its client kept the socket open and read nothing: two
    embeddings of 2,048 texts held 630 MB of the gateway's memory, and the
    connections, past ``idle_s`` (found by a hunt). Past ``idle_s`` without a byte
    taken, the gateway drops the connection and what it held, as it does a stream's."""
    gateway = make_gateway(settings={"idle_s": 0.5})
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "fast", "input": [f"text {i}" for i in range(400)]}).encode()
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.settimeout(WAIT_S)
        conn.connect((host, int(port)))
        conn.sendall(_raw_head(gateway, "/v1/embeddings", admin, len(body)) + body)

        def dropped() -> bool:
            return any("took none of its answer" in line for line in debug_logs.lines)

        assert wait_until(dropped), "the gateway kept writing"
        received = b""
        with contextlib.suppress(ConnectionResetError):  # aborted: the buffered dropped
            received = _read_to_close(conn)  # closed by the gateway: no timeout here
    if received:  # (a reset may come before a byte is read)
        head, _, got = received.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(h for h in lines if h.lower().startswith(b"content-length"))
        assert b" 200 " in lines[0]
        assert len(got) < int(length.split(b":")[1]), "not all of it"
    after = httpx.post(
        f"{gateway.url}/v1/embeddings",
        json={"model": "fast", "input": "one"},
        headers=admin,
        timeout=WAIT_S,
    )
    assert after.status_code == 200, after.text


def test_a_plain_answer_read_slowly_but_steadily_is_written_whole(
    make_gateway: Callable[..., Gateway], admin: dict[str, str], debug_logs: LogCollector
) -> None:
    """A client that keeps reading, slower than the kernel's send queue (megabytes on
    loopback) drains: the transport's own buffer does not move meanwhile, and a client
    reading 200 KB a second was dropped as if it read nothing (found by a review)."""
    gateway = make_gateway(settings={"idle_s": 0.5})
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "fast", "input": [f"text {i}" for i in range(150)]}).encode()
    received = b""
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        conn.settimeout(WAIT_S)
        conn.connect((host, int(port)))
        conn.sendall(_raw_head(gateway, "/v1/embeddings", admin, len(body)) + body)
        while b"\r\n\r\n" not in received or len(received) < _whole(received):
            got = conn.recv(65536)
            assert got, f"closed after {len(received)} bytes"
            received += got
            time.sleep(0.01)  # the client's pace (800 KB a second at most), not a wait
    assert not any("took none of its answer" in line for line in debug_logs.lines)


def test_clients_that_hang_up_during_a_large_answer_log_no_error(
    gateway: Gateway, admin: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Each hang-up as the answer was being written was an ERROR with a traceback in the
    log (asyncio's ``Task exception was never retrieved``): one a request, a caller's
    to make (found by a hunt)."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    chat = {"model": "fast", "messages": HI, "max_tokens": 50, "n": 64}
    body = json.dumps({**chat, "logprobs": True, "top_logprobs": 20}).encode()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for _ in range(3):  # it was most of them
            with socket.socket() as conn:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                conn.settimeout(WAIT_S)
                conn.connect((host, int(port)))
                conn.sendall(_raw_head(gateway, "/v1/chat/completions", admin, len(body)) + body)
                assert conn.recv(100).startswith(b"HTTP/1.1 200")  # the answer has begun
                time.sleep(0.3)  # its rest waits in the gateway's buffers: then a hang-up
        ok = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat, headers=admin)
        assert ok.status_code == 200  # the gateway's loop has gone on past the hang-ups
        gc.collect()  # a task is said never retrieved as it is collected
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text[:2000]


def _whole(received: bytes) -> int:
    """How long an answer whose head is in ``received`` is, its head included."""
    head, _, _ = received.partition(b"\r\n\r\n")
    length = next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
    return len(head) + 4 + int(length.split(b":")[1])


# -- the bodies held at once (max_held_mb) ---------------------------------------------------------

ROOMY = {"max_body_mb": 0.25, "max_held_mb": 0.3}
"""A gateway that holds one body of ``_large_chat``'s size at a time."""


def test_a_body_of_many_values_within_max_body_mb_is_taken_by_a_room_of_its_size(
    make_gateway: Callable[..., Gateway], admin: dict[str, str]
) -> None:
    """What its values cost is counted, but never past the whole room: with
    ``max_held_mb = max_body_mb`` (allowed) such a body was refused 413 for good (a
    review)."""
    gateway = make_gateway(settings={"max_body_mb": 0.25, "max_held_mb": 0.25})
    parts = [{"type": "text", "text": "hi"}] * 6_000  # 200 KB, 18,000 values: 1.1 MB read
    body = {"model": "fast", "messages": [{"role": "user", "content": parts}], "max_tokens": 1}
    raw = json.dumps(body).encode()
    assert HEAVY_BODY <= len(raw) <= 0.25 * 2**20
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions", content=raw, headers=admin, timeout=WAIT_S
    )
    assert answer.status_code == 200, answer.text


def _large_chat(model: str = "gate") -> bytes:
    """A chat body of about 200 KB (two do not fit a room of ``ROOMY``)."""
    body = {"model": model, "messages": [{"role": "user", "content": "x" * 200_000}]}
    return json.dumps({**body, "max_tokens": 1}).encode()


def _bodies(gateway: Gateway, admin: dict[str, str]) -> dict[str, int]:
    answer = httpx.get(f"{gateway.url}/v1/callboard/stats", headers=admin, timeout=WAIT_S)
    answer.raise_for_status()
    bodies: dict[str, int] = answer.json()["bodies"]
    return bodies


def test_a_body_that_finds_no_room_is_a_429_and_the_room_comes_back(
    make_gateway: Callable[..., Gateway],
    sdk: Sdk,
    admin: dict[str, str],
    pool: ThreadPoolExecutor,
    occupy: Callable[..., Future[Any]],
) -> None:
    """While one large body is kept (its task queued), another is answered 429 with
    Retry-After at once; a small chat still fits; once the first has ended its room
    is there again."""
    gateway = make_gateway(settings=ROOMY)
    url, raw = f"{gateway.url}/v1/chat/completions", _large_chat()
    blocker = occupy(at=gateway)
    first = pool.submit(httpx.post, url, content=raw, headers=admin, timeout=WAIT_S)
    assert wait_until(lambda: _bodies(gateway, admin)["held_bytes"] >= len(raw))
    refused = httpx.post(url, content=raw, headers=admin, timeout=WAIT_S)
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "gateway_full"
    small = sdk(at=gateway).chat.completions.create(model="fast", messages=HI)
    assert small.choices[0].message.content
    assert not first.done()
    blocker.result(WAIT_S)
    assert first.result(WAIT_S).status_code == 200
    assert wait_until(lambda: _bodies(gateway, admin)["held_bytes"] == 0)
    again = httpx.post(url, content=raw, headers=admin, timeout=WAIT_S)
    assert again.status_code == 200, again.text
    bodies = _bodies(gateway, admin)
    assert bodies["most_bytes"] <= bodies["capacity_bytes"] == math.ceil(0.3 * 1024 * 1024)
    assert bodies["refused"] == 1


def test_bodies_declared_and_never_sent_take_no_room(
    make_gateway: Callable[..., Gateway], admin: dict[str, str]
) -> None:
    """Connections that declare the largest body and then send nothing hold no room:
    a body that came is served meanwhile (room taken for what a head declares would
    let a few stalled connections refuse every request for ``body_timeout_s``)."""
    gateway = make_gateway(settings=ROOMY)
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    largest = 256 * 1024
    stalled = [socket.create_connection((host, int(port)), timeout=WAIT_S) for _ in range(4)]
    try:
        for conn in stalled:
            conn.sendall(_raw_head(gateway, "/v1/chat/completions", admin, largest))
        served = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            content=_large_chat("fast"),
            headers=admin,
            timeout=WAIT_S,
        )
        assert served.status_code == 200, served.text
    finally:
        for conn in stalled:
            conn.close()


def test_a_body_whose_client_left_is_held_while_its_task_is(
    make_gateway: Callable[..., Gateway],
    admin: dict[str, str],
    occupy: Callable[..., Future[Any]],
) -> None:
    """A client that leaves with an ``Idempotency-Key`` leaves its task queued for the
    retry, and with it the request: its body's room is kept until the task ends (a
    flood of such requests held memory without bound). Without a key the task is
    cancelled, and the room comes back at once."""
    gateway = make_gateway(settings=ROOMY)
    url, raw = f"{gateway.url}/v1/chat/completions", _large_chat()
    blocker = occupy(at=gateway)
    held = _bodies(gateway, admin)["held_bytes"]  # the blocker's own small body
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, content=raw, headers=admin, timeout=0.3)
    assert wait_until(lambda: _bodies(gateway, admin)["held_bytes"] == held)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, content=raw, headers={**admin, "Idempotency-Key": "kept"}, timeout=0.3)
    assert not blocker.done()
    parsed = VALUE_BYTES * (raw.count(b"{") + raw.count(b"[") + raw.count(b","))  # read into
    assert _bodies(gateway, admin)["held_bytes"] == held + len(raw) + parsed  # it waits, queued
    blocker.result(WAIT_S)
    assert wait_until(lambda: _bodies(gateway, admin)["held_bytes"] == 0)


def _logprobs(tokens: int, alternatives: int) -> dict[str, Any]:
    """A choice's logprobs: ``tokens`` entries, each with ``alternatives`` ranked."""
    ranked = [{"token": "b", "logprob": -1.5, "bytes": [98]}] * alternatives
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": ranked}
    return {"content": [entry] * tokens, "refusal": None}


def test_a_heavy_answer_is_made_on_the_reader_thread_an_ordinary_one_where_it_came(
    make_gateway: Callable[..., Gateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 150-byte request for 128 choices with 20 logprobs a token made a 57 MB answer,
    built and encoded on the server's loop: every other request waited seconds (found
    by a hunt). One that large is made and encoded on the reader thread, a piece at a
    time; an ordinary one where its result came, with no hand-over."""
    made_on: list[str] = []
    made = gateway_app.completion_body

    def spy(*args: Any, **kwargs: Any) -> Any:
        made_on.append(threading.current_thread().name)
        return made(*args, **kwargs)

    monkeypatch.setattr(gateway_app, "completion_body", spy)
    heavy = wire_completion(content="hi", usage=USAGE)
    heavy["choices"] = [
        {**heavy["choices"][0], "index": i, "logprobs": _logprobs(100, 20)} for i in range(4)
    ]
    bodies = [json.dumps(wire_completion(content="hi", usage=USAGE)).encode()]
    bodies.append(json.dumps(heavy).encode())
    with WireServer(replying(lambda n, _: (200, {}, bodies[n]))) as server:
        system = SystemConfig(models=(ModelSettings(name="m", base_url=server.base_url),))
        url = f"{make_gateway(GatewayConfig(system=system)).url}/v1"
        with openai.OpenAI(base_url=url, api_key="-", max_retries=0) as client:
            ordinary = client.chat.completions.create(model="m", messages=HI)
            large = client.chat.completions.create(
                model="m", messages=HI, n=4, logprobs=True, top_logprobs=20
            )
    assert ordinary.choices[0].message.content == "hi"
    assert [len(c.logprobs.content) for c in large.choices if c.logprobs] == [100] * 4
    last = large.choices[3].logprobs
    assert last is not None
    assert last.model_dump()["content"][99] == heavy["choices"][3]["logprobs"]["content"][99]
    ordinary_on, large_on = made_on
    assert large_on.startswith("callboard-gateway-reader")
    assert not ordinary_on.startswith("callboard-gateway-reader")


def _metric(gateway: Gateway, name: str) -> float:
    """One of the gateway's ``/metrics`` series, with no labels."""
    text = httpx.get(f"{gateway.url}/metrics", timeout=WAIT_S).text
    return float(next(line for line in text.splitlines() if line.startswith(f"{name} ")).split()[1])


def test_a_body_on_its_way_holds_room_for_what_has_come(
    make_gateway: Callable[..., Gateway], admin: dict[str, str]
) -> None:
    """Read whole and only then counted, a body still coming held memory the room never
    saw: eight connections that sent 31 MB of a 32 MB body and stalled held 250 MB
    while ``/metrics`` said 0 (found by a hunt). What has come is held as it comes; a
    body declared larger than the room left is refused before any of it is read; the
    room comes back when the stalled client leaves."""
    gateway = make_gateway(settings=ROOMY)
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    path, sent = "/v1/chat/completions", 150_000
    stalled = socket.create_connection((host, int(port)), timeout=WAIT_S)
    try:
        stalled.sendall(_raw_head(gateway, path, admin, 200_000) + b" " * sent)
        held = "callboard_gateway_body_bytes_held"
        assert wait_until(lambda: _metric(gateway, held) == sent), _metric(gateway, held)
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as second:
            second.sendall(_raw_head(gateway, path, admin, 200_000))  # 164 KB left
            refused = _read_to_close(second)
        assert refused.startswith(b"HTTP/1.1 429"), refused[:200]
        assert json.loads(refused.partition(b"\r\n\r\n")[2])["error"]["code"] == "gateway_full"
        small = httpx.post(f"{gateway.url}{path}", content=_chat_body(), headers=admin)
        assert small.status_code == 200, small.text  # what is left is room for it
    finally:
        stalled.close()
    assert wait_until(lambda: _bodies(gateway, admin)["held_bytes"] == 0)
    bodies = _bodies(gateway, admin)
    assert bodies["refused"] == 1
    assert sent <= bodies["most_bytes"] <= bodies["capacity_bytes"]


def test_a_chunked_body_that_outgrows_the_room_is_refused_as_it_comes(
    make_gateway: Callable[..., Gateway], admin: dict[str, str]
) -> None:
    """A chunked body declares no length: its room grows as its pieces come, and the
    piece the room cannot take is answered 429 (``gateway_full``) and the connection
    closed, not read on."""
    gateway = make_gateway(settings=ROOMY)
    capacity = math.ceil(0.3 * 2**20)
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    path, sent, piece = "/v1/chat/completions", 200_000, 16 * 1024
    stalled = socket.create_connection((host, int(port)), timeout=WAIT_S)
    try:
        stalled.sendall(_raw_head(gateway, path, admin, 250_000) + b" " * sent)
        assert wait_until(lambda: _bodies(gateway, admin)["held_bytes"] == sent)
        pieces = (capacity - sent) // piece + 1  # the last one does not fit
        head = _raw_head(gateway, path, admin, 0).replace(
            b"Content-Length: 0", b"Transfer-Encoding: chunked"
        )
        chunked = b"".join(b"%x\r\n" % piece + b" " * piece + b"\r\n" for _ in range(pieces))
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as grower:
            grower.sendall(head + chunked)  # and no end: it would go on
            refused = _read_to_close(grower)
        assert refused.startswith(b"HTTP/1.1 429"), refused[:200]
        assert json.loads(refused.partition(b"\r\n\r\n")[2])["error"]["code"] == "gateway_full"
        assert wait_until(lambda: _bodies(gateway, admin)["held_bytes"] == sent)  # its own back
    finally:
        stalled.close()
    assert wait_until(lambda: _bodies(gateway, admin)["held_bytes"] == 0)
    assert _bodies(gateway, admin)["most_bytes"] <= capacity


# -- Anthropic's door: POST /v1/messages with the official anthropic SDK -----------------------

PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}

Claude = Callable[..., anthropic.Anthropic]


@pytest.fixture(scope="module")
def claude(gateway: Gateway, keys: dict[str, str]) -> Iterator[Claude]:
    """``claude(key="admin", at=gateway, **options)``: an ``anthropic.Anthropic`` client
    of the gateway ``at`` (the module's by default); no retries; made once per
    arguments."""
    made: dict[tuple[Any, ...], anthropic.Anthropic] = {}

    def make(key: str = "admin", at: Gateway | None = None, **options: Any) -> anthropic.Anthropic:
        url = (at or gateway).url
        options = {"max_retries": 0, "timeout": WAIT_S, **options}
        known = (key, url, *sorted(options.items()))
        if known not in made:
            made[known] = anthropic.Anthropic(base_url=url, api_key=keys[key], **options)
        return made[known]

    yield make
    for client in made.values():
        client.close()


def test_the_anthropic_sdk_lists_and_retrieves_models_in_its_own_shape(
    claude: Claude, sdk: Sdk
) -> None:
    """The list was OpenAI's: the anthropic SDK's ``ModelInfo`` came with ``type``,
    ``display_name`` and ``created_at`` all None (found by a hunt). Its pages follow
    ``after_id``; the OpenAI SDK's list is as it was."""
    expected = [m.id for m in sdk().models.list()]  # models, then routes
    listed = list(claude().models.list(limit=3))  # pages of 3, followed to the end
    assert [m.id for m in listed] == expected
    assert all(m.type == "model" and m.display_name == m.id for m in listed)
    assert all(m.created_at.year == 1970 for m in listed)
    one = claude().models.retrieve("fast")
    assert (one.id, one.type) == ("fast", "model")
    page = claude().models.list(limit=2, after_id=expected[0])
    assert [m.id for m in page.data] == expected[1:3]
    assert page.has_more is (len(expected) > 3)
    with pytest.raises(anthropic.BadRequestError, match="limit"):
        claude().models.list(limit=0)
    with pytest.raises(anthropic.BadRequestError, match="after_id"):
        claude().models.list(after_id="nope")


def test_a_message_is_answered_in_anthropics_shape_with_what_callboard_did_in_headers(
    claude: Claude,
) -> None:
    raw = claude().messages.with_raw_response.create(
        model="fast",
        max_tokens=64,
        system="Be brief.",
        messages=[{"role": "user", "content": "Say hi"}],
        metadata={"user_id": "u-17"},
        stop_sequences=["\n\n\n"],
    )
    message = raw.parse()
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.id.startswith("msg_")
    assert message.content[0].type == "text"
    assert message.content[0].text
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0
    assert message.usage.output_tokens > 0
    assert raw.headers["X-Callboard-Model"] == "fast"
    assert raw.headers["X-Callboard-Attempts"] == "1"
    assert Decimal(raw.headers["X-Callboard-Cost"]) > 0
    assert message._request_id == raw.headers["x-request-id"]  # the trace id


def test_count_tokens_counts_a_heavy_body_off_the_servers_loop(
    gateway: Gateway, admin: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/v1/messages/count_tokens`` counted any body on the server's loop: 17 MB of text
    parts held every other request for 2-3 s (found by a hunt). A heavy body is counted
    on the reader thread, as a message's reservation is; a light one where it came."""
    counted_on: list[str] = []
    estimate = gateway_app.chat_estimate

    def spy(*args: Any, **kwargs: Any) -> Any:
        counted_on.append(threading.current_thread().name)
        return estimate(*args, **kwargs)

    monkeypatch.setattr(gateway_app, "chat_estimate", spy)
    parts = [{"type": "text", "text": f"word{i} more"} for i in range(5_000)]
    heavy = {"model": "fast", "messages": [{"role": "user", "content": parts}]}
    assert len(json.dumps(heavy)) >= HEAVY_BODY
    headers = {**admin, "anthropic-version": "2023-06-01"}
    counts = [
        httpx.post(
            f"{gateway.url}/v1/messages/count_tokens", json=body, headers=headers, timeout=WAIT_S
        ).json()["input_tokens"]
        for body in ({"model": "fast", "messages": HI}, heavy)
    ]
    assert 0 < counts[0] < counts[1]
    light_on, heavy_on = counted_on
    assert heavy_on.startswith("callboard-gateway-reader")
    assert not light_on.startswith("callboard-gateway-reader")


def test_count_tokens_counts_a_message_as_the_reservation_does(claude: Claude) -> None:
    """The ``anthropic`` SDK's ``messages.count_tokens`` was a 404 "no such endpoint"."""
    short = claude().messages.count_tokens(
        model="fast", messages=[{"role": "user", "content": "Say hi"}]
    )
    longer = claude().messages.count_tokens(
        model="fast",
        system="Be brief.",
        messages=[{"role": "user", "content": "Say hi " * 200}],
    )
    assert 0 < short.input_tokens < longer.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        claude().messages.count_tokens(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        claude().messages.count_tokens(model="fast", messages="not a list")  # type: ignore[arg-type]


def test_a_message_stream_names_the_model_that_serves_it_as_a_whole_message_does(
    claude: Claude,
) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    plain = claude().messages.create(model="quick", max_tokens=16, messages=hi)  # type: ignore[arg-type]
    with claude().messages.stream(model="quick", max_tokens=16, messages=hi) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.model == plain.model == "fast"


def test_a_message_stream_is_anthropics_event_sequence_and_assembles_in_the_sdk(
    claude: Claude,
) -> None:
    with claude().messages.stream(
        model="fast", max_tokens=64, messages=[{"role": "user", "content": "Say hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert len(text.split()) > 3
    assert final.content[0].type == "text"
    assert final.content[0].text == text
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens > 0
    assert final.usage.output_tokens > 0
    streamed = list(
        claude().messages.create(
            model="fast", max_tokens=16, messages=[{"role": "user", "content": "Hi"}], stream=True
        )
    )
    events = [e.type for e in streamed]
    assert events[0] == "message_start"
    # its usage says the prompt's size, as Anthropic's does (it said 0; found by a hunt)
    assert streamed[0].message.usage.input_tokens > 0  # type: ignore[union-attr]
    assert events[1] == "content_block_start"
    assert set(events[2:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_tool_round_trip_keeps_the_tool_use_id(claude: Claude) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude().messages.create(
        model="fast",
        max_tokens=128,
        messages=ask,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "any"},
    )
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather"
    assert isinstance(use.input["city"], str)
    answer = [{"type": "tool_result", "tool_use_id": use.id, "content": "15 degrees, clear"}]
    second = claude().messages.create(
        model="fast",
        max_tokens=128,  # the provider draws 16 to 64 tokens: at 64, one draw in 49 was cut
        tools=[WEATHER_TOOL],
        messages=[
            *ask,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": answer},
        ],
    )
    assert second.stop_reason == "end_turn"
    assert second.content[0].type == "text"


def test_a_streamed_tool_call_assembles_in_the_sdk(claude: Claude) -> None:
    with claude().messages.stream(
        model="fast",
        max_tokens=128,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    use = final.content[-1]
    assert use.type == "tool_use"
    assert use.name == "get_weather"
    assert isinstance(use.input["city"], str)


def test_the_async_anthropic_sdk_sends_and_streams(gateway: Gateway, keys: dict[str, str]) -> None:
    async def run() -> tuple[str, str]:
        async with anthropic.AsyncAnthropic(
            base_url=gateway.url, api_key=keys["team"], max_retries=0, timeout=WAIT_S
        ) as client:
            hi = [{"role": "user", "content": "Say hi"}]
            message = await client.messages.create(model="fast", max_tokens=32, messages=hi)
            async with client.messages.stream(model="fast", max_tokens=32, messages=hi) as stream:
                text = "".join([t async for t in stream.text_stream])
            block = message.content[0]
            return (block.text if block.type == "text" else ""), text

    plain, streamed = asyncio.run(run())
    assert plain
    assert streamed


def test_the_anthropic_sdks_betas_reach_the_claude_model_it_is_routed_to(
    make_gateway: Callable[..., Gateway],
) -> None:
    """``client.beta.messages.create(betas=[...])`` sends ``anthropic-beta``: a beta
    changes what the call is (a 1M context, 128k output), so it goes on to the
    provider with that call, added to the model's own betas; a call without betas
    carries the model's only."""
    reply = json.dumps(message_body(text_block("hello"))).encode()
    with WireServer(replying(lambda n, body: (200, {}, reply))) as srv:
        claude = ModelSettings(
            name="claude",
            base_url=srv.base_url,
            api="anthropic",
            headers={"anthropic-beta": "token-efficient-tools-2025-02-19"},
        )
        config = GatewayConfig(
            system=SystemConfig(models=(claude,), default_route=("claude",)),
            gateway=GatewaySettings(),
        )
        at = make_gateway(config)
        with anthropic.Anthropic(base_url=at.url, api_key="open", max_retries=0) as client:
            betas = ["context-1m-2025-08-07", "output-128k-2025-02-19"]
            asked = client.beta.messages.create(
                model="claude", max_tokens=16, messages=HI, betas=betas
            )
            plain = client.messages.create(model="claude", max_tokens=16, messages=HI)
        with_betas, without = srv.arrivals
    assert asked.content[0].type == plain.content[0].type == "text"
    assert with_betas.headers["anthropic-beta"] == (
        "token-efficient-tools-2025-02-19,context-1m-2025-08-07,output-128k-2025-02-19"
    )
    assert without.headers["anthropic-beta"] == "token-efficient-tools-2025-02-19"


def test_a_beta_header_no_call_could_send_is_a_400_naming_it(
    gateway: Gateway, keys: dict[str, str]
) -> None:
    body = {"model": "fast", "max_tokens": 8, "messages": HI}
    headers = {"x-api-key": keys["team"], "anthropic-beta": "caf\u00e9".encode()}
    answer = httpx.post(f"{gateway.url}/v1/messages", json=body, headers=headers, timeout=WAIT_S)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "anthropic-beta" in error["message"]


def test_an_image_reaches_a_vision_model_that_speaks_anthropic_and_its_own_body_comes_back(
    make_gateway: Callable[..., Gateway], upstream: SimulatedProvider
) -> None:
    claude_model = ModelSettings(
        name="claude",
        base_url=upstream.base_url,
        api="anthropic",
        capabilities=frozenset({"vision", "tools"}),
        max_concurrency=4,
    )
    config = GatewayConfig(
        system=SystemConfig(models=(claude_model,), default_route=("claude",)),
        gateway=GatewaySettings(),
    )
    at = make_gateway(config)
    image = {"type": "base64", "media_type": "image/png", "data": PNG}
    with anthropic.Anthropic(base_url=at.url, api_key="open", max_retries=0) as client:
        raw = client.messages.with_raw_response.create(
            model="claude",
            max_tokens=64,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": image},
                        {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
                        {"type": "text", "text": "What is in these images?"},
                    ],
                }
            ],
        )
        message = raw.parse()
        assert raw.headers["X-Callboard-Model"] == "claude"
        assert not message.id.startswith("msg_callboard_")  # the provider's own message
        assert message.content[0].type == "text"
        assert message.usage.input_tokens > 0
        with client.messages.stream(
            model="claude", max_tokens=32, messages=[{"role": "user", "content": "Hi"}]
        ) as stream:
            assert "".join(stream.text_stream)


# -- Anthropic's errors, as the SDK's own classes -------------------------------------------------


def test_anthropic_errors_are_the_sdks_own_classes_in_anthropics_shape(
    claude: Claude, gateway: Gateway
) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    with (
        anthropic.Anthropic(base_url=gateway.url, api_key="sk-wrong-1", max_retries=0) as wrong,
        pytest.raises(anthropic.AuthenticationError) as unknown_key,
    ):
        wrong.messages.create(model="fast", max_tokens=8, messages=hi)
    assert unknown_key.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": unknown_key.value.api_message},
    }
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        claude("limited").messages.create(model="slow", max_tokens=8, messages=hi)
    assert denied.value.type == "permission_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude().messages.create(model="gpt-9", max_tokens=8, messages=hi)
    assert missing.value.type == "not_found_error"
    assert "fast" in (missing.value.api_message or "")
    with pytest.raises(anthropic.BadRequestError) as unmappable:
        claude().messages.create(
            model="fast",
            max_tokens=8,
            messages=hi,
            extra_body={"container": "c-1"},
        )
    assert unmappable.value.type == "invalid_request_error"
    assert (unmappable.value.api_message or "").startswith("container:")
    with pytest.raises(anthropic.RateLimitError) as broke:
        claude("broke").messages.create(model="fast", max_tokens=8, messages=hi)
    assert broke.value.type == "rate_limit_error"
    assert broke.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(anthropic.InternalServerError) as failed:
        claude().messages.create(model="broken", max_tokens=8, messages=hi)
    assert failed.value.status_code == 502
    assert failed.value.type == "api_error"
    with pytest.raises(anthropic.InternalServerError):
        claude().messages.create(model="broken", max_tokens=8, messages=hi, stream=True)


def test_an_unknown_path_under_messages_answers_in_anthropics_shape(http: httpx.Client) -> None:
    answer = http.get("/v1/messages")
    assert answer.status_code == 405
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_a_full_queue_is_anthropics_rate_limit_error_with_retry_after(
    claude: Claude, make_gateway: Callable[..., Gateway], occupy: Callable[..., Future[Any]]
) -> None:
    small = make_gateway(capacity=1)
    blocker = occupy(at=small)
    with pytest.raises(anthropic.RateLimitError) as caught:
        claude(at=small).messages.create(
            model="fast", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
        )
    assert caught.value.type == "rate_limit_error"
    assert caught.value.response.headers["Retry-After"] == "1"
    assert blocker.result(WAIT_S).choices[0].message.content


def test_a_message_stream_cut_after_it_began_ends_with_anthropics_error_event(
    claude: Claude,
) -> None:
    received: list[str] = []
    with (
        pytest.raises(anthropic.APIStatusError) as caught,
        claude().messages.stream(
            model="cut", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
        ) as stream,
    ):
        received.extend(stream.text_stream)
    assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert "".join(received)


# -- Anthropic's door schedules as chat does ------------------------------------------------------


def test_a_message_takes_its_priority_from_the_header_capped_by_the_key(claude: Claude) -> None:
    def priority(key: str, header: str) -> str:
        raw = claude(key).messages.with_raw_response.create(
            model="fast",
            max_tokens=8,
            messages=[{"role": "user", "content": "Hi"}],
            extra_headers={"X-Callboard-Priority": header},
        )
        return raw.headers["X-Callboard-Priority"]

    assert priority("admin", "critical") == "critical"
    assert priority("team", "critical") == "high"


def test_a_message_retried_with_its_idempotency_key_gets_the_first_answer(
    claude: Claude, upstream: SimulatedProvider
) -> None:
    key = {"Idempotency-Key": "message-1"}
    hi = [{"role": "user", "content": "idempotent hi"}]
    create = claude().messages.with_raw_response.create
    before = calls_to(upstream, "fast")
    first = create(model="fast", max_tokens=16, messages=hi, extra_headers=key)
    again = create(model="fast", max_tokens=16, messages=hi, extra_headers=key)
    assert calls_to(upstream, "fast") == before + 1
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.parse().content == first.parse().content
    with pytest.raises(anthropic.UnprocessableEntityError):  # streamed: another body
        claude().messages.create(
            model="fast", max_tokens=16, messages=hi, extra_headers=key, stream=True
        )

    def streamed() -> tuple[str, str]:
        with claude().messages.stream(
            model="fast", max_tokens=16, messages=hi, extra_headers={"Idempotency-Key": "m-2"}
        ) as stream:
            final = stream.get_final_message()
        block = final.content[0]
        return (block.text if block.type == "text" else ""), final.stop_reason or ""

    first_stream = streamed()
    assert first_stream[0]
    assert streamed() == first_stream  # replayed from the first stream's result


def test_a_message_stream_whose_client_leaves_stops_reading_the_provider(
    claude: Claude, upstream: SimulatedProvider, read_stats: Callable[[], dict[str, Any]]
) -> None:
    cancelled = read_stats()["outcomes"].get("cancelled", 0)
    stream = claude().messages.create(
        model="drip", max_tokens=256, messages=[{"role": "user", "content": "Hi"}], stream=True
    )
    assert next(iter(stream)).type == "message_start"
    assert served(upstream, "drip")["in_flight"] == 1
    stream.close()
    assert wait_until(lambda: read_stats()["outcomes"].get("cancelled", 0) == cancelled + 1, 5)
    assert wait_until(lambda: served(upstream, "drip")["in_flight"] == 0, 5)


def test_a_chat_that_names_no_max_tokens_is_sent_the_gateways_default(
    make_gateway: Callable[..., Gateway],
) -> None:
    """OpenAI's API lets a client omit max_tokens; callboard sends one always (its
    reservations need a bound): the gateway's default_max_tokens, not the library's 256.
    One that names it (or max_completion_tokens) is sent its own."""
    with WireServer(answer()) as server:
        system = SystemConfig(models=(ModelSettings(name="m", base_url=server.base_url),))
        config = GatewayConfig(system=system, gateway=GatewaySettings(default_max_tokens=3000))
        url = f"{make_gateway(config).url}/v1"
        with openai.OpenAI(base_url=url, api_key="-", max_retries=0) as client:
            ask = client.chat.completions.create
            ask(model="m", messages=[{"role": "user", "content": "hi"}])
            ask(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=7)
            ask(model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=9)
            # null is none given, as OpenAI's API reads it (the SDK sends one for None;
            # it was refused 400, naming max_tokens for either; found by a hunt)
            ask(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=None)
            ask(model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=None)
        sent = [a.json for a in server.arrivals]
    assert sent[0]["max_tokens"] == 3000
    assert sent[1]["max_tokens"] == 7
    assert 9 in (sent[2].get("max_tokens"), sent[2].get("max_completion_tokens"))
    assert sent[3]["max_tokens"] == sent[4]["max_tokens"] == 3000


def test_a_streams_reasoning_reaches_the_sdk_and_its_replay(
    make_gateway: Callable[..., Gateway],
) -> None:
    """A reasoning model's streamed thinking (``reasoning_content``) was dropped from the
    gateway's stream (found by a hunt), and then from the replay of the stream for its
    ``Idempotency-Key`` (a review): the openai SDK reads it in each delta."""
    text = openai_stream(["4"])
    thoughts = [sse(chunk({"reasoning_content": p})) for p in ("2+2", " is 4")]
    with WireServer(sending([text[0], *thoughts, *text[1:]])) as server:
        system = SystemConfig(models=(ModelSettings(name="m", base_url=server.base_url),))
        url = f"{make_gateway(GatewayConfig(system=system)).url}/v1"
        said = []
        with openai.OpenAI(base_url=url, api_key="-", max_retries=0) as client:
            for _ in range(2):  # the stream, then its replay
                stream = client.chat.completions.create(
                    model="m",
                    messages=HI,
                    stream=True,
                    extra_headers={"Idempotency-Key": "think-once"},
                )
                said.append(
                    "".join(
                        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in stream
                        if c.choices
                    )
                )
        sent = len(server.arrivals)
    assert said == ["2+2 is 4", "2+2 is 4"]
    assert sent == 1


def test_a_null_max_tokens_beside_a_real_cap_is_reserved_at_the_real_cap() -> None:
    """``{"max_tokens": null, "max_completion_tokens": 100000}`` was sent with 100,000
    and reserved against the key's quota as the default 256 (a review)."""
    from callboard.gateway.app import _capped

    fields: dict[str, Any] = {"max_tokens": None, "max_completion_tokens": 100_000}
    _capped(fields, 256)
    assert fields == {"max_completion_tokens": 100_000}
    both_null: dict[str, Any] = {"max_tokens": None, "max_completion_tokens": None}
    _capped(both_null, 256)
    assert both_null == {"max_tokens": 256}


@pytest.mark.parametrize("finish", ["length", "content_filter"])
def test_a_strict_json_answer_cut_short_reaches_the_sdk_as_the_answer_it_is(
    make_gateway: Callable[..., Gateway], finish: str
) -> None:
    """As OpenAI's API answers it: the completion with its ``finish_reason``, from which
    the SDK's ``parse`` raises its own error, and a stream ending in ``[DONE]``. It was a
    502 (``malformed_output``), its paid answer lost, and streamed an error event after
    the finish chunk (found by a hunt)."""

    class City(BaseModel):
        city: str

    cut = '{"city": "Par'

    def reply(n: int, body: Any) -> tuple[int, dict[str, str], bytes]:
        if body.get("stream"):
            events = openai_stream([cut], finish_reason=finish)
            return 200, {"content-type": "text/event-stream"}, b"".join(events)
        answered = wire_completion(content=cut, finish_reason=finish, usage=USAGE)
        return 200, {}, json.dumps(answered).encode()

    with WireServer(replying(reply)) as server:
        system = SystemConfig(models=(ModelSettings(name="m", base_url=server.base_url),))
        url = f"{make_gateway(GatewayConfig(system=system)).url}/v1"
        with openai.OpenAI(base_url=url, api_key="-", max_retries=0) as client:
            refused = (
                openai.LengthFinishReasonError
                if finish == "length"
                else openai.ContentFilterFinishReasonError
            )
            with pytest.raises(refused):
                client.chat.completions.parse(
                    model="m", messages=HI, response_format=City, max_completion_tokens=5
                )
            schema = {"name": "City", "strict": True, "schema": City.model_json_schema()}
            stream = client.chat.completions.create(
                model="m",
                messages=HI,
                response_format={"type": "json_schema", "json_schema": schema},
                max_completion_tokens=5,
                stream=True,
            )
            chunks = list(stream)
        sent = len(server.arrivals)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert sent == 2


def test_an_unusable_embeddings_answer_is_not_retried_by_the_sdk_and_floats_come_as_asked(
    make_gateway: Callable[..., Gateway],
) -> None:
    """A provider that answers one vector for two texts: the 502 says ``x-should-retry:
    false``, so the SDK does not pay for the same answer three times; one that ignores
    ``encoding_format`` and answers floats: a caller that asked base64 gets base64, as
    OpenAI's API gives it (it got the floats). Found by a hunt."""

    def reply(n: int, body: Any) -> tuple[int, dict[str, str], bytes]:
        vectors = [[0.5, -0.25, 0.125]] * (1 if body["input"] == ["short", "of one"] else 2)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        usage = {"prompt_tokens": 2, "total_tokens": 2}
        answered = {"object": "list", "data": data, "model": "e", "usage": usage}
        return 200, {}, json.dumps(answered).encode()

    with WireServer(replying(reply)) as server:
        models = (ModelSettings(name="e", base_url=server.base_url),)
        url = f"{make_gateway(GatewayConfig(system=SystemConfig(models=models))).url}/v1"
        with openai.OpenAI(base_url=url, api_key="-", max_retries=2) as client:
            with pytest.raises(openai.InternalServerError) as refused:
                client.embeddings.create(model="e", input=["short", "of one"])
            sent_for_it = len(server.arrivals)
            encoded = client.embeddings.with_raw_response.create(
                model="e", input=["a", "b"], encoding_format="base64"
            )
    assert refused.value.code == "embedding_failed"
    assert sent_for_it == 1
    data = json.loads(encoded.text)["data"]
    assert [d["embedding"] for d in data] == [
        base64.b64encode(struct.pack("<3f", 0.5, -0.25, 0.125)).decode()
    ] * 2


# -- extended thinking ------------------------------------------------------------------------

THINK: Any = {"type": "enabled", "budget_tokens": 1024}


@pytest.fixture
def thinking_gateway(make_gateway: Callable[..., Gateway], upstream: SimulatedProvider) -> Gateway:
    """A gateway whose one model is a Claude model (the simulator's Messages API, which
    signs its thinking and refuses a thinking tool loop without it, as Anthropic's)."""
    claude_model = ModelSettings(
        name="claude", base_url=upstream.base_url, api="anthropic", max_concurrency=4
    )
    return make_gateway(GatewayConfig(system=SystemConfig(models=(claude_model,))))


def test_a_thinking_tool_loop_runs_through_the_messages_door_streamed_and_replayed(
    thinking_gateway: Gateway,
) -> None:
    """The anthropic SDK's thinking tool loop, as its docs write it: the answer's content
    (its signed thinking first) sent back as the assistant turn. The gateway refused
    ``thinking``, and the wire dropped the blocks: the second turn could not be made."""
    with anthropic.Anthropic(base_url=thinking_gateway.url, api_key="-", max_retries=0) as client:
        ask: Any = [{"role": "user", "content": "Weather in Paris?"}]
        said: list[Any] = []
        for _ in range(2):  # the stream, then its replay for the same Idempotency-Key
            with client.messages.stream(
                model="claude",
                max_tokens=2048,
                thinking=THINK,
                tools=[WEATHER_TOOL],
                messages=ask,
                extra_headers={"Idempotency-Key": "think-loop"},
            ) as stream:
                said.append(stream.get_final_message())
        first, replayed = said
        assert [b.type for b in first.content] == ["thinking", "tool_use"]
        assert first.content[0].type == "thinking"
        assert first.content[0].signature
        assert replayed.content == first.content  # the replay signs as the stream did
        use = first.content[1]
        assert use.type == "tool_use"
        answer: Any = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id}]}
        after = client.messages.create(
            model="claude",
            max_tokens=2048,
            thinking=THINK,
            tools=[WEATHER_TOOL],
            messages=[*ask, {"role": "assistant", "content": first.content}, answer],
        )
        assert after.stop_reason == "end_turn"
        assert after.content[0].type == "thinking"
        with pytest.raises(anthropic.BadRequestError, match="Expected `thinking`"):
            client.messages.create(  # without its thinking: refused upstream, as Anthropic does
                model="claude",
                max_tokens=2048,
                thinking=THINK,
                tools=[WEATHER_TOOL],
                messages=[*ask, {"role": "assistant", "content": [use]}, answer],
            )


def test_a_claude_models_thinking_reaches_an_openai_client_and_goes_back(
    thinking_gateway: Gateway,
) -> None:
    """Through the chat door, as LiteLLM's proxy says it: ``reasoning_content`` and the
    signed ``thinking_blocks``, which the message sent back as it came carries."""
    tool: Any = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER_TOOL["input_schema"]},
    }
    think = {"thinking": THINK}
    ask: Any = [{"role": "user", "content": "Weather in Paris?"}]
    with openai.OpenAI(base_url=f"{thinking_gateway.url}/v1", api_key="-", max_retries=0) as client:
        first = client.chat.completions.create(
            model="claude", max_tokens=2048, messages=ask, tools=[tool], extra_body=think
        )
        message = first.choices[0].message
        extra = message.model_extra or {}
        assert extra["reasoning_content"]
        (block,) = extra["thinking_blocks"]
        assert block["signature"]
        (call,) = message.tool_calls or ()
        result: Any = {"role": "tool", "tool_call_id": call.id, "content": "18C"}
        after = client.chat.completions.create(
            model="claude",
            max_tokens=2048,
            messages=[*ask, message.model_dump(exclude_none=True), result],
            tools=[tool],
            extra_body=think,
        )
    assert after.choices[0].finish_reason == "stop"
