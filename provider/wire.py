"""OpenAI's wire for the simulated provider: Chat Completions requests in, answers and
stream chunks out.

Pure: bytes and dicts in, dicts and bytes out. Invariants: a body that
`parse_chat` accepts has a non-empty ``model`` and its Chat Completions fields
pass ``callboard.wire.openai.check_body`` (the reference's fields, types and
ranges); any other field is a provider-specific one (what a caller's
``extra_body`` puts at the top level), accepted and ignored, as
OpenAI-compatible servers do; a refusal is a `BadRequestError` whose ``param``
names the field, as OpenAI's 400 does;
the prompt size is `tokens.count_prompt_tokens`, the only rule, so what the
limits charge and what ``usage`` reports cannot disagree; a stream's chunks
assemble into exactly the answer the same plan gives unstreamed; error bodies
never carry request data (in particular never an API key).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from callboard.messages import InvalidRequestError
from callboard.provider.cache import MIN_TOKENS, STEP, Prefix, prefix_key
from callboard.provider.engine import Ask, Plan
from callboard.provider.limits import Window, format_duration
from callboard.provider.reply import (
    JSON_OBJECT_SCHEMA,
    PLAIN,
    Choice,
    Intent,
    Reply,
    Tool,
    UnknownToolError,
    compose,
)
from callboard.provider.sse import Stream, compact_bytes, data_event
from callboard.provider.tokens import count_prompt_tokens
from callboard.wire.openai import FIELDS, check_body

__all__ = [
    "REASONING_TOKENS",
    "BadRequestError",
    "ChatRequest",
    "call_id",
    "chat_stream",
    "completion_body",
    "completion_bytes",
    "count_prompt_tokens",
    "error_body",
    "finish_reason",
    "models_body",
    "parse_chat",
    "ratelimit_headers",
    "said",
    "usage_body",
]

REASONING_TOKENS: Mapping[str, int] = {
    "none": 0,
    "minimal": 0,
    "low": 32,
    "medium": 128,
    "high": 512,
    "xhigh": 1024,
    "max": 2048,
}
"""Hidden output per choice for each ``reasoning_effort`` (every value OpenAI's SDK
types name: ``xhigh`` answered a 500 with the server's ``KeyError``, retried, though
callboard takes it; found by a hunt)."""
_CHOICES: Mapping[str, Choice] = {"auto": "auto", "none": "none", "required": "required"}
_FIELD = re.compile(r"[A-Za-z_][\w.\[\]]*")
_FINGERPRINT = "fp_callboard"


class BadRequestError(ValueError):
    """The client sent a request we refuse with 400; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the provider needs from a chat request."""

    model: str
    ask: Ask
    reply: Reply
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    """The ``top_logprobs`` count when ``logprobs`` is asked for, else None."""
    service_tier: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.ask.prompt_tokens

    @property
    def max_tokens(self) -> int | None:
        return self.ask.max_tokens


def parse_chat(body: bytes) -> ChatRequest:
    """The chat request in ``body``, or `BadRequestError` saying what is wrong with it."""
    data = _object(body)
    model, messages = data.get("model"), data.get("messages")
    if not isinstance(model, str) or not model:
        raise BadRequestError("you must provide a model parameter", "model")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty array", "messages")
    keys = data.keys()
    if "extra_body" in keys:
        raise BadRequestError(
            "Unrecognized request argument supplied: extra_body (its fields go at the top "
            "level, as the official SDK sends them)",
            "extra_body",
        )
    try:
        check_body(data if keys <= _CHECKED else _only(data, _CHECKED))
    except InvalidRequestError as exc:
        raise _bad(exc) from None
    intent = _intent(data, messages)
    try:
        reply = _FILLER if intent is PLAIN else compose(intent)
    except ValueError as exc:  # SchemaError, UnknownToolError
        param = "tool_choice" if isinstance(exc, UnknownToolError) else _schema_param(data)
        raise BadRequestError(f"Invalid schema: {exc}", param) from None
    fmt = data.get("response_format")
    stream = data.get("stream") is True
    tokens = count_prompt_tokens(messages, tools=data.get("tools"), response_format=fmt)
    ask = Ask(
        tokens,
        _max_tokens(data),
        reply.fixed_tokens,
        reply.stop_at,
        data.get("n") or 1,
        _reasoning(data) if "reasoning_effort" in keys else 0,
        stream,
        _prefix(data, messages) if tokens >= MIN_TOKENS else None,
        counts_cap=True,
    )
    if keys <= _PLAIN:
        return ChatRequest(model, ask, reply, stream)
    options = data.get("stream_options")
    return ChatRequest(
        model,
        ask,
        reply,
        stream,
        stream and isinstance(options, dict) and bool(options.get("include_usage")),
        (data.get("top_logprobs") or 0) if data.get("logprobs") else None,
        data.get("service_tier"),
    )


def _prefix(data: Mapping[str, Any], messages: list[Any]) -> Prefix | None:
    """What OpenAI caches by itself: the conversation before its last message (the
    whole prompt if it has one message), from `MIN_TOKENS` on, in steps of `STEP`."""
    before = messages[:-1] or messages
    tools, fmt = data.get("tools"), data.get("response_format")
    tokens = count_prompt_tokens(before, tools=tools, response_format=fmt) // STEP * STEP
    if tokens < MIN_TOKENS:
        return None
    return Prefix(prefix_key([tools, fmt, before]), tokens)


def _only(data: Mapping[str, Any], names: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k in names}


_PLAIN = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stream"}
)
"""A body of only these fields needs no more reading than its size."""
_FILLER = compose(PLAIN)
_CHECKED = FIELDS - {"extra_body"}
"""The fields `check_body` holds to the reference (``extra_body`` is the SDK's word for
fields merged into the body, never a field a server receives)."""


def _object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError("We could not parse the JSON body of your request.") from exc
    if not isinstance(data, dict):
        raise BadRequestError("The request body must be a JSON object.")
    return data


def _bad(exc: InvalidRequestError) -> BadRequestError:
    """check_body's refusal (``where: why``) as OpenAI's 400 naming the param."""
    text = str(exc)
    where, colon, _ = text.partition(": ")
    return BadRequestError(text, where if colon and _FIELD.fullmatch(where) else None)


def _schema_param(data: Mapping[str, Any]) -> str:
    fmt = data.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        return "response_format.json_schema.schema"
    return "tools"


def _intent(data: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]) -> Intent:
    tools, fmt, stop = data.get("tools"), data.get("response_format"), data.get("stop")
    if not tools and not fmt and not stop:
        return PLAIN
    asked = data.get("tool_choice") or "auto"
    choice: Choice = "named" if isinstance(asked, Mapping) else _CHOICES[asked]
    named = asked["function"]["name"] if isinstance(asked, Mapping) else None
    schema = None
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        schema = fmt["json_schema"].get("schema") or {"type": "object"}
    elif isinstance(fmt, Mapping) and fmt.get("type") == "json_object":
        schema = JSON_OBJECT_SCHEMA
    return Intent(
        tools=tuple(
            Tool(t["function"]["name"], t["function"].get("parameters") or {"type": "object"})
            for t in tools or ()
        ),
        choice=choice,
        named=named,
        parallel=data.get("parallel_tool_calls") is True,
        after_tool=messages[-1].get("role") == "tool",
        schema=schema,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
    )


def _reasoning(data: Mapping[str, Any]) -> int:
    """The hidden output of the request's ``reasoning_effort``; a value OpenAI does
    not name is a 400 on ``reasoning_effort``, as OpenAI answers it."""
    effort = data["reasoning_effort"]
    if effort is None:
        return 0
    if not isinstance(effort, str) or effort not in REASONING_TOKENS:
        raise BadRequestError(
            f"Invalid value for 'reasoning_effort': {effort!r:.40}. Supported values are: "
            + ", ".join(repr(e) for e in REASONING_TOKENS),
            "reasoning_effort",
        )
    return REASONING_TOKENS[effort]


def _max_tokens(data: Mapping[str, Any]) -> int | None:
    value = data.get("max_completion_tokens")
    return data.get("max_tokens") if value is None else value


def error_body(
    message: str, kind: str, *, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def ratelimit_headers(windows: Iterable[Window]) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers (resets as Go durations: ``1.5s``, ``6m0s``)."""
    headers: dict[str, str] = {}
    for w in windows:
        headers[f"x-ratelimit-limit-{w.kind}"] = str(w.limit)
        headers[f"x-ratelimit-remaining-{w.kind}"] = str(w.remaining)
        headers[f"x-ratelimit-reset-{w.kind}"] = format_duration(w.reset_s)
    return headers


