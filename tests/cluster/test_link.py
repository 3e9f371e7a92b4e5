"""Client processes of one Ray cluster (``cluster._link`` and the shared actors it
reaches): across nodes, a client process killed and resumed, the link's poller dying
and the link restarting, and the link's word on a stream's failures (a failure before
its first delta retried unseen by its reader, one after it cut with the text read; a
batch of deltas lost on its way, before the first reached the reader: the stream
sent again whole; after: cut with exactly the text read).

The cluster is the test run's 2-node one (``two_nodes.py``: head ``near``, worker
``far``), which this test process joined as a driver on the head. A client that
must die or stop is a process of its own (``client_process.py``); the ones that
live through the test (two systems across nodes, the survivor, the heir of a
ledger) are systems in this process, each with its own ledger, link, poller and
owner number, reaching the shared actors through the same Ray calls another
process would. The simulated provider runs in this process too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from callboard.cluster import connect
from callboard.cluster._connect import QUEUE_NAME, model_name
from callboard.core.limiter import LimiterConfig
from callboard.core.retry import RetryConfig
from callboard.core.settings import SchedulerSettings
from callboard.messages import Cancelled, Completed, Crash, Failed, FailureReason, GetState
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.sqlite_ledger import SqliteLedger
from loopback import Arrival, WireServer, open_stream, openai_error, openai_stream, sse
from support import WAIT_S, held_at, served, wait_until

from callboard import ModelSettings, System
from callboard.config import RayCluster

HERE = Path(__file__).parent
TESTS = HERE.parent
LEASE_S = 1.5


@contextlib.contextmanager
def client(*args: str) -> Iterator[subprocess.Popen[str]]:
    """``client_process.py ARGS`` as a process of its own; killed at the end if alive."""
    proc = subprocess.Popen(  # noqa: S603 - our own script, on this interpreter
        [sys.executable, str(HERE / "client_process.py"), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=TESTS,
    )
    try:
        yield proc
    finally:
        _end(proc)


def _line(proc: subprocess.Popen[str], timeout: float, what: str) -> str:
    """The next line ``proc`` writes, within ``timeout``."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            proc.kill()
            _, err = proc.communicate(timeout=WAIT_S)
            pytest.fail(f"{what} within {timeout} s: {(err or '')[-3000:]}")
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=WAIT_S)
        pytest.fail(f"{what}: the process ended ({proc.returncode}): {(err or '')[-3000:]}")
    return line


def _report(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(_line(proc, 2 * WAIT_S, what))
    return report


def _tell(proc: subprocess.Popen[str], word: object) -> None:
    assert proc.stdin is not None
    proc.stdin.write(f"{word}\n")
    proc.stdin.flush()


def _end(proc: subprocess.Popen[str]) -> None:
    try:
        proc.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(WAIT_S)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _shared(ray: Any, namespace: str) -> tuple[Any, Any]:
    """The cluster's queue and model ``m`` actors in ``namespace``."""
    return (
        ray.get_actor(QUEUE_NAME, namespace=namespace),
        ray.get_actor(model_name("m"), namespace=namespace),
    )


def _node_of(ray: Any, actor: Any) -> str:
    """The node ``actor`` runs on (asked of the actor itself)."""
    where = actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id())
    return str(ray.get(where, timeout=WAIT_S))


