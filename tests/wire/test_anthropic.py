"""Anthropic's Messages API as a dialect (wire/anthropic.py, sans-IO), on bodies shaped
as Anthropic's and OpenAI's API references show them. Fidelity is checked with the
official SDKs' own types: every recorded Messages body parses as ``anthropic``'s
``Message`` (and events as its stream events), every answer we build as ``openai``'s
``ChatCompletion`` (and chunks as ``ChatCompletionChunk``)."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic.types as an
import openai.types.chat as oa
import pydantic
import pytest
from callboard.messages import InvalidRequestError
from callboard.wire.anthropic import (
    FINISH_REASONS,
    REFUSED,
    StreamAssembler,
    StreamError,
    completion,
    json_tool_of,
    message_usage,
    request_body,
    stop_reason_of,
    usage,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}},
            "required": ["location"],
        },
    },
}
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    body.update(fields)
    return body


# -- requests -------------------------------------------------------------------------------


def test_a_tool_conversation_becomes_alternating_turns_with_its_ids_kept() -> None:
    body = request_body(
        chat(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Weather here and there?"},
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                        {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"location":"SF"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"location":"NY"}'},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "15C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "20C"},
                {"role": "user", "content": "Thanks"},
            ],
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            stop="END",
            user="u-42",
            max_completion_tokens=300,
            max_tokens=None,
            temperature=0.2,
        )
    )
    assert body["system"] == [  # a message in parts keeps them: blocks are not glued
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Use tools."},
    ]
    assert body["max_tokens"] == 300
    assert body["stop_sequences"] == ["END"]
    assert body["metadata"] == {"user_id": "u-42"}
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert body["tools"] == [
        {
            "name": "get_weather",
            "description": "Get the current weather in a given location",
            "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
        }
    ]
    user, assistant, results = body["messages"]
    assert [t["role"] for t in body["messages"]] == ["user", "assistant", "user"]
    assert user["content"][1] == {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": PNG},
    }
    assert user["content"][2]["source"] == {"type": "url", "url": "https://example.com/a.jpg"}
    assert assistant["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"location": "SF"}},
        {"type": "tool_use", "id": "call_2", "name": "get_weather", "input": {"location": "NY"}},
    ]
    assert results["content"] == [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "15C"},
        {"type": "tool_result", "tool_use_id": "call_2", "content": "20C"},
        {"type": "text", "text": "Thanks"},
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 7),
        ("seed", 0),
        ("logprobs", True),
        ("logit_bias", {"50256": -100}),
        ("frequency_penalty", 0.5),
        ("n", 2),
        ("response_format", {"type": "json_object"}),
        ("functions", []),
        ("temperature", 1.3),
    ],
)
def test_what_the_messages_api_cannot_honour_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError, match=rf"^{field}: .*model api = 'anthropic'"):
        request_body(chat(**{field: value}))


@pytest.mark.parametrize(
    ("turn", "field"),
    [
        ({"role": "user", "content": "hi", "name": "alice"}, "messages[0].name"),
        ({"role": "assistant", "content": "", "audio": {"id": "a1"}}, "messages[0].audio"),
        ({"role": "assistant", "content": ""}, "messages[0]"),
        ({"role": "assistant", "content": None}, "messages[0]"),
    ],
)
def test_a_turn_the_messages_api_cannot_carry_is_refused_by_name_not_dropped(
    turn: dict[str, Any], field: str
) -> None:
    """A participant's name was dropped, and an empty assistant turn sent as
    ``content: []``, which Anthropic answers 400 to (every turn but the last needs
    content)."""
    messages = [turn, {"role": "user", "content": "go on"}]
    with pytest.raises(InvalidRequestError, match=rf"^{re.escape(field)}: "):
        request_body(chat(messages=messages))


def test_a_tool_call_id_anthropic_refuses_is_written_so_it_takes_it_on_both_sides() -> None:
    """An OpenAI-compatible server's ``functions.get_weather:0`` went as it was, and
    Anthropic refused the call (its ids match ``^[a-zA-Z0-9_-]+$``; found by a hunt).
    The same id is written the same way on the call and its result; two that differ
    only in refused characters stay two."""
    ids = ["functions.get_weather:0", "functions.get_weather/0", "toolu_01A-b_c"]
    calls = [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        for i in ids
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": i, "content": "sunny"} for i in ids),
    ]
    body = request_body(chat(messages=messages))
    used = [b["id"] for b in body["messages"][1]["content"]]
    answered = [b["tool_use_id"] for b in body["messages"][2]["content"]]
    assert used == answered
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]+", i) for i in used)
    assert len(set(used)) == 3
    assert used[2] == "toolu_01A-b_c", "an id Anthropic takes goes as it is"


def test_caching_marks_go_on_their_blocks() -> None:
    """``cache_control`` on a part, a system part, a tool result's part or a tool was
    dropped in silence: nothing was cached (found by a hunt)."""
    mark = {"type": "ephemeral"}
    messages = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "Be brief.", "cache_control": mark}],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:", "cache_control": mark},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            ],
        },
    ]
    tool = {**WEATHER, "cache_control": mark}
    body = request_body(chat(messages=messages, tools=[tool]))
    assert body["system"] == [{"type": "text", "text": "Be brief.", "cache_control": mark}]
    text, image = body["messages"][0]["content"]
    assert text["cache_control"] == mark
    assert "cache_control" not in image
    assert body["tools"][0]["cache_control"] == mark


def test_empty_text_is_left_out_and_a_turn_of_nothing_else_is_refused() -> None:
    """Anthropic refuses an empty text block: it was sent, and the call failed 400
    (found by a hunt)."""
    parts = [{"type": "text", "text": ""}, {"type": "text", "text": "hi"}]
    body = request_body(chat(messages=[{"role": "user", "content": parts}]))
    assert body["messages"][0]["content"] == [{"type": "text", "text": "hi"}]
    with pytest.raises(InvalidRequestError, match=r"^messages\[0\]\.content: .*no empty turn"):
        request_body(chat(messages=[{"role": "user", "content": ""}]))


@pytest.mark.parametrize("stop", ["\n", ["\n\n"], ["END", " "], ""])
def test_a_stop_sequence_of_white_space_alone_is_refused_by_name(stop: Any) -> None:
    """OpenAI takes ``"\\n"``, Anthropic refuses a sequence without a visible character:
    it was sent, and the call failed 400 (found by a hunt)."""
    with pytest.raises(InvalidRequestError, match=r"^stop: "):
        request_body(chat(stop=stop))
    assert request_body(chat(stop=["END", "\n###"]))["stop_sequences"] == ["END", "\n###"]


@pytest.mark.parametrize("arguments", ["[1]", "5", '"text"', "null", "{"])
def test_a_tool_calls_arguments_that_are_no_json_object_are_refused_by_name(
    arguments: str,
) -> None:
    """``[1]`` or ``5`` went as the tool use's ``input``, for Anthropic's own 400
    (found by a hunt)."""
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    with pytest.raises(InvalidRequestError, match="arguments must be a JSON object"):
        request_body(chat(messages=messages))


def test_an_assistant_turn_that_only_refused_carries_its_refusal_as_its_text() -> None:
    """A structured output's refusal turn (content "", refusal "...") was sent as an
    empty turn, its words dropped."""
    said = "I can't help with that."
    messages = [
        {"role": "user", "content": "do it"},
        {"role": "assistant", "content": "", "refusal": said},
        {"role": "user", "content": "then this"},
    ]
    turns = request_body(chat(messages=messages))["messages"]
    assert turns[1] == {"role": "assistant", "content": [{"type": "text", "text": said}]}


def test_an_empty_last_assistant_turn_asks_for_nothing_and_is_left_out() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    assert request_body(chat(messages=messages))["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    ]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "be brief"}],
        [{"role": "developer", "content": "be brief"}, {"role": "assistant", "content": ""}],
    ],
)
def test_a_chat_of_no_user_or_assistant_turn_is_refused_not_sent_empty(
    messages: list[dict[str, str]],
) -> None:
    """A chat of system turns alone went out as ``"messages": []``, which Anthropic
    answers 400 (found by a hunt)."""
    with pytest.raises(InvalidRequestError, match=r"^messages: .*no chat without a user turn"):
        request_body(chat(messages=messages))


def test_system_and_tool_texts_in_parts_stay_blocks_and_plain_system_texts_join() -> None:
    """Blocks were glued with nothing between them ("You are terse.Answer in French.")."""
    plain = request_body(
        chat(
            messages=[
                {"role": "system", "content": "You are terse."},
                {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "hi"},
            ]
        )
    )
    assert plain["system"] == "You are terse.\n\nAnswer in French."
    parts = [{"type": "text", "text": "Sunny."}, {"type": "text", "text": "20C."}]
    body = request_body(
        chat(
            messages=[
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "t1",
                            "type": "function",
                            "function": {"name": "w", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "t1", "content": parts},
            ]
        )
    )
    (result,) = body["messages"][-1]["content"]
    assert result["content"] == parts


def test_max_tokens_is_required_and_extra_body_is_merged() -> None:
    with pytest.raises(InvalidRequestError, match=r"^max_tokens"):
        request_body(chat(max_tokens=None))
    body = request_body(chat(extra_body={"top_k": 5, "thinking": {"type": "disabled"}}))
    assert body["top_k"] == 5
    assert body["thinking"] == {"type": "disabled"}


def test_the_user_and_a_metadata_in_extra_body_are_one_metadata() -> None:
    """``user`` is Anthropic's ``metadata.user_id``; a ``metadata`` sent beside it was
    merged over it and the end user's id lost (found by a hunt)."""
    body = request_body(chat(user="u-42", extra_body={"metadata": {"team": "a"}}))
    assert body["metadata"] == {"user_id": "u-42", "team": "a"}
    alone = request_body(chat(extra_body={"metadata": {"user_id": "u-7"}}))
    assert alone["metadata"] == {"user_id": "u-7"}


