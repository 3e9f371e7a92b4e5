"""What an operator watches (gateway/observe.py): ``GET /metrics`` in Prometheus' text,
without a key and without one in it, 501 naming the extra when prometheus_client is
missing; the dashboard at ``/``, one self-contained page, driven in a real headless
Chromium over the DevTools protocol: it asks for a key once, its figures move as load
runs through the gateway, and it shows a model's breaker open."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from browser import Chromium, find_chromium
from callboard.gateway import Gateway, GatewayConfig, GatewaySettings
from callboard.gateway.observe import Observatory, install
from callboard.gateway.settings import BudgetPeriod, Limits
from callboard.provider.server import SimulatedProvider
from prometheus_client.parser import text_string_to_metric_families
from support import WAIT_S, LogCollector, held_at, wait_until

from callboard import BreakerConfig, ModelSettings, Price, RetryConfig, SystemConfig
from callboard import metrics as cb_metrics

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@pytest.fixture(scope="module")
def http(gateway: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=WAIT_S) as client:
        yield client


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for requests that must be in flight while the test looks at the page."""
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def chat(url: str, key: str | None, model: str, priority: str = "normal") -> httpx.Response:
    headers = {"X-Callboard-Priority": priority}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=WAIT_S)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text, by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def breaking_gateway(make_gateway: Callable[..., Gateway], upstream: SimulatedProvider) -> Gateway:
    """An open gateway (no keys, loopback) whose ``broken`` model's breaker opens after
    two failed calls and stays open for a minute."""
    price = Price(input_per_mtok=Decimal("1.00"), output_per_mtok=Decimal("2.00"))
    models = (
        ModelSettings(name="fast", base_url=upstream.base_url, price=price, max_concurrency=8),
        ModelSettings(
            name="broken",
            base_url=upstream.base_url,
            price=price,
            retry=RetryConfig(max_attempts=1),
            breaker=BreakerConfig(consecutive_failures=2, cooldown_s=60.0),
        ),
    )
    system = SystemConfig(models=models, default_route=("fast",))
    return make_gateway(GatewayConfig(system=system, gateway=GatewaySettings()))


# -- /metrics --------------------------------------------------------------------------------


def test_metrics_answer_without_a_key_in_prometheus_text(
    gateway: Gateway, http: httpx.Client, keys: dict[str, str]
) -> None:
    before = http.get("/metrics").text
    for _ in range(3):
        assert chat(gateway.url, keys["team"], "fast", "high").status_code == 200
    assert chat(gateway.url, keys["admin"], "broken").status_code == 502
    http.get("/v1/callboard/stats", headers={"Authorization": f"Bearer {keys['admin']}"})
    answer = http.get("/metrics")  # no key
    assert answer.status_code == 200
    assert answer.headers["Content-Type"] == PROMETHEUS_TEXT
    text = answer.text

    def grew(name: str, by: float, **labels: str) -> bool:
        return value(text, name, **labels) - value(before, name, **labels) == by

    done = {"outcome": "completed", "priority": "HIGH", "reason": ""}
    assert grew("callboard_results_total", 3, model="fast", **done)
    failed = {"outcome": "failed", "priority": "NORMAL", "reason": "provider_error"}
    assert grew("callboard_results_total", 1, model="broken", **failed)
    assert grew("callboard_latency_seconds_count", 3, model="fast")
    chats = {"route": "/v1/chat/completions", "method": "POST"}
    assert grew("callboard_gateway_requests_total", 3, **chats, status="200")
    assert grew("callboard_gateway_requests_total", 1, **chats, status="502")
    assert value(text, "callboard_tokens_total", model="fast", kind="completion") > 0
    assert value(text, "callboard_cost_usd_total", model="fast") > 0
    for priority in ("CRITICAL", "HIGH", "NORMAL", "LOW"):
        assert ("callboard_queue_depth", frozenset({("priority", priority)})) in samples(text)
    for model in ("fast", "slow", "gate", "broken", "cut", "drip"):
        assert value(text, "callboard_breaker_state", model=model) == 0  # never opens here
        assert value(text, "callboard_concurrency_limit", model=model) >= 1
    assert 'callboard_tasks{stage="in_flight"}' in text
    for key in keys.values():
        assert key not in text


