"""OpenAI's Chat Completions wire, sans-IO: the request body checked field by field, and
a stream's chunks assembled into the answer.

Theory of operation
-------------------
callboard's own wire is this one: a request is a Chat Completions body, and
other dialects (``wire.anthropic``) translate from it and back to its
``chat.completion`` answer.

* ``check_body(body)`` checks every field OpenAI's API reference lists, by
  the reference's types and ranges, and refuses a field it does not know
  unless it sits in ``extra_body`` (provider-specific fields go there, as in
  the official SDK). Each refusal is an ``InvalidRequestError`` naming the
  field (``messages[2].tool_calls[0].function.arguments``), so a caller sees
  at submit what the provider would have answered with a 400 after queueing.
* ``ChunkAssembler`` folds ``chat.completion.chunk`` objects (a streamed
  answer, one per server-sent event; ``[DONE]`` is the caller's to stop at)
  into the ``chat.completion`` the same call would have answered unstreamed:
  the content and refusal concatenated, tool calls gathered by their
  ``index`` (id and name from their first fragment, arguments concatenated),
  logprobs appended, the finish reason and the usage (the last chunk's, with
  ``stream_options.include_usage``) kept; one assembly per choice index.

What must hold: ``check_body`` accepts every body the reference allows and
changes none; the assembled answer of a stream equals, field for field, the
unstreamed answer of the same completion. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from callboard.messages import InvalidRequestError

__all__ = ["FIELDS", "ROLES", "ChunkAssembler", "check_body"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_PART_TYPES = {
    "user": frozenset({"text", "image_url", "input_audio", "file"}),
    "system": frozenset({"text"}),
    "developer": frozenset({"text"}),
    "assistant": frozenset({"text", "refusal"}),
    "tool": frozenset({"text"}),
}
_EFFORTS = frozenset({"minimal", "low", "medium", "high"})
_TIERS = frozenset({"auto", "default", "flex", "scale", "priority"})


def check_body(body: Mapping[str, Any]) -> None:
    """Refuse, naming the field, what the Chat Completions reference does not allow."""
    if not isinstance(body, Mapping):
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


def _messages(value: Any, where: str) -> None:
    _list(value, where)
    for i, m in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"{at}: must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{at}.role: must be one of {sorted(ROLES)}, got {role!r}")
        allowed = {"role", "content", "name"}
        if role == "assistant":
            allowed |= {"tool_calls", "refusal", "audio"}
            for j, call in enumerate(m.get("tool_calls") or ()):
                _tool_call(call, f"{at}.tool_calls[{j}]")
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


def _parts(value: Any, where: str, allowed: frozenset[str]) -> None:
    _list(value, where)
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in allowed:
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
    fn = value.get("function") if isinstance(value, Mapping) else None
    if not isinstance(fn, Mapping) or value.get("type") != "function":
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


def _logit_bias(value: Any, where: str) -> None:
    _object(value, where)
    for token, bias in value.items():
        if not str(token).isdigit() or not _number_in(bias, -100, 100):
            raise InvalidRequestError(f"{where}: token ids to numbers in -100..100")


def _list(value: Any, where: str) -> None:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise InvalidRequestError(f"{where}: must be a list")


def _object(value: Any, where: str) -> None:
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{where}: must be an object")


def _text(value: Any, where: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{where}: must be a non-empty string")


def _number_in(value: Any, low: float, high: float) -> bool:
    real = isinstance(value, int | float) and not isinstance(value, bool)
    return real and math.isfinite(value) and low <= value <= high


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


def _one_of(allowed: frozenset[str]) -> Callable[[Any, str], None]:
    def check(value: Any, where: str) -> None:
        if value not in allowed:
            raise InvalidRequestError(f"{where}: must be one of {sorted(allowed)}")

    return check


def _is(kind: type, what: str) -> Callable[[Any, str], None]:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise InvalidRequestError(f"{where}: must be {what}")

    return check


_FIELDS: dict[str, Callable[[Any, str], None]] = {
    "model": _text,
    "messages": _messages,
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
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _is(bool, "true or false"),
    "response_format": _response_format,
    "stream": _is(bool, "true or false"),
    "stream_options": _object,
    "extra_body": _object,
}
"""Every field callboard passes through, and its check."""
FIELDS = frozenset(_FIELDS)
"""The Chat Completions fields callboard knows (another dialect refuses any other)."""


# -- streams --------------------------------------------------------------------------------


class ChunkAssembler:
    """``chat.completion.chunk`` objects in, the ``chat.completion`` they make out."""

    def __init__(self) -> None:
        self._head: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._usage: dict[str, Any] | None = None

    def feed(self, chunk: Mapping[str, Any]) -> None:
        """Fold one chunk in (its choices' deltas, and its usage if it has one)."""
        if not self._head:
            self._head = {k: chunk.get(k) for k in ("id", "model", "created", "system_fingerprint")}
        if chunk.get("usage"):
            self._usage = dict(chunk["usage"])
        for choice in chunk.get("choices") or ():
            self._fold(choice)

    def _fold(self, choice: Mapping[str, Any]) -> None:
        index = int(choice.get("index", 0))
        into = self._choices.setdefault(
            index, {"role": "assistant", "content": [], "refusal": [], "calls": {}, "lp": []}
        )
        delta = choice.get("delta") or {}
        if delta.get("content"):
            into["content"].append(delta["content"])
        if delta.get("refusal"):
            into["refusal"].append(delta["refusal"])
        for call in delta.get("tool_calls") or ():
            slot = into["calls"].setdefault(
                int(call.get("index", 0)), {"id": None, "name": None, "arguments": []}
            )
            fn = call.get("function") or {}
            slot["id"] = slot["id"] or call.get("id")
            slot["name"] = slot["name"] or fn.get("name")
            if fn.get("arguments"):
                slot["arguments"].append(fn["arguments"])
        logprobs = choice.get("logprobs")
        if logprobs and logprobs.get("content"):
            into["lp"].extend(logprobs["content"])
        if choice.get("finish_reason") is not None:
            into["finish_reason"] = choice["finish_reason"]

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
            if c["calls"]:
                message["tool_calls"] = [
                    {
                        "id": s["id"],
                        "type": "function",
                        "function": {"name": s["name"], "arguments": "".join(s["arguments"])},
                    }
                    for _, s in sorted(c["calls"].items())
                ]
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "finish_reason": c.get("finish_reason"),
            }
            if c["lp"]:
                choice["logprobs"] = {"content": c["lp"]}
            choices.append(choice)
        answer = {**self._head, "object": "chat.completion", "choices": choices}
        if self._usage is not None:
            answer["usage"] = self._usage
        return answer
