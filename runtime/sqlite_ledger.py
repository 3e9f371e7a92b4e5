"""The durable ledger: the in-memory ledger, with every acceptance and outcome in SQLite.

Theory of operation. The in-memory ``Ledger`` stays the live truth (stages,
counts, exactly-once ``finish_all``); this subclass writes two facts to a SQLite
file: a task was accepted (its request), and a task finished (its result).
A single writer thread owns the connection and commits in groups: it takes
whatever has queued up (at most ``batch`` records), writes it in one
transaction, commits, and only then resolves the callers' futures for the
outcomes in that group. So an outcome is durable before any caller sees it,
actor threads never touch the disk, and the cost per task is a fraction of
one commit. The one exception: a commit that fails (a full disk) is retried
with backoff while those futures wait, for up to ``RETRY_FOR_S`` (or until
``close``); past that, or at once for an error that will not clear, the
outcomes are delivered anyway and logged as not durable, so a caller is never
left waiting forever on a disk that stays full; for ``RETRY_FOR_S`` after such a
give-up, a group whose commit fails is delivered at once, not retried.

An acceptance is committed before ``accept_all`` returns (the submitting thread
waits for the writer's commit of its group), so a task goes nowhere before the file
holds it. After a crash (even SIGKILL) the file holds every accepted task; those with no
outcome are ``unfinished()`` and are resumed by submitting them again (same
idempotency key). Delivery guarantee, exactly: results are exactly-once
towards the caller (one outcome per task id / idempotency key, recorded before
delivery); calls are at-least-once towards the provider (a call in flight
when the process died, or whose outcome was not yet committed, is sent again).

WAL mode with ``synchronous=NORMAL``: durable across process crashes; a power
loss may lose the last group.

A file that is not a usable ledger is refused with a typed error before
anything is written to it: ``NotALedgerError`` for a SQLite database of
something else (never touched: not even its journal mode changes),
``LedgerDamagedError`` for a file that is not a database at all or whose rows
do not decode (``stored`` and ``kept`` read them all and name the bad ones).
``rebuild`` sets a damaged file aside, renamed, and writes a new ledger from
the rows of it that still read.

Reading a large file costs memory in proportion to what is kept of each row:
``kept`` holds each final result's key, request digest and type, never its
text (SQLite checks that the result is JSON and reads out only its type), and
``kept_result`` decodes one result by key when it is wanted whole; a result
that is JSON of the wrong shape is found then, not by ``kept``.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from callboard.messages import CallboardError, Cancelled, Request, Result, Task
from callboard.runtime.codec import (
    RESULT_TYPES,
    CodecError,
    request_digest,
    request_from_json,
    request_to_json,
    result_from_json,
    result_to_json,
)
from callboard.runtime.durable import sync_folder
from callboard.runtime.filelock import hold_or, lock_path, release
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.ledger import Ledger

log = guarded_logger(__name__)


RETRY_MIN_S = 0.05
RETRY_MAX_S = 2.0
RETRY_FOR_S = 60.0
"""A commit failing for a reason that may clear (a full disk, a busy file) is retried
with this backoff for up to this long, its outcomes held; then, or at once for an
error that will not clear (a corrupt file), they are delivered, logged not durable."""


class LedgerError(CallboardError):
    """The ledger file cannot be used: corrupt, unreadable, or held by another system."""


class LedgerDamagedError(LedgerError):
    """The file is not a SQLite database (garbage, cut short), or rows of it do not
    decode: ``rebuild`` keeps what still reads."""


class LedgerUnavailableError(LedgerError):
    """A ledger that may be whole but cannot be used now: locked by another process,
    not writable, not openable. Not damage: rebuilding it would set a good file aside."""


class NotALedgerError(LedgerError):
    """The file is a SQLite database, but not a callboard ledger: not ours to change."""


class LedgerTooNewError(LedgerUnavailableError):
    """The ledger was written by a newer callboard, whose rows this one may not read:
    not damage (the newer callboard reads it whole)."""


def _hold(path: Path) -> int:
    """Lock PATH.lock for this ledger's life; ``LedgerError`` if another one holds it."""
    return hold_or(lock_path(path), LedgerError, f"the ledger {path} is in use by another system")


