"""The steady scenario (bench/steady.py): a small run through a real provider answers
every task once through callboard with one model and with two, in every round."""

from __future__ import annotations

import dataclasses

import pytest
from callboard.bench.plan import Options, Scale
from callboard.bench.steady import run_steady


@pytest.mark.timeout(60)
def test_a_small_run_answers_every_task_once_through_one_model_and_two() -> None:
    scale = dataclasses.replace(Scale.small(), steady_tasks=40, steady_levels=(8,), steady_rounds=2)
    result = run_steady(Options(scale=scale, scenarios=("steady",), baselines=()))
    runs = [(r.system, r.round) for r in result.runs]
    assert sorted(runs) == sorted(
        [("callboard", 0), ("callboard-2m", 0), ("callboard", 1), ("callboard-2m", 1)]
    )
    for run in result.runs:
        assert (run.tasks, run.ok, run.failed) == (40, 40, 0)
        assert (run.lost, run.duplicated) == (0, 0)
        assert run.server["requests"] == 40
        assert run.server["max_in_flight"] <= 8
        spent = run.extra["cpu_ms_by_thread"]  # where each task's CPU went, by thread
        assert {"MainThread", "callboard-io", "ModelActor", "QueueActor"} <= set(spent)
        assert all(ms >= 0.0 for ms in spent.values())
