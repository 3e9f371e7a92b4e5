"""What an operator watches: ``GET /metrics`` (Prometheus) and the dashboard at ``/``.

    GET /          the dashboard: one HTML page (``dashboard.html``, shipped with the
                   package) whose inline script polls ``GET /v1/callboard/stats`` every
                   second; no build step, no asset from anywhere else (works offline)
    GET /metrics   Prometheus' text exposition (OpenMetrics when the scraper asks for
                   it): ``callboard.metrics``' collectors over the system, and the
                   gateway's own ``callboard_gateway_requests_total{route,method,status}``
                   (``route`` is the route's template, ``unmatched`` for a path no route
                   knows, so a scanner cannot grow the series), and each budgeted key's
                   and tenant's budget (``callboard_gateway_budget_usd``, ``..._spent_usd``,
                   ``..._reserved_usd`` in the current period, and
                   ``..._period_end_timestamp_seconds`` when it renews), labelled
                   ``kind`` (key or tenant) and ``name`` (its label in the config),
                   its requests in flight and waiting at the door for its quotas
                   (``callboard_gateway_requests_in_flight``, ``..._waiting``), and the
                   room for request bodies (``room``):
                   ``callboard_gateway_body_bytes_held`` and ``..._capacity``, and
                   ``callboard_gateway_body_refused_total``; the client connections
                   (``connections``): ``callboard_gateway_connections_open``,
                   ``..._capacity`` (absent when unbounded) and
                   ``callboard_gateway_connections_refused_total``

Who may read what. ``/metrics`` answers without a key by default, as a Prometheus
target usually does (vLLM's server and LiteLLM's proxy do the same by default): a
scraper rarely holds an API key, the series carry no key, prompt or answer (labels
are model, route, key and tenant names, priorities, outcomes, statuses), and the
figures are an operator's. With ``gateway.metrics = "operator"`` it answers only an
``operator`` key (Prometheus sends one as ``authorization: {credentials_file: ...}``
in its scrape config): another key is 403, none 401. An operator who opens the
gateway beyond a private network without that should not route ``/metrics`` there
(the usual ``location /metrics { deny all; }``). The
page answers without a key too: it holds no figure. Its script reads the stats
endpoint with the caller's key, which it asks for once when the stats answer 401
and keeps in ``sessionStorage`` (this tab only, gone when it closes; never in a URL
or a cookie, so nothing sends it unasked), sent as ``Bearer``. The stats answer an
``operator`` key everything; any other key only its own key's and tenant's quotas,
which is all the page then draws, saying why.

The page is served with a Content-Security-Policy that admits only its own inline
style and script (by their SHA-256) and requests to its own origin: a page that
reached for anything else would be refused by the browser, not only by review.

prometheus_client is optional (``callboard[metrics]``): without it the gateway
starts as ever and ``/metrics`` answers 501 naming the extra.

What must hold: scraping never blocks the gateway's event loop (the collectors read
the ledger in a worker thread; the budgets are read on the loop, where the quotas
live, before the worker thread formats them); no key is ever a label, a log line or
part of the page.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from importlib import resources
from typing import Any

from aiohttp import web
from callboard.gateway.quota import QuotaStats
from callboard.messages import ConfigError
from callboard.runtime.guarded_log import guarded_logger

from callboard import AsyncSystem
from callboard import metrics as cb_metrics

__all__ = ["Observatory", "install"]

log = guarded_logger(__name__)

PAGE = "dashboard.html"
UNMATCHED = "unmatched"
"""The ``route`` label of a request no route matched."""
CLIENT_LEFT = 499
"""The status a request whose client left before its answer began is counted under."""
_COUNTED = web.RequestKey("callboard_counted", bool)
"""The request's key saying its answer was counted."""
_KEPT_SERIES = 512
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
"""The methods counted by name; any other is ``other``: aiohttp's pure-Python parser
(``AIOHTTP_NO_EXTENSIONS``, PyPy) takes any token as a method, and 2,000 made-up ones
grew /metrics to 16 MB (found by a hunt)."""
"""How many of the request counter's series ``count`` keeps at hand (a scanner's odd
methods beyond that are still counted, through ``labels``)."""


