"""``callboard.toml``: a full file maps onto SystemConfig; every mistake is a ConfigError
naming its dotted key; API keys come only from the environment and never show."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from callboard.core.breaker import BreakerConfig
from callboard.core.limiter import LimiterConfig
from callboard.core.pricing import Price
from callboard.core.retry import RetryConfig
from callboard.core.routing import AUTO, RoutingPolicy
from callboard.core.settings import SchedulerSettings, Secret, Timeouts
from callboard.messages import Request
from callboard.supervisor.supervisor import Strategy, SupervisorConfig

from callboard import ConfigError, SystemConfig, UsageError
from callboard.cli import main
from callboard.config import RayCluster
from callboard.toml_config import _FIELD_KINDS, MAX_CONFIG_BYTES, load_config, parse_config

KEY = "sk-live-TOP-SECRET-value-0042"
ENV = {"OPENAI_API_KEY": KEY}

FULL_TOML = """
seed = 7

[scheduler]
capacity = 5000
aging_step_s = 2.5
aging_share = 0.25

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
http2 = false  # true needs the h2 package (the http2 extra)
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
    assert (cfg.scheduler.aging_step_s, cfg.scheduler.aging_share) == (2.5, 0.25)
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
    assert (big.transport, big.http2) == ("httpx", False)
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


def test_tpm_refunds_says_how_a_compatible_server_counts_its_token_limit() -> None:
    """By default as the API does (OpenAI keeps all of ``max_tokens``); ``tpm_refunds``
    for a compatible server that counts the tokens used."""
    (plain,) = parse_config(minimal(tpm=1000), environ={}).models
    (counted,) = parse_config(minimal(tpm=1000, tpm_refunds=True), environ={}).models
    assert (plain.refunds_tokens, counted.refunds_tokens) == (False, True)


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


def test_a_file_nested_past_the_parsers_depth_is_not_valid_toml(tmp_path: Path) -> None:
    """``x = [[[[...`` 5,000 deep was a ``RecursionError`` traceback for ``run``,
    ``shell`` and ``serve`` alike (found by a hunt)."""
    path = tmp_path / "deep.toml"
    path.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid TOML: nested too deeply"):
        load_config(path)


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


def test_a_price_has_service_tiers_each_a_plain_price() -> None:
    tiers = {"priority": {"input": "2.5", "output": 20}, "flex": {"input": "0.625", "output": 5}}
    config = parse_config(
        minimal(price={"input": "1.25", "output": 10, "service_tiers": tiers}), environ={}
    )
    price = config.models[0].price
    assert price.at_service_tier("priority") == Price("2.5", 20)
    assert price.at_service_tier("flex") == Price("0.625", 5)
    nested = {"priority": {"input": 1, "output": 1, "service_tiers": {}}}
    err = refused(minimal(price={"input": 1, "output": 1, "service_tiers": nested}))
    assert "unknown config key models.m.price.service_tiers.priority.service_tiers" in str(err)
    err = refused(minimal(price={"input": 1, "output": 1, "service_tiers": {"flex": {"input": 1}}}))
    assert "models.m.price.service_tiers.flex needs both input and output" in str(err)


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
        (minimal(headers={"Authorization": "Bearer x"}), "models.m.headers.Authorization: looks"),
        (minimal(headers={"api-key": "x"}), "models.m.headers.api-key: looks like a credential"),
        (minimal(price={"input": "1e999999", "output": "1"}), "models.m.price: input_per"),
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
        ({**minimal(), "routing": {"default": ""}}, "routing.default"),  # said default_route
        ({**minimal(), "routing": {"default": "ghost"}}, "routing.default"),
        ({"scheduler": {"capacity": 0}}, "capacity"),
        ({"supervisor": {"strategy": "one_for_some"}}, "supervisor.strategy"),
        ({"supervisor": {"within_s": 0}}, "supervisor"),
        ({"scheduler": 5}, "scheduler"),
        (minimal(tpm_refunds="yes"), "models.m.tpm_refunds"),
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


# -- seed, price, base_url, api_key_env, switch_interval_s: checked, the key named ---------


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