def _hold_file(path: Path) -> int:
    """Lock the ledger's own file too (an ``flock``, apart from SQLite's locks), making
    it if it is not there: one file under two names (a hard link, a ``cp -al`` snapshot
    of a job's folder) has two ``.lock`` files, and two runs wrote it at once through
    their own journals, both exiting 0, the file left damaged (found by a hunt). Taken
    before SQLite writes to it (taken after, a refused second name had already left a
    journal that later undid the first's work; a review), and held until the ledger
    closes, after its connections: closing a descriptor of the file lets go of every
    SQLite lock this process holds on it. So a second name of a file this process holds
    is refused by its inode, never opened and closed (``_FILES``)."""
    busy = f"the ledger {path} is in use by another system, under another name"
    with _FILES_LOCK:
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) in _FILES:
            raise LedgerError(f"{busy} ({_FILES[st.st_dev, st.st_ino]}, in this process)")
        fd = hold_or(path, LedgerError, busy)
        st = os.fstat(fd)
        _FILES[st.st_dev, st.st_ino] = path
        return fd


def _let_go_file(fd: int) -> None:
    """Let go of a ledger's file that ``_hold_file`` locked."""
    with _FILES_LOCK:
        st = os.fstat(fd)
        _FILES.pop((st.st_dev, st.st_ino), None)
        release(fd)


_FILES: dict[tuple[int, int], Path] = {}
"""The ledgers' files this process holds, by device and inode: the name each is held by."""
_FILES_LOCK = threading.Lock()


APPLICATION_ID = 0x63626C64
"""``PRAGMA application_id`` of a callboard ledger ("cbld"); 0 in ledgers written
before it was set, which are recognised by their table."""

ROW_FORMAT = 1
"""``PRAGMA user_version`` of a ledger: the form of its rows. Raised whenever a row
may hold what the callboard before could not read (a result's field it lacks); a
ledger of a higher one is refused (``LedgerTooNewError``), where an older callboard
read each such row as damage and called its task again (found by a hunt). 0: written
before it was set (rows every callboard reads)."""

COLUMNS = ("task_id", "key", "trace_id", "request", "accepted_at", "result", "finished_at")
SELECT_ROWS = "SELECT task_id, key, trace_id, request, accepted_at, result, finished_at FROM tasks"
"""Every column of every row, in ``COLUMNS`` order."""
INSERT_ROW = (
    "INSERT INTO tasks (task_id, key, trace_id, request, accepted_at, result, finished_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id      INTEGER PRIMARY KEY,
    key          TEXT UNIQUE,
    trace_id     TEXT NOT NULL,
    request      TEXT NOT NULL,
    accepted_at  REAL NOT NULL,
    result       TEXT,
    finished_at  REAL
);
CREATE TABLE IF NOT EXISTS about (
    name   TEXT PRIMARY KEY,
    value  TEXT NOT NULL
);
"""
"""``about`` holds the file's ``identity`` (``Ledger.identity``), written once."""


def _made_ours(db: sqlite3.Connection) -> None:
    """``db`` a ledger: its table, our application id, the form of its rows."""
    db.executescript(SCHEMA)
    db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    db.execute(f"PRAGMA user_version = {ROW_FORMAT}")


@dataclass(frozen=True, slots=True)
class Stored:
    """A task as the file holds it."""

    task_id: int
    key: str | None
    trace_id: str
    request: Request
    result: Result | None


@dataclass(frozen=True, slots=True)
class Kept:
    """A final result the file keeps under a key, no more of it than a plan needs."""

    key: str
    digest: str
    """``request_digest`` of the request it answered."""
    status: str
    """Its type's name: ``Completed``, ``Failed``, ``Expired`` or ``Rejected``."""


KEPT_ROWS = (
    "SELECT task_id, key, request, CASE WHEN typeof(result) = 'text' AND json_valid(result)"
    " THEN json_extract(result, '$.type') END FROM tasks"
    " WHERE key IS NOT NULL AND result IS NOT NULL"
)
"""Each keyed row with a result: its request, and its result's type as SQLite reads it
from the JSON (NULL if the result is not JSON text), the result's text left in the file."""

_STATUSES = {name: name for name in RESULT_TYPES}
"""Each result type's name, one string object for every row of that type."""


