"""Settings the actors run with: plain frozen data, validated on construction.

Secrets are ``Secret`` values (core/secret.py) that never reach a repr, a log
line, a result or an error; only the HTTP layer calls ``reveal()``.
``ModelSettings`` wraps what it is given as a plain string: the API key
(refusing one that could not be sent as a header, ``SENDABLE_KEY``), the
proxy URL, and a ``base_url`` that carries credentials or key-like query
parameters, which then shows masked (``https://***@host/v1?key=***``).

Collections are normalised on construction (``capabilities`` to a frozenset,
``tiers`` and ``fallbacks`` to tuples); a bare string is refused there, since
iterating it would make every letter a name.
"""

from __future__ import annotations

import importlib.util
import math
import re
import urllib.parse
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Literal, TypeGuard

from callboard.core.breaker import BreakerConfig
from callboard.core.limiter import LimiterConfig
from callboard.core.pqueue import MIN_AGING_SHARE
from callboard.core.pricing import ANTHROPIC_CACHE_TIMES, Price
from callboard.core.retry import RetryConfig
from callboard.core.secret import Secret as Secret  # noqa: PLC0414 - re-exported, known from here
from callboard.core.secret import guarded_url, masked_url, quoted, reveal, url_credentials
from callboard.messages import (
    HEADER_NAME,
    MAX_INPUTS,
    REASONING_BACK,
    ConfigError,
    FrozenMap,
    credential_like,
    is_number,
    shown_value,
)

SENDABLE_KEY = re.compile(r"[\x21-\x7e]+")
"""What an API key may hold: printable ASCII, no whitespace, no control characters
(a stray CR/LF from a paste or a CRLF ``.env`` file can never be sent as a header,
and an HTTP client refusing it may log the header, key included)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Per-attempt timeouts in seconds: connect, read (between bytes), total."""

    connect: float = 5.0
    read: float = 60.0
    total: float = 120.0

    def __post_init__(self) -> None:
        for name in ("connect", "read", "total"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value > 0):
                raise ConfigError(f"timeout.{name} must be a positive number, got {value!r}")


FREE = Price(input_per_mtok=Decimal(0), output_per_mtok=Decimal(0))


