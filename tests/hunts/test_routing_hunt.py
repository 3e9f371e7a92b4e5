"""Bug hunt: routing policies and configuration (pure cores, plus one real system).

Each confirmed bug (now fixed) is a test of the correct behaviour; the others pin
behaviour that was probed and found right.
"""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

import pytest
from callboard.core.complexity import HeuristicClassifier
from callboard.core.limiter import LimiterConfig
from callboard.core.pricing import Price, cost_nusd, estimate_nusd
from callboard.core.routing import (
    AUTO,
    AboveTokenLimit,
    ContextTooLarge,
    MissingCapability,
    NoRoute,
    Order,
    RoutingPolicy,
)
from callboard.core.settings import ModelSettings, SchedulerSettings, Secret
from callboard.messages import ConfigError, Failed, FailureReason, Request, Usage
from callboard.provider.server import SimulatedProvider
from hypothesis import given, settings
from hypothesis import strategies as st
from support import WAIT_S

from callboard import Completed, System
from callboard.config import BudgetSettings, SystemConfig
from callboard.toml_config import parse_config

URL = "http://127.0.0.1:9/v1"


def model(name: str, *, usd_in: str = "1", usd_out: str = "1", **kw: Any) -> ModelSettings:
    return ModelSettings(
        name=name, base_url=URL, price=Price(Decimal(usd_in), Decimal(usd_out)), **kw
    )


def policy(*models: ModelSettings, **kw: Any) -> RoutingPolicy:
    return RoutingPolicy({m.name: m for m in models}, **kw)


def req(prompt: str = "hello there", **kw: Any) -> Request:
    return Request.of(prompt, **kw)


def everything(plan: Any) -> list[str]:
    return [*plan.candidates, *plan.fallbacks]


# -- a model named twice by one route -------------------------------------------------


def test_a_route_naming_a_model_twice_plans_it_once() -> None:
    """routing.py promises "no model appears twice in a plan"; nothing dedupes a route."""
    p = policy(
        model("a", tiers=("fast", "fast")),
        model("b"),
        routes={"x": ("a", "a", "b")},
        default_route=("b", "b"),
    )
    for request in (req(route="fast"), req(route="x"), req()):
        names = everything(p.plan(request, 10))
        assert len(names) == len(set(names)), names


def test_a_toml_tier_listed_twice_plans_the_model_once() -> None:
    cfg = parse_config(
        {"models": {"a": {"base_url": URL, "tiers": ["fast", "fast"]}}},
        environ={},
    )
    p = RoutingPolicy({m.name: m for m in cfg.models}, routes=cfg.routes)
    assert p.plan(req(route="fast"), 10).candidates == ("a",)


# -- the default route --------------------------------------------------------------------


def test_the_default_route_may_be_auto_or_a_tier_in_system_config() -> None:
    """config.py has ``_default_models`` for exactly this, the system passes a single
    non-model name on as a route name, and toml_config turns ``default = "auto"`` into
    ``("auto",)``: but ``SystemConfig.__post_init__`` checks the raw tuple as model names."""
    m = model("a", tiers=("fast",))
    assert SystemConfig(models=(m,), default_route=(AUTO,)).default_route == (AUTO,)
    assert SystemConfig(models=(m,), default_route=("fast",)).default_route == ("fast",)


def test_toml_default_auto_is_accepted() -> None:
    data = {
        "models": {"a": {"base_url": URL, "tiers": ["fast"]}},
        "routing": {"default": "auto"},
    }
    assert parse_config(data, environ={}).default_route == (AUTO,)


def test_a_misspelt_default_route_is_still_refused() -> None:
    data = {"models": {"a": {"base_url": URL}}, "routing": {"default": "fsat"}}
    with pytest.raises(ConfigError, match="fsat"):
        parse_config(data, environ={})


def test_an_empty_route_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        policy(model("a"), routes={"x": ()})
    with pytest.raises(ConfigError):
        policy(model("a"), default_route=())
    with pytest.raises(ConfigError):
        parse_config({"models": {"a": {"base_url": URL}}, "routing": {"default": []}}, environ={})


# -- settings of the wrong type -------------------------------------------------------------


