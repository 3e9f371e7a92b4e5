"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import selectors
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

from callboard.actors.base import CrashPlan
from callboard.bench.measure import Run, ScenarioResult, percentiles
from callboard.bench.plan import Scale
from callboard.bench.provider_process import stop_child
from callboard.messages import Crash, Job, Request, Task, flush_callbacks
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.ledger import Ledger, Refused

import callboard
from callboard import ModelSettings, Price, Result, System, SystemConfig

WAIT_S = 30.0
"""Upper bound for any wait on a future or event in these tests (never a sleep)."""

POLL_S = 0.002
"""How often ``wait_until`` asks again."""


def wait_until(condition: Callable[[], object], timeout: float = WAIT_S) -> bool:
    """Ask ``condition`` again until it is true; False if it is not within ``timeout``.

    For states no event announces (a file another process writes, a count in an
    actor): each ask reads the state, nothing here stands in for a sync point."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            return bool(condition())
        pause.wait(POLL_S)
    return True


# -- models and systems ---------------------------------------------------------------------


def callbacks_run() -> None:
    """Until the done-callbacks handed to callboard's callback thread so far have run
    (it runs them in order: a last one marks the others done)."""
    assert flush_callbacks(WAIT_S), "the callback thread did not run its callbacks"


def two_models(base_url: str, **overrides: Any) -> tuple[ModelSettings, ModelSettings]:
    fields: dict[str, Any] = {"max_concurrency": 16, **overrides}
    return (
        ModelSettings(name="alpha", base_url=base_url, **fields),
        ModelSettings(name="beta", base_url=base_url, **fields),
    )


ROUTER_ROUTES = callboard.BudgetSettings(total_usd=Decimal(1000))
"""A budget no test spends: with one, every task is routed by the router actor (what a
budget places needs it), not by the front door on the submitting thread."""


def one_model(provider: SimulatedProvider, **fields: Any) -> ModelSettings:
    """Model ``m`` on ``provider``, four calls at a time unless ``fields`` say otherwise."""
    return ModelSettings(name="m", base_url=provider.base_url, **{"max_concurrency": 4, **fields})


@contextlib.contextmanager
def running(*models: ModelSettings) -> Iterator[System]:
    """A System over ``models`` that is stopped (cancelling what is left) however the
    test ends."""
    system = System(SystemConfig(models=models))
    try:
        yield system
    finally:
        system.stop(cancel=True, timeout=5)


def threads_since(before: set[threading.Thread]) -> list[str]:
    """The names of the threads alive now that were not in ``before``
    (``set(threading.enumerate())`` taken earlier): what a stop left behind."""
    return [t.name for t in threading.enumerate() if t.is_alive() and t not in before]


def hold_down(system: System, name: str) -> None:
    """Crash ``name`` and return once it is down (the supervisor restarts it later)."""
    system.tell(name, Crash(reason="held down by the test"))
    assert wait_until(lambda: system.book.resolve(name) is None)


def served(provider: SimulatedProvider, model: str) -> dict[str, Any]:
    """The provider's own counters for ``model`` (empty before its first request)."""
    counters: dict[str, Any] = provider.stats()["models"].get(model, {})
    return counters


CallT = TypeVar("CallT")


@contextlib.contextmanager
def held_at(provider: SimulatedProvider, model: str, send: Callable[[], CallT]) -> Iterator[CallT]:
    """``with held_at(provider, model, send) as call:`` ``send()``'s call of ``model``,
    held at ``provider`` until the block ends; the block begins once the call is there.
    A call held for a time was a race: on a loaded machine it ended before the test had
    looked at what waited behind it."""
    before = int(served(provider, model).get("requests", 0))
    with provider.held(model):
        call = send()
        assert wait_until(lambda: int(served(provider, model).get("requests", 0)) > before)
        yield call


def requests_seen(provider: SimulatedProvider) -> int:
    """Requests the provider has received, all models together."""
    return int(provider.stats()["total"]["requests"])


ASSORTED = {
    "alpha": ModelBehaviour(latency_s=0.01),
    "beta": ModelBehaviour(latency_s=0.02),
    "slow": ModelBehaviour(latency_s=0.4, completion_tokens=20),
    "timer": ModelBehaviour(latency_s=1.05),
    "single": ModelBehaviour(latency_s=0.3),
    "bad": ModelBehaviour(latency_s=0.0, status=400),
}
"""The models of ``assorted_system``: what the provider does for each."""
PRICE = Price(input_per_mtok=Decimal("1.00"), output_per_mtok=Decimal("2.00"))
"""What every model of ``assorted_system`` costs."""


# -- results ----------------------------------------------------------------------------------


def kinds(results: list[Result]) -> Counter[str]:
    """How many results of each type."""
    return Counter(type(r).__name__ for r in results)


