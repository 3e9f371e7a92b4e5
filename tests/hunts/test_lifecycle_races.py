"""The task lifecycle under concurrency: cancels, stops, drains and crashes racing the pipeline.

Every test runs real parts: a real ``System`` (actor threads, the I/O loop, the
ledger) over loopback HTTP to the simulated provider. Races are forced, not
hoped for: an actor is held down by a crash and a supervisor backoff, a rate
limiter keeps a granted call waiting, or a gated ledger pauses one thread at
a chosen line. Waits are on futures and events with timeouts; ``wait_until``
polls a condition with a deadline where no event exists.

Tests marked ``xfail(strict=True)`` reproduce a bug found here; the reason
names where it lives.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, as_completed, wait
from typing import Any

import pytest
from callboard.actors.base import CrashPlan
from callboard.core.limiter import LimiterConfig
from callboard.core.retry import RetryConfig
from callboard.messages import Crash, GetState
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.ledger import Ledger
from callboard.supervisor.supervisor import SupervisorConfig
from support import WAIT_S

from callboard import (
    AsyncSystem,
    Cancelled,
    Completed,
    Expired,
    ModelSettings,
    QueueFullError,
    Rejected,
    RejectReason,
    Result,
    SchedulerSettings,
    System,
    SystemConfig,
    SystemStoppedError,
)

GENEROUS = SupervisorConfig(max_restarts=10_000, within_s=1.0, backoff_max_s=0.002)
HELD_DOWN = SupervisorConfig(backoff_min_s=0.5, backoff_max_s=0.5, backoff_jitter=0.0)
"""A crashed actor stays down for exactly 0.5 s: what is told to it meanwhile is held."""


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` (for states with no event)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.001)


def kinds(results: list[Result]) -> Counter[str]:
    return Counter(type(r).__name__ for r in results)


def settle(futures: list[Future[Result]]) -> list[Result]:
    """Every future resolves within the bound; the results of those not cancelled."""
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


def hold_down(system: System, name: str) -> None:
    """Crash ``name`` and return once it is down (the supervisor restarts it later)."""
    system.tell(name, Crash(reason="held down by the test"))
    wait_until(lambda: system.book.resolve(name) is None)


@pytest.fixture
def sim() -> Iterator[SimulatedProvider]:
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.01, jitter_s=0.002), seed=3) as p:
        yield p


@pytest.fixture
def systems() -> Iterator[list[System]]:
    """Systems a test started; each is stopped (cancelling, briefly) whatever happened."""
    started: list[System] = []
    yield started
    for system in started:
        system.stop(cancel=True, timeout=0.2)


def one_model(sim: SimulatedProvider, **fields: Any) -> ModelSettings:
    return ModelSettings(name="m", base_url=sim.base_url, **{"max_concurrency": 4, **fields})


# -- cancel racing submit, routing, dispatch, retries, fallbacks, deadlines ------------------


def test_cancel_right_after_submit_ends_each_task_exactly_once(sim: SimulatedProvider) -> None:
    config = SystemConfig(models=(one_model(sim, max_concurrency=2),))
    with System(config) as system:
        by_id: list[Future[Result]] = []
        by_future: list[Future[Result]] = []
        for i in range(150):
            f = system.submit(f"by id {i}")
            system.cancel(f.task_id)
            by_id.append(f)
            g = system.submit(f"by future {i}")
            assert g.cancel()
            by_future.append(g)
        results = settle(by_id)
        assert system.drain(WAIT_S)
        counts = system.ledger.counts()
    assert set(kinds(results)) <= {"Cancelled", "Completed"}
    assert kinds(results)["Cancelled"] >= len(by_id) // 2
    assert all(r.attempts == 0 for r in results if isinstance(r, Cancelled))
    assert all(g.cancelled() for g in by_future)
    assert counts.balanced
    assert counts.accepted == counts.finished == 300


def test_cancel_storm_racing_dispatch_retries_and_fallbacks(sim: SimulatedProvider) -> None:
    sim.configure("p", ModelBehaviour(latency_s=0.005, error_rate=0.3, unavailable_rate=0.1))
    sim.configure("b", ModelBehaviour(latency_s=0.005))
    retry = RetryConfig(max_attempts=2, initial_s=0.002, max_s=0.01, jitter_s=0.002)
    primary = ModelSettings(
        name="p", base_url=sim.base_url, max_concurrency=8, fallbacks=("b",), retry=retry
    )
    backup = ModelSettings(name="b", base_url=sim.base_url, max_concurrency=8)
    rng = random.Random(11)
    with System(SystemConfig(models=(primary, backup))) as system:
        futures = system.submit_many([f"q{i}" for i in range(600)], model="p")
        victims = rng.sample(futures, 300)
        go = threading.Event()

        def canceller() -> None:
            go.wait(WAIT_S)
            for n, f in enumerate(victims):
                if n % 2:
                    f.cancel()
                else:
                    system.cancel(f.task_id)

        thread = threading.Thread(target=canceller)
        thread.start()
        futures[5].add_done_callback(lambda _: go.set())  # once dispatch is under way
        results = settle(futures)
        thread.join(WAIT_S)
        assert system.drain(WAIT_S)
        counts = system.ledger.counts()
    assert set(kinds(results)) <= {"Completed", "Cancelled", "Failed"}
    assert len({r.task_id for r in results}) == len(results)
    assert counts.balanced
    assert counts.accepted == counts.finished == 600


def test_cancel_racing_deadlines_and_escalation_ends_each_task_once(
    sim: SimulatedProvider,
) -> None:
    sim.configure("slow", ModelBehaviour(latency_s=0.05))
    sim.configure("fast", ModelBehaviour(latency_s=0.005))
    slow = ModelSettings(name="slow", base_url=sim.base_url, max_concurrency=1)
    fast = ModelSettings(name="fast", base_url=sim.base_url, max_concurrency=2)
    config = SystemConfig(
        models=(slow, fast),
        escalate_to="fast",
        scheduler=SchedulerSettings(escalate_margin_s=0.1),
    )
    rng = random.Random(5)
    with System(config) as system:
        futures = system.submit_many([f"d{i}" for i in range(120)], model="slow", deadline_s=0.25)
        for f in rng.sample(futures, 60):
            system.cancel(f.task_id)
        results = settle(futures)
        assert system.drain(WAIT_S)
        counts = system.ledger.counts()
    assert set(kinds(results)) <= {"Completed", "Cancelled", "Expired"}
    assert counts.balanced
    assert counts.accepted == counts.finished == 120


# -- stop and drain while other threads submit -----------------------------------------------


def _submitters(
    system: System, n_threads: int, *, wait_s: float | None = None, started: int = 20
) -> tuple[list[threading.Thread], list[Future[Result]], list[BaseException], threading.Event]:
    """Threads that submit until refused; returns them, their futures and their errors."""
    futures: list[Future[Result]] = []
    errors: list[BaseException] = []
    enough = threading.Event()
    lock = threading.Lock()

    def run(k: int) -> None:
        for i in range(300):
            try:
                f = system.submit(f"t{k} q{i}", wait_s=wait_s)
            except (SystemStoppedError, QueueFullError) as exc:
                with lock:
                    errors.append(exc)
                if isinstance(exc, QueueFullError) or system._stopped.is_set():
                    return
                system._stopped.wait(0.001)  # draining or stopping: admitted again or stopped
                continue
            with lock:
                futures.append(f)
                if len(futures) >= started:
                    enough.set()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    return threads, futures, errors, enough


def test_stop_cancel_while_threads_submit_resolves_every_future(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.002))
    system = System(SystemConfig(models=(one_model(sim, max_concurrency=64),)))
    threads, futures, errors, enough = _submitters(system, 4)
    assert enough.wait(WAIT_S)
    system.stop(cancel=True, timeout=WAIT_S)
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()
    results = settle(futures)
    assert len(results) == len(futures)
    assert set(kinds(results)) <= {"Completed", "Cancelled", "Rejected"}
    assert all(isinstance(e, SystemStoppedError) for e in errors)
    assert len({r.task_id for r in results}) == len(results)


def test_drain_while_threads_submit_resolves_every_future(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.002))
    with System(SystemConfig(models=(one_model(sim, max_concurrency=64),))) as system:
        before = system.submit_many([f"b{i}" for i in range(100)])
        threads, futures, errors, enough = _submitters(system, 3, started=10)
        assert enough.wait(WAIT_S)
        assert system.drain(WAIT_S)
        assert all(f.done() for f in before)
        # submitters refused while draining were refused with the typed error
        assert all(isinstance(e, SystemStoppedError) for e in errors)
        system.stop(cancel=True, timeout=WAIT_S)
        for t in threads:
            t.join(WAIT_S)
            assert not t.is_alive()
        results = settle(futures) + settle(before)
    assert set(kinds(results)) <= {"Completed", "Cancelled"}


def test_backpressured_submitters_during_stop_never_hang(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.05))
    config = SystemConfig(
        models=(one_model(sim, max_concurrency=2),), scheduler=SchedulerSettings(capacity=6)
    )
    system = System(config)
    threads, futures, errors, enough = _submitters(system, 6, wait_s=WAIT_S, started=6)
    assert enough.wait(WAIT_S)
    wait_until(lambda: system.ledger.live_count() == 6)  # full: the others block in submit
    system.stop(cancel=True, timeout=WAIT_S)
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()
    results = settle(futures)
    assert set(kinds(results)) <= {"Completed", "Cancelled"}
    assert errors
    assert all(isinstance(e, SystemStoppedError | QueueFullError) for e in errors)


# -- idempotency keys with cancel and resubmit -------------------------------------------------


def test_a_cancelled_key_stays_used_and_concurrent_duplicates_admit_one(
    sim: SimulatedProvider,
) -> None:
    with System(SystemConfig(models=(one_model(sim),))) as system:
        first = system.submit("once", idempotency_key="K")
        system.cancel(first.task_id)
        again = system.submit("once again", idempotency_key="K")
        r_first, r_again = settle([first, again])
        if isinstance(r_first, Cancelled | Completed):
            assert isinstance(r_again, Rejected)
            assert r_again.reason is RejectReason.DUPLICATE
            assert str(first.task_id) in r_again.detail
        barrier = threading.Barrier(8)
        out: list[Future[Result]] = []
        lock = threading.Lock()

        def dup(i: int) -> None:
            barrier.wait(WAIT_S)
            f = system.submit(f"dup {i}", idempotency_key="K2")
            with lock:
                out.append(f)

        threads = [threading.Thread(target=dup, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        results = settle(out)
        assert system.drain(WAIT_S)
    admitted = [r for r in results if not isinstance(r, Rejected)]
    assert len(admitted) == 1
    assert isinstance(admitted[0], Completed)
    dups = [r for r in results if isinstance(r, Rejected)]
    assert all(r.reason is RejectReason.DUPLICATE for r in dups)
    assert all(str(admitted[0].task_id) in r.detail for r in dups)


# -- the asyncio face --------------------------------------------------------------------------


def test_cancelling_awaiting_callers_cancels_their_tasks(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.2))
    config = SystemConfig(models=(one_model(sim, max_concurrency=1),))

    async def main() -> tuple[list[bool], Result, Any]:
        async with AsyncSystem(config) as cb:
            system = cb.system
            busy = asyncio.ensure_future(cb.submit("occupies the slot"))
            waiters = [asyncio.ensure_future(cb.submit(f"w{i}")) for i in range(20)]
            await asyncio.sleep(0)  # every waiter has submitted
            wait_until(lambda: system.ledger.counts().queued == 20, timeout=5.0)
            for w in waiters:
                w.cancel()
            outcomes = await asyncio.gather(*waiters, return_exceptions=True)
            cancelled = [isinstance(o, asyncio.CancelledError) for o in outcomes]
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(cb.submit("gives up"), timeout=0.01)
            first = await busy
            assert await cb.drain(WAIT_S)
            return cancelled, first, system.ledger.counts()

    cancelled, first, counts = asyncio.run(main())
    assert all(cancelled)
    assert isinstance(first, Completed)
    assert counts.balanced
    assert counts.accepted == counts.finished == 22
    assert counts.in_flight == counts.queued == 0


# -- actor crashes in the middle ---------------------------------------------------------------


@pytest.mark.parametrize("victim", ["ingest", "router", "queue", "model:m", "aggregator"])
def test_crashes_during_cancel_storms_lose_and_duplicate_nothing(
    sim: SimulatedProvider, victim: str
) -> None:
    plan = CrashPlan({victim: 9})
    config = SystemConfig(models=(one_model(sim, max_concurrency=8),), supervisor=GENEROUS)
    rng = random.Random(victim)
    with System(config, crash_plan=plan) as system:
        futures: list[Future[Result]] = []
        for burst in range(30):
            batch = system.submit_many([f"b{burst} q{i}" for i in range(10)])
            for f in rng.sample(batch, 4):
                system.cancel(f.task_id)
            batch[0].cancel()
            futures += batch
        results = settle(futures)
        assert system.drain(WAIT_S)
        counts = system.ledger.counts()
    assert plan.injected > 0
    assert set(kinds(results)) <= {"Completed", "Cancelled"}
    assert len({r.task_id for r in results}) == len(results)
    assert counts.balanced
    assert counts.accepted == counts.finished == 300


def test_model_crash_with_calls_in_flight_then_stop_cancel(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.1))
    config = SystemConfig(models=(one_model(sim, max_concurrency=4),), supervisor=GENEROUS)
    system = System(config)
    futures = system.submit_many([f"q{i}" for i in range(40)])
    wait_until(lambda: system.ledger.counts().in_flight == 4)
    system.tell("model:m", Crash())
    system.stop(cancel=True, timeout=WAIT_S)
    results = settle(futures)
    assert len(results) == 40
    assert set(kinds(results)) <= {"Completed", "Cancelled"}
    assert kinds(results)["Cancelled"] >= 30


def test_escalation_while_threads_submit_resolves_every_future(sim: SimulatedProvider) -> None:
    plan = CrashPlan({"queue": 15})
    supervisor = SupervisorConfig(max_restarts=3, within_s=60.0, backoff_max_s=0.001)
    config = SystemConfig(models=(one_model(sim, max_concurrency=8),), supervisor=supervisor)
    system = System(config, crash_plan=plan)
    try:
        threads, futures, errors, _ = _submitters(system, 4, started=1)
        for t in threads:
            t.join(WAIT_S)
            assert not t.is_alive()
        results = settle(futures)
        wait_until(lambda: system.failure is not None)
    finally:
        system.stop()
    assert "restart intensity" in str(system.failure)
    assert len(results) == len(futures)
    assert len({r.task_id for r in results}) == len(results)
    assert all(isinstance(e, SystemStoppedError) for e in errors)


# -- bugs: each test reproduces one --------------------------------------------------------------


def _rate_limited(sim: SimulatedProvider) -> SystemConfig:
    """One model whose token limit admits one 900-token call a minute. Credits are
    granted for a typical call of 1 token at first, so a second call is granted,
    reaches the model and waits there, unsent, for the limiter."""
    sim.configure("m", ModelBehaviour(latency_s=0.005, completion_tokens=900))
    return SystemConfig(models=(one_model(sim, limiter=LimiterConfig(rpm=None, tpm=1000)),))


def test_cancel_by_id_of_a_granted_but_unsent_task_ends_it(
    sim: SimulatedProvider, systems: list[System]
) -> None:
    system = System(_rate_limited(sim))
    systems.append(system)
    sent, waiting = system.submit_many(["first", "second"], max_tokens=900)
    assert isinstance(sent.result(WAIT_S), Completed)
    # granted, then handed back to the queue when the limiter held it: not sent
    model = system.ask("model:m", GetState())
    assert model["admitting"] == model["in_flight"] == 0
    assert system.ask("queue", GetState())["waiting"] == 1
    system.cancel(waiting.task_id)
    result = waiting.result(1.5)  # a cancel of an unsent task answers at once
    assert isinstance(result, Cancelled)


def test_a_task_waiting_on_the_model_limiter_expires_at_its_deadline(
    sim: SimulatedProvider, systems: list[System]
) -> None:
    system = System(_rate_limited(sim))
    systems.append(system)
    sent = system.submit("first", max_tokens=900)
    hurried = system.submit("second", max_tokens=900, deadline_s=0.3)
    assert isinstance(sent.result(WAIT_S), Completed)
    result = hurried.result(1.5)  # five times the deadline
    assert isinstance(result, Expired)


def test_cancel_by_id_before_routing_survives_a_queue_restart(
    sim: SimulatedProvider, systems: list[System]
) -> None:
    system = System(SystemConfig(models=(one_model(sim),), supervisor=HELD_DOWN))
    systems.append(system)
    hold_down(system, "router")  # the task waits for routing while the cancel goes ahead
    by_id = system.submit("cancelled by id")
    by_future = system.submit("cancelled by its future")
    wait_until(lambda: system.ledger.counts().routing == 2)
    system.cancel(by_id.task_id)
    assert by_future.cancel()
    system.ask("queue", GetState())  # the queue has taken the cancel (asks come in order)
    hold_down(system, "queue")
    assert system.supervision()["router"]["incarnation"] == 1, "router back too early"
    with pytest.raises(CancelledError):
        by_future.result(WAIT_S)
    assert isinstance(by_id.result(WAIT_S), Cancelled)


def test_stop_cancel_cancels_tasks_still_being_routed(
    sim: SimulatedProvider, systems: list[System]
) -> None:
    system = System(SystemConfig(models=(one_model(sim),), supervisor=HELD_DOWN))
    systems.append(system)
    hold_down(system, "router")
    futures = system.submit_many([f"q{i}" for i in range(3)])
    wait_until(lambda: system.ledger.counts().routing == 3)
    system.stop(cancel=True, timeout=WAIT_S)
    results = settle(futures)
    assert kinds(results) == {"Cancelled": 3}


class GatedLedger(Ledger):
    """A real in-memory ledger that can pause a submitter in ``next_id`` (after the
    submit's running check) and the stopping thread in ``close`` (after the sweep,
    before the address book closes)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_ids = False
        self.in_next_id, self.next_id_go = threading.Event(), threading.Event()
        self.in_close, self.close_go = threading.Event(), threading.Event()

    def next_id(self) -> int:
        if self.gate_ids and threading.current_thread().name == "late-submitter":
            self.in_next_id.set()
            assert self.next_id_go.wait(WAIT_S)
        return super().next_id()

    def close(self, timeout: float = 10.0) -> None:
        self.in_close.set()
        assert self.close_go.wait(WAIT_S)
        super().close(timeout)


