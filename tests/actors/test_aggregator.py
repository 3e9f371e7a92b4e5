"""The aggregator actor (actors/aggregator.py): stats read after a result count it; they
match what the provider counted and what the price table says; a rejected task is
counted as one; a model's figures are current once it is idle; stats answer while
the aggregator restarts, and at once when a result was never told to it; its counts
survive its restarts (the runtime keeps them).

Every test runs a real ``System`` against the simulated provider on loopback.
"""

from __future__ import annotations

import asyncio
import threading
import time

from callboard.actors.base import CrashPlan
from callboard.core.pricing import cost_nusd
from callboard.messages import Call, Crash, Rejected, Usage
from callboard.provider.server import SimulatedProvider
from callboard.supervisor.supervisor import SupervisorConfig
from loopback import WireServer, answer
from support import PRICE, WAIT_S, kinds, one_model, served, wait_until

from callboard import (
    AsyncSystem,
    Failed,
    ModelSettings,
    Result,
    SchedulerSettings,
    Stats,
    System,
    SystemConfig,
    messages,
)


def test_stats_match_the_providers_counters_and_the_price_table(
    assorted_system: System, provider: SimulatedProvider
) -> None:
    futures = assorted_system.submit_many([f"question {i}" for i in range(12)], model="alpha")
    futures += assorted_system.submit_many(
        [f"other {i}" for i in range(5)], model="beta", priority="high"
    )
    results = [f.result(WAIT_S) for f in futures]
    assert assorted_system.drain(WAIT_S)
    assert all(r.ok for r in results)
    stats = assorted_system.stats()
    assert stats.outcomes == {"completed": 17}
    for model, n in (("alpha", 12), ("beta", 5)):
        counters = served(provider, model)
        group = stats.by_model[model]
        assert counters["requests"] == n == group.finished == group.attempts
        assert group.prompt_tokens == counters["prompt_tokens"]
        assert group.completion_tokens == counters["completion_tokens"]
        billed = cost_nusd(
            PRICE,
            Usage(
                prompt_tokens=counters["prompt_tokens"],
                completion_tokens=counters["completion_tokens"],
            ),
        )
        assert group.cost_nusd == billed
    assert stats.total.cost_nusd == sum(r.cost_nusd for r in results)
    assert stats.by_priority["HIGH"].finished == 5
    assert stats.by_priority["NORMAL"].finished == 12
    for group in (*stats.by_model.values(), *stats.by_priority.values(), stats.total):
        lat = group.latency
        assert lat.count == group.finished
        assert lat.p50 is not None
        assert lat.p95 is not None
        assert lat.p99 is not None
        assert lat.max is not None
        assert 0 <= lat.p50 <= lat.p95 <= lat.p99 <= lat.max
    assert stats.ledger["accepted"] == stats.ledger["finished"] == 17


def test_the_models_view_in_stats_is_current_once_a_model_is_idle(assorted_system: System) -> None:
    assert assorted_system.submit("wait about a second", model="timer").result(WAIT_S).ok
    result = assorted_system.submit("hi", model="alpha").result(WAIT_S)
    assert result.ok
    assert assorted_system.drain(WAIT_S)
    state = assorted_system.ask("model:alpha", messages.GetState())
    assert state["in_flight"] == 0
    assert state["latency_ewma_s"] is not None

    def idle_in_stats() -> bool:  # reported once it has stood idle IDLE_REPORT_S
        view = assorted_system.stats().models["alpha"]
        return view["in_flight"] == 0 and view["latency_ewma_s"] is not None

    assert wait_until(idle_in_stats)


def test_a_full_queue_is_reported_as_rejected_in_the_stats(provider: SimulatedProvider) -> None:
    models = (ModelSettings(name="single", base_url=provider.base_url, max_concurrency=1),)
    system = System(SystemConfig(models=models, scheduler=SchedulerSettings(capacity=2)))
    try:
        results = [f.result(WAIT_S) for f in system.submit_many([f"q{i}" for i in range(6)])]
        assert system.drain(WAIT_S)
        rejected = sum(isinstance(r, Rejected) for r in results)
        assert rejected >= 1
        stats = system.stats()
        assert stats.outcomes.get("rejected", 0) == rejected
        assert stats.outcomes.get("completed", 0) == len(results) - rejected
        assert stats.ledger["rejected"] == rejected
    finally:
        system.stop(timeout=WAIT_S)


