"""OpenAI's Chat Completions wire, sans-IO: a stream's chunks assembled into the answer.

Theory of operation
-------------------
callboard's own wire is this one: a request is a Chat Completions body (its fields
and their checks are ``callboard.messages.check_body``, re-exported here), and
other dialects (``wire.anthropic``) translate from it and back to its
``chat.completion`` answer.

``ChunkAssembler`` folds ``chat.completion.chunk`` objects (a streamed answer,
one per server-sent event; ``[DONE]`` is the caller's to stop at) into the
``chat.completion`` the same call would have answered unstreamed: the content
and refusal concatenated, tool calls gathered by their ``index`` (id and name
from their first fragment, arguments concatenated; ``_Numbering`` says which call a
fragment is when the server numbers them wrongly or not at all), logprobs (the content's and the
refusal's) appended, the
finish reason and the usage (the last chunk's, with
``stream_options.include_usage``) kept; one assembly per choice index. The
reasoning some compatible servers stream beside the content (DeepSeek's and vLLM's
``reasoning_content``, OpenRouter's ``reasoning``) is concatenated under its own
name, as their unstreamed answers hold it.

Servers that speak this wire do not all write it as OpenAI does, and each chunk (and
an unstreamed answer, ``normal_completion``) is read into OpenAI's shapes first
(``_normal_message``): Mistral's reasoning models answer ``content`` as a list of
``text`` and ``thinking`` parts (the text parts joined as the content, the thinking as
``reasoning_content``), and some servers give a tool call's ``arguments`` as a JSON
object, not its text (written as JSON text). Read as they came, every Magistral
answer failed malformed and was sent four times, each an outage; the gateway passed
an object as ``arguments`` to SDKs whose callers ``json.loads`` it (found by a hunt).

What must hold: the assembled answer of a stream equals, field for field, the
unstreamed answer of the same completion. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from callboard.messages import FIELDS, ROLES, check_body

__all__ = [
    "FIELDS",
    "ROLES",
    "ChunkAssembler",
    "check_body",
    "normal_completion",
    "reasoning_of",
    "thinks",
]


_HEAD = ("id", "model", "created", "system_fingerprint")


MOST_TOOL_CALLS: Final = 1024
"""The tool calls one streamed answer may make (a stream whose every event began a new
one held nine times its bytes; found by a hunt)."""


class ChunkAssembler:
    """``chat.completion.chunk`` objects in, the ``chat.completion`` they make out."""

    def __init__(self, *, choices: int = 1) -> None:
        self._n = choices
        """The choices asked for: the stream is finished once each of them is."""
        self._head: dict[str, Any] = {}
        self._unsaid: tuple[str, ...] = _HEAD
        """The head's fields no chunk has said yet (looked for in each chunk until said)."""
        self._choices: dict[int, dict[str, Any]] = {}
        self._usage: dict[str, Any] | None = None
        self.ended = False
        """The usage chunk (no choices) came after every choice had finished: with
        ``stream_options.include_usage`` the last chunk OpenAI sends before ``[DONE]``,
        so the answer is whole whether or not ``[DONE]`` follows (a server that kept its
        connection open without one held the call to its read timeout, and cut it)."""
        self._tier: Any = None
        """The tier that served it, which its bill follows (a stream's assembled answer
        lost it; a hunt): from the first chunk that says one. Apart from the head, whose
        loop a provider that never says it would run for every chunk."""

    def feed(self, chunk: Mapping[str, Any]) -> None:
        """Fold one chunk in (its choices' deltas, and its usage if it has one)."""
        if self._unsaid:  # each from the first chunk that says it: Azure's first chunk,
            head = self._head  # the prompt's filter results, has "" and 0 for all
            for key in self._unsaid:
                head[key] = chunk.get(key)
            self._unsaid = tuple(k for k in self._unsaid if not head[k])
        if self._tier is None:
            self._tier = chunk.get("service_tier")
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if not usage and "x_groq" in chunk:
            usage = _groqs_usage(chunk)
        if usage:
            self._usage = dict(usage)
            self.ended = not choices and self.finished
        for choice in choices or ():
            self._fold(choice)

    def _choice(self, index: int) -> dict[str, Any]:
        """Choice ``index``'s assembly, begun at its first delta."""
        into = self._choices.get(index)
        if into is not None:
            return into
        if not 0 <= index < self._n:  # each a message's worth of lists: events that each
            # named a new one held 65 times their bytes (found by a hunt)
            raise IndexError(f"choice {index} of a stream that asked for {self._n}")
        into = self._choices[index] = {
            "role": "assistant",
            "content": [],
            "refusal": [],
            "calls": {},
            "numbering": _Numbering(),
            "lp": [],
            "refusal_lp": [],
            "reasoning_content": [],
            "reasoning": [],
        }
        return into

    def _fold(self, choice: Mapping[str, Any]) -> None:
        into = self._choice(int(choice.get("index", 0)))
        delta = choice.get("delta") or {}
        if delta:
            if type(delta.get("content")) is list or "tool_calls" in delta:
                _normal_message(delta, in_place=True)  # the reader's deltas are read after
            _fold_texts(into, delta)
        if legacy := delta.get("function_call"):  # the deprecated functions' one call:
            slot = into.setdefault("function_call", {"name": None, "arguments": []})
            slot["name"] = slot["name"] or legacy.get("name")  # it was dropped (a hunt)
            if legacy.get("arguments"):
                slot["arguments"].append(legacy["arguments"])
        for call in delta.get("tool_calls") or ():
            _fold_call(into, call)
        logprobs = choice.get("logprobs")
        if logprobs:
            if logprobs.get("content"):
                into["lp"].extend(logprobs["content"])
            if logprobs.get("refusal"):
                into["refusal_lp"].extend(logprobs["refusal"])
        if choice.get("finish_reason") is not None:
            into["finish_reason"] = choice["finish_reason"]

    @property
    def finished(self) -> bool:
        """Every choice asked for has its finish reason (an ``n`` > 1 stream ends when
        its last choice does, not its first, nor before one that never began)."""
        choices = self._choices
        return len(choices) >= self._n and all("finish_reason" in c for c in choices.values())

    def completion(self) -> dict[str, Any]:
        """The answer the chunks so far make, as an unstreamed call would give it."""
        choices = []
        for index in sorted(self._choices):
            c = self._choices[index]
            message: dict[str, Any] = {
                "role": "assistant",
                "content": "".join(c["content"]) if c["content"] else None,
            }
            if c["refusal"]:
                message["refusal"] = "".join(c["refusal"])
            for name in _REASONING:
                if c[name]:
                    message[name] = "".join(c[name])
            if c["calls"]:
                message["tool_calls"] = [
                    {
                        "id": s["id"],
                        "type": "function",
                        "function": {"name": s["name"], "arguments": "".join(s["arguments"])},
                    }
                    for _, s in sorted(c["calls"].items())
                ]
            if "function_call" in c:
                legacy = c["function_call"]
                args = "".join(legacy["arguments"])
                message["function_call"] = {"name": legacy["name"], "arguments": args}
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "finish_reason": c.get("finish_reason"),
            }
            if c["lp"] or c["refusal_lp"]:
                choice["logprobs"] = {
                    "content": c["lp"] or None,
                    "refusal": c["refusal_lp"] or None,
                }
            choices.append(choice)
        answer = {**self._head, "object": "chat.completion", "choices": choices}
        if self._tier is not None:
            answer["service_tier"] = self._tier
        if self._usage is not None:
            answer["usage"] = self._usage
        return answer


