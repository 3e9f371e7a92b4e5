"""Anthropic's Messages wire for the simulated provider: ``POST /v1/messages``.

Pure: bytes and headers in, dicts and bytes out.

Theory of operation
-------------------
``POST /v1/messages/count_tokens`` (`count_tokens_body`) answers what a
request's input would cost, by the same rule as its ``usage``.

``check_headers`` holds the request to Anthropic's: an ``anthropic-version``
(missing: 400 ``anthropic-version: header is required``; not a date from
`OLDEST_VERSION` on: 400). The
key, ``x-api-key``, is the app's to compare. ``parse_messages`` reads the body
as the API reference has it (``model``, ``messages`` of ``user``/``assistant``
turns whose content is a string or text, image, tool_use, tool_result and
document blocks, the required ``max_tokens``, ``system``, ``stop_sequences``,
``tools`` with an ``input_schema``, ``tool_choice`` ``auto``/``any``/``tool``/
``none`` with ``disable_parallel_tool_use``, ``stream``...), refusing what the
API refuses with its words (``max_tokens: Field required``, ``foo: Extra
inputs are not permitted``). The reply is `reply.compose`'s, as on the OpenAI
wire, and the answer is rendered as a ``message`` (``stop_reason``
``end_turn``/``max_tokens``/``tool_use``/``stop_sequence``; usage with
``input_tokens``, ``output_tokens`` and the cache's two counts: a prefix up to
the last ``cache_control`` mark is written on its first sight and read after,
see ``cache``), as stream
events (``message_start``, ``content_block_start``, ``ping``,
``content_block_delta`` with ``text_delta`` or ``input_json_delta``,
``content_block_stop``, ``message_delta`` with the stop reason and usage,
``message_stop``; a cut fault in ``error`` mode sends ``event: error`` with
``overloaded_error``), or as an error (``{"type": "error", "error": {...}}``;
the overload fault is 529 ``overloaded_error``). Rate-limit headers are
``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`` with the
reset as an RFC 3339 time; a 429 also carries ``retry-after`` in seconds.

Thinking (`parse_thinking`): ``thinking`` is ``disabled``, ``between_tools``
(no thinking here either), ``enabled`` with an integer ``budget_tokens`` from
`MIN_THINKING_BUDGET` and below ``max_tokens``, or ``adaptive``; ``enabled`` and
``adaptive`` take ``display`` ``summarized`` or ``omitted``. With thinking on,
the answer starts with one ``thinking`` block (`Thought`: a short text made
from the request's size and the answer it leads to, never from the prompt's
words), signed by `sign_thinking` (base64 of an HMAC-SHA256 under the
simulator's fixed key), or, when a user turn holds `REDACTED_THINKING_TRIGGER`
(Anthropic's own test string), one ``redacted_thinking`` block whose ``data``
`redact_thinking` makes (base64 of a fixed prefix, a MAC and the text). Its
text counts in ``output_tokens`` as a fixed text does (``ceil(len / 4)``), as
the engine's reasoning tokens; a stream sends it first (``content_block_start``
with an empty thinking block, ``thinking_delta`` word by word, one
``signature_delta``, ``content_block_stop``; a redacted block whole in its
start). Thinking blocks sent back are checked: a ``thinking`` block whose
signature is not its text's, or ``redacted_thinking`` data the simulator did
not make, is a 400 (``Invalid `signature` in `thinking` block``); with
thinking on, a last ``assistant`` turn that calls a tool must start with a
thinking block (`check_final_thinking`), and ``tool_choice`` may not force a
tool use.

What must hold: every body the official SDK sends for these fields is
accepted; every answer parses with the SDK's own types; errors never echo the
key.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import hmac
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from callboard.core.tokens import ANTHROPIC_REPLY_PRIMER
from callboard.provider.cache import MIN_TOKENS, Prefix, prefix_key
from callboard.provider.engine import Ask, Plan
from callboard.provider.limits import Window
from callboard.provider.reply import Call, Intent, Reply, Tool, UnknownToolError, compose
from callboard.provider.sse import Stream, compact_bytes, named_event
from callboard.provider.tokens import count_anthropic_tokens
from callboard.provider.wire import BadRequestError, said

__all__ = [
    "MIN_THINKING_BUDGET",
    "OLDEST_VERSION",
    "REDACTED_THINKING_TRIGGER",
    "Display",
    "MessagesRequest",
    "Thought",
    "check_final_thinking",
    "check_headers",
    "count_tokens_body",
    "error_body",
    "error_kind",
    "message_body",
    "message_stream",
    "parse_messages",
    "parse_thinking",
    "ratelimit_headers",
    "redact_thinking",
    "redacted_ok",
    "sign_thinking",
    "signature_ok",
    "stop_reason",
    "thinking_block",
    "thinking_text",
]

OLDEST_VERSION = "2023-01-01"
"""The oldest ``anthropic-version`` the API accepts; a version is a date (``2023-06-01``
is the one every SDK sends at least; newer SDKs send newer dates)."""
_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")
_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "metadata",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
        "service_tier",
        "container",
        "mcp_servers",
    }
)
_BLOCKS = frozenset(
    {"text", "image", "tool_use", "tool_result", "document", "thinking", "redacted_thinking"}
)
_THINKING_BLOCKS = ("thinking", "redacted_thinking")
MIN_THINKING_BUDGET = 1024
"""The least ``thinking.budget_tokens`` the API takes."""
REDACTED_THINKING_TRIGGER = (
    "ANTHROPIC_MAGIC_STRING_TRIGGER_REDACTED_THINKING_"
    "46C9A13E193C177646C7398A98432ECCCE4C1253D5E2D82641AC0E52CC2876CB"
)
"""Anthropic's test string: a user turn that holds it, with thinking on, is answered with a
``redacted_thinking`` block instead of a ``thinking`` one."""
_THINKING_KEYS = {
    "disabled": frozenset({"type"}),
    "between_tools": frozenset({"type"}),
    "enabled": frozenset({"type", "budget_tokens", "display"}),
    "adaptive": frozenset({"type", "display"}),
}
_THINKING_DOCS = "https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
_KEY = b"callboard simulated provider: thinking"
"""The simulator's fixed signing key (a simulator's signature proves nothing outside it)."""
_REDACTED_PREFIX = b"callboard-redacted-thinking:"
_MAC_SIZE = 32
_CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
_STATUS_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_MESSAGES = {
    "invalid_request_error": "Simulated bad request.",
    "authentication_error": "invalid x-api-key",
    "permission_error": "Your API key does not have permission to use the specified resource.",
    "not_found_error": "The requested resource could not be found.",
    "request_too_large": "Request exceeds the maximum allowed number of bytes.",
    "rate_limit_error": "This request would exceed your organization's rate limit.",
    "api_error": "Internal server error",
    "timeout_error": "Request timed out",
    "overloaded_error": "Overloaded",
}


Display = Literal["summarized", "omitted"]
"""How an answer shows its thinking: its text, or an empty text (still signed)."""


@dataclass(frozen=True, slots=True)
class Thought:
    """The thinking an answer starts with."""

    text: str
    """All of it: what ``output_tokens`` counts, whatever the block shows."""
    display: Display = "summarized"
    redacted: bool = False
    """Answered as a ``redacted_thinking`` block."""

    @property
    def tokens(self) -> int:
        """Its output tokens, as a fixed text's: ``ceil(len / 4)``."""
        return -(-len(self.text) // 4)


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """What the provider needs from a Messages request."""

    model: str
    ask: Ask
    reply: Reply
    stream: bool = False
    thought: Thought | None = None
    """The thinking the answer starts with (None: thinking is off)."""


def check_headers(headers: Mapping[str, str]) -> None:
    """Refuse (`BadRequestError`) a request without a valid ``anthropic-version``."""
    version = headers.get("anthropic-version")
    if version is None:
        raise BadRequestError("anthropic-version: header is required")
    if not _VERSION.fullmatch(version) or version < OLDEST_VERSION:
        raise BadRequestError(f'anthropic-version: "{version}" is not a valid version')


def parse_messages(body: bytes) -> MessagesRequest:
    """The Messages request in ``body``, or `BadRequestError` in Anthropic's words."""
    data = _load(body, ("model", "messages", "max_tokens"), _FIELDS)
    model, max_tokens = data["model"], data["max_tokens"]
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequestError("max_tokens: Input should be an integer >= 1", "max_tokens")
    display = parse_thinking(data.get("thinking"), max_tokens)
    _check_messages(data["messages"])
    _check_system(data.get("system"))
    if display is not None:
        check_final_thinking(data["messages"])
    stops = _stop_sequences(data.get("stop_sequences"))
    intent = _intent(data, stops)
    if display is not None and intent.choice in ("required", "named"):
        raise BadRequestError(
            "Thinking may not be enabled when tool_choice forces tool use.", "tool_choice"
        )
    try:
        reply = compose(intent)
    except UnknownToolError as exc:
        raise BadRequestError(f"tool_choice: {exc}", "tool_choice") from None
    except ValueError as exc:  # SchemaError
        raise BadRequestError(f"tools: input_schema: {exc}", "tools") from None
    stream = data.get("stream") is True
    tokens = count_anthropic_tokens(data)
    thought = None
    if display is not None:
        text = thinking_text(reply, tokens, after_tool=intent.after_tool)
        thought = Thought(text, display, _asks_redaction(data["messages"]))
    ask = Ask(
        tokens,
        max_tokens,
        reply.fixed_tokens,
        reply.stop_at,
        reasoning_tokens=0 if thought is None else thought.tokens,
        stream=stream,
        prefix=_prefix(data) if tokens >= MIN_TOKENS else None,
    )
    return MessagesRequest(model, ask, reply, stream, thought)


def count_tokens_body(body: bytes) -> dict[str, int]:
    """``POST /v1/messages/count_tokens``: what a Messages request's input would cost,
    ``{"input_tokens": n}``, or `BadRequestError` in Anthropic's words."""
    data = _load(body, ("model", "messages"), _COUNTED)
    parse_thinking(data.get("thinking"), None)
    _check_messages(data["messages"])
    _check_system(data.get("system"))
    _intent(data, ())  # the tools and tool_choice, checked
    return {"input_tokens": count_anthropic_tokens(data)}


_COUNTED = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})
"""The fields a token count takes."""


