"""The complexity classifier (core/complexity.py): ``HeuristicClassifier`` labels a
request EASY, MEDIUM or HARD from its last user turn, deterministically and fast;
``TIER_PREFERENCES`` turns every label into tiers to try."""

from __future__ import annotations

import time

import pytest
from callboard.core.complexity import (
    EASY,
    HARD,
    MEDIUM,
    TIER_PREFERENCES,
    HeuristicClassifier,
)
from callboard.core.routing import AUTO
from callboard.core.tokens import estimate_prompt_tokens
from callboard.messages import Request
from hypothesis import given
from hypothesis import strategies as st

CLASSIFY = HeuristicClassifier()


def label(prompt: str | list[dict[str, str]], **fields: object) -> str:
    request = Request.of(prompt, **fields)
    return CLASSIFY(request, estimate_prompt_tokens(request.messages))


@pytest.mark.parametrize("prompt", ["hi", "Hello there, how are you today my dear friend?"])
def test_a_greeting_is_easy(prompt: str) -> None:
    assert label(prompt) == EASY


def test_a_short_prompt_is_easy() -> None:
    assert label("capital of France") == EASY


def test_a_short_factual_question_is_easy() -> None:
    question = "What is the boiling point of water at sea level, in degrees Celsius and Kelvin"
    request = Request.of(question)
    assert CLASSIFY(request, 40) == EASY
    assert CLASSIFY(request, 65) == MEDIUM


def test_anything_else_is_medium() -> None:
    prompt = "Write a friendly note to my neighbour about the new fence. " * 3
    assert label(prompt) == MEDIUM


@pytest.mark.parametrize(
    "prompt",
    [
        "Please prove it",
        "Walk me through it step by step",
        "fix this:\n```\nx = 1\n```",
        "why does this fail\ndef f(x):\n    return x",
        "Is it red? Is it blue?",
        "Tell me:\n1. one thing\n2. another thing",
    ],
)
def test_hard_signals_make_a_short_request_hard(prompt: str) -> None:
    assert label(prompt) == HARD


def test_a_long_prompt_or_a_long_answer_is_hard() -> None:
    assert label("word " * 2_000) == HARD
    assert label("hi", max_tokens=4_096) == HARD
    off = HeuristicClassifier(long_output_tokens=None)
    assert off(Request.of("hi", max_tokens=10_000), 8) == EASY


def test_the_last_user_turn_is_the_one_classified() -> None:
    chat = [
        {"role": "user", "content": "Prove the theorem, rigorously"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "thanks"},
    ]
    assert label(chat) == EASY


def test_only_scan_chars_of_the_turn_are_read() -> None:
    tail = " then prove it"
    prompt = "a" * 100 + tail
    request = Request.of(prompt)
    assert HeuristicClassifier(scan_chars=100)(request, 40) == MEDIUM
    assert HeuristicClassifier(scan_chars=200)(request, 40) == HARD


@given(st.text(max_size=300), st.integers(1, 5_000))
def test_the_label_is_deterministic_and_one_of_three(text: str, tokens: int) -> None:
    request = Request.of(text + "x")
    first = CLASSIFY(request, tokens)
    assert first in (EASY, MEDIUM, HARD)
    assert CLASSIFY(request, tokens) == first


def test_every_label_prefers_every_standard_tier_once() -> None:
    tiers = set(TIER_PREFERENCES["fast"])
    for name, order in TIER_PREFERENCES.items():
        assert set(order) == tiers, name
        assert len(order) == len(tiers), name
    assert TIER_PREFERENCES[EASY][0] == "fast"
    assert TIER_PREFERENCES[MEDIUM][0] == "balanced"
    assert TIER_PREFERENCES[HARD][0] == "accurate"
    with pytest.raises(TypeError):
        TIER_PREFERENCES["new"] = ("fast",)  # type: ignore[index]


def test_the_heuristic_classifier_is_fast_on_blank_lines() -> None:
    """The docstring promises microseconds per call on the router's thread; ``_LIST_ITEM``
    and ``_CODE_LINE`` start with ``^\\s*`` under MULTILINE, and ``\\s`` eats newlines, so
    every line start rescans the rest of the blank run: 6,000 newlines take ~0.6 s,
    20,000 (within ``scan_chars``) ~7.5 s, during which no task is routed."""
    request = Request.of("x" + "\n" * 6_000 + "x", route=AUTO)
    started = time.perf_counter()
    HeuristicClassifier()(request, 2_010)
    assert time.perf_counter() - started < 0.2