class Observatory:
    """One gateway's ``/metrics`` and dashboard, over ``cb`` (started)."""

    def __init__(
        self,
        cb: AsyncSystem,
        quotas: Callable[[], QuotaStats] | None = None,
        bodies: Callable[[], Mapping[str, int]] | None = None,
        connections: Callable[[], Mapping[str, int | None]] | None = None,
        guard: Callable[[web.Request], None] | None = None,
    ) -> None:
        self.cb = cb
        self._guard = guard
        """Raises for a caller who may not read ``/metrics`` (None: anyone may)."""
        self._budgets = _Budgets(quotas)
        self._bodies = _Snapshot(bodies, _body_families)
        self._connections = _Snapshot(connections, _connection_families)
        self._page, self._policy = _page()
        self.metrics: cb_metrics.Metrics | None = None
        """The system's collectors; None without prometheus_client."""
        self._missing = ""
        self._requests: Any = None
        self._series: dict[tuple[str, str, int], Any] = {}
        """The request counter's children by labels: ``labels()`` checks the values and
        takes a lock at every call, a dict lookup does not."""
        self._rendering: dict[str, asyncio.Future[bytes]] = {}
        """The scrape being rendered, by content type: one asked meanwhile gets it."""
        try:
            self.metrics = cb_metrics.install(cb.system)
        except ConfigError as exc:  # prometheus_client is not installed
            self._missing = str(exc)
            log.info("GET /metrics is off: %s", exc)
            return
        from prometheus_client import Counter

        self._requests = Counter(
            "callboard_gateway_requests",
            "Requests the gateway answered, by route template, method and status",
            ["route", "method", "status"],
            registry=self.metrics.registry,
        )
        if quotas is not None:
            self.metrics.registry.register(self._budgets)
        if bodies is not None:
            self.metrics.registry.register(self._bodies)
        if connections is not None:
            self.metrics.registry.register(self._connections)

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/", self.dashboard), web.get("/metrics", self.scrape)]

    async def dashboard(self, _request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=self._page,
            content_type="text/html",
            charset="utf-8",
            headers={
                "Content-Security-Policy": self._policy,
                "Cache-Control": "no-cache",
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer",
            },
        )

    async def scrape(self, request: web.Request) -> web.StreamResponse:
        if self._guard is not None:
            self._guard(request)
        metrics = self.metrics
        if metrics is None:
            return web.json_response(
                {
                    "error": {
                        "message": f"GET /metrics is off: {self._missing}",
                        "type": "not_implemented",
                        "code": "metrics_not_installed",
                    }
                },
                status=501,
            )
        from prometheus_client.exposition import choose_encoder

        accept = request.headers.get("Accept", "").replace('"', "")  # a quoted version
        try:  # is RFC 9110's, and prometheus_client compares it as a str with an int
            encoder, content_type = choose_encoder(accept)
        except (TypeError, ValueError):  # one it cannot read: the text format, as for none
            encoder, content_type = choose_encoder("")
        rendering = self._rendering.get(content_type)
        if rendering is None:  # one scrape at a time: those asked meanwhile share it (four
            # scrapers at once, each scanning a deep queue under the ledger's lock, held
            # up every submit; found by a hunt)
            self._budgets.read()  # here, on the loop: the quotas are the loop's
            self._bodies.read()  # and so is the room
            self._connections.read()  # and the server's connections
            rendering = asyncio.ensure_future(asyncio.to_thread(encoder, metrics.registry))
            self._rendering[content_type] = rendering
            rendering.add_done_callback(lambda _: self._rendering.pop(content_type, None))
        body = await asyncio.shield(rendering)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def count(self, request: web.Request, response: web.StreamResponse) -> None:
        """``on_response_prepare``: count the answer by route template and status."""
        self._count(request, response.status)

    def left(self, request: web.Request) -> None:
        """``request``'s handler was cancelled (its client left) before an answer began:
        counted as status 499, nginx's "client closed request". Uncounted, an SDK's
        timeouts and retries (three requests, three billed calls) showed no request at
        all (found by a hunt)."""
        if not request.get(_COUNTED, False):
            self._count(request, CLIENT_LEFT)

    def _count(self, request: web.Request, status: int) -> None:
        if self._requests is None:
            return
        request[_COUNTED] = True
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else UNMATCHED
        method = request.method if request.method in _METHODS else "other"
        labels = (route, method, status)
        series = self._series.get(labels)
        if series is None:
            series = self._requests.labels(route, method, str(status))
            if len(self._series) < _KEPT_SERIES:
                self._series[labels] = series
        series.inc()


