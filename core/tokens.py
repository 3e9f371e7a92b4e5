"""Prompt-size estimates: how many tokens a chat will cost before it is sent.

Theory of operation
-------------------
The limiter reserves ``prompt + max_tokens`` tokens before a call and a budget
reserves its cost, so every request needs a prompt estimate at the front
door: computed once, cheaply, and not below what the provider will report.
Nothing here runs a tokenizer; text is counted by characters and everything
else by the providers' published rules (cited beside each constant).

* Text: ``ceil(chars / 4)``. A message costs its text plus 4 tokens of
  framing (role, separators) and the reply primer costs 3. For a plain-text
  chat that is the whole rule, and ``estimate_prompt_tokens`` applies it to
  ``ChatMessage`` objects; the simulated provider counts the same way, so its
  usage and our estimates agree. Against a real tokenizer the rule is an
  approximation: English prose runs nearer five characters a token (the
  OpenAI cookbook's example chat: 160 here, 124 reported), CJK text nearer
  one character a token. A message whose content is a list of parts counts the characters of
  all its text parts as one text.
* A message's ``name`` costs its text + 1, as in the cookbook; an assistant's
  tool call its function name and arguments as text + 3; a tool message's
  ``tool_call_id`` its text.
* Images (``image_tokens``): OpenAI's tile rule, or Anthropic's area rule
  with ``dialect="anthropic"``. The size is read from a base64 data URL's
  header (``core.media``); an image we cannot measure (an http(s) URL) costs
  the most the rule allows, so a reservation is never too low for it.
* Audio: 10 tokens a second of input audio (OpenAI), the length read from the
  clip's header; a clip we cannot read is timed at the lowest bitrate the
  format uses, which overstates it.
* Files: 3,000 tokens a page (the top of Anthropic's 1,500-3,000 a page; both
  providers put a page's text and an image of it in the prompt). A file sent
  by ``file_id`` is counted as one page: its size is not in the request.
* Tools, OpenAI: the cookbook's ``num_tokens_for_tools`` for the GPT-4o
  family (per function, per property and per enum item overheads), with
  nested properties (objects, and the items of arrays) counted by the same
  rule. Anthropic: each tool's JSON text, plus the system prompt the API adds
  when tools are present (346 tokens on current models).
* ``response_format`` ``json_schema``: no provider publishes a rule. OpenAI:
  the schema's compact JSON text, plus its name and description, framed like
  one function definition (7 + 12 tokens). Anthropic: our wire asks for a
  schema through a forced tool, so it is counted as one more tool.

What always holds: an estimate is an ``int`` >= 3; it is pure (the same
messages give the same answer); adding a message, a part, a tool or more text
never lowers it; and no JSON-shaped request that ``wire.openai.check_body``
accepts makes it raise (a part it cannot read is skipped or costed at its
upper bound, never an error).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, TypeGuard

from callboard.core import media
from callboard.messages import ChatMessage

__all__ = [
    "DIALECTS",
    "MESSAGE_OVERHEAD",
    "REPLY_PRIMER",
    "count_chat_tokens",
    "estimate_prompt_tokens",
    "image_tokens",
    "text_tokens",
]

DIALECTS = frozenset({"openai", "azure", "anthropic"})
"""Whose rules count images and tools (Azure serves OpenAI's models: OpenAI's)."""

MESSAGE_OVERHEAD = 4
"""Tokens of framing per message (role, separators)."""
REPLY_PRIMER = 3
"""Tokens that prime the assistant's reply."""
NAME_OVERHEAD = 1
"""A message's ``name`` costs its text and this (OpenAI cookbook, ``tokens_per_name``)."""
TOOL_CALL_OVERHEAD = 3
"""An assistant's tool call costs its name and arguments as text and this (our figure for
the call's framing; no provider publishes one)."""

# OpenAI, "How to count tokens with tiktoken", num_tokens_for_tools (gpt-4o, gpt-4o-mini):
# https://github.com/openai/openai-cookbook/blob/main/examples/How_to_count_tokens_with_tiktoken.ipynb
FUNC_INIT = 7
"""Per function definition."""
PROP_INIT = 3
"""Per function (or nested object) that has properties."""
PROP_KEY = 3
"""Per property."""
ENUM_INIT = -3
"""Per property with a (non-empty) enum list."""
ENUM_ITEM = 3
"""Per enum value, besides its text."""
FUNC_END = 12
"""Once per request with tools."""

