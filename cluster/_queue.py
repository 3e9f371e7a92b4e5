"""The cluster's one queue: a Ray actor over the same ``core.pqueue`` as the local queue.

Theory of operation. Processes send batches of tickets (``enqueue``); model
actors grant batches of credits (``ready``) with their incarnation and their
own handle; each credit takes the ticket whose turn it is at that model
(priority, aging, then tenants' fair shares within a level: ``TaskQueue``),
and one ``call`` per batch goes to the model. Tickets whose deadline passed
while waiting are told to their owner in its next ``collect``. A model that
holds tickets back (its limiter said "not yet") returns them (``back``); they
keep their place, as their arrival is the task's.

Displacing. A model holds one ticket as its next call (``cluster._model``),
so a freed slot refills without a round trip here. So that a held LOW ticket
does not make a CRITICAL one wait a second call, a ticket that finds no
credit for any of its models is sent, without one, to the first whose held
ticket (as last heard: ``ready`` and ``back`` say its place, and a dispatch
may have filled it with the last in order it sent) comes after it in the
queue's own static order (``Ticket.order``: the core's rank, priority then
aging window, then deadline and arrival), so a ticket of a more urgent level
takes the place of one that aged however long (aged work gets its share of
the queue's turns, not a place ahead of urgent work a model holds), except a
ticket taken on an aged turn, which goes ranked ``AGED_RANK``, ahead of all:
displaced by each CRITICAL newcomer, it came back to earn its turn again and
was never called (found by a review); the model keeps the first of the two
and sends the other back, to its place. Each
ticket sent to a model goes with its rank (the core's, computed as its
``push`` does), so the model compares as the queue would.
The core's epoch is the Unix epoch: a rank means the same in every
incarnation of the queue.

Credits: a grant from a newer incarnation of a model voids the older one's;
one from an older incarnation is ignored.

Leases: each owner polls (``collect``) every fraction of a second; an owner
not heard from for ``lease_s`` is taken for dead, and its waiting tickets are
dropped (looked at in every poll, and before any ticket goes to a model), so a
client process that died stops holding the queue, and none of its tickets is
called past its lease.

What must hold: a key waits at most once; the state lives only here, and a
restarted queue (a new ``incarnation``) starts empty: every owner then sends
its tickets again (the owner's ledger is the truth). Every method runs on the
actor's one event loop, so no state needs a lock.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from callboard.cluster._longpoll import LongPoll
from callboard.cluster._wire import Order, QueueNews, Ticket, queue_settings
from callboard.core.pqueue import AGED_RANK, QueueFull, TaskQueue
from callboard.core.settings import SchedulerSettings
from callboard.messages import Settlement
from callboard.runtime.guarded_log import guarded_logger

log = guarded_logger(__name__)

SWEEP_EVERY_S = 1.0
"""How often, at most, the leases are looked at (a lease lasts a second or more)."""
LAPSED_KEEP_S = 86_400.0
"""How long a shared actor remembers an owner it took for dead, to tell it so if it
collects again: a process that died never does, and one back after a day still
finds its tasks' deadlines passed, or sends them again on the cluster's word."""
GRANTED_KEPT = 65_536
"""How many tickets sent lately the queue remembers how it sent (``_granted_as``)."""

EPOCH = 0.0
"""The core's epoch (its aging windows start there): fixed, so that ranks stamped by
one incarnation compare with the next's."""


@dataclass(slots=True)
class _Credit:
    incarnation: int
    handle: Any
    n: int = 0
    held: Order | None = None
    """The place (``Ticket.order``) of the ticket the model holds as its next call, as
    last heard (or the last it may hold since): None, nothing to displace."""


@dataclass(slots=True)
class _Owner:
    seen: float
    """When it was last heard from, on the queue's lease clock (``QueueShell._clock``)."""
    expired: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    """Its tickets this queue had no room for, to tell it."""
    invalid: list[tuple[int, str]] = field(default_factory=list)
    """Its tickets this queue could not take, and why, to tell it."""
    keys: set[int] = field(default_factory=set)
    """Its tickets waiting here."""
    name: str | None = None
    """The name it registered by (None: not to this incarnation)."""
    poll: LongPoll = field(default_factory=LongPoll)


