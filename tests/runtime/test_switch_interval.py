"""The switch interval held by whoever asked (runtime/switch_interval.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from callboard.runtime.switch_interval import SwitchInterval


@pytest.fixture(autouse=True)
def interval_restored() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_newest_remaining_holds_interval_is_in_force_when_the_newest_goes() -> None:
    """System A asked 0.5 ms, B then 2 ms: once B stopped, A ran on at B's 2 ms until it
    stopped itself (found by a hunt)."""
    before = sys.getswitchinterval()
    a, b, c = SwitchInterval(0.0005), SwitchInterval(0.002), SwitchInterval(0.001)
    a.hold()
    b.hold()
    assert sys.getswitchinterval() == pytest.approx(0.002)
    c.hold()
    b.release()  # not the newest: the newest's stays
    assert sys.getswitchinterval() == pytest.approx(0.001)
    c.release()
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    a.release()
    assert sys.getswitchinterval() == pytest.approx(before)


def test_an_interval_someone_else_set_meanwhile_is_left_as_it_is() -> None:
    a, b = SwitchInterval(0.0005), SwitchInterval(0.002)
    a.hold()
    b.hold()
    sys.setswitchinterval(0.003)  # the host's own, after ours
    b.release()
    assert sys.getswitchinterval() == pytest.approx(0.003)
    a.release()
    assert sys.getswitchinterval() == pytest.approx(0.003)
