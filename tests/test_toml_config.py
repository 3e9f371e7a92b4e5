"""``callboard.toml``: a full file maps onto SystemConfig; every mistake is a ConfigError
naming its dotted key; API keys come only from the environment and never show."""

from __future__ import annotations

import copy
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from callboard.actors.settings import Secret, Timeouts
from callboard.supervisor.supervisor import Strategy

from callboard import ConfigError, SystemConfig, UsageError
from callboard.toml_config import load_config, parse_config

KEY = "sk-live-TOP-SECRET-value-0042"
ENV = {"OPENAI_API_KEY": KEY}

FULL_TOML = """
seed = 7

[scheduler]
capacity = 5000
aging_step_s = 2.5

[supervisor]
strategy = "rest_for_one"
max_restarts = 3
within_s = 5

[routing]
default = ["mini"]
[routing.routes]
cheap = ["mini"]
smart = ["big", "mini"]

[models.mini]
base_url = "https://api.example.test/v1"
provider_model = "gpt-4o-mini"
api_key_env = "OPENAI_API_KEY"
rpm = 500
tpm = 200000
burst_s = 2
max_concurrency = 50
timeout = { connect = 5, read = 60, total = 120 }
price = { input = "0.15", output = "0.60", cached_input = "0.075" }
context_window = 128000
capabilities = ["json", "tools"]
tiers = ["fast", "cheap"]
fallbacks = ["big"]
breaker = { consecutive_failures = 5, cooldown_s = 5 }
retry = { max_attempts = 4, initial_s = 0.5 }

[models.big]
base_url = "http://127.0.0.1:9/v1"
transport = "httpx"
http2 = true
timeout = 30
price = { input = 2.5, output = 10 }
"""


def minimal(**model: Any) -> dict[str, Any]:
    return {"models": {"m": {"base_url": "http://127.0.0.1:9/v1", **model}}}


