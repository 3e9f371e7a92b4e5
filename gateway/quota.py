"""Per-key and per-tenant quotas: rpm, tpm and requests in flight that a request waits
for, budgets that refuse it.

Theory of operation
-------------------
A *scope* is one key, or one tenant (all its keys together), that has limits
(``settings.Limits``: ``rpm``, ``tpm``, ``max_parallel``, ``budget_usd``). A request belongs to its
key's scope and to its tenant's, where they have limits; a request with neither
is admitted at once and holds nothing.

``QuotaBook`` decides, pure (no asyncio; ``now`` is given, monotonic, and the budgets'
periods read the injected ``wall`` clock, UTC):

* ``arrive(now, key, tenant, need, deadline_at)`` answers ``Admitted(ticket)``,
  ``Queued(id)`` or ``Refused``. The budget first: the request's upper bound
  (``Need.cost_nusd``: prompt + ``max_tokens`` at the dearest price it could
  reach) is reserved in every scope that has a budget, or in none. One that
  would not fit even once every reservation there is settled is refused
  (``OVER_BUDGET``, at once: waiting does not make money; a budget that renews says
  when, as ``Retry-After``, with no retry now); one that would waits for the
  settlements, in arrival order per budget, up to its deadline (an upper bound
  comes back mostly unspent). Then the rates: the
  request goes now only if nobody waits in any of its scopes (first in, first
  out: nobody overtakes, so a large request is never starved by small ones) and
  each scope's ``RateLimiter`` admits it now (``available_at``); the limiters are
  then acquired together, so neither is held while the other is waited for.
  Else it waits in each scope's queue, unless one of them holds ``queue_bound``
  waiters already (``QUEUE_FULL``) or its deadline is certainly missed
  (``DEADLINE``), both with the time to try again; a request larger than a
  scope's tpm can never go (``TOO_LARGE``).
* ``pump(now)`` says what became of the waiters: a waiter goes when it is first
  in each of its queues and each limiter admits it (at its deadline still, never
  after); one whose deadline passed is refused. ``wake_at(now)`` says when
  pumping next could change anything (the earliest time a first waiter could
  go, or a deadline), so the driver sets one timer and never polls.
* ``leave(id)``: a waiter's client left; its budget is released, it holds nothing.
* ``settle``, ``release``, ``forfeit`` end an admitted ticket exactly once: the
  usage and cost replace the reservations; nothing was sent (everything back,
  the request included); or the outcome is unknown (the reservations count as
  spent, the upper bound).

A budget is held per period (``_Purse``): with a ``budget_period`` the scope's
purse is replaced by an empty one when the wall clock enters a new period
(``settings.BudgetPeriod.bounds``: UTC, never from when the gateway started), and
only forward (a clock stepped back keeps the current one). A ticket and a waiter
hold the purses they reserved in, so a request admitted before a period's end is
settled (or released) in that period even when it ends after it; the new period
starts with nothing spent or held. Each settlement is also noted as unrecorded
spend of its purse (``unrecorded()``, then ``recorded()`` once the driver wrote it
to the spend file); ``seen(purse, total)`` takes in what the file holds, spend
other gateways (or earlier runs) settled, as spent.

A scope's limiter lets the whole minute go at once (``burst_s`` of 60 s): the
limit is a client's quota, not a provider's pace (each model's own limiter
paces the calls). So ``rpm = 60`` admits 60 requests at once, then the 61st
when the first leaves the 60 s window.

A scope's ``max_parallel`` counts its open tickets (``_Scope.open``): at the cap,
the next request waits in the scope's queue, like one over a rate, until a ticket
ends (``settle``/``release``/``forfeit`` pump the book). When that will be is not
known (``available_at`` says ``inf``), so such a wait is never refused before its
deadline, and a refusal says no ``Retry-After`` of its own (the driver's
``retry_after_s``).

A waiter stands in its key's queue first, and in its tenant's only once it is
first in its key's and the key would admit it: one waiting for its own key's
limit does not hold its tenant's queue for the tenant's other keys. So a tenant
admits its keys' requests in arrival order among those their keys would admit,
and each key admits its own in arrival order. No queue waits on another
forever: a key belongs to one tenant, every queue is in arrival order, and the
first waiter of a tenant is the first of its key too.

A deadline is refused before it passes only when that is certain: when the
limiters have no reservation outstanding (a settlement may refund tokens, a
release a request), the time they give is the earliest the request could go.

``Quotas`` is the asyncio driver the gateway's handlers call: ``await
admit(...)`` -> ``Ticket`` (or ``OverQuota``, carrying the 429), then ``settle``
/ ``follow`` / ``release`` / ``forfeit``. It runs on the gateway's event loop
only; time comes from an injected clock, wall clock and ``Timer``. With a spend
store (``spend.SpendFile``) it reads each budgeted scope's spend from the file
before the book reserves (so gateways sharing the file share their settled
spend) and writes the charges of the tickets ended in a turn of the loop at the
end of that turn, in one transaction (``flush`` writes them at once, before the
file closes); a store that fails is logged and the book goes on from memory
(charges not written are written with the next).

What always holds: requests admitted for a scope in any 60 s <= its rpm; tokens
<= its tpm once settled; spent + reserved <= its budget, in each period, at every
reservation (a settlement above its reservation, which an upper bound forbids, is
the only way over; gateways sharing a spend file see each other's settled spend,
not each other's reservations, so together they may go over by what the others
hold in flight); a cost counts in the period its request was admitted in; a key
admits its waiters in arrival order, and a tenant its keys' waiters in arrival
order among those their keys would admit; a waiter refused or gone, and a
ticket ended, hold nothing; nothing waits unbounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Protocol, TypeGuard

from callboard.core.budget import Budgets, Exhausted, dollars
from callboard.core.limiter import WINDOW_S, Admit, LimiterConfig, RateLimiter, Reservation
from callboard.core.pricing import NUSD_PER_USD, Price, estimate_nusd, marks_cache, usd_to_nusd
from callboard.core.settings import ModelSettings
from callboard.core.tokens import GPT_4O_IMAGES, ImageRule, count_chat_tokens, text_tokens
from callboard.gateway.errors import ApiError
from callboard.gateway.keys import Caller
from callboard.gateway.settings import GatewaySettings, Limits
from callboard.gateway.spend import Charge, SpendFileError, SpendStore
from callboard.messages import EmbeddingResult, Request, Result
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.shared_budget import OverReserved

__all__ = [
    "Admitted",
    "Alarm",
    "Estimate",
    "LoopTimer",
    "Need",
    "OverQuota",
    "Queued",
    "QuotaBook",
    "QuotaStats",
    "Quotas",
    "Refused",
    "ScopeStats",
    "Ticket",
    "Timer",
    "Why",
    "chat_estimate",
    "embed_estimate",
    "reachable_prices",
]

log = guarded_logger(__name__)


def _default_max_tokens() -> int:
    default = next(f.default for f in dataclasses.fields(Request) if f.name == "max_tokens")
    assert isinstance(default, int)
    return default


DEFAULT_MAX_TOKENS = _default_max_tokens()
"""What a request that names no ``max_tokens`` reserves (``Request``'s default)."""
STEPPED_BACK_S = 60.0
"""How far before its budget period's start the clock may step back and the period
stand (NTP's slews and small steps); further, the budget takes the period it reads."""
RECENT_PURSES = 3
"""A scope's purses of periods it left that it keeps, for a clock that comes back."""


# -- what the book decides ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Need:
    """What one request may take."""

    tokens: int
    """Prompt estimate + completion cap (>= 1): what the tpm limits reserve."""
    cost_nusd: int = 0
    """Upper bound on its cost, in nano-USD: what the budgets reserve."""

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"tokens must be an integer >= 1, got {self.tokens!r}")
        cost = self.cost_nusd
        if isinstance(cost, bool) or not isinstance(cost, int) or cost < 0:
            raise ValueError(f"cost_nusd must be an integer >= 0, got {cost!r}")


