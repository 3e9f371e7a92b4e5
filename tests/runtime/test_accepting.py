"""``stop_accepting``: a server that stops accepting before its runner's cleanup closes
even the connection it accepted in the loop turn it was told to stop (CPython
gh-109564: accepted then, it never reached aiohttp, and only the collector found it).
The servers that use it (the provider's, the gateway's) test their own stops."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web
from callboard.runtime.accepting import stop_accepting
from support import WAIT_S, accepted_as_it_stops


class _Server:
    """An aiohttp runner on a selector loop of its own, stopped by ``stop``."""

    def __init__(self) -> None:
        self.loop = asyncio.SelectorEventLoop()
        self.port = 0
        self._ready = threading.Event()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(WAIT_S)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(WAIT_S)

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self._main())
        finally:
            self.loop.close()

    async def _main(self) -> None:
        runner = web.AppRunner(web.Application(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = runner.addresses[0][1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await stop_accepting(runner.sites)
            await runner.cleanup()


def test_what_was_accepted_as_the_server_stopped_is_closed_by_its_cleanup() -> None:
    server = _Server()
    server.start()
    accepted_as_it_stops(server.loop, server.port, server.stop)