class QueueShell:
    """The Ray actor (see the module docstring); made remote by ``cluster._connect``."""

    def __init__(
        self,
        settings: SchedulerSettings,
        lease_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.incarnation = time.time_ns()
        self._lease_s = lease_s
        self._clock = clock
        """What owners' leases are measured on: this process's monotonic clock. On the
        wall clock, a step back of an hour stretched every lease by as much, and a dead
        process's tickets were called for (found by a hunt); deadlines and arrivals
        stay on the wall clock, which every process shares."""
        self._settings = queue_settings(settings, lease_s)
        """The settings it was made with (``state``): a process that asks for others
        hears that these hold."""
        self._core: TaskQueue[Ticket] = TaskQueue(
            capacity=settings.capacity,
            aging_step_s=settings.aging_step_s,
            aging_share=settings.aging_share,
            epoch=EPOCH,
            tenant_weights=settings.tenant_weights,
        )
        self._credits: dict[str, _Credit] = {}
        self._names: dict[str, int] = {}
        self._first_number = (self.incarnation // 1_000_000) << 8
        """Owner numbers this incarnation gives start here, past every number an earlier
        one gave (256 a millisecond of its life at most): a process keeps its number
        across a restart of the queue and does not register again, so a restarted queue
        counting from 1 gave a new process the number of one still running, and their
        tasks and answers crossed."""
        self._owners: dict[int, _Owner] = {}
        self._numbers = itertools.count(self._first_number)
        self._swept_at = -math.inf
        self._lapsed: dict[int, float] = {}
        """Owners taken for dead with tickets dropped (told when they collect again), and
        when: forgotten after ``LAPSED_KEEP_S`` (a process that died never collects)."""
        self._ledgers: dict[str, int] = {}
        """Each ledger's identity (``Ledger.identity``) and the owner that holds it."""
        self._granted: OrderedDict[int, tuple[bool, bool]] = OrderedDict()
        """Tickets sent to models lately: charged, and on an aged turn (``_granted_as``)."""
        self.dispatched = 0
        self.displaced = 0
        self.refused = 0

    async def register(self, owner: str) -> tuple[int, int]:
        """The number ``owner`` (a process's unique name) goes by here, and this
        queue's incarnation."""
        number = self._names.get(owner)
        if number is None:
            number = self._names[owner] = next(self._numbers)
        self._owner(number).name = owner
        return number, self.incarnation

    async def succeed(self, owner: int, ledger: str) -> int:
        """``owner`` holds the ledger ``ledger`` now (a file one process holds at a time),
        so an owner that held it before is gone, though its lease may run yet (a process
        killed and resumed at once): its tickets still waiting are dropped, not called,
        and ``owner`` sends their tasks again from the ledger. Kept to its lease, each
        was called twice (found by a hunt). Answers how many were dropped."""
        before = self._ledgers.get(ledger)
        self._ledgers[ledger] = owner
        if before is None or before == owner or before not in self._owners:
            return 0
        return self._drop(before, self._clock(), "another process holds its ledger now")

    async def enqueue(self, tickets: list[Ticket]) -> int:
        """Queue ``tickets`` (one already waiting is left as it is); answer the incarnation.
        Their owners are heard from: a lease that ran out since the last poll is not
        taken for dead as its tickets go on."""
        now = self._clock()
        for owner in {t.owner for t in tickets}:
            self._owner(owner).seen = now
        self._push(tickets)
        return self.incarnation

    async def back(
        self, tickets: list[Ticket], model: str, incarnation: int, held: Order | None
    ) -> None:
        """``model`` hands back tickets it could not start or hold: they wait again, in
        their place, and their tenants' charges for them there are undone (none was
        sent: ``TaskQueue.refund``); ``held`` is the place of what it holds now."""
        credit = self._credits.get(model)
        if credit is not None and credit.incarnation == incarnation:
            credit.held = held
        refunds: list[Settlement] = []
        aged = 0
        for t in tickets:
            charged, on_aged_turn = self._granted.pop(t.key, (True, False))
            if charged:
                refunds.append((t.priority, t.tenant, _charge(t)))
            aged += on_aged_turn
        self._push(tickets, refund=(model, refunds, aged))

    async def ready(
        self,
        model: str,
        incarnation: int,
        n: int,
        handle: Any,
        *,
        held: Order | None = None,
        settled: tuple[Settlement, ...] = (),
    ) -> tuple[int, int]:
        """``model``'s incarnation ``incarnation`` can take ``n`` more calls; ``held``
        is the place (``Ticket.order``) of the ticket it holds as its next call, if any;
        ``settled``, the charges of its calls ended since to settle (``settle``). The
        answer: this queue's incarnation, and how many tickets that may go to ``model``
        still wait once the credits are spent (the model lends nothing while any do)."""
        credit = self._credits.get(model)
        if credit is None or incarnation > credit.incarnation:
            credit = self._credits[model] = _Credit(incarnation, handle)
        elif incarnation < credit.incarnation:
            return self.incarnation, 0  # a grant from a dead incarnation
        self._core.settle(model, settled)
        credit.n += n
        credit.held = held
        self._dispatch(model, time.time())
        return self.incarnation, self._core.waiting_for(model)

    async def settle(self, model: str, settled: tuple[Settlement, ...]) -> None:
        """Calls of ``model`` ended that were charged more (or less) than they used: each
        ``Settlement`` gives its tenant the difference (``TaskQueue.settle``)."""
        self._core.settle(model, settled)

    async def withdraw(self, keys: list[int]) -> list[int]:
        """Drop the tickets of ``keys`` still waiting (their tasks were cancelled); the
        keys of those it dropped."""
        dropped: list[int] = []
        for key in keys:
            ticket = self._core.cancel(key)
            if ticket is not None:
                self._owner(ticket.owner).keys.discard(key)
                dropped.append(key)
        return dropped

    async def collect(self, owner: int, wait_s: float) -> QueueNews:
        """Renew ``owner``'s lease; answer what expired of its tickets and what found no
        room (waiting up to ``wait_s`` for news)."""
        self._expire(time.time())
        self._sweep()
        lapsed = self._lapsed.pop(owner, None) is not None
        entry = self._owner(owner)
        entry.seen = self._clock()
        if not entry.expired and not entry.refused and not entry.invalid:
            await entry.poll.park(wait_s)
            self._expire(time.time())
        expired, entry.expired = entry.expired, []
        refused, entry.refused = entry.refused, []
        invalid, entry.invalid = entry.invalid, []
        entry.seen = self._clock()
        return QueueNews(
            incarnation=self.incarnation,
            expired=tuple(expired),
            lapsed=lapsed,
            refused=tuple(refused),
            invalid=tuple(invalid),
        )

    async def state(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "settings": self._settings,
            "waiting": len(self._core),
            "credits": {m: c.n for m, c in self._credits.items()},
            "dispatched": self.dispatched,
            "displaced": self.displaced,
            "refused": self.refused,
            "owners": sorted(self._owners),
            "cpu_s": time.process_time(),
        }

    # -- inside -----------------------------------------------------------

    def _owner(self, number: int) -> _Owner:
        entry = self._owners.get(number)
        if entry is None:
            entry = self._owners[number] = _Owner(seen=self._clock())
        return entry

    def _push(
        self,
        tickets: Iterable[Ticket],
        *,
        refund: tuple[str, list[Settlement], int] | None = None,
    ) -> None:
        """Queue ``tickets`` and send what they make possible; ``refund``: the model that
        hands them back unsent, the charges there to undo first, and the aged turns
        owed again (``TaskQueue.refund``)."""
        tickets = list(tickets)
        core = self._core
        owners = self._owners
        touched: dict[str, None] = {}
        pushed: list[Ticket] = []
        for t in tickets:
            key = t.key
            if key in core or t.owner not in owners:  # not an owner's (``enqueue`` makes
                continue  # it one): a model handing back a ticket of an owner taken for
            # dead since brought it back to life and had it called past its lease (a review)
            try:
                core.push(
                    key,
                    t,
                    priority=t.priority,
                    candidates=t.lanes,
                    arrival=t.arrival,
                    deadline=t.deadline,
                    tenant=t.tenant,
                    cost=_charge(t),
                    order=_order(t.arrival),
                )
            except QueueFull:  # the owner is told, and ends the task: it was dropped silently
                self.refused += 1
                owner = self._owner(t.owner)
                owner.refused.append(t.task_id)
                owner.poll.wake()
                continue
            except (TypeError, ValueError) as exc:  # another version's ticket, or a bug: one
                self._invalid(t, exc)  # stopped the batch, the tickets before it waited
                continue  # with credits free, and its owner was never told (found by a hunt)
            self._owner(t.owner).keys.add(key)
            touched.update(dict.fromkeys(t.lanes))
            pushed.append(t)
        if refund is not None:  # undone before anything is taken again
            core.refund(*refund)
        now = time.time()
        for model in touched:
            self._dispatch(model, now)
        for t in pushed:
            if t.key in core:
                self._displace(t)

    def _invalid(self, t: Ticket, exc: Exception) -> None:
        """``t`` cannot wait here: its owner is told why, and ends its task."""
        why = f"{type(exc).__name__}: {exc}"
        log.error(
            "owner %d, task %d: the queue cannot take its ticket: %s", t.owner, t.task_id, why
        )
        owner = self._owner(t.owner)
        owner.invalid.append((t.task_id, why))
        owner.poll.wake()

    def _dispatch(self, model: str, now: float) -> None:
        credit = self._credits.get(model)
        if credit is None or credit.n <= 0:
            return
        self._sweep()  # swept in polls alone, a lone process that died was called for
        # as long as its model granted (20 calls past its lease; found by a hunt)
        aged: list[Ticket] = []
        taken, skipped = self._core.pop_for(model, now, credit.n, aged=aged)
        self._ended(skipped)
        for t in taken:
            self._owner(t.owner).keys.discard(t.key)
        if taken:
            credit.n -= len(taken)
            self.dispatched += len(taken)
            on_aged_turns = {id(t) for t in aged}  # held, no newcomer takes their turn
            ranks = [AGED_RANK if id(t) in on_aged_turns else self._rank(t) for t in taken]
            for t in taken:
                self._granted_as(t.key, charged=True, aged=id(t) in on_aged_turns)
            worst = max(map(Ticket.order, taken, ranks))  # the model may hold it next
            credit.held = worst if credit.held is None else max(credit.held, worst)
            waiting = self._core.waiting_for(model)  # nothing is lent while any wait
            try:
                credit.handle.call.remote(credit.incarnation, taken, ranks, False, waiting)
            except TypeError:  # a model actor of an older callboard takes no ``waiting``:
                credit.handle.call.remote(credit.incarnation, taken, ranks)  # (Ray checks)

    def _displace(self, t: Ticket) -> None:
        """``t`` found no credit: if a model it may go to holds as its next call a
        ticket that comes after ``t`` in this queue's order, ``t`` takes that place
        (the model sends the other back)."""
        rank, order = 0, None  # its place, found once a model could be displaced
        for model in t.lanes:
            credit = self._credits.get(model)
            if credit is None or credit.n > 0 or credit.held is None:
                continue
            if order is None:
                rank = self._rank(t)
                order = t.order(rank)
            if order < credit.held:
                self._core.cancel(t.key)
                self._owner(t.owner).keys.discard(t.key)
                credit.held = order
                self.displaced += 1
                self._granted_as(t.key, charged=False, aged=False)  # cancelled: no charge
                credit.handle.call.remote(credit.incarnation, [t], [rank], True)
                return

    def _granted_as(self, key: int, *, charged: bool, aged: bool) -> None:
        """Remember how ``key``'s ticket was sent to a model, for if it comes back unsent
        (``back``): charged to its tenant, on an aged turn. A ticket sent to displace a
        held one was taken out uncharged: refunded when it came back, it undid a charge of
        another of its tenant's calls; one taken on an aged turn came back with the turn
        spent (both found by a review). The latest ``GRANTED_KEPT`` are kept: a ticket
        older than that comes back as charged on a plain turn, as most are."""
        granted = self._granted
        granted[key] = (charged, aged)
        granted.move_to_end(key)
        if len(granted) > GRANTED_KEPT:
            granted.popitem(last=False)

    def _rank(self, t: Ticket) -> int:
        """``t``'s rank in the core's static order."""
        return self._core.rank(t.priority, t.arrival)

    def _expire(self, now: float) -> None:
        self._ended(self._core.expire(now))

    def _ended(self, tickets: Iterable[Ticket]) -> None:
        for t in tickets:
            owner = self._owner(t.owner)
            owner.keys.discard(t.key)
            owner.expired.append(t.task_id)
            owner.poll.wake()

    def _sweep(self) -> None:
        """Drop the tickets of owners whose lease ran out: at most once in
        ``SWEEP_EVERY_S`` (it is asked before every dispatch and in every poll, and
        walks every owner, and every owner taken for dead in the last day)."""
        now = self._clock()
        if now - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = now
        for number, owner in list(self._owners.items()):
            if now - owner.seen > self._lease_s:
                self._drop(number, now, "it went silent")
        forget = [n for n, at in self._lapsed.items() if now - at > LAPSED_KEEP_S]
        for number in forget:
            del self._lapsed[number]

    def _drop(self, number: int, now: float, why: str) -> int:
        """Take owner ``number`` for dead (``why``): drop its waiting tickets and forget
        it; how many tickets were dropped."""
        owner = self._owners.pop(number)
        for key in owner.keys:
            self._core.cancel(key)
        if owner.keys:
            log.warning("owner %d: %s: %d waiting tickets dropped", number, why, len(owner.keys))
            self._lapsed[number] = now  # told so if it is back: it sends them again
        if owner.name is not None:  # a process that died leaves nothing here for good
            self._names.pop(owner.name, None)  # (one back keeps its number)
        for ledger in [k for k, held_by in self._ledgers.items() if held_by == number]:
            del self._ledgers[ledger]
        return len(owner.keys)


def _charge(t: Ticket) -> int:
    """What fair queuing charges ``t``'s tenant when it is sent."""
    return max(1, t.cost)


def _order(arrival: float) -> int | None:
    """A ticket's tie-break in the core's order (``TaskQueue.push``): its arrival in whole
    microseconds, which every process reads alike, so a ticket a model hands back keeps
    its place. By the push's count it went behind everything waiting at its priority,
    again each time it came back: under a binding rate limit a task submitted second was
    answered last (found by a hunt). None for an arrival the core refuses anyway."""
    if not math.isfinite(arrival) or arrival < 0:
        return None
    return int(arrival * 1_000_000)
