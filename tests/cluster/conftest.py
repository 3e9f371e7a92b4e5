"""Fixtures for the cluster tests: ONE local Ray per test worker, and systems on it.

Ray takes ~20 s to start on the shared 2-core machine, so it starts once per
worker (only in a worker that runs a test asking for it) and every test gets
its own namespace: its own shared queue and model actors, killed at its end
(they are detached: nothing else would stop them).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from callboard.provider.server import ModelBehaviour, SimulatedProvider

from callboard import ModelSettings, System, SystemConfig
from callboard.config import RayCluster

_namespaces = itertools.count(1)

RAY_START_LOCK = Path(tempfile.gettempdir()) / "callboard-tests-ray-start.lock"
"""Held (``flock``) while a Ray starts: one at a time on this machine. Ray gives a node
30 s to register; test workers starting three at once on the loaded 2-core machine ran
past that ("The current node timed out during startup"). ``two_nodes.py`` takes it too."""


@pytest.fixture(scope="session")
def ray_local() -> Iterator[Any]:
    """A local Ray with 2 CPUs for this test worker, shut down at its end."""
    import ray

    with warnings.catch_warnings(), RAY_START_LOCK.open("a") as turn:
        warnings.simplefilter("ignore")  # Ray's own start-up warnings are not ours
        fcntl.flock(turn, fcntl.LOCK_EX)  # released when the file closes
        ray.init(
            address="local",  # a Ray of its own, even where one runs (``ray start``) already
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            namespace="callboard-tests",
        )
    yield ray
    ray.shutdown()


@pytest.fixture
def shared_provider() -> Iterator[SimulatedProvider]:
    """The provider every system of a test calls: ``m`` answers in ~20 ms."""
    with SimulatedProvider(models={"m": ModelBehaviour(latency_s=0.02)}, seed=5) as p:
        yield p


@pytest.fixture
def cluster_systems(
    ray_local: Any, shared_provider: SimulatedProvider
) -> Iterator[Callable[..., System]]:
    """``make(**model_fields)``: a System whose queue and model ``m`` run on the test's
    own namespace of the local Ray; several made in one test share them."""
    namespace = f"t{os.getpid()}-{next(_namespaces)}"
    systems: list[System] = []

    def make(**fields: Any) -> System:
        model = ModelSettings(name="m", base_url=shared_provider.base_url, **fields)
        config = SystemConfig(models=(model,), cluster=RayCluster(namespace=namespace))
        system = System(config)
        systems.append(system)
        return system

    yield make
    for system in systems:
        system.stop(cancel=True, timeout=10)
    for name in ("callboard.queue", "callboard.model:m"):
        try:
            actor = ray_local.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        ray_local.kill(actor, no_restart=True)
