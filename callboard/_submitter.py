"""What the patterns need of a running system: the ``Submitter`` interface.

Every pattern (gather, race, chain, callbacks) is written once, against
``Submitter``: submit one request, submit a burst, cancel by task id. A
``System`` is one. An ``AsyncSystem`` is a ``Fronts``: it holds a ``System``
and submits through it, so a pattern given either face finds the submitter
with ``submitter_of``, and the asyncio face awaits the same futures the sync
face blocks on.

What must hold: ``cancel_unsent`` only asks, so a task already sent runs to
its end and its future gets its real result; a system stopped meanwhile is
not an error (the stop resolves every future).
"""

from __future__ import annotations

import abc
import logging
import uuid
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Protocol

from callboard.messages import Result, SystemStoppedError, TaskFuture
from callboard.supervisor.address_book import AddressError

__all__ = ["Face", "Fronts", "Submitter", "cancel_unsent", "new_trace_id", "submitter_of"]

log = logging.getLogger("callboard.patterns")  # the public module's name


class Submitter(Protocol):
    """Submit requests and cancel them by id; every call thread-safe (``System`` is one)."""

    def submit(self, prompt: Any, /, **fields: Any) -> Future[Result]:
        """One request; its future resolves to its ``Result``. Misuse raises at once."""
        ...

    def submit_many(self, prompts: Iterable[Any], /, **fields: Any) -> list[Future[Result]]:
        """A burst, in one message; the futures in input order."""
        ...

    def cancel(self, *task_ids: int) -> None:
        """Cancel tasks that were not sent yet (they end ``Cancelled``)."""
        ...


class Fronts(abc.ABC):
    """A face that submits through a ``Submitter`` it holds (``AsyncSystem`` holds a ``System``)."""

    @property
    @abc.abstractmethod
    def system(self) -> Submitter:
        """The submitter behind this face; ``SystemStoppedError`` when there is none."""


Face = Submitter | Fronts
"""What a pattern is given: a submitter, or a face in front of one."""


def submitter_of(face: Face) -> Submitter:
    """The ``Submitter`` ``face`` submits through (itself, unless it fronts one)."""
    return face.system if isinstance(face, Fronts) else face


def new_trace_id(kind: str) -> str:
    """A fresh trace id for a chain or a race (``chain.<16 hex>``)."""
    return f"{kind}.{uuid.uuid4().hex[:16]}"


def cancel_unsent(face: Face, futures: Iterable[Future[Result]]) -> int:
    """Ask the queue to cancel the tasks of ``futures`` that are still live; returns how many.

    A task waiting in the queue, or still on its way there, ends ``Cancelled``;
    one already sent runs to its end and its future gets its real result.
    """
    ids = [f.task_id for f in futures if not f.done() and isinstance(f, TaskFuture)]
    if ids:
        try:
            submitter_of(face).cancel(*ids)
        except (AddressError, SystemStoppedError) as exc:  # stopping: the stop resolves them
            log.debug("cancel of %s not sent: %s", ids, exc)
    return len(ids)
