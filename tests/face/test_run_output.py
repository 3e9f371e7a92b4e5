"""The batch run's output file (callboard/_run_output.py): one run at a time writes it."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
from callboard.messages import Completed, UsageError
from support import write_lines

from callboard import _run_output
from callboard._run_output import exclusive, open_ledger, spooled
from callboard.batch import OutputState, result_record


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_second_run_on_the_same_output_by_another_name_is_refused(
    tmp_path: Path, how: str
) -> None:
    """The lock went by the name given: two runs, one through a link, both wrote the
    file (1,784 ids doubled)."""
    a = json.dumps(result_record("a", Completed(task_id=3, trace_id="t", content="x")))
    real = write_lines(tmp_path / "real.jsonl", [a])
    other = tmp_path / "other.jsonl"
    if how == "symlink":
        other.symlink_to(real)
    else:
        other.hardlink_to(real)
    refused = pytest.raises(UsageError, match="another callboard run is writing")
    with exclusive(real), refused, exclusive(other):
        pass
    with exclusive(other):  # released: a later run may
        pass


def test_a_hard_link_to_an_output_the_run_made_is_refused_too(tmp_path: Path) -> None:
    """A new output was held only by its OUTPUT.lock, named by its path: a second run
    through a hard link made to it meanwhile wrote every id again (found by a hunt). The
    output is made and held as itself; taken away again if nothing was written."""
    new = tmp_path / "new.jsonl"
    link = tmp_path / "link.jsonl"
    refused = pytest.raises(UsageError, match="another callboard run is writing")
    with exclusive(new):
        link.hardlink_to(new)
        with refused, exclusive(link):
            pass
    assert not new.exists()  # the run wrote nothing: it leaves no file of its own
    with exclusive(tmp_path / "kept.jsonl"):
        (tmp_path / "kept.jsonl").write_text("{}\n", encoding="utf-8")
    assert (tmp_path / "kept.jsonl").exists()


def _special(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"the-{kind}"
    if kind == "directory":
        path.mkdir()
        (path / "keep.txt").write_text("somebody's file")
    elif kind == "pipe":
        os.mkfifo(path)
    else:  # a device: a link to /dev/null, the usual way of saying "none" (as root, a
        path.symlink_to("/dev/null")  # rebuild renamed the device itself)
    return path


@pytest.mark.parametrize("kind", ["directory", "pipe", "device"])
@pytest.mark.parametrize("rebuild", [False, True])
@pytest.mark.timeout(20)  # a pipe opened for reading waits for a writer for ever
def test_a_ledger_that_is_no_file_is_refused_untouched(
    tmp_path: Path, kind: str, rebuild: bool
) -> None:
    """``--ledger /dev/null`` was called damaged and ``--rebuild-ledger`` renamed the
    device (a directory: moved aside, a SQLite file in its place); a pipe hung."""
    path = _special(tmp_path, kind)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(UsageError, match=f"is a {kind}, not a file"):
        open_ledger(path, tmp_path / "out.jsonl", OutputState(), rebuild_it=rebuild)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if kind == "directory":
        assert (path / "keep.txt").read_text() == "somebody's file"


@pytest.mark.parametrize("reopenable", [True, False])
def test_stdin_is_spooled_where_it_can_be_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reopenable: bool
) -> None:
    """Unnamed where ``/proc/self/fd`` reopens it; where a sandbox forbids that (here:
    a directory with nothing in it), a named copy, not a run that cannot read it (found
    by a review)."""
    if not reopenable:
        (tmp_path / "fd").mkdir()
        monkeypatch.setattr(_run_output, "_OPEN_FILES", tmp_path / "fd")
    elif not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc/self/fd here")
    data = b'{"id": "a", "prompt": "x"}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    spool = tmp_path / "spool"
    spool.mkdir()
    with spooled(Path("-"), spool) as copy:
        assert copy.read_bytes() == copy.read_bytes() == data
        named = [p.name for p in spool.iterdir()]
    assert named == ([] if reopenable else ["stdin.jsonl"])


def test_the_ledger_is_beside_the_file_a_link_names_as_its_lock_is(tmp_path: Path) -> None:
    """A run resumed through a link (a ``latest.jsonl`` a cron job uses) found no ledger
    beside the link's name and paid again for every result the output lacked (a hunt)."""
    real = tmp_path / "runs" / "results-06.jsonl"
    real.parent.mkdir()
    real.touch()
    link = tmp_path / "latest.jsonl"
    link.symlink_to(real)
    assert _run_output.ledger_path(link) == real.with_name("results-06.jsonl.ledger")
    assert _run_output.ledger_path(real) == _run_output.ledger_path(link)
    (tmp_path / "latest.jsonl.ledger").touch()  # the link's own: never the ledger of the
    assert _run_output.ledger_path(link) == real.with_name("results-06.jsonl.ledger")  # file


def test_a_rebuild_of_a_ledger_that_does_not_open_says_every_row_is_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ledger cut to half its size does not open as a database: its rebuild said "0 did
    not" read, of 300 rows lost (a hunt)."""
    path = tmp_path / "out.jsonl.ledger"
    path.write_bytes(b"SQLite format 3\x00" + b"\x01" * 4000)  # its head, then nothing readable
    ledger = open_ledger(path, tmp_path / "out.jsonl", OutputState(), rebuild_it=True)
    ledger.close()
    said = capsys.readouterr().err
    assert "every row it held is lost" in said, said
    assert "0 did not" not in said
