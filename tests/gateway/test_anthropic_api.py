"""Anthropic's Messages API as the gateway reads and answers it (gateway/anthropic_api.py,
pure), on bodies shaped as Anthropic's API reference and guides show them. Fidelity is
checked both ways: a body read into chat fields and written back by the outbound
dialect (``wire.anthropic.request_body``) is the body sent; every answer and event we
build parses with the ``anthropic`` SDK's own types, and a stream's events assemble
into the answer the plain body gives."""

from __future__ import annotations

import json
from typing import Any

import anthropic.types as an
import pydantic
import pytest
from anthropic.types.shared import ErrorResponse
from callboard.core.answer import read_answer
from callboard.gateway.anthropic_api import (
    MessageEvents,
    error_event,
    message_body,
    message_id,
    messages_call,
    models_page,
    provider_stop,
)
from callboard.gateway.errors import ApiError, error_for_exception
from callboard.messages import (
    Completed,
    InvalidRequestError,
    MalformedOutputError,
    Priority,
    Request,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
    check_body,
)
from callboard.wire.anthropic import REFUSED, StreamAssembler, completion, request_body

PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "Get the current weather in a given location",
    "input_schema": {
        "type": "object",
        "properties": {
            "location": {
                "type": "string",
                "description": "The city and state, e.g. San Francisco, CA",
            }
        },
        "required": ["location"],
    },
}
# A tool-use conversation with an image, as the tool-use and vision guides build one.
CONVERSATION: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 1024,
    "system": "You are a weather assistant.",
    "tools": [WEATHER],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    "stop_sequences": ["\n\nHuman:"],
    "temperature": 0.5,
    "top_p": 0.9,
    "metadata": {"user_id": "13803d75-b4b5-4c3e-b2a2-6f21399b021b"},
    "messages": [
        {
            "role": "user",
            "content": [
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                },
                {"type": "image", "source": {"type": "url", "url": "https://example.com/sky.jpg"}},
                {"type": "text", "text": "What is the weather like in San Francisco?"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "I'll check the weather."},
                {
                    "type": "tool_use",
                    "id": "toolu_01A09q90qw90lq917835lq9",
                    "name": "get_weather",
                    "input": {"location": "San Francisco, CA"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                    "content": "15 degrees",
                }
            ],
        },
    ],
}
HELLO: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 1024,
    "messages": [{"role": "user", "content": "Hello, world"}],
}
IDS: dict[str, Any] = {"task_id": 7, "trace_id": "t.7", "model": "fast"}


def chat_of(body: dict[str, Any]) -> dict[str, Any]:
    """The Chat Completions body ``body`` is submitted as."""
    call = messages_call(body)
    return {"model": call.name, "messages": call.messages, **call.fields}


# -- requests -----------------------------------------------------------------------------


def test_a_tool_conversation_with_images_reads_into_chat_and_writes_back_unchanged() -> None:
    chat = chat_of(CONVERSATION)
    check_body(chat)  # callboard's request takes it as it is
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    user = chat["messages"][1]["content"]
    assert user[0] == {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
    assert user[1] == {"type": "image_url", "image_url": {"url": "https://example.com/sky.jpg"}}
    (call,) = chat["messages"][2]["tool_calls"]
    assert call["id"] == chat["messages"][3]["tool_call_id"] == "toolu_01A09q90qw90lq917835lq9"
    assert json.loads(call["function"]["arguments"]) == {"location": "San Francisco, CA"}
    assert chat["tool_choice"] == "auto"
    assert chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["\n\nHuman:"]
    assert chat["user"] == CONVERSATION["metadata"]["user_id"]
    assert request_body(chat) == CONVERSATION  # the outbound dialect gives the body back


def test_a_plain_body_and_system_blocks_read_as_chat_messages() -> None:
    blocks = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": " Be kind."}]
    call = messages_call({**HELLO, "system": blocks, "stream": True, "priority": "high"})
    assert call.name == "claude-sonnet-4-5"
    assert call.messages == [
        {"role": "system", "content": blocks},
        {"role": "user", "content": "Hello, world"},
    ]
    assert call.fields == {"max_tokens": 1024}
    assert call.stream
    assert call.priority is Priority.HIGH


def test_an_assistants_and_a_tool_results_texts_stay_apart() -> None:
    """Their blocks were glued with nothing between them ("Checking.One moment.")."""
    texts = [{"type": "text", "text": "Checking."}, {"type": "text", "text": "One moment."}]
    use = {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": texts}
    call = messages_call(
        {
            **HELLO,
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [*texts, use]},
                {"role": "user", "content": [result]},
            ],
        }
    )
    assistant, tool = call.messages[1], call.messages[2]
    assert assistant["content"] == texts
    assert (tool["role"], tool["content"]) == ("tool", texts)


