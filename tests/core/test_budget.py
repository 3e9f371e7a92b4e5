"""Budgets (core/budget.py): examples, then a hypothesis state machine for the reservation
invariant, then the invariant held at every moment by a real System under load."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from callboard.core.breaker import BreakerConfig
from callboard.core.budget import (
    Account,
    Budgets,
    Exhausted,
    Placed,
    Reserved,
    Wait,
)
from callboard.core.pricing import Price, estimate_nusd
from callboard.core.retry import RetryConfig
from callboard.core.settings import FREE
from callboard.messages import FailureReason
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)
from support import WAIT_S, BudgetWatch

from callboard import ModelSettings, System, SystemConfig
from callboard.config import BudgetSettings

# -- examples ---------------------------------------------------------------------------


def test_reserve_settle_release_within_the_total() -> None:
    b = Budgets(1_000)
    assert b.reserve(1, None, 600) == Reserved(task_id=1, tag=None, amount_nusd=600)
    assert b.reserve(2, None, 500) == Exhausted(which=None, remaining=400, requested=500)
    assert (b.spent, b.reserved, b.remaining()) == (0, 600, 400)
    b.settle(1, 250)  # a refund of 350
    assert (b.spent, b.reserved, b.remaining()) == (250, 0, 750)
    assert isinstance(b.reserve(2, None, 500), Reserved)
    assert b.release(2) is True
    assert b.release(2) is False
    assert (b.spent, b.reserved, b.remaining()) == (250, 0, 750)


def test_a_refusal_speaks_dollars_not_nano_dollars() -> None:
    """Issue 14: the budget's message said "400 nano-USD left"."""
    assert str(Exhausted(which=None, remaining=400, requested=1_500_000_000)) == (
        "the total budget has $0.0000004 left; this call may cost up to $1.5"
    )
    assert str(Exhausted(which="team-a", remaining=0, requested=20_000)).startswith(
        "the 'team-a' budget has $0 left"
    )


def test_a_tag_budget_and_the_total_both_hold() -> None:
    b = Budgets(1_000, {"team-a": 300})
    assert isinstance(b.reserve(1, "team-a", 300), Reserved)
    assert b.reserve(2, "team-a", 1) == Exhausted(which="team-a", remaining=0, requested=1)
    assert isinstance(b.reserve(3, "team-b", 700), Reserved)  # no budget of its own
    assert b.reserve(4, "team-b", 1) == Exhausted(which=None, remaining=0, requested=1)
    assert b.remaining("team-a") == 0
    assert b.account("team-a") == Account(limit=300, spent=0, reserved=300)
    assert b.account("team-b") is None
    assert b.account() == Account(limit=1_000, spent=0, reserved=1_000)
    b.settle(1, 100)
    assert b.remaining("team-a") == 200
    assert b.remaining("team-b") == 200  # the total is the tighter limit


def test_a_refused_reservation_holds_nothing() -> None:
    b = Budgets(1_000, {"t": 100})
    assert isinstance(b.reserve(1, "t", 200), Exhausted)
    assert (b.reserved, b.account("t")) == (0, Account(limit=100, spent=0, reserved=0))
    assert isinstance(b.reserve(1, "t", 100), Reserved)  # the id was not taken


def test_a_charge_beyond_the_limit_is_recorded_and_exhausts() -> None:
    b = Budgets(1_000)
    b.reserve(1, None, 900)
    b.settle(1, 1_200)  # the provider spent more than the estimate
    assert (b.spent, b.reserved, b.remaining()) == (1_200, 0, 0)
    assert b.should_stop() is True
    assert b.reserve(2, None, 0) == Exhausted(which=None, remaining=0, requested=0)


