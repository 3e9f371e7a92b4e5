"""The batch run's output file (callboard/_run_output.py): one run at a time writes it."""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from callboard.messages import Completed, UsageError
from callboard.provider.server import SimulatedProvider
from support import CLI_TIMEOUT_S, good, records, requests_seen, write_lines

from callboard import _run_output
from callboard._run_output import exclusive, open_ledger, repair_tail, spooled
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


def test_only_a_stream_input_needs_a_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One was made for every run, and a host with none writable (a read-only root, a
    TMPDIR that is not there) got a traceback for a regular file (found by a hunt)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "not-there"))
    regular = tmp_path / "in.jsonl"
    regular.write_bytes(b'{"id": "a", "prompt": "x"}\n')
    with spooled(regular) as source:
        assert source == regular
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(regular.read_bytes())))
    with (
        pytest.raises(UsageError, match=r"no writable temporary directory .*TMPDIR"),
        spooled(Path("-")),
    ):
        pass


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


def started_with(redirect: str, *args: Any) -> subprocess.CompletedProcess[str]:
    """``python -m callboard ARGS`` started by a shell with ``redirect`` (``>&-``: no
    stdout, as a service or a cron job may be started; ``<&-``: no stdin); its stderr."""
    command = [sys.executable, "-m", "callboard", *map(str, args)]
    return subprocess.run(  # noqa: S603 - our own module, fixed arguments
        ["sh", "-c", f'exec "$@" {redirect}', "sh", *command],  # noqa: S607 - the shell
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


@pytest.mark.parametrize(
    ("redirect", "given", "said"),
    [
        (">&-", ["IN", "-o", "-"], "-o - is standard output, which is closed"),
        (">&-", ["IN", "-o", "/dev/stdout"], "-o /dev/stdout is standard output, which is closed"),
        (
            "<&-",
            ["-", "-o", "OUT"],
            "the input is - (standard input), but standard input is closed",
        ),
        (
            "<&-",
            ["/dev/stdin", "-o", "OUT"],
            "the input is /dev/stdin (standard input), but standard input is closed",
        ),
        (">>IN", ["IN", "-o", "-"], "-o - is standard output, which is the input file"),
        (">>IN", ["IN", "-o", "/dev/stdout"], "which is the input file"),
    ],
    ids=[
        "stdout closed, -o -",
        "stdout closed, -o /dev/stdout",
        "stdin closed, input -",
        "stdin closed, input /dev/stdin",
        "stdout is the input, -o -",
        "stdout is the input, -o /dev/stdout",
    ],
)
def test_a_closed_stdout_or_stdin_is_refused_before_anything_is_sent(
    tmp_path: Path, provider: SimulatedProvider, redirect: str, given: list[str], said: str
) -> None:
    """``-o -`` with stdout closed: ``sys.stdout`` was None, the writer died on its first
    line, every line was still sent and paid for, and the summary said "0 results
    (nothing to do)". ``-o /dev/stdout``: descriptor 1 was taken by the ledger's lock
    file, which got the results, and the run ended 0. Input ``-`` with stdin closed: a
    traceback; ``/dev/stdin`` with stdin closed read the run's own spool file on
    descriptor 0 and ended 0, nothing done; ``-o - >> IN``: the run read its own
    results as input, 85,000 lines in seconds (all found by hunts). Each is exit 2
    naming the stream, nothing sent."""
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in ("a", "b", "c")])
    before = src.read_bytes()
    out = tmp_path / "out.jsonl"
    conf = tmp_path / "c.toml"
    conf.write_text(f'[models.m]\nbase_url = "{provider.base_url}"\n', encoding="utf-8")
    ledger = tmp_path / "kept.db"
    named = {"IN": str(src), "OUT": str(out)}
    args = [named.get(a, a) for a in given]
    redirect = redirect.replace("IN", shlex.quote(str(src)))
    proc = started_with(redirect, "run", *args, "--config", conf, "--ledger", ledger)
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr
    assert "Traceback" not in proc.stderr
    assert requests_seen(provider) == 0, "nothing is sent"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "in.jsonl"]
    assert src.read_bytes() == before


def test_a_path_the_system_cannot_look_at_is_exit_2_naming_it(tmp_path: Path) -> None:
    """A name longer than the system takes (ENAMETOOLONG) was a traceback, exit 1, from
    the checks of -o, the input and --ledger (found by a hunt)."""
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    long = tmp_path / ("x" * 300)
    for args in (
        [src, "-o", long],
        [long, "-o", tmp_path / "out.jsonl"],
        [src, "-o", long / "out.jsonl"],
        [src, "-o", tmp_path / "out.jsonl", "--ledger", long / "l.db"],
    ):
        proc = started_with("", "run", *args)
        assert proc.returncode == 2, proc.stderr
        assert "File name too long" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