# -- answers --------------------------------------------------------------------------------

# A Messages answer with text and a tool call, and cache usage (API reference shape).
TOOL_ANSWER: dict[str, Any] = {
    "id": "msg_01Aq9w938a90dw8q",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5",
    "content": [
        {"type": "text", "text": "I'll check the weather."},
        {
            "type": "tool_use",
            "id": "toolu_01A09q90qw90lq917835lq9",
            "name": "get_weather",
            "input": {"location": "San Francisco, CA"},
        },
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 472,
        "output_tokens": 91,
        "cache_creation_input_tokens": 10,
        "cache_read_input_tokens": 2000,
    },
}


def test_a_tool_use_answer_is_a_chat_completion_with_tool_calls_and_cache_usage() -> None:
    an.Message.model_validate(TOOL_ANSWER)  # the recording is a real Messages answer
    got = completion(TOOL_ANSWER)
    oa.ChatCompletion.model_validate({**got, "created": 0})
    (choice,) = got["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I'll check the weather."
    (call,) = choice["message"]["tool_calls"]
    assert call["id"] == "toolu_01A09q90qw90lq917835lq9"
    assert json.loads(call["function"]["arguments"]) == {"location": "San Francisco, CA"}
    assert got["usage"] == {
        "prompt_tokens": 2482,
        "completion_tokens": 91,
        "total_tokens": 2573,
        "prompt_tokens_details": {"cached_tokens": 2000, "cache_write_tokens": 10},
    }


def test_the_tier_anthropic_says_served_a_call_is_where_openai_says_it() -> None:
    message = {**TOOL_ANSWER, "usage": {**TOOL_ANSWER["usage"], "service_tier": "priority"}}
    an.Message.model_validate(message)
    got = completion(message)
    oa.ChatCompletion.model_validate({**got, "created": 0})
    assert got["service_tier"] == "priority"  # what prices a call at its tier
    assert "service_tier" not in completion(TOOL_ANSWER)  # unsaid: not made up


@pytest.mark.parametrize(
    ("stop_reason", "finish"),
    [("end_turn", "stop"), ("max_tokens", "length"), ("refusal", "content_filter")],
)
def test_stop_reasons_map_to_finish_reasons(stop_reason: str, finish: str) -> None:
    answer = {**TOOL_ANSWER, "content": [{"type": "text", "text": "x"}], "stop_reason": stop_reason}
    got = completion(answer)
    assert got["choices"][0]["finish_reason"] == finish
    assert ("refusal" in got["choices"][0]["message"]) == (stop_reason == "refusal")
    assert got["choices"][0]["message"]["content"] == "x"
    if stop_reason == "refusal":  # the text said before the stop is not said twice
        assert got["choices"][0]["message"]["refusal"] == REFUSED


def test_a_json_schema_is_asked_through_a_forced_tool_and_answered_as_text() -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "person",
            "schema": {"type": "object", "properties": {"name": {"type": "string"}}},
        },
    }
    body = request_body(chat(response_format=fmt))
    assert body["tool_choice"] == {"type": "tool", "name": "person"}
    assert body["tools"][-1]["input_schema"] == fmt["json_schema"]["schema"]  # type: ignore[index]
    answer = {
        **TOOL_ANSWER,
        "content": [{"type": "tool_use", "id": "t", "name": "person", "input": {"name": "Ada"}}],
    }
    got = completion(answer, json_tool=json_tool_of(chat(response_format=fmt)))
    (choice,) = got["choices"]
    assert json.loads(choice["message"]["content"]) == {"name": "Ada"}
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]