def test_steady_heap_is_read_and_checked() -> None:
    assert parse_config({}, environ={}).steady_heap is False
    assert parse_config({**minimal(), "steady_heap": True}, environ={}).steady_heap is True
    for bad in (1, "true"):
        with pytest.raises(ConfigError, match="steady_heap must be true or false"):
            parse_config({**minimal(), "steady_heap": bad}, environ={})


# -- API keys that can never be sent ---------------------------------------------------------


def _no_piece_of(secret: str, err: ConfigError) -> None:
    """Neither the key nor any 6-character piece of it is in the error, however shown."""
    pieces = {secret[i : i + 6] for i in range(len(secret) - 5)}
    for text in (str(err), repr(err), repr(err.args), str(err.__cause__), str(err.__context__)):
        assert not any(p in text for p in pieces), text


@pytest.mark.parametrize(
    "bad",
    [
        KEY + "\r",
        KEY + "\n",
        KEY + "\r\n",
        " " + KEY,
        KEY[:10] + " " + KEY[10:],
        KEY + "\t",
        KEY[:10] + "\x00" + KEY[10:],
        KEY + "\x7f",
        KEY + "\u200b",  # zero-width space: invisible in a terminal
        KEY + "\u00a0",  # no-break space
        KEY[:3] + "\u2011" + KEY[4:],  # a non-breaking hyphen pasted for "-"
    ],
)
def test_an_api_key_with_whitespace_or_control_characters_is_refused_unseen(bad: str) -> None:
    err = refused(minimal(api_key_env="OPENAI_API_KEY"), environ={"OPENAI_API_KEY": bad})
    assert "models.m.api_key_env" in str(err)
    assert "OPENAI_API_KEY" in str(err), "the message names the variable to fix"
    _no_piece_of(KEY, err)


def test_a_sendable_api_key_is_kept_as_is() -> None:
    odd = "Key.with+all/the~usual_chars=="
    cfg = parse_config(minimal(api_key_env="K"), environ={"K": odd})
    assert cfg.models[0].api_key == Secret(odd)