ANTHROPIC_TOOL_PROMPT = 346
"""The system prompt Anthropic adds when a request has tools: 346 tokens with tool choice
auto or none (313 with any or a named tool) on Claude 4 models and Sonnet 3.7; the older
Opus 3 costs 530 with auto. https://docs.claude.com/en/docs/agents-and-tools/tool-use/overview#pricing"""

# OpenAI, "Images and vision", calculating costs (GPT-4o family):
# https://platform.openai.com/docs/guides/images-vision#calculating-costs
IMAGE_BASE = 85
"""Every image costs this; a ``detail: low`` image costs only this."""
IMAGE_TILE = 170
"""Per 512 px tile of a high-detail image, after it is scaled to fit 2048 x 2048 and then
to a shortest side of at most 768 px."""
_TILE_PX, _FIT_PX, _SHORT_PX = 512, 2048, 768

# Anthropic, "Vision", evaluate image size: tokens = width * height / 750, after an image
# whose long edge exceeds 1568 px or whose cost exceeds ~1,600 tokens is scaled down.
# https://docs.claude.com/en/docs/build-with-claude/vision#evaluate-image-size
ANTHROPIC_PIXELS_PER_TOKEN = 750
ANTHROPIC_LONG_EDGE_PX = 1568
ANTHROPIC_MAX_IMAGE_TOKENS = 1600

AUDIO_TOKENS_PER_SECOND = 10
"""OpenAI: one token per 100 ms of input audio.
https://platform.openai.com/docs/guides/realtime-costs"""
_LOWEST_BYTES_PER_SECOND = {"wav": 8_000, "mp3": 1_000}
"""For a clip whose header we cannot read: 8 kHz 8-bit mono WAV, 8 kbit/s MP3."""

PDF_PAGE_TOKENS = 3000
"""Anthropic: "each page typically uses 1,500-3,000 tokens", text and image of the page.
https://docs.claude.com/en/docs/build-with-claude/pdf-support#estimate-your-costs"""


def _is_anthropic(dialect: str) -> bool:
    if dialect not in DIALECTS:
        raise ValueError(f"dialect must be one of {sorted(DIALECTS)}, got {dialect!r}")
    return dialect == "anthropic"


def text_tokens(text: str) -> int:
    """ceil(len(text) / 4)."""
    return (len(text) + 3) // 4


def estimate_prompt_tokens(messages: Sequence[ChatMessage], *, dialect: str = "openai") -> int:
    """``count_chat_tokens`` of the messages alone; a plain text turn takes the fast
    path, ``ceil(len(content) / 4) + 4``."""
    _is_anthropic(dialect)  # known
    total = REPLY_PRIMER
    for m in messages:
        content = m.content
        plain = m.name is None and m.tool_calls is None and m.tool_call_id is None
        if type(content) is str and plain and m.refusal is None:
            total += (len(content) + 3) // 4 + MESSAGE_OVERHEAD
        else:
            total += _message(m.wire(), dialect)
    return total


def count_chat_tokens(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    response_format: Mapping[str, Any] | None = None,
    dialect: str = "openai",
) -> int:
    """The prompt tokens of a Chat Completions request's messages, tools and response
    format, by ``dialect``'s rules (``openai``, ``azure`` or ``anthropic``)."""
    anthropic = _is_anthropic(dialect)
    total = REPLY_PRIMER + sum(_message(m, dialect) for m in messages if isinstance(m, Mapping))
    defined = [t for t in tools or () if isinstance(t, Mapping)]
    schema = _schema_tool(response_format)
    if anthropic:
        defined += [schema] if schema is not None else []
        if defined:
            total += ANTHROPIC_TOOL_PROMPT + sum(_anthropic_tool(t) for t in defined)
        return total
    if defined:
        total += sum(_openai_function(t.get("function")) for t in defined) + FUNC_END
    if schema is not None:
        total += _openai_schema(schema)
    return total


def _message(message: Mapping[str, Any], dialect: str) -> int:
    content = message.get("content")
    if isinstance(content, str) and len(message) <= 2:  # role and text: the common turn
        return (len(content) + 3) // 4 + MESSAGE_OVERHEAD
    chars, tokens = _content(content, dialect)
    if isinstance(message.get("refusal"), str):
        chars += len(message["refusal"])
    tokens += MESSAGE_OVERHEAD + (chars + 3) // 4
    if isinstance(message.get("name"), str):
        tokens += text_tokens(message["name"]) + NAME_OVERHEAD
    if isinstance(message.get("tool_call_id"), str):
        tokens += text_tokens(message["tool_call_id"])
    calls = message.get("tool_calls")
    if _is_array(calls):
        tokens += sum(_tool_call(c) for c in calls if isinstance(c, Mapping))
    return tokens