def test_a_user_turn_keeps_its_order_around_tool_results() -> None:
    turn = {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "t1",
                "content": [{"type": "text", "text": "1"}],
            },
            {"type": "tool_result", "tool_use_id": "t2", "content": "2"},
            {"type": "text", "text": "Now sum them."},
        ],
    }
    chat = chat_of({**HELLO, "messages": [turn]})
    assert chat["messages"] == [
        {"role": "tool", "tool_call_id": "t1", "content": "1"},
        {"role": "tool", "tool_call_id": "t2", "content": "2"},
        {"role": "user", "content": [{"type": "text", "text": "Now sum them."}]},
    ]


@pytest.mark.parametrize(
    ("choice", "fields"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        (
            {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            {
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "parallel_tool_calls": False,
            },
        ),
    ],
)
def test_each_tool_choice_has_its_chat_equivalent(
    choice: dict[str, Any], fields: dict[str, Any]
) -> None:
    chat = chat_of({**HELLO, "tools": [WEATHER], "tool_choice": choice})
    assert {k: chat[k] for k in fields} == fields
    assert request_body(chat)["tool_choice"] == choice  # and back


def test_what_maps_elsewhere_is_carried() -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    chat = chat_of(
        {
            **HELLO,
            "top_k": 5,
            "thinking": {"type": "disabled"},
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        }
    )
    check_body(chat)
    assert chat["extra_body"] == {"top_k": 5}  # for the provider to judge
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    assert "thinking" not in chat


def _user_turn(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {**HELLO, "messages": [{"role": "user", "content": list(blocks)}]}


def _first_block(**more: Any) -> dict[str, Any]:
    return {
        **HELLO,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x", **more}]}],
    }


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**HELLO, "thinking": {"type": "on"}}, "thinking.type"),
        ({**HELLO, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({**HELLO, "thinking": {"type": "adaptive", "budget": 9}}, "thinking.budget"),
        (_first_block(cache_control={"type": "ephemeral"}), "messages[0].content[0].cache_control"),
        (
            {
                **HELLO,
                "messages": [
                    {"role": "user", "content": [{"type": "document", "source": {"type": "text"}}]}
                ],
            },
            "messages[0].content[0].type",
        ),
        (
            {
                **HELLO,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": "boom",
                                "is_error": True,
                            }
                        ],
                    }
                ],
            },
            "messages[0].content[0].is_error",
        ),
        (
            {**HELLO, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools[0].type",
        ),
        (
            {**HELLO, "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}]},
            "tools[0].cache_control",
        ),
        (
            {
                **HELLO,
                "system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
            },
            "system[0].cache_control",
        ),
        ({**HELLO, "service_tier": "auto"}, "service_tier"),
        ({**HELLO, "stream": {}}, "stream"),
        ({**HELLO, "frequency_penalty": 1}, "frequency_penalty"),
        ({**HELLO, "temperature": 1.5}, "temperature"),
        ({**HELLO, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({**HELLO, "metadata": {"user_id": 17}}, "metadata.user_id"),
        ({**HELLO, "metadata": {"user_id": "u", "team": "x"}}, "metadata.team"),
        ({**HELLO, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": []}, "max_tokens"),
        ({**HELLO, "tools": [{"name": "f", "input_schema": []}]}, "tools[0].input_schema"),
        ({**HELLO, "tools": [{"name": [], "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({**HELLO, "tools": [{"name": "f", "input_schema": {}}]}, "tools[0].input_schema.type"),
        (
            {**HELLO, "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
            "tools[0].input_schema.type",
        ),
        ({**HELLO, "tools": [{**WEATHER, "description": 5}]}, "tools[0].description"),
        ({**HELLO, "tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict"),
        (
            _user_turn({"type": "tool_result", "tool_use_id": 5, "content": "x"}),
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                **HELLO,
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "", "name": "f"}]}
                ],
            },
            "messages[0].content[0].id",
        ),
        (
            {
                **HELLO,
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}
                ],
            },
            "messages[0].content[0].name",
        ),
    ],
)
def test_what_cannot_be_carried_is_refused_naming_the_field(
    body: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        messages_call(body)
    assert str(refused.value).startswith(f"{field}:")
    assert error_for_exception(refused.value, retry_after_s=1).param == field


@pytest.mark.parametrize("field", ["model", "max_tokens", "messages"])
def test_a_required_field_given_null_is_refused_as_anthropics_api_refuses_it(field: str) -> None:
    """The OpenAI door reads a null cap as none given; this one took that reading too,
    and a null ``max_tokens`` went out with the gateway's default (a review)."""
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidRequestError, match=f"^{field}: Field required"):
        messages_call({**body, field: None})


# -- answers ------------------------------------------------------------------------------


def completed(**fields: Any) -> Completed:
    usage = Usage(prompt_tokens=2482, completion_tokens=91, cached_tokens=2000)
    return Completed(**{**IDS, "usage": usage, "content": "", **fields})


WEATHER_CALL = ToolCall(
    id="toolu_01A09q90qw90lq917835lq9", name="get_weather", arguments='{"location":"SF"}'
)


def test_an_answer_with_a_tool_call_is_a_message_the_sdk_reads() -> None:
    result = completed(
        content="I'll check the weather.", tool_calls=(WEATHER_CALL,), finish_reason="tool_calls"
    )
    message = an.Message.model_validate(message_body(result, model="quick"))
    assert message.id == message_id(7)
    assert message.model == "fast"  # the model that served it
    assert message.stop_reason == "tool_use"
    text, use = message.content
    assert text.type == "text"
    assert text.text == "I'll check the weather."
    assert use.type == "tool_use"
    assert (use.id, use.name, use.input) == (WEATHER_CALL.id, "get_weather", {"location": "SF"})
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (482, 2000)
    assert message.usage.output_tokens == 91


@pytest.mark.parametrize(
    ("finish", "stop_reason"),
    [
        ("stop", "end_turn"),
        (None, "end_turn"),
        ("length", "max_tokens"),
        ("content_filter", "refusal"),
    ],
)
def test_finish_reasons_are_stop_reasons(finish: str | None, stop_reason: str) -> None:
    body = message_body(completed(content="x", finish_reason=finish), model="fast")
    assert body["stop_reason"] == stop_reason


def test_a_refusal_is_the_messages_text() -> None:
    body = message_body(
        completed(refusal="I can't help with that.", finish_reason="content_filter"), model="m"
    )
    assert body["content"] == [{"type": "text", "text": "I can't help with that."}]


def test_tool_arguments_that_are_not_a_json_object_are_a_typed_failure() -> None:
    bad = ToolCall(id="c", name="f", arguments="[1, 2]")
    with pytest.raises(MalformedOutputError, match="'f'"):
        message_body(completed(tool_calls=(bad,)), model="m")


def test_a_tool_call_cut_at_max_tokens_is_a_max_tokens_message_not_an_error() -> None:
    """A 502 after the provider was paid, where the same answer streamed said max_tokens."""
    cut = ToolCall(id="c", name="f", arguments='{"city": "Os')
    body = message_body(completed(tool_calls=(cut,), finish_reason="length"), model="m")
    assert body["stop_reason"] == "max_tokens"
    assert body["content"][-1] == {"type": "tool_use", "id": "c", "name": "f", "input": {}}
    an.Message.model_validate(body)


STREAMED = (
    StreamDelta(text="Okay,"),
    StreamDelta(text=" let me"),
    StreamDelta(tool_calls=(ToolCallDelta(index=0, id=WEATHER_CALL.id, name="get_weather"),)),
    StreamDelta(tool_calls=(ToolCallDelta(index=0, arguments='{"location":'),)),
    StreamDelta(tool_calls=(ToolCallDelta(index=0, arguments=' "SF"}'),)),
    StreamDelta(
        tool_calls=(ToolCallDelta(index=1, id="toolu_2", name="get_time", arguments="{}"),)
    ),
    StreamDelta(finish_reason="tool_calls"),
)


def events_of(
    deltas: tuple[StreamDelta, ...], result: Completed
) -> list[tuple[str, dict[str, Any]]]:
    events = MessageEvents(message_id=message_id(result.task_id), model="fast")
    return [e for d in deltas for e in events.delta(d)] + events.end(
        result.usage, result.finish_reason
    )


def test_a_streams_deltas_are_anthropics_event_sequence_the_sdk_reads() -> None:
    result = completed(finish_reason="tool_calls")
    events = events_of(STREAMED, result)
    for name, data in events:
        assert data["type"] == name
        pydantic.TypeAdapter(an.RawMessageStreamEvent).validate_python(data)
    assert [n for n, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [d["index"] for n, d in events if n == "content_block_start"] == [0, 1, 2]


def test_a_streams_events_assemble_into_the_plain_answer() -> None:
    result = completed(
        content="Okay, let me",
        tool_calls=(WEATHER_CALL, ToolCall(id="toolu_2", name="get_time", arguments="{}")),
        finish_reason="tool_calls",
    )
    assembler = StreamAssembler()
    for _, data in events_of(STREAMED, result):
        list(assembler.feed(data))
    assert assembler.done
    streamed = assembler.completion()
    plain = completion(message_body(result, model="fast"))
    for answer in (streamed, plain):
        (choice,) = answer["choices"]
        assert choice["message"]["content"] == "Okay, let me"
        assert choice["finish_reason"] == "tool_calls"
        calls = [
            (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]
        ]
        assert calls == [
            (WEATHER_CALL.id, "get_weather", {"location": "SF"}),
            ("toolu_2", "get_time", {}),
        ]
    assert streamed["usage"] == plain["usage"]


def test_interleaved_tool_calls_are_whole_blocks_each_with_its_id_name_and_input() -> None:
    """OpenAI's chunks may interleave tool calls by ``index`` (and say text after them);
    Anthropic's blocks cannot interleave, so no block is opened for a fragment."""
    interleaved = (
        StreamDelta(text="Checking."),
        StreamDelta(tool_calls=(ToolCallDelta(index=0, id="call_A", name="weather"),)),
        StreamDelta(tool_calls=(ToolCallDelta(index=1, id="call_B", name="time"),)),
        StreamDelta(tool_calls=(ToolCallDelta(index=0, arguments='{"city":'),)),
        StreamDelta(tool_calls=(ToolCallDelta(index=1, arguments='{"tz":'),)),
        StreamDelta(tool_calls=(ToolCallDelta(index=0, arguments=' "Paris"}'),)),
        StreamDelta(text=" Done."),
        StreamDelta(tool_calls=(ToolCallDelta(index=1, arguments=' "UTC"}'),)),
        StreamDelta(finish_reason="tool_calls"),
    )
    events = events_of(interleaved, completed(finish_reason="tool_calls"))
    for _, data in events:
        pydantic.TypeAdapter(an.RawMessageStreamEvent).validate_python(data)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["type"], b.get("id"), b.get("name")) for b in starts] == [
        ("text", None, None),
        ("tool_use", "call_A", "weather"),
        ("tool_use", "call_B", "time"),
        ("text", None, None),
    ]
    assembler = StreamAssembler()
    for _, data in events:
        list(assembler.feed(data))
    (choice,) = assembler.completion()["choices"]
    assert choice["message"]["content"] == "Checking. Done."
    calls = [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"]["tool_calls"]
    ]
    assert calls == [("call_A", "weather", {"city": "Paris"}), ("call_B", "time", {"tz": "UTC"})]


def test_what_follows_the_first_tool_call_is_written_in_the_order_it_began() -> None:
    deltas = (
        StreamDelta(text="First:"),
        StreamDelta(tool_calls=(ToolCallDelta(index=0, id="c0", name="f", arguments="{}"),)),
        StreamDelta(text="Now the second:"),
        StreamDelta(tool_calls=(ToolCallDelta(index=1, id="c1", name="g", arguments="{}"),)),
        StreamDelta(text=" done."),
        StreamDelta(finish_reason="tool_calls"),
    )
    events = events_of(deltas, completed(finish_reason="tool_calls"))
    assembler = StreamAssembler()
    for _, data in events:
        pydantic.TypeAdapter(an.RawMessageStreamEvent).validate_python(data)
        list(assembler.feed(data))
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    said = [b.get("id") or "text" for b in starts]
    assert said == ["text", "c0", "text", "c1", "text"]
    texts = [
        d["delta"]["text"] for n, d in events if n == "content_block_delta" and "text" in d["delta"]
    ]
    assert texts == ["First:", "Now the second:", " done."]


def _message(text: str, stop_reason: str, stop_sequence: str | None = None) -> dict[str, Any]:
    """An Anthropic ``message`` of ``text`` that ended so."""
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude",
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": 5, "output_tokens": 2},
    }


def test_the_stop_sequence_that_ended_an_answer_is_said_streamed_or_not() -> None:
    """Anthropic names it (``stop_reason: stop_sequence``); a stream said ``end_turn``."""
    said = _message("one two", "stop_sequence", "three")
    raw = completion(said)
    result = completed(content="one two", finish_reason="stop", raw=raw)
    body = message_body(result, model="m")
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "three")
    events = MessageEvents(message_id="msg_1", model="m")
    ended = dict(events.end(result.usage, "stop", provider_stop(result)))
    assert ended["message_delta"]["delta"] == {
        "stop_reason": "stop_sequence",
        "stop_sequence": "three",
    }
    plain = completed(content="one two", finish_reason="stop")
    assert message_body(plain, model="m")["stop_reason"] == "end_turn"


