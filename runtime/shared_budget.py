"""The budgets shared by threads: the pure ``Budgets`` behind one lock.

The router reserves before a task is queued and every thread that finishes a
task settles its cost, so the accounts need one lock; the decisions stay in
``callboard.core.budget``. A plan told to ``Wait`` (it fits once what is reserved
is settled) is counted here under the same lock as the decision, and the first
settlement after it calls ``wake`` (the router is told to place its waiting tasks
again): no settlement can fall between a decision to wait and the count that
makes it wake someone. What must hold: every read and write of the accounts
holds the lock, for a few microseconds; while a plan waits, the next settlement
wakes (once, until ``take_waiters``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from callboard.core.budget import (
    Budgets,
    Exhausted,
    Placed,
    Wait,
    cheapest_call_nusd,
    dollars,
)
from callboard.core.pricing import Price
from callboard.runtime.guarded_log import guarded_logger

__all__ = ["OverReserved", "SharedBudget"]

log = guarded_logger(__name__)

OVER_RESERVED_EVERY = 100
"""After the first, one warning per this many calls that cost more than they reserved."""


class OverReserved:
    """Counts the calls settled at more than they reserved, and says so in a warning,
    the first and then every ``OVER_RESERVED_EVERY``: what a provider bills is charged
    as it comes (beyond ``max_tokens``, a prompt beyond its estimate, a billed attempt
    and its retry), which can take ``budget`` past its limit (a provider reporting
    three times ``max_tokens`` took a $1 budget to $3 in silence; found by a hunt).
    Thread-safe."""

    def __init__(self, budget: str) -> None:
        self._budget = budget
        self._lock = threading.Lock()
        self.count = 0

    def saw(self, what: str, over_nusd: int) -> None:
        """``what`` (``task 12``) cost ``over_nusd`` more than it reserved (0: it did not)."""
        if over_nusd <= 0:
            return
        with self._lock:
            self.count += 1
            told = self.count
        if told == 1 or told % OVER_RESERVED_EVERY == 0:
            log.warning(
                "%s cost %s more than it reserved (%d calls so far): what a provider bills "
                "is charged as it comes, which can take %s past its limit",
                what,
                dollars(over_nusd),
                told,
                self._budget,
            )


class SharedBudget:
    """``Budgets`` behind one lock (see the module docstring)."""

    def __init__(self, budgets: Budgets, prices: Mapping[str, Price]) -> None:
        """Own ``budgets``; its cheapest call becomes at least the cheapest with ``prices``."""
        self._budgets = budgets
        self._prices = dict(prices)
        budgets.cheapest_call_nusd = max(budgets.cheapest_call_nusd, cheapest_call_nusd(prices))
        self._lock = threading.Lock()
        self._waiters = 0
        self._wake_pending = False
        self.over_reserved = OverReserved("the budget")
        """Calls settled at more than they reserved (``Budgets.settle``)."""
        self.wake: Callable[[], bool] | None = None
        """Called (outside the lock, on the settling thread) by the first settlement
        after a plan was told to wait; False if the wake could not be sent (the next
        settlement tries again)."""

    def place(
        self,
        task_id: int,
        tag: str | None,
        models: Sequence[str],
        *,
        prompt_tokens: int,
        max_tokens: int,
        cache_writes: bool = True,
    ) -> Placed | Wait | Exhausted:
        with self._lock:
            answer = self._budgets.place(
                task_id,
                tag,
                models,
                self._prices,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                cache_writes=cache_writes,
            )
            if type(answer) is Wait:
                self._waiters += 1
            return answer

    def charge(self, task_id: int, amount_nusd: int) -> bool:
        """``Budgets.charge``: a billed call the task goes on after; False if its next
        call would take the spend past a limit."""
        with self._lock:
            return self._budgets.charge(task_id, amount_nusd)

    def settle(self, task_id: int, actual_nusd: int, tag: str | None) -> bool:
        """Record the task's final cost (0 releases its reservation); True if the
        total budget is now spent."""
        with self._lock:
            over = self._budgets.settle(task_id, actual_nusd, tag=tag)
            spent = self._budgets.should_stop()
            wake = self._waiters > 0 and not self._wake_pending
            if wake:
                self._wake_pending = True
        self.over_reserved.saw(f"task {task_id}", over)
        if wake and self.wake is not None and not self.wake():
            with self._lock:
                self._wake_pending = False
        return spent

    def take_waiters(self) -> None:
        """The plans that waited are being placed again (those that must wait still are
        counted anew): the next settlement after one of them wakes again."""
        with self._lock:
            self._waiters = 0
            self._wake_pending = False

    def leaves_unsent(self, refusal: Exhausted) -> bool:
        """Whether the refused task is left unsent (``Budgets.leaves_unsent``)."""
        with self._lock:
            return self._budgets.leaves_unsent(refusal)

    def should_stop(self) -> bool:
        """Whether the total budget is spent (``Budgets.should_stop``)."""
        with self._lock:
            return self._budgets.should_stop()

    def snapshot(self) -> dict[str, int | None]:
        with self._lock:
            b = self._budgets
            return {
                "spent_nusd": b.spent,
                "reserved_nusd": b.reserved,
                "remaining_nusd": b.remaining(),
            }
