"""JSON forms of requests and results, for the durable ledger and the batch files,
and the digest that tells whether a request changed.

What must hold: ``request_from_json(request_to_json(r)) == r`` and likewise for
results (a request's metadata is plain JSON: ``Request`` refuses any other; a value
in a result that JSON cannot hold is stored as its ``repr``, never silently dropped).
Text that does not decode (a damaged row) raises ``CodecError``, never a bare
``KeyError`` or ``JSONDecodeError``. ``request_digest`` depends only on what shapes the answer.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

from callboard.messages import (
    Billed,
    CallboardError,
    Cancelled,
    ChatMessage,
    Choice,
    Completed,
    Expired,
    Failed,
    FailureReason,
    Priority,
    Rejected,
    RejectReason,
    Request,
    Result,
    ToolCall,
    Usage,
)

RESULT_TYPES: dict[str, type[Result]] = {
    cls.__name__: cls for cls in (Completed, Failed, Expired, Cancelled, Rejected)
}


class CodecError(CallboardError):
    """Stored text is not the JSON form of a request or a result (a damaged record)."""


def request_digest(request: Request) -> str:
    """The sha256 (hex) of what ``request`` asks and of whom, not when or at what
    priority (deadline, priority, metadata, budget tag and key leave it as it was)."""
    data: dict[str, Any] = {
        "messages": [_digest_turn(m) for m in request.messages],
        "model": request.model,
        "route": request.route,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
    }
    if request.options:  # absent when empty: digests of plain requests stay as they were
        data["options"] = request.options
    if request.input is not None:
        data["input"] = request.input
    if request.extra_headers:  # a beta named there changes the answer
        data["extra_headers"] = request.extra_headers
    text = json.dumps(data, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _digest_turn(m: ChatMessage) -> Any:
    turn = m.wire()
    return [m.role, m.content] if len(turn) == 2 else turn


def request_to_json(request: Request) -> str:
    data: dict[str, Any] = {
        "messages": [m.wire() for m in request.messages],
        "priority": request.priority.name,
        "model": request.model,
        "route": request.route,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "deadline_s": request.deadline_s,
        "metadata": dict(request.metadata),
        "idempotency_key": request.idempotency_key,
        "budget_tag": request.budget_tag,
        "options": request.options,
        "input": request.input,
    }
    if request.models_allowed is not None:
        data["models_allowed"] = sorted(request.models_allowed)
    if request.extra_headers:  # absent when empty: stored requests read as they did
        data["extra_headers"] = request.extra_headers
    return json.dumps(data, default=_json_default, separators=(",", ":"))


def _json_default(value: Any) -> Any:
    """What plain JSON cannot hold: a tool call or a choice as its fields; anything else
    (a metadata value that is not JSON) as its repr."""
    if isinstance(value, ToolCall | Choice):
        return dataclasses.asdict(value)
    return repr(value)


def request_from_json(text: str) -> Request:
    """Raises ``CodecError`` if ``text`` is not a request's JSON form."""
    try:
        data: dict[str, Any] = json.loads(text)
        data["messages"] = tuple(ChatMessage(**m) for m in data["messages"])
        data["options"] = data.get("options") or {}
        if data.get("input") is not None:
            data["input"] = tuple(data["input"])
        data["priority"] = Priority[data["priority"]]
        if data.get("models_allowed") is not None:
            data["models_allowed"] = frozenset(data["models_allowed"])
        return Request(**data)
    except (ValueError, KeyError, TypeError, CallboardError) as exc:
        raise CodecError(f"not a request's JSON form ({_why(exc)})") from exc