def test_a_plain_string_api_key_never_appears_in_a_repr() -> None:
    """Invariant 9. ``api_key: Secret | None`` is not checked, so a caller passing the
    key as a string gets it printed in every repr of the settings and of SystemConfig
    (and the HTTP layer later fails on ``str.reveal``)."""
    key = "sk-live-abcdef0123456789"
    refused: ConfigError | None = None
    try:
        settings_ = ModelSettings(name="a", base_url=URL, api_key=key)  # type: ignore[arg-type]
    except ConfigError as exc:  # refusing it is fine, as long as the error hides it
        refused = exc
    if refused is not None:
        assert key not in str(refused)
        return
    assert key not in repr(settings_)
    assert key not in repr(SystemConfig(models=(settings_,)))
    assert isinstance(settings_.api_key, Secret)


def test_a_secret_api_key_never_appears_in_a_repr() -> None:
    key = "sk-live-abcdef0123456789"
    s = ModelSettings(name="a", base_url=URL, api_key=Secret(key))
    assert key not in repr(s)
    assert key not in repr(SystemConfig(models=(s,)))


def test_capabilities_given_as_a_list_are_refused_or_work() -> None:
    try:
        m = ModelSettings(name="a", base_url=URL, capabilities=["vision"])  # type: ignore[arg-type]
    except ConfigError:
        return
    plan = policy(m).plan(req(metadata={"capabilities": ["vision"]}), 10)
    assert plan.candidates == ("a",)


def test_tiers_given_as_a_string_are_refused_or_work() -> None:
    try:
        m = ModelSettings(name="a", base_url=URL, tiers="fast")  # type: ignore[arg-type]
    except ConfigError:
        return
    p = policy(m)
    assert "fast" in p.routes
    assert "f" not in p.routes


@pytest.mark.parametrize("amount", ["NaN", "sNaN", "Infinity"])
def test_budget_settings_refuse_non_finite_amounts(amount: str) -> None:
    """A NaN escapes as ``decimal.InvalidOperation`` (not ``ConfigError``); an infinite
    total is accepted and ``System()`` then dies in ``usd_to_nusd`` with OverflowError."""
    with pytest.raises(ConfigError):
        BudgetSettings(total_usd=Decimal(amount))
    with pytest.raises(ConfigError):
        BudgetSettings(per_tag_usd={"team": Decimal(amount)})


def test_toml_budget_refuses_non_finite_amounts() -> None:
    for amount in ("nan", "inf", float("inf")):
        with pytest.raises(ConfigError, match="finite"):
            parse_config(
                {"models": {"a": {"base_url": URL}}, "budget": {"total_usd": amount}},
                environ={},
            )


def test_system_config_checks_order_and_escalate_to() -> None:
    """SystemConfig checks fallbacks and route members eagerly with ConfigError, and the
    TOML loader checks both of these; the Python face does not."""
    m = model("a")
    with pytest.raises(ConfigError):
        SystemConfig(models=(m,), order="fastest")
    with pytest.raises(ConfigError):
        SystemConfig(models=(m,), escalate_to="nobody")


# -- pure policy properties that hold ---------------------------------------------------------

_NAMES = ("m0", "m1", "m2", "m3")


@st.composite
def policies(draw: st.DrawFn) -> tuple[RoutingPolicy, dict[str, ModelSettings]]:
    models = {}
    for name in _NAMES:
        others = st.sampled_from([n for n in _NAMES if n != name])
        models[name] = model(
            name,
            usd_in=str(draw(st.integers(0, 5))),
            usd_out=str(draw(st.integers(0, 5))),
            context_window=draw(st.sampled_from([1_000, 8_000, 100_000])),
            limiter=LimiterConfig(rpm=None, tpm=draw(st.sampled_from([None, 2_000, 60_000]))),
            capabilities=frozenset(draw(st.sets(st.sampled_from(["vision", "json"])))),
            tiers=tuple(draw(st.sets(st.sampled_from(["fast", "accurate"])))),
            fallbacks=tuple(draw(st.lists(others, unique=True, max_size=2))),
        )
    p = policy(*models.values(), escalate_to=draw(st.none() | st.sampled_from(_NAMES)))
    return p, models


