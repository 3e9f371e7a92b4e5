"""The REPL: a console with ``cb`` bound, driven line by line in-process and over stdin.

Also: every message and result type echoes as one bounded, readable line,
however large its payload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from callboard.messages import (
    AdmitDue,
    Billed,
    BreakerState,
    Call,
    CallResult,
    CallsDone,
    CallShape,
    Cancel,
    Cancelled,
    ChatMessage,
    CheckLiveness,
    ChildFailed,
    ChildStopped,
    Choice,
    Completed,
    Crash,
    EmbeddingResult,
    Enqueue,
    EscalateDue,
    Expired,
    ExpireDue,
    Failed,
    FailureReason,
    Finished,
    GetState,
    GetStats,
    GroupStats,
    Health,
    Job,
    LetGo,
    Percentiles,
    Ready,
    Redelivered,
    Regrant,
    Rejected,
    RejectReason,
    ReplaceChildren,
    Request,
    RestartChild,
    Result,
    Route,
    StartChildren,
    Stats,
    StatsOverdue,
    StopChildren,
    StreamDelta,
    Task,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from callboard.provider.server import SimulatedProvider
from support import WAIT_S, two_models, wait_until

from callboard import ModelSettings, System, SystemConfig, SystemStoppedError, messages
from callboard.shell import banner, main, make_console, short_repr


@pytest.fixture
def cb() -> Iterator[System]:
    system = System()  # what the shell starts: the simulated provider
    try:
        yield system
    finally:
        system.stop(timeout=WAIT_S)


def push(console: Any, *lines: str) -> tuple[str, str]:
    """Feed the console complete statements; returns what it printed (out, err)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for line in lines:
            assert not console.push(line), f"incomplete statement: {line!r}"
    return out.getvalue(), err.getvalue()


def test_the_console_submits_crashes_an_actor_asks_and_reads_stats(cb: System) -> None:
    console = make_console(cb)
    out, err = push(
        console,
        'r = cb.submit("hi", priority=Priority.HIGH).result(30)',
        "r.ok",
        'cb.tell("queue", messages.Crash())',
        'after = cb.submit("after the crash").result(30)',  # served by the new queue
        'restarts = cb.supervision()["queue"]["restarts"]',
        'state = cb.ask("model:sim-fast", messages.GetState())',
        "stats = cb.stats()",
        "r",
    )
    assert "Traceback" not in err, err
    names = console.locals
    assert names["r"].ok
    assert names["after"].ok
    assert names["restarts"] >= 1
    assert names["state"]["name"] == "model:sim-fast"
    assert names["stats"].outcomes == {"completed": 2}
    echoed = out.splitlines()
    assert echoed[0] == "True"
    assert echoed[1].startswith("Completed(task_id=")
    assert "priority=Priority.HIGH" in echoed[1]
    assert len(echoed) == 2


def test_the_console_has_its_names_bound_and_a_banner_with_examples(cb: System) -> None:
    console = make_console(cb)
    assert {"cb", "callboard", "messages", "Priority", "patterns", "every"} <= set(console.locals)
    assert console.locals["cb"] is cb
    text = banner(cb)
    for example in ("cb.submit(", "messages.Crash()", "messages.GetState()", "cb.stats()"):
        assert example in text
    assert "cb.supervision()" in text
    assert "model:sim-fast" in text


def test_an_error_in_the_console_is_shown_and_the_session_goes_on(cb: System) -> None:
    console = make_console(cb)
    out, err = push(console, 'cb.submit("")', "1 + 1")
    assert "InvalidRequestError" in err
    assert out.strip() == "2"