# -- answers --------------------------------------------------------------------------------


def finish_reason(plan: Plan, reply: Reply) -> str:
    """The plan's finish in OpenAI's words."""
    if plan.finish_reason == "length":
        return "length"
    return "tool_calls" if reply.calls else "stop"


def said(plan: Plan, reply: Reply) -> Reply:
    """What the model says under ``plan``: the reply cut by ``max_tokens``, or the words."""
    if reply.fixed_tokens is not None:
        return reply.cut(plan.completion_tokens) if plan.finish_reason == "length" else reply
    text = reply.words(plan.completion_tokens, stopped=plan.finish_reason == "stop_sequence")
    return Reply(text=text)


def call_id(seq: int, choice: int, index: int) -> str:
    """A tool call's id: ``call_`` and 24 characters, unique per answer."""
    return f"call_{seq:014x}{choice:05x}{index:05x}"


def usage_body(plan: Plan) -> dict[str, object]:
    completion = plan.output_tokens
    return {
        "prompt_tokens": plan.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": plan.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": plan.cache_read, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": plan.reasoning_tokens * plan.choices,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def completion_body(
    *, completion_id: str, model: str, created: int, plan: Plan, chat: ChatRequest, seq: int
) -> dict[str, object]:
    """A ``chat.completion`` object for ``chat`` answered under ``plan``."""
    answer = said(plan, chat.reply)
    finish = finish_reason(plan, chat.reply)
    choices = []
    for i in range(plan.choices):
        message: dict[str, Any] = {
            "role": "assistant",
            "content": answer.text,
            "refusal": None,
            "annotations": [],
        }
        if answer.calls:
            message["tool_calls"] = [
                {
                    "id": call_id(seq, i, j),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for j, c in enumerate(answer.calls)
            ]
        logprobs = None
        if chat.logprobs is not None:
            logprobs = {"content": _logprobs(answer.text, chat.logprobs), "refusal": None}
        choices.append(
            {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
        )
    body: dict[str, object] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(plan),
        "system_fingerprint": _FINGERPRINT,
    }
    if chat.service_tier is not None:
        body["service_tier"] = "default" if chat.service_tier == "auto" else chat.service_tier
    return body


def completion_bytes(
    *, completion_id: str, model: str, created: int, plan: Plan, chat: ChatRequest, seq: int
) -> bytes:
    """`completion_body` as compact JSON. A plain answer (one choice of text, no
    logprobs, no service tier) is spliced from bytes made once, byte for byte what
    encoding `completion_body` gives (its test holds that), at a fraction of the cost:
    the bench drives this path thousands of times a second."""
    if plan.choices != 1 or chat.reply.calls or chat.logprobs is not None or chat.service_tier:
        return compact_bytes(
            completion_body(
                completion_id=completion_id,
                model=model,
                created=created,
                plan=plan,
                chat=chat,
                seq=seq,
            )
        )
    return b"".join(
        (
            b'{"id":',
            compact_bytes(completion_id),
            b',"object":"chat.completion","created":',
            b"%d" % created,
            b',"model":',
            compact_bytes(model),
            b',"choices":[{"index":0,"message":{"role":"assistant","content":',
            compact_bytes(said(plan, chat.reply).text),
            b',"refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"',
            finish_reason(plan, chat.reply).encode(),
            b'"}],"usage":',
            _USAGE
            % (
                plan.prompt_tokens,
                plan.output_tokens,
                plan.prompt_tokens + plan.output_tokens,
                plan.cache_read,
                plan.reasoning_tokens,
            ),
            b',"system_fingerprint":"' + _FINGERPRINT.encode() + b'"}',
        )
    )


_USAGE = (
    b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,'
    b'"prompt_tokens_details":{"cached_tokens":%d,"audio_tokens":0},'
    b'"completion_tokens_details":{"reasoning_tokens":%d,"audio_tokens":0,'
    b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}'
)