@settings(max_examples=200, deadline=None)
@given(
    config=policies(),
    target=st.sampled_from(["m0", "m2", "fast", "accurate"]),
    prompt_tokens=st.sampled_from([10, 1_500, 5_000, 50_000, 500_000]),
    caps=st.sets(st.sampled_from(["vision", "json"])),
    order=st.sampled_from([Order.COST, Order.CHEAPEST]),
)
def test_no_route_only_when_nothing_fits_and_cost_order_is_cheapest_first(
    *,
    config: tuple[RoutingPolicy, dict[str, ModelSettings]],
    target: str,
    prompt_tokens: int,
    caps: set[str],
    order: Order,
) -> None:
    p, models = config
    need = prompt_tokens + 100
    fields: dict[str, Any] = {}
    if target.startswith("m"):
        fields["model"] = target
        wanted: tuple[str, ...] = (target,)
    elif target in p.routes:
        fields["route"] = target
        wanted = p.routes[target]
    else:
        return
    chain = [fb for w in wanted for fb in models[w].fallbacks]
    if p._escalate is not None:
        chain.append(p._escalate)
    considered = {*wanted, *chain}

    def fits(m: str) -> bool:
        s = models[m]
        tpm = s.limiter.tpm
        return s.context_window >= need and (tpm is None or tpm >= need) and caps <= s.capabilities

    request = req(max_tokens=100, **fields)
    if not any(fits(m) for m in considered):
        capable = [m for m in considered if caps <= models[m].capabilities]
        expected: type[NoRoute] = ContextTooLarge
        if not capable:
            expected = MissingCapability
        elif any(models[m].context_window >= need for m in capable):
            expected = AboveTokenLimit
        with pytest.raises(expected):
            p.plan(request, prompt_tokens, capabilities=caps, order=order)
        return
    plan = p.plan(request, prompt_tokens, capabilities=caps, order=order)
    qualifying_wanted = [m for m in wanted if fits(m)]
    if qualifying_wanted:
        costs = [p.estimate_nusd(m, prompt_tokens, 100) for m in qualifying_wanted]
        first = p.estimate_nusd(plan.candidates[0], prompt_tokens, 100)
        assert first == min(costs)
        if order is Order.CHEAPEST:
            assert len(plan.candidates) == 1


@settings(max_examples=300, deadline=None)
@given(
    price=st.tuples(st.decimals(0, 1000, places=4), st.decimals(0, 1000, places=4), st.none()),
    cached=st.none() | st.decimals(0, 1000, places=4),
    prompt=st.integers(0, 2_000_000),
    completion=st.integers(0, 100_000),
    cached_tokens=st.integers(0, 2_000_000),
    max_tokens=st.integers(0, 100_000),
)
def test_cost_never_exceeds_the_reservation(
    *,
    price: tuple[Decimal, Decimal, None],
    cached: Decimal | None,
    prompt: int,
    completion: int,
    cached_tokens: int,
    max_tokens: int,
) -> None:
    p = Price(price[0], price[1], cached)
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached_tokens)
    cost = cost_nusd(p, usage)
    assert cost >= 0
    if completion <= max_tokens:
        assert cost <= estimate_nusd(p, prompt, max_tokens)


# -- the classifier ---------------------------------------------------------------------------


def test_the_heuristic_classifier_is_fast_on_blank_lines() -> None:
    """The docstring promises microseconds per call on the router's thread; ``_LIST_ITEM``
    and ``_CODE_LINE`` start with ``^\\s*`` under MULTILINE, and ``\\s`` eats newlines, so
    every line start rescans the rest of the blank run: 6,000 newlines take ~0.6 s,
    20,000 (within ``scan_chars``) ~7.5 s, during which no task is routed."""
    request = req("x" + "\n" * 6_000 + "x", route=AUTO)
    started = time.perf_counter()
    HeuristicClassifier()(request, 2_010)
    assert time.perf_counter() - started < 0.2


def test_a_classifier_returning_garbage_routes_as_medium() -> None:
    """routing.py: "a classifier failure never loses a task"; only raising is caught,
    and ``label in self._routes`` then raises for a list or dict label."""
    p = policy(model("a", tiers=("fast",)), classifier=lambda request, tokens: ["fast"])
    assert p.plan(req(route=AUTO), 10).candidates == ("a",)


def test_a_classifier_that_raises_routes_as_medium() -> None:
    def broken(request: Request, tokens: int) -> str:
        raise RuntimeError("down")

    p = policy(model("a", tiers=("balanced",)), model("b", tiers=("fast",)), classifier=broken)
    plan = p.plan(req(route=AUTO), 10)
    assert plan.candidates == ("a",)
    assert "classifier failed: RuntimeError" in plan.reason