def test_a_submit_racing_the_end_of_stop_never_leaves_a_pending_future(
    sim: SimulatedProvider,
) -> None:
    ledger = GatedLedger()
    system = System(SystemConfig(models=(one_model(sim),)), ledger=ledger)
    out: list[Future[Result] | BaseException] = []

    def submit() -> None:
        try:
            out.append(system.submit("late"))
        except SystemStoppedError as exc:
            out.append(exc)

    ledger.gate_ids = True
    submitter = threading.Thread(target=submit, name="late-submitter")
    submitter.start()
    assert ledger.in_next_id.wait(WAIT_S)  # past the running check
    stopper = threading.Thread(target=system.stop)
    stopper.start()
    assert ledger.in_close.wait(WAIT_S)  # the sweep is done; the book is still open
    ledger.next_id_go.set()
    submitter.join(WAIT_S)
    ledger.close_go.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    assert len(out) == 1
    outcome = out[0]
    if isinstance(outcome, Future):
        assert isinstance(outcome.result(0.5), Cancelled)  # pending: TimeoutError
    else:
        assert isinstance(outcome, SystemStoppedError)


def test_a_drain_ending_during_stop_does_not_reopen_admission(
    sim: SimulatedProvider,
) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.5))
    system = System(SystemConfig(models=(one_model(sim),)))
    slow = system.submit("keeps stop waiting")
    stopper = threading.Thread(target=system.stop, kwargs={"timeout": WAIT_S})
    stopper.start()
    try:
        wait_until(lambda: system.admission.reason == "stopping")
        assert not system.drain(timeout=0.05)  # ends while stop still waits
        with pytest.raises(SystemStoppedError):
            system.submit("after stop began")
    finally:
        stopper.join(WAIT_S)
    assert isinstance(slow.result(WAIT_S), Completed)


