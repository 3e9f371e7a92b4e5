"""``callboard.runtime.job_table``: the jobs' table, read and changed from any thread."""

from __future__ import annotations

import _thread
import sys
import threading
import time

import pytest
from callboard.runtime.job_table import JobTable
from support import WAIT_S


def test_a_ctrl_c_as_a_caller_takes_the_tables_lock_does_not_leave_it_taken() -> None:
    """Taken through a ``Condition``'s Python ``__enter__``, a Ctrl-C handled between
    the lock's acquire and the ``with`` left the table's lock taken for good: every
    job's tick and every ``cb.jobs`` call after it waited for ever."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("interrupt_main() reaches the main thread only")
    table = JobTable()
    lock = table._changed._lock  # type: ignore[attr-defined]  # the Condition's own
    main = threading.main_thread().ident
    taken = threading.Event()

    def main_waits() -> bool:
        frame = sys._current_frames().get(main)
        return frame is not None and frame.f_code.co_name in {"__enter__", "infos"}

    def hold() -> None:
        with lock:  # until the main thread waits for it; the Ctrl-C; let go
            taken.set()
            for _ in range(2000):
                if main_waits():
                    break
                time.sleep(0.001)
            _thread.interrupt_main()

    def read_then_wait() -> None:
        table.infos(time.monotonic())
        time.sleep(WAIT_S)  # the interrupt lands after the read, if not within it

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(WAIT_S)
    with pytest.raises(KeyboardInterrupt):
        read_then_wait()
    holder.join(WAIT_S)
    free: list[bool] = []

    def take() -> None:  # from another thread: the lock is reentrant
        free.append(lock.acquire(timeout=WAIT_S))
        if free[0]:
            lock.release()

    other = threading.Thread(target=take)
    other.start()
    other.join(2 * WAIT_S)
    assert free == [True], "the table's lock was left taken"
