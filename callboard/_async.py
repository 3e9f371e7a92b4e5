"""``AsyncSystem``: the asyncio face. Awaiting never blocks the host's loop.

Each loop the system is used from has a ``Handoff`` and a ``Batch`` of its own
(``runtime.handoff``, ``runtime.batch``), which cut the crossings between the
loop and callboard's threads to a few per turn of the loop, whatever the number
of callers awaiting in it. The submits of one turn go in one ``submit_many``
(the turn's first at once, alone, unless the turn is that of callers a delivery of
results woke: then all of them at its end); one that carries a ``trace_id`` or a
``wait_s`` goes on its own. Each result future is a ``concurrent.futures.Future``
resolved on an actor thread (never ``await`` a pykka future: that blocks the
loop): the handoff carries the results that finish together to the loop in one
wake-up, where ``asyncio.wrap_future`` would cost a ``call_soon_threadsafe`` (a
write to the loop's wake-up descriptor from the actor's thread, and a turn of the
loop) for each. Start-up, stats, drain and shutdown, which wait on threads, run in
the default executor; a submit with ``wait_s`` that finds no room at once
waits on a small pool of its own, and the recurring jobs' asks (``every``, a
job's pause, resume and cancel) run on another; a wait for a job's state holds
no thread (the job table tells the loop of each change).
Cancelling an awaiting caller cancels its task if it has not been sent yet
(a handoff never cancels a future: the caller does, here).

The patterns are the very functions ``System`` uses, in their asyncio form
(``cb.gather`` is ``patterns.agather``): an ``AsyncSystem`` fronts its
``System`` (``_submitter.Fronts``), and each pattern awaits the futures the
sync face would block on.

What must hold: one ``AsyncSystem`` builds at most one ``System``, however
many starts overlap, and a start given up leaves none running; it may be
used from any loop in any thread (nothing is tied to the loop it started
on); a submit with ``wait_s`` returns or raises within about ``wait_s``;
a drain given up admits again at once; once ``stop`` has begun nothing is
started, and when it returns no thread of ours is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Never, Self, TypeVar

from callboard import _callbacks, _chain, _gather, _race
from callboard import jobs as _jobs
from callboard._embed import texts_of
from callboard._stream import AsyncChatStream
from callboard._submitter import (
    NO_PROMPT,
    Fronts,
    checked_fields,
    checked_prompts,
    checked_seconds,
    refuse_keywords,
    request_of,
)
from callboard._system import System
from callboard.actors.base import CrashPlan
from callboard.config import SystemConfig
from callboard.jobs import AsyncJobHandle, JobInfo
from callboard.messages import (
    EmbeddingResult,
    InvalidRequestError,
    Priority,
    QueueFullError,
    Result,
    Stats,
    SystemStoppedError,
)
from callboard.runtime.batch import Batch
from callboard.runtime.flag import Flag
from callboard.runtime.handoff import Handoff
from callboard.runtime.io_loop import IoLoop
from callboard.runtime.ledger import Ledger
from callboard.supervisor.supervisor import Escalation

T = TypeVar("T")

ROOM_WAITERS = 32
"""At most this many submits wait for room at once; more queue behind them
(each still within its own ``wait_s``)."""
DRAIN_SLICE_S = 0.1
"""How soon the thread of a drain given up notices it and ends."""
ASKERS = 4
"""Threads for the jobs' short asks of the jobs actor (``every``, a job's pause,
resume and cancel): a pool of their own, so they never queue behind the host's
use of its default executor."""
ALONE = frozenset(("wait_s", "trace_id"))
"""A submit given one of these goes on its own, not with its loop turn's batch."""


