"""The link: in each process, the local end of the cluster's queue and model actors.

It stands at the queue's address (``QUEUE``), so the ``Enqueue`` of the front
door and of the router and the system's ``Cancel`` reach it as they would the
local queue. It keeps
what belongs to this process: each task's current ``Job``, the retry policy
of every model, and the ledger's word on every task.

Theory of operation. An ``Enqueue`` turns into one batch of tickets to the
shared queue, but for the tasks that find a permit of a model's lease here
(``cluster._lease``): those calls this process makes itself, on its I/O loop
(``Direct`` brings their results back, judged here as a model's answers are,
and reported to the model's actor, which learns from them). The ``Poller``
(one thread) long-polls the queue and every model actor for this process's
news and tells it here (``News``). A model's
answer is judged here (``attempt.judge``, the same decision the local model
actor makes): a retry goes back to the shared queue after its delay
(``Resend``), a job the model gives up on moves on along its plan
(``fallback.leave``), an end is delivered through the ledger.

Streams. A streamed task's deltas come in its model's news (``Deltas``), in
batches; the first call heard from claims the stream (``_Claim``): another
call's deltas or answer for it (a duplicate after a restart) are ignored, and
the call ended on its model (``refuse``), so the reader never gets the text
twice. A reader gets a call's deltas only in order from its first, each once:
they are numbered (``Deltas.seq``) and the call's answer counts them
(``Attempted.deltas``), so a batch lost on the way (a poll's answer lost with
the poller that died fetching it) shows as a gap (``unheard``). A call whose
first deltas were lost, none of its deltas having reached the reader, is
refused (ended on its model; whatever else comes of it ignored) and the task
sent again, a fresh stream (the first call heard from at its first delta
claims it); a gap after the claim cuts the stream ``STREAM_CUT`` with exactly
the text the reader got. Each batch goes to the task's
``StreamFeed`` (``cluster._feed``) on the process's I/O loop, which puts it to
the reader's channel and pauses the call on its actor while the reader is
behind; the task's end is delivered through the feed, after its last delta.
A stream that started is never called again: a retry or a move after it, or
its model lost (restarted, or it took this process for dead), ends it
``STREAM_CUT`` with the text the reader has. A cancelled stream (its reader
left) ends its call on the actor (``abandon``). The claims outlive the link
(``Claims``, held by the assembly): a restarted link ends each stream that had
started ``STREAM_CUT`` with the text its reader got, as a local stream cut
would, and ends its call on the actor (nobody reads it any more). A process
that gives the cluster up (``when_lost = "local"``) first ends its started
streams the same way (``EndStreams``), at once, with the text that went into
their readers' channels: the local queue that takes over would call them again
from the start.

Deadlines are kept here too: a task whose deadline passes ends ``Expired``
here, whatever the cluster does meanwhile (so a cluster lost after the start
holds no task past its deadline). The queue expires what waits there too;
whichever comes first ends the task, the ledger once.

A lost cluster. The poller takes the cluster for lost when none of its polls
has been answered for ``lost_after_s`` and tells the system's ``on_lost``.
With ``when_lost = "wait"`` the link hears ``Lost``: every task it holds
without a deadline fails ``PROVIDER_DOWN`` (it would otherwise wait for
ever), and so does each one sent while the cluster stays lost; a task with a
deadline waits for the cluster up to it. An answer from the cluster again
(``Lost(why=None)``) ends that. (``"local"`` replaces the link: see
``_assembly``.)

Failures. Every batch carries its sender's incarnation. When the queue or a
model actor comes back as a new incarnation (Ray restarted it, its state
lost), every task of this process still in the cluster is sent again: the
ledger is the truth, the queue ignores a ticket already waiting, and an
answer for an attempt no longer awaited (a duplicate call) is ignored, so
nothing is lost and nothing is answered twice. A call made here on a lease
is in this process's hands, not the cluster's: it is not sent again (nor
failed with a lost cluster); the permits held of a dead incarnation are void.

The poller dying. The poller thread is this process's only ear on the
cluster: if it dies of an exception it does not expect (a bug, a foreign
error out of Ray), it tells the link (``PollerDied``) and the link fails
(``PollerDiedError``), as an actor does on a bug: the supervisor restarts it,
and the new link starts a new poller thread, which takes over the polls the
dead one had made (no answer they bring is dropped), and sends every task of
this process still in the cluster again (what the dead poller took and never
told is called again: answered once, by the ledger). This is what a Ray user
expects of a failed worker (Ray restarts its actors the same way), and not
the lost-cluster policy: the cluster did not go away, and ``when_lost``
would fail tasks (``"wait"``) or give up the cluster's shared limits
(``"local"``) for a fault of this process's own. A poller that keeps dying
crash-loops the link until the supervisor's restart intensity gives up: the
system then fails every live task and stops. No task hangs either way.

What must hold: every task handed to the link ends through ``deliver``
exactly once, or stays in ``_jobs`` (in the cluster) until it does; the poller
runs, or the link is told it died; a stream's reader gets one call's deltas, in
order from its first, each once, and then the task's end: its whole answer, or
a ``STREAM_CUT`` whose ``partial_text`` is exactly the text it got.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import heapq
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import ray
from callboard.actors.base import (
    AGGREGATOR,
    OVER_BUDGET,
    QUEUE,
    ROUTER,
    Actor,
    Runtime,
    deliver,
    ended,
    goes_on_after,
    judged,
    paid_by,
    paying,
    restamped,
    stranded_end,
    to_retry,
)
from callboard.cluster._connect import Connection
from callboard.cluster._feed import StreamFeed
from callboard.cluster._lease import Calls, DirectCall, Stocks, Void
from callboard.cluster._wire import (
    Adopted,
    Attempted,
    Deltas,
    Direct,
    Lease,
    Leased,
    ModelNews,
    News,
    QueueNews,
    Resend,
    Spent,
    StockDue,
    Unqueue,
    Unqueued,
    Unsent,
    clock_of,
    key_of,
    lesson_only,
    on_my_clock,
    task_id_of,
    ticket_of,
    unheard,
)
from callboard.core.admission import Send, send_of, tokens_of, unmade
from callboard.core.alarm import Alarm
from callboard.core.attempt import (
    End,
    RetryAt,
    judge,
    known_usage,
    most_charged,
    served_price,
)
from callboard.core.fallback import Availability, leave
from callboard.core.learn import lesson_of
from callboard.core.pricing import cost_nusd
from callboard.core.retry import RetryPolicy
from callboard.core.settings import ModelSettings
from callboard.messages import (
    BreakerState,
    CallboardError,
    CallsDone,
    Cancel,
    Cancelled,
    Enqueue,
    Expired,
    ExpireDue,
    Failed,
    FailureReason,
    Job,
    Rejected,
    RejectReason,
    Result,
    Task,
    Usage,
)
from callboard.messages._errors import shown_address
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.http import UNSENT, ModelClient, error_detail
from callboard.supervisor.address_book import AddressBook

log = guarded_logger(__name__)

UNQUEUE_AGAIN_S = (0.05, 0.25, 1.0)
"""After a stop's cancel, when the link takes back again what the cluster has not
called (each delay from the one before): tickets in transit as it first asked."""

POLL_WAIT_S = 0.25
"""How long one long poll waits for news (the bound on noticing a stop)."""
REPOLL_S = 0.2
"""How soon a poll that failed (its actor restarting) is made again."""
TAKE_BACK_S = 2.0
"""How long a stopping link waits for the cluster to hear that its tasks ended."""
_LATE = "the deadline passed while the cluster held it"
_MAYBE_CALLED = " (its call may have been made: counted)"
_LOST = "some of its deltas were lost on their way from the model"

DirectClient: TypeAlias = Callable[[str, Callable[[CallsDone], object]], ModelClient]
"""Model name, where its results go -> the client of the calls this process makes on
that model's leases (``ModelClients.direct``)."""

