"""``TaskFuture``: the caller's handle, a ``concurrent.futures.Future`` that costs little.

Every queued task holds one. The standard ``Future`` builds a
``threading.Condition`` in ``__init__`` (about 1.2 KB and twelve objects the
garbage collector walks): on the backlog bench, 40% of a queued task's memory
and most of its collector work. ``TaskFuture`` keeps the exact semantics of
``concurrent.futures.Future`` and stays a subclass (``asyncio.wrap_future``,
``wait`` and ``as_completed`` accept it) while holding no lock until one is
needed:

- the state lives in slots; a future gets a lock of its own only when somebody
  waits on it: blocks in ``result``/``exception`` (the ``Condition`` is then
  built over that lock), or reaches for ``_condition``, as ``wait`` and
  ``as_completed`` do, only to lock it and to enrol a waiter, so ``_condition``
  is the lock itself. Until then its state changes under one of a few shared
  locks (``_STRIPES``, picked by the future's id), held for a few attribute
  writes: a queued task holds no lock, and one that is answered without a
  waiter never makes one (88 bytes a task on the backlog bench);
- the done-callback list is built by the first ``add_done_callback``; a callback
  the caller adds runs on callboard's callback thread once the future is done,
  never on the actor thread that resolves it (``_callback_thread``); callboard's
  own, added with ``on_done``, run on that thread (they only hand the result on);
- ``cancel`` tells ``on_cancel(task_id)`` (the system's one shared hook)
  instead of a per-task done-callback, so the queue drops a task its caller
  gave up on;
- ``cancel`` goes straight to ``CANCELLED_AND_NOTIFIED``, which a standard
  future reaches only when its executor calls ``set_running_or_notify_cancel``:
  no executor ever will here, and ``wait``/``as_completed`` count a cancelled
  future done only in that state.

What must hold: every state change happens under the future's guard: its
stripe while ``_lock`` is None, ``_lock`` once it is set. ``_lock`` is set
once, under the stripe, and never cleared, and a change made under the stripe
first checks, holding it, that ``_lock`` is still None; so a change under the
stripe happens before the lock exists, and every later one under the lock.
Waiters enrol (``_waiters``, the ``Condition``) only under ``_lock``, so a
change made under the stripe has no waiter to tell. Whoever holds a
``Condition`` holds ``_lock`` (it is the Condition's lock), so a waiter that
found the future pending cannot miss the ``notify_all`` of the state change;
callbacks run outside any lock, exactly once each.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures import _base as _cf
from typing import Any

from callboard.messages._callback_thread import call, hand_over, handing_over
from callboard.messages._flow import TracePrefix
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

_STRIPES = tuple(threading.Lock() for _ in range(64))
"""Guard the futures that have no lock of their own (see the module docstring)."""
_STRIPE_OF = len(_STRIPES) - 1

Callback = Callable[["Future[Result]"], object]


class TaskFuture(Future[Result]):
    """A ``concurrent.futures.Future`` for one task's ``Result``; knows its ``task_id``."""

    __slots__ = (
        "_callbacks",
        "_cond",
        "_exc",
        "_inline",
        "_lock",
        "_on_cancel",
        "_res",
        "_st",
        "_trace",
        "_waiter_list",
        "task_id",
    )

    def __init__(
        self, task_id: int, trace_id: str, *, on_cancel: Callable[[int], object] | None = None
    ) -> None:
        # Future.__init__ is not called: it would build the Condition this class defers.
        self.task_id = task_id
        self._trace = trace_id
        self._on_cancel = on_cancel
        self._lock: threading.Lock | None = None
        self._cond: threading.Condition | None = None
        self._st = _PENDING
        self._res: Result | None = None
        self._exc: BaseException | None = None
        self._waiter_list: list[Any] | None = None
        self._callbacks: list[Callback] | None = None
        """The caller's: run on the callback thread."""
        self._inline: list[Callback] | None = None
        """callboard's own (``on_done``): run where the future ends."""

    @property
    def trace_id(self) -> str:
        """The task's trace id (derived from a ``TracePrefix``, as ``Task.trace_id``)."""
        trace = self._trace
        return trace.of(self.task_id) if type(trace) is TracePrefix else trace

    @trace_id.setter
    def trace_id(self, trace_id: str) -> None:
        self._trace = trace_id

    # -- the guard (see the module docstring) -------------------------------

    def _guard(self) -> threading.Lock:
        """The lock that guards the state now, not taken: ``_lock``, else the stripe.

        Take it with ``with`` (its ``__enter__`` is C: a signal handled on the way in
        cannot strand it taken, as one handled between a Python ``acquire()`` and its
        ``try`` can; a Ctrl-C in a host's main thread left a stripe, and every future
        on it, locked for good) and, holding the stripe, check that no lock of the
        future's own was made meanwhile (``_moved``); if one was, take that instead."""
        return self._lock or _STRIPES[id(self) >> 4 & _STRIPE_OF]

    def _moved(self, guard: threading.Lock) -> bool:
        """Whether ``guard``, the stripe, no longer guards: a lock of its own was made."""
        return guard is not self._lock and self._lock is not None

    def _own_lock(self) -> threading.Lock:
        """This future's own lock, made now if it has none (somebody is about to wait)."""
        lock = self._lock
        if lock is None:
            with _STRIPES[id(self) >> 4 & _STRIPE_OF]:
                lock = self._lock
                if lock is None:
                    lock = self._lock = threading.Lock()
        return lock

    # -- what concurrent.futures.wait / as_completed reach for -------------

    @property
    def _condition(self) -> threading.Lock:  # type: ignore[override]
        # only ever taken as a lock (see the module docstring); every method that
        # waits on or notifies a Condition is overridden here
        return self._own_lock()

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

        A future that is done is read without a lock (``_finish`` writes the state
        last, and a done future's state changes no more but from cancelled to
        notified): ``concurrent.futures.wait(FIRST_EXCEPTION)`` calls ``exception()``
        while it holds ``_condition``, that is our lock.
        """
        st = self._st
        if st not in _DONE:
            lock = self._own_lock()
            with lock:
                if self._st not in _DONE:
                    cond = self._cond
                    if cond is None:
                        cond = self._cond = threading.Condition(lock)
                    cond.wait(timeout)
                st = self._st
        if st in _GONE:
            raise CancelledError
        if st != _FINISHED:
            raise TimeoutError

    # -- changing ------------------------------------------------------------

    def cancel(self) -> bool:
        """Cancel the task: True unless its result is in. A task is never marked
        running (a call that fails goes back to waiting for the next), so this succeeds
        while a call is on the wire too: the future is cancelled at once and that call's
        answer dropped, but the call runs to its end and is billed (``stats()`` and the
        budgets count it). ``System.cancel`` leaves a sent call's answer to the future."""
        # straight to CANCELLED_AND_NOTIFIED (see the module docstring)
        while True:
            guard = self._guard()
            with guard:
                if self._moved(guard):
                    continue
                if self._st in (_RUNNING, _FINISHED):
                    return False
                if self._st in _GONE:
                    return True
                self._st = _NOTIFIED
                callbacks, self._callbacks = self._callbacks, None
                inline, self._inline = self._inline, None
                if callbacks:  # promised before a waiter wakes: an exit flushes it
                    handing_over()
                for waiter in self._waiter_list or ():
                    waiter.add_cancelled(self)
                if self._cond is not None:
                    self._cond.notify_all()
                break
        self._call_all(inline, callbacks)
        if self._on_cancel is not None:
            self._on_cancel(self.task_id)
        return True

    def set_running_or_notify_cancel(self) -> bool:
        while True:
            guard = self._guard()
            with guard:
                if self._moved(guard):
                    continue
                if self._st in _GONE:  # cancel() has notified already
                    return False
                if self._st == _PENDING:
                    self._st = _RUNNING
                    return True
                break
        raise RuntimeError("Future in unexpected state")

    def set_result(self, result: Result) -> None:
        self._finish(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        self._finish(None, exception)

    def _finish(self, result: Result | None, exception: BaseException | None) -> None:
        while True:
            guard = self._guard()
            with guard:
                if self._moved(guard):
                    continue
                if self._st in _DONE:
                    raise InvalidStateError(f"{self._st}: {self!r}")
                self._res, self._exc, self._st = result, exception, _FINISHED
                callbacks, self._callbacks = self._callbacks, None
                inline, self._inline = self._inline, None
                if callbacks:  # promised before a waiter wakes: an exit flushes it
                    handing_over()
                for waiter in self._waiter_list or ():
                    if exception is None:
                        waiter.add_result(self)
                    else:
                        waiter.add_exception(self)
                if self._cond is not None:
                    self._cond.notify_all()
                break
        self._call_all(inline, callbacks)

    # -- callbacks -----------------------------------------------------------

    def add_done_callback(self, fn: Callback) -> None:
        """As ``Future.add_done_callback``, but ``fn`` runs on callboard's callback
        thread, never on the actor thread that resolves the future (one added once the
        future is done runs at once, in the caller's thread)."""
        self._add(fn, inline=False)

    def on_done(self, fn: Callback) -> None:
        """callboard's own callback: it runs on the thread that resolves the future, so
        it must only hand the result on (to a loop, a queue, another future)."""
        self._add(fn, inline=True)

    def _add(self, fn: Callback, *, inline: bool) -> None:
        """``fn`` to its list (``_inline`` or ``_callbacks``), or called now if done."""
        while True:
            guard = self._guard()
            with guard:
                if self._moved(guard):
                    continue
                if self._st not in _DONE:
                    kept = self._inline if inline else self._callbacks
                    if kept is None:
                        kept = []
                        if inline:
                            self._inline = kept
                        else:
                            self._callbacks = kept
                    kept.append(fn)
                    return
                break
        call(fn, self)

    def _call_all(self, inline: list[Callback] | None, callbacks: list[Callback] | None) -> None:
        """Run the callbacks taken off the future as it ended (outside any lock):
        callboard's here, the caller's on the callback thread."""
        try:
            for fn in inline or ():
                call(fn, self)
        finally:
            if callbacks:
                hand_over(self, callbacks, expected=True)

    # -- copies: as a standard Future (whose lock cannot be pickled) ------------

    def __reduce_ex__(self, protocol: object) -> Any:
        # a future is a handle on this process's task: pickled (or deep-copied), it would
        # never be resolved; a standard Future refuses, through its lock, and so does this
        # one, lock or none
        raise TypeError(f"cannot pickle {type(self).__name__!r} object")

    def __copy__(self) -> TaskFuture:
        # a shallow copy shares the state objects, as copy.copy of a standard Future does
        cls = type(self)
        twin: TaskFuture = Future.__new__(cls)
        twin.__dict__.update(self.__dict__)
        for klass in cls.__mro__:
            for name in klass.__dict__.get("__slots__", ()):
                if hasattr(self, name):
                    object.__setattr__(twin, name, getattr(self, name))
        return twin

    def __repr__(self) -> str:
        st, what = self._st, ""
        if st == _FINISHED and self._exc is not None:
            what = f" raised {type(self._exc).__name__}"
        elif st == _FINISHED:
            what = f" returned {type(self._res).__name__}"
        state = _cf._STATE_TO_DESCRIPTION_MAP[st]
        return f"<TaskFuture task={self.task_id} state={state}{what}>"
