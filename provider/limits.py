"""Server-side rate limits of the simulated provider, the way OpenAI applies them.

Pure: no I/O, no clock of its own; every call takes ``now`` (monotonic seconds).

A model has up to two token buckets, requests and tokens. Each refills
continuously at ``limit / 60`` per second up to a capacity of ``burst_s``
seconds' worth (at least one request). Invariants:

- a refused request is not charged, in either bucket;
- an admitted request is charged in both buckets exactly what it costs;
- a request larger than a bucket's capacity is admitted when the bucket is
  full and leaves it in debt, so no single request is impossible and the
  long-run rate still holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["LimitKind", "ModelLimits", "Refusal", "TokenBucket", "Window", "format_duration"]

LimitKind = Literal["requests", "tokens"]

_SLACK = 1e-6
"""Rounding slack: a client that waits exactly the advertised time is admitted."""


@dataclass(slots=True)
class TokenBucket:
    """A continuously refilling bucket that may go into debt (negative level)."""

    limit: int
    """The per-minute limit, as reported in ``x-ratelimit-limit-*``."""
    capacity: float
    level: float
    updated: float

    @classmethod
    def per_minute(cls, limit: int, burst_s: float, now: float) -> TokenBucket:
        """A full bucket for ``limit`` per minute holding ``burst_s`` seconds' worth."""
        capacity = max(limit * burst_s / 60.0, 1.0)
        return cls(limit=limit, capacity=capacity, level=capacity, updated=now)

    @property
    def rate(self) -> float:
        """Refill per second."""
        return self.limit / 60.0

    def refill(self, now: float) -> None:
        """Add what has dripped in since the last call (time never runs back)."""
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` may be taken (0.0 = now); call after `refill`."""
        need = min(amount, self.capacity) - _SLACK
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def remaining(self) -> int:
        return max(0, math.floor(self.level))

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, self.capacity - self.level) / self.rate


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the limits refuse: which limit, and how long until it would pass."""

    kind: LimitKind
    wait_s: float


@dataclass(frozen=True, slots=True)
class Window:
    """One bucket's state as a wire reports it in its rate-limit headers."""

    kind: LimitKind
    limit: int
    """The per-minute limit."""
    remaining: int
    reset_s: float
    """Seconds until the bucket is full again."""


class ModelLimits:
    """The request and token buckets of one model (either may be absent)."""

    __slots__ = ("requests", "tokens")

    def __init__(self, rpm: int | None, tpm: int | None, burst_s: float, now: float) -> None:
        self.requests = None if rpm is None else TokenBucket.per_minute(rpm, burst_s, now)
        self.tokens = None if tpm is None else TokenBucket.per_minute(tpm, burst_s, now)

    @property
    def limited(self) -> bool:
        return self.requests is not None or self.tokens is not None

    def try_admit(self, now: float, tokens: int) -> Refusal | None:
        """Charge one request of ``tokens`` and return None, or refuse and charge nothing."""
        wait_requests = _wait(self.requests, now, 1)
        wait_tokens = _wait(self.tokens, now, tokens)
        if wait_requests > 0.0 or wait_tokens > 0.0:
            kind: LimitKind = "requests" if wait_requests >= wait_tokens else "tokens"
            return Refusal(kind, max(wait_requests, wait_tokens))
        if self.requests is not None:
            self.requests.level -= 1
        if self.tokens is not None:
            self.tokens.level -= tokens
        return None

    def windows(self, now: float) -> tuple[Window, ...]:
        """The state of the buckets this model has (requests first)."""
        windows = []
        buckets: tuple[tuple[LimitKind, TokenBucket | None], ...] = (
            ("requests", self.requests),
            ("tokens", self.tokens),
        )
        for kind, bucket in buckets:
            if bucket is not None:
                bucket.refill(now)
                windows.append(Window(kind, bucket.limit, bucket.remaining(), bucket.reset_s()))
        return tuple(windows)


def _wait(bucket: TokenBucket | None, now: float, amount: int) -> float:
    if bucket is None:
        return 0.0
    bucket.refill(now)
    return bucket.wait_for(amount)


def format_duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format: ``"0s"``, ``"120ms"``, ``"1.5s"``, ``"6m0s"``."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