def test_async_submit_with_wait_s_does_not_block_the_event_loop(
    sim: SimulatedProvider,
) -> None:
    """While a submit waits for room, the loop runs; the wait ends in QueueFullError."""
    sim.configure("m", ModelBehaviour(latency_s=1.0))
    config = SystemConfig(
        models=(one_model(sim, max_concurrency=1),), scheduler=SchedulerSettings(capacity=1)
    )

    async def main() -> None:
        async with AsyncSystem(config) as cb:
            system = cb.system
            busy = asyncio.ensure_future(cb.submit("fills the queue"))
            await asyncio.sleep(0)
            wait_until(lambda: system.ledger.live_count() == 1, timeout=5.0)
            waiting = asyncio.ensure_future(cb.submit("waits for room", wait_s=0.5))
            await asyncio.sleep(0)  # the submit has started waiting
            ran_meanwhile = not waiting.done()  # a blocked loop would get here after it
            with pytest.raises(QueueFullError):
                await waiting
            assert ran_meanwhile
            await cb.stop(cancel=True, timeout=0.1)
            busy.cancel()

    asyncio.run(main())


def test_an_async_caller_cancelled_while_waiting_for_room_cancels_what_it_submits(
    sim: SimulatedProvider,
) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.3))
    config = SystemConfig(
        models=(one_model(sim, max_concurrency=1),), scheduler=SchedulerSettings(capacity=1)
    )

    async def main() -> Result:
        async with AsyncSystem(config) as cb:
            system = cb.system
            busy = system.submit("fills the queue")
            wait_until(lambda: system.ledger.live_count() == 1, timeout=5.0)
            waiting = asyncio.ensure_future(cb.submit("waits for room", wait_s=WAIT_S))
            await asyncio.sleep(0)
            waiting.cancel()  # the caller gives up while its submit waits on a thread
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert isinstance(await asyncio.wrap_future(busy), Completed)
            await cb.drain(WAIT_S)  # the late submit was admitted, then cancelled at once
            return busy.result()

    asyncio.run(main())
    assert sim.stats()["models"]["m"]["requests"] == 1


