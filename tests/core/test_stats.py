"""Statistics (core/stats.py, pure): every result is counted exactly once in the total,
once under its model and once under its priority; percentiles are nearest-rank over a
bounded window of samples, and only over tasks that made a call."""

from __future__ import annotations

from collections import Counter

import pytest
from callboard.core import stats as stats_module
from callboard.core.stats import Reservoir, StatsBook, percentiles
from callboard.messages import (
    Billed,
    BreakerState,
    Cancelled,
    Completed,
    Expired,
    Failed,
    FailureReason,
    GroupStats,
    Health,
    Percentiles,
    Priority,
    Rejected,
    RejectReason,
    Result,
    Usage,
)
from hypothesis import given
from hypothesis import strategies as st


def done(task_id: int, model: str = "m", **fields: object) -> Completed:
    base: dict[str, object] = {"attempts": 1, "latency_s": 0.1, "queue_wait_s": 0.01}
    return Completed(
        task_id=task_id,
        trace_id=f"t{task_id}",
        model=model,
        content="x",
        **{**base, **fields},  # type: ignore[arg-type]
    )


def test_percentiles_of_nothing_are_unknown() -> None:
    assert percentiles([]) == Percentiles()


def test_percentiles_are_nearest_rank() -> None:
    """They were a rank too high: the p99 of 100 samples was their maximum, one slow
    call in a hundred (found by a hunt)."""
    p = percentiles(float(i) for i in range(1, 101))
    assert (p.count, p.p50, p.p95, p.p99, p.max) == (100, 50.0, 95.0, 99.0, 100.0)
    halves = percentiles([0.02] * 50 + [0.2] * 50)
    assert halves.p50 == 0.02
    twenty = percentiles(i / 100 for i in range(1, 21))
    assert (twenty.p95, twenty.max) == (0.19, 0.2)
    one = percentiles([0.3])
    assert (one.count, one.p50, one.p99, one.max) == (1, 0.3, 0.3, 0.3)


def test_estimated_usage_is_counted_apart_within_the_totals() -> None:
    """Answers without usage are charged their estimate, which the totals mixed in with
    what the providers reported, unmarked (found by a hunt)."""
    book = StatsBook()
    said = Usage(prompt_tokens=5, completion_tokens=7)
    guessed = Usage(prompt_tokens=5, completion_tokens=64, estimated=True)
    book.add(
        [
            done(1, usage=said, cost_nusd=30),
            done(2, usage=guessed, cost_nusd=200),
            done(3, model="n", usage=guessed, cost_nusd=200),
        ]
    )
    total, m = book.total.freeze(), book.by_model["m"].freeze()
    assert (total.cost_nusd, total.estimated, total.estimated_cost_nusd) == (430, 2, 400)
    assert (m.cost_nusd, m.estimated, m.estimated_cost_nusd) == (230, 1, 200)


def test_each_result_is_counted_in_the_total_its_model_and_its_priority() -> None:
    book = StatsBook()
    book.add(
        [
            done(1, usage=Usage(prompt_tokens=5, completion_tokens=7), cost_nusd=30),
            done(2, model="n", priority=Priority.HIGH, attempts=2),
            Failed(task_id=3, trace_id="t3", model="m", reason=FailureReason.TIMEOUT, attempts=3),
            Rejected(task_id=4, trace_id="t4", reason=RejectReason.QUEUE_FULL),
            Cancelled(task_id=5, trace_id="t5", priority=Priority.LOW),
            Expired(task_id=6, trace_id="t6", model="m", attempts=1),
        ]
    )
    assert book.outcomes == {
        "completed": 2,
        "failed": 1,
        "rejected": 1,
        "cancelled": 1,
        "expired": 1,
    }
    assert book.failures == {"timeout": 1}
    total = book.total.freeze()
    assert (total.finished, total.ok, total.failed, total.cancelled) == (6, 2, 3, 1)
    assert (total.prompt_tokens, total.completion_tokens, total.cost_nusd) == (5, 7, 30)
    assert total.attempts == 1 + 2 + 3 + 1
    assert sorted(book.by_model) == ["m", "n"]  # the rejected and cancelled ran nowhere
    assert book.by_model["m"].finished == 3
    assert {p: g.finished for p, g in book.by_priority.items()} == {
        "NORMAL": 4,
        "HIGH": 1,
        "LOW": 1,
    }