@pytest.mark.parametrize("how", ["as received", "assembled from a stream"])
def test_a_context_window_full_is_said_as_the_provider_said_it(how: str) -> None:
    """Anthropic's ``model_context_window_exceeded`` is OpenAI's ``length``, and the way
    back said ``max_tokens``: the client was told its own limit cut the answer (found by
    a hunt). The provider's own stop reason is kept, plain and streamed."""
    said = _message("cut", "model_context_window_exceeded")
    raw = said if how == "as received" else completion(said)
    result = completed(content="cut", finish_reason="length", raw=raw)
    assert message_body(result, model="m")["stop_reason"] == "model_context_window_exceeded"
    events = MessageEvents(message_id="msg_1", model="m")
    ended = dict(events.end(result.usage, "length", provider_stop(result)))
    assert ended["message_delta"]["delta"]["stop_reason"] == "model_context_window_exceeded"
    own = completed(content="cut", finish_reason="length")  # an OpenAI provider's
    assert message_body(own, model="m")["stop_reason"] == "max_tokens"


def test_an_anthropic_refusal_carries_no_text_the_model_did_not_write() -> None:
    """callboard's note of a refusal (``stop_reason: refusal``, no content) went to the
    client as the model's text block (found by a hunt); an OpenAI model's own refusal
    words are its text."""
    noted = completed(content=None, finish_reason="content_filter", refusal=REFUSED)
    body = message_body(noted, model="m")
    assert (body["content"], body["stop_reason"]) == ([], "refusal")
    said = completed(content=None, finish_reason="stop", refusal="I can't help with that.")
    assert message_body(said, model="m")["content"] == [
        {"type": "text", "text": "I can't help with that."}
    ]


