"""Submitting to a ``System``: a caller's prompt made a task, room waited for, sent to ingest.

``System.submit``, ``submit_many`` and ``resume`` are built from these three
steps: ``new_task`` (check, id, trace id, future), ``wait_for_room`` (the
caller's optional backpressure) and ``send``.

What must hold:

* Misuse raises before anything is sent: a system stopped, failed or not
  admitting, an invalid request or an unknown model raise from ``new_task``,
  and a burst that can never fit raises from ``wait_for_room``.
* A task is announced to the ledger before ingest is told of it (so a
  ``cancel`` that overtakes it still finds it), and forgotten again if the
  telling fails: nothing is half-sent.
* Every task's future shares the system's one ``on_cancel`` hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from callboard.actors.base import INGEST
from callboard.core.tokens import estimate_prompt_tokens
from callboard.messages import QueueFullError, Request, Submit, SystemStoppedError, Task, TaskFuture

if TYPE_CHECKING:
    from callboard._system import System


def new_task(
    system: System,
    prompt: Any,
    fields: dict[str, Any],
    task_id: int | None = None,
    trace_id: str | None = None,
) -> Task:
    """One caller task; ``fields`` are the request's (read, not changed)."""
    _check_running(system)
    request = Request.of(prompt, **fields)
    system.policy.check(request)
    now = system.rt.clock()
    task_id = task_id or system.ledger.next_id()
    trace_id = trace_id or f"{system._prefix}.{task_id}"
    future = TaskFuture(task_id, trace_id, on_cancel=system._on_cancel)
    return Task(
        task_id=task_id,
        trace_id=trace_id,
        request=request,
        submitted_at=now,
        deadline_at=None if request.deadline_s is None else now + request.deadline_s,
        prompt_tokens=estimate_prompt_tokens(request.messages),
        future=future,
    )


def wait_for_room(system: System, tasks: tuple[Task, ...], wait_s: float | None) -> None:
    """With ``wait_s``, block until the queue has room for ``tasks`` (else ``QueueFullError``)."""
    if wait_s is None:
        return
    capacity = system.admission.capacity
    if len(tasks) > capacity:
        raise QueueFullError(f"{len(tasks)} tasks can never fit a queue of {capacity}")
    if not system.ledger.wait_for_room(capacity, len(tasks), wait_s):
        raise QueueFullError(f"queue stayed full ({capacity} tasks) for {wait_s} s")


def send(system: System, tasks: tuple[Task, ...]) -> None:
    """Announce ``tasks`` and tell ingest of them in one ``Submit``."""
    system.ledger.announce(tasks)
    try:
        system.book.tell(INGEST, Submit(tasks=tasks))
    except BaseException as exc:
        system.ledger.forget(tasks)
        if not isinstance(exc, Exception):
            raise
        raise SystemStoppedError(f"callboard is not running: {exc}") from exc


def _check_running(system: System) -> None:
    system._check_alive()
    if not system.admission.is_open:
        raise SystemStoppedError(f"callboard is not admitting: {system.admission.reason}")
