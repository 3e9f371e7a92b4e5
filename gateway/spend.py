"""The gateway's spend file: each budgeted key's and tenant's settled spend, per period,
in SQLite, so that a restart keeps what was spent (``[gateway] spend_file``).

Theory of operation
-------------------
One row per scope and period: ``scope`` (``key:<name>`` or ``tenant:<name>``),
``period`` (``1d``, ``1mo``...; ``""`` for a budget that never renews), ``start``
and ``ends`` (Unix seconds, UTC; 0 and NULL for no period) and ``spent_nusd``,
the settled cost in nano-USD. The quota book (``quota``) decides; this module only
keeps its numbers:

* ``spent(scope, period, start)``: what the file holds for that period, read before
  a reservation (and by ``/v1/callboard/stats``), so spend another gateway wrote to
  the same file counts here too;
* ``add(charges)``: settled costs, each added to its row (``spent_nusd + ?``, never
  overwritten) in one ``BEGIN IMMEDIATE`` transaction. Two gateways writing the same
  file add up; neither loses the other's spend. The first charge of a period to a
  scope also drops that scope's rows of the period older than its ``KEPT_PERIODS``
  latest: only the current one is read, and a row per period for good grew the file
  without end (a 1 s period, 86,400 rows a day a budget; found by a hunt), while the
  latest periods stay for whoever reads what was spent.

WAL mode with ``synchronous=NORMAL``: a committed settlement survives the process
(a crash, SIGKILL); a power cut may lose the last ones. What is in flight when the
process dies (reserved, not settled, or settled in the loop's turn it died in: the
quotas write a turn's settlements at its end) is lost: nothing was written for it.

The file is looked at before anything is written to it: a file that is not a SQLite
database (damaged, truncated, something else), or a database of another
application, or a spend file whose rows break its rules (``PRAGMA quick_check``,
negative spend) is refused with ``SpendFileError`` naming the file, the file left
as it was. An empty or absent file becomes a new spend file.

The connection is the gateway's I/O loop's (SQLite's ``check_same_thread``), the loop
that also makes every model's calls: each call blocks it for one indexed read or one
small transaction, the price of reading before reserving. While serving, a call waits
at most ``SERVING_BUSY_S`` for another gateway's transaction (then the write is kept
in memory for the next, the read goes on from memory); opening and the last write at
a stop wait ``BUSY_TIMEOUT_S``.

What must hold: spend in the file never decreases; every error is a
``SpendFileError`` naming the file.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import NamedTuple, Protocol

from callboard.core.pricing import NUSD_PER_USD
from callboard.messages import CallboardError, ConfigError
from callboard.runtime.guarded_log import guarded_logger

__all__ = [
    "APPLICATION_ID",
    "KEPT_PERIODS",
    "PRUNED_AT_ONCE",
    "Charge",
    "SpendFile",
    "SpendFileError",
    "SpendStore",
]

log = guarded_logger(__name__)

APPLICATION_ID = 0x63627370
"""``PRAGMA application_id`` of a spend file ("cbsp")."""
SCHEMA_VERSION = 1
"""``PRAGMA user_version`` of the layout below."""
BUSY_TIMEOUT_S = 5.0
"""How long opening the file, and the last write at a stop (``wait_longer``), wait for
another gateway's transaction on it."""
SERVING_BUSY_S = 0.05
"""How long a read or write waits for another's transaction while the gateway serves:
the connection is the I/O loop's, which makes every model's calls, and a file held
for 3 s by another process held all of them as long (a review). A write that finds it
held longer is kept in memory and goes with the next (``Quotas``); a read goes on from
memory."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS spend (
    scope       TEXT NOT NULL,
    period      TEXT NOT NULL,
    start       INTEGER NOT NULL,
    ends        INTEGER,
    spent_nusd  INTEGER NOT NULL CHECK (spent_nusd >= 0),
    PRIMARY KEY (scope, period, start)
) WITHOUT ROWID;
"""
_COLUMNS = ("scope", "period", "start", "ends", "spent_nusd")
_KEY = ("scope", "period", "start")
"""The table's primary key, in order: what each write's ``ON CONFLICT`` names."""
_ADD = (
    "INSERT INTO spend (scope, period, start, ends, spent_nusd) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (scope, period, start)"
    " DO UPDATE SET spent_nusd = spent_nusd + excluded.spent_nusd"
)
_PRUNE = (
    "DELETE FROM spend WHERE scope = :scope AND period = :period AND start IN ("
    " SELECT start FROM spend WHERE scope = :scope AND period = :period AND start <= ("
    "  SELECT start FROM spend WHERE scope = :scope AND period = :period"
    "  ORDER BY start DESC LIMIT 1 OFFSET :kept)"
    " ORDER BY start LIMIT :most)"
)
KEPT_PERIODS = 1000
"""The periods kept of each budget, the current one among them: a day's budget keeps
2.7 years, a month's 83, a 30 s one 8 hours."""
PRUNED_AT_ONCE = 1000
"""The most rows one prune drops (the oldest): a file grown for months by a short
period before pruning was dropped in one 250 ms transaction on the gateway's I/O loop,
which makes every model's calls (a review); the rest goes with the next periods."""
_ROWS = "SELECT scope, period, start, ends, spent_nusd FROM spend ORDER BY scope, start"
_SPENT = "SELECT spent_nusd FROM spend WHERE scope = ? AND period = ? AND start = ?"