def test_an_empty_stream_is_still_a_whole_message() -> None:
    events = MessageEvents(message_id="msg_1", model="fast").end(Usage(), "stop")
    assert [n for n, _ in events] == ["message_start", "message_delta", "message_stop"]
    assert events[1][1]["delta"]["stop_reason"] == "end_turn"


def test_a_stream_cut_ends_with_anthropics_error_event() -> None:
    error = ApiError(status=502, message="the stream was cut", code="stream_cut")
    name, data = error_event(error.anthropic_body())
    assert name == "error"
    parsed = ErrorResponse.model_validate(data)
    assert (parsed.error.type, parsed.error.message) == ("api_error", "the stream was cut")


@pytest.mark.parametrize("limit", ["0", "1001", "abc", "\u00b2", "\u0661", "9" * 5000, "-1", " 5"])
def test_a_models_page_limit_that_is_no_small_whole_number_is_refused_naming_it(
    limit: str,
) -> None:
    """A superscript two, an Arabic-Indic one and 5,000 nines are "digits" to
    ``str.isdigit``: ``int()`` refused the first, read the second as 1, and refused
    the last with a 500 (found by a hunt)."""
    with pytest.raises(InvalidRequestError, match=r"^limit: a whole number from 1 to 1000"):
        models_page(["a", "b"], {"limit": limit})


