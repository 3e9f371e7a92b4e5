"""Complexity classifier (pure): how hard a request is, for ``route="auto"``.

Theory of operation
-------------------
For ``route="auto"`` the routing policy asks a ``Classifier``
(``classifier(request, prompt_tokens) -> str``) for a *label*: the name of a
configured route, used as is; else a difficulty (``EASY``, ``MEDIUM``,
``HARD``) or a standard tier name, for which the policy takes the first
configured route in ``TIER_PREFERENCES[label]`` (so a configuration with only
``fast`` and ``accurate`` still gets an answer for ``MEDIUM``).

``HeuristicClassifier`` is the default: keyword and length rules over the
last user turn, microseconds per call, no I/O. HARD on a long prompt, a long
requested answer, a code block or code-looking lines, words such as
"prove", "derive", "analyze", "step by step", or a multi-part question; EASY
on a greeting or a short prompt with none of those; MEDIUM otherwise.

A plugged-in classifier runs on the router's thread, so it must answer fast.
If it raises or answers something other than a string, the policy routes the
request as ``MEDIUM`` and says so in the plan's reason: it never loses a task.

What always holds: ``HeuristicClassifier`` is deterministic, returns one of
``EASY``/``MEDIUM``/``HARD``, and reads at most ``scan_chars`` characters.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from callboard.messages import Request

__all__ = [
    "EASY",
    "HARD",
    "MEDIUM",
    "TIER_PREFERENCES",
    "Classifier",
    "HeuristicClassifier",
]

EASY = "easy"
MEDIUM = "medium"
HARD = "hard"

_FAST_FIRST = ("fast", "cheap", "balanced", "accurate", "reasoning")
_CHEAP_FIRST = ("cheap", "fast", "balanced", "accurate", "reasoning")
_BALANCED_FIRST = ("balanced", "accurate", "fast", "cheap", "reasoning")
_ACCURATE_FIRST = ("accurate", "reasoning", "balanced", "fast", "cheap")
_REASONING_FIRST = ("reasoning", "accurate", "balanced", "fast", "cheap")

TIER_PREFERENCES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        EASY: _FAST_FIRST,
        MEDIUM: _BALANCED_FIRST,
        HARD: _ACCURATE_FIRST,
        "fast": _FAST_FIRST,
        "cheap": _CHEAP_FIRST,
        "balanced": _BALANCED_FIRST,
        "accurate": _ACCURATE_FIRST,
        "reasoning": _REASONING_FIRST,
    }
)
"""Label -> the tiers to try, best first; the first one configured wins."""


class Classifier(Protocol):
    """Answers a label (a difficulty, a standard tier or a route name) for a request."""

    def __call__(self, request: Request, prompt_tokens: int) -> str: ...


_HARD_WORDS = re.compile(
    r"\b(?:prove|proofs?|derive|derivation|analy[sz]e|analysis|step[- ]by[- ]step"
    r"|theorem|lemma|rigorous(?:ly)?|formally|optimi[sz]e|algorithms?|refactor|debug"
    r"|trade-?offs?|compare and contrast|in depth|critique|evaluate|architecture"
    r"|think carefully|reason about|explain why)\b",
    re.IGNORECASE,
)
# Line starts are matched with ``^[ \t]*``, never ``^\s*``: under MULTILINE ``\s`` eats
# newlines, so every line start of a run of blank lines would rescan the rest of the
# run (quadratic: 20,000 newlines took seconds of the router's thread).
_CODE_LINE = re.compile(
    r"^[ \t]*(?:def |class |import |from \S+ import |#include|fn |func |public |SELECT |"
    r"const |let |var |return\b)",
    re.MULTILINE,
)
_LIST_ITEM = re.compile(r"^[ \t]*(?:\d+[.)]|\(?[a-z]\)|[-*])\s+\S", re.MULTILINE)
_GREETING = re.compile(
    r"^\s*(?:hi|hello|hey|thanks|thank you|good (?:morning|afternoon|evening)|bye)\b", re.IGNORECASE
)
_FACTUAL = re.compile(
    r"^\s*(?:(?:what|who|when|where|which)(?:'s|\s+(?:is|are|was|were|did|does))\b"
    r"|define\b|translate\b|spell\b|convert\b)",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeuristicClassifier:
    """The default classifier: keyword and length rules (see the module docstring)."""

    long_prompt_tokens: int = 2_000
    """A prompt at least this large (estimated tokens) is HARD."""
    short_prompt_tokens: int = 32
    """A prompt at most this large with no HARD signal is EASY."""
    factual_prompt_tokens: int = 64
    """A factual question ("what is", "define", ...) up to this size is EASY."""
    long_output_tokens: int | None = 4_096
    """A request allowing at least this many completion tokens is HARD (None: ignore)."""
    scan_chars: int = 20_000
    """Only this many characters of the last user turn are scanned."""

    def __call__(self, request: Request, prompt_tokens: int) -> str:
        text = _last_user_text(request)[: self.scan_chars]
        if self._hard(request, prompt_tokens, text):
            return HARD
        if _GREETING.match(text) or prompt_tokens <= self.short_prompt_tokens:
            return EASY
        if prompt_tokens <= self.factual_prompt_tokens and _FACTUAL.match(text):
            return EASY
        return MEDIUM

    def _hard(self, request: Request, prompt_tokens: int, text: str) -> bool:
        long_output = self.long_output_tokens
        return (
            prompt_tokens >= self.long_prompt_tokens
            or (long_output is not None and request.max_tokens >= long_output)
            or "```" in text
            or _CODE_LINE.search(text) is not None
            or _HARD_WORDS.search(text) is not None
            or text.count("?") >= 2  # a multi-part question
            or len(_LIST_ITEM.findall(text)) >= 2
        )


def _last_user_text(request: Request) -> str:
    """The turn being answered: the last user message (else the last message)."""
    for message in reversed(request.messages):
        if message.role == "user":
            return message.text
    return request.messages[-1].text
