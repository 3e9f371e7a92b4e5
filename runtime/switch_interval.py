"""The GIL switch interval, held by whoever asked for one (see ``SystemConfig``).

``sys.setswitchinterval`` is process-wide, so the holds are counted: the value
before the first holder comes back when the last one releases, unless
somebody else changed it meanwhile (then it is theirs). The newest holder's
value is in force. CPython keeps the interval in whole microseconds, so what
was set is compared as CPython reads it back.
"""

from __future__ import annotations

import sys
import threading

__all__ = ["SwitchInterval"]


class SwitchInterval:
    """One hold of the switch interval: ``hold`` sets ``wanted``, ``release`` gives it back.

    ``None`` holds nothing (both calls do nothing); each is idempotent.
    """

    _lock = threading.Lock()
    _holders = 0
    _before = 0.0
    _ours = 0.0
    """The interval as CPython keeps it (whole microseconds) after we set it."""

    def __init__(self, wanted: float | None) -> None:
        self._wanted = wanted
        self._held = False

    def hold(self) -> None:
        if self._wanted is None or self._held:
            return
        cls = type(self)
        with cls._lock:
            if cls._holders == 0:
                cls._before = sys.getswitchinterval()
            cls._holders += 1
            sys.setswitchinterval(self._wanted)
            cls._ours = sys.getswitchinterval()
        self._held = True

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        cls = type(self)
        with cls._lock:
            cls._holders -= 1
            if cls._holders == 0 and sys.getswitchinterval() == cls._ours:
                sys.setswitchinterval(cls._before)
