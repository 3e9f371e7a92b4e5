"""Client processes of a Ray cluster, for the cluster tests: ``python client_process.py
ROLE ADDRESS NAMESPACE BASE_URL ...``, run with ``tests/`` as the working directory.

Each role joins the cluster at ADDRESS as its own Ray driver, runs callboard
systems whose shared queue and model ``m`` (calling the provider at BASE_URL)
live in NAMESPACE, and reports what it saw as JSON lines on stdout:

* ``across`` N: places the shared actors on the node with the ``far`` resource
  (a placement group that captures what its task creates: the plain Ray way to
  put an application's actors on a node), then two systems submit N tasks each.
  Reports where the driver and the shared actors are, and every result.
* ``victim`` LEDGER N LEASE_S: one system on a SQLite ledger submits N tasks to a
  model taking two calls at a time; once the first has ended (so every
  acceptance is in the file: one writer, in order) and the shared actors hold
  some of its tasks, it reports its owner number and their state, and waits to
  be killed.
* ``sleeper`` N LEASE_S: one system submits N tasks to a model taking two calls
  at a time; once the shared actors hold some, it reports so and waits for a
  line on stdin (meanwhile the test stops the process for longer than its
  lease, and wakes it), then reports the results it gets.
* ``survivor`` LEASE_S: one system that reports its owner number, then reads a
  dead owner's number on stdin and reports the shared actors' state once that
  owner's lease has lapsed (the queue and the model have forgotten it); then
  reads N on stdin, sends N tasks of its own and reports their results.
* ``heir`` LEDGER LEASE_S: a system on the victim's ledger resumes it and
  reports the results and the shared queue's state.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, ".")

import ray
from callboard.cluster import connect
from callboard.cluster._connect import QUEUE_NAME, model_name
from callboard.core.limiter import LimiterConfig
from callboard.messages import GetState, Result
from support import WAIT_S, wait_until

from callboard import ModelSettings, System, SystemConfig
from callboard.config import RayCluster


@dataclass(frozen=True, slots=True)
class Joined:
    """The cluster this process joined, the namespace of the test, the provider."""

    address: str
    namespace: str
    base_url: str


def main(argv: list[str]) -> None:
    role, address, namespace, base_url, *rest = argv
    ray.init(address=address, namespace=namespace, log_to_driver=False)
    at = Joined(address, namespace, base_url)
    if role == "across":
        across(at, int(rest[0]))
    elif role == "victim":
        victim(at, rest[0], int(rest[1]), float(rest[2]))
    elif role == "survivor":
        survivor(at, float(rest[0]))
    elif role == "heir":
        heir(at, rest[0], float(rest[1]))
    elif role == "sleeper":
        sleeper(at, int(rest[0]), float(rest[1]))
    else:
        raise SystemExit(f"unknown role {role!r}")


def across(at: Joined, n: int) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # each system is configured under the provider's limit, as a deployment would be:
    # two limiters would send twice it, the shared one sends what it allows
    model = ModelSettings(
        name="m",
        base_url=at.base_url,
        max_concurrency=8,
        limiter=LimiterConfig(rpm=240, tpm=None, burst_s=0.5),
    )
    cluster = RayCluster(address=at.address, namespace=at.namespace)
    config = SystemConfig(models=(model,), cluster=cluster)
    far = placement_group([{"far": 1}])
    ray.get(far.ready(), timeout=WAIT_S)

    @ray.remote(num_cpus=0)
    def place() -> None:
        connect(cluster, {"m": model}, config.scheduler)

    pinned = PlacementGroupSchedulingStrategy(far, placement_group_capture_child_tasks=True)
    ray.get(place.options(scheduling_strategy=pinned).remote(), timeout=WAIT_S)
    queue, shell = shared(at.namespace)
    where = {
        "driver": ray.get_runtime_context().get_node_id(),
        "queue": node_of(queue),
        "model": node_of(shell),
        "far": [x["NodeID"] for x in ray.nodes() if x["Alive"] and "far" in x["Resources"]],
    }
    a, b = System(config), System(config)
    try:
        futures = [s.submit(f"{name} {i}") for i in range(n) for name, s in (("a", a), ("b", b))]
        results = [f.result(timeout=WAIT_S) for f in futures]
        drained = [s.drain(timeout=WAIT_S) for s in (a, b)]
        report(
            where=where,
            results=[described(r) for r in results],
            drained=drained,
            ledgers=[tallied(s) for s in (a, b)],
            owners=[s.ask("queue", GetState())["owner"] for s in (a, b)],
            queue=ray.get(queue.state.remote(), timeout=WAIT_S),
        )
    finally:
        for s in (a, b):
            s.stop(cancel=True, timeout=10)
        for actor in (queue, shell):
            ray.kill(actor, no_restart=True)
        remove_placement_group(far)


def victim(at: Joined, ledger: str, n: int, lease: float) -> None:
    cb = System(two_at_a_time(at, lease), ledger=ledger)
    futures = cb.submit_many([f"task {i}" for i in range(n)])
    futures[0].result(timeout=WAIT_S)  # committed after every acceptance: one writer, in order
    queue, shell = shared(at.namespace)
    states: dict[str, Any] = {}

    def holding() -> bool:  # calls in flight at the model, tickets waiting in the queue
        states["queue"], states["model"] = ray.get(
            [queue.state.remote(), shell.state.remote()], timeout=WAIT_S
        )
        return bool(states["model"]["in_flight"] >= 1 and states["queue"]["waiting"] >= 1)

    held = wait_until(holding)
    owner = cb.ask("queue", GetState())["owner"]
    report(owner=owner, held=held, **states)
    threading.Event().wait()  # until the test kills this process


def survivor(at: Joined, lease: float) -> None:
    cb = System(two_at_a_time(at, lease))
    try:
        queue, shell = shared(at.namespace)
        report(owner=cb.ask("queue", GetState())["owner"])
        dead = int(sys.stdin.readline())  # the test's word: it killed this owner's process
        states: dict[str, Any] = {}

        def forgotten() -> bool:  # the dead owner's lease lapsed at the queue and the model
            states["queue"], states["model"] = ray.get(
                [queue.state.remote(), shell.state.remote()], timeout=WAIT_S
            )
            q, m = states["queue"], states["model"]
            return (
                dead not in q["owners"]
                and q["waiting"] == 0
                and dead not in m["owners"]
                and m["in_flight"] == 0
            )

        started = time.monotonic()
        lapsed = wait_until(forgotten)
        report(lapsed=lapsed, after_s=time.monotonic() - started, **states)
        n = int(sys.stdin.readline())  # the test's word: send n tasks of its own
        futures = cb.submit_many([f"own {i}" for i in range(n)])
        report(results=[described(f.result(timeout=WAIT_S)) for f in futures])
    finally:
        cb.stop(timeout=10)


def heir(at: Joined, ledger: str, lease: float) -> None:
    cb = System(two_at_a_time(at, lease), ledger=ledger)
    try:
        queue = ray.get_actor(QUEUE_NAME, namespace=at.namespace)
        futures = cb.resume()
        results = [f.result(timeout=WAIT_S) for f in futures]
        drained = cb.drain(timeout=WAIT_S)
        report(
            results=[described(r) for r in results],
            drained=drained,
            ledger=tallied(cb),
            queue=ray.get(queue.state.remote(), timeout=WAIT_S),
        )
    finally:
        cb.stop(timeout=10)


def sleeper(at: Joined, n: int, lease: float) -> None:
    cb = System(two_at_a_time(at, lease))
    try:
        futures = cb.submit_many([f"task {i}" for i in range(n)])
        queue, shell = shared(at.namespace)

        def holding() -> bool:  # calls in flight at the model, tickets waiting in the queue
            q, m = ray.get([queue.state.remote(), shell.state.remote()], timeout=WAIT_S)
            return bool(m["in_flight"] >= 1 and q["waiting"] >= 1)

        report(held=wait_until(holding))
        sys.stdin.readline()  # the test's word: it has stopped and woken this process
        done, left = concurrent.futures.wait(futures, timeout=WAIT_S / 4)
        report(
            results=[described(f.result()) for f in done],
            unanswered=len(left),
            link=cb.ask("queue", GetState()),
        )
    finally:
        cb.stop(cancel=True, timeout=10)


# -- helpers --------------------------------------------------------------------


def two_at_a_time(at: Joined, lease: float) -> SystemConfig:
    model = ModelSettings(name="m", base_url=at.base_url, max_concurrency=2)
    cluster = RayCluster(address=at.address, namespace=at.namespace, lease_s=lease)
    return SystemConfig(models=(model,), cluster=cluster)


def shared(namespace: str) -> tuple[Any, Any]:
    """The cluster's queue and model ``m`` actors."""
    return (
        ray.get_actor(QUEUE_NAME, namespace=namespace),
        ray.get_actor(model_name("m"), namespace=namespace),
    )


def node_of(actor: Any) -> str:
    """The node ``actor`` runs on (asked of the actor itself)."""
    where = actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id())
    return str(ray.get(where, timeout=WAIT_S))


def described(r: Result) -> dict[str, Any]:
    return {"task_id": r.task_id, "kind": type(r).__name__, "model": getattr(r, "model", None)}


def tallied(system: System) -> dict[str, int]:
    counts = system.ledger.counts()
    return {"accepted": counts.accepted, "finished": counts.finished, "live": counts.live}


def report(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
