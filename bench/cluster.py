"""Scenario ``cluster``: several client processes share one scheduler on a local Ray.

The bench process starts a local Ray and the provider process; every client
is a process of its own (``python -m callboard.bench.cluster CLIENT``) whose
``System`` joins the bench's Ray (by its address) in a namespace
of this run, and prints its report as one JSON line.

Phases, each on a model of its own (so each starts with fresh shared actors):

* ``shared``: ``CLIENTS`` processes send to one model the provider limits to
  ``RPM``; each is configured with the same ``RPM``. Figures: the server's
  429s (must be 0) and the combined rate after the first second's burst over
  the limit (must be >= 0.95). Without the shared limiter four processes would
  send up to four times the limit.
* ``priority``: process A queues a LOW backlog on a one-call-at-a-time model;
  process B then sends CRITICAL tasks one after another (its first, which
  pays for a fresh process's first calls, is not counted). Figure: B's p99
  queue wait over the service time (must be <= 1: it waits at most for the
  call in flight), measured as the priority scenario does: the median time of
  A's calls from the wire to their results (the server's latency, the HTTP
  and the way back); over the server's latency alone beside it.
* ``crash``: one process sends a burst; the bench kills the model actor
  mid-run (Ray restarts it). Figures: lost and duplicated (must be 0), the
  calls the server received per task.
* ``overhead``: one call at a time, on a local system and on a cluster one in
  the same client process, in alternating rounds (so both see the same load);
  the per-call added latency of the Ray path (target p50 <= 2 ms), and the CPU
  each call costs the client process and the shared actors' processes (what
  a loaded machine changes little). Beside it, in the same rounds, a bare Ray
  round trip to the queue actor and the load average: the added latency moves
  with the machine (1.5 ms at light load, 3.5 under load, for the same code),
  and in round trips it moves far less.
* ``queue``: the shared queue alone, fed tickets in batches and granted
  credits in batches by a sink actor: the calls per second one queue actor
  schedules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from callboard.bench.measure import ScenarioResult
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess
from callboard.bench.subject import bench_model, quiet, thread_cpu_s
from callboard.core.limiter import LimiterConfig
from callboard.messages import Priority, Result

from callboard import System, SystemConfig
from callboard.config import RayCluster

__all__ = ["run_cluster"]

NAME = "cluster"
CLIENTS = 4
RPM = 1200
SHARED_TASKS = 150
"""Per client: 600 tasks at 20/s take ~30 s."""
SERVICE_S = 0.1
"""The priority phase's call time (one call at a time)."""
BACKLOG = 60
URGENT = 20
CRASH_TASKS = 300
OVERHEAD_CALLS = 200
OVERHEAD_ROUNDS = 10
"""The overhead phase alternates local and Ray rounds of ``OVERHEAD_CALLS / ROUNDS`` calls."""
QUEUE_TICKETS = 20_000
WAIT_S = 180.0
NOISY = ("callboard.cluster", "ray")


@dataclass(frozen=True, slots=True)
class _Client:
    """What one client process does."""

    base_url: str
    namespace: str
    model: str
    concurrency: int
    tasks: int
    priority: Priority = Priority.NORMAL
    rpm: int | None = None
    one_by_one: bool = False
    """Submit each task when the one before has ended (else all at once)."""
    start_after_s: float = 0.0
    warmup: int = 0
    """Calls made (and not measured) before the measured ones."""
    paired: bool = False
    """The overhead phase: a local and a cluster system, alternating rounds."""
    address: str = ""
    """The bench's own Ray (its GCS address), filled in by ``_start``: "auto" would
    join whichever Ray this machine started last, another user's or a test's."""


def run_cluster(opts: Options) -> ScenarioResult:
    result = ScenarioResult(name=NAME)
    try:
        import ray
    except ImportError:
        result.notes.append("skipped: Ray is not installed (pip install 'callboard[ray]')")
        return result
    started = time.monotonic()
    namespace = f"bench-{os.getpid()}"
    result.settings = {
        "clients": CLIENTS,
        "rpm": RPM,
        "server_burst_s": 1.0,
        "shared_tasks": SHARED_TASKS * CLIENTS,
        "priority": {"service_s": SERVICE_S, "backlog": BACKLOG, "urgent": URGENT},
        "crash_tasks": CRASH_TASKS,
        "overhead_calls": OVERHEAD_CALLS,
        "queue_tickets": QUEUE_TICKETS,
    }
    with quiet(*NOISY):
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            with ProviderProcess(latency_s=0.02, seed=opts.seed) as prov:
                base = prov.base_url
                result.figures["shared"] = _shared(prov, base, namespace)
                result.figures["priority"] = _priority(prov, base, namespace)
                result.figures["crash"] = _crash(prov, base, namespace)
                result.figures["overhead"] = _overhead(prov, base, namespace)
            result.figures["queue"] = _queue_rate(namespace)
        finally:
            ray.shutdown()
    result.seconds = time.monotonic() - started
    return result