class BlockingObserver:
    """An aggregator observer that holds the aggregator in ``observe_results`` on demand."""

    def __init__(self) -> None:
        self.armed = False
        self.blocked, self.go = threading.Event(), threading.Event()

    def observe_results(self, results: Any) -> None:
        if self.armed:
            self.blocked.set()
            self.go.wait(WAIT_S)

    def observe_health(self, health: Any) -> None:
        pass


def test_a_restart_due_during_stop_starts_no_actor(sim: SimulatedProvider) -> None:
    before = set(threading.enumerate())
    config = SystemConfig(
        models=(one_model(sim),),
        supervisor=SupervisorConfig(backoff_min_s=0.2, backoff_max_s=0.2, backoff_jitter=0.0),
    )
    system = System(config)
    observer = BlockingObserver()
    system.rt.extras.setdefault("observers", []).append(observer)
    observer.armed = True
    assert isinstance(system.submit("x").result(WAIT_S), Completed)
    assert observer.blocked.wait(WAIT_S)  # stop_children will wait on the aggregator
    hold_down(system, "router")  # its restart is due in 0.2 s
    stopper = threading.Thread(target=system.stop)
    stopper.start()
    try:
        wait_until(
            lambda: any(
                type(e.message).__name__ == "RestartChild"
                for e in list(system._supervisor.actor_inbox.queue)
            )
        )
    finally:
        observer.go.set()
        stopper.join(WAIT_S)
    leaked = [t.name for t in threading.enumerate() if t.is_alive() and t not in before]
    late = system.book.resolve("router")
    if late is not None and late.is_alive():  # the incarnation started after the stop
        late.stop(block=True, timeout=WAIT_S)
    assert not leaked, leaked