def refused(data: dict[str, Any], environ: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(data, environ=ENV if environ is None else environ)
    assert isinstance(info.value, UsageError)
    return info.value


# -- a full file ---------------------------------------------------------------------


def test_a_full_config_file_maps_onto_system_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    path = tmp_path / "callboard.toml"
    path.write_text(FULL_TOML, encoding="utf-8")
    cfg = load_config(path)
    assert isinstance(cfg, SystemConfig)
    assert cfg.seed == 7
    assert cfg.scheduler.capacity == 5000
    assert cfg.scheduler.aging_step_s == 2.5
    assert cfg.supervisor.strategy is Strategy.REST_FOR_ONE
    assert (cfg.supervisor.max_restarts, cfg.supervisor.within_s) == (3, 5)
    assert cfg.default_route == ("mini",)
    assert dict(cfg.routes) == {"cheap": ("mini",), "smart": ("big", "mini")}

    mini, big = cfg.models
    assert mini.name == "mini"
    assert mini.base_url == "https://api.example.test/v1"
    assert mini.wire_model == "gpt-4o-mini"
    assert mini.api_key == Secret(KEY)
    assert mini.api_key is not None
    assert mini.api_key.reveal() == KEY
    assert (mini.limiter.rpm, mini.limiter.tpm, mini.limiter.burst_s) == (500, 200000, 2)
    assert mini.max_concurrency == 50
    assert mini.timeout == Timeouts(connect=5, read=60, total=120)
    assert mini.price.input_per_mtok == Decimal("0.15")
    assert mini.price.output_per_mtok == Decimal("0.60")
    assert mini.price.cached_input_per_mtok == Decimal("0.075")
    assert mini.context_window == 128000
    assert mini.capabilities == frozenset({"json", "tools"})
    assert mini.tiers == ("fast", "cheap")
    assert mini.fallbacks == ("big",)
    assert (mini.breaker.consecutive_failures, mini.breaker.cooldown_s) == (5, 5)
    assert mini.breaker.min_calls == 10, "unset breaker keys keep their defaults"
    assert (mini.retry.max_attempts, mini.retry.initial_s) == (4, 0.5)
    assert mini.transport == "aiohttp"

    assert big.api_key is None
    assert (big.transport, big.http2) == ("httpx", True)
    assert big.timeout.total == 30
    assert big.timeout.read == 30, "a bare number sets the read and total timeouts"
    assert big.price.input_per_mtok == Decimal("2.5")
    assert big.price.output_per_mtok == Decimal(10)
    assert big.price.cached_input_per_mtok is None
    assert (big.limiter.rpm, big.limiter.tpm) == (None, None)

    assert KEY not in repr(cfg)
    assert KEY not in str(cfg)


def test_a_single_default_route_may_be_a_bare_name() -> None:
    cfg = parse_config({**minimal(), "routing": {"default": "m"}}, environ={})
    assert cfg.default_route == ("m",)


def test_an_empty_config_means_the_simulated_provider() -> None:
    cfg = parse_config({}, environ={})
    assert cfg.simulated
    assert cfg.models == ()


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_a_file_that_is_not_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[models\nbase_url = ", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(path)
    assert str(path) in str(info.value)


# -- unknown keys are named by their dotted path ---------------------------------------------


def _with(path: str, value: Any = 1) -> dict[str, Any]:
    """The valid minimal config with one extra key at a dotted path."""
    data: dict[str, Any] = copy.deepcopy(
        minimal(
            timeout={"connect": 1},
            price={"input": 1, "output": 1},
            breaker={"cooldown_s": 1},
            retry={"max_attempts": 2},
        )
    )
    data |= {"routing": {"routes": {}}, "scheduler": {}, "supervisor": {}}
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data


@pytest.mark.parametrize(
    "path",
    [
        "bogus",
        "routing.bogus",
        "scheduler.bogus",
        "supervisor.bogus",
        "models.m.bogus",
        "models.m.timeout.bogus",
        "models.m.price.bogus",
        "models.m.breaker.bogus",
        "models.m.retry.bogus",
        "models.m.API_KEY",
    ],
)
def test_an_unknown_key_anywhere_names_its_dotted_path(path: str) -> None:
    parse_config(_with("seed", 1), environ={})  # the base is valid
    err = refused(_with(path, "sk-typo-value"))
    assert f"unknown config key {path}" in str(err)
    assert "sk-typo-value" not in str(err)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (minimal(max_concurrency=0), "models.m"),
        (minimal(rpm=0), "rpm"),
        (minimal(tpm=-5), "tpm"),
        (minimal(burst_s=0), "burst_s"),
        (minimal(timeout={"connect": -1}), "timeout.connect"),
        (minimal(timeout="soon"), "models.m.timeout"),
        (minimal(price={"input": "abc", "output": "1"}), "models.m.price.input"),
        (minimal(price={"input": "1"}), "models.m.price"),
        (minimal(price="free"), "models.m.price"),
        (minimal(breaker={"consecutive_failures": 0}), "models.m.breaker"),
        (minimal(retry={"max_attempts": 0}), "models.m.retry"),
        (minimal(transport="carrier-pigeon"), "transport"),
        (minimal(http2=True), "http2"),
        (minimal(capabilities="json"), "models.m.capabilities"),
        (minimal(tiers=[1]), "models.m.tiers"),
        (minimal(fallbacks=["ghost"]), "ghost"),
        (minimal(fallbacks=["m"]), "fallback"),
        ({"models": {"m": {}}}, "models.m.base_url"),
        ({"models": {"m": "http://x"}}, "models.m"),
        ({"models": []}, "models"),
        (minimal(base_url="ftp://x"), "base_url"),
        ({**minimal(), "routing": {"default": ["ghost"]}}, "ghost"),
        ({**minimal(), "routing": {"routes": {"r": ["ghost"]}}}, "ghost"),
        ({**minimal(), "routing": {"routes": {"r": "m"}}}, "routing.routes.r"),
        ({**minimal(), "routing": {"default": 5}}, "routing.default"),
        ({**minimal(), "routing": {"default": ["m", ""]}}, "routing.default"),
        ({"scheduler": {"capacity": 0}}, "capacity"),
        ({"supervisor": {"strategy": "one_for_some"}}, "supervisor.strategy"),
        ({"supervisor": {"within_s": 0}}, "supervisor"),
        ({"scheduler": 5}, "scheduler"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_key(data: dict[str, Any], needle: str) -> None:
    assert needle in str(refused(data))


# -- secrets ---------------------------------------------------------------------------------


def test_an_api_key_in_the_file_is_refused_without_echoing_it() -> None:
    err = refused(minimal(api_key=KEY))
    assert "models.m.api_key" in str(err)
    assert "api_key_env" in str(err), "the message says what to do instead"
    assert KEY not in str(err)
    assert KEY not in repr(err)


@pytest.mark.parametrize("environ", [{}, {"OPENAI_API_KEY": ""}, {"OTHER": KEY}])
def test_an_unset_api_key_env_names_the_variable(environ: dict[str, str]) -> None:
    err = refused(minimal(api_key_env="OPENAI_API_KEY"), environ=environ)
    assert "OPENAI_API_KEY" in str(err)
    assert "models.m.api_key_env" in str(err)
    assert KEY not in str(err)


@pytest.mark.parametrize(
    "mistake",
    [
        {"max_concurrency": 0},
        {"fallbacks": ["ghost"]},
        {"base_url": "ftp://nope"},
        {"http2": True},
        {"timeout": {"connect": 0}},
        {"price": {"input": "x", "output": "1"}},
        {"retry": {"max_attempts": 0}},
        {"bogus": KEY},
    ],
)
def test_the_secret_never_appears_in_an_error_after_it_was_read(mistake: dict[str, Any]) -> None:
    err = refused(minimal(api_key_env="OPENAI_API_KEY", **mistake))
    for text in (str(err), repr(err), repr(err.args), str(err.__cause__), str(err.__context__)):
        assert KEY not in text


def test_a_secret_read_from_the_environment_never_shows_in_the_config() -> None:
    cfg = parse_config(minimal(api_key_env="OPENAI_API_KEY"), environ=ENV)
    (model,) = cfg.models
    for text in (repr(cfg), str(cfg), repr(model), f"{model}", repr(model.api_key)):
        assert KEY not in text
    assert model.api_key is not None
    assert model.api_key.reveal() == KEY


# -- bugs found ----------------------------------------------------------------------------


def test_a_bad_seed_is_a_config_error_naming_seed() -> None:
    assert "seed" in str(refused({"seed": "lucky"}))


def test_a_negative_price_is_a_config_error_naming_the_key() -> None:
    assert "models.m.price" in str(refused(minimal(price={"input": "-1", "output": "1"})))


def test_a_non_string_base_url_is_a_config_error() -> None:
    assert "base_url" in str(refused({"models": {"m": {"base_url": 5}}}))


def test_a_non_string_api_key_env_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "callboard.toml"
    path.write_text('[models.m]\nbase_url = "http://127.0.0.1:9/v1"\napi_key_env = 5\n')
    with pytest.raises(ConfigError, match="api_key_env"):
        load_config(path)


def test_switch_interval_is_read_and_checked() -> None:
    assert parse_config({}, environ={}).switch_interval_s is None
    cfg = parse_config({**minimal(), "switch_interval_s": 0.001}, environ={})
    assert cfg.switch_interval_s == 0.001
    for bad in (0, -1.0, 2.0, True, "fast"):
        with pytest.raises(ConfigError, match="switch_interval_s"):
            parse_config({**minimal(), "switch_interval_s": bad}, environ={})
