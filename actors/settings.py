"""Settings the actors run with: plain frozen data, validated on construction.

``Secret`` wraps an API key so that it never reaches a repr, a log line, a
result or an error; only ``Secret.reveal()`` gives the value, and only the
HTTP layer calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Literal

from callboard.messages import ConfigError

from .breaker import BreakerConfig
from .limiter import LimiterConfig
from .pricing import Price
from .retry import RetryConfig


class Secret:
    """A value that prints as ``***``."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Per-attempt timeouts in seconds: connect, read (between bytes), total."""

    connect: float = 5.0
    read: float = 60.0
    total: float = 120.0

    def __post_init__(self) -> None:
        for name in ("connect", "read", "total"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"timeout.{name} must be a positive number, got {value!r}")


FREE = Price(input_per_mtok=Decimal(0), output_per_mtok=Decimal(0))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSettings:
    """One model deployment: where it is, what it may do, how it is protected."""

    name: str
    """callboard's name for it (what requests and routes say)."""
    base_url: str
    """An OpenAI-compatible base URL, e.g. ``https://api.openai.com/v1``."""
    provider_model: str | None = None
    """The model name sent to the provider (default: ``name``)."""
    api_key: Secret | None = None
    max_concurrency: int = 64
    timeout: Timeouts = field(default_factory=Timeouts)
    price: Price = FREE
    context_window: int = 128_000
    capabilities: frozenset[str] = frozenset()
    tiers: tuple[str, ...] = ()
    """Route names (aliases) this model serves, e.g. ("fast", "cheap")."""
    fallbacks: tuple[str, ...] = ()
    """Models to try, in order, when this one fails or its breaker is open."""
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    limiter: LimiterConfig = field(default_factory=lambda: LimiterConfig(rpm=None, tpm=None))
    retry: RetryConfig = field(default_factory=RetryConfig)
    transport: Literal["aiohttp", "httpx"] = "aiohttp"
    """``aiohttp`` (default, measured fastest) or httpx's own (for HTTP/2, proxies)."""
    http2: bool = False

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"model name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.base_url, str) or not self.base_url.startswith(
            ("http://", "https://")
        ):
            raise ConfigError(
                f"model {self.name!r}: base_url must be http(s), got {self.base_url!r}"
            )
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise ConfigError(f"model {self.name!r}: max_concurrency must be >= 1")
        if not isinstance(self.context_window, int) or self.context_window < 1:
            raise ConfigError(f"model {self.name!r}: context_window must be >= 1")
        if self.transport not in ("aiohttp", "httpx"):
            raise ConfigError(f"model {self.name!r}: transport must be 'aiohttp' or 'httpx'")
        if self.http2 and self.transport != "httpx":
            raise ConfigError(f"model {self.name!r}: http2 needs transport = 'httpx'")
        if self.name in self.fallbacks:
            raise ConfigError(f"model {self.name!r} lists itself as a fallback")

    @property
    def wire_model(self) -> str:
        return self.provider_model or self.name


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerSettings:
    """Queue and admission."""

    capacity: int = 100_000
    """Tasks accepted and not yet finished, at most."""
    aging_step_s: float | None = 10.0
    """A waiting task gains one priority level per this many seconds (None: no aging)."""
    escalate_margin_s: float = 1.0
    """With ``escalate_to`` set: a task still waiting this long before its deadline
    (or twice the escalation model's latency, if longer) is moved to that model."""

    def __post_init__(self) -> None:
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise ConfigError(f"queue capacity must be a positive integer, got {self.capacity!r}")
        if self.aging_step_s is not None and not self.aging_step_s > 0:
            raise ConfigError(f"aging_step_s must be positive or None, got {self.aging_step_s!r}")
        m = self.escalate_margin_s
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m < float("inf"):
            raise ConfigError(f"escalate_margin_s must be a finite number >= 0, got {m!r}")