@pytest.fixture
def far_node(ray_local: Any, ray_namespace: str) -> Iterator[Any]:
    """A scheduling strategy that puts a task, and the actors it creates, on the ``far``
    node (a placement group capturing its children: the plain Ray way to put an
    application's actors on a node). The namespace's shared actors are killed before the
    group is removed: its removal would kill them, for Ray to restart them elsewhere."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"far": 1}])
    try:
        ray_local.get(group.ready(), timeout=WAIT_S)
        yield PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
        with contextlib.suppress(ValueError):
            for actor in _shared(ray_local, ray_namespace):
                ray_local.kill(actor, no_restart=True)
    finally:
        remove_placement_group(group)


def test_shared_actors_on_another_node_serve_two_systems_within_one_limit(
    ray_local: Any,
    ray_namespace: str,
    far_node: Any,
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
) -> None:
    # the provider allows 300 rpm (5 a second, a burst of 5); each system is set to 240,
    # as a deployment would be: two limiters would send 8 a second
    shared_provider.configure("m", ModelBehaviour(latency_s=0.01, rpm=300, burst_s=1.0))
    limits = {"limiter": LimiterConfig(rpm=240, tpm=None, burst_s=0.5), "max_concurrency": 8}
    model = ModelSettings(name="m", base_url=shared_provider.base_url, **limits)
    cluster = RayCluster(namespace=ray_namespace)
    place = ray_local.remote(num_cpus=0)(connect).options(scheduling_strategy=far_node)
    ray_local.get(place.remote(cluster, {"m": model}, SchedulerSettings()), timeout=WAIT_S)
    a, b = cluster_systems(**limits), cluster_systems(**limits)  # they find those actors
    n = 8
    futures = [s.submit(f"{name} {i}") for i in range(n) for name, s in (("a", a), ("b", b))]
    results = [f.result(timeout=WAIT_S) for f in futures]
    # the driver joined the head; the queue and the model run on the other node
    queue, shell = _shared(ray_local, ray_namespace)
    far = [x["NodeID"] for x in ray_local.nodes() if x["Alive"] and "far" in x["Resources"]]
    assert len(far) == 1
    driver = ray_local.get_runtime_context().get_node_id()
    assert _node_of(ray_local, queue) == _node_of(ray_local, shell) == far[0] != driver
    assert all(isinstance(r, Completed) and r.model == "m" for r in results)
    assert len({r.task_id for r in results[0::2]}) == n  # a's, each once
    for system in (a, b):
        assert system.drain(timeout=WAIT_S)
        counts = system.ledger.counts()
        assert (counts.accepted, counts.finished, counts.live) == (n, n, 0)
    owners = sorted(s.ask("queue", GetState())["owner"] for s in (a, b))
    assert owners == ray_local.get(queue.state.remote(), timeout=WAIT_S)["owners"]  # one queue
    served = shared_provider.stats()["models"]["m"]
    assert served["rate_limited"] == 0
    assert served["requests"] == 2 * n


def test_a_killed_client_holds_no_capacity_and_its_ledger_resumes_exactly_once(
    ray_local: Any,
    ray_address: str,
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    tmp_path: Path,
) -> None:
    # calls take 1 s, two at a time: when the victim dies, two are in flight and the
    # rest wait in the shared queue; a survivor (a system here) polls the shared actors
    # meanwhile: the queue sweeps a dead owner only when some owner collects
    shared_provider.configure("m", ModelBehaviour(latency_s=1.0))
    n, path = 12, tmp_path / "victim.db"
    base = shared_provider.base_url
    survivor = cluster_systems(lease_s=LEASE_S, max_concurrency=2)
    alive = survivor.ask("queue", GetState())["owner"]
    namespace = survivor.config.cluster.namespace  # type: ignore[union-attr]
    queue, shell = _shared(ray_local, namespace)
    args = (ray_address, namespace, base, str(path), str(n), str(LEASE_S))
    with client("victim", *args) as victim:
        held = _report(victim, "the victim did not get its tasks into the cluster")
        assert held["held"], held  # calls in flight at the model, tickets in the queue
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(WAIT_S) == -signal.SIGKILL
    dead = held["owner"]
    # (a) the lease lapses: the queue drops what waited, the model's slots come back
    states: dict[str, Any] = {}

    def forgotten() -> bool:  # the dead owner's lease lapsed at the queue and the model
        states["queue"], states["model"] = ray_local.get(
            [queue.state.remote(), shell.state.remote()], timeout=WAIT_S
        )
        q, m = states["queue"], states["model"]
        return (
            dead not in q["owners"]
            and q["waiting"] == 0
            and dead not in m["owners"]
            and m["in_flight"] == 0
        )

    assert wait_until(forgotten), states
    q, m = states["queue"], states["model"]
    assert q["owners"] == m["owners"] == [alive]
    assert q["waiting"] == m["in_flight"] == 0
    dropped = n - q["dispatched"]
    assert dropped >= 1, "some of the dead client's tickets were dropped, never called"
    # every call the model made reached the provider; the ticket it held as the dead
    # owner's next call, dispatched by the queue, is dropped with its lease, not called
    assert shared_provider.stats()["models"]["m"]["requests"] == m["sent"] <= q["dispatched"]
    # the survivor has the model's whole concurrency, and every call is its own
    shared_provider.configure("m", ModelBehaviour(latency_s=0.2))
    shared_provider.reset_stats()
    own = [f.result(timeout=WAIT_S) for f in survivor.submit_many([f"own {i}" for i in range(4)])]
    assert all(isinstance(r, Completed) for r in own)
    served = shared_provider.stats()["models"]["m"]
    assert (served["requests"], served["max_in_flight"]) == (4, 2)
    before = {s.task_id: s.result for s in _stored(path)}
    assert sorted(before) == list(range(1, n + 1)), "every accepted task is in the file"
    done_before = {i for i, r in before.items() if r is not None}
    # (b) a new system resumes the ledger: every unfinished task, once
    shared_provider.configure("m", ModelBehaviour(latency_s=0.05))
    heir = cluster_systems(ledger=path, lease_s=LEASE_S, max_concurrency=2)
    resumed = [f.result(timeout=WAIT_S) for f in heir.resume()]
    assert all(isinstance(r, Completed) for r in resumed)
    ids = [r.task_id for r in resumed]
    assert sorted(ids) == sorted(set(before) - done_before), "exactly the unfinished, once each"
    assert heir.drain(timeout=WAIT_S)
    counts = heir.ledger.counts()
    assert (counts.accepted, counts.finished, counts.live) == (len(ids), len(ids), 0)
    heir.stop(timeout=10)  # the file is closed: read it as it stands
    after = {s.task_id: s.result for s in _stored(path)}
    assert sorted(after) == sorted(before)
    assert all(r is not None for r in after.values()), "every accepted task has its outcome"
    for i in done_before:  # what the victim finished stands as it was: answered once
        assert after[i] == before[i]


def test_a_client_killed_and_resumed_at_once_has_only_its_calls_in_flight_made_twice(
    *,
    ray_local: Any,
    ray_address: str,
    ray_namespace: str,
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    tmp_path: Path,
) -> None:
    """Resumed within the killed process's lease, every task it left waiting in the
    shared queue was called twice: the dead owner's ticket, its answer dropped, and
    the successor's (12 of 12; found by a hunt). The successor takes the ledger over:
    what waited for the dead process is dropped as it starts, and only what the queue
    had handed to the model by then is made twice."""
    shared_provider.configure("m", ModelBehaviour(latency_s=0.3))
    n, path, lease_s = 12, tmp_path / "victim.db", 30.0  # a lease the test never outlives
    args = (ray_address, ray_namespace, shared_provider.base_url, str(path), str(n))
    with client("victim", *args, str(lease_s)) as victim:
        held = _report(victim, "the victim did not get its tasks into the cluster")
        assert held["held"], held
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(WAIT_S) == -signal.SIGKILL
    heir = cluster_systems(ledger=path, lease_s=lease_s, max_concurrency=2)
    queue, _ = _shared(ray_local, ray_namespace)
    then = ray_local.get(queue.state.remote(), timeout=WAIT_S)
    assert then["waiting"] == 0, "the dead holder's tickets wait out its lease"
    resumed = [f.result(timeout=WAIT_S) for f in heir.resume()]
    assert all(isinstance(r, Completed) for r in resumed), resumed
    assert wait_until(lambda: shared_provider.stats()["models"]["m"]["in_flight"] == 0)
    calls = shared_provider.stats()["models"]["m"]["requests"]
    assert calls <= then["dispatched"] + len(resumed), (calls, then, len(resumed))


def _stored(path: Path) -> list[Any]:
    ledger = SqliteLedger(path)
    try:
        return list(ledger.stored())
    finally:
        ledger.close()


def test_a_client_silent_past_its_lease_gets_every_answer_once_it_is_back(
    ray_address: str, ray_namespace: str, shared_provider: SimulatedProvider
) -> None:
    # the process is alive but silent (stopped, a long pause, a partition) for longer
    # than its lease: the shared actors take it for dead and drop its tickets and its
    # answers; when it is back, every task it holds must still end
    shared_provider.configure("m", ModelBehaviour(latency_s=0.5))
    n = 8
    base = shared_provider.base_url
    with client("sleeper", ray_address, ray_namespace, base, str(n), str(LEASE_S)) as sleeper:
        held = _report(sleeper, "the sleeper did not get its tasks into the cluster")
        assert held["held"], held
        os.kill(sleeper.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            # silent past its lease, its calls in flight answered meanwhile
            assert wait_until(
                lambda: (
                    time.monotonic() - stopped > 2 * LEASE_S
                    and shared_provider.stats()["models"]["m"]["in_flight"] == 0
                )
            )
        finally:
            os.kill(sleeper.pid, signal.SIGCONT)
        _tell(sleeper, "go")
        seen = _report(sleeper, "the sleeper did not report")
        assert sleeper.wait(WAIT_S) == 0
    assert seen["unanswered"] == 0, seen["link"]
    assert sorted(r["task_id"] for r in seen["results"]) == list(range(1, n + 1))
    assert all(r["kind"] == "Completed" for r in seen["results"])


# -- the link's poller dies; the link restarts -------------------------------------------------


class _Breaks:
    """A model actor's handle whose next ``collect`` raises an error foreign to Ray (as a
    broken connection inside Ray's client would), once armed; all else is the actor's."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.armed = threading.Event()
        self.broke = threading.Event()

    def __getattr__(self, name: str) -> Any:
        if name == "collect" and self.armed.is_set() and not self.broke.is_set():
            return self
        return getattr(self._handle, name)

    def remote(self, *args: Any) -> Any:  # this handle's collect, armed
        self.broke.set()
        raise ConnectionResetError("injected: the connection to the model actor broke")


