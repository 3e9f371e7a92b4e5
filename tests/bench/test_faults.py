"""The faulty-provider scenario (bench/faults.py): the sustained rate skips the first
second, and a run keeps no server arrival list in its JSON."""

from __future__ import annotations

import dataclasses

import pytest
from callboard.bench.faults import run_faulty, sustained_rate
from callboard.bench.plan import Options, Scale


def test_sustained_rate_skips_the_first_second() -> None:
    burst = [0.0] * 50
    steady = [1.0 + k / 100 for k in range(301)]
    assert sustained_rate(burst + steady) == pytest.approx(100.0)
    assert sustained_rate([0.0, 0.1]) is None


@pytest.mark.timeout(60)
def test_faulty_runs_keep_no_server_arrival_list_in_the_json() -> None:
    scale = dataclasses.replace(Scale.small(), faulty_tasks=40)
    result = run_faulty(Options(scale=scale, scenarios=("faulty",), baselines=()))
    assert result.figures["tasks"] == 40
    assert result.figures["failed"] == 0
    for run in result.runs:
        assert "arrivals" not in run.as_json()["extra"]
        assert "arrivals" not in run.server
