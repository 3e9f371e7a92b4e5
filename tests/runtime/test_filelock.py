"""The advisory lock file of a run or a ledger (runtime/filelock.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from callboard.runtime.filelock import LockHeldError, hold, lock_path, release


def test_a_held_lock_refuses_a_second_holder_until_released(tmp_path: Path) -> None:
    lock = lock_path(tmp_path / "out.jsonl")
    assert lock == tmp_path / "out.jsonl.lock"
    fd = hold(lock)
    with pytest.raises(LockHeldError):
        hold(lock)
    release(fd)
    release(hold(lock))


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
        release(fd)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_does_not_keep_its_parents_lock(tmp_path: Path) -> None:
    """An ``flock`` belongs to the open file, which a fork shares: a child that never
    touched callboard (a ``multiprocessing`` worker) held the parent's ledger locked
    until it exited, and the parent could not open the ledger again (found by a
    hunt). The child closes its copies as it starts."""
    lock = lock_path(tmp_path / "tasks.db")
    fd = hold(lock)
    go_on, told = os.pipe()
    started, says = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child: says it runs, waits to be told, ends
        os.close(told)
        os.write(says, b"x")  # its fork's hooks have run by now
        os.read(go_on, 1)
        os._exit(0)
    os.close(go_on)
    os.close(says)
    try:
        assert os.read(started, 1) == b"x"
        os.close(started)
        release(fd)
        release(hold(lock))  # the child is alive: the lock went with the parent's release
    finally:
        os.write(told, b"x")
        os.close(told)
        os.waitpid(child, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_lock_a_forked_child_takes_is_not_let_go_by_releasing_an_inherited_one(
    tmp_path: Path,
) -> None:
    """Closed in the child, the parent's number was free for the child's own next lock,
    and a ``release`` of the inherited one (a ledger's close) closed the child's (a
    review). The number stays taken, pointed at /dev/null."""
    inherited = hold(lock_path(tmp_path / "a.db"))
    child = os.fork()
    if child == 0:  # pragma: no cover - the child: its verdict is its exit status
        own = hold(lock_path(tmp_path / "b.db"))
        release(inherited)
        try:
            hold(lock_path(tmp_path / "b.db"))
        except LockHeldError:
            os._exit(0 if own != inherited else 2)
        os._exit(1)
    try:
        _, status = os.waitpid(child, 0)
    finally:
        release(inherited)
    assert os.waitstatus_to_exitcode(status) == 0
