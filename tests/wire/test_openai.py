"""OpenAI's Chat Completions wire (wire/openai.py, sans-IO): every field the API
reference lists is checked and passed through unchanged, an unknown one refused by name
unless in ``extra_body``; a stream's chunks assemble into the answer the same call
gives unstreamed (checked with the official ``openai`` SDK's own types)."""

from __future__ import annotations

import copy
import json
from typing import Any

import openai.types.chat as oa
import pytest
from callboard.messages import InvalidRequestError
from callboard.wire.openai import ChunkAssembler, check_body

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
    body = copy.deepcopy(FULL)
    target: Any = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises(InvalidRequestError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_body(body)


def test_an_unknown_field_is_refused_unless_it_is_in_extra_body() -> None:
    with pytest.raises(InvalidRequestError, match=r"^top_k: .*extra_body"):
        check_body({**FULL, "top_k": 5})
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.tool_calls"):
        check_body({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})
    check_body({"messages": [{"role": "user", "content": "x"}], "extra_body": {"top_k": 5}})


def test_a_message_needs_content_unless_it_is_an_assistants_tool_call() -> None:
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content: needed"):
        check_body({"messages": [{"role": "user"}]})
    with pytest.raises(InvalidRequestError, match="messages: at least one"):
        check_body({"messages": []})


# -- streams --------------------------------------------------------------------------------

# A streamed answer with a tool call, logprobs and usage in its last chunk, and the same
# answer unstreamed (API reference shapes).
CHUNKS: list[dict[str, Any]] = [
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "Let me"},
                "logprobs": {
                    "content": [
                        {"token": "Let", "logprob": -0.1, "bytes": None, "top_logprobs": []}
                    ]
                },
                "finish_reason": None,
            }
        ],
    },
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "delta": {
                    "content": " check.",
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"ci'},
                        }
                    ],
                },
                "finish_reason": None,
            }
        ],
    },
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Paris"}'}}]},
                "finish_reason": "tool_calls",
            }
        ],
    },
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o",
        "choices": [],
        "usage": {"prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62},
    },
]


def test_a_streams_chunks_assemble_into_the_unstreamed_answer() -> None:
    assembler = ChunkAssembler()
    for chunk in CHUNKS:
        oa.ChatCompletionChunk.model_validate(chunk)  # the recording is the SDK's shape
        assembler.feed(chunk)
    answer = assembler.completion()
    oa.ChatCompletion.model_validate(answer)
    (choice,) = answer["choices"]
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["id"] == "call_9"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"
    assert choice["logprobs"]["content"][0]["token"] == "Let"  # noqa: S105 - a token of text
    assert answer["usage"]["total_tokens"] == 62
    assert answer["id"] == "chatcmpl-1"


def test_choices_of_n_assemble_apart() -> None:
    assembler = ChunkAssembler()
    for index, text in ((0, "a"), (1, "b"), (0, "c"), (1, "d")):
        assembler.feed({"id": "x", "choices": [{"index": index, "delta": {"content": text}}]})
    got = [c["message"]["content"] for c in assembler.completion()["choices"]]
    assert got == ["ac", "bd"]
