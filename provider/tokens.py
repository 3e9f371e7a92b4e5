"""The simulated provider's one prompt-size rule, for every wire.

Pure: JSON (already parsed) in, a token count out. What the limits charge and
what ``usage`` reports both come from here, so they cannot disagree.

The rule
--------
* text: ``ceil(chars / 4) + 4`` per message (its text: a string, text parts or
  blocks, a tool call's name and arguments, a tool result), ``+ 3`` for the
  reply primer (the Anthropic wire counts ``system`` as one more message);
* an image, by the provider's published rule: OpenAI's tiles (``detail: low``
  85; else the image fitted in 2048x2048, its short side scaled to 768, then
  170 per 512-pixel tile + 85); Anthropic's ``ceil(w * h / 750)`` after fitting
  the long side in 1568 pixels. The size is read from a base64 PNG, GIF, JPEG
  or WebP header; an image given by URL (or unreadable) counts as
  `DEFAULT_IMAGE` pixels;
* tool definitions and a response schema: ``ceil(len(compact JSON) / 4)``.

TODO(issue 15): ``callboard.core.tokens.count_chat_tokens`` (being written
alongside) will be callboard's estimate over the same shapes; once it exists,
`count_prompt_tokens` calls it so the estimate and the simulator's ``usage``
agree exactly. Until then this is the rule, and the plain-text part of it is
already the estimator's.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from callboard.provider.sse import compact

__all__ = ["DEFAULT_IMAGE", "count_anthropic_tokens", "count_prompt_tokens", "image_size"]

DEFAULT_IMAGE = (1024, 1024)
"""The pixels an image of unknown size counts as."""
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+);base64,(?P<data>.*)", re.DOTALL)
_HEADER_B64 = 64 * 1024
"""How much base64 is decoded to find an image's size (a JPEG's SOF may sit after EXIF)."""


def count_prompt_tokens(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Any] | None = None,
    schema: Mapping[str, Any] | None = None,
) -> int:
    """Chat Completions messages (and tools, and a response schema) as prompt tokens."""
    total = 3
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += -(-len(content) // 4) + 4
            continue
        chars, images = _parts(content)
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping):
                chars += len(str(fn.get("name") or "")) + len(str(fn.get("arguments") or ""))
        total += -(-chars // 4) + 4 + images
    return total + _json_tokens(tools) + _json_tokens(schema)


def _parts(content: object) -> tuple[int, int]:
    """(text characters, image tokens) of a list of content parts."""
    chars = images = 0
    if not isinstance(content, list):
        return 0, 0
    for part in content:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text" and isinstance(text := part.get("text"), str):
            chars += len(text)
        elif kind == "image_url" and isinstance(spec := part.get("image_url"), Mapping):
            images += openai_image_tokens(str(spec.get("url", "")), str(spec.get("detail", "auto")))
    return chars, images


def count_anthropic_tokens(body: Mapping[str, Any]) -> int:
    """A Messages request body (``system``, ``messages``, ``tools``) as input tokens."""
    total = 3
    system = body.get("system")
    if system:
        total += -(-_block_chars(system) // 4) + 4
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, Mapping) else None
        chars = _block_chars(content)
        images = 0
        if isinstance(content, list):
            for block in content:
                if isinstance(block, Mapping) and block.get("type") == "image":
                    images += anthropic_image_tokens(block.get("source"))
        total += -(-chars // 4) + 4 + images
    return total + _json_tokens(body.get("tools"))


def _block_chars(content: object) -> int:
    """The text characters of a string or a list of Messages content blocks."""
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    chars = 0
    for block in content:
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if kind == "text":
            chars += len(str(block.get("text", "")))
        elif kind == "tool_use":
            chars += len(str(block.get("name", ""))) + len(compact(block.get("input", {})))
        elif kind == "tool_result":
            chars += _block_chars(block.get("content"))
    return chars


def _json_tokens(value: object) -> int:
    return -(-len(compact(value)) // 4) if value else 0


def openai_image_tokens(url: str, detail: str) -> int:
    """OpenAI's published rule for one image."""
    if detail == "low":
        return 85
    w, h = image_size(url) or DEFAULT_IMAGE
    scale = min(1.0, 2048 / max(w, h))
    width, height = w * scale, h * scale
    scale = min(1.0, 768 / min(width, height))
    width, height = width * scale, height * scale
    return 170 * math.ceil(width / 512) * math.ceil(height / 512) + 85


def anthropic_image_tokens(source: object) -> int:
    """Anthropic's published rule for one image: (w * h) / 750 once it fits 1568 px."""
    size = None
    if isinstance(source, Mapping) and source.get("type") == "base64":
        size = image_size(f"data:{source.get('media_type')};base64,{source.get('data', '')}")
    width, height = size or DEFAULT_IMAGE
    scale = min(1.0, 1568 / max(width, height))
    return math.ceil(width * scale * height * scale / 750)


def image_size(url: str) -> tuple[int, int] | None:
    """(width, height) of a base64 data-URL image, or None if it cannot be read."""
    match = _DATA_URL.match(url)
    if match is None:
        return None
    data = match["data"][:_HEADER_B64]
    try:
        head = base64.b64decode(data[: len(data) // 4 * 4], validate=False)
    except (binascii.Error, ValueError):
        return None
    return _png(head) or _gif(head) or _webp(head) or _jpeg(head)


def _png(head: bytes) -> tuple[int, int] | None:
    if head[:8] != b"\x89PNG\r\n\x1a\n" or len(head) < 24:
        return None
    width, height = struct.unpack(">II", head[16:24])
    return (width, height) if width and height else None


def _gif(head: bytes) -> tuple[int, int] | None:
    if head[:6] not in (b"GIF87a", b"GIF89a") or len(head) < 10:
        return None
    width, height = struct.unpack("<HH", head[6:10])
    return (width, height) if width and height else None


def _webp(head: bytes) -> tuple[int, int] | None:
    if head[:4] != b"RIFF" or head[8:12] != b"WEBP" or len(head) < 30:
        return None
    kind = head[12:16]
    if kind == b"VP8X":
        width = 1 + int.from_bytes(head[24:27], "little")
        height = 1 + int.from_bytes(head[27:30], "little")
    elif kind == b"VP8 ":
        width, height = (v & 0x3FFF for v in struct.unpack("<HH", head[26:30]))
    elif kind == b"VP8L":
        bits = int.from_bytes(head[21:25], "little")
        width, height = 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    else:
        return None
    return (width, height) if width and height else None


def _jpeg(head: bytes) -> tuple[int, int] | None:
    if head[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 9 < len(head):
        if head[i] != 0xFF:
            return None
        marker = head[i + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        length = struct.unpack(">H", head[i + 2 : i + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", head[i + 5 : i + 9])
            return (width, height) if width and height else None
        i += 2 + length
    return None
