"""The front door (actors/ingest.py): admission, and routing where only the policy
decides, on the thread that submits.

A task is in the ledger when ``submit`` returns (no actor's mailbox between the
caller and the ledger), routed already unless a budget or the host's classifier
needs the router; one the queue or the router cannot be told of ends at once and
the submit raises, so nothing is left live with nobody to route it.

Every test runs a real ``System`` against the simulated provider on loopback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from typing import Any

import pytest
from callboard.messages import Crash, Enqueue, FailureReason, RejectReason, TaskFuture
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.supervisor.address_book import AddressBookClosedError
from callboard.supervisor.supervisor import SupervisorConfig
from support import ROUTER_ROUTES, WAIT_S, hold_down, one_model, served, wait_until

from callboard import (
    BudgetSettings,
    Cancelled,
    Failed,
    Rejected,
    System,
    SystemConfig,
    SystemStoppedError,
)


def test_a_task_is_in_the_ledger_when_submit_returns(provider: SimulatedProvider) -> None:
    """Admitted on the caller's thread: a ``cancel`` right after finds it wherever it went,
    and no thread of the system's runs the admission."""
    provider.configure("m", ModelBehaviour(latency_s=1.0))
    with System(SystemConfig(models=(one_model(provider, max_concurrency=1),))) as system:
        futures = system.submit_many([f"q{i}" for i in range(20)])
        assert all(system.ledger.is_live(f.task_id) for f in futures)  # type: ignore[attr-defined]
        system.cancel(*(f.task_id for f in futures[1:]))  # type: ignore[attr-defined]
        results = [f.result(WAIT_S) for f in futures[1:]]
        assert all(isinstance(r, Cancelled) for r in results), results
        system.cancel(futures[0].task_id)  # type: ignore[attr-defined]
        assert "ingest" not in system.supervision()


@pytest.mark.parametrize(
    ("told", "budget"), [("queue", BudgetSettings()), ("router", ROUTER_ROUTES)]
)
def test_an_actor_that_cannot_be_told_leaves_nothing_live(
    provider: SimulatedProvider,
    monkeypatch: pytest.MonkeyPatch,
    told: str,
    budget: BudgetSettings,
) -> None:
    """A stop closing the address book between the admission and the telling (of the
    queue, for what the door routes; of the router, for what a budget places): the
    submit raises the typed error, and what was accepted ended ``Rejected`` (stopping)
    first."""
    system = System(SystemConfig(models=(one_model(provider),), budget=budget))
    real_tell = system.book.tell
    seen: list[Any] = []

    def closed(name: str, message: Any) -> None:
        if name == told:
            seen.extend(getattr(message, "tasks", None) or [j.task for j in message.jobs])
            raise AddressBookClosedError(f"cannot send to {name!r}: the system is stopped")
        real_tell(name, message)

    try:
        monkeypatch.setattr(system.book, "tell", closed)
        with pytest.raises(SystemStoppedError, match="not running"):
            system.submit_many(["a", "b"])
        monkeypatch.undo()
        assert len(seen) == 2
        for task in seen:
            result = task.future.result(0)
            assert isinstance(result, Rejected)
            assert result.reason is RejectReason.STOPPING
        assert system.ledger.wait_idle(0), "nothing left live"
        assert system.ledger.counts().balanced
        assert system.submit("after").result(WAIT_S).ok  # the door itself is unharmed
    finally:
        system.stop(timeout=WAIT_S)


# -- routing on the submitting thread ------------------------------------------------------

DOWN_FOR_GOOD = SupervisorConfig(backoff_min_s=600.0, backoff_max_s=600.0, backoff_jitter=0.0)
"""A crashed actor stays down for the whole test."""


def test_without_a_budget_a_task_reaches_the_queue_with_no_router(
    provider: SimulatedProvider,
) -> None:
    """The door routes it on the submitting thread and tells the queue: a router that is
    down is not on its way."""
    config = SystemConfig(models=(one_model(provider),), supervisor=DOWN_FOR_GOOD)
    with System(config) as system:
        hold_down(system, "router")
        future = system.submit("hello")
        assert not system.ledger.is_accepted(future.task_id)  # type: ignore[attr-defined]
        assert future.result(WAIT_S).ok
        assert system.book.resolve("router") is None, "the router stayed down throughout"
        system.stop(cancel=True, timeout=WAIT_S)


def test_with_a_budget_the_router_routes(provider: SimulatedProvider) -> None:
    """What a budget places is the router's (its waiters, its timers)."""
    config = SystemConfig(
        models=(one_model(provider),), supervisor=DOWN_FOR_GOOD, budget=ROUTER_ROUTES
    )
    with System(config) as system:
        hold_down(system, "router")
        future = system.submit("hello")
        assert system.ledger.is_accepted(future.task_id), "waits for the router"  # type: ignore[attr-defined]
        assert system.ledger.counts().routing == 1
        system.stop(cancel=True, timeout=0)  # nobody to wait for: the stop's sweep ends it
    assert isinstance(future.result(WAIT_S), Cancelled)