def test_strict_goes_with_the_tool_and_with_the_schemas_tool() -> None:
    """Anthropic's strict tool use (``strict: true`` on the tool) as OpenAI's: it was
    dropped, so a caller who asked for inputs that match the schema got unchecked ones
    ("2" for 2, a required field missing; found by a hunt)."""
    strict = {"type": "function", "function": {"name": "w", "parameters": {}, "strict": True}}
    loose = {"type": "function", "function": {"name": "x", "parameters": {}}}
    body = request_body(chat(tools=[strict, loose]))
    assert [t.get("strict") for t in body["tools"]] == [True, None]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "strict": True}}
    assert request_body(chat(response_format=fmt))["tools"][-1]["strict"] is True
    assert "strict" not in request_body(chat(response_format=PERSON))["tools"][-1]


PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": {"type": "object"}}}
CALLERS_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {}}}


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "sent"),
    [
        (None, None, {"type": "any"}),
        ("auto", False, {"type": "any", "disable_parallel_tool_use": True}),
        ("none", None, {"type": "tool", "name": "person"}),
        (
            {"type": "function", "function": {"name": "weather"}},
            None,
            {"type": "tool", "name": "weather"},
        ),
    ],
)
def test_a_json_schema_beside_the_callers_tools_keeps_the_callers_tool_choice(
    tool_choice: Any, parallel: bool | None, sent: dict[str, Any]
) -> None:
    """OpenAI lets the model call a tool or answer in the schema; a named choice forces
    that tool, not the schema's."""
    asked = {"response_format": PERSON, "tools": [CALLERS_TOOL], "tool_choice": tool_choice}
    if parallel is not None:
        asked["parallel_tool_calls"] = parallel
    body = request_body(chat(**asked))
    assert body["tool_choice"] == sent
    assert [t["name"] for t in body["tools"]] == ["weather", "person"]


