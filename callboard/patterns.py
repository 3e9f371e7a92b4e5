"""Patterns over a running system: scatter-gather, streaming, races, chains, callbacks.

Each pattern is a function taking a ``System`` (or an ``AsyncSystem``) and
using only its public face (``submit``, ``submit_many``, ``cancel``); the
``a``-prefixed twins (``agather``, ``arace``, ``achain``) and
``stream_results`` are the asyncio variants, which never block the loop.

What must hold:

* Failures are results (``result.ok`` is False), never exceptions; only
  misuse raises (a ``UsageError`` before anything is sent) and so does a
  caller's own ``timeout`` (``TimeoutError``).
* Nothing here runs on, or blocks, an actor thread: a done-callback on a
  result future only hands the result on (to a waiting caller, or to the
  ``CallbackRunner``), so a slow callback never stalls the system.
* User callbacks run on the ``CallbackRunner``: sync ones on a small bounded
  thread pool, async ones on the caller's event loop (or a dedicated loop
  thread). An exception in a callback is logged with the task and trace ids,
  never lost silently.
* "Cancel what was not sent" (``cancel_unsent``) asks the queue to cancel the
  waiting tasks: their futures resolve as ``Cancelled``. A task already sent
  runs to its end, its cost is counted in ``stats()``, and its real result
  is still reported where a pattern promises it (``RaceResult.losers``).
* A chain or a race shares one ``trace_id`` across all its tasks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import string
import threading
import uuid
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal, overload

from callboard.messages import Request, Result, TaskFuture, UsageError
from callboard.messages._results import NANO
from callboard.supervisor.address_book import AddressError

if TYPE_CHECKING:
    from ._async import AsyncSystem
    from ._system import System

log = logging.getLogger(__name__)

ResultCallback = Callable[[Result], object]
"""Called with an ok result; a plain function, or an ``async def`` (its awaitable is run)."""
ErrorCallback = Callable[[Result | BaseException], object]
"""Called with a result that is not ok, or the exception that stopped the submit."""
Stage = str | Callable[[str], object]
"""A chain stage: a template naming ``{input}``, or a function of the previous text
returning a prompt, a ``Request`` or a dict of request fields (``prompt`` or
``messages`` plus fields); in ``achain`` it may be ``async``."""
ReturnWhen = Literal["all", "first"]

__all__ = [
    "CallbackRunner",
    "ChainResult",
    "ErrorCallback",
    "RaceResult",
    "ResultCallback",
    "Stage",
    "achain",
    "agather",
    "arace",
    "as_completed",
    "cancel_unsent",
    "chain",
    "default_runner",
    "fire_and_forget",
    "gather",
    "new_trace_id",
    "race",
    "stream_results",
    "when_done",
]


def _sync(system: System | AsyncSystem) -> System:
    from ._async import AsyncSystem

    return system.system if isinstance(system, AsyncSystem) else system


def new_trace_id(kind: str) -> str:
    """A fresh trace id for a chain or a race (``chain.<16 hex>``)."""
    return f"{kind}.{uuid.uuid4().hex[:16]}"


def _about(value: object) -> str:
    if isinstance(value, Result):
        return f"task {value.task_id} (trace {value.trace_id})"
    return repr(value)[:200]


# -- callbacks --------------------------------------------------------------------------


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
        if max_workers < 1:
            raise UsageError(f"max_workers must be at least 1, got {max_workers!r}")
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="callboard-callback")
        self._loop = loop
        self._own_loop: _LoopThread | None = None
        self._lock = threading.Lock()
        self._backlog = 0
        self._backlog_warning = backlog_warning
        self._closed = False

    @property
    def backlog(self) -> int:
        """Sync callbacks scheduled and not finished yet."""
        return self._backlog

    def run(
        self,
        callback: Callable[[Any], object],
        arg: Any,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Schedule ``callback(arg)``; a failure to schedule (runner closed) is logged."""
        if self._closed:
            log.error("callback %r for %s not run: the runner is closed", callback, _about(arg))
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
            log.exception("callback %r for %s could not be scheduled", callback, _about(arg))

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
            log.exception("callback %r failed for %s", callback, _about(arg))
        finally:
            self._count(-1)

    async def _guarded(self, callback: Callable[[Any], object], arg: Any) -> None:
        """Run ``callback(arg)`` on the loop, awaiting what it returns; log what it raises."""
        try:
            out = callback(arg)
            if inspect.isawaitable(out):
                await out
        except Exception:
            log.exception("callback %r failed for %s", callback, _about(arg))

    def _on_loop(
        self, coro: Coroutine[Any, Any, None], loop: asyncio.AbstractEventLoop | None
    ) -> None:
        target = loop or self._loop or self._dedicated_loop()
        try:
            asyncio.run_coroutine_threadsafe(coro, target)
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
            log.warning("%s ended without success and no on_error was given", _about(outcome))

    future.add_done_callback(done)


