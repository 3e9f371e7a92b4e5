"""A task whose first step runs now, in the callback that creates it.

``loop.create_task`` runs a coroutine's first step on the loop's next iteration. On
the I/O loop that is a whole iteration away: with 200 streams open, every socket with
bytes waiting is read first, and a call handed over by its model actor waited there
0.1-0.2 ms at the median and 0.6-0.9 ms at p90 before its request was written
(docs/bench.md). Python 3.12 starts a task eagerly (``eager_start``); this is the same
on 3.11: the first step runs inside the task (``current_task`` is it, so timeouts and
everything that looks for its task work), in the task's own context, and the task
then goes on from where that step stopped.

A task cancelled before its first scheduled step is cancelled where the coroutine
waits, as any task is: the future it waits on is cancelled, and the task waits for
that before the cancellation is thrown in at the ``await`` (an awaited task that
swallows it is waited for). Unlike 3.12's, a task whose coroutine ended in its first
step is not done until its first scheduled step, so a cancel before that replaces
its result. A ``KeyboardInterrupt`` or ``SystemExit`` in the first step is raised to
the caller of ``start_task``, as 3.12 does; there its task ends with it, here the
task ends cancelled. Neither difference reaches callboard's calls: a call catches
its own errors, and its cancels come from other threads, a loop turn later at least.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from asyncio import Task
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

__all__ = ["start_task"]

T = TypeVar("T")

if sys.version_info >= (3, 12):

    def start_task(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> Task[T]:
        """``coro`` as a task of ``loop`` (the running one), its first step taken now."""
        return asyncio.Task(coro, loop=loop, eager_start=True)

else:
    from asyncio.tasks import _enter_task, _leave_task

    def start_task(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> Task[T]:
        """``coro`` as a task of ``loop`` (the running one), its first step taken now."""
        context = contextvars.copy_context()
        resumed = _Resumed(coro)
        task: asyncio.Task[T] = loop.create_task(resumed, context=context)
        running = asyncio.current_task(loop)  # a task's step may start another (3.12 too)
        if running is not None:
            _leave_task(loop, running)
        _enter_task(loop, task)
        try:
            context.run(resumed.first_step)
        finally:
            _leave_task(loop, task)
            if running is not None:
                _enter_task(loop, running)
        return task


_TAKEN: Any = object()


def _without_this_frame(exc: BaseException) -> BaseException:
    """``exc`` with the first entry of its traceback (the caller's frame) dropped."""
    tb = exc.__traceback__
    return exc if tb is None else exc.with_traceback(tb.tb_next)


class _Ended:
    """How a coroutine ended in its first step: what its task's first ``send`` raises
    (``StopIteration`` with the value it returned, or what it raised)."""

    __slots__ = ("raised",)

    def __init__(self, raised: BaseException) -> None:
        self.raised = raised


class _Resumed(Coroutine[Any, Any, Any]):
    """``coro`` with its first step taken before its task's first ``send``: that one
    hands the task what the step waits on (or ends as the step did); every later one
    goes to ``coro``."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self._first: Any = _TAKEN
        """What the first step waits on, or how it ended (``_Ended``), until the task
        takes it."""

    def first_step(self) -> None:
        try:
            self._first = self._coro.send(None)
        except StopIteration as stop:
            self._first = _Ended(StopIteration(stop.value))
        except (KeyboardInterrupt, SystemExit):
            self._first = _Ended(asyncio.CancelledError())  # raised here; the task: cancelled
            raise
        except BaseException as exc:  # noqa: BLE001 - its task raises it, as it would have
            self._first = _Ended(_without_this_frame(exc))  # which holds self, which holds exc

    def send(self, value: Any) -> Any:
        first = self._first
        if first is _TAKEN:
            return self._coro.send(value)
        self._first = _TAKEN
        if type(first) is _Ended:
            raise first.raised
        return first

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        first, self._first = self._first, _TAKEN
        if type(first) is _Ended:
            raise typ if val is None else val  # ended in its first step: nothing to throw into
        if isinstance(first, asyncio.Future) and first.cancel():
            return first  # cancelled before the task waited on it: it waits now, as any task
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)  # pragma: no cover - asyncio throws instances

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:  # pragma: no cover - a task's only
        raise TypeError("an eagerly started coroutine is driven by its task")
