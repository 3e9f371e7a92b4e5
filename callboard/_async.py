"""``AsyncSystem``: the asyncio face. Awaiting never blocks the host's loop.

Each result future is a ``concurrent.futures.Future`` resolved on an actor
thread; ``asyncio.wrap_future`` carries it to the caller's loop with one
``call_soon_threadsafe`` (never ``await`` a pykka future: that blocks the
loop). Start-up, stats and shutdown, which wait on threads, run in the
default executor; a submit with ``wait_s`` (it may block for room) waits on a
small pool of its own.
Cancelling an awaiting caller cancels its task if it has not been sent yet.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

from callboard.messages import Result, SystemStoppedError
from callboard.messages._stats import Stats
from callboard.supervisor.supervisor import Escalation

from . import jobs as _jobs
from . import patterns
from ._system import System
from .config import SystemConfig
from .jobs import JobHandle, JobInfo
from .patterns import ChainResult, ErrorCallback, RaceResult, ResultCallback, Stage

T = TypeVar("T")

ROOM_WAITERS = 32
"""At most this many submits wait for room at once; more queue behind them."""


class AsyncSystem:
    """``async with AsyncSystem() as cb: result = await cb.submit("hi")``."""

    def __init__(self, config: SystemConfig | None = None, **kwargs: Any) -> None:
        self._config = config
        self._kwargs = kwargs
        self._system: System | None = None
        self._room_waiters: ThreadPoolExecutor | None = None
        """Threads for submits that wait for room (``wait_s``): their own pool, so
        they never take the loop's default executor from the host."""
        self.failed = asyncio.Event()
        """Set (on the host's loop) if the supervisor gives up; see ``failure``."""

    @property
    def system(self) -> System:
        if self._system is None:
            raise SystemStoppedError("AsyncSystem is not started: use 'async with' or start()")
        return self._system

    async def start(self) -> Self:
        if self._system is None:
            self._system = await asyncio.to_thread(System, self._config, **self._kwargs)
            loop = asyncio.get_running_loop()
            self._system.on_failure(lambda _: loop.call_soon_threadsafe(self.failed.set))
        return self

    @property
    def failure(self) -> Escalation | None:
        """Why the supervisor gave up (each actor and reason), if it did."""
        return self.system.failure

    async def submit(self, prompt: Any, /, **fields: Any) -> Result:
        future = await self._admitted(self.system.submit, prompt, fields)
        return await asyncio.wrap_future(future)

    async def submit_many(self, prompts: Iterable[Any], /, **fields: Any) -> list[Result]:
        futures = await self._admitted(self.system.submit_many, list(prompts), fields)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    async def _admitted(self, submit: Callable[..., T], what: Any, fields: dict[str, Any]) -> T:
        """``submit(what, **fields)``; with ``wait_s`` (it may block for room) on a
        thread of our own, so the loop runs meanwhile. A caller cancelled while it
        waits cancels what the submit then returns (nobody would read it)."""
        if not fields.get("wait_s"):
            return submit(what, **fields)
        if self._room_waiters is None:
            self._room_waiters = ThreadPoolExecutor(
                max_workers=ROOM_WAITERS, thread_name_prefix="callboard-wait"
            )
        work = asyncio.get_running_loop().run_in_executor(
            self._room_waiters, functools.partial(submit, what, **fields)
        )
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(_cancel_what_was_submitted)
            raise

    async def gather(
        self,
        prompts: Iterable[Any],
        /,
        *,
        return_when: Literal["all", "first"] = "all",
        timeout: float | None = None,
        **fields: Any,
    ) -> list[Result] | Result:
        return await patterns.agather(
            self, prompts, return_when=return_when, timeout=timeout, **fields
        )

    def stream(
        self, futures_or_prompts: Iterable[Any], timeout: float | None = None, **fields: Any
    ) -> AsyncIterator[Result]:
        """Results as they finish (``async for``)."""
        return patterns.stream_results(self, futures_or_prompts, timeout, **fields)

    async def race(
        self, prompt: Any, /, models: Sequence[str], *, timeout: float | None = None, **fields: Any
    ) -> RaceResult:
        return await patterns.arace(self, prompt, models, timeout=timeout, **fields)

    async def chain(
        self,
        stages: Sequence[Stage],
        first_input: str,
        /,
        *,
        trace_id: str | None = None,
        **fields: Any,
    ) -> ChainResult:
        return await patterns.achain(self, stages, first_input, trace_id=trace_id, **fields)

    def fire_and_forget(
        self,
        prompt: Any,
        /,
        *,
        on_error: ErrorCallback,
        on_result: ResultCallback | None = None,
        **fields: Any,
    ) -> Future[Result] | None:
        return patterns.fire_and_forget(
            self, prompt, on_error=on_error, on_result=on_result, **fields
        )

    async def every(self, interval: str | float, request: Any, **options: Any) -> JobHandle:
        return await asyncio.to_thread(_jobs.every, self.system, interval, request, **options)

    def jobs(self) -> list[JobInfo]:
        return _jobs.jobs(self.system)

    async def stats(self) -> Stats:
        return await asyncio.to_thread(self.system.stats)

    async def drain(self, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.system.drain, timeout)

    async def stop(self, *, cancel: bool = False, timeout: float = 30.0) -> None:
        if self._system is not None:
            await asyncio.to_thread(self._system.stop, cancel=cancel, timeout=timeout)
        if self._room_waiters is not None:  # their waits ended with the stop
            self._room_waiters.shutdown(wait=False, cancel_futures=True)
            self._room_waiters = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop(cancel=exc is not None)


def _cancel_what_was_submitted(work: asyncio.Future[Any]) -> None:
    if work.cancelled() or work.exception() is not None:
        return
    done = work.result()
    for future in done if isinstance(done, list) else (done,):
        future.cancel()