def fire_and_forget(
    system: System | AsyncSystem,
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
    runner = runner or default_runner()
    loop = loop or _caller_loop()
    try:
        future = _sync(system).submit(prompt, **fields)
    except Exception as exc:  # noqa: BLE001 - handed to on_error: that is the contract
        runner.run(on_error, exc, loop=loop)
        return None
    when_done(future, on_result=on_result, on_error=on_error, runner=runner, loop=loop)
    return future


# -- cancelling what was not sent ---------------------------------------------------


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
        except AddressError as exc:  # stopped meanwhile: the stop resolves every future
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


# -- gather and as_completed ------------------------------------------------------------


def _check_return_when(return_when: str, prompts: list[Any]) -> None:
    if return_when not in ("all", "first"):
        raise UsageError(f"return_when must be 'all' or 'first', got {return_when!r}")
    if return_when == "first" and not prompts:
        raise UsageError("gather(return_when='first') needs at least one prompt")


@overload
def gather(
    system: System | AsyncSystem,
    prompts: Iterable[Any],
    /,
    *,
    return_when: Literal["all"] = "all",
    timeout: float | None = None,
    **fields: Any,
) -> list[Result]: ...
@overload
def gather(
    system: System | AsyncSystem,
    prompts: Iterable[Any],
    /,
    *,
    return_when: Literal["first"],
    timeout: float | None = None,
    **fields: Any,
) -> Result: ...
def gather(
    system: System | AsyncSystem,
    prompts: Iterable[Any],
    /,
    *,
    return_when: ReturnWhen = "all",
    timeout: float | None = None,
    **fields: Any,
) -> list[Result] | Result:
    """Scatter ``prompts`` (one burst), gather the results in input order.

    ``return_when="first"``: the first result to end, whatever it is; the
    others are cancelled if not yet sent. On ``timeout`` (``TimeoutError``)
    every task not yet sent is cancelled too.
    """
    sync = _sync(system)
    prompts = list(prompts)
    _check_return_when(return_when, prompts)
    futures = sync.submit_many(prompts, **fields)
    try:
        if return_when == "first":
            return _Decider(futures, lambda _: True).decided.result(timeout)
        _, pending = concurrent.futures.wait(futures, timeout)
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(futures)} results not ready in {timeout}s")
        return [f.result() for f in futures]
    finally:
        cancel_unsent(sync, futures)


@overload
async def agather(
    system: System | AsyncSystem,
    prompts: Iterable[Any],
    /,
    *,
    return_when: Literal["all"] = "all",
    timeout: float | None = None,
    **fields: Any,
) -> list[Result]: ...
@overload
async def agather(
    system: System | AsyncSystem,
    prompts: Iterable[Any],
    /,
    *,
    return_when: Literal["first"],
    timeout: float | None = None,
    **fields: Any,
) -> Result: ...
async def agather(
    system: System | AsyncSystem,
    prompts: Iterable[Any],
    /,
    *,
    return_when: ReturnWhen = "all",
    timeout: float | None = None,
    **fields: Any,
) -> list[Result] | Result:
    """``gather`` for asyncio: the same results, awaited without blocking the loop."""
    sync = _sync(system)
    prompts = list(prompts)
    _check_return_when(return_when, prompts)
    futures = sync.submit_many(prompts, **fields)
    try:
        if return_when == "first":
            decided = asyncio.wrap_future(_Decider(futures, lambda _: True).decided)
            return await asyncio.wait_for(decided, timeout)
        everything = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        return list(await asyncio.wait_for(everything, timeout))
    finally:
        cancel_unsent(sync, futures)