def _load(body: bytes, required: tuple[str, ...], known: frozenset[str]) -> dict[str, Any]:
    """The JSON object in ``body``, with its ``required`` fields and no unknown ones."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError("There was an error parsing the body of your request.") from exc
    if not isinstance(data, dict):
        raise BadRequestError("The request body must be a JSON object.")
    for name in required:
        if name not in data:
            raise BadRequestError(f"{name}: Field required", name)
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        raise BadRequestError(f"{unknown[0]}: Extra inputs are not permitted", unknown[0])
    if not isinstance(data["model"], str) or not data["model"]:
        raise BadRequestError("model: Input should be a valid string", "model")
    return data


def parse_thinking(value: object, max_tokens: int | None) -> Display | None:
    """How the answer shows its thinking (None: thinking is off), or `BadRequestError`
    in Anthropic's words; ``max_tokens`` None (a token count) skips the budget's cap."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequestError("thinking: Input should be a valid dictionary", "thinking")
    kind = value.get("type")
    if kind is None:
        raise BadRequestError("thinking.type: Field required", "thinking")
    if kind not in _THINKING_KEYS:
        tags = ", ".join(f"'{k}'" for k in sorted(_THINKING_KEYS))
        raise BadRequestError(
            f"thinking: Input tag {kind!r} found using 'type' does not match any of the "
            f"expected tags: {tags}",
            "thinking",
        )
    extra = sorted(k for k in value if k not in _THINKING_KEYS[kind])
    if extra:
        at = f"thinking.{kind}.{extra[0]}"
        raise BadRequestError(f"{at}: Extra inputs are not permitted", at)
    if kind in ("disabled", "between_tools"):
        return None
    display = value.get("display")
    if display not in (None, "summarized", "omitted"):
        at = f"thinking.{kind}.display"
        raise BadRequestError(f"{at}: Input should be 'summarized' or 'omitted'", at)
    if kind == "enabled":
        _check_budget(value, max_tokens)
    return "omitted" if display == "omitted" else "summarized"


