"""The cyclic garbage collector, tuned for a process of callboard's own.

A call's objects die by reference counting, but with a few hundred calls in
flight more than 700 container objects are alive at once, so at CPython's
default thresholds (700, 10, 10) the collector runs every few calls over
everything in flight and, every so often, over the whole heap, with every
thread stopped: measured in ``callboard serve`` at 50 requests in flight, 0.1 ms
of CPU a request and full collections of 50 ms (``gc.callbacks``); 0.002 ms a
request after ``steady_heap``. Garbage in cycles is still collected, only less
often.

Only callboard's own commands (``callboard serve``, ``callboard run``) do this,
for as long as they serve or run: ``steady_heap`` is a context manager that puts
the thresholds back and unfreezes on its way out, so a caller of ``cli.main`` in
a longer-lived process (a test, a notebook) gets its collector back as it was. A
host application that embeds a ``System`` keeps its own settings (it may use
``steady_heap`` itself once it is up).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["YOUNG_COLLECTION_EVERY", "steady_heap"]

YOUNG_COLLECTION_EVERY = 10_000
"""The collector's first threshold after ``steady_heap`` (CPython's default: 700)."""


@contextlib.contextmanager
def steady_heap() -> Iterator[None]:
    """Entered once the process is up: what it built to run (modules, the system, a
    server) is moved out of the collector's sight (``gc.freeze``), and young collections
    come every ``YOUNG_COLLECTION_EVERY`` net allocations; the older generations after
    10 of those each, as before. Left: the thresholds as they were, nothing frozen."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, 10, 10)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
