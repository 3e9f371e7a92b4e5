"""What an answer holds (core/answer.py, pure): the first choice's tool calls, refusal
and logprobs, every choice for n > 1, and the JSON asked for (a strict schema that is
not met is a MALFORMED_OUTPUT failure, a loose one just has nothing parsed)."""

from __future__ import annotations

from typing import Any

import pytest
from callboard.core.answer import _read_choices, read_answer
from callboard.messages import Choice, FailureReason, MalformedOutputError, Request, ToolCall
from hypothesis import given, settings
from hypothesis import strategies as st

SCHEMA = {"name": "person", "schema": {"type": "object"}}


def answer(*messages: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    choices = [
        {"index": i, "message": {"role": "assistant", **m}, "finish_reason": finish}
        for i, m in enumerate(messages)
    ]
    return {"object": "chat.completion", "choices": choices}


def test_tool_calls_keep_their_raw_arguments_and_parse_on_demand() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    fields = read_answer(answer({"content": None, "tool_calls": [call]}), Request.of("x"))
    (got,) = fields["tool_calls"]
    assert got == ToolCall(id="c1", name="f", arguments='{"a": 1}')
    assert got.parsed_arguments() == {"a": 1}
    bad = ToolCall(id="c2", name="f", arguments="{not json")
    with pytest.raises(MalformedOutputError, match="'c2' to 'f'"):
        bad.parsed_arguments()


def test_a_json_format_is_parsed_and_a_strict_schema_not_met_is_a_typed_failure() -> None:
    loose = Request.of("x", response_format={"type": "json_object"})
    assert read_answer(answer({"content": '{"a": [1]}'}), loose) == {"parsed": {"a": [1]}}
    assert read_answer(answer({"content": "not json"}), loose) == {}
    strict = Request.of(
        "x", response_format={"type": "json_schema", "json_schema": {**SCHEMA, "strict": True}}
    )
    failed = read_answer(answer({"content": "not json"}), strict)
    assert failed["reason"] is FailureReason.MALFORMED_OUTPUT
    assert "not JSON" in failed["detail"]
    assert "cut" not in failed["detail"]


@pytest.mark.parametrize("finish", ["length", "content_filter"])
def test_a_strict_answer_cut_short_is_the_answer_with_nothing_parsed(finish: str) -> None:
    """As OpenAI's API answers it: the completion, its ``finish_reason`` saying it was cut
    (the SDKs raise ``LengthFinishReasonError`` / ``ContentFilterFinishReasonError`` from
    it). A ``MALFORMED_OUTPUT`` failure lost the paid answer, and the gateway made it a
    502 (found by a hunt)."""
    strict = Request.of(
        "x", response_format={"type": "json_schema", "json_schema": {**SCHEMA, "strict": True}}
    )
    fields = read_answer(answer({"content": '{"a": [1, 2'}, finish=finish), strict)
    assert "reason" not in fields
    assert "parsed" not in fields


def test_a_refusal_is_an_answer_with_nothing_parsed() -> None:
    strict = Request.of(
        "x", response_format={"type": "json_schema", "json_schema": {**SCHEMA, "strict": True}}
    )
    fields = read_answer(answer({"content": None, "refusal": "I can't help"}), strict)
    assert fields == {"refusal": "I can't help"}


def test_every_choice_of_n_is_kept_in_order() -> None:
    fields = read_answer(answer({"content": "a"}, {"content": "b"}), Request.of("x", n=2))
    assert fields["choices"] == (
        Choice(index=0, content="a", finish_reason="stop"),
        Choice(index=1, content="b", finish_reason="stop"),
    )


def test_an_answer_with_odd_shapes_never_raises() -> None:
    odd: dict[str, Any] = {"choices": [None, {"message": "x"}, {"message": {"tool_calls": 3}}]}
    fields = read_answer(odd, Request.of("x"))
    assert len(fields["choices"]) == 3
    assert read_answer({"choices": []}, Request.of("x")) == {}
    assert read_answer(None, Request.of("x")) == {}


_ODD = st.sampled_from([None, "", "x", '{"a": 1}', 3, [], {}, [None], {"k": "v"}])
_CALLS = st.sampled_from(
    [None, [], (), "x", [{"function": {"name": "f", "arguments": "{}"}}], [{"function": 3}]]
)
_MESSAGES = st.fixed_dictionaries(
    {},
    optional={"content": _ODD, "tool_calls": _CALLS, "refusal": _ODD, "role": _ODD},
)
_CHOICES = st.fixed_dictionaries(
    {},
    optional={
        "message": _MESSAGES | _ODD,
        "logprobs": _ODD,
        "finish_reason": _ODD,
        "index": st.sampled_from([0, 1, "0", None]),
    },
)
_REQUESTS = st.sampled_from(
    [
        Request.of("x"),
        Request.of("x", n=2),
        Request.of("x", response_format={"type": "json_object"}),
        Request.of(
            "x",
            response_format={"type": "json_schema", "json_schema": {**SCHEMA, "strict": True}},
        ),
    ]
)


@settings(max_examples=400)
@given(st.lists(_CHOICES | _ODD, max_size=3), _REQUESTS)
def test_the_plain_answers_short_path_reads_as_every_choice_read(
    choices: list[Any], request: Request
) -> None:
    """A plain answer (one choice of text, no JSON asked) skips building its ``Choice``;
    what it reads is what reading every choice reads, for any answer."""
    got = {"choices": choices}
    assert read_answer(got, request) == _read_choices(got, request)


@pytest.mark.parametrize("strict", [False, True])
def test_json_nested_past_the_parsers_depth_is_unparsed_not_a_crash(strict: bool) -> None:
    """An answer nested deeper than ``json`` goes raised ``RecursionError`` out of
    ``read_answer``: the model actor died judging it, twice, and the call was sent twice
    (found by a hunt). It is JSON that does not parse: nothing parsed, and a strict
    schema's failure."""
    schema = {**SCHEMA, "strict": True} if strict else SCHEMA
    request = Request.of("x", response_format={"type": "json_schema", "json_schema": schema})
    fields = read_answer(answer({"content": "[" * 100_000 + "]" * 100_000}), request)
    assert "parsed" not in fields
    assert ("reason" in fields) is strict