def test_a_json_schema_with_tool_choice_required_is_refused_by_name() -> None:
    asked = {"response_format": PERSON, "tools": [CALLERS_TOOL], "tool_choice": "required"}
    with pytest.raises(InvalidRequestError, match=r"^tool_choice: 'required' with a json_schema"):
        request_body(chat(**asked))


# -- streams --------------------------------------------------------------------------------

# The event sequence of a streamed tool-use answer (Messages streaming guide shape).
EVENTS: list[dict[str, Any]] = [
    {
        "type": "message_start",
        "message": {
            "id": "msg_014p7gG3wDgGV9EUtLvnow3U",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 472, "output_tokens": 2},
        },
    },
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "ping"},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Okay,"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " let me"}},
    {"type": "content_block_stop", "index": 0},
    {
        "type": "content_block_start",
        "index": 1,
        "content_block": {
            "type": "tool_use",
            "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6",
            "name": "get_weather",
            "input": {},
        },
    },
    {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": '{"location": "San Fra'},
    },
    {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": 'ncisco, CA"}'},
    },
    {"type": "content_block_stop", "index": 1},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"output_tokens": 89},
    },
    {"type": "message_stop"},
]


def test_a_streamed_tool_use_answer_becomes_chunks_and_the_same_completion() -> None:
    for event in EVENTS:  # the recording is a real Messages stream (ping is kept apart)
        if event["type"] != "ping":
            pydantic.TypeAdapter(an.RawMessageStreamEvent).validate_python(event)
    assembler = StreamAssembler()
    chunks = [chunk for event in EVENTS for chunk in assembler.feed(event)]
    for chunk in chunks:
        oa.ChatCompletionChunk.model_validate({**chunk, "created": 0})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "Okay, let me"
    fragments = [
        call["function"]["arguments"]
        for c in chunks
        for call in c["choices"][0]["delta"].get("tool_calls", ())
    ]
    assert json.loads("".join(fragments)) == {"location": "San Francisco, CA"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == 89
    assert assembler.done
    whole = assembler.completion()
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    assert call["id"] == "toolu_01T1x1fJ34qAmk2tNTrN7Up6"
    assert whole["choices"][0]["message"]["content"] == "Okay, let me"
    assert whole["usage"]["completion_tokens"] == 89


def test_an_error_event_mid_stream_is_a_typed_error() -> None:
    assembler = StreamAssembler()
    list(assembler.feed(EVENTS[0]))
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    with pytest.raises(StreamError, match="overloaded_error: Overloaded") as raised:
        list(assembler.feed(overloaded))
    assert raised.value.kind == "overloaded_error"


def test_a_streamed_tool_calls_arguments_are_the_text_its_chunks_carried() -> None:
    """``Result.tool_calls[].arguments`` is the raw text; for a stream that is what the
    ``input_json_delta`` fragments joined say (here with a space after the colon), so a
    reader joining the chunks' fragments has the same text as the answer."""
    fragments, call = _streamed_call(EVENTS)
    assert fragments == '{"location": "San Francisco, CA"}'
    assert call["function"]["arguments"] == fragments


def _streamed_call(events: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The arguments a stream's chunks carry for its one tool call, and the call as the
    assembled answer has it."""
    assembler = StreamAssembler()
    chunks = [chunk for event in events for chunk in assembler.feed(event)]
    fragments = "".join(
        call["function"]["arguments"]
        for c in chunks
        for call in c["choices"][0]["delta"].get("tool_calls", ())
    )
    (call,) = assembler.completion()["choices"][0]["message"]["tool_calls"]
    return fragments, call


def test_a_streamed_tool_call_with_no_input_fragment_says_empty_arguments_to_the_reader() -> None:
    """Its fragments added up to "" while the answer said ``{}``."""
    start = {"type": "tool_use", "id": "toolu_B", "name": "now", "input": {}}
    events = [
        EVENTS[0],
        {"type": "content_block_start", "index": 0, "content_block": start},
        {"type": "content_block_stop", "index": 0},
        *EVENTS[-3:],
    ]
    fragments, call = _streamed_call(events)
    assert fragments == call["function"]["arguments"] == "{}"


# -- the way back (the gateway answering an Anthropic client) -------------------------------


@pytest.mark.parametrize("stop_reason", ["end_turn", "max_tokens", "tool_use", "refusal"])
def test_a_stop_reason_survives_the_round_trip_through_a_finish_reason(stop_reason: str) -> None:
    assert stop_reason_of(FINISH_REASONS[stop_reason]) == stop_reason


def test_a_finish_that_says_less_is_an_end_turn() -> None:
    assert stop_reason_of(FINISH_REASONS["stop_sequence"]) == "end_turn"  # "stop" says no more
    assert stop_reason_of(None) == "end_turn"


def test_usage_read_back_keeps_the_caches_reads_and_writes_apart() -> None:
    chat = usage(TOOL_ANSWER["usage"])
    details = chat["prompt_tokens_details"]
    back = message_usage(
        chat["prompt_tokens"],
        chat["completion_tokens"],
        details["cached_tokens"],
        details["cache_write_tokens"],
    )
    an.Usage.model_validate(back)
    assert back == TOOL_ANSWER["usage"]


def _started(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


MESSAGE_START = {  # the recorded stream's start, with a cache read in its usage
    **EVENTS[0],
    "message": {
        **EVENTS[0]["message"],
        "usage": {
            "input_tokens": 1200,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 800,
            "output_tokens": 1,
        },
    },
}


def test_a_null_count_in_message_delta_keeps_what_message_start_said() -> None:
    """``MessageDeltaUsage`` counts are cumulative and may be null (the SDK's accumulator
    keeps the earlier value then): a null must not wipe out the prompt's tokens."""
    final = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {
            "input_tokens": None,
            "cache_creation_input_tokens": None,
            "cache_read_input_tokens": None,
            "output_tokens": 25,
        },
    }
    events = [MESSAGE_START, _started(0, {"type": "text", "text": ""}), final]
    for event in events:
        pydantic.TypeAdapter(an.RawMessageStreamEvent).validate_python(event)
    assembler = StreamAssembler()
    chunks = [chunk for event in events for chunk in assembler.feed(event)]
    assert chunks[-1]["usage"]["prompt_tokens"] == 1200 + 800
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 800
    assert assembler.completion()["usage"]["completion_tokens"] == 25


def test_a_server_tools_input_is_never_the_answers_text() -> None:
    """A web search's query arrives as ``input_json_delta`` on a ``server_tool_use``
    block: the provider's business, not text the reader sees, so the streamed text and
    the assembled answer say the same."""
    search = {"type": "server_tool_use", "id": "srvtoolu_01", "name": "web_search", "input": {}}
    found = {
        "type": "web_search_tool_result",
        "tool_use_id": "srvtoolu_01",
        "content": [{"type": "web_search_result", "title": "W", "url": "https://x"}],
    }
    events = [
        MESSAGE_START,
        _started(0, {"type": "text", "text": ""}),
        _delta(0, {"type": "text_delta", "text": "Let me search. "}),
        _started(1, search),
        _delta(1, {"type": "input_json_delta", "partial_json": '{"query": "weather'}),
        _delta(1, {"type": "input_json_delta", "partial_json": ' NYC"}'}),
        _started(2, found),
        _started(3, {"type": "text", "text": ""}),
        _delta(3, {"type": "text_delta", "text": "It is sunny."}),
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 1},
        },
    ]
    assembler = StreamAssembler()
    chunks = [chunk for event in events for chunk in assembler.feed(event)]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "Let me search. It is sunny."
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    message = assembler.completion()["choices"][0]["message"]
    assert message["content"] == text
    assert "tool_calls" not in message


