"""OpenAI's API as the gateway speaks it: request bodies in, response bodies out.

Theory of operation
-------------------
``chat_call(body)`` reads a ``POST /v1/chat/completions`` body into what
``System.submit`` / ``System.stream`` take: the Chat Completions fields callboard
knows (``callboard.messages.FIELDS``) as they are, ``stream`` and
``stream_options`` for the gateway to act on, ``priority`` (callboard's own,
where the SDK's ``extra_body`` puts it: at the body's top level) and every other
field into ``extra_body``, sent on to the provider untouched. (The SDK merges
``extra_body`` into the top level, so at the gateway a provider's own field
cannot be told from a misspelt one: the provider judges it, as it would
without the gateway.) The values themselves are checked where every request is
checked: ``Request`` (``InvalidRequestError`` naming the field).

``completion_body``, ``chunk``, ``usage_chunk``, ``embeddings_body`` and
``models_body`` are the answers, in OpenAI's shapes. A completion from a model
that speaks OpenAI's wire (``openai`` or ``azure``) is answered with the
provider's body as received (``Completed.raw``), so fields callboard does not
model (``system_fingerprint``, ``service_tier``, ``logprobs``...) reach the
client; another dialect's answer is built from the result.

``encode`` is the one JSON encoder (compact; callboard's frozen mappings and
tuples written as objects and arrays).

Pure: no I/O, no clock (``created`` is given).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import Any

from callboard.messages import (
    FIELDS,
    MAX_INPUTS,
    Choice,
    Completed,
    EmbeddingResult,
    InvalidRequestError,
    Priority,
    StreamDelta,
    Usage,
    token_ids,
)
from callboard.runtime.codec import finite_json
from callboard.wire.openai import normal_completion

from callboard._embed import texts_of

__all__ = [
    "ChatCall",
    "EmbedCall",
    "chat_call",
    "chunk",
    "completion_body",
    "embed_call",
    "embeddings_body",
    "embeddings_json",
    "encode",
    "encode_pieces",
    "models_body",
    "plain",
    "usage_body",
    "usage_chunk",
]

GATEWAY_FIELDS = frozenset({"model", "messages", "stream", "stream_options", "priority"})
"""What the gateway reads itself; the other known fields go to ``submit`` as they are."""
_PASSED = FIELDS - GATEWAY_FIELDS - {"extra_body"}
EMBEDDING_FIELDS = frozenset(
    {"input", "model", "dimensions", "encoding_format", "user", "priority"}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatCall:
    """A chat completions body, read."""

    name: str
    """The ``model`` it names: a model, a route (tier) or ``auto``."""
    messages: Any
    fields: dict[str, Any]
    """``submit``'s keywords: every other Chat Completions field, and ``extra_body``."""
    stream: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: end the stream with a usage chunk."""
    priority: Priority | None = None
    """The body's own ``priority``, if it has one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbedCall:
    """An embeddings body, read."""

    name: str
    input: Any
    fields: dict[str, Any]
    """``embed``'s keywords: ``dimensions``, ``user``, ``extra_body``."""
    base64: bool
    """The client asked for base64 vectors (the OpenAI SDK does, unless told not to)."""
    priority: Priority | None = None


def chat_call(body: object) -> ChatCall:
    """Read a chat completions body (``InvalidRequestError`` naming what is wrong)."""
    t = _object(body)
    if "extra_body" in t:
        raise InvalidRequestError(
            "extra_body: not a field of the body (the SDK's extra_body fields are sent at "
            "the top level of the body; send them there)"
        )
    if "messages" not in t:
        raise InvalidRequestError("messages: required")
    if not isinstance(t["messages"], list):  # submit() would take a string as a prompt
        kind = "a string" if isinstance(t["messages"], str) else type(t["messages"]).__name__
        raise InvalidRequestError(f"messages: must be an array of messages, got {kind}")
    stream = t.get("stream")
    stream = False if stream is None else stream  # {} or 0: refused, not taken as false
    if not isinstance(stream, bool):
        raise InvalidRequestError(f"stream: must be true or false, got {stream!r}")
    options = t.get("stream_options")
    if options is not None and not stream:
        raise InvalidRequestError("stream_options: only allowed with stream: true")
    if options is not None and not isinstance(options, Mapping):
        raise InvalidRequestError("stream_options: must be an object")
    include_usage = bool(options and options.get("include_usage"))
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in t.items():
        if key in _PASSED:
            fields[key] = value
        elif key not in GATEWAY_FIELDS:
            extra[key] = value
    if extra:
        fields["extra_body"] = extra
    return ChatCall(
        name=_model(t),
        messages=t["messages"],
        fields=fields,
        stream=stream,
        include_usage=include_usage,
        priority=_priority(t),
    )