def test_a_poller_that_dies_fails_its_link_which_restarts_and_every_task_ends_once(
    cluster_systems: Callable[..., System], shared_provider: SimulatedProvider
) -> None:
    # 20 tasks, 4 at a time, 0.2 s each: when the poller dies some are answered, some in
    # flight at the model, some waiting in the queue; nothing polls for them until the
    # link, failed by the poller's death and restarted, starts another poller
    shared_provider.configure("m", ModelBehaviour(latency_s=0.2))
    system = cluster_systems(max_concurrency=4)
    n = 20
    futures = system.submit_many([f"task {i}" for i in range(n)])
    futures[0].result(timeout=WAIT_S)
    connection = system._assembly.connection  # type: ignore[attr-defined]
    fault = _Breaks(connection.models["m"])
    connection.models["m"] = fault  # the poller's way to the model, broken once
    fault.armed.set()
    results = [f.result(timeout=WAIT_S) for f in futures]
    assert fault.broke.is_set()
    assert all(isinstance(r, Completed) for r in results), results
    assert sorted(r.task_id for r in results) == sorted(f.task_id for f in futures)  # type: ignore[attr-defined]
    assert system.drain(timeout=WAIT_S)
    counts = system.ledger.counts()
    assert (counts.accepted, counts.finished, counts.live) == (n, n, 0)  # each once
    link = system.supervision()["queue"]
    assert (link["incarnation"], link["alive"]) == (2, True)
    assert "PollerDiedError" in link["last_errors"][-1]
    assert "ConnectionResetError" in link["last_errors"][-1]
    state = system.ask("queue", GetState())
    assert (state["poller"], state["in_cluster"]) == (1, 0)  # a new thread polls
    after = system.submit("after the restart").result(timeout=WAIT_S)
    assert isinstance(after, Completed)


