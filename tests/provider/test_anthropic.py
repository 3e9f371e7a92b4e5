"""Anthropic's Messages wire for the simulator (provider/anthropic.py): the headers and
bodies it accepts and refuses in Anthropic's words, its rate-limit headers, and extended
thinking (checked pure, and with the official SDK against a running simulator)."""

from __future__ import annotations

import base64
import datetime
import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from callboard.provider.anthropic import (
    MIN_THINKING_BUDGET,
    REDACTED_THINKING_TRIGGER,
    MessagesRequest,
    check_headers,
    count_tokens_body,
    error_body,
    message_body,
    message_stream,
    parse_messages,
    ratelimit_headers,
    redact_thinking,
    redacted_ok,
    sign_thinking,
    signature_ok,
    stop_reason,
)
from callboard.provider.behaviour import ModelBehaviour
from callboard.provider.engine import Finish, Outcome, Plan
from callboard.provider.limits import Window
from callboard.provider.reply import Call, Reply
from callboard.provider.server import SimulatedProvider
from callboard.provider.wire import BadRequestError
from callboard.wire.sse import EventStream
from pydantic import TypeAdapter

HI = [{"role": "user", "content": "hi"}]
TOOL = {
    "name": "t",
    "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
}


def parse(**body: Any) -> Any:
    return parse_messages(
        json.dumps({"model": "c", "max_tokens": 10, "messages": HI, **body}).encode()
    )


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "anthropic-version: header is required"),
        (
            {"anthropic-version": "yesterday"},
            'anthropic-version: "yesterday" is not a valid version',
        ),
        (
            {"anthropic-version": "2022-12-31"},
            'anthropic-version: "2022-12-31" is not a valid version',
        ),
    ],
)
def test_the_version_header_is_required(headers: dict[str, str], message: str) -> None:
    with pytest.raises(BadRequestError) as refused:
        check_headers(headers)
    assert refused.value.message == message
    check_headers({"anthropic-version": "2023-06-01"})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": None}, "max_tokens: Input should be an integer >= 1"),
        ({"temperature_k": 1}, "temperature_k: Extra inputs are not permitted"),
        (
            {"messages": [{"role": "system", "content": "x"}]},
            "messages.0.role: Input should be 'user' or 'assistant'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages.0.content.0.type: Input tag 'video' does not match any known tag",
        ),
        ({"tools": [{"name": "t"}]}, "tools.0.input_schema: Field required"),
        ({"tool_choice": {"type": "tool"}, "tools": [TOOL]}, "tool_choice.name: Field required"),
        ({"stop_sequences": "x"}, "stop_sequences: Input should be a list of strings"),
    ],
)
def test_bad_bodies_are_refused_in_anthropics_words(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequestError) as refused:
        parse(**body)
    assert refused.value.message == message


def test_a_missing_max_tokens_is_a_required_field() -> None:
    with pytest.raises(BadRequestError, match="max_tokens: Field required"):
        parse_messages(json.dumps({"model": "c", "messages": HI}).encode())


def test_tools_system_and_images_are_read() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://x/cat.png"}}
    request = parse(
        system=[{"type": "text", "text": "abcd"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "look"}, image]}],
        tools=[TOOL, {"type": "web_search_20250305", "name": "web_search"}],
        tool_choice={"type": "any"},
        stream=True,
    )
    assert [c.name for c in request.reply.calls] == ["t"]  # a server tool is not ours to call
    assert request.ask.stream
    assert request.ask.prompt_tokens > 1600  # an image of unknown size costs the most: 1600
    after = parse(
        messages=[
            *HI,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "x", "name": "t", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]},
        ],
        tools=[TOOL],
    )
    assert after.reply.calls == ()


def test_stop_reasons_are_anthropics() -> None:
    def plan(finish: Finish) -> Plan:
        return Plan(Outcome.OK, 200, (), 1, 1, finish)

    calls = Reply(calls=(Call("t", "{}"),))
    assert stop_reason(plan("stop"), Reply()) == "end_turn"
    assert stop_reason(plan("stop"), calls) == "tool_use"
    assert stop_reason(plan("length"), calls) == "max_tokens"
    assert stop_reason(plan("stop_sequence"), Reply()) == "stop_sequence"


