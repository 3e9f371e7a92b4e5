"""The command line (callboard/cli.py) and the batch run it drives: results and errors
per line, exit codes, ``--help``, resuming after SIGINT, SIGTERM or SIGKILL, repairing a
torn output, two runs on one output, files that are not ours, bad configs, and secrets
that never leak.

Everything runs on real parts: the CLI in-process (``main``) or as a subprocess, on the
embedded simulated provider or a ``SimulatedProvider`` on loopback (in its own process
where a run is killed).
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.metadata
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from callboard.bench.provider_process import ProviderProcess
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from loopback import Gate, WireServer
from support import (
    INTERRUPTIBLE,
    WAIT_S,
    cli,
    good,
    records,
    requests_seen,
    two_models,
    wait_until,
    write_lines,
)

from callboard import Cancelled, ModelSettings, System, SystemConfig
from callboard import cli as cli_module
from callboard._run_batch import stop_waiting
from callboard._signals import Interrupts
from callboard.cli import Exit, _parser, main
from callboard.toml_config import load_config

RUN_TIMEOUT_S = 90.0
"""Upper bound for one ``callboard run`` (a few seconds normally)."""


def assert_no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr


def start(
    args: list[Any], stderr: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with stderr.open("wb") as err:
        return subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
            [sys.executable, "-c", INTERRUPTIBLE, *map(str, args)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=None if env is None else {**os.environ, **env},
        )


def finish(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)


def here(capsys: pytest.CaptureFixture[str], *args: Any) -> subprocess.CompletedProcess[str]:
    """``callboard ARGS`` in this process, as ``cli`` gives it from a child: for the runs
    whose point is not the process (its signals, its streams), a second of start-up less."""
    argv = [str(a) for a in args]
    try:
        code: object = main(argv)
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    assert isinstance(code, int), code
    return subprocess.CompletedProcess(argv, code, out, err)


def run_inproc(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str]:
    code = main(["run", *map(str, args)])
    return code, capsys.readouterr().err


def final_counts(path: Path) -> Counter[str]:
    """Result lines per id, not counting 'cancelled' (those are rerun by design)."""
    return Counter(r["id"] for r in records(path) if r["status"] != "cancelled")


def has_line(path: Path, predicate: Callable[[dict[str, Any]], bool] = lambda r: True) -> bool:
    if not path.exists():
        return False
    return any(predicate(json.loads(raw)) for raw in path.read_bytes().split(b"\n")[:-1])


def ledger_rows(output: Path) -> int:
    """Tasks the run's ledger has accepted (a read-only look at another process's file)."""
    ledger = output.with_name(output.name + ".ledger")
    if not ledger.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
            return int(db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])
    except sqlite3.OperationalError:  # not created yet
        return 0


def in_flight(provider: SimulatedProvider) -> int:
    return int(provider.stats()["total"]["in_flight"])


def toml_config(path: Path, base_url: str, **model: str) -> Path:
    """One model ``m`` on ``base_url``; extra keys as raw TOML values."""
    extra = "".join(f"{k} = {v}\n" for k, v in model.items())
    path.write_text(f'[models.m]\nbase_url = "{base_url}"\n{extra}', encoding="utf-8")
    return path


def run_args(
    tmp_path: Path, base_url: str, lines: list[Any], *extra: str, **model: str
) -> tuple[list[Any], Path]:
    """``run IN -o OUT --config C EXTRA`` for ``lines`` on model ``m`` at ``base_url``
    (``model``: more of its TOML keys); the arguments and OUT."""
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    config = toml_config(tmp_path / "c.toml", base_url, **model)
    return ["run", src, "-o", out, "--config", config, *extra], out


@pytest.fixture
def slow(provider: SimulatedProvider) -> SimulatedProvider:
    """The provider with model ``m``'s calls taking 1.5 s, so a signal lands with calls on
    the wire."""
    provider.configure("m", ModelBehaviour(latency_s=1.5))
    return provider


IDS = [f"q{i}" for i in range(12)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One all-good run, done once; tests resume from copies of what it left behind."""
    root = tmp_path_factory.mktemp("finished")
    src = write_lines(root / "in.jsonl", [good(i) for i in IDS])
    out = root / "out.jsonl"
    proc = cli("run", src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc.stderr)
    assert "12 results" in proc.stderr
    return src, out


@pytest.fixture
def resumed(finished_run: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the finished run's output (and whatever sits beside it)."""
    src, out = finished_run
    for path in out.parent.glob(out.name + "*"):
        shutil.copy2(path, tmp_path / path.name)
    return src, tmp_path / out.name


# -- one run ------------------------------------------------------------------------------


def test_good_and_bad_lines_each_get_one_line_and_bad_ones_name_their_line(
    tmp_path: Path,
) -> None:
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            good("g1"),  # line 1
            '{"id": "broken", "prompt": ',  # line 2: bad JSON
            good("g2"),  # line 3
            {"id": "empty", "prompt": "   "},  # line 4: empty prompt
            {"id": "ghost", "prompt": "hi", "model": "no-such-model"},  # line 5: unknown model
            {"id": "typo", "prompt": "hi", "colour": "red"},  # line 6: unknown key
            good("g3"),  # line 7
            {"id": "neg", "prompt": "hi", "max_tokens": -1},  # line 8: bad max_tokens
            {
                "custom_id": "oa1",
                "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            },  # line 9: OpenAI batch shape
        ],
    )
    out = tmp_path / "out.jsonl"
    proc = cli("run", src, "-o", out)
    assert proc.returncode == 1, proc.stderr
    assert_no_traceback(proc.stderr)

    by_id: dict[str, list[dict[str, Any]]] = {}
    for rec in records(out):
        by_id.setdefault(rec["id"], []).append(rec)
    assert set(by_id) == {"g1", "g2", "g3", "oa1", "line-2", "empty", "ghost", "typo", "neg"}
    assert all(len(recs) == 1 for recs in by_id.values()), by_id
    for ident in ("g1", "g2", "g3", "oa1"):
        (rec,) = by_id[ident]
        assert rec["ok"] is True
        assert rec["status"] == "completed"
        assert rec["text"]
    bad = {"line-2": 2, "empty": 4, "ghost": 5, "typo": 6, "neg": 8}
    for ident, number in bad.items():
        (rec,) = by_id[ident]
        assert rec["ok"] is False
        assert rec["status"] == "invalid"
        assert rec["error"]["line"] == number
        assert rec["error"]["detail"].startswith(f"line {number}: ")
        assert f"line {number}: " in proc.stderr
    assert "no-such-model" in by_id["ghost"][0]["error"]["detail"]
    assert "colour" in by_id["typo"][0]["error"]["detail"]


def test_an_all_good_file_exits_0_and_a_rerun_sends_nothing(
    resumed: tuple[Path, Path],
) -> None:
    src, out = resumed
    after_first = out.read_bytes()
    assert sorted(r["id"] for r in records(out)) == sorted(IDS)
    assert {r["status"] for r in records(out)} == {"completed"}

    again = cli("run", src, "-o", out)
    assert again.returncode == 0, again.stderr
    assert out.read_bytes() == after_first, "nothing was resent or rewritten"
    assert "12 already done, skipped" in again.stderr
    assert "0 results" in again.stderr