class _Budgets:
    """The quotas' gauges (budgets, requests in flight), from the quotas' statistics
    read on the loop (``read``) and formatted in the scrape's worker thread
    (``collect``)."""

    def __init__(self, quotas: Callable[[], QuotaStats] | None) -> None:
        self._quotas = quotas
        self._read: QuotaStats | None = None

    def read(self) -> None:
        if self._quotas is not None:
            self._read = self._quotas()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        labels = ["kind", "name"]
        families = {
            "budget": GaugeMetricFamily(
                "callboard_gateway_budget_usd",
                "Budget of a key or tenant, per period",
                labels=labels,
            ),
            "spent": GaugeMetricFamily(
                "callboard_gateway_budget_spent_usd",
                "Settled spend in the budget's current period",
                labels=labels,
            ),
            "reserved": GaugeMetricFamily(
                "callboard_gateway_budget_reserved_usd",
                "Held for requests not yet settled, in the current period",
                labels=labels,
            ),
            "ends": GaugeMetricFamily(
                "callboard_gateway_budget_period_end_timestamp_seconds",
                "When the budget's current period ends and its spend starts again (Unix time)",
                labels=labels,
            ),
            "in_flight": GaugeMetricFamily(
                "callboard_gateway_requests_in_flight",
                "Requests of a key or tenant with quotas admitted and not yet ended",
                labels=labels,
            ),
            "waiting": GaugeMetricFamily(
                "callboard_gateway_requests_waiting",
                "Requests of a key or tenant waiting at the door for its rpm, tpm or "
                "max_parallel (before they reach the scheduler's queue)",
                labels=labels,
            ),
            "parallel": GaugeMetricFamily(
                "callboard_gateway_max_parallel",
                "The most requests a key or tenant may have in flight at once",
                labels=labels,
            ),
        }
        read = self._read
        for s in () if read is None else read.scopes:
            families["in_flight"].add_metric([s.kind, s.name], s.in_flight)
            families["waiting"].add_metric([s.kind, s.name], s.waiting)
            if s.max_parallel is not None:
                families["parallel"].add_metric([s.kind, s.name], s.max_parallel)
            if s.budget_usd is None or s.spent_usd is None or s.reserved_usd is None:
                continue
            who = [s.kind, s.name]
            families["budget"].add_metric(who, float(s.budget_usd))
            families["spent"].add_metric(who, float(s.spent_usd))
            families["reserved"].add_metric(who, float(s.reserved_usd))
            if s.period_ends_at is not None:
                families["ends"].add_metric(
                    who, datetime.fromisoformat(s.period_ends_at).timestamp()
                )
        yield from families.values()


class _Snapshot:
    """Figures the loop holds (the room, the connections), read there (``read``) and
    made metric families in the scrape's worker thread (``collect``) by ``families``."""

    def __init__(
        self,
        source: Callable[[], Mapping[str, Any]] | None,
        families: Callable[[Mapping[str, Any]], Iterator[Any]],
    ) -> None:
        self._source = source
        self._families = families
        self._read: Mapping[str, Any] = {}

    def read(self) -> None:
        if self._source is not None:
            self._read = self._source()

    def collect(self) -> Iterator[Any]:
        if self._read:
            yield from self._families(self._read)


def _body_families(read: Mapping[str, Any]) -> Iterator[Any]:
    """The room for request bodies (``Room.statistics``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily(
        "callboard_gateway_body_bytes_held",
        "Bytes of request bodies held now (read, queued or in flight)",
        value=read["held_bytes"],
    )
    yield GaugeMetricFamily(
        "callboard_gateway_body_bytes_capacity",
        "The most bytes of request bodies held at once (max_held_mb)",
        value=read["capacity_bytes"],
    )
    yield CounterMetricFamily(
        "callboard_gateway_body_refused",
        "Requests answered 429 for want of room for their bodies",
        value=read["refused"],
    )


def _connection_families(read: Mapping[str, Any]) -> Iterator[Any]:
    """The client connections (``ConnectionCap.statistics``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily(
        "callboard_gateway_connections_open",
        "Client connections open now",
        value=read["open"],
    )
    if read["capacity"] is not None:
        yield GaugeMetricFamily(
            "callboard_gateway_connections_capacity",
            "The most client connections open at once (max_connections)",
            value=read["capacity"],
        )
    yield CounterMetricFamily(
        "callboard_gateway_connections_refused",
        "Client connections answered 503 and closed for want of room",
        value=read["refused"],
    )


def install(
    app: web.Application,
    cb: AsyncSystem,
    quotas: Callable[[], QuotaStats] | None = None,
    bodies: Callable[[], Mapping[str, int]] | None = None,
    connections: Callable[[], Mapping[str, int | None]] | None = None,
    *,
    guard: Callable[[web.Request], None] | None = None,
) -> Observatory:
    """Mount the routes on ``app`` and count its answers (before ``app`` starts);
    ``quotas`` (``Quotas.statistics``) adds the budgets' gauges, ``bodies``
    (``Room.statistics``) the room's, ``connections`` (``ConnectionCap.statistics``)
    the client connections'; ``guard`` raises for a caller who may not read
    ``/metrics``."""
    observatory = Observatory(cb, quotas, bodies, connections, guard)
    app.on_response_prepare.append(observatory.count)
    app.router.add_routes(observatory.routes())
    return observatory


def _page() -> tuple[bytes, str]:
    """The dashboard's bytes, and the policy that admits its inline style and script."""
    page = resources.files("callboard.gateway").joinpath(PAGE).read_bytes()
    hashes = []
    for tag in ("style", "script"):
        found = re.findall(rb"<%s>(.*?)</%s>" % (tag.encode(), tag.encode()), page, re.DOTALL)
        if len(found) != 1:
            raise RuntimeError(f"{PAGE} must hold exactly one <{tag}>, found {len(found)}")
        digest = base64.b64encode(hashlib.sha256(found[0]).digest()).decode()
        hashes.append(f"'sha256-{digest}'")
    style, script = hashes
    policy = (
        f"default-src 'none'; style-src {style}; script-src {script}; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return page, policy
