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

aiohttp's answer to such a request quoted the bytes too (``Invalid header value
char: b'Authorization: Bearer <key>\x01'``), to the client and any proxy that keeps
answers: ``quiet_answers(runner)``, after ``runner.setup()``, makes it the status
and its reason alone.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

__all__ = ["quiet_answers", "server_log"]


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


class _QuietHandler(RequestHandler):
    """aiohttp's handler, whose answer to a request it could not read says no byte of
    it (a ``__class__`` of the same layout: aiohttp gives no hook for the answer)."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if 400 <= status < 500:
            message = f"{status} {HTTPStatus(status).phrase}"
        return super().handle_error(request, status, exc, message)


class _QuietServer(web.Server):
    """aiohttp's server, whose connections get ``_QuietHandler``."""

    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = _QuietHandler
        return handler


def quiet_answers(runner: web.AppRunner) -> None:
    """Make ``runner``'s answer to a request aiohttp cannot read (a 4xx) its status and
    reason, not its message quoting the client's bytes; call after ``runner.setup()``."""
    server = runner.server
    if server is not None and type(server) is web.Server:
        server.__class__ = _QuietServer