def test_a_bad_key_in_the_environment_names_the_file_not_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CB_TEST_KEY", KEY + "\r")
    path = tmp_path / "callboard.toml"
    path.write_text('[models.m]\nbase_url = "http://x/v1"\napi_key_env = "CB_TEST_KEY"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "CB_TEST_KEY" in str(info.value)
    _no_piece_of(KEY, info.value)


@pytest.mark.parametrize("value", [KEY, "sk live", "", "1ABC", "A-B"])
def test_an_api_key_env_that_is_no_variable_name_is_not_echoed(value: str) -> None:
    """``api_key_env = "sk-..."`` (the key itself, not its variable's name) must not show."""
    err = refused(minimal(api_key_env=value), environ={value: "x"} if value else {})
    assert "models.m.api_key_env" in str(err)
    assert "environment variable" in str(err)
    if value:
        assert value not in str(err)
    _no_piece_of(KEY, err)


# -- routing.order ---------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["bogus", "Cost", "", 5, True, ["cost"]])
def test_a_bad_routing_order_names_the_key_and_the_choices(order: Any) -> None:
    message = str(refused({**minimal(), "routing": {"order": order}}))
    assert "routing.order" in message
    for choice in ("cost", "cheapest", "latency", "least_busy", "config"):
        assert choice in message


@pytest.mark.parametrize("order", ["cost", "cheapest", "latency", "least_busy", "config"])
def test_every_routing_order_is_accepted(order: str) -> None:
    assert parse_config({**minimal(), "routing": {"order": order}}, environ={}).order == order


def test_routing_order_defaults_to_cost() -> None:
    assert parse_config(minimal(), environ={}).order == "cost"


def test_escalate_to_must_name_a_configured_model() -> None:
    assert "routing.escalate_to" in str(refused({**minimal(), "routing": {"escalate_to": "x"}}))
    assert "routing.escalate_to" in str(refused({**minimal(), "routing": {"escalate_to": 5}}))
    cfg = parse_config({**minimal(), "routing": {"escalate_to": "m"}}, environ={})
    assert cfg.escalate_to == "m"


# -- every value has its type checked --------------------------------------------------------


def _set(path: str, value: Any) -> dict[str, Any]:
    """The valid minimal config with ``value`` at a dotted path."""
    data: dict[str, Any] = copy.deepcopy(minimal())
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data


WRONG_TYPES = [
    ("budget.downgrade_when_tight", "false"),
    ("budget.downgrade_when_tight", 0),
    ("budget.stop_when_spent", "no"),
    ("budget.stop_when_spent", 1),
    ("budget.close_on_refusals", "yes"),
    ("budget.total_usd", True),
    ("budget.total_usd", [1]),
    ("budget.per_tag_usd.team", {"usd": 1}),
    ("models.m.provider_model", 5),
    ("models.m.provider_model", ["gpt"]),
    ("models.m.base_url", 5),
    ("models.m.transport", 5),
    ("models.m.http2", "true"),
    ("models.m.max_concurrency", True),
    ("models.m.max_concurrency", 2.5),
    ("models.m.max_concurrency", "4"),
    ("models.m.context_window", True),
    ("models.m.rpm", True),
    ("models.m.rpm", "500"),
    ("models.m.tpm", "1000"),
    ("models.m.burst_s", True),
    ("models.m.timeout", True),
    ("models.m.timeout.connect", True),
    ("models.m.timeout.read", "60"),
    ("models.m.price.input", True),
    ("models.m.breaker.cooldown_s", True),
    ("models.m.breaker.consecutive_failures", 2.0),
    ("models.m.retry.max_attempts", True),
    ("models.m.retry.initial_s", "0.5"),
    ("scheduler.capacity", True),
    ("scheduler.capacity", 10.0),
    ("scheduler.aging_step_s", True),
    ("scheduler.aging_share", "0.1"),
    ("scheduler.escalate_margin_s", "1"),
    ("supervisor.within_s", True),
    ("supervisor.max_restarts", "3"),
    ("supervisor.strategy", 5),
    ("seed", True),
    ("seed", 1.0),
    ("switch_interval_s", True),
    ("steady_heap", 1),
    ("routing.escalate_to", True),
]


@pytest.mark.parametrize(("path", "value"), WRONG_TYPES)
def test_a_value_of_the_wrong_type_is_refused_naming_its_key(path: str, value: Any) -> None:
    if path.startswith("models.m.price."):
        data = _set("models.m.price", {"input": 1, "output": 1})
        data["models"]["m"]["price"][path.rsplit(".", 1)[1]] = value
    else:
        data = _set(path, value)
    assert path in str(refused(data))


@pytest.mark.parametrize(
    ("path", "value"),
    [("models.m.rpm", math.nan), ("models.m.timeout", math.nan), ("budget.total_usd", math.nan)],
)
def test_nan_is_not_a_number_here(path: str, value: float) -> None:
    assert path in str(refused(_set(path, value)))


@pytest.mark.parametrize("amount", ["NaN", "sNaN", "Infinity", "-inf", math.inf])
def test_an_amount_must_be_finite(amount: Any) -> None:
    assert "budget.total_usd" in str(refused(_set("budget.total_usd", amount)))
    price = {"input": amount, "output": 1}
    assert "models.m.price.input" in str(refused(_set("models.m.price", price)))


def test_a_long_text_that_is_no_amount_is_shown_by_its_length() -> None:
    """It may be a key pasted into the price; ``sNaN...`` was repeated whole (a hunt)."""
    said = "sNaN" + "7" * 22
    error = str(refused(_set("models.m.price", {"input": said, "output": 1})))
    assert said not in error
    assert "a text of 26 characters" in error


def test_a_type_error_shows_the_type_not_the_value() -> None:
    """A value in the wrong place may be a secret: only its type is shown."""
    err = refused(_set("budget.stop_when_spent", KEY))
    assert "budget.stop_when_spent must be true or false" in str(err)
    assert "got a string" in str(err)
    assert KEY not in str(err)
    err = refused(_set("models.m.provider_model", 5))
    assert "models.m.provider_model must be a string, got an integer" in str(err)


def test_booleans_and_numbers_of_the_right_type_are_read() -> None:
    cfg = parse_config(
        {
            **minimal(rpm=60, burst_s=1, timeout=2, retry={"initial_s": 1, "max_s": 3}),
            "budget": {
                "downgrade_when_tight": False,
                "stop_when_spent": True,
                "close_on_refusals": False,
                "total_usd": 2,
            },
            "scheduler": {"aging_step_s": 1, "escalate_margin_s": 0.5},
            "supervisor": {"within_s": 3, "max_restarts": 0},
        },
        environ={},
    )
    assert (cfg.budget.downgrade_when_tight, cfg.budget.stop_when_spent) == (False, True)
    assert cfg.budget.close_on_refusals is False
    assert cfg.budget.total_usd == Decimal(2)
    (model,) = cfg.models
    assert (model.limiter.rpm, model.limiter.burst_s) == (60, 1), "an integer is a number"
    assert (model.timeout.read, model.timeout.total) == (2, 2)
    assert (model.retry.initial_s, model.retry.max_s) == (1, 3)
    assert (cfg.scheduler.aging_step_s, cfg.scheduler.escalate_margin_s) == (1, 0.5)
    assert (cfg.supervisor.within_s, cfg.supervisor.max_restarts) == (3, 0)


@pytest.mark.parametrize(
    "cls",
    [BreakerConfig, LimiterConfig, RetryConfig, SchedulerSettings, Timeouts, SupervisorConfig],
)
def test_every_settings_field_has_a_kind_the_loader_checks(cls: type) -> None:
    """A new field with a type the loader does not know would crash it: map it first."""
    for f in dataclasses.fields(cls):
        parsed_apart = ("strategy", "tenant_weights")  # tables, read by their own code
        assert f.name in parsed_apart or str(f.type) in _FIELD_KINDS, (cls.__name__, f.name)


# -- a config file with no models ------------------------------------------------------------


@pytest.mark.parametrize(
    "body", ["[models]\n[scheduler]\ncapacity = 100\n", "[scheduler]\ncapacity = 100\n", ""]
)
def test_a_config_file_without_models_is_refused(tmp_path: Path, body: str) -> None:
    path = tmp_path / "callboard.toml"
    path.write_text(body, encoding="utf-8")
    with pytest.raises(ConfigError, match="the config defines no models") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_an_empty_models_table_is_refused_in_code_too() -> None:
    assert "defines no models" in str(refused({"models": {}}))


def test_a_config_without_models_reports_a_bad_key_first(tmp_path: Path) -> None:
    path = tmp_path / "callboard.toml"
    path.write_text('[models]\n[scheduler]\ncapacity = "lots"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"scheduler\.capacity"):
        load_config(path)


# -- errors from a file name the file --------------------------------------------------------


def test_every_error_from_a_file_names_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "callboard.toml"
    path.write_text('[models.m]\nbase_url = "http://x/v1"\n[budget]\nstop_when_spent = "no"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "budget.stop_when_spent" in str(info.value)
    assert isinstance(info.value, UsageError)


def test_a_config_path_that_cannot_be_read_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read") as info:
        load_config(tmp_path)
    assert str(tmp_path) in str(info.value)
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[models.m]\nbase_url = "http://x/v1" # caf\xe9\n')
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(path)


def test_a_config_that_begins_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "notepad.toml"
    path.write_bytes(b'\xef\xbb\xbf[models.m]\nbase_url = "http://x/v1"\n')
    (model,) = load_config(path).models
    assert (model.name, model.base_url) == ("m", "http://x/v1")


def test_the_cli_exits_2_on_a_bad_config_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "hi", "max_tokens": 4}\n', encoding="utf-8")
    config = tmp_path / "c.toml"
    config.write_text('[models.m]\nbase_url = "http://127.0.0.1:9/v1"\n[routing]\norder = "x"\n')
    code = main(["run", str(src), "-o", str(tmp_path / "out.jsonl"), "--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(config) in err
    assert "routing.order" in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("value", [-1.0, float("nan"), True])
def test_a_bad_escalation_margin_is_a_config_error(value: object) -> None:
    from callboard.core.settings import SchedulerSettings

    with pytest.raises(ConfigError, match="escalate_margin_s"):
        SchedulerSettings(escalate_margin_s=value)  # type: ignore[arg-type]


PASTED = "sk-proj-AbCdEf0123456789xyzQRSTUV"
HOST_URL = "https://api.example.com/v1"


def test_proxy_and_the_cap_field_come_from_the_file_and_credentials_only_from_the_env() -> None:
    base = {"base_url": "https://api.example.com/v1", "transport": "httpx"}
    wanted = {"proxy": "http://proxy:3128", "max_tokens_param": "max_completion_tokens"}
    (m,) = parse_config({"models": {"m": {**base, **wanted}}}, environ={}).models
    assert m.proxy is not None
    assert m.proxy.reveal() == "http://proxy:3128"
    assert m.max_tokens_param == "max_completion_tokens"
    with_credentials = "http://user:pw@proxy:3128"
    env = {"CB_PROXY": with_credentials}
    (m,) = parse_config({"models": {"m": {**base, "proxy_env": "CB_PROXY"}}}, environ=env).models
    assert m.proxy is not None
    assert m.proxy.reveal() == with_credentials
    for secret_url in (with_credentials, "http://proxy:3128/?token=pw-0123456789"):
        with pytest.raises(ConfigError, match="proxy_env") as refused:
            parse_config({"models": {"m": {**base, "proxy": secret_url}}}, environ={})
        assert "pw" not in str(refused.value)
    with pytest.raises(ConfigError, match="max_tokens_param"):
        parse_config({"models": {"m": {**base, "max_tokens_param": "max_toks"}}}, environ={})


@pytest.mark.parametrize(
    ("section", "where"),
    [
        ({"models": {"m": {"base_url": HOST_URL, "api": PASTED}}}, "api"),
        ({"models": {"m": {"base_url": HOST_URL, "max_tokens_param": PASTED}}}, "max_tokens_param"),
        ({"models": {"m": {"base_url": HOST_URL}}, "routing": {"order": PASTED}}, "order"),
        ({"models": {"m": {"base_url": HOST_URL}}, "cluster": {"engine": PASTED}}, "engine"),
        ({"models": {"m": {"base_url": HOST_URL, "price": {"input": PASTED}}}}, "input"),
    ],
)
def test_a_key_pasted_into_a_choice_or_an_amount_is_not_echoed(
    section: dict[str, Any], where: str
) -> None:
    """A long text where a choice or an amount belongs is shown by its length: it may
    be a key pasted in the wrong place (found by a hunt)."""
    with pytest.raises(ConfigError, match=where) as refused:
        parse_config(section, environ={})
    assert PASTED not in str(refused.value)
    assert f"a text of {len(PASTED)} characters" in str(refused.value)


# -- routes and the default route ------------------------------------------------------------

HOST = "http://127.0.0.1:9/v1"


@pytest.mark.parametrize(
    "url",
    [
        f"https://api.example.com/v1?key={KEY}",
        f"https://api.example.com/v1?api-version=1&api_key={KEY}",
        f"https://user:{KEY}@api.example.com/v1",
    ],
)
def test_a_base_url_holding_a_secret_comes_only_from_the_env(url: str) -> None:
    with pytest.raises(ConfigError, match="base_url_env") as refused:
        parse_config({"models": {"m": {"base_url": url}}}, environ={})
    assert KEY not in str(refused.value)
    env = {"CB_URL": url}
    (m,) = parse_config({"models": {"m": {"base_url_env": "CB_URL"}}}, environ=env).models
    assert isinstance(m.base_url, Secret)
    assert m.base_url.reveal() == url
    assert KEY not in repr(m)


def test_base_url_and_base_url_env_are_one_or_the_other() -> None:
    both = {"base_url": "https://api.example.com/v1", "base_url_env": "CB_URL"}
    with pytest.raises(ConfigError, match="not both"):
        parse_config({"models": {"m": both}}, environ={"CB_URL": "https://x/v1"})
    with pytest.raises(ConfigError, match=r"models\.m\.base_url_env: environment variable CB_URL"):
        parse_config({"models": {"m": {"base_url_env": "CB_URL"}}}, environ={})


def test_an_azure_api_version_is_no_secret() -> None:
    url = "https://x.openai.azure.com/openai/deployments/d?api-version=2024-06-01"
    (m,) = parse_config({"models": {"m": {"base_url": url}}}, environ={}).models
    assert m.base_url == url


def test_a_toml_tier_listed_twice_plans_the_model_once() -> None:
    cfg = parse_config(
        {"models": {"a": {"base_url": HOST, "tiers": ["fast", "fast"]}}},
        environ={},
    )
    p = RoutingPolicy({m.name: m for m in cfg.models}, routes=cfg.routes)
    assert p.plan(Request.of("hello there", route="fast"), 10).candidates == ("a",)


def test_toml_default_auto_is_accepted() -> None:
    data = {
        "models": {"a": {"base_url": HOST, "tiers": ["fast"]}},
        "routing": {"default": "auto"},
    }
    assert parse_config(data, environ={}).default_route == (AUTO,)


def test_a_misspelt_default_route_is_still_refused() -> None:
    data = {"models": {"a": {"base_url": HOST}}, "routing": {"default": "fsat"}}
    with pytest.raises(ConfigError, match="fsat"):
        parse_config(data, environ={})


def test_toml_budget_refuses_non_finite_amounts() -> None:
    for amount in ("nan", "inf", float("inf")):
        with pytest.raises(ConfigError, match="finite"):
            parse_config(
                {"models": {"a": {"base_url": HOST}}, "budget": {"total_usd": amount}},
                environ={},
            )


@pytest.mark.parametrize(
    "pasted", ["gsk_AbCdEf0123456789xyz", "ghp_abcdefABCDEF0123", "AKIAABCDEFGHIJKLMNOP"]
)
def test_a_key_pasted_as_api_key_env_is_not_echoed(pasted: str) -> None:
    """Such keys are valid variable names; the error must not print them."""
    with pytest.raises(ConfigError, match=r"models\.a\.api_key_env") as info:
        parse_config({"models": {"a": {"base_url": HOST, "api_key_env": pasted}}}, environ={})
    assert pasted not in str(info.value)


@pytest.mark.parametrize(
    "field",
    [
        {"headers_env": {"api-key": "gsk_AbCdEf0123456789xyz"}},
        {"base_url_env": "gsk_AbCdEf0123456789xyz"},
        {"proxy_env": "gsk_AbCdEf0123456789xyz"},
    ],
)
def test_a_key_pasted_where_any_variables_name_goes_is_not_echoed(field: dict[str, Any]) -> None:
    """As for ``api_key_env``: ``headers_env``, ``base_url_env`` and ``proxy_env`` name
    variables that hold secrets, and a secret pasted there is often a valid name."""
    model = {"base_url": HOST, **field}
    if "base_url_env" in field:
        del model["base_url"]
    with pytest.raises(ConfigError, match="is not set") as info:
        parse_config({"models": {"a": model}}, environ={})
    assert "gsk_AbCdEf0123456789xyz" not in str(info.value)


def test_a_budget_that_is_no_number_is_shown_only_when_short() -> None:
    with pytest.raises(ConfigError, match="got 'ten dollars'"):
        parse_config({"budget": {"total_usd": "ten dollars"}}, environ={})
    with pytest.raises(ConfigError, match="a text of 23 characters") as info:
        parse_config({"budget": {"total_usd": "gsk_AbCdEf0123456789xyz"}}, environ={})
    assert "gsk_" not in str(info.value)


@pytest.mark.parametrize(
    ("section", "said"),
    [  # each said its section twice ("scheduler: scheduler.capacity"), money as Python
        ({"scheduler": {"capacity": -1}}, "scheduler.capacity must be a positive integer, got -1"),
        ({"budget": {"total_usd": -1}}, "budget.total_usd must be a Decimal or int amount"),
        ({"budget": {"per_tag_usd": {"a": "-2"}}}, "budget.per_tag_usd.a must be a Decimal"),
    ],
)
def test_an_error_names_its_key_once_and_shows_the_value_as_written(
    section: dict[str, Any], said: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"models": {"a": {"base_url": HOST}}, **section}, environ={})
    message = str(info.value)
    assert message.startswith(said), message
    assert "Decimal(" not in message
    assert re.search(r"got -[12]$", message), message


def test_give_up_s_is_set_for_the_system_and_per_model_in_the_file() -> None:
    data = {
        "give_up_s": 30,
        "models": {
            "a": {"base_url": "https://a.example/v1", "breaker": {"give_up_s": 5}},
            "b": {"base_url": "https://b.example/v1"},
        },
    }
    config = parse_config(data, environ={})
    assert config.give_up_s == 30
    assert [m.breaker.give_up_s for m in config.models] == [5, 30]
    with pytest.raises(ConfigError, match="give_up_s must be"):
        parse_config({**data, "give_up_s": "soon"}, environ={})


# -- dialects and headers -----------------------------------------------------------------------


def test_a_header_in_both_tables_is_refused_whatever_its_case() -> None:
    """``X-A`` in headers and ``x-a`` in headers_env are one header: one value was sent and
    the other dropped, silently (found by a hunt)."""
    table = {
        "base_url": "https://example.test",
        "headers": {"X-A": "plain"},
        "headers_env": {"x-a": "OPENAI_API_KEY"},
    }
    with pytest.raises(ConfigError, match="'x-a' is in both headers and headers_env"):
        parse_config({"models": {"m": table}}, environ=ENV)


def test_a_models_dialect_and_headers_are_read_secret_ones_from_the_environment() -> None:
    config = parse_config(
        {
            "models": {
                "az": {
                    "base_url": "https://res.openai.azure.com",
                    "api": "azure",
                    "api_version": "2024-10-21",
                    "headers": {"X-Title": "my app"},
                    "headers_env": {"api-key": "OPENAI_API_KEY"},
                    "price": {"input": 1, "output": 4, "reasoning": 8, "cache_write": 2},
                }
            }
        },
        environ=ENV,
    )
    (model,) = config.models
    assert (model.api, model.api_version) == ("azure", "2024-10-21")
    assert model.headers["X-Title"] == "my app"
    secret = model.headers["api-key"]
    assert isinstance(secret, Secret)
    assert secret.reveal() == KEY
    assert KEY not in repr(model)
    assert model.price.cache_write_per_mtok == Decimal(2)
    assert model.price.reasoning_per_mtok == Decimal(8)


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ({"api": "gemini"}, "api must be"),
        ({"headers": {"bad name": "x"}}, "not an HTTP header name"),
        ({"headers": {"X-A": "line\r\nbreak"}}, "without line breaks"),
        ({"headers": {"X-A": "1"}, "headers_env": {"X-A": "OPENAI_API_KEY"}}, "in both"),
        ({"headers_env": {"api-key": "NOT_SET_ANYWHERE"}}, "is not set"),
    ],
)
def test_a_bad_dialect_or_header_is_a_config_error_naming_it(
    model: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle) as caught:
        parse_config({"models": {"m": {"base_url": "http://127.0.0.1:9/v1", **model}}}, environ=ENV)
    assert KEY not in str(caught.value)


def test_a_models_embedding_batch_limits_are_read_and_checked() -> None:
    base = {"base_url": "https://api.example.com/v1"}
    limits = {"embedding_batch_size": 100, "embedding_batch_tokens": 8000}
    (m,) = parse_config({"models": {"m": {**base, **limits}}}, environ={}).models
    assert (m.embedding_batch_size, m.embedding_batch_tokens) == (100, 8000)
    (default,) = parse_config({"models": {"m": base}}, environ={}).models
    assert (default.embedding_batch_size, default.embedding_batch_tokens) == (2048, 300_000)


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("embedding_batch_size", "100", "models.m.embedding_batch_size must be an integer"),
        ("embedding_batch_size", 0, "embedding_batch_size must be an integer >= 1"),
        ("embedding_batch_size", 4096, "embedding_batch_size must be at most 2048"),
        ("embedding_batch_tokens", 1.5, "models.m.embedding_batch_tokens must be an integer"),
        ("embedding_batch_tokens", -1, "embedding_batch_tokens must be an integer >= 1"),
    ],
)
def test_a_bad_embedding_batch_limit_names_its_key(key: str, value: object, needle: str) -> None:
    model = {"base_url": "https://api.example.com/v1", key: value}
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_config({"models": {"m": model}}, environ={})