class Why(enum.Enum):
    """Why a request was refused."""

    QUEUE_FULL = "queue_full"
    """``queue_bound`` requests wait for the scope already."""
    DEADLINE = "deadline"
    """Its deadline passed while it waited, or certainly will."""
    TOO_LARGE = "too_large"
    """It needs more tokens than the scope's tpm: no wait can admit it."""
    OVER_BUDGET = "over_budget"
    """Its upper bound does not fit what is left of a budget."""
    STOPPING = "stopping"
    """The gateway is shutting down: what still waits is turned away (``turn_away``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    """An admitted request's claim on its scopes; ended exactly once (``settle``,
    ``release`` or ``forfeit``)."""

    id: int
    deadline_at: float
    """When its wait would have ended (monotonic seconds)."""
    admitted_at: float
    need: Need
    holds: tuple[tuple[_Scope, Reservation | None], ...] = dataclasses.field(default=(), repr=False)
    """Each scope and its limiter reservation (None: the scope has no rpm/tpm)."""
    purses: tuple[_Purse, ...] = dataclasses.field(default=(), repr=False)
    """The budgets (each of one period) its cost was reserved in."""


@dataclass(frozen=True, slots=True)
class Admitted:
    ticket: Ticket


@dataclass(frozen=True, slots=True)
class Queued:
    id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    why: Why
    scope: str
    """Whose limit: ``key 'a'`` or ``tenant 't'``."""
    detail: str
    retry_after_s: float | None = None
    """When trying again may succeed, if that is known."""


Decision = Admitted | Queued | Refused


@dataclass(frozen=True, slots=True, kw_only=True)
class ScopeStats:
    """One key's or tenant's quotas, as they stand."""

    kind: str
    """``key`` or ``tenant``."""
    name: str
    waiting: int
    """Requests waiting for its rpm/tpm."""
    rpm: int | None
    tpm: int | None
    requests_room: float | None
    """Requests it could admit now (None: no rpm)."""
    tokens_room: float | None
    """Tokens it could admit now (None: no tpm)."""
    in_flight: int
    """Its requests admitted and not yet ended."""
    max_parallel: int | None
    """The most it may have in flight at once (None: no limit)."""
    budget_usd: Decimal | None
    spent_usd: Decimal | None
    """Settled cost (None: no budget)."""
    reserved_usd: Decimal | None
    """Held for requests not yet settled (None: no budget)."""
    budget_period: str | None = None
    """How often the budget renews (``1d``, ``1mo``; None: never, or no budget)."""
    period_started_at: str | None = None
    """When the current period began (ISO 8601, UTC; None: no period)."""
    period_ends_at: str | None = None
    """When it ends and the spend starts again from nothing (ISO 8601, UTC)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QuotaStats:
    """``Quotas.statistics()``: every scope with limits."""

    waiting: int
    """Requests waiting, all scopes together."""
    scopes: tuple[ScopeStats, ...]


_FOREIGN = -1
"""The task id of spend charged from the spend file (no ticket's: they count from 1)."""


class _Purse:
    """One scope's budget for one period (``start`` = ``ends`` = None: no period)."""

    __slots__ = ("budget", "ends", "period", "recorded", "scope_id", "start")

    def __init__(
        self, scope_id: str, limit_nusd: int, period: str, bounds: tuple[int, int] | None
    ) -> None:
        self.scope_id = scope_id
        self.period = period
        self.start: int | None = None if bounds is None else bounds[0]
        self.ends: int | None = None if bounds is None else bounds[1]
        self.budget = Budgets(limit_nusd)
        self.recorded = 0
        """What the spend file holds for this purse, as far as the book knows."""

    def charge(self, nusd: int) -> Charge:
        return Charge(
            scope=self.scope_id,
            period=self.period,
            start=0 if self.start is None else self.start,
            ends=self.ends,
            nusd=nusd,
        )

    def __repr__(self) -> str:
        return f"<purse {self.scope_id} {self.period or 'for good'} from {self.start}>"


class _Scope:
    """One key's or tenant's limiter, budget and queue of waiters."""

    __slots__ = (
        "budget_nusd",
        "id",
        "kind",
        "label",
        "limiter",
        "limits",
        "name",
        "open",
        "parallel",
        "purse",
        "queue",
        "recent",
    )

    def __init__(self, kind: str, name: str, limits: Limits, now: float, utc: float) -> None:
        self.kind = kind
        self.name = name
        self.label = f"{kind} {name!r}"
        self.id = f"{kind}:{name}"
        """The scope's name in the spend file."""
        self.limits = limits
        self.limiter: RateLimiter | None = None
        if limits.rpm is not None or limits.tpm is not None:
            # the whole minute may go at once: a client's quota, not a provider to pace
            config = LimiterConfig(rpm=limits.rpm, tpm=limits.tpm, burst_s=WINDOW_S)
            self.limiter = RateLimiter(config, now)
        self.parallel = limits.max_parallel
        self.open = 0
        """Its tickets not yet ended."""
        usd = limits.budget_usd
        self.budget_nusd = 0 if usd is None else usd_to_nusd(usd)
        self.purse: _Purse | None = None
        """Its budget in the current period (None: no budget)."""
        if usd is not None:
            period = limits.budget_period
            bounds = None if period is None else period.bounds(utc)
            text = "" if period is None else str(period)
            self.purse = _Purse(self.id, self.budget_nusd, text, bounds)
        self.recent: dict[int, _Purse] = {}
        """Its latest periods' purses by start (``RECENT_PURSES``): a clock stepped back
        over a boundary and set right again finds the spend it left."""
        self.queue: deque[_Waiter] = deque()

    @property
    def budget(self) -> Budgets | None:
        """Its budget in the current period (None: no budget)."""
        return None if self.purse is None else self.purse.budget

    @property
    def paced(self) -> bool:
        """Whether a request may wait for it: it has an rpm, a tpm or a ``max_parallel``."""
        return self.limiter is not None or self.parallel is not None

    def available_at(self, now: float, tokens: int) -> float:
        """When it would admit a request of ``tokens`` (<= now: now; ``inf``: once one
        of its requests in flight ends, at ``max_parallel``)."""
        if self.parallel is not None and self.open >= self.parallel:
            return math.inf
        return now if self.limiter is None else self.limiter.available_at(now, tokens)

    def purse_at(self, utc: float) -> _Purse:
        """Its budget in the period holding ``utc``: a new, empty one once the clock
        has passed the current one's end. A clock stepped back a little keeps it; one
        stepped back more than ``STEPPED_BACK_S`` before its start takes the period it
        now reads (a gateway started while its clock ran a year ahead, then set right
        by NTP, kept a period a year away and refused a daily budget for the year; a
        hunt): its spend so far is the spend file's for that period, if there is one."""
        purse = self.purse
        assert purse is not None, self
        period = self.limits.budget_period
        if period is None or purse.ends is None or purse.start is None:
            return purse
        if utc >= purse.ends or utc < purse.start - STEPPED_BACK_S:
            if utc < purse.start:
                log.warning(
                    "%s: the clock stepped back %.0f s before its budget's period: the "
                    "budget now counts the period it reads",
                    self.label,
                    purse.start - utc,
                )
            self.recent[purse.start] = purse
            bounds = period.bounds(utc)
            purse = self.recent.pop(bounds[0], None) or _Purse(
                self.id, self.budget_nusd, purse.period, bounds
            )
            while len(self.recent) >= RECENT_PURSES:  # the oldest go
                del self.recent[min(self.recent)]
            self.purse = purse
        return purse

    def __repr__(self) -> str:
        return f"<scope {self.label}>"