def test_a_billed_call_is_charged_as_it_comes_and_counted_off_the_settle() -> None:
    """A retry's billed call was settled only at the task's end: billed retries took
    the spend to 1.8x a budget with nothing to stop them (found by a hunt). Charged
    as it comes, the task is told when its next call would go past the limit."""
    b = Budgets(total_nusd=1000, per_tag={"team": 600})
    assert isinstance(b.reserve(1, "team", 300), Reserved)
    assert b.charge(1, 200)  # spent 200, still 300 held: 500 of the team's 600
    assert (b.spent, b.reserved, b.remaining("team")) == (200, 300, 100)
    assert not b.charge(1, 200)  # 400 spent + 300 held: past the team's 600
    assert b.remaining("team") == 0  # (as an account over its limit says it)
    b.settle(1, 650)  # its whole cost: 400 charged already, 250 for the last call
    assert (b.spent, b.reserved) == (650, 0)
    assert b.charge(2, 50)  # a task without a reservation: the total alone
    b.settle(2, 50)
    assert b.spent == 700


def test_should_stop_once_spending_reaches_the_total() -> None:
    b = Budgets(100)
    assert b.should_stop() is False
    b.reserve(1, None, 100)
    assert b.should_stop() is False  # reserved is not spent
    b.settle(1, 100)
    assert b.should_stop() is True
    assert Budgets(None).should_stop() is False


def test_should_stop_when_what_is_left_is_below_the_cheapest_call() -> None:
    b = Budgets(100, cheapest_call_nusd=30)
    b.reserve(1, None, 100)
    assert b.should_stop() is False  # the reservation may be refunded in full
    b.settle(1, 71)
    assert b.should_stop() is True  # 29 left: no call costs less than 30


def test_should_stop_once_what_is_left_cannot_take_the_calls_turned_away() -> None:
    b = Budgets(100, close_on_refusals=True)
    for task in (1, 2):
        assert isinstance(b.reserve(task, None, 50), Reserved)
    assert isinstance(b.reserve(3, None, 50), Exhausted)  # a burst: refused while reserved
    b.settle(1, 30)
    assert b.should_stop() is False  # a call is still reserved
    b.settle(2, 30)
    assert b.remaining() == 40  # less than the call turned away
    assert b.should_stop() is True


def test_refunds_that_could_take_the_calls_turned_away_do_not_spend_the_total() -> None:
    b = Budgets(100, close_on_refusals=True)
    for task in (1, 2):
        assert isinstance(b.reserve(task, None, 50), Reserved)
    assert isinstance(b.reserve(3, None, 40), Exhausted)
    b.settle(1, 10)
    b.settle(2, 10)
    assert (b.remaining(), b.should_stop()) == (80, False)  # room for the next burst
    assert isinstance(b.reserve(4, None, 50), Reserved)
    assert isinstance(b.reserve(5, None, 40), Exhausted)
    assert isinstance(b.reserve(6, None, 40), Exhausted)
    b.release(4)
    assert (b.remaining(), b.should_stop()) == (80, False)  # 80 could take both
    assert isinstance(b.reserve(7, None, 50), Reserved)
    assert isinstance(b.reserve(8, None, 50), Exhausted)
    b.settle(7, 40)
    assert (b.remaining(), b.should_stop()) == (40, True)


def test_an_outsized_call_or_a_tag_refusal_does_not_spend_the_total() -> None:
    b = Budgets(1_000, {"t": 10}, close_on_refusals=True)
    assert isinstance(b.reserve(1, None, 5_000), Exhausted)  # larger than anything granted
    assert b.should_stop() is False
    assert isinstance(b.reserve(2, "t", 10), Reserved)
    assert b.reserve(3, "t", 10) == Exhausted(which="t", remaining=0, requested=10)
    b.settle(2, 10)
    assert b.should_stop() is False  # the tag is spent, not the total
    assert isinstance(b.reserve(4, None, 600), Reserved)
    assert isinstance(b.reserve(5, None, 600), Exhausted)  # as large as one granted
    b.settle(4, 500)
    assert (b.remaining(), b.should_stop()) == (490, True)


