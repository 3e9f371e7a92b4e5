"""A rename made durable: the folder that holds it written to the disk.

A file's own ``fsync`` makes its bytes durable, not its name: after ``os.replace``
a power cut may leave the old name until the folder itself is synced. Used by the
batch run's output rewrite and the ledger's rebuild, both of which put a finished
file in place of another by renaming it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["sync_folder"]


def sync_folder(folder: Path) -> None:
    """Make the renames in ``folder`` durable (where the system allows opening a
    folder: Windows does not, and nothing is done there)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
