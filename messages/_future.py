"""``TaskFuture``: the caller's handle, a ``concurrent.futures.Future`` that costs little.

Every queued task holds one. The standard ``Future`` builds a
``threading.Condition`` in ``__init__`` (about 1.2 KB and twelve objects the
garbage collector walks): on the backlog bench, 40% of a queued task's memory
and most of its collector work. ``TaskFuture`` keeps the exact semantics of
``concurrent.futures.Future`` and stays a subclass (``asyncio.wrap_future``,
``wait`` and ``as_completed`` accept it) while holding only a plain lock:

- the state lives in slots; the ``Condition`` is built over that same lock
  the first time somebody blocks in ``result``/``exception``, so a future
  that is only ever read after it is done never builds one; ``wait`` and
  ``as_completed`` reach for ``_condition`` and ``_waiters`` directly, but
  only to lock and to enrol a waiter, so ``_condition`` is the lock itself;
- the done-callback list is built by the first ``add_done_callback``;
- ``cancel`` tells ``on_cancel(task_id)`` (the system's one shared hook)
  instead of a per-task done-callback, so the queue drops a task its caller
  gave up on;
- ``cancel`` goes straight to ``CANCELLED_AND_NOTIFIED``, which a standard
  future reaches only when its executor calls ``set_running_or_notify_cancel``:
  no executor ever will here, and ``wait``/``as_completed`` count a cancelled
  future done only in that state.

What must hold: every state change happens under ``_lock``; whoever holds a
``Condition`` holds ``_lock`` (it is the Condition's lock), so a waiter that
found the future pending cannot miss the ``notify_all`` of the state change;
callbacks run outside the lock, exactly once each.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures import _base as _cf
from typing import Any

from callboard.messages._results import Result

__all__ = ["TaskFuture"]

log = logging.getLogger("concurrent.futures")  # where the standard Future logs callback errors

_PENDING: str = _cf.PENDING
_RUNNING: str = _cf.RUNNING
_CANCELLED: str = _cf.CANCELLED
_NOTIFIED: str = _cf.CANCELLED_AND_NOTIFIED
_FINISHED: str = _cf.FINISHED
_DONE = frozenset((_CANCELLED, _NOTIFIED, _FINISHED))

_GONE = frozenset((_CANCELLED, _NOTIFIED))

Callback = Callable[["Future[Result]"], object]


class TaskFuture(Future[Result]):
    """A ``concurrent.futures.Future`` for one task's ``Result``; knows its ``task_id``."""

    __slots__ = (
        "_callbacks",
        "_cond",
        "_exc",
        "_lock",
        "_on_cancel",
        "_res",
        "_st",
        "_waiter_list",
        "task_id",
        "trace_id",
    )

    def __init__(
        self, task_id: int, trace_id: str, *, on_cancel: Callable[[int], object] | None = None
    ) -> None:
        # Future.__init__ is not called: it would build the Condition this class defers.
        self.task_id = task_id
        self.trace_id = trace_id
        self._on_cancel = on_cancel
        self._lock = threading.Lock()
        self._cond: threading.Condition | None = None
        self._st = _PENDING
        self._res: Result | None = None
        self._exc: BaseException | None = None
        self._waiter_list: list[Any] | None = None
        self._callbacks: list[Callback] | None = None

    # -- what concurrent.futures.wait / as_completed reach for -------------

    @property
    def _condition(self) -> threading.Lock:  # type: ignore[override]
        # only ever taken as a lock (see the module docstring); every method that
        # waits on or notifies a Condition is overridden here
        return self._lock

    @property
    def _state(self) -> str:  # type: ignore[override]
        return self._st

    @property
    def _waiters(self) -> list[Any]:  # type: ignore[override]
        # wait() and as_completed() hold _condition (our lock) when they get here
        waiters = self._waiter_list
        if waiters is None:
            waiters = self._waiter_list = []
        return waiters

    # -- reading -------------------------------------------------------------

    def cancelled(self) -> bool:
        return self._st in _GONE

    def running(self) -> bool:
        return self._st == _RUNNING

    def done(self) -> bool:
        return self._st in _DONE

    def result(self, timeout: float | None = None) -> Result:
        self._settled(timeout)
        if self._exc is None:
            return self._res  # type: ignore[return-value]
        try:
            raise self._exc
        finally:  # break the cycle exception -> traceback -> this frame, as Future does
            self = None  # type: ignore[assignment]  # noqa: PLW0642

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._settled(timeout)
        return self._exc

    def _settled(self, timeout: float | None) -> None:
        """Return once finished; raise ``CancelledError`` or, after ``timeout``, ``TimeoutError``.

        A finished future is read without the lock (``_finish`` writes the
        state last): ``concurrent.futures.wait(FIRST_EXCEPTION)`` calls
        ``exception()`` while it holds ``_condition``, that is our lock.
        """
        if self._st == _FINISHED:
            return
        with self._lock:
            if self._st not in _DONE:
                cond = self._cond
                if cond is None:
                    cond = self._cond = threading.Condition(self._lock)
                cond.wait(timeout)
            st = self._st
        if st in _GONE:
            raise CancelledError
        if st != _FINISHED:
            raise TimeoutError

    # -- changing ------------------------------------------------------------

    def cancel(self) -> bool:
        # straight to CANCELLED_AND_NOTIFIED (see the module docstring): a task is never
        # marked running, so a cancel succeeds until the result
        with self._lock:
            if self._st in (_RUNNING, _FINISHED):
                return False
            if self._st in _GONE:
                return True
            self._st = _NOTIFIED
            for waiter in self._waiter_list or ():
                waiter.add_cancelled(self)
            if self._cond is not None:
                self._cond.notify_all()
        self._invoke_callbacks()
        if self._on_cancel is not None:
            self._on_cancel(self.task_id)
        return True

    def set_running_or_notify_cancel(self) -> bool:
        with self._lock:
            if self._st in _GONE:  # cancel() has notified already
                return False
            if self._st == _PENDING:
                self._st = _RUNNING
                return True
        raise RuntimeError("Future in unexpected state")

    def set_result(self, result: Result) -> None:
        self._finish(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        self._finish(None, exception)

    def _finish(self, result: Result | None, exception: BaseException | None) -> None:
        with self._lock:
            if self._st in _DONE:
                raise InvalidStateError(f"{self._st}: {self!r}")
            self._res, self._exc, self._st = result, exception, _FINISHED
            for waiter in self._waiter_list or ():
                if exception is None:
                    waiter.add_result(self)
                else:
                    waiter.add_exception(self)
            if self._cond is not None:
                self._cond.notify_all()
        self._invoke_callbacks()

    # -- callbacks -----------------------------------------------------------

    def add_done_callback(self, fn: Callback) -> None:
        with self._lock:
            if self._st not in _DONE:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        self._call(fn)

    def _invoke_callbacks(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            self._call(fn)

    def _call(self, fn: Callback) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("exception calling callback for %r", self)

    def __repr__(self) -> str:
        st, what = self._st, ""
        if st == _FINISHED and self._exc is not None:
            what = f" raised {type(self._exc).__name__}"
        elif st == _FINISHED:
            what = f" returned {type(self._res).__name__}"
        state = _cf._STATE_TO_DESCRIPTION_MAP[st]
        return f"<TaskFuture task={self.task_id} state={state}{what}>"