def _futures_of(
    system: System | AsyncSystem | None, items: Iterable[Any], fields: dict[str, Any]
) -> list[Future[Result]]:
    items = list(items)
    prompts = [x for x in items if not isinstance(x, Future)]
    fresh: Iterator[Future[Result]] = iter(())
    if prompts:
        if system is None:
            raise UsageError("prompts given without a system to submit them to")
        fresh = iter(_sync(system).submit_many(prompts, **fields))
    return [x if isinstance(x, Future) else next(fresh) for x in items]


def as_completed(
    system: System | AsyncSystem | None,
    futures_or_prompts: Iterable[Future[Result] | Any],
    timeout: float | None = None,
    **fields: Any,
) -> Iterator[Result]:
    """Results as they end. Prompts are submitted now (one burst, with ``fields``).

    ``TimeoutError`` when ``timeout`` seconds pass before all have ended.
    """
    futures = _futures_of(system, futures_or_prompts, fields)
    return (f.result() for f in concurrent.futures.as_completed(futures, timeout))


def stream_results(
    system: System | AsyncSystem | None,
    futures_or_prompts: Iterable[Future[Result] | Any],
    timeout: float | None = None,
    **fields: Any,
) -> AsyncIterator[Result]:
    """``as_completed`` for asyncio: ``async for result in stream_results(cb, prompts)``."""
    futures = _futures_of(system, futures_or_prompts, fields)

    async def stream() -> AsyncIterator[Result]:
        wrapped = [asyncio.wrap_future(f) for f in futures]
        for next_done in asyncio.as_completed(wrapped, timeout=timeout):
            yield await next_done

    return stream()


# -- race -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RaceResult:
    """How a race ended: the winner now, the losers' results when they end."""

    result: Result
    """The first successful result; if none succeeded, the last to fail."""
    trace_id: str
    losers: Future[tuple[Result, ...]] = field(repr=False, compare=False)
    """Every other entrant's result, in ``models`` order, once all have ended:
    ``Cancelled`` if it was never sent, else its real result (and cost)."""

    @property
    def ok(self) -> bool:
        return self.result.ok

    @property
    def text(self) -> str | None:
        return self.result.text

    @property
    def model(self) -> str | None:
        return self.result.model

    def total_cost_usd(self, timeout: float | None = None) -> Decimal:
        """The winner's cost plus every loser's (waits for the losers to end)."""
        losers = self.losers.result(timeout)
        return Decimal(self.result.cost_nusd + sum(r.cost_nusd for r in losers)) / NANO


class _Race:
    def __init__(
        self, system: System, prompt: Any, models: Sequence[str], fields: dict[str, Any]
    ) -> None:
        if isinstance(models, str) or not models:
            raise UsageError("race needs a non-empty list of models")
        if "model" in fields or "route" in fields:
            raise UsageError("race chooses the model: pass models=[...], not model= or route=")
        self.trace_id = fields.pop("trace_id", None) or new_trace_id("race")
        requests = [Request.of(prompt, model=m, **fields) for m in models]
        self.futures = system.submit_many(requests, trace_id=self.trace_id)
        self.decider = _Decider(self.futures, lambda r: r.ok)

    def outcome(self, winner: Result) -> RaceResult:
        index = self.decider.index
        losers = [f for i, f in enumerate(self.futures) if i != index]
        return RaceResult(result=winner, trace_id=self.trace_id, losers=_collect(losers))


def race(
    system: System | AsyncSystem,
    prompt: Any,
    /,
    models: Sequence[str],
    *,
    timeout: float | None = None,
    **fields: Any,
) -> RaceResult:
    """Hedge: send ``prompt`` to every model at once; the first ok result wins.

    The losers are cancelled if not yet sent; those already sent run to their
    end (their cost is accounted) and show up in ``RaceResult.losers``.
    """
    sync = _sync(system)
    entrants = _Race(sync, prompt, models, dict(fields))
    try:
        winner = entrants.decider.decided.result(timeout)
    finally:
        cancel_unsent(sync, entrants.futures)
    return entrants.outcome(winner)


