"""The spend file: settled spend per scope and period, added (never overwritten), kept
across a reopen, shared by two writers, and a file that is not one refused untouched."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
from callboard.gateway.settings import BudgetPeriod
from callboard.gateway.spend import (
    APPLICATION_ID,
    KEPT_PERIODS,
    PRUNED_AT_ONCE,
    SCHEMA_VERSION,
    Charge,
    SpendFile,
    SpendFileError,
)
from callboard.messages import ConfigError


def charge(nusd: int, scope: str = "key:a", start: int = 100) -> Charge:
    return Charge(scope=scope, period="1h", start=start, ends=start + 3600, nusd=nusd)


def test_a_charge_is_added_to_its_period_and_kept_across_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "spend.db"
    spend = SpendFile(path)
    spend.add([charge(5), charge(7), charge(3, start=3700), charge(2, scope="tenant:t")])
    spend.add([charge(1)])
    assert spend.spent("key:a", "1h", 100) == 13
    assert spend.spent("key:a", "1h", 3700) == 3
    assert spend.spent("key:a", "1d", 100) == 0  # another period's row: none yet
    spend.close()
    again = SpendFile(path)
    assert again.spent("key:a", "1h", 100) == 13
    assert again.rows() == [
        ("key:a", "1h", 100, 3700, 13),
        ("key:a", "1h", 3700, 7300, 3),
        ("tenant:t", "1h", 100, 3700, 2),
    ]
    again.close()
    again.close()  # idempotent
    with pytest.raises(SpendFileError, match="is closed"):
        again.spent("key:a", "1h", 100)


def test_two_writers_on_one_file_add_up_and_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "spend.db"
    times = 200
    go = threading.Barrier(2)

    def write() -> None:  # each connection in its own thread, as each gateway on its loop
        go.wait()  # both open the new file at once, too
        spend = SpendFile(path)
        spend.wait_longer()  # a write that waits past the serving time would fail (and a
        try:  # gateway keep it for its next): here each must go
            for _ in range(times):
                spend.add([charge(1), charge(2, scope="tenant:t")])
        finally:
            spend.close()

    other = threading.Thread(target=write)
    other.start()
    write()
    other.join()
    spend = SpendFile(path)
    assert spend.spent("key:a", "1h", 100) == 2 * times
    assert spend.spent("tenant:t", "1h", 100) == 2 * 2 * times
    spend.close()


def test_a_file_that_is_not_a_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "spend.db"
    junk = b"not a database at all\n" * 400
    path.write_bytes(junk)
    with pytest.raises(SpendFileError, match="not a readable SQLite database") as caught:
        SpendFile(path)
    assert isinstance(caught.value, ConfigError)  # callboard serve: exit 2, the message
    assert str(path) in str(caught.value)
    assert path.read_bytes() == junk
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spend.db"]  # no -wal, no -shm


def test_a_truncated_spend_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "spend.db"
    spend = SpendFile(path)
    spend.add([charge(n + 1, scope=f"key:{n:04}-{'x' * 200}") for n in range(400)])
    spend.close()
    with closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size // 2)
    kept = path.read_bytes()
    with pytest.raises(SpendFileError, match="damaged"):
        SpendFile(path)
    assert path.read_bytes() == kept


def test_another_applications_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE notes (body TEXT)")
        db.commit()
    kept = path.read_bytes()
    with pytest.raises(SpendFileError, match="not a callboard spend file"):
        SpendFile(path)
    assert path.read_bytes() == kept


def test_a_spend_file_a_newer_callboard_wrote_is_refused_untouched(tmp_path: Path) -> None:
    """Its layout mark was written and never read: a newer layout was read as this one's,
    and marked this one's again (found by a hunt)."""
    path = tmp_path / "spend.db"
    SpendFile(path).close()
    with closing(sqlite3.connect(path)) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    before = path.read_bytes()
    with pytest.raises(SpendFileError, match="written by a newer callboard"):
        SpendFile(path)
    assert path.read_bytes() == before


def test_a_spend_table_without_its_primary_key_is_refused_untouched(tmp_path: Path) -> None:
    """The right columns without the layout (what ``sqlite3 .import --csv`` makes): it
    was taken, then every write failed on it while the gateway served, and no spend was
    kept across a restart (found by a hunt)."""
    path = tmp_path / "spend.db"
    with closing(sqlite3.connect(path)) as db:
        db.execute(
            "CREATE TABLE spend (scope TEXT, period TEXT, start INTEGER, ends INTEGER,"
            " spent_nusd INTEGER)"
        )
        db.execute("INSERT INTO spend VALUES ('key:a', '1h', 100, 3700, 5)")
        db.commit()
    kept = path.read_bytes()
    with pytest.raises(SpendFileError, match=r"primary key is not \(scope, period, start\)"):
        SpendFile(path)
    assert path.read_bytes() == kept


def test_a_device_or_folder_as_the_spend_file_is_refused_untouched(tmp_path: Path) -> None:
    for path in (Path(os.devnull), tmp_path):
        with pytest.raises(SpendFileError, match="not a regular file"):
            SpendFile(path)
    assert not Path(f"{os.devnull}-journal").exists()
    assert list(tmp_path.iterdir()) == []


def test_a_row_of_negative_spend_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "spend.db"
    SpendFile(path).close()
    with closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA ignore_check_constraints = ON")
        db.execute("INSERT INTO spend VALUES ('key:a', '1h', 0, 3600, -5)")
        db.commit()
    with pytest.raises(SpendFileError, match=r"spend\.db is damaged"):
        SpendFile(path)