class SqliteLedger(Ledger):
    """``SqliteLedger(path)``; call ``close()`` when done (``System.stop`` does)."""

    def __init__(
        self,
        path: str | Path,
        *,
        batch: int = 512,
        remember_keys: int = 100_000,
        durable_accepts: bool = True,
    ) -> None:
        """``durable_accepts=False``: a submit does not wait for its acceptance's commit,
        for a caller whose own input holds every task (``callboard run``: a line with no
        result is sent again by the next run); waiting made it 45-60% slower,
        one commit a line (5,000 lines: 7.1 s -> 10.3-11.4 s)."""
        super().__init__(remember_keys=remember_keys)
        self.path = Path(path)
        self._batch = batch
        self._durable_accepts = durable_accepts
        self._queue: queue.SimpleQueue[tuple[str, Task, Result | None] | None] = queue.SimpleQueue()
        self._lock_fd = _hold(self.path)  # one live ledger per file: ids are numbered here
        self._file_fd = -1
        try:
            _finish_rebuild(self.path)  # (before the file is made, if it is not there)
            self._file_fd = _hold_file(self.path)  # before SQLite writes a byte of it
            top, finished, self.identity = self._open(remember_keys)
            self.skip_ids(top)
            # a key answered in an earlier process stays answered (a duplicate is refused)
            for key, task_id in reversed(finished):
                self._finished_keys[key] = task_id
        except BaseException:  # a Ctrl-C too: its lock was kept for the process's life,
            if self._file_fd >= 0:  # and a retry found the ledger in use (a hunt)
                _let_go_file(self._file_fd)
                self._file_fd = -1
            release(self._lock_fd)
            self._lock_fd = -1
            raise
        self._closing = threading.Event()
        self._reading = threading.Lock()
        self._reader: sqlite3.Connection | None = None
        """``kept_result``'s connection, made at its first read, closed with the ledger."""
        self._accepts_lock = threading.Lock()
        self._accepts = threading.Condition(self._accepts_lock)  # taken by its lock's C
        # ``with`` (a Ctrl-C in a Condition's Python ``__enter__`` could leave it held)
        self._accepts_queued = 0
        self._accepts_done = 0
        """Acceptances queued, and committed (or given up on), counted in queue order:
        a submit waits until its last one is done (``_persist_accepts``)."""
        self._held_sends: collections.deque[tuple[int, Callable[[bool], None]]] = (
            collections.deque()
        )
        """What sends tasks accepted on an event loop's thread (which may not wait for
        the commit), each with the count of acceptances it waits for, in that order
        (``when_accepted``)."""
        self._degraded_until = 0.0
        """Until when a failing commit is not retried: one gave up on its window less
        than ``RETRY_FOR_S`` ago (the writer's)."""
        self.not_durable = 0
        """Writes (a task's request, or its result) delivered without being made durable
        (a full disk, a damaged page): what a crash would have lost. Read from any
        thread."""
        self._writer = threading.Thread(target=self._write, name="callboard-ledger", daemon=True)
        self._writer.start()

    def _open(self, remember_keys: int) -> tuple[int, list[tuple[str, int]], str]:
        """Check the file and make it a ledger; its highest task id, the keys it has
        answered for good, newest first, and its identity (made at its first open). A
        failure is a ``LedgerError`` of its kind."""
        try:
            _finish_rebuild(self.path)
            _inspect(self.path)  # before WAL mode or a table is written to it
            with closing(self._connect()) as db, db:
                _check_pages(db, self.path)
                _made_ours(db)
                db.execute(
                    "INSERT OR IGNORE INTO about (name, value) VALUES ('identity', ?)",
                    (uuid.uuid4().hex,),
                )
                (identity,) = db.execute(
                    "SELECT value FROM about WHERE name = 'identity'"
                ).fetchone()
                (top,) = db.execute("SELECT COALESCE(MAX(task_id), 0) FROM tasks").fetchone()
                finished = db.execute(  # the keys answered for good (``binds_key``)
                    "SELECT key, task_id FROM tasks WHERE key IS NOT NULL AND result IS NOT NULL"
                    ' AND result NOT LIKE \'{"type":"Cancelled"%\''  # the codec's prefix
                    " AND CASE WHEN json_valid(result)"  # a row that does not read binds its
                    " THEN json_extract(result, '$.type') = 'Completed'"  # key: shown later
                    " OR json_extract(result, '$.attempts')"  # a call the provider did not
                    " > COALESCE(json_extract(result, '$.refused'), 0) ELSE 1 END"  # refuse
                    # newest first by id, not by finished_at: a wall clock a year ahead
                    # (then set right) kept the keys it wrote over newer ones (a hunt)
                    " ORDER BY task_id DESC LIMIT ?",
                    (remember_keys,),
                ).fetchall()
        except sqlite3.OperationalError as exc:  # locked, read-only, unopenable: not damage
            raise LedgerUnavailableError(_unusable(self.path, exc)) from None
        except sqlite3.DatabaseError as exc:  # a damaged page, found past the header
            raise LedgerDamagedError(f"the ledger {self.path} is damaged ({exc})") from None
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open the ledger {self.path}: {exc}") from None
        return int(top), finished, str(identity)

    def _connect(self, *, check_same_thread: bool = True) -> sqlite3.Connection:
        db = sqlite3.connect(
            self.path,
            timeout=BUSY_TIMEOUT_S,
            isolation_level=None,
            check_same_thread=check_same_thread,
        )
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    # -- the two durable facts ----------------------------------------------

    def _persist_accepts(self, tasks: list[Task]) -> None:
        """Queue ``tasks``' acceptance and wait until the writer has committed it (or
        given up on a disk that will not take it, said not durable): a submit returns
        a task that is in the file. Queued and left, a task went to its model before
        its group was committed, and a process killed then had sent a call for a task
        the file never held, which ``resume`` then never answered (found by a hunt)."""
        with self._accepts_lock:  # puts and count in one order: the writer's
            for task in tasks:
                self._queue.put(("accept", task, None))
            self._accepts_queued += len(tasks)
            target = self._accepts_queued
            if not self._durable_accepts or asyncio._get_running_loop() is not None:
                return  # on an event loop's thread (an AsyncSystem's, the gateway's) a
                # wait held every request and stream of the loop, as long as a full disk's
                # retries (60 s; a review): there the sending waits (``when_accepted``)
            while self._accepts_done < target and self._writer.is_alive():
                self._accepts.wait(ACCEPT_POLL_S)

    def when_accepted(self, send: Callable[[bool], None]) -> None:
        """``send`` now if every acceptance queued is committed (a submit that waited),
        else on the writer's thread after the commit: a task accepted on an event loop's
        thread went to its model at once, and a process killed before its group's
        commit had sent a call for a task the file never held (documented as a gap
        until this). Not for ``callboard run`` (``durable_accepts=False``): its input
        holds every line."""
        with self._accepts_lock:
            hold = (
                self._durable_accepts
                and self._accepts_done < self._accepts_queued
                and self._writer.is_alive()
            )
            if hold:
                self._held_sends.append((self._accepts_queued, send))
        if not hold:
            send(False)

    def _record_then_deliver(self, task: Task, result: Result) -> None:
        self._queue.put(("finish", task, result))

    # -- reading the file -----------------------------------------------------

    def stored(self, *, unfinished_only: bool = False) -> list[Stored]:
        """What the file holds (a fresh read connection; safe from any thread).

        Raises ``LedgerDamagedError`` naming the rows that do not decode (how many,
        and the first few by task id and key), or if the file cannot be read."""
        sql = SELECT_ROWS + (" WHERE result IS NULL" if unfinished_only else "")
        stored: list[Stored] = []
        bad: list[str] = []
        for row in self._rows(sql):
            try:
                stored.append(_decode(row))
            except CodecError as exc:
                bad.append(f"task {row[0]} (key {row[1]!r}): {exc}")
        self._refuse(bad)
        stored.sort(key=lambda s: s.task_id)
        return stored

    def unfinished(self) -> list[Stored]:
        return self.stored(unfinished_only=True)

    def kept(self) -> dict[str, Kept]:
        """Each key's final result (a cancelled one is not final), as ``Kept``: no result
        is decoded, and nothing of a request is kept but its digest. Safe from any thread.

        Raises ``LedgerDamagedError`` as ``stored`` does, naming the rows whose request
        does not decode or whose result is not the JSON of a result type."""
        kept: dict[str, Kept] = {}
        bad: list[str] = []
        for row in self._rows(KEPT_ROWS):
            try:
                one = _kept(row)
            except CodecError as exc:
                bad.append(f"task {row[0]} (key {row[1]!r}): {exc}")
                continue
            if one.status != "Cancelled":
                kept[one.key] = one
        self._refuse(bad)
        return kept

    def kept_result(self, key: str) -> Result | None:
        """The final result kept under ``key``, decoded (None: none, or a cancelled one).
        Raises ``LedgerDamagedError`` if it does not decode. Read on one connection kept
        for it: a fresh one for each (as ``_rows``) cost 1 ms a row, and a run writing
        300,000 results back from the ledger took three minutes (a hunt)."""
        try:
            with self._reading:
                if self._reader is None:
                    self._reader = self._connect(check_same_thread=False)
                rows = self._reader.execute(SELECT_ROWS + " WHERE key = ?", (key,)).fetchall()
        except sqlite3.DatabaseError as exc:
            raise LedgerDamagedError(f"the ledger {self.path} cannot be read ({exc})") from None
        if not rows or rows[0][5] is None:
            return None
        try:
            result = _decode(rows[0]).result
        except CodecError as exc:
            raise LedgerDamagedError(
                f"the ledger {self.path} is damaged: the row of task {rows[0][0]} (key "
                f"{key!r}) cannot be read ({exc})"
            ) from None
        return None if isinstance(result, Cancelled) else result

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
        """The rows ``sql`` selects, read from a fresh connection one at a time;
        ``LedgerDamagedError`` if the file cannot be read."""
        try:
            with closing(self._connect()) as db:
                yield from db.execute(sql, args)
        except sqlite3.DatabaseError as exc:
            raise LedgerDamagedError(f"the ledger {self.path} cannot be read ({exc})") from None

    def _refuse(self, bad: list[str]) -> None:
        """``LedgerDamagedError`` naming the rows in ``bad`` (how many, the first few)."""
        if bad:
            shown = "; ".join(bad[:3]) + ("; ..." if len(bad) > 3 else "")
            raise LedgerDamagedError(
                f"the ledger {self.path} is damaged: {len(bad)} of its rows cannot be read "
                f"({shown})"
            )

    # -- the writer thread ----------------------------------------------------

    def _write(self) -> None:
        db = self._connect()
        try:
            while True:
                first = self._queue.get()
                if first is None:
                    if self._queue.empty():
                        return
                    # queued behind the end by the last group's delivery (a held send
                    # whose tasks the stop ended Rejected: their outcomes were never
                    # delivered, and a future waited for good; a review): written first
                    self._queue.put(None)
                    continue
                group = [first]
                while len(group) < self._batch:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        self._queue.put(None)
                        break
                    group.append(item)
                self._commit_each(db, group)
        finally:
            db.close()

    def _commit_each(
        self, db: sqlite3.Connection, group: list[tuple[str, Task, Result | None]]
    ) -> None:
        """``group`` committed together; if that raises (not SQLite: a record that
        cannot be written), each alone, so only the records that cannot be are lost,
        delivered NOT durable. One such record lost its whole group: other tasks'
        records, finished and never written, were called again by ``resume`` (found by
        a hunt). The writer outlives any record."""
        try:
            self._commit(db, group)
        except Exception:  # told below, record by record
            if db.in_transaction:
                db.rollback()
            if len(group) == 1:
                kind, task, _ = group[0]
                log.exception("ledger: the %s of task %d cannot be written", kind, task.task_id)
                self.not_durable += 1
                self._deliver_group(group)
                return
            for item in group:
                self._commit_each(db, [item])

    def _commit(self, db: sqlite3.Connection, group: list[tuple[str, Task, Result | None]]) -> None:
        now = time.time()
        runs = _runs(group, now)
        delay = RETRY_MIN_S
        give_up_at = time.monotonic() + RETRY_FOR_S
        while True:  # an outcome is delivered only once it is durable
            try:
                db.execute("BEGIN")
                for accepts, finishes in runs:  # in the order they came
                    # a key accepted again (its old task ended with no call made, or never
                    # finished) takes over its row: the new task id and request, no result
                    db.executemany(
                        "UPDATE tasks SET task_id = ?, trace_id = ?, request = ?,"
                        " accepted_at = ?, result = NULL, finished_at = NULL"
                        " WHERE key = ? AND task_id != ?",
                        [(i, tr, rq, at, k, i) for i, k, tr, rq, at in accepts if k is not None],
                    )
                    db.executemany(
                        "INSERT OR IGNORE INTO tasks (task_id, key, trace_id, request,"
                        " accepted_at) VALUES (?, ?, ?, ?, ?)",
                        accepts,
                    )
                    # by key where there is one: a resumed task may carry a new id
                    db.executemany(
                        "UPDATE tasks SET result = ?, finished_at = ?"
                        " WHERE task_id = ? OR (key IS NOT NULL AND key = ?)",
                        finishes,
                    )
                db.execute("COMMIT")  # (a success does not end ``_degraded_until``: on a
                break  # full disk, small commits may pass between failing ones)
            except sqlite3.Error as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                transient = isinstance(exc, sqlite3.OperationalError)  # full, busy, I/O
                now_s = time.monotonic()
                # a group that gave up less than RETRY_FOR_S ago says the disk is not
                # coming back soon: each group waited its own window on a disk that
                # stayed full (2,000 lines: six minutes), small commits in between
                expired = now_s > give_up_at or now_s < self._degraded_until
                if self._closing.is_set() or not transient or expired:
                    if transient and expired:  # the disk is not coming back soon
                        self._degraded_until = now_s + RETRY_FOR_S
                    # shutting down, or it will not clear (a damaged file): the callers get
                    # their outcomes; the error names it, a traceback would add nothing
                    log.error(  # noqa: TRY400
                        "ledger commit to %s failed (%d records): delivered, NOT durable: %s",
                        self.path,
                        len(group),
                        exc,
                    )
                    self.not_durable += len(group)
                    break
                log.error(  # noqa: TRY400 - a line per retry; a traceback each would flood
                    "ledger commit failed (%d records), retrying in %.2f s; their outcomes wait"
                    " until it succeeds: %s",
                    len(group),
                    delay,
                    exc,
                )
                self._closing.wait(delay)
                delay = min(RETRY_MAX_S, delay * 2)
        self._deliver_group(group)

    def _deliver_group(self, group: list[tuple[str, Task, Result | None]]) -> None:
        accepted = 0
        for kind, task, result in group:
            if kind == "finish" and result is not None:
                self._delivered(task, result)
            elif kind == "accept":
                accepted += 1
        if accepted:
            due: list[Callable[[bool], None]] = []
            with self._accepts_lock:
                self._accepts_done += accepted
                self._accepts.notify_all()
                held = self._held_sends
                while held and held[0][0] <= self._accepts_done:
                    due.append(held.popleft()[1])
            for send in due:
                _run_held(send)

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is queued, deliver it, and stop the writer (a commit that keeps
        failing gets until ``timeout``, then what it holds is delivered, not durable)."""
        super().close(timeout)
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout)
            self._closing.set()
            self._writer.join(timeout)
        if self._writer.is_alive():  # its commit still waits (a busy file): it may write
            log.warning(  # on, so the file stays ours, locked, until the process exits
                "the ledger %s: its writer did not stop within %g s; the ledger stays "
                "locked until this process exits",
                self.path,
                timeout,
            )
            return
        with self._reading:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        if self._file_fd >= 0:
            _let_go_file(self._file_fd)
            self._file_fd = -1
        if self._lock_fd >= 0:
            release(self._lock_fd)
            self._lock_fd = -1


def _decode(row: tuple[Any, ...]) -> Stored:
    """A row of ``COLUMNS`` as ``Stored``; ``CodecError`` if its JSON does not decode."""
    task_id, key, trace_id, request, _, result, _ = row
    if not isinstance(request, str) or not (result is None or isinstance(result, str)):
        raise CodecError("a request or result that is not text")
    return Stored(
        task_id=task_id,
        key=key,
        trace_id=trace_id,
        request=request_from_json(request),
        result=None if result is None else result_from_json(result),
    )


def _kept(row: tuple[Any, ...]) -> Kept:
    """A row of ``KEPT_ROWS`` as ``Kept``; ``CodecError`` if its request does not decode
    or its result is not the JSON of a result type."""
    _, key, request, status = row
    if not isinstance(request, str):
        raise CodecError("a request that is not text")
    digest = request_digest(request_from_json(request))
    if status not in _STATUSES:
        raise CodecError("a result that is not a result's JSON form")
    return Kept(key, digest, _STATUSES[status])


ACCEPT_POLL_S = 0.5
"""How often a submit waiting for its acceptance's commit looks whether the writer is
still there (a closed ledger's writer commits what is queued, then ends)."""

BUSY_TIMEOUT_S = 30.0
"""How long opening the ledger waits for another process's lock on it."""

_WHY_UNUSABLE = {
    "database is locked": "another process holds it locked (a sqlite3 shell, another "
    "program in a write transaction): end that, then run again",
    "attempt to write a readonly database": "it, its folder, or the -wal or -shm file "
    "beside it is not writable by this user (SQLite writes all of them)",
    "unable to open database file": "it cannot be opened (its permissions, or its folder's)",
}


def _unusable(path: Path, exc: sqlite3.OperationalError) -> str:
    """Why a healthy ledger cannot be used, said as such: not damage, and nothing that
    ``--rebuild-ledger`` (which would set a good file aside) should answer."""
    said = str(exc)
    return f"cannot use the ledger {path}: {_WHY_UNUSABLE.get(said, said)} ({said})"


def _inspect(path: Path) -> None:
    """Refuse a file that is not a ledger (or an empty one, which becomes one), reading
    only: ``LedgerDamagedError`` if it is not a SQLite database, ``NotALedgerError`` if
    it is someone else's."""
    if not path.exists() or path.stat().st_size == 0:
        return  # SQLite starts a new database in it
    try:
        with closing(sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)) as db:
            (app_id,) = db.execute("PRAGMA application_id").fetchone()
            (row_format,) = db.execute("PRAGMA user_version").fetchone()
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            columns = tuple(r[1] for r in db.execute("PRAGMA table_info(tasks)"))
    except sqlite3.OperationalError as exc:  # locked, unreadable: a healthy file, maybe
        raise LedgerUnavailableError(_unusable(path, exc)) from None
    except sqlite3.DatabaseError as exc:  # "file is not a database", a bad header
        raise LedgerDamagedError(
            f"the ledger {path} is not a SQLite database ({exc}): damaged, or not a ledger"
        ) from None
    if app_id not in (0, APPLICATION_ID):
        raise NotALedgerError(
            f"{path} is a SQLite database of another application (application_id "
            f"{app_id:#x}), not a callboard ledger"
        )
    if app_id == APPLICATION_ID and row_format > ROW_FORMAT:
        raise LedgerTooNewError(
            f"the ledger {path} was written by a newer callboard (its rows' form "
            f"{row_format}; this one reads up to {ROW_FORMAT}): run that callboard, or "
            "give this one a ledger of its own (--ledger)"
        )
    if tables and sorted(columns) != sorted(COLUMNS):
        raise NotALedgerError(
            f"{path} is a SQLite database but not a callboard ledger (its tables: "
            f"{', '.join(sorted(tables))})"
        )


