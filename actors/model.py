"""Model: one actor per model deployment, owning everything that protects it.

Theory of operation. The actor grants the queue credits (``Ready``) only for
calls it could start now: concurrency cap not reached, breaker allowing,
limiter with headroom. A ``Call`` brings jobs for those credits; each job
passes admission (breaker permit, limiter reservation of prompt + max_tokens
tokens) and is started on the I/O loop, in one batch per message. When
admission says "not yet", the actor sets ONE timer (a message to itself) for
the earliest time it could, and waits: no polling, no sleeping.

Completions come back batched (``CallsDone``). Each is classified once
(``classify``); the breaker learns from it, the limiter settles the
reservation from the real usage and honours Retry-After and x-ratelimit-*
headers, and the retry policy decides: retry after a delay (the job waits
off the concurrency cap and goes through admission again), move to a
fallback model, or end. Successes and final failures are finished through the
ledger, which resolves the caller's future right here (the aggregator is off
the latency path and accounts afterwards).

What must hold: at most ``max_concurrency`` calls in flight; nothing sent
while the breaker rejects or the limiter has not admitted; a completion from
another incarnation, or for a call no longer in flight, is ignored; a
restarted incarnation reclaims its predecessor's calls from the ledger and
re-queues them (at-least-once towards the provider, exactly-once results).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import logging
import random
import time
from collections import deque
from typing import Any

from callboard.messages import (
    BreakerState,
    Call,
    CallResult,
    CallsDone,
    Cancel,
    Cancelled,
    Completed,
    Enqueue,
    Expired,
    Failed,
    FailureReason,
    Health,
    Job,
    Ready,
    Regrant,
    Result,
    Task,
    Tick,
    Usage,
)

from ._base import AGGREGATOR, QUEUE, ROUTER, Actor, Runtime, deliver, ended, restamped
from .breaker import Allow, CircuitBreaker
from .classify import ErrorKind, Signal, classify
from .http import ModelClient
from .limiter import Admit, RateLimiter, RateLimitHeaders, Reservation, TooLarge, read_headers
from .pricing import cost_nusd
from .retry import GiveUp, RetryPolicy
from .settings import ModelSettings

log = logging.getLogger(__name__)
HEALTH_ALPHA = 0.1
"""Weight of the newest attempt in the latency and error-rate averages."""
NO_HEADERS = RateLimitHeaders()
"""What a response without rate-limit headers says (most successes)."""
HEALTH_EVERY_S = 1.0
"""Health is reported on every breaker change, and otherwise at most this often."""


@dataclasses.dataclass(slots=True)
class _Flight:
    job: Job
    permit: Allow
    reservation: Reservation


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
        self.limiter = RateLimiter(settings.limiter, rt.clock())
        self.retry = RetryPolicy(settings.retry, random.Random(seed * 1_000_003 + incarnation))
        self.client = client
        self.in_flight: dict[int, _Flight] = {}
        self.admitting: deque[Job] = deque()
        self.retrying: list[tuple[float, int, Job]] = []
        self._seq = itertools.count()
        self.epoch = 0
        self.granted = 0
        self._timer_at: float | None = None
        self._typical_tokens = 1.0
        self._grants_held_until: float | None = None
        """The limiter could admit the waiting call no sooner: no credits until then,
        or until a call settles (its refund may make room earlier)."""
        self._reported: BreakerState | None = None
        self._reported_at = 0.0
        self.latency_ewma: float | None = None
        self.error_rate = 0.0
        self.sent = 0
        self.ignored = 0

    # -- lifecycle --------------------------------------------------------

    def setup(self) -> None:
        self._inherit_limits()
        if self.incarnation > 1:
            self._reclaim_predecessors()
        self._report_health(force=True)
        self._pump()

    def _inherit_limits(self) -> None:
        """Take over the limits of the incarnation before, so invariant 2 holds across
        restarts. Its limiter, with what it sent still in the windows (its calls in
        flight charged in full: they never settle here). Its breaker's state: open
        stays open until the same time, half-open reopens now (the next call is a
        probe); the counts start afresh, the old calls in flight being the old
        incarnation's to report. Kept in ``rt.extras`` by model; the predecessor is
        dead by now, so only this thread touches them from here on."""
        kept: dict[str, tuple[RateLimiter, CircuitBreaker]] = self.rt.extras.setdefault(
            _KEPT_LIMITS, {}
        )
        before = kept.get(self.model)
        if before is not None:
            limiter, breaker = before
            if limiter.abandon_held():
                log.info("%s: the calls of a dead incarnation stay charged", self.name)
            self.limiter = limiter
            if breaker.state is not BreakerState.CLOSED:
                now = self.rt.clock()
                self.breaker.trip(now, until=breaker.reopen_at or now)
        kept[self.model] = (self.limiter, self.breaker)

    def _reclaim_predecessors(self) -> None:
        ledger = self.rt.ledger
        back = [
            job
            for job, inc in ledger.in_flight_of(self.model, below=self.incarnation)
            if ledger.reclaim(job, self.model, inc)
        ]
        if back:
            log.warning("%s: re-queueing %d calls of a dead incarnation", self.name, len(back))
            self.tell(QUEUE, Enqueue(jobs=tuple(back)))

    def handle(self, message: Any) -> None:
        kind = type(message)
        if kind is CallsDone:
            self._done(message)
        elif kind is Call:
            self._call(message)
        elif kind is Tick:
            self._timer_at = None
            self._pump()
        elif kind is Regrant:
            self.epoch += 1
            self.granted = 0
            self._pump()
        elif kind is Cancel:
            self._cancel(message)

    def _cancel(self, msg: Cancel) -> None:
        """End the jobs held here unsent (waiting for admission or for a retry)."""
        ids = set(msg.task_ids)

        def wanted(job: Job) -> bool:
            return msg.everything or job.task.task_id in ids

        now = self.rt.clock()
        dropped = [j for j in self.admitting if wanted(j)]
        dropped += [j for _, _, j in self.retrying if wanted(j)]
        if not dropped:
            return
        self.admitting = deque(j for j in self.admitting if not wanted(j))
        self.retrying = [r for r in self.retrying if not wanted(r[2])]
        heapq.heapify(self.retrying)
        deliver(
            self.rt,
            (
                (j.task, ended(Cancelled, j.task, now, job=j, model=self.model, detail=msg.detail))
                for j in dropped
            ),
        )
        self._pump()

    # -- credits and admission --------------------------------------------

    def _call(self, msg: Call) -> None:
        if msg.incarnation != self.incarnation:
            self._hand_back(msg.jobs, msg.incarnation)
            return
        if msg.epoch == self.epoch:
            self.granted = max(0, self.granted - len(msg.jobs))
        room = self.cap - len(self.in_flight) - len(self.admitting)
        self.admitting.extend(msg.jobs[: max(0, room)])
        if room < len(msg.jobs):  # duplicate credits after a queue restart: never over the cap
            self._hand_back(msg.jobs[max(0, room) :], self.incarnation)
        self._pump()

    def _hand_back_waiting(self) -> None:
        """The limiter holds calls back: what waits for admission goes back to the queue,
        which gives the next credits to the best task then waiting (a CRITICAL one that
        arrived meanwhile goes before these), and no credit is granted before the limiter
        could admit again (``_grant``)."""
        waiting, self.admitting = tuple(self.admitting), deque()
        self._hand_back(waiting, self.incarnation)

    def _hand_back(self, jobs: tuple[Job, ...], incarnation: int) -> None:
        ledger = self.rt.ledger
        back = tuple(j for j in jobs if ledger.reclaim(j, self.model, incarnation))
        if back:
            self.tell(QUEUE, Enqueue(jobs=back))

    def _pump(self) -> None:
        now = self.rt.clock()
        self._due_retries(now)
        wake = _earliest(self._admit(now), self._grant(now))
        if self.retrying:
            due = self.retrying[0][0]
            wake = due if wake is None else min(wake, due)
        if wake is not None:
            self._arm(wake, now)
        self._report_health()

    def _due_retries(self, now: float) -> None:
        due = []
        while self.retrying and self.retrying[0][0] <= now:
            due.append(heapq.heappop(self.retrying)[2])
        self.admitting.extendleft(reversed(due))

    def _admit(self, now: float) -> float | None:
        """Start what admission allows; return when to try again, if something waits."""
        batch: list[tuple[int, int, bytes, float | None]] = []
        expired: list[tuple[Task, Result]] = []  # ended unsent: expired, cancelled, too large
        wake: float | None = None
        while self.admitting and len(self.in_flight) < self.cap:
            job = self.admitting[0]
            task = job.task
            gone = self._ended_unsent(job, now)
            if gone is not None:
                self.admitting.popleft()
                expired.append((task, gone))
                continue
            permit = self.breaker.before_call(now)
            if not isinstance(permit, Allow):
                wake = permit.until
                self._admitting_to_fallbacks()
                break
            tokens = task.prompt_tokens + task.request.max_tokens
            decision = self.limiter.try_acquire(now, tokens)
            if isinstance(decision, TooLarge):  # the router's plan keeps this rare
                self.breaker.release(now, permit)
                self.admitting.popleft()
                moved = self._to_fallback(job)  # the limit is this model's, not the request's
                if moved is not None:
                    self.tell(QUEUE, Enqueue(jobs=(moved,)))
                else:
                    expired.append((task, self._too_large(job, decision, now)))  # ends it
                continue
            if not isinstance(decision, Admit):
                self.breaker.release(now, permit)
                wake = self._grants_held_until = decision.at
                self._hand_back_waiting()
                break
            self._typical_tokens += (tokens - self._typical_tokens) * 0.1
            self.admitting.popleft()
            job = restamped(
                job,
                attempt=job.attempt + 1,
                dispatched_at=job.dispatched_at,
                model_attempt=job.model_attempt + 1,
            )
            self.in_flight[task.task_id] = _Flight(job, permit, decision.reservation)
            left = None if task.deadline_at is None else max(0.0, task.deadline_at - now)
            batch.append((task.task_id, job.attempt, self._body(task), left))
        if batch:
            self.sent += len(batch)
            self.rt.io.call_soon(self.client.start, batch)
        if wake is not None:  # held back: what waits behind may expire before then
            wake = _earliest(wake, self._expire_waiting(now, expired))
        if expired:
            deliver(self.rt, expired)
        return wake

    def _expire_waiting(self, now: float, expired: list[tuple[Task, Result]]) -> float | None:
        """End the waiting jobs whose deadline has passed or whose cancel was asked;
        return the next deadline of those left."""
        first: float | None = None
        keep: deque[Job] = deque()
        for job in self.admitting:
            gone = self._ended_unsent(job, now)
            if gone is not None:
                expired.append((job.task, gone))
                continue
            keep.append(job)
            first = _earliest(first, job.task.deadline_at)
        self.admitting = keep
        return first

    def _ended_unsent(self, job: Job, now: float) -> Result | None:
        """How a job waiting here ends without a call: its deadline passed (``Expired``)
        or it is to be cancelled (``Cancelled``); None if it still waits."""
        task = job.task
        if task.deadline_at is not None and task.deadline_at <= now:
            return ended(Expired, task, now, job=job, model=self.model)
        if self.rt.ledger.cancel_wanted(task):
            return ended(Cancelled, task, now, job=job, model=self.model, detail="cancelled")
        return None

    def _grant(self, now: float) -> float | None:
        """Grant the queue what could start now; return when to look again if held back."""
        free = self.cap - len(self.in_flight) - len(self.admitting) - self.granted
        if free <= 0 or self.admitting:
            return None
        held = self._grants_held_until
        if held is not None:
            if now < held:
                return held
            self._grants_held_until = None
        breaker_room = self.breaker.capacity(now)
        if breaker_room is not None:
            if breaker_room <= 0:
                return self.breaker.reopen_at
            free = min(free, breaker_room)
        typical = max(1, round(self._typical_tokens))
        limit = self.limiter.grantable(now, typical)
        if limit <= 0:
            at = self.limiter.available_at(now, typical)
            return at if at != float("inf") else None
        free = min(free, limit)
        self.granted += free
        self.tell(
            QUEUE,
            Ready(model=self.model, incarnation=self.incarnation, epoch=self.epoch, credits=free),
        )
        return None

    def _too_large(self, job: Job, decision: TooLarge, now: float) -> Result:
        return ended(
            Failed,
            job.task,
            now,
            job=job,
            model=self.model,
            reason=FailureReason.REQUEST_ERROR,
            detail=f"needs {decision.tokens} tokens; "
            f"{self.model} admits {decision.limit:g} per minute",
        )

    def _arm(self, at: float, now: float) -> None:
        if self._timer_at is not None and self._timer_at <= at:
            return
        self._timer_at = at
        self.rt.after(at - now, self.name, Tick(what="admit", at=at))

    def _body(self, task: Task) -> bytes:
        req = task.request
        body: dict[str, Any] = {
            "model": self.settings.wire_model,
            "messages": [{"role": m.role, "content": m.content} for m in req.messages],
            "max_tokens": req.max_tokens,
        }
        if req.temperature is not None:
            body["temperature"] = req.temperature
        return json.dumps(body, separators=(",", ":")).encode()

    # -- completions ------------------------------------------------------

    def _done(self, msg: CallsDone) -> None:
        if msg.incarnation != self.incarnation:
            self.ignored += len(msg.results)
            return
        now = self.rt.clock()
        finished: list[tuple[Task, Result]] = []
        moved: list[Job] = []
        for r in msg.results:
            flight = self.in_flight.get(r.task_id)
            if flight is None or flight.job.attempt != r.attempt:
                self.ignored += 1
                continue
            del self.in_flight[r.task_id]
            outcome = self._outcome(flight, r, now)
            if isinstance(outcome, Job):
                moved.append(outcome)
            elif outcome is not None:
                finished.append((flight.job.task, outcome))
        if moved:
            self.tell(QUEUE, Enqueue(jobs=tuple(moved)))
        self._pump()  # the freed slots' credits first: the queue refills them meanwhile
        if finished:
            deliver(self.rt, finished)

    def _outcome(self, flight: _Flight, r: CallResult, now: float) -> Result | Job | None:
        """Learn from one attempt; return its result, a job for another model, or None (retry)."""
        job, task = flight.job, flight.job.task
        verdict = classify(r.status_code, ErrorKind(r.error) if r.error else None, r.detail)
        self.breaker.record(now, verdict.breaker, flight.permit)
        self._observe(r, verdict.reason is None, verdict.breaker is Signal.OUTAGE)
        headers = read_headers(dict(r.headers), time.time()) if r.headers else NO_HEADERS
        self._learn_limits(now, flight.reservation, r, headers)
        if r.error == ErrorKind.DEADLINE.value:
            detail = "the deadline passed while the call was in flight; it was cut"
            return ended(Expired, task, now, job=job, model=self.model, detail=detail)
        if verdict.reason is None and r.error is None:
            usage = r.usage or Usage(
                prompt_tokens=task.prompt_tokens,
                completion_tokens=task.request.max_tokens,
                estimated=True,
            )
            return ended(
                Completed,
                task,
                now,
                job=job,
                model=self.model,
                content=r.content,
                finish_reason=r.finish_reason,
                usage=usage,
                cost_nusd=cost_nusd(self.settings.price, usage),
            )
        reason = verdict.reason or FailureReason.MALFORMED_RESPONSE
        decision = self.retry.decide(
            attempt=job.model_attempt,  # this model's calls: a fallback has retries of its own
            verdict=verdict,
            retry_after_s=headers.retry_after_s,
            now=now,
            deadline=task.deadline_at,
        )
        if not isinstance(decision, GiveUp):
            heapq.heappush(self.retrying, (now + decision.delay_s, next(self._seq), job))
            return None
        moved = self._to_fallback(job)  # another deployment may take what this one refused
        if moved is not None:
            return moved
        return ended(
            Failed,
            task,
            now,
            job=job,
            model=self.model,
            reason=reason,
            status_code=r.status_code,
            detail=r.detail or decision.why,
        )

    def _learn_limits(
        self, now: float, res: Reservation, r: CallResult, headers: RateLimitHeaders
    ) -> None:
        self.limiter.settle(now, res, _tokens_used(r, res))
        self._grants_held_until = None  # a refund may make room before the limiter said
        if r.status_code == 429 and (headers.limit_requests or headers.limit_tokens):
            # pushed back with no limit of ours: pace at the one the provider advertises
            # (taken as per minute, as OpenAI's are; only once it has said no)
            self.limiter.adopt(now, headers.limit_requests, headers.limit_tokens)
        self.limiter.observe(
            now,
            remaining_requests=headers.remaining_requests,
            remaining_tokens=headers.remaining_tokens,
            reset_requests_s=headers.reset_requests_s,
            reset_tokens_s=headers.reset_tokens_s,
        )
        if r.status_code == 429:
            self.limiter.pause_until(now + _pause_s(headers))

    def _admitting_to_fallbacks(self) -> None:
        """The breaker rejects: jobs granted before it opened go on to their fallbacks."""
        stay: deque[Job] = deque()
        moved = []
        for job in self.admitting:
            nxt = self._to_fallback(job)
            if nxt is None:
                stay.append(job)
            else:
                moved.append(nxt)
        self.admitting = stay
        if moved:
            self.tell(QUEUE, Enqueue(jobs=tuple(moved)))

    def _to_fallback(self, job: Job) -> Job | None:
        """The job leaves this model: for the other candidates of its group if any,
        else for its next fallback. None if it has nowhere else to go. Its count of
        calls to this model starts again from 0 there; the total goes on."""
        others = tuple(c for c in job.candidates if c != self.model)
        if others:
            nxt = dataclasses.replace(job, candidates=others, model_attempt=0)
        elif job.fallbacks:
            nxt = dataclasses.replace(
                job, candidates=job.fallbacks[:1], fallbacks=job.fallbacks[1:], model_attempt=0
            )
        else:
            return None
        if self.rt.ledger.reclaim(nxt, self.model, self.incarnation):
            return nxt
        return None

    # -- health -----------------------------------------------------------

    def _observe(self, r: CallResult, ok: bool, outage: bool) -> None:
        """Fold one attempt into the latency and error-rate EWMAs."""
        a = HEALTH_ALPHA
        if ok:
            took = r.ended_at - r.started_at
            self.latency_ewma = (
                took
                if self.latency_ewma is None
                else self.latency_ewma + a * (took - self.latency_ewma)
            )
        self.error_rate += a * ((1.0 if outage else 0.0) - self.error_rate)

    def _report_health(self, *, force: bool = False) -> None:
        """Tell the router (and stats) when the breaker moved, else at most once a second."""
        now = self.rt.clock()
        state = self.breaker.state
        changed = state is not self._reported
        if not (force or changed or now - self._reported_at >= HEALTH_EVERY_S):
            return
        self._reported, self._reported_at = state, now
        room = self.limiter.headroom(now)
        health = Health(
            model=self.model,
            breaker=state,
            reopen_at=self.breaker.reopen_at,
            latency_ewma_s=self.latency_ewma,
            error_rate=round(self.error_rate, 4),
            in_flight=len(self.in_flight),
            max_concurrency=self.cap,
            requests_headroom=room.requests,
            tokens_headroom=room.tokens,
            paused_until=room.paused_until,
        )
        if changed and not force:
            log.warning("%s: breaker %s", self.model, state.value)
        for name in (ROUTER, QUEUE, AGGREGATOR):
            self.rt.book.try_tell(name, health)

    def state(self) -> dict[str, Any]:
        now = self.rt.clock()
        return super().state() | {
            "breaker": self.breaker.state.value,
            "in_flight": len(self.in_flight),
            "admitting": len(self.admitting),
            "retrying": len(self.retrying),
            "granted": self.granted,
            "sent": self.sent,
            "ignored": self.ignored,
            "latency_ewma_s": self.latency_ewma,
            "error_rate": round(self.error_rate, 4),
            "limiter": self.limiter.headroom(now),
        }


def _pause_s(h: RateLimitHeaders) -> float:
    """How long a 429 pauses the model: its Retry-After; else the reset of the limit
    it says is spent (remaining 0), both if both are; else the sooner reset (a reset
    is the time to a full refill: the tokens' can be minutes when only the requests
    ran out); else one second."""
    if h.retry_after_s is not None:
        return h.retry_after_s
    spent = [
        reset
        for remaining, reset in (
            (h.remaining_requests, h.reset_requests_s),
            (h.remaining_tokens, h.reset_tokens_s),
        )
        if remaining == 0 and reset is not None
    ]
    if spent:
        return max(spent)
    resets = [t for t in (h.reset_requests_s, h.reset_tokens_s) if t is not None]
    return min(resets) if resets else 1.0


_KEPT_LIMITS = "model-limits"
"""``rt.extras`` key: model name -> the limiter and breaker of its live incarnation."""


def _tokens_used(r: CallResult, res: Reservation) -> int:
    """What a finished call counts against the token limit.

    Its reported usage if it has one; nothing for a 429 (refused, so not charged);
    else the whole reservation: a provider counts a request's tokens when it
    arrives (OpenAI does), so a call that failed after reaching it, or that it
    answered without usage, may have cost all of them.
    """
    if r.usage is not None:
        return r.usage.total_tokens
    return 0 if r.status_code == 429 else res.tokens


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)