def settle(futures: list[Future[Result]]) -> list[Result]:
    """Every future resolves within WAIT_S; the results of those not cancelled."""
    deadline = time.monotonic() + WAIT_S
    results = []
    for f in futures:
        if f.cancelled():
            continue
        try:
            results.append(f.result(max(0.0, deadline - time.monotonic())))
        except CancelledError:
            continue
        except TimeoutError:
            pending = [g for g in futures if not g.done()]
            raise AssertionError(f"{len(pending)} futures still pending: {pending[:3]}") from None
    return results


# -- one task through the ledger's batch calls --------------------------------------------------


def accepted_by_a_dead_process(path: Path, *requests: Request) -> None:
    """Tasks for ``requests`` written to the durable ledger at ``path`` and never
    finished, as a process that died after accepting them leaves them."""
    from callboard.runtime.sqlite_ledger import SqliteLedger

    ledger = SqliteLedger(path)
    try:
        for i, request in enumerate(requests):
            task = Task(task_id=ledger.next_id(), trace_id=f"t{i}", request=request, submitted_at=0)
            assert accept_one(ledger, task) is None
    finally:
        ledger.close()


def accept_one(ledger: Ledger, task: Task, capacity: int | None = None) -> int | Refused | None:
    """What ``accept_all`` answers for ``task`` alone: None (accepted), the id of the task
    holding its idempotency key, or ``FULL``."""
    return ledger.accept_all((task,), capacity)[0]


def route_one(ledger: Ledger, job: Job) -> bool:
    """Whether ``route_all`` routed ``job`` (False: its task was not waiting to be routed)."""
    return ledger.route_all((job,)) == [job]


def finish_one(ledger: Ledger, task: Task, result: Result) -> bool:
    """Whether ``finish_all`` delivered ``result`` (False: the task was not live)."""
    return ledger.finish_all(((task, result),)) == [result]


# -- bench figures ------------------------------------------------------------------------------


def steady_run(
    system: str, label: str, rnd: int, ok: int, *, cpu: float = 0.1, conc: int = 50
) -> Run:
    """One measured run of the steady scenario, as the bench records it."""
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


def callboard_runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The callboard runs of one scenario's JSON (``ScenarioResult.as_json``)."""
    return [run for run in result["runs"] if run["system"].startswith("callboard")]


def assert_nothing_lost_or_doubled(result: dict[str, Any]) -> None:
    """Every callboard run of the scenario answered each of its tasks exactly once."""
    runs = callboard_runs(result)
    assert runs
    for run in runs:
        assert run["lost"] == 0, (run["scenario"], run["system"], run["label"])
        assert run["duplicated"] == 0, (run["scenario"], run["system"], run["label"])
        assert run["tasks"] > 0


def small(**changes: Any) -> Scale:
    """The small bench plan with ``changes``."""
    return dataclasses.replace(Scale.small(), **changes)


def run_json(result: ScenarioResult) -> dict[str, Any]:
    """A scenario's result as the bench's JSON writes it."""
    return result.as_json([])


# -- budgets ------------------------------------------------------------------------------------


