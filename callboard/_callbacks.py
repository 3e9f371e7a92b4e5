"""Callbacks on results: the ``CallbackRunner``, ``when_done`` and ``fire_and_forget``.

What must hold:

* Nothing here runs on, or blocks, an actor thread: a done-callback on a
  result future only hands the result on to the ``CallbackRunner``, so a
  slow callback never stalls the system.
* User callbacks run on the ``CallbackRunner``: sync ones on a small bounded
  thread pool, async ones on the caller's event loop (or a dedicated loop
  thread). An exception in a callback is logged with the task and trace ids,
  never lost silently; ``CallbackRunner.run`` never blocks and never raises.
* There is one process-wide default runner (``default_runner``), created
  lazily under a lock; it is this module's only state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from callboard._submitter import Face, submitter_of
from callboard.actors.base import task_extra
from callboard.messages import Result, UsageError, on_done
from callboard.runtime.guarded_log import guarded_logger

log = guarded_logger("callboard.patterns")  # the public module's name, as before the split

ResultCallback = Callable[[Result], object]
"""Called with an ok result; a plain function, or an ``async def`` (its awaitable is run)."""
ErrorCallback = Callable[[Result | BaseException], object]
"""Called with a result that is not ok, or the exception that stopped the submit."""


def _about(value: object) -> str:
    if isinstance(value, Result):
        return f"task {value.task_id} (trace {value.trace_id})"
    return repr(value)[:200]


class _LoopThread:
    """An event loop in its own daemon thread, for async callbacks with no caller loop."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        settle = asyncio.run_coroutine_threadsafe(_settle_tasks(timeout), self.loop)
        try:
            settle.result(timeout + 1.0)
        except concurrent.futures.TimeoutError:
            log.warning("async callbacks still running after %.1f s at close", timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


async def _settle_tasks(timeout: float) -> None:
    """Let running callbacks finish within ``timeout``, then cancel the rest."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


class CallbackRunner:
    """Runs user callbacks off the actor threads; ``run`` never blocks and never raises.

    Sync callbacks run on a pool of ``max_workers`` threads; ``async def``
    callbacks (and awaitables a sync callback returns) run on ``loop`` (the
    caller's), else on a dedicated loop thread started on first use. The pool
    threads are bounded; the backlog is not (bounding it would mean blocking
    an actor thread or dropping a callback), so a warning is logged each time
    it passes ``backlog_warning``.
    """

    def __init__(
        self,
        max_workers: int = 4,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        backlog_warning: int = 10_000,
    ) -> None:
        if type(max_workers) is not int or max_workers < 1:
            raise UsageError(f"max_workers must be an integer >= 1, got {max_workers!r}")
        self._pool = _DaemonPool(max_workers, "callboard-callback")
        self._loop = loop
        self._own_loop: _LoopThread | None = None
        self._lock = threading.Lock()
        self._backlog = 0
        self._backlog_warning = backlog_warning
        self._closed = False

    def run(
        self,
        callback: Callable[[Any], object],
        arg: Any,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Schedule ``callback(arg)``; a failure to schedule (runner closed) is logged."""
        if self._closed:
            log.error(
                "callback %r for %s not run: the runner is closed",
                callback,
                _about(arg),
                extra=_ids(arg),
            )
            return
        try:
            if inspect.iscoroutinefunction(callback):
                self._on_loop(self._guarded(callback, arg), loop)
                return
            self._count(1)
            try:
                self._pool.submit(self._call, callback, arg, loop)
            except BaseException:
                self._count(-1)
                raise
        except RuntimeError:
            log.exception(
                "callback %r for %s could not be scheduled", callback, _about(arg), extra=_ids(arg)
            )

    def _count(self, delta: int) -> None:
        with self._lock:
            self._backlog += delta
            crossed = delta > 0 and self._backlog == self._backlog_warning
        if crossed:
            log.warning("%d callbacks are waiting: a callback is slow or blocked", self._backlog)

    def _call(
        self, callback: Callable[[Any], object], arg: Any, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        """A sync callback, on a pool thread; an awaitable it returns goes to the loop."""
        out: object = None
        try:
            out = callback(arg)
            if inspect.isawaitable(out):
                self._on_loop(self._guarded(lambda _: out, arg), loop)
        except Exception:
            if inspect.iscoroutine(out):
                out.close()  # never scheduled: close it rather than leave it unawaited
            log.exception("callback %r failed for %s", callback, _about(arg), extra=_ids(arg))
        finally:
            self._count(-1)

    async def _guarded(self, callback: Callable[[Any], object], arg: Any) -> None:
        """Run ``callback(arg)`` on the loop, awaiting what it returns; log what it raises."""
        try:
            out = callback(arg)
            if inspect.isawaitable(out):
                await out
        except Exception:
            log.exception("callback %r failed for %s", callback, _about(arg), extra=_ids(arg))

    def _on_loop(
        self, coro: Coroutine[Any, Any, None], loop: asyncio.AbstractEventLoop | None
    ) -> None:
        target = loop or self._loop or self._dedicated_loop()
        if target.is_closed():  # the caller's loop ended before its outcome came: the
            target = self._dedicated_loop()  # callback runs on ours (it was dropped)
        try:
            try:
                asyncio.run_coroutine_threadsafe(coro, target)
            except RuntimeError:  # closed since: once more, on ours
                asyncio.run_coroutine_threadsafe(coro, self._dedicated_loop())
        except BaseException:
            coro.close()
            raise

    def _dedicated_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._own_loop is None:
                self._own_loop = _LoopThread("callboard-callback-loop")
            return self._own_loop.loop

    def close(self, *, wait: bool = True, timeout: float = 10.0) -> None:
        """Stop taking callbacks; with ``wait``, let the scheduled ones finish first."""
        self._closed = True
        self._pool.shutdown(wait=wait)
        with self._lock:
            own, self._own_loop = self._own_loop, None
        if own is not None:
            own.stop(timeout if wait else 0.0)

    def __enter__(self) -> CallbackRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _DaemonPool:
    """Up to ``size`` daemon threads running what is submitted, in order. Not a
    ``ThreadPoolExecutor``: Python joins its workers at exit, so one user callback that
    blocks held the process for ever after every system had stopped."""

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._work: queue.SimpleQueue[tuple[Callable[..., object], tuple[Any, ...]] | None]
        self._work = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new callbacks after shutdown")
            self._work.put((fn, args))
            if len(self._threads) < self._size:  # one more worker while any is missing
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            fn, args = item
            try:
                fn(*args)  # the runner's _call: it logs what a callback raises
            except BaseException:  # SystemExit and the like: this worker lives on
                log.exception("a callback ended its thread's work abruptly")

    def shutdown(self, *, wait: bool) -> None:
        """What was submitted still runs; with ``wait``, return once it has."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            threads = list(self._threads)
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()


_default_lock = threading.Lock()
_default: CallbackRunner | None = None


def default_runner() -> CallbackRunner:
    """The process-wide runner the patterns use when given none (4 threads)."""
    global _default  # noqa: PLW0603 - one lazily created, process-wide runner
    with _default_lock:
        if _default is None:
            _default = CallbackRunner()
        return _default


def _caller_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _outcome(future: Future[Result]) -> Result | BaseException:
    if future.cancelled():
        return concurrent.futures.CancelledError()
    return future.exception() or future.result()


def when_done(
    future: Future[Result],
    *,
    on_result: ResultCallback | None = None,
    on_error: ErrorCallback | None = None,
    runner: CallbackRunner | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> None:
    """Call ``on_result`` with an ok result, else ``on_error`` (with the result or exception).

    Both run on ``runner`` (default: ``default_runner()``); async ones on
    ``loop``, by default the caller's running loop if there is one.
    """
    _check_callbacks(on_result=on_result, on_error=on_error)
    runner = runner or default_runner()
    loop = loop or _caller_loop()

    def done(f: Future[Result]) -> None:
        outcome = _outcome(f)
        if isinstance(outcome, Result) and outcome.ok:
            if on_result is not None:
                runner.run(on_result, outcome, loop=loop)
        elif on_error is not None:
            runner.run(on_error, outcome, loop=loop)
        else:
            log.warning(
                "%s ended without success and no on_error was given",
                _about(outcome),
                extra=_ids(outcome),
            )

    on_done(future, done)  # it only hands the result to the runner


def fire_and_forget(
    face: Face,
    prompt: Any,
    /,
    *,
    on_error: ErrorCallback,
    on_result: ResultCallback | None = None,
    runner: CallbackRunner | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
    **fields: Any,
) -> Future[Result] | None:
    """Submit and return at once; ``on_error`` is called for every outcome that is not ok.

    That includes an exception raised by the submit itself (then None is
    returned) and a future the caller cancelled (a ``CancelledError``).
    """
    _check_callbacks(on_result=on_result, on_error=on_error, error_needed=True)
    runner = runner or default_runner()
    loop = loop or _caller_loop()
    try:
        future = submitter_of(face).submit(prompt, **fields)
    except Exception as exc:  # noqa: BLE001 - handed to on_error: that is the contract
        runner.run(on_error, exc, loop=loop)
        return None
    when_done(future, on_result=on_result, on_error=on_error, runner=runner, loop=loop)
    return future


def _check_callbacks(*, on_result: object, on_error: object, error_needed: bool = False) -> None:
    """Callbacks are callables (``on_error=None`` or ``"x"`` was taken, and only a log
    line said so once an outcome came; found by a hunt)."""
    if error_needed and on_error is None:
        raise UsageError("on_error is required: it hears every outcome that is not ok")
    for name, callback in (("on_result", on_result), ("on_error", on_error)):
        if callback is not None and not callable(callback):
            raise UsageError(f"{name} must be a callable, got {callback!r}")


def _ids(arg: object) -> dict[str, Any]:
    """The task and trace ids for a record about ``arg``, when it is a result."""
    return task_extra(arg.task_id, arg.trace_id) if isinstance(arg, Result) else {}
