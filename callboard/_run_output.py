"""The files of ``callboard run``: its paths, its output and the ledger beside it.

Everything here runs before a line is submitted: the paths are checked, the
existing output is read (and must be ours: every complete line a result
record), its lock taken, a last line torn by a crash cut, and the ledger
opened and matched against this input.

What must hold: nothing is created, cut or appended before the paths and the
output's records have been checked (a file that is not ours gets no lock file
beside it either); one run at a time per output; a ledger that answered an id
of this input for another request is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from callboard.batch import LineError, NotOurOutputError, read_output, read_requests
from callboard.messages import Cancelled, Request, Result, UsageError
from callboard.runtime.filelock import LockHeldError, hold, lock_path
from callboard.runtime.sqlite_ledger import LedgerError, SqliteLedger

__all__ = [
    "OUTPUT_PEEK_LINES",
    "check_paths",
    "count_lines",
    "exclusive",
    "ledger_path",
    "open_ledger",
    "read_our_output",
    "recoverable",
    "repair_tail",
]


OUTPUT_PEEK_LINES = 10
"""Lines of an existing output read before its lock file is created."""


TAIL_BYTES = 1 << 20
"""How much of the output's end ``repair_tail`` reads (a result line is far shorter)."""


def read_our_output(path: Path, *, first: int | None = None) -> dict[str, str]:
    try:
        return read_output(path, first=first)
    except NotOurOutputError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None


def check_paths(args: argparse.Namespace) -> None:
    """Refuse paths that cannot work before anything is opened, created or cut."""
    if not args.input.is_file():
        raise UsageError(f"input file not found: {args.input}")
    out: Path = args.output
    if out.is_dir():
        raise UsageError(f"-o {out} is a directory; give a file")
    if not out.parent.is_dir():
        raise UsageError(f"the directory of -o {out} does not exist")
    if out.exists() and out.samefile(args.input):
        raise UsageError(f"-o {out} is the input file; give another file for the results")
    if args.ledger is not None and not args.ledger.parent.is_dir():
        raise UsageError(f"the directory of --ledger {args.ledger} does not exist")


@contextmanager
def exclusive(output: Path) -> Iterator[None]:
    """Hold OUTPUT.lock for the run: a second run on the same output exits 2."""
    lock = lock_path(output)
    try:
        fd = hold(lock)
    except LockHeldError:
        raise UsageError(f"another callboard run is writing {output} (it holds {lock})") from None
    except OSError as exc:
        raise UsageError(f"cannot create {lock}: {exc.strerror or exc}") from None
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def open_ledger(path: Path) -> SqliteLedger:
    try:
        return SqliteLedger(path)
    except LedgerError as exc:
        raise UsageError(str(exc)) from None
    except (sqlite3.Error, OSError) as exc:
        raise UsageError(f"cannot open the ledger {path}: {exc}") from None


def recoverable(
    ledger: SqliteLedger, args: argparse.Namespace, done: set[str]
) -> dict[str, Result]:
    """Final results the ledger holds for ids of this input, by id.

    Raises ``UsageError`` if the ledger answered an id of this input for another
    request: it belongs to another input (the output was removed, the ledger kept).
    """
    stored = {
        s.key: s
        for s in ledger.stored()
        if s.key is not None and s.result is not None and not isinstance(s.result, Cancelled)
    }
    found: dict[str, Result] = {}
    if not stored:
        return found
    for item in read_requests(args.input):
        s = stored.get(item.id)
        if s is None or isinstance(item, LineError) or s.result is None or item.id in done:
            continue  # (an id the output has is skipped anyway, whatever the ledger says)
        if _asks(s.request) != _asks(item.request):
            raise UsageError(
                f"the ledger {ledger.path} holds a result for id {item.id!r} (line "
                f"{item.number}) of another request: it belongs to another input. "
                "Delete it, or give --ledger another path"
            )
        found[item.id] = s.result
    return found


def _asks(request: Request) -> tuple[Any, ...]:
    return (request.messages, request.model, request.route)


def ledger_path(output: Path) -> Path:
    return output.with_name(output.name + ".ledger")


def count_lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def repair_tail(path: Path) -> None:
    """Cut a last line left incomplete by a crash, so appended lines start clean.

    Only a tail that begins like one of our records (``{"id":``) is cut; the rest of
    the file was checked by ``read_output`` already.
    """
    if not path.exists() or path.stat().st_size == 0:
        return
    line = _last_line(path)
    if line.endswith(b"\n"):
        return
    try:
        json.loads(line)
    except ValueError:  # torn mid-line: that id runs again
        if not line.startswith(b'{"id":'):
            raise UsageError(f"{path} does not end with a callboard result record") from None
        with path.open("r+b") as fh:
            fh.truncate(path.stat().st_size - len(line))
    else:  # complete but for its newline
        with path.open("ab") as fh:
            fh.write(b"\n")


def _last_line(path: Path) -> bytes:
    """The file's last line (with its newline, if it has one), read from the end in
    ``TAIL_BYTES`` steps however long it is."""
    with path.open("rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        fh.seek(end - 1)
        if fh.read(1) == b"\n":
            return b"\n"
        tail = b""
        at = end
        while at > 0:
            upto, at = at, max(0, at - TAIL_BYTES)
            fh.seek(at)
            tail = fh.read(upto - at) + tail
            cut = tail.rfind(b"\n")
            if cut >= 0:
                return tail[cut + 1 :]
        return tail
