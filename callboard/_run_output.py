"""The files of ``callboard run``: its paths, its output and the ledger beside it.

Everything here runs before a line is submitted: the paths are checked, the
existing output is read (and must be ours: every complete line a result
record), its lock taken, a last line torn by a crash cut, and the ledger
opened and read.

``-`` (or a path that is not a regular file: a pipe, ``/dev/stdout``) is a
stream: the input is read once into a temporary file, the output is written
and never read. A stream output has nothing to resume from, so it gets no lock
and no ledger unless ``--ledger`` names one.

What must hold: nothing is created, cut or appended before the paths and the
output's records have been checked (a file that is not ours gets no lock file
beside it either); one run at a time per output; a ledger that cannot be used
is a ``UsageError`` naming the file, what is wrong and what to do, before any
line is sent; a damaged one is only ever renamed, never deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sqlite3
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from callboard._run_plan import Held
from callboard.batch import NotOurOutputError, OutputState, is_record, read_output
from callboard.messages import UsageError
from callboard.runtime.filelock import hold_or, lock_path, release
from callboard.runtime.sqlite_ledger import (
    LedgerDamagedError,
    LedgerError,
    LedgerUnavailableError,
    SqliteLedger,
    rebuild,
)

__all__ = [
    "OUTPUT_PEEK_LINES",
    "STDIO",
    "check_paths",
    "count_lines",
    "exclusive",
    "fd_open",
    "is_stream",
    "ledger_path",
    "ledger_results",
    "open_ledger",
    "open_output",
    "read_our_output",
    "repair_tail",
    "spooled",
]

STDIO = "-"
"""The path that means stdin for the input, stdout for the output."""


OUTPUT_PEEK_LINES = 10
"""Lines of an existing output read before its lock file is created."""


TAIL_BYTES = 1 << 20
"""How much of the output's end ``repair_tail`` reads at a time, looking for where its
last line starts (a result line is mostly far shorter)."""


def read_our_output(path: Path, *, first: int | None = None) -> OutputState:
    try:
        return read_output(path, first=first)
    except NotOurOutputError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None


def is_stream(path: Path) -> bool:
    """``-``, or a path that is not a regular file or a directory (a pipe, a terminal,
    ``/dev/stdout``): read or written once, in order, never reopened."""
    if str(path) == STDIO or path.parent in (Path("/dev"), Path("/dev/fd"), Path("/proc/self/fd")):
        return True
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_paths(args: argparse.Namespace) -> None:
    """Refuse paths that cannot work before anything is opened, created or cut. A path
    the system cannot look at (a name too long, a folder it may not search) is refused
    naming it: it was a traceback (found by a hunt)."""
    try:
        _check_paths(args)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        raise UsageError(f"cannot use the path {where}{exc.strerror or exc}") from None


def _check_paths(args: argparse.Namespace) -> None:
    _stdin_open(args.input)
    _stdout_open(args.output)
    _not_the_input_on_stdout(args.input, args.output)
    for what, given in (("-o", args.output), ("--ledger", args.ledger)):
        if given is not None and not is_stream(given):
            _resolvable(what, given)
    if not is_stream(args.input):
        _readable(args.input)
    out: Path = args.output
    if args.ledger is not None:
        if not args.ledger.parent.is_dir():
            raise UsageError(f"the directory of --ledger {args.ledger} does not exist")
        for what, path in (("the input file", args.input), ("the -o file", out)):
            if not is_stream(path) and _same_file(args.ledger, path):
                raise UsageError(
                    f"--ledger {args.ledger} is {what}; give the ledger a path of its own"
                )
    if is_stream(out):
        return
    if out.is_dir():
        raise UsageError(f"-o {out} is a directory; give a file")
    if not out.parent.is_dir():
        raise UsageError(f"the directory of -o {out} does not exist")
    if not is_stream(args.input) and _same_file(out, args.input):
        raise UsageError(f"-o {out} is the input file; give another file for the results")


@contextmanager
def spooled(path: Path, directory: Path | None = None) -> Iterator[Path]:
    """A stream input (``-``: stdin) copied into a file in ``directory`` (None: a
    temporary directory of its own), which the run reads as often as it needs; a
    regular file as it is, needing no temporary directory (one was made for every run,
    and a host with none writable got a traceback; found by a hunt). Where the system
    names a process's open files (Linux's ``/proc/self/fd``), the copy has no name of
    its own: a run killed (SIGKILL) left every prompt of its input in it for good."""
    if not is_stream(path):
        yield path
        return
    with contextlib.ExitStack() as held:
        if directory is None:
            try:
                directory = Path(held.enter_context(tempfile.TemporaryDirectory(prefix=SPOOL)))
            except OSError as exc:  # none writable
                raise UsageError(
                    f"cannot read the input {path}: no writable temporary directory to copy "
                    f"it into ({exc}); set TMPDIR to one"
                ) from None
        try:
            dst, copy = _spool_file(held, directory)
            if str(path) == STDIO:
                shutil.copyfileobj(sys.stdin.buffer, dst)
            else:
                with path.open("rb") as src:
                    shutil.copyfileobj(src, dst)
            dst.flush()
        except OSError as exc:
            raise UsageError(f"cannot read the input {path}: {exc.strerror or exc}") from None
        yield copy  # the unnamed copy is held open (by ``held``) while the run reads it


SPOOL = "callboard-run-"
"""The prefix of the temporary directory a stream input is copied into."""


def _spool_file(held: contextlib.ExitStack, directory: Path) -> tuple[IO[bytes], Path]:
    """A file to copy stdin into, held open by ``held``, and the path the run reads it
    by: an unnamed one where ``/proc/self/fd`` reopens it (each open reads from its
    start), else ``stdin.jsonl`` in ``directory`` (a sandbox may forbid the reopening)."""
    if _OPEN_FILES.is_dir():
        unnamed = held.enter_context(tempfile.TemporaryFile(dir=directory))  # noqa: SIM115
        copy = _OPEN_FILES / str(unnamed.fileno())
        try:
            copy.open("rb").close()
        except OSError:
            pass
        else:
            return unnamed, copy
    copy = directory / "stdin.jsonl"
    return held.enter_context(copy.open("wb")), copy


_OPEN_FILES = Path("/proc/self/fd")


def _stdout_open(path: Path) -> None:
    """``UsageError`` for an output that is standard output when that is closed (the
    command started with ``>&-``, as a service or a cron job may be). ``-`` was
    ``sys.stdout``, None: the writer died on its first line, and every line was still
    sent and paid for, its result written nowhere. ``/dev/stdout`` named descriptor 1,
    which the next file opened had taken: the results went into the ledger's lock file,
    and the run ended 0 (the first found by a hunt)."""
    if _closed_stdio(path, 1):
        raise UsageError(
            f"-o {path} is standard output, which is closed (the command was started "
            "with >&-): the results could be written nowhere; give -o a file"
        )


_STDOUT_NAMES = frozenset({Path("/dev/stdout"), Path("/dev/fd/1"), Path("/proc/self/fd/1")})
"""The paths that name the process's standard output."""
_STDIN_NAMES = frozenset({Path("/dev/stdin"), Path("/dev/fd/0"), Path("/proc/self/fd/0")})
"""The paths that name the process's standard input."""


def _stdin_open(path: Path) -> None:
    """``UsageError`` for an input that is standard input when that is closed (started
    with ``<&-``): reading ``-`` was a traceback; ``/dev/stdin`` named descriptor 0, which
    the run's own spool file had taken by then, and the run read that, found nothing to
    do and ended 0 (found by a hunt)."""
    if _closed_stdio(path, 0):
        raise UsageError(
            f"the input is {path} (standard input), but standard input is closed; give "
            "the input file's path"
        )


def _closed_stdio(path: Path, fd: int) -> bool:
    """Whether ``path`` names standard input (``fd`` 0) or output (1), and it is closed."""
    if str(path) == STDIO:
        return (sys.stdin if fd == 0 else sys.stdout) is None
    return _is_stdio(path, fd) and not fd_open(fd)


def _is_stdio(path: Path, fd: int) -> bool:
    """Whether ``path`` names standard input (``fd`` 0) or output (1)."""
    return str(path) == STDIO or path in (_STDIN_NAMES if fd == 0 else _STDOUT_NAMES)


def fd_open(fd: int) -> bool:
    """Whether descriptor ``fd`` is open."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _not_the_input_on_stdout(given: Path, output: Path) -> None:
    """``UsageError`` for results written on standard output when that is the input
    file (``-o - >> in.jsonl``): the run read its own results as input, and grew the
    file by 85,000 lines in seconds (found by a hunt)."""
    if not _is_stdio(output, 1) or is_stream(given):
        return
    try:
        out, read = os.fstat(1), given.stat()
    except OSError:  # closed (refused above) or no input (refused below)
        return
    if (out.st_dev, out.st_ino) == (read.st_dev, read.st_ino):
        raise UsageError(
            f"-o {output} is standard output, which is the input file {given}; give "
            "another file for the results"
        )


@contextmanager
def open_output(path: Path) -> Iterator[IO[str]]:
    """The output, for appending (``-``: stdout, left open). ``UsageError`` if it cannot
    be opened, or is standard output and that is closed."""
    _stdout_open(path)
    if str(path) == STDIO:
        yield sys.stdout
        return
    try:
        fh = path.open("a", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        yield fh
    finally:
        # each line was flushed as it was written: what is left is a line whose write
        # failed, which the writer has recorded (a pipe whose reader left, a full disk)
        with contextlib.suppress(OSError):
            fh.close()


def file_identity(fh: IO[str]) -> tuple[int, int]:
    """The open file's device and inode."""
    st = os.fstat(fh.fileno())
    return st.st_dev, st.st_ino


