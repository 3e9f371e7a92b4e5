"""Router: decide where each task may go (the policy is in ``routing``).

It turns admitted tasks into ``Job``s (the plan: where each wants to go),
marks them routed in the ledger, and enqueues them in one message per batch;
``Health`` reports feed the policy's order. Where nothing but the policy
decides (no budget, no plugged-in classifier), the front door does the same on
the submitting thread (``route_here``) and only what is left comes here: what
a budget places or makes wait, and what ends before the queue. A task no model
can serve ends here as ``Failed(NO_ROUTE)``; one above every able model's
tokens-per-minute limit as ``Failed(REQUEST_ERROR)`` (what the limiter would
say, only sooner); one whose plan raises anything else (a bug) as
``Failed(INTERNAL)``.

A task whose plan does not fit the budget now, but would once the money reserved
for the calls in flight is settled (``Wait``), waits here, unrouted (accepted in
the ledger), until a settlement wakes the router (``BudgetFreed``): then it is
placed again, or ends ``Cancelled`` if its caller gave it up meanwhile, or
``Expired`` past its deadline; a timer (``ExpireDue``) ends it at its deadline if
no settlement came by then. A stop's sweep ends what still waits. One that could
not fit even with nothing reserved ends ``Failed(BUDGET_EXCEEDED)``, or, once the
total is spent under ``close_on_refusals`` (a batch), ``Cancelled``: not sent, for
the next run (``Budgets.leaves_unsent``).

A restarted router re-routes what the ledger says is still waiting to be
routed (a ``Route`` the address book redelivers is then a no-op in
``route_all``), the tasks that waited for the budget among them.
"""

from __future__ import annotations

import logging
from typing import Any

from callboard.actors.base import QUEUE, Actor, Runtime, deliver, ended, task_extra
from callboard.core.alarm import Alarm
from callboard.core.budget import Exhausted, Wait
from callboard.core.fallback import within
from callboard.core.pricing import writes_cache
from callboard.core.routing import AboveTokenLimit, CannotCarry, NoRoute, Plan, RoutingPolicy
from callboard.core.tokens import unsized
from callboard.messages import (
    BudgetFreed,
    Cancelled,
    Enqueue,
    Expired,
    ExpireDue,
    Failed,
    FailureReason,
    Health,
    Job,
    Result,
    Route,
    Task,
)
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.ledger import Ledger
from callboard.runtime.shared_budget import SharedBudget

log = guarded_logger(__name__)