def _check_budget(thinking: Mapping[str, Any], max_tokens: int | None) -> None:
    at = "thinking.enabled.budget_tokens"
    if "budget_tokens" not in thinking:
        raise BadRequestError(f"{at}: Field required", "thinking.budget_tokens")
    budget = thinking["budget_tokens"]
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise BadRequestError(f"{at}: Input should be a valid integer", "thinking.budget_tokens")
    if budget < MIN_THINKING_BUDGET:
        raise BadRequestError(
            f"{at}: Input should be greater than or equal to {MIN_THINKING_BUDGET}",
            "thinking.budget_tokens",
        )
    if max_tokens is not None and budget >= max_tokens:
        raise BadRequestError(
            "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our "
            f"documentation at {_THINKING_DOCS}#max-tokens-and-context-window-size",
            "thinking.budget_tokens",
        )


def check_final_thinking(messages: list[Any]) -> None:
    """With thinking on: refuse (`BadRequestError`, Anthropic's words) a last ``assistant``
    turn that calls a tool and does not start with a thinking or redacted_thinking block,
    as the API does when a client dropped the thinking it was given."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            break
    else:
        return
    content = messages[i].get("content")
    if not isinstance(content, list) or not any(b["type"] == "tool_use" for b in content):
        return
    found = content[0]["type"]
    if found in _THINKING_BLOCKS:
        return
    at = f"messages.{i}.content.0.type"
    raise BadRequestError(  # "preceeding" (sic): the API's own words, kept as they are
        f"{at}: Expected `thinking` or `redacted_thinking`, but found `{found}`. When "
        "`thinking` is enabled, a final `assistant` message must start with a thinking block "
        "(preceeding the lastmost set of `tool_use` and `tool_result` blocks). We recommend "
        "you include thinking blocks from previous turns. To avoid this requirement, disable "
        f"`thinking`. Please consult our documentation at {_THINKING_DOCS}",
        at,
    )


def _asks_redaction(messages: list[Any]) -> bool:
    """A user turn holds `REDACTED_THINKING_TRIGGER`."""
    for m in messages:
        if m["role"] != "user":
            continue
        content = m.get("content")
        texts = (
            [content]
            if isinstance(content, str)
            else [b["text"] for b in content if b["type"] == "text"]
        )
        if any(REDACTED_THINKING_TRIGGER in t for t in texts):
            return True
    return False


def thinking_text(reply: Reply, prompt_tokens: int, *, after_tool: bool) -> str:
    """The simulated model's thinking before ``reply``: deterministic, and made of the
    request's size and what the reply does, not of the prompt's words."""
    if reply.calls:
        names = ", ".join(c.name for c in reply.calls)
        plan = f"I will call {names} and wait for the result."
    elif after_tool:
        plan = "The tool has answered, so I will answer in words."
    else:
        plan = "I will answer in words."
    return f"Thinking about a prompt of {prompt_tokens} tokens. {plan}"


def _mac(kind: bytes, text: str) -> bytes:
    message = kind + b"\0" + text.encode("utf-8", "surrogatepass")
    return hmac.new(_KEY, message, hashlib.sha256).digest()


def sign_thinking(text: str) -> str:
    """A ``thinking`` block's signature: base64 of the HMAC-SHA256 of its text under the
    simulator's key."""
    return base64.b64encode(_mac(b"thinking", text)).decode()


