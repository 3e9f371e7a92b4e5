"""``AsyncSystem``: the asyncio face. Awaiting never blocks the host's loop.

Each result future is a ``concurrent.futures.Future`` resolved on an actor
thread; ``asyncio.wrap_future`` carries it to the caller's loop with one
``call_soon_threadsafe`` (never ``await`` a pykka future: that blocks the
loop). Start-up, stats and shutdown, which wait on threads, run in the
default executor. Cancelling an awaiting caller cancels its task if it has
not been sent yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

from callboard.messages import Result, SystemStoppedError
from callboard.messages._stats import Stats

from ._system import System
from .config import SystemConfig


class AsyncSystem:
    """``async with AsyncSystem() as cb: result = await cb.submit("hi")``."""

    def __init__(self, config: SystemConfig | None = None, **kwargs: Any) -> None:
        self._config = config
        self._kwargs = kwargs
        self._system: System | None = None

    @property
    def system(self) -> System:
        if self._system is None:
            raise SystemStoppedError("AsyncSystem is not started: use 'async with' or start()")
        return self._system

    async def start(self) -> Self:
        if self._system is None:
            self._system = await asyncio.to_thread(System, self._config, **self._kwargs)
        return self

    async def submit(self, prompt: Any, /, **fields: Any) -> Result:
        return await asyncio.wrap_future(self.system.submit(prompt, **fields))

    async def submit_many(self, prompts: Iterable[Any], /, **fields: Any) -> list[Result]:
        futures = self.system.submit_many(prompts, **fields)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    async def stats(self) -> Stats:
        return await asyncio.to_thread(self.system.stats)

    async def drain(self, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.system.drain, timeout)

    async def stop(self, *, cancel: bool = False, timeout: float = 30.0) -> None:
        if self._system is not None:
            await asyncio.to_thread(self._system.stop, cancel=cancel, timeout=timeout)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop(cancel=exc is not None)
