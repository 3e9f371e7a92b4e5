"""The router actor (actors/router.py): every admitted task leaves it planned or ended.
A task no model can hold ends ``NO_ROUTE``, one above every able model's token limit
``REQUEST_ERROR`` at once, one whose plan raises ``INTERNAL`` (the router lives on);
a tight budget downgrades to a cheaper plan member or refuses; a restarted router
re-routes what was waiting, and its budget reservations balance.

Every test runs a real ``System`` against the simulated provider on loopback.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from decimal import Decimal
from typing import Any

from callboard.actors.base import CrashPlan
from callboard.core.limiter import LimiterConfig
from callboard.core.pricing import Price, estimate_nusd
from callboard.core.routing import AUTO
from callboard.core.tokens import count_chat_tokens
from callboard.messages import GetState, Request
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from loopback import WireServer, completion_body, replying
from support import WAIT_S, served, wait_until

from callboard import (
    Completed,
    Expired,
    Failed,
    FailureReason,
    ModelSettings,
    System,
    SystemConfig,
)
from callboard.config import BudgetSettings


def _server_requests(provider: SimulatedProvider, model: str) -> int:
    return int(served(provider, model).get("requests", 0))


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


def test_a_router_restart_with_a_budget_loses_no_task_and_no_money(
    provider: SimulatedProvider,
) -> None:
    price = Price(1, 1)
    models = (ModelSettings(name="m", base_url=provider.base_url, max_concurrency=8, price=price),)
    config = SystemConfig(models=models, budget=BudgetSettings(total_usd=Decimal(100)))
    with System(config, crash_plan=CrashPlan({"router": 3})) as system:
        futures = []
        for batch in range(8):
            futures += system.submit_many([f"b{batch} t{i}" for i in range(5)], max_tokens=16)
        results = [f.result(WAIT_S) for f in futures]
        assert system.drain(WAIT_S)
        snapshot = system.rt.budget.snapshot() if system.rt.budget else {}
        restarts = system.supervision()["router"]["restarts"]
    assert restarts >= 1
    failed = [r for r in results if not r.ok]
    assert not failed, Counter((type(r).__name__, getattr(r, "reason", None)) for r in failed)
    assert snapshot["reserved_nusd"] == 0
    assert snapshot["spent_nusd"] == sum(r.cost_nusd for r in results)


def _budgeted(provider: SimulatedProvider, calls: float, **fields: Any) -> SystemConfig:
    """One model, ``m``, whose calls answer 8 tokens of the 256 reserved, under a total
    budget of ``calls`` reservations."""
    provider.configure("m", ModelBehaviour(latency_s=0.05, completion_tokens=8))
    price = Price(1000, 1000)
    model = ModelSettings(name="m", base_url=provider.base_url, price=price, **fields)
    reservation = estimate_nusd(price, 9, 256)
    total = Decimal(int(reservation * calls)) / 10**9
    return SystemConfig(models=(model,), budget=BudgetSettings(total_usd=total))


def test_a_file_by_id_is_budgeted_at_what_the_context_window_leaves() -> None:
    """callboard never sees a file sent by ``file_id`` and counts it as one page (3,000
    tokens): forty files of 100,000 tokens each, sent at once, spent $15 of a $0.50
    budget (found by a hunt). Their reservation is what the context window leaves
    beside the answer, so spent + reserved stays within the budget."""
    usage = {"prompt_tokens": 100_000, "completion_tokens": 8, "total_tokens": 100_008}
    body = json.dumps(completion_body(usage=usage)).encode()
    price = Price(1, 1)  # dollars a million tokens: a file, $0.10; a reservation, $0.128
    with WireServer(replying(lambda n, b: (200, {}, body))) as srv:
        model = ModelSettings(name="m", base_url=srv.base_url, price=price, max_concurrency=8)
        total = Decimal("0.25")
        config = SystemConfig(models=(model,), budget=BudgetSettings(total_usd=total))
        file = {"type": "file", "file": {"file_id": "file-abc123"}}
        turn = [{"role": "user", "content": [{"type": "text", "text": "summarise"}, file]}]
        with System(config) as system:
            futures = [system.submit(turn, max_tokens=256) for _ in range(5)]
            results = [f.result(WAIT_S) for f in futures]
            snapshot = system.rt.budget.snapshot() if system.rt.budget else {}
    spent = sum(r.cost_nusd for r in results)
    assert snapshot["spent_nusd"] == spent <= total * 10**9
    assert Counter(type(r).__name__ for r in results) == {"Completed": 2, "Failed": 3}
    assert srv.count() == 2


def test_tasks_wait_for_money_reserved_in_flight_rather_than_fail(
    provider: SimulatedProvider,
) -> None:
    """Reservations are upper bounds (256 tokens each, 8 used): a budget of five
    reservations takes all 30 tasks (about two reservations' worth of money), five at
    a time, as the reservations of the calls in flight settle (25 of 30 failed
    budget_exceeded, with most of the budget unspent)."""
    config = _budgeted(provider, 5, max_concurrency=8)
    with System(config) as system:
        futures = [system.submit(f"task {i:04}", max_tokens=256) for i in range(30)]
        results = [f.result(WAIT_S) for f in futures]
        assert system.drain(WAIT_S)
        snapshot = system.rt.budget.snapshot() if system.rt.budget else {}
    assert [type(r).__name__ for r in results] == ["Completed"] * 30, [
        r for r in results if not r.ok
    ]
    assert snapshot["reserved_nusd"] == 0
    assert snapshot["spent_nusd"] == sum(r.cost_nusd for r in results)
    assert _server_requests(provider, "m") == 30


def test_a_task_waiting_for_the_budget_can_be_cancelled_and_never_sent(
    provider: SimulatedProvider,
) -> None:
    config = _budgeted(provider, 1.5, max_concurrency=8)
    provider.configure("m", ModelBehaviour(latency_s=1.0, completion_tokens=8))
    with System(config) as system:
        first = system.submit("holds the budget", max_tokens=256)
        waiting = system.submit("waits for it", max_tokens=256)
        assert wait_until(lambda: system.ask("router", GetState())["waiting_for_budget"] == 1)
        assert waiting.cancel()
        assert isinstance(first.result(WAIT_S), Completed)
        assert system.drain(WAIT_S)  # the waiting one ended too
        counts = system.stats().outcomes
    assert counts.get("cancelled") == 1
    assert _server_requests(provider, "m") == 1


def test_a_task_waiting_for_the_budget_expires_at_its_deadline(
    provider: SimulatedProvider,
) -> None:
    """Not at the next settlement, which may come much later (a long call holding the
    money it reserved)."""
    config = _budgeted(provider, 1.5, max_concurrency=8)
    provider.configure("m", ModelBehaviour(latency_s=2.0, completion_tokens=8))
    with System(config) as system:
        holder = system.submit("holds the budget", max_tokens=256)
        late = system.submit("waits for it", max_tokens=256, deadline_s=0.3)
        result = late.result(WAIT_S)
        held_on = not holder.done()
        assert isinstance(holder.result(WAIT_S), Completed)
    assert isinstance(result, Expired), result
    assert held_on  # it ended while the call holding the money still ran
    assert _server_requests(provider, "m") == 1


def test_a_task_that_cannot_fit_even_with_nothing_reserved_still_fails(
    provider: SimulatedProvider,
) -> None:
    config = _budgeted(provider, 0.5)
    with System(config) as system:
        result = system.submit("too dear", max_tokens=256).result(WAIT_S)
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.BUDGET_EXCEEDED


def test_a_budget_reserves_max_tokens_for_each_of_n_choices(provider: SimulatedProvider) -> None:
    """The provider bills every choice: a reservation for one let n = 8 spend 8x it."""
    config = _budgeted(provider, 4)
    with System(config) as system:
        eight = system.submit("eight answers", max_tokens=256, n=8).result(WAIT_S)
        one = system.submit("one answer", max_tokens=256).result(WAIT_S)
    assert isinstance(eight, Failed), eight
    assert eight.reason is FailureReason.BUDGET_EXCEEDED
    assert isinstance(one, Completed), one
    assert _server_requests(provider, "m") == 1


def test_a_prompt_is_reserved_at_the_cache_write_price_only_where_it_marks_the_cache(
    provider: SimulatedProvider,
) -> None:
    """Claude's 1-hour cache writes cost twice its input, and a call writes the cache only
    where its request marks it (``cache_control``): the budget reserved every prompt at
    the write price, so a budget with room for twice a call refused it (noticed in a
    review). An unmarked prompt is reserved at the input price; a marked one still at
    the write price."""
    provider.configure("m", ModelBehaviour(latency_s=0.01, completion_tokens=8))
    price = Price(1000, 1, cache_write_1h_per_mtok=2000)
    model = ModelSettings(name="m", base_url=provider.base_url, price=price)
    text = " ".join(f"word{i}" for i in range(400))
    prompt = count_chat_tokens([{"role": "user", "content": text}])
    plain = estimate_nusd(price, prompt, 16, cache_writes=False)
    total = Decimal(plain * 3 // 2) / 10**9  # one unmarked call's reservation, not a marked one
    config = SystemConfig(models=(model,), budget=BudgetSettings(total_usd=total))
    mark = {"type": "ephemeral", "ttl": "1h"}
    marked = [{"role": "user", "content": [{"type": "text", "text": text, "cache_control": mark}]}]
    with System(config) as system:
        unmarked_result = system.submit(text, max_tokens=16).result(WAIT_S)
        marked_result = system.submit(marked, max_tokens=16).result(WAIT_S)
    assert isinstance(unmarked_result, Completed), unmarked_result
    assert isinstance(marked_result, Failed), marked_result
    assert marked_result.reason is FailureReason.BUDGET_EXCEEDED
    assert _server_requests(provider, "m") == 1


def _tpm_models(provider: SimulatedProvider, **small: Any) -> tuple[ModelSettings, ModelSettings]:
    provider.configure("small", ModelBehaviour(latency_s=0.5, completion_tokens=8))
    provider.configure("big", ModelBehaviour(latency_s=0.01, completion_tokens=8))
    return (
        ModelSettings(
            name="small",
            base_url=provider.base_url,
            max_concurrency=1,
            limiter=LimiterConfig(rpm=None, tpm=1000),
            **small,
        ),
        ModelSettings(name="big", base_url=provider.base_url, max_concurrency=4),
    )


def test_a_request_above_the_tpm_limit_fails_typed_and_at_once(provider: SimulatedProvider) -> None:
    with System(SystemConfig(models=_tpm_models(provider))) as system:
        first = system.submit("occupies the only slot", model="small", max_tokens=16)
        assert wait_until(lambda: _server_requests(provider, "small") == 1), "the first call"
        t0 = time.monotonic()
        huge = system.submit("needs more than a minute of tokens", model="small", max_tokens=4000)
        result = huge.result(WAIT_S)
        took = time.monotonic() - t0
        assert first.result(WAIT_S).ok
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.REQUEST_ERROR
    assert result.attempts == 0
    assert _server_requests(provider, "small") <= 1
    assert took < 0.3, took  # the slot frees only after 0.5 s


def test_a_request_above_one_models_tpm_goes_to_a_fallback_that_admits_it(
    provider: SimulatedProvider,
) -> None:
    with System(SystemConfig(models=_tpm_models(provider, fallbacks=("big",)))) as system:
        result = system.submit("too big for small", model="small", max_tokens=4000).result(WAIT_S)
    assert isinstance(result, Completed), result
    assert result.model == "big"


def test_context_window_and_capabilities_route_end_to_end(provider: SimulatedProvider) -> None:
    small = ModelSettings(
        name="small", base_url=provider.base_url, context_window=100, tiers=("t",)
    )
    large = ModelSettings(name="large", base_url=provider.base_url, tiers=("t",))
    seeing = ModelSettings(
        name="seeing", base_url=provider.base_url, capabilities=frozenset({"vision"})
    )
    config = SystemConfig(models=(small, large, seeing), order="config")
    with System(config) as system:
        fits = system.submit("short", route="t", max_tokens=16).result(WAIT_S)
        too_big = system.submit("short", route="t", max_tokens=200).result(WAIT_S)
        vision = system.submit(
            "look", route="t", max_tokens=16, metadata={"capabilities": ["vision"]}
        ).result(WAIT_S)
        explicit = system.submit("look", model="seeing", metadata={"capabilities": ["vision"]})
        nothing = system.submit("x", model="small", max_tokens=500).result(WAIT_S)
        assert explicit.result(WAIT_S).model == "seeing"
    assert fits.model in {"small", "large"}  # both fit: whichever grants first
    assert too_big.model == "large"  # 9 + 200 tokens do not fit small's window of 100
    assert isinstance(vision, Failed)
    assert vision.reason is FailureReason.NO_ROUTE
    assert vision.attempts == 0
    assert isinstance(nothing, Failed)
    assert nothing.reason is FailureReason.NO_ROUTE
    assert _server_requests(provider, "small") <= 1


def test_downgrade_to_a_cheaper_plan_member_or_refuse_when_asked(
    provider: SimulatedProvider,
) -> None:
    dear_price, cheap_price = Price(100, 100), Price(1, 1)
    dear_cost = estimate_nusd(dear_price, 9, 32)
    for downgrade in (True, False):
        models = (
            ModelSettings(name="dear", base_url=provider.base_url, price=dear_price, tiers=("t",)),
            ModelSettings(
                name="cheap", base_url=provider.base_url, price=cheap_price, tiers=("t",)
            ),
        )
        budget = BudgetSettings(
            total_usd=Decimal(dear_cost - 1) / 10**9, downgrade_when_tight=downgrade
        )
        config = SystemConfig(models=models, order="config", budget=budget)
        with System(config) as system:
            result = system.submit("task 0000", route="t", max_tokens=32).result(WAIT_S)
            assert system.drain(WAIT_S)
            snapshot = system.rt.budget.snapshot() if system.rt.budget else {}
        if downgrade:
            assert isinstance(result, Completed), result
            assert result.model == "cheap"
        else:
            assert isinstance(result, Failed)
            assert result.reason is FailureReason.BUDGET_EXCEEDED
            assert result.attempts == 0
        assert snapshot["reserved_nusd"] == 0
