"""One model's shared guard on the cluster: a Ray actor owning its breaker, limiter,
concurrency cap and HTTP client, on the actor's own event loop.

Theory of operation. The actor grants the shared queue credits (``ready``)
for the calls it could start now (``admission.to_grant``: the cap, the
breaker, the limiter), plus one for its *next* call. A ``call`` brings
tickets for them, best first; each passes ``admission.gate`` and is started
by the ``ModelClient`` (``runtime.http``) on this actor's loop, one batch per
call; the one that finds every slot taken is *held* (not admitted: it has
reserved nothing), and starts in the loop iteration a slot frees in. Without
it a freed slot stood idle for two Ray hops (the credit to the queue, the
ticket back: 12-15 ms measured on the loaded 2-core box), and a CRITICAL task
waited that long twice, once behind the LOW call that took the slot late.
The queue may send a ticket more urgent than the held one without a credit
(``displacing``): it takes the held place and the held ticket goes back to
the queue, in its place. "More urgent" is the queue's own static order: each ticket
comes with its rank there (``Ticket.order``: priority, then aging window), so
a more urgent level's ticket takes the place of a held one however long that
one waited.
Credits go without a round trip, in one batch a millisecond after the slots
freed, once the long polls woken with them have answered (``GRANT_AFTER_S``),
and only once the queue holds fewer than half of them (``low_water``): while
it has credits enough for what arrives, another grant would pay for nothing,
and at light load it landed on the queue as the next call's ticket did
(measured: a grant after every call cost that call 0.7-1.3 ms at p50 on the
loaded 2-core box, one call at a time on 4 slots; one in three calls now
grants). A saturated model's credits are spent as they come, so it grants
after every freed slot as before.
When admission says "not yet", the rest (and the held ticket) go back to the
queue and a timer wakes the actor when it could admit.
Each finished call teaches the guards (``core.learn``) and is handed, with
what it taught, to the process that owns the task, in that process's next
``collect`` (a long poll: answers travel in batches). What an answer means
for its task (retry, another model, the end) is decided there, by the
owner's ledger and ``attempt.judge``: this actor holds no task beyond its call.

Streams. A ticket that says ``streamed`` is called with the same streaming
path as a local call (``ModelClient``), its deltas going to a ``DeltaSpool``
(``cluster._spool``) in the owner's outbox: the first delta a poll has not
taken wakes the owner's long poll, and the deltas of all its calls travel in
that poll's answer (``ModelNews.streams``), before any answer of the batch.
A spool holds ``LIMIT`` deltas at most: then the call stops reading the
provider until the owner collects, or, paused by an owner whose reader is
behind (``pause``), until it asks again. ``abandon`` (a reader who left) and an
owner's lapsed lease end the call where it waits; its slot comes back. A
call's deltas are numbered in order (``Deltas.seq``) and its answer says how
many it sent (``Attempted.deltas``), so an owner can tell a batch lost on its
way there; it ends a call it will not read (``refuse``): one whose beginning
it lost, or a second call for the same task.

A restart. Ray restarts a killed actor (``max_restarts``) with a new
``incarnation``: its calls in flight are lost with it, and each owner, seeing
the new incarnation, sends its tickets again. The new limiter starts as if
its bucket were spent (nothing for ``burst_s``), so a restart never bursts
past the provider's limit.

Leases: an owner that has not collected for ``lease_s`` is taken for dead and
its answers are dropped; its calls still run to their end, so their slots
come back (capacity never leaks).

Lending. With capacity to spare, an owner is lent calls it makes itself
(``lease``, ``cluster._lease``): each permit is admitted here as a ticket's
call is (a slot, the breaker's permit, the limiter's reservation of the
permit's tokens) and counts against the cap until the owner reports its call
(``report``: the guards learn from it as from a call made here) or gives it
back. Only spare capacity is lent: nothing while anything waits for this
model in the queue (no credit unspent there, a ticket held), one slot always
left beside the lent ones, nothing with the breaker other than closed. A
permit whose owner is taken for dead, or that nobody reported by ``RECLAIM_S``
past its call's total timeout, is taken back as a call made (``_reclaim``).

What must hold: at most ``max_concurrency`` calls in flight here and lent, and
``HELD`` ticket held; nothing sent while the breaker rejects or the limiter has not
admitted, and nothing held once they have said no; each call ends in
exactly one answer to its owner (or none, if the owner's lease ran out).
Every method runs on the actor's one event loop: no state needs a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import ray
from callboard.cluster._longpoll import LongPoll
from callboard.cluster._queue import LAPSED_KEEP_S
from callboard.cluster._spool import DeltaSpool
from callboard.cluster._wire import (
    Attempted,
    Deltas,
    Lease,
    ModelNews,
    Order,
    Spent,
    Ticket,
    Unsent,
    portable,
    settings_digest,
    task_of,
)
from callboard.core.admission import (
    Grant,
    Passed,
    Send,
    admit,
    gate,
    send_of,
    to_grant,
    tokens_of,
    too_large,
)
from callboard.core.breaker import Allow, CircuitBreaker
from callboard.core.health import LIMITED_RUN, HealthBook
from callboard.core.learn import RATE_LIMITED_RUN, Lesson, learn
from callboard.core.limiter import RateLimiter, Reservation, TooLarge, WaitUntil
from callboard.core.settings import ModelSettings
from callboard.messages import BreakerState, CallResult, CallsDone, Settlement, settlement
from callboard.runtime.codec import CodecError
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.http import UNSENT, ModelClient, error_detail

log = guarded_logger(__name__)

LEND_MOST = 4
"""Permits one lease lends at most (``lease``)."""
RECLAIM_S = 5.0
"""How long past its call's total timeout a lent permit nobody reported is taken back
(its call counted as made: the limiter keeps its charge)."""
RETRY_GRANT_S = 0.2
"""How soon a grant the queue did not take (it was restarting) is tried again."""
HELD = 1
"""Tickets a model holds beyond its cap, to start the moment a slot frees."""
GRANT_AFTER_S = 0.001
"""How long a grant waits after the slot that freed: the owners' long polls woken
with it answer first. Their replies are written by Ray's own thread, which needs
the GIL; a ``ready`` sent at once (~1 ms of Python on this loop) held them up:
answer to owner 3.8-4.9 ms with the grant sent in the same loop iteration,
2.5 ms with it a millisecond later (load 9-14 on 2 cores). The grant is off
the latency path: the held ticket refills a freed slot, and the credits of idle
slots are out already."""


@dataclass(slots=True)
class _Flight:
    ticket: Ticket
    permit: Allow
    reservation: Reservation
    sent_at: float
    spool: DeltaSpool | None = None
    """A streamed call's deltas, waiting for the owner's poll."""


@dataclass(slots=True)
class _Lent:
    """A permit lent to ``owner`` (``lease``): a slot, the breaker's permit and the
    limiter's reservation, until the owner reports its call or gives it back."""

    owner: int
    permit: Allow | None
    """None for a call adopted (``adopt``): admitted by the incarnation before."""
    reservation: Reservation | None
    at: float


