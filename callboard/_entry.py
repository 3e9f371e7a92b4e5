"""The ``callboard`` command's entry point (and ``python -m callboard``'s).

The command's code takes most of a second to load on a small machine; a Ctrl-C or a
SIGTERM in that time ended the command in a traceback out of whichever import it
landed in. Here the loading is inside the ``try``: it ends as any interrupted
command does, with a word and its status. Nothing else happens here.
"""

from __future__ import annotations

import signal
import sys

__all__ = ["main"]

_INTERRUPTED = 130
_TERMINATED = 143


def main() -> int:
    """Load the CLI and run it."""
    previous = signal.signal(signal.SIGTERM, _terminated)  # a Ctrl-C is already an
    try:  # exception (Python's own handler)
        from callboard.cli import main as cli_main
    except KeyboardInterrupt as exc:
        print("callboard: interrupted", file=sys.stderr)
        return _TERMINATED if isinstance(exc, _Terminated) else _INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
    return cli_main()


class _Terminated(KeyboardInterrupt):
    """SIGTERM while the CLI loads."""


def _terminated(_signum: int, _frame: object) -> None:
    raise _Terminated
