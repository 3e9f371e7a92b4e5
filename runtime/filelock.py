"""An advisory lock file held for a run or a ledger's life (``PATH.lock``).

``hold(lock)`` opens (creating) the file and takes an exclusive, non-blocking
``flock`` on it; ``release(fd)`` lets it go. A lock another process (or another
open of the file) holds raises ``LockHeldError``; failing to create the file raises
the ``OSError``. Without ``fcntl`` (Windows) nothing is locked: the file is still
created and the descriptor still returned.

A forked child lets go of its copies of the held descriptors at once: an ``flock`` is
the open file's, which a fork shares, so a child that never touched callboard (a
``multiprocessing`` worker) held the parent's ledger locked until it exited, and the
parent could not open its ledger again (found by a hunt). Each number is pointed at
``/dev/null`` there rather than closed: closed, it was free for the child's own next
lock, which a ``release`` of the inherited one then closed (a review).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory lock
    fcntl = None  # type: ignore[assignment]

__all__ = ["LockHeldError", "hold", "hold_or", "lock_path", "release"]

_HELD: set[int] = set()
"""The descriptors ``hold`` returned and ``release`` has not closed."""


class LockHeldError(OSError):
    """Somebody else holds the lock."""


def lock_path(path: Path) -> Path:
    """``PATH.lock`` beside the file ``path`` names (through symbolic links: two names
    of one file are one lock)."""
    path = path.resolve()
    return path.with_name(path.name + ".lock")


def hold(lock: Path) -> int:
    """Open and lock ``lock``; the descriptor to ``release`` when done."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockHeldError(f"{lock} is held") from None
    _HELD.add(fd)
    return fd


def release(fd: int) -> None:
    """Close ``fd`` (one ``hold`` returned), letting its lock go."""
    _HELD.discard(fd)
    os.close(fd)


def _let_go_in_child() -> None:
    if not _HELD:
        return
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        for fd in _HELD:
            with contextlib.suppress(OSError):  # closed meanwhile
                os.dup2(null, fd)
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_let_go_in_child)


def hold_or(lock: Path, error: type[Exception], busy: str) -> int:
    """``hold(lock)``, a failure raised as ``error``: ``busy`` (what holds it, said
    for its reader) when another holds it, the reason when the file cannot be made."""
    try:
        return hold(lock)
    except LockHeldError:
        raise error(f"{busy} (it holds {lock})") from None
    except OSError as exc:
        doing = "open" if lock.exists() else "create"  # a file there that may not be written
        raise error(f"cannot {doing} {lock}: {exc.strerror or exc}") from None
