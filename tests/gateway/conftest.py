"""Fixtures of the gateway's tests: a simulated provider upstream, and a gateway in
front of it on loopback (its own event loop, in a thread), started once per module.

Models upstream (what the provider does for each):

- ``fast``: answers in ~5 ms; tools, JSON, embeddings; in the route ``quick``;
- ``slow``: one call at a time, 0.4 s each (requests that overlap);
- ``gate``: one call at a time, quick, unless a test slows it (``slowed``) for a call
  of its own, so that others wait in the queue while the test looks at them;
- ``broken``: every call answered 500, never retried (502 at the gateway);
- ``cut``: every stream cut after three events with OpenAI's error event;
- ``drip``: a stream of 200 tokens 50 ms apart (a client that leaves mid-stream);
- ``flood``: one call at a time, a stream of 300,000 tokens as fast as they are read
  (a client that stops reading).

Keys (``KEYS``: name -> the key in clear, as a client holds it):

- ``admin``: tenant ``ops``, may ask any priority, an operator's (reads all the stats);
- ``team``: tenant ``team``, default normal, ceiling high;
- ``limited``: tenant ``limited``, only ``fast``, default low;
- ``broke``: tenant ``broke``, whose budget is one nano-dollar.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from decimal import Decimal
from typing import Any

import pytest
from callboard.gateway import ClientKey, Gateway, GatewayConfig, GatewaySettings
from callboard.messages import Priority
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S

from callboard import (
    BreakerConfig,
    BudgetSettings,
    ModelSettings,
    Price,
    RetryConfig,
    SchedulerSettings,
    SystemConfig,
)

KEYS = {
    "admin": "sk-admin-0123456789",
    "team": "sk-team-0123456789",
    "limited": "sk-limited-0123456789",
    "broke": "sk-broke-0123456789",
}
PRICE = Price(input_per_mtok=Decimal("1.00"), output_per_mtok=Decimal("2.00"))
UPSTREAM = {
    "fast": ModelBehaviour(latency_s=0.005),
    "slow": ModelBehaviour(latency_s=0.4, completion_tokens=8),
    "gate": ModelBehaviour(latency_s=0.01, completion_tokens=8),
    "broken": ModelBehaviour(latency_s=0.0, status=500),
    "cut": ModelBehaviour(latency_s=0.0, ttft_s=0.0, cut_rate=1.0, cut_after=3, cut_mode="error"),
    "drip": ModelBehaviour(latency_s=0.0, ttft_s=0.0, token_gap_s=0.05, completion_tokens=200),
    "flood": ModelBehaviour(latency_s=0.0, ttft_s=0.0, token_gap_s=0.0, completion_tokens=300_000),
}


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def client_keys() -> tuple[ClientKey, ...]:
    return (
        ClientKey(name="admin", digest=digest(KEYS["admin"]), tenant="ops", operator=True),
        ClientKey(
            name="team",
            digest=digest(KEYS["team"]),
            tenant="team",
            max_priority=Priority.HIGH,
        ),
        ClientKey(
            name="limited",
            digest=digest(KEYS["limited"]),
            tenant="limited",
            priority=Priority.LOW,
            models=frozenset({"fast"}),
        ),
        ClientKey(name="broke", digest=digest(KEYS["broke"]), tenant="broke"),
    )


def upstream_models(base_url: str) -> tuple[ModelSettings, ...]:
    """The system's models on the provider at ``base_url`` (see the module docstring)."""
    never_open = BreakerConfig(consecutive_failures=10_000, min_calls=10_000)
    common: dict[str, Any] = {"base_url": base_url, "price": PRICE, "breaker": never_open}
    return (
        ModelSettings(
            name="fast",
            max_concurrency=16,
            capabilities=frozenset({"json", "tools", "embeddings"}),
            tiers=("quick",),
            **common,
        ),
        ModelSettings(name="slow", max_concurrency=1, **common),
        ModelSettings(name="gate", max_concurrency=1, **common),
        ModelSettings(
            name="broken", max_concurrency=4, retry=RetryConfig(max_attempts=1), **common
        ),
        ModelSettings(name="cut", max_concurrency=4, retry=RetryConfig(max_attempts=1), **common),
        ModelSettings(name="drip", max_concurrency=4, **common),
        ModelSettings(name="flood", max_concurrency=1, **common),
    )