# -- calls made on leases (cluster/_lease.py) ------------------------------------------------


def _model_state(ray: Any, namespace: str) -> dict[str, Any]:
    _, model = _shared(ray, namespace)
    state: dict[str, Any] = ray.get(model.state.remote(), timeout=WAIT_S)
    return state


def _warm(system: System, n: int = 1) -> int:
    """``n`` tasks at once, answered, until the link holds ``n`` permits of ``m``'s leases,
    kept unused as long as the test needs them (not ``PERMIT_S``: a loaded machine's
    pause gave them back); the tasks it took."""
    system._assembly.stocks.permit_s = 60.0  # type: ignore[attr-defined]
    for rounds in range(1, 11):  # an ask before the model first granted its queue is refused
        futures = system.submit_many([f"warm {i}" for i in range(n)])
        assert all(isinstance(f.result(timeout=WAIT_S), Completed) for f in futures)
        if wait_until(lambda: system.ask("queue", GetState())["permits"] >= n, timeout=1.0):
            return rounds * n
    pytest.fail(f"no {n} permits lent: {system.ask('queue', GetState())}")
    return 0


def test_a_process_alone_on_an_idle_model_makes_its_calls_itself_on_leases(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    ray_local: Any,
    ray_namespace: str,
) -> None:
    # one call at a time on eight slots: past the first, each is made by this process on
    # a permit its model's actor lent it (no hop on the call's way), and the shared actor
    # learns of each from the process's report
    system = cluster_systems(max_concurrency=8)
    n = 30
    for i in range(n):
        assert isinstance(system.submit(f"task {i}").result(timeout=WAIT_S), Completed)
    link = system.ask("queue", GetState())
    # (most: on a loaded machine a permit may go back unused, past PERMIT_S, before the
    # next task comes, which then goes to the queue and asks again)
    assert link["direct_calls"] >= n // 2, (link, _model_state(ray_local, ray_namespace))
    assert link["sent"] + link["direct_calls"] == n  # each task called once
    assert shared_provider.stats()["models"]["m"]["requests"] == n
    assert wait_until(
        lambda: _model_state(ray_local, ray_namespace)["spent"] == link["direct_calls"]
    )
    assert system.drain(timeout=WAIT_S)
    counts = system.ledger.counts()
    assert (counts.accepted, counts.finished, counts.live) == (n, n, 0)
    # permits not used go back: the model lends nothing once the process is idle
    assert wait_until(lambda: _model_state(ray_local, ray_namespace)["lent"] == 0)
    assert system.ask("queue", GetState())["permits"] == 0


