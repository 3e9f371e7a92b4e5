"""``CountedHold``: the first of a kind's holds takes the setting, the last gives it back;
each kind counts its own."""

from __future__ import annotations

import threading
from typing import ClassVar

from callboard.runtime.counted_hold import CountedHold


class Flag(CountedHold):
    events: ClassVar[list[str]] = []

    def _take(self, *, first: bool) -> None:
        self.events.append("take first" if first else "take")

    def _give_back(self) -> None:
        self.events.append("give back")


class Other(Flag):
    events: ClassVar[list[str]] = []


def test_the_first_hold_takes_and_the_last_release_gives_back_once() -> None:
    a, b, idle = Flag(wanted=True), Flag(wanted=True), Flag(wanted=False)
    a.hold()
    a.hold()  # idempotent
    b.hold()
    idle.hold()  # not wanted: nothing
    a.release()
    a.release()  # idempotent: not a second release of the count
    assert Flag.events == ["take first", "take"]
    b.release()
    assert Flag.events == ["take first", "take", "give back"]


def test_each_kind_counts_its_own_holds() -> None:
    flag, other = Flag(wanted=True), Other(wanted=True)
    Flag.events.clear()
    flag.hold()
    other.hold()  # another kind: its own first hold
    assert (Flag.events, Other.events) == (["take first"], ["take first"])
    flag.release()
    other.release()
    assert (Flag.events, Other.events) == (["take first", "give back"], ["take first", "give back"])


class Third(Flag):
    events: ClassVar[list[str]] = []


def test_a_hold_released_by_two_threads_at_once_is_released_once() -> None:
    """Looked at outside the lock, both went through: the count went down twice, and the
    setting was given back while another hold still wanted it (a review)."""
    for _ in range(200):
        Third.events.clear()
        keeper, racing = Third(wanted=True), Third(wanted=True)
        keeper.hold()
        racing.hold()
        start = threading.Barrier(4)

        def release(hold: Third = racing, start: threading.Barrier = start) -> None:
            start.wait()
            hold.release()

        threads = [threading.Thread(target=release) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert "give back" not in Third.events  # keeper still holds it
        keeper.release()
        assert Third.events.count("give back") == 1