def embed_call(body: object) -> EmbedCall:
    """Read an embeddings body (``InvalidRequestError`` naming what is wrong)."""
    t = _object(body)
    if "input" not in t:
        raise InvalidRequestError("input: required")
    texts = t["input"]
    if isinstance(texts, list) and len(texts) > MAX_INPUTS and token_ids(texts) is None:
        # as OpenAI's API: one request of a few bytes a text could otherwise ask for
        # gigabytes of vectors; one list of token ids is one input (of up to 8,192
        # tokens: 2,049 were refused as 2,049 texts; found by a hunt)
        raise InvalidRequestError(f"input: at most {MAX_INPUTS} texts a request, got {len(texts)}")
    texts_of(texts, "input")  # each a text or a list of token ids, named as the client did
    fmt = t.get("encoding_format")
    if fmt not in (None, "float", "base64"):
        raise InvalidRequestError(f"encoding_format: must be float or base64, got {fmt!r}")
    fields: dict[str, Any] = {k: t[k] for k in ("dimensions", "user") if k in t}
    extra = {k: v for k, v in t.items() if k not in EMBEDDING_FIELDS}
    if extra:
        fields["extra_body"] = extra
    return EmbedCall(
        name=_model(t),
        input=t["input"],
        fields=fields,
        base64=fmt == "base64",
        priority=_priority(t),
    )


def _object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidRequestError(f"the body must be a JSON object, got {_json_kind(body)}")
    return body


def _model(t: Mapping[str, Any]) -> str:
    name = t.get("model")
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequestError("model: required, a model or route name (or auto)")
    return name


def _priority(t: Mapping[str, Any]) -> Priority | None:
    value = t.get("priority")
    return None if value is None else Priority.parse(value)


def _json_kind(value: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


# -- answers ---------------------------------------------------------------------------


def completion_body(result: Completed, *, call_id: str, created: int, raw_ok: bool) -> Any:
    """The ``chat.completion`` of ``result``: the provider's own body when ``raw_ok``
    (its model speaks OpenAI's wire) and it has one, else built from the result."""
    raw = result.raw
    if raw_ok and isinstance(raw, Mapping) and raw.get("object") == "chat.completion":
        return normal_completion(raw)  # in OpenAI's shapes: an SDK's caller reads them
    choices = [_choice_of(c.index, c) for c in result.choices] or [_choice_of(0, result)]
    return {
        "id": call_id,
        "object": "chat.completion",
        "created": created,
        "model": result.model,
        "choices": choices,
        "usage": usage_body(result.usage),
    }


def _choice_of(index: int, answer: Choice | Completed) -> dict[str, Any]:
    """One of ``choices``: the first is the result itself (``Choice`` and ``Completed``
    carry the same fields)."""
    content, tool_calls, refusal = answer.content, answer.tool_calls, answer.refusal
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not (tool_calls or refusal) else None,
        "refusal": refusal,
    }
    if tool_calls:
        message["tool_calls"] = [c.wire() for c in tool_calls]
    if isinstance(answer, Completed) and answer.reasoning:  # as DeepSeek's say it
        message["reasoning_content"] = answer.reasoning
    if isinstance(answer, Completed) and answer.thinking_blocks:  # as LiteLLM's say them
        message["thinking_blocks"] = [dict(b) for b in answer.thinking_blocks]
    return {
        "index": index,
        "message": message,
        "logprobs": answer.logprobs,
        "finish_reason": answer.finish_reason or "stop",
    }


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's ``usage`` object (with cached and reasoning tokens in their details)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
            "cache_write_1h_tokens": usage.cache_write_1h_tokens,
        },
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def chunk(
    delta: StreamDelta,
    *,
    call_id: str,
    created: int,
    model: str,
    first: bool,
    include_usage: bool,
) -> dict[str, Any]:
    """The ``chat.completion.chunk`` of one delta (``first``: the choice's first, which
    names the role)."""
    body: dict[str, Any] = {}
    if first:
        body["role"] = "assistant"
    if delta.text:
        body["content"] = delta.text
    elif first:  # a choice that opens with a tool call or a refusal has no content
        body["content"] = None if delta.tool_calls or delta.refusal else ""
    if delta.refusal:
        body["refusal"] = delta.refusal
    if delta.reasoning:  # as DeepSeek's and vLLM's streams say it
        body["reasoning_content"] = delta.reasoning
    if delta.thinking_blocks:  # a Claude model's, signed: as LiteLLM's streams say them
        body["thinking_blocks"] = [dict(b) for b in delta.thinking_blocks]
    if delta.tool_calls:
        body["tool_calls"] = [_tool_delta(d) for d in delta.tool_calls]
    event: dict[str, Any] = {
        "id": call_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": delta.choice,
                "delta": body,
                "logprobs": delta.logprobs,
                "finish_reason": delta.finish_reason,
            }
        ],
    }
    if include_usage:
        event["usage"] = None
    return event


