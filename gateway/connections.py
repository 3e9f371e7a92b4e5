"""The gateway's client connections, bounded: ``max_connections`` open at once.

Every connection a client opens is a file descriptor, and so is every connection
the gateway opens to a provider. Nothing bounded the first: about 1,100 idle
connections (no key, not a byte sent) held every descriptor of a process limited
to 1,024, and the gateway's own calls to its providers failed to connect (EMFILE)
until ``idle_s`` closed them (found by a hunt). A connection past the bound is
answered at once, ``503`` with ``Retry-After`` and an error body both SDKs read
(``overloaded_error``, as Anthropic's own 529 says; OpenAI's SDK reads
``error.message``), and closed; it never reaches the server, so it holds nothing
beyond that moment. The connections already open, and the calls they wait for, go
on: the bound keeps the descriptors the providers need, as nginx's
``worker_connections`` and uvicorn's ``--limit-concurrency`` do for theirs.

The bound by default (``auto_capacity``): the process's soft limit of open files
(which ``serve`` first raises to the hard one) less what the models' connections may
take (each model's ``max_concurrency``; none for a cluster's models, whose calls the
cluster's actors make) and a margin for everything else (the listening socket's
backlog, logs, the ledger, the spend file, the event loop's own); none where the
limit is unlimited. It is logged at start, and warned of when small. A probe
(``/healthz``, ``/readyz``) is a connection like any other: past the bound it gets
the 503 too, so an orchestrator's probes see a gateway at its bound as unready.

What must hold: a connection is turned away only when ``capacity`` are open (on
asyncio's own loop, connections accepted in one turn are counted only once they are
made, so a burst may pass it by one accept batch, the listening backlog at most;
uvloop makes each before it accepts the next); a refusal writes its answer and
closes, and is counted (``refused``) and logged (once a minute at most). Everything
here runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from typing import cast

from aiohttp import web
from callboard.runtime.guarded_log import guarded_logger

__all__ = [
    "FEW_CONNECTIONS",
    "MARGIN",
    "CappedSite",
    "ConnectionCap",
    "auto_capacity",
    "open_file_limit",
    "raise_open_file_limit",
]

log = guarded_logger(__name__)

MARGIN = 256
"""Descriptors kept for what is neither a client's connection nor a provider's: the
listening backlog (128, aiohttp's default), the event loop's, logs, the ledger, the
spend file, a cluster's sockets."""

FEW_CONNECTIONS = 256
"""A bound by default below this is warned of at start."""
LEAST = 16
"""The bound ``auto_capacity`` never goes below (a process allowed so few files that
its models take them all still answers a few clients)."""

RETRY_AFTER_S = 1
"""The ``Retry-After`` of a connection turned away: connections free as requests end."""

LOG_EVERY_S = 60.0
"""How often, at most, refusals are logged (each refusal is counted)."""


def open_file_limit() -> int:
    """The process's soft limit of open files; -1: unlimited (or no such limit here)."""
    try:
        import resource  # not on Windows
    except ImportError:  # pragma: no cover - Windows
        return -1
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return -1 if soft == resource.RLIM_INFINITY else soft


def raise_open_file_limit() -> None:
    """Raise the process's soft limit of open files to its hard one, as Go's runtime
    does at start: a service's default soft limit (1,024 under systemd) bounds the
    connections for nothing. ``serve`` does it (its process is the gateway's)."""
    try:
        import resource  # not on Windows
    except ImportError:  # pragma: no cover - Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if resource.RLIM_INFINITY in (hard, soft) or soft >= hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # a container may refuse it: the soft one stands
        log.debug("the open-file limit stays at %d: %s", soft, exc)


def auto_capacity(soft_limit: int, provider_connections: Iterable[int]) -> int | None:
    """The bound for a process allowed ``soft_limit`` open files (negative: unlimited,
    as ``resource.RLIM_INFINITY`` is) whose models may open ``provider_connections``
    each; None: no bound."""
    if soft_limit < 0:
        return None
    return max(LEAST, soft_limit - sum(provider_connections) - MARGIN)


class ConnectionCap:
    """At most ``capacity`` client connections open at once (None: no bound)."""

    def __init__(self, capacity: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"a connection cap's capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.refused = 0
        """Connections turned away, ever."""
        self._server: web.Server | None = None
        self._clock = clock
        self._logged_at: float | None = None
        self._logged_refused = 0

    def admitting(self, server: web.Server) -> Callable[[], asyncio.BaseProtocol]:
        """The protocol factory to listen with: ``server``'s, or a refusal past the bound."""
        self._server = server
        if self.capacity is None:
            return server
        capacity = self.capacity

        def protocol() -> asyncio.BaseProtocol:
            if len(server.connections) < capacity:
                return server()
            self._refuse()
            return _TurnedAway()

        return protocol

    @property
    def open(self) -> int:
        """Client connections open now."""
        return 0 if self._server is None else len(self._server.connections)

    def statistics(self) -> dict[str, int | None]:
        return {"open": self.open, "capacity": self.capacity, "refused": self.refused}

    def _refuse(self) -> None:
        self.refused += 1
        now = self._clock()
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_S:
            return
        log.warning(
            "gateway: %d client connections turned away (503) since %s: %d open, the most "
            "allowed (gateway.max_connections)",
            self.refused - self._logged_refused,
            "the start" if self._logged_at is None else "the last such line",
            self.capacity,
        )
        self._logged_at = now
        self._logged_refused = self.refused


class CappedSite(web.TCPSite):
    """aiohttp's ``TCPSite`` listening through ``cap`` (``ConnectionCap.admitting``): its
    ``start`` is ``TCPSite.start``'s with that one protocol factory in place of the
    server's (aiohttp takes no factory of one's own)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, cap: ConnectionCap) -> None:
        super().__init__(runner, host, port)
        self._cap = cap

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert isinstance(server, web.Server)  # set up
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._cap.admitting(server),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


def _answer() -> bytes:
    body = json.dumps(
        {
            "type": "error",
            "error": {
                "type": "overloaded_error",
                "code": "too_many_connections",
                "message": (
                    "the gateway has as many client connections open as it allows "
                    "(gateway.max_connections); try again shortly"
                ),
            },
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Retry-After: {RETRY_AFTER_S}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


_ANSWER = _answer()


class _TurnedAway(asyncio.Protocol):
    """A connection past the bound: answered 503 and closed as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream's transport (uvloop's is none of asyncio's classes: no isinstance)
        cast("asyncio.WriteTransport", transport).write(_ANSWER)
        transport.close()  # after what was written has gone

    def data_received(self, data: bytes) -> None:
        pass  # the request it may have sent meanwhile is not read
