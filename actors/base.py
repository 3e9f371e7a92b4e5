"""The base of every callboard actor: supervision hooks over pykka's gaps.

pykka stops an actor whose handler raises on a ``tell`` and silently drops
its mailbox; an exception in ``on_start`` fires no hook at all. This base
turns both into a report to the supervisor (``ChildFailed``), and hands the
message being handled plus everything left in the mailbox to the address
book, which holds them for the next incarnation. A stop asked for from
elsewhere is reported too (``ChildStopped``: a normal exit). A message that
crashes an actor twice is poison: it is not redelivered again, and the
supervisor fails the tasks it carries instead, so a bug cannot crash-loop
the system or lose a task.

Subclasses implement ``handle`` (and optionally ``setup`` and ``state``);
they never override pykka's hooks.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, TypeVar

import pykka
from callboard.core.attempt import End, Paid, RetryAt, unserved
from callboard.core.fallback import Availability, stranded
from callboard.core.stats import StatsBook
from callboard.messages import (
    Billed,
    CallResult,
    ChildFailed,
    ChildStopped,
    Crash,
    Expired,
    Failed,
    FailureReason,
    Finished,
    GetState,
    Health,
    Job,
    LetGo,
    Redelivered,
    Result,
    Task,
    Usage,
)
from callboard.runtime import redact
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.io_loop import IoLoop
from callboard.runtime.job_table import JobTable
from callboard.runtime.ledger import Ledger
from callboard.runtime.shared_budget import SharedBudget
from callboard.runtime.succession import KeptLimits
from callboard.supervisor.address_book import AddressBook

log = guarded_logger(__name__)
R = TypeVar("R", bound=Result)

SUPERVISOR = "supervisor"


LET_GO_AT = 64
"""A message carrying this many tasks, jobs or results (a burst) is let go at once
(``LetGo``): up to this many stay held by an idle actor's loop."""


def _carried(message: Any) -> int:
    """How many tasks, jobs or results ``message`` carries."""
    for name in ("tasks", "jobs", "results"):
        held = getattr(message, name, None)
        if held is not None:
            return len(held)
    return 0


class InjectedCrash(RuntimeError):  # noqa: N818 - it is a crash, by request
    """Raised by the crash plan or a ``Crash`` message, to exercise supervision."""


class CrashPlan:
    """Test and bench hook: make named actors raise every N-th message they receive
    (``only``: of those kinds, for an actor's name: the router's ``Route``s, say, and
    not the health reports it hears whatever the test does)."""

    def __init__(
        self,
        every: dict[str, int],
        *,
        fail_starts: dict[str, int] | None = None,
        only: dict[str, tuple[type, ...]] | None = None,
    ) -> None:
        self._every = dict(every)
        self._only = dict(only or {})
        self._counters = {name: itertools.count(1) for name in every}
        self._fail_starts = dict(fail_starts or {})
        self._lock = threading.Lock()
        self.injected = 0

    def maybe_fail_start(self, name: str, incarnation: int) -> None:
        """Fail the start of restarted incarnations, ``fail_starts[name]`` times."""
        with self._lock:
            left = self._fail_starts.get(name, 0)
            if incarnation == 1 or left <= 0:
                return
            self._fail_starts[name] = left - 1
            self.injected += 1
        raise InjectedCrash(f"{name}: injected failure while starting #{incarnation}")

    def maybe_crash(self, name: str, message: Any) -> None:
        every = self._every.get(name)
        if every is None:
            return
        kinds = self._only.get(name)
        if kinds is not None and not isinstance(message, kinds):
            return
        with self._lock:
            n = next(self._counters[name])
            if n % every:
                return
            self.injected += 1
        raise InjectedCrash(f"{name}: injected crash at message {n}")


class Observer(Protocol):
    """Told by the aggregator, on its thread, of what it accounts (e.g. ``callboard.metrics``)."""

    def observe_results(self, results: tuple[Result, ...]) -> None: ...

    def observe_health(self, health: Health) -> None: ...


