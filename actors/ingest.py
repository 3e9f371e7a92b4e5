"""Ingest: the front door. Admit, record in the ledger, route, hand to the queue.

``FrontDoor.admit`` runs on the thread that submits (a caller's ``submit``, a
recurring job's tick, the gateway's loop), not on an actor of its own: what it
decides needs no state but the ledger's, which is thread-safe, and an actor cost
every task a crossing between threads (a wake-up waiting for the GIL: 0.10 ms at
the median and 0.2-0.4 ms at the 90th percentile of 200 streams in flight) and
0.07 ms of CPU, for no decision of its own.

For the same reason it routes what only the routing policy decides (no budget, no
plugged-in classifier: ``actors.router.route_here``) and tells the queue itself,
which takes the router's crossing off such a task's way (router to queue: 0.07-0.09
ms at the median, 0.33-0.51 ms at p90, at 200 streams). The router keeps what needs
its state or its timers: budget placements and the tasks waiting for money, the
tasks that end before the queue (no route, a plan that raised), and a restart's
re-routing of what the ledger holds unrouted. A deadline passed or a cancel is
the queue's to see, as for the router's jobs.

Requests are validated when constructed and their model names when submitted;
the front door applies admission control (capacity, a stop, idempotency key) and
records each admitted task in the ledger before it goes anywhere, so nothing admitted can
be lost: one the router is not told of ends at once (the system stopped), and the
router re-routes the ledger's admitted tasks when it restarts. Refusals are
``Rejected`` results, delivered at once.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

from callboard.actors.base import AGGREGATOR, QUEUE, ROUTER, Runtime, ended
from callboard.actors.router import route_here
from callboard.core.routing import RoutingPolicy
from callboard.messages import (
    Enqueue,
    Finished,
    Job,
    Rejected,
    RejectReason,
    Result,
    Route,
    Task,
)
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.ledger import CLOSED, FULL, LIVE, Refused
from callboard.supervisor.address_book import AddressError

log = guarded_logger(__name__)


class Admission:
    """Shared admission switch (thread-safe): open unless something holds it closed:
    a drain while it waits (several may overlap), a spent budget or a stop for good.
    ``stopped`` makes the front door refuse too."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self._stopped = threading.Event()
        self._drains = 0
        self._for_good: str | None = None
        self.reason = ""

    def close(self, reason: str) -> None:
        """Close for good (a spent budget, a stop beginning)."""
        with self._lock:
            if self._for_good is None:
                self._for_good = reason
            self.reason = self._for_good
            self._open.clear()

    def hold(self, reason: str) -> None:
        """Close until the matching ``release`` (a drain)."""
        with self._lock:
            self._drains += 1
            if self._for_good is None:
                self.reason = reason
            self._open.clear()

    def release(self) -> None:
        with self._lock:
            self._drains = max(0, self._drains - 1)
            if self._drains == 0 and self._for_good is None:
                self.reason = ""
                self._open.set()

    def stop(self, reason: str) -> None:
        with self._lock:
            self._for_good = self.reason = reason
            self._open.clear()
        self._stopped.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()


