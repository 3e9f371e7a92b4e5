"""OpenAI's chat wire for the simulator (provider/wire.py): what a body asks for, read
once, and the refusals it answers with 400."""

from __future__ import annotations

import json
from typing import Any

import pytest
from callboard.provider.behaviour import ModelBehaviour
from callboard.provider.engine import ProviderCore
from callboard.provider.reply import PLAIN, compose
from callboard.provider.sse import compact_bytes
from callboard.provider.wire import (
    REASONING_TOKENS,
    BadRequestError,
    completion_body,
    completion_bytes,
    parse_chat,
)

USER = [{"role": "user", "content": "hi"}]


def parse(**body: Any) -> Any:
    return parse_chat(json.dumps({"model": "m", "messages": USER, **body}).encode())


def test_a_plain_body_is_read_cheaply_as_plain() -> None:
    chat = parse(max_tokens=9, temperature=0.3)
    assert chat.ask.prompt_tokens == 1 + 4 + 3
    assert chat.ask.max_tokens == 9
    assert chat.reply == compose(PLAIN)
    assert (chat.stream, chat.include_usage, chat.logprobs, chat.service_tier) == (
        False,
        False,
        None,
        None,
    )


def test_every_option_is_carried() -> None:
    chat = parse(
        max_completion_tokens=40,
        max_tokens=10,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=2,
        service_tier="flex",
        reasoning_effort="medium",
        metadata={"a": "b"},
        top_k=5,  # a provider-specific field, as extra_body sends it: ignored
    )
    assert chat.ask.max_tokens == 40  # max_completion_tokens wins
    assert chat.ask.choices == 3
    assert chat.ask.reasoning_tokens == REASONING_TOKENS["medium"]
    assert chat.ask.stream
    assert chat.include_usage
    assert chat.logprobs == 2
    assert chat.service_tier == "flex"


def test_tools_and_formats_fix_the_answers_size() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = parse(tools=[tool])
    assert [c.name for c in chat.reply.calls] == ["f"]
    assert chat.ask.fixed_tokens == chat.reply.fixed_tokens == 2  # "{}" + 1
    plain = parse()
    assert chat.ask.prompt_tokens > plain.ask.prompt_tokens  # the tool's definition counts
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
            },
        },
    }
    assert parse(response_format=fmt).reply.text == '{"a":0}'


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{", None),
        (b"[]", None),
        (json.dumps({"messages": USER}).encode(), "model"),
        (json.dumps({"model": "m", "messages": []}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": USER, "top_p": 2}).encode(), "top_p"),
        (json.dumps({"model": "m", "messages": USER, "extra_body": {}}).encode(), "extra_body"),
        (
            json.dumps({"model": "m", "messages": [{"role": "robot", "content": "x"}]}).encode(),
            "messages[0].role",
        ),
        (
            json.dumps(
                {
                    "model": "m",
                    "messages": USER,
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": {"type": "function", "function": {"name": "g"}},
                }
            ).encode(),
            "tool_choice",
        ),
        (
            json.dumps({"model": "m", "messages": USER, "reasoning_effort": "huge"}).encode(),
            "reasoning_effort",
        ),
        (
            json.dumps({"model": "m", "messages": USER, "reasoning_effort": ["max"]}).encode(),
            "reasoning_effort",
        ),
    ],
)
def test_refusals_name_the_param(raw: bytes, param: str | None) -> None:
    with pytest.raises(BadRequestError) as refused:
        parse_chat(raw)
    assert refused.value.param == param


def test_every_reasoning_effort_callboard_takes_is_served() -> None:
    """``xhigh`` and ``max`` were a 500 (the server's ``KeyError``), retried, though
    callboard's requests take them (found by a hunt)."""
    from callboard.messages._body import _EFFORTS

    for effort in sorted(_EFFORTS):
        assert parse(reasoning_effort=effort).ask.reasoning_tokens == REASONING_TOKENS[effort]
    assert parse(reasoning_effort=None).ask.reasoning_tokens == 0


@pytest.mark.parametrize(
    "extra",
    [{}, {"stop": "fox", "max_tokens": 50}, {"max_tokens": 3}, {"reasoning_effort": "low"}],
    ids=["plain", "stopped", "length", "reasoning"],
)
def test_a_plain_answers_spliced_bytes_are_its_bodys_encoding(extra: dict[str, Any]) -> None:
    chat = parse(**extra)
    core = ProviderCore(default=ModelBehaviour(completion_tokens=20), models=None, seed=0)
    plan = core.plan(core.state("m"), chat.ask)
    args = {
        "completion_id": "chatcmpl-1",
        "model": "m\u00e9",
        "created": 7,
        "plan": plan,
        "chat": chat,
        "seq": 1,
    }
    assert completion_bytes(**args) == compact_bytes(completion_body(**args))