def test_stats_are_readable_while_the_aggregator_restarts(provider: SimulatedProvider) -> None:
    config = SystemConfig(
        models=(one_model(provider),),
        supervisor=SupervisorConfig(backoff_min_s=0.3, backoff_max_s=0.3, backoff_jitter=0.0),
    )

    async def main() -> Stats:
        async with AsyncSystem(config) as cb:
            assert (await cb.submit("one")).ok
            cb.system.tell("aggregator", Crash(reason="a bug, on purpose"))
            assert wait_until(lambda: cb.system.book.resolve("aggregator") is None, timeout=5.0)
            return await asyncio.wait_for(cb.stats(), WAIT_S)  # e.g. GET /stats meanwhile

    assert isinstance(asyncio.run(main()), Stats)


def test_stats_read_after_a_result_count_it(provider: SimulatedProvider) -> None:
    """The caller holds a result, so ``stats()`` must count it.

    The race is forced, not hoped for: a done-callback holds the resolving thread
    for at most 0.5 s (the window that a GIL switch opens by chance; about one
    request in five in a loop of submit, await, stats).
    """
    go = threading.Event()
    with System(SystemConfig(models=(one_model(provider),))) as system:
        future = system.submit("hi")
        future.add_done_callback(lambda _: go.wait(0.5))
        assert future.result(WAIT_S).ok
        try:
            stats = system.stats()
        finally:
            go.set()
    assert stats.ledger["finished"] == 1
    assert stats.outcomes == {"completed": 1}


def test_stats_after_a_poisoned_call_answers_at_once(provider: SimulatedProvider) -> None:
    m = ModelSettings(name="m", base_url=provider.base_url)
    config = SystemConfig(
        models=(m,),
        supervisor=SupervisorConfig(max_restarts=10, within_s=60.0, backoff_max_s=0.01),
    )
    # the model crashes on every Call: the task's crashes it twice and is poison
    system = System(config, crash_plan=CrashPlan({"model:m": 1}, only={"model:m": (Call,)}))
    try:
        result = system.submit("poison").result(WAIT_S)
        assert isinstance(result, Failed), result
        assert system.failure is None
        t0 = time.monotonic()
        stats = system.stats()
        took = time.monotonic() - t0
    finally:
        system.stop(cancel=True, timeout=5)
    assert stats.ledger["finished"] == 1
    assert stats.outcomes == {"failed": 1}
    assert took < 0.5, f"stats() was held {took:.2f} s for a result never told to it"


def test_outcomes_stay_equal_to_the_truth_across_aggregator_restarts() -> None:
    """The aggregator crashes on every 7th message it takes, mid-run, results and all:
    each incarnation goes on from its predecessor's counts, and the batch it crashed
    on is counted once. The provider is a plain loopback server answering as OpenAI does."""
    with WireServer(answer()) as server:
        stats, results, restarts, injected = _run_with_aggregator_crashes(server.base_url)
    truth = {("completed" if k == "Completed" else k.lower()): n for k, n in kinds(results).items()}
    assert set(truth) == {"completed", "rejected"}, truth  # both kinds, counted apart
    assert restarts >= 3, injected
    assert stats.outcomes == truth
    assert sum(truth.values()) == stats.ledger["finished"] + stats.ledger["rejected"]
    assert stats.total.finished == len(results)


def _run_with_aggregator_crashes(base_url: str) -> tuple[Stats, list[Result], int, int]:
    config = SystemConfig(
        models=(ModelSettings(name="m", base_url=base_url, max_concurrency=4),),
        scheduler=SchedulerSettings(capacity=40),
        supervisor=SupervisorConfig(max_restarts=10_000, within_s=1.0, backoff_max_s=0.002),
    )
    plan = CrashPlan({"aggregator": 7})
    system = System(config, crash_plan=plan)
    try:
        futures = [
            f for i in range(6) for f in system.submit_many([f"q{i}.{j}" for j in range(20)])
        ]
        results = [f.result(WAIT_S) for f in futures]
        assert system.drain(WAIT_S)
        stats = system.stats()
        restarts = system.supervision()["aggregator"]["restarts"]
    finally:
        system.stop(timeout=WAIT_S)
    return stats, results, restarts, plan.injected