def signature_ok(text: str, signature: str) -> bool:
    """``signature`` is `sign_thinking` of ``text`` (compared in constant time)."""
    expected = sign_thinking(text).encode()
    return hmac.compare_digest(expected, signature.encode("utf-8", "surrogatepass"))


def redact_thinking(text: str) -> str:
    """A ``redacted_thinking`` block's data: base64 of a fixed prefix, the MAC of the
    text and the text (opaque to a client; checkable here)."""
    payload = _REDACTED_PREFIX + _mac(b"redacted_thinking", text) + text.encode()
    return base64.b64encode(payload).decode()


def redacted_ok(data: str) -> bool:
    """``data`` is `redact_thinking` of some text."""
    try:
        payload = base64.b64decode(data, validate=True)
        text = payload[len(_REDACTED_PREFIX) + _MAC_SIZE :].decode()
    except (binascii.Error, ValueError):  # UnicodeError is a ValueError
        return False
    if not payload.startswith(_REDACTED_PREFIX):
        return False
    mac = payload[len(_REDACTED_PREFIX) : len(_REDACTED_PREFIX) + _MAC_SIZE]
    return hmac.compare_digest(mac, _mac(b"redacted_thinking", text))


def _prefix(data: Mapping[str, Any]) -> Prefix | None:
    """What the request marks for caching: tools, system and messages up to the last
    block with ``cache_control``, if that holds `MIN_TOKENS` or more."""
    tools = data.get("tools") or []
    system = data.get("system")
    system_blocks = system if isinstance(system, list) else []
    messages = data["messages"]
    cut: dict[str, Any] | None = None
    for k in range(len(messages) - 1, -1, -1):
        content = messages[k].get("content")
        marked = (
            [j for j, b in enumerate(content) if _marked(b)] if isinstance(content, list) else []
        )
        if marked:
            last = {**messages[k], "content": content[: marked[-1] + 1]}
            cut = {"tools": tools, "system": system, "messages": [*messages[:k], last]}
            break
    if cut is None:
        marked = [j for j, b in enumerate(system_blocks) if _marked(b)]
        if marked:
            cut = {"tools": tools, "system": system_blocks[: marked[-1] + 1]}
    if cut is None:
        marked = [i for i, t in enumerate(tools) if _marked(t)]
        if marked:
            cut = {"tools": tools[: marked[-1] + 1]}
    if cut is None:
        return None
    tokens = count_anthropic_tokens(cut) - ANTHROPIC_REPLY_PRIMER  # the prefix is not the end
    return Prefix(prefix_key(cut), tokens) if tokens >= MIN_TOKENS else None