def test_metrics_for_an_operator_only_answer_it_alone(
    make_gateway: Callable[..., Gateway], keys: dict[str, str]
) -> None:
    """``gateway.metrics = "operator"``: the series name keys, tenants and their
    budgets, which a gateway open to many tenants may keep to its operator."""
    guarded = make_gateway(settings={"metrics": "operator"})

    def scrape(key: str | None) -> httpx.Response:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.get(f"{guarded.url}/metrics", headers=headers, timeout=WAIT_S)

    assert scrape(None).status_code == 401
    assert scrape("sk-not-ours").status_code == 401
    refused = scrape(keys["team"])
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "operator_only"
    assert "callboard_" not in refused.text
    answer = scrape(keys["admin"])
    assert answer.status_code == 200
    assert answer.headers["Content-Type"] == PROMETHEUS_TEXT
    assert "callboard_gateway_requests_total" in answer.text
    assert httpx.get(f"{guarded.url}/healthz", timeout=WAIT_S).status_code == 200  # probes open


def test_metrics_speak_openmetrics_when_the_scraper_asks(http: httpx.Client) -> None:
    answer = http.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert answer.status_code == 200
    assert answer.headers["Content-Type"].startswith("application/openmetrics-text")
    assert answer.text.rstrip().endswith("# EOF")


@pytest.mark.parametrize(
    ("accept", "spoken"),
    [
        ('application/openmetrics-text; version="1.0.0"', "application/openmetrics-text"),
        ("application/openmetrics-text; version=abc", "text/plain"),
        ("application/openmetrics-text; version=", "application/openmetrics-text"),
    ],
)
def test_an_accept_header_the_encoder_cannot_read_is_answered_not_a_500(
    http: httpx.Client, accept: str, spoken: str, debug_logs: LogCollector
) -> None:
    """A quoted version (RFC 9110 allows it) or one that is no number made
    prometheus_client raise: anybody, keyless, got a 500 and an ERROR traceback in the
    log per request, counted as the gateway's own failure."""
    answer = http.get("/metrics", headers={"Accept": accept})
    assert answer.status_code == 200
    assert answer.headers["Content-Type"].startswith(spoken)
    assert not [r for r in debug_logs.records if r.levelno >= logging.ERROR]


def test_without_prometheus_client_metrics_answer_501_naming_the_extra(
    make_gateway: Callable[..., Gateway], keys: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(sys.modules):
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]
    gateway = make_gateway()  # starts as ever
    answer = httpx.get(f"{gateway.url}/metrics", timeout=WAIT_S)
    assert answer.status_code == 501
    assert "pip install 'callboard[metrics]'" in answer.json()["error"]["message"]
    assert chat(gateway.url, keys["admin"], "fast").status_code == 200
    assert httpx.get(f"{gateway.url}/", timeout=WAIT_S).status_code == 200


