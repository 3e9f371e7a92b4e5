"""Ingest: the front door. Admit, record in the ledger, forward to the router.

Requests are validated when constructed; ingest checks the model names again
(a REPL user may ``tell`` it directly), applies admission control (capacity,
draining, idempotency key) and records each admitted task in the ledger before
it goes anywhere, so nothing admitted can be lost. Refusals are ``Rejected``
results, delivered at once.
"""

from __future__ import annotations

import threading
from typing import Any

from callboard.actors.base import AGGREGATOR, ROUTER, Actor, Runtime, ended
from callboard.core.routing import RoutingPolicy
from callboard.messages import (
    Finished,
    Rejected,
    RejectReason,
    Result,
    Route,
    Submit,
    Task,
    UsageError,
)
from callboard.runtime.ledger import FULL


class Admission:
    """Shared admission switch (thread-safe): open unless something holds it closed:
    a drain while it waits (several may overlap), a spent budget or a stop for good.
    ``stopped`` makes ingest refuse too."""

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


class IngestActor(Actor):
    def __init__(
        self,
        rt: Runtime,
        name: str,
        incarnation: int,
        *,
        policy: RoutingPolicy,
        admission: Admission,
    ) -> None:
        super().__init__(rt, name, incarnation)
        self._policy = policy
        self._admission = admission
        self.admitted = 0
        self.rejected = 0

    def handle(self, message: Any) -> None:
        if type(message) is Submit:
            tasks = message.tasks
            if self._current_count:  # redelivered: this Submit may have been handled already
                tasks = self._not_ended(tasks)
            self._submit(tasks)

    def _not_ended(self, tasks: tuple[Task, ...]) -> tuple[Task, ...]:
        """The tasks still announced or live: one in neither was accepted (or refused)
        by the incarnation that crashed and has ended since; accepting it again
        would call the provider for a result nobody will read."""
        ledger = self.rt.ledger
        return tuple(t for t in tasks if ledger.is_pending(t.task_id))

    def _submit(self, tasks: tuple[Task, ...]) -> None:
        ledger, now = self.rt.ledger, self.rt.clock()
        refused: list[Result] = []
        candidates: list[Task] = []
        for task in tasks:
            refusal = self._refusal(task)
            if refusal is None:
                candidates.append(task)
            else:
                refused.append(self._refuse(task, now, *refusal))
        admitted: list[Task] = []
        capacity = self._admission.capacity
        answers = ledger.accept_all(candidates, capacity)
        for task, answer in zip(candidates, answers, strict=True):
            if answer is None:
                admitted.append(task)
            elif answer is FULL:
                detail = f"queue is full ({capacity} tasks)"
                refused.append(self._refuse(task, now, RejectReason.QUEUE_FULL, detail))
            else:
                detail = f"idempotency key already used by {answer}"
                refused.append(self._refuse(task, now, RejectReason.DUPLICATE, detail))
        if refused:
            self.tell(AGGREGATOR, Finished(results=tuple(refused)))
        if admitted:
            self.admitted += len(admitted)
            self.tell(ROUTER, Route(tasks=tuple(admitted)))

    def _refuse(self, task: Task, now: float, reason: RejectReason, detail: str) -> Result:
        self.rejected += 1
        result = ended(Rejected, task, now, reason=reason, detail=detail)
        self.rt.ledger.reject(task, result)
        return result

    def _refusal(self, task: Task) -> tuple[RejectReason, str] | None:
        if self._admission.stopped:
            return RejectReason.STOPPING, self._admission.reason or "system is not admitting"
        try:
            self._policy.check(task.request)
        except UsageError as exc:
            return RejectReason.UNKNOWN_MODEL, str(exc)
        return None

    def state(self) -> dict[str, Any]:
        return super().state() | {"admitted": self.admitted, "rejected": self.rejected}
