"""``steady_heap``: the collector off the calls' path for as long as a command runs, and
as it was afterwards (a test or a notebook calling ``cli.main`` keeps its own)."""

from __future__ import annotations

import gc

import pytest
from callboard.runtime.collector import YOUNG_COLLECTION_EVERY, steady_heap


def test_steady_heap_freezes_and_raises_the_threshold_then_puts_both_back() -> None:
    before = gc.get_threshold()
    built = [object() for _ in range(3)]  # alive when the command is up: frozen
    with steady_heap():
        assert gc.get_threshold() == (YOUNG_COLLECTION_EVERY, 10, 10)
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
