"""A hold of a process-wide setting that several parts may want at once.

The interpreter's switch interval and its collector's settings are each one
for the whole process, and two systems (or a system and ``callboard run``) may
each ask for one. So the holds are counted, per kind of hold: the first takes
the setting (remembering what it was), the last gives it back. What taking
and giving back mean is the kind's own (``_take``, ``_give_back``, and ``_left``
for a hold that goes while others remain); each runs under the kind's lock.
``hold`` and ``release`` are idempotent, and a hold made not ``wanted`` does
nothing.
"""

from __future__ import annotations

import threading
from typing import ClassVar

__all__ = ["CountedHold"]


class CountedHold:
    """One hold of a kind of setting (a subclass): see the module docstring."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _holders: ClassVar[int] = 0

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls._lock = threading.Lock()  # each kind counts its own holds
        cls._holders = 0

    def __init__(self, wanted: bool) -> None:
        self._wanted = wanted
        self._held = False

    def hold(self) -> None:
        if not self._wanted:
            return
        cls = type(self)
        with cls._lock:  # looked at under the lock: two threads at once hold it once
            if self._held:
                return
            self._take(first=cls._holders == 0)
            cls._holders += 1
            self._held = True

    def release(self) -> None:
        cls = type(self)
        with cls._lock:  # (released twice at once, it was given back twice; a review)
            if not self._held:
                return
            self._held = False
            cls._holders -= 1
            if cls._holders == 0:
                self._give_back()
            else:
                self._left()

    def _take(self, *, first: bool) -> None:
        """Take the setting (``first``: no other hold has it; remember what it was)."""
        raise NotImplementedError

    def _give_back(self) -> None:
        """The last hold has gone: put back what the first found, unless changed since."""
        raise NotImplementedError

    def _left(self) -> None:
        """This hold has gone and others remain (nothing to do, unless the kind says)."""