@dataclass(slots=True, kw_only=True)
class Runtime:
    """What every actor of one system shares (all thread-safe)."""

    book: AddressBook
    ledger: Ledger
    io: IoLoop
    clock: Callable[[], float] = time.monotonic
    crash_plan: CrashPlan | None = None
    budget: SharedBudget | None = None
    on_budget_spent: Callable[[], None] | None = None
    observers: list[Observer] = field(default_factory=list)
    """Told of every result and health report the aggregator accounts."""
    jobs: JobTable = field(default_factory=JobTable)
    """The recurring jobs: written by the jobs actor, read by anyone."""
    kept_limits: dict[str, KeptLimits] = field(default_factory=dict)
    """Model name -> the limiter and breaker of its live incarnation (``runtime.succession``)."""
    fatal_answers: Counter[tuple[str, int]] = field(default_factory=Counter)
    """(model, task id) -> the incarnations judging that task's answer killed: a new one
    sends such a task again only so often (``actors.model``). Written by a dying model
    actor, read by its successor, which starts once it is dead."""
    stats: StatsBook = field(default_factory=StatsBook)
    """The aggregator's counts, kept across its incarnations: only the live one writes
    them (not thread-safe), and the system's final sweep once every actor stopped."""

    def after(self, delay: float, name: str, message: Any) -> None:
        """A timer: tell ``name`` the ``message`` after ``delay`` seconds."""
        self.io.call_later(delay, self.book.try_tell, name, message)


class Actor(pykka.ThreadingActor):
    """A supervised actor with a stable name and a numbered incarnation."""

    use_daemon_thread = True  # a host that forgets stop() must still be able to exit

    @staticmethod
    def _create_actor_inbox() -> queue.SimpleQueue[Any]:
        """The mailbox: a ``SimpleQueue`` (C; a put releases one lock the reader waits
        on) rather than pykka's ``Queue`` (a condition variable and a new lock for every
        wait). A task crosses four actors on its way to its call, each hop a put and a
        get: measured 77-80 against 96-101 us for five hops between idle threads, and
        less of the GIL held on every hop."""
        return queue.SimpleQueue()

    def __init__(self, rt: Runtime, name: str, incarnation: int) -> None:
        super().__init__()
        self.rt = rt
        self.name = name
        self.incarnation = incarnation
        self._current: Any = None
        self._current_count = 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} #{self.incarnation}>"

    # -- what subclasses write --------------------------------------------

    def setup(self) -> None:
        """Run on the actor's thread before the first message."""

    def handle(self, message: Any) -> Any:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """A readable snapshot for ``GetState`` (the REPL)."""
        return {"name": self.name, "incarnation": self.incarnation}

    def tell(self, name: str, message: Any) -> None:
        self.rt.book.tell(name, message)

    # -- pykka hooks ------------------------------------------------------

    def on_start(self) -> None:
        try:
            if self.rt.crash_plan is not None:
                self.rt.crash_plan.maybe_fail_start(self.name, self.incarnation)
            self.setup()
        except Exception as exc:
            self._died(exc, in_start=True)
            raise

    def on_receive(self, message: Any) -> Any:
        if type(message) is LetGo:
            return None
        count = 0
        if type(message) is Redelivered:
            count, message = message.count, message.message
        self._current, self._current_count = message, count
        plan = self.rt.crash_plan
        if plan is not None:
            plan.maybe_crash(self.name, message)
        if type(message) is GetState:
            reply: Any = self.state()
        elif type(message) is Crash:
            raise InjectedCrash(f"{self.name}: {message.reason}")
        else:
            reply = self.handle(message)
        self._current = None
        if _carried(message) >= LET_GO_AT and self.actor_inbox.empty():
            self.actor_ref.tell(LetGo())  # pykka's loop holds the last message until the next
        return reply

    def on_stop(self) -> None:
        """Stopped by request: what was told to it and not read is held for the next
        incarnation (pykka would drop it), and the supervisor hears of it (it ignores
        the stops it asked for)."""
        self.rt.book.fail(self.name, self.actor_ref, [])
        self.rt.book.try_tell(
            SUPERVISOR, ChildStopped(name=self.name, incarnation=self.incarnation)
        )

    def on_failure(
        self,
        exception_type: type[BaseException] | None,  # noqa: ARG002 - pykka's hook signature
        exception_value: BaseException | None,
        traceback: TracebackType | None,  # noqa: ARG002 - pykka's hook signature
    ) -> None:
        self._died(exception_value, in_start=False)

    def _died(self, exc: BaseException | None, *, in_start: bool) -> None:
        current, poison = self._current, None
        first: list[Any] = []
        if current is not None and not isinstance(current, Crash | GetState):
            if self._current_count >= 1:
                poison = current
            else:
                first.append(Redelivered(message=current, count=self._current_count + 1))
        kept = self.rt.book.fail(self.name, self.actor_ref, first)
        log.warning(
            "%r crashed%s: %r (%d messages held for the next incarnation)",
            self,
            " while starting" if in_start else "",
            exc,
            kept,
        )
        self.rt.book.try_tell(
            SUPERVISOR,
            ChildFailed(
                name=self.name,
                incarnation=self.incarnation,
                error=repr(exc),  # redacted where the supervisor takes it (``_failed``)
                poison=poison,
            ),
        )