def test_a_missing_input_file_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    proc = cli("run", missing, "-o", tmp_path / "out.jsonl", timeout=WAIT_S)
    assert proc.returncode == 2
    assert "not found" in proc.stderr
    assert str(missing) in proc.stderr
    assert_no_traceback(proc.stderr)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_config_with_an_unknown_key_exits_2_naming_it(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = tmp_path / "callboard.toml"
    config.write_text(
        '[models.m]\nbase_url = "http://127.0.0.1:9/v1"\nmax_concurency = 4\n', encoding="utf-8"
    )
    proc = cli("run", src, "-o", tmp_path / "out.jsonl", "--config", config, timeout=WAIT_S)
    assert proc.returncode == 2
    assert "models.m.max_concurency" in proc.stderr
    assert_no_traceback(proc.stderr)


def test_one_config_file_serves_run_too_its_gateway_table_left_to_serve(
    tmp_path: Path, provider: SimulatedProvider
) -> None:
    """The configuration reference says ``[gateway]`` is ``callboard serve``'s alone,
    and the README gives one ``callboard.toml`` to both: ``run`` refused the file."""
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = tmp_path / "callboard.toml"
    config.write_text(
        f'[gateway]\ngrace_s = 5\n\n[models.m]\nbase_url = "{provider.base_url}"\n',
        encoding="utf-8",
    )
    out = tmp_path / "out.jsonl"
    proc = cli("-v", "run", src, "-o", out, "--config", config, timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr
    assert [r["status"] for r in records(out)] == ["completed"]
    assert load_config(str(config)).models[0].name == "m"  # a str path, as the docs show it


def test_run_takes_its_verbosity_after_the_command_as_the_docs_show_it(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    proc = cli("run", src, "-o", tmp_path / "out.jsonl", "-vv", timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr
    assert " DEBUG " in proc.stderr or "DEBUG" in proc.stderr


def test_a_ledger_and_no_ledger_at_once_is_a_usage_error(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    ledger = tmp_path / "x.db"
    proc = cli("run", src, "-o", tmp_path / "o.jsonl", "--ledger", ledger, "--no-ledger")
    assert proc.returncode == 2
    assert "not allowed with" in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()
    assert not ledger.exists()


def test_an_output_a_crash_left_two_lines_for_an_id_is_rewritten_by_the_next_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run killed after writing a replacing line, before its rewrite, left the old
    line too; every later run said 'done', exit 0, with two lines for that id (the
    first an old answer)."""
    src = write_lines(tmp_path / "in.jsonl", [good("a"), good("b")])
    out = tmp_path / "out.jsonl"
    assert here(capsys, "run", src, "-o", out, "--no-ledger").returncode == 0
    old = {**records(out)[0], "status": "failed", "content": "an old answer"}
    out.write_text(json.dumps(old) + "\n" + out.read_text(encoding="utf-8"), encoding="utf-8")
    proc = here(capsys, "run", src, "-o", out, "--no-ledger")
    assert proc.returncode == 0, proc.stderr
    kept = records(out)
    assert sorted(r["id"] for r in kept) == ["a", "b"]
    assert all(r["status"] == "completed" for r in kept)


@pytest.mark.parametrize(
    "first", [[{"prompt": "no id here"}], [good("a"), good("a")]], ids=["no-id", "duplicate-id"]
)
def test_a_lines_own_id_that_callboard_gave_a_line_without_one_is_said_so(
    tmp_path: Path, first: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The line callboard keyed ``line-N`` had no id, or one an earlier line has."""
    n = len(first)
    src = write_lines(tmp_path / "in.jsonl", [*first, good(f"line-{n}")])
    proc = here(capsys, "run", src, "-o", tmp_path / "out.jsonl", "--no-ledger")
    assert proc.returncode == 1
    errors = {r["id"]: r for r in records(tmp_path / "out.jsonl") if r["status"] == "invalid"}
    detail = errors[f"line-{n + 1}"]["error"]["detail"]
    assert detail == (
        f"line {n + 1}: duplicate id 'line-{n}' (callboard gave that id to line {n}, which has "
        "no usable id of its own; give this line another id)"
    )


def test_ctrl_c_before_the_feed_or_in_the_summary_ends_130_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while the output was read, the transport made or the summary printed
    ended in a traceback (four times in twelve tries); the feed's own stop was fine."""

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "cmd_run", interrupted)
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    assert main(["run", str(src), "-o", str(tmp_path / "out.jsonl")]) == Exit.INTERRUPTED
    err = capsys.readouterr().err
    assert "interrupted" in err
    assert_no_traceback(err)


def test_a_queue_smaller_than_the_window_holds_lines_back_instead_of_refusing_them(
    provider: SimulatedProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``[scheduler] capacity`` under ``--window``: the lines past the capacity were
    refused (``queue_full``) and written so, and a rerun skipped them as done, never
    sending them (found by a hunt). The window is the capacity at most."""
    src = write_lines(tmp_path / "in.jsonl", [good(f"r{i}") for i in range(40)])
    out = tmp_path / "out.jsonl"
    config = toml_config(tmp_path / "c.toml", provider.base_url)
    config.write_text(config.read_text() + "[scheduler]\ncapacity = 5\n", encoding="utf-8")
    code, err = run_inproc(capsys, src, "-o", out, "--config", config)
    assert code == 0, err
    assert Counter(r["status"] for r in records(out)) == {"completed": 40}


def test_a_bad_window_is_a_usage_error(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    proc = cli("run", src, "-o", tmp_path / "out.jsonl", "--window", "0", timeout=WAIT_S)
    assert proc.returncode == 2
    assert "--window" in proc.stderr


# -- resuming after a crash ----------------------------------------------------------------


@pytest.mark.parametrize(
    "tail",
    [lambda line: line[:25], lambda line: line[:3], lambda line: line[:1], lambda _: "\0" * 2000],
    ids=["mid-record", "3 bytes", "1 byte", "nul bytes"],
)
def test_a_torn_last_line_is_repaired_and_its_id_completed_on_rerun(
    resumed: tuple[Path, Path], tail: Callable[[str], str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A write can be cut at any byte (a full disk, a file size limit, a power cut,
    which on ext4 can leave NUL bytes): a tail of 1-5 bytes, shorter than the
    ``{"id":`` a record begins with, or of NULs, was taken for a file not ours and
    every rerun refused (exit 2; found by a hunt)."""
    src, out = resumed
    lines = out.read_text(encoding="utf-8").splitlines()
    torn_id = json.loads(lines[-1])["id"]
    out.write_text("\n".join(lines[:-1]) + "\n" + tail(lines[-1]), encoding="utf-8")

    proc = here(capsys, "run", src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    recs = records(out)  # every line parses: the torn fragment is gone
    assert Counter(r["id"] for r in recs) == Counter(IDS)
    assert all(r["status"] == "completed" for r in recs)
    assert json.loads(out.read_text(encoding="utf-8").splitlines()[-1])["id"] == torn_id


def test_a_torn_last_line_longer_than_the_tail_read_at_once_is_repaired(
    resumed: tuple[Path, Path],
) -> None:
    src, out = resumed
    lines = out.read_text(encoding="utf-8").splitlines()
    torn_id = json.loads(lines[-1])["id"]
    torn = json.dumps({"id": torn_id, "text": "x" * 3_000_000})[:2_500_000]  # > 2 MiB
    out.write_text("\n".join(lines[:-1]) + "\n" + torn, encoding="utf-8")

    proc = cli("run", src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    recs = records(out)
    assert Counter(r["id"] for r in recs) == Counter(IDS)


SIGNALLED_AT_THE_TIDY = """
import os, signal, sys
import callboard.cli as cli
tidy, sig = cli._tidy, getattr(signal, sys.argv.pop(1))
def tidy_signalled(*args, **kw):
    os.kill(os.getpid(), sig)
    return tidy(*args, **kw)
cli._tidy = tidy_signalled
sys.exit(cli.main(sys.argv[1:]))
"""
"""``callboard`` whose output's tidy-up first sends the process the signal named by
its first argument: a signal as the run ends."""


@pytest.mark.parametrize(("sig", "status"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_as_the_run_ends_is_an_interruption_said_not_a_silent_death(
    tmp_path: Path, provider: SimulatedProvider, sig: str, status: int
) -> None:
    """After the last result, the handlers were the process's own again: a SIGTERM
    killed it without a word (and could cut the output's rewrite short, leaving its
    ``.compacting`` file), found by a hunt. It is noted: the tidy-up ends, the summary
    is said, and the status is the signal's."""
    args, out = run_args(tmp_path, provider.base_url, [good("a"), good("b")])
    proc = subprocess.run(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-c", SIGNALLED_AT_THE_TIDY, sig, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == status, proc.stderr
    assert "2 results" in proc.stderr
    assert "interrupted as the run ended" in proc.stderr
    assert_no_traceback(proc.stderr)
    assert Counter(r["id"] for r in records(out)) == Counter(["a", "b"])
    assert not list(tmp_path.glob("*.compacting"))


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_an_output_removed_or_replaced_mid_run_is_not_reported_complete(
    tmp_path: Path, how: str
) -> None:
    """The run wrote on into the unlinked file and said "completed 2", exit 0, with
    the file at that name empty or missing (found by a hunt). It says what happened,
    exits 1, and the rerun writes the results from the ledger without sending them."""
    gate = Gate()
    with WireServer(gate.handler) as srv:
        args, out = run_args(tmp_path, srv.base_url, [good("a"), good("b")], "--window", "1")
        proc = start(args, tmp_path / "err.txt")
        try:
            assert wait_until(lambda: srv.count() == 1)
            gate.release()
            assert wait_until(lambda: lines_in(out) == 1 and srv.count() == 2)
            if how == "removed":
                out.unlink()
            else:
                out.rename(tmp_path / "elsewhere.jsonl")
                out.write_text("", encoding="utf-8")
            gate.release()
            code = finish(proc)
        finally:
            gate.release(2)
        err = (tmp_path / "err.txt").read_text(encoding="utf-8")
        assert code == 1, err
        assert f"{out} was removed or replaced while the run wrote to it" in err
        again = cli(*args)
        assert again.returncode == 0, again.stderr
        assert srv.count() == 2  # nothing sent again
    assert Counter(r["id"] for r in records(out)) == Counter(["a", "b"])


def test_a_complete_last_line_without_its_newline_is_not_lost(
    resumed: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = resumed
    out.write_bytes(out.read_bytes().rstrip(b"\n"))  # the crash hit between record and newline

    proc = here(capsys, "run", src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert Counter(r["id"] for r in records(out)) == Counter(IDS)


def test_recovery_keeps_line_ids_when_a_line_has_its_own_idempotency_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [{**good("q1"), "idempotency_key": "K1"}, good("q2")])
    out = tmp_path / "out.jsonl"
    assert here(capsys, "run", src, "-o", out).returncode == 0
    lines = out.read_text(encoding="utf-8").splitlines()
    keep = [line for line in lines if json.loads(line)["id"] != "q1"]
    torn = next(line for line in lines if json.loads(line)["id"] == "q1")[:20]
    out.write_text("\n".join(keep) + "\n" + torn, encoding="utf-8")

    proc = here(capsys, "run", src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert Counter(r["id"] for r in records(out)) == Counter(["q1", "q2"])


def test_sigint_exits_130_and_a_rerun_completes_every_id_exactly_once(tmp_path: Path) -> None:
    n = 1500  # at --window 50 the feed lasts seconds: the interrupt lands mid-feed
    src = write_lines(tmp_path / "in.jsonl", [good(f"r{i}") for i in range(n)])
    out = tmp_path / "out.jsonl"
    err_path = tmp_path / "stderr.txt"
    args = ["run", str(src), "-o", str(out), "--window", "50"]
    with err_path.open("w", encoding="utf-8") as err:
        proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
            [sys.executable, "-c", INTERRUPTIBLE, *args], stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            assert wait_until(lambda: has_line(out)), "no result appeared"
            proc.send_signal(signal.SIGINT)
            code = proc.wait(RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(WAIT_S)
    stderr = err_path.read_text(encoding="utf-8")
    assert code == 130, stderr
    assert "run the same command again to resume" in stderr
    assert_no_traceback(stderr)
    first = records(out)
    finished_first = {r["id"] for r in first if r["status"] != "cancelled"}
    assert 0 < len(finished_first) < n, "interrupted part-way"

    rerun = cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(finished_first)} already done, skipped" in rerun.stderr
    final = Counter(r["id"] for r in records(out) if r["status"] != "cancelled")
    assert set(final) == {f"r{i}" for i in range(n)}
    assert set(final.values()) == {1}, "no id has two results"
    assert {r["status"] for r in records(out)} <= {"completed", "cancelled"}


def test_an_interrupt_inside_submit_leaves_nothing_for_stop_and_drain_to_wait_on(
    provider: SimulatedProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``callboard run`` does on SIGINT (stop(cancel=True), then drain) when the signal
    lands inside ``submit``; in-process so the interrupt lands at that exact point."""
    system = System(SystemConfig(models=two_models(provider.base_url)))
    try:
        real_tell = system.book.tell

        def interrupted(name: str, message: Any) -> None:
            if name in ("router", "queue"):  # the front door telling them, inside submit
                raise KeyboardInterrupt
            real_tell(name, message)

        monkeypatch.setattr(system.book, "tell", interrupted)
        with pytest.raises(KeyboardInterrupt):
            system.submit("hi")
        monkeypatch.undo()
        started = time.monotonic()
        system.stop(cancel=True, timeout=1.0)
        stop_waited = time.monotonic() - started >= 0.75  # for a task that never arrived
        drained = system.drain(timeout=0.25)  # the CLI calls drain() with no timeout
        assert (stop_waited, drained) == (False, True)
    finally:
        system.stop(timeout=WAIT_S)


# -- --version and --help --------------------------------------------------------------------


def test_version_prints_the_installed_packages_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"callboard {importlib.metadata.version('callboard')}\n"


def test_help_lists_every_command_examples_and_exit_statuses_in_plain_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", "shell", "mock", "bench", "serve"):
        assert f"\n    {command} " in out, command  # one line each under "commands:"
    assert "``" not in out, "no raw reST markup"
    assert "--version" in out
    assert "callboard run examples/requests.jsonl -o results.jsonl" in out
    assert "exit status:" in out
    for code in (0, 1, 2, 130, 143):
        assert f"\n  {code} " in out, code


def test_run_help_lists_its_defaults_and_every_exit_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    for default in ("(default: 2000)", "(default: OUTPUT.ledger)", "simulated provider"):
        assert default in out, default
    assert "up to 30 s" in out
    assert "OUTPUT.lock" in out
    assert [int(code) for code in Exit] == [0, 1, 2, 130, 143]
    for code in Exit:
        assert f" {int(code)} " in out, code


# -- stopping early ---------------------------------------------------------------------------


def _budgeted_run(
    tmp_path: Path, provider: SimulatedProvider, n: int
) -> tuple[Path, str, Path, Path]:
    """``n`` lines; a model priced so that about 13 calls fit $0.50 (without its
    ``[budget]``, to write again for a rerun), the config with that budget, the output."""
    src = write_lines(tmp_path / "in.jsonl", [good(f"b{i}") for i in range(n)])
    model = f'[models.m]\nbase_url = "{provider.base_url}"\n'
    priced = model + 'price = { input = "1000", output = "1000" }\n'
    config = tmp_path / "budget.toml"
    config.write_text(priced + '[budget]\ntotal_usd = "0.5"\n', encoding="utf-8")
    return src, priced, config, tmp_path / "out.jsonl"


def test_a_spent_budget_stops_the_run_taking_lines_and_a_rerun_sends_the_rest(
    tmp_path: Path, provider: SimulatedProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    n = 300  # about 13 calls fit the budget; --window 4 keeps the rest unread by then
    src, priced, config, out = _budgeted_run(tmp_path, provider, n)
    args = ["run", src, "-o", out, "--window", "4"]

    proc = here(capsys, *args, "--config", config)
    assert proc.returncode == Exit.UNFINISHED, proc.stderr
    assert_no_traceback(proc.stderr)
    assert "stopped taking lines" in proc.stderr
    assert "budget is spent" in proc.stderr
    first = Counter(r["id"] for r in records(out))
    assert set(first.values()) == {1}
    assert 0 < len(first) < n, "the lines after the budget was spent got no line"
    assert {r["status"] for r in records(out)} <= {"completed", "failed"}

    config.write_text(priced, encoding="utf-8")  # no budget now
    rerun = here(capsys, *args, "--config", config)
    assert_no_traceback(rerun.stderr)
    final = records(out)
    assert Counter(r["id"] for r in final) == Counter(f"b{i}" for i in range(n))
    unsent = {f"b{i}" for i in range(n)} - set(first)
    assert all(r["status"] == "completed" for r in final if r["id"] in unsent)
    failed = [r for r in final if r["status"] != "completed"]  # refused by the budget: final
    assert all(r["error"]["reason"] == "budget_exceeded" for r in failed), failed[:1]
    assert rerun.returncode == (Exit.UNFINISHED if failed else Exit.COMPLETED), rerun.stderr


def test_lines_taken_before_the_budget_was_spent_are_left_for_the_rerun_not_failed(
    tmp_path: Path, provider: SimulatedProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default window takes all 50 lines at once: those the spent total refused
    were each written ``failed`` (budget_exceeded, final), where the docs promise
    they are left unsent for a rerun."""
    n = 50
    src, priced, config, out = _budgeted_run(tmp_path, provider, n)

    proc = here(capsys, "run", src, "-o", out, "--config", config)
    assert proc.returncode == Exit.UNFINISHED, proc.stderr
    first = records(out)
    assert 0 < len(first) < n
    summary = f"{len(first)} results in "  # what was written, the rest said apart
    assert summary in proc.stderr
    assert f"{n - len(first)} cancelled or left unsent, not written" in proc.stderr
    assert {r["status"] for r in first} == {"completed"}, [
        r for r in first if r["status"] != "completed"
    ][:1]

    config.write_text(priced, encoding="utf-8")  # no budget now
    rerun = here(capsys, "run", src, "-o", out, "--config", config)
    assert rerun.returncode == Exit.COMPLETED, rerun.stderr
    assert Counter(r["id"] for r in records(out)) == Counter(f"b{i}" for i in range(n))


# -- resuming after a signal ------------------------------------------------------------------


LINES = 1500


CONCURRENCY = 50


WINDOW = 200


def run_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(  # noqa: S603 - our own CLI, fixed arguments
        [sys.executable, "-m", "callboard", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_mid_batch_then_resume(
    provider_in_process: ProviderProcess, tmp_path: Path
) -> None:
    provider_in_process.configure("m", latency_s=0.05)
    base_url = provider_in_process.base_url
    config = toml_config(tmp_path / "callboard.toml", base_url, max_concurrency=str(CONCURRENCY))
    lines = [{"id": f"r{i}", "prompt": f"q{i}"} for i in range(LINES)]
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "results.jsonl"
    args = (str(requests), "-o", str(out), "--config", str(config), "--window", str(WINDOW))

    first = run_cli(*args)
    assert wait_until(lambda: lines_in(out) >= 300)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=WAIT_S)
    sent_before = provider_in_process.stats()["total"]["requests"]
    assert sent_before < LINES  # it really died mid-run

    second = run_cli(*args)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err

    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    ids = Counter(r["id"] for r in records)
    assert set(ids) == {f"r{i}" for i in range(LINES)}
    assert max(ids.values()) == 1, [i for i, n in ids.items() if n > 1][:5]
    assert all(r["ok"] for r in records)
    repeated = provider_in_process.stats()["total"]["requests"] - LINES
    # at-least-once towards the provider: only calls whose outcome was not yet
    # durable at the kill are sent again -- those in flight (at most the cap)
    # plus those finished but not yet committed; the run never has more than
    # its window of tasks unfinished, so that bounds the repeats
    assert 0 <= repeated <= WINDOW, repeated


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_a_killed_run_resumes_with_every_id_exactly_once(
    tmp_path: Path, sig: signal.Signals
) -> None:
    n = 200
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.04), seed=1) as p:
        lines = [good(f"k{i}") for i in range(n)]
        args, out = run_args(tmp_path, p.base_url, lines, "--window", "10")
        proc = start(args, tmp_path / "err1.txt")
        try:
            assert wait_until(lambda: has_line(out)), "no result appeared"
            proc.send_signal(sig)
        finally:
            code = finish(proc)
        # SIGTERM and SIGHUP stop the run as Ctrl-C does (exit 143); SIGKILL cannot be
        assert code == (-sig if sig == signal.SIGKILL else 143)  # handled
        before = {r["id"] for r in records(out)}  # every line parses: nothing torn
        assert 0 < len(before) < n, "killed part-way"

        p.reset_stats()
        rerun = cli(*args)
        assert rerun.returncode == 0, rerun.stderr
        assert final_counts(out) == Counter({f"k{i}": 1 for i in range(n)})
        assert requests_seen(p) <= n - len(before), "a finished id was sent again"


def test_sigint_while_draining_exits_130_cleanly_and_resumes(
    tmp_path: Path, slow: SimulatedProvider
) -> None:
    ids = ["d1", "d2", "d3"]
    args, out = run_args(tmp_path, slow.base_url, [good(i) for i in ids])
    err = tmp_path / "err.txt"
    proc = start(args, err)
    try:
        assert wait_until(lambda: in_flight(slow) == len(ids)), "calls never reached the wire"
        proc.send_signal(signal.SIGINT)  # every line is submitted: the CLI is in drain()
    finally:
        code = finish(proc)
    stderr = err.read_text(encoding="utf-8")
    rerun = cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert final_counts(out) == Counter(dict.fromkeys(ids, 1))
    assert code == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert "run the same command again to resume" in stderr


def ctrl_c_after(
    first: signal.Signals,
    hint: str,
    *,
    args: list[Any],
    tmp_path: Path,
    slow: SimulatedProvider,
    calls: int,
) -> tuple[int, str]:
    """Run ``args`` until its ``calls`` are on the wire, send it ``first`` and, once its
    standard error says ``hint``, a Ctrl-C while the calls (1.5 s) are still there: its
    exit code and standard error."""
    err = tmp_path / "err.txt"
    proc = start(args, err)
    try:
        assert wait_until(lambda: in_flight(slow) == calls), "calls never reached the wire"
        proc.send_signal(first)
        assert wait_until(lambda: hint in err.read_text(encoding="utf-8"))
        proc.send_signal(signal.SIGINT)
    finally:
        code = finish(proc)
    return code, err.read_text(encoding="utf-8")


def test_a_second_ctrl_c_stops_at_once_cleanly_and_the_rerun_finishes(
    tmp_path: Path, slow: SimulatedProvider
) -> None:
    ids = ["e1", "e2", "e3"]
    args, out = run_args(tmp_path, slow.base_url, [good(i) for i in ids])
    code, stderr = ctrl_c_after(
        signal.SIGINT, "Ctrl-C again", args=args, tmp_path=tmp_path, slow=slow, calls=len(ids)
    )
    assert code == 130, stderr
    assert "stopping at once" in stderr
    assert "Traceback" not in stderr, stderr
    assert "Exception in thread" not in stderr, stderr
    rerun = cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert final_counts(out) == Counter(dict.fromkeys(ids, 1))


def test_a_ctrl_c_after_a_sigterm_stops_at_once_as_its_hint_says(
    tmp_path: Path, slow: SimulatedProvider
) -> None:
    """After a SIGTERM the hint said a Ctrl-C would stop the run at once, and the run
    waited for every call in flight (found by a hunt)."""
    ids = ["f1", "f2", "f3"]
    args, _ = run_args(tmp_path, slow.base_url, [good(i) for i in ids])
    hint = "(Ctrl-C to stop at once)"
    code, stderr = ctrl_c_after(
        signal.SIGTERM, hint, args=args, tmp_path=tmp_path, slow=slow, calls=len(ids)
    )
    assert code == 143, stderr
    assert "stopping at once" in stderr, stderr
    assert "Traceback" not in stderr, stderr


def test_a_second_ctrl_c_noted_before_the_stop_began_still_stops_at_once(
    slow: SimulatedProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two Ctrl-C 2 ms apart were both noted before the stop began, the second was taken
    as seen, and the run waited for every call in flight (found by a hunt): the stop
    counts from the signal that began it."""
    model = ModelSettings(name="m", base_url=slow.base_url)
    interrupts = Interrupts()
    interrupts.first, interrupts.sigints, interrupts.count = signal.SIGINT, 2, 2
    with System(SystemConfig(models=(model,))) as cb:
        future = cb.submit("hi", model="m")
        assert wait_until(lambda: in_flight(slow) == 1)
        stop_waiting(cb, interrupts, hurry_after=1)
    assert "stopping at once" in capsys.readouterr().err
    result = future.result(WAIT_S)
    assert isinstance(result, Cancelled), "the call in flight (1.5 s) was not waited for"


def test_after_an_interrupt_and_a_rerun_each_id_has_exactly_one_line(
    tmp_path: Path, slow: SimulatedProvider
) -> None:
    ids = [f"s{i}" for i in range(6)]
    lines = [good(i) for i in ids]
    args, out = run_args(tmp_path, slow.base_url, lines, "--window", "3", max_concurrency="1")
    proc = start(args, tmp_path / "err.txt")
    try:  # one call on the wire, two queued behind it, the feed waiting for room
        assert wait_until(lambda: in_flight(slow) == 1 and ledger_rows(out) == 3)
        proc.send_signal(signal.SIGINT)
    finally:
        code = finish(proc)
    stderr = (tmp_path / "err.txt").read_text(encoding="utf-8")
    assert code == 130, stderr
    assert "cancelled" not in {r["status"] for r in records(out)}  # not written: they rerun
    # nor counted as failures in the table ("(none): count 2, failed 2"; a hunt)
    assert "(none)" not in stderr, stderr
    assert "2 cancelled or left unsent" in stderr, stderr
    slow.configure("m", ModelBehaviour(latency_s=0.005))
    rerun = cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert final_counts(out) == Counter(dict.fromkeys(ids, 1))
    assert Counter(r["id"] for r in records(out)) == Counter(dict.fromkeys(ids, 1))


def test_a_duplicate_id_error_does_not_mark_the_original_line_done(
    tmp_path: Path, slow: SimulatedProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    args, out = run_args(tmp_path, slow.base_url, [good("a"), good("a", "again")])
    proc = start(args, tmp_path / "err.txt")
    try:
        assert wait_until(lambda: has_line(out) and in_flight(slow) == 1)
        proc.kill()  # line 1 on the wire, line 2's duplicate error already written
    finally:
        finish(proc)
    slow.configure("m", ModelBehaviour(latency_s=0.005))
    rerun = here(capsys, *args)
    assert rerun.returncode == 1, rerun.stderr  # line 2 is still a duplicate
    statuses = [r["status"] for r in records(out) if r["id"] == "a"]
    assert "completed" in statuses, statuses


def test_two_runs_on_one_output_never_duplicate_results(
    tmp_path: Path, slow: SimulatedProvider
) -> None:
    ids = [f"c{i}" for i in range(10)]
    args, out = run_args(tmp_path, slow.base_url, [good(i) for i in ids])
    first = start(args, tmp_path / "err1.txt")
    try:
        assert wait_until(lambda: requests_seen(slow) == len(ids))
        second = cli(*args)
    finally:
        first_code = finish(first)
    assert first_code == 0
    if second.returncode == 0:  # allowed only if it did not duplicate anything
        assert requests_seen(slow) == len(ids), "the second run sent every id again"
    else:
        assert second.returncode == 2, second.stderr
    assert final_counts(out) == Counter(dict.fromkeys(ids, 1))


# -- the output file and its ledger -----------------------------------------------------------


def test_a_stale_ledger_does_not_put_other_inputs_results_in_the_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    first = write_lines(tmp_path / "a.jsonl", [good("a1"), good("a2")])
    assert run_inproc(capsys, first, "-o", out)[0] == 0
    out.unlink()  # start over with another input
    second = write_lines(tmp_path / "b.jsonl", [good("b1")])
    code, err = run_inproc(capsys, second, "-o", out)
    assert code == 0, err
    assert {r["id"] for r in records(out)} == {"b1"}


def test_output_equal_to_input_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a"), good("b")])
    before = src.read_bytes()
    code, err = run_inproc(capsys, src, "-o", src)
    assert src.read_bytes() == before
    assert code == 2, err


def test_a_foreign_output_file_is_never_truncated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    notes = tmp_path / "notes.txt"
    original = b"my notes\nthe last line, without a newline"
    notes.write_bytes(original)
    code, err = run_inproc(capsys, src, "-o", notes)
    assert notes.read_bytes().startswith(original), "the user's last line was cut"
    assert code in (0, 2), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "notes.txt"], (
        "nothing is created beside a file that is not ours"
    )


@pytest.mark.parametrize(
    "tail",
    [b'{"log_level": "debug"}', b'{"id": "a", "prompt": "x"}'],
    ids=["a-settings-file", "an-input-line"],
)
def test_an_output_ending_with_json_that_is_no_record_is_refused_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tail: bytes
) -> None:
    """A file ``json.dump`` wrote (one object, no newline) given as -o: its last line was
    taken for a record missing its newline, and results were appended under it, the
    file no longer JSON (found by a hunt on damaged files)."""
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    target = tmp_path / "settings.json"
    target.write_bytes(tail)
    code, err = run_inproc(capsys, src, "-o", target)
    assert code == 2, err
    assert "not a callboard result record" in err
    assert target.read_bytes() == tail
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "settings.json"], (
        "nothing is created beside a file that is not ours (its OUTPUT.lock was; a hunt)"
    )


def _binary_output(tmp_path: Path) -> list[Any]:
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(128, 256)) * 8 + b"\n")
    return ["-o", path]


def _directory_output(tmp_path: Path) -> list[Any]:
    (tmp_path / "adir").mkdir()
    return ["-o", tmp_path / "adir"]


def _missing_output_dir(tmp_path: Path) -> list[Any]:
    return ["-o", tmp_path / "no" / "such" / "out.jsonl"]


def _missing_ledger_dir(tmp_path: Path) -> list[Any]:
    return ["-o", tmp_path / "out.jsonl", "--ledger", tmp_path / "no" / "x.ledger"]


def _ledger_is_the_input(tmp_path: Path) -> list[Any]:
    return ["-o", tmp_path / "out.jsonl", "--ledger", tmp_path / "in.jsonl"]


def _ledger_is_the_output(tmp_path: Path) -> list[Any]:
    return ["-o", tmp_path / "out.jsonl", "--ledger", tmp_path / "out.jsonl"]


def _looped(tmp_path: Path, name: str) -> Path:
    """A symbolic link to a link to it: a path that names no file."""
    (tmp_path / f"{name}-b").symlink_to(tmp_path / name)
    (tmp_path / name).symlink_to(tmp_path / f"{name}-b")
    return tmp_path / name


def _looped_output(tmp_path: Path) -> list[Any]:
    return ["-o", _looped(tmp_path, "out.jsonl")]


def _looped_ledger(tmp_path: Path) -> list[Any]:
    return ["-o", tmp_path / "out.jsonl", "--ledger", _looped(tmp_path, "x.ledger")]


@pytest.mark.parametrize(
    "output",
    [
        _looped_output,
        _looped_ledger,
        _binary_output,
        _directory_output,
        _missing_output_dir,
        _missing_ledger_dir,
        _ledger_is_the_input,
        _ledger_is_the_output,
    ],
    ids=[
        "output-a-link-loop",
        "ledger-a-link-loop",
        "non-utf8-output",
        "output-is-a-directory",
        "output-dir-missing",
        "ledger-dir-missing",
        "ledger-is-the-input",
        "ledger-is-the-output",
    ],
)
def test_an_unusable_output_or_ledger_is_a_usage_error(
    tmp_path: Path, output: Callable[[Path], list[Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    before = src.read_bytes()
    code, err = run_inproc(capsys, src, *output(tmp_path))
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith("callboard: error: ")
    assert src.read_bytes() == before


# -- exit status, reruns and --help -----------------------------------------------------------


def test_a_rerun_of_a_run_with_failures_does_not_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a"), {"id": "bad", "prompt": "  "}])
    out = tmp_path / "out.jsonl"
    assert run_inproc(capsys, src, "-o", out)[0] == 1
    code, err = run_inproc(capsys, src, "-o", out)
    assert "1 already done, skipped" in err  # the invalid line is checked again, not resent
    assert code == 1, err


def test_a_line_made_invalid_after_its_result_is_reported_and_its_result_stands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was skipped as "already done", without a word, and the run exited 0."""
    src = write_lines(tmp_path / "in.jsonl", [good("x"), good("y")])
    out = tmp_path / "out.jsonl"
    assert run_inproc(capsys, src, "-o", out)[0] == 0
    kept = out.read_bytes()
    write_lines(src, [{"id": "x", "promt": "a"}, good("y")])  # x broken by an edit
    code, err = run_inproc(capsys, src, "-o", out)
    assert code == 1, err
    assert "line 1: unknown keys ['promt']" in err
    assert "the result its id 'x' has from an earlier run stands" in err
    assert out.read_bytes() == kept


def test_a_fixed_invalid_line_runs_on_rerun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a"), {"id": "b", "prompt": "  "}])
    out = tmp_path / "out.jsonl"
    assert run_inproc(capsys, src, "-o", out)[0] == 1
    write_lines(src, [good("a"), good("b")])  # fixed
    code, err = run_inproc(capsys, src, "-o", out)
    assert code == 0, err
    assert [r["status"] for r in records(out) if r["id"] == "b"][-1] == "completed"


def test_stdout_stays_empty_and_the_readme_example_runs(tmp_path: Path) -> None:
    example = Path(__file__).parents[2] / "examples" / "requests.jsonl"
    ids = [json.loads(line)["id"] for line in example.read_text().splitlines() if line.strip()]
    out = tmp_path / "results.jsonl"
    proc = cli("run", example, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert final_counts(out) == Counter(dict.fromkeys(ids, 1))
    assert (tmp_path / "results.jsonl.ledger").exists(), "README: a ledger beside the output"
    assert f"{len(ids)} results" in proc.stderr


def test_with_stderr_closed_the_results_on_stdout_are_results_only(tmp_path: Path) -> None:
    """``callboard run IN -o - 2>&-``: with no stderr (``sys.stderr`` None),
    ``print(..., file=sys.stderr)`` printed to stdout, and the notice, each bad line's
    error and the summary went into the results (found by a hunt). What would go to
    stderr goes nowhere; stdout holds one result line per id."""
    src = write_lines(tmp_path / "in.jsonl", [good("a"), good("b"), {"id": "c"}])
    command = [sys.executable, "-m", "callboard", "run", str(src), "-o", "-"]
    proc = subprocess.run(  # noqa: S603 - our own module, fixed arguments
        ["sh", "-c", 'exec "$@" 2>&-', "sh", *command],  # noqa: S607 - the shell
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 1, "line c is invalid"
    lines = proc.stdout.splitlines()
    assert [x for x in lines if not x.startswith("{")] == []
    assert sorted((r["id"], r["status"]) for r in map(json.loads, lines)) == [
        ("a", "completed"),
        ("b", "completed"),
        ("c", "invalid"),
    ]


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["--help"], 0, "run"),
        (["run", "--help"], 0, "--no-ledger"),
        (["mock", "--help"], 0, "--port"),
        (["serve", "--help"], 0, "--port"),
        (["serve", "--host", "0.0.0.0"], 2, "loopback"),
        ([], 2, "usage"),
        (["run", "in.jsonl"], 2, "-o/--output"),
        (["run", "in.jsonl", "-o", "x", "--window", "many"], 2, "--window"),
        (["frobnicate"], 2, "invalid choice"),
    ],
)
def test_help_and_usage_errors(
    argv: list[str], code: int, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # in this process (the parser is all they reach; the other tests here start
    # ``python -m callboard`` itself)
    try:
        returned: object = main(argv)
    except SystemExit as exc:
        returned = exc.code or 0
    out, err = capsys.readouterr()
    assert returned == code, err
    assert needle in out + err
    assert "Traceback" not in err
    if argv == ["run", "--help"]:
        for flag in ("--output", "--config", "--window", "--ledger"):
            assert flag in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-v", "bench", "--scenarios", "nope"], "unknown scenario"),
        (["-v", "mock", "--host", "0.0.0.0"], "loopback only"),
    ],
)
def test_the_verbose_flag_before_bench_or_mock_reaches_their_parsers(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert needle in err, err


def test_the_verbose_flags_before_serve_are_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``callboard serve`` sets its logging up at every verbosity (its warnings in the
    log's layout); ``callboard -vv serve`` is ``serve -vv``, not undone by it."""
    import callboard.gateway

    handed: list[list[str]] = []
    monkeypatch.setattr(callboard.gateway, "main", lambda argv: handed.append(list(argv)) or 0)
    assert main(["-vv", "serve", "--port", "0"]) == 0
    assert main(["serve", "--port", "0"]) == 0
    assert handed == [["-v", "-v", "--port", "0"], ["--port", "0"]]


@pytest.mark.parametrize("port", ["65536", "73616", "-1", "http"])
def test_serve_refuses_a_port_out_of_range_instead_of_binding_another(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--port 73616`` listened on 8080 (the kernel takes the port modulo 65536) and
    65536 on any port, in silence."""
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", port])
    assert exc.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_the_verbose_flag_before_a_bad_mock_port_is_still_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["-vv", "mock", "--port", "70000"])
    assert exc.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_every_subcommand_of_the_top_parser_has_a_func() -> None:
    parser = _parser()  # main() hands these off before parsing; the parser still works
    for argv in (["bench"], ["shell"], ["mock"]):
        assert callable(parser.parse_args(argv).func), argv


# -- bad input lines --------------------------------------------------------------------------


def test_every_bad_line_gets_one_typed_error_naming_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines: list[Any] = [
        good("g1"),  # 1
        "",  # 2 blank: skipped
        "   \t",  # 3 whitespace only: skipped
        '{"id": "torn", "prompt": "hi"',  # 4
        "[1, 2]",  # 5 not an object
        b'{"id": "latin", "prompt": "caf\xe9"}',  # 6 not UTF-8
        {"id": "noprompt", "max_tokens": 8},  # 7
        {"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},  # 8
        {"id": "mt", "prompt": "x", "max_tokens": "8"},  # 9
        {"id": "prio", "prompt": "x", "priority": "urgent"},  # 10
        {"id": "prio7", "prompt": "x", "priority": 7},  # 11
        {"id": "ghost", "prompt": "x", "model": "gpt-99"},  # 12
        good("g1"),  # 13 duplicate id
        {"id": None, "prompt": "x"},  # 14
        {"id": 1.5, "prompt": "x"},  # 15
        {"id": "role", "messages": [{"role": "wizard", "content": "x"}]},  # 16
        {"id": "route", "prompt": "x", "route": "warp"},  # 17
        {"id": "meta", "prompt": "x", "metadata": "not a map"},  # 18
        '{"id": "deep", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",  # 19
        {"id": "g2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},  # 20
        {"id": "huge", "prompt": "word " * 300_000, "max_tokens": 4},  # 21 a 1.5 MB line
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    code, err = run_inproc(capsys, src, "-o", out)
    assert code == 1, err
    assert "Traceback" not in err
    recs = records(out)
    by_line = {r["error"]["line"]: r for r in recs if r["status"] == "invalid"}
    expect = {
        4: "not valid JSON",
        5: "expected a JSON object",
        6: "not UTF-8",
        7: "exactly one of 'prompt' or 'messages'",
        8: "exactly one of 'prompt' or 'messages'",
        9: "max_tokens",
        10: "priority",
        11: "priority",
        12: "gpt-99",
        13: "duplicate id 'g1'",
        14: "id must be",
        15: "id must be",
        16: "role",
        17: "warp",
        18: "metadata",
        19: "nested too deeply",
    }
    assert sorted(by_line) == sorted(expect)
    for number, needle in expect.items():
        detail = by_line[number]["error"]["detail"]
        assert detail.startswith(f"line {number}: "), detail
        assert needle in detail, detail
        assert by_line[number]["error"]["type"] == "InvalidRequest"
        assert f"callboard: line {number}: " in err
    ok = {r["id"]: r for r in recs if r["status"] == "completed"}
    assert set(ok) == {"g1", "g2"}
    (huge,) = [r for r in recs if r["id"] == "huge"]
    assert huge["status"] == "failed"
    assert huge["error"]["reason"] == "no_route", "too big for every context window"
    assert len(recs) == len(expect) + 3, "one line per non-blank input line"


def test_boolean_numbers_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "t", "prompt": "x", "max_tokens": 4, "temperature": True},
            {"id": "d", "prompt": "x", "max_tokens": 4, "deadline_s": True},
        ],
    )
    out = tmp_path / "out.jsonl"
    run_inproc(capsys, src, "-o", out)
    status = {r["id"]: r["status"] for r in records(out)}
    assert status == {"t": "invalid", "d": "invalid"}


def test_openai_batch_body_fields_pass_through_and_an_unknown_one_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    msg = [{"role": "user", "content": "give me JSON"}]
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            {
                "custom_id": "rf",
                "body": {"messages": msg, "response_format": {"type": "json_object"}},
            },
            {"custom_id": "stop", "body": {"messages": msg, "stop": ["\n"], "seed": 7}},
            {"id": "name", "messages": [{"role": "user", "content": "hi", "name": "bob"}]},
            {"custom_id": "odd", "body": {"messages": msg, "frobnicate": 1}},
        ],
    )
    out = tmp_path / "out.jsonl"
    run_inproc(capsys, src, "-o", out)
    status = {r["id"]: r["status"] for r in records(out)}
    assert status == {"rf": "completed", "stop": "completed", "name": "completed", "odd": "invalid"}
    (odd,) = [r for r in records(out) if r["id"] == "odd"]
    assert "frobnicate" in odd["error"]["detail"]


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("[models.m\n", "not valid TOML"),
        ('[models.m]\nbase_url = "http://127.0.0.1:9/v1"\nrmp = 5\n', "models.m.rmp"),
        ('[models.m]\nbase_url = "http://127.0.0.1:9/v1"\nrpm = "500"\n', "rpm"),
        ('[models.m]\nbase_url = "http://127.0.0.1:9/v1"\ntiers = "fast"\n', "models.m.tiers"),
        ('[models.m]\nbase_url = "http://127.0.0.1:9/v1"\nretry = 3\n', "models.m.retry"),
        ('[models.m]\nbase_url = "ftp://x/v1"\n', "base_url"),
        ('[models.m]\nbase_url = "http://x/v1"\napi_key = "sk-hunt-infile"\n', "api_key_env"),
        ('[models.m]\nbase_url = "http://x/v1"\napi_key_env = "HUNT_UNSET"\n', "HUNT_UNSET"),
        ('[models.m]\nbase_url = "http://x/v1"\n[scheduler]\ncapacity = -1\n', "capacity"),
        ('[models.m]\nbase_url = "http://x/v1"\n[budget]\ntotal_usd = "lots"\n', "total_usd"),
        ('[models.m]\nbase_url = "http://x/v1"\n[routing]\ndefault = "nope"\n', "nope"),
        ('switch_interval_s = "fast"\n', "switch_interval_s"),
    ],
)
def test_a_bad_config_exits_2_naming_the_key_and_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, needle: str
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = tmp_path / "c.toml"
    config.write_text(body, encoding="utf-8")
    out = tmp_path / "out.jsonl"
    code, err = run_inproc(capsys, src, "-o", out, "--config", config)
    assert code == 2, err
    assert err.startswith("callboard: error: ")
    assert needle in err
    assert "sk-hunt-infile" not in err
    assert not out.exists()
    assert not (tmp_path / "out.jsonl.ledger").exists()


def test_a_bad_routing_order_is_a_config_error(tmp_path: Path, provider: SimulatedProvider) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = toml_config(tmp_path / "c.toml", provider.base_url)
    config.write_text(config.read_text() + '[routing]\norder = "bogus"\n', encoding="utf-8")
    proc = cli("run", src, "-o", tmp_path / "out.jsonl", "--config", config)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "routing.order" in proc.stderr


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ('[budget]\ntotal_usd = "1"\ndowngrade_when_tight = "false"\n', "downgrade_when_tight"),
        ('[budget]\nstop_when_spent = "no"\n', "stop_when_spent"),
        ("provider_model = 5\n", "provider_model"),
    ],
)
def test_wrong_types_in_the_config_are_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    provider: SimulatedProvider,
    extra: str,
    key: str,
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = tmp_path / "c.toml"
    head = f'[models.m]\nbase_url = "{provider.base_url}"\nretry = {{ max_attempts = 1 }}\n'
    config.write_text(head + extra, encoding="utf-8")
    code, err = run_inproc(capsys, src, "-o", tmp_path / "out.jsonl", "--config", config)
    assert code == 2, err
    assert key in err


def test_a_config_without_models_does_not_silently_use_the_simulator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = tmp_path / "c.toml"
    config.write_text("[models]\n[scheduler]\ncapacity = 100\n", encoding="utf-8")
    code, err = run_inproc(capsys, src, "-o", tmp_path / "out.jsonl", "--config", config)
    assert code == 2, err
    assert "models" in err


# -- secrets ----------------------------------------------------------------------------------


SECRET = "sk-hunt-0123456789abcdefghijKLMNOPQRSTUV"  # noqa: S105 - a fake key to look for


def _leaks(tmp_path: Path, *texts: str) -> list[str]:
    """Where the secret, or any 12-character piece of it, appears."""
    pieces = {SECRET[i : i + 12] for i in range(len(SECRET) - 11)}
    found = [f"text[{i}]" for i, t in enumerate(texts) if any(p in t for p in pieces)]
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.suffix != ".toml":
            data = path.read_bytes()
            if any(p.encode() in data for p in pieces):
                found.append(path.name)
    return found


def test_a_rejected_key_never_reaches_logs_results_or_ledger(tmp_path: Path) -> None:
    with SimulatedProvider(api_key="the-right-key") as p:
        src = write_lines(tmp_path / "in.jsonl", [good("a")])
        config = toml_config(
            tmp_path / "c.toml",
            p.base_url,
            api_key_env='"HUNT_KEY"',
            retry="{ max_attempts = 1 }",
        )
        out = tmp_path / "out.jsonl"
        proc = cli("-vv", "run", src, "-o", out, "--config", config, env={"HUNT_KEY": SECRET})
    assert proc.returncode == 1, proc.stderr
    (rec,) = records(out)
    assert rec["error"]["status_code"] == 401
    assert _leaks(tmp_path, proc.stdout, proc.stderr) == []


def test_an_api_key_with_a_stray_newline_never_leaks(
    tmp_path: Path, provider: SimulatedProvider
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = toml_config(
        tmp_path / "c.toml",
        provider.base_url,
        api_key_env='"HUNT_KEY"',
        transport='"httpx"',
        retry="{ max_attempts = 1 }",
    )
    out = tmp_path / "out.jsonl"
    proc = cli("run", src, "-o", out, "--config", config, env={"HUNT_KEY": SECRET + "\r"})
    assert _leaks(tmp_path, proc.stdout, proc.stderr) == []
    assert proc.returncode == 2, "a key that can never be sent is a config error"


class _EchoAuthHandler(http.server.BaseHTTPRequestHandler):
    """Answers 400 with a body that quotes the Authorization header 276 characters in,
    as some proxies and self-hosted servers do in their error messages."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        body = ("E" * 270 + " got: " + self.headers.get("authorization", "")).encode()
        self.send_response(400)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass


@pytest.fixture
def echo_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EchoAuthHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(WAIT_S)


def test_a_key_echoed_near_the_detail_limit_is_still_redacted(
    tmp_path: Path, echo_server: str
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = toml_config(
        tmp_path / "c.toml", echo_server, api_key_env='"HUNT_KEY"', retry="{ max_attempts = 1 }"
    )
    out = tmp_path / "out.jsonl"
    proc = cli("run", src, "-o", out, "--config", config, env={"HUNT_KEY": SECRET})
    assert proc.returncode == 1, proc.stderr
    (rec,) = records(out)
    assert rec["error"]["status_code"] == 400
    assert _leaks(tmp_path, proc.stdout, proc.stderr) == []


def test_ctrl_c_in_a_handed_off_command_is_an_interruption_said_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``callboard bench`` interrupted printed KeyboardInterrupt's traceback (found by a
    hunt): it says so in a line and ends 130, as ``callboard run`` does."""
    from callboard.bench import harness

    def interrupted(argv: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "main", interrupted)
    assert main(["bench", "--quick"]) == 130
    err = capsys.readouterr().err
    assert "callboard: interrupted" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", ["m", "gpt-4.1", "claude 3", 'a"b'])
def test_the_unpriced_hint_names_the_models_table_as_toml_reads_it(name: str) -> None:
    """``[models.gpt-4.1]`` names a table ``1`` in ``models.gpt-4`` (found by a hunt)."""
    read = tomllib.loads(f'[models.{cli_module._toml_key(name)}]\nprice = "x"\n')
    assert read == {"models": {name: {"price": "x"}}}


def test_a_run_the_thread_limit_stops_says_so_without_a_traceback(tmp_path: Path) -> None:
    """At a process's limit of threads (a container's pids limit) or of address space
    (each thread reserves its stack), a run ended in a traceback saying only "can't
    start new thread" (found by a hunt). Here the address space is cut to 400 MB, which
    a system's threads need more than, on most hosts."""
    src = write_lines(tmp_path / "in.jsonl", [good(f"q{i}") for i in range(5)])
    limited = (
        "import resource, runpy, sys; "
        "resource.setrlimit(resource.RLIMIT_AS, (400 * 2**20, resource.RLIM_INFINITY)); "
        "sys.argv[0] = 'callboard'; runpy.run_module('callboard', run_name='__main__')"
    )
    proc = subprocess.run(  # noqa: S603 - this interpreter, our own module
        [sys.executable, "-c", limited, "run", str(src), "-o", str(tmp_path / "out.jsonl")],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert_no_traceback(proc.stderr)
    if proc.returncode != 0:  # (a host whose threads fit in it runs the file whole)
        assert proc.returncode == Exit.UNFINISHED, proc.stderr
        assert "cannot start a thread" in proc.stderr
