"""Patterns as steps: each is written once, and waited on blocking or on asyncio.

A pattern is a generator (``Steps``): it submits, yields each future it
waits on and is sent that future's result, and returns its answer. Its
``finally`` is its cleanup (cancel what was not sent). ``wait_steps`` drives
it on the caller's thread, blocking; ``await_steps`` drives the very same
generator on the caller's event loop, awaiting each future with
``asyncio.wrap_future`` (never blocking the loop). A chain's stage may be an
awaitable of its own; only ``await_steps`` takes one.

Two futures settle a burst of task futures: ``Decider`` (the first result a
pattern accepts, else the last to end) and ``collect`` (every result, once
all have ended).

What must hold:

* A ``timeout`` bounds the whole pattern, not each step; past it the
  caller gets ``TimeoutError`` and the pattern's cleanup has run.
* A ``Decider`` resolves ``decided`` exactly once: with the first result
  ``accept`` takes, else the last to end, else (all cancelled) it cancels
  ``decided``; a waiter that gave up meanwhile (its future cancelled by an
  asyncio timeout) is not an error, and neither is it for ``collect``.
* Done-callbacks here only count and hand results on: they never block.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, TypeVar

from callboard._submitter import checked_seconds
from callboard.messages import CallerFuture, QueueFullError, Result, UsageError, on_done
from callboard.runtime.handoff import wrapped

T = TypeVar("T")

Step = Future[Any] | Awaitable[Any]
"""What a pattern waits on: a future (a task's, or one settling a burst), or a
chain stage's own awaitable (asyncio only)."""
Steps = Generator[Step, Any, T]
"""A pattern: yields what it waits on, is sent its result, returns its answer."""


def wait_steps(steps: Steps[T], timeout: float | None = None) -> T:
    """Run ``steps`` to its answer, blocking; ``TimeoutError`` after ``timeout`` seconds."""
    timeout = checked_seconds(timeout, "timeout")
    deadline = None if timeout is None else time.monotonic() + timeout
    with contextlib.closing(steps):  # a step that raises runs the pattern's cleanup
        try:
            waiting = next(steps)
            while True:
                if not isinstance(waiting, Future):
                    if inspect.iscoroutine(waiting):
                        waiting.close()  # never to be awaited: say so here, not in a warning
                    raise UsageError("a chain stage returned an awaitable: use achain")
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    value = waiting.result(left)
                except TimeoutError:
                    raise TimeoutError(f"results not ready within {timeout} s") from None
                waiting = steps.send(value)
        except StopIteration as done:
            answer: T = done.value
            return answer


async def await_steps(
    steps: Steps[T], timeout: float | None = None, *, blocking: bool = False
) -> T:
    """Run ``steps`` to its answer on the running loop; ``TimeoutError`` after ``timeout``.
    ``blocking``: a step may block (a submit that waits for room, ``wait_s``), so each
    runs on a worker thread, the loop free meanwhile."""
    timeout = checked_seconds(timeout, "timeout")
    with contextlib.closing(steps):
        scope = asyncio.timeout(timeout)
        try:
            async with scope:
                ended, waiting = await _advance(steps, None, blocking=blocking)
                while not ended:
                    if isinstance(waiting, Future):
                        value = await wrapped(waiting)
                    else:
                        value = await waiting
                    ended, waiting = await _advance(steps, value, blocking=blocking)
                answer: T = waiting
                return answer
        except TimeoutError:
            if scope.expired():  # ours, said as the blocking wait says it (it said nothing)
                raise TimeoutError(f"results not ready within {timeout} s") from None
            raise


async def _advance(steps: Steps[T], value: Any, *, blocking: bool) -> tuple[bool, Any]:
    """Send ``value`` to ``steps`` (the first time, None starts it): ``(False, what it
    waits on next)`` or ``(True, its answer)``. ``blocking``: on a worker thread; a
    cancel (the timeout) then waits for that step to end, so the pattern's cleanup
    never runs beside it (a ``wait_s`` no longer than the timeout bounds the wait)."""
    if not blocking:
        return _step(steps, value)
    job = asyncio.ensure_future(asyncio.to_thread(_step, steps, value))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        while not job.done():  # a second cancel too: the generator is the thread's till
            with contextlib.suppress(asyncio.CancelledError):  # then (closed beside it,
                await asyncio.wait([job])  # "generator already executing"; found by a
        raise  # review)


def _step(steps: Steps[T], value: Any) -> tuple[bool, Any]:
    try:
        return False, steps.send(value)
    except StopIteration as done:  # returned: a future may not carry StopIteration
        return True, done.value


@dataclass(frozen=True, slots=True)
class Bounded:
    """A pattern's fields with its wait for room bounded by its timeout (``bounded``)."""

    fields: dict[str, Any]
    blocking: bool
    """A submit may block (a ``wait_s`` is given): the asyncio twins submit on a thread."""
    by_timeout: bool
    """The timeout is what bounds that wait: a queue still full past it is the timeout
    (``TimeoutError``, said as a timeout is said), not ``QueueFullError``."""


@contextlib.contextmanager
def timing_out(within: Bounded, timeout: float | None) -> Iterator[None]:
    """Around a pattern bounded by ``within``: a queue still full when the timeout
    bounded the wait for room raises ``TimeoutError``, as a timeout does."""
    try:
        yield
    except QueueFullError as exc:
        if within.by_timeout and not exc.for_good:  # a burst too large is not a timeout
            raise TimeoutError(f"results not ready within {timeout} s") from None
        raise


def bounded(fields: dict[str, Any], timeout: float | None) -> Bounded:
    """A pattern's ``fields`` with ``wait_s`` (the wait for room in the queue) no longer
    than its ``timeout``, which bounds the whole pattern: a full queue held a gather
    with ``timeout=0.5`` for its ``wait_s``, the asyncio one blocking its loop all
    along (found by a hunt)."""
    wait_s = checked_seconds(fields.get("wait_s"), "wait_s")
    if not wait_s:
        return Bounded(fields, blocking=False, by_timeout=False)
    timeout = checked_seconds(timeout, "timeout")
    if timeout is not None and timeout < wait_s:
        return Bounded({**fields, "wait_s": timeout}, blocking=True, by_timeout=True)
    return Bounded(fields, blocking=True, by_timeout=False)


class Decider:
    """Resolves ``decided`` with the first result ``accept`` takes, else the last to end."""

    def __init__(self, futures: Sequence[Future[Result]], accept: Callable[[Result], bool]) -> None:
        self.decided: Future[Result] = CallerFuture()
        self.index: int | None = None
        """The index of the deciding future once decided (-1: all were cancelled)."""
        self._accept = accept
        self._left = len(futures)
        self._last: tuple[int, Result] | None = None
        self._lock = threading.Lock()
        for i, f in enumerate(futures):
            on_done(f, functools.partial(self._ended, i))

    def _ended(self, index: int, future: Future[Result]) -> None:
        failed = None if future.cancelled() else future.exception()
        if failed is not None:  # a Submitter's future may end so (a System's never do)
            with self._lock:
                self._left -= 1
                if self.index is not None:
                    return
                self.index = index
            with contextlib.suppress(InvalidStateError):
                self.decided.set_exception(failed)
            return
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
        with contextlib.suppress(InvalidStateError):  # the waiter gave up (asyncio timeout)
            if chosen is None:
                self.decided.cancel()
            else:
                self.decided.set_result(chosen[1])


def collect(futures: Sequence[Future[Result]]) -> Future[tuple[Result, ...]]:
    """A future of every result, in order, once all have ended (cancelled ones left out)."""
    out: Future[tuple[Result, ...]] = CallerFuture()
    left = [len(futures)]
    lock = threading.Lock()

    def ended(_: Future[Result]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            ended = [f for f in futures if not f.cancelled()]
            failed = next((e for f in ended if (e := f.exception()) is not None), None)
            with contextlib.suppress(InvalidStateError):  # the waiter gave up
                if failed is not None:  # a Submitter's future may end so
                    out.set_exception(failed)
                else:
                    out.set_result(tuple(f.result() for f in ended))

    if not futures:
        out.set_result(())
    for f in futures:
        on_done(f, ended)
    return out