def test_rate_limit_headers_reset_at_rfc_3339_times() -> None:
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC).timestamp()
    headers = ratelimit_headers(
        [Window("requests", 60, 0, 1.2), Window("tokens", 1000, 900, 0.0)], now
    )
    assert headers == {
        "anthropic-ratelimit-requests-limit": "60",
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2026-01-02T03:04:07Z",
        "anthropic-ratelimit-tokens-limit": "1000",
        "anthropic-ratelimit-tokens-remaining": "900",
        "anthropic-ratelimit-tokens-reset": "2026-01-02T03:04:05Z",
    }


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (529, "overloaded_error"),
        (502, "api_error"),
    ],
)
def test_errors_have_anthropics_shape(status: int, kind: str) -> None:
    body = error_body(status, request_id="req_1")
    assert body["type"] == "error"
    assert body["error"]["type"] == kind
    assert body["error"]["message"]
    assert body["request_id"] == "req_1"


# --- extended thinking -------------------------------------------------------------------

THINK: Any = {"type": "enabled", "budget_tokens": MIN_THINKING_BUDGET}
BIG = 2000
"""A ``max_tokens`` above the least budget."""
WEATHER: Any = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}


def think(**body: Any) -> MessagesRequest:
    """``parse`` with thinking on and room for its budget."""
    request: MessagesRequest = parse(**{"max_tokens": BIG, "thinking": THINK, **body})
    return request


def plan_for(request: MessagesRequest, completion: int = 4) -> Plan:
    """The plan the engine makes for ``request`` when it draws ``completion`` words."""
    ask = request.ask
    size = ask.fixed_tokens if ask.fixed_tokens is not None else completion
    return Plan(Outcome.OK, 200, (), ask.prompt_tokens, size, "stop", ask.reasoning_tokens)


def body_of(request: MessagesRequest, completion: int = 4) -> dict[str, Any]:
    plan = plan_for(request, completion)
    return message_body(message_id="msg_1", model="c", plan=plan, request=request, seq=1)


