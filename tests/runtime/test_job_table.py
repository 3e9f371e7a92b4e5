"""``callboard.runtime.job_table``: the jobs' table, read and changed from any thread."""

from __future__ import annotations

import time

from callboard.runtime.job_table import JobTable
from support import interrupted_taking


def test_a_ctrl_c_as_a_caller_takes_the_tables_lock_does_not_leave_it_taken() -> None:
    """Taken through a ``Condition``'s Python ``__enter__``, a Ctrl-C handled between
    the lock's acquire and the ``with`` left the table's lock taken for good: every
    job's tick and every ``cb.jobs`` call after it waited for ever."""
    table = JobTable()
    lock = table._changed._lock  # type: ignore[attr-defined]  # the Condition's own
    interrupted_taking(lock, {"__enter__", "infos"}, lambda: table.infos(time.monotonic()))