_Accept = tuple[int, str | None, str, str, float]
_Finish = tuple[str, float, int, str | None]


def _runs(
    group: list[tuple[str, Task, Result | None]], now: float
) -> list[tuple[list[_Accept], list[_Finish]]]:
    """``group``'s records as rows to write, in runs kept in the order they came: each run
    its acceptances, then the outcomes that followed them. All acceptances first, a key
    freed and taken again in one group went wrong: the new task took the old one's row,
    then the old outcome was written on it (a crash before the new task ended lost it),
    or, its first task accepted in the same group, the new one's row was never made (a
    review)."""
    runs: list[tuple[list[_Accept], list[_Finish]]] = []
    for kind, t, r in group:
        if kind == "accept":
            if not runs or runs[-1][1]:  # outcomes came since: a new run
                runs.append(([], []))
            key = t.request.idempotency_key
            runs[-1][0].append((t.task_id, key, t.trace_id, request_to_json(t.request), now))
        elif r is not None:
            if not runs:
                runs.append(([], []))
            runs[-1][1].append((result_to_json(r), now, t.task_id, t.request.idempotency_key))
    return runs


def _check_pages(db: sqlite3.Connection, path: Path) -> None:
    """``LedgerDamagedError`` if a page of the file is damaged (``PRAGMA quick_check``:
    every page read once, 0.26 s for 250 MB). Opening reads the header and the table's
    highest id only: a damaged index passed, every result looked up by its key was
    then not found and its line sent again, and every write failed, so the run went
    on without a durable ledger and said nothing of it (found by a hunt)."""
    said = [row[0] for row in db.execute("PRAGMA quick_check(3)")]
    if said != ["ok"]:
        raise LedgerDamagedError(f"the ledger {path} is damaged ({'; '.join(said)})")


