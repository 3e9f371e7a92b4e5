"""Budgets (pure): spend limits enforced by reservation, in integer nano-dollars.

Theory of operation
-------------------
There is one *total* account (limit ``total_nusd``, or None: unlimited) and
one account per budget tag listed in ``per_tag``; a tag not listed has no
limit of its own but still counts towards the total. Each account holds
``spent`` (settled money) and ``reserved`` (held for calls in flight).

* ``reserve(task_id, tag, amount)`` before dispatch, with the call's upper
  bound (``pricing.estimate_nusd``): held in the total and the tag's account,
  or in neither (``Exhausted`` names the account that would go over).
* ``settle(task_id, actual)`` when the call ends: the reservation becomes the
  actual cost. A charge is never refused (the money is spent), so settling
  above the reservation is the only way an account goes over its limit;
  while it is over, every ``reserve`` against it is refused.
* ``release(task_id)`` when no call was made: the reservation is dropped.

A plan that does not fit now but would once what is reserved is settled (the
money reserved for calls in flight is an upper bound, most of it comes back)
is told to ``Wait``, not refused: a batch of 300 calls under a $1 budget whose
first 24 reserved it all failed the other 276 with $0.36 spent. Only a plan that
could not fit even with nothing reserved is ``Exhausted``.

What always holds (the hypothesis state machine in ``tests/core/test_budget.py``
checks it): at every successful ``reserve``, spent + reserved <= limit for
each account it touches, however many reservations are outstanding; spent
never decreases; reserved is the sum of the outstanding reservations.

Not thread-safe: one owner calls it (``SharedBudget`` locks around it).
``Budgets.place`` picks a cheaper plan member when the budget is tight;
``should_stop`` tells the system it may stop itself.

*When the total counts as spent* (``should_stop``). Reservations are upper
bounds, so spending rarely reaches the total exactly. The room that could
ever be reserved again is ``total - spent`` (what is reserved may be refunded
to nothing), and it only shrinks. So the total is spent once (a) ``total -
spent`` is below the cheapest call any model could make
(``cheapest_call_nusd``), for good; or (b), with ``close_on_refusals`` (a batch
of like lines: ``callboard run`` turns it on; a service, where one large request
must not close admission for every small one after it, leaves it off), nothing
is reserved, and ``total -
spent`` could not take the calls the total account refused for lack of room
since it last had nothing reserved (a burst is refused while its first calls
hold the whole total, and their refunds come after it). Only ordinary calls
count there: a refused reservation larger than any ever granted says more of
the request than of the budget. (b) is weighed whenever nothing is reserved
(a refusal then, or the last settlement), and the calls it weighed are then
forgotten.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

from callboard.core.pricing import Price, estimate_nusd

__all__ = [
    "Account",
    "Budgets",
    "Exhausted",
    "Placed",
    "Reserved",
    "Wait",
    "cheapest_call_nusd",
    "dollars",
]


@dataclass(frozen=True, slots=True)
class Reserved:
    """``amount_nusd`` is held for ``task_id``."""

    task_id: int
    tag: str | None
    amount_nusd: int


@dataclass(frozen=True, slots=True)
class Exhausted:
    """A reservation refused: it would take an account over its limit."""

    which: str | None
    """The tag whose budget is short, or None for the total budget."""
    remaining: int
    """What that account could still reserve (0 when it is over its limit)."""
    requested: int = 0

    def __str__(self) -> str:
        """In dollars, as a person reads a budget."""
        which = "the total" if self.which is None else f"the {self.which!r}"
        if self.remaining == 0 == self.requested:  # only when over: a free call fits at 0
            return f"{which} budget is over its limit: no call may start, a free one neither"
        return (
            f"{which} budget has {dollars(self.remaining)} left; "
            f"this call may cost up to {dollars(self.requested)}"
        )


def dollars(nusd: int) -> str:
    """Nano-dollars as dollars, exactly and without trailing zeros: ``$0.00042``."""
    return f"${(Decimal(nusd) / _NANO).normalize():f}"


_NANO = Decimal(1_000_000_000)


@dataclass(frozen=True, slots=True)
class Wait:
    """``Budgets.place``: the plan does not fit now, but would once the reservations
    outstanding are settled: ask again after a settlement."""

    requested: int


@dataclass(frozen=True, slots=True)
class Placed:
    """``Budgets.place``: the plan's models that fit the budget, and the reservation."""

    models: tuple[str, ...]
    """The plan's models (in plan order) whose estimate fits; never empty."""
    reserved: Reserved
    """Covers the dearest of ``models``."""


@dataclass(frozen=True, slots=True)
class Account:
    """A snapshot of one account."""

    limit: int | None
    spent: int
    reserved: int

    @property
    def remaining(self) -> int | None:
        """Room for new reservations (never negative); None: unlimited."""
        if self.limit is None:
            return None
        return max(0, self.limit - self.spent - self.reserved)


class _Ledger:
    __slots__ = ("limit", "reserved", "spent")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.spent = 0
        self.reserved = 0

    def room(self) -> int | None:
        return None if self.limit is None else self.limit - self.spent - self.reserved