def _marked(block: object) -> bool:
    return isinstance(block, dict) and block.get("cache_control") is not None


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages: at least one message is required", "messages")
    for i, m in enumerate(messages):
        at = f"messages.{i}"
        if not isinstance(m, dict):
            raise BadRequestError(f"{at}: Input should be a valid dictionary", at)
        if m.get("role") not in ("user", "assistant"):
            raise BadRequestError(f"{at}.role: Input should be 'user' or 'assistant'", at)
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise BadRequestError(f"{at}.content: Field required", f"{at}.content")
        for j, block in enumerate(content):
            _check_block(block, f"{at}.content.{j}")


def _check_block(block: object, at: str) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in _BLOCKS:
        raise BadRequestError(f"{at}.type: Input tag {kind!r} does not match any known tag", at)
    assert isinstance(block, dict)  # narrowed by the test above
    if kind == "text" and not isinstance(block.get("text"), str):
        raise BadRequestError(f"{at}.text: Field required", at)
    if kind == "image":
        source = block.get("source")
        ok = isinstance(source, dict) and (
            (source.get("type") == "base64" and isinstance(source.get("data"), str))
            or (source.get("type") == "url" and isinstance(source.get("url"), str))
        )
        if not ok:
            raise BadRequestError(f"{at}.source: a base64 or url image source is required", at)
    if kind == "tool_use" and not (
        isinstance(block.get("id"), str)
        and isinstance(block.get("name"), str)
        and isinstance(block.get("input"), dict)
    ):
        raise BadRequestError(f"{at}: tool_use needs an id, a name and an input object", at)
    if kind == "tool_result" and not isinstance(block.get("tool_use_id"), str):
        raise BadRequestError(f"{at}.tool_use_id: Field required", at)
    if kind in _THINKING_BLOCKS:
        _check_thinking(block, at)


def _check_thinking(block: Mapping[str, Any], at: str) -> None:
    """A thinking block sent back must be one the simulator made, unchanged."""
    if block["type"] == "redacted_thinking":
        data = block.get("data")
        if not isinstance(data, str):
            raise BadRequestError(f"{at}.data: Field required", at)
        if not redacted_ok(data):
            raise BadRequestError(f"{at}: Invalid `data` in `redacted_thinking` block", at)
        return
    text, signature = block.get("thinking"), block.get("signature")
    if not isinstance(text, str):
        raise BadRequestError(f"{at}.thinking: Field required", at)
    if not isinstance(signature, str):
        raise BadRequestError(f"{at}.signature: Field required", at)
    if not signature_ok(text, signature):
        raise BadRequestError(f"{at}: Invalid `signature` in `thinking` block", at)


