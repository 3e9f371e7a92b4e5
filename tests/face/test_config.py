"""``SystemConfig`` and ``BudgetSettings`` (callboard/config.py): routes, the default
route, ordering, escalation, model names and spend limits are checked when the config
is built, with a ``ConfigError`` that names what is wrong."""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

import pytest
from callboard.core.breaker import BreakerConfig
from callboard.core.pricing import Price
from callboard.core.retry import RetryConfig
from callboard.core.routing import AUTO
from callboard.core.settings import ModelSettings
from callboard.messages import ConfigError
from callboard.supervisor.supervisor import SupervisorConfig

from callboard.config import BudgetSettings, RayCluster, SystemConfig

URL = "http://127.0.0.1:9/v1"


def model(name: str, **kw: Any) -> ModelSettings:
    return ModelSettings(name=name, base_url=URL, price=Price(Decimal(1), Decimal(1)), **kw)


def test_the_default_route_may_be_auto_or_a_tier_in_system_config() -> None:
    """config.py has ``_default_models`` for exactly this, the system passes a single
    non-model name on as a route name, and toml_config turns ``default = "auto"`` into
    ``("auto",)``: but ``SystemConfig.__post_init__`` checks the raw tuple as model names."""
    m = model("a", tiers=("fast",))
    assert SystemConfig(models=(m,), default_route=(AUTO,)).default_route == (AUTO,)
    assert SystemConfig(models=(m,), default_route=("fast",)).default_route == ("fast",)