@dataclass(slots=True)
class _Lending:
    """Counts of the permits lent (``lease``)."""

    out: dict[int, _Lent] = field(default_factory=dict)
    """Permit id -> a call lent to an owner, which makes it itself."""
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    lent: int = 0
    """Permits lent in all."""
    spent: int = 0
    """Those whose call was reported made."""
    refused: int = 0
    """Asks for a lease answered with none."""
    queue_waits: bool = False
    """The queue's last word (a batch's ``waiting``, a grant's answer): tickets that may
    come here wait there. A word that may be out of date errs towards lending nothing
    (the queue's way is always right): refreshed by the next batch or grant."""
    grants_out: int = 0
    """Grants the queue has not answered yet: what it does with them is not known."""


@dataclass(slots=True)
class _Outbox:
    seen: float
    answers: list[Attempted | Unsent] = field(default_factory=list)
    poll: LongPoll = field(default_factory=LongPoll)
    spools: dict[int, DeltaSpool] = field(default_factory=dict)
    """Call id -> the owner's streamed calls here, until their last deltas are taken."""
    recall: bool = False
    """The owner is to give back its permits not used (``ModelShell._recall``)."""

    def due(self) -> bool:
        """Whether a poll would answer at once: answers, deltas or a recall wait."""
        return bool(self.answers) or self.recall or any(s.due for s in self.spools.values())

    def deltas(self) -> tuple[Deltas, ...]:
        """What the streamed calls read since the last poll; a call that ended and
        handed over its last is forgotten (its answer goes in the same news)."""
        found: list[Deltas] = []
        for call, spool in list(self.spools.items()):
            seq = spool.handed
            taken = spool.take()
            if taken:
                found.append(
                    Deltas(
                        task_id=spool.task_id,
                        attempt=spool.attempt,
                        call=call,
                        seq=seq,
                        deltas=taken,
                    )
                )
            if spool.ended and not spool.due:
                del self.spools[call]
        return tuple(found)

    def abandon(self, task_ids: set[int] | None) -> int:
        """The streamed calls of ``task_ids`` (None: all) lose their reader."""
        n = 0
        for spool in self.spools.values():
            if task_ids is None or spool.task_id in task_ids:
                spool.abandon()
                n += 1
        return n

    def refuse(self, calls: list[int]) -> None:
        """These streamed calls lose their reader (whatever task they are for)."""
        for call in calls:
            spool = self.spools.get(call)
            if spool is not None:
                spool.abandon()


