"""The simulator's prompt-size rule (provider/tokens.py): text, images by each provider's
published rule, tools and schemas."""

from __future__ import annotations

import base64
import struct

import pytest
from callboard.provider.tokens import (
    anthropic_image_tokens,
    count_anthropic_tokens,
    count_prompt_tokens,
    image_size,
    openai_image_tokens,
)


def data_url(kind: str, head: bytes) -> str:
    return f"data:image/{kind};base64,{base64.b64encode(head).decode()}"


def png(width: int, height: int) -> bytes:
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", 13)
        + b"IHDR"
        + struct.pack(">II", width, height)
        + b"\x08\x02\0\0\0"
    )


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\0\0\0"


def jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0" + b"\0" * 9
    sof = b"\xff\xc0" + struct.pack(">HBHH", 17, 8, height, width) + b"\x03" + b"\0" * 9
    return b"\xff\xd8" + app0 + sof


def webp(width: int, height: int) -> bytes:
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\0" * 4
    return (
        b"RIFF\0\0\0\0WEBP"
        + vp8x
        + (width - 1).to_bytes(3, "little")
        + (height - 1).to_bytes(3, "little")
    )


@pytest.mark.parametrize(
    ("kind", "make"), [("png", png), ("gif", gif), ("jpeg", jpeg), ("webp", webp)]
)
def test_image_sizes_are_read_from_the_header(kind: str, make: object) -> None:
    assert callable(make)
    assert image_size(data_url(kind, make(640, 480))) == (640, 480)


def test_an_image_that_cannot_be_read_has_no_size() -> None:
    assert image_size("https://example.com/cat.png") is None
    assert image_size("data:image/png;base64,!!!") is None
    assert image_size(data_url("png", b"not an image")) is None


@pytest.mark.parametrize(
    ("size", "detail", "tokens"),
    [
        ((1024, 1024), "high", 765),  # 768x768: 4 tiles
        ((2048, 4096), "high", 1105),  # 1024x2048 then 768x1536: 2x3 tiles
        ((512, 512), "auto", 255),
        ((4000, 4000), "low", 85),
    ],
)
def test_openai_images_follow_the_tile_rule(
    size: tuple[int, int], detail: str, tokens: int
) -> None:
    assert openai_image_tokens(data_url("png", png(*size)), detail) == tokens


def test_anthropic_images_cost_their_area_over_750_once_they_fit() -> None:
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png(750, 750)).decode(),
    }
    assert anthropic_image_tokens(source) == 750
    big = {**source, "data": base64.b64encode(png(3136, 1568)).decode()}
    assert anthropic_image_tokens(big) == 1568 * 784 // 750 + 1
    assert anthropic_image_tokens({"type": "url", "url": "https://x"}) == 1399  # 1024 x 1024


def test_plain_text_is_a_quarter_of_its_characters_plus_framing() -> None:
    assert count_prompt_tokens([{"role": "user", "content": "abcde"}]) == 2 + 4 + 3
    two = [{"role": "system", "content": "x" * 8}, {"role": "user", "content": "y"}]
    assert count_prompt_tokens(two) == (2 + 4) + (1 + 4) + 3


def test_tool_calls_tools_and_schemas_count_as_their_text() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "abcd", "arguments": "{}"}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    assert count_prompt_tokens(messages) == 2 + 4 + 3  # ceil(6 / 4)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert count_prompt_tokens(messages, tools=tools) == 9 + 12  # 45 characters of JSON
    assert count_prompt_tokens(messages, schema={"type": "object"}) == 9 + 5


def test_an_anthropic_body_counts_system_blocks_and_tools() -> None:
    body = {
        "system": "abcd",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "ab", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "abcd"}],
            },
        ],
    }
    assert count_anthropic_tokens(body) == 3 + (1 + 4) + (2 + 4) + (1 + 4) + (1 + 4)
