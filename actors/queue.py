"""Queue: decide *when*, and to which candidate model (the order is in ``pqueue``).

Model actors grant credits (``Ready``); each credit takes the waiting job whose
turn it is at that model, so there is no priority inversion per model and a
model with credit never idles while a job for it waits (work-conserving).
Within a priority level the turns are shared between tenants (a request's
``budget_tag``; untagged requests are one tenant) by ``tenant_weights``, each
job charged its estimated tokens (prompt plus ``max_tokens``), so a tenant that
floods a model cannot starve a light one.
Credits are kept per model with the (incarnation, epoch) that granted them;
credits of an older incarnation or epoch are void, and so are a model's
credits once it reports its breaker open. Jobs whose deadline has passed (or
cannot be met) end here as ``Expired``, before any money is spent.

Where a job may go is ``fallback``'s to say (``place``, ``too_late``,
``escalate``); this actor only applies it. A job waits in the lanes of
``fallback.place(job, down)``; when a model goes down or comes back, the jobs
in its lane are placed again (``TaskQueue.retarget``, keeping their place in
order). Its timers (``ExpireDue``, ``EscalateDue``) go through an ``Alarm``
each, so none is ever set twice.

The heap lives only in this actor; the ledger is the truth. A restarted queue
rebuilds its heap from ``ledger.routed()`` and the supervisor tells every
model to grant afresh. An ``Enqueue`` for a job already waiting, or no longer
routed in the ledger, is ignored, so redelivered messages are harmless.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable
from typing import Any

from callboard.actors.base import (
    MODEL_PREFIX,
    Actor,
    Runtime,
    deliver,
    ended,
    model_address,
    stranded_end,
)
from callboard.core.alarm import Alarm
from callboard.core.fallback import (
    Availability,
    escalate,
    escalation_at,
    place,
    too_late,
)
from callboard.core.health import RecentLatency
from callboard.core.pqueue import COMPACT_SLACK, TaskQueue
from callboard.core.settings import SchedulerSettings
from callboard.messages import (
    BreakerState,
    Call,
    Cancel,
    Cancelled,
    Enqueue,
    EscalateDue,
    Expired,
    ExpireDue,
    Health,
    Job,
    Ready,
    Result,
    Task,
)
from callboard.runtime.guarded_log import guarded_logger

log = guarded_logger(__name__)

_INF = float("inf")
_TOO_LATE = "deadline passed in the queue"
_CANNOT_MEET = "deadline cannot be met: less time left than its models' recent latency"
"""Said of a job ended before its deadline, which no model of its plan could meet."""


@dataclasses.dataclass(slots=True)
class _Credit:
    incarnation: int
    epoch: int
    n: int = 0


class QueueActor(Actor):
    def __init__(
        self,
        rt: Runtime,
        name: str,
        incarnation: int,
        *,
        settings: SchedulerSettings,
        epoch: float,
        escalate_to: str | None = None,
    ) -> None:
        super().__init__(rt, name, incarnation)
        self._escalate_to = escalate_to
        self._escalate_margin_s = settings.escalate_margin_s
        self._escalations: list[tuple[float, int]] = []
        """(when to escalate, task id): a job still waiting then moves to ``escalate_to``."""
        self._escalation_alarm = Alarm()
        self._expiry_alarm = Alarm()
        self._core: TaskQueue[Job] = TaskQueue(
            capacity=settings.capacity,
            aging_step_s=settings.aging_step_s,
            aging_share=settings.aging_share,
            epoch=epoch,
            tenant_weights=settings.tenant_weights,
        )
        self._credits: dict[str, _Credit] = {}
        self._latency = RecentLatency()
        """Each model's recent latency: a job with less time left than this expires."""
        self._down = Availability()
        self.dispatched = 0

    def setup(self) -> None:
        if self.incarnation > 1:
            self._enqueue(self.rt.ledger.routed())

    def handle(self, message: Any) -> None:
        kind = type(message)
        if kind is Enqueue:
            self._enqueue(message.jobs)
        elif kind is Ready:
            self._ready(message)
        elif kind is Cancel:
            self._cancel(message)
        elif kind is ExpireDue:
            if self._expiry_alarm.rang(message.at):
                self._expire()
        elif kind is EscalateDue:
            if self._escalation_alarm.rang(message.at):
                self._escalate_due()
        elif kind is Health:
            self._health(message)

    # -- arrivals ---------------------------------------------------------

    def _enqueue(self, jobs: Iterable[Job]) -> None:
        core, ledger = self._core, self.rt.ledger
        now = self.rt.clock()
        touched: dict[str, None] = {}  # in order of preference: the first has the first pick
        expired: list[tuple[Task, Result]] = []
        cancelled: list[tuple[Task, Result]] = []
        last: tuple[str, ...] = ()
        for job in jobs:
            task = job.task
            if task.task_id in core or not ledger.is_routed(task.task_id):
                continue
            if ledger.cancel_wanted(task):
                cancelled.append((task, ended(Cancelled, task, now, job=job, detail="cancelled")))
                continue
            if task.deadline_at is not None and task.deadline_at <= now:
                expired.append((task, ended(Expired, task, now, job=job, detail="deadline passed")))
                continue
            failed = self._stranded(job, now)
            if failed is not None:
                expired.append((task, failed))  # ends it
                continue
            lanes = self._push(job)
            if lanes is not last:  # plans are shared tuples: a burst has a handful
                touched.update(dict.fromkeys(lanes))
                last = lanes
            self._plan_escalation(job)
        if expired or cancelled:
            deliver(self.rt, expired + cancelled)
        for model in touched:
            self._dispatch(model, now)
        self._arm_expiry(now)

    def _ready(self, msg: Ready) -> None:
        credit = self._credits.get(msg.model)
        if credit is None or (msg.incarnation, msg.epoch) > (credit.incarnation, credit.epoch):
            credit = self._credits[msg.model] = _Credit(msg.incarnation, msg.epoch)
        elif (msg.incarnation, msg.epoch) < (credit.incarnation, credit.epoch):
            return  # a grant from a dead incarnation or an old epoch
        self._core.settle(msg.model, msg.settled)
        if msg.refunds or msg.aged:
            self._core.refund(msg.model, msg.refunds, msg.aged)
        if msg.credits:
            credit.n += msg.credits
            self._dispatch(msg.model, self.rt.clock())

    def _push(self, job: Job) -> tuple[str, ...]:
        """Queue ``job`` by its task's priority, arrival and deadline (seniority is
        kept when a job comes back: the arrival is the task's submission) and its
        tenant's share, for the models it may go to now; return them."""
        task = job.task
        request = task.request
        lanes = place(job, self._down)
        self._core.push(
            task.task_id,
            job,
            priority=int(request.priority),
            candidates=lanes,
            arrival=task.submitted_at,
            deadline=task.deadline_at,
            tenant=request.budget_tag,
            cost=task.fair_cost,
            order=task.task_id,  # ids grow with submission: ties by it keep seniority
        )
        return lanes

    # -- health: where jobs may go, and latency-aware deadlines ----------------

    def _health(self, health: Health) -> None:
        model = health.model
        self._latency.observe(model, health.latency_ewma_s or 0.0, self.rt.clock())
        if health.breaker is BreakerState.OPEN:
            credit = self._credits.get(model)
            if credit is not None:  # granted before it opened: its own grants are void too
                credit.n = 0
        if self._down.observe(health):
            self._place_again(model, back=model not in self._down)
        if health.given_up is not None:
            self._end_stranded(model)

    def _stranded(self, job: Job, now: float) -> Result | None:
        """``job``'s end if every model of its plan is given up on (``fallback.stranded``)."""
        return stranded_end(job, self._down, now)

    def _end_stranded(self, model: str) -> None:
        """``model`` is given up on: end the jobs waiting for it that have no other model."""
        core, now = self._core, self.rt.clock()
        gone: list[tuple[Task, Result]] = []
        for job in core.items_for(model):
            failed = self._stranded(job, now)
            if failed is not None and core.cancel(job.task.task_id) is not None:
                gone.append((job.task, failed))
        if gone:
            log.warning("%s is given up on: %d waiting tasks end", model, len(gone))
            deliver(self.rt, gone)

    def _place_again(self, model: str, *, back: bool) -> None:
        """``model`` went down or came back: the jobs in its lane may now go elsewhere
        (its fallbacks take them while it is down) or back to it alone."""
        core, down = self._core, self._down
        touched: dict[str, None] = {}
        moved = 0
        for job in core.items_for(model):
            lanes = place(job, down)
            if core.retarget(job.task.task_id, lanes):
                touched.update(dict.fromkeys(lanes))
                moved += 1
        if not moved:
            return
        if back:
            log.info("%s is back: %d waiting jobs may go to it again", model, moved)
        else:
            others = [m for m in touched if m != model]
            log.warning("%s is down: %d waiting jobs may go to %s", model, moved, others)
        now = self.rt.clock()
        for m in touched:
            self._dispatch(m, now)

    # -- dispatch ---------------------------------------------------------

    def _dispatch(self, model: str, now: float) -> None:
        credit = self._credits.get(model)
        if credit is None or credit.n <= 0:
            return
        aged: list[Job] = []
        taken, skipped = self._core.pop_for(
            model, now, credit.n, min_remaining_s=self._latency.get(model, now), aged=aged
        )
        if skipped:
            self._too_late_for(model, skipped, now)
        if not taken:
            return
        jobs = self.rt.ledger.dispatch_all(taken, model, credit.incarnation)
        if not jobs:
            return
        credit.n -= len(jobs)
        self.dispatched += len(jobs)
        call = Call(
            model=model,
            incarnation=credit.incarnation,
            epoch=credit.epoch,
            jobs=tuple(jobs),
            aged=frozenset(job.task.task_id for job in aged),
        )
        self.tell(model_address(model), call)

    # -- endings ----------------------------------------------------------

    def _cancel(self, msg: Cancel) -> None:
        """End what waits here; have the ledger remember the rest (still on its way
        here, or granted to a model and not sent yet) and tell the models holding it."""
        ledger, now = self.rt.ledger, self.rt.clock()
        if msg.everything:
            ledger.cancel_everything()  # whatever arrives later is cancelled on arrival
            self._end_all(Cancelled, self._core.clear(), now, msg.detail)
            for name in self.rt.book.names():
                if name.startswith(MODEL_PREFIX):
                    self.rt.book.try_tell(name, msg)
            return
        ended_jobs = []
        elsewhere = []
        for key in msg.task_ids:
            job = self._core.cancel(key)
            if job is not None:
                ended_jobs.append(job)
            else:
                elsewhere.append(key)
        if elsewhere:
            for model, ids in ledger.holders(ledger.ask_cancel(elsewhere)).items():
                self.rt.book.try_tell(
                    model_address(model), Cancel(task_ids=tuple(ids), detail=msg.detail)
                )
        self._end_all(Cancelled, ended_jobs, now, msg.detail)

    def _expire(self) -> None:
        now = self.rt.clock()
        self._end_all(Expired, self._core.expire(now), now, _TOO_LATE)
        self._arm_expiry(now)

    def _too_late_for(self, model: str, jobs: list[Job], now: float) -> None:
        """Jobs ``model`` cannot finish before their deadline: each waits on for the rest
        of its plan that still could (``fallback.too_late``), or ends ``Expired``."""
        expired: list[Job] = []
        touched: dict[str, None] = {}
        latency = self._latency.view(now)
        for job in jobs:
            dl = job.task.deadline_at
            left = _INF if dl is None else dl - now
            rest = too_late(job, model, left, latency)
            if rest is None:
                expired.append(job)
                continue
            touched.update(dict.fromkeys(self._push(rest)))
        if expired:
            self._end_all(Expired, expired, now, _CANNOT_MEET)
        for other in touched:
            self._dispatch(other, now)

    def _end_all(self, kind: type[Result], jobs: Iterable[Job], now: float, detail: str) -> None:
        """End each of ``jobs`` here with a ``kind`` result saying ``detail``."""
        deliver(self.rt, ((j.task, ended(kind, j.task, now, job=j, detail=detail)) for j in jobs))

    # -- escalation: a job that will not get a slot before its deadline ----

    def _plan_escalation(self, job: Job) -> None:
        target = self._escalate_to
        if target is None:
            return
        at = escalation_at(
            job,
            target,
            margin_s=self._escalate_margin_s,
            target_latency_s=self._latency.get(target, self.rt.clock()),
        )
        if at is None:
            return
        if len(self._escalations) > 2 * len(self._core) + COMPACT_SLACK:
            self._compact_escalations()
        heapq.heappush(self._escalations, (at, job.task.task_id))
        self._arm(self._escalation_alarm, at, EscalateDue(at=at), self.rt.clock())

    def _compact_escalations(self) -> None:
        """The escalations of jobs still waiting, one a job (its earliest). An entry
        went only when its time came: every task sent, cancelled or expired kept its
        own until its deadline, one more each time its job came back to the queue
        (found by a hunt: 30,000 entries with nothing waiting, at an hour's deadline)."""
        first: dict[int, float] = {}
        for at, key in self._escalations:
            if key in self._core and at < first.get(key, math.inf):
                first[key] = at
        self._escalations = [(at, key) for key, at in first.items()]
        heapq.heapify(self._escalations)

    def _escalate_due(self) -> None:
        """Jobs still waiting this close to their deadline go to ``escalate_to``."""
        now = self.rt.clock()
        target = self._escalate_to
        touched: dict[str, None] = {}
        moved = 0
        while self._escalations and self._escalations[0][0] <= now:
            _, key = heapq.heappop(self._escalations)
            job = self._core.cancel(key)
            if job is None:
                continue
            escalated = None if target is None else escalate(job, target)
            touched.update(dict.fromkeys(self._push(escalated or job)))
            moved += escalated is not None
        if moved:
            log.info("escalated %d jobs near their deadline to %s", moved, target)
        for model in touched:
            self._dispatch(model, now)
        if self._escalations:
            at = self._escalations[0][0]
            self._arm(self._escalation_alarm, at, EscalateDue(at=at), now)

    def _arm_expiry(self, now: float) -> None:
        at = self._core.next_deadline()
        if at is not None:
            self._arm(self._expiry_alarm, at, ExpireDue(at=at), now)

    def _arm(self, alarm: Alarm, at: float, message: ExpireDue | EscalateDue, now: float) -> None:
        """A timer for ``at``, unless one already pending rings no later."""
        if alarm.wants(at):
            self.rt.after(at - now, self.name, message)

    def state(self) -> dict[str, Any]:
        core = self._core
        return super().state() | {
            "waiting": len(core),
            "waiting_for": {m: core.waiting_for(m) for m in sorted(self._credits)},
            "dispatched": self.dispatched,
            "credits": {m: c.n for m, c in self._credits.items()},
            "down": list(self._down),
            "timers": self._expiry_alarm.pending + self._escalation_alarm.pending,
            "escalations": len(self._escalations),
            "bookkeeping": dataclasses.asdict(core.statistics()),
        }