class ModelShell:
    """The Ray actor (see the module docstring); made remote by ``cluster._connect``."""

    def __init__(self, settings: ModelSettings, queue: Any, lease_s: float) -> None:
        self.incarnation = time.time_ns()
        self.settings = settings
        self.model = settings.name
        self.cap = settings.max_concurrency
        self.breaker = CircuitBreaker(settings.breaker)
        self.limiter = RateLimiter(
            settings.limiter, time.monotonic(), refunds=settings.refunds_tokens
        )
        if _restarted():  # as if spent
            self.limiter.pause_until(time.monotonic() + settings.limiter.burst_s)
        self.health = HealthBook()
        self._queue = queue
        self._lease_s = lease_s
        self._client = ModelClient(settings, incarnation=self.incarnation, deliver=self._done)
        """Made here, not at the first call: a transport that cannot be made (CAs that
        cannot be loaded) is the actor's start's error, named to the process that made
        it; made at the first call, the error left that call's batch holding its slots
        for good, and every call after it failed alike, unheard (found by a hunt)."""
        self._ids = itertools.count(1)
        self._flights: dict[int, _Flight] = {}
        self._held: Ticket | None = None
        """The next call: granted beyond the cap, started the moment a slot frees."""
        self._held_order: Order | None = None
        """The held ticket's place in the queue's order."""
        self._outboxes: dict[int, _Outbox] = {}
        self._lapsed: dict[int, float] = {}
        """Owners taken for dead with answers dropped (told when they collect again), and
        when: forgotten after ``LAPSED_KEEP_S``."""
        self._sweeping = False
        """A sweep of the leases is due on a timer (``_mind_leases``)."""
        self.granted = 0
        """Credits the queue holds: granted and not yet used by a ``call``."""
        self.low_water = max(1, (self.cap + HELD) // 2)
        """A grant waits until the queue holds fewer credits than this."""
        self.grants = 0
        """``ready`` calls made (each a batch of credits)."""
        self._typical_tokens = 1.0
        self._wake_at: float | None = None
        self._granting = False
        """A grant is due at the end of this loop iteration."""
        self._grants_held_until: float | None = None
        """Admission said "not before" then: no credit before it (as ``ModelActor``'s),
        or the tickets it held back came again on the next credits, back and forth."""
        self._held_back_tokens = 0
        """The size of the call the limiter last said "not yet" to: no credit before a
        call that large could go (``admission.to_grant``)."""
        self._me: Any = None
        """This actor's own handle, for the queue's calls back (made once)."""
        self._queue_incarnation: int | None = None
        """The queue's incarnation as its last answer to a grant said."""
        self._settled: list[Settlement] = []
        """Ended calls whose tenants' charges the queue is to settle: with the next
        grant, or on their own when no grant is due (lost with a failed one: fairness
        is then off by those calls' estimates until their tenants stop waiting)."""
        self.sent = 0
        self.lending = _Lending()
        self.polls = 0
        """Owners' polls answered (a stream's deltas ride on them: no hop of their own)."""
        self.relayed = 0
        """Stream deltas handed to owners."""

    # -- what processes and the queue call --------------------------------

    async def call(
        self,
        incarnation: int,
        tickets: list[Ticket],
        ranks: list[int],
        displacing: bool = False,
        waiting: int | None = None,
    ) -> None:
        """The queue's batch for this actor's credits (best first), each ticket's rank
        in the queue beside it, or, ``displacing``, one ticket more urgent than
        the one held here, sent without a credit; ``waiting``: how many tickets that
        may come here the queue holds still (nothing is lent while any do)."""
        if waiting is not None:
            self._queue_said(waiting)
        if incarnation != self.incarnation:  # granted by the incarnation before
            self._back(tickets)
            return
        if not displacing:
            self.granted = max(0, self.granted - len(tickets))
        free = max(0, self.cap - self._busy())
        self._admit(tickets[:free])
        for ticket, rank in zip(tickets[free:], ranks[free:], strict=True):
            self._hold(ticket, ticket.order(rank))
        self._start_held()  # a slot left free (a ticket past its deadline, say)
        self._pump()

    async def collect(self, owner: int, wait_s: float, queue: int | None = None) -> ModelNews:
        """Renew ``owner``'s lease; answer its calls' news (waiting up to ``wait_s``).
        ``queue`` is the queue's incarnation as the owner last heard it: an idle model
        learns so of a queue restarted with its credits (it grants on no answer else)."""
        if queue is not None:
            self._saw_queue(queue)
        self._pump()
        now = time.monotonic()
        self._sweep(now)
        lapsed = self._lapsed.pop(owner, None) is not None
        box = self._outboxes.get(owner)
        if box is None:
            box = self._outboxes[owner] = _Outbox(seen=now)
        box.seen = now
        if not box.due():
            await box.poll.park(wait_s)
        streams = box.deltas()  # before the answers: a call's last deltas come first
        self.polls += 1
        self.relayed += sum(len(d.deltas) for d in streams)
        answers, box.answers = box.answers, []
        recall, box.recall = box.recall, False
        box.seen = time.monotonic()
        health = self.health.report(
            self.model,
            box.seen,
            self.breaker,
            self.limiter,
            in_flight=self._busy(),
            cap=self.cap,
            given_up=self.health.given_up(box.seen, self.breaker),
        )
        return ModelNews(
            model=self.model,
            incarnation=self.incarnation,
            answers=tuple(answers),
            health=health,
            at=box.seen,
            lapsed=lapsed,
            streams=streams,
            recall=recall,
        )

    async def pause(self, owner: int, task_id: int, paused: bool, ask: int) -> None:
        """``owner``'s reader of ``task_id``'s stream is behind (``paused``: its deltas
        wait here, and once ``LIMIT`` wait, the call stops reading the provider) or has
        caught up; ``ask`` numbers the owner's asks for it (Ray may run them out of
        order: an older one is ignored)."""
        box = self._outboxes.get(owner)
        if box is not None:
            for spool in box.spools.values():
                if spool.task_id == task_id:
                    spool.pause(paused, ask)

    async def abandon(self, owner: int, task_ids: list[int], *, calls: bool = True) -> list[int]:
        """``owner`` gave these tasks up (cancelled; a stream's reader left): a stream's
        call ends where it is (the provider is read no more; not without ``calls``: a
        stop's cancel leaves the calls made to finish), and the ticket held as the next
        call, if it is one of them, is dropped unsent (it was called, a paid call for a
        task already ended ``Cancelled``); a plain call already sent runs on. The tasks
        whose held ticket it dropped."""
        gone = set(task_ids)
        dropped: list[int] = []
        held = self._held
        if held is not None and held.owner == owner and held.task_id in gone:
            self._held, self._held_order = None, None
            dropped.append(held.task_id)
            self._pump()  # the held place is free: the queue may send the next
        box = self._outboxes.get(owner)
        if box is not None and calls:
            box.abandon(gone)
        return dropped

    async def refuse(self, owner: int, incarnation: int, calls: list[int]) -> None:
        """``owner`` will not read these streamed calls of this actor's ``incarnation``
        (it lost a batch of their deltas, or reads another call of the same task): they
        end where they are. Calls of another incarnation are not these (numbers restart)."""
        box = self._outboxes.get(owner)
        if box is not None and incarnation == self.incarnation:
            box.refuse(calls)

    async def lease(self, owner: int, n: int, tokens: int) -> Lease | None:
        """Lend ``owner`` up to ``n`` calls it makes itself (``cluster._lease``), each of
        at most ``tokens``, admitted here as a ticket's call is (a slot, the breaker, the
        limiter); None when none can be spared. Only spare capacity is lent: the breaker
        closed, one slot left free beside the lent ones, nothing held here and a credit
        unspent in the queue (nothing waits there for this model), and no limit held
        apart by input and output (a permit reserves a total). What waits in the queue
        goes first: once something does, nothing more is lent."""
        now = time.monotonic()
        self.breaker.advance(now)
        spare = min(n, LEND_MOST, self.cap - self._busy() - 1)
        if (
            spare <= 0
            or tokens < 1
            or self._held is not None
            or self.granted < 1
            or self.lending.queue_waits
            or self.lending.grants_out
            or self.breaker.state is not BreakerState.CLOSED
            or owner in self._lapsed
            or owner not in self._outboxes  # not polling (yet, or any more): lent for ever
            or self.limiter.parts_limits() != (None, None)
        ):
            self.lending.refused += 1
            return None
        permits: list[int] = []
        for _ in range(spare):
            decision = admit(now, self.breaker, self.limiter, tokens)
            if not isinstance(decision, Passed):
                break
            pid = next(self.lending.ids)
            self.lending.out[pid] = _Lent(owner, decision.permit, decision.reservation, now)
            permits.append(pid)
        if not permits:
            self.lending.refused += 1
            return None
        self.lending.lent += len(permits)
        return Lease(
            model=self.model, incarnation=self.incarnation, permits=tuple(permits), tokens=tokens
        )

    async def report(
        self,
        owner: int,
        incarnation: int,
        spent: list[Spent],
        unused: list[int],
        gone: tuple[int, ...] = (),
    ) -> None:
        """``owner``'s calls on permits of this actor's ``incarnation`` ended (``spent``:
        the guards learn from each, as from a call made here), were never made
        (``unused``: given back whole), or will not be heard of (``gone``: its system
        stopped with them on the wire; taken back as made). Permits of another
        incarnation are void: the guards that lent them died with it."""
        if incarnation != self.incarnation:
            return
        now, wall = time.monotonic(), time.time()
        was = self.breaker.state
        self._take_back(
            now, [p for p in gone if p in self.lending.out and self.lending.out[p].owner == owner]
        )
        for pid in unused:
            lent = self.lending.out.get(pid)
            if lent is not None and lent.owner == owner:
                del self.lending.out[pid]
                if lent.permit is not None:
                    self.breaker.release(now, lent.permit)
                if lent.reservation is not None:
                    self.limiter.release(now, lent.reservation)
        for s in spent:
            lent = self.lending.out.get(s.permit)
            if lent is None or lent.owner != owner:
                continue  # taken back already (``_reclaim``): counted as made
            del self.lending.out[s.permit]
            self.lending.spent += 1
            if lent.permit is None or lent.reservation is None:
                continue  # adopted: admitted (and to be learnt) by the incarnation before
            self._grants_held_until = None  # a refund may make room before the limiter said
            self._learn(s.result, lent.permit, lent.reservation, now, wall)
            # no settlement: the queue charged its tenant nothing for a call it never saw
        self._breaker_told(was)
        self._start_held()
        self._pump()

    async def adopt(self, owner: int, n: int) -> tuple[int, tuple[int, ...]]:
        """``owner`` has ``n`` calls on the wire that the incarnation before this one
        lent it: each takes a slot here until the owner reports it (the cap counts them;
        the guards learnt nothing of their admission, and learn nothing of their end).
        Without this a restarted actor admitted its whole cap beside them. This
        incarnation, and the permits that stand for them."""
        now = time.monotonic()
        permits = tuple(next(self.lending.ids) for _ in range(max(0, n)))
        for pid in permits:
            self.lending.out[pid] = _Lent(owner, None, None, now)
        return self.incarnation, permits

    def _queue_said(self, waiting: int) -> None:
        """The queue says ``waiting`` tickets that may come here wait there: while any do,
        nothing is lent, and what is lent and not used is called back."""
        self.lending.queue_waits = waiting > 0
        if waiting > 0:
            self._recall()

    def _recall(self) -> None:
        """Work waits for this model (in the queue, or held here): every owner holding
        permits is told, at once (its poll answers), to give back those it has not used;
        left, they held slots and limiter reservations a CRITICAL ticket waited behind
        for up to ``PERMIT_S`` (found by a review)."""
        for owner in {lent.owner for lent in self.lending.out.values()}:
            box = self._outboxes.get(owner)
            if box is not None and not box.recall:
                box.recall = True
                box.poll.wake()

    def _breaker_told(self, was: BreakerState) -> None:
        """The breaker moved from ``was``: every owner's poll answers with the health that
        says so (an owner stops using its permits of a breaker not closed)."""
        if self.breaker.state is not was:
            for box in self._outboxes.values():
                box.poll.wake()

    def _busy(self) -> int:
        """Slots taken: calls in flight here and calls lent."""
        return len(self._flights) + len(self.lending.out)

    async def state(self) -> dict[str, Any]:
        spools = [s for b in self._outboxes.values() for s in b.spools.values()]
        return {
            "incarnation": self.incarnation,
            "settings": settings_digest(self.settings),
            "in_flight": len(self._flights),
            "lent": len(self.lending.out),
            "adopted": sum(lent.permit is None for lent in self.lending.out.values()),
            "lent_all": self.lending.lent,
            "spent": self.lending.spent,
            "lend_refused": self.lending.refused,
            "held": self._held_priority(),
            "cpu_s": time.process_time(),
            "granted": self.granted,
            "grants": self.grants,
            "sent": self.sent,
            "breaker": self.breaker.state.value,
            "owners": sorted(self._outboxes),
            "streams": len(spools),
            "spooled": sum(s.waiting for s in spools),
            "paused": sum(s.paused for s in spools),
            "polls": self.polls,
            "relayed": self.relayed,
        }

    # -- admission --------------------------------------------------------

    def _admit(self, tickets: list[Ticket]) -> None:
        now, wall = time.monotonic(), time.time()
        sends: list[Send] = []
        try:
            self._gate_each(tickets, sends, now, wall)
        finally:  # what passed is called, whatever a later ticket did
            if sends:
                self.sent += len(sends)
                self._client.start(sends)

    def _gate_each(self, tickets: list[Ticket], sends: list[Send], now: float, wall: float) -> None:
        """Pass ``tickets`` through admission in order, adding each call to make to
        ``sends``; a ticket this actor cannot read (a newer process's request, say) is
        refused alone: one such in a batch stopped the batch, and the calls gated before
        it held their slots for ever (found by a hunt)."""
        for i, ticket in enumerate(tickets):
            if self._busy() >= self.cap:  # more than granted: never over the cap
                self._back(tickets[i:])
                break
            call_id = next(self._ids)
            spool = self._spool(ticket, call_id) if ticket.streamed else None
            try:
                task = task_of(ticket, call_id, now=now, wall=wall, stream=spool)
            except CodecError as exc:
                self._not_called(ticket, call_id, f"the model's actor cannot read it: {exc}")
                continue
            if task.deadline_at is not None and task.deadline_at <= now:
                self._answer(
                    ticket.owner,
                    Unsent(task_id=ticket.task_id, attempt=ticket.attempt, why="deadline"),
                )
                self._unspool(ticket.owner, call_id)
                continue
            decision = gate(now, self.breaker, self.limiter, task)
            if isinstance(decision, Passed):
                res = decision.reservation
                try:
                    send = send_of(task, ticket.attempt + 1, self.settings, now)
                except Exception as exc:  # this ticket's call, not the actor: logged, it ends
                    log.exception(
                        "%s: the call of task %d (owner %d) could not be made",
                        self.model,
                        ticket.task_id,
                        ticket.owner,
                    )
                    self.breaker.release(now, decision.permit)
                    self.limiter.release(now, res)
                    self._not_called(ticket, call_id, error_detail(exc), why="unmade")
                    continue
                self._typical_tokens += (res.tokens - self._typical_tokens) * 0.1
                self._flights[call_id] = _Flight(ticket, decision.permit, res, wall, spool)
                sends.append(send)
            elif isinstance(decision, TooLarge):
                self._not_called(ticket, call_id, too_large(decision, self.model).fields["detail"])
            else:  # the breaker or the limiter says not yet: the rest wait in the queue
                self._unspool(ticket.owner, call_id)
                held, self._held, self._held_order = self._held, None, None
                self._back(tickets[i:] if held is None else [*tickets[i:], held])
                at = decision.at if isinstance(decision, WaitUntil) else decision.until
                if at is not None:  # None: when a call in flight settles
                    self._grants_held_until = at
                    self._wake(at, now)
                if isinstance(decision, WaitUntil):  # no credit before this call could go
                    self._held_back_tokens = tokens_of(task)  # (as the local model's)
                break

    def _not_called(
        self, ticket: Ticket, call_id: int, detail: str, *, why: str = "refused"
    ) -> None:
        """``ticket`` is not called here: ``refused`` (its owner fails it here, or moves
        it on), ``unmade`` (its body could not be made: its owner fails it)."""
        self._answer(
            ticket.owner,
            Unsent(task_id=ticket.task_id, attempt=ticket.attempt, why=why, detail=detail),
        )
        self._unspool(ticket.owner, call_id)

    def _spool(self, ticket: Ticket, call_id: int) -> DeltaSpool:
        """Where a streamed call's deltas wait for its owner's poll."""
        self._mind_leases()
        box = self._outbox(ticket.owner)
        spool = DeltaSpool(
            task_id=ticket.task_id, attempt=ticket.attempt, call=call_id, wake=box.poll.wake
        )
        box.spools[call_id] = spool
        return spool

    def _unspool(self, owner: int, call_id: int) -> None:
        """A streamed call that was never made: nothing will come from it."""
        box = self._outboxes.get(owner)
        if box is not None:
            box.spools.pop(call_id, None)

    def _outbox(self, owner: int) -> _Outbox:
        box = self._outboxes.get(owner)
        if box is None:
            box = self._outboxes[owner] = _Outbox(seen=time.monotonic())
        return box

    def _hold(self, ticket: Ticket, order: Order) -> None:
        """Keep ``ticket`` (at ``order`` in the queue) as the next call, or send it (or
        the one it displaces) back: the one first in the queue's order stays."""
        self._recall()  # a ticket waits for a slot: the permits not used come back
        held = self._held
        if held is None or self._held_order is None:
            self._held, self._held_order = ticket, order
        elif order < self._held_order:
            self._held, self._held_order = ticket, order
            self._back([held])
        else:
            self._back([ticket])

    def _start_held(self) -> None:
        """A slot is free: the held ticket's call starts now, in this loop iteration
        (unless its owner's lease ran out meanwhile: ``_sweep`` drops it)."""
        if self._held is not None:
            self._sweep(time.monotonic())
        held = self._held
        if held is not None and self._busy() < self.cap:
            self._held, self._held_order = None, None
            self._admit([held])

    def _back(self, tickets: list[Ticket]) -> None:
        """Tickets return to the queue, with word of what is held here now."""
        self._recall()
        self._queue.back.remote(tickets, self.model, self.incarnation, self._held_order)

    def _held_priority(self) -> int | None:
        return None if self._held is None else self._held.priority

    def _pump(self) -> None:
        """Grant the queue what could start now (``GRANT_AFTER_S`` from now), or set a
        timer for when it could."""
        if not self._granting:
            self._granting = True
            asyncio.get_running_loop().call_later(GRANT_AFTER_S, self._grant)

    def _grant(self) -> None:
        """One ``ready`` for the slots freed meanwhile. Not awaited: a credit needs no
        round trip; a failed one is taken back."""
        self._granting = False
        now = time.monotonic()
        self.breaker.advance(now)
        free = self.cap + HELD - self._busy() - (self._held is not None) - self.granted
        if free <= 0 or self.granted >= self.low_water:
            self._settle()
            return  # the queue has credits enough for now: this one would pay for nothing
        grant = to_grant(
            now,
            free,
            self.breaker,
            self.limiter,
            self._typical_tokens,
            granted=self.granted,
            answers_due=bool(self._flights or self.lending.out),
            held_until=self._grants_held_until,
            held_back_tokens=self._held_back_tokens,
        )
        if not isinstance(grant, Grant):
            self._settle()
            if grant.until is not None:
                self._wake(grant.until, now)
            return
        n = grant.credits
        self._held_back_tokens = 0  # once: whoever's turn it is now takes the credit
        self.granted += n
        self.grants += 1
        if self._me is None:
            self._me = ray.get_runtime_context().current_actor
        held = self._held_order
        settled, self._settled = tuple(self._settled), []
        self.lending.grants_out += 1
        ref = self._queue.ready.remote(
            self.model, self.incarnation, n, self._me, held=held, settled=settled
        )
        loop = asyncio.get_running_loop()
        ref.future().add_done_callback(
            lambda done: loop.call_soon_threadsafe(self._granted, n, done)
        )

    def _settle(self) -> None:
        """Send the settlements due on their own (no grant goes now to bring them)."""
        if self._settled:
            settled, self._settled = tuple(self._settled), []
            self._queue.settle.remote(self.model, settled)

    def _granted(self, n: int, done: concurrent.futures.Future[Any]) -> None:
        """The queue's answer to a grant of ``n``: if it never took them (it was
        restarting), they are taken back and granted again soon. If it answers as a
        new incarnation, the credits its predecessor held died with it: every credit
        out is taken back and granted afresh (a few too many may reach the new queue
        meanwhile: the tickets they bring past the cap are held or sent back)."""
        self.lending.grants_out -= 1
        exc = done.exception()
        if exc is None:
            said = done.result()
            if isinstance(said, tuple):  # (incarnation, tickets that may come here wait)
                said, waiting = said
                self._queue_said(waiting)
            self._saw_queue(said)
            return
        log.info("%s: the queue did not take %d credits (%s)", self.model, n, type(exc).__name__)
        self.granted = max(0, self.granted - n)
        self._wake(time.monotonic() + RETRY_GRANT_S, time.monotonic())

    def _saw_queue(self, incarnation: int) -> None:
        """The queue is at ``incarnation`` (an answer to a grant, or an owner's word):
        a newer one than known lost every credit granted before."""
        known = self._queue_incarnation
        if known is not None and incarnation <= known:
            return
        self._queue_incarnation = incarnation
        if known is not None:
            log.warning("%s: the queue restarted; its credits are granted afresh", self.model)
            self.granted = 0
            self.lending.queue_waits = False  # a new queue holds what owners send it again
            self._pump()

    def _wake(self, at: float, now: float) -> None:
        if self._wake_at is not None and self._wake_at <= at:
            return
        self._wake_at = at
        asyncio.get_running_loop().call_later(max(0.0, at - now), self._woken, at)

    def _woken(self, at: float) -> None:
        if self._wake_at == at:
            self._wake_at = None
        self._pump()

    # -- completions ------------------------------------------------------

    def _done(self, msg: CallsDone) -> None:
        now, wall = time.monotonic(), time.time()
        was = self.breaker.state
        for r in msg.results:
            flight = self._flights.pop(r.task_id, None)
            if flight is None:
                continue
            self._grants_held_until = None  # a refund may make room before the limiter said
            t = flight.ticket
            if flight.spool is not None:
                flight.spool.close()  # its last deltas go before its answer
            if r.error == UNSENT:
                self.breaker.release(now, flight.permit)
                self.limiter.release(now, flight.reservation)
                self._unspool(t.owner, r.task_id)
                self._answer(t.owner, Unsent(task_id=t.task_id, attempt=t.attempt, why=r.detail))
                continue
            lesson = self._learn(r, flight.permit, flight.reservation, now, wall)
            settled = settlement(t.priority, t.tenant, t.cost, r.usage)
            if settled is not None:
                self._settled.append(settled)
            if r.error == "abandoned" and t.owner not in self._outboxes:
                continue  # its owner was taken for dead: nobody waits for it
            answer = Attempted(
                task_id=t.task_id,
                attempt=t.attempt,
                sent_at=flight.sent_at,
                result=portable(r, t.task_id),
                lesson=lesson,
                call=r.task_id,
                deltas=0 if flight.spool is None else flight.spool.count,
            )
            self._answer(t.owner, answer)
        self._breaker_told(was)
        self._start_held()
        self._pump()

    def _learn(
        self, r: CallResult, permit: Allow, reservation: Reservation, now: float, wall: float
    ) -> Lesson:
        """What call ``r`` teaches the guards (made here, or by an owner on a lease)."""
        lesson = learn(
            r,
            permit,
            reservation,
            now=now,
            now_epoch=wall,
            breaker=self.breaker,
            limiter=self.limiter,
            health=self.health,
        )
        if lesson.limited_run:
            log.warning(RATE_LIMITED_RUN, self.model, LIMITED_RUN, lesson.error)
        return lesson

    def _answer(self, owner: int, answer: Attempted | Unsent) -> None:
        box = self._outbox(owner)
        box.answers.append(answer)
        box.poll.wake()

    def _mind_leases(self) -> None:
        """Sweep the leases on a timer of their own while a stream is open: the sweep
        otherwise runs in an owner's poll, and a dead owner's stream, once nobody else
        polled this model, held its slot and its provider connection for good (found
        by a hunt)."""
        if not self._sweeping:
            self._sweeping = True
            asyncio.get_running_loop().call_later(self._lease_s, self._swept)

    def _swept(self) -> None:
        self._sweeping = False
        self._sweep(time.monotonic())
        if any(box.spools for box in self._outboxes.values()):
            self._mind_leases()

    def _sweep(self, now: float) -> None:
        for owner, box in list(self._outboxes.items()):
            if now - box.seen > self._lease_s:
                if box.answers:
                    log.warning("owner %d went silent: %d answers dropped", owner, len(box.answers))
                    self._lapsed[owner] = now  # told so if it is back: it sends them again
                if box.abandon(None):  # nobody reads them: their calls end, slots free
                    log.warning("owner %d went silent: its streams end", owner)
                    self._lapsed[owner] = now
                held = self._held
                if held is not None and held.owner == owner:  # not called past its lease: it
                    # was, when a slot freed, for an owner killed a lease before (a hunt)
                    self._held, self._held_order = None, None
                    self._lapsed[owner] = now  # told so if it is back: it sends it again
                    self._pump()  # the held place is free
                del self._outboxes[owner]
        self._reclaim(now)
        forget = [o for o, at in self._lapsed.items() if now - at > LAPSED_KEEP_S]
        for owner in forget:  # a process that died never collects: nothing kept for good
            del self._lapsed[owner]

    def _reclaim(self, now: float) -> None:
        """Take back the permits whose owner is gone (its lease ran out) or that nobody
        reported a call ended by ``RECLAIM_S`` past its total timeout (a report lost on
        its way): their slots free, each counted as a call made (the limiter keeps its
        charge; the breaker hears nothing)."""
        if not self.lending.out:
            return
        late = now - self.settings.timeout.total - RECLAIM_S
        gone = [
            pid
            for pid, lent in self.lending.out.items()
            if lent.owner not in self._outboxes or lent.at < late
        ]
        for pid in gone:  # told so if it is back: its permits are void (found by a review)
            owner = self.lending.out[pid].owner
            if owner not in self._outboxes:
                self._lapsed[owner] = now
        if gone:
            log.info("%s: %d lent permits taken back unreported", self.model, len(gone))
            self._take_back(now, gone)

    def _take_back(self, now: float, permits: list[int]) -> None:
        """These lent permits' calls will not be heard of: each counts as made (the
        limiter keeps its charge; the breaker hears nothing); their slots free."""
        for pid in permits:
            lent = self.lending.out.pop(pid)
            if lent.permit is not None:
                self.breaker.release(now, lent.permit)
            if lent.reservation is not None:
                self.limiter.settle(now, lent.reservation, lent.reservation.tokens)
        if permits:
            self._pump()


def _restarted() -> bool:
    """Whether Ray restarted this actor (it was killed or crashed before)."""
    with warnings.catch_warnings():  # Ray 2.60 calls its own deprecated actor_id there
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