class SecretField:
    """The type of a ``ModelSettings`` field given as a plain string or a ``Secret`` (or
    None) and read as a ``Secret`` (or None), the string wrapped by ``__post_init__``:
    ``api_key`` and ``proxy``. A type checker takes the field's constructor argument
    from ``__set__`` and what it reads from ``__get__`` (a dataclass field typed by a
    descriptor), so ``ModelSettings(api_key="sk-...")`` checks, as the docs show it, and
    ``settings.api_key.reveal()`` too. At run time the field is the dataclass's slot:
    this object only gives its default, None."""

    def __get__(self, obj: object, owner: type | None = None) -> Secret | None:
        return None  # asked only by ``dataclass``, for the field's default

    def __set__(self, obj: object, value: str | Secret | None) -> None:
        raise AttributeError("a ModelSettings is frozen")  # the slot takes every write


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSettings:
    """One model deployment: where it is, what it may do, how it is protected."""

    name: str
    """callboard's name for it (what requests and routes say)."""
    base_url: str | Secret
    """An OpenAI-compatible base URL, e.g. ``https://api.openai.com/v1``. Given as a
    string that carries credentials (``user:pass@``, sent as a Basic ``Authorization``
    header) or key-like query parameters (``?key=``), it is kept as a ``Secret``
    showing it masked."""
    provider_model: str | None = None
    """The model name sent to the provider (default: ``name``)."""
    api_key: SecretField = SecretField()
    """The provider's API key: a ``Secret``; a plain string is wrapped in one (refused
    if it could not be sent as a header, ``SENDABLE_KEY``)."""
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
    """Offer HTTP/2 (transport ``httpx``; needs ``pip install 'callboard[http2]'``)."""
    proxy: SecretField = SecretField()
    """An HTTP(S) proxy for this model's calls, e.g. ``http://proxy:3128`` (transport
    ``httpx``). A plain string is wrapped: a proxy URL may carry credentials."""
    api: Literal["openai", "azure", "anthropic"] = "openai"
    """The dialect the provider speaks: OpenAI's Chat Completions (and every server
    compatible with it), Azure OpenAI (``base_url`` the resource endpoint,
    ``provider_model`` the deployment, the key in ``api-key``) or Anthropic's Messages
    API (``base_url`` e.g. ``https://api.anthropic.com/v1``, the key in ``x-api-key``)."""
    api_version: str | None = None
    """Azure's ``api-version`` query or Anthropic's ``anthropic-version`` header (None:
    the dialect's default)."""
    headers: Mapping[str, str | Secret] = field(default_factory=dict)
    """Headers every call carries besides the dialect's own (and over them), e.g.
    ``{"X-Title": "my app"}``; a value from the environment (``headers_env``) is a
    ``Secret``, redacted like the key."""
    max_tokens_param: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    """The body field the completion cap is sent in: OpenAI's reasoning and newer
    models (o1, o3, gpt-5...) refuse ``max_tokens`` and want ``max_completion_tokens``;
    many compatible servers know only ``max_tokens``."""
    sends_back: frozenset[str] = frozenset()
    """What of an earlier answer's reasoning this model is sent back in the
    conversation's assistant turns (a model of OpenAI's or Azure's dialect; a Claude
    model is always sent its signed thinking): ``reasoning_content`` (DeepSeek's
    thinking mode requires it in a tool loop) and ``thinking_blocks`` (a proxy that
    speaks OpenAI's wire in front of Claude: LiteLLM's, OpenRouter). None by default:
    OpenAI's API refuses a field of a message it does not know."""
    embedding_batch_size: int = 2048
    """The most texts one embeddings call carries (OpenAI's limit, also the most a
    ``Request`` holds); ``embed`` splits a longer input into calls of at most this many."""
    embedding_batch_tokens: int = 300_000
    """The most tokens (estimated) one embeddings call carries: OpenAI's documented
    limit per request. ``embed`` splits by it too, and by the model's tokens per minute
    and context window (what routing admits for one call)."""

    @property
    def refunds_tokens(self) -> bool:
        """Whether the provider's token limit gives back what a call reserved (its
        ``max_tokens``) and did not use: Anthropic's does (output tokens are estimated
        from ``max_tokens`` as a request arrives, then adjusted to those used); OpenAI's
        and Azure's count the prompt and all of ``max_tokens`` as the request arrives
        ("usage needs are estimated from this value"), and give nothing back. Settled to
        the tokens used, callboard sent 1.4x an OpenAI tokens-per-minute limit and drew
        its 429s (found by a hunt). ``limiter.refunds`` says otherwise for a server that
        counts as the other API does (a compatible server counting the tokens used)."""
        if self.limiter.refunds is not None:
            return self.limiter.refunds
        return self.api == "anthropic"

    def _name_lists(self) -> None:
        """Its lists of names, checked and normalised (``capabilities`` and
        ``sends_back`` to frozensets, ``tiers`` and ``fallbacks`` to tuples)."""
        where = f"model {self.name!r}"
        caps = _names(self.capabilities, f"{where}: capabilities")
        object.__setattr__(self, "capabilities", frozenset(caps))
        object.__setattr__(self, "tiers", _names(self.tiers, f"{where}: tiers"))
        object.__setattr__(self, "fallbacks", _names(self.fallbacks, f"{where}: fallbacks"))
        back = frozenset(_names(self.sends_back, f"{where}: sends_back"))
        if not back <= REASONING_BACK:
            raise ConfigError(
                f"{where}: sends_back takes {sorted(REASONING_BACK)}, got "
                f"{shown_value(min(back - REASONING_BACK))}"
            )
        object.__setattr__(self, "sends_back", back)

    def __post_init__(self) -> None:
        if not shown_name(self.name):
            raise ConfigError(
                f"model name must be a non-empty string of printable text, no line breaks "
                "or control characters and no space at either end (it is sent in answers' "
                f"headers and written in logs and metrics), got {shown_value(self.name)}"
            )
        _check_parts(self)
        object.__setattr__(self, "base_url", _base_url(self.base_url, self.name))
        object.__setattr__(self, "api_key", _api_key(self.api_key, self.name))
        if self.api_key is not None and url_credentials(reveal(self.base_url)) is not None:
            raise ConfigError(
                f"model {self.name!r}: give an api_key or credentials in the base_url "
                "(user:pass@), not both: each would be the request's Authorization header"
            )
        for what in (
            "max_concurrency",
            "context_window",
            "embedding_batch_size",
            "embedding_batch_tokens",
        ):
            if not _is_count(getattr(self, what)):
                raise ConfigError(f"model {self.name!r}: {what} must be an integer >= 1")
        self._name_lists()
        if self.embedding_batch_size > MAX_INPUTS:
            raise ConfigError(
                f"model {self.name!r}: embedding_batch_size must be at most {MAX_INPUTS} "
                f"(the texts one request holds), got {self.embedding_batch_size}"
            )
        if self.transport not in ("aiohttp", "httpx"):
            raise ConfigError(f"model {self.name!r}: transport must be 'aiohttp' or 'httpx'")
        if self.http2 and self.transport != "httpx":
            raise ConfigError(f"model {self.name!r}: http2 needs transport = 'httpx'")
        if self.http2 and importlib.util.find_spec("h2") is None:
            raise ConfigError(
                f"model {self.name!r}: http2 needs the h2 package: pip install 'callboard[http2]'"
            )
        object.__setattr__(self, "proxy", _proxy(self.proxy, self.name, self.transport))
        if self.max_tokens_param not in ("max_tokens", "max_completion_tokens"):
            raise ConfigError(
                f"model {self.name!r}: max_tokens_param must be 'max_tokens' or "
                f"'max_completion_tokens', got {shown_value(self.max_tokens_param)}"
            )
        if self.name in self.fallbacks:
            raise ConfigError(f"model {self.name!r} lists itself as a fallback")
        if self.api not in ("openai", "azure", "anthropic"):
            raise ConfigError(
                f"model {self.name!r}: api must be 'openai', 'azure' or 'anthropic', "
                f"got {shown_value(self.api)}"
            )
        v = self.api_version
        if v is not None and (not isinstance(v, str) or not SENDABLE_KEY.fullmatch(v)):
            raise ConfigError(f"model {self.name!r}: api_version must be a plain string")
        object.__setattr__(self, "headers", _headers(self.headers, self.name))
        object.__setattr__(self, "price", _dialect_price(self.price, self.api))

    @property
    def wire_model(self) -> str:
        return self.provider_model or self.name