class AsyncSystem(Fronts):
    """``async with AsyncSystem() as cb: result = await cb.submit("hi")``."""

    def __init__(
        self,
        config: SystemConfig | None = None,
        *,
        crash_plan: CrashPlan | None = None,
        provider: Any = None,
        ledger: Ledger | str | Path | None = None,
        io_loop: IoLoop | None = None,
    ) -> None:
        """``System``'s arguments, kept for the build at ``start`` (a keyword it does not
        take is refused here, not when the block begins)."""
        self._config = config
        self._kwargs: dict[str, Any] = {
            "crash_plan": crash_plan,
            "provider": provider,
            "ledger": ledger,
            "io_loop": io_loop,
        }
        self._lock = threading.Lock()
        """Guards what follows: starts, stops and submits may come from several loops."""
        self._system: System | None = None
        self._building: Future[System] | None = None
        """The one build in flight, awaited by every start meanwhile."""
        self._starts = 0
        """Starts awaiting ``_building``: when the last gives up, the build is stopped."""
        self._stopping = False
        """``stop`` has begun: nothing more is built, and no waiter thread is started."""
        self._room_waiters = _LazyPool(ROOM_WAITERS, "callboard-wait")
        """Threads for submits that wait for room (``wait_s``): their own pool, so
        they never take the loop's default executor from the host."""
        self._askers = _LazyPool(ASKERS, "callboard-ask")
        """Threads for the jobs' asks (``ASKERS``)."""
        self.failed = Flag()
        """Set if the supervisor gives up (``await cb.failed.wait()`` from whichever loop
        the caller runs on, ``cb.failed.is_set()`` anywhere); see ``failure``."""
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _OnLoop] = (
            weakref.WeakKeyDictionary()
        )
        """The batch and handoff of each loop the system is used from (made under
        ``_lock``); a loop that is gone takes its entry with it."""

    @property
    def system(self) -> System:
        """The ``System`` this face fronts; ``SystemStoppedError`` before ``start``."""
        if self._system is None:
            raise SystemStoppedError("AsyncSystem is not started: use 'async with' or start()")
        return self._system

    async def start(self) -> Self:
        """Build the system (once: overlapping starts share one build).

        A start cancelled while it builds leaves nothing running, unless
        another start still awaits the same build."""
        with self._lock:
            if self._stopping:  # before a system built: a stopped one is no start
                raise SystemStoppedError("this AsyncSystem was stopped: make a new one")
            if self._system is not None:
                return self
            building, launch = self._building, self._building is None
            if building is None:
                building = self._building = Future()
                building.set_running_or_notify_cancel()  # so a waiter cannot cancel it
            self._starts += 1
        if launch:
            asyncio.get_running_loop().run_in_executor(None, self._build, building)
        built = asyncio.wrap_future(building)
        try:
            await asyncio.wait((built,))
        except asyncio.CancelledError:
            built.cancel()  # the build goes on: for the other starts, or to be stopped
            raise
        finally:
            with self._lock:
                self._starts -= 1
        built.result()  # the build's error, if it failed
        return self

    def _build(self, building: Future[System]) -> None:
        """On an executor thread: build, then publish the system, or stop it if
        every start awaiting it gave up (or a stop began) meanwhile."""
        try:
            system = System(self._config, **self._kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to every start awaiting it
            with self._lock:
                self._building = None
            building.set_exception(exc)
            return
        with self._lock:
            self._building = None
            wanted = self._starts > 0 and not self._stopping
            if wanted:
                self._system = system
        if wanted:
            system.on_failure(lambda _: self.failed.set())
            building.set_result(system)
            return
        system.stop(cancel=True, timeout=0.0)
        building.set_exception(SystemStoppedError("start given up: the system it built is stopped"))

    @property
    def failure(self) -> Escalation | None:
        """Why the supervisor gave up (each actor and reason), if it did."""
        return self.system.failure

    async def submit(self, prompt: Any = NO_PROMPT, /, **fields: Any) -> Result:
        """``System.submit``, awaited: the same arguments, the same errors (misuse of
        the arguments is reported before a system stopped)."""
        on_loop = self._on_loop()
        if ALONE.isdisjoint(fields):
            checked_fields(fields, "submit", ("prompt", "messages"))
            future = await on_loop.batch.submit(request_of(prompt, fields))
        else:
            future = await self._admitted(self.system.submit, prompt, fields)
        return await on_loop.handoff.settled(future)

    def stream(self, prompt: Any = NO_PROMPT, /, **fields: Any) -> AsyncChatStream:
        """``System.stream`` for asyncio: ``async for delta in cb.stream("...")``, then
        ``await stream.result()``. Submitted at once (a full queue answers the stream
        with ``Rejected``, raised as ``StreamFailedError`` when it is read)."""
        if "wait_s" in fields:
            raise InvalidRequestError("stream() takes no wait_s here: it never blocks")
        self._earlier_first()
        return AsyncChatStream.of(self.system.stream(prompt, **fields))

    async def embed(
        self,
        texts: str | Sequence[int] | Sequence[str | Sequence[int]],
        /,
        *,
        model: str | None = None,
        dimensions: int | None = None,
        encoding_format: Literal["float", "base64"] | None = None,
        keep_base64: bool = False,
        priority: Priority | str | int = Priority.NORMAL,
        route: str | None = None,
        budget_tag: str | None = None,
        deadline_s: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        user: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        trace_id: str | None = None,
        wait_s: float | None = None,
        **unknown: Never,
    ) -> EmbeddingResult:
        """``System.embed``, awaited: the same arguments, the same errors. Cancelling the
        caller cancels the calls not sent yet."""
        refuse_keywords(unknown, "embed", System.embed)
        fields: dict[str, Any] = {
            "model": model,
            "dimensions": dimensions,
            "encoding_format": encoding_format,
            "keep_base64": keep_base64,
            "priority": priority,
            "route": route,
            "budget_tag": budget_tag,
            "deadline_s": deadline_s,
            "metadata": metadata,
            "user": user,
            "extra_body": extra_body,
            "trace_id": trace_id,
            "wait_s": wait_s,
        }
        wait_s = checked_seconds(wait_s, "wait_s")
        on_loop = self._on_loop()
        on_loop.batch.flush()  # what this loop submitted before goes first
        if not wait_s:
            future = self.system.embed(texts, **fields)
        else:  # it waits for room a chunk at a time: on a waiter thread, the loop runs on
            texts_of(texts)  # misuse raises here, before a thread is taken
            deadline = time.monotonic() + wait_s
            future = await self._when_room(self.system.embed, texts, fields, deadline, count=1)
        return await on_loop.handoff.settled(future)

    async def submit_many(self, prompts: Iterable[Any], /, **fields: Any) -> list[Result]:
        """``System.submit_many``, awaited: the results in input order."""
        listed = list(checked_prompts(prompts, "submit_many"))
        on_loop = self._on_loop()
        futures = await self._admitted(self.system.submit_many, listed, fields)
        handoff = on_loop.handoff
        waiters = [handoff.watch(f) for f in futures]
        try:
            return list(await asyncio.gather(*waiters))
        except asyncio.CancelledError:  # the caller's (gather cancels every waiter), or a task's
            for waiter, future in zip(waiters, futures, strict=True):
                if waiter.cancelled():
                    future.cancel()  # the queue drops it if it was not sent
            raise

    def _on_loop(self) -> _OnLoop:
        """The batch and handoff of the running loop, made the first time it is used
        here (``SystemStoppedError`` before ``start``)."""
        loop = asyncio.get_running_loop()
        on_loop = self._loops.get(loop)
        if on_loop is None:
            system = self.system
            with self._lock:
                batch = Batch(system)  # the callers a delivery wakes submit together
                on_loop = self._loops.setdefault(loop, _OnLoop(batch, Handoff(batch.open_turn)))
        return on_loop

    def _earlier_first(self) -> None:
        """Hand over what the running loop's batch holds, if any: a submit that goes
        on its own must not overtake the ones this loop made before it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called off any loop (stream): no batch either
            return
        on_loop = self._loops.get(loop)
        if on_loop is not None:
            on_loop.batch.flush()

    async def _admitted(
        self,
        submit: Callable[..., T],
        what: Any,
        fields: dict[str, Any],
        *,
        count: int | None = None,
    ) -> T:
        """``submit(what, **fields)``; with ``wait_s``, if there is no room at once,
        on a thread of our own, so the loop runs meanwhile. ``count``: the tasks it
        submits (default: one per item of a list ``what``, else one). What this
        loop's batch holds goes first."""
        wait_s = checked_seconds(fields.get("wait_s"), "wait_s")
        self._earlier_first()
        if not wait_s:
            return submit(what, **fields)
        deadline = time.monotonic() + wait_s
        try:
            return submit(what, **{**fields, "wait_s": 0.0})  # room now: no thread needed
        except QueueFullError:
            if wait_s <= 0:
                raise
        if count is None:
            count = len(what) if isinstance(what, list) else 1
        return await self._when_room(submit, what, fields, deadline, count)

    async def _when_room(
        self,
        submit: Callable[..., T],
        what: Any,
        fields: dict[str, Any],
        deadline: float,
        count: int,
    ) -> T:
        """Submit on a waiter thread, for what is left until ``deadline``. A submit
        still queued for a thread at its deadline is given up (``QueueFullError``);
        a caller cancelled meanwhile cancels what the submit then returns."""
        given_up = threading.Event()
        room = functools.partial(self.system.ledger.wait_for_room, self.system.admission.capacity)
        work = self._on_pool(
            self._room_waiters,
            functools.partial(
                _submit_by,
                submit,
                what,
                fields,
                deadline,
                room=room,
                count=count,
                given_up=given_up,
                stop_begun=functools.partial(getattr, self.system, "stop_begun"),
            ),
        )
        waited = asyncio.wrap_future(work)
        try:
            done, _ = await asyncio.wait((waited,), timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                if work.cancel():  # no waiter thread came free in time
                    capacity = self.system.admission.capacity
                    raise QueueFullError(
                        f"queue stayed full ({capacity} tasks) for {fields['wait_s']} s"
                    )
                await asyncio.wait((waited,))  # it has started: its own wait_s ends it
        except asyncio.CancelledError:
            given_up.set()  # a waiter that has not submitted yet never will
            waited.cancel()
            work.add_done_callback(_cancel_what_was_submitted)  # nobody would read it
            raise
        if waited.cancelled():  # a stop cancelled it before a waiter thread took it
            raise SystemStoppedError("callboard stopped while the submit waited for room")
        submitted = waited.result()
        assert submitted is not None  # None only for a caller that gave up, who never reads it
        return submitted

    def _on_pool(self, pool: _LazyPool, fn: Callable[[], T]) -> Future[T]:
        """``fn`` on a thread of ``pool``; ``SystemStoppedError`` once a stop began (a
        pool is never made after it: the stop has taken the pools it shuts down)."""
        with self._lock:
            if self._stopping:
                raise SystemStoppedError("callboard is stopped")
            return pool.submit(fn)

    # -- patterns: the functions of callboard.patterns, in their asyncio form -------

    gather = _gather.agather
    as_completed = _gather.aas_completed
    race = _race.arace
    chain = _chain.achain
    fire_and_forget = _callbacks.fire_and_forget

    async def every(
        self,
        interval: str | float,
        request: Any,
        *,
        run_immediately: bool = False,
        max_runs: int | None = None,
        max_cost: Decimal | str | float | None = None,
        timeout: float | None = None,
        name: str | None = None,
        **unknown: Never,
    ) -> AsyncJobHandle:
        """``System.every``, awaited: its arguments checked here (misuse is reported
        before a system stopped), its ask of the jobs actor on a thread of our own; the
        handle's asks and waits are awaited too."""
        spec = _jobs.job_spec(
            self.system,
            interval,
            request,
            run_immediately=run_immediately,
            max_runs=max_runs,
            max_cost=max_cost,
            timeout=timeout,
            name=name,
            **unknown,
        )
        handle = await self._asked(functools.partial(_jobs.start_job, self.system, spec))
        return AsyncJobHandle(handle, self._asked)

    async def _asked(self, ask: Callable[[], T]) -> T:
        """``ask()`` (a short ask of the jobs actor) on a thread of the askers' pool,
        not the host's default executor: six job waits took all of that on two cores,
        and a job's ``cancel`` queued behind them for ever (found by a hunt)."""
        asked = asyncio.wrap_future(self._on_pool(self._askers, ask))
        try:
            await asyncio.wait((asked,))
        except asyncio.CancelledError:
            asked.cancel()  # not begun yet, the ask is never made
            raise
        if asked.cancelled():  # a stop refused it while it was queued
            raise SystemStoppedError("callboard stopped before the job's ask was made")
        return asked.result()

    def jobs(self) -> list[JobInfo]:
        """``System.jobs``: the recurring jobs (read from the job table, never blocks)."""
        return _jobs.jobs(self.system)

    async def stats(self) -> Stats:
        return await asyncio.to_thread(self.system.stats)

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting, wait for every accepted task to finish, admit again.

        True if idle. A drain cancelled (or timed out by ``asyncio.wait_for``)
        admits again at once."""
        timeout = checked_seconds(timeout, "timeout")
        system = self.system
        given_up = threading.Event()
        system.admission.hold("draining")
        try:
            return await asyncio.to_thread(_wait_idle, system.ledger, timeout, given_up)
        finally:
            given_up.set()
            system.admission.release()  # open again unless a stop or a spent budget closed it

    async def stop(self, *, cancel: bool = False, timeout: float | None = 30.0) -> None:
        """Stop the system (see ``System.stop``) and the threads waiting for room.

        Once begun, a stop runs to its end on a thread: cancelling the caller
        does not cut it short. When it returns, no thread of ours is left. The
        thread is a daemon, not the loop's executor's: ``asyncio.run`` joins that
        at its end, so a second Ctrl-C (``asyncio.run`` cancels what awaits the
        stop, then ends) waited for every call in flight; now the process ends."""
        timeout = checked_seconds(timeout, "timeout")
        with self._lock:
            self._stopping = True
            system, building = self._system, self._building
            pools = (self._room_waiters.take(), self._askers.take())
        done, thread = _on_daemon(_stop, system, building, pools, cancel, timeout)
        await asyncio.shield(done)
        thread.join(JOIN_S)  # it ends as it settles ``done``: then no thread of ours is left

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop (``stop``), with ``cancel=True`` when the block ends by an exception or
        a cancellation: the queued tasks end ``Cancelled`` and the calls in flight get
        up to 30 s to answer, as for ``with System()``. A second cancellation (a second
        Ctrl-C) stops the waiting, the stop going on on its own thread. A block that
        must end at its timeout (``asyncio.timeout``, ``wait_for``: the cancellation
        that ends it is the first) stops first itself, ``await cb.stop(cancel=True,
        timeout=0)``."""
        await self.stop(cancel=exc is not None)


class _OnLoop:
    """What ``AsyncSystem`` keeps for one event loop: its submits' batch and its
    results' handoff (both serve that loop only)."""

    __slots__ = ("batch", "handoff")

    def __init__(self, batch: Batch, handoff: Handoff) -> None:
        self.batch = batch
        self.handoff = handoff


def _submit_by(
    submit: Callable[..., T],
    what: Any,
    fields: dict[str, Any],
    deadline: float,
    *,
    room: Callable[[int, float], bool],
    count: int,
    given_up: threading.Event,
    stop_begun: Callable[[], bool],
) -> T | None:
    """On a waiter thread, which may have come free late: wait for room only what is
    left, in slices, and submit only if the caller still wants it (None if not): a
    caller cancelled while waiting must not have its request sent after all. Room a
    stop made while it waited is not for it (``SystemStoppedError``, as ``System``'s
    own wait)."""
    began = stop_begun()
    while not given_up.is_set():
        left = deadline - time.monotonic()
        if room(count, min(DRAIN_SLICE_S, max(0.0, left))) and not given_up.is_set():
            if not began and stop_begun():
                raise SystemStoppedError("callboard stopped while the submit waited for room")
            return submit(what, **{**fields, "wait_s": max(0.0, deadline - time.monotonic())})
        if left <= 0:
            return submit(what, **{**fields, "wait_s": 0.0})  # raises QueueFullError: full
    return None


def _wait_idle(ledger: Ledger, timeout: float | None, given_up: threading.Event) -> bool:
    """``ledger.wait_idle(timeout)`` in slices, ending soon after ``given_up`` is set."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not given_up.is_set():
        left = DRAIN_SLICE_S if deadline is None else deadline - time.monotonic()
        if ledger.wait_idle(max(0.0, min(left, DRAIN_SLICE_S))):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
    return False


JOIN_S = 1.0
"""How long a stop waits for its thread to end once it said it had (a moment)."""


def _on_daemon(
    fn: Callable[..., None], *args: Any
) -> tuple[asyncio.Future[None], threading.Thread]:
    """``fn(*args)`` on a daemon thread of its own; its end (or error) on this loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            _settle(loop, done, exc)
        else:
            _settle(loop, done, None)

    thread = threading.Thread(target=run, name="callboard-stop", daemon=True)
    thread.start()
    return done, thread


def _settle(
    loop: asyncio.AbstractEventLoop, done: asyncio.Future[None], exc: BaseException | None
) -> None:
    def settle() -> None:
        if done.done():
            return
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

    with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits the stop
        loop.call_soon_threadsafe(settle)


class _LazyPool:
    """A thread pool made on its first ``submit``; ``take`` hands it over (to be shut
    down) and leaves none. Its owner's lock guards both."""

    __slots__ = ("_pool", "_prefix", "_size")

    def __init__(self, size: int, prefix: str) -> None:
        self._size = size
        self._prefix = prefix
        self._pool: ThreadPoolExecutor | None = None

    def __bool__(self) -> bool:
        """Whether the pool has been made (and not taken)."""
        return self._pool is not None

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._size, thread_name_prefix=self._prefix)
        return self._pool.submit(fn)

    def take(self) -> ThreadPoolExecutor | None:
        pool, self._pool = self._pool, None
        return pool


def _stop(
    system: System | None,
    building: Future[System] | None,
    pools: tuple[ThreadPoolExecutor | None, ...],
    cancel: bool,
    timeout: float | None,
) -> None:
    try:
        if building is not None:  # it sees the stop and stops what it built
            futures.wait((building,))
        if system is not None:
            system.stop(cancel=cancel, timeout=timeout)
    finally:
        for pool in pools:  # the waits and asks ended with the stop; queued ones are refused
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


def _cancel_what_was_submitted(work: Future[Any]) -> None:
    if work.cancelled() or work.exception() is not None:
        return
    done = work.result()
    if done is None:  # the caller gave up before it was submitted
        return
    for future in done if isinstance(done, list) else (done,):
        future.cancel()
