"""The simulated provider's prompt cache: which prompt prefixes a model has seen lately.

Pure apart from the ``now`` every call is given. The wires decide what prefix a
request offers for caching and how many tokens it holds (OpenAI: everything
before the last message, automatically, from `MIN_TOKENS` on, in steps of
`STEP`; Anthropic: everything up to the last ``cache_control`` mark, from
`MIN_TOKENS` on); this remembers the prefixes, so the second request with the
same prefix reads it from the cache.

Invariants: at most `CAPACITY` prefixes per model (the least recently used goes
first); a prefix unused for `TTL_S` seconds is forgotten (Anthropic's default
cache lifetime; OpenAI's is similar); a lookup of a prefix stores it, so a miss
is a write.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from callboard.provider.sse import compact

__all__ = ["CAPACITY", "MIN_TOKENS", "STEP", "TTL_S", "Prefix", "PromptCache", "prefix_key"]

CAPACITY = 1024
MIN_TOKENS = 1024
"""The shortest prefix either provider caches."""
STEP = 128
"""OpenAI caches a prefix in steps of this many tokens."""
TTL_S = 300.0


@dataclass(frozen=True, slots=True)
class Prefix:
    """What a request offers for caching."""

    key: bytes
    tokens: int


def prefix_key(value: object) -> bytes:
    """A short digest of a prefix (any JSON value)."""
    return hashlib.blake2b(compact(value).encode(), digest_size=16).digest()


class PromptCache:
    """One model's recently seen prefixes (see the module docstring)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def lookup(self, key: bytes, now: float) -> bool:
        """Whether ``key`` was seen within `TTL_S`; it is (re)stored either way."""
        seen = self._seen.pop(key, None)
        self._seen[key] = now
        while len(self._seen) > CAPACITY:
            self._seen.popitem(last=False)
        return seen is not None and now - seen <= TTL_S