def test_main_stops_the_system_however_the_console_ends(
    monkeypatch: pytest.MonkeyPatch, provider: Any
) -> None:
    started: list[System] = []

    def make(config: SystemConfig | None) -> System:
        assert config is None
        system = System(SystemConfig(models=two_models(provider.base_url)))
        started.append(system)
        return system

    monkeypatch.setattr(sys, "stdin", io.StringIO('x = cb.submit("hi").result(30)\nexit(3)\n'))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = main([], make_system=make)
    assert status == 3
    (system,) = started
    with pytest.raises(SystemStoppedError):
        system.submit("after exit")

    monkeypatch.setattr(sys, "stdin", io.StringIO('exit("leaving now")\n'))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main([], make_system=make) == 1  # a message is a failure status, as in Python
    assert "leaving now" in err.getvalue()

    monkeypatch.setattr(sys, "stdin", io.StringIO("every(cb, '1h', 'later')\n"))  # then EOF
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main([], make_system=make) == 0
    assert "stopped" in repr(started[1])


def test_main_reports_a_bad_config_as_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_the_shell_runs_as_a_module_over_stdin() -> None:
    lines = [
        'cb.submit("hi").result(30).ok',
        'cb.tell("queue", messages.Crash())',
        'cb.submit("again").result(30).ok',
        'cb.supervision()["queue"]["restarts"] >= 1',
        'sorted(cb.ask("model:sim-fast", messages.GetState()))[:1]',
        "cb.stats().outcomes",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "callboard.shell"],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "callboard shell: cb is a running System" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout.count("True") == 3, done.stdout
    assert "{'completed': 2}" in done.stdout
    assert "stopping callboard" in done.stderr


def test_the_shell_over_a_pipe_exits_on_eof_leaving_no_thread_behind(
    monkeypatch: pytest.MonkeyPatch, provider: SimulatedProvider
) -> None:
    started: list[System] = []

    def make(config: SystemConfig | None) -> System:
        assert config is None
        system = System(
            SystemConfig(
                models=(
                    ModelSettings(name="alpha", base_url=provider.base_url),
                    ModelSettings(name="beta", base_url=provider.base_url),
                )
            )
        )
        started.append(system)
        return system

    before = set(threading.enumerate())
    lines = [
        'job = every(cb, 0.05, "ping", run_immediately=True)',
        "job.wait(lambda i: i.runs >= 2, timeout=30).runs >= 2",
        'patterns.race(cb, "hi", models=["alpha", "beta"], timeout=30).ok',
        'cb.gather(["a", "b"], timeout=30)[1].ok',
        'cb.submit("left in flight at EOF")',
    ]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([], make_system=make)
    assert status == 0
    assert "Traceback" not in err.getvalue(), err.getvalue()
    assert out.getvalue().count("True") == 3
    (system,) = started
    assert "stopped" in repr(system)
    with pytest.raises(SystemStoppedError):
        system.submit("after EOF")
    assert wait_until(lambda: not (set(threading.enumerate()) - before), timeout=5)


def test_console_echoes_bounded_lines_without_secrets(provider: SimulatedProvider) -> None:
    key = "sk-very-secret-0123456789"
    system = System(
        SystemConfig(models=(ModelSettings(name="alpha", base_url=provider.base_url, api_key=key),))
    )
    try:
        console = make_console(system)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            for line in (
                "cb",
                "cb.models",
                "cb.config",
                'cb.ask("model:alpha", messages.GetState())',
            ):
                assert not console.push(line)
        echoed = out.getvalue()
        assert key not in echoed
        assert all(len(line) <= 600 for line in echoed.splitlines())
        assert key not in short_repr(system.models)
        assert key not in repr(system.config)
    finally:
        system.stop(timeout=WAIT_S)


# -- one readable line per message, whatever it carries ---------------------------------------

BIG = "x" * 1_000_000
REQUEST = Request.of([ChatMessage(role="user", content=BIG)] * 3, metadata={"k": BIG})
TASK = Task(task_id=7, trace_id="t7", request=REQUEST, submitted_at=0.0, future=Future())
JOB = Job(task=TASK, candidates=("alpha", "beta"))
DONE = Completed(task_id=7, trace_id="t7", content=BIG, usage=Usage(prompt_tokens=3))
GROUP = GroupStats(finished=1, ok=1, latency=Percentiles(count=1, p50=0.123456789))