def test_the_door_and_a_restarted_router_planning_one_task_send_it_once(
    provider: SimulatedProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted router re-routes what the ledger holds unrouted, the task the door is
    planning among them: the ledger's ``route_all`` lets one job through."""
    restarts_at_once = SupervisorConfig(backoff_min_s=0.0, backoff_max_s=0.0, backoff_jitter=0.0)
    config = SystemConfig(models=(one_model(provider),), supervisor=restarts_at_once)
    with System(config) as system:
        submitter, real_plan, real_tell = (
            threading.get_ident(),
            system.policy.plan,
            system.book.tell,
        )
        enqueued: list[list[int]] = []

        def plan(request: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == submitter and not enqueued:
                (task,) = system.ledger.accepted_tasks()
                system.tell("router", Crash(reason="restarts while the door plans"))
                assert wait_until(lambda: not system.ledger.is_accepted(task.task_id))
            return real_plan(request, *args, **kwargs)

        def tell(name: str, message: Any) -> None:
            if type(message) is Enqueue and not any(j.attempt for j in message.jobs):
                enqueued.append([j.task.task_id for j in message.jobs])
            real_tell(name, message)

        monkeypatch.setattr(system.policy, "plan", plan)
        monkeypatch.setattr(system.book, "tell", tell)
        future = system.submit("hi")
        assert future.result(WAIT_S).ok
        monkeypatch.undo()
        assert enqueued == [[future.task_id]], "one job went to the queue"
        assert served(provider, "m")["requests"] == 1
        assert system.ledger.wait_idle(WAIT_S)
        assert system.ledger.counts().balanced


def test_what_the_door_cannot_route_the_router_ends_saying_why(
    provider: SimulatedProvider,
) -> None:
    blind = one_model(provider, capabilities=frozenset({"json"}))
    with System(SystemConfig(models=(blind,))) as system:
        failed = system.submit("look", metadata={"capabilities": ["vision"]}).result(WAIT_S)
        fine = system.submit("hello").result(WAIT_S)
    assert isinstance(failed, Failed)
    assert failed.reason is FailureReason.NO_ROUTE
    assert "vision" in failed.detail
    assert fine.ok


def test_an_interrupt_landing_after_the_ledger_accepted_leaves_nothing_live(
    provider: SimulatedProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C landing between the ledger's accepting and the router's telling: the task
    stayed live with nobody to route it, and ``drain`` and ``stop`` waited out their
    timeouts for it (found by a review)."""
    system = System(SystemConfig(models=(one_model(provider),)))
    real = system.ledger.accept_all

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise KeyboardInterrupt  # as the signal lands on the way back

    try:
        monkeypatch.setattr(system.ledger, "accept_all", interrupted)
        with pytest.raises(KeyboardInterrupt):
            system.submit("hi")
        monkeypatch.undo()
        assert system.ledger.wait_idle(0), "nothing left live"
        assert system.ledger.counts().balanced
    finally:
        system.stop(timeout=WAIT_S)


class _InterruptedCount(Counter[Any]):
    """The ledger's queue depth, where the first increment is where a Ctrl-C lands:
    inside ``route_all``, the record changed and its counters not yet."""

    def __setitem__(self, key: Any, value: int) -> None:
        super().__setitem__(key, value)
        if not getattr(self, "fired", False):
            self.fired = True
            raise KeyboardInterrupt


def test_an_interrupt_inside_the_routing_leaves_the_ledgers_counters_right(
    provider: SimulatedProvider,
) -> None:
    """The door routes in the submitting thread, the main one, where signals land: one
    landing between a record's change and its counters' left a task ``routing`` for
    good and the queue's depth at -1 (found by a review)."""
    with System(SystemConfig(models=(one_model(provider),))) as system:
        system.ledger._depth = _InterruptedCount()
        with pytest.raises(KeyboardInterrupt):
            system.submit("hi")
        counts = system.ledger.counts()
        assert (counts.routing, counts.queued, counts.in_flight) == (0, 0, 0)
        assert counts.balanced
        assert system.ledger.depth() == {}
        assert system.submit("after").result(WAIT_S).ok
        assert system.ledger.wait_idle(WAIT_S)
        assert system.ledger.counts().balanced


def test_a_task_submitted_twice_is_answered_twice_once_refused(
    provider: SimulatedProvider,
) -> None:
    """The same task (one id) handed to the door twice: the second is refused, its own
    future answered; the first runs. Two such tasks both accepted left one future for
    ever unanswered (found by a review)."""
    with System(SystemConfig(models=(one_model(provider),))) as system:
        first = system._task("hi", {})
        again = dataclasses.replace(first, future=TaskFuture(first.task_id, first.trace_id))
        system._send((first,))
        system._send((again,))
        assert again.future is not None
        refused = again.future.result(WAIT_S)
        assert isinstance(refused, Rejected)
        assert refused.reason is RejectReason.DUPLICATE
        assert first.future is not None
        assert first.future.result(WAIT_S).ok


def test_a_submit_that_comes_after_the_stop_closed_the_ledger_is_refused(
    provider: SimulatedProvider,
) -> None:
    """A submit that passed its checks just as the system stopped, and reached the ledger
    once it was closed: refused (``Rejected``, stopping), its future answered (a durable
    ledger's writer, gone, never delivered its outcome; found by a review)."""
    system = System(SystemConfig(models=(one_model(provider),)))
    task = system._task("late", {})
    system.stop(timeout=WAIT_S)
    with contextlib.suppress(SystemStoppedError):  # (the router cannot be told: closed)
        system._send((task,))
    assert task.future is not None
    result = task.future.result(0)
    assert isinstance(result, Rejected)
    assert result.reason is RejectReason.STOPPING