def test_calls_on_leases_in_flight_as_their_model_actor_restarts_are_made_once(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    ray_local: Any,
    ray_namespace: str,
) -> None:
    # a restarted model actor makes the process send again what the cluster held; the
    # calls it made itself on the dead actor's leases are in its own hands: not again
    system = cluster_systems(max_concurrency=8)
    warm = _warm(system, 2)
    before = shared_provider.stats()["models"]["m"]["requests"]
    with shared_provider.held("m"):  # the calls stay on the wire until the block ends
        futures = [system.submit(f"task {i}") for i in range(2)]
        assert wait_until(lambda: system.ask("queue", GetState())["direct_in_flight"] == 2)
        known = system.ask("queue", GetState())["incarnations"]["m"]
        _, model = _shared(ray_local, ray_namespace)
        ray_local.kill(model, no_restart=False)
        # the link hears of the new incarnation (and sends again what the cluster held)
        # while its own calls are still on the wire
        assert wait_until(lambda: system.ask("queue", GetState())["incarnations"]["m"] != known)
        # and the new incarnation counts them against its cap until they are reported
        assert wait_until(lambda: _model_state(ray_local, ray_namespace)["adopted"] == 2)
        assert not any(f.done() for f in futures)
    results = [f.result(timeout=WAIT_S) for f in futures]
    assert all(isinstance(r, Completed) for r in results), results
    assert shared_provider.stats()["models"]["m"]["requests"] == before + 2  # none twice
    # (an ask made as the actor died may have reached its successor: permits of the new
    # incarnation, held unused, are not the adopted calls)
    assert wait_until(lambda: _model_state(ray_local, ray_namespace)["adopted"] == 0)
    assert system.drain(timeout=WAIT_S)
    counts = system.ledger.counts()
    assert (counts.accepted, counts.finished, counts.live) == (warm + 2,) * 2 + (0,)


def test_calls_on_leases_open_the_shared_breaker_and_stop_once_it_opens(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    ray_local: Any,
    ray_namespace: str,
) -> None:
    # the provider fails every call: the failures of the calls this process makes on
    # leases open the one breaker of the cluster, and its permits are given up
    system = cluster_systems(max_concurrency=8, retry=RetryConfig(max_attempts=1))
    _warm(system)
    shared_provider.configure("m", ModelBehaviour(latency_s=0.01, status=500))
    for i in range(30):
        result = system.submit(f"task {i}").result(timeout=WAIT_S)
        assert isinstance(result, Failed), result
        if _model_state(ray_local, ray_namespace)["breaker"] != "closed":
            break
    assert _model_state(ray_local, ray_namespace)["breaker"] == "open"
    assert wait_until(lambda: system.ask("queue", GetState())["permits"] == 0)
    assert wait_until(lambda: _model_state(ray_local, ray_namespace)["lent"] == 0)  # (given
    assert system.ask("queue", GetState())["direct_calls"] > 0  # back by a Ray call)


def test_a_system_that_stops_gives_back_its_permits_and_its_calls_on_the_wire(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    ray_local: Any,
    ray_namespace: str,
) -> None:
    # stopped with a call of its own on the wire (a short timeout), a process frees the
    # slots its leases held at once, not a lease later
    system = cluster_systems(max_concurrency=8)
    _warm(system)
    with shared_provider.held("m"):  # the call stays on the wire until the block ends
        system.submit("slow")
        assert wait_until(lambda: system.ask("queue", GetState())["direct_in_flight"] == 1)
        assert _model_state(ray_local, ray_namespace)["lent"] >= 1
        system.stop(timeout=0.2)
        assert wait_until(lambda: _model_state(ray_local, ray_namespace)["lent"] == 0)


# -- a lost cluster --------------------------------------------------------------------------


def test_tasks_failed_while_the_cluster_was_lost_are_not_called_when_it_is_back(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    ray_local: Any,
    ray_namespace: str,
) -> None:
    """With ``when_lost = "wait"`` a task without a deadline fails ``PROVIDER_DOWN`` once
    the cluster is silent for ``lost_after_s``; its ticket stayed in the shared queue,
    and the cluster, back (a stalled node, a cut healed), called it for a caller told
    it had failed: 22 calls for 24 failed tasks (found by a hunt). Now taken back."""
    shared_provider.configure("m", ModelBehaviour(latency_s=0.2))
    # the shared actors up and calling first: new, on a loaded machine, they answered
    # no poll for the 1 s this system allows, and its first task failed before the stall
    warm = cluster_systems(max_concurrency=1)
    assert isinstance(warm.submit("warm up").result(timeout=WAIT_S), Completed)
    system = cluster_systems(max_concurrency=1, lost_after_s=1.0)
    futures = [system.submit(f"task {i}") for i in range(10)]
    assert isinstance(futures[0].result(timeout=WAIT_S), Completed)
    queue = ray_local.get_actor(QUEUE_NAME, namespace=ray_namespace)
    model = ray_local.get_actor(model_name("m"), namespace=ray_namespace)
    pids = [ray_local.get(a.__ray_call__.remote(lambda _: os.getpid())) for a in (queue, model)]
    for pid in pids:  # the cluster stalls: nothing it holds moves, no poll is answered
        os.kill(pid, signal.SIGSTOP)
    try:
        results = [f.result(timeout=WAIT_S) for f in futures[1:]]
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    failed = [r for r in results if isinstance(r, Failed)]
    assert len(failed) >= 7, results  # all but the call in flight and the one held
    assert all(r.reason is FailureReason.PROVIDER_DOWN for r in failed)
    calls = shared_provider.stats()["models"]["m"]["requests"]
    in_flight = _in_flight(ray_local, ray_namespace)
    assert wait_until(lambda: ray_local.get(queue.state.remote())["waiting"] == 0)
    assert wait_until(lambda: in_flight() == 0)
    assert shared_provider.stats()["models"]["m"]["requests"] <= calls + 1  # the held one


def test_a_stops_cancel_leaves_the_calls_made_to_answer_and_cancels_what_waits(
    cluster_systems: Callable[..., System], shared_provider: SimulatedProvider
) -> None:
    """``stop(cancel=True, timeout=...)`` gives the calls in flight the timeout, as a
    local system does; on Ray every task the link held ended ``Cancelled`` at once, the
    calls at the provider too: answered, paid, thrown away, and called again by a
    resume (found by a hunt). What the cluster had not called ends ``Cancelled``."""
    shared_provider.configure("m", ModelBehaviour(latency_s=0.01))
    system = cluster_systems(max_concurrency=1)
    assert isinstance(system.submit("warm").result(timeout=WAIT_S), Completed)
    with (
        ThreadPoolExecutor(1) as pool,
        held_at(shared_provider, "m", lambda: system.submit("in flight")) as in_flight,
    ):
        waiting = [system.submit(f"waiting {i}") for i in range(3)]
        stopping = pool.submit(system.stop, cancel=True, timeout=WAIT_S)
        results = [f.result(timeout=WAIT_S) for f in waiting]
        assert all(isinstance(r, Cancelled) for r in results), results
        assert not in_flight.done()  # its call has the stop's timeout to answer
    assert isinstance(in_flight.result(timeout=WAIT_S), Completed)
    stopping.result(timeout=WAIT_S)
    assert served(shared_provider, "m")["requests"] == 2  # the warm-up and the one in flight


# -- streams: the link's word on their failures ------------------------------------------------


def test_a_stream_cut_by_its_link_s_restart_fails_with_the_text_its_reader_got(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    ray_local: Any,
    ray_namespace: str,
    read_stream: Callable[..., Any],
) -> None:
    # a 10 s stream; its link (this process's end of the cluster) crashes after the
    # first deltas and the supervisor restarts it: the new link cannot go on with the
    # call (its reader would miss what the old one heard meanwhile) and cuts it
    shared_provider.configure(
        "m", ModelBehaviour(ttft_s=0.02, token_gap_s=0.05, completion_tokens=200)
    )
    cb = cluster_systems()
    stream = cb.stream("tell me", max_tokens=200)
    reader = read_stream(stream)
    for _ in range(3):
        reader.next("the stream's first deltas")
    cb.tell("queue", Crash(reason="the test restarts the link"))
    result = reader.cut("the cut stream's end")
    assert "link restarted" in result.detail
    assert len(reader.read) >= 3
    assert result.model == stream.model == "m"  # named by the news that brought the deltas
    assert result.usage.estimated  # its count is the call's, which is ended unread
    assert cb.supervision()["queue"]["incarnation"] == 2
    in_flight = _in_flight(ray_local, ray_namespace)
    assert wait_until(lambda: in_flight() == 0, timeout=5.0)  # ended on the actor, not in 10 s
    assert shared_provider.stats()["total"]["requests"] == 1, "never a second call"


PIECES = ["Hel", "lo, ", "wor", "ld."]
"""The text a loopback stream sends, in the pieces it sends it in."""


def _failing_first(first: Callable[[web.Request], Any]) -> Callable[..., Any]:
    """A loopback provider whose first request ``first`` answers and every later one
    streams ``PIECES`` whole."""

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        if arrival.index == 0:
            response: web.StreamResponse = await first(request)
            return response
        resp = await open_stream(request)
        for event in openai_stream(PIECES):
            await resp.write(event)
        await resp.write_eof()
        return resp

    return handle


async def _unavailable(request: web.Request) -> web.StreamResponse:
    """A 503 before the stream's first byte."""
    return web.json_response(openai_error("overloaded", "server_error"), status=503)


async def _error_after_two(request: web.Request) -> web.StreamResponse:
    """A stream that sends two pieces, then OpenAI's mid-stream error event."""
    resp = await open_stream(request)
    for event in openai_stream(PIECES)[:3]:  # the role, then two pieces
        await resp.write(event)
    await resp.write(sse(openai_error("the server broke mid-stream")))
    await resp.write_eof()
    return resp


QUICK_RETRY = RetryConfig(initial_s=0.05, jitter_s=0.0)


