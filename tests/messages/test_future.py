"""``TaskFuture``: parity with ``concurrent.futures.Future``, the cancel hook, interop, races.

The state machine drives a ``TaskFuture`` and a standard ``Future`` through the
same operations and demands the same answers. The examples after it pin the
``on_cancel`` hook, ``wait``/``as_completed``/``asyncio`` interop, threads racing
on one future, callback errors, the deferred ``Condition`` and ``repr``.

No test sleeps to synchronise. Where a test must know that a thread is really
blocked inside the future (not merely about to be), it uses a hook that fires
while that thread still holds the future's lock, so the state change the test
makes next cannot get in first: ``_EnrollingCondition`` for ``result`` /
``exception``, ``_WatchedFuture`` for ``wait`` / ``as_completed``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import copy
import gc
import logging
import pickle
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import (
    CancelledError,
    Future,
    InvalidStateError,
    ThreadPoolExecutor,
    as_completed,
    wait,
)
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED
from typing import Any

import pytest
from callboard.messages import TaskFuture
from callboard.messages import _future as future_module
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from support import callbacks_run, interrupted_taking, one_model

from callboard import Result, System, SystemConfig

WAIT_S = 5.0
"""The most any synchronisation in this file waits; reaching it means the test failed."""

ERRORS: tuple[type[Exception], ...] = (ValueError, KeyError, ZeroDivisionError)
EXPECTED_RAISES: tuple[type[Exception], ...] = (
    CancelledError,
    InvalidStateError,
    TimeoutError,
    RuntimeError,
    *ERRORS,
)


def _future(task_id: int = 1, on_cancel: Callable[[int], object] | None = None) -> TaskFuture:
    return TaskFuture(task_id, f"trace-{task_id}", on_cancel=on_cancel)


def _outcome(op: Callable[[Future[Any]], object], fut: Future[Any]) -> tuple[str, object]:
    """What ``op(fut)`` did, comparable across two futures: a value or an exception type."""
    try:
        value = op(fut)
    except EXPECTED_RAISES as exc:
        return ("raised", type(exc))
    if isinstance(value, BaseException):
        return ("exception", (type(value), value.args))
    return ("returned", value)


def _state_tail(fut: Future[Any]) -> str:
    """The part of ``repr`` both classes share: ``state=... [returned|raised ...]>``."""
    return repr(fut).split("state=", 1)[1]


# -- parity with concurrent.futures.Future ------------------------------------


class ParityMachine(RuleBasedStateMachine):
    """One ``TaskFuture`` and one standard ``Future``, the same operations on both."""

    def __init__(self) -> None:
        super().__init__()
        self.cancel_hook_calls: list[int] = []
        self.tf = TaskFuture(7, "trace-7", on_cancel=self.cancel_hook_calls.append)
        self.sf: Future[Any] = Future()
        # one counter per add_done_callback, per future
        self.tf_calls: list[int] = []
        self.sf_calls: list[int] = []
        self.wrong_future_passed: list[object] = []

    def both(self, op: Callable[[Future[Any]], object]) -> tuple[str, object]:
        ours, theirs = _outcome(op, self.tf), _outcome(op, self.sf)
        assert ours == theirs
        return ours

    def _recorder(self, calls: list[int], index: int, owner: Future[Any]) -> Callable[..., None]:
        def callback(fut: Future[Any]) -> None:
            if fut is not owner:
                self.wrong_future_passed.append(fut)
            calls[index] += 1

        return callback

    @rule()
    def cancel(self) -> None:
        self.both(lambda f: f.cancel())
        if self.sf._state == CANCELLED:
            # A TaskFuture has no executor to notify its cancellation later, so it
            # notifies at once: the standard one's executor does the same here.
            self.sf.set_running_or_notify_cancel()

    @rule(value=st.integers())
    def set_result(self, value: int) -> None:
        self.both(lambda f: f.set_result(value))

    @rule(kind=st.sampled_from(ERRORS), message=st.text(max_size=3))
    def set_exception(self, kind: type[Exception], message: str) -> None:
        # a fresh instance per future, so neither sees the other's traceback
        self.both(lambda f: f.set_exception(kind(message)))

    @rule()
    def set_running_or_notify_cancel(self) -> None:
        if self.sf._state == CANCELLED_AND_NOTIFIED:
            # notified already: the standard future raises, a TaskFuture answers
            # "cancelled" (an executor handed one must not run it)
            assert self.tf.set_running_or_notify_cancel() is False
            return
        self.both(lambda f: f.set_running_or_notify_cancel())

    @rule()
    def done(self) -> None:
        self.both(lambda f: f.done())

    @rule()
    def cancelled(self) -> None:
        self.both(lambda f: f.cancelled())

    @rule()
    def running(self) -> None:
        self.both(lambda f: f.running())

    @rule()
    def result_now(self) -> None:
        self.both(lambda f: f.result(timeout=0))

    @rule()
    def exception_now(self) -> None:
        self.both(lambda f: f.exception(timeout=0))

    @rule()
    def add_done_callback(self) -> None:
        index = len(self.tf_calls)
        self.tf_calls.append(0)
        self.sf_calls.append(0)
        self.tf.add_done_callback(self._recorder(self.tf_calls, index, self.tf))
        self.sf.add_done_callback(self._recorder(self.sf_calls, index, self.sf))

    @invariant()
    def same_state(self) -> None:
        assert self.tf._state == self.sf._state
        assert self.tf.done() == self.sf.done()
        assert self.tf.cancelled() == self.sf.cancelled()
        assert self.tf.running() == self.sf.running()
        assert _state_tail(self.tf) == _state_tail(self.sf)

    @invariant()
    def callbacks_once_each_after_done(self) -> None:
        callbacks_run()  # the TaskFuture's run on the callback thread
        assert self.tf_calls == self.sf_calls
        expected = 1 if self.tf.done() else 0
        assert all(calls == expected for calls in self.tf_calls)
        assert not self.wrong_future_passed

    @invariant()
    def cancel_hook_once_iff_cancelled(self) -> None:
        assert self.cancel_hook_calls == ([7] if self.tf.cancelled() else [])


TestParityMachine = ParityMachine.TestCase
TestParityMachine.settings = settings(
    max_examples=200, stateful_step_count=20, deadline=None, database=None
)


# -- the on_cancel hook -------------------------------------------------------


def _finish_with_result(f: TaskFuture) -> None:
    f.set_result("done")  # type: ignore[arg-type]


def _finish_with_error(f: TaskFuture) -> None:
    f.set_exception(ValueError("boom"))


def _start_running(f: TaskFuture) -> None:
    assert f.set_running_or_notify_cancel()


def test_on_cancel_called_once_with_task_id_when_cancel_succeeds() -> None:
    seen: list[tuple[int, bool]] = []
    f: TaskFuture

    def hook(task_id: int) -> None:
        seen.append((task_id, f.cancelled()))

    f = _future(42, on_cancel=hook)
    assert f.cancel() is True
    assert seen == [(42, True)]  # called once, with the id, after the state changed
    assert f.cancel() is True  # a second cancel still answers True ...
    assert seen == [(42, True)]  # ... but does not tell the hook again
    assert f.set_running_or_notify_cancel() is False
    assert f.cancel() is True
    assert seen == [(42, True)]


@pytest.mark.parametrize(
    "prepare",
    [_finish_with_result, _finish_with_error, _start_running],
    ids=["finished", "failed", "running"],
)
def test_on_cancel_not_called_when_cancel_fails(prepare: Callable[[TaskFuture], None]) -> None:
    seen: list[int] = []
    f = _future(5, on_cancel=seen.append)
    prepare(f)
    assert f.cancel() is False
    assert f.cancel() is False
    assert seen == []
    assert not f.cancelled()


def test_on_cancel_once_when_many_threads_cancel_at_once() -> None:
    threads = 16
    seen: list[int] = []
    f = _future(9, on_cancel=seen.append)
    barrier = threading.Barrier(threads)

    def cancel() -> bool:
        barrier.wait(WAIT_S)
        return f.cancel()

    with ThreadPoolExecutor(max_workers=threads) as pool:
        answers = [o.result(WAIT_S) for o in [pool.submit(cancel) for _ in range(threads)]]
    assert answers == [True] * threads
    assert seen == [9]


def _cancel_at(barrier: threading.Barrier, f: TaskFuture) -> bool:
    """Cancel ``f`` once every racer is at ``barrier``: whether this won."""
    barrier.wait(WAIT_S)
    return f.cancel()


def _finish_at(barrier: threading.Barrier, f: TaskFuture) -> bool:
    """Set ``f``'s result once every racer is at ``barrier``: whether this won."""
    barrier.wait(WAIT_S)
    try:
        f.set_result("r")  # type: ignore[arg-type]
    except InvalidStateError:
        return False
    return True


def test_cancel_racing_set_result_has_exactly_one_winner() -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        for task_id in range(100):
            seen: list[int] = []
            f = _future(task_id, on_cancel=seen.append)
            barrier = threading.Barrier(2)
            cancelled_ = pool.submit(_cancel_at, barrier, f)
            finished = pool.submit(_finish_at, barrier, f)
            cancel_won, finish_won = cancelled_.result(WAIT_S), finished.result(WAIT_S)
            assert cancel_won != finish_won
            assert f.cancelled() == cancel_won
            assert seen == ([task_id] if cancel_won else [])
            if finish_won:
                assert f.result(timeout=0) == "r"


# -- interop: wait, as_completed, asyncio -------------------------------------


class _WatchedFuture(TaskFuture):
    """Sets ``watched`` when ``wait``/``as_completed`` first reach for the waiter list.

    They do so holding this future's lock, so a thread that waits for ``watched``
    and then changes the state is sure to find the waiter installed.
    """

    __slots__ = ("watched",)

    def __init__(self, task_id: int) -> None:
        super().__init__(task_id, f"trace-{task_id}")
        self.watched = threading.Event()

    @property
    def _waiters(self) -> list[Any]:
        waiters = super()._waiters
        self.watched.set()
        return waiters


def _resolve(f: TaskFuture, kind: int) -> None:
    """Finish ``f`` one of three ways: a result, an exception, or cancelled and notified."""
    if kind == 0:
        f.set_result(f.task_id)  # type: ignore[arg-type]
    elif kind == 1:
        f.set_exception(ValueError(f.task_id))
    else:
        assert f.cancel()
        assert f.set_running_or_notify_cancel() is False


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def test_wait_all_completed_with_futures_resolved_from_threads(pool: ThreadPoolExecutor) -> None:
    fs = [_future(i) for i in range(9)]
    go = threading.Event()

    def resolve(f: TaskFuture) -> None:
        assert go.wait(WAIT_S)
        _resolve(f, f.task_id % 3)

    resolvers = [pool.submit(resolve, f) for f in fs]
    go.set()
    done, not_done = cf.wait(fs, timeout=WAIT_S, return_when=cf.ALL_COMPLETED)
    assert done == set(fs)
    assert not_done == set()
    for r in resolvers:
        r.result(WAIT_S)
    assert [f.cancelled() for f in fs] == [i % 3 == 2 for i in range(9)]