Call: TypeAlias = tuple[str, int, int]
_Ended: TypeAlias = tuple[list[Spent], list[int], list[Attempted | Unsent]]
"""Calls made on one incarnation's leases that ended: spent permits, unused ones, and
what each says for its task."""
"""A call on a model actor: (model, the actor's incarnation, its number for the call)."""


@dataclass(slots=True)
class _Claim:
    """The one call whose deltas a streamed task's reader gets (the first heard from)."""

    source: str
    incarnation: int
    call: int
    heard: list[str]
    """The text the reader was sent, for a ``STREAM_CUT``'s ``partial_text``."""
    feed: StreamFeed


Claims: TypeAlias = dict[int, _Claim]
"""Task id -> its stream's claim: held by the assembly, so that a restarted link
knows what each started stream's reader got."""


@dataclass(frozen=True, slots=True)
class Lost:
    """Poller -> link: the cluster answers none of our polls (``why``), or again (None)."""

    why: str | None


@dataclass(frozen=True, slots=True)
class EndStreams:
    """Assembly -> link (ask): this process gives the cluster up (``why``); end every
    stream that started now. The answer: a future for each, done once it is delivered."""

    why: str


@dataclass(frozen=True, slots=True)
class PollerDied:
    """Poller -> link: the poller thread of ``generation`` died of an unexpected error."""

    generation: int
    why: str


class PollerDiedError(CallboardError):
    """The link's poller thread died of an unexpected error: the link fails with it, to
    be restarted with a new poller (module docstring)."""


_LEASES = (Direct, Leased, StockDue, Adopted)