class FrontDoor:
    """Admit tasks, on the thread that submits them (thread-safe: it keeps nothing)."""

    def __init__(self, rt: Runtime, admission: Admission, policy: RoutingPolicy) -> None:
        self.rt = rt
        self._admission = admission
        self._policy = policy if policy.plans_anywhere and rt.budget is None else None
        """The routing policy when tasks are routed here (``route_here``), else None."""

    def admit(self, tasks: tuple[Task, ...], *, crowded: list[Task] | None = None) -> None:
        """Accept ``tasks`` in the ledger and route them (here, or by telling the
        router), or refuse each (``Rejected``, delivered at once). With ``crowded``, the
        tasks the queue has no room for go there instead, unanswered, for the caller to
        admit again once there is room (``System.resume``: its tasks were accepted once,
        by a process that died; refused, each came back ``Rejected(queue_full)`` while
        the file still held it unfinished, and the next resume answered it again; found
        by a hunt). When the queue or
        the router cannot be told (the system stopped meanwhile: ``AddressError``), or
        a signal handler's exception lands anywhere between the accepting and the
        telling, the tasks accepted and not sent end ``Rejected`` (stopping) before it
        is raised: none is left live with nobody to route it."""
        rt = self.rt
        now = rt.clock()
        if self._admission.stopped:
            why = self._admission.reason or "system is not admitting"
            refused = [self._refuse(t, now, RejectReason.STOPPING, why) for t in tasks]
            rt.book.try_tell(AGGREGATOR, Finished(results=tuple(refused)))
            return
        answers: list[int | Refused | None] = []
        try:
            answers = rt.ledger.accept_all(tasks, self._admission.capacity)
            admitted = tuple(t for t, answer in zip(tasks, answers, strict=True) if answer is None)
            if admitted:
                policy = self._policy
                jobs, rest = (
                    ((), admitted) if policy is None else route_here(policy, rt.ledger, admitted)
                )
                send = functools.partial(self._send, rest, jobs, admitted, now)
                rt.ledger.when_accepted(send)  # a durable one's commit first
        except BaseException as exc:  # a stop, or a signal's exception landing here
            self._unrouted(tasks, now, exc)  # (those it accepted: it may not know which,
            raise  # cut short in there)
        if crowded is not None:
            crowded += (t for t, answer in zip(tasks, answers, strict=True) if answer is FULL)
        refused = [
            self._refuse(t, now, *self._why(answer))
            for t, answer in zip(tasks, answers, strict=True)
            if answer is not None and (crowded is None or answer is not FULL)
        ]
        if refused:
            rt.book.try_tell(AGGREGATOR, Finished(results=tuple(refused)))

    def _send(
        self,
        rest: tuple[Task, ...],
        jobs: tuple[Job, ...],
        admitted: tuple[Task, ...],
        now: float,
        held: bool,  # the ledger says it positionally (``when_accepted``)
    ) -> None:
        """Tasks accepted, to the router (``rest``) and routed ones to the queue; here, or
        (``held``) on a durable ledger's writer once their acceptance is committed. When
        one cannot be told (the system stopped meanwhile), those not sent end
        ``Rejected``; the error is raised to the submitter, or, held, only logged."""
        try:
            if rest:
                self.rt.book.tell(ROUTER, Route(tasks=rest))
            if jobs:  # last: nothing after it can fail with the queue sending them
                self.rt.book.tell(QUEUE, Enqueue(jobs=jobs))
        except AddressError as exc:
            self._unrouted(admitted, now, exc)
            if not held:
                raise
            log.info("%d tasks accepted as the system stopped ended rejected", len(admitted))
        except BaseException as exc:
            self._unrouted(admitted, now, exc)
            raise

    def _unrouted(self, tasks: Sequence[Task], now: float, exc: BaseException) -> None:
        """``tasks`` (those accepted among them) end ``Rejected`` (stopping): none is left
        live with nobody to route it."""
        detail = f"not routed: {exc or type(exc).__name__}"
        unrouted = [
            (t, ended(Rejected, t, now, reason=RejectReason.STOPPING, detail=detail)) for t in tasks
        ]
        ended_now = self.rt.ledger.finish_own(unrouted)
        if ended_now:
            self.rt.book.try_tell(AGGREGATOR, Finished(results=tuple(ended_now)))

    def end_at_once(self, pairs: list[tuple[Task, Result]]) -> None:
        """Accept each task and end it with its result at once, through the ledger (a
        durable one records the outcome): for resumed tasks that can no longer be
        served as they were asked (``System.resume``). One the ledger does not accept
        (its id live, its idempotency key held, the ledger closed) is refused as
        ``admit`` refuses it: every task's future resolves (one was left unresolved
        for good; found by a review)."""
        tasks = tuple(task for task, _ in pairs)
        answers = self.rt.ledger.accept_all(tasks)
        accepted = [pair for pair, answer in zip(pairs, answers, strict=True) if answer is None]
        ended_now = list(self.rt.ledger.finish_all(accepted))
        now = self.rt.clock()
        ended_now += (
            self._refuse(task, now, *self._why(answer))
            for task, answer in zip(tasks, answers, strict=True)
            if answer is not None
        )
        if ended_now:
            self.rt.book.try_tell(AGGREGATOR, Finished(results=tuple(ended_now)))

    def _why(self, answer: int | Refused) -> tuple[RejectReason, str]:
        """Why the ledger did not accept a task, as its refusal says it."""
        if answer is FULL:
            return RejectReason.QUEUE_FULL, f"queue is full ({self._admission.capacity} tasks)"
        if answer is LIVE:
            return RejectReason.DUPLICATE, "a task of this id is live already (submitted twice)"
        if answer is CLOSED:
            return RejectReason.STOPPING, "callboard stopped"
        return RejectReason.DUPLICATE, f"idempotency key already used by {answer}"

    def _refuse(self, task: Task, now: float, reason: RejectReason, detail: str) -> Result:
        result = ended(Rejected, task, now, reason=reason, detail=detail)
        self.rt.ledger.reject(task, result)
        return result
