"""The faulty-provider scenario (bench/faults.py): the sustained rate skips the first
second, and a run keeps no server arrival list in its JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from callboard.bench.faults import _server, run_faulty, run_misconfigured_limit, sustained_rate
from callboard.bench.measure import Run
from callboard.bench.plan import Options, Scale
from support import assert_nothing_lost_or_doubled, run_json, small


def test_sustained_rate_skips_the_first_second() -> None:
    burst = [0.0] * 50
    steady = [1.0 + k / 100 for k in range(301)]
    assert sustained_rate(burst + steady) == pytest.approx(100.0)
    assert sustained_rate([0.0, 0.1]) is None


def test_the_achieved_rate_counts_only_the_calls_the_provider_served() -> None:
    """A call answered 429 arrived but achieved nothing: counted, the misconfigured
    limit's rate read higher than what was served (found by a review)."""

    class Provider:
        def stats(self) -> dict[str, Any]:
            counters = {"arrivals": [1.0, 1.5, 1.5, 2.0], "refused_arrivals": [1.5]}
            return {"total": {}, "models": {"m": counters}}

    run, arrivals = _server(Run(scenario="s", system="callboard"), Provider(), "m")  # type: ignore[arg-type]
    assert arrivals == [1.0, 1.5, 2.0]
    assert "refused_arrivals" not in run.server
    assert "arrivals" not in run.server


@pytest.mark.timeout(60)
def test_faulty_runs_keep_no_server_arrival_list_in_the_json() -> None:
    scale = dataclasses.replace(Scale.small(), faulty_tasks=40)
    result = run_faulty(Options(scale=scale, scenarios=("faulty",), baselines=()))
    assert result.figures["tasks"] == 40
    assert result.figures["failed"] == 0
    for run in result.runs:
        assert "arrivals" not in run.as_json()["extra"]
        assert "arrivals" not in run.server


@pytest.mark.timeout(60)
def test_faulty_provider_every_task_succeeds() -> None:
    result = run_json(run_faulty(Options(scale=small(faulty_tasks=60), scenarios=("faulty",))))
    assert result["figures"]["success_ratio"] == 1.0
    assert result["figures"]["failed"] == 0
    assert_nothing_lost_or_doubled(result)


@pytest.mark.timeout(60)
def test_a_limit_set_too_high_loses_and_doubles_nothing() -> None:
    scale = small(misconfigured_tasks=40, misconfigured_skip_s=0.2)
    opts = Options(scale=scale, scenarios=("misconfigured-limit",))
    assert_nothing_lost_or_doubled(run_json(run_misconfigured_limit(opts)))
