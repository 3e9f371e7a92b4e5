"""The bare proxy (bench/bare_proxy.py): a request's body goes to the upstream as it came
and the upstream's status and body come back; an upstream nobody answers on gives 502."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
from aiohttp import web
from callboard.bench.bare_proxy import app


async def _started(application: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(application, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}/v1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_body_goes_upstream_untouched_and_the_answer_comes_back() -> None:
    seen: list[tuple[str, bytes]] = []

    async def upstream_handler(request: web.Request) -> web.Response:
        seen.append((request.path, await request.read()))
        return web.json_response({"error": {"message": "slow down"}}, status=429)

    async def scenario() -> tuple[int, dict[str, object]]:
        upstream = web.Application()
        upstream.router.add_post("/v1/chat/completions", upstream_handler)
        up_runner, up_url = await _started(upstream)
        proxy_runner, proxy_url = await _started(app(up_url))
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{proxy_url}/chat/completions", data=b'{"model": "m"}') as answer,
            ):
                return answer.status, json.loads(await answer.read())
        finally:
            await proxy_runner.cleanup()
            await up_runner.cleanup()

    status, body = asyncio.run(scenario())
    assert (status, body) == (429, {"error": {"message": "slow down"}})
    assert seen == [("/v1/chat/completions", b'{"model": "m"}')]


def test_an_upstream_nobody_answers_on_gives_502() -> None:
    async def scenario() -> int:
        proxy_runner, proxy_url = await _started(app(f"http://127.0.0.1:{_free_port()}/v1"))
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{proxy_url}/chat/completions", data=b"{}") as answer,
            ):
                return answer.status
        finally:
            await proxy_runner.cleanup()

    assert asyncio.run(scenario()) == 502