def test_once_a_batchs_total_is_spent_a_refused_call_is_left_unsent_not_failed() -> None:
    """``callboard run``'s lines accepted before the total was spent were each failed
    ``budget_exceeded`` (final: a rerun skipped them), not left for the next run."""
    b = Budgets(100, close_on_refusals=True)
    assert isinstance(b.reserve(1, None, 60), Reserved)
    b.settle(1, 50)
    refused = b.reserve(2, None, 60)
    assert isinstance(refused, Exhausted)
    assert b.leaves_unsent(refused) is True  # a whole budget pays it: the next run sends it
    outsized = b.reserve(3, None, 101)
    assert isinstance(outsized, Exhausted)
    assert b.leaves_unsent(outsized) is False  # no run could: it fails


def test_a_service_or_a_tag_refusal_fails_as_before() -> None:
    service = Budgets(100)
    assert isinstance(service.reserve(1, None, 60), Reserved)
    service.settle(1, 60)
    refused = service.reserve(2, None, 60)
    assert isinstance(refused, Exhausted)
    assert service.leaves_unsent(refused) is False
    tagged = Budgets(1_000, {"t": 10}, close_on_refusals=True)
    assert isinstance(tagged.reserve(1, "t", 10), Reserved)
    tagged.settle(1, 10)
    by_tag = tagged.reserve(2, "t", 10)
    assert isinstance(by_tag, Exhausted)
    assert tagged.leaves_unsent(by_tag) is False  # the tag is spent, not the total


def test_without_close_on_refusals_a_refused_call_leaves_the_rest_to_smaller_ones() -> None:
    """A service's one large request late in the budget closed admission for good, with
    a fifth of the budget left for small ones."""
    b = Budgets(1_000)
    for task in (1, 2):
        assert isinstance(b.reserve(task, None, 400), Reserved)
        b.settle(task, 400)
    assert isinstance(b.reserve(3, None, 400), Exhausted)
    assert b.should_stop() is False
    assert isinstance(b.reserve(4, None, 1), Reserved)


def test_settling_an_unreserved_call_still_charges() -> None:
    b = Budgets(1_000, {"t": 500})
    b.settle(7, 40, tag="t")
    b.reserve(8, "t", 10)
    b.release(8)
    b.settle(8, 15, tag="t")  # a late completion after a release
    assert b.account("t") == Account(limit=500, spent=55, reserved=0)
    assert b.spent == 55


def test_unlimited_budgets() -> None:
    b = Budgets(None, {"t": 10})
    assert isinstance(b.reserve(1, None, 10**15), Reserved)
    assert b.remaining() is None
    assert b.remaining("t") == 10
    assert b.account() == Account(limit=None, spent=0, reserved=10**15)
    assert Account(limit=None, spent=5, reserved=0).remaining is None


