"""aiohttp's server log for callboard's HTTP servers (the gateway, the simulated
provider), where a malformed request is the client's doing, not an error of the
server's.

aiohttp logs a request it cannot parse at ERROR, with the exception, whose message
quotes the offending bytes: a client's key in a malformed ``Authorization`` line
reached the log, traceback and all (and, with no logging configured, stderr, through
Python's last-resort handler). ``server_log()`` is the logger to give aiohttp's
``AppRunner``: such a record becomes one line at INFO (DEBUG if aiohttp asked that)
naming the status and the error's type, never its bytes; every other record goes as
aiohttp makes it.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["server_log"]


class _ServerLog(logging.LoggerAdapter[logging.Logger]):
    """The adapter ``server_log`` gives (see the module docstring)."""

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        error = kwargs.get("exc_info")
        if isinstance(error, HttpProcessingError) and 400 <= error.code < 500:
            quiet = min(level, logging.INFO)
            what = f"{error.code} {type(error).__name__}"
            self.logger.log(quiet, "%s: %s (its bytes are not logged)", str(msg) % args, what)
            return
        super().log(level, msg, *args, **kwargs)


def server_log() -> logging.Logger:
    """``aiohttp.server``'s logger, quiet about what a client sent (a ``Logger`` to
    aiohttp, which only calls its logging methods)."""
    return cast(logging.Logger, _ServerLog(logging.getLogger("aiohttp.server")))
