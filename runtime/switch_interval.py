"""The GIL switch interval, held by whoever asked for one (see ``SystemConfig``).

``sys.setswitchinterval`` is process-wide, so the holds are counted: the value
before the first holder comes back when the last one releases, unless
somebody else changed it meanwhile (then it is theirs). The newest holder's
value is in force, and when it goes, the newest remaining one's. CPython keeps
the interval in whole microseconds, so what was set is compared as CPython reads
it back.
"""

from __future__ import annotations

import sys
from typing import ClassVar

from callboard.runtime.counted_hold import CountedHold

__all__ = ["SwitchInterval"]


class SwitchInterval(CountedHold):
    """One hold of the switch interval: ``hold`` sets ``wanted``, ``release`` gives it back.

    ``None`` holds nothing (both calls do nothing); each is idempotent.
    """

    _before = 0.0
    _ours = 0.0
    """The interval as CPython keeps it (whole microseconds) after we set it."""

    def __init__(self, wanted: float | None) -> None:
        super().__init__(wanted is not None)
        self._value = wanted

    _live: ClassVar[list[SwitchInterval]] = []
    """The holds in force, oldest first: the newest one's interval is the process's."""

    def _take(self, *, first: bool) -> None:
        cls = type(self)
        if first:
            cls._before = sys.getswitchinterval()
        assert self._value is not None  # a hold not wanted takes nothing
        cls._live.append(self)
        self._set(self._value)  # the newest holder's is in force

    def _left(self) -> None:
        """The newest remaining hold's interval is in force again (the one that went,
        the newest, left its own to a system that asked for another; found by a
        hunt), unless someone else has set one since."""
        cls = type(self)
        cls._live.remove(self)
        newest = cls._live[-1]._value
        if sys.getswitchinterval() == cls._ours and newest is not None:
            self._set(newest)

    def _give_back(self) -> None:
        cls = type(self)
        cls._live.remove(self)
        if sys.getswitchinterval() == cls._ours:
            sys.setswitchinterval(cls._before)

    def _set(self, value: float) -> None:
        sys.setswitchinterval(value)
        type(self)._ours = sys.getswitchinterval()
