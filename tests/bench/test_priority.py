"""The priority scenario's inversion count (bench/priority.py): an inversion is an older,
more urgent task sent by a model after a less urgent one it sent, and only when the
clocks are clear."""

from __future__ import annotations

import pytest
from callboard.bench.plan import Options
from callboard.bench.priority import Dispatch, count_inversions, run_priority
from support import assert_nothing_lost_or_doubled, run_json, small


def test_inversion_counted_when_an_older_more_urgent_task_waits_longer() -> None:
    found = [
        Dispatch(priority=0, model="a", earliest=1.0, latest=1.001),  # CRITICAL, first
        Dispatch(priority=3, model="a", earliest=0.5, latest=0.501),  # LOW, went earlier
        Dispatch(priority=3, model="b", earliest=2.0, latest=2.001),  # LOW, after it: fine
    ]
    assert count_inversions(found) == {"a": 1, "b": 0}


def test_no_inversion_for_newer_urgent_tasks_ties_or_unclear_clocks() -> None:
    found = [
        Dispatch(priority=3, model="a", earliest=0.3, latest=0.4),
        Dispatch(priority=3, model="a", earliest=0.1, latest=0.2),  # same level: not judged
        Dispatch(priority=0, model="a", earliest=0.5, latest=0.6),  # newer: may wait
        Dispatch(priority=1, model="b", earliest=0.7, latest=0.9),
        Dispatch(priority=2, model="b", earliest=0.65, latest=0.75),  # overlaps: not certain
    ]
    assert count_inversions(found) == {"a": 0, "b": 0}
    assert count_inversions([]) == {}


def test_tasks_sent_by_different_models_are_not_compared() -> None:
    """Two models send on their own: a CRITICAL task handed to ``a`` may leave a hair
    after a LOW one handed to ``b`` later; the queue's order was right."""
    found = [
        Dispatch(priority=0, model="a", earliest=1.0, latest=1.001),
        Dispatch(priority=3, model="b", earliest=0.9, latest=0.901),
    ]
    assert count_inversions(found) == {"a": 0, "b": 0}


@pytest.mark.timeout(60)
def test_overload_serves_no_task_before_an_older_more_urgent_one() -> None:
    opts = Options(scale=small(priority_overload_s=0.1), scenarios=("priority",))
    result = run_json(run_priority(opts))
    figures = result["figures"]
    lockstep = figures["lockstep"]
    assert figures["dispatched"] > 0
    assert lockstep["dispatched"] > 0
    assert figures["inversions_total"] == 0  # both runs
    assert lockstep["inversions_total"] == 0
    assert figures["lost"] == 0
    assert lockstep["lost"] == 0
    runs = [r["label"] for r in result["runs"]]
    assert runs == ["varied", "lockstep"]
    assert_nothing_lost_or_doubled(result)
