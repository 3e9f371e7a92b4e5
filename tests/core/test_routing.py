"""The routing policy and the complexity classifier: pure, synchronous, no clock.

A plan never names a model twice, refuses empty routes, routes a failing or odd
classifier as MEDIUM, keeps a model that lacks a needed capability out (one test
checks that end to end, on the simulated provider), and raises ``NoRoute``
only when nothing fits."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
from callboard.core.complexity import EASY, HARD, MEDIUM, HeuristicClassifier
from callboard.core.health import LATENCY_HALF_LIFE_S
from callboard.core.limiter import LimiterConfig
from callboard.core.pricing import Price
from callboard.core.routing import (
    AUTO,
    AboveTokenLimit,
    CannotCarry,
    ContextTooLarge,
    MissingCapability,
    NoRoute,
    NotAllowed,
    Order,
    Plan,
    RoutingPolicy,
)
from callboard.core.settings import ModelSettings
from callboard.core.tokens import estimate_prompt_tokens
from callboard.messages import (
    BreakerState,
    ChatMessage,
    ConfigError,
    Health,
    InvalidRequestError,
    Request,
    UnknownModelError,
)
from callboard.provider.server import SimulatedProvider
from hypothesis import event, given, settings
from hypothesis import strategies as st
from support import WAIT_S

from callboard import Completed, System, SystemConfig
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


def health(name: str, state: BreakerState = BreakerState.CLOSED, **kw: Any) -> Health:
    return Health(model=name, breaker=state, **kw)


@pytest.fixture
def tiered() -> RoutingPolicy:
    """fast/cheap: f1 (cheapest), f2; balanced: b; accurate: a; reasoning: r."""
    return policy(
        model("f1", usd_in="0.1", usd_out="0.4", tiers=("fast", "cheap"), fallbacks=("b",)),
        model("f2", usd_in="0.2", usd_out="0.8", tiers=("fast", "cheap"), fallbacks=("b",)),
        model("b", usd_in="1", usd_out="4", tiers=("balanced",), fallbacks=("a",)),
        model("a", usd_in="3", usd_out="12", tiers=("accurate",), fallbacks=("b",)),
        model("r", usd_in="10", usd_out="40", tiers=("reasoning",), fallbacks=("a",)),
    )


# -- explicit model, tiers, routes, default -------------------------------------


def test_explicit_model_with_its_fallbacks(tiered: RoutingPolicy) -> None:
    plan = tiered.plan(req(model="r"), 10)
    assert plan == Plan(("r",), ("a",), plan.reason)
    assert plan.reason == "model=r: [r] fallbacks [a]"


def test_models_allowed_drops_candidates_and_fallbacks_outside_it(tiered: RoutingPolicy) -> None:
    plan = tiered.plan(req(model="r", models_allowed={"r"}), 10)
    assert plan == Plan(("r",), (), plan.reason)
    fast = tiered.plan(req(route="fast", models_allowed=frozenset({"f2", "b"})), 10)
    assert (fast.candidates, fast.fallbacks) == (("f2",), ("b",))
    assert "f1 not allowed" in fast.reason
    promoted = tiered.plan(req(model="r", models_allowed={"a"}), 10)
    assert (promoted.candidates, promoted.fallbacks) == (("a",), ())
    easy = tiered.plan(req("hi", route=AUTO, models_allowed={"b"}), 9)
    assert easy.candidates == ("b",)  # auto skips a tier none of whose models may serve
    with pytest.raises(NotAllowed, match=r"model=r: no model .* allowed .*\(allowed: f1\)"):
        tiered.plan(req(model="r", models_allowed={"f1"}), 10)


def test_models_allowed_must_name_models() -> None:
    for bad in ("r", [""], [1], {"r": 1}):
        with pytest.raises(InvalidRequestError, match="models_allowed"):
            req(models_allowed=bad)
    assert req(models_allowed=["a", "a"]).models_allowed == frozenset({"a"})


def test_unknown_model_or_route_is_a_usage_error(tiered: RoutingPolicy) -> None:
    with pytest.raises(UnknownModelError, match="unknown model 'zz'"):
        tiered.check(req(model="zz"))
    with pytest.raises(UnknownModelError, match=r"unknown route 'zz'.*auto"):
        tiered.plan(req(route="zz"), 10)


def test_a_tier_is_a_group_every_member_is_a_candidate(tiered: RoutingPolicy) -> None:
    plan = tiered.plan(req(route="fast"), 10)
    assert plan.candidates == ("f1", "f2")
    assert plan.fallbacks == ("b",)  # shared fallback listed once
    assert tiered.routes["fast"] == ("f1", "f2")


def test_explicit_routes_override_tiers() -> None:
    p = policy(model("x", tiers=("fast",)), model("y"), routes={"fast": ("y",), "mine": ("x", "y")})
    assert p.plan(req(route="fast"), 10).candidates == ("y",)
    assert p.plan(req(route="mine"), 10, order=Order.CONFIG).candidates == ("x", "y")


def test_default_route_forms(tiered: RoutingPolicy) -> None:
    assert tiered.plan(req(), 10).candidates == ("f1",)  # the first model
    ms = [model("x", tiers=("t",)), model("y", tiers=("t",))]
    assert policy(*ms, default_route=("y",)).plan(req(), 10).candidates == ("y",)
    by_name = policy(*ms, default_route="t").plan(req(), 10)
    assert by_name.candidates == ("x", "y")
    assert by_name.reason.startswith("default route=t:")
    with pytest.raises(UnknownModelError):
        policy(*ms, default_route=("nope",))
    with pytest.raises(UnknownModelError):
        policy(*ms, default_route="nope")


def test_route_names_are_checked_at_construction() -> None:
    with pytest.raises(UnknownModelError, match="route 'r' names unknown model 'q'"):
        policy(model("x"), routes={"r": ("q",)})
    with pytest.raises(ConfigError, match="reserved"):
        policy(model("x", tiers=(AUTO,)))
    with pytest.raises(ValueError, match="at least one model"):
        RoutingPolicy({})


def test_a_route_naming_a_model_twice_plans_it_once() -> None:
    """A route, a default route or a model's tiers that name a model twice plan it once:
    no model appears twice in a plan."""
    p = policy(
        model("a", tiers=("fast", "fast")),
        model("b"),
        routes={"x": ("a", "a", "b")},
        default_route=("b", "b"),
    )
    for request in (req(route="fast"), req(route="x"), req()):
        plan = p.plan(request, 10)
        names = [*plan.candidates, *plan.fallbacks]
        assert len(names) == len(set(names)), names


def test_an_empty_route_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        policy(model("a"), routes={"x": ()})
    with pytest.raises(ConfigError):
        policy(model("a"), default_route=())
    with pytest.raises(ConfigError):
        parse_config({"models": {"a": {"base_url": URL}}, "routing": {"default": []}}, environ={})


# -- the heuristic classifier ------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "label"),
    [
        ("hi!", EASY),
        ("Hello, how are you doing today? I hope all is well with you and yours.", EASY),
        ("What is the capital of France?", EASY),
        ("Prove that the square root of 2 is irrational.", HARD),
        ("Explain this step by step: how does TCP slow start work", HARD),
        ("Why is this slow?\n```python\nfor i in range(n): x += i\n```", HARD),
        ("def f(x):\n    return x + 1\nwhat does it do", HARD),
        ("What is X? And how does it relate to Y? Give an example.", HARD),
        ("Please do:\n1. list the planets\n2. sort them by size", HARD),
        (
            (
                "Write a short, friendly note to my neighbour telling them the parcel they "
                "ordered was delivered to my house by mistake and they can pick it up tonight."
            ),
            MEDIUM,
        ),
    ],
)
def test_heuristic_labels(prompt: str, label: str) -> None:
    r = req(prompt)
    assert HeuristicClassifier()(r, estimate_prompt_tokens(r.messages)) == label


def test_heuristic_size_signals_and_last_user_turn() -> None:
    c = HeuristicClassifier()
    assert c(req("summarise"), 5_000) == HARD
    assert c(req("summarise", max_tokens=8_000), 5) == HARD
    chat = [
        ChatMessage(role="system", content="Analyze everything rigorously, step by step."),
        ChatMessage(role="user", content="hey"),
    ]
    assert c(Request.of(chat), 20) == EASY  # the system prompt's words are not the question


# -- route="auto" ---------------------------------------------------------------------


def test_auto_maps_difficulty_to_tiers(tiered: RoutingPolicy) -> None:
    easy = tiered.plan(req("hi", route=AUTO), 9)
    assert easy.candidates == ("f1", "f2")
    assert easy.reason.startswith("route=auto classified easy -> fast:")
    hard = tiered.plan(req("Prove Fermat's little theorem.", route=AUTO), 15)
    assert hard.candidates == ("a",)
    assert hard.reason == "route=auto classified hard -> accurate: [a] fallbacks [b]"
    medium = tiered.plan(req("x" * 400, route=AUTO), 110)
    assert medium.candidates == ("b",)


def test_auto_falls_back_to_the_tiers_that_exist() -> None:
    p = policy(model("f", tiers=("fast",)), model("a", tiers=("accurate",)), default_route=AUTO)
    assert p.plan(req("x" * 400), 110).candidates == ("a",)  # medium: no balanced
    assert p.plan(req("prove it"), 9).reason.startswith("default=auto classified hard -> accurate")
    bare = policy(model("m1"), model("m2"), default_route=(AUTO,))
    plan = bare.plan(req("hi"), 9, order=Order.CONFIG)
    assert plan.candidates == ("m1", "m2")
    assert "no tier" in plan.reason


def test_auto_skips_a_tier_that_cannot_meet_the_constraints(tiered: RoutingPolicy) -> None:
    p = policy(
        model("f", tiers=("fast",)),
        model("b", tiers=("balanced",), capabilities=frozenset({"vision"})),
    )
    plan = p.plan(req("hi", route=AUTO, metadata={"capabilities": ["vision"]}), 9)
    assert plan.candidates == ("b",)
    assert "classified easy -> balanced" in plan.reason


def test_a_pluggable_classifier() -> None:
    seen: list[int] = []

    def llm_judge(request: Request, prompt_tokens: int) -> str:
        seen.append(prompt_tokens)
        return str(request.metadata.get("judge", "nonsense"))

    p = policy(
        model("f", tiers=("fast",)),
        model("r", tiers=("reasoning",)),
        model("l"),
        routes={"legal": ("l",)},
        classifier=llm_judge,
    )
    assert p.plan(req(route=AUTO, metadata={"judge": "reasoning"}), 42).candidates == ("r",)
    assert p.plan(req(route=AUTO, metadata={"judge": "legal"}), 42).candidates == ("l",)
    assert p.plan(req(route=AUTO, metadata={"judge": HARD}), 42).candidates == ("r",)
    # an unknown label is routed as medium: balanced, accurate, then fast
    assert p.plan(req(route=AUTO), 42).candidates == ("f",)
    assert seen == [42, 42, 42, 42]


def test_only_a_policy_running_no_hosts_code_plans_on_any_thread() -> None:
    """The front door plans on the submitting thread only with the built-in classifier
    (a host's may be slow, or keep state for one thread)."""
    models = {"m": ModelSettings(name="m", base_url="http://127.0.0.1:9/v1")}
    assert RoutingPolicy(models).plans_anywhere
    assert not RoutingPolicy(models, classifier=lambda r, n: MEDIUM).plans_anywhere


def test_a_failing_classifier_degrades_to_medium() -> None:
    def broken(request: Request, prompt_tokens: int) -> str:
        raise RuntimeError("judge is down")

    p = policy(model("f", tiers=("fast",)), model("b", tiers=("balanced",)), classifier=broken)
    plan = p.plan(req(route=AUTO), 9)
    assert plan.candidates == ("b",)
    assert "classifier failed: RuntimeError" in plan.reason


def test_a_classifier_returning_garbage_routes_as_medium() -> None:
    """A classifier failure never loses a task: a label that is not a string (a list,
    which cannot name a route) routes as MEDIUM, as a classifier that raises does."""
    p = policy(model("a", tiers=("fast",)), classifier=lambda request, tokens: ["fast"])
    assert p.plan(req(route=AUTO), 10).candidates == ("a",)


def test_a_classifier_answering_no_label_says_so_in_the_reason() -> None:
    p = policy(model("a", tiers=("balanced",)), classifier=lambda request, tokens: None)  # type: ignore[arg-type,return-value]
    plan = p.plan(req(route=AUTO), 10)
    assert plan.candidates == ("a",)
    assert "classifier answered a NoneType" in plan.reason


# -- capabilities ------------------------------------------------------------------------


@pytest.fixture
def capable() -> RoutingPolicy:
    return policy(
        model("plain", tiers=("t",), fallbacks=("eyes",)),
        model("eyes", tiers=("t",), capabilities=frozenset({"vision", "json"})),
        model("tools", tiers=("t",), capabilities=frozenset({"tools", "json"})),
        order=Order.CONFIG,
    )


def test_capabilities_filter_candidates_and_fallbacks(capable: RoutingPolicy) -> None:
    assert capable.plan(req(route="t", metadata={"capabilities": ["json"]}), 9).candidates == (
        "eyes",
        "tools",
    )
    plan = capable.plan(req(route="t"), 9, capabilities=("vision",))
    assert plan.candidates == ("eyes",)
    assert "plain lacks vision" in plan.reason
    assert capable.plan(req(route="t", metadata={"capabilities": "tools"}), 9).fallbacks == ()


def test_explicit_model_without_the_capability_promotes_a_fallback(
    capable: RoutingPolicy,
) -> None:
    plan = capable.plan(req(model="plain"), 9, capabilities=["vision"])
    assert plan.candidates == ("eyes",)
    assert "promoted fallback eyes" in plan.reason


def test_missing_capability_is_a_typed_no_route(capable: RoutingPolicy) -> None:
    with pytest.raises(MissingCapability, match="audio") as info:
        capable.plan(req(route="t"), 9, capabilities=["audio", "json"])
    assert info.value.missing == frozenset({"audio"})
    assert info.value.required == frozenset({"audio", "json"})
    with pytest.raises(MissingCapability) as split:  # each exists, no model has both
        capable.plan(req(route="t"), 9, capabilities=["vision", "tools"])
    assert split.value.missing == frozenset()
    assert isinstance(split.value, NoRoute)


IMAGE = {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}
TOOL = {"type": "function", "function": {"name": "f"}}


def test_a_request_routes_by_what_it_carries_once_models_declare_capabilities() -> None:
    routing = policy(
        model("cheap", tiers=("t",), capabilities=["tools"]),
        model("eyes", tiers=("t",), capabilities=["vision"]),
    )
    look = Request.of([{"role": "user", "content": [IMAGE]}], route="t")
    assert routing.plan(look, 9).candidates == ("eyes",)
    assert routing.plan(req(tools=[TOOL], route="t"), 9).candidates == ("cheap",)
    with pytest.raises(MissingCapability, match="json") as info:
        routing.plan(req(response_format={"type": "json_object"}, route="t"), 9)
    assert info.value.missing == frozenset({"json"})


def test_texts_to_embed_never_fall_back_to_another_models_vectors() -> None:
    routing = policy(model("a", fallbacks=("b",)), model("b"))
    embed = Request(messages=(), input=("x",), model="a", max_tokens=1)
    assert routing.plan(embed, 9).fallbacks == ()
    assert routing.plan(req(model="a"), 9).fallbacks == ("b",)


def test_with_no_capabilities_declared_anywhere_nothing_is_refused() -> None:
    routing = policy(model("a"), model("b"))
    assert routing.plan(req(tools=[TOOL]), 9).candidates


def test_malformed_capabilities_are_an_invalid_request(capable: RoutingPolicy) -> None:
    with pytest.raises(InvalidRequestError, match="capabilities"):
        capable.check(req(metadata={"capabilities": [1, 2]}))
    with pytest.raises(InvalidRequestError):
        capable.check(req(metadata={"capabilities": {"vision": True}}))


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


# -- order: cost, cheapest, latency, least busy ------------------------------------------


@pytest.fixture
def group() -> RoutingPolicy:
    """Three deployments of one group, in config order dear, cheap, mid."""
    return policy(
        model("dear", usd_in="5", usd_out="20", tiers=("g", "cheap"), max_concurrency=10),
        model("cheap1", usd_in="0.1", usd_out="0.2", tiers=("g", "cheap"), max_concurrency=4),
        model("mid", usd_in="1", usd_out="2", tiers=("g", "cheap"), max_concurrency=100),
        model("other"),
    )


def test_cost_order_ranks_a_model_by_its_own_price_not_its_dearest_tier() -> None:
    """A model with a dear priority tier was ranked by it, behind a model twice its
    standard price (found by a review)."""
    tiered = Price(Decimal(1), Decimal(4), service_tiers={"priority": Price("2.5", 10)})
    a = ModelSettings(name="a", base_url=URL, price=tiered, tiers=("g",))
    b = model("b", usd_in="2", usd_out="8", tiers=("g",))
    assert policy(a, b).plan(req(route="g"), 100).candidates == ("a", "b")


def test_cost_order_ranks_an_anthropic_model_by_its_input_price_not_its_cache_writes() -> None:
    """Anthropic's 1-hour cache writes cost twice its input (the dialect's default):
    ranked by them, a $1 / $5 model went behind a $1.5 / $5 one for a 10,000-token
    prompt, at 50% more (found by a hunt)."""
    claude = ModelSettings(
        name="claude", base_url=URL, api="anthropic", price=Price(1, 5), tiers=("g",)
    )
    gpt = model("gpt", usd_in="1.5", usd_out="5", tiers=("g",))
    p = policy(gpt, claude)
    assert p.plan(req(route="g"), 10_000).candidates == ("claude", "gpt")
    assert p.list_nusd("claude", 10_000, 10) == 10_050_000  # $0.01005


def test_a_model_whose_dialect_cannot_carry_the_request_is_left_out_of_its_plan() -> None:
    """Anthropic's Messages API has no ``n`` > 1: left in the plan as a fallback, it ended
    the task when the first model failed, its refusal (a request error, a 400 at the
    gateway) hiding the first model's own error (found by a hunt)."""
    gpt = model("gpt", fallbacks=("claude",), tiers=("g",))
    claude = ModelSettings(name="claude", base_url=URL, api="anthropic", tiers=("g",))
    p = policy(gpt, claude)
    plan = p.plan(req(model="gpt", n=2), 10)
    assert (plan.candidates, plan.fallbacks) == (("gpt",), ())
    assert p.plan(req(model="gpt"), 10).fallbacks == ("claude",)  # a plain one goes there
    routed = p.plan(req(route="g", n=2, models_allowed=frozenset({"claude", "gpt"})), 10)
    assert routed.candidates == ("gpt",)
    assert "claude cannot carry it (n: " in routed.reason
    with pytest.raises(CannotCarry, match="no model can carry this request") as refused:
        p.plan(req(model="claude", n=2), 10)
    assert set(refused.value.refusals) == {"claude"}


def test_cost_order_is_the_default(group: RoutingPolicy) -> None:
    plan = group.plan(req(route="g"), 100)
    assert plan.candidates == ("cheap1", "mid", "dear")
    assert "order=cost" in plan.reason
    assert group.plan(req(route="g"), 100, order="config").candidates == ("dear", "cheap1", "mid")


def test_cost_weighs_prompt_and_answer_sizes() -> None:
    p = policy(
        model("cheap_in", usd_in="0.1", usd_out="10", tiers=("g",)),
        model("cheap_out", usd_in="10", usd_out="0.1", tiers=("g",)),
    )
    assert p.plan(req(route="g", max_tokens=10), 10_000).candidates[0] == "cheap_in"
    assert p.plan(req(route="g", max_tokens=10_000), 10).candidates[0] == "cheap_out"


def test_cheap_route_takes_only_the_cheapest(group: RoutingPolicy) -> None:
    plan = group.plan(req(route="cheap"), 100)
    assert plan.candidates == ("cheap1",)
    assert plan.fallbacks == ("mid", "dear")
    assert group.plan(req(route="g"), 100, order=Order.CHEAPEST).candidates == ("cheap1",)
    always = policy(
        model("a", usd_in="2", tiers=("g",)), model("b", tiers=("g",)), order="cheapest"
    )
    assert always.plan(req(route="g"), 10).candidates == ("b",)


def test_latency_order_from_observed_health(group: RoutingPolicy) -> None:
    group.observe(health("dear", latency_ewma_s=0.2))
    group.observe(health("cheap1", latency_ewma_s=0.9))
    plan = group.plan(req(route="g"), 10, order=Order.LATENCY)
    assert plan.candidates == ("mid", "dear", "cheap1")  # mid unmeasured: tried first
    group.observe(health("mid", latency_ewma_s=0.5))
    assert group.plan(req(route="g"), 10, order="latency").candidates == ("dear", "mid", "cheap1")


def test_least_busy_order_is_relative_to_capacity(group: RoutingPolicy) -> None:
    group.observe(health("dear", in_flight=5))  # 5/10
    group.observe(health("cheap1", in_flight=1))  # 1/4
    group.observe(health("mid", in_flight=40))  # 40/100
    plan = group.plan(req(route="g"), 10, order=Order.LEAST_BUSY)
    assert plan.candidates == ("cheap1", "mid", "dear")
    group.observe(health("ghost", in_flight=3))  # an unknown model is ignored
    assert group.health.in_flight("ghost", 0.0) == 0


def clocked(now: list[float], order: str, *names: str) -> RoutingPolicy:
    """A policy over models ``names`` of route "g", in ``order``, whose clock reads
    ``now[0]``."""
    return policy(*(model(n, tiers=("g",)) for n in names), order=order, clock=lambda: now[0])


def test_a_model_ranked_slow_once_is_tried_again_as_its_latency_fades() -> None:
    """``order = "latency"``: "a" had a slow spell, "b" took its work, and "a" never got
    a task again (none answered, so its average stayed at its worst; found by a hunt).
    Faded by half every ``LATENCY_HALF_LIFE_S``, it is tried once it would beat "b"."""
    now = [0.0]
    p = clocked(now, "latency", "a", "b")
    p.observe(health("a", latency_ewma_s=0.8))
    for t in range(31):  # "b" answers on, its average moving a little each report
        now[0] = float(t)
        p.observe(health("b", latency_ewma_s=0.08 + t * 1e-4))
        first = p.plan(req(route="g"), 10).candidates[0]
        if 0.8 * 0.5 ** (t / LATENCY_HALF_LIFE_S) > 0.08 + t * 1e-4:
            assert first == "b", t
        else:
            assert first == "a", t  # faded below "b": measured again
            break
    else:
        pytest.fail("'a' was never tried again")
    p.observe(health("a", latency_ewma_s=0.72))  # its quick answers pull its average down
    assert p.plan(req(route="g"), 10).candidates[0] == "a"  # a falling one fades on: first
    now[0] += 1.0
    p.observe(health("a", latency_ewma_s=0.9))  # slow again: that counts from now
    assert p.plan(req(route="g"), 10).candidates[0] == "b"


def test_least_busy_counts_what_it_planned_since_each_report() -> None:
    """``order = "least_busy"``: every task of a second went to the model that last said
    it was idle, then every task of the next to the other (reports come at most once a
    second; found by a hunt). The tasks planned since a report count as its load."""
    now = [0.0]
    p = clocked(now, "least_busy", "slow", "fast")
    p.observe(health("slow", in_flight=0))
    p.observe(health("fast", in_flight=0))
    firsts = Counter(p.plan(req(route="g"), 10).candidates[0] for _ in range(30))
    assert firsts == {"slow": 15, "fast": 15}  # spread, not 30 on one
    p.observe(health("slow", in_flight=15, latency_ewma_s=1.0))  # it holds them all
    p.observe(health("fast", in_flight=0, latency_ewma_s=0.02))  # it answered them all
    firsts = Counter()
    for i in range(30):  # 30 a second: each task planned to "fast" answered before the next
        now[0] = i / 30
        firsts[p.plan(req(route="g"), 10).candidates[0]] += 1
    assert firsts == {"fast": 30}


# -- breakers ----------------------------------------------------------------------------


@pytest.mark.parametrize("state", [BreakerState.OPEN, BreakerState.HALF_OPEN])
def test_a_plan_is_where_the_task_wants_to_go_whatever_the_breakers_say(
    group: RoutingPolicy, state: BreakerState
) -> None:
    # Where it may go while a model is down is the queue's (``fallback.place``): a plan
    # that dropped or demoted the model would never give it its work back.
    before = group.plan(req(route="g"), 10)
    group.observe(health("cheap1", state, reopen_at=50.0))
    after = group.plan(req(route="g"), 10)
    assert (after.candidates, after.fallbacks) == (before.candidates, before.fallbacks)
    assert after.candidates[0] == "cheap1"
    assert "open" not in after.reason


# -- context fit, fallbacks, escalation --------------------------------------------------


def test_context_fit_skips_small_models_and_names_the_sizes() -> None:
    p = policy(
        model("small", context_window=1_000, tiers=("t",), fallbacks=("big",)),
        model("mid", context_window=4_000, tiers=("t",)),
        model("big", context_window=100_000),
    )
    plan = p.plan(req(route="t", max_tokens=500), 1_000)
    assert plan.candidates == ("mid",)
    assert "small too small (1000 < 1500 tokens)" in plan.reason
    assert p.plan(req(route="t", max_tokens=500), 50_000).candidates == ("big",)
    with pytest.raises(ContextTooLarge, match=r"200500 tokens.*largest context: 4000") as info:
        p.plan(req(model="mid", max_tokens=500), 200_000)
    assert (info.value.need, info.value.largest) == (200_500, 4_000)


def test_a_call_above_a_models_tpm_limit_skips_it_for_one_that_admits_it() -> None:
    # the limiter refuses a call above tpm as TooLarge: no wait could admit it
    p = policy(
        model(
            "small", tiers=("t",), limiter=LimiterConfig(rpm=None, tpm=1_000), fallbacks=("big",)
        ),
        model("mid", tiers=("t",), limiter=LimiterConfig(rpm=60, tpm=5_000)),
        model("big"),
        order="config",
    )
    fits = p.plan(req(route="t", max_tokens=500), 500)  # exactly the limit: admitted
    assert (fits.candidates, fits.fallbacks) == (("small", "mid"), ("big",))
    plan = p.plan(req(route="t", max_tokens=500), 1_000)
    assert (plan.candidates, plan.fallbacks) == (("mid",), ("big",))
    assert "small admits 1000 tokens per minute (< 1500)" in plan.reason
    promoted = p.plan(req(model="small", max_tokens=4_000), 10)
    assert (promoted.candidates, promoted.fallbacks) == (("big",), ())


def test_a_call_above_every_tpm_limit_is_refused_typed_and_names_the_limit() -> None:
    p = policy(
        model("a", context_window=100_000, limiter=LimiterConfig(rpm=None, tpm=2_000)),
        model("b", context_window=1_000, tiers=("t",)),
        model("c", context_window=10_000, tiers=("t",), limiter=LimiterConfig(rpm=None, tpm=3_000)),
    )
    with pytest.raises(AboveTokenLimit, match=r"4010 tokens.*tokens per minute: 2000") as info:
        p.plan(req(model="a", max_tokens=4_000), 10)
    assert (info.value.need, info.value.largest) == (4_010, 2_000)
    # b's window is too small, c's window holds it but its limit is too low
    with pytest.raises(AboveTokenLimit, match=r"per minute: 3000"):
        p.plan(req(route="t", max_tokens=4_000), 10)
    # a window too small everywhere stays a context error, whatever the limits
    with pytest.raises(ContextTooLarge):
        p.plan(req(route="t", max_tokens=20_000), 10)


def test_n_choices_count_against_the_tokens_per_minute_not_the_context_window() -> None:
    """The limiter reserves max_tokens for each choice: a plan naming a model whose limit
    can never take the call failed later, at the model, in other words."""
    p = policy(model("a", context_window=10_000, limiter=LimiterConfig(rpm=None, tpm=2_000)))
    assert p.plan(req(model="a", max_tokens=1_900), 10).candidates == ("a",)
    with pytest.raises(AboveTokenLimit, match=r"7610 tokens .*max_tokens 1900 x 4\)") as info:
        p.plan(req(model="a", max_tokens=1_900, n=4), 10)
    assert info.value.need == 7_610
    roomy = policy(model("a", context_window=4_000))  # each choice fits the window
    assert roomy.plan(req(model="a", max_tokens=1_900, n=4), 10).candidates == ("a",)


def test_fallbacks_never_repeat_a_candidate_or_each_other() -> None:
    p = policy(
        model("a", tiers=("t",), fallbacks=("b", "c")),
        model("b", tiers=("t",), fallbacks=("c", "a")),
        model("c"),
        order="config",
    )
    plan = p.plan(req(route="t"), 10)
    assert (plan.candidates, plan.fallbacks) == (("a", "b"), ("c",))


def test_escalation_is_the_last_fallback_and_the_last_resort() -> None:
    p = policy(
        model("a", context_window=2_000, fallbacks=("b",)),
        model("b", context_window=2_000),
        model("boss", context_window=1_000_000),
        escalate_to="boss",
    )
    assert p.plan(req(model="a"), 10).fallbacks == ("b", "boss")
    assert p.plan(req(model="boss"), 10).fallbacks == ()
    huge = p.plan(req(model="a"), 10_000)
    assert (huge.candidates, huge.fallbacks) == (("boss",), ())
    with pytest.raises(UnknownModelError):
        policy(model("a"), escalate_to="nobody")


def test_reason_reads_as_one_line(tiered: RoutingPolicy) -> None:
    plan = tiered.plan(req(route="fast"), 10)
    assert plan.reason == "route=fast: [f1, f2] fallbacks [b] (order=cost)"


# -- what always holds ----------------------------------------------------------------------

_NAMES = ("m0", "m1", "m2", "m3", "m4")


@st.composite
def configs(draw: st.DrawFn) -> tuple[RoutingPolicy, dict[str, ModelSettings]]:
    models = {}
    for name in _NAMES:
        others = st.sampled_from([n for n in _NAMES if n != name])
        models[name] = model(
            name,
            usd_in=str(draw(st.integers(0, 5))),
            context_window=draw(st.sampled_from([1_000, 8_000, 100_000])),
            limiter=LimiterConfig(rpm=None, tpm=draw(st.sampled_from([None, 2_000, 60_000]))),
            capabilities=frozenset(draw(st.sets(st.sampled_from(["vision", "json"])))),
            tiers=tuple(draw(st.sets(st.sampled_from(["fast", "accurate"])))),
            fallbacks=tuple(draw(st.lists(others, unique=True, max_size=3))),
        )
    p = policy(
        *models.values(),
        escalate_to=draw(st.none() | st.sampled_from(_NAMES)),
        default_route=draw(st.sampled_from([None, AUTO])),
    )
    return p, models


@settings(max_examples=200, deadline=None)
@given(
    config=configs(),
    target=st.sampled_from([None, "m0", "m3", AUTO, "fast", "accurate"]),
    prompt_tokens=st.sampled_from([10, 5_000, 50_000, 500_000]),
    caps=st.sets(st.sampled_from(["vision", "json"])),
    order=st.sampled_from(list(Order)),
)
def test_a_plan_is_always_well_formed(
    *,
    config: tuple[RoutingPolicy, dict[str, ModelSettings]],
    target: str | None,
    prompt_tokens: int,
    caps: set[str],
    order: Order,
) -> None:
    p, models = config
    fields: dict[str, Any] = {}
    if target is not None and target.startswith("m"):
        fields["model"] = target
    elif target is not None and (target == AUTO or target in p.routes):
        fields["route"] = target
    request = req(max_tokens=100, **fields)
    try:
        plan = p.plan(request, prompt_tokens, capabilities=caps, order=order)
    except NoRoute:
        event("no route")
        return
    event("planned")
    everything = [*plan.candidates, *plan.fallbacks]
    assert plan.candidates
    assert len(set(everything)) == len(everything)
    for name in everything:
        s = models[name]
        assert s.context_window >= prompt_tokens + 100
        assert s.limiter.tpm is None or s.limiter.tpm >= prompt_tokens + 100
        assert caps <= s.capabilities


_FOUR = ("m0", "m1", "m2", "m3")


@st.composite
def policies(draw: st.DrawFn) -> tuple[RoutingPolicy, dict[str, ModelSettings]]:
    models = {}
    for name in _FOUR:
        others = st.sampled_from([n for n in _FOUR if n != name])
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
    p = policy(*models.values(), escalate_to=draw(st.none() | st.sampled_from(_FOUR)))
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
        costs = [p.list_nusd(m, prompt_tokens, 100) for m in qualifying_wanted]
        first = p.list_nusd(plan.candidates[0], prompt_tokens, 100)
        assert first == min(costs)
        if order is Order.CHEAPEST:
            assert len(plan.candidates) == 1