# -- phases ---------------------------------------------------------------


def _shared(prov: ProviderProcess, base: str, namespace: str) -> dict[str, Any]:
    prov.configure("shared", latency_s=0.02, rpm=RPM)
    prov.reset_stats()
    client = _Client(base, namespace, "shared", 64, SHARED_TASKS, rpm=RPM)
    reports = _in_processes([client] * CLIENTS)
    server = prov.stats()["models"]["shared"]
    arrivals = sorted(server["arrivals"])
    steady = [t for t in arrivals if t >= arrivals[0] + 1.0] if arrivals else []
    rate = (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 else None
    return {
        "completed": sum(r["outcomes"].get("Completed", 0) for r in reports),
        "server_429s": server["rate_limited"],
        "server_requests": server["requests"],
        "rate_per_s": None if rate is None else round(rate, 2),
        "rate_over_limit": None if rate is None else round(rate / (RPM / 60), 3),
    }


def _priority(prov: ProviderProcess, base: str, namespace: str) -> dict[str, Any]:
    prov.configure("prio", latency_s=SERVICE_S)
    backlog = _Client(base, namespace, "prio", 1, BACKLOG, priority=Priority.LOW)
    urgent = _Client(
        base,
        namespace,
        "prio",
        1,
        URGENT,
        priority=Priority.CRITICAL,
        one_by_one=True,
        start_after_s=1.0,
        warmup=1,
    )
    low, critical = _in_processes([backlog, urgent])
    waits = sorted(critical["queue_waits"])
    p99 = waits[min(len(waits) - 1, round(0.99 * (len(waits) - 1)))]
    on_wire = [lat - w for lat, w in zip(low["latencies"], low["queue_waits"], strict=True)]
    service = statistics.median(on_wire)
    return {
        "critical_p50_wait_s": round(statistics.median(waits), 4),
        "critical_p99_wait_s": round(p99, 4),
        "critical_max_wait_s": round(waits[-1], 4),
        # one service time as the priority scenario measures it: a call's time from the
        # wire to its result in the process (the server's SERVICE_S, the client's HTTP
        # and the way back): what a CRITICAL task may wait for the call ahead of it. It
        # was the server's SERVICE_S alone, a definition no other scenario used (a review)
        "p99_over_service": round(p99 / service, 3),
        "p99_over_server_latency": round(p99 / SERVICE_S, 3),
        "low_p50_wait_s": round(statistics.median(low["queue_waits"]), 3),
        "low_p50_on_wire_to_result_s": round(service, 4),
    }


def _crash(prov: ProviderProcess, base: str, namespace: str) -> dict[str, Any]:
    import ray

    prov.configure("crashy", latency_s=0.05)
    prov.reset_stats()
    proc = _start(_Client(base, namespace, "crashy", 8, CRASH_TASKS))
    killed = False
    while not killed and proc.poll() is None:
        if prov.stats()["models"].get("crashy", {}).get("requests", 0) >= CRASH_TASKS // 4:
            actor = ray.get_actor("callboard.model:crashy", namespace=namespace)
            ray.kill(actor, no_restart=False)
            killed = True
        else:
            time.sleep(0.05)  # polling the provider's counters from outside: no event to wait on
    report = _report(proc)
    server = prov.stats()["models"]["crashy"]
    return {
        "killed": killed,
        "lost": CRASH_TASKS - report["answered"],
        # answered is any result: a task the kill failed is served no better than lost
        "not_completed": CRASH_TASKS - report["outcomes"].get("Completed", 0),
        "duplicated": report["duplicated"],
        "ledger_balanced": report["ledger_balanced"],
        "outcomes": report["outcomes"],
        "server_calls_per_task": round(server["requests"] / CRASH_TASKS, 3),
    }


def _overhead(prov: ProviderProcess, base: str, namespace: str) -> dict[str, Any]:
    prov.configure("fast", latency_s=0.005)
    client = _Client(base, namespace, "fast", 4, OVERHEAD_CALLS, one_by_one=True, paired=True)
    report = _report(_start(client))
    local, on_ray = report["local"], report["ray"]
    added = [r - lo for lo, r in zip(local["latencies"], on_ray["latencies"], strict=True)]
    calls = len(on_ray["latencies"])
    trip_ms = statistics.median(report["ray_trips"]) * 1000
    added_ms = 1000 * (
        statistics.median(on_ray["latencies"]) - statistics.median(local["latencies"])
    )
    return {
        "ray_round_trip_p50_ms": round(trip_ms, 2),
        "added_in_round_trips": round(added_ms / trip_ms, 2) if trip_ms > 0 else None,
        "load_average": {"start": report["loads"][0], "end": report["loads"][-1]},
        "local_p50_ms": round(statistics.median(local["latencies"]) * 1000, 2),
        "ray_p50_ms": round(statistics.median(on_ray["latencies"]) * 1000, 2),
        "added_p50_ms": round(
            (statistics.median(on_ray["latencies"]) - statistics.median(local["latencies"])) * 1000,
            2,
        ),
        "added_paired_p50_ms": round(statistics.median(added) * 1000, 2),
        "client_cpu_ms_per_call": {"local": local["cpu_ms"], "ray": on_ray["cpu_ms"]},
        "client_cpu_ms_by_thread": {"local": local["by_thread"], "ray": on_ray["by_thread"]},
        "actor_cpu_ms_per_call": {
            name: round(1e3 * cpu / calls, 3) for name, cpu in report["actors_cpu_s"].items()
        },
    }


def _queue_rate(namespace: str) -> dict[str, Any]:
    """Tickets in, credits in, calls out: the shared queue's scheduling rate alone."""
    import ray
    from callboard.cluster._queue import QueueShell
    from callboard.cluster._wire import Ticket
    from callboard.core.settings import SchedulerSettings

    queue: Any = (
        ray.remote(QueueShell)
        .options(namespace=namespace, name="bench.queue", num_cpus=0)
        .remote(SchedulerSettings(capacity=QUEUE_TICKETS * 2), 60.0)
    )
    sink: Any = ray.remote(_Sink).options(num_cpus=0).remote()
    owner, _ = ray.get(queue.register.remote("bench"))
    now = time.time()
    tickets = [
        Ticket(
            owner=owner,
            task_id=i,
            attempt=0,
            priority=i % 4,
            arrival=now,
            deadline=None,
            lanes=("sink",),
            tenant=None,
            cost=100,
            trace_id=str(i),
            request="{}",
            prompt_tokens=10,
        )
        for i in range(QUEUE_TICKETS)
    ]
    batch = 200
    t0 = time.perf_counter()
    ray.get([queue.enqueue.remote(tickets[i : i + batch]) for i in range(0, len(tickets), batch)])
    t1 = time.perf_counter()
    ray.get([queue.ready.remote("sink", 1, batch, sink) for _ in range(QUEUE_TICKETS // batch)])
    taken: int = ray.get(sink.wait_for.remote(QUEUE_TICKETS))
    t2 = time.perf_counter()
    ray.kill(queue)
    ray.kill(sink)
    return {
        "batch": batch,
        "enqueued_per_s": round(QUEUE_TICKETS / (t1 - t0)),
        "scheduled_per_s": round(taken / (t2 - t1)),
    }


class _Sink:
    """A model actor that only counts the calls the queue sends it."""

    def __init__(self) -> None:
        import asyncio

        self.n = 0
        self._more = asyncio.Event()

    async def call(self, incarnation: int, tickets: list[Any], *_: Any) -> None:  # noqa: ARG002
        """The queue's batch (its ranks, and what else it says, beside it)."""
        self.n += len(tickets)
        self._more.set()

    async def wait_for(self, n: int) -> int:
        while self.n < n:
            self._more.clear()
            await self._more.wait()
        return self.n


# -- client processes ---------------------------------------------------------


def _start(client: _Client) -> subprocess.Popen[str]:
    """A client process (``python -m callboard.bench.cluster CLIENT_JSON``) of this
    bench's Ray."""
    import ray

    client = dataclasses.replace(client, address=ray.get_runtime_context().gcs_address)
    return subprocess.Popen(  # noqa: S603 - this module, on this interpreter
        [sys.executable, "-m", "callboard.bench.cluster", json.dumps(dataclasses.asdict(client))],
        stdout=subprocess.PIPE,
        text=True,
    )


def _report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=WAIT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"a cluster bench client failed with exit code {proc.returncode}")
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report


def _in_processes(clients: list[_Client]) -> list[dict[str, Any]]:
    """Run each client in a process of its own; their reports, in order."""
    procs = [_start(c) for c in clients]
    return [_report(p) for p in procs]


def _config(client: _Client, *, on_ray: bool) -> SystemConfig:
    limiter = LimiterConfig(rpm=client.rpm, tpm=None) if client.rpm else None
    model = bench_model(
        client.model,
        client.base_url,
        client.concurrency,
        **({"limiter": limiter} if limiter else {}),
    )
    cluster = RayCluster(address=client.address, namespace=client.namespace) if on_ray else None
    return SystemConfig(models=(model,), cluster=cluster)


def _paired_main(client: _Client) -> dict[str, Any]:
    """The overhead phase's client: a local and a cluster system, one call at a time,
    in alternating rounds; each side's latencies and client CPU per call."""
    import ray

    runs: dict[str, dict[str, Any]] = {}
    actors_cpu = {"queue": 0.0, "model": 0.0}
    with (
        quiet(*NOISY),
        System(_config(client, on_ray=False)) as local,
        System(_config(client, on_ray=True)) as on_ray,
    ):
        sides = {"local": local, "ray": on_ray}
        for name, system in sides.items():
            for i in range(10):  # a fresh system's first calls: not measured
                system.submit(f"warm-up {i}").result(timeout=WAIT_S)
            runs[name] = {"latencies": [], "cpu_s": 0.0, "by_thread": {}}
        actors: dict[str, Any] = {
            "queue": ray.get_actor("callboard.queue", namespace=client.namespace),
            "model": ray.get_actor(f"callboard.model:{client.model}", namespace=client.namespace),
        }

        def actors_cpu_s() -> dict[str, float]:
            states: list[dict[str, Any]] = ray.get([a.state.remote() for a in actors.values()])
            return {n: float(state["cpu_s"]) for n, state in zip(actors, states, strict=True)}

        per_round = client.tasks // OVERHEAD_ROUNDS
        trips: list[float] = []  # a bare Ray round trip, in the same rounds: the machine's
        loads = [os.getloadavg()[0]]
        for _ in range(OVERHEAD_ROUNDS):
            for _ in range(per_round):
                began = time.perf_counter()
                ray.get(actors["queue"].state.remote())
                trips.append(time.perf_counter() - began)
            for name, system in sides.items():
                run = runs[name]
                shared = actors_cpu_s() if name == "ray" else {}
                cpu, threads = time.process_time(), thread_cpu_s()
                for i in range(per_round):
                    result = system.submit(f"one {i}").result(timeout=WAIT_S)
                    run["latencies"].append(result.latency_s)
                run["cpu_s"] += time.process_time() - cpu
                for kind, used in thread_cpu_s().items():
                    spent = used - threads.get(kind, 0.0)
                    run["by_thread"][kind] = run["by_thread"].get(kind, 0.0) + spent
                for n, used in actors_cpu_s().items() if shared else ():
                    actors_cpu[n] += used - shared[n]
        loads.append(os.getloadavg()[0])
    report: dict[str, Any] = {"actors_cpu_s": actors_cpu, "ray_trips": trips, "loads": loads}
    for name, run in runs.items():
        calls = len(run["latencies"])
        report[name] = {
            "latencies": run["latencies"],
            "cpu_ms": round(1e3 * run["cpu_s"] / calls, 3),
            "by_thread": {
                kind: round(1e3 * used / calls, 3)
                for kind, used in sorted(run["by_thread"].items(), key=lambda kv: -kv[1])
                if used > 0
            },
        }
    return report


def _client_main(client: _Client) -> dict[str, Any]:
    """One client process: join the cluster (or not), send, report."""
    if client.paired:
        return _paired_main(client)
    config = _config(client, on_ray=bool(client.namespace))
    with quiet(*NOISY), System(config) as system:
        for i in range(client.warmup):  # a fresh process's first calls: not measured
            system.submit(f"warm-up {i}", priority=client.priority).result(timeout=WAIT_S)
        time.sleep(client.start_after_s)  # the other client's backlog goes first
        results = _send(system, client)
        counts = system.ledger.counts()
    ids = Counter(r.task_id for r in results)
    return {
        "answered": len(ids),
        "duplicated": sum(n - 1 for n in ids.values()),
        "ledger_balanced": counts.balanced and counts.live == 0,
        "outcomes": dict(Counter(type(r).__name__ for r in results)),
        "queue_waits": [r.queue_wait_s for r in results],
        "latencies": [r.latency_s for r in results],
    }


def _send(system: System, client: _Client) -> list[Result]:
    if client.one_by_one:
        return [
            system.submit(f"one {i}", priority=client.priority).result(timeout=WAIT_S)
            for i in range(client.tasks)
        ]
    prompts = [f"task {i}" for i in range(client.tasks)]
    futures = system.submit_many(prompts, priority=client.priority)
    return [f.result(timeout=WAIT_S) for f in futures]


if __name__ == "__main__":
    fields = json.loads(sys.argv[1])
    fields["priority"] = Priority(fields["priority"])
    print(json.dumps(_client_main(_Client(**fields))))
