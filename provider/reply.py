"""What the simulated model says: filler text, tool calls, or JSON for a schema.

Pure and dialect-free: an `Intent` (what a request asks of the answer, read by
the OpenAI or the Anthropic wire) in, a `Reply` out. The wires render the
reply in their own shapes; the engine sizes the answer from it.

Theory of operation
-------------------
``compose(intent)`` decides, in this order:

1. tools, unless ``tool_choice`` is ``none``: a named choice calls that tool;
   ``required`` calls; ``auto`` calls when the conversation's last turn is the
   user's, and answers in text after a tool's result (so a tool loop ends).
   One call, to the first tool (or the named one), unless the request asked
   for parallel calls explicitly (OpenAI's ``parallel_tool_calls: true``,
   Anthropic's ``disable_parallel_tool_use: false``): then one call per tool,
   at most `MAX_PARALLEL`. Arguments are `instances.instance` of the tool's
   parameter schema, compact JSON;
2. a JSON schema asked for (``json_schema``, or ``json_object`` as a one-field
   object): the instance of the schema as the text;
3. otherwise filler words, as many as the engine draws, cut before the first
   ``stop`` sequence they contain (`Reply.stop_at`).

Sizes are fixed before the engine plans, so the limits charge what ``usage``
reports: filler costs one token a word; a JSON text ``ceil(len / 4)``; a tool
call ``ceil(len(arguments) / 4) + 1``. An answer cut by ``max_tokens``
(`Reply.cut`) keeps whole calls while they fit and cuts the arguments of the
first that does not, as a real model's truncated JSON.

What must hold: the same intent always gives the same reply; every argument
string and JSON text of an uncut reply validates against its schema.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from callboard.provider.instances import instance
from callboard.provider.sse import compact

__all__ = [
    "FILLER",
    "JSON_OBJECT_SCHEMA",
    "MAX_PARALLEL",
    "PLAIN",
    "Call",
    "Choice",
    "Intent",
    "Reply",
    "Tool",
    "UnknownToolError",
    "compose",
    "filler",
]

FILLER = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jam"
"""The words the model says, over and over."""
_WORDS = tuple(FILLER.split())
MAX_PARALLEL = 8
"""The most tool calls one answer makes."""
JSON_OBJECT_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
}
"""What a ``json_object`` answer looks like: ``{"answer": "example"}``."""

Choice = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the caller offers."""

    name: str
    parameters: Mapping[str, Any]
    """Its JSON Schema (``{"type": "object"}`` when the caller gave none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Intent:
    """What a request asks of its answer."""

    tools: tuple[Tool, ...] = ()
    choice: Choice = "auto"
    named: str | None = None
    """The tool a ``named`` choice calls."""
    parallel: bool = False
    """The request asked for parallel calls explicitly."""
    after_tool: bool = False
    """The last turn carries a tool's result."""
    schema: Mapping[str, Any] | None = None
    """The JSON Schema a structured answer must meet (None: free text)."""
    stop: tuple[str, ...] = ()


PLAIN = Intent()
"""A plain chat: filler text, no stop sequence."""


@dataclass(frozen=True, slots=True)
class Call:
    """One tool call (its id is the wire's to give)."""

    name: str
    arguments: str
    """Compact JSON text."""

    @property
    def tokens(self) -> int:
        return -(-len(self.arguments) // 4) + 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """What the model answers, before ``max_tokens`` and the drawn size apply."""

    calls: tuple[Call, ...] = ()
    text: str | None = None
    """A fixed text (a JSON answer); None with no calls: filler words."""
    stop_at: int | None = None
    """Filler only: the words said before the first stop sequence (None: none met)."""
    stop_text: str | None = None
    """Filler only: the text said before the first stop sequence."""
    stop_sequence: str | None = None
    """Filler only: that stop sequence."""

    @property
    def fixed_tokens(self) -> int | None:
        """The size of a tool-call or JSON answer; None for filler (the engine draws it)."""
        if self.calls:
            return sum(call.tokens for call in self.calls)
        if self.text is not None:
            return -(-len(self.text) // 4)
        return None

    def cut(self, tokens: int) -> Reply:
        """This reply as ``tokens`` of output leave it (a fixed answer only)."""
        if self.text is not None:
            return Reply(text=self.text[: tokens * 4])
        calls: list[Call] = []
        left = tokens
        for call in self.calls:
            if left <= 0:
                break
            if call.tokens <= left:
                calls.append(call)
            else:
                calls.append(Call(call.name, call.arguments[: max(0, left - 1) * 4]))
            left -= call.tokens
        return Reply(calls=tuple(calls))

    def words(self, count: int, *, stopped: bool) -> str:
        """The filler text of ``count`` words, or the text before the stop sequence."""
        if stopped and self.stop_text is not None:
            return self.stop_text
        return filler(count)


def compose(intent: Intent) -> Reply:
    """The reply ``intent`` asks for (see the module docstring)."""
    calls = _calls(intent)
    if calls:
        return Reply(calls=calls)
    if intent.schema is not None:
        return Reply(text=compact(instance(intent.schema)))
    if intent.stop:
        return _stopped(intent.stop)
    return _FILLER_REPLY


_FILLER_REPLY = Reply()


def _calls(intent: Intent) -> tuple[Call, ...]:
    tools = intent.tools
    if not tools or intent.choice == "none":
        return ()
    if intent.choice == "named":
        chosen = [t for t in tools if t.name == intent.named]
        if not chosen:
            raise UnknownToolError(intent.named)
    elif intent.choice == "auto" and intent.after_tool:
        return ()
    else:
        chosen = list(tools[:MAX_PARALLEL]) if intent.parallel else [tools[0]]
    return tuple(Call(t.name, compact(instance(t.parameters))) for t in chosen)


class UnknownToolError(ValueError):
    """A ``tool_choice`` names a tool the request does not offer."""

    def __init__(self, name: str | None) -> None:
        super().__init__(f"tool_choice names {name!r}, which is not among the tools")
        self.name = name


@functools.lru_cache(maxsize=256)
def _stopped(stops: tuple[str, ...]) -> Reply:
    """Filler cut at the earliest of ``stops`` in the endless filler (it repeats, so
    two rounds of it hold every place a stop sequence can first appear)."""
    text = (FILLER + " ") * (2 + max(len(s) for s in stops) // len(FILLER))
    found = [(p, s) for p, s in ((text.find(s), s) for s in stops if s) if p >= 0]
    if not found:
        return _FILLER_REPLY
    at, stop = min(found)
    said = text[:at]
    return Reply(stop_at=len(said.split()), stop_text=said, stop_sequence=stop)


@functools.lru_cache(maxsize=256)
def filler(words: int) -> str:
    """``words`` deterministic filler words."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(words))
