"""The outage scenario (bench/outage.py): while the primary model answers 503 its
fallback serves, no task fails or is lost, and the breaker is seen to open."""

from __future__ import annotations

import pytest
from callboard.bench.outage import run_outage
from callboard.bench.plan import Options, Scale


@pytest.mark.timeout(60)
def test_outage_fails_no_task() -> None:
    result = run_outage(Options(scale=Scale.small(), scenarios=("outage",)))
    figures = result.figures
    assert figures["failed"] == 0
    assert figures["lost"] == 0
    assert figures["time_to_open_s"] is not None
    for run in result.runs:
        assert run.tasks > 0
        assert (run.lost, run.duplicated) == (0, 0)