def _fold_call(into: dict[str, Any], call: dict[str, Any]) -> None:
    """A tool call's fragment into its choice's assembly."""
    number = into["numbering"].number(call)
    call["index"] = number  # the reader's delta is numbered as the assembly is
    slot = into["calls"].get(number)
    if slot is None:
        if len(into["calls"]) == MOST_TOOL_CALLS:
            raise IndexError(f"more than {MOST_TOOL_CALLS} tool calls in one answer")
        slot = into["calls"][number] = {"id": None, "name": None, "arguments": []}
    fn = call.get("function") or {}
    slot["id"] = slot["id"] or call.get("id")
    slot["name"] = slot["name"] or fn.get("name")
    if fn.get("arguments"):
        slot["arguments"].append(fn["arguments"])


def _groqs_usage(chunk: Mapping[str, Any]) -> Any:
    """Groq's stream says its usage in ``x_groq.usage`` of its last chunk, not in
    ``usage`` (as its clients read it): read there only, every call was charged its
    estimate (found by a hunt)."""
    extra = chunk.get("x_groq")
    return extra.get("usage") if isinstance(extra, Mapping) else None


def _fold_texts(into: dict[str, Any], delta: Mapping[str, Any]) -> None:
    """A delta's texts (content, refusal, reasoning) added to its choice's."""
    if content := delta.get("content"):
        into["content"].append(content)
    if refusal := delta.get("refusal"):
        into["refusal"].append(refusal)
    for name in _REASONING:
        if thought := delta.get(name):
            if not isinstance(thought, str):
                raise TypeError(f"a delta's {name} is not text")
            into[name].append(thought)


_REASONING = ("reasoning_content", "reasoning")
"""Where compatible servers put a message's reasoning (DeepSeek and vLLM; OpenRouter)."""


def reasoning_of(message: Mapping[str, Any]) -> Any:
    """A message's (or a stream's delta's) reasoning, under whichever of its names the
    server used (None: none)."""
    for name in _REASONING:
        if said := message.get(name):
            return said
    return None


def thinks(delta: Mapping[str, Any]) -> bool:
    """Whether a delta, as the server wrote it, carries reasoning: under one of its
    names, or as Mistral's ``thinking`` content parts."""
    if reasoning_of(delta):
        return True
    content = delta.get("content")
    return type(content) is list and any(
        isinstance(p, Mapping) and p.get("type") == "thinking" for p in content
    )