def test_wait_and_as_completed_count_a_cancelled_task_future_as_done(
    sim: SimulatedProvider,
) -> None:
    """Nothing executor-like ever calls ``set_running_or_notify_cancel`` on a task's
    future, so ``cancel`` itself must wake ``wait`` and ``as_completed``."""
    sim.configure("m", ModelBehaviour(latency_s=0.2))
    with System(SystemConfig(models=(one_model(sim, max_concurrency=1),))) as system:
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


def test_async_submits_waiting_for_room_leave_the_default_executor_to_the_host(
    sim: SimulatedProvider,
) -> None:
    sim.configure("m", ModelBehaviour(latency_s=2.0))
    config = SystemConfig(
        models=(one_model(sim, max_concurrency=1),), scheduler=SchedulerSettings(capacity=1)
    )

    async def main() -> None:
        async with AsyncSystem(config) as cb:
            system = cb.system
            system.submit("fills the queue")
            wait_until(lambda: system.ledger.live_count() == 1, timeout=5.0)
            waiting = [asyncio.ensure_future(cb.submit(f"w{i}", wait_s=WAIT_S)) for i in range(12)]
            await asyncio.sleep(0)
            stats = await cb.stats()  # runs on the default executor: 6 threads here
            assert stats.ledger["accepted"] == 1
            assert not any(w.done() for w in waiting)  # they still wait, on their own pool
            for w in waiting:
                w.cancel()
            await cb.stop(cancel=True, timeout=0.1)

    asyncio.run(main())