def _content(content: object, dialect: str) -> tuple[int, int]:
    """(characters of text, tokens of everything else) in a message's content."""
    if isinstance(content, str):
        return len(content), 0
    chars = tokens = 0
    for part in content if _is_array(content) else ():
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("text", "refusal") and isinstance(part.get(kind), str):
            chars += len(part[kind])
        elif kind == "image_url":
            tokens += _image_part(part.get("image_url"), dialect)
        elif kind == "input_audio":
            tokens += _audio_part(part.get("input_audio"))
        elif kind == "file":
            tokens += _file_part(part.get("file"))
    return chars, tokens


def _tool_call(call: Mapping[str, Any]) -> int:
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        return TOOL_CALL_OVERHEAD
    return TOOL_CALL_OVERHEAD + _tokens(_chars(fn.get("name")) + _chars(fn.get("arguments")))


# -- images, audio, files -------------------------------------------------------------------


def image_tokens(
    size: tuple[int, int] | None, *, detail: str = "auto", dialect: str = "openai"
) -> int:
    """What one image costs by ``dialect``'s rule; ``size`` None (unknown) costs the most
    the rule allows. ``detail`` is OpenAI's: ``low`` is a flat 85, ``auto`` is taken as
    ``high`` (the model may choose it)."""
    if _is_anthropic(dialect):
        if size is None:
            return ANTHROPIC_MAX_IMAGE_TOKENS
        w, h = (Fraction(max(1, side)) for side in size)
        scale = min(Fraction(1), Fraction(ANTHROPIC_LONG_EDGE_PX) / max(w, h))
        area = w * h * scale * scale
        return min(math.ceil(area / ANTHROPIC_PIXELS_PER_TOKEN), ANTHROPIC_MAX_IMAGE_TOKENS)
    if detail == "low":
        return IMAGE_BASE
    if size is None:  # at most 768 x 2048 once scaled: 2 x 4 tiles
        return IMAGE_BASE + IMAGE_TILE * _tiles(Fraction(_SHORT_PX), Fraction(_FIT_PX))
    w, h = (Fraction(max(1, side)) for side in size)
    fit = min(Fraction(1), Fraction(_FIT_PX) / max(w, h))
    w, h = w * fit, h * fit
    short = min(Fraction(1), Fraction(_SHORT_PX) / min(w, h))
    return IMAGE_BASE + IMAGE_TILE * _tiles(w * short, h * short)


def _tiles(width: Fraction, height: Fraction) -> int:
    return math.ceil(width / _TILE_PX) * math.ceil(height / _TILE_PX)


def _image_part(spec: object, dialect: str) -> int:
    if not isinstance(spec, Mapping):
        return image_tokens(None, dialect=dialect)
    url, detail = spec.get("url"), spec.get("detail")
    detail = detail if isinstance(detail, str) else "auto"
    if detail == "low" and dialect != "anthropic":  # no need to measure it
        return IMAGE_BASE
    size = media.image_size(url) if isinstance(url, str) else None
    return image_tokens(size, detail=detail, dialect=dialect)


def _audio_part(spec: object) -> int:
    if not isinstance(spec, Mapping) or not isinstance(spec.get("data"), str):
        return 0
    data, fmt = spec["data"], spec.get("format")
    fmt = fmt if isinstance(fmt, str) else ""
    seconds = media.audio_seconds(data, fmt)
    if seconds is None:
        size = media.decoded_size(data) or 0
        seconds = size / _LOWEST_BYTES_PER_SECOND.get(fmt, 1_000)
    return math.ceil(seconds * AUDIO_TOKENS_PER_SECOND)