def test_wait_all_completed_wakes_on_changes_made_while_it_waits(
    pool: ThreadPoolExecutor,
) -> None:
    fs = [_WatchedFuture(i) for i in range(6)]

    def resolve_once_waited_on() -> None:
        assert fs[-1].watched.wait(WAIT_S)
        for f in fs:
            _resolve(f, f.task_id % 3)

    resolver = pool.submit(resolve_once_waited_on)
    done, not_done = cf.wait(fs, timeout=WAIT_S, return_when=cf.ALL_COMPLETED)
    resolver.result(WAIT_S)
    assert done == set(fs)
    assert not_done == set()
    assert all(f._waiter_list == [] for f in fs)  # wait took its waiter back off


def test_wait_first_completed_returns_the_one_resolved(pool: ThreadPoolExecutor) -> None:
    first, other = _WatchedFuture(1), _WatchedFuture(2)

    def resolve_first() -> None:
        assert first.watched.wait(WAIT_S)
        first.set_result("first")  # type: ignore[arg-type]

    resolver = pool.submit(resolve_first)
    done, not_done = cf.wait([first, other], timeout=WAIT_S, return_when=cf.FIRST_COMPLETED)
    resolver.result(WAIT_S)
    assert done == {first}
    assert not_done == {other}
    assert not other.done()
    assert first._waiter_list == []
    assert other._waiter_list == []


def test_wait_first_completed_returns_at_once_if_one_is_done() -> None:
    finished, pending = _future(1), _future(2)
    finished.set_result("r")  # type: ignore[arg-type]
    done, not_done = cf.wait([finished, pending], timeout=0, return_when=cf.FIRST_COMPLETED)
    assert done == {finished}
    assert not_done == {pending}


