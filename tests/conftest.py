"""Shared fixtures: a real simulated provider on loopback, systems that always stop,
and a log handler that sees every record."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from callboard.bench.provider_process import ProviderProcess
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import (
    ASSORTED,
    PRICE,
    WAIT_S,
    LogCollector,
    attached,
    two_models,
)

from callboard import ModelSettings, System, SystemConfig

# A suite started as a background job (`pytest &` in a script, `nohup pytest`) inherits
# SIGINT, or SIGHUP, ignored, and so would every process its tests start: Python raises no
# KeyboardInterrupt then, and a run or a gateway ignores a hangup as a nohup'd one must.
# The tests of Ctrl-C and of signals expect the dispositions of a terminal's foreground
# job; the tests of an ignored signal set it themselves.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_DFL)

DEBUG_LOGGERS = (
    "callboard",
    "httpx",
    "httpcore",
    "aiohttp",
    "asyncio",
    "pykka",
    "concurrent.futures",
)
"""Every logger a call through callboard may write to."""


@pytest.fixture
def provider() -> Iterator[SimulatedProvider]:
    """The simulated provider on loopback: ``alpha`` answers in ~10 ms, ``beta`` in ~20 ms,
    any other model in ~10 ms (tests ``configure`` what they need)."""
    with SimulatedProvider(
        default=ModelBehaviour(latency_s=0.01, jitter_s=0.002),
        models={
            "alpha": ModelBehaviour(latency_s=0.01, jitter_s=0.002),
            "beta": ModelBehaviour(latency_s=0.02, jitter_s=0.002),
        },
        seed=7,
    ) as p:
        yield p


@pytest.fixture
def provider_in_process() -> Iterator[ProviderProcess]:
    """The simulated provider in its own process (its own GIL), as the bench runs it:
    server-side times are not distorted by the client's threads. Every model answers
    in ~5 ms unless the test ``configure``s it."""
    with ProviderProcess(latency_s=0.005, seed=3) as proc:
        yield proc


@pytest.fixture
def make_system(provider: SimulatedProvider) -> Iterator[Callable[..., System]]:
    """``make_system(config=None, **kwargs)``: a System (by default over ``alpha`` and
    ``beta``) that is stopped in teardown, cancelling what it still holds."""
    systems: list[System] = []

    def make(config: SystemConfig | None = None, **kwargs: Any) -> System:
        cfg = config or SystemConfig(models=two_models(provider.base_url))
        system = System(cfg, **kwargs)
        systems.append(system)
        return system

    yield make
    for system in systems:
        system.stop(cancel=True, timeout=10)


@pytest.fixture
def assorted_system(provider: SimulatedProvider) -> Iterator[System]:
    """A System over six priced models of ``provider`` that behave differently (see
    ``ASSORTED``): ``single`` takes one call at a time, ``bad`` refuses every request."""
    for name, behaviour in ASSORTED.items():
        provider.configure(name, behaviour)
    models = tuple(
        ModelSettings(
            name=name,
            base_url=provider.base_url,
            price=PRICE,
            max_concurrency=1 if name == "single" else 16,
        )
        for name in ASSORTED
    )
    system = System(SystemConfig(models=models))
    try:
        yield system
    finally:
        system.stop(timeout=WAIT_S)


@pytest.fixture
def debug_logs() -> Iterator[LogCollector]:
    """Every record at DEBUG and above from callboard and the libraries it drives."""
    with attached(LogCollector(), *DEBUG_LOGGERS, level=logging.DEBUG) as handler:
        yield handler