class LinkActor(Actor):
    def __init__(
        self,
        rt: Runtime,
        name: str,
        incarnation: int,
        *,
        connection: Connection,
        owner: int,
        models: Mapping[str, ModelSettings],
        poller: Poller,
        claims: Claims,
        seen: dict[str, int] | None = None,
        seed: int = 0,
        direct: DirectClient | None = None,
        leasable: frozenset[str] = frozenset(),
        final: threading.Event | None = None,
        stocks: Stocks | None = None,
        calls: Calls | None = None,
    ) -> None:
        super().__init__(rt, name, incarnation)
        self._conn = connection
        self._owner = owner
        self._models = models
        self._poller = poller
        self._watch = poller.watch
        self._retry = {
            m: RetryPolicy(s.retry, random.Random(seed * 1_000_003 + incarnation))
            for m, s in models.items()
        }
        self._jobs: dict[int, Job] = {}
        """Task id -> its job as it stands, for every task of this process in the cluster."""
        self._retrying: set[int] = set()
        """Tasks waiting here out a retry's delay (not in the cluster until ``Resend``)."""
        self._deadlines: list[tuple[float, int]] = []
        """(deadline, task id) of the tasks in the cluster that have one."""
        self._expiry = Alarm()
        self._seen: dict[str, int] = {} if seen is None else seen
        """Source -> the incarnation its last news came from (or known at start: the
        assembly's, kept across the link's incarnations)."""
        self._lost: str | None = None
        """Why the cluster is taken for lost (``when_lost = "wait"``), or None."""
        self._claims = claims
        """Streamed tasks whose deltas have started: the call that sends them, and the
        feed that puts them to the reader's channel (on the I/O loop). The previous
        incarnation's, after a restart."""
        self._refused: dict[int, set[Call]] = {}
        """Task id -> calls for it whose deltas its reader never gets (their beginning
        was lost on the way, or another call has the stream), ended on their models."""
        self._available = Availability()
        """The models given up on, as their actors' news says (``give_up_s``)."""
        self.sent = 0
        self.ignored = 0
        self.resent = 0
        self.refused = 0
        """Streamed calls refused (``_refuse``)."""
        self._direct = direct
        """Where the calls made here on leases go (None: none are, every task is a
        ticket); with ``_stocks`` and ``_calls``, the assembly's, across incarnations."""
        self._leasable = leasable
        """The models whose calls may be made here on leases."""
        self._final = threading.Event() if final is None else final
        """Set when this link stops for good (its system stops, or runs alone): its calls
        on the wire are then let go (``_let_go``), not on a restart."""
        self._stocks = Stocks() if stocks is None else stocks
        self._calls: Calls = {} if calls is None else calls
        self.direct_calls = 0
        """Calls made here on leases (``cluster._lease``)."""

    def setup(self) -> None:
        if self.incarnation > 1:  # the ledger knows what this process has in the cluster
            if self._poller.revive():
                log.warning("the cluster poller died: a new one polls for this process")
            self._send(self.rt.ledger.routed())
            self._claims.clear()  # the started streams ended there; any other is stale

    def on_stop(self) -> None:
        """Stopped (its system stops, or runs alone from now on): what this process has
        in the cluster is taken back, as a stop that cancels takes it (the stop's sweep
        ends those tasks here; the local queue takes them over). Left there, the cluster
        called them for up to a lease after they had ended ``Cancelled`` here, ahead of
        every other process's work (found by a hunt)."""
        try:
            self._give_back(*self._stocks.drop_all())
            if self._final.is_set():  # a restart (a sibling's) keeps its calls' permits
                self._let_go()
            self._take_back()
        finally:
            super().on_stop()

    def _let_go(self) -> None:
        """Tell each model of the calls still on the wire on its leases (the system stops
        without their answers, or hands them to a local queue): their permits count as
        used there, their slots free (else held until this process's lease ran out)."""
        by_lender: dict[tuple[str, int], list[int]] = {}
        for d in self._calls.values():
            by_lender.setdefault((d.model, d.incarnation), []).append(d.permit)
        for (model, incarnation), permits in by_lender.items():
            self._report(model, incarnation, [], [], gone=permits)

    def _take_back(self) -> None:
        """Withdraw this process's tickets from the queue and abandon its tasks on the
        models, waiting up to ``TAKE_BACK_S`` for the cluster to hear it (not at all if
        it is taken for lost): a process that exits next must not lose the word."""
        jobs = [j for i, j in self._jobs.items() if i not in self._calls]
        if not jobs:  # (a call made here on a lease is in this process's hands)
            return
        refs = self._withdraw(jobs)
        if self._lost is None and not self._poller.lost:  # either way of taking it for lost
            _, late = ray.wait(refs, num_returns=len(refs), timeout=TAKE_BACK_S)
            if late:
                log.warning(
                    "the cluster did not hear within %.0f s that this process's "
                    "%d tasks there ended",
                    TAKE_BACK_S,
                    len(jobs),
                )

    def handle(self, message: Any) -> Any:
        kind = type(message)
        if kind is News:
            self._news(message)
        elif kind in _LEASES:
            self._on_lease(message)
        elif kind is Enqueue:
            self._send(message.jobs)
        elif kind is Resend:
            self._retrying.difference_update(message.task_ids)
            self._tickets(self._jobs[i] for i in message.task_ids if i in self._jobs)
        elif kind is Cancel:
            self._cancel(message)
        elif kind is Unqueued:
            self._unqueued_end(message)
        elif kind is Unqueue:
            self._unqueue(list(self._jobs.values()), message.detail)
            if message.left > 0:
                delay = UNQUEUE_AGAIN_S[len(UNQUEUE_AGAIN_S) - message.left]
                again = Unqueue(detail=message.detail, left=message.left - 1)
                self.rt.after(delay, self.name, again)
        elif kind is ExpireDue and self._expiry.rang(message.at):
            self._expire_due()
        elif kind is Lost:
            self._lost_or_back(message.why)
        elif kind is PollerDied and message.generation == self._poller.generation:
            raise PollerDiedError(f"the cluster poller died: {message.why}")
        elif kind is EndStreams:
            return self._end_streams(message.why)
        return None

    # -- to the cluster ---------------------------------------------------

    def _send(self, jobs: Iterable[Job]) -> None:
        ledger, now = self.rt.ledger, self.rt.clock()
        fresh: list[Job] = []
        gone: list[tuple[Task, Result]] = []
        cut: list[Job] = []
        for job in jobs:
            task = job.task
            if not ledger.is_routed(task.task_id):
                continue
            if ledger.cancel_wanted(task):
                gone.append((task, ended(Cancelled, task, now, job=job, detail="cancelled")))
            elif task.deadline_at is not None and task.deadline_at <= now:
                if task.task_id in self._claims:  # a stream that started: charged as sent
                    gone.append((task, self._late(job, now)))
                else:
                    gone.append(
                        (task, ended(Expired, task, now, job=job, detail="deadline passed"))
                    )
            elif self._lost is not None and task.deadline_at is None:
                gone.append((task, self._down(job, now)))
            elif (stranded_at := self._stranded(job, now)) is not None:
                gone.append((task, stranded_at))
            elif task.task_id in self._claims or (task.stream is not None and task.stream.received):
                cut.append(job)  # this link's restart: the stream had started
                gone.append((task, self._restart_cut(job, now)))
            else:
                self._jobs[task.task_id] = job
                fresh.append(job)
                if task.deadline_at is not None:
                    heapq.heappush(self._deadlines, (task.deadline_at, task.task_id))
        self._abandon(cut)  # nobody reads their calls any more
        self._end(gone)
        self._tickets(fresh)
        self._arm(now)

    def _end_stranded(self) -> None:
        """End the tasks whose every model is given up on (``give_up_s``), but for the
        streams that started, and take their tickets from the queue, as the local queue
        does: a task without a deadline waited for good while its provider was down."""
        now = self.rt.clock()
        gone: list[tuple[Task, Result]] = []
        for job in self._jobs.values():
            if job.task.task_id not in self._claims:
                result = self._stranded(job, now)
                if result is not None:
                    gone.append((job.task, result))
        keys = [key_of(self._owner, task.task_id) for task, _ in gone]
        self._end(gone)
        if keys:
            self._watch(self._conn.queue.withdraw.remote(keys))

    def _stranded(self, job: Job, now: float) -> Result | None:
        return stranded_end(job, self._available, now)

    def _restart_cut(self, job: Job, now: float) -> Result:
        """A stream that had started when this link restarted: ``STREAM_CUT``, with the
        text its reader got (its claim outlived the link's previous incarnation)."""
        detail = "the stream's link restarted while it streamed"
        claim = self._claims.get(job.task.task_id)
        if claim is not None:
            return self._cut(job, claim, now, detail)
        cut = {"reason": FailureReason.STREAM_CUT, "detail": detail}  # its text is not known
        return ended(Failed, job.task, now, job=job, **cut)

    def _tickets(self, jobs: Iterable[Job]) -> None:
        """Each job's call: made here on a permit of a lease (``cluster._lease``) where
        one fits it, else a ticket to the shared queue (one batch)."""
        now, wall = self.rt.clock(), time.time()
        lending = self._direct is not None and self._lost is None
        tickets = []
        sends: dict[str, list[Send]] = {}
        unmade: list[tuple[str, int, Unsent]] = []
        cancelled: list[tuple[Task, Result]] = []
        for j in jobs:
            task = j.task
            if self.rt.ledger.cancel_wanted(task):  # (a stop's cancel, then a retry or move)
                cancelled.append((task, ended(Cancelled, task, now, job=j, detail="cancelled")))
                continue
            lent = None
            # (a task whose call is on the wire here, sent again by a restarted link,
            # goes to the queue: its call's entry stays the one on the wire)
            if lending and task.stream is None and task.task_id not in self._calls:
                leasable = [m for m in j.candidates if m in self._leasable]
                lent = self._stocks.take(leasable, tokens_of(task), now) if leasable else None
            if lent is None:
                tickets.append(ticket_of(j, self._owner, now=now, wall=wall))
                continue
            model, incarnation, permit = lent
            try:
                send = send_of(task, j.attempt + 1, self._models[model], now)
            except Exception as exc:  # this task's call, not the link: logged, it ends
                log.exception("the call of task %d could not be made", task.task_id)
                self._give_back(Void(model, incarnation, (permit,)))
                said = Unsent(
                    task_id=task.task_id, attempt=j.attempt, why="unmade", detail=error_detail(exc)
                )
                unmade.append((model, incarnation, said))
                continue
            self._calls[task.task_id] = DirectCall(
                model=model, incarnation=incarnation, permit=permit, attempt=j.attempt, sent_at=wall
            )
            sends.setdefault(model, []).append(send)
        for model, batch in sends.items():
            assert self._direct is not None
            client = self._direct(model, functools.partial(_tell_direct, self.rt.book, model))
            self.direct_calls += len(batch)
            self.rt.io.call_soon(client.start, batch)
        if tickets:
            self.sent += len(tickets)
            self._watch(self._conn.queue.enqueue.remote(tickets))
        self._end(cancelled)
        for model, incarnation, said in unmade:
            self._judge(model, incarnation, [said])
        if lending:
            self._ask(now)

    # -- leases -------------------------------------------------------------

    def _on_lease(self, message: Direct | Leased | StockDue | Adopted) -> None:
        if isinstance(message, Direct):
            self._direct_done(message)
        elif isinstance(message, Leased):
            self._leased(message.model, message.lease)
        elif isinstance(message, Adopted):
            self._adopted(message)
        else:
            self._give_back(self._stocks.due(message.model, self.rt.clock()))

    def _ask(self, now: float) -> None:
        """Ask each model tasks wanted permits of for a lease (``Stocks.asks``); the
        answer comes back as ``Leased``."""
        for ask in self._stocks.asks(now):
            handle = self._conn.models.get(ask.model)
            if handle is None:
                self._stocks.got(ask.model, None, now)
                continue
            try:
                ref = handle.lease.remote(self._owner, ask.n, ask.tokens)
            except Exception:  # noqa: BLE001 - an actor that cannot lend (another version):
                log.warning("%s: its actor lends nothing: tasks go to the queue", ask.model)
                self._leasable -= {ask.model}  # not asked again
                self._stocks.got(ask.model, None, now)
                continue
            ref.future().add_done_callback(
                functools.partial(_tell_leased, self.rt.book, ask.model, handle, self._owner)
            )

    def _leased(self, model: str, lease: Lease | None) -> None:
        now = self.rt.clock()
        if lease is not None and (
            self._lost is not None or self._seen.get(model, lease.incarnation) != lease.incarnation
        ):
            self._give_back(Void(model, lease.incarnation, lease.permits))
            lease = None  # lent by an incarnation gone (or to a process that gave up)
        self._give_back(self._stocks.got(model, lease, now))
        if lease is not None:
            self.rt.after(self._stocks.permit_s, self.name, StockDue(model=model, at=now))
            self._ask(now)

    def _give_back(self, *voids: Void | None) -> None:
        """Permits not used go back to the incarnation that lent them (one that is gone
        ignores them: they died with it)."""
        for v in voids:
            if v is not None:
                self._report(v.model, v.incarnation, [], list(v.permits))

    def _adopt(self, model: str, incarnation: int) -> None:
        """``model``'s actor restarted: the calls on the wire here on its dead
        incarnation's permits take slots of the new one (``ModelShell.adopt``), which
        admitted its whole cap beside them (found by a review)."""
        calls = self._calls.items()
        task_ids = tuple(i for i, d in calls if d.model == model and d.incarnation != incarnation)
        handle = self._conn.models.get(model)
        if not task_ids or handle is None:
            return
        ref = handle.adopt.remote(self._owner, len(task_ids))
        ref.future().add_done_callback(
            functools.partial(_tell_adopted, self.rt.book, model, task_ids)
        )

    def _adopted(self, msg: Adopted) -> None:
        """Each call still on the wire reports to the incarnation that adopted it; a
        permit whose call ended meanwhile goes back at once."""
        gone: list[int] = []
        for task_id, permit in zip(msg.task_ids, msg.permits, strict=True):
            d = self._calls.get(task_id)
            if d is None or d.model != msg.model or d.incarnation == msg.incarnation:
                gone.append(permit)
            else:
                self._calls[task_id] = dataclasses.replace(
                    d, incarnation=msg.incarnation, permit=permit
                )
        if gone:
            self._report(msg.model, msg.incarnation, [], gone)

    def _report(
        self,
        model: str,
        incarnation: int,
        spent: list[Spent],
        unused: list[int],
        gone: Sequence[int] = (),
    ) -> None:
        """Tell the incarnation that lent them what became of its permits: ``spent`` on
        a call that ended here, ``unused`` (back unspent), ``gone`` (a call still on the
        wire, let go: its slot frees)."""
        handle = self._conn.models.get(model)
        if handle is not None and (spent or unused or gone):
            self._watch(handle.report.remote(self._owner, incarnation, spent, unused, tuple(gone)))

    def _direct_done(self, msg: Direct) -> None:
        """Calls made here on leases ended: each is judged as a model's answer is, and
        reported to the model's actor, which learns from it (one report a batch)."""
        wall = time.time()
        by_lender: dict[tuple[str, int], _Ended] = {}
        for r in msg.results:
            d = self._calls.pop(r.task_id, None)
            if d is None:
                continue
            spent, unused, answers = by_lender.setdefault((d.model, d.incarnation), ([], [], []))
            if r.error == UNSENT:  # never started (its deadline passed in the window)
                unused.append(d.permit)
                answers.append(Unsent(task_id=r.task_id, attempt=d.attempt, why=r.detail))
                continue
            spent.append(Spent(permit=d.permit, result=lesson_only(r)))
            answers.append(
                Attempted(
                    task_id=r.task_id,
                    attempt=d.attempt,
                    sent_at=d.sent_at,
                    result=r,
                    lesson=lesson_of(r, now_epoch=wall),
                )
            )
        for (model, incarnation), (spent, unused, answers) in by_lender.items():
            self._report(model, incarnation, spent, unused)
            self._judge(model, incarnation, answers)

    def _resend_all(self, why: str, source: str) -> None:
        """Everything this process has in the cluster goes to the queue again, but for
        the streams that started: a stream of ``source`` (whose calls are lost) is cut
        there, another's goes on (a second call would send its reader the text again)."""
        self._cut_streams(source, why)
        claims = self._claims
        calls = self._calls  # (a call made here on a lease answers here, whatever restarted)
        jobs = [
            j
            for i, j in self._jobs.items()
            if i not in self._retrying and i not in claims and i not in calls
        ]
        if jobs:
            log.warning("%s: sending %d tasks to the cluster's queue again", why, len(jobs))
            self.resent += len(jobs)
        self._tickets(jobs)

    # -- a lost cluster -----------------------------------------------------

    def _lost_or_back(self, why: str | None) -> None:
        was, self._lost = self._lost, why
        if why is None:
            if was is not None:
                log.warning("the cluster answers again: tasks are sent to it as before")
            return
        now, claims = self.rt.clock(), self._claims
        doomed = [  # but for the calls made here on leases: they answer here
            j for i, j in self._jobs.items() if j.task.deadline_at is None and i not in self._calls
        ]
        log.error(
            "%s: %d tasks without a deadline fail; those with one wait for it up to that",
            why,
            len(doomed),
        )
        # taken back, heard if the cluster comes back: left there, each was called
        # then for a task that had failed here (found by a hunt)
        try:
            self._withdraw(doomed)
        except Exception:  # noqa: BLE001 - a cluster gone for good may refuse the asking:
            log.info("the cluster could not be told of %d tasks that end here", len(doomed))
        said = f"{why} while it streamed"
        self._end(
            [
                (j.task, self._down(j, now))
                if j.task.task_id not in claims  # a stream that started is cut, its text kept
                else (j.task, self._cut(j, claims[j.task.task_id], now, said))
                for j in doomed
            ]
        )

    def _down(self, job: Job, now: float) -> Result:
        assert self._lost is not None
        detail = f"{self._lost}; the task has no deadline to wait for it up to"
        return ended(
            Failed, job.task, now, job=job, reason=FailureReason.PROVIDER_DOWN, detail=detail
        )

    def _cancel(self, msg: Cancel) -> None:
        ledger = self.rt.ledger
        now = self.rt.clock()
        if msg.everything and self._lost is not None:  # no answer is coming: all end now
            ledger.cancel_everything()  # (but for the calls on the wire here: they answer)
            jobs = [j for i, j in self._jobs.items() if i not in self._calls]
            self._withdraw(jobs)
        elif msg.everything:  # a stop's: what the cluster has not called, not the calls made
            ledger.cancel_everything()
            here = {i for i in self._retrying if i in self._jobs}  # a retry's delay
            self._unqueue([j for i, j in self._jobs.items() if i not in here], msg.detail)
            jobs = [self._jobs[i] for i in here]
            # and again: a ticket on its way between the queue and a model (or sent back
            # to the queue) as the first asked missed both, and was held and called after
            # the calls the stop waits for (a fresh-clone CI run's failure)
            again = Unqueue(detail=msg.detail, left=len(UNQUEUE_AGAIN_S) - 1)
            self.rt.after(UNQUEUE_AGAIN_S[0], self.name, again)
        else:
            ids = [i for i in msg.task_ids if i in self._jobs]
            ledger.ask_cancel([i for i in msg.task_ids if i not in self._jobs])
            jobs = [self._jobs[i] for i in ids]
            self._withdraw(jobs)
        self._end([(j.task, ended(Cancelled, j.task, now, job=j, detail=msg.detail)) for j in jobs])

    def _unqueue(self, jobs: Sequence[Job], detail: str) -> None:
        """Take ``jobs``' tickets back from the queue, and from each model the one it
        holds as its next call: the tasks of those it had end ``Cancelled`` (``Unqueued``,
        once the actor has answered); a call made runs on, its answer awaited as ever. A
        stop's cancel ended every task the link held at once, calls made included: the
        provider answered them, paid, and a resume called them again (found by a hunt);
        locally they have the stop's timeout to answer."""
        refs = self._withdraw(jobs, calls=False)
        if refs:  # the queue's answer (its keys) first, then each model's (task ids)
            queue, *models = refs
            queue.future().add_done_callback(self._unqueued(detail, task_id_of))
            for ref in models:
                ref.future().add_done_callback(self._unqueued(detail, int))

    def _unqueued(
        self, detail: str, task_id: Callable[[int], int]
    ) -> Callable[[concurrent.futures.Future[Any]], None]:
        """A done-callback that tells the link which tasks an actor's answer (its keys or
        task ids: ``task_id`` reads each) says left the cluster uncalled."""

        def told(done: concurrent.futures.Future[Any]) -> None:
            if done.cancelled() or done.exception() is not None:
                return  # watched (counted, logged): the stop's timeout ends them
            said = done.result()
            if not isinstance(said, list):  # an actor of an older callboard says nothing
                return  # of what it dropped: the stop's timeout ends them
            ids = tuple(task_id(each) for each in said)
            if ids:
                self.rt.book.try_tell(QUEUE, Unqueued(task_ids=ids, detail=detail))

        return told

    def _unqueued_end(self, msg: Unqueued) -> None:
        now = self.rt.clock()
        jobs = [self._jobs[i] for i in msg.task_ids if i in self._jobs]
        self._end([(j.task, ended(Cancelled, j.task, now, job=j, detail=msg.detail)) for j in jobs])

    # -- from the cluster -------------------------------------------------

    def _news(self, msg: News) -> None:
        news = msg.news
        before = self._seen.get(msg.source)
        self._seen[msg.source] = news.incarnation
        if before is not None and before != news.incarnation:
            self._give_back(self._stocks.drop(msg.source))  # void: the lender died
            if isinstance(news, ModelNews):
                self._adopt(msg.source, news.incarnation)
            self._resend_all(f"{msg.source} restarted", msg.source)
        elif news.lapsed:
            self._give_back(self._stocks.drop(msg.source))  # (it may hold newer ones)
            why = f"{msg.source} took this process for dead (its lease ran out)"
            self._resend_all(why, msg.source)
        if isinstance(news, QueueNews):
            self._expired(news.expired)
            self._no_room(news.refused)
            self._not_taken(news.invalid)
        else:
            self._answers(news)

    def _expired(self, task_ids: tuple[int, ...]) -> None:
        now = self.rt.clock()
        gone = [
            (j.task, ended(Expired, j.task, now, job=j, detail="deadline passed in the queue"))
            for j in (self._jobs.get(i) for i in task_ids)
            if j is not None
        ]
        self._end(gone)

    def _no_room(self, task_ids: tuple[int, ...]) -> None:
        """End the tasks the shared queue had no room for (``Rejected(QUEUE_FULL)``)."""
        if not task_ids:
            return
        now = self.rt.clock()
        full = {"reason": RejectReason.QUEUE_FULL, "detail": "the cluster's shared queue is full"}
        gone = [
            (j.task, ended(Rejected, j.task, now, job=j, **full))
            for j in (self._jobs.get(i) for i in task_ids)
            if j is not None
        ]
        self._end(gone)

    def _not_taken(self, invalid: tuple[tuple[int, str], ...]) -> None:
        """End the tasks whose tickets the shared queue could not take (``Failed(INTERNAL)``:
        another version of callboard there, or a bug)."""
        if not invalid:
            return
        now = self.rt.clock()
        gone: list[tuple[Task, Result]] = []
        for task_id, why in invalid:
            job = self._jobs.get(task_id)
            if job is not None:
                detail = f"the cluster's shared queue cannot take it: {why}"
                failed = ended(
                    Failed, job.task, now, job=job, reason=FailureReason.INTERNAL, detail=detail
                )
                gone.append((job.task, failed))
        self._end(gone)

    def _expire_due(self) -> None:
        """End the tasks whose deadline passed, wherever the cluster has them: a cluster
        that answers nothing (lost, restarting) never holds a task past its deadline."""
        now, due = self.rt.clock(), self._deadlines
        gone: list[tuple[Task, Result]] = []
        while due and due[0][0] <= now:
            _, task_id = heapq.heappop(due)
            job = self._jobs.get(task_id)
            if job is not None:
                gone.append((job.task, self._late(job, now)))
        self._end(gone)
        self._arm(now)

    def _late(self, job: Job, now: float) -> Result:
        """``Expired`` at the deadline; a stream that started was sent, and is charged as
        a local one cut by its deadline is (what it may have used, marked estimated).
        Another may have been called too (a model's answer comes when its call ends): it
        counts that call, so its idempotency key stays answered (``ledger.binds_key``);
        counted as never called, the key was free and a retry with it was called twice
        (found by a review)."""
        claim = self._claims.get(job.task.task_id)
        if claim is None:
            maybe = restamped(job, attempt=job.attempt + 1, dispatched_at=job.dispatched_at)
            return ended(Expired, job.task, now, job=maybe, detail=f"{_LATE}{_MAYBE_CALLED}")
        usage, cost = self._charged(job.task, claim, None)
        calling = restamped(job, attempt=job.attempt + 1, dispatched_at=job.dispatched_at)
        detail = f"{_LATE} as it streamed"
        return ended(
            Expired, job.task, now, job=calling, detail=detail, usage=usage, cost_nusd=cost
        )

    def _arm(self, now: float) -> None:
        jobs, due = self._jobs, self._deadlines
        while due and due[0][1] not in jobs:  # ended meanwhile
            heapq.heappop(due)
        if due and self._expiry.wants(due[0][0]):
            self.rt.after(max(0.0, due[0][0] - now), self.name, ExpireDue(at=due[0][0]))

    def _answers(self, news: ModelNews) -> None:
        model = news.model
        if news.health is not None:
            health = on_my_clock(news.health, clock_of(news), self.rt.clock())
            for name in (ROUTER, AGGREGATOR):
                self.rt.book.try_tell(name, health)
            self._available.observe(health)
            if health.breaker is not BreakerState.CLOSED:  # no call on its permits
                self._give_back(self._stocks.drop(model))
        if news.recall:  # work waits for the model: what is not used goes back
            self._give_back(self._stocks.drop(model))
        for deltas in news.streams:
            self._deltas(model, news.incarnation, deltas)
        self._judge(model, news.incarnation, news.answers)
        if news.health is not None and news.health.given_up is not None:
            self._end_stranded()  # after the answers it came with: the call that had the
            # model given up on (a 401) ended "never made", its own answer dropped, and
            # another task's paid answer in the batch would have been (found by a hunt)

    def _judge(self, model: str, incarnation: int, answers: Iterable[Attempted | Unsent]) -> None:
        """What each answer of ``model``'s actor (``incarnation``), or of a call made
        here on its lease, means for its task: its end, a move, a retry."""
        now, wall = self.rt.clock(), time.time()
        finished: list[tuple[Task, Result]] = []
        moved: list[Job] = []
        for answer in answers:
            job = self._jobs.get(answer.task_id)
            if job is None or job.attempt != answer.attempt or answer.task_id in self._retrying:
                self.ignored += 1  # a duplicate, or for a task ended meanwhile
                continue
            claim = self._claims.get(answer.task_id)
            if claim is not None and not _answers_for(claim, model, incarnation, answer):
                self.ignored += 1  # another call's answer: the reader has this one's text
                continue
            if isinstance(answer, Attempted):
                call = (model, incarnation, answer.call)
                outcome = self._attempted(job, answer, call, now, wall)
            else:
                outcome = self._unsent(job, answer, model, now)
            if isinstance(outcome, Job):
                moved.append(outcome)
            elif outcome is not None:
                finished.append((job.task, outcome))
        self._end(finished)
        self._tickets(moved)

    def _attempted(
        self, job: Job, a: Attempted, call: Call, now: float, wall: float
    ) -> Result | Job | None:
        """What the call made for ``job`` means: its result, the job going on
        elsewhere, or None (a retry here, after its delay; or nothing: a call whose
        deltas its reader never got)."""
        task_id = job.task.task_id
        if call in self._refused.get(task_id, ()):
            self.ignored += 1  # refused: its reader never got its deltas
            return None
        claim = self._claims.get(task_id)
        if job.task.stream is not None and a.deltas > (0 if claim is None else len(claim.heard)):
            return self._lost_end(job, a, call=call, claim=claim, now=now, wall=wall)
        model = call[0]
        sent = judged(_sent(job, a, now, wall), a.result)
        lesson = a.lesson
        settings = self._models[model]
        decision = judge(
            a.result,
            sent,
            lesson.verdict,
            lesson.headers,
            retry=self._retry[model],
            price=settings.price,
            now=now,
        )
        if claim is not None and (isinstance(decision, RetryAt) or decision.move_on):
            said = a.result.detail or "the call failed"
            used = known_usage(a.result, sent.task)
            return self._cut(sent, claim, now, said, used, answered=True)
        if isinstance(decision, RetryAt):
            refused = lesson.verdict.reason is FailureReason.RATE_LIMITED
            again = to_retry(sent, decision, model, rate_limited=refused, error=lesson.error)
            if not goes_on_after(self.rt, again.task, decision.paid):
                return ended(Failed, again.task, now, job=again, model=model, **OVER_BUDGET)
            self._jobs[task_id] = again
            self._retrying.add(task_id)
            self.rt.after(max(0.0, decision.at - now), self.name, Resend(task_ids=(task_id,)))
            return None
        return self._end_or_move(sent, decision, model, now)

    def _lost_end(
        self, job: Job, a: Attempted, *, call: Call, claim: _Claim | None, now: float, wall: float
    ) -> Result | Job:
        """A streamed call ended having sent more deltas than were heard of it: some
        were lost on the way. If its reader got none of them, the task is sent again
        (``job``), a fresh stream; else its stream is cut (``_lost_deltas``)."""
        if claim is None:
            self._refused.setdefault(job.task.task_id, set()).add(call)
            self.refused += 1
            log.warning(
                "task %d: the %d deltas of its stream's call were lost on their way: "
                "sent again, its reader has none of them",
                job.task.task_id,
                a.deltas,
            )
            return job
        sent = _sent(job, a, now, wall)
        return self._cut(sent, claim, now, _LOST, known_usage(a.result, sent.task), answered=True)

    def _unsent(self, job: Job, u: Unsent, model: str, now: float) -> Result | Job | None:
        if u.why == "deadline":
            return ended(Expired, job.task, now, job=job, model=model)
        if u.why == "refused":
            end = End(Failed, {"reason": FailureReason.REQUEST_ERROR, "detail": u.detail}, True)
            return self._end_or_move(job, end, model, now)
        if u.why == "unmade":  # a failure of callboard's, as the local model actor ends it
            return self._end_or_move(job, unmade(u.detail), model, now)
        return job  # revoked: it waits again

    def _end_or_move(self, job: Job, end: End, model: str, now: float) -> Result | Job:
        if end.move_on:
            moved = leave(job, model)
            if moved is not None:  # a budget stops only a task that has somewhere to go on
                paid = paid_by(end)
                if not goes_on_after(self.rt, job.task, paid):
                    over = paying(job, model, paid)
                    return ended(Failed, job.task, now, job=over, model=model, **OVER_BUDGET)
                moved = self._jobs[job.task.task_id] = paying(moved, model, paid)
                return moved
        return ended(end.kind, job.task, now, job=job, model=model, **end.fields)

    def _end(self, pairs: Sequence[tuple[Task, Result]]) -> None:
        if not pairs:
            return
        now: list[tuple[Task, Result]] = []
        for task, result in pairs:
            claim = self._forget(task.task_id)
            if claim is None:
                now.append((task, result))
            else:  # after the deltas on their way to the reader
                then = functools.partial(deliver, self.rt, ((task, result),))
                self.rt.io.call_soon(claim.feed.end, then)
        if now:
            deliver(self.rt, now)

    def _forget(self, task_id: int) -> _Claim | None:
        """The link is done with ``task_id``: its job, its retry mark and its refused
        calls go, and its stream's claim (returned, if it had one)."""
        self._jobs.pop(task_id, None)
        self._retrying.discard(task_id)
        self._refused.pop(task_id, None)
        return self._claims.pop(task_id, None)

    # -- streams ------------------------------------------------------------

    def _deltas(self, model: str, incarnation: int, d: Deltas) -> None:
        """A streamed call's deltas: to the reader, if the call is the task's one and
        they follow what the reader got of it (``unheard``). The first heard from, its
        first delta first, claims the stream; one that starts past its beginning (its
        first batch was lost on the way) is refused and the task sent again; a gap in
        the claimed call's deltas cuts the stream."""
        job = self._jobs.get(d.task_id)
        if job is None or job.attempt != d.attempt or job.task.stream is None:
            self.ignored += 1  # for a task ended meanwhile (its call was told so)
            return
        call = (model, incarnation, d.call)
        if call in self._refused.get(d.task_id, ()):
            self.ignored += 1  # refused before: it is ending on its model
            return
        claim = self._claims.get(d.task_id)
        if claim is not None and (claim.source, claim.incarnation, claim.call) != call:
            self._refuse(d.task_id, call)  # a second call (a duplicate after a restart)
            return
        fresh = unheard(d, 0 if claim is None else len(claim.heard))
        if fresh is None:
            self._lost_deltas(job, call, d.seq, claim)
            return
        if not fresh:
            self.ignored += 1  # heard already (never sent twice; harmless if it were)
            return
        if claim is None:
            handle = self._conn.models[model]
            pause = functools.partial(
                _pause, watch=self._watch, handle=handle, owner=self._owner, task_id=d.task_id
            )
            feed = StreamFeed(job.task.stream, pause)
            job.task.stream.model = model  # the reader's deltas are this call's
            claim = self._claims[d.task_id] = _Claim(model, incarnation, d.call, [], feed)
        # a placeholder for each other choice's delta: the count numbers the deltas
        claim.heard.extend(delta.result_text for delta in fresh)
        self.rt.io.call_soon(claim.feed.push, fresh)

    def _refuse(self, task_id: int, call: Call) -> None:
        """The reader of ``task_id`` never gets ``call``'s deltas: the call ends on its
        model (nobody reads it), and whatever else comes of it is ignored."""
        self._refused.setdefault(task_id, set()).add(call)
        self.refused += 1
        model, incarnation, number = call
        handle = self._conn.models.get(model)
        if handle is not None:
            self._watch(handle.refuse.remote(self._owner, incarnation, [number]))

    def _lost_deltas(self, job: Job, call: Call, seq: int, claim: _Claim | None) -> None:
        """A batch of ``call``'s deltas starts at ``seq``, past what was heard of it: the
        deltas between were lost on the way (a poll's answer lost with the poller that
        died fetching it). Its reader must not get what follows them. If it got none
        of the call's (no claim), the call is refused and the task sent again, a fresh
        stream; else the stream is cut, with exactly the text the reader got."""
        task_id = job.task.task_id
        if claim is None:
            log.warning(
                "task %d: the first %d deltas of its stream's call were lost on their way: "
                "the call ends and the task is sent again, its reader has none of them",
                task_id,
                seq,
            )
            self._refuse(task_id, call)
            self._tickets((job,))
            return
        log.warning(
            "task %d: deltas %d to %d of its stream were lost on their way: it is cut",
            task_id,
            len(claim.heard),
            seq - 1,
        )
        self._abandon((job,))  # nobody reads its call any more
        self._end(((job.task, self._cut(job, claim, self.rt.clock(), _LOST)),))

    def _cut_streams(self, source: str, why: str) -> None:
        """``source`` lost its calls (restarted, or took this process for dead): a
        stream it had started ends ``STREAM_CUT`` with the text the reader has (a new
        call would send it again from the start)."""
        now = self.rt.clock()
        cut = [(i, c) for i, c in self._claims.items() if c.source == source]
        gone = []
        for task_id, claim in cut:
            job = self._jobs[task_id]
            gone.append((job.task, self._cut(job, claim, now, f"{why} while it streamed")))
        self._end(gone)

    def _end_streams(self, why: str) -> list[concurrent.futures.Future[None]]:
        """The cluster given up: every started stream ends ``STREAM_CUT`` now, with the
        text that went into its reader's channel (not waiting for a reader who may be
        behind: the local queue taking over must not find it waiting, or it calls it
        again); a future for each, done once its end is delivered (on the I/O loop)."""
        claims = self._claims
        jobs = [self._jobs[i] for i in claims if i in self._jobs]
        self._abandon(jobs)
        now, detail = self.rt.clock(), f"{why} while it streamed"
        done: list[concurrent.futures.Future[None]] = []
        for job in jobs:
            claim = self._forget(job.task.task_id)
            assert claim is not None  # every job here was chosen for its claim
            delivered: concurrent.futures.Future[None] = concurrent.futures.Future()
            cut = functools.partial(
                self._deliver_cut, job=job, claim=claim, now=now, detail=detail, delivered=delivered
            )
            self.rt.io.call_soon(claim.feed.cut, cut)
            done.append(delivered)
        if done:
            log.warning("%s: %d streams that started end here", why, len(done))
        claims.clear()
        return done

    def _deliver_cut(
        self,
        put: int,
        *,
        job: Job,
        claim: _Claim,
        now: float,
        detail: str,
        delivered: concurrent.futures.Future[None],
    ) -> None:
        """On the I/O loop: a cut stream's end, with the text of the ``put`` deltas its
        reader gets."""
        try:
            result = self._cut(job, claim, now, detail, partial="".join(claim.heard[:put]))
            deliver(self.rt, ((job.task, result),))
        finally:
            delivered.set_result(None)

    def _cut(
        self,
        job: Job,
        claim: _Claim,
        now: float,
        detail: str,
        usage: Usage | None = None,
        *,
        partial: str | None = None,
        answered: bool = False,
    ) -> Result:
        """A stream that started and cannot go on: never called again (its reader would
        get the text twice), it fails ``STREAM_CUT`` with the text the reader has
        (``partial``; by default every delta heard, all of which go to the reader). It
        was sent and may be billed: charged ``usage``, or (none known: its model was
        lost with it) the most it could have used, marked estimated, as locally. Its
        call is counted in its attempts: ``job`` counts it if ``answered`` (restamped
        for the answer), else not. Reads nothing of the link's that changes (it runs
        on the I/O loop too)."""
        attempts = job.attempt if answered else job.attempt + 1
        usage, cost = self._charged(job.task, claim, usage)
        return ended(
            Failed,
            job.task,
            now,
            job=job,
            model=claim.source,
            reason=FailureReason.STREAM_CUT,
            detail=detail,
            partial_text="".join(claim.heard) if partial is None else partial,
            usage=usage,
            cost_nusd=cost,
            attempts=attempts,
        )

    def _charged(self, task: Task, claim: _Claim, usage: Usage | None) -> tuple[Usage, int]:
        """What a started stream is charged: ``usage``, or (none known: its model was
        lost with it) the most it could have used, at its model's price."""
        if usage is None:
            return most_charged(task, self._models[claim.source].price)
        return usage, cost_nusd(served_price(self._models[claim.source].price, None, task), usage)

    def _withdraw(self, jobs: Sequence[Job], *, calls: bool = True) -> list[Any]:
        """Tasks that end here while the cluster may still hold them: their tickets
        leave the queue and each model they may be at drops them (``_abandon``). The
        calls' refs, the queue's first (none for no jobs)."""
        if not jobs:
            return []
        keys = [key_of(self._owner, job.task.task_id) for job in jobs]
        withdrawn = self._conn.queue.withdraw.remote(keys)
        self._watch(withdrawn)
        return [withdrawn, *self._abandon(jobs, calls=calls)]

    def _abandon(self, jobs: Iterable[Job], *, calls: bool = True) -> list[Any]:
        """Cancelled tasks (a stream's reader left, say): each model they may be at drops
        them (the claimed model, else every model of the plan): a stream's call ends where
        it is (not without ``calls``: a stop's cancel lets it finish), a ticket held as a
        model's next call is not called. The calls' refs."""
        options = {} if calls else {"calls": False}  # an older actor takes no keyword
        at: dict[str, list[int]] = {}
        for job in jobs:
            claim = self._claims.get(job.task.task_id)
            models = (claim.source,) if claim is not None else (*job.candidates, *job.fallbacks)
            for model in models:
                at.setdefault(model, []).append(job.task.task_id)
        refs: list[Any] = []
        for model, task_ids in at.items():
            handle = self._conn.models.get(model)
            if handle is not None:
                refs.append(handle.abandon.remote(self._owner, task_ids, **options))
                self._watch(refs[-1])
        return refs

    def state(self) -> dict[str, Any]:
        return super().state() | {
            "owner": self._owner,
            "in_cluster": len(self._jobs),
            "retrying": len(self._retrying),
            "sent": self.sent,
            "resent": self.resent,
            "ignored": self.ignored,
            "incarnations": dict(self._seen),
            "lost": self._lost,
            "streaming": len(self._claims),
            "refused": self.refused,
            "poller": self._poller.generation,
            "direct_calls": self.direct_calls,
            "direct_in_flight": len(self._calls),
            "permits": self._stocks.held(),
        }