def test_a_paused_turn_is_not_a_finished_one() -> None:
    """``pause_turn``: the API paused a long turn and the caller must send it back to go
    on. No OpenAI reason says that, so it stays itself (a ``stop`` would read as done),
    and it survives the way back to an Anthropic client."""
    answer = {**TOOL_ANSWER, "content": [{"type": "text", "text": "x"}]}
    answer["stop_reason"] = "pause_turn"
    assert completion(answer)["choices"][0]["finish_reason"] == "pause_turn"
    assert stop_reason_of("pause_turn") == "pause_turn"
    future = {**answer, "stop_reason": "a_reason_added_later"}
    assert completion(future)["choices"][0]["finish_reason"] == "a_reason_added_later"


# -- extended thinking ----------------------------------------------------------------------

SIGNED = {"type": "thinking", "thinking": "Let me look up the weather.", "signature": "EqQBCgIYAh"}
REDACTED = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT"}
THOUGHT_EVENTS: list[dict[str, Any]] = [
    {
        "type": "message_start",
        "message": {
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "claude-sonnet-4-5",
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 40, "output_tokens": 1},
        },
    },
    {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "thinking", "thinking": "", "signature": ""},
    },
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "thinking_delta", "thinking": "Let me look up "},
    },
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "thinking_delta", "thinking": "the weather."},
    },
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "signature_delta", "signature": "EqQBCgIYAh"},
    },
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": REDACTED},
    {"type": "content_block_stop", "index": 1},
    {"type": "content_block_start", "index": 2, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": "Sunny."}},
    {"type": "content_block_stop", "index": 2},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 30},
    },
    {"type": "message_stop"},
]