def test_install_counts_each_answer_by_route_template_and_status(gateway: Gateway) -> None:
    """``install`` (for ``Front.app``) counts what the app answers; a path no route
    knows is one series, whatever the path."""
    assert gateway.cb is not None
    cb = gateway.cb

    async def hello(_request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    async def run() -> str:
        app = web.Application()
        app.router.add_get("/v1/things/{name}", hello)
        install(app, cb)
        async with TestClient(TestServer(app)) as client:
            for path in ("/v1/things/a", "/v1/things/b", "/nope/1", "/nope/2"):
                await (await client.get(path)).read()
            return await (await client.get("/metrics")).text()

    text = asyncio.run(run())
    requests = "callboard_gateway_requests_total"
    assert value(text, requests, route="/v1/things/{name}", method="GET", status="200") == 2
    assert value(text, requests, route="unmatched", method="GET", status="404") == 2
    assert "/nope/1" not in text


def test_scrapes_asked_while_one_renders_share_it(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each scrape scanned the whole queue under the ledger's lock: four scrapers at
    once, at 100,000 queued tasks, held up every submit (found by a hunt). Those asked
    while one renders get its answer; the queue is read once."""
    assert gateway.cb is not None
    cb = gateway.cb
    reads, entered = [0], [0]
    go = threading.Event()
    collect = cb_metrics._LedgerCollector.collect

    def counted(self: Any) -> Any:
        reads[0] += 1
        assert go.wait(WAIT_S)  # the render is held until every scrape has come
        return collect(self)

    monkeypatch.setattr(cb_metrics._LedgerCollector, "collect", counted)
    scrape = Observatory.scrape

    async def seen(self: Observatory, request: web.Request) -> web.StreamResponse:
        entered[0] += 1
        return await scrape(self, request)

    monkeypatch.setattr(Observatory, "scrape", seen)

    async def run() -> list[str]:
        app = web.Application()
        install(app, cb)
        async with TestClient(TestServer(app)) as client:
            asking = [asyncio.ensure_future(client.get("/metrics")) for _ in range(4)]
            while entered[0] < 4:  # every scrape has reached the handler
                await asyncio.sleep(0.001)
            go.set()
            return [await (await a).text() for a in asking]

    bodies = asyncio.run(run())
    assert len(set(bodies)) == 1
    assert reads == [1]


def test_a_method_no_one_uses_is_counted_as_other(gateway: Gateway) -> None:
    """aiohttp's pure-Python parser takes any token as a method: 2,000 made-up ones grew
    /metrics to 16 MB, a series each (found by a hunt)."""
    assert gateway.cb is not None
    cb = gateway.cb

    async def run() -> str:
        app = web.Application()
        install(app, cb)
        app.freeze()
        for i in range(50):
            request = make_mocked_request(f"BREW{i}", "/nope", app=app)
            request.match_info.route.resource.canonical = "/nope"  # as one route would
            await app.on_response_prepare.send(request, web.Response(status=405))
        async with TestClient(TestServer(app)) as client:
            return await (await client.get("/metrics")).text()

    text = asyncio.run(run())
    counted = [
        n
        for (name, labels), n in samples(text).items()
        if name == "callboard_gateway_requests_total" and ("method", "other") in labels
    ]
    assert counted == [50]  # one series
    assert "BREW" not in text


def test_each_budget_and_cap_is_a_gauge_of_its_limit_use_and_period_end(
    gateway: Gateway, make_gateway: Callable[..., Gateway], keys: dict[str, str]
) -> None:
    base = gateway.config
    daily = BudgetPeriod(1, "d")
    team = next(k for k in base.gateway.keys if k.name == "team")
    budgeted = dataclasses.replace(
        team, limits=Limits(budget_usd=Decimal("0.5"), budget_period=daily, max_parallel=4)
    )
    settings = dataclasses.replace(
        base.gateway,
        keys=tuple(budgeted if k is team else k for k in base.gateway.keys),
        tenants={"team": Limits(budget_usd=Decimal(2))},
    )
    metered = make_gateway(GatewayConfig(system=base.system, gateway=settings))
    assert chat(metered.url, keys["team"], "fast").status_code == 200
    before = time.time()
    text = httpx.get(f"{metered.url}/metrics", timeout=WAIT_S).text  # no key
    after = time.time()
    got = samples(text)

    def gauge(metric: str, kind: str) -> float | None:  # its labels: kind and name
        labels = frozenset({("kind", kind), ("name", "team")})
        return got.get((f"callboard_gateway_budget_{metric}", labels))

    assert (gauge("usd", "key"), gauge("usd", "tenant")) == (0.5, 2.0)
    spent = gauge("spent_usd", "key")
    assert spent is not None
    assert spent > 0
    assert gauge("spent_usd", "tenant") == spent
    assert gauge("reserved_usd", "key") == 0
    ends = gauge("period_end_timestamp_seconds", "key")
    assert ends is not None
    assert ends % 86_400 == 0  # midnight UTC
    assert before < ends <= after + 86_400  # the day it was read in
    assert gauge("period_end_timestamp_seconds", "tenant") is None  # never renews: no end
    who = {"key": frozenset({("kind", "key"), ("name", "team")})}
    who["tenant"] = frozenset({("kind", "tenant"), ("name", "team")})
    assert got.get(("callboard_gateway_max_parallel", who["key"])) == 4
    assert got.get(("callboard_gateway_max_parallel", who["tenant"])) is None  # no cap
    for kind in ("key", "tenant"):  # answered: nothing in flight
        assert got.get(("callboard_gateway_requests_in_flight", who[kind])) == 0
    for secret in keys.values():
        assert secret not in text


def test_a_request_waiting_at_the_door_for_its_keys_max_parallel_is_in_a_gauge(
    *,
    gateway: Gateway,
    make_gateway: Callable[..., Gateway],
    keys: dict[str, str],
    upstream: SimulatedProvider,
    pool: ThreadPoolExecutor,
) -> None:
    """What waits for a key's quota waits before the scheduler sees it: neither the
    queue's depth nor the in-flight gauge showed it."""
    base = gateway.config
    team = next(k for k in base.gateway.keys if k.name == "team")
    capped = dataclasses.replace(team, limits=Limits(max_parallel=1))
    settings = dataclasses.replace(
        base.gateway, keys=tuple(capped if k is team else k for k in base.gateway.keys)
    )
    metered = make_gateway(GatewayConfig(system=base.system, gateway=settings))
    key = frozenset({("kind", "key"), ("name", "team")})

    def gauges() -> tuple[float | None, float | None]:
        got = samples(httpx.get(f"{metered.url}/metrics", timeout=WAIT_S).text)
        waiting = got.get(("callboard_gateway_requests_waiting", key))
        return got.get(("callboard_gateway_requests_in_flight", key)), waiting

    send = functools.partial(pool.submit, chat, metered.url, keys["team"], "gate")
    with held_at(upstream, "gate", send) as first:  # until the gauges are read
        second = pool.submit(chat, metered.url, keys["team"], "fast")
        assert wait_until(lambda: gauges() == (1, 1))
    assert first.result(WAIT_S).status_code == 200
    assert second.result(WAIT_S).status_code == 200
    assert gauges() == (0, 0)


def test_a_request_whose_client_left_is_counted_499(
    gateway: Gateway, http: httpx.Client, keys: dict[str, str], upstream: SimulatedProvider
) -> None:
    """A client that timed out and left (an SDK's retry storm) answered nothing, so the
    request counter never showed it (found by a hunt): it counts as 499, as nginx's
    "client closed request"."""
    series = {"route": "/v1/chat/completions", "method": "POST", "status": "499"}
    before = value(http.get("/metrics").text, "callboard_gateway_requests_total", **series)
    body = b'{"model": "gate", "messages": [{"role": "user", "content": "hi"}]}'
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {keys['team']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=WAIT_S)
    with held_at(upstream, "gate", lambda: conn.sendall(head.encode() + body)):
        conn.close()  # the client leaves while its call is held at the provider

        def counted() -> float:
            text = http.get("/metrics").text
            return value(text, "callboard_gateway_requests_total", **series) - before

        assert wait_until(lambda: counted() == 1)


def test_the_room_for_request_bodies_is_in_gauges_and_counters(
    make_gateway: Callable[..., Gateway], keys: dict[str, str]
) -> None:
    metered = make_gateway(settings={"max_body_mb": 1, "max_held_mb": 2})
    assert chat(metered.url, keys["team"], "fast").status_code == 200
    got = samples(httpx.get(f"{metered.url}/metrics", timeout=WAIT_S).text)

    def sample(metric: str) -> float | None:
        return got.get((f"callboard_gateway_body_{metric}", frozenset()))

    assert sample("bytes_capacity") == 2 * 1024 * 1024
    assert sample("bytes_held") == 0  # the chat has ended
    assert sample("refused_total") == 0


# -- the page --------------------------------------------------------------------------------


def test_the_page_is_one_file_that_reaches_for_nothing_elsewhere(http: httpx.Client) -> None:
    answer = http.get("/")  # no key: the page holds no figure
    assert answer.status_code == 200
    assert answer.headers["Content-Type"] == "text/html; charset=utf-8"
    policy = answer.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy
    assert "connect-src 'self'" in policy
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'$", policy.split(";")[2])
    page = answer.text
    assert not re.search(r"(src|href)\s*=\s*[\"'](?!data:)", page), "a resource from elsewhere"
    assert "://" not in page


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    """One headless Chromium for the module (``.ci/run`` installs it where missing)."""
    executable = find_chromium()
    if executable is None:
        pytest.skip("no chromium on this machine (apt-get install chromium; .ci/run does)")
    with Chromium(executable) as chromium:
        yield chromium


def open_dashboard(browser: Chromium, url: str, key: str | None = None) -> None:
    """Open the page at ``url`` with ``key`` kept for the tab (as the form keeps it), and
    wait for its second snapshot."""
    browser.navigate(f"{url}/")
    if key is not None:
        browser.evaluate(f"sessionStorage.setItem('callboard.key', {key!r})")
        browser.navigate(f"{url}/?again")
    assert browser.wait_for("Number(document.body.dataset.polls) >= 2"), "the page never polled"


def number(browser: Chromium, selector: str) -> float:
    text = browser.evaluate(f"document.querySelector({selector!r}).textContent")
    return float(text.replace(",", "").replace("$", ""))


def test_the_page_asks_for_a_key_once_and_shows_the_gateways_models(
    browser: Chromium, gateway: Gateway, keys: dict[str, str]
) -> None:
    browser.requests.clear()
    browser.console_errors.clear()
    browser.navigate(f"{gateway.url}/")
    assert browser.wait_for("!document.getElementById('key-form').hidden")
    assert browser.evaluate("document.getElementById('status').textContent") == "needs a key"
    browser.evaluate(
        f"document.getElementById('key-input').value = {keys['admin']!r};"
        "document.getElementById('key-form').requestSubmit()"
    )
    assert browser.wait_for("Number(document.body.dataset.polls) >= 2")
    assert browser.evaluate("document.getElementById('key-form').hidden")
    assert browser.evaluate("sessionStorage.getItem('callboard.key')") == keys["admin"]
    shown = browser.evaluate(
        "[...document.querySelectorAll('#models tr[data-model]')].map(r => r.dataset.model)"
    )
    assert shown == ["broken", "cut", "drip", "fast", "flood", "gate", "slow"]
    assert browser.evaluate("document.getElementById('status').textContent").startswith("live")
    browser.navigate(f"{gateway.url}/?reloaded")  # the tab keeps the key: no form again
    assert browser.wait_for("Number(document.body.dataset.polls) >= 1")
    assert browser.evaluate("document.getElementById('key-form').hidden")
    assert all(u.startswith(gateway.url + "/") for u in browser.requests), browser.requests
    assert not any(keys["admin"] in u for u in browser.requests)
    errors = [e for e in browser.console_errors if not e.startswith("network:")]  # the 401
    assert errors == []


def test_a_key_not_an_operators_sees_its_own_quotas_and_is_told_why_no_more(
    browser: Chromium, gateway: Gateway, keys: dict[str, str]
) -> None:
    browser.console_errors.clear()
    open_dashboard(browser, gateway.url, keys["broke"])
    status = browser.evaluate("document.getElementById('status').textContent")
    assert status.startswith('key "broke" reads only its own quotas'), status
    assert browser.evaluate("document.querySelectorAll('#models tr[data-model]').length") == 0
    scopes = browser.evaluate(
        "[...document.querySelectorAll('#quotas tr[data-scope]')].map(r => r.dataset.scope)"
    )
    assert scopes == []  # its key and tenant have no quotas at the front door
    assert not browser.evaluate("document.getElementById('quotas-section').hidden")
    assert [e for e in browser.console_errors if not e.startswith("network:")] == []


def test_the_figures_move_as_load_runs_through_the_gateway(
    browser: Chromium, gateway: Gateway, keys: dict[str, str], pool: ThreadPoolExecutor
) -> None:
    open_dashboard(browser, gateway.url, keys["admin"])
    finished = number(browser, "#t-finished")
    answers = [pool.submit(chat, gateway.url, keys["admin"], "fast") for _ in range(12)]
    assert all(a.result(WAIT_S).status_code == 200 for a in answers)
    shown = "Number(document.getElementById('t-finished').textContent.replace(/,/g, ''))"
    assert browser.wait_for(f"{shown} >= {finished + 12}")
    assert browser.wait_for("Number(document.getElementById('t-rate').textContent) > 0")
    assert number(browser, "#models tr[data-model='fast'] td:last-child") > 0  # its cost


def test_the_queue_shows_what_waits_by_priority_and_tenant(
    browser: Chromium,
    gateway: Gateway,
    keys: dict[str, str],
    pool: ThreadPoolExecutor,
    upstream: SimulatedProvider,
) -> None:
    open_dashboard(browser, gateway.url, keys["admin"])
    send = functools.partial(pool.submit, chat, gateway.url, keys["admin"], "gate")
    with held_at(upstream, "gate", send) as holder:  # one call at a time: the rest wait
        waiting = [pool.submit(chat, gateway.url, keys["admin"], "gate", "low") for _ in range(3)]
        low = "#priorities tr[data-priority='LOW'] td[data-role='waiting']"
        assert browser.wait_for(f"document.querySelector({low!r}).textContent === '3'")
        tenant = "document.querySelector('#tenants tr[data-tenant=\"ops\"]') !== null"
        assert browser.evaluate(tenant)
        assert number(browser, "#t-queued") >= 3
    assert all(f.result(WAIT_S).status_code == 200 for f in [holder, *waiting])
    assert browser.wait_for(f"document.querySelector({low!r}).textContent === '0'")


def test_an_open_breaker_shows_on_the_page(
    browser: Chromium, make_gateway: Callable[..., Gateway], upstream: SimulatedProvider
) -> None:
    gateway = breaking_gateway(make_gateway, upstream)
    open_dashboard(browser, gateway.url)  # an open gateway: no key asked
    assert browser.evaluate("document.getElementById('key-form').hidden")
    row = "#models tr[data-model='broken']"
    assert browser.evaluate(f"document.querySelector({row!r}).dataset.breaker") == "closed"
    for _ in range(2):
        assert chat(gateway.url, None, "broken").status_code == 502
    assert browser.wait_for(f"document.querySelector({row!r}).dataset.breaker === 'open'")
    badge = browser.evaluate(
        f"document.querySelector({row + ' [data-role=breaker]'!r}).textContent"
    )
    assert re.fullmatch(r"open \d+s", badge), badge  # with the seconds until it probes
    assert browser.wait_for("document.querySelector('#failures tr[data-reason]') !== null")
    fast = "#models tr[data-model='fast']"
    assert browser.evaluate(f"document.querySelector({fast!r}).dataset.breaker") == "closed"


def test_a_model_named_as_an_objects_member_is_drawn_like_any_other(
    browser: Chromium, make_gateway: Callable[..., Gateway], upstream: SimulatedProvider
) -> None:
    """A model named ``toString`` found the object's inherited member in the page's
    lookup, and the page drew no model at all, for good if the model never answered
    (found by a hunt)."""
    price = Price(input_per_mtok=Decimal("1.00"), output_per_mtok=Decimal("2.00"))
    models = tuple(
        ModelSettings(name=name, base_url=upstream.base_url, price=price)
        for name in ("fast", "toString", "constructor")
    )
    system = SystemConfig(models=models, default_route=("fast",))
    gateway = make_gateway(GatewayConfig(system=system, gateway=GatewaySettings()))
    assert chat(gateway.url, None, "fast").status_code == 200
    open_dashboard(browser, gateway.url)
    drawn = browser.evaluate(
        "[...document.querySelectorAll('#models tr[data-model]')].map(r => r.dataset.model)"
    )
    assert sorted(drawn) == ["constructor", "fast", "toString"]
    assert browser.evaluate("document.getElementById('status').className") != "down"
