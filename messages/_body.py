"""The Chat Completions request body: every field callboard passes through, and its rules.

Theory of operation
-------------------
callboard's own wire is OpenAI's Chat Completions: a ``Request`` is such a body
(plus callboard's own fields: priority, deadline, budget tag, ...), and other
dialects (``callboard.wire.anthropic``, ``.azure``) translate from it.

``check_body(body)`` checks every field OpenAI's API reference lists, by the
reference's types and ranges, and refuses a field it does not know unless it
sits in ``extra_body`` (provider-specific fields go there, as in the official
SDK). Each refusal is an ``InvalidRequestError`` naming the field
(``messages[2].tool_calls[0].function.arguments``), so a caller sees at submit
what the provider would have answered with a 400 after queueing.

What must hold: ``check_body`` accepts every body the reference allows and
changes none. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

from callboard.messages._errors import InvalidRequestError

__all__ = [
    "ANSWER_ONLY",
    "FIELDS",
    "REASONING_BACK",
    "ROLES",
    "THINKING_BLOCK_TYPES",
    "check_body",
    "check_field",
    "check_messages",
]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_PART_TYPES = {
    "user": frozenset({"text", "image_url", "input_audio", "file"}),
    "system": frozenset({"text"}),
    "developer": frozenset({"text"}),
    "assistant": frozenset({"text", "refusal"}),
    "tool": frozenset({"text"}),
}
_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
_TIERS = frozenset({"auto", "default", "flex", "scale", "priority", "fast"})
"""``reasoning_effort`` and ``service_tier`` as the official SDK's types say them
(openai 3.57: a value one model refuses is that model's 400 to say, not ours)."""


def _is_object(value: object) -> TypeGuard[Mapping[str, Any]]:
    """A JSON object: a dict (checked first: the ABC check costs ~1 us) or a mapping."""
    return type(value) is dict or isinstance(value, Mapping)


def check_field(name: str, value: Any) -> None:
    """Refuse, naming the field, a value the reference does not allow for ``name``
    (one of ``FIELDS``; None is always allowed: the field is then not sent)."""
    if value is not None:
        _FIELDS[name](value, name)


def check_body(body: Mapping[str, Any]) -> None:
    """Refuse, naming the field, what the Chat Completions reference does not allow."""
    if not _is_object(body):
        raise InvalidRequestError(f"a request body must be an object, got {type(body).__name__}")
    unknown = [k for k in body if k not in _FIELDS]
    if unknown:
        raise InvalidRequestError(
            f"{min(unknown)}: not a Chat Completions field (provider-specific fields go in "
            "extra_body)"
        )
    for name, value in body.items():
        if value is not None:
            _FIELDS[name](value, name)
    if not body.get("messages"):
        raise InvalidRequestError("messages: at least one message is needed")


def check_messages(value: Any, where: str = "messages") -> None:
    """Refuse, naming the field, a message list the reference does not allow."""
    _list(value, where)
    for i, m in enumerate(value):
        at = f"{where}[{i}]"
        if not _is_object(m):
            raise InvalidRequestError(f"{at}: must be an object")
        role = m.get("role")
        if not _named(role, ROLES):
            raise InvalidRequestError(f"{at}.role: must be one of {sorted(ROLES)}, got {role!r}")
        allowed = {"role", "content", "name"}
        if role == "assistant":
            allowed |= {"tool_calls", "refusal", "audio", *REASONING_BACK, *ANSWER_ONLY}
            _assistant(m, at)
        if role == "tool":
            allowed.add("tool_call_id")
            _text(m.get("tool_call_id"), f"{at}.tool_call_id")
        extra = [k for k in m if k not in allowed]
        if extra:
            raise InvalidRequestError(f"{at}.{min(extra)}: not a field of a {role} message")
        content = m.get("content")
        if content is None:
            if role != "assistant" or not m.get("tool_calls"):
                raise InvalidRequestError(f"{at}.content: needed")
        elif not isinstance(content, str):
            _parts(content, f"{at}.content", _PART_TYPES[role])
        if m.get("name") is not None:
            _text(m["name"], f"{at}.name")


ANSWER_ONLY = frozenset({"annotations", "function_call", "parsed"})
"""What an answer's message carries that the SDKs send back as it came (OpenAI's guide
appends ``completion.choices[0].message`` to the next turn's messages: ``annotations``
is in every one, ``parsed`` in one ``parse()`` read, ``function_call`` null): taken and
not sent on, as it says what the answer was, not what is asked (refused, the guide's
second turn was a 400; found by a hunt)."""

REASONING_BACK = frozenset({"reasoning_content", "thinking_blocks"})
"""An assistant turn's reasoning, as its answer said it: ``reasoning_content`` (a
reasoning model's thinking as text: DeepSeek's thinking mode wants it back in a tool
loop) and ``thinking_blocks`` (a Claude model's, signed). Kept with the turn; a model
is sent what it takes (``ModelSettings.sends_back``; a Claude model its blocks)."""

THINKING_BLOCK_TYPES = frozenset({"thinking", "redacted_thinking"})
"""The types of an assistant turn's ``thinking_blocks`` (LiteLLM's name for them):
Anthropic's extended thinking's content blocks, as a Claude model answered them,
signed, to be sent back as they came."""


def _thinking_blocks(value: Any, where: str) -> None:
    _list(value, where)
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        _object(block, at)
        kind = block.get("type")
        if kind == "thinking":
            if not isinstance(block.get("thinking"), str):  # may be "": its signature counts
                raise InvalidRequestError(f"{at}.thinking: must be a string")
            _text(block.get("signature"), f"{at}.signature")
        elif kind == "redacted_thinking":
            _text(block.get("data"), f"{at}.data")
        else:
            raise InvalidRequestError(
                f"{at}.type: must be one of {sorted(THINKING_BLOCK_TYPES)}, got {kind!r}"
            )


def _assistant(m: Mapping[str, Any], at: str) -> None:
    """An assistant turn's own fields: what the answer said, its thinking, its calls."""
    _answer_only(m, at)
    blocks = m.get("thinking_blocks")
    if blocks is not None:
        _thinking_blocks(blocks, f"{at}.thinking_blocks")
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise InvalidRequestError(f"{at}.reasoning_content: must be a string")
    calls = m.get("tool_calls")
    if calls is not None:
        _list(calls, f"{at}.tool_calls")
    for j, call in enumerate(calls or ()):
        _tool_call(call, f"{at}.tool_calls[{j}]")


def _answer_only(m: Mapping[str, Any], at: str) -> None:
    annotations = m.get("annotations")
    if annotations is not None:
        _list(annotations, f"{at}.annotations")
    if m.get("function_call") is not None:
        raise InvalidRequestError(
            f"{at}.function_call: the legacy function call is not supported: use tool_calls"
        )


def _parts(value: Any, where: str, allowed: frozenset[str]) -> None:
    _list(value, where)
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        kind = part.get("type") if _is_object(part) else None
        if not _named(kind, allowed):
            raise InvalidRequestError(f"{at}.type: must be one of {sorted(allowed)}, got {kind!r}")
        inner = part.get(kind)
        if kind in ("text", "refusal"):
            _text(inner, f"{at}.{kind}")
        elif kind == "image_url":
            _object(inner, f"{at}.image_url")
            _text(inner.get("url"), f"{at}.image_url.url")
            if inner.get("detail", "auto") not in ("auto", "low", "high"):
                raise InvalidRequestError(f"{at}.image_url.detail: must be auto, low or high")
        elif kind == "input_audio":
            _object(inner, f"{at}.input_audio")
            _text(inner.get("data"), f"{at}.input_audio.data")
            if inner.get("format") not in ("wav", "mp3"):
                raise InvalidRequestError(f"{at}.input_audio.format: must be wav or mp3")
        else:  # file
            _object(inner, f"{at}.file")
            if not (inner.get("file_id") or inner.get("file_data")):
                raise InvalidRequestError(f"{at}.file: needs a file_id or file_data")


def _tool_call(call: Any, where: str) -> None:
    _object(call, where)
    if call.get("type", "function") != "function":
        raise InvalidRequestError(f"{where}.type: must be function")
    _text(call.get("id"), f"{where}.id")
    fn = call.get("function")
    _object(fn, f"{where}.function")
    _text(fn.get("name"), f"{where}.function.name")
    if not isinstance(fn.get("arguments"), str):
        raise InvalidRequestError(f"{where}.function.arguments: must be a JSON string")


def _tools(value: Any, where: str) -> None:
    _list(value, where)
    for i, tool in enumerate(value):
        at = f"{where}[{i}]"
        _object(tool, at)
        if tool.get("type") != "function":
            raise InvalidRequestError(f"{at}.type: must be function")
        fn = tool.get("function")
        _object(fn, f"{at}.function")
        _text(fn.get("name"), f"{at}.function.name")
        if fn.get("parameters") is not None:
            _object(fn["parameters"], f"{at}.function.parameters")


def _tool_choice(value: Any, where: str) -> None:
    if value in ("none", "auto", "required"):
        return
    fn = value.get("function") if _is_object(value) else None
    if not _is_object(fn) or value.get("type") != "function":
        raise InvalidRequestError(
            f"{where}: must be none, auto, required or {{type: function, function: {{name}}}}"
        )
    _text(fn.get("name"), f"{where}.function.name")


def _response_format(value: Any, where: str) -> None:
    _object(value, where)
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError(f"{where}.type: must be text, json_object or json_schema")
    if kind == "json_schema":
        schema = value.get("json_schema")
        _object(schema, f"{where}.json_schema")
        _text(schema.get("name"), f"{where}.json_schema.name")
        if schema.get("schema") is not None:
            _object(schema["schema"], f"{where}.json_schema.schema")
        if schema.get("strict") is not None and not isinstance(schema["strict"], bool):
            raise InvalidRequestError(f"{where}.json_schema.strict: must be true or false")


def _stop(value: Any, where: str) -> None:
    if isinstance(value, str):
        return
    _list(value, where)
    if not 1 <= len(value) <= 4 or not all(isinstance(s, str) for s in value):
        raise InvalidRequestError(f"{where}: must be a string or a list of 1 to 4 strings")


LOGIT_BIAS_TOKENS = 300
"""The most token ids a ``logit_bias`` may name (OpenAI's API takes no more)."""


def _logit_bias(value: Any, where: str) -> None:
    _object(value, where)
    if len(value) > LOGIT_BIAS_TOKENS:
        raise InvalidRequestError(
            f"{where}: at most {LOGIT_BIAS_TOKENS} token ids (OpenAI's limit), got {len(value)}"
        )
    for token, bias in value.items():
        if not _token_id(token) or not _number_in(bias, -100, 100):
            raise InvalidRequestError(f"{where}: token ids to numbers in -100..100")


def _token_id(token: object) -> bool:
    """A token id as a key: an int, or ASCII digits (not "²", not 4,000 of them)."""
    if isinstance(token, int):  # not made text: one of 5,000 digits cannot be
        return not isinstance(token, bool) and 0 <= token < 10**10
    text = str(token)
    return text.isascii() and text.isdigit() and len(text) <= 10


def _list(value: Any, where: str) -> None:
    if type(value) is not list and (
        not isinstance(value, Sequence) or isinstance(value, str | bytes)
    ):
        raise InvalidRequestError(f"{where}: must be a list")


def _object(value: Any, where: str) -> None:
    if not _is_object(value):
        raise InvalidRequestError(f"{where}: must be an object")


OWNED_BY_CALLBOARD = frozenset(
    {"model", "messages", "input", "stream", "stream_options", "encoding_format"}
)
"""What ``extra_body`` may not set: the body callboard sends is built with these (the
model it chose, the request's messages or texts, whether it streams, how it reads
vectors). A caller's ``{"stream": true}`` there made every answer unreadable, and
each unreadable answer counted against the model's breaker, which opened."""
RESERVED_BY = frozenset({"max_tokens", "max_completion_tokens", "n"})
"""What ``extra_body`` may not set either: a call's limiter tokens and budget are
reserved by them, so they are given as the request's own fields (an
``extra_body={"max_tokens": 2000}`` on a request reserving 16 spent 20x a budget)."""


def _extra_body(value: Any, where: str) -> None:
    _object(value, where)
    owned = sorted(OWNED_BY_CALLBOARD.intersection(value))
    if owned:
        raise InvalidRequestError(
            f"{where}.{owned[0]}: callboard sets it (the model it chose, the messages or "
            "texts, whether the call streams: cb.stream), extra_body may not"
        )
    reserved = sorted(RESERVED_BY.intersection(value))
    if reserved:
        raise InvalidRequestError(
            f"{where}.{reserved[0]}: give it as the request's own field, not in extra_body "
            "(the limiter and the budget reserve by it)"
        )


def _text(value: Any, where: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{where}: must be a non-empty string")


def _number_in(value: Any, low: float, high: float) -> bool:
    real = isinstance(value, int | float) and not isinstance(value, bool)
    # compared first: an int too large for a float is compared exactly, where
    # ``isfinite`` raised OverflowError on it (found by a hunt)
    return real and low <= value <= high and (isinstance(value, int) or math.isfinite(value))


def _ranged(low: float, high: float) -> Callable[[Any, str], None]:
    def check(value: Any, where: str) -> None:
        if not _number_in(value, low, high):
            raise InvalidRequestError(f"{where}: must be a number in {low:g}..{high:g}")

    return check


def _count(low: int, high: int) -> Callable[[Any, str], None]:
    def check(value: Any, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidRequestError(f"{where}: must be an integer in {low}..{high}")

    return check


def _named(value: Any, allowed: frozenset[str]) -> TypeGuard[str]:
    """Whether ``value`` is one of the names ``allowed`` (a list or an object is not, and
    is no key to look up: unhashable)."""
    return isinstance(value, str) and value in allowed


def _one_of(allowed: frozenset[str]) -> Callable[[Any, str], None]:
    def check(value: Any, where: str) -> None:
        if not _named(value, allowed):
            raise InvalidRequestError(f"{where}: must be one of {sorted(allowed)}")

    return check


def _is(kind: type, what: str) -> Callable[[Any, str], None]:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise InvalidRequestError(f"{where}: must be {what}")

    return check


def _thinking(value: Any, where: str) -> None:
    """Anthropic's extended thinking (``{"type": "enabled", "budget_tokens": N}``,
    ``{"type": "adaptive"}``...): its form is the provider's to judge, but for its type."""
    _object(value, where)
    _text(value.get("type"), f"{where}.type")


_FIELDS: dict[str, Callable[[Any, str], None]] = {
    "model": _text,
    "messages": check_messages,
    "max_tokens": _count(1, 10_000_000),
    "max_completion_tokens": _count(1, 10_000_000),
    "temperature": _ranged(0, 2),
    "top_p": _ranged(0, 1),
    "frequency_penalty": _ranged(-2, 2),
    "presence_penalty": _ranged(-2, 2),
    "logit_bias": _logit_bias,
    "logprobs": _is(bool, "true or false"),
    "top_logprobs": _count(0, 20),
    "n": _count(1, 128),
    "seed": _count(-(2**63), 2**63 - 1),
    "stop": _stop,
    "user": _text,
    "service_tier": _one_of(_TIERS),
    "reasoning_effort": _one_of(_EFFORTS),
    "thinking": _thinking,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _is(bool, "true or false"),
    "response_format": _response_format,
    "stream": _is(bool, "true or false"),
    "stream_options": _object,
    "extra_body": _extra_body,
}
"""Every field callboard passes through, and its check: OpenAI's Chat Completions
fields, and ``thinking``, Anthropic's extended thinking, which only a model of
Anthropic's dialect is sent (a fallback of another goes on without it: given in
``extra_body``, it went to every model, and OpenAI's API refused it)."""
FIELDS = frozenset(_FIELDS)
"""The Chat Completions fields callboard knows (another dialect refuses any other)."""