def test_a_models_page_of_a_whole_limit_is_that_many() -> None:
    page = models_page(["a", "b", "c"], {"limit": "0002"})
    assert [m["id"] for m in page["data"]] == ["a", "b"]
    assert page["has_more"] is True


# -- extended thinking ----------------------------------------------------------------------

SIGNED = {"type": "thinking", "thinking": "Paris is the capital.", "signature": "EqQBCgIYAh"}
REDACTED = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}


def test_thinking_asked_goes_to_the_provider_and_a_turns_signed_thinking_goes_back() -> None:
    asked = {"type": "enabled", "budget_tokens": 2048}
    unsigned = {"type": "thinking", "thinking": "a thought no API signed", "signature": ""}
    assistant = {
        "role": "assistant",
        "content": [SIGNED, REDACTED, unsigned, {"type": "text", "text": "Paris."}],
    }
    turns = [HELLO["messages"][0], assistant, {"role": "user", "content": "And Spain?"}]
    chat = chat_of({**HELLO, "top_k": 5, "thinking": asked, "messages": turns})
    assert chat["extra_body"] == {"top_k": 5}
    assert chat["thinking"] == asked  # a Claude model's alone (not extra_body: every model's)
    check_body(chat)
    said = chat["messages"][1]
    assert said["thinking_blocks"] == [SIGNED, REDACTED]  # the unsigned one cannot go back
    assert said["content"] == "Paris."
    body = request_body(chat)  # and to a Claude model, as the client sent them
    assert body["messages"][1]["content"] == [SIGNED, REDACTED, {"type": "text", "text": "Paris."}]
    assert body["thinking"] == asked
    assert "thinking" not in chat_of({**HELLO, "thinking": {"type": "disabled"}})
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[0\]\.type"):
        messages_call({**HELLO, "messages": [{"role": "user", "content": [SIGNED]}]})


