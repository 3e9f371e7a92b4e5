"""Optional Prometheus metrics, fed by the aggregator."""

from __future__ import annotations

from collections.abc import Callable

from support import WAIT_S

from callboard import System
from callboard import metrics as cb_metrics


def test_metrics_count_results_cost_and_tasks(make_system: Callable[..., System]) -> None:
    system = make_system()
    metrics = cb_metrics.install(system)
    results = [f.result(WAIT_S) for f in system.submit_many([f"q{i}" for i in range(12)])]
    assert all(r.ok for r in results)
    system.stats()  # an ask to the aggregator: every Finished before it is handled
    text = metrics.text()
    assert (
        'callboard_results_total{model="alpha",outcome="completed",priority="NORMAL"} 12.0' in text
    )
    assert 'callboard_tasks{stage="queued"} 0.0' in text
    assert "callboard_latency_seconds_count" in text
    assert 'callboard_breaker_state{model="alpha"} 0.0' in text