def _run_held(send: Callable[[bool], None]) -> None:
    """A held send, on the writer's thread: one that raises (a bug; a stop is its own
    to handle) is logged, and the writer goes on."""
    try:
        send(True)
    except Exception:
        log.exception("ledger: sending tasks accepted before this commit failed")


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """What ``rebuild`` did."""

    aside: Path | None
    """Where the old file now is (None: there was none)."""
    kept: int
    """Rows of the old file copied into the new ledger."""
    dropped: int | None
    """Rows that did not read (their tasks are as if never accepted); None when the old
    file did not read as a database at all: however many rows it held, none is kept
    (it said 0, and a ledger cut to half its size lost 300 rows in silence; a hunt)."""


def rebuild(path: str | Path) -> Rebuilt:
    """Set the ledger at ``path`` aside as ``PATH.damaged`` (``.damaged-2``, ... if
    taken; its -wal and -shm go with it) and put a new ledger there holding every
    row of it that still reads. Nothing is deleted. Raises ``NotALedgerError`` for a
    SQLite database that is not a ledger (that file is left as it is), ``LedgerError``
    if another system holds the ledger, and ``OSError`` or ``sqlite3.Error`` if the
    new ledger cannot be written (a full disk): the old one is then where it was.

    The new ledger is written whole beside the old one (``PATH.rebuilding``) and
    renamed into place only then: written in place, a rebuild the disk ran out under
    left an empty ledger at ``PATH``, which the next run took as new and sent every
    task the set-aside file had answered again (found by a hunt)."""
    path = Path(path)
    fd = _hold(path)
    held = -1
    try:
        _finish_rebuild(path)
        if not path.exists():
            return Rebuilt(aside=None, kept=0, dropped=0)
        held = _hold_file(path)  # not a file live under another name
        rows, dropped = _readable_rows(path)
        new = _rebuilding(path)
        try:
            _write_ledger(new, rows)
        except BaseException:
            _remove_database(new)
            raise
        aside = _set_aside(path)
        new.replace(path)
        sync_folder(path.parent)
        return Rebuilt(aside=aside, kept=len(rows), dropped=dropped)
    finally:
        if held >= 0:
            _let_go_file(held)
        release(fd)


