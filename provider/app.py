"""The simulated provider's HTTP face: aiohttp handlers that carry out core plans.

Everything here runs on one event loop, the server's. Invariants:
- the server listens on loopback only;
- every chat request that reaches the handler is counted on arrival and
  leaves ``in_flight`` exactly once, however it ends (answer, drop, hang,
  client disconnect, shutdown);
- a hang ends at ``hang_s``, when the client disconnects (the handler is
  cancelled) or when `ProviderApp.close` starts, whichever is first;
- the API key, if any, is compared in constant time and never echoed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import itertools
import json
import math
import socket
import time

from aiohttp import web
from callboard.provider.behaviour import behaviour_from_json
from callboard.provider.counters import Counters
from callboard.provider.engine import Outcome, Plan, ProviderCore
from callboard.provider.wire import (
    BadRequestError,
    completion_body,
    error_body,
    models_body,
    parse_chat,
)

__all__ = ["ProviderApp", "check_loopback", "check_port"]

_GRACE_S = 0.5
"""How long close() lets in-flight requests finish before cancelling them."""
_MAX_BODY = 16 * 1024 * 1024
_MAX_PORT = 65535
_MALFORMED = b'{"id": "chatcmpl-malformed", "object": "chat.completion", "choices": [{'


def check_loopback(host: str) -> str:
    """``host`` as an IP literal, or `ValueError` if it is not a loopback address.

    ``localhost`` means 127.0.0.1 and ``[::1]`` means ::1; anything else must be
    an IP literal that is loopback (``127.0.0.1.5`` and ``127.300.0.1`` are not).
    """
    if host == "localhost":
        return "127.0.0.1"
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(literal)
    except ValueError:
        address = None
    if address is None or not address.is_loopback:
        raise ValueError(f"the simulated provider listens on loopback only, not {host!r}")
    return str(address)


def check_port(port: int) -> int:
    """``port`` if it is 0 (any free port) to 65535, else `ValueError`."""
    if not 0 <= port <= _MAX_PORT:
        raise ValueError(f"port must be 0 (any free port) to {_MAX_PORT}, not {port}")
    return port


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, reuse_port=False)


class ProviderApp:
    """The aiohttp server for one `ProviderCore`; create and use it on the server loop."""

    def __init__(self, core: ProviderCore, *, host: str, port: int, api_key: str | None) -> None:
        self.core = core
        self.host = check_loopback(host)
        self.port = check_port(port)
        self._auth = None if api_key is None else f"Bearer {api_key}".encode()
        self._closing = asyncio.Event()
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None

    async def start(self) -> int:
        """Listen; return the bound port."""
        app = web.Application(client_max_size=_MAX_BODY)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/stats/reset", self._reset)
        app.router.add_post("/admin/models/{name}", self._admin)
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=_GRACE_S
        )
        await runner.setup()
        self._runner = runner
        self.core.mark_started()
        await self.resume()
        return self.port

    async def resume(self) -> None:
        """Listen (again) on ``self.port``; 0 picks a free port once."""
        if self._site is not None or self._runner is None:
            return
        sock = _listening_socket(self.host, self.port)
        try:
            site = web.SockSite(self._runner, sock)
            await site.start()
        except BaseException:
            sock.close()
            raise
        self._site = site
        self.port = sock.getsockname()[1]

    async def pause(self) -> None:
        """Stop listening (new connections are refused); drop open ones, busy or idle."""
        if self._site is None:
            return
        site, self._site = self._site, None
        await site.stop()
        server = self._runner.server if self._runner is not None else None
        for connection in server.connections if server is not None else ():
            connection.force_close()

    async def close(self) -> None:
        """End hangs, stop listening, and shut the server down."""
        self._closing.set()
        self._site = None
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if self._auth is not None and not self._authorized(request):
            return self._refuse(self.core.total, _unauthorized())
        try:
            chat = parse_chat(await request.read())
        except BadRequestError as exc:
            body = error_body(exc.message, "invalid_request_error", param=exc.param)
            return self._refuse(self.core.total, web.json_response(body, status=400))
        state = self.core.state(chat.model)
        counters = state.counters
        counters.arrive(self.core.elapsed())
        try:
            plan = self.core.plan(state, chat.prompt_tokens, chat.max_tokens)
            return await self._carry_out(request, chat.model, plan, counters)
        finally:
            counters.leave()

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        return self._auth is not None and hmac.compare_digest(given, self._auth)

    def _refuse(self, counters: Counters, response: web.Response) -> web.Response:
        counters.arrive(self.core.elapsed())
        counters.respond(response.status)
        counters.leave()
        return response

    async def _carry_out(
        self, request: web.Request, model: str, plan: Plan, counters: Counters
    ) -> web.StreamResponse:
        outcome = plan.outcome
        if outcome is Outcome.DROP:
            counters.fault(dropped=True)
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=204)
        if outcome is Outcome.HANG:
            counters.fault(dropped=False)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), plan.delay_s)
        elif plan.delay_s > 0.0:
            await asyncio.sleep(plan.delay_s)
        response = _respond(model, plan, next(self._ids))
        counters.respond(response.status)
        if outcome is Outcome.OK:
            counters.served(plan.prompt_tokens, plan.completion_tokens)
        return response

    async def _models(self, request: web.Request) -> web.Response:
        if self._auth is not None and not self._authorized(request):
            return _unauthorized()
        return web.json_response(models_body(self.core.model_names()))

    async def _stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.core.stats())

    async def _reset(self, _request: web.Request) -> web.Response:
        self.core.reset_stats()
        return web.json_response({"reset": True})

    async def _admin(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            fields = json.loads(await request.read())
            behaviour = behaviour_from_json(fields, self.core.behaviour(name))
            self.core.configure(name, behaviour)  # ValueError past MAX_MODELS
        except (TypeError, ValueError) as exc:
            body = error_body(str(exc), "invalid_request_error")
            return web.json_response(body, status=400)
        return web.json_response({"model": name, "behaviour": dataclasses.asdict(behaviour)})


def _respond(model: str, plan: Plan, seq: int) -> web.Response:
    """The HTTP response for a plan that answers (anything but a drop)."""
    headers = dict(plan.headers)
    outcome = plan.outcome
    if outcome is Outcome.OK:
        body = completion_body(
            completion_id=f"chatcmpl-{seq:024x}",
            model=model,
            created=int(time.time()),
            prompt_tokens=plan.prompt_tokens,
            completion_tokens=plan.completion_tokens,
            finish_reason=plan.finish_reason,
        )
        return web.json_response(body, headers=headers)
    if outcome is Outcome.MALFORMED:
        return web.Response(body=_MALFORMED, content_type="application/json", headers=headers)
    if plan.retry_after_s is not None:
        headers["retry-after"] = str(math.ceil(plan.retry_after_s))
        headers["retry-after-ms"] = str(math.ceil(plan.retry_after_s * 1000))
    return web.json_response(_error_for(model, plan), status=plan.status, headers=headers)


def _error_for(model: str, plan: Plan) -> dict[str, object]:
    refusal = plan.refusal
    if refusal is not None:
        per = "requests per min (RPM)" if refusal.kind == "requests" else "tokens per min (TPM)"
        message = (
            f"Rate limit reached for {model} on {per}. Please try again in {refusal.wait_s:.3f}s."
        )
        return error_body(message, refusal.kind, code="rate_limit_exceeded")
    if plan.outcome is Outcome.HANG:
        return error_body("The request timed out.", "timeout", code="timeout")
    kind, message = _STATUS_ERRORS.get(plan.status, ("server_error", "Simulated error."))
    if plan.outcome is Outcome.FORCED and plan.status == 429:
        return error_body(message, kind, code="rate_limit_exceeded")
    return error_body(message, kind)


_STATUS_ERRORS = {
    400: ("invalid_request_error", "Simulated bad request."),
    401: ("invalid_request_error", "Incorrect API key provided."),
    403: ("permission_error", "You are not allowed to access this model."),
    404: ("invalid_request_error", "The model does not exist or you do not have access to it."),
    429: ("requests", "Rate limit reached. Please try again later."),
    500: ("server_error", "The server had an error while processing your request."),
    503: ("server_error", "The engine is currently overloaded, please try again later."),
}


def _unauthorized() -> web.Response:
    message = "Incorrect API key provided. You can find your API key in your account settings."
    body = error_body(message, "invalid_request_error", code="invalid_api_key")
    return web.json_response(body, status=401)
