"""The cyclic garbage collector, tuned for a process that runs callboard.

A call's objects die by reference counting, but with a few hundred calls in
flight, and a batch's tasks queued, far more than 700 container objects are
alive at once, so at CPython's default thresholds (700, 10, 10) the collector
runs every few calls over everything in flight and, every so often, over the
whole heap, with every thread stopped. Measured in ``callboard serve`` at 50
requests in flight: 0.1 ms of CPU a request and full collections of 50 ms
(``gc.callbacks``); 0.002 ms a request held steady. Measured in an embedded
``System`` at 200 calls in flight with 20,000 tasks submitted at once: 1.8 s of
collections in an 8 s run (the longest 240 ms, and every call in flight waited
it out), against 0.23 s held steady and 0.13 s for a raw aiohttp client doing
the same calls. Garbage in cycles is still collected, only less often.

``SteadyHeap`` is one hold of that setting: what the process has built so far
(modules, the system, a server) is moved out of the collector's sight
(``gc.freeze``), and young collections come every ``YOUNG_COLLECTION_EVERY`` net
allocations (the older generations after 10 of those each, as before). The
collector is process-wide, so holds are counted, as the switch interval's are
(``runtime.switch_interval``): the last release puts the thresholds back (unless
somebody else changed them meanwhile: then they are theirs) and unfreezes, unless
more objects were frozen before the first hold than when this module was imported
(the host's: what it froze and what we did cannot be told apart, so all of it stays
frozen). What was frozen at import is the interpreter's own: CPython 3.12 starts
with 375 tuples frozen (3.11 and 3.13 with none), and taken as a host's, they kept
everything callboard froze frozen for good on 3.12, so cyclic garbage among it was
never collected (found running the suite on 3.12.1).

callboard's own commands hold it while they serve or run (``callboard serve``,
``callboard run``, ``callboard bench``, through ``steady_heap``); an embedded
``System`` holds it only when asked (``SystemConfig(steady_heap=True)``): a host
application keeps its own collector settings otherwise.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from callboard.runtime.counted_hold import CountedHold

__all__ = [
    "YOUNG_COLLECTION_EVERY",
    "PausedCollector",
    "SteadyHeap",
    "paused_collector",
    "steady_heap",
]

YOUNG_COLLECTION_EVERY = 10_000
"""The collector's first threshold while held (CPython's default: 700)."""

_FROZEN_AT_IMPORT = gc.get_freeze_count()
"""What was frozen when callboard was imported (``callboard/__init__`` loads this module
first thing): the interpreter's own (see the module docstring), or a host's that froze
before importing callboard, taken as the same. A host that freezes after importing
callboard keeps what it froze."""


class SteadyHeap(CountedHold):
    """One hold of the steady collector: ``hold`` sets it, ``release`` gives it back.

    Made with ``wanted=False`` it holds nothing (both calls do nothing); each call is
    idempotent.
    """

    _before: tuple[int, int, int] = (700, 10, 10)
    _frozen_before = 0
    _ours: tuple[int, int, int] = (YOUNG_COLLECTION_EVERY, 10, 10)

    def __init__(self, wanted: bool = True) -> None:
        super().__init__(wanted)

    def _take(self, *, first: bool) -> None:
        if not first:
            return
        cls = type(self)
        cls._before = gc.get_threshold()
        cls._frozen_before = gc.get_freeze_count()
        gc.collect()  # what is garbage now is not frozen with the rest
        gc.freeze()
        _, older, oldest = cls._before
        cls._ours = (YOUNG_COLLECTION_EVERY, older, oldest)
        gc.set_threshold(*cls._ours)

    def _give_back(self) -> None:
        cls = type(self)
        if gc.get_threshold() == cls._ours:
            gc.set_threshold(*cls._before)
        if cls._frozen_before <= _FROZEN_AT_IMPORT:  # nobody froze since: all ours
            gc.unfreeze()


@contextlib.contextmanager
def steady_heap() -> Iterator[None]:
    """The steady collector for the ``with`` block (entered once the process is up),
    as it was afterwards, even when the block raises."""
    held = SteadyHeap()
    held.hold()
    try:
        yield
    finally:
        held.release()


class PausedCollector(CountedHold):
    """One hold of the collector paused (``gc.disable``): while a heavy answer is
    parsed, which makes no cycles, its millions of new containers set off collection
    after collection, each holding the interpreter's lock as it walks every object
    (57 MB: 4.2 s to parse with it, 1.6 s without). Counted, as parses on two threads
    may overlap: the last gives back what the first found, unless changed since."""

    _was_enabled = True

    def _take(self, *, first: bool) -> None:
        if first:
            type(self)._was_enabled = gc.isenabled()
            gc.disable()

    def _give_back(self) -> None:
        if type(self)._was_enabled and not gc.isenabled():
            gc.enable()


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """The collector paused for the ``with`` block (see ``PausedCollector``)."""
    held = PausedCollector(wanted=True)
    held.hold()
    try:
        yield
    finally:
        held.release()