ROUTER = "router"
QUEUE = "queue"
AGGREGATOR = "aggregator"


MODEL_PREFIX = "model:"


def model_address(model: str) -> str:
    return f"{MODEL_PREFIX}{model}"


def restamped(
    job: Job,
    *,
    attempt: int,
    dispatched_at: float | None,
    model_attempt: int | None = None,
    rate_limited: int | None = None,
    refused: int | None = None,
    last_error: str | None = None,
) -> Job:
    """``job`` with new attempt counts (``model_attempt``, ``rate_limited``, ``refused``
    and ``last_error``: kept unless given) and first-send time: every call's path, so
    built directly rather than with ``dataclasses.replace`` (several times slower)."""
    return Job(
        task=job.task,
        candidates=job.candidates,
        fallbacks=job.fallbacks,
        attempt=attempt,
        dispatched_at=dispatched_at,
        model_attempt=job.model_attempt if model_attempt is None else model_attempt,
        rate_limited=job.rate_limited if rate_limited is None else rate_limited,
        refused=job.refused if refused is None else refused,
        last_error=job.last_error if last_error is None else last_error,
        paid=job.paid,
    )


def judged(sent: Job, r: CallResult) -> Job:
    """``sent`` (restamped for the attempt ``r`` answers) counting ``r`` among the calls
    refused unserved if it was one (``attempt.unserved``): an idempotency key whose
    every call was refused is free for its retry (``ledger.binds_key``)."""
    if not unserved(r):
        return sent
    return restamped(
        sent, attempt=sent.attempt, dispatched_at=sent.dispatched_at, refused=sent.refused + 1
    )


def unsent(job: Job) -> Job:
    """``job`` as before the call it was re-stamped for, which never started: that
    attempt not counted, nor its send time if it was the first."""
    return restamped(
        job,
        attempt=job.attempt - 1,
        dispatched_at=job.dispatched_at if job.attempt > 1 else None,
        model_attempt=job.model_attempt - 1,
    )


def to_retry(sent: Job, retry: RetryAt, model: str, *, rate_limited: bool, error: str) -> Job:
    """``sent`` (restamped for the attempt just made) as it waits to call ``model`` again
    (``retry``) after failing with ``error``: a 429 (``rate_limited``) is no attempt at
    the model, so it counts against ``rate_limited`` instead of ``model_attempt``; a
    call billed though it served nothing counts in what the task paid."""
    again = restamped(
        sent,
        attempt=sent.attempt,
        dispatched_at=sent.dispatched_at,
        model_attempt=sent.model_attempt - rate_limited,
        rate_limited=sent.rate_limited + rate_limited,
        last_error=error,
    )
    return paying(again, model, retry.paid)


