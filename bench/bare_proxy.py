"""The floor under any gateway: a bare reverse proxy on aiohttp, for the ``gateway`` scenario.

``callboard serve`` parses each request, schedules it through the actors and
calls the provider; a gateway that did nothing at all would still pay for one
more HTTP server and one more HTTP client between the caller and the provider.
This process pays exactly that and nothing else: an ``aiohttp.web`` server
(uvloop when installed, as ``callboard serve`` runs) whose one handler posts the
request's body, unread and unparsed, to the provider through one shared
``aiohttp.ClientSession`` and answers with the provider's status and body. No
validation, no scheduling, no limits, no threads: what the gateway's figures
would be if callboard's own work cost nothing.

Run as the bench's child: ``python -m callboard.bench.bare_proxy --upstream URL``;
it announces ``bare proxy listening on URL`` on stdout and exits when its stdin
closes (the bench may die without stopping it), or on SIGTERM or SIGINT.

What must hold: it listens on loopback only; every request gets an answer (a
502 when the provider cannot be reached), so the generator never waits on it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
from collections.abc import Sequence

import aiohttp
from aiohttp import web
from callboard.runtime.io_loop import new_event_loop

__all__ = ["ANNOUNCEMENT", "main"]

ANNOUNCEMENT = "bare proxy listening on "


def app(upstream: str) -> web.Application:
    """The proxy: ``POST {path}`` goes to ``{upstream}{path minus /v1}`` as it came."""
    application = web.Application()
    base = upstream.rstrip("/")
    sessions: list[aiohttp.ClientSession] = []

    async def open_session(_: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0)  # the generator bounds what is in flight
        sessions.append(aiohttp.ClientSession(connector=connector))

    async def close_session(_: web.Application) -> None:
        for session in sessions:
            await session.close()

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        url = base + request.path.removeprefix("/v1")
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        try:
            async with sessions[0].post(url, data=body, headers=headers) as answer:
                payload = await answer.read()
                return web.Response(
                    status=answer.status, body=payload, content_type=answer.content_type
                )
        except aiohttp.ClientError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=502)

    application.on_startup.append(open_session)
    application.on_cleanup.append(close_session)
    application.router.add_post("/{tail:.*}", forward)
    return application


async def _serve(upstream: str) -> None:
    runner = web.AppRunner(app(upstream), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def watch() -> None:
        sys.stdin.read()  # returns at EOF: the bench is gone or stopping us
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch, name="stdin-eof", daemon=True).start()
    host, port = runner.addresses[0][:2]
    sys.stdout.write(f"{ANNOUNCEMENT}http://{host}:{port}/v1\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m callboard.bench.bare_proxy")
    parser.add_argument("--upstream", required=True, help="the provider's base URL (.../v1)")
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(_serve(args.upstream))
    return 0


if __name__ == "__main__":
    sys.exit(main())
