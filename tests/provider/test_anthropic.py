"""Anthropic's Messages wire for the simulator (provider/anthropic.py): the headers and
bodies it accepts and refuses in Anthropic's words, and its rate-limit headers."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest
from callboard.provider.anthropic import (
    check_headers,
    error_body,
    parse_messages,
    ratelimit_headers,
    stop_reason,
)
from callboard.provider.engine import Finish, Outcome, Plan
from callboard.provider.limits import Window
from callboard.provider.reply import Call, Reply
from callboard.provider.wire import BadRequestError

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
