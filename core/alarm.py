"""Alarm: the timers one actor has set for one purpose, so it never sets one twice.

An actor has no way to cancel a timer (a message to itself, delivered later
by the I/O loop). So it sets one only when it would ring sooner than every
timer still pending (``wants``): one pending at or before that time wakes the
actor anyway, and the actor then looks again. A timer that rings is forgotten
(``rang``); a ring the alarm does not know (a timer of an incarnation before)
is not the actor's.

What must hold: no two pending timers have the same time, and a ring wakes the
actor once. Each timer set is sooner than all pending, so they number at most
the distinct wake times the actor met in decreasing order between two rings,
never one per wake-up. Pure: times come in as arguments.
"""

from __future__ import annotations

__all__ = ["Alarm"]


class Alarm:
    """The pending timers of one purpose (clock times at which they ring)."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[float] = []

    def wants(self, at: float) -> bool:
        """Whether to set a timer for ``at``: none pending rings at or before it.
        True records the timer as set."""
        pending = self._pending
        if pending and min(pending) <= at:
            return False
        pending.append(at)
        return True

    def rang(self, at: float) -> bool:
        """The timer for ``at`` rang: forget it. False if no such timer was pending."""
        try:
            self._pending.remove(at)
        except ValueError:
            return False
        return True

    @property
    def pending(self) -> int:
        """How many timers are set and have not rung."""
        return len(self._pending)

    def __repr__(self) -> str:
        return f"Alarm(pending={sorted(self._pending)})"
