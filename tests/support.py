"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

from typing import Any

from callboard import ModelSettings

WAIT_S = 30.0
"""Upper bound for any wait on a future or event in these tests (never a sleep)."""


def two_models(base_url: str, **overrides: Any) -> tuple[ModelSettings, ModelSettings]:
    return (
        ModelSettings(name="alpha", base_url=base_url, max_concurrency=16, **overrides),
        ModelSettings(name="beta", base_url=base_url, max_concurrency=16, **overrides),
    )