def thought(**fields: Any) -> Completed:
    """An answer with a Claude model's thinking, as callboard's wire gives it."""
    answer = completion(
        {
            "id": "msg_1",
            "model": "claude",
            "content": [SIGNED, REDACTED, {"type": "text", "text": "Paris."}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 5, "output_tokens": 9},
        }
    )
    read = read_answer(answer, Request.of("hi"))  # as the model actor reads it
    return completed(content="Paris.", finish_reason="stop", raw=answer, **read, **fields)


THOUGHT_STREAMED = (
    StreamDelta(reasoning="Paris is "),
    StreamDelta(reasoning="the capital."),
    StreamDelta(thinking_blocks=(SIGNED,)),
    StreamDelta(thinking_blocks=(REDACTED,)),
    StreamDelta(text="Paris."),
    StreamDelta(finish_reason="stop"),
)


def test_an_answers_thinking_is_first_in_its_message_signed_streamed_or_not() -> None:
    result = thought()
    message = an.Message.model_validate(message_body(result, model="fast"))
    assert [b.type for b in message.content] == ["thinking", "redacted_thinking", "text"]
    assert message.content[0].model_dump() == SIGNED
    events = events_of(THOUGHT_STREAMED, result)
    for _, data in events:
        pydantic.TypeAdapter(an.RawMessageStreamEvent).validate_python(data)
    kinds = [
        (d["delta"]["type"] if n == "content_block_delta" else n)
        for n, d in events
        if n.startswith("content_block")
    ]
    assert kinds == [
        "content_block_start",
        "thinking_delta",
        "thinking_delta",
        "signature_delta",
        "content_block_stop",
        "content_block_start",  # the redacted block, whole
        "content_block_stop",
        "content_block_start",
        "text_delta",
        "content_block_stop",
    ]
    assembler = StreamAssembler()
    for _, data in events:
        list(assembler.feed(data))
    streamed = assembler.completion()["choices"][0]["message"]
    plain = completion(message_body(result, model="fast"))["choices"][0]["message"]
    assert streamed["thinking_blocks"] == plain["thinking_blocks"] == [SIGNED, REDACTED]
    assert streamed["content"] == plain["content"] == "Paris."


