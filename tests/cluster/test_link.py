"""Client processes of one Ray cluster (``cluster._link`` and the shared actors it
reaches): across nodes, and a client process killed and resumed.

The cluster is the test run's 2-node one (``two_nodes.py``: head ``near``, worker
``far``), which this test process joined as a driver on the head. A client that
must die or stop is a process of its own (``client_process.py``); the ones that
live through the test (two systems across nodes, the survivor, the heir of a
ledger) are systems in this process, each with its own ledger, link, poller and
owner number, reaching the shared actors through the same Ray calls another
process would. The simulated provider runs in this process too.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from callboard.cluster import connect
from callboard.cluster._connect import QUEUE_NAME, model_name
from callboard.core.limiter import LimiterConfig
from callboard.core.settings import SchedulerSettings
from callboard.messages import Completed, GetState
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.sqlite_ledger import SqliteLedger
from support import WAIT_S, wait_until

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
    assert shared_provider.stats()["models"]["m"]["requests"] == q["dispatched"]
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
