"""The simulator's prompt-size rule (provider/tokens.py) is callboard's estimate: the same
count for a Chat Completions request, and for the Messages body ``wire.anthropic`` makes
of it, by Anthropic's rules."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest
from callboard.core.tokens import MESSAGE_OVERHEAD, count_chat_tokens
from callboard.provider.tokens import chat_of, count_anthropic_tokens, count_prompt_tokens
from callboard.wire.anthropic import request_body


def png_url(width: int, height: int) -> str:
    head = (
        b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", width, height)
    )
    return "data:image/png;base64," + base64.b64encode(head + b"\x08\x02\0\0\0").decode()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Say hello to the world, please."}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": png_url(1200, 800)}},
                ],
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ],
        "tools": [WEATHER],
    },
]


@pytest.mark.parametrize("chat", CHATS, ids=["text", "image", "tools"])
def test_a_chat_counts_as_callboard_estimates_it(chat: dict[str, Any]) -> None:
    assert count_prompt_tokens(chat["messages"], tools=chat.get("tools")) == count_chat_tokens(
        chat["messages"], tools=chat.get("tools")
    )


@pytest.mark.parametrize("chat", CHATS, ids=["text", "image", "tools"])
def test_a_messages_body_counts_as_the_chat_it_came_from(chat: dict[str, Any]) -> None:
    body = request_body({"model": "c", "max_tokens": 10, **chat})
    estimate = count_chat_tokens(chat["messages"], tools=chat.get("tools"), dialect="anthropic")
    assert count_anthropic_tokens(body) == estimate


def test_merged_turns_count_a_little_lower_never_higher() -> None:
    messages = [
        {"role": "user", "content": "first part"},
        {"role": "user", "content": "second part"},
    ]
    body = request_body({"model": "c", "max_tokens": 10, "messages": messages})
    estimate = count_chat_tokens(messages, dialect="anthropic")
    # one merge: one message's framing less, and one rounding of a quarter
    assert estimate - MESSAGE_OVERHEAD - 1 <= count_anthropic_tokens(body) < estimate


def test_a_messages_body_reads_as_chat_messages() -> None:
    body = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "ok"}],
                    }
                ],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    messages, tools = chat_of(body)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}],
        },
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look."}],
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "ok"},
    ]
    assert tools == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": {"type": "object"}},
        }
    ]
