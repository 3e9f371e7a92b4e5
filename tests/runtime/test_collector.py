"""The steady collector: ``steady_heap`` for as long as a command runs, ``SteadyHeap`` for
as long as a system asks; counted, and as it was afterwards (a test or a notebook calling
``cli.main`` keeps its own, a host keeps what it froze)."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest
from callboard.runtime import collector
from callboard.runtime.collector import (
    YOUNG_COLLECTION_EVERY,
    PausedCollector,
    SteadyHeap,
    paused_collector,
    steady_heap,
)


@pytest.fixture(autouse=True)
def _collector_as_found() -> Iterator[None]:
    """Each test starts with nothing frozen (CPython 3.12 starts with some frozen) and
    leaves the collector as it found it."""
    before = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()


def test_steady_heap_freezes_and_raises_the_threshold_then_puts_both_back() -> None:
    before = gc.get_threshold()
    built = [object() for _ in range(3)]  # alive when the command is up: frozen
    with steady_heap():
        assert gc.get_threshold() == (YOUNG_COLLECTION_EVERY, *before[1:])
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    assert built  # still ours


def test_steady_heap_puts_the_collector_back_when_the_command_raises() -> None:
    before = gc.get_threshold()
    with pytest.raises(KeyboardInterrupt), steady_heap():
        raise KeyboardInterrupt
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_holds_are_counted_and_the_last_release_puts_the_collector_back() -> None:
    before = gc.get_threshold()
    first, second = SteadyHeap(), SteadyHeap()
    first.hold()
    second.hold()
    first.release()
    first.release()  # idempotent: not a second release of the count
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_EVERY  # the second still holds
    assert gc.get_freeze_count() > 0
    second.release()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_hold_not_wanted_touches_nothing() -> None:
    before = gc.get_threshold()
    idle = SteadyHeap(wanted=False)
    idle.hold()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    idle.release()
    assert gc.get_threshold() == before


def test_what_the_host_froze_stays_frozen_and_thresholds_it_set_meanwhile_stay() -> None:
    gc.freeze()  # the host's own (a server forking workers does this)
    frozen = gc.get_freeze_count()
    held = SteadyHeap()
    held.hold()
    gc.set_threshold(5000, 20, 20)  # the host changed its mind while we held
    held.release()
    assert gc.get_threshold() == (5000, 20, 20)  # theirs, not put back
    assert gc.get_freeze_count() >= frozen  # theirs and ours cannot be told apart: kept


def test_what_the_interpreter_froze_before_callboard_was_imported_is_unfrozen_with_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPython 3.12 starts with tuples frozen: taken as a host's, they kept everything a
    hold froze frozen for good (on 3.12, every release; found on 3.12.1). What was
    frozen at import is the interpreter's, and goes back with ours."""
    kept = [(object(),) for _ in range(3)]  # frozen, as 3.12's own are, before the import
    gc.freeze()
    monkeypatch.setattr(collector, "_FROZEN_AT_IMPORT", gc.get_freeze_count())
    with steady_heap():
        assert gc.get_freeze_count() > collector._FROZEN_AT_IMPORT
    assert gc.get_freeze_count() == 0
    assert kept


def test_a_host_that_freezes_after_importing_callboard_keeps_what_it_froze() -> None:
    """The count taken as the interpreter's is read at ``import callboard``: read when
    ``System`` first loaded the collector, it took a host's freeze (imported, frozen
    before forking, then a ``steady_heap`` system) for CPython's, and unfroze it (a
    review). A fresh interpreter, so the import is the first."""
    script = (
        "import gc, callboard\n"
        "gc.freeze()\n"
        "frozen = gc.get_freeze_count()\n"
        "from callboard.runtime.collector import SteadyHeap\n"
        "held = SteadyHeap()\n"
        "held.hold()\n"
        "held.release()\n"
        "assert gc.get_freeze_count() >= frozen, (gc.get_freeze_count(), frozen)\n"
    )
    done = subprocess.run(  # noqa: S603 - this interpreter, a fixed script
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def test_overlapping_pauses_keep_the_collector_off_until_the_last_ends() -> None:
    """Heavy answers parsed on two threads at once: the first to end turned the
    collector on under the other; the holds are counted."""
    assert gc.isenabled()
    first, second = PausedCollector(wanted=True), PausedCollector(wanted=True)
    first.hold()
    second.hold()
    try:
        first.release()
        assert not gc.isenabled()
    finally:  # the collector on again for the worker's next tests, whatever happened
        second.release()
        first.release()
    assert gc.isenabled()


def test_a_pause_leaves_a_collector_the_host_turned_off_off() -> None:
    gc.disable()
    try:
        with paused_collector():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
