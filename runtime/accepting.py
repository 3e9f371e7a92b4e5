"""Stop an aiohttp server's sites accepting before they are closed, so that no
connection accepted as they close is left half-made and open.

On asyncio's selector loop, accepting a connection takes three loop turns: the
listening socket's reader accepts it and schedules a task; the task's first step
builds the transport, which attaches itself to the listening ``asyncio.Server``;
the protocol's ``connection_made`` runs a turn later. ``BaseSite.stop()`` closes
that Server at once; a task that steps after the close fails in
``Server._attach()`` (``assert self._sockets is not None``, CPython gh-109564),
the loop swallows the error (reported only in debug mode), and the transport,
already holding the accepted socket, is handed to nobody: aiohttp never sees the
connection (``AppRunner.cleanup()`` shuts down only the connections it saw), and
nothing closes it. The garbage collector finds it later, in whatever test or
request is running then: ``ResourceWarning: unclosed transport
<_SelectorSocketTransport ...>``.

``stop_accepting`` removes the listening sockets' readers (nothing new is
accepted; the kernel queues or refuses what comes), then lets the loop turn three
times, so every connection already accepted becomes one the server knows, which
``cleanup()`` then closes with the others. uvloop accepts and attaches in one
callback: nothing to do there.
"""

from __future__ import annotations

import asyncio
from asyncio.selector_events import BaseSelectorEventLoop
from collections.abc import Iterable

from aiohttp import web

__all__ = ["stop_accepting"]

_TURNS = 3
"""Accept (the reader), attach (the task's first step), ``connection_made``."""


async def stop_accepting(sites: Iterable[web.BaseSite]) -> None:
    """Stop ``sites`` accepting, and return once what they accepted reached the server."""
    loop = asyncio.get_running_loop()
    if not isinstance(loop, BaseSelectorEventLoop):
        return
    for site in sites:
        server = site._server  # aiohttp keeps its asyncio.Server there (no public name)
        if isinstance(server, asyncio.base_events.Server):
            for sock in server.sockets:
                loop.remove_reader(sock.fileno())
    for _ in range(_TURNS):
        await asyncio.sleep(0)
