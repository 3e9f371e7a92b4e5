"""The SQLite ledger (runtime/sqlite_ledger.py): every accepted task and every outcome
delivered is durable before anyone sees it. A process killed with SIGKILL loses
nothing and resumes the rest; a full disk never delivers an outcome that is not in
the file; idempotency keys hold across restarts; a ledger in use, a corrupt file, rows
that do not decode, another application's database or metadata that is not JSON is a
typed error that leaks nothing; ``rebuild`` keeps every row that still reads.

Real parts throughout: a real ``System``, a real SQLite file, the simulated provider
over loopback, subprocesses killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from callboard.bench.provider_process import ProviderProcess
from callboard.messages import CallboardError, Cancelled, Completed, Expired, Request, Result, Task
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime import sqlite_ledger
from callboard.runtime.codec import request_digest, result_to_json
from callboard.runtime.ledger import Ledger
from callboard.runtime.sqlite_ledger import (
    Kept,
    LedgerDamagedError,
    LedgerError,
    LedgerTooNewError,
    NotALedgerError,
    SqliteLedger,
    rebuild,
)
from support import (
    WAIT_S,
    WrappedConnection,
    accept_one,
    accepted_by_a_dead_process,
    damaged_commits,
    finish_one,
    requests_seen,
    two_models,
    wait_until,
)

import callboard
from callboard import InvalidRequestError, System, SystemConfig, UnknownModelError

SHORT_S = 5.0
"""How long a future that should resolve promptly is given."""
HANG_S = 1.5
"""How long a future that a bug leaves hanging is given (a fixed one takes ms)."""

TESTS = Path(__file__).parents[1]


def config(provider: SimulatedProvider) -> SystemConfig:
    return SystemConfig(models=two_models(provider.base_url))


def stored(path: Path) -> list[tuple[int, str | None, bool]]:
    ledger = SqliteLedger(path)
    try:
        return [(s.task_id, s.key, s.result is not None) for s in ledger.stored()]
    finally:
        ledger.close()


def run_child(code: str, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603 - our own interpreter and code
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=TESTS,
        check=False,
    )


CHILD_KILLED_MID_RUN = """
import os, signal, sys, threading
sys.path.insert(0, ".")
from support import two_models
from callboard import System, SystemConfig

base_url, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
cb = System(SystemConfig(models=two_models(base_url, max_concurrency=4)), ledger=path)
lock = threading.Lock()

def report(future):
    r = future.result()
    with lock:
        print(f"{r.task_id} {type(r).__name__} {r.text}", flush=True)

futures = cb.submit_many([f"prompt {i}" for i in range(n)], model="alpha")
for i, f in enumerate(futures):
    f.add_done_callback(report)
