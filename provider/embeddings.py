"""OpenAI's embeddings wire for the simulated provider: ``POST /v1/embeddings``.

Pure: bytes in, bytes out. A request's ``input`` is a string, a list of
strings, a list of token ids or a list of such lists; ``dimensions`` sets the
vector length (else the model's `ModelBehaviour.dimensions`);
``encoding_format`` is ``float`` (JSON numbers) or ``base64`` (little-endian
float32, what the official SDK asks for by default).

Invariants, as OpenAI holds them: at most `MAX_INPUTS` inputs per call, none
empty (a 400 naming ``input``); no input over `MAX_INPUT_TOKENS`. An input
costs ``core.tokens.text_tokens`` (callboard's estimate; a token list its length), and
``usage`` reports their sum. Vectors come back in input order, each of unit
length and a pure function of (input, length): every component is
``+-1/sqrt(length)``, its sign a bit of the input's SHAKE-256 hash, so two
texts' vectors are as unrelated as random ones and cost almost nothing to
make.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from callboard.core.tokens import text_tokens
from callboard.provider.engine import Ask
from callboard.provider.sse import compact_bytes
from callboard.provider.wire import BadRequestError

__all__ = [
    "MAX_DIMENSIONS",
    "MAX_INPUTS",
    "MAX_INPUT_TOKENS",
    "EmbeddingRequest",
    "embeddings_body",
    "parse_embeddings",
    "vector",
]

MAX_INPUTS = 2048
MAX_INPUT_TOKENS = 8192
MAX_DIMENSIONS = 16384
_FIELDS = frozenset({"model", "input", "dimensions", "encoding_format", "user"})


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """What the provider needs from an embeddings request."""

    model: str
    inputs: tuple[bytes, ...]
    """Each input as the bytes its vector is seeded by (UTF-8 text, or its token ids)."""
    prompt_tokens: int
    dimensions: int | None
    base64: bool

    @property
    def ask(self) -> Ask:
        """An embedding's whole cost is its input; there is no output to size."""
        return Ask(self.prompt_tokens, fixed_tokens=0)


def parse_embeddings(body: bytes) -> EmbeddingRequest:
    """The embeddings request in ``body``, or `BadRequestError` naming the field."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError("We could not parse the JSON body of your request.") from exc
    if not isinstance(data, dict):
        raise BadRequestError("The request body must be a JSON object.")
    unknown = [k for k in data if k not in _FIELDS]
    if unknown:
        raise BadRequestError(f"Unrecognized request argument supplied: {min(unknown)}")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("you must provide a model parameter", "model")
    inputs, tokens = _inputs(data.get("input"))
    dimensions = data.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, int)
        or not 1 <= dimensions <= MAX_DIMENSIONS
    ):
        raise BadRequestError(
            f"Invalid 'dimensions': must be an integer in 1..{MAX_DIMENSIONS}", "dimensions"
        )
    encoding = data.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadRequestError(
            "Invalid 'encoding_format': must be 'float' or 'base64'", "encoding_format"
        )
    return EmbeddingRequest(model, inputs, tokens, dimensions, encoding == "base64")


def _inputs(value: object) -> tuple[tuple[bytes, ...], int]:
    """The inputs as seed bytes, and their tokens."""
    if isinstance(value, str):
        items: Sequence[Any] = [value]
    elif isinstance(value, list) and value and all(_is_token(t) for t in value):
        items = [value]  # one input given as token ids
    elif isinstance(value, list):
        items = value
    else:
        raise BadRequestError("'input' is a required property: a string or an array", "input")
    if not items:
        raise BadRequestError("'$.input' is invalid: an empty array", "input")
    if len(items) > MAX_INPUTS:
        raise BadRequestError(
            f"'$.input' is invalid: at most {MAX_INPUTS} inputs per request, got {len(items)}",
            "input",
        )
    seeds: list[bytes] = []
    total = 0
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            seeds.append(item.encode("utf-8", "surrogatepass"))  # a lone surrogate too
            tokens = text_tokens(item)
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            seeds.append(struct.pack(f"<{len(item)}q", *item))
            tokens = len(item)
        else:
            raise BadRequestError(
                f"'$.input[{i}]' is invalid: a non-empty string or array of token ids", "input"
            )
        if tokens > MAX_INPUT_TOKENS:
            raise BadRequestError(
                f"This model's maximum context length is {MAX_INPUT_TOKENS} tokens, however "
                f"input[{i}] has {tokens} tokens. Please reduce your input.",
                "input",
            )
        total += tokens
    return tuple(seeds), total


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def embeddings_body(request: EmbeddingRequest, *, model: str, dimensions: int = 1536) -> bytes:
    """The ``list`` of ``embedding`` objects, in input order, as JSON bytes; ``dimensions``
    is the length when the request asks none."""
    length = request.dimensions or dimensions
    encode = _base64 if request.base64 else _floats
    parts = [
        b'{"object":"embedding","index":%d,"embedding":%s}' % (i, encode(seed, length))
        for i, seed in enumerate(request.inputs)
    ]
    usage = {"prompt_tokens": request.prompt_tokens, "total_tokens": request.prompt_tokens}
    tail = compact_bytes({"model": model, "usage": usage})
    return b'{"object":"list","data":[' + b",".join(parts) + b"]," + tail[1:]


def vector(seed: bytes, length: int) -> list[float]:
    """The unit vector of ``seed`` (see the module docstring), as float32 values."""
    raw = _signs(seed, length)
    return list(struct.unpack(f"<{length}f", raw))


@functools.lru_cache(maxsize=1024)
def _signs(seed: bytes, length: int) -> bytes:
    """The vector as little-endian float32 bytes."""
    table = _table(length)
    bits = hashlib.shake_256(seed).digest(-(-length // 8))
    return b"".join(table[b] for b in bits)[: 4 * length]


@functools.lru_cache(maxsize=64)
def _table(length: int) -> tuple[bytes, ...]:
    """For each byte, its 8 bits as 8 float32 components of +-1/sqrt(length)."""
    plus = struct.pack("<f", 1 / math.sqrt(length))
    minus = struct.pack("<f", -1 / math.sqrt(length))
    return tuple(b"".join(plus if b >> k & 1 else minus for k in range(8)) for b in range(256))


def _base64(seed: bytes, length: int) -> bytes:
    return b'"' + base64.b64encode(_signs(seed, length)) + b'"'


def _floats(seed: bytes, length: int) -> bytes:
    plus, minus = _numbers(length)
    bits = hashlib.shake_256(seed).digest(-(-length // 8))
    values = [plus if b >> k & 1 else minus for b in bits for k in range(8)][:length]
    return b"[" + b",".join(values) + b"]"


@functools.lru_cache(maxsize=64)
def _numbers(length: int) -> tuple[bytes, bytes]:
    """+-1/sqrt(length) rounded to float32, as JSON numbers."""
    (value,) = struct.unpack("<f", struct.pack("<f", 1 / math.sqrt(length)))
    return repr(value).encode(), repr(-value).encode()
