"""How the simulated provider writes: compact JSON, server-sent events, a stream's parts.

Pure. `compact` is the one JSON style of every body and event (no spaces, UTF-8
as is, like the providers' own), made by one encoder built once: the standard
library builds a new encoder per call for any non-default option, which costs
more than the encoding of a small body.

A `Stream` is an answer cut where its timing changes: ``head`` goes out at
once (OpenAI's role delta; Anthropic's ``message_start``...), ``body`` holds
the tokens (produced lazily, one event each, so the server never holds a whole
stream), ``tail`` ends it, and ``error`` is the wire's mid-stream error event,
sent instead of the rest when a cut fault asks for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Stream", "compact", "compact_bytes", "data_event", "named_event"]

compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""``value`` as compact JSON text."""


def compact_bytes(value: object) -> bytes:
    """``value`` as compact JSON, UTF-8."""
    return compact(value).encode()


@dataclass(frozen=True, slots=True)
class Stream:
    """One answer as events, in the order they go out (see the module docstring)."""

    head: list[bytes]
    body: Iterator[bytes]
    tail: list[bytes]
    error: bytes


def data_event(data: bytes) -> bytes:
    """An unnamed event (OpenAI's kind): ``data: ...`` and a blank line."""
    return b"data: " + data + b"\n\n"


def named_event(name: bytes, data: bytes) -> bytes:
    """A named event (Anthropic's kind): ``event: name``, ``data: ...``, a blank line."""
    return b"event: " + name + b"\ndata: " + data + b"\n\n"
