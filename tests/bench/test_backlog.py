"""The backlog scenario's collector meter (bench/backlog.py): it counts full collections
and removes its callback."""

from __future__ import annotations

import gc

from callboard.bench.backlog import _collector_time


def test_collector_time_counts_full_collections_and_removes_its_callback() -> None:
    before = list(gc.callbacks)
    with _collector_time() as meter:
        gc.collect()
        gc.collect(0)
    assert meter.full == 1
    assert meter.process_seconds >= 0
    assert meter.seconds >= 0
    assert gc.callbacks == before
