"""The ``callboard`` command's entry point (and ``python -m callboard``'s).

The command's code takes most of a second to load on a small machine; a Ctrl-C or a
SIGTERM in that time ended the command in a traceback out of whichever import it
landed in. Here the loading is inside the ``try``: it ends as any interrupted
command does, with a word and its status. Nothing else happens here.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

__all__ = ["main"]

_INTERRUPTED = 130
_TERMINATED = 143


def main() -> int:
    """Load the CLI and run it."""
    try:
        cli_main = _load()
    except KeyboardInterrupt as exc:
        print("callboard: interrupted", file=sys.stderr)
        return _TERMINATED if isinstance(exc, _Terminated) else _INTERRUPTED
    return cli_main()


def _load() -> Callable[[], int]:
    """``callboard.cli.main``, loaded with SIGTERM raising as a Ctrl-C does (Python's own
    handler): a signal anywhere in here, its set-up and tidy-up too, reaches ``main``."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        from callboard.cli import main as cli_main

        return cli_main
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Terminated(KeyboardInterrupt):
    """SIGTERM while the CLI loads."""


def _terminated(_signum: int, _frame: object) -> None:
    raise _Terminated
