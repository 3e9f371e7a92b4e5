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


def test_latency_percentiles_count_only_tasks_that_made_a_call() -> None:
    """A burst of queue-full refusals (ended at once, no call) must not drag p50 to 0."""
    from callboard.core.stats import StatsBook
    from callboard.messages import Completed, Priority, Rejected, RejectReason

    book = StatsBook()
    served = [
        Completed(
            task_id=i,
            trace_id="t",
            priority=Priority.NORMAL,
            model="m",
            attempts=1,
            latency_s=0.5,
            queue_wait_s=0.1,
            content="x",
        )
        for i in range(3)
    ]
    refused = [
        Rejected(
            task_id=10 + i,
            trace_id="t",
            priority=Priority.NORMAL,
            latency_s=0.0,
            reason=RejectReason.QUEUE_FULL,
        )
        for i in range(30)
    ]
    book.add([*served, *refused])
    total = book.total.freeze()
    assert total.finished == 33
    assert total.latency.count == total.queue_wait.count == 3
    assert total.latency.p50 == 0.5
