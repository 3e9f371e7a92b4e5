"""``stop_accepting``: a server that stops accepting before its runner's cleanup closes
even the connection it accepted in the loop turn it was told to stop (CPython
gh-109564: accepted then, it never reached aiohttp, and only the collector found it).
The tests' ``WireServer`` stops so; the servers that use it too (the provider's, the
gateway's) test their own stops."""

from __future__ import annotations

from loopback import WireServer, answer
from support import accepted_as_it_stops


def test_what_was_accepted_as_the_server_stopped_is_closed_by_its_cleanup() -> None:
    server = WireServer(answer())
    server.__enter__()
    accepted_as_it_stops(server._loop, server.port, lambda: server.__exit__(None, None, None))
