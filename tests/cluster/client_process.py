"""Client processes of a Ray cluster that the cluster tests kill or stop: ``python
client_process.py ROLE ADDRESS NAMESPACE BASE_URL ...``, run with ``tests/`` as the
working directory.

Each role joins the cluster at ADDRESS as its own Ray driver, runs a callboard
system whose shared queue and model ``m`` (calling the provider at BASE_URL)
live in NAMESPACE, and reports what it saw as JSON lines on stdout:

* ``victim`` LEDGER N LEASE_S: one system on a SQLite ledger submits N tasks to a
  model taking two calls at a time; once the first has ended (so every
  acceptance is in the file: one writer, in order) and the shared actors hold
  some of its tasks, it reports its owner number and their state, and waits to
  be killed.
* ``sleeper`` N LEASE_S: one system submits N tasks to a model taking two calls
  at a time; once the shared actors hold some, it reports so and waits for a
  line on stdin (meanwhile the test stops the process for longer than its
  lease, and wakes it), then reports the results it gets.

The clients that live through a test are systems in the test process itself.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, ".")

import ray
from callboard.cluster._connect import QUEUE_NAME, model_name
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
    if role == "victim":
        victim(at, rest[0], int(rest[1]), float(rest[2]))
    elif role == "sleeper":
        sleeper(at, int(rest[0]), float(rest[1]))
    else:
        raise SystemExit(f"unknown role {role!r}")


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


def described(r: Result) -> dict[str, Any]:
    return {"task_id": r.task_id, "kind": type(r).__name__, "model": getattr(r, "model", None)}


def report(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
