"""The budgets shared by threads (``runtime/shared_budget.py``)."""

from __future__ import annotations

import logging
import threading
from decimal import Decimal

import pytest
from callboard.core.budget import Budgets, Placed, Wait, cheapest_call_nusd
from callboard.core.pricing import Price, estimate_nusd
from callboard.runtime.shared_budget import OVER_RESERVED_EVERY, SharedBudget


def test_a_shared_budget_knows_the_cheapest_call_of_its_models() -> None:
    prices = {"cheap": Price(Decimal(1), Decimal(2)), "dear": Price(Decimal(10), Decimal(20))}
    cheapest = estimate_nusd(prices["cheap"], 1, 1)
    assert cheapest_call_nusd(prices) == cheapest == 3_000
    budgets = Budgets(cheapest + 1_000)
    shared = SharedBudget(budgets, prices)
    assert budgets.cheapest_call_nusd == cheapest
    assert shared.should_stop() is False
    placed = shared.place(1, None, ("cheap",), prompt_tokens=1, max_tokens=1)
    assert isinstance(placed, Placed)
    assert shared.settle(1, 1_001, None) is True  # 2_999 left: below any call
    assert shared.should_stop() is True


def test_threads_reserving_and_settling_at_once_never_overspend() -> None:
    price = {"m": Price(Decimal(1), Decimal(1))}
    call = estimate_nusd(price["m"], 1, 1)
    budgets = Budgets(call * 100)
    shared = SharedBudget(budgets, price)
    placed: list[int] = []
    lock = threading.Lock()

    def worker(first: int) -> None:
        for task_id in range(first, first + 100):
            if isinstance(
                shared.place(task_id, None, ("m",), prompt_tokens=1, max_tokens=1), Placed
            ):
                with lock:
                    placed.append(task_id)
                shared.settle(task_id, call, None)

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(placed) == 100, "exactly the budget's worth of calls was placed"
    assert shared.snapshot() == {"spent_nusd": call * 100, "reserved_nusd": 0, "remaining_nusd": 0}


def test_the_first_settlement_after_a_plan_waits_wakes_once() -> None:
    """A plan told to wait is counted in the same lock as the decision: the settlement
    that follows it wakes (once, until the waiters are taken), and none wakes while
    nothing waits."""
    price = {"m": Price(Decimal(1), Decimal(1))}
    call = estimate_nusd(price["m"], 1, 1)
    shared = SharedBudget(Budgets(call + call // 2), price)
    woken: list[int] = []

    def wake() -> bool:
        woken.append(1)
        return True

    shared.wake = wake
    assert isinstance(shared.place(1, None, ("m",), prompt_tokens=1, max_tokens=1), Placed)
    assert isinstance(shared.place(2, None, ("m",), prompt_tokens=1, max_tokens=1), Wait)
    assert isinstance(shared.place(3, None, ("m",), prompt_tokens=1, max_tokens=1), Wait)
    shared.settle(1, call // 2, None)
    shared.settle(99, 0, None)  # a second settlement before the waiters are taken
    assert woken == [1]
    shared.take_waiters()
    shared.settle(98, 0, None)  # nothing waits now
    assert woken == [1]


def test_a_wake_that_could_not_be_sent_is_tried_again_by_the_next_settlement() -> None:
    """A wake refused (the router's mailbox full while it restarts) left the waiters
    counted as woken: no settlement after it woke anyone."""
    price = {"m": Price(Decimal(1), Decimal(1))}
    call = estimate_nusd(price["m"], 1, 1)
    shared = SharedBudget(Budgets(call + call // 2), price)
    answers = [False, True]
    shared.wake = lambda: answers.pop(0)
    assert isinstance(shared.place(1, None, ("m",), prompt_tokens=1, max_tokens=1), Placed)
    assert isinstance(shared.place(2, None, ("m",), prompt_tokens=1, max_tokens=1), Wait)
    shared.settle(1, call // 2, None)  # its wake is refused
    shared.settle(99, 0, None)
    assert answers == []  # the second settlement woke again


def test_a_call_that_costs_more_than_it_reserved_is_charged_and_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A provider reporting three times ``max_tokens`` took a $1 budget to $3 in silence
    (found by a hunt): what it billed is charged, and said, once and then every
    ``OVER_RESERVED_EVERY`` calls."""
    price = {"m": Price(Decimal(1), Decimal(1))}
    call = estimate_nusd(price["m"], 1, 1)
    shared = SharedBudget(Budgets(call * 1000), price)
    with caplog.at_level(logging.WARNING, logger="callboard.runtime.shared_budget"):
        for task_id in range(OVER_RESERVED_EVERY + 1):
            shared.place(task_id, None, ("m",), prompt_tokens=1, max_tokens=1)
            shared.settle(task_id, call * 3, None)
        shared.place(10_000, None, ("m",), prompt_tokens=1, max_tokens=1)
        shared.settle(10_000, call, None)  # within its reservation: nothing to say
    assert shared.snapshot()["spent_nusd"] == call * (3 * (OVER_RESERVED_EVERY + 1) + 1)
    assert shared.over_reserved.count == OVER_RESERVED_EVERY + 1
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned  # the first, and the hundredth
    assert warned[0].startswith("task 0 cost $0.000004 more than it reserved (1 calls so far)")
    assert warned[1].startswith(f"task {OVER_RESERVED_EVERY - 1} cost")
