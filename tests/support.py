"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from callboard.bench.provider_process import ProviderProcess

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

CLI_TIMEOUT_S = 90.0
"""Upper bound for one ``callboard`` subprocess (a few seconds normally)."""


def cli(
    *args: Any, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """``python -m callboard ARGS`` in a subprocess; ``env`` adds to this environment."""
    return subprocess.run(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-m", "callboard", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )
