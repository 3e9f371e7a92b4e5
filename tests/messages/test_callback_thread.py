"""A caller's done-callbacks run on callboard's callback thread, never on the actor
thread that resolves the future: a real system, real actors, a real provider."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from callboard.messages import CallerFuture, TaskFuture, on_done
from callboard.messages import _callback_thread as callback_thread
from callboard.messages._callback_thread import CALLBACK_THREAD, flush_callbacks
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S, callbacks_run, one_model, wait_until

from callboard import Completed, Priority, Result, System, SystemConfig


def test_a_blocking_callback_holds_back_no_other_call_of_its_model(
    provider: SimulatedProvider,
) -> None:
    """A callback that blocks ran on the model actor's thread: every other call of that
    model waited for it (five CRITICAL submits got nothing until it was let go)."""
    provider.configure("m", ModelBehaviour(latency_s=0.005))
    release = threading.Event()
    ran_on: list[str] = []

    def blocking(_future: Future[Result]) -> None:
        ran_on.append(threading.current_thread().name)
        release.wait(WAIT_S)

    with System(SystemConfig(models=(one_model(provider),))) as system:
        try:
            first = system.submit("its callback blocks")
            first.add_done_callback(blocking)
            assert isinstance(first.result(WAIT_S), Completed)
            others = [system.submit(f"urgent {i}", priority=Priority.CRITICAL) for i in range(5)]
            for other in others:
                assert isinstance(other.result(WAIT_S), Completed)  # not held by it
            assert not release.is_set()
        finally:
            release.set()
    assert ran_on == [CALLBACK_THREAD]


def test_a_callback_may_submit_and_wait_for_a_follow_up(provider: SimulatedProvider) -> None:
    """A callback that submits the next step and waits for its result gets it (on the
    model actor's thread it waited for its own model, which was busy running it)."""
    got: Future[Result] = Future()
    with System(SystemConfig(models=(one_model(provider),))) as system:

        def follow_up(done: Future[Result]) -> None:
            assert isinstance(done.result(), Completed)
            got.set_result(system.submit("the next step").result(WAIT_S))

        system.submit("the first step").add_done_callback(follow_up)
        assert isinstance(got.result(WAIT_S), Completed)


def test_callbacks_run_once_each_in_the_order_they_were_added() -> None:
    future = TaskFuture(1, "trace-1")
    seen: list[tuple[int, str]] = []
    for i in range(5):
        future.add_done_callback(lambda _f, i=i: seen.append((i, threading.current_thread().name)))
    future.set_result("r")  # type: ignore[arg-type]
    callbacks_run()
    assert seen == [(i, CALLBACK_THREAD) for i in range(5)]


def test_a_callback_added_once_done_runs_at_once_in_the_callers_thread() -> None:
    for future in (TaskFuture(1, "trace-1"), CallerFuture[Any]()):
        future.set_result("r")  # type: ignore[arg-type]
        seen: list[str] = []
        future.add_done_callback(lambda _f, seen=seen: seen.append(threading.current_thread().name))
        assert seen == [threading.current_thread().name]


def test_callboards_own_callbacks_run_where_the_future_is_resolved() -> None:
    for future in (TaskFuture(1, "trace-1"), CallerFuture[Any](), Future[Any]()):
        seen: list[str] = []
        on_done(future, lambda _f, seen=seen: seen.append(threading.current_thread().name))
        resolver = threading.Thread(target=future.set_result, args=(None,), name="resolver")
        resolver.start()
        resolver.join(WAIT_S)
        assert seen == ["resolver"]


def test_a_caller_futures_callback_is_off_the_actor_threads_too(
    provider: SimulatedProvider,
) -> None:
    """What a race or a gather hands the caller (a ``CallerFuture``) is resolved on an
    actor's thread as well: a task's own callback decides it there."""
    names: Future[str] = Future()
    with System(SystemConfig(models=(one_model(provider),))) as system:
        future = CallerFuture[Result]()
        task = system.submit("decides")
        on_done(task, lambda done: future.set_result(done.result()))
        future.add_done_callback(lambda _f: names.set_result(threading.current_thread().name))
        assert names.result(WAIT_S) == CALLBACK_THREAD


def test_stop_waits_for_the_callbacks_of_what_ended(provider: SimulatedProvider) -> None:
    """The callback thread is a daemon: callbacks still queued when ``stop`` returned
    (and the process ended) never ran; on the actors' threads they all had."""
    ran: list[int] = []
    with System(SystemConfig(models=(one_model(provider),))) as system:
        futures = [system.submit(f"task {i}") for i in range(20)]
        futures[0].add_done_callback(lambda _f: threading.Event().wait(0.2))  # a slow one
        for i, future in enumerate(futures):
            future.add_done_callback(lambda _f, i=i: ran.append(i))
        for future in futures:
            future.result(WAIT_S)
    assert sorted(ran) == list(range(20))


def test_a_callback_that_raises_system_exit_does_not_end_the_others() -> None:
    """It ended the callback thread, and every callback after it in the process was
    queued for ever."""
    first, second = TaskFuture(1, "t1"), TaskFuture(2, "t2")
    seen: list[int] = []

    def leave(_f: Future[Any]) -> None:
        raise SystemExit(3)

    first.add_done_callback(leave)
    first.add_done_callback(lambda _f: seen.append(1))
    second.add_done_callback(lambda _f: seen.append(2))
    first.set_result("r")  # type: ignore[arg-type]
    second.set_result("r")  # type: ignore[arg-type]
    callbacks_run()
    assert seen == [1, 2]


def test_a_callback_may_wait_for_another_futures_callback() -> None:
    """``asyncio.wrap_future`` in a callback learns of its future through a callback of
    its own: queued behind the one waiting for it, on the one thread, it never ran (a
    follow-up of 20 ms timed out after 10 s; found by a hunt). Another thread takes
    the callbacks a blocked one holds back."""
    first, second = CallerFuture[Any](), CallerFuture[Any]()
    got: list[object] = []

    def follow_up(done: Future[Any]) -> None:
        heard = threading.Event()
        second.add_done_callback(lambda f: heard.set())
        threading.Thread(target=second.set_result, args=("follow-up",)).start()
        got.append(heard.wait(WAIT_S) and second.result())

    first.add_done_callback(follow_up)
    first.set_result("first")
    assert wait_until(lambda: got == ["follow-up"])


def test_a_stuck_callback_holds_back_the_others_only_for_a_while() -> None:
    """One system's callback stuck for good held every later callback of every system
    in the process, and each ``stop`` waited its flush out (found by a hunt)."""
    stuck, release = CallerFuture[Any](), threading.Event()
    later = [CallerFuture[Any]() for _ in range(3)]
    ran: list[int] = []
    stuck.add_done_callback(lambda _f: release.wait(WAIT_S))
    for i, future in enumerate(later):
        future.add_done_callback(lambda _f, i=i: ran.append(i))
    stuck.set_result(None)
    for future in later:
        future.set_result(None)
    try:  # side by side once the stall is seen: in no set order
        assert wait_until(lambda: sorted(ran) == [0, 1, 2])
    finally:
        release.set()


def test_a_callback_that_waits_for_the_next_of_its_own_future_sees_it_run() -> None:
    """The bound holds between the callbacks of one future too: they ran as one job,
    so a first callback of a task's future that waited for the second (added after
    it) waited for good (found by a hunt; a ``CallerFuture`` hands each over alone)."""
    future, second_ran = TaskFuture(1, "trace-1"), threading.Event()
    saw: list[bool] = []
    future.add_done_callback(lambda _f: saw.append(second_ran.wait(WAIT_S)))
    future.add_done_callback(lambda _f: second_ran.set())
    future.set_result("r")  # type: ignore[arg-type]
    assert wait_until(lambda: saw == [True])


def test_a_callback_behind_many_that_block_waits_one_stall_not_one_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread was added a stall at a time, and each took the next callback, which
    blocked too: behind ten blockers a quick callback waited ten stalls (found by a
    hunt). Now every callback waiting gets a thread at the first stall."""
    monkeypatch.setattr(callback_thread, "STUCK_S", 0.1)
    release, ran = threading.Event(), threading.Event()
    blockers = [CallerFuture[Any]() for _ in range(20)]
    quick = CallerFuture[Any]()
    for future in blockers:
        future.add_done_callback(lambda _f: release.wait(WAIT_S))
    quick.add_done_callback(lambda _f: ran.set())
    try:
        for future in [*blockers, quick]:
            future.set_result(None)
        assert ran.wait(10 * callback_thread.STUCK_S), "it waited a stall per blocker"
    finally:
        release.set()


def test_a_callback_behind_many_slow_ones_none_stuck_waits_one_stall_not_their_sum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thirty callbacks of 0.6 s (another system's), none reaching the 1 s stall, held
    a quick one behind them 17 s: a thread was started only for a callback that had run
    a stall itself (found by a hunt). One that has waited a stall gets a thread."""
    monkeypatch.setattr(callback_thread, "STUCK_S", 0.1)
    ran = threading.Event()
    slow = [CallerFuture[Any]() for _ in range(20)]
    quick = CallerFuture[Any]()
    for future in slow:  # each half a stall (the hunt's 0.6 s of 1 s); ten stalls in all
        future.add_done_callback(lambda _f: time.sleep(0.5 * callback_thread.STUCK_S))
    quick.add_done_callback(lambda _f: ran.set())
    for future in [*slow, quick]:
        future.set_result(None)
    assert ran.wait(5 * callback_thread.STUCK_S), "it waited for every one before it"
    assert flush_callbacks(WAIT_S)  # none left running into the next test


def test_many_quick_callbacks_keep_their_order_on_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """None blocks, but their backlog takes longer than a stall to drain: counted from
    when the next was handed over, they were spread over 32 threads, out of order, and
    the log said they had each blocked (a review). A stall of 0.5 s had a callback of 2
    ms "slow" once the machine kept its thread from running for a quarter of it (0.125
    s: the first callback, on a thread just started, under a full suite's load): 2 s,
    a quarter of it 0.5 s, four times the margin."""
    monkeypatch.setattr(callback_thread, "STUCK_S", 2.0)  # quick: far under a quarter
    ran: list[int] = []  # of it (0.5 s) even on a loaded machine
    threads: set[int] = set()
    futures = [CallerFuture[Any]() for _ in range(500)]
    for i, future in enumerate(futures):  # 500 of 5 ms: more than a stall to drain

        def quick(_f: Any, i: int = i) -> None:
            time.sleep(0.005)
            threads.add(threading.get_ident())
            ran.append(i)

        future.add_done_callback(quick)
    for future in futures:
        future.set_result(None)
    assert flush_callbacks(WAIT_S)
    assert ran == list(range(500))
    assert len(threads) == 1


def test_nine_callbacks_blocked_on_a_tenth_still_see_it_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight threads at most: nine ``wrap_future`` bridges each waiting for a later
    callback deadlocked every callback in the process (found by a hunt)."""
    monkeypatch.setattr(callback_thread, "STUCK_S", 0.05)
    release = threading.Event()
    futures = [CallerFuture[Any]() for _ in range(10)]
    heard: list[bool] = []
    for future in futures[:9]:
        future.add_done_callback(lambda _f: heard.append(release.wait(WAIT_S)))
    futures[9].add_done_callback(lambda _f: release.set())
    for future in futures:
        future.set_result(None)
    assert wait_until(lambda: len(heard) == 9)
    assert all(heard), "each saw the tenth run, none timed out"


def test_every_callback_thread_held_is_said_in_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(callback_thread, "STUCK_S", 0.05)
    monkeypatch.setattr(callback_thread, "MOST_THREADS", 2)
    release = threading.Event()
    futures = [CallerFuture[Any]() for _ in range(4)]
    for future in futures:
        future.add_done_callback(lambda _f: release.wait(WAIT_S))
    try:
        with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
            for future in futures:
                future.set_result(None)
            assert wait_until(lambda: "blocked for over" in caplog.text)
    finally:
        release.set()
    assert flush_callbacks(WAIT_S)


def test_callbacks_handed_over_back_to_back_while_none_runs_are_watched_too() -> None:
    """The first waits for the second's: both were queued before the thread took the
    first, so nothing woke the watcher, and the second waited for good (found by a
    review)."""
    first, second = CallerFuture[Any](), CallerFuture[Any]()
    heard = threading.Event()
    done: list[bool] = []
    first.add_done_callback(lambda _f: done.append(heard.wait(WAIT_S)))
    second.add_done_callback(lambda _f: heard.set())
    first.set_result(None)
    second.set_result(None)
    assert wait_until(lambda: done == [True])


def test_a_flush_after_a_stall_waits_for_what_runs_elsewhere_but_not_the_stuck() -> None:
    """Once a stuck callback had another thread started, a flush returned while an
    earlier callback still ran there (found by a review). It waits for that one, and
    not for the stuck one."""
    stuck, slow = CallerFuture[Any](), CallerFuture[Any]()
    release, slow_began = threading.Event(), threading.Event()
    ran: list[str] = []
    stuck.add_done_callback(lambda _f: release.wait(WAIT_S))

    def slowly(_f: Any) -> None:
        slow_began.set()
        time.sleep(0.2)  # the callback's own work, which the flush must wait out
        ran.append("slow")

    slow.add_done_callback(slowly)
    stuck.set_result(None)
    slow.set_result(None)
    try:
        assert slow_began.wait(WAIT_S)
        assert flush_callbacks(WAIT_S)
        assert ran == ["slow"]
    finally:
        release.set()


class _RaisingFilter(logging.Filter):
    """A host's filter reading what only its own threads set (a request id)."""

    def filter(self, record: logging.LogRecord) -> bool:
        raise LookupError("request_id")


class _Quiet(logging.Handler):
    """A host's handler that writes nothing (its filter raises first)."""

    def emit(self, record: logging.LogRecord) -> None:
        pass


def test_a_callbacks_error_the_hosts_logging_raises_on_does_not_stop_the_callbacks() -> None:
    """Logging a callback's error through a host filter that raises killed the callback
    thread: no callback ran again in the process (found by a review)."""
    handler = _Quiet()
    handler.addFilter(_RaisingFilter())
    logger = logging.getLogger("concurrent.futures")
    logger.addHandler(handler)
    try:
        failing: CallerFuture[int] = CallerFuture()
        failing.add_done_callback(lambda _: 1 / 0)
        failing.set_result(1)
        ran = threading.Event()
        later: CallerFuture[int] = CallerFuture()
        later.add_done_callback(lambda _: ran.set())
        later.set_result(2)
        assert ran.wait(WAIT_S)
        assert flush_callbacks(WAIT_S)
    finally:
        logger.removeHandler(handler)


def test_a_flush_waits_for_a_handover_promised_before_the_waiters_woke() -> None:
    """A future wakes its waiters, then hands its callbacks over: a host that exited as
    soon as ``result()`` returned was gone before the handover, the exit's flush saw
    nothing to wait for, and the callback never ran (9 runs of 10; found by a hunt)."""
    ran = threading.Event()
    callback_thread.handing_over()  # as a future does before it wakes its waiters
    late = threading.Timer(
        0.2,
        lambda: callback_thread.hand_over(Future(), (lambda _: ran.set(),), expected=True),
    )
    late.start()
    assert flush_callbacks(WAIT_S)
    assert ran.is_set()
    late.join()


EXITS_AT_ONCE = """
import sys, callboard
cb = callboard.System()
future = cb.submit("q", max_tokens=8)
future.add_done_callback(lambda f: open(sys.argv[1], "a").write("ran\\n"))
future.result(30)
"""  # and exits, with no stop: the exit's flush must run the callback


def test_a_callback_runs_though_the_host_exits_as_soon_as_its_result_is_in(
    tmp_path: Path,
) -> None:
    ran = tmp_path / "ran.txt"
    for _ in range(3):
        subprocess.run(  # noqa: S603 - our own interpreter and code
            [sys.executable, "-c", EXITS_AT_ONCE, str(ran)], check=True, timeout=60
        )
    assert ran.read_text().splitlines() == ["ran"] * 3