def paid_by(end: End) -> Paid | None:
    """What the call that ``end`` ends (or moves on from) was billed, if anything."""
    cost = end.fields.get("cost_nusd")
    usage = end.fields.get("usage")
    return None if cost is None or usage is None else (usage, cost)


def paying(job: Job, model: str, paid: Paid | None) -> Job:
    """``job`` having paid ``model`` for a call that served nothing (``paid``: None,
    nothing)."""
    if paid is None:
        return job
    usage, cost = paid
    billed = Billed(model=model, usage=usage, cost_nusd=cost)
    return dataclasses.replace(job, paid=(*job.paid, billed))


OVER_BUDGET: dict[str, Any] = {
    "reason": FailureReason.BUDGET_EXCEEDED,
    "detail": "the budget is spent: a call was billed though it served nothing, and "
    "another would take the spend past the limit",
}
"""How a task ends whose billed call left no room in its budget for the next."""


def goes_on_after(rt: Runtime, task: Task, paid: Paid | None) -> bool:
    """Whether ``task`` may make another call (a retry, a fallback's) after one billed
    ``paid`` that served nothing: the budget is charged it now (``Budgets.charge``);
    False when the next call would take the spend past a limit."""
    if paid is None or rt.budget is None or paid[1] <= 0:
        return True
    return rt.budget.charge(task.task_id, paid[1])


def ended(cls: type[R], task: Task, now: float, *, job: Job | None = None, **fields: Any) -> R:
    """Build a terminal result for ``task`` with the common fields filled in. An
    ``Expired`` says how far the task got and the last error it met."""
    queue_wait = 0.0
    attempts = 0
    if job is not None:
        attempts = job.attempt
        if job.dispatched_at is not None:
            queue_wait = job.dispatched_at - task.submitted_at
    fields.setdefault("attempts", attempts)
    if job is not None and job.refused:
        fields.setdefault("refused", job.refused)
    if job is not None and job.paid:  # the calls billed before, in its totals and apart
        usage = fields.get("usage") or Usage()
        cost = fields.get("cost_nusd", 0)
        for billed in job.paid:
            usage, cost = usage.plus(billed.usage), cost + billed.cost_nusd
        fields["usage"], fields["cost_nusd"], fields["billed_before"] = usage, cost, job.paid
    detail = fields.get("detail")
    if detail:  # text from anywhere (a crash's repr, a provider's body): no secret in it
        fields["detail"] = redact.hide(detail)
    if cls is Expired:
        detail = fields.get("detail") or "the deadline passed"
        fields["detail"] = _expired_detail(detail, attempts, "" if job is None else job.last_error)
    return cls(
        task_id=task.task_id,
        trace_id=task.trace_id,
        priority=task.request.priority,
        latency_s=max(0.0, now - task.submitted_at),
        queue_wait_s=max(0.0, queue_wait),
        metadata=task.request.metadata,
        **fields,
    )


def stranded_end(job: Job, available: Availability, now: float) -> Failed | None:
    """``job``'s ``Failed`` end if every model of its plan is given up on
    (``fallback.stranded``: the first one's reason, each one's last error), else None."""
    why = stranded(job, available)
    if why is None:
        return None
    reason, detail = why
    return ended(
        Failed, job.task, now, job=job, model=job.candidates[0], reason=reason, detail=detail
    )


def _expired_detail(detail: str, attempts: int, last_error: str) -> str:
    if not last_error:
        return detail if attempts else f"{detail} before a call was sent"
    calls = "1 call" if attempts == 1 else f"{attempts} calls"
    return f"{detail}; after {calls}, the last error: {last_error}"