def test_a_stream_failing_before_its_first_delta_is_retried_unseen_by_its_reader(
    cluster_systems: Callable[..., System], read_stream: Callable[..., Any]
) -> None:
    with WireServer(_failing_first(_unavailable)) as server:
        cb = cluster_systems(base_url=server.base_url, retry=QUICK_RETRY)
        stream = cb.stream("tell me")
        reader = read_stream(stream)
        reader.rest("the retried stream")
        result = stream.result(WAIT_S)
        assert isinstance(result, Completed), result
        assert [d.text for d in reader.read if d.text] == PIECES  # one stream, each once
        assert reader.text == result.content == "".join(PIECES)
        assert result.attempts == 2
        assert server.count() == 2


def test_a_stream_failing_after_its_first_delta_is_cut_not_retried(
    cluster_systems: Callable[..., System], read_stream: Callable[..., Any]
) -> None:
    with WireServer(_failing_first(_error_after_two)) as server:
        cb = cluster_systems(base_url=server.base_url, retry=QUICK_RETRY)
        stream = cb.stream("tell me")
        reader = read_stream(stream)
        result = reader.cut("the stream cut mid-way")
        assert [d.text for d in reader.read if d.text] == PIECES[:2]
        assert result.partial_text == reader.text == "".join(PIECES[:2])
        assert result.attempts == 1, "a stream its reader has part of is not sent again"
        assert server.count() == 1


# -- streams: deltas lost on their way to the owner -------------------------------------------


class _Loses:
    """A model actor's handle whose polls (``collect``), once armed, are fetched here as
    they are made: the first answer ``loses(news)`` picks is lost on its way, the poll
    failing as a broken connection would fail it: inside Ray's client, foreign to Ray
    (``die``: the poller dies of it), or as a Ray error (the poller polls again). Every
    other answer is passed on as it came."""

    def __init__(self, ray: Any, handle: Any, loses: Callable[[Any], bool], *, die: bool) -> None:
        self._ray = ray
        self._handle = handle
        self._loses = loses
        self._die = die
        self.armed = threading.Event()
        self.polled = threading.Event()
        """A poll was made through here (none is pending that was not)."""
        self.lost = threading.Event()

    def __getattr__(self, name: str) -> Any:
        if name == "collect" and self.armed.is_set() and not self.lost.is_set():
            return self
        return getattr(self._handle, name)

    def remote(self, *args: Any) -> Any:  # this handle's collect, armed
        news = self._ray.get(self._handle.collect.remote(*args), timeout=WAIT_S)
        self.polled.set()
        if not self._loses(news):
            return self._ray.put(news)
        self.lost.set()
        if self._die:
            raise ConnectionResetError("injected: the poll's answer was lost as it was fetched")

        def lost(_actor: Any) -> None:
            raise ConnectionResetError("injected: the poll's answer was lost on its way")

        return self._handle.__ray_call__.remote(lost)


def _losing(system: System, ray: Any, loses: Callable[[Any], bool], *, die: bool) -> _Loses:
    """``system``'s polls of model ``m`` go through a ``_Loses``, armed, once the poll that
    was pending has been answered (so that every answer from now on is fetched there)."""
    connection = system._assembly.connection  # type: ignore[attr-defined]
    fault = _Loses(ray, connection.models["m"], loses, die=die)
    connection.models["m"] = fault
    fault.armed.set()
    assert fault.polled.wait(WAIT_S), "the poller did not poll the model again"
    return fault


def _with_text(news: Any) -> bool:
    return any(d.text for batch in news.streams for d in batch.deltas)


def _in_flight(ray: Any, namespace: str) -> Callable[[], int]:
    model = ray.get_actor(model_name("m"), namespace=namespace)
    return lambda: int(ray.get(model.state.remote(), timeout=WAIT_S)["in_flight"])


LONG_S = 60.0
"""How long a call that is to be ended early goes on at the provider otherwise."""