def signed(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": sign_thinking(text)}


def tool_turn(*first: dict[str, Any]) -> list[dict[str, Any]]:
    """A user ask, an assistant turn (``first`` blocks, then a tool_use), its result."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    return [
        *HI,
        {"role": "assistant", "content": [*first, use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
    ]


@pytest.mark.parametrize(
    ("thinking", "max_tokens", "message"),
    [
        (
            {"type": "enabled", "budget_tokens": 1023},
            BIG,
            "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024",
        ),
        (
            {"type": "enabled", "budget_tokens": 1024},
            1024,
            "`max_tokens` must be greater than `thinking.budget_tokens`.",
        ),
        (
            {"type": "enabled", "budget_tokens": "2000"},
            BIG,
            "thinking.enabled.budget_tokens: Input should be a valid integer",
        ),
        (
            {"type": "enabled", "budget_tokens": True},
            BIG,
            "thinking.enabled.budget_tokens: Input should be a valid integer",
        ),
        ({"type": "enabled"}, BIG, "thinking.enabled.budget_tokens: Field required"),
        ({"type": "on"}, BIG, "thinking: Input tag 'on' found using 'type' does not match"),
        ({}, BIG, "thinking.type: Field required"),
        ("enabled", BIG, "thinking: Input should be a valid dictionary"),
        (
            {"type": "disabled", "budget_tokens": 2000},
            BIG,
            "thinking.disabled.budget_tokens: Extra inputs are not permitted",
        ),
        (
            {"type": "adaptive", "display": "full"},
            BIG,
            "thinking.adaptive.display: Input should be 'summarized' or 'omitted'",
        ),
    ],
)
def test_thinking_config_is_refused_in_anthropics_words(
    thinking: object, max_tokens: int, message: str
) -> None:
    with pytest.raises(BadRequestError) as refused:
        parse(thinking=thinking, max_tokens=max_tokens)
    assert refused.value.message.startswith(message)


def test_thinking_budget_is_at_least_1024_and_below_max_tokens() -> None:
    assert think(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=1025).thought
    with pytest.raises(BadRequestError, match=r"`thinking\.budget_tokens`") as refused:
        think(thinking={"type": "enabled", "budget_tokens": 4096}, max_tokens=4096)
    assert refused.value.param == "thinking.budget_tokens"
    with pytest.raises(BadRequestError, match="budget_tokens") as low:
        think(thinking={"type": "enabled", "budget_tokens": 0})
    assert low.value.param == "thinking.budget_tokens"


@pytest.mark.parametrize(
    ("thinking", "on"),
    [
        (None, False),
        ({"type": "disabled"}, False),
        ({"type": "between_tools"}, False),
        (THINK, True),
        ({"type": "enabled", "budget_tokens": 1500, "display": "summarized"}, True),
        ({"type": "adaptive"}, True),
        ({"type": "adaptive", "display": None}, True),
    ],
)
def test_thinking_types_of_the_sdk_are_accepted(thinking: object, on: bool) -> None:
    request = parse(max_tokens=BIG, thinking=thinking)
    assert (request.thought is not None) is on
    assert request.ask.reasoning_tokens == (request.thought.tokens if request.thought else 0)


def test_a_thinking_block_sent_back_unchanged_is_accepted_a_tampered_one_refused() -> None:
    first = body_of(think(tools=[WEATHER]))["content"][0]
    assert first["type"] == "thinking"
    assert signature_ok(first["thinking"], first["signature"])
    assert think(messages=tool_turn(first), tools=[WEATHER]).thought is not None
    tampered = {**first, "thinking": first["thinking"] + " Or not."}
    forged = {**first, "signature": base64.b64encode(b"x" * 32).decode()}
    for block in (tampered, forged, {**first, "signature": ""}):
        with pytest.raises(BadRequestError) as refused:
            think(messages=tool_turn(block), tools=[WEATHER])
        assert refused.value.message == (
            "messages.1.content.0: Invalid `signature` in `thinking` block"
        )
    with pytest.raises(BadRequestError, match="Invalid `signature`"):  # thinking off: checked too
        parse(messages=tool_turn(tampered), tools=[WEATHER])
    with pytest.raises(BadRequestError, match=r"messages\.1\.content\.0\.signature: Field"):
        think(messages=tool_turn({"type": "thinking", "thinking": "x"}), tools=[WEATHER])


def test_redacted_thinking_data_must_be_the_simulators() -> None:
    data = redact_thinking("I thought.")
    assert redacted_ok(data)
    assert think(messages=tool_turn({"type": "redacted_thinking", "data": data}), tools=[WEATHER])
    raw = base64.b64decode(data)
    changed = base64.b64encode(raw[:-1] + b"?").decode()
    for bad in (changed, "not base64!", base64.b64encode(b"EmwKAhgBEgy3").decode(), ""):
        assert not redacted_ok(bad)
        with pytest.raises(BadRequestError, match=r"messages\.1\.content\.0: Invalid `data`"):
            think(messages=tool_turn({"type": "redacted_thinking", "data": bad}), tools=[WEATHER])


@pytest.mark.parametrize(
    ("first", "found"),
    [
        ((), "tool_use"),
        (({"type": "text", "text": "Let me look."},), "text"),
    ],
)
def test_a_final_assistant_tool_turn_must_start_with_thinking(
    first: tuple[dict[str, Any], ...], found: str
) -> None:
    messages = tool_turn(*first)
    with pytest.raises(BadRequestError) as refused:
        think(messages=messages, tools=[WEATHER])
    assert refused.value.message.startswith(
        f"messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
        f"`{found}`. When `thinking` is enabled, a final `assistant` message must start with a "
        "thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks)."
    )
    adaptive = {"type": "adaptive"}
    with pytest.raises(BadRequestError, match="Expected `thinking`"):
        think(messages=messages, tools=[WEATHER], thinking=adaptive)
    assert parse(messages=messages, tools=[WEATHER]).thought is None  # thinking off: fine
    assert think(messages=tool_turn(signed("Hm."), *first), tools=[WEATHER]).thought
    earlier = [*messages, {"role": "assistant", "content": "Sunny."}, *HI]
    assert think(messages=earlier, tools=[WEATHER]).thought  # only the last assistant turn


def test_thinking_may_not_come_with_forced_tool_use() -> None:
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        with pytest.raises(BadRequestError, match="tool_choice forces tool use"):
            think(tools=[WEATHER], tool_choice=choice)
    assert think(tools=[WEATHER], tool_choice={"type": "auto"}).reply.calls


def test_the_answer_starts_with_signed_thinking_counted_as_output() -> None:
    request = think()
    thought = request.thought
    assert thought is not None
    assert thought.text == "Thinking about a prompt of 8 tokens. I will answer in words."
    assert thought.tokens == -(-len(thought.text) // 4)
    body = body_of(request, completion=4)
    Message.model_validate(body)
    thinking, text = body["content"]
    assert thinking == signed(thought.text)
    assert text["text"] == "the quick brown fox"
    assert body["usage"]["output_tokens"] == 4 + thought.tokens
    plain = message_body(
        message_id="m", model="c", plan=plan_for(parse(max_tokens=BIG)), request=parse(), seq=1
    )
    assert [b["type"] for b in plain["content"]] == ["text"]
    tools = body_of(think(tools=[WEATHER]))
    assert [b["type"] for b in tools["content"]] == ["thinking", "tool_use"]
    assert "I will call get_weather" in tools["content"][0]["thinking"]


def test_omitted_thinking_is_empty_and_still_signed() -> None:
    request = think(thinking={**THINK, "display": "omitted"})
    block = body_of(request)["content"][0]
    assert block == signed("")
    assert request.thought is not None
    assert body_of(request)["usage"]["output_tokens"] == 4 + request.thought.tokens


def test_the_redaction_trigger_answers_a_redacted_thinking_block() -> None:
    asked = [{"role": "user", "content": [{"type": "text", "text": REDACTED_THINKING_TRIGGER}]}]
    request = think(messages=asked)
    assert request.thought is not None
    assert request.thought.redacted
    block = body_of(request)["content"][0]
    assert block == {"type": "redacted_thinking", "data": redact_thinking(request.thought.text)}
    assert not parse(messages=asked).thought  # thinking off: no block at all


def test_thinking_cut_by_max_tokens_is_signed_as_cut() -> None:
    request = parse(max_tokens=3, thinking={"type": "adaptive"})
    plan = Plan(Outcome.OK, 200, (), request.ask.prompt_tokens, 0, "length", 3)
    body = message_body(message_id="m", model="c", plan=plan, request=request, seq=1)
    thinking = body["content"][0]
    assert request.thought is not None
    assert thinking == signed(request.thought.text[:12])
    assert body["stop_reason"] == "max_tokens"
    assert body["usage"]["output_tokens"] == 3


def events_of(request: MessagesRequest) -> list[tuple[str, dict[str, Any]]]:
    plan = plan_for(request)
    stream = message_stream(message_id="msg_1", model="c", plan=plan, request=request, seq=1)
    raw = b"".join([*stream.head, *stream.body, *stream.tail])
    return [(e.event, json.loads(e.data)) for e in EventStream().feed(raw)]


def test_a_stream_sends_the_thinking_block_first() -> None:
    request = think(tools=[WEATHER])
    events = events_of(request)
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    for name, data in events:
        if name != "ping":
            assert adapter.validate_python(data).type == name
    blocks = [(n, d) for n, d in events if n.startswith("content_block")]
    assert blocks[0] == (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
    )
    first = [d for n, d in blocks if d["index"] == 0]
    deltas = [d["delta"] for d in first if d["type"] == "content_block_delta"]
    kinds = [d["type"] for d in deltas]
    assert kinds[-1] == "signature_delta"
    assert set(kinds[:-1]) == {"thinking_delta"}
    assert len(kinds) > 2
    assert first[-1]["type"] == "content_block_stop"
    whole = body_of(request)["content"]
    assert "".join(d["thinking"] for d in deltas[:-1]) == whole[0]["thinking"]
    assert deltas[-1]["signature"] == whole[0]["signature"]
    order = [(d["type"], d["index"]) for _, d in blocks if d["type"] != "content_block_delta"]
    assert order == [
        ("content_block_start", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_stop", 1),
    ]
    starts = [d["content_block"]["type"] for n, d in blocks if n == "content_block_start"]
    assert starts == ["thinking", "tool_use"]


def test_a_stream_sends_redacted_thinking_whole_in_its_start() -> None:
    asked = [{"role": "user", "content": f"hi {REDACTED_THINKING_TRIGGER}"}]
    request = think(messages=asked)
    blocks = [d for n, d in events_of(request) if n.startswith("content_block")]
    assert blocks[0]["content_block"] == body_of(request)["content"][0]
    assert blocks[1] == {"type": "content_block_stop", "index": 0}


def test_count_tokens_checks_thinking() -> None:
    def count(**body: Any) -> dict[str, int]:
        return count_tokens_body(json.dumps({"model": "c", "messages": HI, **body}).encode())

    assert count(thinking=THINK) == count()
    with pytest.raises(BadRequestError, match="budget_tokens"):
        count(thinking={"type": "enabled", "budget_tokens": 5})
    with pytest.raises(BadRequestError, match="Invalid `signature`"):
        count(messages=tool_turn({"type": "thinking", "thinking": "x", "signature": "y"}))


# --- extended thinking through the official SDK ------------------------------------------

Factory = Callable[..., SimulatedProvider]


def dumps(message: Message) -> list[dict[str, Any]]:
    """``message``'s blocks as the SDK holds them, but for the ids (one per answer)."""
    return [b.model_dump(exclude={"parsed_output", "id"}) for b in message.content]


@pytest.fixture
def claude(make_provider: Factory) -> Iterator[anthropic.Anthropic]:
    provider = make_provider(default=ModelBehaviour(latency_s=0.0, completion_tokens=6))
    root = provider.base_url.removesuffix("/v1")
    with anthropic.Anthropic(base_url=root, api_key="sk-test", max_retries=0) as client:
        yield client


def test_the_sdk_accumulates_a_thinking_stream_into_the_message(
    claude: anthropic.Anthropic,
) -> None:
    ask: Any = [{"role": "user", "content": "Weather?"}]
    tools: Any = [WEATHER]
    for kwargs in ({}, {"tools": tools}):
        answer = claude.messages.create(
            model="c", max_tokens=BIG, thinking=THINK, messages=ask, **kwargs
        )
        with claude.messages.stream(
            model="c", max_tokens=BIG, thinking=THINK, messages=ask, **kwargs
        ) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_message()
        assert dumps(final) == dumps(answer)
        assert final.usage.output_tokens == answer.usage.output_tokens
        assert answer.content[0].type == "thinking"
        assert answer.content[0].thinking.startswith("Thinking about a prompt of ")
        assert "thinking" in kinds
        assert kinds.index("signature") < kinds.index("content_block_stop")
    plain = claude.messages.create(model="c", max_tokens=BIG, messages=ask)
    thinking = claude.messages.create(model="c", max_tokens=BIG, thinking=THINK, messages=ask)
    assert thinking.content[0].type == "thinking"
    assert thinking.usage.output_tokens == plain.usage.output_tokens + -(
        -len(thinking.content[0].thinking) // 4
    )


def test_the_sdk_sends_thinking_back_and_a_tampered_block_is_refused(
    claude: anthropic.Anthropic,
) -> None:
    ask: Any = [{"role": "user", "content": "Weather?"}]
    tools: Any = [WEATHER]
    first = claude.messages.create(
        model="c", max_tokens=BIG, thinking=THINK, messages=ask, tools=tools
    )
    thought, use = first.content
    assert thought.type == "thinking"
    assert use.type == "tool_use"
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id}]}
    turn: Any = [*ask, {"role": "assistant", "content": first.content}, result]
    after = claude.messages.create(
        model="c", max_tokens=BIG, thinking=THINK, messages=turn, tools=tools
    )
    assert after.stop_reason == "end_turn"
    assert [b.type for b in after.content] == ["thinking", "text"]
    tampered = {"type": "thinking", "thinking": "I changed this.", "signature": thought.signature}
    for blocks, words in (
        ([tampered, use.model_dump()], "Invalid `signature` in `thinking` block"),
        ([use.model_dump()], "Expected `thinking` or `redacted_thinking`"),
    ):
        changed: Any = [*ask, {"role": "assistant", "content": blocks}, result]
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(
                model="c", max_tokens=BIG, thinking=THINK, messages=changed, tools=tools
            )
        assert refused.value.status_code == 400
        assert words in refused.value.message
        assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match=r"thinking\.budget_tokens"):
        claude.messages.create(
            model="c",
            max_tokens=1024,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=ask,
        )


def test_the_sdk_reads_redacted_thinking_and_sends_it_back(claude: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": f"Weather? {REDACTED_THINKING_TRIGGER}"}]
    tools: Any = [WEATHER]
    answer = claude.messages.create(
        model="c", max_tokens=BIG, thinking={"type": "adaptive"}, messages=ask, tools=tools
    )
    with claude.messages.stream(
        model="c", max_tokens=BIG, thinking={"type": "adaptive"}, messages=ask, tools=tools
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in answer.content] == ["redacted_thinking", "tool_use"]
    assert dumps(final) == dumps(answer)
    use = answer.content[1]
    assert use.type == "tool_use"
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id}]}
    turn: Any = [*ask, {"role": "assistant", "content": answer.content}, result]
    after = claude.messages.create(
        model="c", max_tokens=BIG, thinking={"type": "adaptive"}, messages=turn, tools=tools
    )
    assert after.content[0].type == "redacted_thinking"  # the trigger is still in the turns
