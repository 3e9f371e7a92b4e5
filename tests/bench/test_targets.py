"""The bench's targets (bench/targets.py): a target without its figure is n/a, never a
PASS or a MISS."""

from __future__ import annotations

from callboard.bench.measure import ScenarioResult
from callboard.bench.targets import evaluate


def test_the_priority_target_is_na_without_a_measured_service_time() -> None:
    figures = {
        "service_time_ms": None,
        "critical_p99_wait_ms": 3.0,
        "inversions_total": 0,
        "lost": 0,
    }
    targets = evaluate({"priority": ScenarioResult(name="priority", figures=figures)}, [])
    wait = next(t for t in targets if t.name.startswith("CRITICAL"))
    assert wait.verdict == "n/a"
    assert wait.value is None