def path_identity(path: Path) -> tuple[int, int] | None:
    """The device and inode of the file ``path`` names now; None if it names none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


@contextmanager
def exclusive(output: Path) -> Iterator[None]:
    """Hold OUTPUT.lock for the run, and the output file itself, made now if it is not
    there yet (and taken away again if the run wrote nothing to it): a second run on
    the same output exits 2, whatever name it gives it (the lock is beside the file a
    symbolic link names; a hard link is the same file, made to a new output as well:
    locked only when it was there at the start, two runs wrote every id twice)."""
    made = not output.exists()
    held: list[int] = []
    busy = f"another callboard run is writing {output}"
    try:
        for lock in (lock_path(output), output):
            held.append(hold_or(lock, UsageError, busy))  # noqa: PERF401 - each held as it is taken
        yield
    finally:
        if made and len(held) == 2:
            with contextlib.suppress(OSError):
                made_file = os.fstat(held[1])
                still = path_identity(output) == (made_file.st_dev, made_file.st_ino)
                if made_file.st_size == 0 and still:
                    output.unlink()  # nothing written: as if the run had made nothing
        for fd in held:
            release(fd)


SQLITE_HEADER = b"SQLite format 3\x00"
"""The first 16 bytes of every SQLite database file."""

REBUILD_HINT = (
    "To set it aside (renamed to {path}.damaged or the next free name; nothing is "
    "deleted) and start a new one with every row of it that still reads, run again with "
    "--rebuild-ledger: the ids {output} holds are not sent again"
)


def open_ledger(
    path: Path, output: Path, state: OutputState, *, rebuild_it: bool, given: bool = True
) -> SqliteLedger:
    """The run's ledger, checked: a ``UsageError`` naming the file, what is wrong and what
    to do if it cannot be used. ``rebuild_it``: rebuild it first (``--rebuild-ledger``).
    A text file named by ``--ledger`` (``given``) is refused, and never set aside: it is
    somebody's data (another run's results, an input given by mistake), not a damaged
    ledger. At the default path beside the output it is a damaged ledger as any other:
    ``--rebuild-ledger`` sets it aside (renamed, nothing deleted). A path that is there
    but no regular file (a directory, a device such as ``/dev/null``, a pipe) is
    refused, never opened, set aside or rebuilt."""
    kind = _not_a_file(path)
    if kind is not None:
        flag = "--ledger " if given else "the ledger "
        raise UsageError(
            f"{flag}{path} is {kind}, not a file: a ledger is a file of its own (give "
            "--ledger a file's path; --no-ledger runs without one)"
        )
    foreign = _foreign(path)
    if foreign and given:
        raise UsageError(
            f"--ledger {path} is a text file, not a ledger (callboard's ledgers are "
            "SQLite databases); it is left as it is: give --ledger another path"
        )
    if foreign and not rebuild_it:
        raise UsageError(
            f"the ledger {path} is a text file, not a ledger (callboard's ledgers are SQLite "
            "databases). " + REBUILD_HINT.format(path=path, output=output)
        )
    if rebuild_it:
        _rebuild(path)
    elif _emptied(path) and any(s != "invalid" for s in state.statuses.values()):
        raise UsageError(
            f"the ledger {path} is empty (0 bytes) but {output} holds results: it was cut "
            "or replaced. " + REBUILD_HINT.format(path=path, output=output)
        )
    try:  # the input holds every line: one with no result is sent again by the next run
        return SqliteLedger(path, durable_accepts=False)
    except LedgerDamagedError as exc:
        raise UsageError(f"{exc}. " + REBUILD_HINT.format(path=path, output=output)) from None
    except LedgerUnavailableError as exc:  # whole, maybe: neither rebuilt nor replaced
        raise UsageError(str(exc)) from None
    except LedgerError as exc:
        raise UsageError(f"{exc}; give --ledger another path") from None
    except (sqlite3.Error, OSError) as exc:
        raise UsageError(f"cannot open the ledger {path}: {exc}") from None


def _not_a_file(path: Path) -> str | None:
    """What ``path`` is when it is there and no regular file (links followed), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:  # not there (yet): the ledger makes it
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


