"""Shared fixtures: a real simulated provider on loopback, systems that always stop."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import two_models

from callboard import System, SystemConfig


@pytest.fixture
def provider() -> Iterator[SimulatedProvider]:
    with SimulatedProvider(
        models={
            "alpha": ModelBehaviour(latency_s=0.01, jitter_s=0.002),
            "beta": ModelBehaviour(latency_s=0.02, jitter_s=0.002),
        },
        seed=7,
    ) as p:
        yield p


@pytest.fixture
def make_system(provider: SimulatedProvider) -> Iterator[Callable[..., System]]:
    systems: list[System] = []

    def make(config: SystemConfig | None = None, **kwargs: Any) -> System:
        cfg = config or SystemConfig(models=two_models(provider.base_url))
        system = System(cfg, **kwargs)
        systems.append(system)
        return system

    yield make
    for system in systems:
        system.stop(timeout=10)
