"""``callboard serve``: callboard's scheduler behind OpenAI's and Anthropic's APIs.

Any OpenAI or Anthropic SDK can point its ``base_url`` at the gateway::

    callboard serve --config callboard.toml --port 8080

    client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="...")
    client.chat.completions.create(model="fast", messages=[...],
                                   extra_headers={"X-Callboard-Priority": "high"})

    claude = anthropic.Anthropic(base_url="http://127.0.0.1:8080", api_key="...")
    claude.messages.create(model="fast", max_tokens=256, messages=[...])

Each request becomes a callboard request: ``model`` names a model or a route,
the client key (``[gateway.keys.<name>]``, see ``settings``) gives its tenant
(the budget tag), default priority and ceiling, the headers its priority,
deadline and idempotency key. The gateway holds no scheduling logic of its
own but one: a request over its key's or tenant's quota waits at the front
door (``quota``) before it is submitted; everything after is the queue's.

Layout: ``settings`` (the ``[gateway]`` table), ``keys`` (who is calling),
``quota`` (per-key and per-tenant rpm, tpm and budgets per period: wait, or
429), ``spend`` (the budgets' settled spend in a SQLite file, across restarts),
``openai_api`` and ``anthropic_api`` (bodies in and out, pure), ``errors`` (what
each unanswered ending answers, in either API's shape, pure), ``replays``
(Idempotency-Keys), ``app`` (the aiohttp handlers: chat and messages are one
handler over a door per API; the plain requests of one loop turn go to callboard
together and finished tasks come back with one wake-up of the loop per batch,
through ``runtime.batch`` and ``runtime.handoff``, which ``AsyncSystem`` uses too),
``observe`` (``/metrics`` and the dashboard), ``server`` (``Gateway``, ``serve``,
``main``).

Why aiohttp.web
---------------
Measured side by side on this 2-core machine, shared with other work (load
average 6 to 10, so throughput swings by 2x between runs; the server's own CPU
per request is the steadier figure): a trivial JSON handler, and a pass-through
to ``AsyncSystem.submit`` over a bare ASGI provider answering in 20 ms in its own
process, each at 50 concurrent connections from an aiohttp load generator in a
third process; medians of five 6-second runs:

==============================  =============  ===========  ============  ===========
server                          trivial req/s  trivial CPU  submit req/s  submit CPU
==============================  =============  ===========  ============  ===========
aiohttp.web, asyncio            834            0.29 ms/req  320           1.87 ms/req
aiohttp.web, uvloop             1754           0.19 ms/req  223           1.88 ms/req
Starlette/uvicorn (uvloop,      1109           0.22 ms/req  292           1.93 ms/req
httptools)
==============================  =============  ===========  ============  ===========

On uvloop, aiohttp.web costs what Starlette on uvicorn costs for a bare handler
(0.19 vs 0.22 ms of CPU per request), and with callboard behind it the three are
within the noise of each other: the request's CPU is callboard's (the same
submits made in process cost 1.0-1.3 ms each; this gateway, measured the same
way, 1.45-1.7 ms on either loop). So the gateway takes the server that adds
nothing to install (aiohttp is callboard's dependency already) and has built in
what the gateway needs: a handler cancelled when its client disconnects
(``handler_cancellation``), a graceful shutdown that stops accepting and waits
for requests in flight (``AppRunner.cleanup``), and stream writes that wait for
a slow client (backpressure down to the provider). ``serve`` runs on uvloop
when it is installed (the ``fast`` extra).

Measured again on 2026-12-02 (load average 8 to 16), a handler that parses the
JSON body, waits 50 ms and answers a 400-byte completion, C50, interleaved
rounds: aiohttp.web 0.23-0.25 ms of CPU per request, Starlette on uvicorn 0.23-0.30,
a bare ASGI callable on uvicorn with httptools 0.19-0.20; a middleware and an
``on_response_prepare`` signal (what the gateway's error mapping and request
counter cost) add 0.007 ms. The server is a sixth of the gateway process's CPU
per request: its own handler and submit add about 0.3 ms on the server's loop,
and callboard's actors and HTTP client the rest (0.7-0.9 ms).
"""

from callboard.gateway.keys import Caller, KeyRing
from callboard.gateway.server import ANNOUNCEMENT, Gateway, main, serve
from callboard.gateway.settings import (
    BudgetPeriod,
    ClientKey,
    GatewayConfig,
    GatewaySettings,
    Limits,
    UnsafeBindError,
    check_bind,
    load_config,
    parse_gateway,
)
from callboard.gateway.spend import SpendFileError

__all__ = [
    "ANNOUNCEMENT",
    "BudgetPeriod",
    "Caller",
    "ClientKey",
    "Gateway",
    "GatewayConfig",
    "GatewaySettings",
    "KeyRing",
    "Limits",
    "SpendFileError",
    "UnsafeBindError",
    "check_bind",
    "load_config",
    "main",
    "parse_gateway",
    "serve",
]