def test_an_answers_thinking_is_its_reasoning_and_its_signed_blocks() -> None:
    message = {
        "id": "msg_01",
        "model": "claude-sonnet-4-5",
        "content": [SIGNED, REDACTED, {"type": "text", "text": "Sunny."}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 40, "output_tokens": 30},
    }
    an.Message.model_validate({**message, "type": "message", "role": "assistant"})
    answer = completion(message)["choices"][0]["message"]
    assert answer["content"] == "Sunny."
    assert answer["reasoning_content"] == "Let me look up the weather."
    assert answer["thinking_blocks"] == [SIGNED, REDACTED]


def test_a_streamed_thinking_reaches_the_reader_as_reasoning_then_whole_and_signed() -> None:
    for event in THOUGHT_EVENTS:
        pydantic.TypeAdapter(an.RawMessageStreamEvent).validate_python(event)
    assembler = StreamAssembler()
    deltas = [c["choices"][0]["delta"] for e in THOUGHT_EVENTS for c in assembler.feed(e)]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert reasoning == ["Let me look up ", "the weather."]
    signed = [b for d in deltas for b in d.get("thinking_blocks", ())]
    assert signed == [SIGNED, REDACTED]  # each as its block ends, before the text
    first_text = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("thinking_blocks" not in d for d in deltas[first_text:])
    assert assembler.thinking
    whole = assembler.completion()["choices"][0]["message"]
    assert whole["thinking_blocks"] == [SIGNED, REDACTED]
    assert whole["reasoning_content"] == "Let me look up the weather."
    assert whole["content"] == "Sunny."


def test_a_turns_thinking_goes_back_first_and_signed_as_it_came() -> None:
    call = {
        "id": "toolu_01",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
    }
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call],
            "thinking_blocks": [SIGNED, REDACTED],
        },
        {"role": "tool", "tool_call_id": "toolu_01", "content": "18C, sunny"},
    ]
    body = request_body(chat(messages=turns, extra_body={"thinking": {"type": "adaptive"}}))
    assistant = body["messages"][1]["content"]
    assert [b["type"] for b in assistant] == ["thinking", "redacted_thinking", "tool_use"]
    assert assistant[:2] == [SIGNED, REDACTED]
    assert body["thinking"] == {"type": "adaptive"}