def test_wait_first_exception_wakes_on_an_exception(pool: ThreadPoolExecutor) -> None:
    ok, bad, pending = _WatchedFuture(1), _WatchedFuture(2), _WatchedFuture(3)

    def resolve() -> None:
        assert pending.watched.wait(WAIT_S)
        ok.set_result("fine")  # type: ignore[arg-type]
        bad.set_exception(ValueError("bad"))

    resolver = pool.submit(resolve)
    done, not_done = cf.wait([ok, bad, pending], timeout=WAIT_S, return_when=cf.FIRST_EXCEPTION)
    resolver.result(WAIT_S)
    assert done == {ok, bad}
    assert not_done == {pending}


def test_wait_first_exception_with_an_already_finished_future() -> None:
    finished = _future(1)
    finished.set_result("r")  # type: ignore[arg-type]
    returned = threading.Event()

    def call_wait() -> None:
        cf.wait([finished], timeout=WAIT_S, return_when=cf.FIRST_EXCEPTION)
        returned.set()

    # a daemon thread, not the pool: if it deadlocks, it must not hold up the test run
    threading.Thread(target=call_wait, daemon=True).start()
    assert returned.wait(WAIT_S), "cf.wait(FIRST_EXCEPTION) deadlocked on a finished TaskFuture"


def test_as_completed_yields_in_the_order_threads_resolve(pool: ThreadPoolExecutor) -> None:
    fs = [_future(i) for i in range(9)]
    order = [4, 0, 8, 2, 6, 1, 7, 3, 5]
    todo: queue.Queue[int] = queue.Queue()

    def resolver() -> None:
        for _ in fs:
            i = todo.get(timeout=WAIT_S)
            _resolve(fs[i], i % 3)

    worker = pool.submit(resolver)
    todo.put(order[0])
    yielded: list[int] = []
    for f in cf.as_completed(fs, timeout=WAIT_S):
        assert f.done()
        yielded.append(fs.index(f))  # type: ignore[arg-type]
        if len(yielded) < len(order):
            todo.put(order[len(yielded)])  # resolve the next one only now
    worker.result(WAIT_S)
    assert yielded == order
    assert all(f._waiter_list == [] for f in fs)


def test_asyncio_wrap_future_resolves_with_the_result(pool: ThreadPoolExecutor) -> None:
    f = _future(3)
    value = object()

    async def main() -> object:
        wrapped = asyncio.wrap_future(f)
        pool.submit(f.set_result, value)
        return await asyncio.wait_for(wrapped, WAIT_S)

    assert asyncio.run(main()) is value


def test_asyncio_wrap_future_raises_the_exception(pool: ThreadPoolExecutor) -> None:
    f = _future(3)

    async def main() -> object:
        wrapped = asyncio.wrap_future(f)
        pool.submit(f.set_exception, KeyError("gone"))
        return await asyncio.wait_for(wrapped, WAIT_S)

    with pytest.raises(KeyError, match="gone"):
        asyncio.run(main())