def _tokens(text: str) -> list[str]:
    """``text`` as the model's tokens: words, each after the first with its space."""
    words = text.split(" ")
    return [words[0], *(" " + w for w in words[1:])] if text else []


def _logprobs(text: str | None, top: int) -> list[dict[str, Any]] | None:
    if text is None:
        return None
    return [_logprob(token, i, top) for i, token in enumerate(_tokens(text))]


def _logprob(token: str, i: int, top: int) -> dict[str, Any]:
    value = -round(0.01 + 0.1 * (i % 7), 4)
    alternatives = [
        {"token": alt, "logprob": round(value - 1.0 - k, 4), "bytes": list(alt.encode())}
        for k, alt in enumerate(_ALTERNATIVES[: max(0, top - 1)])
    ]
    entry = {"token": token, "logprob": value, "bytes": list(token.encode())}
    return {**entry, "top_logprobs": [entry, *alternatives][:top]}


_ALTERNATIVES = tuple(f" {w}" for w in ("a", "an", "one", "so", "it", "and", "of", "to") * 3)


# -- streams --------------------------------------------------------------------------------


def chat_stream(
    *, completion_id: str, model: str, created: int, plan: Plan, chat: ChatRequest, seq: int
) -> Stream:
    """The ``chat.completion.chunk`` events of ``chat`` answered under ``plan``, as OpenAI
    sends them: each choice's role delta; content (a token per chunk) or tool-call deltas
    (index, id and name, then argument fragments); each choice's finish; the usage chunk
    (empty ``choices``) with ``stream_options.include_usage``; ``[DONE]``."""
    head: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": _FINGERPRINT,
    }
    if chat.service_tier is not None:
        head["service_tier"] = "default" if chat.service_tier == "auto" else chat.service_tier
    answer = said(plan, chat.reply)
    chunks = _Chunks(head, chat.include_usage)
    first = [
        chunks.make(i, {"role": "assistant", "content": "" if answer.text is not None else None})
        for i in range(plan.choices)
    ]
    finish = finish_reason(plan, chat.reply)
    last = [chunks.make(i, {}, finish=finish) for i in range(plan.choices)]
    if chat.include_usage:
        last.append(data_event(compact_bytes({**head, "choices": [], "usage": usage_body(plan)})))
    last.append(b"data: [DONE]\n\n")
    body = _body(chunks, answer, plan.choices, chat.logprobs, seq)
    error = error_body("The server had an error while processing your request.", "server_error")
    return Stream(first, body, last, data_event(compact_bytes(error)))


