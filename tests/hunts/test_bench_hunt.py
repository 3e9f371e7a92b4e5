"""Bug hunt in the load harness (``bench/``) and ``callboard mock``.

The hunt marked each bug it found with a strict xfail; the bugs are fixed and
those tests now pin the fixes, beside the ones that pinned behaviour that held.
Nothing here asserts speed.
Cross-process state (the provider's pid, its listening socket) is read from
``/proc`` and polled with deadlines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from callboard.bench import harness
from callboard.bench.faults import run_faulty
from callboard.bench.measure import Run, ScenarioResult, percentiles, summarise
from callboard.bench.plan import Options, Scale
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.report import (
    Report,
    render_markdown,
    render_table,
    table_rows,
    write_outputs,
)
from callboard.bench.targets import evaluate
from callboard.provider.app import check_loopback
from callboard.provider.behaviour import ModelBehaviour
from callboard.provider.engine import MAX_MODELS, Outcome, ProviderCore
from callboard.provider.server import run_mock

from callboard import cli

PROVIDER_MODULE = "callboard.provider.server"


# -- /proc helpers -----------------------------------------------------------------


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        threading.Event().wait(0.02)
    return True


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _providers_of(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat and stat[1] == parent and PROVIDER_MODULE in _cmdline(int(entry.name)):
                found.append(int(entry.name))
    return found


def _listening_ports(pid: int) -> list[int]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = str(fd.readlink())
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return []
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


# -- the harness's command line ----------------------------------------------------


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_an_unusable_out_is_a_usage_error_before_any_scenario(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    blocker = tmp_path / "bench-report"
    blocker.write_text("not a directory\n")
    out = blocker if where == "file" else blocker / "sub"
    ran: list[Options] = []
    monkeypatch.setattr(harness, "run_scenarios", lambda opts: (ran.append(opts), ({}, {}))[1])
    with pytest.raises(SystemExit) as exc:
        harness.main(["--quick", "--quiet", "--scenarios", "crash", "--out", str(out)])
    assert exc.value.code == 2
    assert ran == []  # refused before minutes of load are spent
    assert blocker.read_text() == "not a directory\n"


def test_duplicate_scenarios_and_baselines_are_not_run_twice() -> None:
    args = harness._parser().parse_args(
        ["--scenarios", "crash,crash", "--baselines", "aiohttp,aiohttp"]
    )
    try:
        opts = harness._options(args)
    except ValueError:
        return  # refusing duplicates is fine too
    assert opts.scenarios == ("crash",)
    assert opts.baselines == ("aiohttp",)


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
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert needle in err, err


def test_litellm_is_noted_only_when_all_asked_and_refused_when_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(harness, "litellm_available", lambda: False)

    def options(baselines: str) -> Options:
        return harness._options(harness._parser().parse_args(["--baselines", baselines]))

    assert options("none").notes == []
    assert options("aiohttp").notes == []
    assert any("LiteLLM" in n for n in options("all").notes)
    assert "litellm" not in options("all").baselines
    with pytest.raises(ValueError, match="litellm is not importable"):
        options("aiohttp,litellm")


def test_the_verbose_flag_before_a_bad_mock_port_is_still_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["-vv", "mock", "--port", "70000"])
    assert exc.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_every_subcommand_of_the_top_parser_has_a_func() -> None:
    parser = cli._parser()  # main() hands these off before parsing; the parser still works
    for argv in (["bench"], ["shell"], ["mock"]):
        assert callable(parser.parse_args(argv).func), argv


def test_unknown_or_empty_baseline_is_a_usage_error() -> None:
    for value in ("nope", "", "aiohttp,nope"):
        with pytest.raises(SystemExit) as exc:
            harness.main(["--baselines", value, "--scenarios", "crash", "--out", "unused"])
        assert exc.value.code == 2


def test_a_failing_scenario_is_reported_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def boom(_opts: Options) -> ScenarioResult:
        raise RuntimeError("injected")

    ran: list[str] = []

    def fine(_opts: Options) -> ScenarioResult:
        ran.append("crash")
        return ScenarioResult(name="crash")

    monkeypatch.setitem(harness.RUNNERS, "faulty", boom)
    monkeypatch.setitem(harness.RUNNERS, "crash", fine)
    opts = Options(scale=Scale.small(), scenarios=("faulty", "crash"))
    results, errors = harness.run_scenarios(opts)
    assert list(results) == ["crash"]
    assert ran == ["crash"]
    assert errors == {"faulty": "RuntimeError: injected"}


# -- the provider process is always stopped ------------------------------------------


@pytest.mark.timeout(90)
def test_sigterm_to_the_bench_leaves_no_provider_process(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "callboard.bench", "--quick", "--quiet"]
    argv += ["--scenarios", "outage", "--baselines", "none", "--out", str(tmp_path)]
    bench = subprocess.Popen(  # noqa: S603 - our own module
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    provider: list[int] = []
    try:

        def listening() -> bool:
            kids = _providers_of(bench.pid)
            if kids and _listening_ports(kids[0]):
                provider[:] = kids[:1]
                return True
            return bench.poll() is not None

        assert wait_until(listening, 60.0)
        assert provider, "the bench ended before its provider listened"
        port = _listening_ports(provider[0])[0]
        bench.send_signal(signal.SIGTERM)
        bench.wait(30)
        gone = wait_until(lambda: not _alive(provider[0]), 5.0)
        assert gone, f"provider pid {provider[0]} outlived the bench"
        assert _refused(port)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
        for pid in provider:  # the orphan this test caused, by its own pid
            if _alive(pid) and PROVIDER_MODULE in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)


_HOLDS_A_PROVIDER = """
import sys, threading
from callboard.bench.provider_process import ProviderProcess
prov = ProviderProcess()
prov.start()
print(prov.pid, flush=True)
threading.Event().wait(60)
"""


@pytest.mark.timeout(90)
def test_a_bench_killed_outright_still_leaves_no_provider_process() -> None:
    # SIGKILL runs no handler and no finally: only the child's stdin EOF can stop it
    holder = subprocess.Popen(  # noqa: S603 - our own module
        [sys.executable, "-c", _HOLDS_A_PROVIDER], stdout=subprocess.PIPE, text=True
    )
    pid = 0
    try:
        assert holder.stdout is not None
        pid = int(holder.stdout.readline())
        assert wait_until(lambda: bool(_listening_ports(pid)), 30.0)
        port = _listening_ports(pid)[0]
        holder.kill()
        holder.wait(10)
        gone = wait_until(lambda: not _alive(pid), 10.0)
        assert gone, f"provider pid {pid} outlived its parent"
        assert _refused(port)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()
        if pid and _alive(pid) and PROVIDER_MODULE in _cmdline(pid):
            os.kill(pid, signal.SIGKILL)


def test_an_exception_inside_the_provider_block_stops_and_reaps_the_child() -> None:
    seen: dict[str, Any] = {}

    def scenario() -> None:
        with ProviderProcess() as prov:
            seen.update(prov=prov, pid=prov.pid, port=httpx.URL(prov.base_url).port)
            assert _alive(prov.pid)
            prov.reset_stats()
            raise RuntimeError("scenario failed")

    with pytest.raises(RuntimeError, match="scenario failed"):
        scenario()
    pid, port, prov = seen["pid"], seen["port"], seen["prov"]
    assert _stat(pid) is None  # stopped and reaped, no zombie
    assert _refused(port)
    with pytest.raises(RuntimeError, match="not running"):
        prov.stats()
    prov.stop()  # idempotent


# -- the figures ---------------------------------------------------------------------


def _run(system: str, label: str, rnd: int, ok: int, *, cpu: float = 0.1, conc: int = 50) -> Run:
    return Run(
        scenario="steady",
        system=system,
        label=label,
        concurrency=conc,
        tasks=ok,
        ok=ok,
        wall_s=1.0,
        cpu_s=cpu,
        round=rnd,
        latency=percentiles([0.05] * ok),
    )


def test_ratios_pair_each_row_with_the_same_label_and_round_only() -> None:
    runs = [
        _run("callboard", "C50", 0, 90),
        _run("callboard", "C50", 1, 80),
        _run("callboard", "C200", 0, 300, conc=200),
        _run("aiohttp", "C50", 0, 100),
        _run("aiohttp", "C50", 1, 100),
        _run("aiohttp", "C200", 0, 400, conc=200),
        _run("httpx", "C50", 0, 10),  # once per level, round 0 only
        _run("serial", "", 0, 20, conc=1),
    ]
    rows = {(r["label"], r["system"]): r for r in summarise(runs, ["aiohttp", "httpx", "serial"])}
    c50, c200 = rows["C50", "callboard"], rows["C200", "callboard"]
    assert c50["ratio"]["aiohttp"] == pytest.approx((0.9 + 0.8) / 2)
    assert c200["ratio"]["aiohttp"] == pytest.approx(0.75)
    assert c50["ratio"]["httpx"] == pytest.approx((9.0 + 8.0) / 2)
    assert "httpx" not in c200["ratio"]  # no C200 httpx run: no ratio, not C50's
    assert c50["ratio"]["serial"] == pytest.approx((4.5 + 4.0) / 2)
    assert c200["ratio"]["serial"] == pytest.approx(15.0)
    assert rows["", "serial"]["ratio"] == {}
    assert c50["cycle_ms"] == pytest.approx((1000 * 50 / 90 + 1000 * 50 / 80) / 2)


def test_an_empty_or_instant_run_never_divides_by_zero() -> None:
    empty = Run(scenario="x", system="callboard")
    assert (empty.throughput, empty.cpu_ms_per_request) == (0.0, 0.0)
    rows = summarise([_run("callboard", "C50", 0, 0), _run("aiohttp", "C50", 0, 0)], ["aiohttp"])
    by_system = {r["system"]: r for r in rows}
    assert by_system["callboard"]["ratio"]["aiohttp"] is None
    assert by_system["callboard"]["cycle_ms"] is None
    p = percentiles([])
    assert (p.count, p.p50, p.p99) == (0, None, None)
    p = percentiles([0.003, 0.001, 0.002])
    assert (p.p50, p.p95, p.p99, p.max) == (2.0, 3.0, 3.0, 3.0)


def _report(results: dict[str, ScenarioResult]) -> Report:
    return Report(
        environment=harness.environment(),
        options={"seed": 7},
        results=results,
        targets=[],
        baselines=["aiohttp"],
    )


def test_the_json_holds_every_figure_the_table_shows_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = ScenarioResult(
        name="steady",
        runs=[_run("callboard", "C50", 0, 90), _run("aiohttp", "C50", 0, 100)],
        figures={"answer": 42},
    )
    report = _report({"steady": result})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the extra is not installed
    paths = write_outputs(report, tmp_path)
    assert "plot" not in paths
    assert not (tmp_path / "bench.png").exists()
    data = json.loads((tmp_path / "bench.json").read_text())
    assert any("matplotlib" in n for n in data["notes"])
    assert "matplotlib" in (tmp_path / "bench.md").read_text()
    env = data["environment"]
    assert env["packages"]["httpx"]
    assert env["usable_cores"] >= 1
    assert "loadavg_start" in env
    summary = data["scenarios"]["steady"]["summary"]
    assert data["scenarios"]["steady"]["figures"] == {"answer": 42}
    for shown, row in zip(table_rows(report), summary, strict=True):
        assert shown[2] == row["system"]
        assert shown[6] == f"{row['throughput']:.0f}"
        assert shown[7] == (
            "-" if "aiohttp" not in row["ratio"] else f"{row['ratio']['aiohttp']:.2f}"
        )
    cb = next(r for r in summary if r["system"] == "callboard")
    assert cb["ratio"]["aiohttp"] == pytest.approx(0.9)
    assert cb["latency"]["p99"] == 50.0


def test_a_stale_plot_is_removed_when_matplotlib_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bench.png").write_bytes(b"an earlier run's plot")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = write_outputs(_report({"crash": ScenarioResult(name="crash")}), tmp_path)
    assert "plot" not in paths
    assert not (tmp_path / "bench.png").exists()


def test_the_priority_target_is_na_without_a_measured_service_time() -> None:
    figures = {
        "service_time_ms": None,
        "critical_p99_wait_ms": 3.0,
        "inversions_total": 0,
        "lost": 0,
    }
    targets = evaluate({"priority": ScenarioResult(name="priority", figures=figures)}, [])
    wait = next(t for t in targets if t.name.startswith("CRITICAL"))
    assert wait.verdict == "n/a"
    assert wait.value is None


def test_the_markdown_shows_a_long_figure_whole_or_marks_the_cut() -> None:
    sites = [{"site": f"callboard/actors/queue.py:{i}", "bytes_per_task": 1.5} for i in range(40)]
    result = ScenarioResult(name="backlog", figures={"top_sites": sites})
    md = render_markdown(_report({"backlog": result}))
    line = next(x for x in md.splitlines() if x.startswith("- **top_sites**"))
    shown = line.split("`")[1]
    try:
        assert json.loads(shown) == sites
    except json.JSONDecodeError:
        assert shown.endswith(("...", "\u2026")), shown[-40:]
    report = _report({"backlog": result})
    terminal = next(x for x in render_table(report).splitlines() if "top_sites:" in x)
    assert terminal.endswith("\u2026")  # cut, and marked as cut


@pytest.mark.timeout(60)
def test_faulty_runs_keep_no_server_arrival_list_in_the_json() -> None:
    scale = dataclasses.replace(Scale.small(), faulty_tasks=40)
    result = run_faulty(Options(scale=scale, scenarios=("faulty",), baselines=()))
    assert result.figures["tasks"] == 40
    assert result.figures["failed"] == 0
    for run in result.runs:
        assert "arrivals" not in run.as_json()["extra"]
        assert "arrivals" not in run.server


# -- the simulated provider and ``callboard mock`` -------------------------------------


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_mock_port_out_of_range_is_a_clean_error(port: str) -> None:
    # in a subprocess: the failed bind also leaks its socket (create_server closes it on
    # OSError only), which would surface here as an unraisable ResourceWarning
    argv = [sys.executable, "-m", "callboard", "mock", "--port", port]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)  # noqa: S603
    assert "Traceback" not in proc.stderr, proc.stderr[-300:]
    assert proc.returncode in (1, 2)
    assert "port" in proc.stderr


@pytest.mark.parametrize("host", ["127.0.0.1.5", "127.300.0.1"])
def test_loopback_check_refuses_what_is_not_an_ip_literal(host: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        check_loopback(host)


def test_configured_models_respect_the_state_bound() -> None:
    core = ProviderCore(default=ModelBehaviour(), models=None, seed=0)
    for i in range(MAX_MODELS + 50):
        try:
            core.configure(f"m{i}", ModelBehaviour(latency_s=0.0))
        except ValueError:
            break
    stats: Any = core.stats()
    assert len(stats["models"]) <= MAX_MODELS + 1


def test_rpm_window_headers_and_seeded_faults_hold_on_a_fake_clock() -> None:
    now = [0.0]
    core = ProviderCore(
        default=ModelBehaviour(rpm=60, completion_tokens=8),
        models=None,
        seed=1,
        clock=lambda: now[0],
    )
    state = core.state("m")
    admitted, first_refusal = 0, None
    for k in range(1000):  # 100 req/s for 10 s against 60 rpm, burst of one second
        now[0] = k * 0.01
        plan = core.plan(state, 10, None)
        if plan.outcome is Outcome.OK:
            admitted += 1
        elif first_refusal is None:
            first_refusal = plan
    assert admitted == 10  # t = 0, 1, ..., 9
    assert first_refusal is not None
    assert first_refusal.status == 429
    assert first_refusal.retry_after_s == pytest.approx(0.99, abs=1e-4)
    assert first_refusal.headers["x-ratelimit-remaining-requests"] == "0"
    assert first_refusal.headers["x-ratelimit-limit-requests"] == "60"

    def outcomes(seed: int) -> list[Outcome]:
        c = ProviderCore(default=ModelBehaviour(error_rate=0.1), models=None, seed=seed)
        s = c.state("m")
        return [c.plan(s, 10, None).outcome for _ in range(3000)]

    a = outcomes(3)
    assert a == outcomes(3)
    assert a != outcomes(4)
    assert 0.08 < a.count(Outcome.ERROR) / len(a) < 0.12


@pytest.mark.timeout(60)
def test_mock_sigterm_ends_a_hang_and_exits_0_with_its_port_closed() -> None:
    argv = [sys.executable, "-m", "callboard", "mock", "--port", "0", "--timeout-rate", "1"]
    proc = subprocess.Popen(  # noqa: S603 - our own module
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("callboard mock listening on http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1].strip()
        port = httpx.URL(url).port
        assert port is not None
        answers: list[int] = []

        def hang() -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            answers.append(httpx.post(url + "/chat/completions", json=body, timeout=30).status_code)

        caller = threading.Thread(target=hang)
        caller.start()
        root = url.removesuffix("/v1")
        assert wait_until(lambda: httpx.get(root + "/stats").json()["total"]["hung"] == 1, 10.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        caller.join(10)
        assert answers == [504]
        assert _refused(port)
        assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_mock_bad_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--latency", "nan"],
        ["--rpm", "0"],
        ["--error-rate", "0.6", "--drop-rate", "0.6"],
        ["--models", "[1]"],
        ["--models", "{bad json"],
        ["--models", '{"m": {"nope": 1}}'],
        ["--host", "0.0.0.0"],
    ):
        with pytest.raises(SystemExit) as exc:
            run_mock(argv)
        assert exc.value.code == 2, argv
    assert "Traceback" not in capsys.readouterr().err