def _rebuilding(path: Path) -> Path:
    """Where ``rebuild`` writes the new ledger of ``path`` before it takes its name."""
    return path.with_name(path.name + ".rebuilding")


def _finish_rebuild(path: Path) -> None:
    """A rebuild that stopped between its two renames (the old ledger set aside, the
    new one whole beside it) left no ledger at ``path``: the new one takes its name.
    Left so, the next run started an empty ledger there and sent again every task the
    rebuilt one held (a review). With a ledger at ``path``, a ``PATH.rebuilding`` is
    one cut short while written, and the next rebuild replaces it."""
    new = _rebuilding(path)
    if not path.exists() and new.exists():
        new.replace(path)
        sync_folder(path.parent)


def _write_ledger(path: Path, rows: list[tuple[Any, ...]]) -> None:
    """A new ledger at ``path`` (one left there by a rebuild cut short is replaced)
    holding ``rows``, whole in its one file and on the disk when this returns."""
    _remove_database(path)
    with closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("PRAGMA journal_mode=WAL")
        _made_ours(db)
        db.execute("BEGIN")
        db.executemany(INSERT_ROW, rows)
        db.execute("COMMIT")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for suffix in ("-wal", "-shm"):  # nothing of it is left outside the one file
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_database(path: Path) -> None:
    """Remove the database at ``path`` and its -wal and -shm, those that exist."""
    for suffix in ("", "-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)


def _readable_rows(path: Path) -> tuple[list[tuple[Any, ...]], int | None]:
    """The rows of ``path`` that decode, and how many did not (None: the file does not
    read as a database, so nobody knows); ``NotALedgerError`` for someone else's
    database."""
    try:
        _inspect(path)
    except NotALedgerError:
        raise
    except LedgerDamagedError:
        return [], None
    rows: list[tuple[Any, ...]] = []
    dropped = 0
    with closing(sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)) as db:
        try:
            for row in _rows(db, path):
                if row is None:  # a row in a damaged page: not read
                    dropped += 1
                    continue
                try:
                    _decode(row)
                except CodecError:
                    dropped += 1
                else:
                    rows.append(row)
        except _TableUnreadableError:  # how many rows it held, nobody knows (it said 0
            return [], None  # of 300; a review)
    return rows, dropped


