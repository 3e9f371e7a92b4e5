"""``callboard run`` and ``callboard mock`` as real subprocesses, on the embedded simulated
provider: results and errors per line, exit codes, resuming, repair, interruption."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from callboard.provider.server import SimulatedProvider
from support import INTERRUPTIBLE, WAIT_S, cli, two_models

from callboard import System, SystemConfig
from callboard.cli import Exit, main

RUN_TIMEOUT_S = 90.0
"""Upper bound for one ``callboard run`` (a few seconds normally)."""


def write_requests(path: Path, lines: list[Any]) -> Path:
    """Objects are dumped as JSON; strings are written as they are (malformed lines)."""
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    path.write_text(text, encoding="utf-8")
    return path


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def good(ident: str) -> dict[str, Any]:
    return {"id": ident, "prompt": f"say something about {ident}", "max_tokens": 8}


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll ``condition`` (a file another process writes) until true or the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)  # polling a file: there is no event to wait on across processes
    return condition()


def has_a_complete_line(path: Path) -> bool:
    return path.exists() and b"\n" in path.read_bytes()


def assert_no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr


IDS = [f"q{i}" for i in range(12)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One all-good run, done once; tests resume from copies of what it left behind."""
    root = tmp_path_factory.mktemp("finished")
    src = write_requests(root / "in.jsonl", [good(i) for i in IDS])
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
    src = write_requests(
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
    src = write_requests(tmp_path / "in.jsonl", [good("a")])
    config = tmp_path / "callboard.toml"
    config.write_text(
        '[models.m]\nbase_url = "http://127.0.0.1:9/v1"\nmax_concurency = 4\n', encoding="utf-8"
    )
    proc = cli("run", src, "-o", tmp_path / "out.jsonl", "--config", config, timeout=WAIT_S)
    assert proc.returncode == 2
    assert "models.m.max_concurency" in proc.stderr
    assert_no_traceback(proc.stderr)


def test_a_bad_window_is_a_usage_error(tmp_path: Path) -> None:
    src = write_requests(tmp_path / "in.jsonl", [good("a")])
    proc = cli("run", src, "-o", tmp_path / "out.jsonl", "--window", "0", timeout=WAIT_S)
    assert proc.returncode == 2
    assert "--window" in proc.stderr


# -- resuming after a crash -----------------------------------------------------------------


def test_a_torn_last_line_is_repaired_and_its_id_completed_on_rerun(
    resumed: tuple[Path, Path],
) -> None:
    src, out = resumed
    lines = out.read_text(encoding="utf-8").splitlines()
    torn_id = json.loads(lines[-1])["id"]
    out.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25], encoding="utf-8")

    proc = cli("run", src, "-o", out)
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


def test_a_complete_last_line_without_its_newline_is_not_lost(
    resumed: tuple[Path, Path],
) -> None:
    src, out = resumed
    out.write_bytes(out.read_bytes().rstrip(b"\n"))  # the crash hit between record and newline

    proc = cli("run", src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert Counter(r["id"] for r in records(out)) == Counter(IDS)


def test_recovery_keeps_line_ids_when_a_line_has_its_own_idempotency_key(tmp_path: Path) -> None:
    src = write_requests(
        tmp_path / "in.jsonl", [{**good("q1"), "idempotency_key": "K1"}, good("q2")]
    )
    out = tmp_path / "out.jsonl"
    assert cli("run", src, "-o", out).returncode == 0
    lines = out.read_text(encoding="utf-8").splitlines()
    keep = [line for line in lines if json.loads(line)["id"] != "q1"]
    torn = next(line for line in lines if json.loads(line)["id"] == "q1")[:20]
    out.write_text("\n".join(keep) + "\n" + torn, encoding="utf-8")

    proc = cli("run", src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert Counter(r["id"] for r in records(out)) == Counter(["q1", "q2"])


def test_sigint_exits_130_and_a_rerun_completes_every_id_exactly_once(tmp_path: Path) -> None:
    n = 1500  # at --window 50 the feed lasts seconds: the interrupt lands mid-feed
    src = write_requests(tmp_path / "in.jsonl", [good(f"r{i}") for i in range(n)])
    out = tmp_path / "out.jsonl"
    err_path = tmp_path / "stderr.txt"
    args = ["run", str(src), "-o", str(out), "--window", "50"]
    with err_path.open("w", encoding="utf-8") as err:
        proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
            [sys.executable, "-c", INTERRUPTIBLE, *args], stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            assert wait_until(lambda: has_a_complete_line(out), WAIT_S), "no result appeared"
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
            if name == "ingest":
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
    for command in ("run", "shell", "mock", "bench"):
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


def test_a_spent_budget_stops_the_run_taking_lines_and_a_rerun_sends_the_rest(
    tmp_path: Path, provider: SimulatedProvider
) -> None:
    n = 300  # about 13 calls fit the budget; --window 4 keeps the rest unread by then
    src = write_requests(tmp_path / "in.jsonl", [good(f"b{i}") for i in range(n)])
    model = f'[models.m]\nbase_url = "{provider.base_url}"\n'
    priced = model + 'price = { input = "1000", output = "1000" }\n'
    config = tmp_path / "budget.toml"
    config.write_text(priced + '[budget]\ntotal_usd = "0.5"\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    args = ["run", src, "-o", out, "--window", "4"]

    proc = cli(*args, "--config", config)
    assert proc.returncode == Exit.UNFINISHED, proc.stderr
    assert_no_traceback(proc.stderr)
    assert "stopped taking lines" in proc.stderr
    assert "budget is spent" in proc.stderr
    first = Counter(r["id"] for r in records(out))
    assert set(first.values()) == {1}
    assert 0 < len(first) < n, "the lines after the budget was spent got no line"
    assert {r["status"] for r in records(out)} <= {"completed", "failed"}

    config.write_text(priced, encoding="utf-8")  # no budget now
    rerun = cli(*args, "--config", config)
    assert_no_traceback(rerun.stderr)
    final = records(out)
    assert Counter(r["id"] for r in final) == Counter(f"b{i}" for i in range(n))
    unsent = {f"b{i}" for i in range(n)} - set(first)
    assert all(r["status"] == "completed" for r in final if r["id"] in unsent)
    failed = [r for r in final if r["status"] != "completed"]  # refused by the budget: final
    assert all(r["error"]["reason"] == "budget_exceeded" for r in failed), failed[:1]
    assert rerun.returncode == (Exit.UNFINISHED if failed else Exit.COMPLETED), rerun.stderr


# -- the simulated provider ------------------------------------------------------------------


def _readline_within(stream: Any, timeout: float) -> str:
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""


def _serve_then_interrupt(module_args: list[str]) -> None:
    proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-m", *module_args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = _readline_within(proc.stdout, WAIT_S)
        prefix = "callboard mock listening on http://127.0.0.1:"
        assert line.startswith(prefix), (line, proc.poll())
        base_url = line.removeprefix("callboard mock listening on ").strip()
        reply = httpx.post(
            f"{base_url}/chat/completions",
            json={"model": "any", "messages": [{"role": "user", "content": "hi"}]},
            timeout=WAIT_S,
        )
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_callboard_mock_prints_its_ready_line_and_exits_0_on_sigint() -> None:
    _serve_then_interrupt(["callboard", "mock"])


def test_the_provider_module_prints_its_ready_line_and_exits_0_on_sigint() -> None:
    _serve_then_interrupt(["callboard.provider.server"])
