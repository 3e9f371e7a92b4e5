"""Queue: decide *when*, and to which candidate model (the order is in ``pqueue``).

Model actors grant credits (``Ready``); each credit takes the best waiting job
that may go to that model, so there is no priority inversion per model and a
model with credit never idles while a job for it waits (work-conserving).
Credits are kept per model with the (incarnation, epoch) that granted them;
credits of an older incarnation or epoch are void. Jobs whose deadline has
passed (or cannot be met) end here as ``Expired``, before any money is spent.

The heap lives only in this actor; the ledger is the truth. A restarted queue
rebuilds its heap from ``ledger.routed()`` and the supervisor tells every
model to grant afresh. An ``Enqueue`` for a job already waiting, or no longer
routed in the ledger, is ignored, so redelivered messages are harmless.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Iterable
from typing import Any

from callboard.actors.base import (
    MODEL_PREFIX,
    Actor,
    Runtime,
    deliver,
    ended,
    model_address,
    restamped,
)
from callboard.core.pqueue import TaskQueue
from callboard.core.settings import SchedulerSettings
from callboard.messages import (
    BreakerState,
    Call,
    Cancel,
    Cancelled,
    Enqueue,
    Expired,
    Health,
    Job,
    Ready,
    Result,
    Task,
    Tick,
)

log = logging.getLogger(__name__)

_INF = float("inf")


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
        self._escalate_timer_at: float | None = None
        self._core: TaskQueue[Job] = TaskQueue(
            capacity=settings.capacity, aging_step_s=settings.aging_step_s, epoch=epoch
        )
        self._credits: dict[str, _Credit] = {}
        self._latency: dict[str, float] = {}
        """Each model's recent latency: a job with less time left than this expires."""
        self._open: set[str] = set()
        self._timer_at: float | None = None
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
        elif kind is Tick:
            if message.what == "escalate":
                self._escalate_due()
            else:
                self._timer_at = None
                self._expire()
        elif kind is Health:
            self._health(message)

    # -- arrivals ---------------------------------------------------------

    def _enqueue(self, jobs: Iterable[Job]) -> None:
        core, ledger = self._core, self.rt.ledger
        now = self.rt.clock()
        touched: set[str] = set()
        expired: list[tuple[Task, Result]] = []
        cancelled: list[tuple[Task, Result]] = []
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
            self._push(job)
            touched.update(job.candidates)
            self._plan_escalation(job)
        if expired or cancelled:
            deliver(self.rt, expired + cancelled)
        for model in touched:
            self._dispatch(model, now)
        self._arm_timer()

    def _ready(self, msg: Ready) -> None:
        credit = self._credits.get(msg.model)
        if credit is None or (msg.incarnation, msg.epoch) > (credit.incarnation, credit.epoch):
            credit = self._credits[msg.model] = _Credit(msg.incarnation, msg.epoch)
        elif (msg.incarnation, msg.epoch) < (credit.incarnation, credit.epoch):
            return  # a grant from a dead incarnation or an old epoch
        credit.n += msg.credits
        self._dispatch(msg.model, self.rt.clock())

    def _push(self, job: Job) -> None:
        """Queue ``job`` by its task's priority, arrival and deadline (seniority is
        kept when a job comes back: the arrival is the task's submission)."""
        task = job.task
        self._core.push(
            task.task_id,
            job,
            priority=int(task.request.priority),
            candidates=job.candidates,
            arrival=task.submitted_at,
            deadline=task.deadline_at,
        )

    # -- health: fallbacks and latency-aware deadlines ----------------------

    def _health(self, health: Health) -> None:
        self._latency[health.model] = health.latency_ewma_s or 0.0
        if health.breaker is BreakerState.OPEN:
            self._open.add(health.model)
            self._move_off(health.model)
        else:
            self._open.discard(health.model)

    def _move_off(self, model: str) -> None:
        """A breaker opened: waiting jobs that may go elsewhere stop waiting for it.

        A job with other candidates drops this one; a job whose only candidate
        it was moves to its next fallback that is not open. A job whose every
        model is open waits on all of them for the first half-open probe (up to
        its deadline).
        """
        moved: set[str] = set()
        for job in list(self._core.items()):
            if model not in job.candidates:
                continue
            retargeted = self._away_from(job, model)
            if retargeted is None:
                continue
            self._core.cancel(job.task.task_id)
            self._push(retargeted)
            moved.update(retargeted.candidates)
        if moved:
            log.warning("breaker of %s open: waiting jobs moved to %s", model, sorted(moved))
            now = self.rt.clock()
            for m in moved:
                self._dispatch(m, now)

    def _away_from(self, job: Job, model: str) -> Job | None:
        others = tuple(c for c in job.candidates if c != model)
        if others:
            return dataclasses.replace(job, candidates=others, fallbacks=(*job.fallbacks, model))
        for i, fb in enumerate(job.fallbacks):
            if fb not in self._open:
                rest = job.fallbacks[:i] + job.fallbacks[i + 1 :]
                return dataclasses.replace(job, candidates=(fb,), fallbacks=(*rest, model))
        # Every model it may use is open: it waits on all of them, and the first to
        # half-open (an open breaker grants no credit) takes it, up to its deadline.
        every = tuple(dict.fromkeys((*job.candidates, *job.fallbacks)))
        if len(every) == len(job.candidates):
            return None
        return dataclasses.replace(job, candidates=every, fallbacks=())

    # -- dispatch ---------------------------------------------------------

    def _dispatch(self, model: str, now: float) -> None:
        credit = self._credits.get(model)
        if credit is None or credit.n <= 0:
            return
        taken, skipped = self._core.pop_for(
            model, now, credit.n, min_remaining_s=self._latency.get(model, 0.0)
        )
        if skipped:
            self._too_late_for(model, skipped, now)
        if not taken:
            return
        jobs = self.rt.ledger.dispatch_all(
            (
                j
                if j.dispatched_at is not None
                else restamped(j, attempt=j.attempt, dispatched_at=now)
                for j in taken
            ),
            model,
            credit.incarnation,
        )
        if not jobs:
            return
        credit.n -= len(jobs)
        self.dispatched += len(jobs)
        self.tell(
            model_address(model),
            Call(model=model, incarnation=credit.incarnation, epoch=credit.epoch, jobs=tuple(jobs)),
        )

    # -- endings ----------------------------------------------------------

    def _cancel(self, msg: Cancel) -> None:
        """End what waits here; have the ledger remember the rest (still on its way
        here, or granted to a model and not sent yet) and tell the models holding it."""
        ledger = self.rt.ledger
        if msg.everything:
            ledger.cancel_everything()  # whatever arrives later is cancelled on arrival
            self.cancel_all(msg.detail)
            for name in self.rt.book.names():
                if name.startswith(MODEL_PREFIX):
                    self.rt.book.try_tell(name, msg)
            return
        now = self.rt.clock()
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
        deliver(
            self.rt,
            ((j.task, ended(Cancelled, j.task, now, job=j, detail=msg.detail)) for j in ended_jobs),
        )

    def _expire(self) -> None:
        now = self.rt.clock()
        self._end_expired(self._core.expire(now), now)
        self._arm_timer()

    def _too_late_for(self, model: str, jobs: list[Job], now: float) -> None:
        """Jobs ``model`` cannot finish before their deadline (or past it): each waits
        on for its other candidates that still could, by their recent latency, or
        ends ``Expired``. A job moved off ``model`` never meets it again, so the
        work is done once per job."""
        expired: list[Job] = []
        moved: set[str] = set()
        for job in jobs:
            dl = job.task.deadline_at
            left = _INF if dl is None else dl - now
            others = tuple(
                c
                for c in job.candidates
                if c != model and c not in self._open and self._latency.get(c, 0.0) < left
            )
            if left <= 0 or not others:
                expired.append(job)
                continue
            self._push(dataclasses.replace(job, candidates=others))
            moved.update(others)
        if expired:
            self._end_expired(expired, now)
        for other in moved:
            self._dispatch(other, now)

    def _end_expired(self, jobs: list[Job], now: float) -> None:
        deliver(
            self.rt,
            (
                (j.task, ended(Expired, j.task, now, job=j, detail="deadline passed in the queue"))
                for j in jobs
            ),
        )

    # -- escalation: a job that will not get a slot before its deadline ----

    def _plan_escalation(self, job: Job) -> None:
        target = self._escalate_to
        deadline = job.task.deadline_at
        # only where the router's plan kept it (capabilities, context window, budget)
        if target is None or deadline is None or target not in job.fallbacks:
            return
        margin = max(self._escalate_margin_s, 2 * self._latency.get(target, 0.0))
        at = deadline - margin
        heapq.heappush(self._escalations, (at, job.task.task_id))
        if self._escalate_timer_at is None or at < self._escalate_timer_at:
            self._escalate_timer_at = at
            self.rt.after(at - self.rt.clock(), self.name, Tick(what="escalate", at=at))

    def _escalate_due(self) -> None:
        """Jobs still waiting this close to their deadline go to ``escalate_to``."""
        now = self.rt.clock()
        self._escalate_timer_at = None
        target = self._escalate_to
        moved = 0
        while self._escalations and self._escalations[0][0] <= now:
            _, key = heapq.heappop(self._escalations)
            job = self._core.cancel(key)
            if job is None:
                continue
            if target is None or target not in job.fallbacks:  # moved off it meanwhile
                self._push(job)
                continue
            rest = tuple(m for m in (*job.candidates, *job.fallbacks) if m != target)
            self._push(dataclasses.replace(job, candidates=(target,), fallbacks=rest))
            moved += 1
        if moved and target is not None:
            log.info("escalated %d jobs near their deadline to %s", moved, target)
            self._dispatch(target, now)
        if self._escalations:
            at = self._escalations[0][0]
            self._escalate_timer_at = at
            self.rt.after(at - now, self.name, Tick(what="escalate", at=at))

    def _arm_timer(self) -> None:
        at = self._core.next_deadline()
        if at is None or (self._timer_at is not None and self._timer_at <= at):
            return
        self._timer_at = at
        self.rt.after(at - self.rt.clock(), self.name, Tick(what="expire", at=at))

    def cancel_all(self, detail: str) -> int:
        """End every waiting job as ``Cancelled`` (stop with cancel=True)."""
        now = self.rt.clock()
        jobs = self._core.clear()
        return deliver(
            self.rt, ((j.task, ended(Cancelled, j.task, now, job=j, detail=detail)) for j in jobs)
        )

    def state(self) -> dict[str, Any]:
        return super().state() | {
            "waiting": len(self._core),
            "dispatched": self.dispatched,
            "credits": {m: c.n for m, c in self._credits.items()},
        }
