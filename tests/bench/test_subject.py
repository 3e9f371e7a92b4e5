"""Driving callboard in the bench (bench/subject.py): what each kind of thread spent."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from callboard.bench.subject import thread_cpu_s

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="read from /proc")


def _burn(seconds: float, burned: threading.Event, done: threading.Event) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass
    burned.set()
    done.wait(10.0)  # stays alive until read


def test_threads_are_counted_by_kind_with_their_numbers_dropped() -> None:
    before = thread_cpu_s()
    done = threading.Event()
    workers = []
    for n in (2, 7):
        burned = threading.Event()
        worker = threading.Thread(
            target=_burn, args=(0.1, burned, done), name=f"BurnActor-{n}", daemon=True
        )
        worker.start()
        workers.append((worker, burned))
    try:
        for _, burned in workers:
            assert burned.wait(10.0)
        used = thread_cpu_s()
    finally:
        done.set()
        for worker, _ in workers:
            worker.join(5.0)
    assert "BurnActor-2" not in used
    assert "BurnActor-7" not in used
    assert used["BurnActor"] >= 0.15  # 0.1 s each, read in 10 ms ticks
    assert "BurnActor" not in before
    assert used["MainThread"] >= before["MainThread"]
