"""Fixtures of the simulated provider's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from callboard.provider.behaviour import ModelBehaviour
from callboard.provider.server import SimulatedProvider

Factory = Callable[..., SimulatedProvider]
FAST = ModelBehaviour(latency_s=0.0)


@pytest.fixture
def make_provider() -> Iterator[Factory]:
    """Start providers on port 0 (no latency unless told); stop them all in teardown."""
    started: list[SimulatedProvider] = []

    def make(**kwargs: Any) -> SimulatedProvider:
        kwargs.setdefault("default", FAST)
        provider = SimulatedProvider(**kwargs)
        provider.start()
        started.append(provider)
        return provider

    yield make
    for provider in started:
        provider.stop()
