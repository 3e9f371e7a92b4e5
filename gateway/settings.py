"""The gateway's configuration: the ``[gateway]`` table of ``callboard.toml``.

    [gateway]
    grace_s = 30                 # SIGTERM: calls in flight may finish this long
    unready_s = 0                # SIGTERM: /readyz answers 503 this long before the door shuts
    retry_after_s = 1            # the Retry-After of a 429 when nothing better is known
    idempotency_entries = 10000  # Idempotency-Keys remembered (their answers replayed)
    idempotency_mb = 256         # ... and the room their answers may take, at most
    max_body_mb = 32             # the largest request body taken
    max_held_mb = 512            # request bodies kept at once (queued, in flight), at most
    body_timeout_s = 60          # a request body must have come whole within this
    idle_s = 75                  # a connection with no request head this long is closed
    max_connections = 4000       # client connections at once (default: by the open-file limit)
    stream_keepalive_s = 15      # a stream's head, then a keep-alive, after this long silent
    queue_bound = 1000           # requests waiting for a key's (or a tenant's) limits, at most
    max_wait_s = 60              # how long one may wait when it has no deadline
    deadline_s = 300             # the deadline of a request that names none (default: none)
    default_max_tokens = 4096    # max_tokens of a chat request that names none
    spend_file = "spend.db"      # settled spend kept across restarts (default: none, see below)
    metrics = "open"             # GET /metrics: "open" (no key), or "operator" (an operator key)

    [gateway.keys.team-a]        # one table per client key; the name is only a label
    key_sha256 = "9f86d08..."    # the key's SHA-256 in hex (never the key itself)
    # key_env = "TEAM_A_KEY"     # ... or the environment variable that holds the key
    tenant = "team-a"            # its budget tag (default: the key's name)
    priority = "normal"          # the priority of a request that names none
    max_priority = "high"        # the most urgent one it may ask for (default: critical)
    models = ["sim-fast", "fast"]   # the models and routes it may use (default: all)
    rpm = 60                     # requests per minute (default: no limit)
    tpm = 100000                 # tokens per minute: prompt + max_tokens, settled to usage
    max_parallel = 8             # requests in flight at once (default: no limit)
    budget_usd = "25.00"         # spend limit (default: none)
    budget_period = "1mo"        # ... renewed each period (default: never renewed)

    [gateway.tenants.team-a]     # limits shared by every key of the tenant
    rpm = 600
    tpm = 1000000
    budget_usd = 100
    budget_period = "1d"

The rest of the document is callboard's own configuration, read by
``callboard.toml_config.parse_config``; ``load_config`` hands it over without
the ``gateway`` table.

A request over its key's or its tenant's ``rpm``/``tpm``/``max_parallel`` waits
(``quota``) until it fits, up to its deadline (``max_wait_s`` if it names none); over a budget it
is refused at once.

Budgets and their periods. ``budget_usd`` limits the settled cost of a key's (or
a tenant's) requests. Without ``budget_period`` the limit never renews (with no
``spend_file``: it holds while the gateway runs, a restart gives it back whole).
``budget_period`` renews it: the spend resets at the start of each period. Its
grammar is a whole number >= 1 and a unit, nothing else: ``30s``, ``15m``,
``1h``, ``1d``, ``1w``, ``1mo`` (``s`` seconds, ``m`` minutes, ``h`` hours, ``d``
days, ``w`` weeks, ``mo`` calendar months; at most ten years). Periods are aligned
to a fixed clock, UTC, never to when the gateway started, so a restart does not
move a period and every gateway agrees where one begins; UTC rather than a local
time zone, so that no day has 23 or 25 hours (``BudgetPeriod.bounds``):

* ``s``/``m``/``h``/``d``/``w`` periods are counted from Monday 1970-01-05 00:00
  UTC, the first Monday of Unix time: ``1h`` starts on the hour, ``1d`` at 00:00
  UTC, ``1w`` on Monday 00:00 UTC (the week LiteLLM's proxy resets on), ``30d``
  every 30 days from that Monday (not on the 1st: use ``1mo`` for that);
* ``mo`` periods start at 00:00 UTC on the 1st: ``1mo`` each month, ``3mo`` the
  quarters (January, April, July, October), ``12mo`` each year.

A request's cost counts in the period it was admitted in (its reservation's),
even when it is answered after the period ended: the money was allowed from that
period's budget, and the new period starts with nothing spent or held.

``spend_file`` (default: none, as before: spend lives in memory only) is a SQLite
file (``gateway.spend``) where the settled spend of each budgeted key and tenant,
per period, is written as requests settle (those of one turn of the event loop in
one transaction, at its end), and read back at start: a restart keeps what was
spent. A crash loses only what was in flight (reserved, not yet settled, or
settled in the turn it died in); a power cut may also lose the last settlements
(WAL, ``synchronous=NORMAL``). A relative path is taken from the config file's
directory. Gateways pointed at one file (on one host: SQLite's WAL needs shared
memory, not a network file system) share its budgets: each writes its
settlements as increments in transactions and reads the file's spend before it
reserves, so they may together go over a budget by at most what the others hold
in flight at that moment, never by anything settled. Spend is kept by the key's
or tenant's name and period: renaming one, or changing its ``budget_period``,
starts it from nothing; a new key secret under the same name, or a new
``budget_usd``, keeps what was spent. Each budget's latest ``spend.KEPT_PERIODS``
periods are kept (for the operator's records); older rows are dropped as new periods
start.

What must hold: every key checked, every error a ``ConfigError`` naming its key
(prefixed with the file's path by ``load_config``), as ``toml_config`` does; a
key in clear text is never kept: a ``key_env`` variable is read once and only
its digest stays, and no error or repr shows a key or a digest. Without keys
the gateway is open and binds loopback only (``check_bind``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TypeGuard

from callboard.core.pricing import MAX_USD
from callboard.core.settings import shown_name
from callboard.core.stats import OTHER_TENANTS
from callboard.messages import (
    MAX_TOKENS_LIMIT,
    ConfigError,
    FrozenMap,
    Priority,
    is_number,
    shown_number,
    shown_value,
)

from callboard.config import SystemConfig
from callboard.toml_config import GATEWAY_TABLE, named_var, parse_file_config, read_toml

__all__ = [
    "BudgetPeriod",
    "ClientKey",
    "GatewayConfig",
    "GatewaySettings",
    "Limits",
    "UnsafeBindError",
    "check_bind",
    "load_config",
    "parse_gateway",
]

_SETTINGS_KEYS = {
    "grace_s",
    "unready_s",
    "retry_after_s",
    "idempotency_entries",
    "idempotency_mb",
    "max_body_mb",
    "max_held_mb",
    "body_timeout_s",
    "idle_s",
    "max_connections",
    "stream_keepalive_s",
    "queue_bound",
    "max_wait_s",
    "deadline_s",
    "default_max_tokens",
    "spend_file",
    "metrics",
    "keys",
    "tenants",
}
_LIMIT_KEYS = {"rpm", "tpm", "max_parallel", "budget_usd", "budget_period"}
MAX_MB = 1_000_000
"""The most megabytes ``max_body_mb`` and ``max_held_mb`` take (a terabyte: more is
a slip, and ``1e308`` overflowed in the server's arithmetic at start)."""
MAX_S = 86_400.0
"""The most seconds a gateway's durations take (a day): more is a slip, and a stop
waiting ``unready_s = 1e308`` never ended (found by a hunt)."""
METRICS_ACCESS = ("open", "operator")
"""``gateway.metrics``' values: who may read ``GET /metrics``."""
MAX_BUDGET_USD = MAX_USD
"""The largest budget taken (``core.pricing.MAX_USD``)."""
_KEY_KEYS = {
    "key_sha256",
    "key_env",
    "tenant",
    "priority",
    "max_priority",
    "models",
    "operator",
} | _LIMIT_KEYS
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PERIOD = re.compile(r"([0-9]{1,6})(s|m|h|d|w|mo)")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
_MOST_S = 3660 * 86_400
"""The longest period: about ten years (a longer one is a budget that never renews)."""
_MOST_MONTHS = 120
ANCHOR_UTC = 345_600
"""Monday 1970-01-05 00:00 UTC (Unix seconds): where fixed-length periods are counted
from, so that ``1d`` starts at midnight UTC and ``1w`` on a Monday."""


class UnsafeBindError(ConfigError):
    """An open gateway (no keys configured) asked to listen beyond loopback."""


@dataclass(frozen=True, slots=True)
class BudgetPeriod:
    """How often a budget renews: ``count`` units (``s m h d w`` or calendar months
    ``mo``), aligned to UTC (see the module docstring). ``BudgetPeriod.parse("1d")``."""

    count: int
    unit: str

    def __post_init__(self) -> None:
        count, unit = self.count, self.unit
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"a period is at least 1 unit long, not {count!r} (0 would never end)")
        if unit == "mo":
            if count > _MOST_MONTHS:
                raise ValueError(f"a period is at most {_MOST_MONTHS} months, not {count}")
        elif unit in _UNIT_S:
            if count * _UNIT_S[unit] > _MOST_S:
                raise ValueError(f"a period is at most {_MOST_S // 86_400} days, not {self}")
        else:
            raise ValueError(f"unknown unit {unit!r}: one of s, m, h, d, w, mo")

    @classmethod
    def parse(cls, text: object, where: str) -> BudgetPeriod:
        """``"30d"`` -> ``BudgetPeriod(30, "d")``; ``ConfigError`` naming ``where``."""
        grammar = "a whole number >= 1 and a unit (s, m, h, d, w, mo), e.g. 1h, 1d, 30d, 1mo"
        if not isinstance(text, str):
            raise ConfigError(f"{where}: must be a string, {grammar}; got {shown_value(text)}")
        found = _PERIOD.fullmatch(text)
        if found is None:
            raise ConfigError(f"{where}: must be {grammar}; got {shown_value(text)}")
        try:
            return cls(int(found[1]), found[2])
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def __str__(self) -> str:
        return f"{self.count}{self.unit}"

    def bounds(self, utc: float) -> tuple[int, int]:
        """The period holding the instant ``utc`` (Unix seconds): its start and its end
        (exclusive), in whole Unix seconds."""
        if self.unit == "mo":
            at = datetime.fromtimestamp(utc, UTC)
            month = (at.year - 1970) * 12 + at.month - 1
            first = month - month % self.count
            return _month_start(first), _month_start(first + self.count)
        length = self.count * _UNIT_S[self.unit]
        start = ANCHOR_UTC + math.floor((utc - ANCHOR_UTC) / length) * length
        return start, start + length


