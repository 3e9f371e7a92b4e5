"""The embeddings wire (provider/embeddings.py): inputs as OpenAI takes them, refusals as
OpenAI words them, and vectors that are unit length and a function of their input."""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

import pytest
from callboard.provider.embeddings import (
    MAX_INPUT_TOKENS,
    MAX_INPUTS,
    embeddings_body,
    parse_embeddings,
    vector,
)
from callboard.provider.wire import BadRequestError


def parse(**body: Any) -> Any:
    return parse_embeddings(json.dumps({"model": "e", **body}).encode())


@pytest.mark.parametrize(
    ("given", "count", "tokens"),
    [
        ("hello", 1, 2),
        (["a", "abcde"], 2, 1 + 2),
        ([1, 2, 3], 1, 3),
        ([[1, 2], [3]], 2, 3),
    ],
    ids=["string", "strings", "token-ids", "token-id-lists"],
)
def test_every_input_shape_is_read(given: Any, count: int, tokens: int) -> None:
    request = parse(input=given)
    assert len(request.inputs) == count
    assert request.prompt_tokens == request.ask.prompt_tokens == tokens
    assert request.ask.fixed_tokens == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a"] * (MAX_INPUTS + 1)}, "input"),
        ({"input": "x " * (MAX_INPUT_TOKENS + 1)}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "model": ""}, "model"),
        ({"input": "a", "colour": 1}, None),
    ],
)
def test_what_openai_refuses_is_a_400_naming_the_param(
    body: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(BadRequestError) as refused:
        parse(**body)
    assert refused.value.param == param


def test_vectors_are_unit_length_deterministic_and_distinct() -> None:
    a, b = vector(b"alpha", 256), vector(b"beta", 256)
    assert len(a) == 256
    assert math.fsum(x * x for x in a) == pytest.approx(1.0, abs=1e-6)
    assert vector(b"alpha", 256) == a
    assert abs(math.fsum(x * y for x, y in zip(a, b, strict=True))) < 0.3  # unrelated


def test_the_body_keeps_input_order_in_both_encodings() -> None:
    texts = ["alpha", "beta", "gamma"]
    floats = json.loads(embeddings_body(parse(input=texts, dimensions=12), model="e"))
    packed = json.loads(
        embeddings_body(parse(input=texts, encoding_format="base64"), model="e", dimensions=12)
    )
    assert floats["object"] == "list"
    assert floats["model"] == "e"
    assert floats["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    for i, (text, as_floats, as_base64) in enumerate(
        zip(texts, floats["data"], packed["data"], strict=True)
    ):
        assert as_floats["index"] == as_base64["index"] == i
        assert as_floats["embedding"] == pytest.approx(vector(text.encode(), 12))
        raw = base64.b64decode(as_base64["embedding"])
        assert list(struct.unpack("<12f", raw)) == vector(text.encode(), 12)


def test_a_lone_surrogate_is_embedded_not_a_crash() -> None:
    """JSON can carry a lone surrogate (``"\\ud800"``); the simulator seeds its vector
    from it as from any text (it answered 500: UTF-8 has no form for one)."""
    request = parse_embeddings(b'{"model": "e", "input": ["x\\ud800", "x"]}')
    assert len(request.inputs) == 2
    assert request.inputs[0] != request.inputs[1]