def _check_system(system: object) -> None:
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list) or not all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        for b in system
    ):
        raise BadRequestError("system: a string or a list of text blocks", "system")


def _stop_sequences(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequestError("stop_sequences: Input should be a list of strings", "stop_sequences")
    return tuple(value)


def _intent(data: Mapping[str, Any], stops: tuple[str, ...]) -> Intent:
    tools = []
    for i, tool in enumerate(data.get("tools") or ()):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BadRequestError(f"tools.{i}.name: Field required", "tools")
        if tool.get("type") not in (None, "custom"):
            continue  # a server tool (web search...): nothing for the simulated model to call
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise BadRequestError(f"tools.{i}.input_schema: Field required", "tools")
        tools.append(Tool(tool["name"], schema))
    choice = data.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in _CHOICES:
        raise BadRequestError("tool_choice.type: must be auto, any, tool or none", "tool_choice")
    assert isinstance(choice, dict)  # narrowed by the test above
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise BadRequestError("tool_choice.name: Field required", "tool_choice")
    last = data["messages"][-1]
    content = last.get("content")
    after_tool = isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in content
    )
    return Intent(
        tools=tuple(tools),
        choice=_CHOICES[kind],  # type: ignore[arg-type]
        named=choice.get("name"),
        parallel=choice.get("disable_parallel_tool_use") is False,
        after_tool=after_tool and last.get("role") == "user",
        stop=stops,
    )


# -- answers --------------------------------------------------------------------------------


def stop_reason(plan: Plan, reply: Reply) -> str:
    """The plan's finish in Anthropic's words."""
    if plan.finish_reason == "length":
        return "max_tokens"
    if plan.finish_reason == "stop_sequence":
        return "stop_sequence"
    return "tool_use" if reply.calls else "end_turn"


def tool_use_id(seq: int, index: int) -> str:
    """A tool_use block's id: ``toolu_`` and 24 characters, unique per answer."""
    return f"toolu_{seq:019x}{index:05x}"


def _usage(plan: Plan, *, output: int | None = None) -> dict[str, Any]:
    return {
        "input_tokens": plan.prompt_tokens - plan.cache_read - plan.cache_write,
        "output_tokens": plan.output_tokens if output is None else output,
        "cache_creation_input_tokens": plan.cache_write,
        "cache_read_input_tokens": plan.cache_read,
        "service_tier": "standard",
    }


def _blocks(answer: Reply, seq: int) -> list[dict[str, Any]]:
    if answer.calls:
        return [
            {"type": "tool_use", "id": tool_use_id(seq, j), "name": c.name, "input": _input(c)}
            for j, c in enumerate(answer.calls)
        ]
    return [{"type": "text", "text": answer.text or "", "citations": None}]


def thinking_block(thought: Thought, plan: Plan) -> dict[str, Any]:
    """The block ``thought`` is answered as under ``plan``: all of it, unless
    ``max_tokens`` cut it (then its first ``4 * plan.reasoning_tokens`` characters)."""
    text = thought.text[: plan.reasoning_tokens * 4]
    if thought.redacted:
        return {"type": "redacted_thinking", "data": redact_thinking(text)}
    shown = "" if thought.display == "omitted" else text
    return {"type": "thinking", "thinking": shown, "signature": sign_thinking(shown)}


def _content(request: MessagesRequest, plan: Plan, answer: Reply, seq: int) -> list[dict[str, Any]]:
    """The message's content blocks: the thinking, if on, then the answer's."""
    blocks = _blocks(answer, seq)
    if request.thought is None:
        return blocks
    return [thinking_block(request.thought, plan), *blocks]


def _input(call: Call) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments)
    except ValueError:  # cut by max_tokens mid-way
        return {}
    return value if isinstance(value, dict) else {}


