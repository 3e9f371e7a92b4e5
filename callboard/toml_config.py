"""Loading ``callboard.toml``: every key checked, every error naming its key.

    [scheduler]
    capacity = 100000
    aging_step_s = 10

    [routing]
    default = ["gpt-4o-mini"]
    [routing.routes]
    cheap = ["gpt-4o-mini"]

    [models.gpt-4o-mini]
    base_url = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"      # secrets only by environment-variable name
    rpm = 500
    tpm = 200000
    max_concurrency = 50
    timeout = { connect = 5, read = 60, total = 120 }
    price = { input = "0.15", output = "0.60", cached_input = "0.075" }   # $ per million tokens
    context_window = 128000
    capabilities = ["json", "tools"]
    tiers = ["fast", "cheap"]
    fallbacks = ["gpt-4o"]
    breaker = { consecutive_failures = 5, cooldown_s = 5 }
    retry = { max_attempts = 4 }

A key callboard does not know is an error (a typo must not silently mean a
default). An API key written in the file is refused: name the environment
variable that holds it with ``api_key_env``.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TypeVar

from callboard.actors.breaker import BreakerConfig
from callboard.actors.limiter import LimiterConfig
from callboard.actors.pricing import Price
from callboard.actors.retry import RetryConfig
from callboard.actors.settings import ModelSettings, SchedulerSettings, Secret, Timeouts
from callboard.messages import ConfigError
from callboard.supervisor.supervisor import Strategy, SupervisorConfig

from .config import BudgetSettings, SystemConfig

C = TypeVar("C")
TOP_KEYS = {"models", "routing", "scheduler", "supervisor", "budget", "seed", "switch_interval_s"}
MODEL_KEYS = {
    "base_url",
    "provider_model",
    "api_key_env",
    "rpm",
    "tpm",
    "burst_s",
    "max_concurrency",
    "timeout",
    "price",
    "context_window",
    "capabilities",
    "tiers",
    "fallbacks",
    "breaker",
    "retry",
    "transport",
    "http2",
}


def load_config(path: Path) -> SystemConfig:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(data, environ=os.environ)


def parse_config(data: Mapping[str, Any], *, environ: Mapping[str, str]) -> SystemConfig:
    _known(data, TOP_KEYS, "")
    models_table = _table(data.get("models", {}), "models")
    models = tuple(
        _model(name, _table(t, f"models.{name}"), environ) for name, t in models_table.items()
    )
    routing = _table(data.get("routing", {}), "routing")
    _known(routing, {"default", "routes", "order", "escalate_to"}, "routing.")
    routes = {
        k: _names(v, f"routing.routes.{k}")
        for k, v in _table(routing.get("routes", {}), "routing.routes").items()
    }
    default = None
    if "default" in routing:
        raw = routing["default"]
        default = (raw,) if isinstance(raw, str) else _names(raw, "routing.default")
    scheduler = _dataclass(SchedulerSettings, data.get("scheduler", {}), "scheduler")
    sup = dict(_table(data.get("supervisor", {}), "supervisor"))
    if "strategy" in sup:
        try:
            sup["strategy"] = Strategy(sup["strategy"])
        except ValueError:
            raise ConfigError(
                f"supervisor.strategy must be one of {[s.value for s in Strategy]}"
            ) from None
    supervisor = _dataclass(SupervisorConfig, sup, "supervisor")
    try:
        return SystemConfig(
            models=models,
            default_route=default,
            routes=routes,
            scheduler=scheduler,
            supervisor=supervisor,
            budget=_budget(_table(data.get("budget", {}), "budget")),
            order=str(routing.get("order", "cost")),
            escalate_to=routing.get("escalate_to"),
            seed=_seed(data.get("seed", 0)),
            switch_interval_s=data.get("switch_interval_s"),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None


def _seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"seed must be an integer, got {value!r}")
    return value


def _budget(t: Mapping[str, Any]) -> BudgetSettings:
    """``[budget] total_usd = "25.00"``, ``per_tag_usd = { team-a = "5" }``."""
    _known(t, {"total_usd", "per_tag_usd", "downgrade_when_tight", "stop_when_spent"}, "budget.")
    fields: dict[str, Any] = {
        k: t[k] for k in ("downgrade_when_tight", "stop_when_spent") if k in t
    }
    if "total_usd" in t:
        fields["total_usd"] = _decimal(t["total_usd"], "budget.total_usd")
    per_tag = _table(t.get("per_tag_usd", {}), "budget.per_tag_usd")
    fields["per_tag_usd"] = {k: _decimal(v, f"budget.per_tag_usd.{k}") for k, v in per_tag.items()}
    return BudgetSettings(**fields)


def _decimal(value: Any, where: str) -> Decimal:
    try:
        return Decimal(str(value))
    except InvalidOperation:
        raise ConfigError(f"{where} must be a number, got {value!r}") from None


def _model(name: str, t: Mapping[str, Any], environ: Mapping[str, str]) -> ModelSettings:
    where = f"models.{name}"
    if "api_key" in t:
        raise ConfigError(
            f"{where}.api_key: secrets are never read from the file; "
            "set api_key_env to the name of the environment variable that holds the key"
        )
    _known(t, MODEL_KEYS, f"{where}.")
    if "base_url" not in t:
        raise ConfigError(f"{where}.base_url is required")
    key = None
    if "api_key_env" in t:
        var = t["api_key_env"]
        if not isinstance(var, str) or not var:
            raise ConfigError(f"{where}.api_key_env must be the name of an environment variable")
        if var not in environ or not environ[var]:
            raise ConfigError(f"{where}.api_key_env: environment variable {var} is not set")
        key = Secret(environ[var])
    fields: dict[str, Any] = {
        k: t[k]
        for k in (
            "base_url",
            "provider_model",
            "max_concurrency",
            "context_window",
            "transport",
            "http2",
        )
        if k in t
    }
    fields["capabilities"] = frozenset(_names(t.get("capabilities", []), f"{where}.capabilities"))
    fields["tiers"] = _names(t.get("tiers", []), f"{where}.tiers")
    fields["fallbacks"] = _names(t.get("fallbacks", []), f"{where}.fallbacks")
    limiter = {k: t[k] for k in ("rpm", "tpm", "burst_s") if k in t}
    fields["limiter"] = _dataclass(LimiterConfig, {"rpm": None, "tpm": None} | limiter, f"{where}")
    if "timeout" in t:
        timeout = t["timeout"]
        fields["timeout"] = (
            Timeouts(total=timeout, read=timeout)
            if isinstance(timeout, int | float)
            else _dataclass(Timeouts, timeout, f"{where}.timeout")
        )
    if "price" in t:
        fields["price"] = _price(_table(t["price"], f"{where}.price"), f"{where}.price")
    if "breaker" in t:
        fields["breaker"] = _dataclass(BreakerConfig, t["breaker"], f"{where}.breaker")
    if "retry" in t:
        fields["retry"] = _dataclass(RetryConfig, t["retry"], f"{where}.retry")
    try:
        return ModelSettings(name=name, api_key=key, **fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _price(t: Mapping[str, Any], where: str) -> Price:
    _known(t, {"input", "output", "cached_input"}, f"{where}.")
    values: dict[str, Decimal | None] = {}
    for key, field in (
        ("input", "input_per_mtok"),
        ("output", "output_per_mtok"),
        ("cached_input", "cached_input_per_mtok"),
    ):
        if key in t:
            try:
                values[field] = Decimal(str(t[key]))
            except InvalidOperation:
                raise ConfigError(f"{where}.{key} must be a number, got {t[key]!r}") from None
    if "input_per_mtok" not in values or "output_per_mtok" not in values:
        raise ConfigError(f"{where} needs both input and output ($ per million tokens)")
    try:
        return Price(**values)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _dataclass(cls: type[C], t: Any, where: str) -> C:
    table = _table(t, where)
    allowed = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    _known(table, allowed, f"{where}.")
    try:
        return cls(**table)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table, got {type(value).__name__}")
    return value


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where} must be a list of names")
    return tuple(value)


def _known(table: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]} (known here: {', '.join(sorted(allowed))})"
        )
