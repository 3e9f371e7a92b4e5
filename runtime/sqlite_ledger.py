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
left waiting forever on a disk that stays full.

After a crash (even SIGKILL) the file holds every accepted task; those with no
outcome are ``unfinished()`` and are resumed by submitting them again (same
idempotency key). Delivery guarantee, exactly: results are exactly-once
towards the caller (one outcome per task id / idempotency key, recorded before
delivery); calls are at-least-once towards the provider (a call in flight
when the process died, or whose outcome was not yet committed, is sent again).

WAL mode with ``synchronous=NORMAL``: durable across process crashes; a power
loss may lose the last group.
"""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from callboard.messages import CallboardError, Request, Result, Task
from callboard.runtime.codec import (
    request_from_json,
    request_to_json,
    result_from_json,
    result_to_json,
)
from callboard.runtime.filelock import LockHeldError, hold, lock_path
from callboard.runtime.ledger import Ledger

log = logging.getLogger(__name__)


RETRY_MIN_S = 0.05
RETRY_MAX_S = 2.0
RETRY_FOR_S = 60.0
"""A commit failing for a reason that may clear (a full disk, a busy file) is retried
with this backoff for up to this long, its outcomes held; then, or at once for an
error that will not clear (a corrupt file), they are delivered, logged not durable."""


class LedgerError(CallboardError):
    """The ledger file cannot be used: corrupt, unreadable, or held by another system."""


def _hold(path: Path) -> int:
    """Lock PATH.lock for this ledger's life; ``LedgerError`` if another one holds it."""
    lock = lock_path(path)
    try:
        return hold(lock)
    except LockHeldError:
        raise LedgerError(
            f"the ledger {path} is in use by another system (it holds {lock})"
        ) from None
    except OSError as exc:
        raise LedgerError(f"cannot create {lock}: {exc.strerror or exc}") from None


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
"""


@dataclass(frozen=True, slots=True)
class Stored:
    """A task as the file holds it."""

    task_id: int
    key: str | None
    trace_id: str
    request: Request
    result: Result | None


class SqliteLedger(Ledger):
    """``SqliteLedger(path)``; call ``close()`` when done (``System.stop`` does)."""

    def __init__(self, path: str | Path, *, batch: int = 512, remember_keys: int = 100_000) -> None:
        super().__init__(remember_keys=remember_keys)
        self.path = Path(path)
        self._batch = batch
        self._queue: queue.SimpleQueue[tuple[str, Task, Result | None] | None] = queue.SimpleQueue()
        self._lock_fd = _hold(self.path)  # one live ledger per file: ids are numbered here
        try:
            with self._connect() as db:
                db.executescript(SCHEMA)
                (top,) = db.execute("SELECT COALESCE(MAX(task_id), 0) FROM tasks").fetchone()
                finished = db.execute(  # a cancelled task's key may be used again
                    "SELECT key, task_id FROM tasks WHERE key IS NOT NULL AND result IS NOT NULL"
                    ' AND result NOT LIKE \'{"type":"Cancelled"%\''  # the codec's prefix
                    " ORDER BY finished_at DESC LIMIT ?",
                    (remember_keys,),
                ).fetchall()
        except sqlite3.Error as exc:
            os.close(self._lock_fd)
            raise LedgerError(f"cannot open the ledger {self.path}: {exc}") from None
        self.skip_ids(int(top))
        # a key answered in an earlier process stays answered (a duplicate is refused)
        for key, task_id in reversed(finished):
            self._finished_keys[key] = task_id
        self.commits = 0
        self._closing = threading.Event()
        self._writer = threading.Thread(target=self._write, name="callboard-ledger", daemon=True)
        self._writer.start()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    # -- the two durable facts ----------------------------------------------

    def _persist_accept(self, task: Task) -> None:
        self._queue.put(("accept", task, None))

    def _record_then_deliver(self, task: Task, result: Result) -> None:
        self._queue.put(("finish", task, result))

    # -- reading the file -----------------------------------------------------

    def stored(self, *, unfinished_only: bool = False) -> list[Stored]:
        """What the file holds (a fresh read connection; safe from any thread)."""
        sql = "SELECT task_id, key, trace_id, request, result FROM tasks"
        if unfinished_only:
            sql += " WHERE result IS NULL"
        with self._connect() as db:
            rows = db.execute(sql + " ORDER BY task_id").fetchall()
        return [
            Stored(
                task_id=row[0],
                key=row[1],
                trace_id=row[2],
                request=request_from_json(row[3]),
                result=None if row[4] is None else result_from_json(row[4]),
            )
            for row in rows
        ]

    def unfinished(self) -> list[Stored]:
        return self.stored(unfinished_only=True)

    # -- the writer thread ----------------------------------------------------

    def _write(self) -> None:
        db = self._connect()
        try:
            while True:
                first = self._queue.get()
                if first is None:
                    return
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
                try:
                    self._commit(db, group)
                except Exception:  # the writer must outlive any one group
                    log.exception("ledger writer failed on a group of %d records", len(group))
                    self._deliver_group(group)
        finally:
            db.close()

    def _commit(self, db: sqlite3.Connection, group: list[tuple[str, Task, Result | None]]) -> None:
        now = time.time()
        accepts = [
            (t.task_id, t.request.idempotency_key, t.trace_id, request_to_json(t.request), now)
            for kind, t, _ in group
            if kind == "accept"
        ]
        finishes = [
            (result_to_json(r), now, t.task_id, t.request.idempotency_key)
            for kind, t, r in group
            if kind == "finish" and r is not None
        ]
        delay = RETRY_MIN_S
        give_up_at = time.monotonic() + RETRY_FOR_S
        while True:  # an outcome is delivered only once it is durable
            try:
                db.execute("BEGIN")
                # a key accepted again (its old task cancelled, or never finished) takes
                # over its row: the new task id and request, no result yet
                db.executemany(
                    "UPDATE tasks SET task_id = ?, trace_id = ?, request = ?, accepted_at = ?,"
                    " result = NULL, finished_at = NULL WHERE key = ? AND task_id != ?",
                    [(i, tr, rq, at, k, i) for i, k, tr, rq, at in accepts if k is not None],
                )
                db.executemany(
                    "INSERT OR IGNORE INTO tasks (task_id, key, trace_id, request, accepted_at)"
                    " VALUES (?, ?, ?, ?, ?)",
                    accepts,
                )
                # by key where there is one: a resumed task may carry a new id
                db.executemany(
                    "UPDATE tasks SET result = ?, finished_at = ?"
                    " WHERE task_id = ? OR (key IS NOT NULL AND key = ?)",
                    finishes,
                )
                db.execute("COMMIT")
                self.commits += 1
                break
            except sqlite3.Error as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                transient = isinstance(exc, sqlite3.OperationalError)  # full, busy, I/O
                if self._closing.is_set() or not transient or time.monotonic() > give_up_at:
                    # shutting down, or it will not clear: the callers get their outcomes
                    log.exception(
                        "ledger commit failed (%d records): delivered, NOT durable", len(group)
                    )
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
        for kind, task, result in group:
            if kind == "finish" and result is not None:
                self._delivered(task, result)

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is queued, deliver it, and stop the writer (a commit that keeps
        failing gets until ``timeout``, then what it holds is delivered, not durable)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout)
            self._closing.set()
            self._writer.join(timeout)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
