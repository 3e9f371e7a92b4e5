"""The futures a pattern submitted: settling a burst of tasks as they end.

``_sync`` finds the ``System`` behind either face, ``new_trace_id`` names a
chain or a race, ``cancel_unsent`` asks the queue to cancel what was not
sent, ``_Decider`` picks the first result a pattern accepts and ``_collect``
gathers the rest once all have ended.

What must hold:

* ``cancel_unsent`` only asks: a task already sent runs to its end and its
  future gets its real result; a system stopped meanwhile is not an error
  (the stop resolves every future).
* A ``_Decider`` resolves ``decided`` exactly once: with the first result
  ``accept`` takes, else the last to end, else (all cancelled) it cancels
  ``decided``; a waiter that gave up meanwhile is not an error.
* Done-callbacks here only count and hand results on: they never block.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING

from callboard.messages import Result, SystemStoppedError, TaskFuture
from callboard.supervisor.address_book import AddressError

if TYPE_CHECKING:
    from callboard._async import AsyncSystem
    from callboard._system import System

log = logging.getLogger("callboard.patterns")  # the public module's name, as before the split


def _sync(system: System | AsyncSystem) -> System:
    from callboard._async import AsyncSystem

    return system.system if isinstance(system, AsyncSystem) else system


def new_trace_id(kind: str) -> str:
    """A fresh trace id for a chain or a race (``chain.<16 hex>``)."""
    return f"{kind}.{uuid.uuid4().hex[:16]}"


def cancel_unsent(system: System | AsyncSystem, futures: Iterable[Future[Result]]) -> int:
    """Ask the queue to cancel the tasks of ``futures`` that are still live; returns how many.

    A task waiting in the queue, or still on its way there, ends ``Cancelled``;
    one already sent runs to its end and its future gets its real result.
    """
    sync = _sync(system)
    wanted = {f for f in futures if not f.done()}
    if not wanted:
        return 0
    ids = [f.task_id for f in wanted if isinstance(f, TaskFuture)]
    if ids:
        try:
            sync.cancel(*ids)
        except (AddressError, SystemStoppedError) as exc:  # stopping: the stop resolves them
            log.debug("cancel of %s not sent: %s", ids, exc)
    return len(ids)


class _Decider:
    """Resolves ``decided`` with the first result ``accept`` takes, else the last to end."""

    def __init__(self, futures: Sequence[Future[Result]], accept: Callable[[Result], bool]) -> None:
        self.decided: Future[Result] = Future()
        self.index: int | None = None
        self._accept = accept
        self._left = len(futures)
        self._last: tuple[int, Result] | None = None
        self._lock = threading.Lock()
        for i, f in enumerate(futures):
            f.add_done_callback(functools.partial(self._ended, i))

    def _ended(self, index: int, future: Future[Result]) -> None:
        result = None if future.cancelled() else future.result()
        with self._lock:
            self._left -= 1
            if result is not None:
                self._last = (index, result)
            if self.index is not None:
                return
            if result is not None and self._accept(result):
                chosen: tuple[int, Result] | None = (index, result)
            elif self._left == 0:
                chosen = self._last
            else:
                return
            self.index = -1 if chosen is None else chosen[0]
        self._settle(chosen)

    def _settle(self, chosen: tuple[int, Result] | None) -> None:
        try:
            if chosen is None:
                self.decided.cancel()
            else:
                self.decided.set_result(chosen[1])
        except InvalidStateError:  # the waiter gave up (an asyncio timeout cancelled it)
            pass


def _collect(futures: Sequence[Future[Result]]) -> Future[tuple[Result, ...]]:
    """A future of every result, in order, once all have ended (cancelled ones left out)."""
    out: Future[tuple[Result, ...]] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def ended(_: Future[Result]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out.set_result(tuple(f.result() for f in futures if not f.cancelled()))

    if not futures:
        out.set_result(())
    for f in futures:
        f.add_done_callback(ended)
    return out