def test_system_config_default_route_forms() -> None:
    m = model("a", tiers=("fast",))
    assert SystemConfig(models=(m,), default_route="fast").default_route == ("fast",)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lists no model"):
        SystemConfig(models=(m,), routes={"x": ()})
    with pytest.raises(ConfigError, match="model names"):
        SystemConfig(models=(m,), routes={"x": "a"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="'ghost'"):
        SystemConfig(models=(m,), default_route=("a", "ghost"))


def test_system_config_checks_order_and_escalate_to() -> None:
    """SystemConfig checks fallbacks and route members eagerly with ConfigError, and the
    TOML loader checks both of these; the Python face does not."""
    m = model("a")
    with pytest.raises(ConfigError):
        SystemConfig(models=(m,), order="fastest")
    with pytest.raises(ConfigError):
        SystemConfig(models=(m,), escalate_to="nobody")


@pytest.mark.parametrize("amount", ["NaN", "sNaN", "Infinity", "1e999999", "1000000000001"])
def test_budget_settings_refuse_non_finite_amounts(amount: str) -> None:
    """A NaN escapes as ``decimal.InvalidOperation`` (not ``ConfigError``); an infinite
    total is accepted and ``System()`` then dies in ``usd_to_nusd`` with OverflowError,
    as ``1e999999``, finite, did (a trillion dollars is the most taken)."""
    with pytest.raises(ConfigError):
        BudgetSettings(total_usd=Decimal(amount))
    with pytest.raises(ConfigError):
        BudgetSettings(per_tag_usd={"team": Decimal(amount)})


def test_no_models_means_the_simulated_provider() -> None:
    assert SystemConfig().simulated
    assert not SystemConfig(models=(model("a"),)).simulated


def test_model_names_must_be_unique() -> None:
    with pytest.raises(ConfigError, match=r"unique.*'a'"):
        SystemConfig(models=(model("a"), model("a")))


def test_a_fallback_must_be_a_configured_model() -> None:
    with pytest.raises(ConfigError, match="fallback 'ghost'"):
        SystemConfig(models=(model("a", fallbacks=("ghost",)),))
    SystemConfig(models=(model("a", fallbacks=("b",)), model("b")))


def test_a_name_that_names_no_model_is_shown_up_to_64_characters() -> None:
    """Model names run long, and the name is how the typo is found; a longer text
    (a key in the wrong place?) is shown by its length, as any config error's."""
    long_name = "claude-3-5-sonnet-2024102"  # one character short
    with pytest.raises(ConfigError, match=f"fallback '{long_name}' is not"):
        SystemConfig(models=(model("a", fallbacks=(long_name,)),))
    with pytest.raises(ConfigError, match="fallback a text of 65 characters is not") as caught:
        SystemConfig(models=(model("a", fallbacks=("x" * 65,)),))
    assert "x" * 65 not in str(caught.value)


def test_a_route_named_default_route_is_named_as_written() -> None:
    """It was said as ``routing.default``, the default route's key (a review)."""
    with pytest.raises(ConfigError, match=r"^routing\.routes\.default_route names unknown"):
        SystemConfig(models=(model("a"),), routes={"default_route": ("nope",)})


def test_a_route_may_name_only_configured_models() -> None:
    with pytest.raises(ConfigError, match=r"routing\.routes\.x names unknown model 'ghost'"):
        SystemConfig(models=(model("a"),), routes={"x": ("a", "ghost")})


def test_a_default_route_naming_a_route_or_a_tier_is_a_route_name() -> None:
    m = model("a", tiers=("fast",))
    assert SystemConfig(models=(m,), routes={"x": ("a",)}, default_route=("x",)).default_route == (
        "x",
    )
    with pytest.raises(
        ConfigError, match=r"neither a configured model nor a route \(routes: fast, x, auto\)"
    ):
        SystemConfig(models=(m,), routes={"x": ("a",)}, default_route=("nope",))


def test_routes_are_read_only_after_construction() -> None:
    config = SystemConfig(models=(model("a"),), routes={"x": ["a"]})  # type: ignore[dict-item]
    assert config.routes["x"] == ("a",)
    with pytest.raises(TypeError):
        config.routes["y"] = ("a",)  # type: ignore[index]


@pytest.mark.parametrize("interval", [0, 2, 1e-7, float("nan"), True, "0.001"])
def test_switch_interval_must_be_seconds_between_a_microsecond_and_one(interval: Any) -> None:
    with pytest.raises(ConfigError, match="switch_interval_s"):
        SystemConfig(switch_interval_s=interval)
    assert SystemConfig(switch_interval_s=0.0005).switch_interval_s == 0.0005


@pytest.mark.parametrize("wanted", [1, "yes", None])
def test_steady_heap_must_be_true_or_false(wanted: Any) -> None:
    with pytest.raises(ConfigError, match="steady_heap must be true or false"):
        SystemConfig(steady_heap=wanted)


def test_a_budget_is_enabled_by_a_total_or_a_tag_limit() -> None:
    assert not BudgetSettings().enabled
    assert BudgetSettings(total_usd=Decimal(0)).enabled
    assert BudgetSettings(per_tag_usd={"team": Decimal("0.5")}).enabled


@pytest.mark.parametrize("amount", [Decimal(-1), True, 1.5, "10"])
def test_a_budget_amount_is_a_decimal_or_int_of_at_least_zero(amount: Any) -> None:
    with pytest.raises(ConfigError, match=r"budget\.total_usd"):
        BudgetSettings(total_usd=amount)
    assert BudgetSettings(total_usd=3).total_usd == 3


def test_per_tag_limits_are_read_only() -> None:
    b = BudgetSettings(per_tag_usd={"team": Decimal(1)})
    with pytest.raises(TypeError):
        b.per_tag_usd["other"] = Decimal(2)  # type: ignore[index]


def test_the_systems_give_up_s_fills_every_model_that_sets_none() -> None:
    own = ModelSettings(name="own", base_url="http://h/v1", breaker=BreakerConfig(give_up_s=5.0))
    bare = ModelSettings(name="bare", base_url="http://h/v1")
    default = SystemConfig(models=(own, bare))
    assert [m.breaker.give_up_s for m in default.models] == [5.0, 60.0]
    never = SystemConfig(models=(own, bare), give_up_s=math.inf)
    assert [m.breaker.give_up_s for m in never.models] == [5.0, math.inf]


@pytest.mark.parametrize("bad", [0, -1, math.nan, "60", True, None])
def test_give_up_s_is_a_positive_number_of_seconds(bad: object) -> None:
    with pytest.raises(ConfigError, match="give_up_s must be a number of seconds"):
        SystemConfig(give_up_s=bad)  # type: ignore[arg-type]


def test_a_ray_cluster_is_checked_and_needs_configured_models() -> None:
    model = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1")
    config = SystemConfig(models=(model,), cluster=RayCluster(namespace="prod"))
    assert config.cluster is not None
    assert (config.cluster.address, config.cluster.namespace) == ("auto", "prod")
    with pytest.raises(ConfigError, match=r"cluster\.namespace must be a non-empty string"):
        RayCluster(namespace="")
    with pytest.raises(ConfigError, match=r"cluster\.connect_timeout_s must be a number"):
        RayCluster(connect_timeout_s=math.inf)
    assert RayCluster().when_lost == "wait"  # never a hang: see RayCluster.when_lost
    with pytest.raises(ConfigError, match=r"cluster\.when_lost must be one of wait, local"):
        RayCluster(when_lost="retry")
    with pytest.raises(ConfigError, match=r"cluster\.lost_after_s must be a number"):
        RayCluster(lost_after_s=0)
    with pytest.raises(ConfigError, match="a cluster needs configured models"):
        SystemConfig(cluster=RayCluster())
    with pytest.raises(ConfigError, match="cluster must be a RayCluster or None"):
        SystemConfig(models=(model,), cluster="ray")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"seed": "x"}, "seed must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"budget": {}}, "budget must be a BudgetSettings"),
        ({"scheduler": None}, "scheduler must be a SchedulerSettings"),
        ({"supervisor": {"max_restarts": 1}}, "supervisor must be a SupervisorConfig"),
        ({"models": ModelSettings(name="m", base_url="http://127.0.0.1:9")}, "list or tuple"),
        ({"models": ["m"]}, r"models\[0\] must be a ModelSettings"),
    ],
)
def test_a_systems_part_of_the_wrong_kind_is_refused_naming_it(
    fields: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        SystemConfig(**fields)


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda: BudgetSettings(stop_when_spent="false"), "budget.stop_when_spent must be true"),
        (lambda: BudgetSettings(downgrade_when_tight="no"), "budget.downgrade_when_tight"),
        (lambda: BudgetSettings(close_on_refusals=1), "budget.close_on_refusals must be true"),
        (lambda: BudgetSettings(per_tag_usd="a"), "budget.per_tag_usd must be a mapping"),
        (lambda: BudgetSettings(per_tag_usd={5: Decimal(1)}), "budget.per_tag_usd"),
        (lambda: BudgetSettings(per_tag_usd={"": Decimal(1)}), "a tag name must be a non-empty"),
        (lambda: BudgetSettings(total_usd="0.50"), r"str: money is exact, write Decimal\('0.50'\)"),
        (lambda: SystemConfig(models=(model("m"),), routes="fast"), "routes must be a mapping"),
        (lambda: SystemConfig(models=(model("m"),), routes={5: ["m"]}), "routes must be a mapping"),
        (lambda: SystemConfig(models=(model("m"),), escalate_to=["m"]), "escalate_to must be"),
        (
            lambda: SystemConfig(models=(model("m"),), routes={AUTO: ("m",)}),
            r"routing\.routes\.auto: 'auto' is reserved for the classifier",
        ),
        (
            lambda: SystemConfig(
                models=(ModelSettings(name="m", base_url="http://h/v1", tiers=(AUTO,)),)
            ),
            "model 'm': the tier 'auto' is reserved",
        ),
        (lambda: SupervisorConfig(max_restarts="3"), "max_restarts must be an integer"),
        (lambda: SupervisorConfig(within_s=None), "within_s must be a number"),
        (lambda: RetryConfig(max_attempts="3"), "max_attempts must be an integer"),
        (lambda: BreakerConfig(consecutive_failures=2.5), "consecutive_failures must be"),
        (lambda: Price("abc", 1), "input_per_mtok must be a Decimal"),
    ],
)
def test_every_bad_value_in_python_is_a_config_error_naming_it(make: Any, said: str) -> None:
    """Each raised AttributeError, TypeError or ValueError, which ``except UsageError``
    missed, or was taken ("false" for a flag was true; found by a hunt)."""
    with pytest.raises(ConfigError, match=said):
        make()


def test_a_cluster_setting_never_repeats_a_long_value() -> None:
    """A key pasted in the wrong place is named by its length only, as the TOML's other
    keys are."""
    pasted = "sk-proj-" + "PASTEDPASTED0123456789"
    for field in ("when_lost", "namespace", "lease_s"):
        with pytest.raises(ConfigError, match=f"cluster.{field}") as refused:
            RayCluster(**{field: pasted if field != "namespace" else [pasted]})
        assert pasted not in str(refused.value)
