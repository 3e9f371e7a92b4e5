"""The JSON forms of requests and results (runtime/codec.py): they round-trip, text
that is not one of them is a ``CodecError`` naming what is wrong, and the request
digest changes exactly when what is asked changes."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import sys

import pytest
from callboard.messages import (
    Billed,
    Choice,
    Completed,
    Failed,
    FailureReason,
    Priority,
    Request,
    ToolCall,
    Usage,
)
from callboard.runtime.codec import (
    CodecError,
    request_digest,
    request_from_json,
    request_to_json,
    result_from_json,
    result_to_json,
)


def test_requests_and_results_round_trip() -> None:
    request = Request.of("hi", model="m", max_tokens=5, temperature=0.5, metadata={"a": 1})
    assert request_from_json(request_to_json(request)) == request
    narrowed = Request.of("hi", model="m", models_allowed={"m", "n"})  # a gateway key's
    assert request_from_json(request_to_json(narrowed)) == narrowed
    failed = Failed(task_id=3, trace_id="t", reason=FailureReason.TIMEOUT, detail="slow")
    assert result_from_json(result_to_json(failed)) == failed
    estimate = Usage(prompt_tokens=9, completion_tokens=16, estimated=True)
    moved = dataclasses.replace(
        failed, billed_before=(Billed(model="a", usage=estimate, cost_nusd=700),)
    )
    assert result_from_json(result_to_json(moved)) == moved
    assert "billed_before" not in result_to_json(failed)  # as stored before there was one


WEATHER = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}


FUNCTION = {"name": "weather", "arguments": "{}"}


def test_a_request_with_the_whole_wire_and_a_rich_answer_round_trip() -> None:
    request = Request.of(
        [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        tools=[WEATHER],
        seed=7,
        extra_body={"top_k": 3},
        extra_headers={"anthropic-beta": "context-1m-2025-08-07"},
    )
    assert request_from_json(request_to_json(request)) == request
    embed = Request(messages=(), input=("a", "b"), options={"dimensions": 8}, max_tokens=1)
    assert request_from_json(request_to_json(embed)) == embed
    answer = Completed(
        task_id=1,
        trace_id="t",
        content="",
        finish_reason="tool_calls",
        tool_calls=(ToolCall(id="c2", name="weather", arguments='{"city":"Oslo"}'),),
        choices=(Choice(index=0, content="a"), Choice(index=1, content="b")),
        parsed={"x": 1},
        ttft_s=0.01,
    )
    assert result_from_json(result_to_json(answer)) == answer


def test_the_digest_changes_with_an_option_and_not_for_a_plain_request() -> None:
    assert request_digest(Request.of("hi", seed=1)) != request_digest(Request.of("hi", seed=2))
    assert request_digest(Request.of("hi", seed=1)) != request_digest(Request.of("hi"))


@pytest.mark.parametrize(
    "text",
    ["{bad", "5", "[]", '{"type": "Completed"}', '{"type": "Nope", "usage": {}}', ""],
)
def test_text_that_is_not_a_result_is_a_codec_error(text: str) -> None:
    with pytest.raises(CodecError, match="not a result's JSON form"):
        result_from_json(text)


@pytest.mark.parametrize("text", ["{bad", "null", '{"messages": []}', '{"priority": "NORMAL"}'])
def test_text_that_is_not_a_request_is_a_codec_error(text: str) -> None:
    with pytest.raises(CodecError, match="not a request's JSON form"):
        request_from_json(text)


def test_a_completed_result_with_a_field_of_the_wrong_type_is_a_codec_error() -> None:
    text = result_to_json(Completed(task_id=1, trace_id="t", content="x")).replace(
        '"usage":{', '"usage":{"bogus":1,'
    )
    with pytest.raises(CodecError):
        result_from_json(text)


BASE = Request.of("what is 2+2?", model="m", max_tokens=8, temperature=0.0)


@pytest.mark.parametrize(
    "change",
    [
        {"messages": Request.of("what is 2+3?").messages},
        {"model": "other"},
        {"max_tokens": 9},
        {"temperature": 0.7},
        {"extra_headers": {"anthropic-beta": "output-128k-2025-02-19"}},
    ],
    ids=["prompt", "model", "max_tokens", "temperature", "headers"],
)
def test_the_digest_changes_with_what_is_asked(change: dict[str, object]) -> None:
    assert request_digest(dataclasses.replace(BASE, **change)) != request_digest(BASE)


def test_the_digest_ignores_when_and_how_urgently_it_is_asked() -> None:
    same = dataclasses.replace(
        BASE, priority=Priority.HIGH, deadline_s=5.0, idempotency_key="k", budget_tag="team"
    )
    assert request_digest(same) == request_digest(BASE)
    assert len(request_digest(BASE)) == 64  # sha256, hex


def test_the_digest_of_a_prompt_with_a_lone_surrogate_is_defined() -> None:
    odd = Request.of("half a pair: \ud800")
    assert request_digest(odd) != request_digest(Request.of("half a pair: "))


def test_a_results_reasoning_and_thinking_are_stored_only_when_it_has_them() -> None:
    """A row without them reads in the callboard before them (written always, a
    rollback read every row as damage and called its task again; found by a hunt)."""
    plain = Completed(task_id=1, trace_id="t", content="hi")
    assert not {"reasoning", "thinking_blocks"} & set(json.loads(result_to_json(plain)))
    signed = {"type": "thinking", "thinking": "hm", "signature": "EqQB"}
    thought = dataclasses.replace(plain, reasoning="hm", thinking_blocks=(signed,))
    assert result_from_json(result_to_json(thought)) == thought


def test_a_results_refused_calls_are_stored_only_when_it_has_some() -> None:
    """``refused`` is newer than the ledgers' first rows: a row without it reads in the
    callboard before it (a rollback does not take every row for damage)."""
    failed = Failed(task_id=1, trace_id="t", reason=FailureReason.RATE_LIMITED, attempts=2)
    assert "refused" not in json.loads(result_to_json(failed))
    refused = dataclasses.replace(failed, refused=2)
    assert json.loads(result_to_json(refused))["refused"] == 2
    assert result_from_json(result_to_json(refused)) == refused


def test_a_number_past_a_doubles_range_is_written_as_json_the_ledger_reads() -> None:
    """A provider's ``-1e400`` (a logprob) is read as an infinity; written as
    ``-Infinity``, no other JSON reader took it, SQLite's ``json_valid`` neither, and a
    ledger holding the result was "damaged" at the next run (found by a hunt). It is
    written as the largest double of its sign."""
    logprobs = {"content": [{"token": "a", "logprob": float("-inf"), "top_logprobs": []}]}
    result = Completed(task_id=1, trace_id="t", content="a", logprobs=logprobs)
    text = result_to_json(result)
    assert "Infinity" not in text
    json.loads(text, parse_constant=_refused)  # JSON as RFC 8259 has it
    (valid,) = sqlite3.connect(":memory:").execute("SELECT json_valid(?)", (text,)).fetchone()
    assert valid == 1
    back = result_from_json(text)
    assert isinstance(back, Completed)
    assert back.logprobs is not None
    assert back.logprobs["content"][0]["logprob"] == -sys.float_info.max


def _refused(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")
