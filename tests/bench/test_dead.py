"""The dead-provider scenario (bench/dead.py): with nothing listening, every task ends
(given up on), none twice."""

from __future__ import annotations

import dataclasses

import pytest
from callboard.bench.dead import run_dead_provider
from callboard.bench.plan import Options, Scale


@pytest.mark.timeout(60)
def test_every_task_ends_once_when_nothing_listens() -> None:
    scale = dataclasses.replace(Scale.small(), dead_tasks=50, dead_give_up_s=1.0)
    result = run_dead_provider(Options(scale=scale, scenarios=("dead-provider",)))
    assert result.figures["unended"] == 0
    assert result.runs
    for run in result.runs:
        assert run.tasks == 50
        assert (run.lost, run.duplicated) == (0, 0)