def test_a_stream_whose_first_deltas_die_with_the_poller_reaches_its_reader_whole(
    cluster_systems: Callable[..., System],
    ray_local: Any,
    ray_namespace: str,
    read_stream: Callable[..., Any],
) -> None:
    # the first call sends the role and "Hel" at once, "lo, " 0.5 s later, then nothing
    # for a minute; its first batch is lost as the poller fetches it, and the poller dies
    # of it. The link restarts and sends the task again; the old call's "lo, " comes
    # before any delta of the new one. A reader must never get "lo, " first: the old call
    # is refused (ended on its model), and the stream goes to the reader whole, once.
    events = openai_stream(PIECES)

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        if arrival.index == 0:
            await resp.write(events[0] + events[1])  # the role and "Hel": one batch
            await asyncio.sleep(0.5)
            await resp.write(events[2])  # "lo, ": past the lost beginning
            await asyncio.sleep(LONG_S)
            rest = events[3:]
        else:  # a call sent again: its first delta after the old call's second batch
            await asyncio.sleep(1.0)
            rest = events
        for event in rest:
            await resp.write(event)
        await resp.write_eof()
        return resp

    with WireServer(handle) as server:
        cb = cluster_systems(base_url=server.base_url)
        fault = _losing(cb, ray_local, lambda news: bool(news.streams), die=True)
        stream = cb.stream("tell me")
        reader = read_stream(stream)
        reader.rest("the stream, sent again after its first deltas were lost")
        result = stream.result(WAIT_S)
        assert fault.lost.is_set()
        assert isinstance(result, Completed), result
        assert [d.text for d in reader.read if d.text] == PIECES  # from its beginning, once
        assert reader.text == result.content == "".join(PIECES)
        link = cb.supervision()["queue"]
        assert link["incarnation"] == 2
        assert "PollerDiedError" in link["last_errors"][-1]
        state = cb.ask("queue", GetState())
        assert state["refused"] >= 1, state  # the old call's "lo, " came, and was refused
        assert 2 <= server.count() <= 3  # the lost one, and whichever was sent again
        in_flight = _in_flight(ray_local, ray_namespace)
        assert wait_until(lambda: in_flight() == 0, timeout=10.0)  # not in a minute
        assert cb.drain(timeout=WAIT_S)
        counts = cb.ledger.counts()
        assert (counts.accepted, counts.finished, counts.live) == (1, 1, 0)


def test_a_stream_that_loses_deltas_after_its_reader_got_some_is_cut_with_those(
    cluster_systems: Callable[..., System],
    ray_local: Any,
    ray_namespace: str,
    read_stream: Callable[..., Any],
) -> None:
    # the reader gets the role and "Hel"; the batch with "lo, " is lost on its way (a Ray
    # error: the poller polls again), and "wor" comes next: the stream is cut, with
    # exactly the text its reader got, and its call ended on the model
    events = openai_stream(PIECES)

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        await resp.write(events[0] + events[1])  # the role and "Hel": one batch
        for event in events[2:4]:  # "lo, " (lost), then "wor" (past the gap)
            await asyncio.sleep(0.5)
            await resp.write(event)
        await asyncio.sleep(LONG_S)
        for event in events[4:]:
            await resp.write(event)
        await resp.write_eof()
        return resp

    passed: list[Any] = []

    def loses(news: Any) -> bool:  # the first batch after one with text went through
        if passed:
            return bool(news.streams)
        if _with_text(news):
            passed.append(news)
        return False

    with WireServer(handle) as server:
        cb = cluster_systems(base_url=server.base_url)
        fault = _losing(cb, ray_local, loses, die=False)
        stream = cb.stream("tell me")
        reader = read_stream(stream)
        result = reader.cut("the stream cut at the gap")
        assert fault.lost.is_set()
        assert "lost" in result.detail
        assert "Hel" in reader.text
        assert "lo, " not in reader.text  # nothing past the gap
        assert cb.supervision()["queue"]["incarnation"] == 1  # the poller lived
        in_flight = _in_flight(ray_local, ray_namespace)
        assert wait_until(lambda: in_flight() == 0, timeout=10.0)  # not in a minute
        assert server.count() == 1, "never a second call"


def test_a_stream_whose_every_delta_was_lost_before_its_answer_is_sent_again_whole(
    cluster_systems: Callable[..., System], ray_local: Any, read_stream: Callable[..., Any]
) -> None:
    # the first call's deltas (the role to the finish) come in one batch, lost on its
    # way; its answer comes half a second later, counting deltas its reader never got:
    # the call's answer is not the task's (its reader would have an answer it never
    # read), and the task is sent again, a fresh stream
    events = openai_stream(PIECES)

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        resp = await open_stream(request)
        if arrival.index == 0:
            await resp.write(b"".join(events[:6]))  # every delta: one batch
            await asyncio.sleep(0.5)  # the answer in a later poll
            rest = events[6:]
        else:
            rest = events
        for event in rest:
            await resp.write(event)
        await resp.write_eof()
        return resp

    with WireServer(handle) as server:
        cb = cluster_systems(base_url=server.base_url)
        fault = _losing(cb, ray_local, lambda news: bool(news.streams), die=False)
        stream = cb.stream("tell me")
        reader = read_stream(stream)
        reader.rest("the stream, sent again after all its deltas were lost")
        result = stream.result(WAIT_S)
        assert fault.lost.is_set()
        assert isinstance(result, Completed), result
        assert [d.text for d in reader.read if d.text] == PIECES  # from its beginning, once
        assert reader.text == result.content == "".join(PIECES)
        assert cb.ask("queue", GetState())["refused"] == 1
        assert server.count() == 2
        assert cb.supervision()["queue"]["incarnation"] == 1  # the poller lived
