"""Router: decide where each task may go (the policy is in ``routing``).

It turns admitted tasks into ``Job``s (candidates + fallbacks), marks them
routed in the ledger, and enqueues them in one message per batch. It keeps
the latest ``Health`` of every model for the policy. A task no model can
serve ends here as ``Failed(NO_ROUTE)``.

A restarted router re-routes what the ledger says is still waiting to be
routed (a ``Route`` lost with the crashed incarnation's mailbox is also
redelivered by the address book; the ledger's ``route`` makes the second one
a no-op).
"""

from __future__ import annotations

from typing import Any

from callboard.messages import Enqueue, Failed, FailureReason, Health, Job, Route, Task

from ._base import QUEUE, Actor, Runtime, deliver, ended
from .routing import NoRoute, RoutingPolicy


class RouterActor(Actor):
    def __init__(self, rt: Runtime, name: str, incarnation: int, *, policy: RoutingPolicy) -> None:
        super().__init__(rt, name, incarnation)
        self._policy = policy
        self.health: dict[str, Health] = {}
        self.routed = 0

    def setup(self) -> None:
        if self.incarnation > 1:
            self._route(tuple(self.rt.ledger.accepted_tasks()))

    def handle(self, message: Any) -> None:
        if type(message) is Route:
            self._route(message.tasks)
        elif type(message) is Health:
            self.health[message.model] = message

    def _route(self, tasks: tuple[Task, ...]) -> None:
        ledger = self.rt.ledger
        jobs: list[Job] = []
        failed = []
        for task in tasks:
            try:
                plan = self._policy.plan(task.request, task.prompt_tokens)
            except NoRoute as exc:
                now = self.rt.clock()
                failed.append(
                    (task, ended(Failed, task, now, reason=FailureReason.NO_ROUTE, detail=str(exc)))
                )
                continue
            job = Job(task=task, candidates=plan.candidates, fallbacks=plan.fallbacks)
            if ledger.route(job):
                jobs.append(job)
        if failed:
            deliver(self.rt, failed)
        if jobs:
            self.routed += len(jobs)
            self.tell(QUEUE, Enqueue(jobs=tuple(jobs)))

    def state(self) -> dict[str, Any]:
        return super().state() | {
            "routed": self.routed,
            "health": {m: h.breaker.value for m, h in self.health.items()},
        }