def _tell_direct(book: AddressBook, model: str, done: CallsDone) -> None:
    """The direct client's results (on the I/O loop) -> the link, whichever is live."""
    book.try_tell(QUEUE, Direct(model=model, results=done.results))


def _tell_leased(
    book: AddressBook, model: str, handle: Any, owner: int, done: concurrent.futures.Future[Any]
) -> None:
    """A model actor's answer to an ask for a lease (on Ray's thread) -> the link; with
    the link gone (the system stopped), its permits go straight back."""
    lease = None if done.cancelled() or done.exception() is not None else done.result()
    lease = lease if isinstance(lease, Lease) else None
    if not book.try_tell(QUEUE, Leased(model=model, lease=lease)) and lease is not None:
        handle.report.remote(owner, lease.incarnation, [], list(lease.permits))


def _tell_adopted(
    book: AddressBook, model: str, task_ids: tuple[int, ...], done: concurrent.futures.Future[Any]
) -> None:
    """A restarted model actor's answer to ``adopt`` (on Ray's thread) -> the link."""
    if done.cancelled() or done.exception() is not None:
        return  # (restarted again: the link adopts afresh when it hears of it)
    incarnation, permits = done.result()
    book.try_tell(
        QUEUE, Adopted(model=model, incarnation=incarnation, task_ids=task_ids, permits=permits)
    )