def _month_start(months: int) -> int:
    """00:00 UTC on the 1st of the month ``months`` after January 1970."""
    return int(datetime(1970 + months // 12, months % 12 + 1, 1, tzinfo=UTC).timestamp())


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What a key, or a tenant (all its keys together), may use. Checked by whoever
    holds them (``check``), which knows the config path to name."""

    rpm: int | None = None
    """Requests per minute: at most this many admitted in any 60 s (None: no limit)."""
    tpm: int | None = None
    """Tokens per minute: each request reserves its prompt estimate + ``max_tokens``,
    settled to the usage reported; at most this many in any 60 s (None: no limit)."""
    max_parallel: int | None = None
    """Requests in flight at once: admitted and not yet answered (a stream until its
    last event), waiting in callboard's queue or on the wire (None: no limit). What
    LiteLLM's proxy calls ``max_parallel_requests``: a key's slow or stalled streams
    hold its own share of the models, not everyone's."""
    budget_usd: Decimal | None = None
    """Spend limit, exact (None: no limit): for each ``budget_period``, else for good
    (while the gateway runs, or for the life of its ``spend_file``)."""
    budget_period: BudgetPeriod | None = None
    """How often the budget renews (None: never)."""

    @property
    def limited(self) -> bool:
        return (
            self.rpm is not None
            or self.tpm is not None
            or self.max_parallel is not None
            or self.budget_usd is not None
        )

    def check(self, where: str) -> None:
        """``ConfigError`` naming ``where.<field>`` for a value out of range."""
        for name in ("rpm", "tpm", "max_parallel"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(
                    f"{where}.{name}: must be an integer >= 1, got {shown_number(value)}"
                )
        usd = self.budget_usd
        if usd is not None and (
            not isinstance(usd, Decimal) or not usd.is_finite() or not 0 <= usd <= MAX_BUDGET_USD
        ):
            raise ConfigError(
                f"{where}.budget_usd: must be an amount in 0..{MAX_BUDGET_USD}, "
                f"got {shown_value(usd)}"
            )
        period = self.budget_period
        if period is not None:
            if not isinstance(period, BudgetPeriod):
                raise ConfigError(
                    f"{where}.budget_period: must be a BudgetPeriod, got {shown_value(period)}"
                )
            if usd is None:
                raise ConfigError(
                    f"{where}.budget_period: renews a budget, and there is no budget_usd"
                )


NO_LIMITS = Limits()


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientKey:
    """One client key: who it is, how urgent it may be, what it may use."""

    name: str
    """The key's label in the config (``[gateway.keys.<name>]``); shown in logs."""
    digest: bytes = field(repr=False)
    """SHA-256 of the key (32 bytes); compared in constant time, never shown."""
    tenant: str
    """The budget tag of its requests."""
    priority: Priority = Priority.NORMAL
    """The priority of a request that names none."""
    max_priority: Priority = Priority.CRITICAL
    """The most urgent priority it may ask for; a request asking more gets this."""
    models: frozenset[str] | None = None
    """The model and route names it may use (None: every one)."""
    limits: Limits = NO_LIMITS
    """Its own rpm, tpm and budget (its tenant's, in ``GatewaySettings.tenants``,
    apply as well)."""
    operator: bool = False
    """Whether it reads the whole gateway's stats (``/v1/callboard/stats``, and so the
    dashboard): every model, tenant and key. Any other key reads only its own key's
    and tenant's quotas there."""

    def __post_init__(self) -> None:
        rule = (
            "must be printable text, no line breaks or control characters and no space "
            "at either end (it is written in logs, metrics and the dashboard)"
        )
        if not shown_name(self.name):
            raise ConfigError(f"gateway.keys: a key's name {rule}, got {shown_value(self.name)}")
        if not shown_name(self.tenant):
            raise ConfigError(  # a secret pasted there is not shown (a hunt)
                f"gateway.keys.{self.name}.tenant: {rule}, got {shown_value(self.tenant)}"
            )
        if self.tenant == OTHER_TENANTS:  # the stats' name for the tenants not shown
            raise ConfigError(
                f"gateway.keys.{self.name}.tenant: {OTHER_TENANTS!r} is the name the stats "
                "give the tenants they do not show one by one; choose another"
            )
        self.limits.check(f"gateway.keys.{self.name}")
        if not isinstance(self.digest, bytes) or len(self.digest) != 32:
            raise ConfigError(f"gateway.keys.{self.name}: a digest is 32 bytes of SHA-256")
        for level in ("priority", "max_priority"):  # "high" failed the comparison below
            value = getattr(self, level)  # with a bare TypeError (found by a hunt)
            if not isinstance(value, Priority):
                raise ConfigError(
                    f"gateway.keys.{self.name}.{level}: must be a callboard.Priority "
                    f"(Priority.HIGH, ...), got {shown_value(value)}"
                )
        if self.priority < self.max_priority:
            raise ConfigError(
                f"gateway.keys.{self.name}.priority: {self.priority.name.lower()} is more "
                f"urgent than its max_priority {self.max_priority.name.lower()}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewaySettings:
    """The ``[gateway]`` table, checked."""

    keys: tuple[ClientKey, ...] = ()
    """The client keys; none: the gateway is open (and binds loopback only)."""
    grace_s: float = 30.0
    """On SIGTERM, how long calls in flight may take to finish."""
    unready_s: float = 0.0
    """On SIGTERM, how long ``/readyz`` answers 503 before the listener closes (time
    for a load balancer to take the instance out)."""
    retry_after_s: float = 1.0
    """``Retry-After`` of a 429 or 503 when callboard knows no better time."""
    idempotency_entries: int = 10_000
    """How many ``Idempotency-Key`` answers are remembered for replay."""
    idempotency_mb: float = 256.0
    """The room those answers may take, at most (the oldest of the tenant holding the
    most go first): 10,000 long answers kept 1.7 GB (found by a hunt)."""
    max_body_mb: float = 32.0
    """The largest request body taken (images travel inline as base64)."""
    max_held_mb: float = 512.0
    """The request bodies held at once, at most: a body holds its room from its read to
    its task's end (``room``); one that finds none is answered 429 at once."""
    body_timeout_s: float = 60.0
    """How long a request's body may take to arrive, whole, once its head has: a
    body still coming after this is answered 408 and the connection closed (a caller
    trickling a byte a minute holds nothing for long)."""
    idle_s: float = 75.0
    """A connection that has not sent a whole request head this long after it opened,
    or after its last answer, is closed (an idle keep-alive connection, and a caller
    trickling its head, alike; nginx's ``keepalive_timeout`` is 75 s too)."""
    stream_keepalive_s: float = 15.0
    """How long a stream may be silent: its head waits at most this long for the first
    delta (so a stream that fails before it gets its status), and once the head is
    out, a keep-alive (``: keep-alive``; Anthropic's ``ping``) is written whenever
    nothing else was this long. A client that says its timeout (the Python SDKs'
    ``x-stainless-read-timeout``, the Anthropic TypeScript SDK's ``x-stainless-timeout``;
    openai-node sends none) makes it half that if shorter."""
    max_connections: int | None = None
    """Client connections open at once, at most; one more is answered 503 with
    ``Retry-After`` and closed (``connections``). None: the process's soft limit of open
    files less what the models' connections may take and a margin (none if
    unlimited), so idle clients cannot take the descriptors the providers' calls
    need."""
    tenants: Mapping[str, Limits] = field(default_factory=FrozenMap)
    """Limits shared by all the keys of a tenant, by tenant name."""
    queue_bound: int = 1000
    """How many requests may wait for one key's (or one tenant's) rpm/tpm; past it a
    request is answered 429 at once (0: none waits)."""
    max_wait_s: float = 60.0
    """How long a request with no deadline (none named, no ``deadline_s``) may wait for
    its key's and tenant's rpm/tpm before it is answered 429."""
    deadline_s: float | None = None
    """The deadline of a request that names none (``X-Callboard-Deadline``), as if it
    had: its task ends ``Expired`` (a 504) when it passes. None: none, and such a
    request is served for as long as its client waits (a provider's long Retry-After
    held one for up to ten minutes a 429; operators of proxies expect a request timeout
    of their own, LiteLLM's ``request_timeout``; a hunt)."""
    default_max_tokens: int = 4096
    """The ``max_tokens`` of a chat completion that names neither it nor
    ``max_completion_tokens``. OpenAI's API lets a client omit it (the model's own
    limit then); callboard sends one always, because its token and budget
    reservations need an upper bound. Without this a gateway client that omitted it
    was cut at callboard's library default of 256."""
    spend_file: Path | None = None
    """The SQLite file that keeps the budgets' settled spend across restarts (None:
    spend is kept in memory only, and a restart starts every budget afresh)."""
    metrics: str = "open"
    """Who may read ``GET /metrics``: ``"open"``, anyone (as a Prometheus target
    usually is); ``"operator"``, a caller with an ``operator`` key only (its series
    name keys, tenants and their budgets)."""

    def __post_init__(self) -> None:
        for name in ("grace_s", "unready_s", "retry_after_s"):
            value = getattr(self, name)
            if not _number(value) or not 0 <= value <= MAX_S:
                raise ConfigError(
                    f"gateway.{name}: must be a number >= 0 and at most {MAX_S:g} (a day), "
                    f"got {shown_number(value)}"
                )
        if not _number(self.max_body_mb) or not 0 < self.max_body_mb <= MAX_MB:
            raise ConfigError(
                f"gateway.max_body_mb: must be a number > 0 and at most {MAX_MB}, "
                f"got {shown_number(self.max_body_mb)}"
            )
        if not _number(self.max_held_mb) or not self.max_body_mb <= self.max_held_mb <= MAX_MB:
            raise ConfigError(
                "gateway.max_held_mb: must be a number >= max_body_mb "
                f"({self.max_body_mb:g}) and at most {MAX_MB}, got {shown_number(self.max_held_mb)}"
            )
        for name, least in (("idempotency_entries", 0), ("queue_bound", 0), ("max_connections", 1)):
            count = getattr(self, name)
            unset = count is None and name == "max_connections"  # the one that may be
            if not unset and not (_whole(count) and count >= least):
                raise ConfigError(
                    f"gateway.{name}: must be an integer >= {least}, got {shown_number(count)}"
                )
        for name, most, unit in (
            ("max_wait_s", MAX_S, " (a day)"),
            ("deadline_s", MAX_S, " (a day)"),
            ("body_timeout_s", MAX_S, " (a day)"),
            ("idle_s", MAX_S, " (a day)"),
            ("stream_keepalive_s", MAX_S, " (a day)"),
            ("idempotency_mb", MAX_MB, ""),  # 1e308 overflowed at start (found by a hunt)
        ):
            value = getattr(self, name)
            if value is None and name == "deadline_s":  # the one that may be unset
                continue
            if not _number(value) or not 0 < value <= most:
                raise ConfigError(
                    f"gateway.{name}: must be a number > 0 and at most {most:g}{unit}, "
                    f"got {shown_number(value)}"
                )
        mt = self.default_max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or not 0 < mt <= MAX_TOKENS_LIMIT:
            raise ConfigError(
                f"gateway.default_max_tokens: must be an integer in 1..{MAX_TOKENS_LIMIT}, "
                f"got {shown_number(mt)}"
            )
        self._check_metrics()
        self._check_spend_file()
        self._check_tenants()
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            raise ConfigError("gateway.keys: two keys have the same name")
        digests = [k.digest for k in self.keys]
        if len(set(digests)) != len(digests):
            twins = sorted(k.name for k in self.keys if digests.count(k.digest) > 1)
            raise ConfigError(f"gateway.keys: {' and '.join(twins)} are the same key")

    def _check_metrics(self) -> None:
        if not isinstance(self.metrics, str) or self.metrics not in METRICS_ACCESS:
            raise ConfigError(
                f'gateway.metrics: must be "open" or "operator", got {shown_value(self.metrics)}'
            )
        if self.metrics == "operator" and self.keys and not any(k.operator for k in self.keys):
            raise ConfigError(
                'gateway.metrics = "operator", but no key has operator = true: nobody '
                "could read /metrics"
            )

    def _check_spend_file(self) -> None:
        spend: object = self.spend_file
        if isinstance(spend, str) and spend.strip():
            object.__setattr__(self, "spend_file", spend := Path(spend))
        if spend is not None and not isinstance(spend, Path):
            raise ConfigError(
                f"gateway.spend_file: must be a file's path, got {shown_value(spend)}"
            )

    def _check_tenants(self) -> None:
        if not isinstance(self.tenants, Mapping):
            raise ConfigError("gateway.tenants: must be a table")
        object.__setattr__(self, "tenants", FrozenMap(self.tenants))
        served = {k.tenant for k in self.keys}
        for tenant, limits in self.tenants.items():
            if not isinstance(limits, Limits):
                raise ConfigError(f"gateway.tenants.{tenant}: must be Limits")
            limits.check(f"gateway.tenants.{tenant}")
            if tenant not in served:
                raise ConfigError(
                    f"gateway.tenants.{tenant}: no key belongs to this tenant (a key's "
                    "tenant is its `tenant`, else its name)"
                )

    def doubts(self) -> tuple[str, ...]:
        """What in these settings is legal but likely a mistake, to say at start: a
        ``tpm`` not above ``default_max_tokens`` refuses, for good, every request that
        names no ``max_tokens`` (what the SDKs send by default)."""
        scopes = [(f"gateway.keys.{k.name}", k.limits) for k in self.keys]
        scopes += [(f"gateway.tenants.{t}", limits) for t, limits in self.tenants.items()]
        return tuple(
            f"{where}.tpm ({limits.tpm}) is not above gateway.default_max_tokens "
            f"({self.default_max_tokens}), the max_tokens of a request that names none: "
            "each such request is refused as too large"
            for where, limits in scopes
            if limits.tpm is not None and limits.tpm <= self.default_max_tokens
        )

    @property
    def open(self) -> bool:
        """No key configured: every request is served, from loopback only."""
        return not self.keys


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """Everything ``callboard serve`` runs with: the system's config and the gateway's."""

    system: SystemConfig | None = None
    """callboard's configuration (None: the embedded simulated provider)."""
    gateway: GatewaySettings = field(default_factory=GatewaySettings)


def load_config(path: Path | str, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read ``path``: its ``gateway`` table for the gateway, the rest for callboard
    (which must define models, as for ``callboard run``; a file of the ``gateway``
    table alone serves the simulated provider). Every error is a ``ConfigError`` that
    starts with the path."""
    path = Path(path)
    environ = os.environ if environ is None else environ
    data = read_toml(path)
    try:
        gateway = parse_gateway(data.get(GATEWAY_TABLE, {}), environ=environ, base=path.parent)
        rest = {k: v for k, v in data.items() if k != GATEWAY_TABLE}
        # a file with budgets and keys but its models moved elsewhere served the
        # simulator's made-up answers with 200s, where run and shell refused it (a hunt)
        system = parse_file_config(rest, environ=environ) if rest else None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return GatewayConfig(system=system, gateway=gateway)


def parse_gateway(
    table: object, *, environ: Mapping[str, str], base: Path | None = None
) -> GatewaySettings:
    """The ``[gateway]`` table -> ``GatewaySettings`` (a relative ``spend_file`` is
    taken from ``base``, the config file's directory, when given)."""
    t = _table(table, "gateway")
    _known(t, _SETTINGS_KEYS, "gateway.")
    keys = tuple(
        _key(name, _table(value, f"gateway.keys.{name}"), environ)
        for name, value in _table(t.get("keys", {}), "gateway.keys").items()
    )
    tenants = {
        name: _limits(_table(value, f"gateway.tenants.{name}"), f"gateway.tenants.{name}")
        for name, value in _table(t.get("tenants", {}), "gateway.tenants").items()
    }
    given = {k: v for k, v in t.items() if k not in ("keys", "tenants")}
    if "spend_file" in given:
        given["spend_file"] = _file(given["spend_file"], "gateway.spend_file", base)
    return GatewaySettings(keys=keys, tenants=tenants, **given)


def check_bind(settings: GatewaySettings, host: str) -> None:
    """Refuse (``UnsafeBindError``) to listen beyond loopback without keys."""
    if settings.open and not is_loopback(host):
        raise UnsafeBindError(
            f"no [gateway.keys] are configured, so the gateway is open to anyone who can "
            f"reach it: it binds loopback only (127.0.0.1, ::1, localhost), not {host!r}; "
            "add a key to serve other addresses"
        )


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback only (no name is resolved)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _key(name: str, t: Mapping[str, Any], environ: Mapping[str, str]) -> ClientKey:
    where = f"gateway.keys.{name}"
    _known(t, _KEY_KEYS, f"{where}.")
    fields: dict[str, Any] = {
        "name": name,
        "digest": _digest(t, environ, where),
        "tenant": _text(t.get("tenant", name), f"{where}.tenant"),
        "limits": _limits({k: v for k, v in t.items() if k in _LIMIT_KEYS}, where),
    }
    for level in ("priority", "max_priority"):
        if level in t:
            fields[level] = _priority(t[level], f"{where}.{level}")
    ceiling = fields.get("max_priority")
    if "priority" not in fields and ceiling is not None:  # the default, within its ceiling
        fields["priority"] = max(Priority.NORMAL, ceiling)  # (max_priority = "low" alone
        # was refused naming .priority, which the operator never wrote)
    if "models" in t:
        fields["models"] = _models(t["models"], f"{where}.models")
    if "operator" in t:
        if not isinstance(t["operator"], bool):
            raise ConfigError(
                f"{where}.operator: must be true or false, got {shown_number(t['operator'])}"
            )
        fields["operator"] = t["operator"]
    return ClientKey(**fields)


def _limits(t: Mapping[str, Any], where: str) -> Limits:
    """``rpm``, ``tpm``, ``max_parallel``, ``budget_usd`` (a number, or a decimal string
    for exact cents), ``budget_period``; ranges are checked by ``Limits.check``."""
    _known(t, _LIMIT_KEYS, f"{where}.")
    usd = t.get("budget_usd")
    period = t.get("budget_period")
    return Limits(
        rpm=t.get("rpm"),
        tpm=t.get("tpm"),
        max_parallel=t.get("max_parallel"),
        budget_usd=None if usd is None else _amount(usd, f"{where}.budget_usd"),
        budget_period=None
        if period is None
        else BudgetPeriod.parse(period, f"{where}.budget_period"),
    )


def _file(value: object, where: str, base: Path | None) -> Path:
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise ConfigError(f"{where}: must be a file's path (a non-empty string)")
    try:
        path = Path(value).expanduser()
    except RuntimeError:  # ~someone unknown, or no home: a traceback at start (a hunt)
        raise ConfigError(f"{where}: {value!r} names no home folder that is known") from None
    return path if path.is_absolute() or base is None else base / path


def _amount(value: object, where: str) -> Decimal:
    if isinstance(value, str):
        try:
            return Decimal(value.strip())
        except InvalidOperation:
            raise ConfigError(
                f"{where}: must be an amount in USD, got {shown_value(value)}"
            ) from None
    if not is_number(value):
        raise ConfigError(f"{where}: must be an amount in USD (a number or a decimal string)")
    return Decimal(str(value))  # what was written, not the float's binary expansion


def _digest(t: Mapping[str, Any], environ: Mapping[str, str], where: str) -> bytes:
    """The key's SHA-256: from ``key_sha256``, or of the value of ``key_env``."""
    if ("key_sha256" in t) == ("key_env" in t):
        raise ConfigError(f"{where}: give key_sha256 or key_env (one of them)")
    if "key_sha256" in t:
        hexed = t["key_sha256"]
        if not isinstance(hexed, str) or not _HEX_DIGEST.fullmatch(hexed.lower()):
            raise ConfigError(
                f"{where}.key_sha256: must be 64 hex digits (the SHA-256 of the key, e.g. "
                "from `printf %s KEY | sha256sum`)"
            )
        return bytes.fromhex(hexed)
    var = t["key_env"]
    if not isinstance(var, str) or not _ENV_NAME.fullmatch(var):
        raise ConfigError(f"{where}.key_env: must name an environment variable")
    value = environ.get(var)
    if not value:
        raise ConfigError(f"{where}.key_env: {named_var(var)} is not set")
    if value != value.strip():  # no client could present it: a header's value is trimmed
        raise ConfigError(
            f"{where}.key_env: {named_var(var)} has spaces or a line break at an end "
            "(a file read into it with its newline?): no client could present that key"
        )
    return hashlib.sha256(value.encode("utf-8")).digest()


def _priority(value: object, where: str) -> Priority:
    if isinstance(value, str) and value.strip().upper() in Priority.__members__:
        return Priority[value.strip().upper()]
    names = ", ".join(p.name.lower() for p in Priority)
    raise ConfigError(f"{where}: must be one of {names}")


def _models(value: object, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: must be a list of model or route names")
    if not value:  # a key that may use nothing: a mistake, not a way to turn one off
        raise ConfigError(f"{where}: must name at least one model or route")
    return frozenset(value)


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: must be a non-empty string")
    return value


def _table(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: must be a table")
    return value


def _known(t: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
    unknown = sorted(set(t) - allowed)
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key (allowed: {', '.join(sorted(allowed))})"
        )


def _whole(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer (``True`` is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return is_number(value) and math.isfinite(value)