def deliver(rt: Runtime, pairs: Iterable[tuple[Task, Result]]) -> int:
    """Finish tasks through the ledger (exactly once), then account them."""
    done = tuple(rt.ledger.finish_all(pairs))
    if done and rt.budget is not None:
        _settle(rt, done)
    if done:
        rt.book.try_tell(AGGREGATOR, Finished(results=done))
        if log.isEnabledFor(logging.INFO):
            _log_results(done)
    return len(done)


def account(rt: Runtime, results: tuple[Result, ...]) -> None:
    """Count ``results`` in ``rt.stats`` and tell the observers (the metrics), once: the
    aggregator's work, and the stop's sweep's once the aggregator is gone (it counted
    them in the stats alone: the metrics missed every result the sweep ended, and the
    cost of the calls it cut; found by a hunt)."""
    book = rt.stats
    if not book.begin(results):  # counted before (a handler crashed after it)
        return
    counted: list[Result] = []
    for r in results:
        try:
            book.count(r)
        except Exception:  # noqa: BLE001 - a bug: that result alone is missed (logged)
            _uncounted("the stats", r)
        else:
            counted.append(r)
    if counted:
        told = tuple(counted)
        for observer in rt.observers:
            try:
                observer.observe_results(told)
            except Exception:  # noqa: BLE001 - a bug in an observer: it misses the batch
                _uncounted(f"an observer ({type(observer).__name__})", told[0])


def note_health(rt: Runtime, health: Health) -> None:
    """Keep ``health`` as its model's latest in ``rt.stats`` and tell the observers (the
    metrics): the aggregator's work, and the stop's sweep's once the aggregator is gone
    (nothing in flight any more: the gauge said 4 for good; found by a hunt)."""
    rt.stats.health[health.model] = health
    for observer in rt.observers:
        observer.observe_health(health)


def _uncounted(where: str, r: Result) -> None:
    """A result that raised as it was counted: logged (redacted), never the aggregator's
    death. A crash there lost its whole batch to the stats (after two, poison) and
    restarted the aggregator each time; results a batch held that could not be counted
    could take the restart intensity past its limit and stop the system (found by a
    hunt, then a review)."""
    log.error(
        "%s could not count the result of task %d:\n%s",
        where,
        r.task_id,
        redact.hide(traceback.format_exc()),
        extra=task_extra(r.task_id, r.trace_id),
    )


def _settle(rt: Runtime, results: tuple[Result, ...]) -> None:
    assert rt.budget is not None
    spent = False
    for r in results:  # the reservation remembers its tag; a cost of 0 releases it
        spent = rt.budget.settle(r.task_id, r.cost_nusd, None) or spent
    if spent and rt.on_budget_spent is not None:
        rt.on_budget_spent()


def task_extra(task_id: int, trace_id: str) -> dict[str, Any]:
    """``extra=`` for a log record about one task: formatters may use
    ``%(task_id)s`` and ``%(trace_id)s`` (see ``callboard.TaskLogFilter``)."""
    return {"task_id": task_id, "trace_id": trace_id}


def _log_results(results: tuple[Result, ...]) -> None:
    debug = log.isEnabledFor(logging.DEBUG)
    for r in results:
        if not r.ok:
            detail = getattr(r, "detail", "")
            reason = getattr(r, "reason", None)
            log.info(
                "task %d %s%s on %s after %d attempts: %s",
                r.task_id,
                type(r).__name__.lower(),
                f" ({reason.value})" if reason is not None else "",
                r.model or "-",
                r.attempts,
                detail,
                extra=task_extra(r.task_id, r.trace_id),
            )
        elif debug:
            log.debug(
                "task %d completed on %s in %.3f s",
                r.task_id,
                r.model,
                r.latency_s,
                extra=task_extra(r.task_id, r.trace_id),
            )