class _Waiter:
    __slots__ = ("budgeted", "deadline_at", "id", "need", "purses", "queued", "rated", "short")

    def __init__(
        self,
        id: int,  # noqa: A002 - the ticket's id
        need: Need,
        deadline_at: float,
        rated: tuple[_Scope, ...],
        budgeted: tuple[_Scope, ...],
        *,
        purses: tuple[_Purse, ...],
    ) -> None:
        self.id = id
        self.need = need
        self.deadline_at = deadline_at
        self.rated = rated
        """Its scopes with a rate or a ``max_parallel``, its key's first: the queues it
        waits in."""
        self.queued = 0
        """How many of ``rated`` it stands in the queue of (its key's first; its
        tenant's once its key would admit it: ``QuotaBook._stand``)."""
        self.budgeted = budgeted
        """Its scopes with a budget."""
        self.purses = purses
        """Their budgets (each of the period it arrived in), which hold its reservation."""
        self.short: tuple[_Scope, ...] = ()
        """Of ``budgeted``, those whose money it waits for (``QuotaBook._fund``)."""


class QuotaBook:
    """The scopes, their queues and the open tickets (see the module docstring)."""

    def __init__(
        self, settings: GatewaySettings, now: float, *, wall: Callable[[], float] = time.time
    ) -> None:
        self.queue_bound = settings.queue_bound
        self._wall = wall
        """UTC (Unix seconds): which period a budget is in."""
        utc = wall()
        self._keys = {
            k.name: _Scope("key", k.name, k.limits, now, utc)
            for k in settings.keys
            if k.limits.limited
        }
        self._tenants = {
            name: _Scope("tenant", name, limits, now, utc)
            for name, limits in settings.tenants.items()
            if limits.limited
        }
        self._scopes: dict[tuple[str, str | None], tuple[_Scope, ...]] = {}
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiter] = {}
        self._deadlines: list[tuple[float, int]] = []
        """(deadline_at, id) of the waiters; entries of waiters gone are skipped."""
        self._busy: dict[_Scope, None] = {}
        """The scopes with waiters, in the order they got them."""
        self._open: dict[int, Ticket] = {}
        self.over_reserved = OverReserved("a key's or a tenant's budget")
        """Requests settled at more than they reserved (a warning says so)."""
        self._unfunded: dict[int, _Waiter] = {}
        """The requests waiting for money that requests in flight hold, in arrival order
        (``_wait_for_money``)."""
        self._unrecorded: dict[_Purse, int] = {}
        """Spend settled since the driver last wrote it to the spend file, by purse."""

    # -- reading -------------------------------------------------------------------------

    def scopes(self, key: str, tenant: str | None) -> tuple[_Scope, ...]:
        """The scopes with limits that a request of ``key`` (of ``tenant``) is in."""
        found = self._scopes.get((key, tenant))
        if found is None:
            both = (self._keys.get(key), None if tenant is None else self._tenants.get(tenant))
            found = self._scopes[key, tenant] = tuple(s for s in both if s is not None)
        return found

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def waiting_in(self) -> dict[str, int]:
        """How many wait, by scope (``key 'a'``, ``tenant 't'``), for those with any."""
        return {s.label: len(s.queue) for s in self._busy}

    @property
    def open_tickets(self) -> int:
        return len(self._open)

    def statistics(self, now: float, *, of: tuple[str, str | None] | None = None) -> QuotaStats:
        """A snapshot of every scope: who waits, the room left, the money (in the
        current period); of one key's and its tenant's scopes only when ``of`` names
        them (``(key, tenant)``: ``waiting`` then counts the waiting requests that any
        of those scopes limits)."""
        scopes = []
        utc = self._wall()
        shown = (*self._keys.values(), *self._tenants.values())
        waiting = len(self._waiting)
        if of is not None:
            shown = self.scopes(*of)
            waiting = sum(
                1
                for w in self._waiting.values()
                if any(s in shown for s in (*w.rated, *w.budgeted))
            )
        for s in shown:
            room = None if s.limiter is None else s.limiter.headroom(now)
            purse = None if s.purse is None else s.purse_at(utc)
            budget = None if purse is None else purse.budget
            scopes.append(
                ScopeStats(
                    kind=s.kind,
                    name=s.name,
                    waiting=len(s.queue),
                    rpm=s.limits.rpm,
                    tpm=s.limits.tpm,
                    requests_room=None if room is None else room.requests,
                    tokens_room=None if room is None else room.tokens,
                    in_flight=s.open,
                    max_parallel=s.parallel,
                    budget_usd=s.limits.budget_usd,
                    spent_usd=None if budget is None else _usd(budget.spent),
                    reserved_usd=None if budget is None else _usd(budget.reserved),
                    budget_period=None if purse is None else purse.period or None,
                    period_started_at=None if purse is None else _iso(purse.start),
                    period_ends_at=None if purse is None else _iso(purse.ends),
                )
            )
        return QuotaStats(waiting=waiting, scopes=tuple(scopes))

    # -- arriving ------------------------------------------------------------------------

    def arrive(
        self, now: float, key: str, tenant: str | None, need: Need, deadline_at: float
    ) -> Decision:
        """A request of ``key``: admitted now, queued, or refused (see the docstring)."""
        tid = next(self._ids)
        scopes = self.scopes(key, tenant)
        rated = tuple(s for s in scopes if s.paced)
        for s in rated:
            tpm = s.limits.tpm
            if tpm is not None and need.tokens > tpm:
                return Refused(
                    why=Why.TOO_LARGE,
                    scope=s.label,
                    detail=f"this request may take {need.tokens} tokens (prompt + "
                    f"max_tokens), more than the {tpm} tokens per minute of {s.label}",
                )
        budgeted = tuple(s for s in scopes if s.purse is not None)
        purses = self._reserve(tid, budgeted, need.cost_nusd)
        if isinstance(purses, Refused):
            if not self._held_back(budgeted, need.cost_nusd):
                return purses  # it cannot fit even once what is held is settled
            waiter = _Waiter(tid, need, deadline_at, rated, budgeted, purses=())
            return self._wait_for_money(waiter, self._lacking(waiter) or budgeted)
        behind = self._behind(budgeted) if self._unfunded else ()
        if behind:  # no overtaking those who wait
            for purse in purses:
                purse.budget.release(tid)
            waiter = _Waiter(tid, need, deadline_at, rated, budgeted, purses=())
            return self._wait_for_money(waiter, behind)
        waiter = _Waiter(tid, need, deadline_at, rated, budgeted, purses=purses)
        return self._enter(now, waiter)

    def _enter(self, now: float, waiter: _Waiter) -> Decision:
        """The rates' word on ``waiter``, its money reserved: admitted now, queued (in
        its key's queue, and its tenant's if its key would admit it), or refused."""
        rated = waiter.rated
        at = self._ready_at(now, waiter)
        if at <= now and not any(s.queue for s in rated):
            return Admitted(self._admit(now, waiter))
        full = [s for s in rated if len(s.queue) >= self.queue_bound]
        if full:
            self._unreserve(waiter)
            return Refused(
                why=Why.QUEUE_FULL,
                scope=full[0].label,
                detail=f"{full[0].label} is over its rate limit "
                f"({_rates(full[0].limits)}) and {len(full[0].queue)} requests wait for it "
                "already",
                retry_after_s=self._room_after(now, full, waiter),
            )
        if at > waiter.deadline_at and self._certain(waiter):
            self._unreserve(waiter)
            return self._late(now, waiter, at)
        self._waiting[waiter.id] = waiter
        self._stand(waiter)
        if self._key_ready(now, waiter):
            self._stand(waiter)
        self._mind_deadline(waiter)
        return Queued(waiter.id)

    def _mind_deadline(self, waiter: _Waiter) -> None:
        heapq.heappush(self._deadlines, (waiter.deadline_at, waiter.id))
        if len(self._deadlines) > 2 * len(self._waiting) + 64:  # entries of waiters gone
            self._deadlines = [(w.deadline_at, w.id) for w in self._waiting.values()]
            heapq.heapify(self._deadlines)

    # -- waiting for money -------------------------------------------------------------

    def _held_back(self, budgeted: Sequence[_Scope], cost: int) -> bool:
        """Whether ``cost`` would fit every budget once what is reserved there is settled
        (what requests in flight hold may come back: their bound is an upper bound)."""
        utc = self._wall()
        return all(s.purse_at(utc).budget.spent + cost <= s.budget_nusd for s in budgeted)

    def _behind(self, budgeted: Sequence[_Scope]) -> tuple[_Scope, ...]:
        """Those of ``budgeted`` whose money a request waits for (a later one waits
        behind it: a large request is not starved by small ones). Only the budgets it is
        short of: a key waiting for its own budget held every other key of its tenant
        that shared the tenant's (found by a review)."""
        short = {s for w in self._unfunded.values() for s in w.short}
        return tuple(s for s in budgeted if s in short)

    def _lacking(self, waiter: _Waiter) -> tuple[_Scope, ...]:
        """The budgets that cannot take ``waiter``'s reservation now."""
        utc, cost = self._wall(), waiter.need.cost_nusd
        return tuple(s for s in waiter.budgeted if not self._fits(s, utc, cost))

    def _wait_for_money(self, waiter: _Waiter, short: tuple[_Scope, ...]) -> Queued | Refused:
        """Queue ``waiter`` until settlements leave its ``short`` budgets room
        (``_fund``): a request the budget refused only for what requests in flight held
        was answered ``insufficient_quota``, not to be retried, with the money nearly all
        unspent (found by a hunt). Refused if ``queue_bound`` requests wait for that
        money already."""
        scope = short[0]
        waiting = sum(1 for w in self._unfunded.values() if scope in w.short)
        if waiting >= self.queue_bound:
            return Refused(
                why=Why.QUEUE_FULL,
                scope=scope.label,
                detail=f"the budget of {scope.label} is held by requests in flight, and "
                f"{waiting} requests wait for it already",
            )
        waiter.short = short
        self._unfunded[waiter.id] = waiter
        self._waiting[waiter.id] = waiter
        self._mind_deadline(waiter)
        return Queued(waiter.id)

    def _fund(self, now: float, decided: list[tuple[int, Admitted | Refused]]) -> None:
        """Reserve the money of the requests waiting for it, in arrival order per budget
        (a later one never takes what an earlier one waits for); each then goes on to its
        rates (``_enter``). One that no longer fits once everything held is settled
        (what was held was spent) is refused for good."""
        blocked: set[_Scope] = set()
        for waiter in list(self._unfunded.values()):
            if waiter.deadline_at < now or blocked.intersection(waiter.budgeted):
                continue  # past its deadline: refused by _expire
            cost = waiter.need.cost_nusd
            purses = self._reserve(waiter.id, waiter.budgeted, cost)
            if isinstance(purses, Refused) and self._held_back(waiter.budgeted, cost):
                waiter.short = self._lacking(waiter) or waiter.short
                blocked.update(waiter.short)  # what it waits for: no later one takes it
                continue
            del self._unfunded[waiter.id]
            del self._waiting[waiter.id]
            if isinstance(purses, Refused):
                decided.append((waiter.id, purses))
                continue
            waiter.purses = purses
            decision = self._enter(now, waiter)
            if not isinstance(decision, Queued):
                decided.append((waiter.id, decision))

    def _short(self, waiter: _Waiter) -> Refused:
        """The refusal of a request whose deadline came while it waited for money."""
        held = self._lacking(waiter) or waiter.budgeted
        label = " and ".join(s.label for s in held)
        return Refused(
            why=Why.DEADLINE,
            scope=label,
            detail=f"the budget of {label} was held by requests in flight until this "
            f"request's deadline; it may cost up to {dollars(waiter.need.cost_nusd)}",
        )

    @staticmethod
    def _fits(s: _Scope, utc: float, cost: int) -> bool:
        budget = s.purse_at(utc).budget
        return budget.spent + budget.reserved + cost <= s.budget_nusd

    def _reserve(
        self, tid: int, budgeted: Sequence[_Scope], cost: int
    ) -> tuple[_Purse, ...] | Refused:
        """Hold ``cost`` in each scope's budget of the current period, or in none."""
        if not budgeted:
            return ()
        utc = self._wall()
        held: list[_Purse] = []
        for s in budgeted:
            purse = s.purse_at(utc)
            answer = purse.budget.reserve(tid, None, cost)
            if isinstance(answer, Exhausted):
                for h in held:
                    h.budget.release(tid)
                return Refused(
                    why=Why.OVER_BUDGET,
                    scope=s.label,
                    detail=f"the budget of {s.label} ({dollars(s.budget_nusd)}{_per(purse)}) "
                    f"has {dollars(answer.remaining)} left{_until(purse)}; this request may "
                    f"cost up to {dollars(answer.requested)}",
                    retry_after_s=None if purse.ends is None else max(0.0, purse.ends - utc),
                )
            held.append(purse)
        return tuple(held)

    # -- the spend file ----------------------------------------------------------------

    def purses(self, scopes: Iterable[_Scope] | None = None) -> tuple[_Purse, ...]:
        """The current period's budget of each of ``scopes`` (default: every scope)
        that has one."""
        utc = self._wall()
        every = (*self._keys.values(), *self._tenants.values()) if scopes is None else scopes
        return tuple(s.purse_at(utc) for s in every if s.purse is not None)

    def seen(self, purse: _Purse, total: int) -> None:
        """The spend file holds ``total`` for ``purse``'s period: what it holds beyond
        what the book knows of (others' settlements, an earlier run's) counts as spent."""
        foreign = total - purse.recorded
        if foreign > 0:
            purse.budget.settle(_FOREIGN, foreign)
            purse.recorded = total

    def unrecorded(self) -> tuple[Charge, ...]:
        """Spend settled that the spend file does not hold yet, a charge per purse."""
        return tuple(p.charge(n) for p, n in self._unrecorded.items() if n)

    def recorded(self) -> None:
        """What ``unrecorded()`` said is in the spend file now."""
        for purse, nusd in self._unrecorded.items():
            purse.recorded += nusd
        self._unrecorded.clear()

    # -- time passing --------------------------------------------------------------------

    def pump(self, now: float) -> list[tuple[int, Admitted | Refused]]:
        """Admit the waiters that can go now (one due at its deadline still goes), then
        refuse those whose deadline passed; again while that lets others move up."""
        decided: list[tuple[int, Admitted | Refused]] = []
        while True:  # until nothing moves: a refusal gives money back for those who wait
            before = len(decided)  # for it (found by the state machine)
            self._fund(now, decided)
            self._admit_ready(now, decided)
            self._expire(now, decided)
            if len(decided) == before:
                return decided

    def _admit_ready(self, now: float, decided: list[tuple[int, Admitted | Refused]]) -> None:
        moved = True
        while moved:
            moved = False
            for s in list(self._busy):
                if not s.queue:
                    continue
                waiter = s.queue[0]
                if waiter.deadline_at < now:
                    continue  # past its deadline: refused by _expire, never admitted late
                if self._key_ready(now, waiter):  # its key would admit it: on to its tenant
                    self._stand(waiter)
                    moved = True
                    continue
                if not self._first(waiter):
                    continue
                at = self._ready_at(now, waiter)
                if at <= now:
                    self._drop(waiter, keep_budget=True)
                    decided.append((waiter.id, Admitted(self._admit(now, waiter))))
                    moved = True
                elif at > waiter.deadline_at and self._certain(waiter):
                    decided.append((waiter.id, self._late(now, waiter, at)))
                    self._drop(waiter)
                    moved = True

    def _expire(self, now: float, decided: list[tuple[int, Admitted | Refused]]) -> None:
        """Refuse the waiters whose deadline passed."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, tid = heapq.heappop(self._deadlines)
            waiter = self._waiting.get(tid)
            if waiter is not None:
                if waiter.id in self._unfunded:
                    decided.append((tid, self._short(waiter)))
                else:
                    decided.append((tid, self._late(now, waiter, self._ready_at(now, waiter))))
                self._drop(waiter)

    def wake_at(self, now: float) -> float | None:
        """When ``pump`` could next decide something (None: nothing waits)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][1] not in self._waiting:
            heapq.heappop(deadlines)  # a waiter gone
        at = deadlines[0][0] if deadlines else math.inf
        for s in self._busy:
            waiter = s.queue[0]
            if self._first(waiter):
                at = min(at, self._ready_at(now, waiter))
            elif waiter.queued < len(waiter.rated) and s is waiter.rated[0]:
                at = min(at, self._key_at(now, waiter))  # when it moves on to its tenant
        if self._unfunded:  # a budget that renews has room again from its next period
            utc = self._wall()
            ends = (
                s.purse_at(utc).ends for w in self._unfunded.values() for s in w.short if s.purse
            )
            renews = min((e for e in ends if e is not None), default=None)
            if renews is not None:
                at = min(at, now + max(0.0, renews - utc))
        return None if at == math.inf else at

    def leave(self, tid: int) -> bool:
        """The waiter ``tid`` is gone (its client left): it holds nothing any more.
        False if it was not waiting (admitted or refused already)."""
        waiter = self._waiting.get(tid)
        if waiter is None:
            return False
        self._drop(waiter)
        return True

    # -- ending a ticket -----------------------------------------------------------------

    def settle(self, now: float, ticket: Ticket, tokens: int, cost_nusd: int) -> bool:
        """The call ended having used ``tokens`` and cost ``cost_nusd``; False if the
        ticket was ended already."""
        if self._open.pop(ticket.id, None) is None:
            return False
        for s, reservation in ticket.holds:
            s.open -= 1
            if s.limiter is not None and reservation is not None:
                s.limiter.settle(now, reservation, tokens)
        for purse in ticket.purses:
            self.over_reserved.saw(
                f"request {ticket.id}", purse.budget.settle(ticket.id, cost_nusd)
            )
            if cost_nusd:
                self._unrecorded[purse] = self._unrecorded.get(purse, 0) + cost_nusd
        return True

    def release(self, now: float, ticket: Ticket) -> bool:
        """Nothing was sent: everything reserved comes back (the request too)."""
        if self._open.pop(ticket.id, None) is None:
            return False
        for s, reservation in ticket.holds:
            s.open -= 1
            if s.limiter is not None and reservation is not None:
                s.limiter.release(now, reservation)
        for purse in ticket.purses:
            purse.budget.release(ticket.id)
        return True

    def forfeit(self, now: float, ticket: Ticket) -> bool:
        """The outcome is unknown: count the reservations as spent."""
        return self.settle(now, ticket, ticket.need.tokens, ticket.need.cost_nusd)

    # -- inside --------------------------------------------------------------------------

    def _admit(self, now: float, waiter: _Waiter) -> Ticket:
        holds: list[tuple[_Scope, Reservation | None]] = []
        for s in {**dict.fromkeys(waiter.rated), **dict.fromkeys(waiter.budgeted)}:
            reservation = None
            if s.limiter is not None:
                answer = s.limiter.try_acquire(now, waiter.need.tokens)
                assert isinstance(answer, Admit), answer  # _ready_at said it would
                reservation = answer.reservation
            s.open += 1
            holds.append((s, reservation))
        ticket = Ticket(
            id=waiter.id,
            deadline_at=waiter.deadline_at,
            admitted_at=now,
            need=waiter.need,
            holds=tuple(holds),
            purses=waiter.purses,
        )
        self._open[ticket.id] = ticket
        return ticket

    def _ready_at(self, now: float, waiter: _Waiter) -> float:
        """When every scope it waits for would admit it (<= now: now; ``inf``: once a
        request in flight ends)."""
        at = now
        for s in waiter.rated:
            at = max(at, s.available_at(now, waiter.need.tokens))
        return at

    def _first(self, waiter: _Waiter) -> bool:
        """Whether ``waiter`` stands first in every queue it waits in."""
        return waiter.queued == len(waiter.rated) and all(
            s.queue[0] is waiter for s in waiter.rated
        )

    def _stand(self, waiter: _Waiter) -> None:
        """Put ``waiter`` in the queue of its next scope, in arrival order there.

        A waiter stands in its key's queue, and in its tenant's only once it is first
        in its key's and the key would admit it (``_key_ready``): so a request that
        waits for its own key's limit does not hold its tenant's queue, where another
        key's request, with room in its own key and in the tenant, waited behind it
        until its deadline (found by a hunt). At most one request a key stands in its
        tenant's queue, so the key's room cannot be taken from under it there."""
        s = waiter.rated[waiter.queued]
        waiter.queued += 1
        queue = s.queue
        if not queue:
            self._busy[s] = None
        if not queue or queue[-1].id < waiter.id:
            queue.append(waiter)
            return
        at = len(queue)
        while at and queue[at - 1].id > waiter.id:
            at -= 1
        queue.insert(at, waiter)

    def _key_ready(self, now: float, waiter: _Waiter) -> bool:
        """Whether ``waiter`` waits only in its key's queue, first there, and the key
        would admit it now (it moves on to its tenant's queue)."""
        return (
            waiter.queued == 1 < len(waiter.rated)
            and waiter.rated[0].queue[0] is waiter
            and self._key_at(now, waiter) <= now
        )

    def _key_at(self, now: float, waiter: _Waiter) -> float:
        """When ``waiter``'s key (its first scope) would admit it."""
        return waiter.rated[0].available_at(now, waiter.need.tokens)

    def _certain(self, waiter: _Waiter) -> bool:
        """Whether its scopes' answer can only get later: nothing they hold may be given
        back (a settlement may refund tokens, a release a request, any end a place in
        ``max_parallel``)."""
        return not any(s.open for s in waiter.rated)

    def _room_after(self, now: float, full: Sequence[_Scope], waiter: _Waiter) -> float | None:
        """Seconds until each full queue's first waiter could go, so a place frees (with
        no place at all, ``queue_bound = 0``: until ``waiter`` itself could go)."""
        at = now
        for s in full:
            first = s.queue[0] if s.queue else waiter
            at = max(at, s.available_at(now, first.need.tokens))
        return _seconds(at - now)

    def _late(self, now: float, waiter: _Waiter, at: float) -> Refused:
        """The refusal of a waiter its deadline leaves (before ``_drop``: it names the
        scopes that hold it back, not a tenant with room it never reached)."""
        holding = self._holding(now, waiter)
        scopes = " and ".join(s.label for s in holding)
        rates = "; ".join(f"{s.label}: {_rates(s.limits)}" for s in holding)
        return Refused(
            why=Why.DEADLINE,
            scope=scopes,
            detail=f"{scopes} could not take this request before its deadline ({rates})",
            retry_after_s=_seconds(at - now),
        )

    def _holding(self, now: float, waiter: _Waiter) -> tuple[_Scope, ...]:
        """The scopes that hold ``waiter`` back: its key's alone while it waits there;
        else those whose limiter would not admit it now or where another waits first."""
        rated = waiter.rated
        if 0 < waiter.queued < len(rated):
            return rated[:1]
        tokens = waiter.need.tokens
        held = tuple(
            s
            for s in rated
            if (s.queue and s.queue[0] is not waiter) or s.available_at(now, tokens) > now
        )
        return held or rated

    def _drop(self, waiter: _Waiter, *, keep_budget: bool = False) -> None:
        """Take the waiter out of every queue (and its budget back unless kept)."""
        del self._waiting[waiter.id]
        self._unfunded.pop(waiter.id, None)
        for s in waiter.rated[: waiter.queued]:
            if s.queue[0] is waiter:
                s.queue.popleft()
            else:
                s.queue.remove(waiter)
            if not s.queue:
                del self._busy[s]
        if not keep_budget:
            self._unreserve(waiter)

    def _unreserve(self, waiter: _Waiter) -> None:
        for purse in waiter.purses:
            purse.budget.release(waiter.id)