class RouterActor(Actor):
    def __init__(
        self,
        rt: Runtime,
        name: str,
        incarnation: int,
        *,
        policy: RoutingPolicy,
        budget: SharedBudget | None = None,
    ) -> None:
        super().__init__(rt, name, incarnation)
        self._policy = policy
        self._budget = budget
        self.health: dict[str, Health] = {}
        self.waiting: list[Task] = []
        """Tasks waiting for the budget's reservations to be settled."""
        self._expiry = Alarm()
        """The timers set for the deadlines of waiting tasks."""

    def setup(self) -> None:
        if self.incarnation > 1:
            if self._budget is not None:  # the tasks that waited wait anew, counted anew
                self._budget.take_waiters()
            self._route(tuple(self.rt.ledger.accepted_tasks()))

    def handle(self, message: Any) -> None:
        if type(message) is Route:
            self._route(message.tasks)
        elif type(message) is BudgetFreed:
            if self._budget is not None:
                self._budget.take_waiters()
            waiting, self.waiting = self.waiting, []
            waiting.sort(key=_most_urgent_first)  # the money that came back goes to them
            self._route(tuple(waiting))  # one that waits again sets its timer (_plan)
        elif type(message) is ExpireDue:
            if self._expiry.rang(message.at):
                self._expire(self.rt.clock())
        elif type(message) is Health:
            self.health[message.model] = message
            self._policy.observe(message)

    def _route(self, tasks: tuple[Task, ...]) -> None:
        ledger = self.rt.ledger
        now = self.rt.clock()
        jobs: list[Job] = []
        failed: list[tuple[Task, Result]] = []
        for task in tasks:
            if not ledger.is_accepted(task.task_id):
                continue  # routed already (a redelivered Route after a restart) or ended
            outcome = self._given_up(task, now) or self._plan(task, now)
            if isinstance(outcome, Job):
                jobs.append(outcome)
            elif outcome is not None:
                failed.append((task, outcome))
        if failed:
            deliver(self.rt, failed)
        jobs = ledger.route_all(jobs)
        if jobs:
            self.tell(QUEUE, Enqueue(jobs=tuple(jobs)))

    def _plan(self, task: Task, now: float) -> Job | Result | None:
        """The job for ``task``, or the result that ends it here; None: it waits for the
        budget (``waiting``)."""
        try:
            plan = planned(self._policy, task)
        except (AboveTokenLimit, CannotCarry) as exc:  # the request asks what none can give
            return ended(Failed, task, now, reason=FailureReason.REQUEST_ERROR, detail=str(exc))
        except NoRoute as exc:
            return ended(Failed, task, now, reason=FailureReason.NO_ROUTE, detail=str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug in one plan must not crash-loop the router
            return self._plan_crashed(task, now, exc)
        candidates, fallbacks = plan.candidates, plan.fallbacks
        if self._budget is not None:
            models = (*candidates, *fallbacks)
            placed = self._budget.place(
                task.task_id,
                task.request.budget_tag,
                models,
                prompt_tokens=self._prompt_bound(task, models),
                max_tokens=task.request.output_tokens,
                cache_writes=writes_cache(task.request),
            )
            if isinstance(placed, Wait):
                self.waiting.append(task)
                self._arm_expiry(now)
                return None
            if isinstance(placed, Exhausted):
                return self._refused_for_budget(task, placed, now)
            narrowed = within(candidates, fallbacks, placed.models)
            assert narrowed is not None, placed  # a placement keeps at least one model
            candidates, fallbacks = narrowed
        return Job(task=task, candidates=candidates, fallbacks=fallbacks)

    def _prompt_bound(self, task: Task, models: tuple[str, ...]) -> int:
        """The most the prompt may cost in tokens, for the budget: its estimate, or for
        content of a size callboard cannot know (a file by ``file_id``, estimated as one
        page), what the largest context window of ``models`` leaves beside the answer:
        forty 100,000-token files by id spent $15 of a $0.50 budget (found by a hunt)."""
        request = task.request
        if request.plain or not unsized(request.messages):
            return task.prompt_tokens
        window = max(self._policy.context_window(m) for m in models)
        return max(task.prompt_tokens, window - request.max_tokens)

    def _expire(self, now: float) -> None:
        """End the waiting tasks whose deadline passed (or whose caller left)."""
        kept: list[Task] = []
        gone: list[tuple[Task, Result]] = []
        for task in self.waiting:
            result = self._given_up(task, now)
            if result is None:
                kept.append(task)
            else:
                gone.append((task, result))
        self.waiting = kept
        if gone:
            deliver(self.rt, gone)
        self._arm_expiry(now)

    def _arm_expiry(self, now: float) -> None:
        """A timer for the soonest deadline of a waiting task, unless one rings sooner."""
        at = min((t.deadline_at for t in self.waiting if t.deadline_at is not None), default=None)
        if at is not None and self._expiry.wants(at):
            self.rt.after(max(0.0, at - now), self.name, ExpireDue(at=at))

    def _given_up(self, task: Task, now: float) -> Result | None:
        """The end of a task its caller cancelled, or whose deadline passed, before it
        was routed (one that waited for the budget, mostly)."""
        if self.rt.ledger.cancel_wanted(task):
            return ended(Cancelled, task, now, detail="cancelled before it was routed")
        if task.deadline_at is not None and now >= task.deadline_at:
            return ended(Expired, task, now, detail="the deadline passed")
        return None

    def _plan_crashed(self, task: Task, now: float, exc: Exception) -> Result:
        """A plan that raised (a bug, e.g. in a plugged-in classifier) ends its task: a
        crash would come back for ever, as the restarted router re-routes the same task
        in ``setup``. The detail names only the exception's type (its text may quote
        anything the plan saw); the log keeps the traceback."""
        log.error(
            "task %d: routing raised %s; the task fails",
            task.task_id,
            type(exc).__name__,
            exc_info=exc,
            extra=task_extra(task.task_id, task.trace_id),
        )
        detail = f"routing failed: {type(exc).__name__} (a bug; see the log)"
        return ended(Failed, task, now, reason=FailureReason.INTERNAL, detail=detail)

    def _refused_for_budget(self, task: Task, refusal: Exhausted, now: float) -> Result:
        """The end of a task the budget could not take even with nothing reserved. The
        refusal may be what shows the total spent (nothing reserved, too little left):
        settlements report the rest (``deliver``). Once it is, under
        ``close_on_refusals`` (a batch), a task a whole budget could pay is left unsent
        (``Cancelled``) for the next run rather than failed for good."""
        assert self._budget is not None
        spent = self.rt.on_budget_spent
        if spent is not None and self._budget.should_stop():
            spent()
        if self._budget.leaves_unsent(refusal):
            detail = f"not sent: the total budget is spent ({refusal})"
            return ended(Cancelled, task, now, detail=detail)
        reason = FailureReason.BUDGET_EXCEEDED
        return ended(Failed, task, now, reason=reason, detail=str(refusal))

    def state(self) -> dict[str, Any]:
        return super().state() | {
            "waiting_for_budget": len(self.waiting),
            "health": {m: h.breaker.value for m, h in self.health.items()},
        }


def planned(policy: RoutingPolicy, task: Task) -> Plan:
    """The policy's plan for ``task`` (what ``RoutingPolicy.plan`` raises, raised), its
    reason logged at DEBUG."""
    plan = policy.plan(task.request, task.prompt_tokens)
    if log.isEnabledFor(logging.DEBUG):
        extra = task_extra(task.task_id, task.trace_id)
        log.debug("task %d: %s", task.task_id, plan.reason, extra=extra)
    return plan


def route_here(
    policy: RoutingPolicy, ledger: Ledger, tasks: tuple[Task, ...]
) -> tuple[tuple[Job, ...], tuple[Task, ...]]:
    """Route ``tasks`` on the calling thread, as the router would, where nothing but
    the policy decides: (the jobs routed in the ledger, for the queue; the tasks left
    for the router). What a budget places, and what ends here (no route, a plan that
    raised) is the router's, which plans it again and says why. A deadline that passed
    or a cancel is the queue's to see (it checks both as jobs arrive), as for the
    router's jobs.

    For a policy whose plans run anywhere (``RoutingPolicy.plans_anywhere``) and a
    system without a budget; the front door calls it on the submitting thread, so a
    task goes to the queue without a crossing through the router (see the module
    docstring of ``actors.ingest``)."""
    jobs: list[Job] = []
    rest: list[Task] = []
    for task in tasks:
        try:
            plan = planned(policy, task)
        except Exception:  # noqa: BLE001 - the router plans it again, and ends it saying why
            rest.append(task)
            continue
        jobs.append(Job(task=task, candidates=plan.candidates, fallbacks=plan.fallbacks))
    routed = tuple(ledger.route_all(jobs)) if jobs else ()
    return routed, tuple(rest)


def _most_urgent_first(task: Task) -> tuple[int, float]:
    return task.request.priority, task.submitted_at