def test_tenant_weights_are_a_table_of_numbers() -> None:
    config = parse_config({"scheduler": {"tenant_weights": {"team-a": 3, "b": 0.5}}}, environ={})
    assert config.scheduler.tenant_weights == {"team-a": 3, "b": 0.5}
    with pytest.raises(ConfigError, match=r"scheduler\.tenant_weights\.b must be a number"):
        parse_config({"scheduler": {"tenant_weights": {"b": "heavy"}}}, environ={})
    with pytest.raises(ConfigError, match="positive"):
        parse_config({"scheduler": {"tenant_weights": {"b": 0}}}, environ={})


def test_a_cluster_table_runs_the_scheduler_on_ray() -> None:
    data = {
        "cluster": {
            "engine": "ray",
            "address": "ray://head:10001",
            "namespace": "prod",
            "when_lost": "local",
            "lost_after_s": 10,
        },
        "models": {"m": {"base_url": "http://127.0.0.1:9/v1"}},
    }
    config = parse_config(data, environ={})
    assert config.cluster == RayCluster(
        address="ray://head:10001", namespace="prod", when_lost="local", lost_after_s=10
    )
    assert parse_config({"cluster": {"engine": "local"}}, environ={}).cluster is None


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"engine": "spark"}, "cluster.engine must be one of local, ray; got 'spark'"),
        ({"address": "auto"}, 'cluster.address needs cluster.engine = "ray"'),
        ({"engine": "ray", "address": 6379}, "cluster.address must be a string, got an integer"),
        ({"engine": "ray", "lease_s": 0}, "cluster.lease_s must be a number of seconds > 0"),
        # shorter than a poll's wait: live processes were taken for dead (found by a hunt)
        ({"engine": "ray", "lease_s": 0.1}, "cluster.lease_s must be at least 1.0 s"),
        ({"engine": "ray", "port": 1}, "unknown config key cluster.port"),
        (
            {"engine": "ray", "when_lost": "panic"},
            "cluster.when_lost must be one of wait, local; got 'panic'",
        ),
        ({"engine": "ray", "lost_after_s": -1}, "cluster.lost_after_s must be a number of"),
        ({"engine": "ray"}, "a cluster needs configured models"),
    ],
)
def test_a_wrong_cluster_table_names_its_key(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"cluster": table}, environ={})


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"budget": {"per_tag_usd": {"total_usd": -1}}}, "budget.per_tag_usd.total_usd"),
        ({"routing": {"routes": {"r": ["zz"]}}}, "routing.routes.r"),
        ({"scheduler": {"capacity": 0}}, "scheduler.capacity"),
    ],
)
def test_an_error_names_the_key_as_it_is_written(data: dict[str, Any], key: str) -> None:
    """A tag's budget was said as ``budget total_usd`` (a key the user never wrote, for a
    tag of that name), a route as ``route 'r'``, the capacity as "queue capacity" (a
    hunt)."""
    with pytest.raises(ConfigError, match=re.escape(key)):
        parse_config({**minimal(), **data}, environ={})


def test_what_a_model_is_sent_back_of_an_answers_reasoning_is_read_and_checked() -> None:
    cfg = parse_config(minimal(sends_back=["reasoning_content"]), environ={})
    assert cfg.models[0].sends_back == frozenset({"reasoning_content"})
    assert parse_config(minimal(), environ={}).models[0].sends_back == frozenset()
    assert "sends_back" in str(refused(minimal(sends_back=["thoughts"])))
    assert "sends_back" in str(refused(minimal(sends_back="reasoning_content")))


def test_an_endless_config_is_refused_not_read_until_memory_runs_out() -> None:
    """``--config /dev/zero`` was read until the machine ran out of memory (a hunt)."""
    with pytest.raises(ConfigError, match=r"^/dev/zero: cannot read the config: larger than"):
        load_config("/dev/zero")


def test_a_config_as_large_as_allowed_is_read(tmp_path: Path) -> None:
    path = tmp_path / "callboard.toml"
    head = '[models.m]\nbase_url = "http://127.0.0.1:9/v1"\n'
    path.write_text(head + "#" * (MAX_CONFIG_BYTES - len(head) - 1) + "\n")
    assert path.stat().st_size == MAX_CONFIG_BYTES
    assert [m.name for m in load_config(path).models] == ["m"]