class SpendFileError(ConfigError):
    """The spend file cannot be used (damaged, someone else's, unreadable)."""


class SpendNotRecordedError(CallboardError):
    """Spend settled before a stop that the spend file could not take (held by another
    process past every try, a full disk): the next start reads the budgets as lower
    by ``charges``, which the message names for an operator to add back."""

    def __init__(self, path: Path, charges: Sequence[Charge]) -> None:
        self.charges = tuple(charges)
        shown = "; ".join(
            f"{c.scope} {c.period or 'total'} from {c.start}: {Decimal(c.nusd) / NUSD_PER_USD} USD"
            for c in self.charges
        )
        super().__init__(f"the spend file {path} lacks spend settled before the stop: {shown}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Charge:
    """Settled cost to add to one scope's period."""

    scope: str
    """``key:<name>`` or ``tenant:<name>``."""
    period: str
    """The period's text (``1d``), ``""`` for a budget that never renews."""
    start: int
    """The period's start (Unix seconds, UTC; before 1970 for the week, or the days, a
    clock not yet set reads: a negative start refused every charge; a hunt); 0 for no
    period."""
    ends: int | None
    nusd: int
    """Cost in nano-USD (>= 0; a charge of 0 is not written)."""

    def __post_init__(self) -> None:
        for name, least in (("start", None), ("nusd", 0)):
            value = getattr(self, name)
            whole = isinstance(value, int) and not isinstance(value, bool)
            if not whole or (least is not None and value < least):
                floor = "" if least is None else f" >= {least}"
                raise ValueError(f"{name} must be an integer{floor}, got {value!r}")


class SpendStore(Protocol):
    """Where the quota book's settled spend is kept (``SpendFile``)."""

    def spent(self, scope: str, period: str, start: int) -> int: ...

    def add(self, charges: Iterable[Charge]) -> None: ...


class SpendFile:
    """``SpendFile(path)``: the spend file, checked and opened; ``close()`` when done."""

    def __init__(self, path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.path = path
        deadline = time.monotonic() + busy_timeout_s
        pause = 0.005
        while True:
            try:
                _inspect(path)
                db = _open(path, busy_timeout_s)
                break
            except _Locked as exc:
                # another gateway opening the file at the same moment: SQLite answers
                # "locked" at once, not after busy_timeout, while the journal mode changes
                if time.monotonic() + pause > deadline:
                    raise SpendFileError(f"cannot open the spend file {path}: {exc}") from None
            except sqlite3.Error as exc:
                raise SpendFileError(f"cannot open the spend file {path}: {exc}") from None
            time.sleep(pause)  # only while opening, before the gateway serves
            pause = min(0.1, pause * 2)
        self._db: sqlite3.Connection | None = db
        self._latest: dict[tuple[str, str], int] = {}
        """The latest period start written to each (scope, period) by this process."""

    def spent(self, scope: str, period: str, start: int) -> int:
        """The settled spend the file holds for the period (0: none yet)."""
        try:
            row = self._open().execute(_SPENT, (scope, period, start)).fetchone()
        except sqlite3.Error as exc:
            raise SpendFileError(f"cannot read the spend file {self.path}: {exc}") from None
        return 0 if row is None else int(row[0])

    def add(self, charges: Iterable[Charge]) -> None:
        """Add each charge to its row, all in one transaction (or none of them)."""
        rows = [(c.scope, c.period, c.start, c.ends, c.nusd) for c in charges if c.nusd]
        if not rows:
            return
        latest = self._latest
        new = {(s, p): t for s, p, t, _, _ in rows if p and t > latest.get((s, p), -1)}
        db = self._open()
        try:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(_ADD, rows)
            pruned = [
                {"scope": s, "period": p, "kept": KEPT_PERIODS, "most": PRUNED_AT_ONCE}
                for s, p in new
            ]
            db.executemany(_PRUNE, pruned)
            db.execute("COMMIT")
            latest.update(new)
        except sqlite3.Error as exc:
            _roll_back(db)  # a COMMIT that failed (busy, disk full) leaves it open
            raise SpendFileError(f"cannot write the spend file {self.path}: {exc}") from None
        except BaseException:
            _roll_back(db)
            raise

    def rows(self) -> list[tuple[str, str, int, int | None, int]]:
        """Every row (scope, period, start, ends, spent_nusd), for a reader."""
        try:
            return list(self._open().execute(_ROWS))
        except sqlite3.Error as exc:
            raise SpendFileError(f"cannot read the spend file {self.path}: {exc}") from None

    def wait_longer(self) -> None:
        """From now on wait ``BUSY_TIMEOUT_S`` for another's transaction (the last write,
        at a stop, when nothing else waits on the loop)."""
        self._open().execute(f"PRAGMA busy_timeout = {round(BUSY_TIMEOUT_S * 1000)}")

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._db is not None:
            self._db.close()
            self._db = None

    def __repr__(self) -> str:
        return f"<SpendFile {self.path}>"

    def _open(self) -> sqlite3.Connection:
        if self._db is None:
            raise SpendFileError(f"the spend file {self.path} is closed")
        return self._db


class _Locked(Exception):  # noqa: N818 - a state, retried
    """Another connection holds the file for a moment (``database is locked``)."""


def _open(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode, the schema in place, waiting
    ``SERVING_BUSY_S`` for another's transaction from then on; closed if any of it
    fails (a connection left to the collector is a ``ResourceWarning`` on Python 3.13)."""
    db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("BEGIN IMMEDIATE")
        db.execute(SCHEMA)
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
        db.execute(f"PRAGMA busy_timeout = {round(SERVING_BUSY_S * 1000)}")  # from now on
    except sqlite3.OperationalError as exc:
        _roll_back(db)
        db.close()
        if "locked" in str(exc):
            raise _Locked(str(exc)) from None
        raise
    except BaseException:
        _roll_back(db)
        db.close()
        raise
    return db


def _roll_back(db: sqlite3.Connection) -> None:
    """End the transaction a failure left open, if any (nothing of it was written)."""
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")


def _inspect(path: Path) -> None:
    """Refuse, reading only, a file that is not a spend file (an empty or absent one
    becomes one)."""
    facts = _facts(path)
    if facts is not None:
        _judge(path, facts)


class _Facts(NamedTuple):
    """What a spend file is, as ``_judge`` reads it."""

    app_id: int
    layout: int
    """``PRAGMA user_version``."""
    tables: list[str]
    columns: tuple[str, ...]
    """The spend table's."""
    key: tuple[str, ...]
    """The spend table's primary key."""
    checked: list[str]
    """``PRAGMA quick_check``'s words."""
    negative: int
    """Rows that hold no valid spend."""


def _facts(path: Path) -> _Facts | None:
    """What the file at ``path`` is (None: none there, or an empty one), reading only."""
    try:
        if not path.exists():
            return None
        if not path.is_file():  # /dev/null: SQLite's "disk I/O error", and a journal
            raise SpendFileError(  # left beside it as /dev/null-journal (a hunt)
                f"the spend file {path} is not a regular file (a device, a folder or a "
                "pipe): name a file, new or one a gateway wrote"
            )
        if path.stat().st_size == 0:
            return None
    except OSError as exc:
        raise SpendFileError(f"cannot read the spend file {path}: {exc}") from None
    try:
        with closing(sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)) as db:  # reads only
            (app_id,) = db.execute("PRAGMA application_id").fetchone()
            (layout,) = db.execute("PRAGMA user_version").fetchone()
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            info = db.execute("PRAGMA table_info(spend)").fetchall()
            columns = tuple(r[1] for r in info)
            key = tuple(r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5]))
            checked = [r[0] for r in db.execute("PRAGMA quick_check")]
            negative = (
                columns == _COLUMNS
                and db.execute(
                    "SELECT COUNT(*) FROM spend WHERE typeof(spent_nusd) != 'integer'"
                    " OR spent_nusd < 0"
                ).fetchone()[0]
            )
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            raise _Locked(str(exc)) from None
        raise SpendFileError(f"cannot read the spend file {path}: {exc}") from None
    except sqlite3.DatabaseError as exc:  # "file is not a database", a damaged page
        raise SpendFileError(
            f"the spend file {path} is not a readable SQLite database ({exc}): damaged, or "
            "not a spend file; move it aside to start from no spend"
        ) from None
    except sqlite3.Error as exc:
        raise SpendFileError(f"cannot read the spend file {path}: {exc}") from None
    return _Facts(app_id, layout, tables, columns, key, checked, negative)


