"""Syncing a folder after a rename: done where a folder opens, quietly skipped where not."""

from __future__ import annotations

from pathlib import Path

import pytest
from callboard.runtime import durable
from callboard.runtime.durable import sync_folder


def test_a_rename_is_synced_through_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real = durable.os.fsync
    monkeypatch.setattr(durable.os, "fsync", lambda fd: synced.append(fd) or real(fd))
    (tmp_path / "new").write_text("x")
    (tmp_path / "new").replace(tmp_path / "old")
    sync_folder(tmp_path)
    assert len(synced) == 1


def test_a_folder_that_does_not_open_is_left_alone(tmp_path: Path) -> None:
    sync_folder(tmp_path / "gone")  # as on a system that opens no folder: no error
