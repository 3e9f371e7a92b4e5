"""Logging helpers: every callboard record can show its task id and trace id, and
none can show a secret.

Records about one task carry ``task_id`` and ``trace_id`` attributes; others
do not. ``TaskLogFilter`` gives every record both (``-`` when absent) so one
format string serves all records::

    handler.addFilter(callboard.TaskLogFilter())
    handler.setFormatter(logging.Formatter(callboard.LOG_FORMAT))

Secrets: once a model with a key is built, every log record made in the
process is redacted when it is made (``runtime/redact.py``), whoever logs it;
``RedactingFilter`` does it again on a handler, whatever else is in place, and
hides the ``extra=`` fields too, which logging sets after a record is made: a host
whose handlers print them (JSON logs) adds it to its own.

Handlers are the host's: callboard adds none outside ``configure``, so a process
that configured no logging gets Python's ``lastResort`` (WARNING and above on
stderr, the message alone), the logging HOWTO's default for a library, which
``callboard shell`` relies on without ``-v``; a host drops them with a
``NullHandler`` on the ``callboard`` logger.

``configure(verbose)`` is the command line's logging: one stderr handler
carrying both filters; callboard's own loggers at ``-v`` info, ``-vv`` debug;
the libraries callboard drives (``THIRD_PARTY``: httpx, httpcore, aiohttp,
asyncio...) stay at warnings whatever ``-v`` says (their DEBUG records print
request and response headers), and ``-vvv`` lets their INFO through, never
their DEBUG. Python's warnings go through logging too (``py.warnings``), so
they pass the redactor like any record.
"""

from __future__ import annotations

import logging
from typing import Final, TextIO

from callboard.runtime.redact import RedactingFilter

__all__ = ["LOG_FORMAT", "THIRD_PARTY", "RedactingFilter", "TaskLogFilter", "configure"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [task=%(task_id)s trace=%(trace_id)s] %(message)s"

THIRD_PARTY: Final = (
    "httpx",
    "httpcore",
    "h11",
    "h2",
    "hpack",
    "aiohttp",
    "asyncio",
    "urllib3",
    "pykka",
    "concurrent.futures",
)
"""Loggers of the libraries callboard drives, held at ``third_party_level``."""


class TaskLogFilter(logging.Filter):
    """Adds ``task_id``/``trace_id`` = ``-`` to records that have none; drops nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "task_id"):
            record.task_id = "-"
        if not hasattr(record, "trace_id"):
            record.trace_id = "-"
        return True


def callboard_level(verbose: int) -> int:
    """Warnings; ``-v`` info; ``-vv`` (or more) debug."""
    return max(logging.DEBUG, logging.WARNING - 10 * verbose)


def third_party_level(verbose: int) -> int:
    """Warnings; ``-vvv`` (or more) info; never debug."""
    return logging.INFO if verbose >= 3 else logging.WARNING


class _Stderr(logging.StreamHandler[TextIO]):
    """The command line's handler, on stderr, carrying both filters."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(TaskLogFilter())
        self.addFilter(RedactingFilter())
        self.setFormatter(logging.Formatter(LOG_FORMAT))


def configure(verbose: int) -> None:
    """The command line's logging (see the module). Like ``logging.basicConfig``, it
    leaves a process whose root logger already has a handler it did not put there
    as it is (a host, or a test harness, configured logging); called again, it
    replaces its own handler and levels."""
    root = logging.getLogger()
    if any(not isinstance(h, _Stderr) for h in root.handlers):
        return
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.addHandler(_Stderr())
    outside = third_party_level(verbose)
    root.setLevel(outside)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(outside)
    logging.getLogger("callboard").setLevel(callboard_level(verbose))
    logging.captureWarnings(True)  # a warning's text is a record too, so it is redacted
