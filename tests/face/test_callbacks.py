"""Callbacks on results (callboard/_callbacks.py): a failing callback and an unhandled
failure are logged with the task's ids.

Every test runs a real ``System`` against the simulated provider on loopback.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
from callboard.messages import UsageError
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S, LogCollector

from callboard import ModelSettings, System, SystemConfig
from callboard._callbacks import CallbackRunner, fire_and_forget, when_done


def test_failing_callback_record_carries_task_ids(
    make_system: Callable[..., System], debug_logs: LogCollector
) -> None:
    system = make_system()
    ran = threading.Event()

    def boom(_: Any) -> None:
        ran.set()
        raise RuntimeError("callback bug")

    runner = CallbackRunner()
    try:
        future = system.submit("hello", trace_id="trace-cb")
        when_done(future, on_result=boom, on_error=boom, runner=runner)
        result = future.result(WAIT_S)
        assert ran.wait(WAIT_S)
    finally:
        runner.close(wait=True)
    recs = [
        r for r in debug_logs.records if "callback" in r.getMessage() and "failed" in r.getMessage()
    ]
    assert recs
    assert getattr(recs[0], "task_id", None) == result.task_id
    assert getattr(recs[0], "trace_id", None) == "trace-cb"


def test_unhandled_failure_warning_carries_task_ids(
    make_system: Callable[..., System], debug_logs: LogCollector
) -> None:
    system = make_system()
    runner = CallbackRunner()
    try:
        future = system.submit("hello", trace_id="trace-warn", deadline_s=1e-9)
        done = threading.Event()
        when_done(future, runner=runner)
        future.add_done_callback(lambda _: done.set())
        result = future.result(WAIT_S)
        assert done.wait(WAIT_S)
    finally:
        runner.close(wait=True)
    assert not result.ok
    recs = [r for r in debug_logs.records if "without success" in r.getMessage()]
    assert recs
    assert getattr(recs[0], "task_id", None) == result.task_id
    assert getattr(recs[0], "trace_id", None) == "trace-warn"


def test_an_async_callback_whose_callers_loop_closed_runs_on_the_runners_own(
    make_system: Callable[..., System], provider: SimulatedProvider, debug_logs: LogCollector
) -> None:
    """``fire_and_forget`` inside ``asyncio.run``, which ended before the outcome came:
    the async ``on_error`` was dropped ("could not be scheduled": the loop was closed),
    though it is called for every outcome that is not ok (found by a hunt)."""
    provider.configure("held-cb", ModelBehaviour(latency_s=30.0))
    system = make_system(
        SystemConfig(models=(ModelSettings(name="held-cb", base_url=provider.base_url),))
    )
    called = threading.Event()

    async def on_error(_: object) -> None:
        called.set()

    runner = CallbackRunner()
    try:

        async def submit() -> Any:
            return fire_and_forget(system, "x", on_error=on_error, runner=runner)

        future = asyncio.run(submit())  # its loop is closed when this returns
        assert future is not None
        assert future.cancel()  # the outcome, after the loop closed: on_error's to hear
        assert called.wait(WAIT_S), "the callback never ran"
    finally:
        runner.close(wait=True)
        system.stop(timeout=0)  # the call sent runs to its end: not waited for here
    assert not [r for r in debug_logs.records if "could not be scheduled" in r.getMessage()]


BLOCKED_AT_EXIT = """
import threading
from callboard import System
from callboard.patterns import fire_and_forget
started = threading.Event()
def block(_):
    started.set()
    threading.Event().wait()  # a callback that never returns
with System() as cb:
    fire_and_forget(cb, "hi", on_result=block, on_error=print)
    assert started.wait(30)
print("stopped")
"""


def test_a_callback_that_never_returns_does_not_hold_the_process_at_exit() -> None:
    """The runner's pool was a ThreadPoolExecutor, whose workers Python joins at exit:
    after every system had stopped, the process never ended (found by a hunt)."""
    proc = subprocess.run(  # noqa: S603 - our own interpreter, fixed arguments
        [sys.executable, "-c", BLOCKED_AT_EXIT],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "stopped\n"


@pytest.mark.parametrize("workers", [0, 1.5, float("nan"), "4", None, True])
def test_a_runner_of_no_whole_number_of_workers_is_refused(workers: object) -> None:
    with pytest.raises(UsageError, match="max_workers must be an integer >= 1"):
        CallbackRunner(workers)  # type: ignore[arg-type]