class BudgetWatch:
    """Wraps a system's ``Budgets`` to record the peak of spent + reserved after every
    reserve and settle (the invariant must hold at every moment, not only at the end)."""

    def __init__(self, system: System) -> None:
        assert system.rt.budget is not None
        self.budgets = system.rt.budget._budgets
        self.peak_total = 0
        self.peak_tag: dict[str, int] = {}
        for name in ("reserve", "settle", "release"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        inner = getattr(self.budgets, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            b = self.budgets
            self.peak_total = max(self.peak_total, b.spent + b.reserved)
            for tag, led in b._tags.items():
                self.peak_tag[tag] = max(self.peak_tag.get(tag, 0), led.spent + led.reserved)
            return out

        setattr(self.budgets, name, wrapped)


# -- logs --------------------------------------------------------------------------------------

HandlerT = TypeVar("HandlerT", bound=logging.Handler)


@contextlib.contextmanager
def attached(handler: HandlerT, *loggers: str, level: int) -> Iterator[HandlerT]:
    """``handler`` hears ``loggers`` from ``level`` up for the with block; each logger's
    own level is set back and the handler taken off however the block ends."""
    saved = []
    for name in loggers:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(level)
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger, old in saved:
            logger.removeHandler(handler)
            logger.setLevel(old)


class LogCollector(logging.Handler):
    """Keeps every record and formats each with callboard's own format and filter."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.lines: list[str] = []
        self.addFilter(callboard.TaskLogFilter())
        self.setFormatter(logging.Formatter(callboard.LOG_FORMAT))
        self._kept = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record)  # the traceback included
        with self._kept:
            self.records.append(record)
            self.lines.append(line + " " + repr(record.args))

    def callboard_records(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.name.startswith("callboard")]

    def assert_no_secret(self, *secrets: str) -> None:
        for line in self.lines:
            for s in secrets:
                assert s not in line, line[:300]


class HoldAtCrash(logging.Handler):
    """Holds a dying actor's thread at its "crashed" warning, which lies between its
    book hand-over and its ``ChildFailed``, until ``until(system, dying_ref)`` holds
    (2 s at most); ``held`` is set if it did. Only ``actor`` #``incarnation``'s warning
    that says ``saying`` is held; ``system`` is set by ``held_at_crash``."""

    def __init__(
        self,
        actor: str,
        incarnation: int,
        saying: str,
        until: Callable[[System, Any], bool],
    ) -> None:
        super().__init__(logging.WARNING)
        self.actor, self.incarnation, self.saying, self.until = actor, incarnation, saying, until
        self.system: System | None = None
        self.held = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        actor = record.args[0] if isinstance(record.args, tuple) and record.args else None
        if (getattr(actor, "name", None), getattr(actor, "incarnation", None)) != (
            self.actor,
            self.incarnation,
        ):
            return
        system = self.system
        if system is None or self.saying not in record.getMessage():
            return
        dying = actor.actor_ref  # type: ignore[union-attr]
        if wait_until(lambda: self.until(system, dying), 2.0):
            self.held.set()


@contextlib.contextmanager
def held_at_crash(hold: HoldAtCrash, config: SystemConfig, plan: CrashPlan) -> Iterator[System]:
    """A System with ``plan``'s crashes whose actors' warnings ``hold`` hears; it is
    stopped (0.5 s) however the block ends."""
    with attached(hold, "callboard.actors.base", level=logging.WARNING):
        system = System(config, crash_plan=plan)
        hold.system = system
        try:
            yield system
        finally:
            system.stop(timeout=0.5)


# -- the command line ------------------------------------------------------------------------

INTERRUPTIBLE = (
    "import runpy, signal, sys; "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'callboard'; "
    "runpy.run_module('callboard', run_name='__main__')"
)
"""``python -m callboard`` with Python's own SIGINT handler even when this test runs with
SIGINT ignored (a background job), which the child would otherwise inherit."""

CLI_TIMEOUT_S = 90.0
"""Upper bound for one ``callboard`` subprocess (a few seconds normally)."""


def cli(
    *args: Any, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """``python -m callboard ARGS`` in a subprocess; ``env`` adds to this environment."""
    return subprocess.run(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-m", "callboard", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def fresh(probe: str) -> str:
    """What ``probe`` prints in a fresh interpreter (nothing of callboard loaded yet)."""
    return subprocess.run(  # noqa: S603 - our own interpreter, fixed arguments
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=True,
    ).stdout.strip()


def write_lines(path: Path, lines: list[Any]) -> Path:
    """A JSONL file: dicts are dumped as JSON, str written as is, bytes written raw."""
    data = b"".join(
        (x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode())
        + b"\n"
        for x in lines
    )
    path.write_bytes(data)
    return path


def records(path: Path) -> list[dict[str, Any]]:
    """The result lines ``callboard run`` wrote to ``path``."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def good(ident: str, prompt: str = "say something") -> dict[str, Any]:
    """A valid input line for ``callboard run``."""
    return {"id": ident, "prompt": f"{prompt} about {ident}", "max_tokens": 8}


# -- other processes, read from /proc --------------------------------------------------------

PROVIDER_MODULE = "callboard.provider.server"
"""What the command line of the provider's own process names."""


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def providers_of(parent: int) -> list[int]:
    """The provider processes whose parent is ``parent``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat and stat[1] == parent and PROVIDER_MODULE in cmdline(int(entry.name)):
                found.append(int(entry.name))
    return found


def listening_ports(pid: int) -> list[int]:
    """The TCP ports ``pid`` listens on."""
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


def dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def refused(port: int) -> bool:
    """Nothing accepts a connection on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


def kill_stray_provider(pid: int) -> None:
    """SIGKILL ``pid`` if it is still a provider process (one a test caused to outlive
    its parent), by its own pid."""
    if pid and alive(pid) and PROVIDER_MODULE in cmdline(pid):
        os.kill(pid, 9)


@contextlib.contextmanager
def child(
    argv: list[str], *, env: dict[str, str] | None = None, gently: bool = False
) -> Iterator[subprocess.Popen[str]]:
    """``python ARGV`` as a process of its own (text pipes for stdout and stderr),
    stopped at the end if it still runs: killed, or with ``gently`` asked to stop
    (SIGTERM) and killed only if it will not."""
    proc = subprocess.Popen(  # noqa: S603 - our own modules, fixed arguments
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        yield proc
    finally:
        stop_child(proc, signal.SIGTERM if gently else signal.SIGKILL, WAIT_S)


def announced(proc: subprocess.Popen[str], prefix: str, timeout: float = CLI_TIMEOUT_S) -> str:
    """What a child announces on its first line after ``prefix`` (a gateway's URL);
    its stderr in the error if it says nothing of the kind within ``timeout``."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        ready = selector.select(timeout)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith(prefix):
        proc.kill()
        _, err = proc.communicate(timeout=WAIT_S)
        raise AssertionError(f"the child did not announce itself: {line!r} {err[-3000:]}")
    return line.removeprefix(prefix).strip()


def interrupted_taking(lock: Any, waits_in: set[str], call: Callable[[], object]) -> None:
    """Make a Ctrl-C land as the main thread takes ``lock``, and check it was not left
    taken. ``call`` runs on the main thread while another thread holds ``lock`` until
    the main thread waits for it (its innermost frame is one of ``waits_in``), then
    makes a SIGINT pending (``_thread.interrupt_main()``: it is handled once the main
    thread has the lock) and lets go. ``call`` must end in the ``KeyboardInterrupt``
    (a wait follows it, should the interrupt land after its work). A third thread then
    takes the lock: a reentrant one left held by the main thread would let it in."""
    import _thread

    import pytest

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("interrupt_main() reaches the main thread only")
    main = threading.main_thread().ident
    taken = threading.Event()

    def main_waits() -> bool:
        frame = sys._current_frames().get(main)
        return frame is not None and frame.f_code.co_name in waits_in

    def hold() -> None:
        with lock:  # until the main thread waits for it; the Ctrl-C; let go
            taken.set()
            for _ in range(2000):
                if main_waits():
                    break
                time.sleep(0.001)
            _thread.interrupt_main()

    def call_then_wait() -> None:
        call()
        time.sleep(WAIT_S)  # the interrupt lands after the call's work, if not within it

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(WAIT_S)
    with pytest.raises(KeyboardInterrupt):
        call_then_wait()
    holder.join(WAIT_S)
    free: list[bool] = []

    def take() -> None:
        free.append(lock.acquire(timeout=WAIT_S))
        if free[0]:
            lock.release()

    other = threading.Thread(target=take)
    other.start()
    other.join(2 * WAIT_S)
    assert free == [True], "the lock was left taken"


def accepted_as_it_stops(loop: Any, port: int, stop: Callable[[], object]) -> None:
    """Connect to a server on ``loop`` in the very loop turn it is told to stop, and
    check the stop closed that connection rather than leave it for the collector
    (``ResourceWarning: unclosed transport``, CPython gh-109564). The loop is held
    while the client connects and ``stop`` (on another thread) schedules its callback,
    so one ``select()`` sees both; ``stop`` must hand the loop a callback first."""
    import gc
    import warnings

    import pytest

    if not hasattr(loop, "_ready"):
        pytest.skip("an asyncio selector loop's race (uvloop accepts in one callback)")
    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        go.wait(WAIT_S)

    loop.call_soon_threadsafe(hold)
    assert held.wait(WAIT_S)
    waiting = len(loop._ready)
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
        stopping = threading.Thread(target=stop)
        stopping.start()
        try:
            assert wait_until(lambda: len(loop._ready) > waiting), "stop scheduled nothing"
        finally:
            go.set()
            stopping.join(WAIT_S)
        assert not stopping.is_alive()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            gc.collect()
        assert [str(w.message) for w in seen if w.category is ResourceWarning] == []
        assert raw.recv(1) == b"", "the server left the connection open"


# -- a ledger whose disk goes bad --------------------------------------------------------------


class WrappedConnection:
    """A SQLite connection, the real one underneath: a subclass changes ``execute``."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        return self._db.execute(sql, *args)

    def __enter__(self) -> WrappedConnection:
        self._db.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._db.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


class DamagedCommits(WrappedConnection):
    """A SQLite connection whose every ``COMMIT`` fails as a damaged page makes it fail
    (``database disk image is malformed``: no retry helps); the rest is the real one.
    ``SqliteLedger._connect`` patched to return it (``damaged_commits``) has a ledger
    that opens, and whose writes then fail."""

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql == "COMMIT":
            raise sqlite3.DatabaseError("database disk image is malformed")
        return super().execute(sql, *args)


def damaged_commits(monkeypatch: Any) -> None:
    """Every ``SqliteLedger`` opened from here has its commits fail (``DamagedCommits``)."""
    from callboard.runtime.sqlite_ledger import SqliteLedger

    connect = SqliteLedger._connect
    monkeypatch.setattr(SqliteLedger, "_connect", lambda self: DamagedCommits(connect(self)))
