"""The Chat Completions request body (messages/_body.py): every field the API reference
lists is checked and passed through unchanged, an unknown one refused by name unless in
``extra_body``."""

from __future__ import annotations

import copy
import typing
from typing import Any

import pytest
from callboard.messages import InvalidRequestError, check_body
from openai.types.chat import completion_create_params as params
from openai.types.shared import reasoning_effort

# A body using every field callboard passes through (API reference shapes).
FULL: dict[str, Any] = {
    "model": "gpt-4o",
    "messages": [
        {"role": "developer", "content": "Answer in JSON."},
        {
            "role": "user",
            "name": "ada",
            "content": [
                {"type": "text", "text": "What is in this image, and the weather?"},
                {
                    "type": "image_url",
                    "image_url": {"url": "https://x.test/a.png", "detail": "low"},
                },
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                {"type": "file", "file": {"file_id": "file-abc"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": True,
            },
        }
    ],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "parallel_tool_calls": False,
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
    },
    "stop": ["\n\n", "END"],
    "seed": 42,
    "temperature": 0.3,
    "top_p": 0.9,
    "frequency_penalty": 0.1,
    "presence_penalty": -0.1,
    "logit_bias": {"50256": -100},
    "logprobs": True,
    "top_logprobs": 3,
    "n": 2,
    "user": "user-1",
    "service_tier": "flex",
    "reasoning_effort": "low",
    "max_completion_tokens": 500,
    "stream": True,
    "stream_options": {"include_usage": True},
    "extra_body": {"provider_only": {"x": 1}},
}


def test_every_reasoning_effort_and_service_tier_the_sdk_types_is_allowed() -> None:
    """What the official SDK lets its user send, callboard passes on."""
    efforts = _literals(reasoning_effort.ReasoningEffort)
    tiers = _literals(typing.get_type_hints(params.CompletionCreateParamsBase)["service_tier"])
    assert "none" in efforts  # the SDK's lists were read
    assert "fast" in tiers
    for effort in efforts:
        check_body({**FULL, "reasoning_effort": effort})
    for tier in tiers:
        check_body({**FULL, "service_tier": tier})


def _literals(optional: Any) -> tuple[str, ...]:
    """The strings of an ``Optional[Literal[...]]``."""
    return typing.get_args(typing.get_args(optional)[0])


def test_a_body_with_every_field_passes_unchanged() -> None:
    body = copy.deepcopy(FULL)
    check_body(body)
    assert body == FULL


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("temperature",), 2.5, "temperature"),
        (("n",), 0, "n"),
        (("stop",), ["a", "b", "c", "d", "e"], "stop"),
        (("top_logprobs",), 21, "top_logprobs"),
        (("service_tier",), "cheap", "service_tier"),
        (("logit_bias",), {"x": 1}, "logit_bias"),
        (("logit_bias",), {"²": 1}, "logit_bias"),  # a digit to str.isdigit, not a token id
        (("logit_bias",), {"9" * 4000: 1}, "logit_bias"),
        (("logit_bias",), {"50256": 10**5000}, "logit_bias"),  # not an OverflowError
        (("logit_bias",), {10**5000: 1}, "logit_bias"),  # a key no str() writes
        (("logit_bias",), {str(t): 1 for t in range(301)}, "at most 300 token ids"),
        (("tool_choice",), "sometimes", "tool_choice"),
        (("response_format",), {"type": "yaml"}, "response_format.type"),
        (("messages", 1, "content", 1, "image_url", "detail"), "max", "messages[1].content[1]"),
        (("messages", 1, "content", 2, "input_audio", "format"), "ogg", "input_audio.format"),
        (("messages", 2, "tool_calls", 0, "function", "arguments"), {"city": "P"}, "arguments"),
        (("messages", 3, "tool_call_id"), "", "messages[3].tool_call_id"),
        (("messages", 0, "role"), "robot", "messages[0].role"),
        (("logprobs",), 1, "logprobs"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(
    path: tuple[Any, ...], value: Any, named: str
) -> None:
    refused_naming(path, value, named)


def refused_naming(path: tuple[Any, ...], value: Any, named: str) -> None:
    """``FULL`` with ``value`` at ``path`` is refused with a message naming ``named``."""
    body = copy.deepcopy(FULL)
    target: Any = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises(InvalidRequestError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_body(body)


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("messages", 0, "role"), {}, "messages[0].role"),
        (("messages", 0, "role"), ["user"], "messages[0].role"),
        (("messages", 1, "content", 0, "type"), ["text"], "messages[1].content[0].type"),
        (("service_tier",), [], "service_tier"),
        (("reasoning_effort",), {}, "reasoning_effort"),
        (("messages", 2, "tool_calls"), 5, "messages[2].tool_calls"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_naming_its_field_not_a_type_error(
    path: tuple[Any, ...], value: Any, named: str
) -> None:
    """Lists and objects where a name belongs were looked up in sets (unhashable), and a
    number where a list of tool calls belongs was iterated: ``TypeError``, a 500."""
    refused_naming(path, value, named)


def test_an_unknown_field_is_refused_unless_it_is_in_extra_body() -> None:
    with pytest.raises(InvalidRequestError, match=r"^top_k: .*extra_body"):
        check_body({**FULL, "top_k": 5})
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.tool_calls"):
        check_body({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})
    check_body({"messages": [{"role": "user", "content": "x"}], "extra_body": {"top_k": 5}})


@pytest.mark.parametrize(
    "owned", ["stream", "stream_options", "model", "messages", "input", "encoding_format"]
)
def test_extra_body_may_not_set_what_callboard_builds_the_call_with(owned: str) -> None:
    """``extra_body={"stream": True}`` made every answer unreadable, which opened the
    model's breaker: refused at submit, naming the key."""
    body = {"messages": [{"role": "user", "content": "x"}], "extra_body": {owned: True}}
    with pytest.raises(InvalidRequestError, match=rf"^extra_body\.{owned}: callboard sets it"):
        check_body(body)


@pytest.mark.parametrize("reserved", ["max_tokens", "max_completion_tokens", "n"])
def test_extra_body_may_not_set_what_a_calls_reservation_is_made_of(reserved: str) -> None:
    """``extra_body={"max_tokens": 2000}`` on a request reserving 16 spent 20x a budget."""
    body = {"messages": [{"role": "user", "content": "x"}], "extra_body": {reserved: 2000}}
    with pytest.raises(InvalidRequestError, match=rf"^extra_body\.{reserved}: give it as"):
        check_body(body)


def test_what_an_answers_message_carries_is_taken_back_and_a_legacy_call_refused() -> None:
    """The SDKs send an answer's message back as it came (OpenAI's guide appends it):
    ``annotations``, ``parsed`` and a null ``function_call`` (refused, the guide's
    second turn was a 400; found by a hunt)."""
    said = {"role": "assistant", "content": "Paris", "annotations": [], "function_call": None}
    check_body({"messages": [{"role": "user", "content": "x"}, {**said, "parsed": {"a": 1}}]})
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.function_call: the legacy"):
        check_body({"messages": [{**said, "function_call": {"name": "f", "arguments": "{}"}}]})
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.annotations"):
        check_body({"messages": [{**said, "annotations": "none"}]})
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.annotations: not a field"):
        check_body({"messages": [{"role": "user", "content": "x", "annotations": []}]})


def test_an_answers_thinking_goes_back_signed_and_its_text_is_taken_not_sent() -> None:
    """A Claude model's answer carries its thinking as ``reasoning_content`` (text) and
    ``thinking_blocks`` (signed): an SDK sends the message back as it came."""
    signed = {"type": "thinking", "thinking": "", "signature": "EqQB"}
    redacted = {"type": "redacted_thinking", "data": "EmwK"}
    said = {
        "role": "assistant",
        "content": "Paris",
        "reasoning_content": "the capital",
        "thinking_blocks": [signed, redacted],
    }
    check_body({"messages": [{"role": "user", "content": "x"}, said]})
    for block, field in (
        ({"type": "thinking", "thinking": "t"}, r"\[0\]\.signature: must be a non-empty"),
        ({"type": "thinking", "thinking": 3, "signature": "s"}, r"\[0\]\.thinking: must be a"),
        ({"type": "redacted_thinking"}, r"\[0\]\.data: must be a non-empty"),
        ({"type": "text", "text": "t"}, r"\[0\]\.type: must be one of"),
    ):
        with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.thinking_blocks" + field):
            check_body({"messages": [{**said, "thinking_blocks": [block]}]})
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.thinking_blocks: not a"):
        check_body({"messages": [{"role": "user", "content": "x", "thinking_blocks": []}]})


def test_a_message_needs_content_unless_it_is_an_assistants_tool_call() -> None:
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content: needed"):
        check_body({"messages": [{"role": "user"}]})
    with pytest.raises(InvalidRequestError, match="messages: at least one"):
        check_body({"messages": []})