def test_latency_counts_only_tasks_that_made_a_call() -> None:
    book = StatsBook()
    book.add([done(1, latency_s=0.5, queue_wait_s=0.2)])
    book.add([Rejected(task_id=2, trace_id="t2", reason=RejectReason.QUEUE_FULL)])
    frozen = book.total.freeze()
    assert frozen.finished == 2
    assert frozen.latency.count == frozen.queue_wait.count == 1
    assert (frozen.latency.p50, frozen.queue_wait.p50) == (0.5, 0.2)


def test_time_to_first_token_counts_the_streamed_answers_per_model_and_priority() -> None:
    book = StatsBook()
    book.add([done(1, ttft_s=0.05, priority=Priority.HIGH), done(2), done(3, ttft_s=0.2)])
    assert book.total.freeze().ttft.count == 2  # the answer not streamed has none
    assert book.by_priority["HIGH"].freeze().ttft.p50 == 0.05
    assert book.by_model["m"].freeze().ttft.max == 0.2


def test_the_sample_window_is_bounded_and_the_counts_are_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stats_module, "WINDOW", 8)
    book = StatsBook()
    book.add(done(i, latency_s=float(i)) for i in range(20))
    frozen = book.total.freeze()
    assert frozen.finished == 20
    assert frozen.latency.count == 8
    assert frozen.latency.max == 19.0  # the newest samples are kept


def test_a_frozen_group_is_a_record_of_that_moment() -> None:
    book = StatsBook()
    book.add([done(1)])
    before = book.total.freeze()
    book.add([done(2)])
    assert isinstance(before, GroupStats)
    assert before.finished == 1
    assert book.total.freeze().finished == 2


@given(st.lists(st.sampled_from(["done", "failed", "cancelled"]), max_size=50))
def test_every_result_is_counted_exactly_once(kinds: list[str]) -> None:
    results: list[Result] = []
    for i, kind in enumerate(kinds):
        if kind == "done":
            results.append(done(i, model="ab"[i % 2]))
        elif kind == "failed":
            results.append(
                Failed(task_id=i, trace_id="t", model="a", reason=FailureReason.PROVIDER_ERROR)
            )
        else:
            results.append(Cancelled(task_id=i, trace_id="t"))
    book = StatsBook()
    book.add(results)
    assert sum(book.outcomes.values()) == book.total.finished == len(results)
    assert sum(g.finished for g in book.by_priority.values()) == len(results)
    with_model = sum(r.model is not None for r in results)
    assert sum(g.finished for g in book.by_model.values()) == with_model


def test_a_batch_handed_over_again_after_a_crash_is_counted_once() -> None:
    """An aggregator that crashed after counting a batch hands it to its successor
    (``Redelivered``), which finds it counted: the same batch object, not its equal."""
    book = StatsBook()
    batch = (done(1), done(2))
    assert book.add(batch)
    assert not book.add(batch)
    assert book.add((done(1), done(2)))  # a new batch that happens to be equal counts
    assert book.outcomes == {"completed": 4}
    assert book.accounted == book.total.finished == 4


# -- the queue's depth and the models' health in a snapshot ---------------------------------


def test_the_queue_depth_names_every_level_and_each_tenant() -> None:
    depth = {
        (Priority.LOW, "a"): 1,
        (Priority.LOW, "b"): 1,
        (Priority.HIGH, "a"): 1,
        (Priority.LOW, None): 1,
    }
    stats = StatsBook().snapshot({"queued": 4}, waiting=depth)
    assert list(stats.queued.items()) == [("CRITICAL", 0), ("HIGH", 1), ("NORMAL", 0), ("LOW", 3)]
    assert dict(stats.queued_by_tenant) == {"a": 2, "b": 1, "": 1}


