"""Bug hunt on ``callboard run``: resuming after SIGINT/SIGTERM/SIGKILL, two runs on one
output, output files that are not ours, bad input lines, bad configs, secrets, exit codes
and ``--help``. Everything runs on real parts: the CLI in-process (``main``) or as a
subprocess, against the embedded simulated provider or a ``SimulatedProvider`` on loopback.

Each test marked ``xfail(strict=True)`` exposes a bug; its reason names the cause."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import INTERRUPTIBLE, cli

from callboard.cli import main

RUN_TIMEOUT_S = 60.0
WAIT_S = 20.0


# -- helpers ---------------------------------------------------------------------------------


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


def run_inproc(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str]:
    code = main(["run", *map(str, args)])
    return code, capsys.readouterr().err


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Poll a condition another process or thread makes true (no event crosses processes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def write_lines(path: Path, lines: list[Any]) -> Path:
    """Dicts are dumped as JSON, str written as is, bytes written raw."""
    data = b"".join(
        (x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode())
        + b"\n"
        for x in lines
    )
    path.write_bytes(data)
    return path


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def good(ident: str, prompt: str = "say something") -> dict[str, Any]:
    return {"id": ident, "prompt": f"{prompt} about {ident}", "max_tokens": 8}


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


def requests_seen(provider: SimulatedProvider) -> int:
    return int(provider.stats()["total"]["requests"])


def toml_config(path: Path, base_url: str, **model: str) -> Path:
    """One model ``m`` on ``base_url``; extra keys as raw TOML values."""
    extra = "".join(f"{k} = {v}\n" for k, v in model.items())
    path.write_text(f'[models.m]\nbase_url = "{base_url}"\n{extra}', encoding="utf-8")
    return path


@pytest.fixture
def slow() -> Iterator[SimulatedProvider]:
    """A provider whose calls take a while, so a signal lands with calls on the wire."""
    with SimulatedProvider(default=ModelBehaviour(latency_s=1.5), seed=3) as p:
        yield p


@pytest.fixture
def quick() -> Iterator[SimulatedProvider]:
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.005), seed=3) as p:
        yield p


# -- resuming after a signal -----------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_run_resumes_with_every_id_exactly_once(
    tmp_path: Path, sig: signal.Signals
) -> None:
    n = 200
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.04), seed=1) as p:
        src = write_lines(tmp_path / "in.jsonl", [good(f"k{i}") for i in range(n)])
        out = tmp_path / "out.jsonl"
        config = toml_config(tmp_path / "c.toml", p.base_url)
        args = ["run", src, "-o", out, "--config", config, "--window", "10"]
        proc = start(args, tmp_path / "err1.txt")
        try:
            assert wait_until(lambda: has_line(out)), "no result appeared"
            proc.send_signal(sig)
        finally:
            code = finish(proc)
        # SIGTERM stops the run as Ctrl-C does (exit 143); SIGKILL cannot be handled
        assert code == (143 if sig == signal.SIGTERM else -sig)
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
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in ids])
    out = tmp_path / "out.jsonl"
    args = ["run", src, "-o", out, "--config", toml_config(tmp_path / "c.toml", slow.base_url)]
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


def test_a_second_ctrl_c_stops_at_once_cleanly_and_the_rerun_finishes(
    tmp_path: Path, slow: SimulatedProvider
) -> None:
    ids = ["e1", "e2", "e3"]
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in ids])
    out = tmp_path / "out.jsonl"
    args = ["run", src, "-o", out, "--config", toml_config(tmp_path / "c.toml", slow.base_url)]
    err = tmp_path / "err.txt"
    proc = start(args, err)
    try:
        assert wait_until(lambda: in_flight(slow) == len(ids)), "calls never reached the wire"
        proc.send_signal(signal.SIGINT)
        assert wait_until(lambda: "Ctrl-C again" in err.read_text(encoding="utf-8"))
        proc.send_signal(signal.SIGINT)  # the calls (1.5 s) are still on the wire
    finally:
        code = finish(proc)
    stderr = err.read_text(encoding="utf-8")
    assert code == 130, stderr
    assert "stopping at once" in stderr
    assert "Traceback" not in stderr, stderr
    assert "Exception in thread" not in stderr, stderr
    rerun = cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert final_counts(out) == Counter(dict.fromkeys(ids, 1))


def test_after_an_interrupt_and_a_rerun_each_id_has_exactly_one_line(
    tmp_path: Path, slow: SimulatedProvider
) -> None:
    ids = [f"s{i}" for i in range(6)]
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in ids])
    out = tmp_path / "out.jsonl"
    config = toml_config(tmp_path / "c.toml", slow.base_url, max_concurrency="1")
    args = ["run", src, "-o", out, "--config", config, "--window", "3"]
    proc = start(args, tmp_path / "err.txt")
    try:  # one call on the wire, two queued behind it, the feed waiting for room
        assert wait_until(lambda: in_flight(slow) == 1 and ledger_rows(out) == 3)
        proc.send_signal(signal.SIGINT)
    finally:
        code = finish(proc)
    assert code == 130, (tmp_path / "err.txt").read_text()
    assert "cancelled" not in {r["status"] for r in records(out)}  # not written: they rerun
    slow.configure("m", ModelBehaviour(latency_s=0.005))
    rerun = cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert final_counts(out) == Counter(dict.fromkeys(ids, 1))
    assert Counter(r["id"] for r in records(out)) == Counter(dict.fromkeys(ids, 1))


def test_a_duplicate_id_error_does_not_mark_the_original_line_done(
    tmp_path: Path, slow: SimulatedProvider
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a"), good("a", "again")])
    out = tmp_path / "out.jsonl"
    args = ["run", src, "-o", out, "--config", toml_config(tmp_path / "c.toml", slow.base_url)]
    proc = start(args, tmp_path / "err.txt")
    try:
        assert wait_until(lambda: has_line(out) and in_flight(slow) == 1)
        proc.kill()  # line 1 on the wire, line 2's duplicate error already written
    finally:
        finish(proc)
    slow.configure("m", ModelBehaviour(latency_s=0.005))
    rerun = cli(*args)
    assert rerun.returncode == 1, rerun.stderr  # line 2 is still a duplicate
    statuses = [r["status"] for r in records(out) if r["id"] == "a"]
    assert "completed" in statuses, statuses


def test_two_runs_on_one_output_never_duplicate_results(
    tmp_path: Path, slow: SimulatedProvider
) -> None:
    ids = [f"c{i}" for i in range(10)]
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in ids])
    out = tmp_path / "out.jsonl"
    args = ["run", src, "-o", out, "--config", toml_config(tmp_path / "c.toml", slow.base_url)]
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


# -- the output file and its ledger ------------------------------------------------------------


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


@pytest.mark.parametrize(
    "output",
    [_binary_output, _directory_output, _missing_output_dir, _missing_ledger_dir],
    ids=["non-utf8-output", "output-is-a-directory", "output-dir-missing", "ledger-dir-missing"],
)
def test_an_unusable_output_or_ledger_is_a_usage_error(
    tmp_path: Path, output: Callable[[Path], list[Any]]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    proc = cli("run", src, *output(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("callboard: error: ")


# -- exit status and reruns ------------------------------------------------------------------


def test_a_rerun_of_a_run_with_failures_does_not_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a"), {"id": "bad", "prompt": "  "}])
    out = tmp_path / "out.jsonl"
    assert run_inproc(capsys, src, "-o", out)[0] == 1
    code, err = run_inproc(capsys, src, "-o", out)
    assert "1 already done, skipped" in err  # the invalid line is checked again, not resent
    assert code == 1, err


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


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["--help"], 0, "run"),
        (["run", "--help"], 0, "--no-ledger"),
        (["mock", "--help"], 0, "--port"),
        ([], 2, "usage"),
        (["run", "in.jsonl"], 2, "-o/--output"),
        (["run", "in.jsonl", "-o", "x", "--window", "many"], 2, "--window"),
        (["frobnicate"], 2, "invalid choice"),
    ],
)
def test_help_and_usage_errors(argv: list[str], code: int, needle: str) -> None:
    proc = cli(*argv, timeout=WAIT_S)
    assert proc.returncode == code, proc.stderr
    assert needle in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    if argv == ["run", "--help"]:
        for flag in ("--output", "--config", "--window", "--ledger"):
            assert flag in proc.stdout


# -- bad input lines -------------------------------------------------------------------------


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


def test_openai_batch_fields_are_never_silently_dropped(
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
            {"custom_id": "stop", "body": {"messages": msg, "stop": ["\n"], "max_tokens": 4}},
            {"id": "name", "messages": [{"role": "user", "content": "hi", "name": "bob"}]},
        ],
    )
    out = tmp_path / "out.jsonl"
    run_inproc(capsys, src, "-o", out)
    for rec in records(out):
        assert rec["status"] == "invalid", rec
        assert rec["id"] in ("rf", "stop", "name")
    details = " ".join(r["error"]["detail"] for r in records(out))
    for key in ("response_format", "stop", "name"):
        assert key in details


# -- configuration -----------------------------------------------------------------------------


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


def test_a_bad_routing_order_is_a_config_error(tmp_path: Path, quick: SimulatedProvider) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = toml_config(tmp_path / "c.toml", quick.base_url)
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
    quick: SimulatedProvider,
    extra: str,
    key: str,
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = tmp_path / "c.toml"
    head = f'[models.m]\nbase_url = "{quick.base_url}"\nretry = {{ max_attempts = 1 }}\n'
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


# -- secrets ---------------------------------------------------------------------------------

SECRET = "sk-hunt-0123456789abcdefghijKLMNOPQRSTUV"  # noqa: S105 - a fake key to hunt for


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
    tmp_path: Path, quick: SimulatedProvider
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good("a")])
    config = toml_config(
        tmp_path / "c.toml",
        quick.base_url,
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


def test_the_redactor_hides_a_key_quoted_as_a_repr_or_bytes_repr() -> None:
    from callboard.core.settings import Secret
    from callboard.runtime.http import Redactor

    # ModelSettings refuses such a key now (ConfigError); the redactor, the last line
    # of defence, still hides one that came some other way
    key = SECRET + "\r"
    redact = Redactor(types.SimpleNamespace(api_key=Secret(key), proxy=None))  # type: ignore[arg-type]
    for text in (
        f"raw {key} end",
        f"Illegal header value b'Bearer {key.encode()!r}'",
        f"repr {key!r}",
        "E" * 290 + key,
    ):
        assert SECRET[:8] not in redact(text), text
