"""Where a caller's done-callbacks run: one thread of callboard's, never an actor's.

A result future is resolved on the thread that ends its task, an actor's (the
model's, the queue's...): a hop less per result than handing it to another
thread first. callboard's own done-callbacks only hand the result on (to an event
loop, a gather, a writer) and run right there (``on_done``). A callback the
caller adds with ``add_done_callback`` is user code, which may block (wait for
another result, write a file, take a lock): on the actor's thread it stalled
every call of that model while it ran, and one that waited for a result of the
same model never got it. So such a callback runs here instead, on a daemon
thread (``callboard-callbacks``), in the order the callbacks were added (as
``concurrent.futures`` promises); one added to a future already done runs at once
in the caller's own thread, as with any ``Future``. A callback that blocks holds
back the callbacks after it for ``STUCK_S`` at most (counted from when each was
handed over), then each of them gets a thread of its own (``_CallbackThread``, up
to ``MOST_THREADS``: past that the log says so) and they run side by side, in no
set order; never the system.

A system's ``stop`` waits (``flush``, bounded) for the callbacks handed over
before it (but for one stuck), and so does the interpreter's exit: the threads are
daemons, and their queue would otherwise be dropped with the process (callbacks on
actor threads had always run by the time ``stop`` returned).

What must hold: no callback added by ``add_done_callback`` to a ``TaskFuture`` or
a ``CallerFuture`` runs on the thread that resolves the future; each runs exactly
once; anything it raises (``SystemExit`` too) is logged (as ``concurrent.futures``
does), never lost, raised into callboard, or the end of the thread.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = [
    "CALLBACK_THREAD",
    "CallerFuture",
    "flush_callbacks",
    "hand_over",
    "handing_over",
    "on_callback_thread",
    "on_done",
]

log = logging.getLogger("concurrent.futures")  # where the standard Future logs callback errors

CALLBACK_THREAD = "callboard-callbacks"
_T = TypeVar("_T")
_Job = tuple[Future[Any], Sequence[Callable[[Any], object]]]


FLUSH_POLL_S = 0.005
"""How often a flush looks again at callbacks still running on other threads."""
STUCK_S = 1.0
"""A callback running this long holds the callbacks after it: another thread starts
for them (see ``_CallbackThread``)."""
SLOW_SHARE = 0.25
"""A running callback is slow once it has run this share of ``STUCK_S``: one waiting
behind slow ones for ``STUCK_S`` gets a thread (quick ones, however many, keep their
order on one thread)."""
MOST_THREADS = 32
"""The most callback threads at once (as many callbacks blocked at once hold every
callback after them: said as an error in the log; 8 deadlocked nine ``wrap_future``
bridges waiting on each other, found by a hunt)."""


class _CallbackThread:
    """Daemon threads that run callbacks in the order they were handed over: one,
    started at the first, and more while callbacks block.

    A callback that waited for another future through its own done-callback
    (``asyncio.wrap_future``, the usual bridge to asyncio) waited for itself: that
    callback was queued behind it, on the one thread (found by a hunt); and one
    callback stuck in one system held every other system's callbacks, and made each
    ``stop`` wait its flush out. When every thread has run one callback for
    ``STUCK_S`` and more wait, another thread starts (up to ``MOST_THREADS``), and
    ends once none waits. Each callback is a job of its own: they run one at a time,
    in the order handed over (one future's in the order added), unless one blocks,
    whoever's future the callbacks behind it are of."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job] | None = None
        self._busy: dict[int, float] = {}
        """Each thread running a callback: since when (monotonic)."""
        self._threads = 0
        self._said_full = False
        """The log said every thread is held (said again once one is free)."""
        self._held = threading.Condition(self._lock)
        """Told when callbacks wait while one runs: the watcher looks then."""
        self._coming = 0
        """Handovers promised (``expect``) and not made yet: a future's waiters are
        woken before its callbacks are handed over, and a host that exited as soon as
        ``result()`` returned left before them: the exit's flush saw no callback
        thread, and the callback never ran (9 runs of 10; found by a hunt)."""
        self._came = threading.Condition(self._lock)
        self._since: collections.deque[float] = collections.deque()
        """When each callback waiting was handed over, oldest first (appended as one is
        put, taken as one is taken: the same order, to within a race of two handovers
        at once): how long the next one has waited."""

    def expect(self) -> None:
        """A handover of callbacks is coming (``run(..., expected=True)``): a flush
        waits for it."""
        with self._lock:
            self._coming += 1

    def run(
        self,
        future: Future[Any],
        callbacks: Sequence[Callable[[Any], object]],
        *,
        expected: bool = False,
    ) -> None:
        try:
            self._run(future, callbacks)
        finally:
            if expected:
                with self._lock:
                    self._coming -= 1
                    self._came.notify_all()

    def _run(self, future: Future[Any], callbacks: Sequence[Callable[[Any], object]]) -> None:
        jobs = self._jobs
        if jobs is None:
            with self._lock:
                jobs = self._jobs
                if jobs is None:
                    jobs = queue.SimpleQueue()
                    if not self._start(jobs):  # the interpreter is exiting
                        for fn in callbacks:
                            call(fn, future)
                        return
                    self._jobs = jobs
        now = time.monotonic()
        for fn in callbacks:  # each a job: one that blocks holds the next, even its own
            self._since.append(now)  # future's, for ``STUCK_S`` at most (one that waited
            jobs.put((future, (fn,)))  # for the next of its future waited for good; a hunt)
        if self._busy:
            with self._lock:
                self._held.notify()

    def _start(self, jobs: queue.SimpleQueue[_Job]) -> bool:
        """The first thread and the watcher, under the lock; False if none can start."""
        return self._worker(jobs, first=True) and _started(
            self._watch, (jobs,), f"{CALLBACK_THREAD}-watch"
        )

    def _worker(self, jobs: queue.SimpleQueue[_Job], *, first: bool) -> bool:
        """One more thread on ``jobs``, under the lock; False if none can start."""
        if not _started(self._work, (jobs, first), CALLBACK_THREAD):
            return False
        self._threads += 1
        return True

    def _watch(self, jobs: queue.SimpleQueue[_Job]) -> None:
        """While callbacks wait behind running ones, every thread busy: once each running
        one has run ``STUCK_S``, or the next waiting has waited ``STUCK_S`` behind ones
        that are slow (each has run ``SLOW_SHARE`` of a stall), start a thread for each
        callback waiting (up to ``MOST_THREADS`` in all). One at a time, each new thread
        took the next callback, which could block too: behind ten that blocked, a quick
        one waited eight seconds, not one; and a thread was started only for a callback
        that ran ``STUCK_S`` itself: behind thirty of 0.6 s each (another system's), one
        waited 17 s (both found by hunts). Quick callbacks, however many wait, stay on
        one thread, in order (a review)."""
        with self._lock:
            while True:
                since = list(self._busy.values())
                try:  # (taken from by the threads outside the lock: it may empty now)
                    oldest = self._since[0]
                except IndexError:
                    oldest = None
                if jobs.empty() or oldest is None:
                    self._held.wait()  # told by a hand-over, or a take, with more behind
                    continue
                if not since:  # a thread is about to take it
                    self._held.wait(STUCK_S)
                    continue
                now = time.monotonic()
                held_s = now - max(since)  # what the youngest running one has run
                slow = held_s >= SLOW_SHARE * STUCK_S and now - oldest >= STUCK_S
                if len(since) < self._threads or not (held_s >= STUCK_S or slow):
                    self._held.wait(SLOW_SHARE * STUCK_S)  # looked at again, while it waits
                    continue
                if self._threads >= MOST_THREADS:
                    if not self._said_full and held_s >= STUCK_S:
                        self._said_full = True
                        log.error(
                            "%d done-callbacks have each blocked for over %g s: the callbacks "
                            "after them wait until one returns",
                            MOST_THREADS,
                            STUCK_S,
                        )
                else:
                    for _ in range(min(max(1, jobs.qsize()), MOST_THREADS - self._threads)):
                        if not self._worker(jobs, first=False):
                            return  # the interpreter is exiting
                self._held.wait(STUCK_S)

    def _work(self, jobs: queue.SimpleQueue[_Job], first: bool) -> None:
        me = threading.get_ident()
        busy = self._busy
        while True:
            try:  # an extra thread ends once nothing waits
                future, callbacks = jobs.get() if first else jobs.get_nowait()
            except queue.Empty:
                with self._lock:
                    self._threads -= 1
                    self._said_full = False
                return
            with contextlib.suppress(IndexError):  # (taken as its job is: see _since)
                self._since.popleft()
            busy[me] = time.monotonic()
            if not jobs.empty():  # more behind this one: the watcher keeps an eye on it
                with self._lock:
                    self._held.notify()
            try:
                for fn in callbacks:
                    _call_caught(fn, future)
            finally:
                del busy[me]
            del future, callbacks  # hold no result while waiting for the next

    def flush(self, timeout: float) -> bool:
        """Wait until the callbacks handed over so far have run, but for one held
        ``STUCK_S`` or more (stuck: it is not waited for); False: not within
        ``timeout``, or asked from a callback, which cannot wait for itself."""
        if on_callback_thread():
            return False
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._coming:  # woken waiters' callbacks, on their way here
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._came.wait(left)
        jobs = self._jobs
        if jobs is None:
            return True
        ran = threading.Event()
        self.run(Future(), (lambda _: ran.set(),))
        if not ran.wait(timeout):
            return False
        while True:  # taken in order, but some may still run on another thread
            now = time.monotonic()
            if all(now - began >= STUCK_S for began in list(self._busy.values())):
                return True  # (those held that long are stuck: not waited for)
            if now >= deadline:
                return False
            time.sleep(min(FLUSH_POLL_S, deadline - now))

    def forget(self) -> None:
        """In a forked child: the threads did not come along; the next job starts one."""
        self._lock = threading.Lock()
        self._held = threading.Condition(self._lock)
        self._came = threading.Condition(self._lock)
        self._coming = 0
        self._jobs = None
        self._busy = {}
        self._threads = 0
        self._since = collections.deque()


def _started(target: Callable[..., object], args: tuple[Any, ...], name: str) -> bool:
    """A daemon thread running ``target(*args)``; False if none can start (the
    interpreter is exiting)."""
    try:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()
    except RuntimeError:
        return False
    return True


def on_callback_thread() -> bool:
    """Whether the caller runs on a callback thread (in a caller's done-callback)."""
    return threading.current_thread().name == CALLBACK_THREAD


def call(fn: Callable[[Any], object], future: Future[Any]) -> None:
    """``fn(future)``, its exception logged as ``concurrent.futures`` logs one."""
    try:
        fn(future)
    except Exception as exc:  # noqa: BLE001 - logged (_logged), as concurrent.futures does
        _logged(future, exc)


def _call_caught(fn: Callable[[Any], object], future: Future[Any]) -> None:
    """``call`` on the callback thread: a ``SystemExit`` or a ``KeyboardInterrupt`` from
    one callback is logged too (it ended the thread, and no callback ran after)."""
    try:
        call(fn, future)
    except BaseException as exc:  # noqa: BLE001 - logged (_logged): the thread goes on
        _logged(future, exc)


def _logged(future: Future[Any], exc: BaseException) -> None:
    """Log a callback's error ``exc``; a host's logging that raises on it (a filter
    reading a context variable this thread never set) is not ours to raise: it killed
    the callback thread, and no callback ran again (found by a review)."""
    with contextlib.suppress(Exception):  # the host's logging failed: nothing to say it with
        log.error("exception calling callback for %r", future, exc_info=exc)


_THREAD = _CallbackThread()
os.register_at_fork(after_in_child=_THREAD.forget)
FLUSH_AT_EXIT_S = 5.0
atexit.register(lambda: _THREAD.flush(FLUSH_AT_EXIT_S))


def flush_callbacks(timeout: float) -> bool:
    """Wait up to ``timeout`` for the callbacks handed over so far (``System.stop``)."""
    return _THREAD.flush(timeout)


def hand_over(
    future: Future[Any], callbacks: Sequence[Callable[[Any], object]], *, expected: bool = False
) -> None:
    """Run ``callbacks`` (the caller's, of ``future``, now done) on the callback thread;
    ``expected``: promised by ``handing_over`` before the future's waiters were woken."""
    _THREAD.run(future, callbacks, expected=expected)


def handing_over() -> None:
    """Promise a ``hand_over(..., expected=True)``: until it is made, a flush (the
    exit's) waits for it."""
    _THREAD.expect()


class CallerFuture(Future[_T]):
    """A ``concurrent.futures.Future`` handed to a caller and resolved on an actor's
    thread (a gather's, an embedding's): its ``add_done_callback`` callbacks run on the
    callback thread (see the module docstring); callboard's own use ``on_done``."""

    def add_done_callback(self, fn: Callable[[Future[_T]], object]) -> None:
        if self.done():
            call(fn, self)  # in the caller's thread, as any Future's
            return
        super().add_done_callback(functools.partial(_handed, fn))

    def on_done(self, fn: Callable[[Future[_T]], object]) -> None:
        """callboard's own callback: it runs on the thread that resolves the future (it
        must only hand the result on)."""
        super().add_done_callback(fn)


def _handed(fn: Callable[[Any], object], future: Future[Any]) -> None:
    hand_over(future, (fn,))


def on_done(future: Future[_T], fn: Callable[[Future[_T]], object]) -> None:
    """Add callboard's own ``fn`` to ``future``: on a ``TaskFuture`` or a
    ``CallerFuture`` it runs on the thread that resolves the future (it must only hand
    the result on); on any other ``Future``, as ``add_done_callback`` runs it."""
    own = getattr(future, "on_done", None)
    if own is not None:
        own(fn)
    else:
        future.add_done_callback(fn)