def gateway_config(base_url: str, **scheduler: Any) -> GatewayConfig:
    system = SystemConfig(
        models=upstream_models(base_url),
        default_route=("fast",),
        scheduler=SchedulerSettings(**scheduler),
        budget=BudgetSettings(per_tag_usd={"broke": Decimal("0.000000001")}),
    )
    return GatewayConfig(system=system, gateway=GatewaySettings(keys=client_keys()))


class Running:
    """A ``Gateway`` served on an event loop of its own, in a thread (as in production:
    the test's clients are other threads, or other loops)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._started: asyncio.Future[str] | None = None
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> str:
        self._thread.start()
        assert self._ready.wait(WAIT_S), "the gateway did not start"
        if self._error is not None:
            raise self._error
        return self.gateway.url

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(WAIT_S)
            assert not self._thread.is_alive(), "the gateway did not stop"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        try:
            await self.gateway.start()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.gateway.stop()


@pytest.fixture(scope="module")
def keys() -> dict[str, str]:
    """The client keys in clear, by name (``KEYS``)."""
    return dict(KEYS)


@pytest.fixture(scope="module")
def upstream() -> Iterator[SimulatedProvider]:
    """The simulated provider behind the module's gateway."""
    with SimulatedProvider(models=UPSTREAM, default=UPSTREAM["fast"], seed=11) as provider:
        yield provider


@pytest.fixture
def slowed(upstream: SimulatedProvider) -> Callable[[str, float], AbstractContextManager[None]]:
    """``with slowed(model, seconds):`` the calls ``model`` receives meanwhile take
    ``seconds`` upstream; it is as before for the calls after."""

    @contextlib.contextmanager
    def slow(model: str, seconds: float) -> Iterator[None]:
        upstream.configure(model, dataclasses.replace(UPSTREAM[model], latency_s=seconds))
        try:
            yield
        finally:
            upstream.configure(model, UPSTREAM[model])

    return slow


@pytest.fixture(scope="module")
def gateway(upstream: SimulatedProvider) -> Iterator[Gateway]:
    """The module's gateway (``gateway.url``), with ``KEYS``, in front of ``upstream``."""
    running = Running(Gateway(gateway_config(upstream.base_url), port=0))
    running.start()
    try:
        yield running.gateway
    finally:
        running.stop()


@pytest.fixture
def base_config(upstream: SimulatedProvider) -> GatewayConfig:
    """The module gateway's configuration, for a test to vary and ``make_gateway``."""
    return gateway_config(upstream.base_url)


@pytest.fixture
def make_gateway(upstream: SimulatedProvider) -> Iterator[Callable[..., Gateway]]:
    """``make_gateway(config=None, *, settings=None, **options)``: a gateway of the
    test's own, stopped in teardown (by default configured as the module's, with
    ``settings`` as ``GatewaySettings`` fields and ``options`` as ``SchedulerSettings``
    fields)."""
    started: list[Running] = []

    def make(
        config: GatewayConfig | None = None,
        *,
        settings: dict[str, Any] | None = None,
        **scheduler: Any,
    ) -> Gateway:
        if config is None:
            config = gateway_config(upstream.base_url, **scheduler)
            if settings:
                gateway = dataclasses.replace(config.gateway, **settings)
                config = dataclasses.replace(config, gateway=gateway)
        running = Running(Gateway(config, port=0))
        running.start()
        started.append(running)
        return running.gateway

    yield make
    for running in started:
        running.stop()
