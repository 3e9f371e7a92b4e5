"""Prompt-size estimates: how many tokens a chat will cost before it is sent.

Theory of operation
-------------------
The limiter reserves ``prompt + max_tokens`` tokens before a call, so every
request needs a prompt estimate at the front door, computed once and cheaply.
The default, ``estimate_prompt_tokens``, counts characters: each message
costs ``ceil(len(content) / 4) + 4`` (four characters per token, four tokens
of per-message framing) and the reply primer costs 3. The simulated provider
counts exactly this way, so estimates and reported usage agree there; against
a real provider it is an approximation (its own tokenizer decides).

What always holds: an estimate is an ``int`` >= 3, pure, and depends only on
the messages.
"""

from __future__ import annotations

from collections.abc import Sequence

from callboard.messages import ChatMessage

__all__ = ["MESSAGE_OVERHEAD", "REPLY_PRIMER", "estimate_prompt_tokens"]

MESSAGE_OVERHEAD = 4
"""Tokens of framing per message (role, separators)."""
REPLY_PRIMER = 3
"""Tokens that prime the assistant's reply."""


def estimate_prompt_tokens(messages: Sequence[ChatMessage]) -> int:
    """sum(ceil(len(content) / 4) + 4 per message) + 3: fast and character-based."""
    return sum((len(m.content) + 3) // 4 + MESSAGE_OVERHEAD for m in messages) + REPLY_PRIMER
