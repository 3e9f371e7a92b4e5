"""Signal handlers for a block of code: the CLI's run and the bench harness.

``Interrupts`` notes SIGINT, SIGTERM and SIGHUP where they land and raises them only where
the main thread asks (``check``). An exception raised wherever the main thread
happens to be can leave a lock it shares with other threads held for good: a
``threading.Condition``'s ``__enter__`` is Python, and a pending signal is handled
between its C acquire and the ``with`` that would release it. ``callboard run``
hung so (1 run in about 1,500): the window's semaphore, which the actors release as
results arrive, was left locked by the Ctrl-C, and every release waited for ever.

What must hold: the handlers in force before the block are back after it,
however it ends; only the main thread can set a handler, so elsewhere the
block runs with the handlers as they are; a noting handler takes no lock and calls
nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

__all__ = ["TERMINATING", "Interrupts", "Terminated", "handling", "hang_ups"]

Handler = Callable[[int, Any], Any] | int


@contextmanager
def handling(handler: Handler, *signals: signal.Signals) -> Iterator[None]:
    """``signals`` go to ``handler`` (a function, ``SIG_IGN`` or ``SIG_DFL``) for the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = [(sig, signal.signal(sig, handler)) for sig in signals]
    try:
        yield
    finally:
        for sig, previous in reversed(before):
            signal.signal(sig, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a container or service manager stopping us), or SIGHUP (the terminal
    closed: an SSH session dropped): stop as for Ctrl-C."""


_SIGHUP: signal.Signals | None = getattr(signal, "SIGHUP", None)
"""SIGHUP, where there is one (not on Windows)."""


def hang_ups() -> tuple[signal.Signals, ...]:
    """SIGHUP, where there is one and the process does not ignore it: under ``nohup``
    (which ignores it) a dropped session must not stop a run or a gateway; taken over
    regardless, it did (a review)."""
    return () if _SIGHUP is None else heeded(_SIGHUP)


def heeded(*signals: signal.Signals) -> tuple[signal.Signals, ...]:
    """Those of ``signals`` the process does not ignore. What started it decides: a
    background job of a non-interactive shell starts with SIGINT ignored (a Ctrl-C at
    the terminal goes to its whole process group), ``nohup`` ignores SIGHUP; Python
    leaves an ignored SIGINT ignored, and so does callboard (taken over regardless, a
    Ctrl-C meant for the script's foreground stopped the run in the background; found by
    a hunt)."""
    return tuple(sig for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN)


TERMINATING = frozenset({signal.SIGTERM} if _SIGHUP is None else {signal.SIGTERM, _SIGHUP})
"""The signals raised as ``Terminated``. SIGHUP's default ended a run at once (a
dropped SSH session without nohup or tmux): the calls in flight, already paid for, were
lost and sent again by the rerun."""


class Interrupts:
    """SIGINT, SIGTERM and SIGHUP counted by the handler, raised by ``check`` (see the module
    docstring). Use ``noted()`` around the block; poll ``check`` where the main thread
    waits (a wait in slices) and between steps of its work."""

    def __init__(self) -> None:
        self.first = 0
        """The first signal noted (0: none yet)."""
        self.sigints = 0
        """SIGINTs noted so far (a second Ctrl-C asks for more haste)."""
        self.count = 0
        """Signals noted so far, of either kind."""
        self.raise_at: int | None = None
        """From this many signals on, the handler raises at once (``check``'s exception):
        set where the main thread shares no lock with another (the run's tidy-up,
        which a second signal may cut short)."""

    def _note(self, signum: int, _frame: object) -> None:
        # plain stores: the handler runs between any two bytecodes of the main thread
        if signum == signal.SIGINT:
            self.sigints += 1
        if not self.first:
            self.first = signum
        self.count += 1
        if self.raise_at is not None and self.count >= self.raise_at:
            raise Terminated if signum in TERMINATING else KeyboardInterrupt

    def noted(self) -> AbstractContextManager[None]:
        """SIGINT, SIGTERM and SIGHUP are noted, not raised, for the block."""
        return handling(self._note, *heeded(signal.SIGINT, signal.SIGTERM), *hang_ups())

    @property
    def terminated(self) -> bool:
        """Whether the first signal was one of ``TERMINATING``."""
        return self.first in TERMINATING

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` (``Terminated`` for SIGTERM or SIGHUP) if a signal
        came."""
        if self.terminated:
            raise Terminated
        if self.first:
            raise KeyboardInterrupt