def test_reasoning_without_a_signature_is_a_thinking_block_in_its_place() -> None:
    """A model that reasons unsigned (DeepSeek's ``reasoning_content``) through this
    door: its reasoning is a thinking block with no signature, where it came."""
    message = message_body(completed(content="4", finish_reason="stop", reasoning="2+2"), model="m")
    assert message["content"][0] == {"type": "thinking", "thinking": "2+2", "signature": ""}
    deltas = (StreamDelta(reasoning="2+2"), StreamDelta(text="4"), StreamDelta(reasoning="!"))
    events = events_of(deltas, completed(content="4", finish_reason="stop"))
    said = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert said == ["thinking_delta", "text_delta", "thinking_delta"]


def test_an_interleaved_thinking_streams_every_block_in_its_order() -> None:
    """Thinking between a Claude model's tool calls (interleaved thinking): what came
    after the first call was dropped from the stream, so a client that sent the
    streamed answer back had lost a redacted block (found by a hunt)."""
    omitted = {"type": "thinking", "thinking": "", "signature": "EqQC"}
    deltas = (
        StreamDelta(reasoning="Paris first."),
        StreamDelta(thinking_blocks=(SIGNED,)),
        StreamDelta(tool_calls=(ToolCallDelta(index=0, id="t1", name="get_weather"),)),
        StreamDelta(tool_calls=(ToolCallDelta(index=0, arguments='{"city":"Paris"}'),)),
        StreamDelta(thinking_blocks=(REDACTED,)),
        StreamDelta(thinking_blocks=(omitted,)),
        StreamDelta(tool_calls=(ToolCallDelta(index=1, id="t2", name="get_weather"),)),
        StreamDelta(tool_calls=(ToolCallDelta(index=1, arguments='{"city":"Rome"}'),)),
        StreamDelta(finish_reason="tool_calls"),
    )
    events = events_of(deltas, completed(finish_reason="tool_calls"))
    for _, data in events:
        pydantic.TypeAdapter(an.RawMessageStreamEvent).validate_python(data)
    blocks: dict[int, dict[str, Any]] = {}
    for name, data in events:  # as a client accumulates them
        if name == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"])
        elif name == "content_block_delta" and data["delta"]["type"] == "signature_delta":
            blocks[data["index"]]["signature"] = data["delta"]["signature"]
    said = [
        (b["type"], b.get("signature") or b.get("data") or b.get("name"))
        for _, b in sorted(blocks.items())
    ]
    assert said == [
        ("thinking", SIGNED["signature"]),
        ("tool_use", "get_weather"),
        ("redacted_thinking", REDACTED["data"]),
        ("thinking", "EqQC"),
        ("tool_use", "get_weather"),
    ]