def message_body(
    *, message_id: str, model: str, plan: Plan, request: MessagesRequest, seq: int
) -> dict[str, Any]:
    """A ``message`` object for ``request`` answered under ``plan``."""
    answer = said(plan, request.reply)
    stopped = plan.finish_reason == "stop_sequence"
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _content(request, plan, answer, seq),
        "stop_reason": stop_reason(plan, request.reply),
        "stop_sequence": request.reply.stop_sequence if stopped else None,
        "usage": _usage(plan),
    }


def message_stream(
    *, message_id: str, model: str, plan: Plan, request: MessagesRequest, seq: int
) -> Stream:
    """The events of ``request`` answered under ``plan``, as Anthropic streams them."""
    answer = said(plan, request.reply)
    start: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(plan, output=1),
    }
    head = [_event("message_start", {"type": "message_start", "message": start})]
    blocks = _content(request, plan, answer, seq)
    head.append(_block_start(0, blocks[0]))
    head.append(_event("ping", {"type": "ping"}))
    stopped = plan.finish_reason == "stop_sequence"
    delta = {
        "stop_reason": stop_reason(plan, request.reply),
        "stop_sequence": request.reply.stop_sequence if stopped else None,
    }
    usage = {"output_tokens": plan.output_tokens}
    tail = [
        _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}),
        _event("message_stop", {"type": "message_stop"}),
    ]
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    return Stream(head, _body(answer, blocks), tail, _event("error", error))


def _body(answer: Reply, blocks: list[dict[str, Any]]) -> Iterator[bytes]:
    calls = iter(answer.calls)
    for index, block in enumerate(blocks):
        if index:
            yield _block_start(index, block)
        kind = block["type"]
        if kind == "thinking":
            for piece in _words(block["thinking"]):
                yield _delta(index, {"type": "thinking_delta", "thinking": piece})
            yield _delta(index, {"type": "signature_delta", "signature": block["signature"]})
        elif kind == "tool_use":
            arguments = next(calls).arguments  # as said, cut JSON included
            for k in range(0, len(arguments), 4):
                part = {"type": "input_json_delta", "partial_json": arguments[k : k + 4]}
                yield _delta(index, part)
        elif kind == "text":
            for piece in _words(block["text"]):
                yield _delta(index, {"type": "text_delta", "text": piece})
        # redacted_thinking: whole in its start
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})


def _words(text: str) -> Iterator[str]:
    """``text`` in pieces of a word each, the space before a word with it."""
    for n, word in enumerate(text.split(" ") if text else ()):
        yield word if n == 0 else " " + word


_EMPTY: Mapping[str, Mapping[str, Any]] = {
    "text": {"type": "text", "text": ""},
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
}


def _block_start(index: int, block: Mapping[str, Any]) -> bytes:
    kind = block["type"]
    if kind == "tool_use":
        empty: Mapping[str, Any] = {**block, "input": {}}
    elif kind == "redacted_thinking":
        empty = block
    else:
        empty = _EMPTY[kind]
    start = {"type": "content_block_start", "index": index, "content_block": empty}
    return _event("content_block_start", start)


def _delta(index: int, delta: Mapping[str, Any]) -> bytes:
    event = {"type": "content_block_delta", "index": index, "delta": delta}
    return _event("content_block_delta", event)


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    return named_event(name.encode(), compact_bytes(data))


# -- errors and headers ---------------------------------------------------------------------


def error_kind(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return _STATUS_KINDS.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str | None = None, *, request_id: str) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = error_kind(status)
    error = {"type": kind, "message": message or _MESSAGES[kind]}
    return {"type": "error", "error": error, "request_id": request_id}


def ratelimit_headers(windows: Iterable[Window], wall_now: float) -> dict[str, str]:
    """``anthropic-ratelimit-*`` headers; resets as RFC 3339 times from ``wall_now``."""
    headers: dict[str, str] = {}
    for w in windows:
        reset = datetime.datetime.fromtimestamp(math.ceil(wall_now + w.reset_s), datetime.UTC)
        headers[f"anthropic-ratelimit-{w.kind}-limit"] = str(w.limit)
        headers[f"anthropic-ratelimit-{w.kind}-remaining"] = str(w.remaining)
        headers[f"anthropic-ratelimit-{w.kind}-reset"] = reset.strftime("%Y-%m-%dT%H:%M:%SZ")
    return headers