def _readable(path: Path) -> None:
    """``UsageError`` for an input that is no file this run can read."""
    if path.is_dir():
        raise UsageError(f"the input {path} is a directory; give a file")
    if not path.is_file():
        raise UsageError(f"input file not found: {path}")
    try:
        with path.open("rb") as fh:
            head = fh.read(2)
    except OSError as exc:  # unreadable: before a lock or a ledger is made for it
        raise UsageError(f"cannot read the input {path}: {exc.strerror}") from None
    if head in (b"\xff\xfe", b"\xfe\xff"):  # each line was "not UTF-8" (a hunt)
        raise UsageError(
            f"the input {path} is UTF-16 (as PowerShell's > writes a file); save it as "
            "UTF-8 (Out-File -Encoding utf8, or Set-Content -Encoding utf8)"
        )


def _resolvable(what: str, path: Path) -> None:
    """``UsageError`` for a path that names no file: a loop of symbolic links (its
    ``RuntimeError`` was a traceback), or one too deep to follow."""
    try:
        path.resolve()
    except (RuntimeError, OSError) as exc:
        raise UsageError(f"{what} {path} cannot be followed to a file: {exc}") from None


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file (through links too), or one path."""
    try:
        return a.samefile(b)
    except OSError:  # one of them does not exist (yet)
        return a.resolve() == b.resolve()


def _foreign(path: Path) -> bool:
    """A file at ``path`` that is text (JSON lines, a CSV, a note), not a database: a
    damaged ledger is binary, even where its SQLite header is gone."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:  # none there (or unreadable: opening it says so)
        return False
    if not head or head.startswith(SQLITE_HEADER):
        return False
    text = head.decode("utf-8", "ignore")  # a character cut at 4096 bytes is dropped
    return len(text.encode()) >= len(head) - 3 and all(
        c.isprintable() or c in "\t\n\r" for c in text
    )


def _emptied(path: Path) -> bool:
    """A ledger file of 0 bytes. A write-ahead log beside it does not make it whole:
    SQLite writes the main file's header before any log, so no crash leaves an empty
    main file with a log, and SQLite opening one discards the log (its rows with it)."""
    try:
        return path.stat().st_size == 0
    except OSError:
        return False


def _rebuild(path: Path) -> None:
    try:
        done = rebuild(path)
    except LedgerError as exc:
        raise UsageError(f"cannot rebuild: {exc}; give --ledger another path") from None
    except (sqlite3.Error, OSError) as exc:
        raise UsageError(f"cannot rebuild the ledger {path}: {exc}") from None
    if done.aside is None:
        return
    if done.dropped is None:
        said = (
            "empty: the old file does not read as a database, and every row it held is "
            "lost (their ids are sent again unless the output holds their result)"
        )
    else:
        said = (
            f"with the {done.kept} rows that read ({done.dropped} did not: their ids are "
            "sent again unless the output holds their result)"
        )
    print(
        f"callboard: set the ledger aside as {done.aside}; rebuilt {path} {said}", file=sys.stderr
    )


def ledger_results(ledger: SqliteLedger, output: Path) -> dict[str, Held]:
    """The final results the ledger holds, by key (the line id): the digest of the
    request each answered and its status, no result decoded (``BatchRun`` reads the
    ones it recovers). Raises ``UsageError`` if rows of it do not decode."""
    try:
        kept = ledger.kept()
    except LedgerDamagedError as exc:
        raise UsageError(
            f"{exc}. " + REBUILD_HINT.format(path=ledger.path, output=output)
        ) from None
    statuses = {name: name.lower() for name in {k.status for k in kept.values()}}
    return {key: Held(k.digest, statuses[k.status]) for key, k in kept.items()}


