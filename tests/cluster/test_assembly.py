"""Systems whose queue and model run on a local Ray (``cluster._assembly`` and the
actors it wires: ``_link``, ``_queue``, ``_model``), against a real simulated provider.

The cluster is the test run's one (``ray_local``), each test in a namespace of its
own. Two systems in one process stand for two client processes: each has its own ledger, link,
poller and owner number, and reaches the shared actors through the same Ray
calls a second process would (the bench runs four real processes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from callboard.cluster._assembly import ray_said
from callboard.cluster._wire import Ticket, ticket_of
from callboard.core.breaker import BreakerConfig
from callboard.core.limiter import LimiterConfig
from callboard.core.retry import RetryConfig
from callboard.messages import (
    Cancelled,
    Completed,
    Expired,
    Failed,
    FailureReason,
    Job,
    Priority,
    Rejected,
    RejectReason,
    Result,
)
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from loopback import WireServer, answer, openai_error
from support import WAIT_S, dead_port

from callboard import ModelSettings, StreamFailedError, System, SystemConfig
from callboard.config import RayCluster


def _results(futures: list[Any]) -> list[Result]:
    return [f.result(timeout=WAIT_S) for f in futures]


def _exactly_once(system: System, n: int) -> None:
    """Every accepted task ended once: the ledger finished ``n``, none live."""
    assert system.drain(timeout=WAIT_S)
    counts = system.ledger.counts()
    assert (counts.accepted, counts.finished, counts.live) == (n, n, 0)
    assert system.stats().outcomes["completed"] == n


def test_a_system_on_ray_answers_its_tasks(cluster_systems: Callable[..., System]) -> None:
    system = cluster_systems(max_concurrency=8)
    results = _results([system.submit(f"question {i}") for i in range(30)])
    assert all(isinstance(r, Completed) and r.model == "m" for r in results)
    assert {r.task_id for r in results} == {f.task_id for f in results}  # type: ignore[attr-defined]
    _exactly_once(system, 30)


def test_two_systems_share_one_limiter(
    cluster_systems: Callable[..., System], shared_provider: SimulatedProvider
) -> None:
    # the provider allows 300 rpm with a 1 s burst; each system is configured under
    # it, as a deployment would: two limiters would send up to 480 rpm, and draw 429s
    shared_provider.configure("m", ModelBehaviour(latency_s=0.01, rpm=300, burst_s=1.0))
    limits = {"limiter": LimiterConfig(rpm=240, tpm=None, burst_s=0.5), "max_concurrency": 8}
    a, b = cluster_systems(**limits), cluster_systems(**limits)
    futures = [s.submit(f"{name} {i}") for i in range(12) for name, s in (("a", a), ("b", b))]
    results = _results(futures)
    assert all(isinstance(r, Completed) for r in results)
    stats = shared_provider.stats()["models"]["m"]
    assert stats["rate_limited"] == 0
    assert stats["requests"] == 24


def test_priority_is_global_across_systems(
    cluster_systems: Callable[..., System], shared_provider: SimulatedProvider
) -> None:
    # one call at a time, 50 ms each: A's LOW backlog holds the model when B's
    # CRITICAL tasks arrive; they go at the next free slots, ahead of A's backlog
    shared_provider.configure("m", ModelBehaviour(latency_s=0.05))
    a, b = cluster_systems(max_concurrency=1), cluster_systems(max_concurrency=1)
    low_at = time.monotonic()
    low = [a.submit(f"low {i}", priority=Priority.LOW) for i in range(20)]
    low[0].result(timeout=WAIT_S)
    critical_at = time.monotonic()
    critical = [b.submit(f"urgent {i}", priority=Priority.CRITICAL) for i in range(3)]
    results = _results(critical + low)
    assert all(isinstance(r, Completed) for r in results)
    # in the order the calls went (submitted, then waited in the queue: 50 ms apart, one
    # at a time), not the order the two systems delivered their answers in: each hears
    # of its own in its own poll, and a CRITICAL answer heard late read as a LOW ahead
    sent = sorted(
        [(critical_at + r.queue_wait_s, "critical") for r in results[:3]]
        + [(low_at + r.queue_wait_s, "low") for r in results[3:]]
    )
    order = [name for _, name in sent]
    last_critical = max(i for i, n in enumerate(order) if n == "critical")
    lows_before = order[:last_critical].count("low")
    # at most the LOW call in flight, the ones granted ahead and the one in the window
    assert lows_before <= 1 + 4, order
    assert len(order) - last_critical - 1 >= 20 - 1 - 4 - 1 - 5  # the backlog waited


def test_a_queue_killed_before_a_process_heard_from_it_is_still_seen_restarted(
    cluster_systems: Callable[..., System], shared_provider: SimulatedProvider, ray_local: Any
) -> None:
    """A process learnt its actors' incarnations only from their news, and the queue's
    first news comes after a long poll's wait (0.25 s): a queue killed before it lost
    the process's waiting tickets, and nothing sent them again (a CI run's hang). The
    incarnations known at start (the queue's from ``register``, the models' asked) are
    where it compares from."""
    shared_provider.configure("m", ModelBehaviour(latency_s=0.05))
    system = cluster_systems(max_concurrency=1)
    futures = [system.submit(f"task {i}") for i in range(6)]  # five wait in the queue
    namespace = system.config.cluster.namespace  # type: ignore[union-attr]
    ray_local.kill(ray_local.get_actor("callboard.queue", namespace=namespace), no_restart=False)
    assert all(isinstance(r, Completed) for r in _results(futures))
    _exactly_once(system, 6)


def test_a_process_joining_a_restarted_queue_gets_a_number_no_other_process_has(
    cluster_systems: Callable[..., System], shared_provider: SimulatedProvider, ray_local: Any
) -> None:
    """A process keeps its owner number across a restart of the queue; the restarted
    queue counted from 1 again and gave a new process the same number: tickets of the
    two collided, answers crossed, tasks hung."""
    shared_provider.configure("m", ModelBehaviour(latency_s=0.02))
    a = cluster_systems(max_concurrency=4)
    assert isinstance(a.submit("before").result(timeout=WAIT_S), Completed)
    namespace = a.config.cluster.namespace  # type: ignore[union-attr]
    ray_local.kill(ray_local.get_actor("callboard.queue", namespace=namespace), no_restart=False)
    c = cluster_systems(max_concurrency=4)  # registers with the restarted queue
    futures = [s.submit(f"{name} {i}") for i in range(10) for name, s in (("a", a), ("c", c))]
    results = _results(futures)
    assert all(isinstance(r, Completed) for r in results)
    assert [r.task_id for r in results] == [f.task_id for f in futures]  # type: ignore[attr-defined]
    _exactly_once(a, 11)
    _exactly_once(c, 10)


def test_tasks_the_shared_queue_has_no_room_for_end_rejected_not_hung(
    cluster_systems: Callable[..., System], shared_provider: SimulatedProvider
) -> None:
    """The shared queue's capacity is the cluster's (here the first process's, 5):
    another process, within its own, filled it, and the tickets it refused were
    dropped with nobody told: their tasks never ended."""
    shared_provider.configure("m", ModelBehaviour(latency_s=0.2))
    small = cluster_systems(max_concurrency=1, queue_capacity=5)
    assert isinstance(small.submit("creates the queue").result(timeout=WAIT_S), Completed)
    roomy = cluster_systems(max_concurrency=1)
    results = _results([roomy.submit(f"task {i}") for i in range(20)])
    kinds = {type(r).__name__ for r in results}
    assert kinds <= {"Completed", "Rejected"}, kinds
    rejected = [r for r in results if isinstance(r, Rejected)]
    assert rejected, "the queue holds 5: some had no room"
    assert all(r.reason is RejectReason.QUEUE_FULL for r in rejected)
    assert roomy.drain(timeout=WAIT_S)


def test_a_task_whose_ticket_the_shared_queue_cannot_take_fails_and_the_rest_run(
    cluster_systems: Callable[..., System], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process of another version wrote a ticket the shared queue cannot take (a
    tenant that is not a name): the queue's batch stopped there and that task never
    ended (found by a hunt). It fails, naming why; the others run."""
    system = cluster_systems(max_concurrency=4)
    assert isinstance(system.submit("the queue is up").result(timeout=WAIT_S), Completed)

    def another_version(job: Job, owner: int, *, now: float, wall: float) -> Ticket:
        ticket = ticket_of(job, owner, now=now, wall=wall)
        skewed = "another version" in job.task.request.messages[0].content
        return dataclasses.replace(ticket, tenant=7) if skewed else ticket  # type: ignore[arg-type]

    monkeypatch.setattr("callboard.cluster._link.ticket_of", another_version)
    futures = [system.submit("one"), system.submit("from another version"), system.submit("two")]
    first, skewed, second = _results(futures)
    assert isinstance(first, Completed)
    assert isinstance(second, Completed)
    assert isinstance(skewed, Failed)
    assert skewed.reason is FailureReason.INTERNAL
    assert "cannot take it" in skewed.detail
    assert "tenant" in skewed.detail
    assert system.drain(timeout=WAIT_S)
    counts = system.ledger.counts()
    assert (counts.accepted, counts.finished, counts.live) == (4, 4, 0)


def test_a_system_that_stops_takes_its_waiting_tickets_back_from_the_cluster(
    cluster_systems: Callable[..., System], shared_provider: SimulatedProvider
) -> None:
    """A stop that ends what is left ``Cancelled`` (not cancelling first) left the
    tickets in the shared queue: the cluster called the provider for tasks already
    ended, up to a lease, ahead of another process's work (found by a hunt)."""
    shared_provider.configure("m", ModelBehaviour(latency_s=0.2))
    stopping = cluster_systems(max_concurrency=1)
    futures = [stopping.submit(f"task {i}") for i in range(20)]
    assert isinstance(futures[0].result(timeout=WAIT_S), Completed)
    stopping.stop(timeout=0.1)
    assert sum(isinstance(r, Cancelled) for r in _results(futures)) >= 15
    before = shared_provider.stats()["models"]["m"]["requests"]
    other = cluster_systems(max_concurrency=1)
    assert isinstance(other.submit("after the stop").result(timeout=WAIT_S), Completed)
    called = shared_provider.stats()["models"]["m"]["requests"] - before
    assert called <= 3, f"{called} calls: the stopped system's tickets were still called"


def test_a_model_given_up_on_fails_its_tasks_on_ray_as_locally(
    cluster_systems: Callable[..., System],
) -> None:
    """The shared model actor never said it gave up (``give_up_s``): tasks without a
    deadline waited for good while the provider was down."""
    breaker = BreakerConfig(
        consecutive_failures=2, cooldown_s=0.1, max_cooldown_s=0.2, give_up_s=0.5
    )
    retry = RetryConfig(max_attempts=3, initial_s=0.01, jitter_s=0.0)
    system = cluster_systems(
        base_url=f"http://127.0.0.1:{dead_port()}/v1", breaker=breaker, retry=retry
    )
    results = _results([system.submit(f"doomed {i}") for i in range(3)])
    assert {type(r) for r in results} == {Failed}, results
    down = [r for r in results if isinstance(r, Failed) and r.reason is FailureReason.PROVIDER_DOWN]
    assert down, "some waited for the breaker, and were ended when the model was given up on"
    assert all("m is given up on" in r.detail for r in down), down
    assert system.drain(timeout=WAIT_S)


def test_the_call_that_has_a_model_given_up_on_keeps_its_own_answer_on_ray(
    cluster_systems: Callable[..., System],
) -> None:
    """A wrong key: the 401 gives the model up, and its health came in the same batch
    as the answer, which was dropped: the task ended as never called (attempts 0, no
    status), where locally it ends with the provider's 401 (found by a hunt)."""
    refused = openai_error("Incorrect API key provided", "invalid_request_error", "invalid_api_key")
    with WireServer(answer(refused, status=401)) as srv:
        system = cluster_systems(base_url=srv.base_url)
        result = system.submit("with a wrong key").result(WAIT_S)
    assert isinstance(result, Failed), result
    assert (result.attempts, result.status_code) == (1, 401), result
    assert srv.count() == 1


def test_a_process_configuring_a_shared_model_otherwise_is_told_what_differs(
    cluster_systems: Callable[..., System], caplog: pytest.LogCaptureFixture
) -> None:
    """The shared actor keeps the first process's settings: a rotated key, another
    base_url or cap here changed nothing, and nothing said so."""
    first = cluster_systems(max_concurrency=1, api_key="sk-first-0123456789abcdef")
    assert isinstance(first.submit("made the actor").result(timeout=WAIT_S), Completed)
    with caplog.at_level(logging.WARNING, logger="callboard.cluster"):
        cluster_systems(max_concurrency=1, api_key="sk-first-0123456789abcdef")
        assert "shared actor was made with other" not in caplog.text
        cluster_systems(max_concurrency=8, api_key="sk-second-0123456789abcdef")
    assert "model m: the cluster's shared actor was made with other" in caplog.text
    assert "api_key, max_concurrency" in caplog.text
    assert "sk-" not in caplog.text


def test_a_process_configuring_the_shared_queue_otherwise_is_told_what_differs(
    cluster_systems: Callable[..., System], caplog: pytest.LogCaptureFixture
) -> None:
    """The shared queue keeps the first process's scheduler and lease: a later one's
    ``capacity = 2`` held back nothing, and nothing said so (found by a hunt)."""
    first = cluster_systems(max_concurrency=1)
    assert isinstance(first.submit("made the queue").result(timeout=WAIT_S), Completed)
    with caplog.at_level(logging.WARNING, logger="callboard.cluster"):
        cluster_systems(max_concurrency=1)
        assert "shared queue was made with other" not in caplog.text
        cluster_systems(max_concurrency=1, queue_capacity=2, lease_s=5.0)
    assert "the cluster's shared queue was made with other capacity, lease_s" in caplog.text


def test_killed_queue_and_model_actors_lose_and_repeat_nothing(
    cluster_systems: Callable[..., System], shared_provider: SimulatedProvider, ray_local: Any
) -> None:
    # Ray restarts both (their state lost: waiting tickets, calls in flight, credits);
    # each system's ledger sends its tasks again, and each ends exactly once
    shared_provider.configure("m", ModelBehaviour(latency_s=0.1))
    a, b = cluster_systems(max_concurrency=4), cluster_systems(max_concurrency=4)
    futures = [s.submit(f"task {i}") for i in range(15) for s in (a, b)]
    futures[0].result(timeout=WAIT_S)
    namespace = a.config.cluster.namespace  # type: ignore[union-attr]
    for name in ("callboard.queue", "callboard.model:m"):
        ray_local.kill(ray_local.get_actor(name, namespace=namespace), no_restart=False)
    results = _results(futures)
    assert all(isinstance(r, Completed) for r in results)
    _exactly_once(a, 15)
    _exactly_once(b, 15)
    assert shared_provider.stats()["models"]["m"]["requests"] >= 30


def test_a_call_on_the_wire_at_its_deadline_keeps_its_key_answered_on_ray(
    cluster_systems: Callable[..., System], shared_provider: SimulatedProvider
) -> None:
    """The link ends a task at its deadline before the model's answer comes: counted as
    never called, its idempotency key was free, and a retry with it was called a second
    time (found by a review). The deadline leaves the ticket 3 s to reach the provider
    through the cluster's hops: at 1 s, a fresh-clone run's call had not yet arrived
    when its deadline passed (the provider saw none)."""
    shared_provider.configure("m", ModelBehaviour(latency_s=6.0))
    system = cluster_systems()
    before = shared_provider.stats()["total"]["requests"]
    late = system.submit("slow", deadline_s=3.0, idempotency_key="k1").result(WAIT_S)
    assert isinstance(late, Expired), late
    assert late.attempts == 1, "its call may have been made: counted"
    again = system.submit("slow", idempotency_key="k1").result(WAIT_S)
    assert isinstance(again, Rejected), again
    assert again.reason is RejectReason.DUPLICATE
    assert shared_provider.stats()["total"]["requests"] - before == 1


def test_a_lost_cluster_holds_no_task_past_its_deadline(
    cluster_systems: Callable[..., System], ray_local: Any, kill_for_good: Callable[[Any], None]
) -> None:
    system = cluster_systems(max_concurrency=4)
    assert isinstance(system.submit("warm").result(timeout=WAIT_S), Completed)
    namespace = system.config.cluster.namespace  # type: ignore[union-attr]
    kill_for_good(ray_local.get_actor("callboard.queue", namespace=namespace))
    result = system.submit("too late", deadline_s=1.0).result(timeout=WAIT_S)
    assert isinstance(result, Expired)
    assert "the deadline passed while the cluster held it" in result.detail
    assert 1.0 <= result.latency_s < 3.0


# -- a cluster lost after the start: the two policies --------------------------


def _alone_on_ray(
    ray_local: Any, kill: Callable[[Any], None], provider: SimulatedProvider, when_lost: str
) -> tuple[System, Callable[[], None]]:
    """A system on its own namespace, taking the cluster for lost after 1 s of silence,
    and a function that takes its shared actors away for good."""
    namespace = f"lost-{when_lost}-{os.getpid()}-{time.monotonic_ns()}"
    model = ModelSettings(name="m", base_url=provider.base_url, max_concurrency=4)
    cluster = RayCluster(namespace=namespace, lost_after_s=1.0, when_lost=when_lost)
    system = System(SystemConfig(models=(model,), cluster=cluster))

    def take_away() -> None:
        for name in ("callboard.queue", "callboard.model:m"):
            kill(ray_local.get_actor(name, namespace=namespace))

    return system, take_away


def test_a_lost_cluster_fails_tasks_without_a_deadline_when_told_to_wait(
    ray_local: Any, shared_provider: SimulatedProvider, kill_for_good: Callable[[Any], None]
) -> None:
    system, take_away = _alone_on_ray(ray_local, kill_for_good, shared_provider, "wait")
    try:
        assert isinstance(system.submit("warm").result(timeout=WAIT_S), Completed)
        take_away()
        waiting = system.submit("no deadline")
        bounded = system.submit("a deadline", deadline_s=4.0)
        failed = waiting.result(timeout=WAIT_S)
        assert isinstance(failed, Failed)
        assert failed.reason is FailureReason.PROVIDER_DOWN
        assert "answered no poll for 1 s" in failed.detail
        assert not bounded.done()  # it waits for the cluster up to its deadline
        late = system.submit("sent while lost").result(timeout=WAIT_S)
        assert isinstance(late, Failed)
        assert late.reason is FailureReason.PROVIDER_DOWN
        assert isinstance(bounded.result(timeout=WAIT_S), Expired)
        _exactly_ended(system, 4)
    finally:
        system.stop(cancel=True, timeout=10)


def test_a_stops_cancel_on_a_lost_cluster_ends_what_waits_for_it_at_once(
    ray_local: Any, shared_provider: SimulatedProvider, kill_for_good: Callable[[Any], None]
) -> None:
    """No answer comes from a lost cluster: a stop's cancel ends the tasks waiting for it
    at once, not at the stop's timeout (a stop's cancel leaves a reachable cluster's
    calls their answer; a review found it waiting for a lost one's too)."""
    system, take_away = _alone_on_ray(ray_local, kill_for_good, shared_provider, "wait")
    try:
        assert isinstance(system.submit("warm").result(timeout=WAIT_S), Completed)
        take_away()
        failed = system.submit("no deadline").result(timeout=WAIT_S)  # lost: said so
        assert isinstance(failed, Failed), failed
        bounded = system.submit("a deadline", deadline_s=600.0)
        with ThreadPoolExecutor(1) as pool:
            stopping = pool.submit(system.stop, cancel=True, timeout=3 * WAIT_S)
            cancelled = bounded.result(timeout=WAIT_S)
            assert isinstance(cancelled, Cancelled), cancelled
            assert cancelled.detail == "system stopped"  # the cancel's, not the stop's sweep
            stopping.result(timeout=WAIT_S)
    finally:
        system.stop(cancel=True, timeout=10)


@pytest.mark.parametrize("dead", ["callboard.model:m", "callboard.queue"])
def test_one_shared_actor_dead_for_good_is_a_lost_cluster_too(
    ray_local: Any,
    shared_provider: SimulatedProvider,
    kill_for_good: Callable[[Any], None],
    dead: str,
) -> None:
    """The other actor went on answering polls, so the cluster was never taken for
    lost, and the tasks without a deadline waited for ever, nothing said above INFO
    (found by a hunt)."""
    system, _ = _alone_on_ray(ray_local, kill_for_good, shared_provider, "wait")
    try:
        assert isinstance(system.submit("warm").result(timeout=WAIT_S), Completed)
        namespace = system.config.cluster.namespace  # type: ignore[union-attr]
        kill_for_good(ray_local.get_actor(dead, namespace=namespace))
        failed = system.submit("no deadline").result(timeout=WAIT_S)
        assert isinstance(failed, Failed), failed
        assert failed.reason is FailureReason.PROVIDER_DOWN
        assert "answered no poll for 1 s" in failed.detail
    finally:
        system.stop(cancel=True, timeout=10)


def test_a_lost_cluster_hands_its_tasks_to_a_local_queue_and_models_when_told_to(
    ray_local: Any, shared_provider: SimulatedProvider, kill_for_good: Callable[[Any], None]
) -> None:
    shared_provider.configure("m", ModelBehaviour(latency_s=0.2))
    system, take_away = _alone_on_ray(ray_local, kill_for_good, shared_provider, "local")
    try:
        futures = [system.submit(f"before {i}") for i in range(12)]
        futures[0].result(timeout=WAIT_S)
        take_away()  # some answered, some in flight in the cluster, some waiting there
        futures += [system.submit(f"after {i}") for i in range(5)]
        results = _results(futures)
        assert all(isinstance(r, Completed) and r.model == "m" for r in results)
        _exactly_once(system, 17)
        supervision = system.supervision()
        assert supervision["model:m"]["alive"]
        assert supervision["queue"]["incarnation"] == 2  # the link's successor
    finally:
        system.stop(cancel=True, timeout=10)


def test_a_lost_cluster_taken_over_locally_cuts_a_started_stream_not_calls_it_again(
    ray_local: Any,
    shared_provider: SimulatedProvider,
    kill_for_good: Callable[[Any], None],
    read_stream: Callable[..., Any],
) -> None:
    # a 3 s stream; its cluster is taken away after its first deltas: the local queue
    # that takes over must not call it again (its reader would get the text twice)
    shared_provider.configure(
        "m", ModelBehaviour(ttft_s=0.02, token_gap_s=0.02, completion_tokens=150)
    )
    system, take_away = _alone_on_ray(ray_local, kill_for_good, shared_provider, "local")
    try:
        stream = system.stream("tell me", max_tokens=150)
        reader = read_stream(stream)
        for _ in range(5):
            reader.next("the stream's first deltas")
        take_away()
        result = reader.cut("the stream's end once the cluster is given up")
        assert "while it streamed" in result.detail
        assert len(reader.read) >= 5
        assert shared_provider.stats()["total"]["requests"] == 1, "never a second call"
        after = system.submit("after").result(timeout=WAIT_S)  # the local queue and model
        assert isinstance(after, Completed)
        assert system.supervision()["queue"]["incarnation"] == 2  # the link's successor
        _exactly_ended(system, 2)
    finally:
        system.stop(cancel=True, timeout=10)


def test_a_lost_cluster_waited_for_cuts_its_started_streams_charged_as_sent(
    ray_local: Any,
    shared_provider: SimulatedProvider,
    kill_for_good: Callable[[Any], None],
    read_stream: Callable[..., Any],
) -> None:
    """With ``when_lost = "wait"`` a started stream ended ``PROVIDER_DOWN`` with no text,
    no model and no attempt, though its reader had text: it is cut, as a local one is.
    One with a deadline said at it that it expired "before a call was sent", charged
    nothing: it is charged as sent."""
    shared_provider.configure(
        "m", ModelBehaviour(ttft_s=0.02, token_gap_s=0.02, completion_tokens=150)
    )
    system, take_away = _alone_on_ray(ray_local, kill_for_good, shared_provider, "wait")
    try:
        stream = system.stream("tell me", max_tokens=150)
        bounded = system.stream("tell me too", max_tokens=150, deadline_s=4.0)
        reader, bounded_reader = read_stream(stream), read_stream(bounded)
        for _ in range(5):
            reader.next("the stream's first deltas")
            bounded_reader.next("the bounded stream's first deltas")
        take_away()
        result = reader.cut("the stream's end once the cluster is lost")
        assert "answered no poll for 1 s while it streamed" in result.detail
        assert (result.model, result.attempts) == ("m", 1)
        assert result.usage.estimated  # its call was lost with the cluster: charged as sent
        with pytest.raises(StreamFailedError):  # the end comes after what its reader has
            bounded_reader.rest("the bounded stream's end at its deadline")
        late = bounded.result(WAIT_S)
        assert isinstance(late, Expired)
        assert "as it streamed" in late.detail
        assert "before a call was sent" not in late.detail
        assert late.usage.completion_tokens == 150  # the most it could have used
        assert late.usage.estimated
        assert late.attempts == 1
        _exactly_ended(system, 2)
    finally:
        system.stop(cancel=True, timeout=10)


def _exactly_ended(system: System, n: int) -> None:
    assert system.drain(timeout=WAIT_S)
    counts = system.ledger.counts()
    assert (counts.accepted, counts.finished, counts.live) == (n, n, 0)


def test_a_shared_actor_that_could_not_start_is_named_by_its_root_error() -> None:
    """Ray's word for a queue whose creation failed where callboard is not installed on
    the cluster's nodes (as Ray 2.60 words it); the type alone (``ActorDiedError``) sent
    an operator looking at the network (found by a hunt)."""

    class ActorDiedError(Exception):  # Ray's, by name: only its text is read
        pass

    said = (
        "The actor died because of an error raised in its creation task, "
        "\x1b[36mray::callboard.queue:QueueShell.__init__()\x1b[39m (pid=13281)\n"
        "  At least one of the input arguments for this task could not be computed:\n"
        "ray.exceptions.RaySystemError: System error: callboard is not importable\n"
        "traceback: Traceback (most recent call last):\n"
        '  File "/tmp/callboard/__init__.py", line 1, in <module>\n'
        '    raise ImportError("callboard is not importable")\n'
        "ImportError: callboard is not importable"
    )
    assert ray_said(ActorDiedError(said)) == (
        "ActorDiedError (ImportError: callboard is not importable)"
    )
    assert ray_said(ActorDiedError("no word of why")) == "ActorDiedError"