SIZE_LIMITED = (
    "import resource, runpy, sys; "
    "limit = int(sys.argv.pop(1)); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)); "
    "sys.argv[0] = 'callboard'; "
    "runpy.run_module('callboard', run_name='__main__')"
)
"""``python -m callboard`` with files limited to ``sys.argv[1]`` bytes (Python ignores
SIGXFSZ: a write past the limit fails with EFBIG, as on a disk that is full)."""


def test_a_last_record_whose_newline_cannot_be_added_is_exit_2_naming_the_file(
    tmp_path: Path,
) -> None:
    """A record missing only its newline, on a disk still full (here: the file size
    limit at the file's size): the newline's write raised "File too large" in a
    traceback (found by a hunt). It is exit 2 naming the file and why; the file is left
    as it was, and once there is room the next run completes it."""
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    out = tmp_path / "out.jsonl"
    record = json.dumps(result_record("a", Completed(task_id=1, trace_id="t", content="x")))
    out.write_text(record, encoding="utf-8")  # the write was cut just before the newline
    limited = [sys.executable, "-c", SIZE_LIMITED, str(out.stat().st_size)]
    proc = subprocess.run(  # noqa: S603 - our own module, fixed arguments
        [*limited, "run", str(src), "-o", str(out), "--no-ledger"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"cannot add the newline the last record of {out} lacks (File too large)" in (
        proc.stderr
    )
    assert out.read_text(encoding="utf-8") == record
    repair_tail(out)  # room again
    assert out.read_text(encoding="utf-8") == record + "\n"
    assert [r["id"] for r in records(out)] == ["a"]


PIECE = 8
"""``TAIL_BYTES`` in the tests of the torn line: a line of a few dozen bytes spans
several pieces, and its newline falls at every place in one."""


def _record_line(ident: str, text: str = "x") -> bytes:
    done = Completed(task_id=1, trace_id="t", content=text)
    return json.dumps(result_record(ident, done)).encode()


@pytest.mark.parametrize("before", [b"", _record_line("a") + b"\n"], ids=["alone", "after a"])
def test_a_torn_last_line_over_several_pieces_is_cut_where_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: bytes
) -> None:
    """Every length from 1 byte to four pieces and more: the newline before the torn
    line at the end of a piece, at its start, inside one, or nowhere (the torn line is
    the whole file)."""
    monkeypatch.setattr(_run_output, "TAIL_BYTES", PIECE)
    path = tmp_path / "out.jsonl"
    whole = _record_line("b", "y" * 40)
    for length in range(1, 5 * PIECE):
        path.write_bytes(before + whole[:length])
        repair_tail(path)
        assert path.read_bytes() == before, length


@pytest.mark.parametrize("before", [b"", _record_line("a") + b"\n"], ids=["alone", "after a"])
def test_a_whole_record_over_several_pieces_gets_its_newline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: bytes
) -> None:
    monkeypatch.setattr(_run_output, "TAIL_BYTES", PIECE)
    path = tmp_path / "out.jsonl"
    for size in range(PIECE):  # records whose newline falls at every place in a piece
        whole = _record_line("b", "y" * size)
        assert len(whole) > 4 * PIECE
        path.write_bytes(before + whole)
        repair_tail(path)
        assert path.read_bytes() == before + whole + b"\n", size
        repair_tail(path)  # it ends with a newline now: left as it is
        assert path.read_bytes() == before + whole + b"\n", size


def test_a_torn_last_line_is_read_once_not_gathered_piece_by_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each piece read from the end was joined to the tail read so far, and the whole
    tail searched again: quadratic (a torn line of 156 MB: 15 s and 863 MB; found by a
    hunt), and the joining held the line twice over. Each piece is searched once, and
    the line read once from where it starts: it is held once, not parsed."""
    monkeypatch.setattr(_run_output, "TAIL_BYTES", 1 << 14)
    path = tmp_path / "out.jsonl"
    before = _record_line("a") + b"\n"
    torn = b'{"id": "b", "embeddings": [' + b"0.123456789, " * 200_000  # 2.6 MB, 160 pieces
    path.write_bytes(before + torn)
    tracemalloc.start()
    try:
        repair_tail(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert path.read_bytes() == before
    assert peak < 1.5 * len(torn), f"{peak} bytes held for a torn line of {len(torn)}"


def test_an_input_in_utf16_is_exit_2_saying_so(tmp_path: Path) -> None:
    """PowerShell's ``>`` writes UTF-16: each line was "not UTF-8 (invalid start byte)",
    and a 2-line file gave 3 error lines (found by a hunt)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "hi"}\n', encoding="utf-16")
    proc = started_with("", "run", src, "-o", tmp_path / "out.jsonl")
    assert proc.returncode == 2, proc.stderr
    assert "is UTF-16" in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()
