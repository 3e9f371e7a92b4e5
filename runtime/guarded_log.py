"""callboard's loggers: a record never raises into callboard.

The standard library guards a handler's ``emit`` only where the handler itself
does (``StreamHandler`` calls ``handleError``); a filter that raises, or a custom
``emit`` that does not catch, raises out of the ``log.info(...)`` that made the
record. A host's request-id filter reading a context variable that callboard's
threads never set (``LookupError``) killed the model actor that logged a
delivery, then the root supervisor as it logged that, and accepted tasks never
got a result (found by a hunt). Every logger of callboard's own code is made
with ``guarded_logger``: a record the host's logging raises on (its record
factory, a filter, a handler) is dropped, and the first such error of each kind
a logger meets is written to stderr, as ``handleError`` writes its own.

What must hold: a log call in callboard returns normally whatever the host's
filters and handlers do (``BaseException`` other than ``Exception`` still goes
through: a Ctrl-C is not a logging error).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import traceback
from typing import Any

__all__ = ["guarded_logger"]


class _Guarded(logging.Logger):
    """What makes a ``Logger`` (of any class) guarded: its ``_log``, which makes the
    record (the host's record factory runs there) and hands it to the handlers, does
    not raise (see the module docstring)."""

    def _log(self, *args: Any, stacklevel: int = 1, **kwargs: Any) -> None:
        try:  # one frame more between the caller and logging: the record names the caller
            super()._log(*args, stacklevel=stacklevel + 1, **kwargs)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - the host's logging, not ours: never raise
            _report(self.name, exc)


_classes: dict[type[logging.Logger], type[logging.Logger]] = {logging.Logger: _Guarded}
"""Each logger class met (the host's ``setLoggerClass`` may make its own) and its
guarded kind."""


_reported: set[tuple[str, type[BaseException]]] = set()
"""(logger, kind of error) said already."""
_lock = threading.Lock()


def _report(name: str, exc: Exception) -> None:
    """Say once per logger and kind of error that the host's logging raised on its
    records."""
    with _lock:
        if (name, type(exc)) in _reported:
            return
        _reported.add((name, type(exc)))
    with contextlib.suppress(Exception):  # stderr closed or broken: nothing left to tell
        sys.stderr.write(
            f"--- callboard: the application's logging raised {type(exc).__name__} on a "
            f"record of {name!r}; such records are dropped (this is said once) ---\n"
            + "".join(traceback.format_exception(exc))
        )


def guarded_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)``, made one whose records never raise into the caller
    (a plain ``Logger`` is changed in place: the same object, so the host's levels,
    handlers and filters on it still apply)."""
    logger = logging.getLogger(name)
    kind = type(logger)
    if issubclass(kind, _Guarded):
        return logger
    with _lock:
        guarded = _classes.get(kind)
        if guarded is None:  # the host's own class: the guard goes in front of it
            guarded = _classes[kind] = type(f"Guarded{kind.__name__}", (_Guarded, kind), {})
    logger.__class__ = guarded
    return logger
