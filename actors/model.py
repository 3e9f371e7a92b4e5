"""Model: one actor per model deployment, owning everything that protects it.

Theory of operation. The actor grants the queue credits (``Ready``) only for
calls it could start now (cap, breaker, limiter). A ``Call`` brings jobs for
those credits; each passes admission (breaker permit, limiter reservation)
and is started on the I/O loop, one batch per message. When admission says
"not yet", the jobs go back to the queue and the actor sets a timer
(``AdmitDue``, through an ``Alarm``) for the earliest time it could: no
polling, no sleeping.

Completions come back batched (``CallsDone``). Each is classified once; the
breaker learns from it, the limiter settles and reads the rate-limit headers,
and the retry policy decides: retry after a delay (off the concurrency cap,
through admission again), leave this model (``fallback.leave``), or end.
Ending goes through the ledger, which resolves the caller's future right here
(the aggregator accounts afterwards, off the latency path). A task's queue wait
lasts until its first call started on the wire, so a call that waited in the
loop's window for a slot counts that wait there, not in its service time.

The breaker. When it opens, the router and the queue hear it first (a
``Health`` report), the credits granted before are void (a new epoch), and
every job held here unsent goes back to the queue, which places it on its
fallbacks: an open breaker holds nothing and costs one timer, which
half-opens it (``CircuitBreaker.advance``); the probe credits then take jobs
that still prefer this model, and once the breaker closes, that work comes
back here.

The actor decides nothing itself; it drives the cores: ``admission``,
``backlog`` (what waits here unsent), ``attempt`` (what an attempt means),
``fallback``, ``health`` and ``runtime.succession`` (what a restart takes
over).

What must hold: at most ``max_concurrency`` calls in flight; nothing sent
while the breaker rejects or the limiter has not admitted; nothing held while
the breaker is open; a completion from another incarnation, or for a call no
longer in flight, is ignored; a restarted incarnation reclaims its
predecessor's calls from the ledger and re-queues them (at-least-once
towards the provider, exactly-once results).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any, TypeVar

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
    to_retry,
    unsent,
)
from callboard.core.admission import (
    Flight,
    Grant,
    Passed,
    Send,
    earliest,
    gate,
    send_of,
    to_grant,
    tokens_of,
    too_large,
    unmade,
    untranslatable,
    window_of,
)
from callboard.core.alarm import Alarm
from callboard.core.attempt import End, RetryAt, judge, most_charged
from callboard.core.backlog import Backlog
from callboard.core.breaker import CircuitBreaker, Reject
from callboard.core.fallback import leave
from callboard.core.health import HEALTH_EVERY_S, LIMITED_RUN, RESTING_S, Due, HealthBook, resting
from callboard.core.learn import RATE_LIMITED_RUN, learn
from callboard.core.limiter import RateLimiter, TooLarge, WaitUntil
from callboard.core.retry import RetryPolicy
from callboard.core.settings import ModelSettings
from callboard.messages import (
    AdmitDue,
    BreakerState,
    Call,
    CallResult,
    CallsDone,
    Cancel,
    Cancelled,
    Enqueue,
    Expired,
    Failed,
    FailureReason,
    Job,
    Ready,
    Regrant,
    Result,
    Settlement,
    Task,
    refund,
    settlement,
)
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.http import UNSENT, UNSENT_DEADLINE, ModelClient, error_detail
from callboard.runtime.stream import StreamChannel
from callboard.runtime.succession import inherit_limits, reclaim_predecessors

log = guarded_logger(__name__)

FATAL_ANSWERS = 2
"""A task whose answer killed its model actor this often is not sent again: it fails.
Once may be a fault elsewhere (an injected crash, a bug another answer hit)."""
R = TypeVar("R", bound=Result)


class ModelActor(Actor):
    def __init__(
        self,
        rt: Runtime,
        name: str,
        incarnation: int,
        *,
        settings: ModelSettings,
        client: ModelClient,
        seed: int = 0,
    ) -> None:
        super().__init__(rt, name, incarnation)
        self.settings = settings
        self.model = settings.name
        self.cap = settings.max_concurrency
        self.breaker = CircuitBreaker(settings.breaker)
        self.limiter = RateLimiter(settings.limiter, rt.clock(), refunds=settings.refunds_tokens)
        self.retry = RetryPolicy(settings.retry, random.Random(seed * 1_000_003 + incarnation))
        self.client = client
        self.in_flight: dict[int, Flight] = {}
        self.held = Backlog()
        self.epoch = 0
        self.granted = 0
        self._settled: list[Settlement] = []
        """Ended calls whose tenants' charges the queue is to settle, with the next
        ``Ready``."""
        self._refunds: list[Settlement] = []
        """Jobs granted here and not sent, whose tenants' charges the queue is to undo."""
        self._aged_back = 0
        """How many of those came on aged turns (``_aged``)."""
        self._aged: set[int] = set()
        """The jobs held here unsent that the queue granted on aged turns."""
        self._held_back_tokens = 0
        """The size of the call the limiter last said "not yet" to: no credit is granted
        before a call that large could go (see ``_held_back``)."""
        self._alarm = Alarm()
        self._breaker_seen = self.breaker.state
        """The breaker's state as last reported (a move is reported before anything else)."""
        self._typical_tokens = 1.0
        self._grants_held_until: float | None = None
        """The limiter could admit the waiting call no sooner: no credits until then,
        or until a call settles (its refund may make room earlier)."""
        self.health = HealthBook()
        self._loop_clock = rt.clock is time.monotonic
        """The I/O loop stamps calls on ``time.monotonic``: when this actor's clock is the
        same, a call's ``started_at`` is when its task was first sent (on an injected
        clock the time it was admitted stands for it)."""
        self.sent = 0
        self.ignored = 0
        self._answering: int | None = None
        """The task whose answer is being judged: if that kills the actor, it is counted."""

    @property
    def slots(self) -> int:
        """Calls this model may hold admitted at once: ``cap`` on the wire, and the
        window waiting on the I/O loop to take a slot the moment it frees."""
        return self.cap + window_of(self.cap, self.limiter)

    # -- lifecycle --------------------------------------------------------

    def setup(self) -> None:
        """Take over the limits of the incarnation before, so invariant 2 holds across
        restarts, and re-queue its calls in flight (see ``runtime.succession``)."""
        self.limiter, abandoned = inherit_limits(
            self.rt.kept_limits, self.model, self.limiter, self.breaker, self.rt.clock
        )
        self._breaker_seen = self.breaker.state  # reported just below
        if abandoned:
            log.info("%s: the calls of a dead incarnation stay charged", self.name)
        if self.incarnation > 1:
            back = reclaim_predecessors(self.rt.ledger, self.model, self.incarnation)
            fatal = self.rt.fatal_answers
            spent = [j for j in back if fatal[self.model, j.task.task_id] >= FATAL_ANSWERS]
            for job in spent:
                del fatal[self.model, job.task.task_id]
                back.remove(job)
            begun = [j for j in back if j.task.stream is not None and j.task.stream.received]
            for job in begun:
                back.remove(job)
            if back:
                log.warning("%s: re-queueing %d calls of a dead incarnation", self.name, len(back))
                self.tell(QUEUE, Enqueue(jobs=tuple(back)))
            if spent:
                self._end_spent(spent)
            if begun:
                self._end_begun(begun)
        self._report_health(force=True)
        self._pump()

    def _end_spent(self, jobs: list[Job]) -> None:
        """End the tasks whose answers killed an incarnation ``FATAL_ANSWERS`` times: a bug
        that kills the actor on judging an answer (a price it cannot read) had the call
        sent, and paid for, again at each restart, for ever."""
        log.error(
            "%s: judging the answers of %d tasks killed the model actor %d times each: "
            "they fail, not sent again (a bug: see the crashes above)",
            self.name,
            len(jobs),
            FATAL_ANSWERS,
        )
        now = self.rt.clock()
        detail = (
            f"judging its answer killed the model actor {FATAL_ANSWERS} times; not sent "
            "again (a bug in callboard or its configuration: see the log)"
        )
        internal = FailureReason.INTERNAL
        ends = [(j.task, self._end(Failed, j, now, reason=internal, detail=detail)) for j in jobs]
        deliver(self.rt, ends)

    def _end_begun(self, jobs: list[Job]) -> None:
        """End the streams a dead incarnation had begun: their readers have part of an
        answer, so they are cut (``STREAM_CUT`` with the text they had), never sent
        again (the new call wrote the whole answer after the part the reader had; found
        by a hunt). Each was sent: charged the most it could have used, marked
        estimated, like any stream cut without its usage."""
        log.warning(
            "%s: %d streams of a dead incarnation had begun: they end cut, not sent again",
            self.name,
            len(jobs),
        )
        now = self.rt.clock()
        detail = "the model actor serving the stream crashed after its first delta"
        ends = []
        for job in jobs:
            stream = job.task.stream
            usage, cost = most_charged(job.task, self.settings.price)
            ends.append(
                (
                    job.task,
                    self._end(
                        Failed,
                        job,
                        now,
                        reason=FailureReason.STREAM_CUT,
                        detail=detail,
                        partial_text=stream.cut() if isinstance(stream, StreamChannel) else "",
                        usage=usage,
                        cost_nusd=cost,
                    ),
                )
            )
        deliver(self.rt, ends)

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._answering is not None:  # its answer killed this incarnation
            self.rt.fatal_answers[self.model, self._answering] += 1
        super().on_failure(exception_type, exception_value, traceback)

    def handle(self, message: Any) -> None:
        kind = type(message)
        if kind is CallsDone:
            self._done(message)
        elif kind is Call:
            self._call(message)
        elif kind is AdmitDue:
            if self._alarm.rang(message.at):
                self._pump()
        elif kind is Regrant:  # the queue restarted: it knows neither our credits nor health
            self.epoch += 1
            self.granted = 0
            self._report_health(force=True)
            self._pump()
        elif kind is Cancel:
            self._cancel(message)

    def _cancel(self, msg: Cancel) -> None:
        """End the jobs held here unsent (waiting for admission or for a retry)."""
        ids = set(msg.task_ids)
        now = self.rt.clock()
        if msg.everything or any(i in self.in_flight for i in ids):
            # calls waiting on the loop are unsent too: they come back as such
            self.rt.io.call_soon(self.client.revoke, None if msg.everything else frozenset(ids))

        def wanted(job: Job) -> bool:
            return msg.everything or job.task.task_id in ids

        granted = [j for j in self.held.waiting if wanted(j)]  # charged, never sent
        dropped = self.held.drop(wanted)
        if not dropped:
            return
        self._refund(granted)  # (a retry's charge paid for the call it retries)
        deliver(
            self.rt, ((j.task, self._end(Cancelled, j, now, detail=msg.detail)) for j in dropped)
        )
        self._pump()

    # -- credits and admission --------------------------------------------

    def _call(self, msg: Call) -> None:
        if msg.aged:
            self._aged.update(msg.aged)
        if msg.incarnation != self.incarnation:
            self._hand_back(msg.jobs, msg.incarnation)
            return
        if msg.epoch == self.epoch:
            self.granted = max(0, self.granted - len(msg.jobs))
        room = self.slots - len(self.in_flight) - len(self.held.waiting)
        self.held.waiting.extend(msg.jobs[: max(0, room)])
        if room < len(msg.jobs):  # duplicate credits after a queue restart: never over the cap
            self._hand_back(msg.jobs[max(0, room) :], self.incarnation)
        self._pump()

    def _hand_back(self, jobs: tuple[Job, ...], incarnation: int, *, charged: bool = True) -> None:
        """``jobs`` go back to the queue; ``charged``: granted here, charged to their
        tenants then, and not sent since, so the charges are undone (``_refund``); a
        retry's charge paid for the call it retries. The refunds due go first, so that
        no grant meanwhile takes the jobs again at their old charges."""
        if charged:
            self._refund(jobs)
        if self._refunds:
            self._ready(0)
        ledger = self.rt.ledger
        back = tuple(j for j in jobs if ledger.reclaim(j, self.model, incarnation))
        if back:
            self.tell(QUEUE, Enqueue(jobs=back))

    def _refund(self, jobs: Iterable[Job]) -> None:
        """``jobs`` were granted here, charged to their tenants then, and not sent: the
        charges are to be undone, and the aged turns they came on owed again, with the
        next ``Ready`` (``TaskQueue.refund``)."""
        aged = self._aged
        for job in jobs:
            self._refunds.append(refund(job.task))
            if aged and job.task.task_id in aged:
                aged.discard(job.task.task_id)
                self._aged_back += 1

    def _pump(self) -> None:
        now = self.rt.clock()
        self._watch_breaker(now)
        paused = self.limiter.paused_until
        rests = resting(paused, now)
        if self.breaker.state is BreakerState.OPEN or rests:
            # nothing goes before its reopen time, or the end of a long pause: the queue
            # gives what has a fallback to it meanwhile
            self._hand_back(self.held.take_waiting(), self.incarnation)
            self._hand_back(self.held.take_retrying(), self.incarnation, charged=False)
        due = self.held.take_due(now)
        if due:  # to the queue, where priority decides: at the head of the waiting line,
            # a LOW retry took the first call after each pause from a CRITICAL task, drew
            # another 429 and paused the model again (2.9 s behind two; found by a hunt)
            self._hand_back(due, self.incarnation, charged=False)
        wake = earliest(earliest(self._admit(now), self._grant(now)), self.held.next_retry())
        wake = earliest(wake, self.breaker.reopen_at)  # half-open on our own timer
        wake = earliest(wake, self.health.give_up_due(now, self.breaker))
        if rests and paused is not None:  # its work comes back as the pause nears its end
            wake = earliest(wake, paused - RESTING_S)
        if wake is not None:
            self._arm(wake, now)
        self._report_health()

    def _watch_breaker(self, now: float) -> None:
        """Half-open once the cool-down is over, work or none. When the breaker has
        moved, the router and the queue hear it before anything else, and an opening
        voids the credits granted before it (the queue voids them too on hearing)."""
        self.breaker.advance(now)
        state = self.breaker.state
        if state is self._breaker_seen:
            return
        self._breaker_seen = state
        if state is BreakerState.OPEN and self.health.last_error:  # why, as it opens: an
            # operator at the default level saw no cause until "given up on", a minute on
            log.warning(  # (found by a hunt)
                "%s: breaker open (last failure: %s)", self.model, self.health.last_error
            )
        else:
            log.warning("%s: breaker %s", self.model, state.value)
        if state is BreakerState.OPEN:
            self.epoch += 1
            self.granted = 0
            if len(self.in_flight) > self.cap:  # some wait on the loop: take them back
                self.rt.io.call_soon(self.client.revoke, None)
        self._report_health(force=True)

    def _admit(self, now: float) -> float | None:
        """Start what admission allows; return when to try again, if something waits."""
        batch: list[Send] = []
        sent: list[Job] = []
        expired: list[tuple[Task, Result]] = []  # ended unsent: expired, cancelled, too large
        wake: float | None = None
        waiting = self.held.waiting
        slots = self.slots
        while waiting and len(self.in_flight) < slots:
            job = waiting[0]
            gone = self._ended_unsent(job, now)
            if gone is not None:
                waiting.popleft()
                self._refund((job,))
                expired.append((job.task, gone))
                continue
            refused = untranslatable(self.settings, job.task)
            decision = refused or gate(now, self.breaker, self.limiter, job.task)
            if isinstance(decision, Passed):
                waiting.popleft()
                try:
                    send = self._dispatch(job, decision, now)
                except Exception as exc:  # noqa: BLE001 - this task's call, not the actor
                    expired.append((job.task, self._unmade(job, decision, now, exc)))
                    continue
                batch.append(send)
                sent.append(self.in_flight[send[0]].job)
            elif isinstance(decision, TooLarge | End):  # the router's plan keeps these rare
                waiting.popleft()
                self._refund((job,))
                if isinstance(decision, TooLarge):
                    decision = too_large(decision, self.model)
                end = self._end_or_move(job, decision, now)
                if isinstance(end, Job):
                    self.tell(QUEUE, Enqueue(jobs=(end,)))
                else:
                    expired.append((job.task, end))  # ends it
            else:
                wake = self._held_back(decision, job)
                break
        if batch:
            self.sent += len(batch)
            self.rt.ledger.sent(sent, self.model, self.incarnation)  # a successor counts it
            self.rt.io.call_soon(self.client.start, batch)
        if wake is not None:  # held back: what waits behind may expire before then
            wake = earliest(wake, self._expire_waiting(now, expired))
        if expired:
            deliver(self.rt, expired)
        return wake

    def _dispatch(self, job: Job, passed: Passed, now: float) -> Send:
        """Put an admitted job in flight; return the call to start for it."""
        self._typical_tokens += (passed.reservation.tokens - self._typical_tokens) * 0.1
        job = restamped(
            job,
            attempt=job.attempt + 1,
            dispatched_at=now if job.dispatched_at is None else job.dispatched_at,
            model_attempt=job.model_attempt + 1,
        )
        send = send_of(job.task, job.attempt, self.settings, now)  # first: it may raise
        self.in_flight[job.task.task_id] = Flight(job, passed.permit, passed.reservation)
        if self._aged:  # sent: its aged turn was had
            self._aged.discard(job.task.task_id)
        return send

    def _unmade(self, job: Job, passed: Passed, now: float, exc: Exception) -> Result:
        """``job``'s admitted call whose body could not be made: its permit and
        reservation given back, its task failed (``unmade``)."""
        log.error(
            "%s: the call of task %d could not be made",
            self.model,
            job.task.task_id,
            exc_info=exc,
            extra={"task_id": job.task.task_id},
        )
        self.breaker.release(now, passed.permit)
        self.limiter.release(now, passed.reservation)
        self._refund((job,))
        end = unmade(error_detail(exc))
        return self._end(end.kind, job, now, **end.fields)

    def _held_back(self, decision: Reject | WaitUntil, job: Job) -> float | None:
        """Admission says "not yet" to ``job``: what waits for admission goes back to the
        queue unchanged (so the next credits take the best task then waiting); return
        when to try again. After the limiter's no, no credit is granted before it could
        admit ``job``'s call (``to_grant``'s ``held_back_tokens``)."""
        self._hand_back(self.held.take_waiting(), self.incarnation)
        if isinstance(decision, Reject):
            return decision.until
        self._grants_held_until = decision.at
        self._held_back_tokens = tokens_of(job.task)
        return decision.at

    def _expire_waiting(self, now: float, expired: list[tuple[Task, Result]]) -> float | None:
        """End the waiting jobs whose deadline has passed or whose cancel was asked;
        return the next deadline of those left."""
        gone = self.held.pull_waiting(lambda job: self._ended_unsent(job, now))
        expired.extend((job.task, result) for job, result in gone)
        self._refund(job for job, _ in gone)
        return self.held.next_deadline()

    def _ended_unsent(self, job: Job, now: float) -> Result | None:
        """How a job waiting here ends without a call: its deadline passed (``Expired``)
        or it is to be cancelled (``Cancelled``); None if it still waits."""
        task = job.task
        if task.deadline_at is not None and task.deadline_at <= now:
            return self._end(Expired, job, now)
        if self.rt.ledger.cancel_wanted(task):
            return self._end(Cancelled, job, now, detail="cancelled")
        return None

    def _grant(self, now: float) -> float | None:
        """Grant the queue what could start now; return when to look again if held back."""
        free = self.slots - len(self.in_flight) - len(self.held.waiting) - self.granted
        if free <= 0 or self.held.waiting:
            return None
        grant = to_grant(
            now,
            free,
            self.breaker,
            self.limiter,
            self._typical_tokens,
            granted=self.granted,
            answers_due=bool(self.in_flight),
            held_until=self._grants_held_until,
            held_back_tokens=self._held_back_tokens,
        )
        if not isinstance(grant, Grant):
            return grant.until
        n = grant.credits
        self._held_back_tokens = 0  # once: whoever's turn it is now takes the credit
        self.granted += n
        self._ready(n)
        return None

    def _ready(self, n: int) -> None:
        """Tell the queue of ``n`` more credits (0: none), with the settlements due."""
        settled, self._settled = tuple(self._settled), []
        ready = Ready(
            model=self.model,
            incarnation=self.incarnation,
            epoch=self.epoch,
            credits=n,
            settled=settled,
            refunds=tuple(self._refunds),
            aged=self._aged_back,
        )
        self._refunds.clear()
        self._aged_back = 0
        self.tell(QUEUE, ready)

    def _arm(self, at: float, now: float) -> None:
        """A timer for ``at``, unless one already pending rings no later."""
        if self._alarm.wants(at):
            self.rt.after(at - now, self.name, AdmitDue(at=at))

    # -- completions ------------------------------------------------------

    def _done(self, msg: CallsDone) -> None:
        if msg.incarnation != self.incarnation:
            self.ignored += len(msg.results)
            return
        now = self.rt.clock()
        finished: list[tuple[Task, Result]] = []
        moved: list[Job] = []
        try:
            crash = self._judge_all(msg, now, finished, moved)
        except BaseException:
            self._keep(moved, finished)
            raise
        if crash is not None:
            self._keep(moved, finished)
            self._answering = crash[0]  # counted for ``FATAL_ANSWERS`` as the actor dies
            raise crash[1]
        if moved:
            self.tell(QUEUE, Enqueue(jobs=tuple(moved)))
        self._pump()  # the freed slots' credits first: the queue refills them meanwhile
        if self._settled:  # no credit went with them
            self._ready(0)
        if finished:
            deliver(self.rt, finished)

    def _keep(self, moved: list[Job], finished: list[tuple[Task, Result]]) -> None:
        """What was decided for a batch's answers, sent on before the actor dies of one:
        a task moved on is ROUTED in the ledger already, and no successor reclaims it
        (only calls in flight), so it waited for nobody until stop; an answer judged
        was called and billed again (found by a hunt). The crashing answer's task is
        still in flight here: the successor calls it again (at most ``FATAL_ANSWERS``
        times)."""
        if moved:
            self.tell(QUEUE, Enqueue(jobs=tuple(moved)))
        if finished:
            deliver(self.rt, finished)

    def _judge_all(
        self,
        msg: CallsDone,
        now: float,
        finished: list[tuple[Task, Result]],
        moved: list[Job],
    ) -> tuple[int, Exception] | None:
        """Each answer of ``msg`` judged: its task's result into ``finished``, or its job
        into ``moved`` when it goes on to another model (a retry waits here). One whose
        judging raised (a bug) is left in flight, the others judged all the same (those
        after it were called and billed again by the successor; a review): the first
        such task and its error, for the actor to die of."""
        crash: tuple[int, Exception] | None = None
        for r in msg.results:
            flight = self.in_flight.get(r.task_id)
            if flight is None or flight.job.attempt != r.attempt:
                self.ignored += 1
                continue
            del self.in_flight[r.task_id]
            outcome: Result | Job | None
            if r.error == UNSENT:
                outcome = self._unsent(flight, r.detail, now)
            else:
                if flight.job.attempt == 1 and self._loop_clock:  # the task's first call
                    flight.job = _first_sent(flight.job, r.started_at)
                task = flight.job.task
                request = task.request
                settled = settlement(
                    int(request.priority), request.budget_tag, task.fair_cost, r.usage
                )
                if settled is not None:
                    self._settled.append(settled)
                self._answering = r.task_id  # left set by anything else it raises
                try:
                    outcome = self._outcome(flight, r, now)
                except Exception as exc:  # noqa: BLE001 - raised again once all are judged
                    self._answering = None
                    crash = crash or (r.task_id, exc)
                    continue
                self._answering = None
            if isinstance(outcome, Job):
                moved.append(outcome)
            elif outcome is not None:
                finished.append((flight.job.task, outcome))
        return crash

    def _outcome(self, flight: Flight, r: CallResult, now: float) -> Result | Job | None:
        """Learn from one attempt; return its result, a job for another model, or None (retry)."""
        lesson = learn(
            r,
            flight.permit,
            flight.reservation,
            now=now,
            now_epoch=time.time(),
            breaker=self.breaker,
            limiter=self.limiter,
            health=self.health,
        )
        verdict, headers, error = lesson.verdict, lesson.headers, lesson.error
        if lesson.limited_run:
            log.warning(RATE_LIMITED_RUN, self.model, LIMITED_RUN, error)
        self._grants_held_until = None  # a refund may make room before the limiter said
        sent = judged(flight.job, r)
        decision = judge(
            r, sent, verdict, headers, retry=self.retry, price=self.settings.price, now=now
        )
        if isinstance(decision, RetryAt):
            refused = verdict.reason is FailureReason.RATE_LIMITED
            job = to_retry(sent, decision, self.model, rate_limited=refused, error=error)
            if not goes_on_after(self.rt, job.task, decision.paid):
                return self._end(Failed, job, now, **OVER_BUDGET)
            # the ledger's job counts the attempt and what it paid, and it waits here, not
            # on the wire: a restart keeps them, a stop charges nothing more (it charged
            # all of max_tokens again for a retry's wait; found by a review)
            self.rt.ledger.sent((job,), self.model, self.incarnation, handed=False)
            self.held.retry_at(decision.at, job)
            return None
        return self._end_or_move(sent, decision, now)

    def _unsent(self, flight: Flight, why: str, now: float) -> Result | None:
        """A call the loop's window never started: the breaker and the limiter take back
        what they gave it, and its attempt does not count. It ends ``Expired`` or
        ``Cancelled``, or else goes back to the queue as it was."""
        self.breaker.release(now, flight.permit)
        self.limiter.release(now, flight.reservation)
        self._grants_held_until = None
        job = unsent(flight.job)
        self.sent -= 1
        self._refund((job,))
        if why == UNSENT_DEADLINE:  # the loop saw it pass; this clock may not have yet
            return self._end(Expired, job, now)
        gone = self._ended_unsent(job, now)
        if gone is None:
            self._hand_back((job,), self.incarnation, charged=False)  # refunded above
        return gone

    def _end_or_move(self, job: Job, end: End, now: float) -> Result | Job:
        """The job as it moves to another model if ``end`` lets it and it can (another
        deployment may take what this one refused), else the task's result."""
        if end.move_on:
            paid = paid_by(end)
            moved = leave(job, self.model)  # for good (``fallback.leave``)
            if moved is not None:  # a budget stops only a task that has somewhere to go on
                if not goes_on_after(self.rt, job.task, paid):
                    return self._end(Failed, paying(job, self.model, paid), now, **OVER_BUDGET)
                moved = paying(moved, self.model, paid)  # paid, in the ledger too
                if self.rt.ledger.reclaim(moved, self.model, self.incarnation):
                    return moved
        return self._end(end.kind, job, now, **end.fields)

    def _end(self, kind: type[R], job: Job, now: float, **fields: Any) -> R:
        """The result ``kind`` that ends ``job``'s task here."""
        return ended(kind, job.task, now, job=job, model=self.model, **fields)

    # -- health -----------------------------------------------------------

    def _report_health(self, *, force: bool = False) -> None:
        """Tell the router, the queue and stats when the breaker moved, else at most
        once a second, and after the refill of a slot that just freed (the queue holds
        its credit): counted before it, the slot would show empty."""
        now = self.rt.clock()
        state = self.breaker.state
        given_up = self.health.given_up(now, self.breaker)
        in_flight = len(self.in_flight)
        refilling = self.granted > 0 and in_flight < self.cap  # the queue has the credit
        due = self.health.due(
            now,
            state,
            in_flight=in_flight,
            force=force,
            given_up=given_up,
            refilling=refilling,
            paused_until=self.limiter.paused_until,
        )
        if due is None:
            owed = self.health.owed_at
            if owed is not None:  # a timer: the figures reach the router even when idle
                self._arm(owed, now)
            return
        in_flight = min(in_flight, self.cap)  # on the wire, not the window
        health = self.health.report(
            self.model,
            now,
            self.breaker,
            self.limiter,
            in_flight=in_flight,
            cap=self.cap,
            given_up=given_up,
        )
        if given_up is not None and due is not Due.PERIODIC:
            log.warning("%s: given up on (%s): %s", self.model, given_up.value, health.last_error)
        for name in (ROUTER, QUEUE, AGGREGATOR):
            self.rt.book.try_tell(name, health)
        if not self.in_flight and not self.limiter.refilled(now):  # idle, still filling:
            # its headroom is said again each period until full (it stayed at its last
            # figure, 23 of 100 requests or a debt long paid, for good; a hunt)
            self._arm(now + HEALTH_EVERY_S, now)

    def state(self) -> dict[str, Any]:
        now = self.rt.clock()
        return super().state() | {
            "breaker": self.breaker.state.value,
            "in_flight": len(self.in_flight),
            "admitting": len(self.held.waiting),
            "retrying": len(self.held.retrying),
            "granted": self.granted,
            "timers": self._alarm.pending,
            "sent": self.sent,
            "ignored": self.ignored,
            "latency_ewma_s": self.health.latency_ewma,
            "error_rate": round(self.health.error_rate, 4),
            "limiter": self.limiter.headroom(now),
        }


def _first_sent(job: Job, at: float) -> Job:
    """``job`` with its first call stamped as sent at ``at``, when the call started on
    the wire, however long it waited in the loop's window for a slot after it was
    admitted: that wait is the task's queue wait (``Result.queue_wait_s``: until its
    first call), not the call's service time. Never earlier than it was admitted."""
    if job.dispatched_at is None or at <= job.dispatched_at:
        return job
    return restamped(job, attempt=job.attempt, dispatched_at=at)