def test_bugs_raise() -> None:
    b = Budgets(100)
    b.reserve(1, None, 10)
    with pytest.raises(ValueError, match="already holds"):
        b.reserve(1, None, 10)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="nano-dollars"):
            b.reserve(2, None, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nano-dollars"):
        b.settle(1, -5)
    with pytest.raises(ValueError, match="total_nusd"):
        Budgets(-1)
    with pytest.raises(ValueError, match="non-empty"):
        Budgets(100, {"": 5})


# -- cheaper alternatives ---------------------------------------------------------------

PRICES = {
    "dear": Price("10", "30"),
    "mid": Price("1", "3"),
    "cheap": Price(Decimal("0.1"), Decimal("0.3")),
}
PLAN = ("dear", "mid", "cheap")  # in plan order


def cost(model: str) -> int:
    return estimate_nusd(PRICES[model], 1_000, 1_000)


def test_place_keeps_what_fits_and_reserves_for_the_dearest_kept() -> None:
    roomy = Budgets(None).place(1, None, PLAN, PRICES, prompt_tokens=1_000, max_tokens=1_000)
    assert roomy == Placed(models=PLAN, reserved=Reserved(1, None, cost("dear")))
    b = Budgets(10 * cost("dear"), {"t": cost("mid")})
    placed = b.place(
        2, "t", ("mid", "dear", "cheap"), PRICES, prompt_tokens=1_000, max_tokens=1_000
    )
    assert placed == Placed(models=("mid", "cheap"), reserved=Reserved(2, "t", cost("mid")))


def test_place_downgrades_only_when_configured() -> None:
    b = Budgets(cost("mid"))
    placed = b.place(1, None, PLAN, PRICES, prompt_tokens=1_000, max_tokens=1_000)
    assert placed == Placed(models=("mid", "cheap"), reserved=Reserved(1, None, cost("mid")))
    strict = Budgets(cost("mid"), {"t": cost("mid")}, downgrade_when_tight=False)
    refused = strict.place(1, "t", PLAN, PRICES, prompt_tokens=1_000, max_tokens=1_000)
    assert refused == Exhausted(which=None, remaining=cost("mid"), requested=cost("dear"))
    assert strict.reserved == 0
    broke = Budgets(10 * cost("dear"), {"t": 0})
    nothing = broke.place(1, "t", PLAN, PRICES, prompt_tokens=1_000, max_tokens=1_000)
    assert nothing == Exhausted(which="t", remaining=0, requested=cost("cheap"))


def test_place_over_the_limit_refuses_a_free_model_too() -> None:
    """Over its limit (a provider billed past the reservation), a plan with a model
    whose estimate is 0 kept it at the clamped room of 0; its reservation was refused
    and an assertion failed, in the router (found by a hunt)."""
    b = Budgets(1_000)
    assert isinstance(b.reserve(1, None, 1_000), Reserved)
    b.settle(1, 1_500)
    prices = {**PRICES, "local": FREE}
    refused = b.place(2, None, ("dear", "local"), prices, prompt_tokens=10, max_tokens=10)
    assert refused == Exhausted(which=None, remaining=0, requested=0)
    assert str(refused) == (
        "the total budget is over its limit: no call may start, a free one neither"
    )
    assert b.reserved == 0


def test_a_plan_that_fits_once_reservations_settle_waits_instead_of_failing() -> None:
    """The money reserved for calls in flight is an upper bound; a plan that would fit
    without it waits for it to settle (300 calls under a $1 budget: 276 failed with
    $0.36 spent). One that would not fit even so is refused, as before."""
    b = Budgets(cost("dear") + cost("dear") // 2, downgrade_when_tight=False)
    first = b.place(1, None, ("dear",), PRICES, prompt_tokens=1_000, max_tokens=1_000)
    assert isinstance(first, Placed)
    second = b.place(2, None, ("dear",), PRICES, prompt_tokens=1_000, max_tokens=1_000)
    assert second == Wait(requested=cost("dear"))
    assert (b.reserved, b.should_stop()) == (cost("dear"), False)  # a wait is no refusal
    b.settle(1, cost("dear") // 4)  # the call cost a quarter of its reservation
    again = b.place(2, None, ("dear",), PRICES, prompt_tokens=1_000, max_tokens=1_000)
    assert isinstance(again, Placed)
    b.settle(2, cost("dear"))  # all of it: nothing reserved, and no room for another
    last = b.place(3, None, ("dear",), PRICES, prompt_tokens=1_000, max_tokens=1_000)
    assert isinstance(last, Exhausted)


def test_a_tag_short_of_money_of_its_own_does_not_wait_on_others_reservations() -> None:
    b = Budgets(10 * cost("dear"), {"t": cost("dear") // 2})
    assert isinstance(
        b.place(1, None, ("dear",), PRICES, prompt_tokens=1_000, max_tokens=1_000), Placed
    )
    refused = b.place(2, "t", ("dear",), PRICES, prompt_tokens=1_000, max_tokens=1_000)
    assert isinstance(refused, Exhausted)  # "t" holds nothing that could come back
    assert refused.which == "t"


# -- the invariant, by state machine --------------------------------------------------------

TAGS = (None, "a", "b", "free")
LIMITS = {"a": 3_000, "b": 5_000}


class BudgetMachine(RuleBasedStateMachine):
    """Random reserve / settle / release sequences against a model of the accounts."""

    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.b = Budgets(0)
        self.total = 0
        self.next_id = 0
        self.outstanding: dict[int, tuple[str | None, int]] = {}
        self.spent: dict[str | None, int] = {}
        self.overcharged = False
        self.cheapest = 0
        self.close = False
        self.largest_granted = 0
        self.turned_away = 0  # ordinary refusals by the total since it last held nothing
        self.turned_away_for_good = False

    @initialize(
        total=st.integers(0, 10_000),
        cheapest=st.sampled_from([0, 0, 1, 300]),
        close=st.booleans(),
    )
    def start(self, total: int, cheapest: int, close: bool) -> None:
        self.total = total
        self.cheapest = cheapest
        self.close = close
        self.b = Budgets(total, LIMITS, cheapest_call_nusd=cheapest, close_on_refusals=close)

    def _limits(self, tag: str | None) -> list[tuple[str | None, int]]:
        """(account key, limit) of the accounts a reservation under ``tag`` touches."""
        pairs: list[tuple[str | None, int]] = [(None, self.total)]
        if tag in LIMITS:
            pairs.append((tag, LIMITS[tag]))
        return pairs

    def _used(self, key: str | None) -> int:
        held = sum(a for t, a in self.outstanding.values() if key is None or t == key)
        return self.spent.get(key, 0) + held

    @rule(target=held, tag=st.sampled_from(TAGS), amount=st.integers(0, 4_000))
    def reserve(self, tag: str | None, amount: int) -> object:
        self.next_id += 1
        task = self.next_id
        over_before = any(self._used(k) > lim for k, lim in self._limits(tag))
        fits = all(self._used(k) + amount <= lim for k, lim in self._limits(tag))
        refused_by_total = self._used(None) + amount > self.total  # it is checked first
        answer = self.b.reserve(task, tag, amount)
        if refused_by_total and amount <= self.largest_granted:
            self.turned_away += amount
            self.weigh()
        if over_before:
            assert isinstance(answer, Exhausted), "an account over its limit took a reservation"
        assert isinstance(answer, Reserved) == fits
        if isinstance(answer, Exhausted):
            assert answer.remaining >= 0
            return multiple()
        self.outstanding[task] = (tag, amount)
        self.largest_granted = max(self.largest_granted, amount)
        for key, limit in self._limits(tag):
            assert self._used(key) <= limit  # the invariant, at reservation time
        return task

    def weigh(self) -> None:
        """With nothing reserved: could what is left take the calls turned away?"""
        if sum(a for _, a in self.outstanding.values()) or not self.turned_away:
            return
        if self.total - self.spent.get(None, 0) < self.turned_away:
            self.turned_away_for_good = True
        self.turned_away = 0

    def _charge(self, task: int, actual: int) -> None:
        tag, amount = self.outstanding.pop(task)
        self.b.settle(task, actual)
        self.overcharged |= actual > amount
        for key, _ in self._limits(tag):
            self.spent[key] = self.spent.get(key, 0) + actual
        self.weigh()

    @rule(task=consumes(held), share=st.fractions(0, 1))
    def settle_within(self, task: int, share: Fraction) -> None:
        amount = self.outstanding[task][1]
        self._charge(task, int(amount * share))

    @rule(task=consumes(held), extra=st.integers(1, 3_000))
    def settle_above(self, task: int, extra: int) -> None:
        self._charge(task, self.outstanding[task][1] + extra)

    @rule(task=consumes(held))
    def release(self, task: int) -> None:
        assert self.b.release(task) is True
        del self.outstanding[task]
        self.weigh()

    @invariant()
    def books_balance(self) -> None:
        assert self.b.reserved == sum(a for _, a in self.outstanding.values())
        assert self.b.spent == self.spent.get(None, 0)
        for tag, limit in LIMITS.items():
            assert self.b.account(tag) == Account(
                limit=limit,
                spent=self.spent.get(tag, 0),
                reserved=sum(a for t, a in self.outstanding.values() if t == tag),
            )

    @invariant()
    def only_an_overcharge_goes_over(self) -> None:
        if self.overcharged:
            return
        for key, limit in [(None, self.total), *LIMITS.items()]:
            assert self._used(key) <= limit

    @invariant()
    def stops_once_the_total_can_take_no_more(self) -> None:
        left = self.total - self.spent.get(None, 0)
        cannot_fit = left <= 0 or left < self.cheapest
        assert self.b.should_stop() == (cannot_fit or (self.close and self.turned_away_for_good))


BudgetMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_budget_machine = BudgetMachine.TestCase


# -- under load, in a real System --------------------------------------------------------


def test_budget_holds_at_every_moment_under_load_with_retries_fallbacks_429s_cancels(
    provider: SimulatedProvider,
) -> None:
    """60 concurrent calls; 500s (retried), server-side 429s (Retry-After), fallbacks to a
    dearer model, cancels, hopeless deadlines, a per-tag budget: spent + reserved never
    exceeds any limit, every reservation is released, and the books match the results."""
    provider.configure("cheap", ModelBehaviour(latency_s=0.01, jitter_s=0.005, error_rate=0.5))
    provider.configure("dear", ModelBehaviour(latency_s=0.01, rpm=1200, burst_s=0.1))
    retry = RetryConfig(max_attempts=2, initial_s=0.01, jitter_s=0.01)
    never_open = BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000)
    cheap = ModelSettings(
        name="cheap",
        base_url=provider.base_url,
        max_concurrency=60,
        price=Price(1, 2),
        fallbacks=("dear",),
        retry=retry,
        breaker=never_open,
    )
    dear = ModelSettings(
        name="dear",
        base_url=provider.base_url,
        max_concurrency=60,
        price=Price(10, 20),
        retry=RetryConfig(max_attempts=3, initial_s=0.01, jitter_s=0.01),
        breaker=never_open,
    )
    one_dear = estimate_nusd(Price(10, 20), 9, 64)
    total, tag_limit = 40 * one_dear, 6 * one_dear
    budget = BudgetSettings(
        total_usd=Decimal(total) / 10**9, per_tag_usd={"team": Decimal(tag_limit) / 10**9}
    )
    config = SystemConfig(models=(cheap, dear), budget=budget)
    with System(config) as system:
        watch = BudgetWatch(system)
        results = []
        for wave in range(5):  # waves, so that settled refunds make room again
            futures = []
            for i in range(wave * 40, wave * 40 + 40):
                fields: dict[str, Any] = {"max_tokens": 64}
                if i % 5 == 0:
                    fields["budget_tag"] = "team"
                if i % 11 == 0:
                    fields["deadline_s"] = 0.001
                futures.append(system.submit(f"task {i:04d}", **fields))
                if i % 7 == 0:
                    system.cancel(futures[-1].task_id)
            results += [f.result(WAIT_S) for f in futures]
        assert system.drain(WAIT_S)
        snapshot = system.rt.budget.snapshot() if system.rt.budget else {}
        team = system.rt.budget._budgets.account("team") if system.rt.budget else None
    kinds = Counter(type(r).__name__ for r in results)
    assert kinds["Completed"] >= 20, kinds
    assert kinds["Cancelled"] >= 1, kinds
    assert kinds["Expired"] >= 1, kinds
    assert Counter(r.model for r in results)["dear"] >= 1  # fallbacks took load
    refused = [r for r in results if getattr(r, "reason", None) is FailureReason.BUDGET_EXCEEDED]
    assert all(r.attempts == 0 for r in refused)  # (most wait for the refunds instead)
    assert watch.peak_total <= total
    assert watch.peak_tag.get("team", 0) <= tag_limit
    assert snapshot["reserved_nusd"] == 0
    assert snapshot["spent_nusd"] == sum(r.cost_nusd for r in results) <= total
    assert team is not None
    assert team.reserved == 0
    assert team.spent <= tag_limit