def _nusd(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer number of nano-dollars >= 0, got {value!r}")
    return value


class Budgets:
    """The total budget and the per-tag budgets, with reservations."""

    def __init__(
        self,
        total_nusd: int | None,
        per_tag: Mapping[str, int] | None = None,
        *,
        downgrade_when_tight: bool = True,
        cheapest_call_nusd: int = 0,
        close_on_refusals: bool = False,
    ) -> None:
        self._total = _Ledger(None if total_nusd is None else _nusd("total_nusd", total_nusd))
        self.cheapest_call_nusd = _nusd("cheapest_call_nusd", cheapest_call_nusd)
        """A lower bound on any call's reservation: less room than this takes nothing
        (``SharedBudget`` sets it from the models' prices)."""
        self._largest_granted = 0
        """The largest reservation the total account granted."""
        self._turned_away = 0
        """The ordinary reservations (no larger than ``_largest_granted`` was then) the
        total account refused since it last had nothing reserved."""
        self._turned_away_for_good = False
        """Whether, with nothing reserved, what is left could not take ``_turned_away``."""
        self._tags: dict[str, _Ledger] = {}
        for tag, limit in (per_tag or {}).items():
            if not isinstance(tag, str) or not tag:
                raise ValueError(f"budget tags must be non-empty strings, got {tag!r}")
            self._tags[tag] = _Ledger(_nusd(f"per_tag[{tag!r}]", limit))
        self._holds: dict[int, tuple[str | None, int]] = {}
        self._charged: dict[int, int] = {}
        """What each live task was charged already (``charge``): its settle counts the rest."""
        self.downgrade_when_tight = downgrade_when_tight
        """Whether ``place`` may take a cheaper plan member when the first does not fit."""
        self.close_on_refusals = close_on_refusals
        """Whether (b) of the module docstring counts the total as spent."""

    # -- the three operations -----------------------------------------------

    def reserve(self, task_id: int, tag: str | None, amount_nusd: int) -> Reserved | Exhausted:
        """Hold ``amount_nusd`` for ``task_id`` in the total and in ``tag``'s account."""
        amount = _nusd("amount_nusd", amount_nusd)
        if task_id in self._holds:
            raise ValueError(f"task {task_id} already holds a reservation")
        for account in self._accounts(tag):
            room = account.room()
            if room is not None and amount > room:
                which = None
                if account is self._total:
                    if amount <= self._largest_granted:
                        self._turned_away += amount
                        self._weigh()
                else:
                    which = tag
                return Exhausted(which=which, remaining=max(0, room), requested=amount)
        for account in self._accounts(tag):
            account.reserved += amount
        self._holds[task_id] = (tag, amount)
        self._largest_granted = max(self._largest_granted, amount)
        return Reserved(task_id=task_id, tag=tag, amount_nusd=amount)

    def settle(self, task_id: int, actual_nusd: int, *, tag: str | None = None) -> int:
        """Replace ``task_id``'s reservation by its actual cost (always recorded).
        Without a reservation (released earlier, or never made) the cost is charged to
        the total and to ``tag``: money spent is never dropped. Returns how much the
        cost went over the reservation it replaced (0 within it, or without one): a
        provider that bills beyond ``max_tokens``, or a prompt beyond its estimate, is
        charged what it billed, which can take spent past a limit."""
        actual = _nusd("actual_nusd", actual_nusd)
        actual = max(0, actual - self._charged.pop(task_id, 0))  # charged as it came
        held_tag, held = self._holds.pop(task_id, (tag, 0))
        for account in self._accounts(held_tag):
            account.reserved -= held
            account.spent += actual
        self._weigh()
        return actual - held if held and actual > held else 0

    def charge(self, task_id: int, amount_nusd: int) -> bool:
        """What a call of live task ``task_id`` was billed though it served nothing, as
        the task goes on (a retry, a fallback): spent now, in the accounts its
        reservation holds (the total alone without one), the reservation kept
        for the call that follows, and counted off the task's ``settle``. True while
        those accounts hold their reservations within their limits; False when the
        next call would take the spend past one (the task should end there). Settled
        only at the task's end, billed retries took the spend to 1.8x a budget with
        nothing to stop them (found by a hunt)."""
        amount = _nusd("amount_nusd", amount_nusd)
        held_tag, _ = self._holds.get(task_id, (None, 0))
        accounts = self._accounts(held_tag)
        for account in accounts:
            account.spent += amount
        self._charged[task_id] = self._charged.get(task_id, 0) + amount
        return all((room := account.room()) is None or room >= 0 for account in accounts)

    def release(self, task_id: int) -> bool:
        """Drop ``task_id``'s reservation (no call was made); False if it held none."""
        hold = self._holds.pop(task_id, None)
        if hold is None:
            return False
        tag, amount = hold
        for account in self._accounts(tag):
            account.reserved -= amount
        self._weigh()
        return True

    def _weigh(self) -> None:
        """With nothing reserved: could what is left take the calls turned away?"""
        total = self._total
        if total.reserved or not self._turned_away or total.limit is None:
            return
        if total.limit - total.spent < self._turned_away:
            self._turned_away_for_good = True
        self._turned_away = 0

    # -- reading ---------------------------------------------------------------

    @property
    def spent(self) -> int:
        return self._total.spent

    @property
    def reserved(self) -> int:
        return self._total.reserved

    def remaining(self, tag: str | None = None) -> int | None:
        """What a new reservation under ``tag`` could take (the tighter of the total
        and the tag's account; never negative); None: unlimited."""
        rooms = [r for r in (a.room() for a in self._accounts(tag)) if r is not None]
        return max(0, min(rooms)) if rooms else None

    def account(self, tag: str | None = None) -> Account | None:
        """A snapshot of the total (``tag=None``) or of a tag's budget (None: the tag
        has no budget of its own; its spending is not tracked apart, which keeps
        memory bounded however many tags callers invent)."""
        ledger = self._total if tag is None else self._tags.get(tag)
        if ledger is None:
            return None
        return Account(limit=ledger.limit, spent=ledger.spent, reserved=ledger.reserved)

    def should_stop(self) -> bool:
        """True once the total budget is spent: it reached the total, or what is left
        can take no more calls (see the module docstring). The system may stop itself."""
        total = self._total
        if total.limit is None:
            return False
        left = total.limit - total.spent
        if left <= 0 or left < self.cheapest_call_nusd:
            return True
        return self.close_on_refusals and self._turned_away_for_good

    def leaves_unsent(self, refusal: Exhausted) -> bool:
        """Whether a task the total refused is left unsent rather than failed: with
        ``close_on_refusals`` (a batch of like lines), once the total is spent, a call
        a whole budget could pay goes to the next run, which starts with the budget
        anew; one larger than the whole total fails (no run could send it)."""
        total = self._total
        return (
            self.close_on_refusals
            and refusal.which is None
            and total.limit is not None
            and refusal.requested <= total.limit
            and self.should_stop()
        )

    # -- choosing a model that fits ---------------------------------------------

    def place(
        self,
        task_id: int,
        tag: str | None,
        models: Sequence[str],
        prices: Mapping[str, Price],
        *,
        prompt_tokens: int,
        max_tokens: int,
        cache_writes: bool = True,
    ) -> Placed | Wait | Exhausted:
        """Reserve for a plan: ``models`` are its candidates then fallbacks, in order.

        The queue may dispatch to any model of a plan, so the reservation covers
        the dearest model kept, and models whose estimate does not fit the room
        left are dropped. When the first model does not fit, the rest are kept
        only if ``downgrade_when_tight``; else the plan must ``Wait`` for the money
        reserved to be settled if that would make room, and is ``Exhausted`` if not.
        ``cache_writes``: a call may write the prompt cache (``pricing.writes_cache``),
        so its prompt is reserved at the cache-write price where that is dearer.
        """
        if not models:
            raise ValueError("place needs at least one model")
        cost = {
            m: estimate_nusd(prices[m], prompt_tokens, max_tokens, cache_writes=cache_writes)
            for m in models
        }
        rooms = [r for r in (a.room() for a in self._accounts(tag)) if r is not None]
        room = min(rooms) if rooms else None  # below 0 while over: a free model fits no
        # more than a dear one (kept at the clamped 0, its reservation was refused, and
        # an assertion failed in the router; found by a hunt)
        kept = [m for m in models if room is None or cost[m] <= room]
        if not kept or (kept[0] != models[0] and not self.downgrade_when_tight):
            asked = cost[models[0]] if kept else min(cost.values())
            if self._fits_once_settled(tag, asked):
                return Wait(requested=asked)
            refused = self.reserve(task_id, tag, asked)  # more than the room: names the account
            assert isinstance(refused, Exhausted), refused
            return refused
        answer = self.reserve(task_id, tag, max(cost[m] for m in kept))
        assert isinstance(answer, Reserved), answer  # every kept estimate fits the room
        return Placed(models=tuple(kept), reserved=answer)

    def _fits_once_settled(self, tag: str | None, amount: int) -> bool:
        """Whether ``amount`` would fit every account it is short in once that account's
        reservations were settled (each holds money reserved: without it, waiting
        brings nothing)."""
        for account in self._accounts(tag):
            room = account.room()
            if room is not None and amount > room:
                assert account.limit is not None  # a room means a limit
                if not account.reserved or account.limit - account.spent < amount:
                    return False
        return True

    def _accounts(self, tag: str | None) -> tuple[_Ledger, ...]:
        """The total, then the tag's account when the tag has a budget."""
        account = None if tag is None else self._tags.get(tag)
        return (self._total,) if account is None else (self._total, account)


def cheapest_call_nusd(prices: Mapping[str, Price]) -> int:
    """A lower bound on any call's reservation with these prices: one prompt token and
    one completion token on the cheapest model (0 with no models)."""
    return min((estimate_nusd(p, 1, 1, cache_writes=False) for p in prices.values()), default=0)
