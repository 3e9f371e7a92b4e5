"""Loading ``callboard.toml``: every key checked, every error naming its key.

    [scheduler]
    capacity = 100000
    aging_step_s = 10
    aging_share = 0.1                   # aged tasks' share of turns under more urgent work
    tenant_weights = { team-a = 3 }     # a tenant (budget tag) shares a model 3:1

    [routing]
    default = ["gpt-4o-mini"]
    order = "cost"                      # cost, cheapest, latency, least_busy or config
    [routing.routes]
    cheap = ["gpt-4o-mini"]

    [cluster]                           # optional: share the scheduler through Ray
    engine = "ray"                      # the only engine ("local", the default: no table)
    address = "auto"                    # ray.init's address: "auto", "ray://head:10001", ...
    namespace = "callboard"             # processes sharing it share one queue and limiter
    when_lost = "wait"                  # or "local": run alone if the cluster is lost

    [models.gpt-4o-mini]
    base_url = "https://api.openai.com/v1"   # or base_url_env, for one holding a key
    api_key_env = "OPENAI_API_KEY"      # secrets only by environment-variable name
    rpm = 500
    tpm = 200000
    max_concurrency = 50
    timeout = { connect = 5, read = 60, total = 120 }
    price = { input = "0.15", output = "0.60", cached_input = "0.075" }   # $ per million tokens
                                        # (and reasoning = ..., if not the output price)
    api = "openai"                      # or "azure", "anthropic": the dialect it speaks
    headers = { "X-Title" = "my app" }  # sent with every call
    headers_env = { "api-key" = "AZURE_OPENAI_KEY" }   # secret ones: from the environment
    context_window = 128000
    capabilities = ["json", "tools"]   # "embeddings" for a model embed() may choose
    tiers = ["fast", "cheap"]
    fallbacks = ["gpt-4o"]
    breaker = { consecutive_failures = 5, cooldown_s = 5 }
    retry = { max_attempts = 4 }
    embedding_batch_size = 2048         # texts per embeddings call (embed() splits by it)
    embedding_batch_tokens = 300000     # and tokens per embeddings call

What always holds:

- A key callboard does not know is an error (a typo must not silently mean a
  default).
- Every value has its type checked here, before any settings class sees it:
  a flag is ``true``/``false`` (the string ``"false"`` is not), a name is a
  string, a count is an integer, a number is an integer or a float (never a
  boolean), an amount in USD is a number or a decimal string. ``_typed`` is
  the one check; dataclass sections derive their kinds from their fields.
- An API key written in the file is refused: name the environment variable
  that holds it with ``api_key_env``. A key read from the environment must be
  printable ASCII with no whitespace (a stray CR/LF from a paste or a CRLF
  ``.env`` file can never be sent as a header). No error text contains the
  key or any part of it; a type error shows the value's type, not the value.
  An error names an ``api_key_env`` (``headers_env``, ``base_url_env``,
  ``proxy_env``, a gateway key's ``key_env``) variable only when it plainly is
  one (``SHOWN_VAR_NAME``): a key pasted there by mistake is often a valid name.
- A ``base_url`` with credentials (``user:pass@``) or a key-like query
  parameter (``?key=``, ``messages.credential_like``) is a secret too,
  refused in the file like a proxy URL with credentials: name the variable
  that holds it with ``base_url_env`` (``proxy_env`` for a proxy). Either is
  kept as a ``Secret`` that shows it masked.
- ``load_config`` prefixes every error with the file's path, and refuses a
  file that defines no models (no models means the built-in simulator, which
  a config file never asks for). ``parse_config({})`` still means the
  simulator, for callers building a config in code.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from callboard.config import BudgetSettings, RayCluster, SystemConfig
from callboard.core.breaker import BreakerConfig
from callboard.core.limiter import LimiterConfig
from callboard.core.pricing import Price
from callboard.core.retry import RetryConfig
from callboard.core.routing import Order
from callboard.core.secret import url_secrets
from callboard.core.settings import (
    SENDABLE_KEY,
    ModelSettings,
    SchedulerSettings,
    Secret,
    Timeouts,
)
from callboard.messages import ConfigError, credential_like, shown_name, shown_value
from callboard.supervisor.supervisor import Strategy, SupervisorConfig

C = TypeVar("C")
E = TypeVar("E", bound=enum.Enum)
Kind = Literal["int", "number", "bool", "str"]

GATEWAY_TABLE = "gateway"
"""The gateway's table (``callboard.gateway.load_config`` reads it; callboard's own
configuration leaves it alone)."""
TOP_KEYS = {
    "models",
    "routing",
    "scheduler",
    "supervisor",
    "budget",
    "seed",
    "give_up_s",
    "switch_interval_s",
    "steady_heap",
    "cluster",
}
CLUSTER_KEYS = {
    "engine",
    "address",
    "namespace",
    "lease_s",
    "connect_timeout_s",
    "lost_after_s",
    "when_lost",
}
ROUTING_KEYS = {"default", "routes", "order", "escalate_to"}
BUDGET_KEYS = {
    "total_usd",
    "per_tag_usd",
    "downgrade_when_tight",
    "stop_when_spent",
    "close_on_refusals",
}
MODEL_SCALARS: Final[Mapping[str, Kind]] = {
    "provider_model": "str",
    "max_concurrency": "int",
    "context_window": "int",
    "transport": "str",
    "http2": "bool",
    "max_tokens_param": "str",
    "api": "str",
    "api_version": "str",
    "embedding_batch_size": "int",
    "embedding_batch_tokens": "int",
}
"""Model keys passed to ``ModelSettings`` as they are, once their type is checked."""
MODEL_KEYS = {
    *MODEL_SCALARS,
    "base_url",
    "base_url_env",
    "api_key_env",
    "proxy",
    "proxy_env",
    "rpm",
    "tpm",
    "tpm_refunds",
    "burst_s",
    "timeout",
    "price",
    "capabilities",
    "tiers",
    "fallbacks",
    "sends_back",
    "breaker",
    "retry",
    "headers",
    "headers_env",
}
ENV_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SHOWN_VAR_NAME = re.compile(r"[A-Z][A-Z0-9]{0,15}(?:_[A-Z0-9]{1,16}){1,6}")
"""A variable name an error may show: short ALL_CAPS words joined by underscores
(``OPENAI_API_KEY``). Keys (``gsk_...``, ``ghp_...``, ``AKIA...``) are mixed or lower
case, or one long run, so one pasted into ``api_key_env`` is never printed."""

_KINDS: Final[Mapping[Kind, tuple[Callable[[object], bool], str]]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v),
        "a number",
    ),
    "bool": (lambda v: isinstance(v, bool), "true or false (without quotes)"),
    "str": (lambda v: isinstance(v, str), "a string"),
}
_FIELD_KINDS: Final[Mapping[str, Kind]] = {
    "int": "int",
    "float": "number",
    "float | None": "number",
    "bool": "bool",
    "str": "str",
    "str | None": "str",
    "bool | None": "bool",
}
"""A settings dataclass field's annotation -> the kind its TOML value must have."""
_TOML_TYPES: Final = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}


MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""The most a config file may hold: ``--config /dev/zero`` (or any endless stream) was
read until the machine ran out of memory (found by a hunt). A pipe (``<(...)``) is read
as a file is."""


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML document at ``path``; a ``ConfigError`` starting with the path when it
    cannot be read or is not TOML. A UTF-8 byte-order mark before it (Notepad's) is
    read past: it was "Invalid statement (at line 1, column 1)", naming nothing a
    reader could see (found by a hunt)."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            limit = MAX_CONFIG_BYTES // (1024 * 1024)
            raise ConfigError(f"{path}: cannot read the config: larger than {limit} MiB")
        return tomllib.loads(raw.decode("utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"{path}: cannot read the config: {why}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # [[[[... deeper than the parser goes: a traceback (a hunt)
        raise ConfigError(f"{path}: not valid TOML: nested too deeply") from None


def load_config(path: Path | str) -> SystemConfig:
    """Read ``path``; every error is a ``ConfigError`` that starts with the path. A
    ``[gateway]`` table is ``callboard serve``'s and is left to it: one file serves
    ``serve``, ``run`` and ``shell`` alike."""
    path = Path(path)
    data = read_toml(path)
    try:
        config = parse_file_config(data, environ=os.environ)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config


def parse_file_config(data: Mapping[str, Any], *, environ: Mapping[str, str]) -> SystemConfig:
    """A config file's parsed document -> ``SystemConfig``, as ``parse_config``; one
    that defines no model is refused (a file never asks for the simulator: it would
    answer made-up text with a 200 where the models were meant)."""
    config = parse_config(data, environ=environ)
    if config.simulated:
        raise _no_models()
    return config


def parse_config(data: Mapping[str, Any], *, environ: Mapping[str, str]) -> SystemConfig:
    """A parsed TOML document -> ``SystemConfig``; ``{}`` means the simulated provider."""
    _known(data, TOP_KEYS | {GATEWAY_TABLE}, "")
    models_table = _table(data.get("models", {}), "models")
    models = tuple(
        _model(name, _table(t, f"models.{name}"), environ) for name, t in models_table.items()
    )
    routing = _routing(_table(data.get("routing", {}), "routing"), {m.name for m in models})
    sup = dict(_table(data.get("supervisor", {}), "supervisor"))
    strategy = {}
    if "strategy" in sup:
        strategy["strategy"] = _choice(sup.pop("strategy"), Strategy, "supervisor.strategy")
    try:
        config = SystemConfig(
            models=models,
            scheduler=_scheduler(_table(data.get("scheduler", {}), "scheduler")),
            supervisor=_dataclass(SupervisorConfig, sup, "supervisor", **strategy),
            budget=_budget(_table(data.get("budget", {}), "budget")),
            cluster=_cluster(_table(data.get("cluster", {}), "cluster")),
            seed=_typed(data.get("seed", 0), "int", "seed"),
            switch_interval_s=_optional(data, "switch_interval_s", "number", ""),
            steady_heap=_typed(data.get("steady_heap", False), "bool", "steady_heap"),
            **(
                {"give_up_s": _typed(data["give_up_s"], "number", "give_up_s")}
                if "give_up_s" in data
                else {}
            ),
            **routing,
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None
    if "models" in data and not models:  # every other key is checked first
        raise _no_models()
    return config


def _cluster(t: Mapping[str, Any]) -> RayCluster | None:
    """``[cluster]``: absent or ``engine = "local"`` is this process alone; ``"ray"``
    shares the queue and the model actors through the Ray cluster at ``address``."""
    _known(t, CLUSTER_KEYS, "cluster.")
    engine = _typed(t.get("engine", "local"), "str", "cluster.engine")
    if engine not in ("local", "ray"):
        raise ConfigError(f"cluster.engine must be one of local, ray; got {shown_value(engine)}")
    rest = {k: v for k, v in t.items() if k != "engine"}
    if engine == "local":
        if rest:
            raise ConfigError(f'cluster.{min(rest)} needs cluster.engine = "ray"')
        return None
    kinds: dict[str, Kind] = {
        "address": "str",
        "namespace": "str",
        "lease_s": "number",
        "connect_timeout_s": "number",
        "lost_after_s": "number",
        "when_lost": "str",
    }
    return RayCluster(**_scalars(rest, kinds, "cluster."))


def _no_models() -> ConfigError:
    return ConfigError(
        "the config defines no models: add a [models.NAME] table with a base_url "
        "(run without a config for the built-in simulated provider)"
    )


def _routing(t: Mapping[str, Any], models: set[str]) -> dict[str, Any]:
    """``[routing]`` -> the ``SystemConfig`` fields it sets."""
    _known(t, ROUTING_KEYS, "routing.")
    fields: dict[str, Any] = {
        "routes": {
            k: _route(v, f"routing.routes.{k}")
            for k, v in _table(t.get("routes", {}), "routing.routes").items()
        }
    }
    if "default" in t:
        raw = t["default"]
        fields["default_route"] = _route([raw] if isinstance(raw, str) else raw, "routing.default")
    if "order" in t:
        fields["order"] = _choice(t["order"], Order, "routing.order").value
    escalate = _optional(t, "escalate_to", "str", "routing.")
    if escalate is not None and models and escalate not in models:
        raise ConfigError(f"routing.escalate_to names unknown model {shown_name(escalate)}")
    fields["escalate_to"] = escalate
    return fields


def _budget(t: Mapping[str, Any]) -> BudgetSettings:
    """``[budget] total_usd = "25.00"``, ``per_tag_usd = { team-a = "5" }``."""
    _known(t, BUDGET_KEYS, "budget.")
    fields: dict[str, Any] = _scalars(
        t,
        {"downgrade_when_tight": "bool", "stop_when_spent": "bool", "close_on_refusals": "bool"},
        "budget.",
    )
    if "total_usd" in t:
        fields["total_usd"] = _decimal(t["total_usd"], "budget.total_usd")
    per_tag = _table(t.get("per_tag_usd", {}), "budget.per_tag_usd")
    fields["per_tag_usd"] = {k: _decimal(v, f"budget.per_tag_usd.{k}") for k, v in per_tag.items()}
    try:
        return BudgetSettings(**fields)
    except (TypeError, ValueError) as exc:
        raise _at("budget", exc) from None


def _model(name: str, t: Mapping[str, Any], environ: Mapping[str, str]) -> ModelSettings:
    where = f"models.{name}"
    if "api_key" in t:
        raise ConfigError(
            f"{where}.api_key: secrets are never read from the file; "
            "set api_key_env to the name of the environment variable that holds the key"
        )
    _known(t, MODEL_KEYS, f"{where}.")
    fields = _scalars(t, MODEL_SCALARS, f"{where}.")
    fields["base_url"] = _base_url(t, environ, where)
    fields["capabilities"] = frozenset(_names(t.get("capabilities", []), f"{where}.capabilities"))
    fields["tiers"] = _names(t.get("tiers", []), f"{where}.tiers")
    fields["fallbacks"] = _names(t.get("fallbacks", []), f"{where}.fallbacks")
    if "sends_back" in t:
        fields["sends_back"] = frozenset(_names(t["sends_back"], f"{where}.sends_back"))
    limiter = {k: t[k] for k in ("rpm", "tpm", "burst_s") if k in t}
    if "tpm_refunds" in t:
        limiter["refunds"] = _typed(t["tpm_refunds"], "bool", f"{where}.tpm_refunds")
    fields["limiter"] = _dataclass(LimiterConfig, limiter, where, rpm=None, tpm=None)
    if "timeout" in t:
        fields["timeout"] = _timeout(t["timeout"], f"{where}.timeout")
    if "price" in t:
        fields["price"] = _price(_table(t["price"], f"{where}.price"), f"{where}.price")
    if "breaker" in t:
        fields["breaker"] = _dataclass(BreakerConfig, t["breaker"], f"{where}.breaker")
    if "retry" in t:
        fields["retry"] = _dataclass(RetryConfig, t["retry"], f"{where}.retry")
    key = _api_key(t["api_key_env"], environ, where) if "api_key_env" in t else None
    fields["proxy"] = _proxy(t, environ, where)
    fields["headers"] = _headers(t, environ, where)
    try:
        return ModelSettings(name=name, api_key=key, **fields)
    except (TypeError, ValueError) as exc:
        raise _at(where, exc) from None


def _headers(
    t: Mapping[str, Any], environ: Mapping[str, str], where: str
) -> dict[str, str | Secret]:
    """``headers = { "X-Title" = "..." }`` as written, and ``headers_env = { "api-key" =
    "AZURE_OPENAI_KEY" }`` from the environment, each a ``Secret`` (redacted like the
    key). A header named in both is an error."""
    plain = _table(t.get("headers", {}), f"{where}.headers")
    named = _table(t.get("headers_env", {}), f"{where}.headers_env")
    both = sorted({k.lower() for k in plain} & {k.lower() for k in named})
    if both:  # names are not case-sensitive: X-A and x-a were one, one value dropped
        raise ConfigError(f"{where}: header {both[0]!r} is in both headers and headers_env")
    for k in plain:
        if credential_like(k):  # not echoed: it is what the file must not hold
            raise ConfigError(
                f"{where}.headers.{k}: looks like a credential, and the file holds no "
                f"secret: name the environment variable that holds it in headers_env"
            )
    headers: dict[str, str | Secret] = {
        k: _typed(v, "str", f"{where}.headers.{k}") for k, v in plain.items()
    }
    for k, var in named.items():
        headers[k] = Secret(_from_env(var, environ, f"{where}.headers_env.{k}"))
    return headers


def _base_url(t: Mapping[str, Any], environ: Mapping[str, str], where: str) -> str | Secret:
    """``base_url`` (one with no secret in it: the file holds none) or ``base_url_env``
    (the environment variable that holds one with credentials or a key in its query)."""
    if "base_url" in t and "base_url_env" in t:
        raise ConfigError(f"{where}: give base_url or base_url_env, not both")
    if "base_url_env" in t:
        return Secret.of_url(_from_env(t["base_url_env"], environ, f"{where}.base_url_env"))
    if "base_url" not in t:
        raise ConfigError(f"{where}.base_url is required")
    url: str = _typed(t["base_url"], "str", f"{where}.base_url")
    if url.startswith(("http://", "https://")) and url_secrets(url):  # not echoed
        raise ConfigError(
            f"{where}.base_url: a base URL with credentials (user:pass@) or a key in its "
            "query (key=, api_key=, token=, sig=...) is a secret; put it in an environment "
            "variable and name it in base_url_env"
        )
    return url


def _from_env(var: Any, environ: Mapping[str, str], where: str) -> str:
    """The value of environment variable ``var``, which must be set."""
    if not isinstance(var, str) or not ENV_VAR_NAME.fullmatch(var):
        raise ConfigError(f"{where} must be the name of an environment variable")
    value = environ.get(var, "")
    if not value:
        raise ConfigError(f"{where}: {named_var(var)} is not set")
    return value


def named_var(var: str) -> str:
    """An environment variable as an error names it: by name only when it plainly is
    one (``SHOWN_VAR_NAME``), for a secret pasted where its variable's name goes is
    often a valid name too."""
    if SHOWN_VAR_NAME.fullmatch(var):
        return f"environment variable {var}"
    return "the environment variable it names"


def _proxy(t: Mapping[str, Any], environ: Mapping[str, str], where: str) -> Secret | None:
    """``proxy`` (a URL without credentials: the file holds no secret) or ``proxy_env``
    (the environment variable that holds the URL, credentials and all)."""
    if "proxy" in t and "proxy_env" in t:
        raise ConfigError(f"{where}: give proxy or proxy_env, not both")
    if "proxy" in t:
        url = _typed(t["proxy"], "str", f"{where}.proxy")
        if "@" in url or url_secrets(url):  # not echoed: it holds credentials
            raise ConfigError(
                f"{where}.proxy: a proxy URL with credentials (user:pass@) or a key in its "
                "query (token=, key=...) is a secret; put it in an environment variable "
                "and name it in proxy_env"
            )
        return Secret(url)
    if "proxy_env" not in t:
        return None
    return Secret.of_url(_from_env(t["proxy_env"], environ, f"{where}.proxy_env"))


def _api_key(var: Any, environ: Mapping[str, str], where: str) -> Secret:
    """The key in environment variable ``var``; no error shows the key or any part of it."""
    if not isinstance(var, str) or not ENV_VAR_NAME.fullmatch(var):
        # not echoed: a value that is no variable name may be the key itself
        raise ConfigError(
            f"{where}.api_key_env must be the name of an environment variable "
            "(letters, digits and _), not the key itself"
        )
    named = named_var(var)
    value = environ.get(var, "")
    if not value:
        raise ConfigError(f"{where}.api_key_env: {named} is not set")
    if not SENDABLE_KEY.fullmatch(value):
        raise ConfigError(
            f"{where}.api_key_env: the API key in {named} contains "
            "whitespace, control or non-ASCII characters (often a trailing newline or "
            "carriage return from a paste or a CRLF .env file); fix the variable"
        )
    return Secret(value)


def _at(where: str, exc: Exception) -> ConfigError:
    """``exc`` said of the section or key ``where``, once: a message that names it
    already is not prefixed again (``scheduler: scheduler.capacity must be...``)."""
    said = str(exc)
    if said.startswith((f"{where}.", f"{where} ")):
        return ConfigError(said)
    return ConfigError(f"{where}: {said}")


def _timeout(value: Any, where: str) -> Timeouts:
    """A table of connect/read/total, or one number for both read and total."""
    if isinstance(value, Mapping):
        return _dataclass(Timeouts, value, where)
    seconds = _typed(value, "number", where, also="or a table")
    try:
        return Timeouts(total=seconds, read=seconds)
    except ValueError as exc:
        raise _at(where, exc) from None


def _price(t: Mapping[str, Any], where: str, *, tiered: bool = True) -> Price:
    keys = ("input", "output", "cached_input", "reasoning", "cache_write", "cache_write_1h")
    _known(t, {*keys, "service_tiers"} if tiered else set(keys), f"{where}.")
    values: dict[str, Any] = {
        f"{k}_per_mtok": _decimal(t[k], f"{where}.{k}") for k in keys if k in t
    }
    if "input_per_mtok" not in values or "output_per_mtok" not in values:
        raise ConfigError(f"{where} needs both input and output ($ per million tokens)")
    if "service_tiers" in t:  # { priority = { input = ..., output = ... }, flex = { ... } }
        tiers = _table(t["service_tiers"], f"{where}.service_tiers")
        values["service_tiers"] = {
            name: _price(
                _table(tier, f"{where}.service_tiers.{name}"),
                f"{where}.service_tiers.{name}",
                tiered=False,
            )
            for name, tier in tiers.items()
        }
    try:
        return Price(**values)
    except (TypeError, ValueError) as exc:
        raise _at(where, exc) from None


def _decimal(value: Any, where: str) -> Decimal:
    """An amount: a number, or a decimal string for exact cents (``"0.15"``)."""
    if isinstance(value, str):
        try:
            amount = Decimal(value)
        except InvalidOperation:
            raise ConfigError(f"{where} must be a number, got {shown_value(value)}") from None
    else:
        amount = Decimal(str(_typed(value, "number", where, also="or a decimal string")))
    if not amount.is_finite():
        raise ConfigError(f"{where} must be a finite number, got {shown_value(value)}")
    return amount


def _scheduler(t: Mapping[str, Any]) -> SchedulerSettings:
    """``[scheduler]``; ``tenant_weights = { team-a = 3, team-b = 1 }`` a table of
    numbers."""
    rest = {k: v for k, v in t.items() if k != "tenant_weights"}
    given: dict[str, Any] = {}
    if "tenant_weights" in t:
        where = "scheduler.tenant_weights"
        weights = _table(t["tenant_weights"], where)
        given["tenant_weights"] = {
            k: _typed(v, "number", f"{where}.{k}") for k, v in weights.items()
        }
    return _dataclass(SchedulerSettings, rest, "scheduler", **given)


def _dataclass(cls: type[C], t: Any, where: str, **given: Any) -> C:
    """A section onto a settings dataclass, each value checked against its field's type.

    ``given`` are fields the caller has already converted (or defaults the section
    may override); a section's own values always go through ``_typed``."""
    table = _table(t, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    _known(table, set(fields), f"{where}.")
    kinds = {k: _FIELD_KINDS[str(fields[k].type)] for k in table}
    try:
        return cls(**(given | _scalars(table, kinds, f"{where}.")))
    except (TypeError, ValueError) as exc:
        raise _at(where, exc) from None


def _scalars(t: Mapping[str, Any], kinds: Mapping[str, Kind], prefix: str) -> dict[str, Any]:
    """Those of ``kinds``' keys that ``t`` has, each checked for its kind."""
    return {k: _typed(t[k], kind, f"{prefix}{k}") for k, kind in kinds.items() if k in t}


def _optional(t: Mapping[str, Any], key: str, kind: Kind, prefix: str) -> Any:
    return _typed(t[key], kind, f"{prefix}{key}") if key in t else None


def _typed(value: Any, kind: Kind, where: str, also: str = "") -> Any:
    """``value`` if it is of ``kind``; else a ConfigError naming the key and the
    value's type (not the value, which may be a secret in the wrong place)."""
    ok, what = _KINDS[kind]
    if not ok(value):
        what = f"{what} {also}" if also else what
        raise ConfigError(f"{where} must be {what}, got {_toml_type(value)}")
    return value


def _choice(value: Any, choices: type[E], where: str) -> E:
    """One of an enum's values, e.g. ``routing.order = "latency"``."""
    allowed = [str(m.value) for m in choices]
    if isinstance(value, str) and value in allowed:
        return choices(value)
    got = shown_value(value) if isinstance(value, str) else _toml_type(value)
    raise ConfigError(f"{where} must be one of {', '.join(allowed)}; got {got}")


def _toml_type(value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return _TOML_TYPES.get(type(value), f"a {type(value).__name__}")


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table, got {_toml_type(value)}")
    return value


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where} must be a list of names")
    return tuple(value)


def _route(value: Any, where: str) -> tuple[str, ...]:
    """A route's models: a non-empty list of names (an empty one could serve nothing)."""
    names = _names(value, where)
    if not names:
        raise ConfigError(f"{where} lists no model")
    return names


def _known(table: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]} (known here: {', '.join(sorted(allowed))})"
        )