def _iso(utc: int | None) -> str | None:
    """Unix seconds as ISO 8601 in UTC (``2026-12-01T00:00:00Z``)."""
    if utc is None:
        return None
    return datetime.fromtimestamp(utc, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _per(purse: _Purse) -> str:
    return f" per {purse.period}" if purse.period else ""


def _until(purse: _Purse) -> str:
    return f" until it renews at {_iso(purse.ends)}" if purse.ends is not None else ""


def _rates(limits: Limits) -> str:
    """``60 requests and 10000 tokens per minute, 8 at once``, of the limits set."""
    parts = []
    if limits.rpm is not None:
        parts.append(f"{limits.rpm} request{'s' if limits.rpm != 1 else ''}")
    if limits.tpm is not None:
        parts.append(f"{limits.tpm} token{'s' if limits.tpm != 1 else ''}")
    rates = " and ".join(parts) + " per minute" if parts else ""
    if limits.max_parallel is None:
        return rates
    at_once = f"{limits.max_parallel} in flight at once"
    return f"{rates}, {at_once}" if rates else at_once


def _seconds(wait: float) -> float | None:
    """A wait as ``Retry-After`` gives it: None when there is none, or when it is not
    known (``inf``: a place in ``max_parallel`` frees when a request ends)."""
    return wait if 0 < wait < math.inf else None


# -- the asyncio driver -------------------------------------------------------------------


class Alarm(Protocol):
    def cancel(self) -> None: ...


class Timer(Protocol):
    """Calls back at a time of the quotas' clock (``asyncio.TimerHandle`` is an Alarm)."""

    def call_at(self, when: float, callback: Callable[[], None]) -> Alarm: ...


class LoopTimer:
    """A ``Timer`` on the running event loop, for a clock that may not be the loop's own
    (uvloop's ``loop.time()`` is not ``time.monotonic()``)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def call_at(self, when: float, callback: Callable[[], None]) -> Alarm:
        loop = asyncio.get_running_loop()
        return loop.call_later(max(0.0, when - self._clock()), callback)


class OverQuota(Exception):  # noqa: N818 - an answer, not a failure of ours
    """A request refused by its key's or tenant's quota: ``error`` is its 429."""

    def __init__(self, error: ApiError, why: Why) -> None:
        super().__init__(error.message)
        self.error = error
        self.why = why


@dataclass(frozen=True, slots=True)
class Estimate:
    """A request's size before it is sent."""

    prompt_tokens: int
    max_tokens: int
    """Completion tokens it may take (all its choices; 0 for embeddings)."""
    cache_writes: bool = False
    """Whether it may write the provider's prompt cache (a ``cache_control`` mark in
    it: ``pricing.marks_cache``), so its prompt is priced at the cache-write price
    where that is dearer."""


PriceLookup = Callable[[str, frozenset[str] | None], Sequence[Price]]
"""The prices a request naming a model or route could be charged at, served only by the
models ``allowed`` (None: any; a key's ``models`` keep its fallbacks to them)."""


_NOTHING = Need(tokens=1)


def _free(_name: str, _allowed: frozenset[str] | None) -> Sequence[Price]:
    return ()


class Quotas:
    """The gateway's quotas, on its event loop: ``ticket = await admit(...)`` before a
    submit, then ``settle`` / ``follow`` / ``release`` / ``forfeit`` it."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        prices: PriceLookup = _free,
        clock: Callable[[], float] = time.monotonic,
        timer: Timer | None = None,
        wall: Callable[[], float] = time.time,
        spend: SpendStore | None = None,
    ) -> None:
        self._clock = clock
        self._timer: Timer = LoopTimer(clock) if timer is None else timer
        self._prices = prices
        self._max_wait_s = settings.max_wait_s
        self._retry_after_s = settings.retry_after_s
        self._book = QuotaBook(settings, clock(), wall=wall)
        self._spend = spend
        """Where settled spend is kept (None: in memory only)."""
        self._writing: asyncio.Handle | None = None
        """The write of this turn's settlements, due at the end of the turn."""
        # what earlier runs spent is read where it counts: before each reservation and
        # each statistics read, on the loop that uses the file (this may be built on
        # another thread, and SQLite's connection is its opener's: read here, every
        # gateway's start logged that budgets went on from memory; found by a hunt)
        self._waiters: dict[int, asyncio.Future[Ticket]] = {}
        self._turned_away: ApiError | None = None
        """Set by ``turn_away``: a request that comes later is refused with it at once
        (one whose body was still being read at the last word waited, then was cut)."""
        self._alarm: Alarm | None = None
        self._alarm_at: float | None = None

    @property
    def book(self) -> QuotaBook:
        """The decisions' state."""
        return self._book

    def statistics(self, caller: Caller | None = None) -> QuotaStats:
        """Each key's and tenant's quotas as they stand (for ``/v1/callboard/stats``),
        with what the spend file holds; only ``caller``'s key's and tenant's unless it
        is an operator's."""
        self._refresh(self._book.purses())
        of = None if caller is None or caller.operator else (caller.name, caller.tenant)
        return self._book.statistics(self._clock(), of=of)

    def limited(self, caller: Caller) -> bool:
        """Whether ``caller``'s key or tenant has limits: only then does ``admit`` call
        the request's ``estimate``."""
        return bool(self._book.scopes(caller.name, caller.tenant))

    async def admit(
        self,
        caller: Caller,
        *,
        model: str,
        estimate: Callable[[], Estimate],
        deadline_s: float | None = None,
        allowed: frozenset[str] | None = None,
    ) -> Ticket:
        """Wait until ``caller``'s key and tenant can take the request, up to
        ``deadline_s`` (else ``max_wait_s``); ``OverQuota`` (a 429) when they cannot.
        ``estimate`` is called only when the caller has limits; ``model`` (a model or
        route name) prices the budget's reservation, at the dearest model that may serve
        it among ``allowed`` (the key's models; None: any)."""
        if self._turned_away is not None:
            raise OverQuota(self._turned_away, Why.STOPPING)
        now = self._clock()
        wait_s = self._max_wait_s if deadline_s is None else deadline_s
        scopes = self._book.scopes(caller.name, caller.tenant)
        if not scopes:  # nothing to hold: a ticket the book does not know ends as a no-op
            return Ticket(id=0, deadline_at=now + wait_s, admitted_at=now, need=_NOTHING)
        need = self._need(scopes, model, allowed, estimate)
        if self._spend is not None:
            self._refresh(self._book.purses(scopes))
        decision = self._book.arrive(now, caller.name, caller.tenant, need, now + wait_s)
        if isinstance(decision, Admitted):
            return decision.ticket
        if isinstance(decision, Refused):
            raise self._refusal(decision)
        waiter: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._waiters[decision.id] = waiter
        self._rearm(now)
        try:
            return await waiter
        except asyncio.CancelledError:
            self._abandon(decision.id, waiter)
            raise

    def time_left(self, ticket: Ticket) -> float:
        """What is left of the request's deadline after its wait (> 0)."""
        return max(1e-3, ticket.deadline_at - self._clock())

    def settle(self, ticket: Ticket, result: Result | EmbeddingResult) -> bool:
        """The request ended with ``result``: its usage and cost replace what was
        reserved, or everything comes back if nothing was sent. False if the ticket
        was ended already."""
        if not _sent(result):
            return self.release(ticket)
        return self._ended(
            self._book.settle(self._clock(), ticket, result.usage.total_tokens, result.cost_nusd)
        )

    def release(self, ticket: Ticket) -> bool:
        """Nothing was sent (refused, or cancelled before it went)."""
        return self._ended(self._book.release(self._clock(), ticket))

    def forfeit(self, ticket: Ticket) -> bool:
        """The outcome will never be known (the client left an embeddings call that
        may have been sent): the reservations count as spent."""
        return self._ended(self._book.forfeit(self._clock(), ticket))

    def follow(self, ticket: Ticket, outcome: asyncio.Future[Any]) -> None:
        """End ``ticket`` when ``outcome`` (a future on this loop, of a ``Result`` or
        an ``EmbeddingResult``) resolves, whoever still waits for it: settled by its
        result, released if its task ended with no call sent (cancelled, expired or
        refused unsent) or its future was cancelled (a stream's, before it was sent),
        forfeited if it failed."""
        if ticket.holds:  # a caller without limits holds nothing to end
            outcome.add_done_callback(lambda done: self._end_by(ticket, done))

    # -- inside --------------------------------------------------------------------------

    def _need(
        self,
        scopes: Sequence[_Scope],
        model: str,
        allowed: frozenset[str] | None,
        estimate: Callable[[], Estimate],
    ) -> Need:
        size = estimate()
        cost = 0
        if any(s.budget is not None for s in scopes):
            prices = self._prices(model, allowed)
            cost = max(
                (
                    estimate_nusd(
                        p, size.prompt_tokens, size.max_tokens, cache_writes=size.cache_writes
                    )
                    for p in prices
                ),
                default=0,
            )
        return Need(tokens=max(1, size.prompt_tokens + size.max_tokens), cost_nusd=cost)

    def _end_by(self, ticket: Ticket, done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            self.release(ticket)
        elif done.exception() is not None:
            self.forfeit(ticket)
        elif _never_sent(done.result()):
            self.release(ticket)
        else:
            self.settle(ticket, done.result())

    def flush(self) -> tuple[Charge, ...]:
        """Write the settlements not written yet now (before the spend file closes);
        return what the spend file still lacks (it failed)."""
        if self._writing is not None:
            self._writing.cancel()
        self._record()
        return self._book.unrecorded() if self._spend is not None else ()

    def _ended(self, ended: bool) -> bool:
        if ended:
            if self._spend is None:
                self._book.recorded()
            elif self._writing is None:  # one transaction for the turn's settlements
                self._writing = asyncio.get_running_loop().call_soon(self._record)
            if self._book.waiting:
                self._pump()
        return ended

    def _refresh(self, purses: Iterable[_Purse]) -> None:
        """Take in what the spend file holds for ``purses`` (before reserving in them)."""
        if self._spend is None:
            return
        for purse in purses:
            start = 0 if purse.start is None else purse.start
            try:
                total = self._spend.spent(purse.scope_id, purse.period, start)
            except SpendFileError as exc:
                log.error("budgets go on from memory: %s", exc)  # noqa: TRY400 - no traceback
                return
            self._book.seen(purse, total)

    def _record(self) -> None:
        """Write the settled spend the spend file does not hold yet (kept for the next
        time if the file fails)."""
        self._writing = None
        if self._spend is not None:
            charges = self._book.unrecorded()
            if not charges:
                return
            try:
                self._spend.add(charges)
            except SpendFileError as exc:
                log.error("settled spend kept in memory until the next write: %s", exc)  # noqa: TRY400
                return
        self._book.recorded()

    def turn_away(self, error: ApiError) -> int:
        """The gateway's grace ran out: every request still waiting for its quotas is
        answered ``error`` now (``OverQuota``, a 503 with ``Retry-After``), holding
        nothing, rather than have its connection closed under it; how many."""
        self._turned_away = error  # and every one that comes after
        waiters, self._waiters = self._waiters, {}
        for tid, waiter in waiters.items():
            self._book.leave(tid)
            if not waiter.done():
                waiter.set_exception(OverQuota(error, Why.STOPPING))
        return len(waiters)

    def _abandon(self, tid: int, waiter: asyncio.Future[Ticket]) -> None:
        """The waiting handler was cancelled (its client left): hold nothing."""
        self._waiters.pop(tid, None)
        if not waiter.done() or waiter.cancelled():
            if self._book.leave(tid):
                self._pump()
        elif waiter.exception() is None:  # admitted as its client left
            self.release(waiter.result())

    def _pump(self) -> None:
        now = self._clock()
        for tid, decision in self._book.pump(now):
            waiter = self._waiters.pop(tid, None)
            if waiter is None or waiter.done():  # its handler is being cancelled
                if isinstance(decision, Admitted):
                    self._book.release(now, decision.ticket)
                continue
            if isinstance(decision, Admitted):
                waiter.set_result(decision.ticket)
            else:
                waiter.set_exception(self._refusal(decision))
        self._rearm(now)

    def _rearm(self, now: float) -> None:
        at = self._book.wake_at(now)
        if at == self._alarm_at:
            return
        if self._alarm is not None:
            self._alarm.cancel()
        self._alarm_at = at
        self._alarm = None if at is None else self._timer.call_at(at, self._ring)

    def _ring(self) -> None:
        self._alarm = None
        self._alarm_at = None
        self._pump()

    def _refusal(self, refused: Refused) -> OverQuota:
        log.debug("quota refused (%s): %s", refused.why.value, refused.detail)
        if refused.why is Why.OVER_BUDGET:  # no retry now; Retry-After: when it renews
            error = ApiError(
                status=429,
                message=refused.detail,
                type="insufficient_quota",
                code="insufficient_quota",
                retry_after_s=refused.retry_after_s,
                retry=False,
            )
        elif refused.why is Why.TOO_LARGE:
            error = ApiError(
                status=429,
                message=refused.detail,
                type="requests",
                code="rate_limit_exceeded",
                retry=False,
            )
        else:
            wait_s = refused.retry_after_s
            error = ApiError(
                status=429,
                message=refused.detail,
                type="requests",
                code="rate_limit_exceeded",
                retry_after_s=self._retry_after_s if wait_s is None else wait_s,
                retry=True,
            )
        return OverQuota(error, refused.why)


def _usd(nusd: int) -> Decimal:
    return Decimal(nusd) / NUSD_PER_USD


def _sent(result: Result | EmbeddingResult) -> bool:
    """Whether anything reached a provider for ``result``."""
    if isinstance(result, EmbeddingResult):
        return result.ok or result.usage.total_tokens > 0 or result.cost_nusd > 0
    return result.attempts > 0


# -- sizes and prices ------------------------------------------------------------------------


def chat_estimate(
    messages: object,
    fields: Mapping[str, Any],
    *,
    dialect: str = "openai",
    image_rules: Sequence[ImageRule] = (GPT_4O_IMAGES,),
) -> Estimate:
    """A chat request's size, as ``submit`` will see it: its messages, ``tools`` and
    ``response_format`` counted by ``core.tokens`` (its images by the costliest of
    ``image_rules``, the rules of the models that may serve it), and ``max_tokens``
    (or ``max_completion_tokens``, else the default) for each of its ``n`` choices. A
    malformed field counts as absent (``submit`` refuses it by name afterwards)."""
    turns = messages if isinstance(messages, list) else []
    tools = fields.get("tools")
    response_format = fields.get("response_format")
    prompt = count_chat_tokens(
        turns,
        tools=tools if isinstance(tools, list) else None,
        response_format=response_format if isinstance(response_format, Mapping) else None,
        dialect=dialect,
        images=image_rules,
    )
    cap = fields.get("max_tokens", fields.get("max_completion_tokens"))
    choices = fields.get("n")
    return Estimate(
        prompt_tokens=prompt,
        max_tokens=(cap if _count(cap) else DEFAULT_MAX_TOKENS)
        * (choices if _count(choices) else 1),
        cache_writes=marks_cache((fields, turns)),
    )


def embed_estimate(texts: object) -> Estimate:
    """An embeddings request's size: its texts' tokens (or token arrays' lengths)."""
    items = texts if isinstance(texts, list) else [texts]
    tokens = 0
    for item in items:
        if isinstance(item, str):
            tokens += text_tokens(item)
        elif isinstance(item, list):
            tokens += len(item)
        else:
            tokens += 1
    return Estimate(prompt_tokens=tokens, max_tokens=0)


def reachable_prices(
    models: Mapping[str, ModelSettings],
    routes: Mapping[str, Sequence[str]],
    escalate_to: str | None = None,
) -> PriceLookup:
    """For a model or route name, the prices of every model a request naming it could
    be served by: the model (or the route's), their fallbacks (and theirs), and
    ``escalate_to``; any other name (``auto``) may reach every model. Of those, only
    the ``allowed`` ones count (the router skips the others: a key limited to a cheap
    model is never served, so never charged, by a dear fallback)."""
    table: dict[str, tuple[str, ...]] = {}

    def reach(names: Iterable[str]) -> tuple[str, ...]:
        seen: list[str] = []
        todo = [*names, *([escalate_to] if escalate_to is not None else [])]
        while todo:
            name = todo.pop()
            if name in seen or name not in models:
                continue
            seen.append(name)
            todo.extend(models[name].fallbacks)
        return tuple(seen)

    for name in models:
        table[name] = reach([name])
    for route, members in routes.items():
        table.setdefault(route, reach(members))
    every = tuple(models)
    priced: dict[tuple[str, frozenset[str] | None], tuple[Price, ...]] = {}

    def lookup(name: str, allowed: frozenset[str] | None) -> tuple[Price, ...]:
        found = priced.get((name, allowed))
        if found is None:  # a few names, a few keys' sets: kept as they are asked for
            names = table.get(name, every)
            found = tuple(models[n].price for n in names if allowed is None or n in allowed)
            priced[(name, allowed)] = found
        return found

    return lookup


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _never_sent(result: object) -> bool:
    """Whether ``result`` is a task's end with no call made (``attempts`` 0): what it
    reserved goes back, as for a request refused before it went."""
    return isinstance(result, Result) and not result.ok and result.attempts == 0