_PARTS: tuple[tuple[str, type], ...] = (
    ("timeout", Timeouts),
    ("price", Price),
    ("breaker", BreakerConfig),
    ("limiter", LimiterConfig),
    ("retry", RetryConfig),
)
"""A model's parts given as objects of their own: a ``dict`` (a TOML table's shape) or a
number (``timeout=30``, the SDKs' spelling) would fail later, on the actor, after a call
was paid for (a price read when the answer is settled crashed the model actor after
every answer, and each restart sent the call again)."""


def check_kinds(config: object, parts: tuple[tuple[str, type], ...], where: str = "") -> None:
    """``ConfigError`` unless each of ``config``'s ``parts`` (attribute name, kind) is
    an object of its kind; ``where`` starts the message."""
    for what, kind in parts:
        value = getattr(config, what)
        if not isinstance(value, kind):
            raise ConfigError(
                f"{where}{what} must be a {kind.__name__}, got "
                f"{type(value).__name__} {value!r:.60} (callboard.{kind.__name__}(...); "
                "a TOML file's table is read into one)"
            )


def _check_parts(m: ModelSettings) -> None:
    """``m``'s parts of their kinds, and its wire name and flags as typed."""
    check_kinds(m, _PARTS, f"model {m.name!r}: ")
    wire = m.provider_model
    if wire is not None and not shown_name(wire):
        raise ConfigError(
            f"model {m.name!r}: provider_model must be None or a non-empty string of "
            f"printable text on one line (it is sent in each body), got {quoted(wire)}"
        )
    if type(m.http2) is not bool:
        raise ConfigError(f"model {m.name!r}: http2 must be true or false")


def _dialect_price(price: Price, api: str) -> Price:
    """``price`` as the dialect charges: Anthropic's, which publishes one rule for every
    model, charges cache reads and writes ``ANTHROPIC_CACHE_TIMES`` the input price unless
    the price says otherwise (OpenAI's cached discount differs by model: none assumed)."""
    if api != "anthropic" or price == FREE:  # unpriced stays unpriced: made a price of
        return price  # zeros, its cost was shown $0, not unknown, unwarned (a hunt)
    return price.caching_at(*ANTHROPIC_CACHE_TIMES)