def _body(
    chunks: _Chunks, answer: Reply, choices: int, logprobs: int | None, seq: int
) -> Iterator[bytes]:
    if answer.calls:
        for j, call in enumerate(answer.calls):
            for i in range(choices):
                start = {"index": j, "id": call_id(seq, i, j), "type": "function"}
                start["function"] = {"name": call.name, "arguments": ""}
                yield chunks.make(i, {"tool_calls": [start]})
            for k in range(0, len(call.arguments), 4):
                piece = {"index": j, "function": {"arguments": call.arguments[k : k + 4]}}
                for i in range(choices):
                    yield chunks.make(i, {"tool_calls": [piece]})
        return
    for n, token in enumerate(_tokens(answer.text or "")):
        for i in range(choices):
            if logprobs is None:
                yield chunks.content(i, token)
            else:
                lp = {"content": [_logprob(token, n, logprobs)], "refusal": None}
                yield chunks.make(i, {"content": token}, logprobs=lp)


class _Chunks:
    """Chunk events of one stream; a plain content delta is spliced from bytes made once."""

    __slots__ = ("_head", "_prefix", "_suffixes", "_usage")

    def __init__(self, head: dict[str, Any], include_usage: bool) -> None:
        self._head = head
        self._usage = include_usage
        opened = compact_bytes({**head, "choices": []})[:-2]  # ...,"choices":[
        self._prefix = b"data: " + opened + b'{"index":'
        tail = b',"logprobs":null,"finish_reason":null}]'
        self._suffixes = tail + (b',"usage":null}\n\n' if include_usage else b"}\n\n")

    def content(self, index: int, token: str) -> bytes:
        return b"".join(
            (
                self._prefix,
                str(index).encode(),
                b',"delta":{"content":',
                compact_bytes(token),
                b"}",
                self._suffixes,
            )
        )

    def make(
        self,
        index: int,
        delta: dict[str, Any],
        *,
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if self._usage:
            chunk["usage"] = None
        return data_event(compact_bytes(chunk))


def models_body(names: Iterable[str]) -> dict[str, object]:
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "callboard"} for n in names]
    return {"object": "list", "data": data}