def _file_part(spec: object) -> int:
    data = spec.get("file_data") if isinstance(spec, Mapping) else None
    if not isinstance(data, str):
        return PDF_PAGE_TOKENS  # by file_id: one page, its size unknown to us
    pages = media.pdf_pages(data)
    if pages is not None:
        return pages * PDF_PAGE_TOKENS
    return max(PDF_PAGE_TOKENS, ((media.decoded_size(data) or 0) + 3) // 4)  # bytes as text


# -- tools and response formats -------------------------------------------------------------
# Only lengths matter to the character rule, so a definition's text is measured, never
# built: "name:description" is len(name) + 1 + len(description).


def _openai_function(fn: object) -> int:
    """The cookbook's count of one function definition (FUNC_END is the caller's)."""
    if not isinstance(fn, Mapping):
        return FUNC_INIT
    params = fn.get("parameters")
    props = params.get("properties") if isinstance(params, Mapping) else None
    return FUNC_INIT + _name_line(fn) + _openai_properties(props)


def _name_line(fn: Mapping[str, Any]) -> int:
    """``name:description`` (a final period dropped, as the cookbook does)."""
    return _tokens(_chars(fn.get("name")) + 1 + _described(fn.get("description")))


def _openai_properties(props: object) -> int:
    """Properties, and the properties nested in them (of objects, and of arrays' items),
    each ``key:type:description`` by the cookbook's rule; walked with a stack, so a deep
    schema cannot exhaust the recursion limit."""
    tokens, stack = 0, [props]
    while stack:
        level = stack.pop()
        if not isinstance(level, Mapping) or not level:
            continue
        tokens += PROP_INIT
        for key, value in level.items():
            spec = value if isinstance(value, Mapping) else {}
            kind = spec.get("type")  # "string", or a union such as ["string", "null"]
            kinds = sum(map(_chars, kind)) + len(kind) - 1 if _is_array(kind) and kind else 0
            line = (
                _chars(key) + 1 + (kinds or _chars(kind)) + 1 + _described(spec.get("description"))
            )
            tokens += PROP_KEY + _tokens(line)
            enum = spec.get("enum")
            if _is_array(enum) and enum:
                tokens += ENUM_INIT + sum(ENUM_ITEM + _tokens(_chars(v)) for v in enum)
            items = spec.get("items")
            stack.append(spec.get("properties"))
            stack.append(items.get("properties") if isinstance(items, Mapping) else None)
    return tokens


def _anthropic_tool(tool: Mapping[str, Any]) -> int:
    """A tool as Anthropic receives it: name, description and input schema, as JSON text."""
    fn = tool.get("function")
    fn = fn if isinstance(fn, Mapping) else {}
    shape = {
        "name": fn.get("name"),
        "description": fn.get("description"),
        "input_schema": fn.get("parameters"),
    }
    return _tokens(_json_chars(shape))


def _schema_tool(response_format: object) -> dict[str, Any] | None:
    """A ``json_schema`` response format as the tool it is counted as: its name and
    description, its schema standing as the parameters."""
    if not isinstance(response_format, Mapping) or response_format.get("type") != "json_schema":
        return None
    spec = response_format.get("json_schema")
    spec = spec if isinstance(spec, Mapping) else {}
    fields = {k: spec.get(k) for k in ("name", "description")}
    return {"type": "function", "function": {**fields, "parameters": spec.get("schema")}}


def _openai_schema(tool: Mapping[str, Any]) -> int:
    """A schema framed like one function definition: ``name:description`` by the
    cookbook's rule, the schema's JSON text as text."""
    fn = tool["function"]
    schema = _tokens(_json_chars(fn.get("parameters")))
    return FUNC_INIT + _name_line(fn) + schema + FUNC_END


# -- measuring JSON values ------------------------------------------------------------------

_MAX_NODES = 1_000_000
"""Values walked when measuring JSON too deep for ``json.dumps`` (a bound, should a
value refer to itself)."""


def _tokens(chars: int) -> int:
    return (chars + 3) // 4


def _chars(value: object) -> int:
    """The length of a value as text: a string as it is, null as nothing, the rest as
    JSON."""
    return len(value) if isinstance(value, str) else 0 if value is None else _json_chars(value)


def _described(value: object) -> int:
    """A description's length, less a final period."""
    return _chars(value) - (1 if isinstance(value, str) and value.endswith(".") else 0)


def _is_array(value: object) -> TypeGuard[Sequence[Any]]:
    """A JSON array: a list, or the tuple a frozen request holds it as."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _json_chars(value: object) -> int:
    """The length of ``value``'s compact JSON text."""
    try:
        return len(_dumps(value))
    except (RecursionError, ValueError):  # nested past the recursion limit, or a cycle
        return _walked_json_chars(value)


def _walked_json_chars(value: object) -> int:
    """The same length, walked with a stack (at most ``_MAX_NODES`` values)."""
    total, stack = 0, [value]
    for _ in range(_MAX_NODES):
        if not stack:
            break
        item = stack.pop()
        if isinstance(item, Mapping):
            total += 2 + max(0, len(item) - 1) + len(item) + sum(len(_dumps(str(k))) for k in item)
            stack.extend(item.values())
        elif _is_array(item):
            total += 1 + max(1, len(item))
            stack.extend(item)
        else:
            total += len(_dumps(item))
    return total


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_thawed)


def _thawed(value: object) -> object:
    """What ``json.dumps`` writes for a value it does not know: a read-only mapping (how a
    frozen request holds an object) as a dict, anything else as its text."""
    return dict(value) if isinstance(value, Mapping) else str(value)
