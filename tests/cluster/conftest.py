"""Fixtures for the cluster tests: ONE Ray cluster for the whole test run, and systems on it.

Ray takes 20-40 s to start on the shared 2-core machine, so a test run starts one:
the 2-node cluster of ``two_nodes.py`` (head ``near``, worker ``far``), started by
the first test worker that asks for it and joined by every other (a driver joins
in a few seconds). Which run a worker belongs to is the xdist run id (or, with
``-n 0``, the pytest process); the address is in a file in the temp dir named
after it, written under an ``flock`` of that file, so the workers agree on one
cluster. The keeper process outlives the worker that started it and shuts the
cluster down when the run's controller process ends, however it ends (a normal
end, a Ctrl-C, a SIGTERM).

Every test gets its own namespace: its own shared queue and model actors, killed
at its end (they are detached: nothing else would stop them).

A stream is read with a deadline (``read_stream``): a stream that hangs fails its
test naming what it waited for, not as the suite's timeout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import itertools
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from callboard.core.settings import SchedulerSettings
from callboard.messages import Failed, FailureReason, StreamDelta
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S

from callboard import ModelSettings, System, SystemConfig
from callboard._stream import ChatStream, StreamFailedError
from callboard.config import RayCluster

HERE = Path(__file__).parent
START_S = 100.0
"""How long the cluster may take to start on a loaded machine, its turn at the
machine-wide start lock included: under the test timeout (120 s), so a start that
fails says why (the keeper's stderr)."""
_namespaces = itertools.count(1)


@pytest.fixture(scope="session")
def ray_address() -> str:
    """The address of this test run's Ray cluster, started here if no worker has yet."""
    run, controller = _this_run()
    state = Path(tempfile.gettempdir()) / f"callboard-tests-ray-{run}.address"
    with state.open("a+", encoding="utf-8") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        held.seek(0)
        address = held.read().strip()
        if address and _answers(address):
            return address
        address = _start(state, controller)
        held.seek(0)
        held.truncate()
        held.write(address)
    return address


@pytest.fixture(scope="session")
def ray_local(ray_address: str) -> Iterator[Any]:
    """Ray, this test worker joined to the run's cluster as a driver; left at its end."""
    import ray

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Ray's own start-up warnings are not ours
        ray.init(address=ray_address, namespace="callboard-tests", log_to_driver=False)
    yield ray
    ray.shutdown()


def _this_run() -> tuple[str, int]:
    """The test run's name and its controller's pid (the process whose end ends the run)."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id and os.environ.get("PYTEST_XDIST_WORKER"):
        return run_id, os.getppid()  # an xdist worker: the controller started it
    return f"pid{os.getpid()}", os.getpid()


def _answers(address: str) -> bool:
    """Something listens at ``address`` (a cluster left by a keeper that died does not)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except OSError:
        return False


def _start(state: Path, controller: int) -> str:
    """Start the keeper of the run's cluster; its address once it is up."""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as log:
        keeper = subprocess.Popen(  # noqa: S603 - our own script, on this interpreter
            [sys.executable, str(HERE / "two_nodes.py"), str(state), str(controller)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,  # a Ctrl-C ends the run; the run's end ends the keeper
        )
        assert keeper.stdout is not None
        keeper.wait(START_S)  # it forks the keeper and exits
        with keeper.stdout:
            address = _address(keeper.stdout, START_S)
        if address is None:
            with contextlib.suppress(ProcessLookupError):  # the keeper's group: it and its Ray
                os.killpg(keeper.pid, signal.SIGTERM)
            log.seek(0)
            pytest.fail(f"the test run's Ray cluster did not start: {log.read()[-3000:]}")
    return address


def _address(out: IO[str], timeout: float) -> str | None:
    """The address the keeper prints, or None if it ends or ``timeout`` passes first."""
    with selectors.DefaultSelector() as selector:
        selector.register(out, selectors.EVENT_READ)
        if not selector.select(timeout):
            return None
    return out.readline().strip() or None


@pytest.fixture
def shared_provider() -> Iterator[SimulatedProvider]:
    """The provider every system of a test calls: ``m`` answers in ~20 ms."""
    with SimulatedProvider(models={"m": ModelBehaviour(latency_s=0.02)}, seed=5) as p:
        yield p


@pytest.fixture
def kill_for_good(ray_local: Any) -> Callable[[Any], None]:
    """``kill(handle)``: kill a shared actor for good and return once it is dead.
    ``ray.kill`` only asks: the actor may answer calls for a while after it returns,
    so a test that goes on at once may find the actor it killed still serving."""

    def kill(handle: Any) -> None:
        ray_local.kill(handle, no_restart=True)
        for _ in range(1000):  # each turn waits on a call the dying actor must refuse
            try:
                ray_local.get(handle.__ray_ready__.remote(), timeout=WAIT_S)
            except ray_local.exceptions.RayActorError:
                return
        raise AssertionError(f"{handle} still answers after ray.kill")

    return kill


@pytest.fixture
def ray_namespace(ray_local: Any) -> Iterator[str]:
    """A namespace of the test's own on the run's cluster; the shared actors made in it
    are killed at the test's end (they are detached: nothing else would stop them)."""
    namespace = f"t{os.getpid()}-{next(_namespaces)}"
    yield namespace
    for actor in ray_local.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == namespace:
            try:
                handle = ray_local.get_actor(actor["name"], namespace=namespace)
            except ValueError:  # listed as it died (a test's own teardown killed it): a
                continue  # fresh-clone CI run's error at teardown
            ray_local.kill(handle, no_restart=True)


@pytest.fixture
def cluster_systems(
    ray_namespace: str, shared_provider: SimulatedProvider
) -> Iterator[Callable[..., System]]:
    """``make(ledger=None, lease_s=30.0, base_url=None, queue_capacity=None,
    lost_after_s=30.0, **model_fields)``: a System whose
    queue and model ``m`` (at ``base_url``, by default the shared provider's) run in the
    test's own namespace on the run's cluster; several made in one test share them. Each
    is stopped at the test's end."""
    systems: list[System] = []

    def make(
        *,
        ledger: Path | None = None,
        lease_s: float = 30.0,
        base_url: str | None = None,
        queue_capacity: int | None = None,
        lost_after_s: float = 30.0,
        **fields: Any,
    ) -> System:
        url = shared_provider.base_url if base_url is None else base_url
        model = ModelSettings(name="m", base_url=url, **fields)
        cluster = RayCluster(namespace=ray_namespace, lease_s=lease_s, lost_after_s=lost_after_s)
        config = SystemConfig(models=(model,), cluster=cluster)
        if queue_capacity is not None:
            scheduler = SchedulerSettings(capacity=queue_capacity)
            config = dataclasses.replace(config, scheduler=scheduler)
        system = System(config, ledger=ledger)
        systems.append(system)
        return system

    yield make
    for system in systems:
        system.stop(cancel=True, timeout=10)


_DONE = object()
"""What ``StreamReader``'s worker hands back when the stream's iteration has ended."""


class StreamReader:
    """A ``ChatStream`` read with a deadline: each read fails the test, naming what it
    waited for, when no delta (nor the stream's end) comes within ``timeout``.

    ``ChatStream`` blocks without a timeout of its own; its iterator is advanced on
    a worker thread, one delta per ask (so nothing is read ahead of the test: a
    test of backpressure reads exactly what it asks for), the test waiting on each
    with its deadline. A worker left waiting on a stream that hangs is released when
    the system stops (the stream's end closes its channel)."""

    def __init__(self, stream: ChatStream, timeout: float = WAIT_S) -> None:
        self._stream = stream
        self._deltas = iter(stream)
        self._timeout = timeout
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "stream-reader")
        self.read: list[StreamDelta] = []
        """Every delta read so far, in order."""

    @property
    def text(self) -> str:
        """The text of every delta read so far."""
        return "".join(d.text for d in self.read)

    def next(self, what: str) -> StreamDelta:
        """The next delta; fails the test if the stream ends first or none comes in time
        (``what``: what the test waits for, for the message)."""
        delta = self._one(what, time.monotonic() + self._timeout)
        if delta is None:
            pytest.fail(f"{what}: the stream ended after {len(self.read)} deltas")
        return delta

    def rest(self, what: str) -> list[StreamDelta]:
        """Every delta to the stream's end, all within ``timeout``: the ones read here
        (``StreamFailedError`` raised, as iterating does, by a stream that failed;
        ``read`` holds every delta before it)."""
        deadline, start = time.monotonic() + self._timeout, len(self.read)
        while self._one(what, deadline) is not None:
            pass
        return self.read[start:]

    def cut(self, what: str) -> Failed:
        """Read to the end of a stream that is to be cut: its reading fails
        (``StreamFailedError``, carrying the stream's result), and the result is a
        ``Failed(STREAM_CUT)`` whose partial text is exactly the text read here."""
        with pytest.raises(StreamFailedError) as failed:
            self.rest(what)
        result = self._stream.result(WAIT_S)
        assert failed.value.result is result
        assert isinstance(result, Failed), result
        assert result.reason is FailureReason.STREAM_CUT, result
        assert result.partial_text == self.text  # every delta its reader got, and only those
        return result

    def _one(self, what: str, deadline: float) -> StreamDelta | None:
        ask = self._worker.submit(next, self._deltas, _DONE)
        with contextlib.suppress(concurrent.futures.TimeoutError):
            ask.result(max(0.0, deadline - time.monotonic()))
        if not ask.done():
            n = len(self.read)
            pytest.fail(f"{what}: no delta nor the end within {self._timeout:g} s (after {n})")
        got = ask.result()  # a failed stream's StreamFailedError, raised here
        if got is _DONE:
            return None
        assert isinstance(got, StreamDelta)
        self.read.append(got)
        return got

    def close(self) -> None:
        """Let the worker go (not waiting for it: a hung stream ends with its system)."""
        self._worker.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def read_stream() -> Iterator[Callable[..., StreamReader]]:
    """``read_stream(stream, timeout=WAIT_S)``: a ``StreamReader`` of ``stream``."""
    readers: list[StreamReader] = []

    def make(stream: ChatStream, timeout: float = WAIT_S) -> StreamReader:
        reader = StreamReader(stream, timeout)
        readers.append(reader)
        return reader

    yield make
    for reader in readers:
        reader.close()