def _judge(path: Path, facts: _Facts) -> None:
    """Refuse a file whose ``_facts`` say it is no spend file this callboard reads."""
    app_id, layout, tables, columns, key, checked, negative = facts
    # application_id 0 with our table: a spend file seen while another gateway makes it
    if app_id not in (0, APPLICATION_ID) or (tables and columns != _COLUMNS):
        raise SpendFileError(
            f"{path} is a SQLite database but not a callboard spend file (application_id "
            f"{app_id:#x}, tables: {', '.join(sorted(tables)) or 'none'})"
        )
    if app_id == APPLICATION_ID and layout > SCHEMA_VERSION:  # read as this one's, and
        raise SpendFileError(  # marked this one's again (found by a hunt)
            f"the spend file {path} was written by a newer callboard (its layout "
            f"{layout}; this one reads up to {SCHEMA_VERSION}): run that callboard, or "
            "give this one a spend file of its own"
        )
    if tables and key != _KEY:  # the columns, not the layout: every write failed on it
        raise SpendFileError(  # while the gateway served, and nothing was kept (a hunt)
            f"the spend file {path} has a spend table whose primary key is not "
            f"({', '.join(_KEY)}) (made by hand, or by an import?); move it aside to "
            "start from no spend"
        )
    if checked != ["ok"]:
        raise SpendFileError(
            f"the spend file {path} is damaged ({'; '.join(checked[:3])}); move it aside to "
            "start from no spend"
        )
    if negative:
        raise SpendFileError(
            f"the spend file {path} is damaged: {negative} rows hold no valid spend"
        )
