"""Signal handlers for a block of code: the CLI's run and the bench harness.

What must hold: the handlers in force before the block are back after it,
however it ends; only the main thread can set a handler, so elsewhere the
block runs with the handlers as they are.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["handling"]

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
