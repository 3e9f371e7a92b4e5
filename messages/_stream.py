"""What a stream delivers as it arrives: text fragments and tool-call fragments."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from callboard.messages._frozen import quick_init

__all__ = ["DeltaSink", "StreamDelta", "ToolCallDelta"]


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallDelta:
    """A fragment of a tool call: its first names the call (``id``, ``name``); the rest
    carry pieces of its ``arguments`` text, in order."""

    index: int
    """Which of the answer's tool calls this fragment belongs to."""
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class StreamDelta:
    """One step of a streamed answer (OpenAI's ``choices[].delta``, whichever dialect
    the model speaks)."""

    text: str = ""
    """The next fragment of the answer's text ("" for none)."""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    refusal: str = ""
    finish_reason: str | None = None
    """Set on the last delta of a choice."""
    choice: int = 0
    """Which choice it belongs to (``n`` > 1)."""
    logprobs: Mapping[str, Any] | None = None
    """The chunk's ``logprobs`` for this delta's tokens, as the provider sent them."""
    reasoning: str = ""
    """The next fragment of the model's reasoning, as OpenAI-compatible servers of
    reasoning models stream it before and beside the text (DeepSeek's and vLLM's
    ``reasoning_content``, OpenRouter's ``reasoning``, Mistral's thinking parts); not
    part of ``text``. After the fields before it: a delta pickles them by place, and one
    pickled by a process of the version before (a cluster's) read its fields shifted (a
    review)."""
    thinking_blocks: tuple[Mapping[str, Any], ...] = ()
    """A Claude model's thinking blocks that ended with this delta, whole and signed
    (``{"type": "thinking", "thinking", "signature"}`` or ``{"type":
    "redacted_thinking", "data"}``), as the answer's ``thinking_blocks`` has them; their
    text came before, as ``reasoning``. Last of the fields (see ``reasoning``)."""

    @property
    def result_text(self) -> str:
        """What it adds to ``Result.text``, which is choice 0's: its text, or "" for
        another choice's (a cut n=2 stream's partial text mixed both; a review)."""
        return self.text if self.choice == 0 else ""


class DeltaSink(Protocol):
    """Where a streamed call puts its deltas (``runtime.stream.StreamChannel``)."""

    model: str
    """The model whose call feeds it, named by the call as it starts (the last one
    named is the one whose deltas are read: a stream that began is not called again);
    "" before any call."""

    @property
    def received(self) -> bool:
        """Whether a delta has arrived (the stream started: it is not retried)."""
        ...

    async def put(self, delta: StreamDelta) -> None:
        """Append ``delta``, waiting for room; raises if the reader left."""
        ...

    def close(self) -> None:
        """No more deltas."""
        ...

    @property
    def abandoned(self) -> bool:
        """Whether the reader left."""
        ...

    def attach(self, task: asyncio.Task[Any]) -> None:
        """The call's ``task`` is to be cancelled if the reader leaves (at once if it
        has left already)."""
        ...