def test_an_empty_queue_still_names_every_level() -> None:
    stats = StatsBook().snapshot({})
    assert dict(stats.queued) == {p.name: 0 for p in Priority}
    assert dict(stats.queued_by_tenant) == {}


def test_the_tenants_named_are_bounded_and_the_rest_summed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats_module, "TENANTS_SHOWN", 2)
    depth = {(Priority.NORMAL, t): n for t, n in Counter("aaabbcdd").items()}
    queued, by_tenant = stats_module.queue_depth(depth)
    assert by_tenant == {"a": 3, "b": 2, stats_module.OTHER_TENANTS: 3}  # b before d: by name
    assert sum(by_tenant.values()) == sum(queued.values()) == 8


def test_a_models_reopen_and_pause_are_also_given_as_seconds_from_the_snapshot() -> None:
    book = StatsBook()
    book.health["m"] = Health(
        model="m",
        breaker=BreakerState.OPEN,
        reopen_at=130.0,
        paused_until=101.5,
        given_up=FailureReason.PROVIDER_DOWN,
        last_error="provider_error (HTTP 500)",
    )
    book.health["n"] = Health(model="n", breaker=BreakerState.CLOSED, paused_until=90.0)
    models = book.snapshot({}, now=100.0).models
    assert models["m"]["breaker"] == "open"
    assert models["m"]["reopens_in_s"] == 30.0
    assert models["m"]["paused_for_s"] == 1.5
    assert models["m"]["given_up"] == "provider_down"
    assert models["m"]["last_error"] == "provider_error (HTTP 500)"
    assert models["n"]["reopens_in_s"] is None
    assert models["n"]["given_up"] is None
    assert models["n"]["paused_for_s"] == 0.0  # a pause already over


def test_an_estimate_billed_before_a_real_answer_counts_as_estimated_only_itself() -> None:
    """An unreadable first answer (charged its estimate) made the fallback's real answer
    count, whole, as estimated: 41.7 m nUSD of estimates where 0.8 m were (found by a
    hunt). The estimate counts on the model that billed it and in the total; the real
    answer is not one."""
    estimate = Usage(prompt_tokens=10, completion_tokens=100, estimated=True)
    billed = Billed(model="cheap", usage=estimate, cost_nusd=809)
    real = Usage(prompt_tokens=10, completion_tokens=20)
    answered = Completed(
        task_id=1,
        trace_id="t",
        model="dear",
        content="ok",
        usage=real.plus(estimate),
        cost_nusd=809 + 40_900,
        billed_before=(billed,),
    )
    book = StatsBook()
    book.add([answered])
    assert (book.total.estimated_cost_nusd, book.total.estimated) == (809, 0)
    assert (book.by_model["dear"].estimated_cost_nusd, book.by_model["dear"].estimated) == (0, 0)
    assert book.by_model["cheap"].estimated_cost_nusd == 809


def test_a_reservoir_is_exact_until_full_then_a_uniform_sample_of_its_size() -> None:
    """``callboard run`` kept every latency for its table: memory and a sort a line
    (a hunt). A reservoir keeps ``size`` of them, each value with the same chance."""
    small = Reservoir(size=100)
    for i in range(50):
        small.add(float(i))
    assert small.values == [float(i) for i in range(50)]
    big = Reservoir(size=1000, seed=7)
    for i in range(100_000):
        big.add(float(i))
    assert (len(big.values), big.added) == (1000, 100_000)
    p = percentiles(big.values)
    assert p.p50 is not None
    assert 45_000 < p.p50 < 55_000  # the stream's median is 50,000
    assert sum(v >= 50_000 for v in big.values) > 400  # late values get in too
    with pytest.raises(ValueError, match="at least one"):
        Reservoir(size=0)