def test_cancelling_the_asyncio_task_cancels_the_task_future() -> None:
    told = threading.Event()
    seen: list[int] = []

    def hook(task_id: int) -> None:
        seen.append(task_id)
        told.set()

    f = _future(11, on_cancel=hook)

    async def main() -> None:
        started = asyncio.Event()

        async def await_it() -> object:
            wrapped = asyncio.wrap_future(f)
            started.set()
            return await wrapped

        task = asyncio.create_task(await_it())
        await asyncio.wait_for(started.wait(), WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert told.wait(WAIT_S)
    assert seen == [11]
    assert f.cancelled()


def test_cancelling_the_task_future_from_a_thread_cancels_the_asyncio_side(
    pool: ThreadPoolExecutor,
) -> None:
    seen: list[int] = []
    f = _future(12, on_cancel=seen.append)

    async def main() -> None:
        wrapped = asyncio.wrap_future(f)
        assert pool.submit(f.cancel).result(WAIT_S) is True
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(wrapped, WAIT_S)

    asyncio.run(main())
    assert seen == [12]


def test_wait_and_as_completed_count_a_cancelled_task_future_as_done(
    provider: SimulatedProvider,
) -> None:
    """Nothing executor-like ever calls ``set_running_or_notify_cancel`` on a task's
    future, so ``cancel`` itself must wake ``wait`` and ``as_completed``."""
    provider.configure("m", ModelBehaviour(latency_s=0.2))
    with System(SystemConfig(models=(one_model(provider, max_concurrency=1),))) as system:
        busy = system.submit("occupies the slot")
        cancelled = system.submit("cancelled while it waits")
        waiting = Future[set[Future[Result]]]()
        waiter = threading.Thread(
            target=lambda: waiting.set_result(wait([cancelled], timeout=WAIT_S)[0])
        )
        waiter.start()
        assert cancelled.cancel()
        assert waiting.result(WAIT_S) == {cancelled}  # woke at the cancel, not at WAIT_S
        waiter.join(WAIT_S)
        assert next(as_completed([cancelled], timeout=WAIT_S)) is cancelled
        assert system.drain(WAIT_S)  # the ledger has ended it as Cancelled
        done, _ = wait([busy, cancelled], timeout=WAIT_S)
        assert done == {busy, cancelled}


# -- races: threads blocked inside result() / exception() ---------------------


class _EnrollingCondition(threading.Condition):
    """A Condition that sets ``all_waiting`` when the ``expected``-th thread calls ``wait``.

    A thread calls ``wait`` holding the future's lock, and the lock is released
    only once it is enrolled as a waiter, so whoever sees ``all_waiting`` and then
    takes the lock to change the state finds all of them enrolled.
    """

    def __init__(self, lock: Any, expected: int) -> None:
        super().__init__(lock)
        self.expected = expected
        self.entered = 0  # guarded by the lock: wait() is called holding it
        self.all_waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.entered += 1
        if self.entered == self.expected:
            self.all_waiting.set()
        return super().wait(timeout)


def _enrolling(f: TaskFuture, expected: int) -> _EnrollingCondition:
    cond = _EnrollingCondition(f._condition, expected)  # makes the future's own lock
    f._cond = cond
    return cond


def test_many_blocked_readers_all_get_the_result() -> None:
    threads = 16
    f = _future(1)
    cond = _enrolling(f, threads)
    value = object()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        readers = [pool.submit(f.result, WAIT_S) for _ in range(threads)]
        assert cond.all_waiting.wait(WAIT_S), "the readers never blocked"
        assert not any(r.done() for r in readers)
        f.set_result(value)  # type: ignore[arg-type]
        assert [r.result(WAIT_S) for r in readers] == [value] * threads


def test_many_readers_racing_set_result_all_get_the_result() -> None:
    # no hook: the Condition is built by whichever reader blocks first (if any does)
    threads = 16
    value = object()
    with ThreadPoolExecutor(max_workers=threads + 1) as pool:
        for task_id in range(20):
            f = _future(task_id)
            barrier = threading.Barrier(threads + 1)

            def read(f: TaskFuture = f, barrier: threading.Barrier = barrier) -> object:
                barrier.wait(WAIT_S)
                return f.result(timeout=WAIT_S)

            def write(f: TaskFuture = f, barrier: threading.Barrier = barrier) -> None:
                barrier.wait(WAIT_S)
                f.set_result(value)  # type: ignore[arg-type]

            readers = [pool.submit(read) for _ in range(threads)]
            pool.submit(write).result(WAIT_S)
            assert [r.result(WAIT_S) for r in readers] == [value] * threads


@pytest.mark.parametrize("method", ["result", "exception"])
def test_blocked_reader_gets_cancelled_error_when_cancelled(method: str) -> None:
    seen: list[int] = []
    f = _future(8, on_cancel=seen.append)
    cond = _enrolling(f, 1)
    with ThreadPoolExecutor(max_workers=1) as pool:
        reader = pool.submit(getattr(f, method), WAIT_S)
        assert cond.all_waiting.wait(WAIT_S), "the reader never blocked"
        assert f.cancel() is True
        # the reader raised CancelledError (the outer future itself was not cancelled)
        assert isinstance(reader.exception(WAIT_S), CancelledError)
    assert seen == [8]


def test_blocked_reader_gets_the_exception() -> None:
    f = _future(8)
    cond = _enrolling(f, 2)
    with ThreadPoolExecutor(max_workers=2) as pool:
        raiser = pool.submit(f.result, WAIT_S)
        getter = pool.submit(f.exception, WAIT_S)
        assert cond.all_waiting.wait(WAIT_S)
        error = ValueError("late")
        f.set_exception(error)
        assert raiser.exception(WAIT_S) is error
        assert getter.result(WAIT_S) is error


def test_blocked_reader_times_out_while_pending() -> None:
    f = _future(1)
    with pytest.raises(TimeoutError):
        f.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        f.exception(timeout=0.01)
    assert not f.done()


# -- callbacks that raise -----------------------------------------------------


def test_raising_callback_is_logged_and_later_callbacks_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    f = _future(21)
    calls: list[str] = []

    def bad(fut: Future[Any]) -> None:
        calls.append("bad")
        raise ValueError("callback broke")

    f.add_done_callback(lambda fut: calls.append("before"))
    f.add_done_callback(bad)
    f.add_done_callback(lambda fut: calls.append("after"))
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        f.set_result("r")  # type: ignore[arg-type]
        callbacks_run()
    assert calls == ["before", "bad", "after"]
    [record] = [r for r in caplog.records if r.name == "concurrent.futures"]
    assert record.levelno == logging.ERROR
    assert "exception calling callback" in record.getMessage()
    assert "task=21" in record.getMessage()
    assert record.exc_info is not None
    assert record.exc_info[0] is ValueError


def test_raising_callback_added_after_done_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    f = _future(22)
    assert f.cancel()
    calls: list[str] = []

    def bad(fut: Future[Any]) -> None:
        raise KeyError("late callback broke")

    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        f.add_done_callback(bad)  # runs at once, and must not raise out of here
        f.add_done_callback(lambda fut: calls.append("after"))
    assert calls == ["after"]
    records = [r for r in caplog.records if r.name == "concurrent.futures"]
    assert len(records) == 1
    assert records[0].exc_info is not None
    assert records[0].exc_info[0] is KeyError


def test_raising_callback_on_cancel_still_tells_the_hook(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []
    f = _future(23, on_cancel=seen.append)

    def bad(fut: Future[Any]) -> None:
        raise RuntimeError("callback broke")

    f.add_done_callback(bad)
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        assert f.cancel() is True
        callbacks_run()
    assert seen == [23]
    assert len([r for r in caplog.records if r.name == "concurrent.futures"]) == 1


# -- structure: no Condition unless somebody blocks, few GC objects ------------


def test_future_nobody_waits_on_builds_no_condition() -> None:
    f = _future(1)
    assert f._cond is None
    assert f._callbacks is None
    assert f._waiter_list is None
    f.done()
    f.cancelled()
    f.running()
    repr(f)
    assert f._cond is None
    f.set_result("r")  # type: ignore[arg-type]
    assert f._cond is None
    assert f.result() == "r"
    assert f.result(timeout=0) == "r"
    assert f.exception() is None
    f.add_done_callback(lambda fut: None)
    assert f._cond is None
    assert f._callbacks is None  # never built: the callback ran at once


def test_cancelled_or_failed_future_builds_no_condition() -> None:
    cancelled = _future(1)
    assert cancelled.cancel()
    with pytest.raises(CancelledError):
        cancelled.result()
    assert cancelled._cond is None

    failed = _future(2)
    failed.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        failed.result()
    assert isinstance(failed.exception(), KeyError)
    assert failed._cond is None


def test_condition_is_built_over_the_futures_own_lock() -> None:
    f = _future(1)
    with pytest.raises(TimeoutError):
        f.result(timeout=0)  # blocking (even for no time) builds it
    assert isinstance(f._cond, threading.Condition)
    with f._cond:
        assert f._lock.locked()
    assert f._condition is f._lock  # what wait() and as_completed() lock


def test_wait_and_as_completed_build_no_condition() -> None:
    fs = [_future(i) for i in range(3)]
    for i, f in enumerate(fs):
        if i:
            f.set_result(None)  # type: ignore[arg-type]
    done, pending = cf.wait(fs, timeout=0)
    assert (len(done), pending) == (2, {fs[0]})
    fs[0].set_result(None)  # type: ignore[arg-type]
    assert len(list(cf.as_completed(fs, timeout=WAIT_S))) == 3
    assert all(f._cond is None for f in fs)


def test_a_future_nobody_waits_on_makes_no_lock() -> None:
    answered, cancelled, called = _future(1), _future(2), _future(3)
    called.add_done_callback(lambda fut: None)
    for f in (answered, cancelled, called):
        f.done()
        f.running()
        repr(f)
    answered.set_result("r")  # type: ignore[arg-type]
    assert answered.result() == "r"
    assert answered.exception(timeout=0) is None
    answered.add_done_callback(lambda fut: None)
    assert cancelled.cancel()
    with pytest.raises(CancelledError):
        cancelled.result()
    called.set_exception(KeyError("k"))
    assert isinstance(called.exception(), KeyError)
    assert [f._lock for f in (answered, cancelled, called)] == [None, None, None]


def test_a_waiter_makes_the_futures_own_lock_and_it_guards_from_then_on() -> None:
    blocked, waited = _future(1), _future(2)
    with pytest.raises(TimeoutError):
        blocked.result(timeout=0)
    assert cf.wait([waited], timeout=0).not_done == {waited}
    for f in (blocked, waited):
        lock = f._lock
        assert lock is not None
        assert f._condition is lock
        f.set_result("r")  # type: ignore[arg-type]
        assert f._lock is lock  # made once, never replaced
        assert f.result(timeout=0) == "r"


def test_futures_change_state_while_their_lock_is_being_made() -> None:
    # One thread finishes each future, one cancels it, one adds a callback, one waits on
    # it (wait() makes the future's lock): whatever guard each change meets (the shared
    # stripe before the lock exists, the lock after), exactly one of finish and cancel
    # wins, the waiter wakes, and the callback runs once.
    workers = 4
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for task_id in range(100):
            f = _future(task_id)
            calls: list[object] = []
            barrier = threading.Barrier(workers)

            def add(
                f: TaskFuture = f, barrier: threading.Barrier = barrier, calls: list[object] = calls
            ) -> None:
                barrier.wait(WAIT_S)
                f.add_done_callback(calls.append)

            def waiter(f: TaskFuture = f, barrier: threading.Barrier = barrier) -> bool:
                barrier.wait(WAIT_S)
                return f in cf.wait([f], timeout=WAIT_S).done

            running = [
                pool.submit(_finish_at, barrier, f),
                pool.submit(_cancel_at, barrier, f),
                pool.submit(add),
                pool.submit(waiter),
            ]
            finished, cancelled, _, woke = (r.result(WAIT_S) for r in running)
            callbacks_run()
            assert finished != cancelled
            assert woke
            assert f.cancelled() == cancelled
            assert calls == [f]


class _AnnouncingLock:
    """A lock that sets ``tried`` when a thread takes it through ``acquire`` (or
    ``with``); the test takes ``raw``, the lock itself, unannounced."""

    def __init__(self) -> None:
        self.raw = threading.Lock()
        self.tried = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.tried.set()
        return self.raw.acquire(blocking, timeout)

    def release(self) -> None:
        self.raw.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()


def test_a_change_waiting_for_the_stripe_takes_the_lock_made_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stripe, own = _AnnouncingLock(), _AnnouncingLock()
    monkeypatch.setattr(future_module, "_STRIPES", (stripe,) * len(future_module._STRIPES))
    f = _future(1)
    stripe.raw.acquire()  # the test stands where _own_lock does: holding the stripe
    with ThreadPoolExecutor(max_workers=1) as pool:
        finishing = pool.submit(f.set_result, "r")
        assert stripe.tried.wait(WAIT_S)  # set_result found no lock: it waits for the stripe
        f._lock = own  # type: ignore[assignment]  # made, as _own_lock makes it...
        own.raw.acquire()  # ...and taken, as a waiter takes it to enrol
        stripe.raw.release()
        assert own.tried.wait(WAIT_S)  # set_result turned to the lock made meanwhile
        assert not f.done()  # and changed nothing while the waiter held it
        own.raw.release()
        finishing.result(WAIT_S)
    assert f.result(timeout=0) == "r"


def test_a_future_is_copied_but_never_pickled_as_a_standard_one() -> None:
    # a pickled future would be a handle nobody resolves: the standard one refuses
    # through its lock, a TaskFuture refuses whether or not it has made its lock
    waited = _future(2)
    with pytest.raises(TimeoutError):
        waited.result(timeout=0)  # made its lock
    for f in (_future(1), waited, Future()):
        for refused in (pickle.dumps, copy.deepcopy):
            with pytest.raises(TypeError, match="pickle"):
                refused(f)
    done = _future(3)
    done.set_result("r")  # type: ignore[arg-type]
    twin = copy.copy(done)
    assert type(twin) is TaskFuture
    assert (twin.task_id, twin.trace_id, twin.result(timeout=0)) == (3, "trace-3", "r")


def test_task_future_keeps_its_state_in_slots() -> None:
    f = _future(1)
    assert isinstance(f, Future)
    assert f.task_id == 1
    assert f.trace_id == "trace-1"
    assert set(TaskFuture.__slots__) >= {"_cond", "_lock", "_st", "_res", "_exc", "task_id"}


def _tracked_objects_added(make: Callable[[int], object], n: int) -> tuple[int, list[object]]:
    keep: list[object] = []
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for i in range(n):
            keep.append(make(i))  # noqa: PERF401 -- a comprehension would add its own objects
        added = len(gc.get_objects()) - before
    finally:
        gc.enable()
    return added, keep


def test_a_thousand_task_futures_add_at_most_two_gc_objects_each() -> None:
    n = 1000
    added, keep = _tracked_objects_added(lambda i: TaskFuture(i, "trace"), n)
    assert len(keep) == n
    assert added <= 2 * n, f"{added / n:.2f} GC-tracked objects per TaskFuture"
    # the measurement itself works: the standard Future adds many more
    std_added, std_keep = _tracked_objects_added(lambda i: Future(), n)
    assert len(std_keep) == n
    assert std_added > added


# -- repr ---------------------------------------------------------------------


def _futures_in_every_state() -> Iterator[tuple[TaskFuture, str, str]]:
    """``(future, state description, tail)`` for each state a future can be in."""
    yield _future(42), "pending", ""
    running = _future(42)
    running.set_running_or_notify_cancel()
    yield running, "running", ""
    cancelled = _future(42)
    cancelled.cancel()
    yield cancelled, "cancelled", ""
    notified = _future(42)
    notified.cancel()
    notified.set_running_or_notify_cancel()
    yield notified, "cancelled", ""
    finished = _future(42)
    finished.set_result(3.5)  # type: ignore[arg-type]
    yield finished, "finished", " returned float"
    failed = _future(42)
    failed.set_exception(ZeroDivisionError())
    yield failed, "finished", " raised ZeroDivisionError"


def test_repr_names_task_and_state() -> None:
    for f, state, tail in _futures_in_every_state():
        assert repr(f) == f"<TaskFuture task=42 state={state}{tail}>"


class _Hostile:
    """A result whose own repr and str blow up."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")

    __str__ = __repr__


@pytest.mark.parametrize("task_id", [0, -1, 2**70, None, "abc", "task\nid"])
def test_repr_never_raises(task_id: Any) -> None:
    f = TaskFuture(task_id, "")
    assert f"task={task_id}" in repr(f)
    f.set_result(_Hostile())  # type: ignore[arg-type]
    assert repr(f).endswith("state=finished returned _Hostile>")


def test_repr_does_not_take_the_lock() -> None:
    # _finish formats repr(self) while holding the lock; repr must not need it
    f = _future(5)
    with f._condition:  # its own lock, made now
        assert "task=5" in repr(f)
    f.set_result("r")  # type: ignore[arg-type]
    with pytest.raises(InvalidStateError, match=r"task=5 state=finished"):
        f.set_result("again")  # type: ignore[arg-type]


def test_repr_inside_hook_and_callbacks() -> None:
    reprs: list[str] = []
    f = _future(6, on_cancel=lambda task_id: reprs.append(repr(f)))
    f.add_done_callback(lambda fut: reprs.append(repr(fut)))
    f.cancel()
    callbacks_run()
    assert reprs == ["<TaskFuture task=6 state=cancelled>"] * 2


def test_module_logs_where_the_standard_future_does() -> None:
    assert future_module.log is logging.getLogger("concurrent.futures")


def test_a_ctrl_c_as_the_main_thread_takes_a_stripe_does_not_leave_it_taken() -> None:
    """A ``KeyboardInterrupt`` handled just after ``_guard`` took the shared stripe (a
    Python ``acquire()``, then a check for signals before the ``try``) left that
    stripe taken for good: every future on it then hung whoever resolved it (a host
    stopped by Ctrl-C hung at its ``with System()``'s exit). Taken by ``with``, it is
    given back as the exception leaves."""
    future = TaskFuture(1, "t")
    stripe = future_module._STRIPES[id(future) >> 4 & future_module._STRIPE_OF]
    interrupted_taking(stripe, {"_guard", "_add"}, lambda: future.add_done_callback(_nothing))


def _nothing(_future: Any) -> None:
    """A done-callback that does nothing."""
