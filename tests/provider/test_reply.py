"""What the simulated model says (provider/reply.py): tool choice, schema answers, stop
sequences and how max_tokens cuts a fixed answer."""

from __future__ import annotations

import json

import pytest
from callboard.provider.reply import (
    JSON_OBJECT_SCHEMA,
    MAX_PARALLEL,
    PLAIN,
    Call,
    Intent,
    Reply,
    Tool,
    UnknownToolError,
    compose,
    filler,
)

A = Tool("a", {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]})
B = Tool("b", {"type": "object"})


def names(reply: Reply) -> list[str]:
    return [c.name for c in reply.calls]


@pytest.mark.parametrize(
    ("intent", "called"),
    [
        (Intent(tools=(A, B)), ["a"]),
        (Intent(tools=(A, B), after_tool=True), []),
        (Intent(tools=(A, B), choice="required", after_tool=True), ["a"]),
        (Intent(tools=(A, B), choice="none"), []),
        (Intent(tools=(A, B), choice="named", named="b", after_tool=True), ["b"]),
        (Intent(tools=(A, B), parallel=True), ["a", "b"]),
        (Intent(tools=(A,) * (MAX_PARALLEL + 3), parallel=True), ["a"] * MAX_PARALLEL),
    ],
    ids=["auto", "auto-after-tool", "required", "none", "named", "parallel", "bounded"],
)
def test_tool_choice_decides_the_calls(intent: Intent, called: list[str]) -> None:
    reply = compose(intent)
    assert names(reply) == called
    assert all(
        json.loads(c.arguments) == ({"q": "example"} if c.name == "a" else {}) for c in reply.calls
    )
    assert (reply.fixed_tokens is None) == (not called)


def test_a_named_tool_that_is_not_offered_is_refused() -> None:
    with pytest.raises(UnknownToolError, match="zzz"):
        compose(Intent(tools=(A,), choice="named", named="zzz"))


def test_a_schema_answers_with_its_instance_and_tools_come_first() -> None:
    reply = compose(Intent(schema=JSON_OBJECT_SCHEMA))
    assert reply.text == '{"answer":"example"}'
    assert reply.fixed_tokens == 5  # ceil(20 / 4)
    assert names(compose(Intent(tools=(A,), schema=JSON_OBJECT_SCHEMA))) == ["a"]


def test_plain_text_is_filler_the_engine_sizes() -> None:
    reply = compose(PLAIN)
    assert reply.fixed_tokens is None
    assert reply.words(4, stopped=False) == "the quick brown fox"
    assert filler(17).split()[15:] == ["the", "quick"]  # it repeats after 15 words


@pytest.mark.parametrize(
    ("stops", "said", "words", "which"),
    [
        (("fox",), "the quick brown ", 3, "fox"),
        (("lazy", "quick"), "the ", 1, "quick"),
        (("qui",), "the ", 1, "qui"),
        (
            ("jam the",),
            "the quick brown fox jumps over a lazy dog while seven wizards quietly box ",
            14,
            "jam the",
        ),
    ],
)
def test_a_stop_sequence_cuts_the_filler_before_it(
    stops: tuple[str, ...], said: str, words: int, which: str
) -> None:
    reply = compose(Intent(stop=stops))
    assert (reply.stop_text, reply.stop_at, reply.stop_sequence) == (said, words, which)
    assert reply.words(50, stopped=True) == said


def test_a_stop_sequence_the_filler_never_says_changes_nothing() -> None:
    assert compose(Intent(stop=("zebra",))) == compose(PLAIN)


def test_max_tokens_cuts_whole_calls_then_the_arguments_of_the_first_that_does_not_fit() -> None:
    calls = (Call("a", '{"q":"example"}'), Call("b", "{}"))  # 5 tokens, then 2
    reply = Reply(calls=calls)
    assert reply.fixed_tokens == 7
    assert reply.cut(7) == reply
    assert reply.cut(6).calls == (calls[0], Call("b", ""))
    assert reply.cut(3).calls == (Call("a", '{"q":"ex'),)
    assert Reply(text='{"answer":"example"}').cut(2).text == '{"answer'