def normal_completion(body: Any) -> Any:
    """``body`` (a ``chat.completion``) with each choice's message in OpenAI's shapes
    (see the module: content parts joined, object arguments as JSON text): ``body``
    itself when it is so already, else a copy. ``TypeError`` for a content part or
    arguments no shape reads."""
    choices = body.get("choices") if isinstance(body, Mapping) else None
    if not isinstance(choices, list):
        return body
    normal = [
        {**choice, "message": message}
        if isinstance(choice, Mapping)
        and isinstance(choice.get("message"), Mapping)
        and (message := _normal_message(choice["message"])) is not choice["message"]
        else choice
        for choice in choices
    ]
    if all(new is old for new, old in zip(normal, choices, strict=True)):
        return body
    return {**body, "choices": normal}


def _normal_message(message: Any, *, in_place: bool = False) -> Any:
    """A message (or a stream's delta) in OpenAI's shapes: itself when it is, else a
    copy (``in_place``: itself, changed)."""
    content = message.get("content")
    calls = message.get("tool_calls")
    odd_calls = isinstance(calls, list) and any(_object_arguments(c) for c in calls)
    if not isinstance(content, list) and not odd_calls:
        return message
    out = message if in_place else dict(message)
    if isinstance(content, list):
        text, thought = _parts(content)
        out["content"] = text
        if thought:
            out["reasoning_content"] = (out.get("reasoning_content") or "") + thought
    if odd_calls:
        out["tool_calls"] = [_text_arguments(c) for c in calls]
    return out


def _parts(parts: list[Any]) -> tuple[str, str]:
    """Content parts (Mistral's: ``{"type": "text", "text"}``, ``{"type": "thinking",
    "thinking": [parts]}``; others, such as references, say nothing) as their text and
    their thinking."""
    text: list[str] = []
    thought: list[str] = []
    for part in parts:
        if not isinstance(part, Mapping):
            raise TypeError("a content part is not an object")
        kind = part.get("type")
        if kind == "text":
            said = part.get("text")
            if not isinstance(said, str):
                raise TypeError("a text part's text is not text")
            text.append(said)
        elif kind == "thinking":
            inner = part.get("thinking")
            if isinstance(inner, str):
                thought.append(inner)
            elif isinstance(inner, list):
                said, deeper = _parts(inner)
                thought.append(said + deeper)
            else:
                raise TypeError("a thinking part's thinking is neither text nor parts")
    return "".join(text), "".join(thought)


def _object_arguments(call: Any) -> bool:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return False
    return isinstance(function.get("arguments"), Mapping)  # (a number stays malformed)


def _text_arguments(call: Any) -> Any:
    """A tool call whose ``arguments`` are a JSON object, with them as JSON text."""
    if not _object_arguments(call):
        return call
    function = call["function"]
    text = json.dumps(function["arguments"], ensure_ascii=False, separators=(",", ":"))
    return {**call, "function": {**function, "arguments": text}}


class _Numbering:
    """Which of a choice's tool calls each streamed fragment belongs to.

    OpenAI numbers fragments by ``index`` and names a call (``id``) in its first one.
    Servers that speak its wire do not all: Gemini's sends each call whole with no
    ``index``, some adapters send every call at index 0. So an ``id`` is the call it
    names; a new ``id`` at an index another call holds opens a new call (numbered
    after the last), as does one with no index; a fragment without an ``id``
    continues the call its index (or, with none, the last fragment without one)
    stands for. Merging two calls' fragments would make neither's arguments JSON
    (the ``openai`` SDK refuses a fragment with no index instead)."""

    __slots__ = ("_at", "_by_id", "_ids", "_last")

    def __init__(self) -> None:
        self._at: dict[object, int] = {}
        """The server's index (None: none given) -> the call it stands for now."""
        self._by_id: dict[str, int] = {}
        self._ids: dict[int, str | None] = {}
        """Each call's id (None: not named yet)."""
        self._last = -1

    def number(self, call: Mapping[str, Any]) -> int:
        given = call.get("index")
        key = given if type(given) is int else None
        ident = call.get("id")
        if isinstance(ident, str) and ident:
            known = self._by_id.get(ident)
            if known is not None:
                self._at[key] = known
                return known
            held = self._at.get(key)
            if held is not None and self._ids[held] is None:  # its first fragment named none
                self._ids[held] = ident
                self._by_id[ident] = held
                return held
            number = key if key is not None and key not in self._ids else self._last + 1
            return self._open(number, ident, at=key)
        held = self._at.get(key)
        if held is not None:
            return held
        if key is None:
            return self._last if self._last >= 0 else self._open(0, None, at=None)
        return self._open(key if key not in self._ids else self._last + 1, None, at=key)

    def _open(self, number: int, ident: str | None, *, at: object) -> int:
        self._ids[number] = ident
        if ident is not None:
            self._by_id[ident] = number
        self._at[at] = number
        self._last = max(self._last, number)
        return number
