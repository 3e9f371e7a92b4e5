"""The advisory lock file of a run or a ledger (runtime/filelock.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from callboard.runtime.filelock import LockHeldError, hold, lock_path


def test_a_held_lock_refuses_a_second_holder_until_released(tmp_path: Path) -> None:
    lock = lock_path(tmp_path / "out.jsonl")
    assert lock == tmp_path / "out.jsonl.lock"
    fd = hold(lock)
    with pytest.raises(LockHeldError):
        hold(lock)
    os.close(fd)
    os.close(hold(lock))


def test_two_names_of_one_file_through_a_symbolic_link_are_one_lock(tmp_path: Path) -> None:
    """A ledger or an output named through a link was locked beside the link: two
    systems wrote one ledger, two runs one output."""
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "tasks.db"
    real.touch()
    link = tmp_path / "tasks.db"
    link.symlink_to(real)
    assert lock_path(link) == lock_path(real) == real.with_name("tasks.db.lock")
    fd = hold(lock_path(real))
    try:
        with pytest.raises(LockHeldError):
            hold(lock_path(link))
    finally:
        os.close(fd)
