"""The prompt-token estimate (core/tokens.py): four characters a token, four tokens of
framing a message, three to prime the reply; pure, and never below three."""

from __future__ import annotations

import pytest
from callboard.core.tokens import (
    MESSAGE_OVERHEAD,
    REPLY_PRIMER,
    estimate_prompt_tokens,
)
from callboard.messages import ChatMessage
from hypothesis import given
from hypothesis import strategies as st


def chat(*contents: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=c) for c in contents]


@pytest.mark.parametrize(
    ("contents", "expected"),
    [
        (("",), 0 + 4 + 3),
        (("a",), 1 + 4 + 3),
        (("abcd",), 1 + 4 + 3),
        (("hello",), 2 + 4 + 3),
        (("x" * 4000,), 1000 + 4 + 3),
        (("hello", "abcdefgh"), (2 + 4) + (2 + 4) + 3),
    ],
)
def test_estimate_prompt_tokens(contents: tuple[str, ...], expected: int) -> None:
    assert estimate_prompt_tokens(chat(*contents)) == expected


def test_an_empty_chat_costs_the_reply_primer() -> None:
    assert estimate_prompt_tokens(()) == REPLY_PRIMER == 3


def test_the_role_does_not_change_the_estimate() -> None:
    roles = [ChatMessage(role=r, content="twelve chars") for r in ("system", "user", "assistant")]
    assert estimate_prompt_tokens(roles) == 3 * (3 + MESSAGE_OVERHEAD) + REPLY_PRIMER


@given(st.lists(st.text(max_size=200), max_size=8), st.text(max_size=50))
def test_an_estimate_is_at_least_the_primer_and_grows_with_every_message(
    contents: list[str], more: str
) -> None:
    before = estimate_prompt_tokens(chat(*contents))
    after = estimate_prompt_tokens(chat(*contents, more))
    assert isinstance(before, int)
    assert before >= REPLY_PRIMER
    assert after >= before + MESSAGE_OVERHEAD
    assert estimate_prompt_tokens(chat(*contents)) == before  # pure: the same answer again