def result_to_json(result: Result) -> str:
    data: dict[str, Any] = {"type": type(result).__name__}
    for f in dataclasses.fields(result):
        value = getattr(result, f.name)
        if isinstance(value, Usage):
            value = dataclasses.asdict(value)
        elif isinstance(value, Priority):
            value = value.name
        elif isinstance(value, FailureReason | RejectReason):
            value = value.value
        elif f.name == "metadata":
            value = dict(value)
        elif f.name == "billed_before":
            if not value:  # absent when none: stored results read as they did
                continue
            value = [dataclasses.asdict(billed) for billed in value]
        elif f.name in _ABSENT_AT_DEFAULT and value == _ABSENT_AT_DEFAULT[f.name]:
            continue
        data[f.name] = value
    return dumps(data, default=_json_default, separators=(",", ":"))


def dumps(data: Any, **options: Any) -> str:
    """``json.dumps(data, **options)``, JSON whatever ``data`` holds: a float past a
    double's range (a provider's ``1e400``, which Python reads as an infinity) is
    written as the largest double of its sign (``finite``). ``json.dumps`` wrote
    ``Infinity``, which no other JSON reader takes: SQLite's ``json_valid`` neither,
    and a ledger holding such a result was "damaged" at the next run (found by a
    hunt). Costs nothing more when there is none."""
    encode = functools.partial(json.dumps, allow_nan=False, **options)
    return finite_json(encode, data, options.get("default"))


def finite_json(
    encode: Callable[[Any], str], value: Any, default: Callable[[Any], Any] | None = None
) -> str:
    """``encode(value)`` by an encoder that refuses non-finite numbers (``allow_nan``
    false), and, if ``value`` holds one, ``encode(finite(value, default))``: nothing
    more is done when it holds none."""
    try:
        return encode(value)
    except ValueError as exc:
        if "Out of range float" not in str(exc):
            raise
        return encode(finite(value, default))


def finite(value: Any, default: Callable[[Any], Any] | None = None) -> Any:
    """``value`` with each infinite float as the largest double of its sign, each NaN as
    null, in the mappings and sequences it holds (and in what ``default``, the
    encoder's, makes of what JSON cannot hold)."""
    if isinstance(value, float):
        if math.isinf(value):
            return math.copysign(sys.float_info.max, value)
        return None if math.isnan(value) else value
    if isinstance(value, Mapping):
        return {k: finite(v, default) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v, default) for v in value]
    if default is not None and not isinstance(value, str | int | bool | type(None)):
        return finite(default(value), default)
    return value


_ABSENT_AT_DEFAULT: dict[str, Any] = {"reasoning": None, "thinking_blocks": (), "refused": 0}
"""Result fields newer than the ledgers' first rows, written only when they say
something: a row without them reads in the callboard before them (written always, a
rollback of one release read every row as damage and called each again; found by a
hunt)."""


def result_from_json(text: str) -> Result:
    """Raises ``CodecError`` if ``text`` is not a result's JSON form."""
    try:
        data: dict[str, Any] = json.loads(text)
        cls = RESULT_TYPES[data.pop("type")]
        data["usage"] = Usage(**data["usage"])
        data["priority"] = Priority[data["priority"]]
        if "billed_before" in data:
            data["billed_before"] = tuple(
                Billed(**{**b, "usage": Usage(**b["usage"])}) for b in data["billed_before"]
            )
        if cls is Completed:
            data["tool_calls"] = _tool_calls(data.get("tool_calls", ()))
            data["thinking_blocks"] = tuple(data.get("thinking_blocks", ()))
            data["choices"] = tuple(
                Choice(**{**c, "tool_calls": _tool_calls(c.get("tool_calls", ()))})
                for c in data.get("choices", ())
            )
        if cls is Failed:
            data["reason"] = FailureReason(data["reason"])
        elif cls is Rejected:
            data["reason"] = RejectReason(data["reason"])
        return cls(**data)
    except (ValueError, KeyError, TypeError, AttributeError, CallboardError) as exc:
        raise CodecError(f"not a result's JSON form ({_why(exc)})") from exc


def _tool_calls(calls: list[dict[str, Any]]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(**c) for c in calls)


def _why(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"no {exc}"
    return str(exc) or type(exc).__name__