def ledger_path(output: Path) -> Path:
    """``OUTPUT.ledger`` beside the file ``output`` names, through symbolic links, as its
    lock is (a run resumed through a link, a ``latest.jsonl`` a cron job uses, found no
    ledger beside the link's name and paid again for every result the output lacked;
    found by a hunt). A ledger a run made beside a link's name before this is not
    looked for: once there, it was taken for every file the link later named (a
    review)."""
    real = output.resolve()
    return real.with_name(real.name + ".ledger")


def count_lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def repair_tail(path: Path) -> None:
    """Cut a last line left incomplete by a crash, so appended lines start clean.

    Only a tail that could be the start of one of our records is cut: one that begins
    with ``{"id":``, or a part of it (a write cut at any byte by a full disk or a
    file size limit), or NUL bytes (what a power cut can leave); the rest of the file
    was checked by ``read_output`` already. A cut or a newline that cannot be written
    (the disk still full, the file size limit still there) is a ``UsageError`` naming
    the file: it was a traceback (found by a hunt).
    """
    torn = check_tail(path)
    if torn is None:
        return
    if torn:
        _cut(path, torn)
        return
    try:
        with path.open("ab") as fh:  # a record complete but for its newline
            fh.write(b"\n")
    except OSError as exc:
        raise UsageError(
            f"cannot add the newline the last record of {path} lacks "
            f"({exc.strerror or exc}); free some space (or lift the file size limit) and "
            "run again"
        ) from None


def check_tail(path: Path) -> int | None:
    """What ``repair_tail`` would do to the file's last line, the file left as it is:
    None, nothing (no file, or a last line with its newline); the bytes of a torn record
    to cut; 0, a record complete but for its newline. A last line that is neither is a
    ``UsageError``: asked before the run's lock is taken, so such a file (one line of a
    settings file's JSON with no newline) gets no ``OUTPUT.lock`` beside it (it did;
    found by a hunt)."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    line = _last_line(path)
    if line.endswith(b"\n"):
        return None
    if line.startswith(_RECORD_START) and not _ends_an_object(line):
        return len(line)  # torn: not parsed (a torn line of vectors may be hundreds of MB,
        # and parsing it took several times that)
    try:
        json.loads(line)
    except ValueError:  # torn mid-line: that id runs again
        if not _torn_record(line):
            raise UsageError(f"{path} does not end with a callboard result record") from None
        return len(line)
    if not is_record(line):  # whole JSON, but no record of ours: a file written by json.dump
        raise UsageError(  # (a settings file given as -o?) would have results appended to it
            f"{path} ends with a line that is not a callboard result record; is this the right -o?"
        )
    return 0


def _cut(path: Path, torn: int) -> None:
    """Cut the last ``torn`` bytes of ``path`` (a line a crash left incomplete)."""
    try:
        with path.open("r+b") as fh:
            fh.truncate(fh.seek(0, os.SEEK_END) - torn)
    except OSError as exc:
        raise UsageError(
            f"cannot cut the incomplete last line of {path} ({exc.strerror or exc})"
        ) from None


def _ends_an_object(line: bytes) -> bool:
    """Whether ``line`` ends as a JSON object does: ``}``, then JSON's spaces only. (Not
    by ``line.rstrip()``, which copies a torn line that ends in a space.)"""
    end = len(line)
    while end and line[end - 1] in b" \t\r\n":
        end -= 1
    return line.endswith(b"}", 0, end)


def _torn_record(line: bytes) -> bool:
    """Whether ``line`` (no newline) can be what is left of a record cut short."""
    line = line.rstrip(b"\0")  # a power cut's NULs, after the cut record or alone
    return not line or line.startswith(_RECORD_START) or _RECORD_START.startswith(line)


_RECORD_START = b'{"id":'


def _last_line(path: Path) -> bytes:
    """The file's last line (with its newline, if it has one; b"\\n" alone for a file
    that ends with one). Its start is found reading back from the end ``TAIL_BYTES``
    at a time, each piece searched once; the line is then read once. (The pieces were
    joined and the whole tail searched again at each step: a torn line of 156 MB took
    15 s and 863 MB; found by a hunt.)"""
    with path.open("rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        fh.seek(end - 1)
        if fh.read(1) == b"\n":
            return b"\n"
        start = 0
        at = end
        while at > 0:
            upto, at = at, max(0, at - TAIL_BYTES)
            fh.seek(at)
            cut = fh.read(upto - at).rfind(b"\n")
            if cut >= 0:
                start = at + cut + 1
                break
        fh.seek(start)
        return fh.read(end - start)