async def arace(
    system: System | AsyncSystem,
    prompt: Any,
    /,
    models: Sequence[str],
    *,
    timeout: float | None = None,
    **fields: Any,
) -> RaceResult:
    """``race`` for asyncio."""
    sync = _sync(system)
    entrants = _Race(sync, prompt, models, dict(fields))
    try:
        decided = asyncio.wrap_future(entrants.decider.decided)
        winner = await asyncio.wait_for(decided, timeout)
    finally:
        cancel_unsent(sync, entrants.futures)
    return entrants.outcome(winner)


# -- chain ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainResult:
    """What a chain came to: one result per stage run, the last being the answer or the failure."""

    results: tuple[Result, ...]
    trace_id: str
    stages: int

    @property
    def result(self) -> Result:
        return self.results[-1]

    @property
    def ok(self) -> bool:
        return len(self.results) == self.stages and self.result.ok

    @property
    def text(self) -> str | None:
        return self.result.text

    @property
    def failed_stage(self) -> int | None:
        """The index of the stage that failed, or None."""
        return None if self.ok else len(self.results) - 1

    @property
    def cost_nusd(self) -> int:
        return sum(r.cost_nusd for r in self.results)

    @property
    def cost_usd(self) -> Decimal:
        return Decimal(self.cost_nusd) / NANO


def _check_stages(stages: Sequence[Stage]) -> None:
    if isinstance(stages, str) or not stages:
        raise UsageError("chain needs a non-empty list of stages")
    for i, stage in enumerate(stages):
        if callable(stage):
            continue
        if not isinstance(stage, str):
            raise UsageError(f"stage {i} must be a template string or a callable, got {stage!r}")
        names = {name for _, name, _, _ in string.Formatter().parse(stage) if name is not None}
        if names - {"input"}:
            raise UsageError(f"stage {i} template may only name {{input}}, not {sorted(names)}")


def _stage_request(output: object, fields: Mapping[str, Any], index: int) -> Request:
    """Turn what a stage produced (a prompt, a Request or a dict of fields) into a Request."""
    if isinstance(output, str | Request):
        return Request.of(output, **fields) if isinstance(output, str) else output
    if isinstance(output, Mapping):
        spec = dict(output)
        if "trace_id" in spec:
            raise UsageError(f"stage {index}: the chain owns trace_id; do not set it per stage")
        prompt = spec.pop("prompt", None) or spec.pop("messages", None)
        if prompt is None:
            raise UsageError(f"stage {index} returned fields with neither prompt nor messages")
        return Request.of(prompt, **{**fields, **spec})
    raise UsageError(f"stage {index} returned {type(output).__name__}: want str, Request or dict")


def _stage_output(stage: Stage, text: str) -> object:
    return stage.format(input=text) if isinstance(stage, str) else stage(text)


def chain(
    system: System | AsyncSystem,
    stages: Sequence[Stage],
    first_input: str,
    /,
    *,
    trace_id: str | None = None,
    **fields: Any,
) -> ChainResult:
    """Run ``stages`` in turn, each fed the previous stage's text; stop at the first failure.

    ``fields`` apply to every stage (a stage's dict may override them); every
    task carries one ``trace_id``.
    """
    sync = _sync(system)
    _check_stages(stages)
    trace = trace_id or new_trace_id("chain")
    results: list[Result] = []
    text = first_input
    for i, stage in enumerate(stages):
        request = _stage_request(_stage_output(stage, text), fields, i)
        result = sync.submit(request, trace_id=trace).result()
        results.append(result)
        if not result.ok:
            break
        text = result.text or ""
    return ChainResult(results=tuple(results), trace_id=trace, stages=len(stages))


async def achain(
    system: System | AsyncSystem,
    stages: Sequence[Stage],
    first_input: str,
    /,
    *,
    trace_id: str | None = None,
    **fields: Any,
) -> ChainResult:
    """``chain`` for asyncio; a stage function may be ``async``."""
    sync = _sync(system)
    _check_stages(stages)
    trace = trace_id or new_trace_id("chain")
    results: list[Result] = []
    text = first_input
    for i, stage in enumerate(stages):
        output = _stage_output(stage, text)
        if inspect.isawaitable(output):
            output = await output
        request = _stage_request(output, fields, i)
        result = await asyncio.wrap_future(sync.submit(request, trace_id=trace))
        results.append(result)
        if not result.ok:
            break
        text = result.text or ""
    return ChainResult(results=tuple(results), trace_id=trace, stages=len(stages))