SAMPLES: list[Any] = [
    ChatMessage(role="user", content=BIG),
    REQUEST,
    Usage(prompt_tokens=1, completion_tokens=2),
    Billed(model="alpha", usage=Usage(prompt_tokens=9, estimated=True), cost_nusd=700),
    DONE,
    Failed(task_id=7, trace_id="t7", reason=FailureReason.TIMEOUT, detail=BIG),
    Expired(task_id=7, trace_id="t7", detail=BIG),
    Cancelled(task_id=7, trace_id="t7"),
    Rejected(task_id=7, trace_id="t7", reason=RejectReason.QUEUE_FULL),
    Result(task_id=7, trace_id="t7"),
    TASK,
    JOB,
    Route(tasks=(TASK,) * 1000),
    messages.BudgetFreed(),
    Enqueue(jobs=(JOB,) * 1000),
    Ready(model="alpha", incarnation=1, epoch=0, credits=4),
    Call(model="alpha", incarnation=1, epoch=0, jobs=(JOB,) * 100),
    Cancel(task_ids=tuple(range(100_000))),
    Health(model="alpha", breaker=BreakerState.OPEN, reopen_at=3.0),
    Finished(results=(DONE,) * 1000),
    AdmitDue(at=1.0),
    ExpireDue(at=1.0),
    EscalateDue(at=1.0),
    CallResult(task_id=7, attempt=1, started_at=0.0, ended_at=0.1, content=BIG),
    CallsDone(incarnation=1, results=()),
    ChildFailed(name="queue", incarnation=1, error=BIG, poison=Route(tasks=(TASK,))),
    RestartChild(name="queue", incarnation=2),
    ChildStopped(name="queue", incarnation=1),
    StartChildren(),
    StopChildren(),
    CheckLiveness(),
    Redelivered(message=Route(tasks=(TASK,))),
    Regrant(),
    ReplaceChildren(specs=()),
    GetState(),
    LetGo(),
    Crash(),
    GetStats(),
    ToolCall(id="call_1", name="lookup", arguments='{"q": "x"}'),
    Choice(index=1, content="second"),
    CallShape(json_tool="answer"),
    StreamDelta(text="he", tool_calls=(ToolCallDelta(index=0, arguments="{"),)),
    ToolCallDelta(index=0, id="call_1", name="lookup"),
    EmbeddingResult(vectors=[[0.1, 0.2]], model="m", batches=1),
    StatsOverdue(finished=10**9, reply=Future()),
    GROUP.latency,
    GROUP,
    Stats(
        outcomes={"completed": 1},
        failures={},
        total=GROUP,
        by_model={f"m{i}": GROUP for i in range(50)},
        by_priority={},
        ledger={"accepted": 1},
    ),
]


def _exported_dataclasses() -> list[type]:
    return [
        obj
        for name in messages.__all__
        if dataclasses.is_dataclass(obj := getattr(messages, name)) and isinstance(obj, type)
    ]


def test_every_exported_message_type_has_a_sample_here() -> None:
    sampled = {type(s) for s in SAMPLES}
    missing = [c.__name__ for c in _exported_dataclasses() if c not in sampled]
    assert missing == [], f"add a sample of {missing} to SAMPLES"


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: type(s).__name__)
def test_every_message_echoes_as_one_bounded_readable_line(sample: Any) -> None:
    text = short_repr(sample)
    assert "\n" not in text
    assert len(text) <= 600
    assert text.startswith(f"{type(sample).__name__}(")
    assert " object at 0x" not in text
    assert "Future" not in text, "the caller's future is not part of a task's repr"


def test_short_repr_keeps_what_identifies_a_result() -> None:
    text = short_repr(DONE)
    for part in ("task_id=7", "trace_id='t7'", "priority=Priority.NORMAL", "content='xxx"):
        assert part in text
    assert "..." in text
    assert short_repr(GROUP.latency) == (
        "Percentiles(count=1, p50=0.1235, p95=None, p99=None, max=None)"
    )


def test_short_repr_of_plain_values_is_reprlib_like() -> None:
    assert short_repr(None) == "None"
    assert short_repr({"a": 1}) == "{'a': 1}"
    assert short_repr(list(range(100))).endswith("...]")
    assert len(short_repr(BIG)) < 100