def _tool_delta(d: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"index": d.index}
    function: dict[str, Any] = {"arguments": d.arguments}
    if d.id is not None:
        out["id"] = d.id
        out["type"] = "function"
    if d.name is not None:
        function["name"] = d.name
    out["function"] = function
    return out


def usage_chunk(usage: Usage, *, call_id: str, created: int, model: str) -> dict[str, Any]:
    """The last chunk of a stream that asked ``include_usage``: no choices, the usage."""
    return {
        "id": call_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(usage),
    }


def embeddings_body(result: EmbeddingResult, *, name: str) -> dict[str, Any]:
    """The ``list`` of ``embedding`` objects of an ``ok`` result, in input order (base64
    strings when the result kept them)."""
    vectors: list[Any] = (
        result.vectors_base64 if result.vectors_base64 is not None else result.vectors
    )
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)
        ],
        "model": result.model or name,
        "usage": {
            "prompt_tokens": result.usage.prompt_tokens,
            "total_tokens": result.usage.prompt_tokens,
        },
    }


def embeddings_json(result: EmbeddingResult, *, name: str) -> bytes:
    """``encode(embeddings_body(result, name=name))``, built a vector at a time: each
    vector's JSON is one short call into C, so a thread that builds a large answer lets
    the others run between them (the whole in one call held the interpreter for
    seconds: 2.6 s for 2,048 vectors of 1,536 floats)."""
    body = embeddings_body(result, name=name)
    items = b",".join([encode(item) for item in body.pop("data")])
    del body["object"]  # written first, as OpenAI's order has it
    return b'{"object":"list","data":[' + items + b"]," + encode(body)[1:]


def models_body(names: list[tuple[str, str]], created: int) -> dict[str, Any]:
    """``GET /v1/models``: each ``(name, owner)``; routes are owned by ``callboard``."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": owner}
            for name, owner in names
        ],
    }


def plain(value: Any) -> Any:
    """``value`` as JSON can hold it: dataclasses and mappings as objects, sets sorted,
    enums by value, ``Decimal`` as a string (exact)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [plain(v) for v in value]
        return items if isinstance(value, list | tuple) else sorted(items)
    if isinstance(value, Enum):
        return value.value
    return str(value) if isinstance(value, Decimal) else value


def _default(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


_ENCODER = json.JSONEncoder(
    separators=(",", ":"), ensure_ascii=False, default=_default, allow_nan=False
)


_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_default, allow_nan=False)


def encode_pieces(value: Any, depth: int = 5) -> bytes:
    """``encode(value)``, the same JSON, made a piece at a time: the objects and arrays
    down to ``depth`` are written here, and each value below them (one of a choice's
    logprobs: a token and its alternatives) in one short call into C. The whole in one
    call keeps the interpreter's lock throughout (a 57 MB answer: about 2 s), so a
    thread that encodes a large answer lets the others run only between pieces."""
    out: list[bytes] = []
    _pieces(value, depth, out)
    return b"".join(out)


def _pieces(value: Any, depth: int, out: list[bytes]) -> None:
    if depth > 0 and isinstance(value, Mapping) and all(type(k) is str for k in value):
        out.append(b"{")
        for i, (key, item) in enumerate(value.items()):
            out.append(b"," + encode(key) + b":" if i else encode(key) + b":")
            _pieces(item, depth - 1, out)
        out.append(b"}")
    elif depth > 0 and isinstance(value, list | tuple):
        out.append(b"[")
        for i, item in enumerate(value):
            if i:
                out.append(b",")
            _pieces(item, depth - 1, out)
        out.append(b"]")
    else:
        out.append(encode(value))


def encode(value: Any) -> bytes:
    """``value`` as compact JSON (UTF-8). A lone surrogate (which a provider's JSON
    may carry as an escape) goes back as the same escape: UTF-8 has no form for it. A
    number past a double's range (a provider's ``1e400``) goes as the largest double of
    its sign: it went as ``Infinity``, which a strict reader (JSON.parse, openai-node)
    refuses, the whole answer with it (found by a hunt)."""
    text = finite_json(_ENCODER.encode, value, _default)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return finite_json(_ASCII_ENCODER.encode, value, _default).encode("ascii")