class _TableUnreadableError(Exception):
    """The table of tasks does not read at all (``_rows``)."""


def _rows(db: sqlite3.Connection, path: Path) -> Iterator[tuple[Any, ...] | None]:
    """Every row, in task id order; None for each id a damaged page keeps from being
    read. A scan stops at a damaged page: the rows after it are read past it, id by id
    up to the highest, so a page lost loses its own rows only, and each is counted (the
    scan's stop lost every row after it, uncounted)."""
    try:
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'tasks'").fetchone() is None:
            return  # a new (empty) file
        (top,) = db.execute("SELECT COALESCE(MAX(task_id), 0) FROM tasks").fetchone()
    except sqlite3.DatabaseError:
        log.warning("the ledger %s: its table of tasks does not read", path)
        raise _TableUnreadableError from None
    last = 0
    while last < top:
        try:
            for row in db.execute(SELECT_ROWS + " WHERE task_id > ? ORDER BY task_id", (last,)):
                last = row[0]
                yield row
        except sqlite3.DatabaseError:
            log.warning("the ledger %s: a damaged page after task %d", path, last)
        else:
            return
        while last < top:  # past the damaged page, one id at a time
            last += 1
            try:
                found = db.execute(SELECT_ROWS + " WHERE task_id = ?", (last,)).fetchone()
            except sqlite3.DatabaseError:
                yield None
                continue
            if found is not None:
                yield found
                break


def _set_aside(path: Path) -> Path:
    """Rename ``path`` (and its -wal, -shm) to the first free ``PATH.damaged[-N]``."""
    aside = path.with_name(path.name + ".damaged")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{n}")
    for suffix in ("-wal", "-shm"):
        companion = path.with_name(path.name + suffix)
        if companion.exists():
            companion.replace(aside.with_name(aside.name + suffix))
    path.replace(aside)
    return aside
