"""Stopping a ``System``: ``stop``, the teardown, the sweep, and giving up on escalation.

The state these read and set is the system's own (created in
``System._build``): ``_stopped`` (an ``Event``), ``_torn_down``, ``_stop_lock``
and ``_failure``. The supervisor's callbacks ``escalated`` and ``poisoned``
run on its thread.

What must hold:

* ``_stopped`` is set when the teardown begins: from then on nothing is
  admitted or started. ``_torn_down`` is set only once the teardown ran to
  its end, and then ``stop`` has nothing left to do.
* A stop cut short by an exception (a ``KeyboardInterrupt`` while it waits,
  say) is finished by the next call, which waits no longer than its own
  ``timeout`` and, once the teardown began, not at all: each teardown step
  may run again (a teardown cut short is redone).
* Nothing is left behind: every future not finished ends ``Cancelled`` (or
  ``Failed`` when the supervisor gave up), every actor and thread the system
  started is stopped, and the switch interval is released even if a step
  raised.
* ``stop`` and the escalation's ``fail_all`` run under ``_stop_lock``, one at
  a time; ``fail_all`` does nothing once a stop began its teardown.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from callboard._system_read import ASK_TIMEOUT_S
from callboard.actors.base import AGGREGATOR, QUEUE, deliver, ended
from callboard.actors.jobs import StopAllJobs
from callboard.jobs import JOBS
from callboard.messages import (
    Call,
    Cancel,
    Cancelled,
    Enqueue,
    Failed,
    FailureReason,
    Finished,
    Result,
    Route,
    Submit,
    Task,
)
from callboard.supervisor.supervisor import Escalation

if TYPE_CHECKING:
    from callboard._system import System

log = logging.getLogger("callboard._system")  # the System's logger, as before the split


def stop(system: System, *, cancel: bool, timeout: float) -> None:
    """``System.stop``: close the door, wait (or cancel), then tear down; see there."""
    with system._stop_lock:
        if system._torn_down:
            return
        if not system._stopped.is_set():
            _stop_jobs(system)  # first: a job's next tick would be refused at the door
            system.admission.close("stopping")
            if system._failure is None:
                if cancel:
                    system.book.try_tell(QUEUE, Cancel(everything=True, detail="system stopped"))
                system.ledger.wait_idle(timeout)
        teardown(system)


def _stop_jobs(system: System) -> None:
    ref = system.book.resolve(JOBS)
    if ref is None:
        return
    try:
        ref.ask(StopAllJobs(), timeout=ASK_TIMEOUT_S)
    except Exception:  # a stop goes on whatever the jobs actor does
        log.warning("the jobs actor did not stop its jobs", exc_info=True)


def teardown(system: System) -> None:
    """Stop everything; each step may run again (a teardown cut short is redone)."""
    try:
        _stop_everything(system)
    finally:
        system._switch_interval.release()
    system._torn_down = True


def _stop_everything(system: System) -> None:
    system._stopped.set()
    system.admission.stop("stopped")
    sup = getattr(system, "_supervisor", None)
    if sup is not None and sup.is_alive():
        try:
            sup.ask(lambda s: s.stop_children(), timeout=ASK_TIMEOUT_S * 3)
        finally:
            sup.stop(block=True, timeout=ASK_TIMEOUT_S)
    system.book.close()  # first: a submit racing the stop fails instead of being held
    sweep(system, "system stopped before the task finished")
    system.ledger.close()
    if not system.io.closed:
        try:
            system.io.run(system._clients.aclose(), timeout=ASK_TIMEOUT_S)
        except Exception:  # a transport that will not close must not keep threads alive
            log.exception("closing HTTP clients failed")
    system.io.stop()
    if system._own_provider and system.provider is not None:
        system.provider.stop()


def sweep(system: System, why: str) -> None:
    """End every task still live or held, so no future is left unresolved: ``Cancelled``,
    or ``Failed`` (internal) once the supervisor gave up, even if a stop got here
    before the escalation's own pass (``fail_all``) did."""
    now = system.rt.clock()
    failure = system._failure
    kind: type[Result] = Cancelled if failure is None else Failed
    fields: dict[str, Any] = (
        {"detail": why}
        if failure is None
        else {"reason": FailureReason.INTERNAL, "detail": str(failure)}
    )
    for name in system.book.names():
        for message in system.book.take_held(name):
            for task in tasks_in(message):
                if not system.ledger.is_live(task.task_id):
                    system.ledger.reject(task, ended(kind, task, now, **fields))
    _end_live(system, now, kind, **fields)
    system.ledger.forget_announced()


def abandon(system: System, *, owns_ledger: bool) -> None:
    """``__init__`` failed: stop what it had started (unless the teardown did)."""
    stopped = getattr(system, "_stopped", None)
    if stopped is not None and stopped.is_set():
        return
    io = getattr(system, "io", None)
    if io is not None:
        io.stop()
    if getattr(system, "_own_provider", False) and system.provider is not None:
        system.provider.stop()
    if owns_ledger:
        system.ledger.close()


# -- supervision callbacks (run on the supervisor's thread) -------------------


def escalated(system: System, escalation: Escalation) -> None:
    """The supervisor gave up: refuse everything, tell the hooks, fail all (on a thread)."""
    system._failure = escalation
    system.admission.stop(str(escalation))
    for hook in system._failure_hooks:
        try:
            hook(escalation)
        except Exception:
            log.exception("a failure hook raised")
    threading.Thread(
        target=fail_all, args=(system, escalation), name="callboard-escalation"
    ).start()


def fail_all(system: System, escalation: Escalation) -> None:
    """End every live task ``Failed`` (internal), then tear down; unless a stop began."""
    with system._stop_lock:
        if not system._stopped.is_set():
            now = system.rt.clock()
            _end_live(system, now, Failed, reason=FailureReason.INTERNAL, detail=str(escalation))
            teardown(system)


def poisoned(system: System, message: Any, why: str) -> None:
    """A message its actor crashed on twice: its tasks end ``Failed`` (internal)."""
    now = system.rt.clock()
    for task in tasks_in(message):
        result = ended(Failed, task, now, reason=FailureReason.INTERNAL, detail=why)
        # through deliver, which also settles (releases) the task's budget reservation
        if not deliver(system.rt, ((task, result),)) and not system.ledger.is_live(task.task_id):
            # never accepted: the stats count it as they count the front door's refusals
            system.ledger.reject(task, result)
            system.book.try_tell(AGGREGATOR, Finished(results=(result,)))


def tasks_in(message: Any) -> list[Task]:
    """The tasks a pipeline message carries (looking inside a wrapped one)."""
    if isinstance(message, Submit | Route):
        return list(message.tasks)
    if isinstance(message, Enqueue | Call):
        return [j.task for j in message.jobs]
    inner = getattr(message, "message", None)
    return tasks_in(inner) if inner is not None else []


def _end_live(system: System, now: float, kind: type[Result], **fields: Any) -> None:
    """Deliver a ``kind`` result, ended ``now``, to every task the ledger holds live."""
    deliver(system.rt, ((t, ended(kind, t, now, **fields)) for t in system.ledger.live_tasks()))