def _answers_for(claim: _Claim, model: str, incarnation: int, answer: Attempted | Unsent) -> bool:
    """Whether ``answer`` is the claimed call's (whose deltas the reader has)."""
    if not isinstance(answer, Attempted):
        return False  # the call that streamed was made
    return (claim.source, claim.incarnation, claim.call) == (model, incarnation, answer.call)


def _sent(job: Job, a: Attempted, now: float, wall: float) -> Job:
    """``job`` restamped for the call ``a`` says was made."""
    first = job.dispatched_at
    return restamped(
        job,
        attempt=job.attempt + 1,
        dispatched_at=now - max(0.0, wall - a.sent_at) if first is None else first,
        model_attempt=job.model_attempt + 1,
    )


def _pause(
    paused: bool, ask: int, *, watch: Callable[[Any], None], handle: Any, owner: int, task_id: int
) -> None:
    """Ask a model actor to pause a stream's call (its reader is behind) or go on (the
    ``ask``-th such ask of that stream: the latest holds)."""
    watch(handle.pause.remote(owner, task_id, paused, ask))


class Poller:
    """One thread: long polls for this process's news from the queue and every model
    actor, told to the link as ``News``; and watches the link's calls for errors.

    It also tells ``on_lost`` when no poll has been answered for the cluster's
    ``lost_after_s`` (with why), and again (with None) when one is answered after
    that; ``on_lost`` returns whether to go on polling.

    A thread that dies of an unexpected error tells the link (``PollerDied``, with
    its ``generation``); ``revive`` (the restarted link's) starts the next, which
    waits on the polls the dead one had made: their answers are not lost."""

    def __init__(
        self,
        connection: Connection,
        owner: int,
        book: AddressBook,
        on_lost: Callable[[str | None], bool],
    ) -> None:
        self._conn = connection
        self._owner = owner
        self._book = book
        self._on_lost = on_lost
        self._lost = False
        """The cluster answered no poll for ``lost_after_s`` (read by ``lost``)."""
        self._lock = threading.Lock()
        """Guards ``failures`` (counted here and on Ray's thread) and the thread's
        replacement (``revive``, on the link's thread)."""
        self._stopped = threading.Event()
        self.generation = 0
        """Which thread polls: one more each time one died and another took over."""
        self._dead: int | None = None
        """The generation whose thread died (told to the link), until ``revive``."""
        self._thread = self._new_thread()
        self._pending: dict[Any, str] = {}
        """Polls made and not answered yet (ref -> its source): a new thread's too."""
        self.failures = 0
        self._queue_incarnation: int | None = None
        """As the queue's last news said; told to the models with each poll."""

    @property
    def lost(self) -> bool:
        """Whether the cluster is taken for lost (it answered no poll for a while)."""
        return self._lost

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name="callboard-cluster", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        with self._lock:
            thread = self._thread
        if thread.is_alive():
            thread.join(timeout)

    def revive(self) -> bool:
        """Start a new thread if the last one died (not if it was stopped); whether one
        was started."""
        with self._lock:
            if self._dead != self.generation or self._stopped.is_set():
                return False
            self.generation += 1
            self._dead = None
            self._lost = False  # the new thread counts the silence afresh
            self._thread = thread = self._new_thread()
        thread.start()
        return True

    def watch(self, ref: Any) -> None:
        """Report ``ref``'s error, if it fails (a call the link does not wait for). On
        Ray's own thread, when it ends: not a turn of this thread's loop and a fetch
        of its answer each (measured: 1.45 ms of this thread's CPU per call at load
        11, one call at a time, most of it on the ``enqueue`` answers)."""
        ref.future().add_done_callback(self._watched)

    def _watched(self, done: concurrent.futures.Future[Any]) -> None:
        exc = done.exception()
        if exc is not None:
            with self._lock:
                self.failures += 1
            log.info("cluster call failed (watched): %s", type(exc).__name__)

    def _poll(self, source: str) -> Any:
        if source == QUEUE:
            return self._conn.queue.collect.remote(self._owner, POLL_WAIT_S)
        model = self._conn.models[source]
        return model.collect.remote(self._owner, POLL_WAIT_S, self._queue_incarnation)

    def _run(self) -> None:
        generation = self.generation
        try:
            self._polls()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            log.exception("the cluster poller (generation %d) died", generation)
            with self._lock:
                self._dead = generation
            self._book.try_tell(QUEUE, PollerDied(generation=generation, why=why))

    def _polls(self) -> None:
        sources = [QUEUE, *self._conn.models]
        pending = self._pending
        again_at: dict[str, float] = {}
        heard = time.monotonic()  # the last answer of any source
        failing: dict[str, float] = {}  # since when each source's polls fail: one dead
        # for good (killed without a restart) while the others answered held its tasks
        # for ever, the cluster never taken for lost (found by a hunt); one slow to
        # answer (a new actor on a loaded machine) is not failing
        lost_after = self._conn.cluster.lost_after_s
        while not self._stopped.is_set():
            now = time.monotonic()
            dead = [source for source, since in failing.items() if now - since > lost_after]
            if not self._lost and (dead or now - heard > lost_after):
                self._lost = True
                address = shown_address(self._conn.cluster.address)
                who = f" ({', '.join(dead)})" if dead and now - heard <= lost_after else ""
                why = f"the cluster at {address}{who} answered no poll for {lost_after:g} s"
                if not self._on_lost(why):
                    return
            polling = set(pending.values())
            for source in sources:
                if source not in polling and again_at.get(source, 0.0) <= now:
                    pending[self._poll(source)] = source
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.1)
            for ref in ready:
                source = pending.pop(ref)
                try:
                    news = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    with self._lock:
                        self.failures += 1
                    log.info("cluster call failed (%s): %s", source, type(exc).__name__)
                    again_at[source] = time.monotonic() + REPOLL_S
                    failing.setdefault(source, time.monotonic())
                    continue
                heard = time.monotonic()
                failing.pop(source, None)
                if self._lost and not failing:
                    self._lost = False
                    self._on_lost(None)
                if source == QUEUE:
                    self._queue_incarnation = news.incarnation
                self._book.try_tell(QUEUE, News(source=source, news=news))