def _base_url(url: object, model: str) -> str | Secret:
    """``url`` as a string, or as a ``Secret`` if it carries any (``guarded_url``); an
    error shows it masked."""
    text = reveal(url) if isinstance(url, Secret) else url
    shown = str(url) if isinstance(url, Secret) else None  # marked secret: shown masked whole
    if not isinstance(text, str) or not text.startswith(("http://", "https://")):
        got = shown or (masked_url(text) if isinstance(text, str) else f"a {type(text).__name__}")
        raise ConfigError(f"model {model!r}: base_url must be http(s), got {got!r}")
    _reachable(text, model, "base_url", shown or masked_url(text))
    return url if isinstance(url, Secret) else guarded_url(text)


def _reachable(text: str, model: str, field: str, shown: str) -> None:
    """A ``ConfigError`` unless the URL ``text`` names a host (and, if it gives one, a
    port in 1..65535) and holds no white space or control character: else every call
    would fail, blamed on the provider (a proxy's typo took its model down for good, and
    a ``\n`` an .env file left failed only at start, past the ledger; found by a hunt)."""
    if any(c.isspace() or not c.isprintable() for c in text):
        raise ConfigError(
            f"model {model!r}: {field} holds white space or a control character (often a "
            f"line end an .env file left), got {shown!r}"
        )
    try:
        parts = urllib.parse.urlsplit(text)
        host, port = parts.hostname, parts.port  # a port that is no port raises
    except ValueError:
        host, port = None, -1
    if not host or port in (-1, 0):
        raise ConfigError(
            f"model {model!r}: {field} needs a host and, if it gives one, a port in "
            f"1..65535, got {shown!r}"
        )


def _proxy(proxy: object, model: str, transport: str) -> Secret | None:
    """``proxy`` as a ``Secret`` (it may hold credentials) showing it masked; never
    echoed in an error."""
    if proxy is None:
        return None
    if isinstance(proxy, str):
        proxy = Secret.of_url(proxy)
    if not isinstance(proxy, Secret):
        raise ConfigError(f"model {model!r}: proxy must be a URL string or a Secret")
    if transport != "httpx":
        raise ConfigError(f"model {model!r}: proxy needs transport = 'httpx'")
    if not proxy.reveal().startswith(("http://", "https://")):
        raise ConfigError(f"model {model!r}: proxy must be an http:// or https:// URL")
    _reachable(proxy.reveal(), model, "proxy", masked_url(proxy.reveal()))
    return proxy


def _api_key(key: object, model: str) -> Secret | None:
    """``key`` as a ``Secret``: a plain string is wrapped (else every repr of the settings
    would print it). No error shows the key or any part of it, nor its type's repr."""
    if isinstance(key, str):
        key = Secret(key)
    if key is None:
        return None
    if not isinstance(key, Secret):
        raise ConfigError(
            f"model {model!r}: api_key must be a Secret (or None), got a {type(key).__name__}"
        )
    value = key.reveal()
    if not isinstance(value, str) or not SENDABLE_KEY.fullmatch(value):
        raise ConfigError(
            f"model {model!r}: the API key is empty or contains whitespace, control or "
            "non-ASCII characters (often a trailing newline or carriage return from a "
            "paste or a CRLF .env file); it could never be sent as a header"
        )
    return key


