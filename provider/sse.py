"""Server-sent events as the simulated provider writes them: framing, and a stream's parts.

Pure. A `Stream` is an answer cut where its timing changes: ``head`` goes out
at once (OpenAI's role delta; Anthropic's ``message_start``...), ``body``
holds the tokens (produced lazily, one event each, so the server never holds a
whole stream), ``tail`` ends it, and ``error`` is the wire's mid-stream error
event, sent instead of the rest when a cut fault asks for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Stream", "data_event", "named_event"]


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
