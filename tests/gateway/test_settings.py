"""The ``[gateway]`` table: every key checked, keys kept as digests only, and an open
gateway kept on loopback."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from callboard.gateway import (
    ClientKey,
    GatewayConfig,
    GatewaySettings,
    UnsafeBindError,
    check_bind,
    load_config,
    parse_gateway,
)
from callboard.gateway.settings import BudgetPeriod, Limits, is_loopback
from callboard.messages import ConfigError, Priority

KEY = "sk-live-abcdef0123456789"
HEX = hashlib.sha256(KEY.encode()).hexdigest()


PASTED = "sk-proj-AbCdEf0123456789xyzQRSTUV"


def parse(table: dict[str, Any], **environ: str) -> GatewaySettings:
    return parse_gateway(table, environ=environ)


def test_a_key_is_read_with_its_tenant_priorities_and_models() -> None:
    settings = parse(
        {
            "grace_s": 5,
            "keys": {
                "team-a": {
                    "key_sha256": HEX,
                    "tenant": "a",
                    "priority": "low",
                    "max_priority": "High",
                    "models": ["fast", "sim-smart"],
                }
            },
        }
    )
    (key,) = settings.keys
    assert key.name == "team-a"
    assert key.tenant == "a"
    assert key.digest == hashlib.sha256(KEY.encode()).digest()
    assert (key.priority, key.max_priority) == (Priority.LOW, Priority.HIGH)
    assert key.models == frozenset({"fast", "sim-smart"})
    assert settings.grace_s == 5
    assert not settings.open


def test_a_key_from_the_environment_keeps_only_its_digest() -> None:
    settings = parse({"keys": {"ops": {"key_env": "OPS_KEY"}}}, OPS_KEY=KEY)
    (key,) = settings.keys
    assert key.digest == hashlib.sha256(KEY.encode()).digest()
    assert key.tenant == "ops"  # the key's name, when no tenant is given
    assert (key.priority, key.max_priority, key.models) == (
        Priority.NORMAL,
        Priority.CRITICAL,
        None,
    )
    assert KEY not in repr(settings)
    assert HEX not in repr(settings)


def test_only_a_key_marked_operator_reads_the_whole_gateway() -> None:
    settings = parse(
        {"keys": {"ops": {"key_sha256": HEX, "operator": True}, "team": {"key_env": "TEAM"}}},
        TEAM="sk-team-0123456789",
    )
    assert [(k.name, k.operator) for k in settings.keys] == [("ops", True), ("team", False)]
    with pytest.raises(ConfigError, match=r"gateway\.keys\.ops\.operator: must be true or false"):
        parse({"keys": {"ops": {"key_sha256": HEX, "operator": "yes"}}})


def test_metrics_are_open_unless_kept_to_an_operator() -> None:
    assert parse({}).metrics == "open"
    guarded = parse({"metrics": "operator", "keys": {"ops": {"key_sha256": HEX, "operator": True}}})
    assert guarded.metrics == "operator"
    assert parse({"metrics": "operator"}).metrics == "operator"  # open: every caller is one


def test_limits_are_read_per_key_and_per_tenant() -> None:
    settings = parse(
        {
            "queue_bound": 5,
            "max_wait_s": 2.5,
            "deadline_s": 300,
            "body_timeout_s": 5,
            "idle_s": 10,
            "max_connections": 500,
            "default_max_tokens": 1024,
            "keys": {
                "a": {"key_sha256": HEX, "tenant": "t", "rpm": 60, "budget_usd": "0.10"},
                "b": {"key_env": "B_KEY", "tenant": "t", "tpm": 1000, "budget_usd": 0.1},
            },
            "tenants": {"t": {"rpm": 100, "tpm": 5000, "max_parallel": 16, "budget_usd": 3}},
        },
        B_KEY="sk-b",
    )
    a, b = settings.keys
    assert a.limits == Limits(rpm=60, budget_usd=Decimal("0.10"))
    # a float amount is taken as written, not as 0.1000000000000000055...
    assert b.limits == Limits(tpm=1000, budget_usd=Decimal("0.1"))
    assert settings.tenants == {
        "t": Limits(rpm=100, tpm=5000, max_parallel=16, budget_usd=Decimal(3))
    }
    assert (settings.queue_bound, settings.max_wait_s, settings.deadline_s) == (5, 2.5, 300)
    assert (settings.body_timeout_s, settings.idle_s, settings.max_connections) == (5, 10, 500)
    assert settings.default_max_tokens == 1024
    with pytest.raises(TypeError):
        settings.tenants["u"] = Limits()  # type: ignore[index]


def test_without_limits_a_key_has_none_and_the_bounds_have_defaults() -> None:
    settings = parse({"keys": {"a": {"key_sha256": HEX}}})
    (key,) = settings.keys
    assert not key.limits.limited
    assert settings.tenants == {}
    assert (settings.queue_bound, settings.max_wait_s, settings.deadline_s) == (1000, 60.0, None)
    assert (settings.body_timeout_s, settings.idle_s) == (60.0, 75.0)
    assert settings.max_connections is None  # by the open-file limit (gateway.connections)
    assert settings.default_max_tokens == 4096


def test_limits_built_in_python_are_checked_by_whoever_holds_them() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.keys\.k\.tpm: must be an integer >= 1"):
        ClientKey(name="k", digest=bytes(32), tenant="t", limits=Limits(tpm=0))
    with pytest.raises(ConfigError, match=r"gateway\.tenants\.t\.budget_usd"):
        GatewaySettings(
            keys=(ClientKey(name="k", digest=bytes(32), tenant="t"),),
            tenants={"t": Limits(budget_usd=Decimal(-1))},
        )
    with pytest.raises(ConfigError, match=r"gateway\.keys\.k\.budget_period: must be a Budget"):
        ClientKey(
            name="k",
            digest=bytes(32),
            tenant="t",
            limits=Limits(budget_usd=Decimal(1), budget_period="1d"),  # type: ignore[arg-type]
        )


def test_a_key_built_in_python_with_a_priority_not_a_priority_is_a_config_error() -> None:
    """``ClientKey(priority="high")`` failed its own comparison with a bare
    ``TypeError: '<' not supported`` (found by a hunt)."""
    with pytest.raises(ConfigError, match=r"gateway\.keys\.k\.priority: must be a callboard\.Pri"):
        ClientKey(name="k", digest=bytes(32), tenant="t", priority="high")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"gateway\.keys\.k\.max_priority: .* got 'low'"):
        ClientKey(name="k", digest=bytes(32), tenant="t", max_priority="low")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"gateway\.keys\.k: a digest is 32 bytes"):
        ClientKey(name="k", digest="0" * 32, tenant="t")  # type: ignore[arg-type]


def test_a_key_pasted_as_key_env_is_not_echoed() -> None:
    """``key_env`` names the variable that holds a client key; a key pasted there by
    mistake (a valid name too) must not be printed by the error."""
    pasted = "gsk_AbCdEf0123456789xyz"
    with pytest.raises(ConfigError, match=r"gateway\.keys\.a\.key_env: .* is not set") as info:
        parse({"keys": {"a": {"key_env": pasted}}})
    assert pasted not in str(info.value)


@pytest.mark.parametrize(
    "table",
    [
        {"keys": {"a": {"key_sha256": HEX, "rpm": PASTED}}},
        {"keys": {"a": {"key_sha256": HEX, "budget_usd": PASTED}}},
        {"keys": {"a": {"key_sha256": HEX, "budget_usd": 1, "budget_period": PASTED}}},
        {"keys": {"a": {"key_sha256": HEX}}, "tenants": {"a": {"budget_usd": PASTED}}},
        {"grace_s": PASTED},
        {"default_max_tokens": PASTED},
    ],
)
def test_a_key_pasted_into_another_field_is_not_echoed(table: dict[str, Any]) -> None:
    """A key pasted where a number or a period belongs: the error names the field and
    shows a long text by its length, never the text (found by a hunt)."""
    with pytest.raises(ConfigError) as info:
        parse(table)
    assert PASTED not in str(info.value)
    assert f"a text of {len(PASTED)} characters" in str(info.value) or "got a str" in str(
        info.value
    )


def test_a_key_env_value_with_a_space_or_a_newline_at_an_end_is_refused() -> None:
    """No client could present it (a header's value is trimmed): accepted, the key was
    unusable, in silence (found by a hunt)."""
    table = {"keys": {"a": {"key_env": "TEAM_KEY"}}}
    with pytest.raises(ConfigError, match="TEAM_KEY has spaces or a line break at an end"):
        parse_gateway(table, environ={"TEAM_KEY": "sk-team-0123456789\n"})


def test_max_priority_alone_lowers_the_default_priority_to_it() -> None:
    """``max_priority = "low"`` alone was refused, naming ``priority``, which the
    operator never wrote (found by a hunt)."""
    settings = parse({"keys": {"a": {"key_sha256": HEX, "max_priority": "low"}}})
    (key,) = settings.keys
    assert (key.priority, key.max_priority) == (Priority.LOW, Priority.LOW)
    (key,) = parse({"keys": {"a": {"key_sha256": HEX, "max_priority": "high"}}}).keys
    assert key.priority is Priority.NORMAL


def test_a_tpm_not_above_default_max_tokens_is_doubted() -> None:
    """Each request naming no max_tokens (the SDKs' default) was refused for good
    (found by a hunt): legal, as clients may name theirs, so said at start."""
    settings = parse({"default_max_tokens": 4096, "keys": {"a": {"key_sha256": HEX, "tpm": 1000}}})
    (doubt,) = settings.doubts()
    assert doubt.startswith("gateway.keys.a.tpm (1000) is not above")
    assert not parse({"keys": {"a": {"key_sha256": HEX, "tpm": 100_000}}}).doubts()


def test_without_keys_the_gateway_is_open() -> None:
    assert parse({}).open
    assert GatewaySettings().open


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ({"graces": 1}, "gateway.graces: unknown key"),
        ({"grace_s": -1}, "gateway.grace_s"),
        ({"grace_s": "30"}, "gateway.grace_s"),
        ({"retry_after_s": True}, "gateway.retry_after_s"),
        ({"idempotency_entries": 1.5}, "gateway.idempotency_entries"),
        ({"max_body_mb": 0}, "gateway.max_body_mb"),
        ({"max_body_mb": 1e308, "max_held_mb": 1e308}, "gateway.max_body_mb"),  # overflowed
        ({"max_held_mb": 1e308}, "gateway.max_held_mb"),
        ({"max_held_mb": 16}, "gateway.max_held_mb: must be a number >= max_body_mb"),
        ({"max_held_mb": "512"}, "gateway.max_held_mb"),
        # overflowed at start, or a stop that never ended (found by a hunt)
        ({"idempotency_mb": 1e308}, "gateway.idempotency_mb: must be a number > 0 and at most"),
        ({"unready_s": 1e308}, "gateway.unready_s: must be a number >= 0 and at most 86400"),
        ({"grace_s": 86_401}, "gateway.grace_s"),
        ({"idle_s": 1e308}, "gateway.idle_s"),
        ({"max_wait_s": float("inf")}, "gateway.max_wait_s"),
        ({"keys": {"a": {}}}, "gateway.keys.a: give key_sha256 or key_env"),
        ({"keys": {"a": {"key_sha256": HEX, "key_env": "X"}}}, "gateway.keys.a: give"),
        ({"keys": {"a": {"key_sha256": "abc"}}}, "gateway.keys.a.key_sha256: must be 64 hex"),
        ({"keys": {"a": {"key_env": "NOT_SET"}}}, "NOT_SET is not set"),
        ({"keys": {"a": {"key_env": "1BAD"}}}, "gateway.keys.a.key_env"),
        ({"keys": {"a": {"key_sha256": HEX, "tenant": ""}}}, "gateway.keys.a.tenant"),
        ({"keys": {"a": {"key_sha256": HEX, "priority": "urgent"}}}, "gateway.keys.a.priority"),
        ({"keys": {"a": {"key_sha256": HEX, "models": "fast"}}}, "gateway.keys.a.models"),
        # a key that may use nothing (found by a hunt)
        ({"keys": {"a": {"key_sha256": HEX, "models": []}}}, "must name at least one model"),
        ({"keys": {"a": {"key_sha256": HEX, "rpm": 0}}}, "gateway.keys.a.rpm: must be an integer"),
        ({"keys": {"a": {"key_sha256": HEX, "rpm": 1.5}}}, "gateway.keys.a.rpm"),
        (
            {"keys": {"a": {"key_sha256": HEX, "max_parallel": 0}}},
            "gateway.keys.a.max_parallel: must be an integer >= 1, got 0",
        ),
        ({"keys": {"a": {"key_sha256": HEX, "max_parallel": True}}}, "gateway.keys.a.max_parallel"),
        ({"keys": {"a": {"key_sha256": HEX, "tpm": True}}}, "gateway.keys.a.tpm"),
        ({"keys": {"a": {"key_sha256": HEX, "budget_usd": -1}}}, "gateway.keys.a.budget_usd"),
        ({"keys": {"a": {"key_sha256": HEX, "budget_usd": "ten"}}}, "gateway.keys.a.budget_usd"),
        ({"keys": {"a": {"key_sha256": HEX, "budget_usd": "inf"}}}, "gateway.keys.a.budget_usd"),
        ({"keys": {"a": {"key_sha256": HEX, "budget_usd": [1]}}}, "gateway.keys.a.budget_usd"),
        ({"keys": {"a": {"key_sha256": HEX, "budget_usd": "1e400"}}}, "gateway.keys.a.budget_usd"),
        ({"keys": {"a\nb": {"key_sha256": HEX}}}, "gateway.keys: a key's name must be printable"),
        ({"keys": {"a": {"key_sha256": HEX, "tenant": "t\r\nx"}}}, "gateway.keys.a.tenant"),
        ({"keys": {"a": {"key_sha256": HEX, "tenant": " t"}}}, "gateway.keys.a.tenant: must be"),
        # the stats' name for the rest: merged into it (found by a hunt)
        ({"keys": {"a": {"key_sha256": HEX, "tenant": "*"}}}, "the name the stats give the"),
        (
            {"keys": {"a": {"key_sha256": HEX}}, "tenants": {"a": {"rpm": -1}}},
            "gateway.tenants.a.rpm",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX}}, "tenants": {"a": {"rps": 1}}},
            "gateway.tenants.a.rps: unknown key",
        ),
        ({"keys": {"a": {"key_sha256": HEX}}, "tenants": {"a": 5}}, "gateway.tenants.a: must be"),
        ({"keys": {"a": {"key_sha256": HEX}}, "tenants": []}, "gateway.tenants: must be a table"),
        (
            {"keys": {"a": {"key_sha256": HEX, "tenant": "t"}}, "tenants": {"a": {"rpm": 1}}},
            "gateway.tenants.a: no key belongs to this tenant",
        ),
        ({"tenants": {"t": {"rpm": 1}}}, "gateway.tenants.t: no key belongs"),
        ({"queue_bound": -1}, "gateway.queue_bound: must be an integer >= 0"),
        ({"queue_bound": 10.0}, "gateway.queue_bound"),
        ({"max_wait_s": 0}, "gateway.max_wait_s: must be a number > 0"),
        ({"max_wait_s": "60"}, "gateway.max_wait_s"),
        ({"deadline_s": 0}, "gateway.deadline_s: must be a number > 0"),
        ({"deadline_s": True}, "gateway.deadline_s"),
        ({"deadline_s": 86_401}, "gateway.deadline_s"),
        ({"body_timeout_s": 0}, "gateway.body_timeout_s: must be a number > 0"),
        ({"idle_s": -1}, "gateway.idle_s: must be a number > 0"),
        ({"idle_s": "75"}, "gateway.idle_s"),
        ({"max_connections": 0}, "gateway.max_connections: must be an integer >= 1, got 0"),
        ({"stream_keepalive_s": 0}, "gateway.stream_keepalive_s: must be a number > 0"),
        ({"max_connections": True}, "gateway.max_connections"),
        ({"max_connections": 10.0}, "gateway.max_connections"),
        ({"default_max_tokens": 0}, "gateway.default_max_tokens: must be an integer in 1.."),
        ({"default_max_tokens": 10**7}, "gateway.default_max_tokens"),
        ({"default_max_tokens": True}, "gateway.default_max_tokens"),
        ({"keys": {"a": {"key_sha256": HEX, "colour": 1}}}, "gateway.keys.a.colour: unknown"),
        (
            {"keys": {"a": {"key_sha256": HEX, "priority": "critical", "max_priority": "high"}}},
            "more urgent than its max_priority",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX}, "b": {"key_sha256": HEX.upper()}}},
            "a and b are the same key",
        ),
        ({"keys": []}, "gateway.keys: must be a table"),
        (
            {"keys": {"a": {"key_sha256": HEX, "budget_usd": 1, "budget_period": "-1d"}}},
            "gateway.keys.a.budget_period: must be a whole number >= 1 and a unit",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX, "budget_usd": 1, "budget_period": "0"}}},
            "gateway.keys.a.budget_period: must be a whole number",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX, "budget_usd": 1, "budget_period": "0d"}}},
            "gateway.keys.a.budget_period: a period is at least 1 unit long, not 0",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX, "budget_usd": 1, "budget_period": "1y"}}},
            "gateway.keys.a.budget_period",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX, "budget_usd": 1, "budget_period": 30}}},
            "gateway.keys.a.budget_period: must be a string",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX, "budget_usd": 1, "budget_period": "1D"}}},
            "gateway.keys.a.budget_period",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX, "budget_usd": 1, "budget_period": "121mo"}}},
            "gateway.keys.a.budget_period: a period is at most 120 months",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX, "budget_usd": 1, "budget_period": "99999d"}}},
            "gateway.keys.a.budget_period: a period is at most 3660 days",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX, "budget_period": "1d"}}},
            "gateway.keys.a.budget_period: renews a budget, and there is no budget_usd",
        ),
        (
            {"keys": {"a": {"key_sha256": HEX}}, "tenants": {"a": {"budget_period": "1h"}}},
            "gateway.tenants.a.budget_period: renews a budget",
        ),
        ({"spend_file": ""}, "gateway.spend_file: must be a file's path"),
        ({"spend_file": 7}, "gateway.spend_file: must be a file's path"),
        # a traceback, exit 1 (found by a hunt)
        ({"spend_file": "~nosuchuser-cb/spend.db"}, "gateway.spend_file: '~nosuchuser-cb"),
        ({"metrics": "closed"}, 'gateway.metrics: must be "open" or "operator"'),
        ({"metrics": True}, 'gateway.metrics: must be "open" or "operator"'),
        (
            {"metrics": "operator", "keys": {"a": {"key_sha256": HEX}}},
            'gateway.metrics = "operator", but no key has operator = true',
        ),
    ],
)
def test_a_bad_value_is_a_config_error_naming_its_key(table: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        parse(table)


def test_a_budget_period_is_read_per_key_and_per_tenant() -> None:
    settings = parse(
        {
            "keys": {"a": {"key_sha256": HEX, "budget_usd": "5", "budget_period": "30d"}},
            "tenants": {"a": {"budget_usd": 50, "budget_period": "1mo"}},
        }
    )
    assert settings.keys[0].limits.budget_period == BudgetPeriod(30, "d")
    assert settings.tenants["a"].budget_period == BudgetPeriod(1, "mo")
    assert str(settings.tenants["a"].budget_period) == "1mo"
    assert parse({"keys": {"a": {"key_sha256": HEX}}}).keys[0].limits.budget_period is None


def utc(*when: int) -> float:
    return datetime(*when, tzinfo=UTC).timestamp()  # type: ignore[misc]


@pytest.mark.parametrize(
    ("period", "at", "start", "ends"),
    [
        ("1h", (2026, 12, 2, 10, 30), (2026, 12, 2, 10), (2026, 12, 2, 11)),
        ("15m", (2026, 12, 2, 10, 31), (2026, 12, 2, 10, 30), (2026, 12, 2, 10, 45)),
        ("1d", (2026, 12, 2, 23, 59, 59), (2026, 12, 2), (2026, 12, 3)),
        ("1w", (2026, 12, 2, 10), (2026, 11, 30), (2026, 12, 7)),  # Monday to Monday
        ("7d", (2026, 12, 7), (2026, 12, 7), (2026, 12, 14)),  # the start is its own
        ("1mo", (2026, 12, 31, 23, 59), (2026, 12, 1), (2027, 1, 1)),
        ("1mo", (2028, 2, 29, 12), (2028, 2, 1), (2028, 3, 1)),
        ("3mo", (2026, 5, 20), (2026, 4, 1), (2026, 7, 1)),
        ("12mo", (2026, 12, 2), (2026, 1, 1), (2027, 1, 1)),
    ],
)
def test_a_period_is_aligned_to_utc_not_to_when_the_gateway_started(
    period: str, at: tuple[int, ...], start: tuple[int, ...], ends: tuple[int, ...]
) -> None:
    bounds = BudgetPeriod.parse(period, "p").bounds(utc(*at))
    assert bounds == (utc(*start), utc(*ends))


def test_a_spend_file_is_taken_from_the_config_files_directory(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "callboard.toml"
    path.parent.mkdir()
    path.write_text('[gateway]\nspend_file = "state/spend.db"\n', encoding="utf-8")
    assert load_config(path).gateway.spend_file == tmp_path / "etc" / "state" / "spend.db"
    path.write_text(f'[gateway]\nspend_file = "{tmp_path}/abs.db"\n', encoding="utf-8")
    assert load_config(path).gateway.spend_file == tmp_path / "abs.db"
    assert GatewaySettings().spend_file is None  # the default: spend in memory only
    assert GatewaySettings(spend_file="x.db").spend_file == Path("x.db")  # type: ignore[arg-type]


def test_an_error_about_a_key_from_the_environment_never_shows_it() -> None:
    with pytest.raises(ConfigError) as caught:
        parse({"keys": {"a": {"key_env": "K"}, "b": {"key_env": "L"}}}, K=KEY, L=KEY)
    assert KEY not in str(caught.value)
    assert HEX not in str(caught.value)


def test_load_config_hands_the_rest_of_the_file_to_callboards_own_parser(tmp_path: Path) -> None:
    path = tmp_path / "callboard.toml"
    path.write_text(
        f"""
[gateway]
grace_s = 2
[gateway.keys.a]
key_sha256 = "{HEX}"

[models.m]
base_url = "http://127.0.0.1:9/v1"
tiers = ["fast"]
""",
        encoding="utf-8",
    )
    config = load_config(path)
    assert config.gateway.grace_s == 2
    assert config.system is not None
    assert [m.name for m in config.system.models] == ["m"]


def test_a_file_of_callboards_own_tables_without_models_is_refused(tmp_path: Path) -> None:
    """Budgets and keys with the models moved to another file: served the simulator's
    made-up answers with 200s, where ``callboard run`` and ``shell`` refused the file (a
    hunt)."""
    path = tmp_path / "callboard.toml"
    path.write_text(
        f'[budget]\ntotal_usd = "25.00"\n\n[gateway.keys.a]\nkey_sha256 = "{HEX}"\n',
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match="defines no models"):
        load_config(path)


def test_a_file_with_only_a_gateway_table_serves_the_simulated_provider(tmp_path: Path) -> None:
    path = tmp_path / "callboard.toml"
    path.write_text(f'[gateway.keys.a]\nkey_sha256 = "{HEX}"\n', encoding="utf-8")
    assert load_config(path) == GatewayConfig(system=None, gateway=load_config(path).gateway)
    assert load_config(path).system is None


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[gateway]\ngrace = 1\n", "gateway.grace: unknown key"),
        ("[models.m]\nbase_url = 1\n", "models.m"),
        ("[gateway\n", "not valid TOML"),
    ],
)
def test_load_config_prefixes_every_error_with_the_path(
    tmp_path: Path, text: str, named: str
) -> None:
    path = tmp_path / "callboard.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=named) as caught:
        load_config(path)
    assert str(caught.value).startswith(str(path))


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_an_open_gateway_may_bind_loopback(host: str) -> None:
    assert is_loopback(host)
    check_bind(GatewaySettings(), host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.4", "example.com", ""])
def test_an_open_gateway_refuses_any_other_address(host: str) -> None:
    with pytest.raises(UnsafeBindError, match="binds loopback only"):
        check_bind(GatewaySettings(), host)


def test_a_gateway_with_keys_may_bind_any_address() -> None:
    check_bind(parse({"keys": {"a": {"key_sha256": HEX}}}), "0.0.0.0")


@pytest.mark.parametrize(
    ("field", "value"),
    [("operator", PASTED), ("tenant", PASTED + " "), ("tenant", "\t" + PASTED)],
)
def test_a_key_pasted_into_a_keys_field_is_not_repeated_by_its_error(
    field: str, value: str
) -> None:
    """``operator`` echoed a string whole, and a tenant with a space at an end too (a
    hunt): the docs promise a text over 16 characters is shown by its length only."""
    with pytest.raises(ConfigError, match=field) as info:
        parse({"keys": {"a": {"key_sha256": HEX, field: value}}})
    assert PASTED not in str(info.value)
    shown = "got a str" if field == "operator" else f"a text of {len(value)} characters"
    assert shown in str(info.value)


@pytest.mark.parametrize(
    "table",
    [
        {"grace_s": "sk-abcdefghijkl"},
        {"queue_bound": "sk-abcdefghijkl"},
        {"keys": {"a": {"key_sha256": HEX, "rpm": "sk-abcdefgh"}}},
        {"keys": {"a": {"key_sha256": HEX, "operator": "sk-abcdefgh"}}},
    ],
)
def test_a_short_text_where_a_number_or_a_flag_belongs_is_shown_by_its_type(
    table: dict[str, Any],
) -> None:
    """A type error shows the type, never the value (the docs' promise): the gateway's
    table repeated a text of up to 16 characters, a short key whole (found by a docs
    audit)."""
    with pytest.raises(ConfigError) as info:
        parse(table)
    assert "sk-abcdefgh" not in str(info.value)
    assert "got a str" in str(info.value)