threading.Event().wait()  # killed by the parent
"""


def test_sigkill_with_calls_in_flight_and_retries_pending_loses_nothing(tmp_path: Path) -> None:
    """Every result a caller saw is the one in the file; the rest resume; none twice."""
    n = 40
    path = tmp_path / "kill.db"
    with ProviderProcess(
        latency_s=0.02,
        seed=5,
        models={"alpha": {"error_rate": 0.2}, "beta": {}},
    ) as proc:
        child = subprocess.Popen(  # noqa: S603
            [
                sys.executable,
                "-c",
                textwrap.dedent(CHILD_KILLED_MID_RUN),
                proc.base_url,
                str(path),
                str(n),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=TESTS,
        )
        seen: dict[int, str] = {}
        try:
            assert child.stdout is not None
            for line in child.stdout:
                task_id, kind, text = line.rstrip("\n").split(" ", 2)
                assert kind == "Completed"
                seen[int(task_id)] = text
                if len(seen) >= 10:
                    break
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait(SHORT_S)
            assert child.stdout is not None
            child.stdout.close()
        assert len(seen) >= 10

        ledger = SqliteLedger(path)
        rows = {s.task_id: s for s in ledger.stored()}
        ledger.close()
        assert sorted(rows) == list(range(1, n + 1)), "every accepted task is in the file"
        for task_id, text in seen.items():  # delivered => durable, with that very result
            result = rows[task_id].result
            assert result is not None
            assert result.text == text

        with System(
            SystemConfig(models=two_models(proc.base_url, max_concurrency=8)), ledger=path
        ) as cb:
            resumed = cb.resume()
            results = [f.result(20) for f in resumed]
        assert sorted(r.task_id for r in results) == sorted(
            t for t, s in rows.items() if s.result is None
        ), "exactly the tasks without a durable outcome are sent again"
        assert all(r.ok for r in results)
    assert all(done for _, _, done in stored(path))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_ledger_file_keeps_one_identity_across_processes_and_each_file_its_own(
    tmp_path: Path,
) -> None:
    """What tells a cluster's queue that a process took a ledger over from one that held
    it (``QueueShell.succeed``): the same for every opening of one file, another for
    another file, none for a ledger in memory."""
    first = SqliteLedger(tmp_path / "a.db")
    identity = first.identity
    first.close()
    again = SqliteLedger(tmp_path / "a.db")
    other = SqliteLedger(tmp_path / "b.db")
    try:
        assert identity is not None
        assert again.identity == identity
        assert other.identity not in (None, identity)
    finally:
        again.close()
        other.close()
    assert Ledger().identity is None


def test_unserialisable_nested_metadata_does_not_kill_the_ledger_writer(
    provider: SimulatedProvider, tmp_path: Path
) -> None:
    cb = System(config(provider), ledger=tmp_path / "meta.db")
    try:
        with pytest.raises(InvalidRequestError, match="metadata cannot be stored as JSON"):
            cb.submit("x", metadata={"nested": {(1, 2): "tuple key"}}, model="alpha")
        later = cb.submit("y", model="alpha")
        assert later.result(HANG_S).ok  # the writer lives on
    finally:
        cb.stop(timeout=0.5)


def test_a_record_that_cannot_be_written_costs_no_other_its_place(tmp_path: Path) -> None:
    """A record the writer cannot write (here an integer of 700 digits once the host
    lowered Python's limit to 640) failed its whole group: other tasks finished and
    never written were called again by ``resume`` (found by a hunt). Only it is lost."""
    path = tmp_path / "group.db"
    ledger = SqliteLedger(path)
    tasks = [
        Task(
            task_id=ledger.next_id(),
            trace_id=f"t{i}",
            request=Request.of(f"task {i}", metadata={"n": 10**700 if i == 2 else i}),
            submitted_at=0,
        )
        for i in range(5)
    ]
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        assert ledger.accept_all(tasks, None) == [None] * 5
        done = [(t, Completed(task_id=t.task_id, trace_id=t.trace_id, content="ok")) for t in tasks]
        assert len(ledger.finish_all(done)) == 5  # every outcome delivered
        ledger.close()
    finally:
        sys.set_int_max_str_digits(limit)
    reopened = SqliteLedger(path)
    rows = {row.task_id: row for row in reopened.stored()}
    reopened.close()
    assert sorted(rows) == [t.task_id for i, t in enumerate(tasks) if i != 2]
    assert all(row.result is not None for row in rows.values())


def test_idempotency_key_is_honoured_across_a_restart(
    provider: SimulatedProvider, tmp_path: Path
) -> None:
    path = tmp_path / "keys.db"
    with System(config(provider), ledger=path) as cb:
        first = cb.submit("hello", idempotency_key="K", model="alpha").result(SHORT_S)
        again = cb.submit("hello", idempotency_key="K", model="alpha").result(SHORT_S)
    assert first.ok
    assert not again.ok
    calls = requests_seen(provider)
    with System(config(provider), ledger=path) as cb:
        after = cb.submit("hello", idempotency_key="K", model="alpha").result(SHORT_S)
    assert requests_seen(provider) == calls, "a finished key was sent to the provider again"
    assert type(after) is type(again) or after.text == first.text


def test_writes_that_fail_are_answered_and_counted_as_not_durable(
    provider: SimulatedProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged page makes every commit fail: the callers get their results all the
    same (logged, NOT durable), and the ledger counts them, so a run can say it was not
    crash-safe (it said nothing of it; found by a hunt)."""
    damaged_commits(monkeypatch)
    path = tmp_path / "bad.db"
    with System(config(provider), ledger=path) as cb:
        results = [f.result(SHORT_S) for f in cb.submit_many(["a", "b", "c"], model="alpha")]
        ledger = cb.ledger
    assert all(r.ok for r in results)
    assert isinstance(ledger, SqliteLedger)
    assert ledger.not_durable >= 6, "three accepts and three results"
    monkeypatch.undo()
    assert stored(path) == []


def test_resume_twice_resolves_every_future(provider: SimulatedProvider, tmp_path: Path) -> None:
    path = tmp_path / "twice.db"
    accepted_by_a_dead_process(path, *(Request.of(f"lost {i}", model="beta") for i in range(2)))
    cb = System(config(provider), ledger=path)
    first = cb.resume()
    second = cb.resume()  # what the first resumed is on its way: nothing is sent twice
    assert len(first) == 2
    assert second == []
    try:
        for f in first:
            assert f.result(SHORT_S).ok
    finally:
        cb.stop(timeout=0.5)


def test_second_system_on_a_live_ledger_never_drops_an_accepted_task(
    provider: SimulatedProvider, tmp_path: Path
) -> None:
    path = tmp_path / "shared.db"
    with System(config(provider), ledger=path) as a:
        assert a.submit("a1", model="alpha").result(SHORT_S).ok
        try:
            b = System(config(provider), ledger=path)
        except CallboardError:
            return  # refusing a ledger in use is a correct answer
        try:
            ra = a.submit("a2", model="alpha").result(SHORT_S)
            rb = b.submit("b1", model="alpha").result(SHORT_S)
        finally:
            b.stop(timeout=5)
    assert ra.task_id != rb.task_id, "two live tasks share one task id in one ledger"
    assert len(stored(path)) == 3


def test_corrupt_ledger_file_is_a_typed_error_and_leaks_nothing(
    provider: SimulatedProvider, tmp_path: Path
) -> None:
    bad = tmp_path / "corrupt.db"
    bad.write_bytes(b"this is not an sqlite database\n" * 200)
    before = set(threading.enumerate())
    with pytest.raises(CallboardError):
        System(config(provider), ledger=bad)
    leaked = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    for t in leaked:
        t.join(SHORT_S)
    assert [t.name for t in leaked if t.is_alive()] == []
    assert bad.read_bytes() == b"this is not an sqlite database\n" * 200  # nothing lost


CHILD_DISK_FULL = """
import json, os, resource, signal, sys, threading
sys.path.insert(0, ".")
from support import requests_seen, two_models
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard import System, SystemConfig

path = sys.argv[1]
with SimulatedProvider(models={"alpha": ModelBehaviour(latency_s=0.01)}, seed=1) as p:
    cb = System(SystemConfig(models=two_models(p.base_url)), ledger=path)
    assert cb.submit("warm", model="alpha").result(10).ok
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail: EFBIG
    limit = os.path.getsize(path + "-wal")
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    futures = []
    def submit():  # each waits for its acceptance's commit, which fails and is retried
        futures.extend(cb.submit("x" * 5000 + str(i), model="alpha") for i in range(5))
    submitting = threading.Thread(target=submit, daemon=True)
    submitting.start()
    submitting.join(1)
    out = []
    for f in list(futures):
        try:
            r = f.result(1)  # a commit that fails holds the outcome: it waits
            out.append([r.task_id, r.ok])
        except Exception as exc:
            out.append([None, type(exc).__name__])
    said = {"answers": out, "returned": len(futures), "sent": requests_seen(p) - 1}
    print(json.dumps(said), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_disk_full_never_delivers_an_outcome_that_is_not_durable(tmp_path: Path) -> None:
    """Nor sends a task whose acceptance is not: the submit waits for its commit, and the
    task goes nowhere meanwhile (it went to its model at once, its acceptance queued)."""
    path = tmp_path / "full.db"
    child = run_child(CHILD_DISK_FULL, str(path))
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    said = json.loads(child.stdout.strip().splitlines()[-1])
    rows = {task_id: done for task_id, _, done in stored(path)}
    for task_id, ok in said["answers"]:
        if ok is True:  # delivered as a success: it must be in the file, finished
            assert rows.get(task_id) is True, f"task {task_id} delivered but not durable"
    assert (said["returned"], said["sent"]) == (0, 0), said


CHILD_DISK_STAYS_FULL = """
import logging, os, resource, signal, sys
sys.path.insert(0, ".")
from support import two_models
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime import sqlite_ledger
from callboard import System, SystemConfig

logging.basicConfig(level=logging.ERROR, format="%(message)s")
sqlite_ledger.RETRY_FOR_S = 0.5  # the window, scaled down: the disk stays full past it
path = sys.argv[1]
with SimulatedProvider(models={"alpha": ModelBehaviour(latency_s=0.01)}, seed=1) as p:
    cb = System(SystemConfig(models=two_models(p.base_url)), ledger=path)
    assert cb.submit("warm", model="alpha").result(10).ok
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = os.path.getsize(path + "-wal")
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    for i in range(4):  # one group each: the next is submitted once the last is delivered
        print("delivered", cb.submit("x" * 5000 + str(i), model="alpha").result(30).ok, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_disk_that_stays_full_holds_outcomes_once_for_the_window_not_per_group(
    tmp_path: Path,
) -> None:
    """Each group of outcomes waited its own RETRY_FOR_S on a disk that stayed full: a
    batch of 2,000 lines stalled for six minutes. The window counts from the first
    failure; after it, each group is tried once and delivered, not durable."""
    child = run_child(CHILD_DISK_STAYS_FULL, str(tmp_path / "full.db"))
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert child.stdout.count("delivered") == 4, child.stdout
    log = child.stderr.splitlines()
    gave_up = [i for i, line in enumerate(log) if "NOT durable" in line]
    assert len(gave_up) >= 3, child.stderr[-2000:]  # the groups after the window's end
    assert not [line for line in log[gave_up[0] :] if "retrying in" in line]


def test_system_resumes_unfinished_tasks_from_the_ledger(
    provider: SimulatedProvider, tmp_path: Path
) -> None:
    path = tmp_path / "ledger.sqlite"
    lost = (Request.of(f"lost {i}", idempotency_key=f"k{i}") for i in range(3))
    accepted_by_a_dead_process(path, *lost)
    probe = SqliteLedger(path)
    assert len(probe.unfinished()) == 3
    probe.close()

    with System(SystemConfig(models=two_models(provider.base_url)), ledger=path) as system:
        futures = system.resume()
        results = [f.result(WAIT_S) for f in futures]
    assert [r.ok for r in results] == [True, True, True]
    reopened = SqliteLedger(path)
    assert reopened.unfinished() == []
    assert [s.result is not None for s in reopened.stored() if s.key == "k1"] == [True]
    reopened.close()


def test_after_a_restart_a_key_whose_task_made_no_call_may_be_used_again(tmp_path: Path) -> None:
    """As in memory (``binds_key``): an expired task that made no call (or whose every
    call the provider refused unserved) frees its key, one that made a call keeps it
    answered, in the next process too."""
    path = tmp_path / "unsent.db"
    ledger = SqliteLedger(path)
    tasks = {}
    for key in ("unsent", "sent", "refused"):
        tasks[key] = Task(
            task_id=ledger.next_id(),
            trace_id=key,
            request=Request.of(key, idempotency_key=key),
            submitted_at=0,
        )
        assert accept_one(ledger, tasks[key]) is None
    for key, attempts, refused in (("unsent", 0, 0), ("sent", 1, 0), ("refused", 2, 2)):
        task = tasks[key]
        ended = Expired(task_id=task.task_id, trace_id=key, attempts=attempts, refused=refused)
        assert finish_one(ledger, task, ended)
    ledger.close()
    ledger = SqliteLedger(path)
    try:  # every call of "refused" was a 429: it ran no more than "unsent" did
        for key, holder in (("unsent", None), ("sent", tasks["sent"].task_id), ("refused", None)):
            again = Task(
                task_id=ledger.next_id(),
                trace_id=f"{key} again",
                request=Request.of(key, idempotency_key=key),
                submitted_at=0,
            )
            assert accept_one(ledger, again) == holder, key
    finally:
        ledger.close()


class _HeldBegin(WrappedConnection):
    """A connection whose first ``BEGIN`` after ``armed`` waits until ``go`` is set: what
    the writer takes meanwhile goes in its next group, together."""

    armed = threading.Event()
    holding = threading.Event()
    go = threading.Event()

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql == "BEGIN" and self.armed.is_set():
            self.armed.clear()
            self.holding.set()
            assert self.go.wait(WAIT_S)
        return super().execute(sql, *args)


def hold_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ledger's writer, from here, waits at its first ``BEGIN`` after
    ``_HeldBegin.armed`` until ``_HeldBegin.go`` (``monkeypatch.undo()`` ends it)."""
    for event in (_HeldBegin.armed, _HeldBegin.holding, _HeldBegin.go):
        event.clear()
    connect = SqliteLedger._connect
    monkeypatch.setattr(SqliteLedger, "_connect", lambda self: _HeldBegin(connect(self)))


def test_a_key_freed_and_taken_again_in_one_commit_keeps_the_new_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task that ends with no call made frees its key (``binds_key``), and a new task may
    take it at once: with the first task's acceptance, its end and the new acceptance in
    one commit, all acceptances went first and the new task's row was never made (the
    key was taken), so a crash before it ended lost it (found by a review)."""
    hold_writer(monkeypatch)
    path = tmp_path / "retaken.db"
    ledger = SqliteLedger(path)
    try:
        _HeldBegin.armed.set()

        def task(name: str, key: str | None) -> Task:
            request = Request.of(name, idempotency_key=key)
            return Task(task_id=ledger.next_id(), trace_id=name, request=request, submitted_at=0)

        # an acceptance returns once committed: each on a thread of its own, as
        # submitters are, while the writer is held
        with ThreadPoolExecutor(3) as pool:
            holder = task("holds the writer", None)
            held = pool.submit(accept_one, ledger, holder)
            assert _HeldBegin.holding.wait(WAIT_S)
            first, second = task("first", "K"), task("second", "K")
            accepted = pool.submit(accept_one, ledger, first)
            # queued for the writer, not only accepted in memory: the end must come after
            assert wait_until(lambda: ledger._accepts_queued == 2)
            assert finish_one(ledger, first, Expired(task_id=first.task_id, trace_id="first"))
            retaken = pool.submit(accept_one, ledger, second)
            assert wait_until(lambda: ledger._accepts_queued == 3)
            _HeldBegin.go.set()  # the three go in the next commit, together
            assert held.result(WAIT_S) is None
            assert accepted.result(WAIT_S) is None
            assert retaken.result(WAIT_S) is None, "the key is free: it made no call"
    finally:
        _HeldBegin.go.set()
        ledger.close()
    monkeypatch.undo()
    reopened = SqliteLedger(path)
    try:
        assert [t.task_id for t in reopened.unfinished()] == [holder.task_id, second.task_id]
    finally:
        reopened.close()


def test_a_task_goes_nowhere_before_its_acceptance_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit returns once the file holds the task, and nothing is sent before: its
    acceptance was queued for the writer and the task went to its model at once, so a
    process killed before the group's commit had sent a call for a task the file never
    held, and ``resume`` never answered it (found by a hunt)."""
    hold_writer(monkeypatch)
    with SimulatedProvider(models={"alpha": ModelBehaviour(latency_s=0.01)}, seed=1) as p:
        cb = System(SystemConfig(models=two_models(p.base_url)), ledger=tmp_path / "t.db")
        try:
            _HeldBegin.armed.set()
            with ThreadPoolExecutor(1) as pool:
                submitted = pool.submit(cb.submit, "hi", model="alpha")
                assert _HeldBegin.holding.wait(WAIT_S)
                assert not wait_until(lambda: requests_seen(p) > 0, timeout=0.5)
                assert not submitted.done()
                _HeldBegin.go.set()
                assert submitted.result(WAIT_S).result(WAIT_S).ok
        finally:
            _HeldBegin.go.set()
            cb.stop()


def test_a_submit_on_an_event_loop_does_not_wait_for_its_acceptances_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``AsyncSystem``'s submit runs on its loop's thread: waiting there for the
    writer held every request and stream of the loop, as long as a full disk's retries
    (60 s; a review). On a loop's thread an acceptance returns before the file holds it;
    on any other thread, once it does."""
    hold_writer(monkeypatch)
    path = tmp_path / "loop.db"
    ledger = SqliteLedger(path)

    async def accept_on_the_loop(task: Task) -> list[int]:
        assert accept_one(ledger, task) is None
        with contextlib.closing(sqlite3.connect(path)) as db:  # another reader, as a restart
            return [row[0] for row in db.execute("SELECT task_id FROM tasks")]

    try:
        _HeldBegin.armed.set()
        task = Task(
            task_id=ledger.next_id(), trace_id="t", request=Request.of("hi"), submitted_at=0
        )
        assert asyncio.run(accept_on_the_loop(task)) == [], "returned before the commit"
        assert _HeldBegin.holding.wait(WAIT_S)
    finally:
        _HeldBegin.go.set()
        ledger.close()
    assert [task_id for task_id, _, _ in stored(path)] == [task.task_id]


def test_a_task_submitted_on_an_event_loop_goes_nowhere_before_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The submit does not wait on the loop's thread; the sending does: an
    ``AsyncSystem``'s (or the gateway's) task went to its model at once, and a process
    killed before its group's commit had sent a call for a task the file never held
    (a gap the docs owned to until this)."""
    hold_writer(monkeypatch)
    path = tmp_path / "async.db"

    async def main(p: SimulatedProvider) -> bool:
        config = SystemConfig(models=two_models(p.base_url))
        async with callboard.AsyncSystem(config, ledger=path) as cb:
            _HeldBegin.armed.set()
            answer = asyncio.ensure_future(cb.submit("hi", model="alpha"))
            assert await asyncio.to_thread(_HeldBegin.holding.wait, WAIT_S)
            sent = await asyncio.to_thread(wait_until, lambda: requests_seen(p) > 0, 0.5)
            assert not sent, "sent before the file held it"
            assert not answer.done()
            _HeldBegin.go.set()
            return (await asyncio.wait_for(answer, WAIT_S)).ok

    with SimulatedProvider(models={"alpha": ModelBehaviour(latency_s=0.01)}, seed=1) as p:
        try:
            assert asyncio.run(main(p))
        finally:
            _HeldBegin.go.set()
    assert [task_id for task_id, _, _ in stored(path)] == [1]


def test_an_outcome_a_held_send_gives_as_the_ledger_closes_is_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A send held for a commit runs on the writer as the ledger closes: one that ends
    its tasks then (the system stopped: ``Rejected``) queued their outcomes behind the
    writer's end, and their futures waited for good (found by a review)."""
    from callboard.messages import Rejected, RejectReason, TaskFuture

    hold_writer(monkeypatch)
    ledger = SqliteLedger(tmp_path / "closing.db")
    future = TaskFuture(1, "t")
    task = Task(
        task_id=ledger.next_id(),
        trace_id="t",
        request=Request.of("hi"),
        submitted_at=0,
        future=future,
    )
    ended = Rejected(task_id=task.task_id, trace_id="t", reason=RejectReason.STOPPING)
    _HeldBegin.armed.set()

    def send(held: bool) -> None:  # as a stop meets it: the tasks end here
        assert held
        ledger.finish_all([(task, ended)])

    async def accept_on_the_loop() -> None:  # no wait there: the send is held
        assert accept_one(ledger, task) is None
        ledger.when_accepted(send)

    asyncio.run(accept_on_the_loop())
    assert _HeldBegin.holding.wait(WAIT_S)
    closing = threading.Thread(target=ledger.close)
    closing.start()
    assert wait_until(lambda: ledger._queue.qsize() >= 1)  # its end is queued
    _HeldBegin.go.set()
    closing.join(WAIT_S)
    assert future.result(WAIT_S) is ended


def test_a_ledger_whose_caller_holds_its_tasks_does_not_wait_for_acceptances(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``durable_accepts=False`` (``callboard run``'s: its input holds every line): an
    acceptance returns while the writer is held, and is in the file once it goes on."""
    hold_writer(monkeypatch)
    path = tmp_path / "run.db"
    ledger = SqliteLedger(path, durable_accepts=False)
    try:
        _HeldBegin.armed.set()
        tasks = [
            Task(task_id=ledger.next_id(), trace_id=n, request=Request.of(n), submitted_at=0)
            for n in ("a", "b")
        ]
        assert accept_one(ledger, tasks[0]) is None
        assert _HeldBegin.holding.wait(WAIT_S)
        assert accept_one(ledger, tasks[1]) is None  # the writer is held: no wait
    finally:
        _HeldBegin.go.set()
        ledger.close()
    monkeypatch.undo()
    assert [task_id for task_id, _, _ in stored(path)] == [t.task_id for t in tasks]


def test_a_ledger_interrupted_while_it_opens_lets_its_lock_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while a large ledger was read at its opening kept its lock for the rest
    of the process: a notebook's retry found the ledger in use (found by a hunt)."""
    path = tmp_path / "big.db"
    SqliteLedger(path).close()

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(sqlite_ledger, "_check_pages", interrupted)
        with pytest.raises(KeyboardInterrupt):
            SqliteLedger(path)
    SqliteLedger(path).close()


def test_a_key_accepted_again_after_a_cancel_takes_over_its_row(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    ledger = SqliteLedger(path)
    first = Task(
        task_id=ledger.next_id(),
        trace_id="t1",
        request=Request.of("old", idempotency_key="K"),
        submitted_at=0,
    )
    assert accept_one(ledger, first) is None
    assert finish_one(ledger, first, Cancelled(task_id=first.task_id, trace_id="t1"))
    ledger.close()
    ledger = SqliteLedger(path)  # a cancelled key may be used again after a restart
    again = Task(
        task_id=ledger.next_id(),
        trace_id="t2",
        request=Request.of("new", idempotency_key="K"),
        submitted_at=0,
    )
    assert accept_one(ledger, again) is None
    ledger.close()
    reopened = SqliteLedger(path)
    (row,) = reopened.stored()
    reopened.close()
    assert (row.task_id, row.request.messages[0].content, row.result) == (
        again.task_id,
        "new",
        None,
    )


def test_a_system_that_fails_to_start_releases_its_ledger(tmp_path: Path) -> None:
    path = tmp_path / "released.db"
    with pytest.raises(UnknownModelError):
        System(SystemConfig(escalate_to="nope"), ledger=path)
    with System(ledger=path) as system:  # the file is not held by the failed one
        assert system.submit("hi").result(WAIT_S).ok


# -- files that are not a usable ledger ------------------------------------------------------


def finished_ledger(path: Path, *keys: str) -> None:
    """A ledger at ``path`` with one completed task per key."""
    ledger = SqliteLedger(path)
    try:
        finish_keys(ledger, *keys)
    finally:
        ledger.close()


def finish_keys(ledger: SqliteLedger, *keys: str) -> None:
    """One completed task per key, in ``ledger``."""
    for key in keys:
        task = Task(
            task_id=ledger.next_id(),
            trace_id=f"t-{key}",
            request=Request.of(f"ask {key}", idempotency_key=key),
            submitted_at=0,
        )
        assert accept_one(ledger, task) is None
        done = Completed(task_id=task.task_id, trace_id=task.trace_id, content=f"re {key}")
        assert finish_one(ledger, task, done)


def test_the_keys_remembered_are_the_newest_whatever_the_clock_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest ``remember_keys`` were ranked by when they finished, by the wall
    clock: keys finished while it ran a year ahead outranked the newest after NTP set it
    right, whose retry was then sent and billed again (a hunt)."""
    path = tmp_path / "clock.db"
    ledger = SqliteLedger(path, remember_keys=2)
    try:
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 365 * 86_400)
        finish_keys(ledger, "k1", "k2")
        monkeypatch.setattr(time, "time", real)
        finish_keys(ledger, "k3")
    finally:
        ledger.close()
    ledger = SqliteLedger(path, remember_keys=2)
    try:
        remembered = {
            key
            for key in ("k1", "k2", "k3")
            if accept_one(
                ledger,
                Task(
                    task_id=ledger.next_id(),
                    trace_id=key,
                    request=Request.of(f"ask {key}", idempotency_key=key),
                    submitted_at=0,
                ),
            )
            is not None
        }
    finally:
        ledger.close()
    assert remembered == {"k2", "k3"}


def damage(path: Path, key: str, column: str, text: str) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute(f"UPDATE tasks SET {column} = ? WHERE key = ?", (text, key))  # noqa: S608


@pytest.mark.parametrize("column", ["result", "request"])
def test_rows_that_do_not_decode_are_a_typed_error_naming_them(tmp_path: Path, column: str) -> None:
    path = tmp_path / "rows.db"
    finished_ledger(path, "a", "b", "c")
    damage(path, "b", column, "{bad")
    damage(path, "c", column, '{"type": "Completed"}')
    ledger = SqliteLedger(path)  # opening reads no JSON: the damage shows when rows are read
    try:
        with pytest.raises(LedgerDamagedError) as caught:
            ledger.stored()
    finally:
        ledger.close()
    message = str(caught.value)
    assert str(path) in message
    assert "2 of its rows cannot be read" in message
    assert "key 'b'" in message
    assert "key 'c'" in message
    assert "key 'a'" not in message


def test_kept_names_rows_whose_request_or_result_is_not_json_and_reads_no_result(
    tmp_path: Path,
) -> None:
    """``kept`` checks a result's JSON in SQLite and reads out its type only: text that
    is not JSON is found at once, a JSON of the wrong shape when that result is read."""
    path = tmp_path / "kept.db"
    finished_ledger(path, "a", "b", "c", "d")
    damage(path, "b", "result", "{bad")
    damage(path, "c", "request", '{"type": "Completed"}')
    damage(path, "d", "result", '{"type": "Completed"}')
    ledger = SqliteLedger(path)
    try:
        with pytest.raises(LedgerDamagedError) as caught:
            ledger.kept()
        message = str(caught.value)
        assert "2 of its rows cannot be read" in message
        assert "key 'b'" in message
        assert "key 'c'" in message
        with pytest.raises(LedgerDamagedError, match="key 'd'"):
            ledger.kept_result("d")
        assert isinstance(ledger.kept_result("a"), Completed)
    finally:
        ledger.close()


def test_kept_is_each_keys_final_digest_and_type_and_kept_result_reads_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "index.db"
    finished_ledger(path, "a", "b")
    accepted_by_a_dead_process(path, Request.of("unanswered", idempotency_key="u"))
    with contextlib.closing(sqlite3.connect(path)) as db, db:  # a cancelled one is not final
        db.execute(
            "UPDATE tasks SET result = ? WHERE key = 'b'",
            (result_to_json(Cancelled(task_id=2, trace_id="t-b")),),
        )
    decoded: list[str] = []
    real = sqlite_ledger.result_from_json

    def counting(text: str) -> Result:
        decoded.append(text)
        return real(text)

    monkeypatch.setattr(sqlite_ledger, "result_from_json", counting)
    ledger = SqliteLedger(path)
    try:
        assert ledger.kept() == {
            "a": Kept("a", request_digest(Request.of("ask a", idempotency_key="a")), "Completed")
        }
        assert decoded == [], "no result is decoded to index them"
        result = ledger.kept_result("a")
        assert isinstance(result, Completed)
        assert result.content == "re a"
        assert len(decoded) == 1
        assert ledger.kept_result("b") is None, "cancelled"
        assert ledger.kept_result("u") is None, "unanswered"
        assert ledger.kept_result("nobody") is None
    finally:
        ledger.close()


def test_results_kept_are_read_on_one_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh connection a result (1 ms each) made a run writing 300,000 results back
    from its ledger take three minutes (a hunt): one connection reads them all, and is
    closed with the ledger."""
    path = tmp_path / "reads.db"
    finished_ledger(path, *(f"k{i}" for i in range(20)))
    made: list[sqlite3.Connection] = []
    connect = SqliteLedger._connect

    def counted(self: SqliteLedger, **options: Any) -> sqlite3.Connection:
        made.append(connect(self, **options))
        return made[-1]

    ledger = SqliteLedger(path)
    monkeypatch.setattr(SqliteLedger, "_connect", counted)
    try:
        assert all(isinstance(ledger.kept_result(f"k{i}"), Completed) for i in range(20))
        assert len(made) == 1
    finally:
        ledger.close()
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        made[0].execute("SELECT 1")


def test_a_file_that_is_not_a_database_is_damaged_and_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "garbage.db"
    garbage = os.urandom(4096)
    path.write_bytes(garbage)
    with pytest.raises(LedgerDamagedError, match="not a SQLite database"):
        SqliteLedger(path)
    assert path.read_bytes() == garbage


def test_a_ledger_locked_by_another_process_is_said_to_be_locked_not_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sqlite3 shell holding a write transaction: the run said the healthy ledger was
    damaged and advised --rebuild-ledger, which set it aside while the shell had it
    open (found by a hunt)."""
    path = tmp_path / "locked.db"
    SqliteLedger(path).close()
    monkeypatch.setattr(sqlite_ledger, "BUSY_TIMEOUT_S", 0.1)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as shell:
        shell.execute("BEGIN EXCLUSIVE")
        with pytest.raises(LedgerError, match="another process holds it locked") as info:
            SqliteLedger(path)
        assert not isinstance(info.value, LedgerDamagedError)
        assert "rebuild" not in str(info.value)
        shell.execute("ROLLBACK")
    SqliteLedger(path).close()  # and it is whole


def test_another_applications_database_is_not_a_ledger_and_is_never_changed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "theirs.db"
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE notes (body TEXT)")
        db.execute("INSERT INTO notes VALUES ('mine')")
    before = path.read_bytes()
    with pytest.raises(NotALedgerError, match="its tables: notes"):
        SqliteLedger(path)
    with pytest.raises(NotALedgerError):
        rebuild(path)
    assert path.read_bytes() == before, "not even its journal mode changed"
    assert not path.with_name("theirs.db.damaged").exists()


def test_a_ledger_a_newer_callboard_wrote_is_refused_as_such_and_left_whole(
    tmp_path: Path,
) -> None:
    """Its rows may hold what this callboard cannot read: each was read as damage and
    its task called again, the run exiting 0 (a rollback; found by a hunt)."""
    path = tmp_path / "newer.db"
    finished_ledger(path, "a")
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (sqlite_ledger.ROW_FORMAT,)
        db.execute(f"PRAGMA user_version = {sqlite_ledger.ROW_FORMAT + 1}")
    before = path.read_bytes()
    for opening in (SqliteLedger, rebuild):
        with pytest.raises(LedgerTooNewError, match="written by a newer callboard") as said:
            opening(path)
        assert str(path) in str(said.value)
        assert "--ledger" in str(said.value)
    assert path.read_bytes() == before
    assert not path.with_name("newer.db.damaged").exists()


def test_a_tasks_table_of_another_shape_is_not_a_ledger(tmp_path: Path) -> None:
    path = tmp_path / "shape.db"
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE tasks (x)")
    with pytest.raises(NotALedgerError, match="not a callboard ledger"):
        SqliteLedger(path)


def test_rebuild_keeps_the_rows_that_read_and_sets_the_file_aside(tmp_path: Path) -> None:
    path = tmp_path / "fix.db"
    finished_ledger(path, "a", "b", "c")
    damage(path, "b", "result", "{bad")
    first = rebuild(path)
    assert (first.aside, first.kept, first.dropped) == (tmp_path / "fix.db.damaged", 2, 1)
    ledger = SqliteLedger(path)
    try:
        assert sorted((s.key, s.result is not None) for s in ledger.stored()) == [
            ("a", True),
            ("c", True),
        ]
        # a key answered before the rebuild stays answered: a duplicate is refused
        again = Task(
            task_id=ledger.next_id(),
            trace_id="t",
            request=Request.of("ask a", idempotency_key="a"),
            submitted_at=0,
        )
        assert isinstance(accept_one(ledger, again), int)
    finally:
        ledger.close()
    second = rebuild(path)  # the first one set aside is kept: the next name is taken
    assert second.aside == tmp_path / "fix.db.damaged-2"
    assert first.aside is not None
    assert first.aside.exists()


CHILD_REBUILD_DISK_FULL = """
import os, resource, signal, sys
sys.path.insert(0, ".")
from callboard.runtime.sqlite_ledger import rebuild

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail: EFBIG
limit = os.path.getsize(sys.argv[1]) // 2  # room to read it (its -shm), not to copy it
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    rebuild(sys.argv[1])
except Exception as exc:
    print("failed:", type(exc).__name__, exc, flush=True)
else:
    print("rebuilt", flush=True)
"""


def test_a_rebuild_the_disk_runs_out_under_leaves_the_old_ledger_in_place(
    tmp_path: Path,
) -> None:
    """The old ledger was set aside before the new one was written: a disk that filled
    up left an empty ledger at the old name, which the next run took as new, sending
    again every task the old one had answered (found by a hunt)."""
    path = tmp_path / "full.db"
    keys = [f"k{i:04d}" for i in range(2000)]
    finished_ledger(path, *keys)
    damage(path, "k0001", "result", "{bad")
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    before = path.read_bytes()
    child = run_child(CHILD_REBUILD_DISK_FULL, str(path))
    assert "failed:" in child.stdout, (child.stdout, child.stderr[-2000:])
    assert path.read_bytes() == before  # where it was, as it was; nothing half-made beside
    assert not [p.name for p in tmp_path.iterdir() if "damaged" in p.name or "rebuil" in p.name]
    done = rebuild(path)  # with room, it goes as it would have
    assert (done.kept, done.dropped) == (1999, 1)
    assert sorted(p.name for p in tmp_path.iterdir() if "lock" not in p.name) == [
        "full.db",
        "full.db.damaged",
    ]


def test_a_rebuild_stopped_between_its_renames_is_finished_when_the_ledger_opens(
    tmp_path: Path,
) -> None:
    """The old ledger set aside, the new one whole beside it, then the process died:
    no ledger at the path, and the next run started an empty one there, sending again
    every task it held (a review). The new one takes its name."""
    path = tmp_path / "cut.db"
    finished_ledger(tmp_path / "cut.db.rebuilding", "a", "b")
    ledger = SqliteLedger(path)
    try:
        assert sorted(s.key for s in ledger.stored()) == ["a", "b"]
    finally:
        ledger.close()
    assert not (tmp_path / "cut.db.rebuilding").exists()


def test_rebuild_reads_past_a_damaged_page_and_counts_what_it_lost(tmp_path: Path) -> None:
    """A scan stopped at the first damaged page: every row after it was lost, and the
    run said none was (found by a hunt on damaged files). A row a damaged page keeps
    from being read is counted; one its scribbled cells hide may go uncounted."""
    path = tmp_path / "paged.db"
    keys = [f"k{i:03d}" for i in range(200)]
    finished_ledger(path, *keys)
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    middle = (pages // 2) * size
    data[middle + 100 : middle + size - 100] = os.urandom(size - 200)  # one leaf, scribbled
    path.write_bytes(bytes(data))
    done = rebuild(path)
    assert done.kept + done.dropped <= len(keys), done
    assert done.kept >= len(keys) * 3 // 4, done  # one page's rows lost, not all after it
    ledger = SqliteLedger(path)
    try:
        stored = {s.key for s in ledger.stored()}
    finally:
        ledger.close()
    assert keys[-1] in stored  # rows after the damaged page were kept
    assert len(stored) == done.kept


def test_a_damaged_index_is_damage_and_a_rebuild_keeps_every_row(tmp_path: Path) -> None:
    """The keys' index overwritten, the table whole: opening read the header and the
    highest id only, so the ledger opened; each result looked up by its key was then
    not found (sent again) and every write failed, in silence (found by a hunt)."""
    path = tmp_path / "index.db"
    keys = [f"k{i:03d}" for i in range(300)]
    finished_ledger(path, *keys)
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (root,) = db.execute(
            "SELECT rootpage FROM sqlite_master WHERE type = 'index' AND tbl_name = 'tasks'"
        ).fetchone()
        size = db.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    data[(root - 1) * size : root * size] = b"\x07" * size
    path.write_bytes(bytes(data))
    with pytest.raises(LedgerDamagedError, match=f"the ledger {path} is damaged"):
        SqliteLedger(path)
    done = rebuild(path)
    assert (done.kept, done.dropped) == (len(keys), 0), done
    ledger = SqliteLedger(path)
    try:
        assert sorted(s.key for s in ledger.stored()) == keys
    finally:
        ledger.close()


@pytest.mark.parametrize("damage", ["cut-to-half", "table-root-overwritten"])
def test_a_rebuild_that_reads_no_row_of_a_real_ledger_says_nobody_knows_how_many(
    tmp_path: Path, damage: str
) -> None:
    """A ledger of 300 rows cut to half its size, or whose table's root page is
    overwritten (its header and schema still read): the rebuild said 0 rows did not
    read (a hunt, then a review)."""
    path = tmp_path / "real.db"
    finished_ledger(path, *(f"k{i:03d}" for i in range(300)))
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'tasks'").fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    if damage == "cut-to-half":
        data = data[: len(data) // 2]
    else:
        data[(root - 1) * size : root * size] = b"\x07" * size
    path.write_bytes(bytes(data))
    done = rebuild(path)
    assert (done.kept, done.dropped) == (0, None), done


def test_rebuild_of_garbage_starts_an_empty_ledger(tmp_path: Path) -> None:
    path = tmp_path / "g.db"
    path.write_bytes(b"\x00garbage" * 100)
    done = rebuild(path)
    assert (done.kept, done.dropped) == (0, None)  # not 0: how many it held, nobody knows
    assert done.aside is not None
    assert done.aside.read_bytes() == b"\x00garbage" * 100
    ledger = SqliteLedger(path)
    try:
        assert ledger.stored() == []
    finally:
        ledger.close()


def test_resume_twice_at_once_submits_each_task_once(
    provider: SimulatedProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ``resume`` calls at the same time: both read the unfinished tasks before either
    submitted, each submitted every one, and of each pair one future was never
    resolved (found by a review). The second waits for the first and finds nothing."""
    path = tmp_path / "together.db"
    accepted_by_a_dead_process(path, *(Request.of(f"lost {i}", model="beta") for i in range(3)))
    cb = System(config(provider), ledger=path)
    real = cb._send
    both = threading.Barrier(2)

    def send(tasks: Any, **options: Any) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):  # (the other waits its turn)
            both.wait(1.0)  # both have read and are about to submit, unless one waits
        real(tasks, **options)

    monkeypatch.setattr(cb, "_send", send)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            calls = [pool.submit(cb.resume) for _ in range(2)]
            futures = [f for call in calls for f in call.result(SHORT_S)]
        results = [f.result(SHORT_S) for f in futures]
        assert sorted(r.task_id for r in results) == [1, 2, 3]
        assert all(r.ok for r in results)
    finally:
        cb.stop(timeout=0.5)


def test_one_ledger_under_two_names_is_used_by_one_system_at_a_time(tmp_path: Path) -> None:
    """A hard link (a ``cp -al`` snapshot of a job's folder) has a ``.lock`` of its own:
    two runs wrote the one file at once, each through its own journal, both exiting 0,
    the file left damaged (found by a hunt)."""
    path = tmp_path / "a.ledger"
    finished_ledger(path, "a")
    other = tmp_path / "elsewhere"
    other.mkdir()
    linked = other / "a.ledger"
    os.link(path, linked)
    first = SqliteLedger(path)
    try:
        with pytest.raises(LedgerError, match=r"under another name .*in this process"):
            SqliteLedger(linked)  # refused by its inode: never opened, and closed
        refused = subprocess.run(  # noqa: S603 - this interpreter, our own code
            [sys.executable, "-c", OPEN_LEDGER, str(linked)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert "under another name" in refused.stdout, refused.stderr
        # refused before SQLite wrote a byte: no journal of its own left to undo the
        # first's work later (a review)
        assert not (other / "a.ledger-wal").exists()
        finish_keys(first, "b")
    finally:
        first.close()
    second = SqliteLedger(linked)  # once the first let go
    try:
        assert sorted(s.key for s in second.stored()) == ["a", "b"]
    finally:
        second.close()


OPEN_LEDGER = """
import sys
from callboard.runtime.sqlite_ledger import LedgerError, SqliteLedger
try:
    SqliteLedger(sys.argv[1]).close()
except LedgerError as exc:
    print(exc)
"""