def test_a_plan_that_raises_ends_its_task_instead_of_wedging_the_router(
    provider: SimulatedProvider,
) -> None:
    """router.py caught only ``NoRoute``; any other exception crashed the router, and
    every restarted incarnation re-routed the ledger's accepted tasks in ``setup`` and
    crashed there again (setup crashes are not counted as poison). Found with a
    classifier returning a list (now routed as MEDIUM); here the plan itself raises."""
    alpha, beta = (
        ModelSettings(name=n, base_url=provider.base_url, tiers=("fast",))
        for n in ("alpha", "beta")
    )
    with System(SystemConfig(models=(alpha, beta))) as system:
        policy_ = system.policy
        real_plan = policy_.plan
        needle = "sk-live-never-shown"

        def plan(request: Request, *args: Any, **kw: Any) -> Any:
            if request.route == AUTO:
                raise RuntimeError(needle)
            return real_plan(request, *args, **kw)

        policy_.plan = plan  # type: ignore[method-assign]
        try:
            bad = system.submit("hello", route=AUTO)
            good = system.submit("hello", model="beta")
            failed = bad.result(3.0)
            assert isinstance(failed, Failed), failed
            assert failed.reason is FailureReason.INTERNAL
            assert "RuntimeError" in failed.detail
            assert needle not in repr(failed)
            assert isinstance(good.result(3.0), Completed)
        finally:
            del policy_.plan  # type: ignore[method-assign]


# -- end to end: capabilities and context on the fallback path --------------------------------


def test_a_fallback_without_the_capability_is_never_used(provider: SimulatedProvider) -> None:
    """alpha (vision) falls back to beta (no vision): a vision task names only alpha."""
    alpha = ModelSettings(
        name="alpha",
        base_url=provider.base_url,
        capabilities=frozenset({"vision"}),
        fallbacks=("beta",),
        context_window=4_000,
    )
    beta = ModelSettings(name="beta", base_url=provider.base_url, context_window=100_000)
    with System(SystemConfig(models=(alpha, beta))) as system:
        plan = system.policy.plan(req(model="alpha", metadata={"capabilities": ["vision"]}), 10)
        assert (plan.candidates, plan.fallbacks) == (("alpha",), ())
        big = system.submit("x" * 20_000, model="alpha").result(WAIT_S)  # too big for alpha
        vision = system.submit("look", model="alpha", metadata={"capabilities": "vision"})
        assert isinstance(big, Completed), big
        assert big.model == "beta"
        done = vision.result(WAIT_S)
        assert isinstance(done, Completed), done
        assert done.model == "alpha"


# -- smaller checks found on the way ---------------------------------------------------------


@pytest.mark.parametrize("field", ["max_concurrency", "context_window"])
def test_a_bool_is_no_count(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelSettings(name="a", base_url=URL, **{field: True})


@pytest.mark.parametrize("step", ["10", float("inf"), float("nan"), True, 0])
def test_aging_step_must_be_a_positive_finite_number(step: Any) -> None:
    with pytest.raises(ConfigError, match="aging_step_s"):
        SchedulerSettings(aging_step_s=step)


def test_a_bool_capacity_is_refused() -> None:
    with pytest.raises(ConfigError, match="capacity"):
        SchedulerSettings(capacity=True)


def test_an_unsendable_plain_key_is_refused_unseen() -> None:
    key = "sk-live-abcdef0123456789"
    for bad in (key + "\n", key[:5] + " " + key[5:], ""):
        with pytest.raises(ConfigError) as info:
            ModelSettings(name="a", base_url=URL, api_key=Secret(bad))
        assert key[:8] not in str(info.value)
    with pytest.raises(ConfigError, match="api_key"):
        ModelSettings(name="a", base_url=URL, api_key=b"sk-bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "pasted", ["gsk_AbCdEf0123456789xyz", "ghp_abcdefABCDEF0123", "AKIAABCDEFGHIJKLMNOP"]
)
def test_a_key_pasted_as_api_key_env_is_not_echoed(pasted: str) -> None:
    """Such keys are valid variable names; the error must not print them."""
    with pytest.raises(ConfigError, match=r"models\.a\.api_key_env") as info:
        parse_config({"models": {"a": {"base_url": URL, "api_key_env": pasted}}}, environ={})
    assert pasted not in str(info.value)


def test_a_classifier_answering_no_label_says_so_in_the_reason() -> None:
    p = policy(model("a", tiers=("balanced",)), classifier=lambda request, tokens: None)  # type: ignore[arg-type,return-value]
    plan = p.plan(req(route=AUTO), 10)
    assert plan.candidates == ("a",)
    assert "classifier answered a NoneType" in plan.reason


def test_system_config_default_route_forms() -> None:
    m = model("a", tiers=("fast",))
    assert SystemConfig(models=(m,), default_route="fast").default_route == ("fast",)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lists no model"):
        SystemConfig(models=(m,), routes={"x": ()})
    with pytest.raises(ConfigError, match="model names"):
        SystemConfig(models=(m,), routes={"x": "a"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="'ghost'"):
        SystemConfig(models=(m,), default_route=("a", "ghost"))
