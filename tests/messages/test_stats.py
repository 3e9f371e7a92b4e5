"""The stats snapshot (messages/_stats.py): a readable repr, JSON through ``asdict``, and
frozen all the way down.

Every test reads the stats of a real ``System`` on the simulated provider.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
from support import WAIT_S

from callboard import System


def test_stats_snapshot_repr_str_and_json(make_system: Callable[..., System]) -> None:
    system = make_system()
    for f in system.submit_many(["a", "b"]):
        f.result(WAIT_S)
    stats = system.stats()
    assert repr(stats).startswith("Stats(")
    assert str(stats)
    data = json.loads(json.dumps(dataclasses.asdict(stats)))
    assert data["outcomes"] == {"completed": 2}
    assert data["total"]["finished"] == 2
    assert str(stats.cost_usd) == str(stats.total.cost_usd)


def test_stats_snapshot_is_frozen_all_the_way(make_system: Callable[..., System]) -> None:
    system = make_system()
    system.submit("a").result(WAIT_S)
    stats = system.stats()
    with pytest.raises(TypeError):
        stats.outcomes["completed"] = 99  # type: ignore[index]
    with pytest.raises(TypeError):
        stats.queued["LOW"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        stats.queued_by_tenant["a"] = 1  # type: ignore[index]


def test_an_idle_system_names_every_priority_level_with_nothing_waiting(
    make_system: Callable[..., System],
) -> None:
    system = make_system()
    system.submit("a").result(WAIT_S)
    stats = system.stats()
    assert dict(stats.queued) == {"CRITICAL": 0, "HIGH": 0, "NORMAL": 0, "LOW": 0}
    assert dict(stats.queued_by_tenant) == {}
    assert all(view["reopens_in_s"] is None for view in stats.models.values())
