"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

from typing import Any

from callboard.bench._bench_provider import ProviderProcess

from callboard import ModelSettings

WAIT_S = 30.0
"""Upper bound for any wait on a future or event in these tests (never a sleep)."""


def two_models(base_url: str, **overrides: Any) -> tuple[ModelSettings, ModelSettings]:
    fields: dict[str, Any] = {"max_concurrency": 16, **overrides}
    return (
        ModelSettings(name="alpha", base_url=base_url, **fields),
        ModelSettings(name="beta", base_url=base_url, **fields),
    )


def provider_process(*, latency_s: float, seed: int) -> ProviderProcess:
    """The simulated provider in its own process (its own GIL), as the bench runs it."""
    proc = ProviderProcess(latency_s=latency_s, seed=seed)
    proc.start()
    return proc


INTERRUPTIBLE = (
    "import runpy, signal, sys; "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'callboard'; "
    "runpy.run_module('callboard', run_name='__main__')"
)
"""``python -m callboard`` with Python's own SIGINT handler even when this test runs with
SIGINT ignored (a background job), which the child would otherwise inherit."""