def test_an_empty_file_becomes_a_spend_file(tmp_path: Path) -> None:
    path = tmp_path / "spend.db"
    path.touch()
    spend = SpendFile(path)
    spend.add([charge(4)])
    spend.close()
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_write_that_fails_writes_nothing_and_the_next_one_goes(tmp_path: Path) -> None:
    path = tmp_path / "spend.db"
    spend = SpendFile(path, busy_timeout_s=0.05)
    with closing(sqlite3.connect(path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")  # another writer holds the file past the timeout
        with pytest.raises(SpendFileError, match=r"cannot write the spend file .* locked"):
            spend.add([charge(5), charge(6, scope="tenant:t")])
        other.execute("ROLLBACK")
    spend.add([charge(1)])  # nothing of the failed write, and no transaction left open
    assert (spend.spent("key:a", "1h", 100), spend.spent("tenant:t", "1h", 100)) == (1, 0)
    spend.close()


def test_while_serving_a_locked_file_fails_a_write_at_once_and_at_a_stop_it_waits(
    tmp_path: Path,
) -> None:
    """The connection is the I/O loop's, which makes every model's calls: another
    process holding the file for 3 s held all of them as long (a review). Serving, a
    write gives up after ``SERVING_BUSY_S`` (the gateway keeps it for its next); the
    last write, at a stop, waits for the file."""
    path = tmp_path / "spend.db"
    spend = SpendFile(path)
    with closing(sqlite3.connect(path, isolation_level=None, check_same_thread=False)) as other:
        other.execute("BEGIN IMMEDIATE")
        began = time.monotonic()
        with pytest.raises(SpendFileError, match="locked"):
            spend.add([charge(5)])
        assert time.monotonic() - began < 1.0
        spend.wait_longer()
        release = threading.Timer(0.2, other.execute, args=("ROLLBACK",))
        release.start()
        spend.add([charge(7)])  # waited for the other's transaction to end
        release.join()
    assert spend.spent("key:a", "1h", 100) == 7
    spend.close()


def test_a_charge_is_checked() -> None:
    with pytest.raises(ValueError, match="nusd must be an integer >= 0"):
        charge(-1)
    with pytest.raises(ValueError, match=r"start must be an integer, got 1\.5"):
        charge(1, start=1.5)  # type: ignore[arg-type]


def test_a_period_that_starts_before_1970_is_kept(tmp_path: Path) -> None:
    """A gateway started before its clock was set (1970-01-01) counts a week from Monday
    1969-12-29: the charge's negative start was refused, and every charge after it
    with it, so the spend file kept nothing (a hunt)."""
    week = BudgetPeriod(1, "w")
    start, ends = week.bounds(1000.0)
    assert start < 0 < ends
    spend = SpendFile(tmp_path / "spend.db")
    spend.add([Charge(scope="key:a", period="1w", start=start, ends=ends, nusd=25)])
    assert spend.spent("key:a", "1w", start) == 25


def test_a_file_in_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpendFileError, match="spend file"):
        SpendFile(tmp_path / "nowhere" / "spend.db")


def test_a_budget_keeps_its_latest_periods_and_drops_the_older_ones(tmp_path: Path) -> None:
    """A row per period for good grew the file without end (a 1 s period: 86,400 rows a
    day a budget; found by a hunt): a scope keeps its ``KEPT_PERIODS`` latest, the
    current one among them, and no other scope or period loses any."""
    spend = SpendFile(tmp_path / "spend.db")
    last = KEPT_PERIODS + 5
    for n in range(1, last + 1):  # a charge per period, in turn after turn
        spend.add([charge(n, start=3600 * n)])
    spend.add([charge(1, start=3600 * last), charge(9, scope="tenant:t", start=3600)])
    once = Charge(scope="key:b", period="", start=0, ends=None, nusd=4)  # never renews
    spend.add([once])
    kept = [row for row in spend.rows() if row[0] == "key:a"]
    assert [row[2] for row in kept] == [3600 * n for n in range(6, last + 1)]
    assert spend.spent("key:a", "1h", 3600 * last) == last + 1
    assert spend.spent("tenant:t", "1h", 3600) == 9  # its only period
    assert spend.spent("key:b", "", 0) == 4
    spend.close()


def test_a_prune_drops_at_most_its_share_of_a_long_backlog(tmp_path: Path) -> None:
    """A file grown before pruning (months of a short period) was dropped in one long
    transaction on the gateway's loop (a review): each new period drops at most
    ``PRUNED_AT_ONCE`` of the oldest rows, until only ``KEPT_PERIODS`` are left."""
    path = tmp_path / "spend.db"
    backlog = KEPT_PERIODS + PRUNED_AT_ONCE + 10
    with closing(sqlite3.connect(path)) as db:  # as a spend file grown unpruned
        SpendFile(path).close()
        rows = [("key:a", "1h", 3600 * n, 3600 * (n + 1), 1) for n in range(1, backlog + 1)]
        db.executemany("INSERT INTO spend VALUES (?, ?, ?, ?, ?)", rows)
        db.commit()
    spend = SpendFile(path)
    spend.add([charge(1, start=3600 * (backlog + 1))])
    assert len(spend.rows()) == backlog + 1 - PRUNED_AT_ONCE
    spend.add([charge(1, start=3600 * (backlog + 2))])
    kept = [row[2] for row in spend.rows()]
    assert len(kept) == KEPT_PERIODS
    assert kept[-1] == 3600 * (backlog + 2)
    spend.close()