def shown_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` (a model's, a key's, a tenant's) is a non-empty string that may
    be shown as it is in a header, a log line or a metric: printable, on one line,
    without spaces at its ends (a line break in a header value is refused by the HTTP
    server mid-answer, and in a log line forges the next one)."""
    return isinstance(name, str) and bool(name) and name.isprintable() and name == name.strip()


def _headers(headers: object, model: str) -> Mapping[str, str | Secret]:
    """Extra headers, names checked as HTTP tokens and values as sendable text (a CR or
    LF could split the request); a value is never echoed (it may be a secret), and one
    whose name says it is a credential (``Authorization``, ``api-key``...) is kept as a
    ``Secret`` however it was given, so no repr, log or error shows it."""
    if not isinstance(headers, Mapping):
        raise ConfigError(f"model {model!r}: headers must be a table of name = value")
    checked: dict[str, str | Secret] = {}
    seen: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not HEADER_NAME.fullmatch(name):
            raise ConfigError(f"model {model!r}: {quoted(name)} is not an HTTP header name")
        other = seen.setdefault(name.lower(), name)
        if other != name:  # one header to HTTP: the last was sent, the other dropped (a hunt)
            raise ConfigError(
                f"model {model!r}: headers {other!r} and {name!r} are one header (names "
                "are not case-sensitive); give it once"
            )
        text = reveal(value) if isinstance(value, Secret) else value
        if not isinstance(text, str) or not _SENDABLE_VALUE.fullmatch(text):
            raise ConfigError(
                f"model {model!r}: header {name!r} must be printable text without line "
                "breaks (its value is not shown: it may be a secret)"
            )
        secret = credential_like(name) and not isinstance(value, Secret)
        checked[name] = Secret(text) if secret else value
    return FrozenMap(checked)


_SENDABLE_VALUE = re.compile(r"[\x20-\x7e]+")


def _is_count(value: object) -> bool:
    """An integer >= 1 (``True`` is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _names(value: object, what: str) -> tuple[str, ...]:
    """A collection of non-empty strings as a tuple (order kept). A bare string is
    refused: iterating it would make each letter a name."""
    if isinstance(value, str) or not isinstance(value, list | tuple | Set):
        raise ConfigError(f"{what} must be a list of names, got {_type_name(value)}")
    names = tuple(value)
    if not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{what} must be a list of non-empty strings, got {shown_value(names)}")
    return names


def _type_name(value: object) -> str:
    return f"the string {value!r}" if isinstance(value, str) else f"a {type(value).__name__}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerSettings:
    """Queue and admission."""

    capacity: int = 100_000
    """Tasks accepted and not yet finished, at most."""
    aging_step_s: float | None = 10.0
    """A waiting task gains one priority level per this many seconds (None: no aging)."""
    aging_share: float = 0.1
    """The share of a model's turns that tasks aged past a more urgent waiting task
    may take: under a flood of more urgent work they go one turn in 1 / share. At
    most 0.5, so a CRITICAL task waits for one aged turn at most; at least 0.001."""
    escalate_margin_s: float = 1.0
    """With ``escalate_to`` set: a task still waiting this long before its deadline
    (or twice the escalation model's latency, if longer) is moved to that model."""
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    """Each tenant's (a request's ``budget_tag``) weight in sharing a model between
    tenants within a priority level: under contention, tokens in proportion to the
    weights. A tenant not named here, and the requests with no tag (one tenant
    together), weigh 1."""

    def __post_init__(self) -> None:
        if not _is_count(self.capacity):
            raise ConfigError(  # as the TOML key is written
                f"scheduler.capacity must be a positive integer, got {self.capacity!r}"
            )
        a = self.aging_step_s
        if a is not None and (
            isinstance(a, bool) or not isinstance(a, int | float) or not 0 < a < float("inf")
        ):
            raise ConfigError(f"aging_step_s must be a positive finite number or None, got {a!r}")
        share = self.aging_share
        if (
            isinstance(share, bool)
            or not isinstance(share, int | float)
            or not MIN_AGING_SHARE <= share <= 0.5
        ):
            raise ConfigError(
                f"aging_share must be a number from {MIN_AGING_SHARE} to 0.5 (a CRITICAL task "
                f"waits for one aged turn at most), got {share!r}"
            )
        m = self.escalate_margin_s
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m < float("inf"):
            raise ConfigError(f"escalate_margin_s must be a finite number >= 0, got {m!r}")
        object.__setattr__(self, "tenant_weights", _weights(self.tenant_weights))


def _weights(value: object) -> Mapping[str, float]:
    """Tenant weights as a frozen mapping: non-empty names, positive finite numbers."""
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"tenant_weights must be a table of tenant = weight, got {_type_name(value)}"
        )
    for tenant, weight in value.items():
        if not isinstance(tenant, str) or not tenant.strip():
            raise ConfigError(
                f"tenant_weights: a tenant must be a non-empty string, got {shown_value(tenant)}"
            )
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not 0 < weight < float("inf")
        ):
            raise ConfigError(
                f"tenant_weights: tenant {tenant!r} must weigh a positive finite number, "
                f"got {weight!r}"
            )
    return FrozenMap({tenant: float(weight) for tenant, weight in value.items()})
