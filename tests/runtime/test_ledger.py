"""The in-memory ledger (runtime/ledger.py): stage transitions, exactly-once finish,
idempotency keys (also through a real System: a cancelled key stays used, concurrent
duplicates admit one), balanced counts (examples, a hypothesis state machine, real
threads), ``wait_idle``."""

from __future__ import annotations

import dataclasses
import enum
import random
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
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
    Request,
    Result,
    Task,
)
from callboard.provider.server import SimulatedProvider
from callboard.runtime.ledger import CLOSED, FULL, LIVE, Ledger, binds_key
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support import (
    WAIT_S,
    accept_one,
    finish_one,
    interrupted_taking,
    one_model,
    route_one,
    settle,
)

from callboard import System, SystemConfig

# -- helpers ------------------------------------------------------------------


class Stage(enum.Enum):
    """Where a live task stands, as the ledger's public predicates tell it."""

    ACCEPTED = "accepted"
    ROUTED = "routed"
    IN_FLIGHT = "in_flight"


def stage_of(ledger: Ledger, task_id: int) -> Stage | None:
    if ledger.is_accepted(task_id):
        return Stage.ACCEPTED
    if ledger.is_routed(task_id):
        return Stage.ROUTED
    return Stage.IN_FLIGHT if ledger.is_live(task_id) else None


def make_task(
    task_id: int,
    key: str | None = None,
    priority: Priority = Priority.NORMAL,
    tenant: str | None = None,
) -> Task:
    return Task(
        task_id=task_id,
        trace_id=f"trace-{task_id}",
        request=Request.of(
            f"prompt {task_id}", idempotency_key=key, priority=priority, budget_tag=tenant
        ),
        submitted_at=0.0,
        future=Future(),
    )


def job_of(task: Task, attempt: int = 0, candidates: tuple[str, ...] = ("alpha",)) -> Job:
    return Job(task=task, candidates=candidates, attempt=attempt)


def done(task: Task, content: str = "ok") -> Completed:
    return Completed(task_id=task.task_id, trace_id=task.trace_id, content=content)


def counting(task: Task) -> Counter[int]:
    """Count how many times the task's future fires its done-callbacks."""
    calls: Counter[int] = Counter()
    assert task.future is not None
    task.future.add_done_callback(lambda _f: calls.update([task.task_id]))
    return calls


def accepted(ledger: Ledger, *tasks: Task) -> None:
    for task in tasks:
        assert accept_one(ledger, task) is None


# -- stage transitions ----------------------------------------------------------


def test_a_task_walks_accept_route_dispatch_reclaim_finish() -> None:
    ledger = Ledger()
    task = make_task(ledger.next_id())
    accepted(ledger, task)
    assert stage_of(ledger, task.task_id) is Stage.ACCEPTED
    assert ledger.accepted_tasks() == [task]
    assert ledger.counts().routing == 1

    job = job_of(task)
    assert route_one(ledger, job)
    assert stage_of(ledger, task.task_id) is Stage.ROUTED
    assert ledger.is_routed(task.task_id)
    assert ledger.routed() == [job]
    assert ledger.accepted_tasks() == []
    assert ledger.counts().queued == 1

    assert ledger.dispatch_all([job], "alpha", 3)
    assert stage_of(ledger, task.task_id) is Stage.IN_FLIGHT
    assert ledger.in_flight_of("alpha", below=4) == [(job, 3)]
    assert ledger.in_flight_of("alpha", below=3) == []  # the live incarnation keeps its own
    assert ledger.in_flight_of("beta", below=99) == []
    assert ledger.routed() == []
    assert ledger.counts().in_flight == 1

    retry = job_of(task, attempt=1)
    assert ledger.reclaim(retry, "alpha", 3)
    assert stage_of(ledger, task.task_id) is Stage.ROUTED
    assert ledger.routed() == [retry]  # the reclaimed job replaces the old one
    assert ledger.in_flight_of("alpha", below=99) == []

    assert ledger.dispatch_all([retry], "beta", 1)
    result = done(task)
    assert finish_one(ledger, task, result)
    assert stage_of(ledger, task.task_id) is None
    assert not ledger.is_live(task.task_id)
    assert task.future is not None
    assert task.future.result(timeout=0) is result
    c = ledger.counts()
    assert (c.accepted, c.routing, c.queued, c.in_flight, c.finished) == (1, 0, 0, 0, 1)
    assert c.balanced
    assert c.live == 0


def test_transitions_out_of_order_are_refused_and_change_nothing() -> None:
    ledger = Ledger()
    task = make_task(1)
    job = job_of(task)
    assert not route_one(ledger, job), "unknown task"
    assert not ledger.dispatch_all([job], "alpha", 1), "unknown task"
    assert not ledger.reclaim(job, "alpha", 1), "unknown task"

    accepted(ledger, task)
    assert not ledger.dispatch_all([job], "alpha", 1), "not routed yet"
    assert not ledger.reclaim(job, "alpha", 1), "not in flight"
    assert stage_of(ledger, 1) is Stage.ACCEPTED

    assert route_one(ledger, job)
    assert not route_one(ledger, job), "already routed"
    assert not ledger.reclaim(job, "alpha", 1), "not in flight"

    assert ledger.dispatch_all([job], "alpha", 2)
    assert not ledger.dispatch_all([job], "alpha", 2), "already in flight"
    assert not route_one(ledger, job), "in flight"
    assert not ledger.reclaim(job, "beta", 2), "wrong model"
    assert not ledger.reclaim(job, "alpha", 1), "an older incarnation's late report"
    assert not ledger.reclaim(job, "alpha", 3), "wrong incarnation"
    assert stage_of(ledger, 1) is Stage.IN_FLIGHT
    assert ledger.in_flight_of("alpha", below=3) == [(job, 2)]

    assert finish_one(ledger, task, done(task))
    assert not route_one(ledger, job)
    assert not ledger.dispatch_all([job], "alpha", 2)
    assert not ledger.reclaim(job, "alpha", 2)
    c = ledger.counts()
    assert c.balanced
    assert (c.accepted, c.finished, c.live) == (1, 1, 0)


@pytest.mark.parametrize("stage", ["accepted", "routed", "in_flight"])
def test_finish_ends_a_task_from_any_live_stage(stage: str) -> None:
    ledger = Ledger()
    task = make_task(1)
    job = job_of(task)
    accepted(ledger, task)
    if stage in {"routed", "in_flight"}:
        assert route_one(ledger, job)
    if stage == "in_flight":
        assert ledger.dispatch_all([job], "alpha", 1)
    assert finish_one(ledger, task, done(task))
    c = ledger.counts()
    assert (c.routing, c.queued, c.in_flight, c.finished) == (0, 0, 0, 1)
    assert c.balanced
    assert ledger.live_entries() == []


# -- exactly once ----------------------------------------------------------------


def test_finish_succeeds_once_and_resolves_the_future_once() -> None:
    ledger = Ledger()
    task = make_task(1)
    calls = counting(task)
    accepted(ledger, task)
    first, second = done(task, "first"), done(task, "second")
    assert finish_one(ledger, task, first) is True
    assert finish_one(ledger, task, second) is False
    assert finish_one(ledger, task, second) is False
    assert task.future is not None
    assert task.future.result(timeout=0) is first
    assert calls[1] == 1
    assert ledger.counts().finished == 1
    assert ledger.counts().balanced


def test_finish_all_counts_only_first_finishes() -> None:
    ledger = Ledger()
    tasks = [make_task(i) for i in range(1, 6)]
    accepted(ledger, *tasks)
    assert finish_one(ledger, tasks[0], done(tasks[0]))
    pairs = [(t, done(t)) for t in tasks] + [(tasks[1], done(tasks[1], "again"))]
    delivered = ledger.finish_all(pairs)
    assert delivered == [result for _, result in pairs[1:5]]  # the first result of each, in order
    assert ledger.counts().finished == 5
    assert ledger.counts().balanced


def test_finish_of_a_task_never_accepted_is_refused_and_leaves_its_future() -> None:
    ledger = Ledger()
    task = make_task(1)
    assert not finish_one(ledger, task, done(task))
    assert task.future is not None
    assert not task.future.done()
    c = ledger.counts()
    assert (c.accepted, c.finished) == (0, 0)


def test_a_future_cancelled_by_its_caller_does_not_break_finish() -> None:
    ledger = Ledger()
    task = make_task(1)
    accepted(ledger, task)
    assert task.future is not None
    assert task.future.cancel()
    assert finish_one(ledger, task, done(task)) is True  # no InvalidStateError escapes
    assert task.future.cancelled()
    assert ledger.counts().finished == 1
    assert ledger.wait_idle(0)


def test_cancel_racing_finish_never_raises_and_resolves_at_most_once() -> None:
    ledger = Ledger()
    rounds = 300
    with ThreadPoolExecutor(max_workers=2) as pool:
        for i in range(1, rounds + 1):
            task = make_task(i)
            calls = counting(task)
            accepted(ledger, task)
            assert task.future is not None
            barrier = threading.Barrier(2)
            fut = task.future

            def cancel(fut: Future[object] = fut, barrier: threading.Barrier = barrier) -> bool:
                barrier.wait(WAIT_S)
                return fut.cancel()

            def finish(task: Task = task, barrier: threading.Barrier = barrier) -> bool:
                barrier.wait(WAIT_S)
                return finish_one(ledger, task, done(task))

            cancelled = pool.submit(cancel)
            finished = pool.submit(finish)
            assert finished.result(WAIT_S) is True
            was_cancelled = cancelled.result(WAIT_S)
            assert fut.done()
            assert was_cancelled == fut.cancelled()
            if not was_cancelled:
                assert fut.result(timeout=0).task_id == i
            assert calls[i] == 1
    c = ledger.counts()
    assert (c.accepted, c.finished, c.live) == (rounds, rounds, 0)


def test_finish_own_ends_only_the_very_task_the_ledger_holds() -> None:
    """A submit cut short ends what it accepted, not another submit's task of its id."""
    ledger = Ledger()
    task, twin, never = make_task(1), make_task(1), make_task(2)
    accepted(ledger, task)
    assert ledger.finish_own([(twin, done(twin)), (never, done(never))]) == []
    assert ledger.is_live(1)
    assert twin.future is not None
    assert not twin.future.done()
    assert ledger.finish_own([(task, done(task))]) == [done(task)]
    assert ledger.wait_idle(0)


def test_nothing_is_accepted_once_the_ledger_is_closed() -> None:
    """A submit that passed its checks as the system stopped accepted its task after the
    stop's sweep: with a durable ledger, its outcome went to a writer that was gone,
    and its future never resolved (found by a review)."""
    ledger = Ledger()
    ledger.close()
    assert ledger.accept_all([make_task(1), make_task(2)]) == [CLOSED, CLOSED]
    assert ledger.wait_idle(0)


def test_reject_delivers_without_counting_the_task_as_accepted() -> None:
    ledger = Ledger()
    task = make_task(1)
    refusal = Rejected(task_id=1, trace_id="trace-1", reason=RejectReason.QUEUE_FULL)
    ledger.reject(task, refusal)
    assert task.future is not None
    assert task.future.result(timeout=0) is refusal
    c = ledger.counts()
    assert (c.accepted, c.rejected, c.finished) == (0, 1, 0)
    assert c.balanced
    assert not ledger.is_live(1)
    assert ledger.wait_idle(0)


def test_a_task_whose_id_is_live_is_refused_and_not_counted_twice() -> None:
    """Two ``resume`` calls at once accepted each id twice, as two tasks: the router
    routed one, and the other's future was never resolved (found by a review)."""
    ledger = Ledger()
    task, again = make_task(1), make_task(1)
    accepted(ledger, task)
    assert accept_one(ledger, again) is LIVE
    assert ledger.counts().accepted == 1
    assert finish_one(ledger, task, done(task))
    c = ledger.counts()
    assert (c.accepted, c.live, c.finished) == (1, 0, 1)


# -- idempotency keys ------------------------------------------------------------


def test_a_duplicate_key_returns_the_holder_and_is_not_accepted() -> None:
    ledger = Ledger()
    first, dup = make_task(1, key="k"), make_task(2, key="k")
    other = make_task(3, key="other")
    accepted(ledger, first)
    assert accept_one(ledger, dup) == 1
    assert not ledger.is_live(2)
    accepted(ledger, other)
    c = ledger.counts()
    assert (c.accepted, c.routing) == (2, 2)
    assert c.balanced


def test_a_finished_key_is_remembered_so_a_resubmission_is_still_a_duplicate() -> None:
    ledger = Ledger()
    first = make_task(1, key="k")
    accepted(ledger, first)
    assert finish_one(ledger, first, done(first))
    assert accept_one(ledger, make_task(2, key="k")) == 1
    assert ledger.counts().accepted == 1


def test_a_finished_keys_result_is_not_kept_in_memory() -> None:
    """Only a durable ledger keeps results (``SqliteLedger.kept_result``)."""
    ledger = Ledger()
    task = make_task(1, key="k")
    accepted(ledger, task)
    assert finish_one(ledger, task, done(task))
    assert ledger.kept_result("k") is None


def test_a_cancelled_tasks_key_may_be_used_again_once_it_has_ended() -> None:
    """The docs say so, and a new process reading a durable ledger did: the process
    that cancelled it refused the key as a duplicate for good."""
    ledger = Ledger()
    cancelled, completed = make_task(1, key="c"), make_task(2, key="d")
    accepted(ledger, cancelled, completed)
    assert finish_one(ledger, cancelled, Cancelled(task_id=1, trace_id="t"))
    assert finish_one(ledger, completed, done(completed))
    assert accept_one(ledger, make_task(3, key="c")) is None, "sent anew"
    assert accept_one(ledger, make_task(4, key="d")) == 2, "a completed key stays answered"


def test_a_key_whose_task_ended_with_no_call_made_may_be_used_again() -> None:
    """Stripe keeps no answer for a request that never ran: an expired task's key held
    for good, and its retry without the deadline got the same 504 (found by a hunt).
    One that made a call (it may have been served, and billed) stays answered."""
    ledger = Ledger()
    unsent, sent, refused = (make_task(i, key=k) for i, k in ((1, "u"), (2, "s"), (3, "r")))
    accepted(ledger, unsent, sent, refused)
    assert finish_one(ledger, unsent, Expired(task_id=1, trace_id="t", attempts=0))
    assert finish_one(ledger, sent, Expired(task_id=2, trace_id="t", attempts=1))
    assert finish_one(
        ledger, refused, Failed(task_id=3, trace_id="t", reason=FailureReason.NO_ROUTE)
    )
    assert accept_one(ledger, make_task(4, key="u")) is None, "sent anew"
    assert accept_one(ledger, make_task(5, key="s")) == 2, "a call was made: answered"
    assert accept_one(ledger, make_task(6, key="r")) is None, "refused before any call"


@pytest.mark.parametrize(
    ("result", "binds"),
    [
        (Completed(task_id=1, trace_id="t", content="a"), True),
        (Completed(task_id=1, trace_id="t", content="a", attempts=2), True),
        (Failed(task_id=1, trace_id="t", reason=FailureReason.PROVIDER_DOWN, attempts=1), True),
        (Failed(task_id=1, trace_id="t", reason=FailureReason.NO_ROUTE), False),
        (Expired(task_id=1, trace_id="t", attempts=3), True),
        (Expired(task_id=1, trace_id="t"), False),
        (Rejected(task_id=1, trace_id="t", reason=RejectReason.QUEUE_FULL), False),
        (Cancelled(task_id=1, trace_id="t", attempts=1), False),
        # every call refused unserved (a 429, an overloaded 503/529): nothing ran, and a
        # retry once the limit has passed is a new request, not the replayed 429 (a hunt)
        (Failed(task_id=1, trace_id="t", reason=FailureReason.RATE_LIMITED, attempts=2), True),
        (
            Failed(
                task_id=1, trace_id="t", reason=FailureReason.RATE_LIMITED, attempts=2, refused=2
            ),
            False,
        ),
        (
            Failed(
                task_id=1, trace_id="t", reason=FailureReason.RATE_LIMITED, attempts=3, refused=2
            ),
            True,  # one call may have been served (a timeout, a 500)
        ),
        (Expired(task_id=1, trace_id="t", attempts=1, refused=1), False),
        (Completed(task_id=1, trace_id="t", content="a", attempts=2, refused=1), True),
    ],
)
def test_binds_key_is_an_answer_or_a_call_made_never_a_cancel(result: Result, binds: bool) -> None:
    assert binds_key(result) is binds


def test_a_reopened_key_is_accepted_again_and_a_live_one_stays_held() -> None:
    ledger = Ledger()
    failed, live = make_task(1, key="retry"), make_task(2, key="live")
    accepted(ledger, failed, live)
    assert finish_one(ledger, failed, done(failed))
    ledger.reopen(["retry", "live", "never-seen"])
    assert accept_one(ledger, make_task(3, key="retry")) is None, "sent anew"
    assert accept_one(ledger, make_task(4, key="live")) == 2, "a live key is not reopened"
    assert ledger.counts().balanced


def test_remembered_keys_are_bounded_oldest_forgotten_first() -> None:
    ledger = Ledger(remember_keys=2)
    tasks = [make_task(i, key=f"k{i}") for i in (1, 2, 3)]
    for task in tasks:
        accepted(ledger, task)
        assert finish_one(ledger, task, done(task))
    assert accept_one(ledger, make_task(10, key="k1")) is None, "k1 was the oldest: forgotten"
    assert accept_one(ledger, make_task(11, key="k2")) == 2
    assert accept_one(ledger, make_task(12, key="k3")) == 3
    # a live key is never forgotten, however many keys finish meanwhile
    live = make_task(20, key="live")
    accepted(ledger, live)
    for i in range(30, 40):
        t = make_task(i, key=f"k{i}")
        accepted(ledger, t)
        assert finish_one(ledger, t, done(t))
    assert accept_one(ledger, make_task(21, key="live")) == 20


def test_tasks_without_a_key_are_never_duplicates() -> None:
    ledger = Ledger(remember_keys=0)
    tasks = [make_task(i) for i in range(1, 4)]
    accepted(ledger, *tasks)
    assert ledger.counts().accepted == 3


def test_a_cancelled_key_stays_used_and_concurrent_duplicates_admit_one(
    provider: SimulatedProvider,
) -> None:
    with System(SystemConfig(models=(one_model(provider),))) as system:
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


# -- wait_idle ---------------------------------------------------------------------


def test_an_empty_ledger_is_idle() -> None:
    assert Ledger().wait_idle(0)


def test_a_waiter_wakes_when_the_last_task_finishes() -> None:
    ledger = Ledger()
    a, b = make_task(1), make_task(2)
    accepted(ledger, a, b)
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiter = pool.submit(ledger.wait_idle, WAIT_S)
        assert finish_one(ledger, a, done(a))
        assert not waiter.done(), "one task is still live"
        assert finish_one(ledger, b, done(b))
        assert waiter.result(WAIT_S) is True


def test_wait_idle_times_out_false_while_a_task_is_live() -> None:
    ledger = Ledger()
    accepted(ledger, make_task(1))
    assert ledger.wait_idle(0.02) is False


def test_the_ledger_is_not_idle_until_the_result_is_delivered() -> None:
    """A drain must not return before the caller's callbacks have run."""
    ledger = Ledger()
    task = make_task(1)
    seen: list[bool] = []
    assert task.future is not None
    task.future.add_done_callback(lambda _f: seen.append(ledger.wait_idle(0)))
    accepted(ledger, task)
    assert finish_one(ledger, task, done(task))
    assert seen == [False]
    assert ledger.wait_idle(0)


# -- a state machine against a reference model -----------------------------------

MODELS = ("m1", "m2")
INCARNATIONS = (1, 2, 3)
KEYS = (None, None, "a", "b", "c")
REMEMBER = 2


@dataclass
class RefTask:
    task: Task
    stage: Stage | None = Stage.ACCEPTED
    """None once finished."""
    model: str | None = None
    incarnation: int = 0
    job: Job | None = None
    cancelled: bool = False
    resolved: Counter[int] = field(default_factory=Counter)


class LedgerMachine(RuleBasedStateMachine):
    """Random op sequences: return values, stages and counts match a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(remember_keys=REMEMBER)
        self.tasks: list[RefTask] = []
        self.live_keys: dict[str, int] = {}
        self.finished_keys: OrderedDict[str, int] = OrderedDict()
        self.finished = 0
        self.rejected = 0
        self.ledger_ids = 0

    def pick(self, i: int) -> RefTask:
        return self.tasks[i % len(self.tasks)]

    @rule(key=st.sampled_from(KEYS))
    def accept(self, key: str | None) -> None:
        task = make_task(
            self.ledger.next_id(),
            key=key,
            priority=Priority(self.ledger_ids % 4),
            tenant=(None, "a", "b")[self.ledger_ids % 3],
        )
        self.ledger_ids += 1
        ref = RefTask(task)
        assert task.future is not None
        task.future.add_done_callback(lambda _f: ref.resolved.update([1]))
        expected = None
        if key is not None:
            expected = self.live_keys.get(key) or self.finished_keys.get(key)
        assert accept_one(self.ledger, task) == expected
        if expected is None:
            if key is not None:
                self.live_keys[key] = task.task_id
            self.tasks.append(ref)
        else:
            self.rejected += 1
            self.ledger.reject(
                task, Rejected(task_id=task.task_id, trace_id="t", reason=RejectReason.DUPLICATE)
            )
            assert ref.resolved[1] == 1

    @precondition(lambda self: self.tasks)
    @rule(i=st.integers(0, 60), attempt=st.integers(0, 3))
    def route(self, i: int, attempt: int) -> None:
        ref = self.pick(i)
        job = job_of(ref.task, attempt=attempt)
        ok = ref.stage is Stage.ACCEPTED
        assert route_one(self.ledger, job) == ok
        if ok:
            ref.stage, ref.job = Stage.ROUTED, job

    @precondition(lambda self: self.tasks)
    @rule(i=st.integers(0, 60), model=st.sampled_from(MODELS), inc=st.sampled_from(INCARNATIONS))
    def dispatch(self, i: int, model: str, inc: int) -> None:
        ref = self.pick(i)
        job = ref.job or job_of(ref.task)
        ok = ref.stage is Stage.ROUTED
        assert bool(self.ledger.dispatch_all([job], model, inc)) == ok
        if ok:
            ref.stage, ref.model, ref.incarnation = Stage.IN_FLIGHT, model, inc

    @precondition(lambda self: self.tasks)
    @rule(i=st.integers(0, 60), model=st.sampled_from(MODELS), inc=st.sampled_from(INCARNATIONS))
    def reclaim(self, i: int, model: str, inc: int) -> None:
        ref = self.pick(i)
        job = job_of(ref.task, attempt=(ref.job.attempt + 1) if ref.job else 1)
        ok = ref.stage is Stage.IN_FLIGHT and ref.model == model and ref.incarnation == inc
        assert self.ledger.reclaim(job, model, inc) == ok
        if ok:
            ref.stage, ref.model, ref.job = Stage.ROUTED, None, job

    @precondition(lambda self: self.tasks)
    @rule(i=st.integers(0, 60))
    def finish(self, i: int) -> None:
        ref = self.pick(i)
        result = done(ref.task)
        ok = ref.stage is not None
        assert finish_one(self.ledger, ref.task, result) == ok
        if not ok:
            return
        ref.stage = None
        self.finished += 1
        key = ref.task.request.idempotency_key
        if key is not None:
            del self.live_keys[key]
            self.finished_keys[key] = ref.task.task_id
            while len(self.finished_keys) > REMEMBER:
                self.finished_keys.popitem(last=False)
        assert ref.task.future is not None
        if not ref.cancelled:
            assert ref.task.future.result(timeout=0) is result

    @precondition(lambda self: self.tasks)
    @rule(i=st.integers(0, 60))
    def caller_cancels(self, i: int) -> None:
        ref = self.pick(i)
        assert ref.task.future is not None
        if ref.task.future.cancel():
            ref.cancelled = True

    @precondition(lambda self: self.tasks)
    @rule(i=st.integers(0, 60))
    def recover_views(self, i: int) -> None:
        ref = self.pick(i)
        assert stage_of(self.ledger, ref.task.task_id) is ref.stage
        routed = {j.task.task_id: j for j in self.ledger.routed()}
        expected = {r.task.task_id: r.job for r in self.tasks if r.stage is Stage.ROUTED}
        assert routed == expected
        for model in MODELS:
            flying = {(j.task.task_id, inc) for j, inc in self.ledger.in_flight_of(model, below=3)}
            assert flying == {
                (r.task.task_id, r.incarnation)
                for r in self.tasks
                if r.stage is Stage.IN_FLIGHT and r.model == model and r.incarnation < 3
            }

    @invariant()
    def counts_are_balanced_and_match_the_model(self) -> None:
        c = self.ledger.counts()
        assert c.balanced
        stages = Counter(r.stage for r in self.tasks)
        assert c.accepted == len(self.tasks)
        assert c.routing == stages[Stage.ACCEPTED]
        assert c.queued == stages[Stage.ROUTED]
        assert c.in_flight == stages[Stage.IN_FLIGHT]
        assert c.finished == self.finished
        assert c.rejected == self.rejected
        assert self.ledger.wait_idle(0) == (c.live == 0)

    @invariant()
    def the_depth_counts_the_routed_jobs_by_priority_and_tenant(self) -> None:
        """Kept as jobs come and go, never by a scan: the scan must agree."""
        routed = Counter(
            (r.task.request.priority, r.task.request.budget_tag)
            for r in self.tasks
            if r.stage is Stage.ROUTED
        )
        assert self.ledger.depth() == dict(routed)

    @invariant()
    def every_future_resolved_at_most_once_and_only_when_finished_or_cancelled(self) -> None:
        for ref in self.tasks:
            assert ref.resolved[1] <= 1
            assert ref.task.future is not None
            if ref.stage is None or ref.cancelled:
                assert ref.resolved[1] == 1
            else:
                assert not ref.task.future.done()


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


# -- real threads ------------------------------------------------------------------


def test_concurrent_dispatch_reclaim_and_finish_stay_balanced_and_finish_once() -> None:
    ledger = Ledger()
    n, workers = 1500, 6
    tasks = [make_task(ledger.next_id(), key=f"k{i}" if i % 3 == 0 else None) for i in range(n)]
    resolved: Counter[int] = Counter()
    lock = threading.Lock()

    def on_done(task_id: int) -> None:
        with lock:
            resolved[task_id] += 1

    for task in tasks:
        assert task.future is not None
        task.future.add_done_callback(lambda _f, tid=task.task_id: on_done(tid))
        accepted(ledger, task)
        assert route_one(ledger, job_of(task))
    barrier = threading.Barrier(workers + 1)
    stop_checking = threading.Event()
    unbalanced: list[object] = []

    def worker(seed: int) -> list[int]:
        rng = random.Random(seed)
        order = list(tasks)
        rng.shuffle(order)
        mine: list[int] = []
        model = f"m{seed}"
        barrier.wait(WAIT_S)
        for task in order:
            job = job_of(task)
            if ledger.dispatch_all([job], model, 1) and rng.random() < 0.3:
                ledger.reclaim(job_of(task, attempt=1), model, 1)
                ledger.dispatch_all([job], model, 2)
            if finish_one(ledger, task, done(task, content=model)):
                mine.append(task.task_id)
        return mine

    def checker() -> None:
        barrier.wait(WAIT_S)
        while not stop_checking.is_set():
            c = ledger.counts()
            if not c.balanced:
                unbalanced.append(c)

    check = threading.Thread(target=checker)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        check.start()
        runs = [pool.submit(worker, seed) for seed in range(workers)]
        finished_by = [r.result(WAIT_S) for r in runs]
    stop_checking.set()
    check.join(WAIT_S)

    all_finished = Counter(tid for mine in finished_by for tid in mine)
    assert set(all_finished) == {t.task_id for t in tasks}
    assert set(all_finished.values()) == {1}, "each task finished by exactly one thread"
    assert set(resolved.values()) == {1}
    assert len(resolved) == n
    winner = {tid: f"m{seed}" for seed, mine in enumerate(finished_by) for tid in mine}
    for task in tasks:
        assert task.future is not None
        result = task.future.result(timeout=0)
        assert isinstance(result, Completed)
        assert result.content == winner[task.task_id], "the future holds the winning result"
    assert unbalanced == []
    c = ledger.counts()
    assert (c.accepted, c.finished, c.live) == (n, n, 0)
    assert ledger.wait_idle(0)


def test_concurrent_submitters_and_finishers_with_one_waiter() -> None:
    """Accept on some threads, finish on others; the waiter wakes only at the end (a
    sentinel task, live from the start, ends after them all)."""
    ledger = Ledger()
    per_thread, producers = 300, 4
    handoff: list[list[Task]] = [[] for _ in range(producers)]
    ready = [threading.Event() for _ in range(producers)]
    all_tasks = [[make_task(ledger.next_id()) for _ in range(per_thread)] for _ in range(producers)]
    sentinel = make_task(ledger.next_id())
    accepted(ledger, sentinel)

    def produce(k: int) -> None:
        for task in all_tasks[k]:
            accepted(ledger, task)
            handoff[k].append(task)
        ready[k].set()

    def consume(k: int) -> int:
        assert ready[k].wait(WAIT_S)
        return sum(finish_one(ledger, t, done(t)) for t in handoff[k])

    with ThreadPoolExecutor(max_workers=2 * producers + 1) as pool:
        waiter = pool.submit(ledger.wait_idle, WAIT_S)
        finishers = [pool.submit(consume, k) for k in range(producers)]
        for k in range(producers):
            pool.submit(produce, k)
        assert sum(f.result(WAIT_S) for f in finishers) == per_thread * producers
        assert not waiter.done(), "the sentinel is still live"
        assert finish_one(ledger, sentinel, done(sentinel))
        assert waiter.result(WAIT_S) is True
    c = ledger.counts()
    assert c.balanced
    assert c.finished == per_thread * producers + 1
    for batch in all_tasks:
        for task in batch:
            assert task.future is not None
            assert isinstance(task.future.result(timeout=0), Completed)


def test_cancelled_result_type_is_delivered_like_any_other() -> None:
    ledger = Ledger()
    task = make_task(1)
    accepted(ledger, task)
    result = Cancelled(task_id=1, trace_id="trace-1", detail="system stopped")
    assert finish_one(ledger, task, result)
    assert task.future is not None
    assert task.future.result(timeout=0) is result


# -- batches --------------------------------------------------------------------


def test_accept_all_answers_each_task_in_order_and_sees_keys_taken_in_the_same_batch() -> None:
    ledger = Ledger()
    first, twin, other = make_task(1, key="k"), make_task(2, key="k"), make_task(3)
    assert ledger.accept_all([first, twin, other, first]) == [None, 1, None, LIVE]
    counts = ledger.counts()
    assert (counts.accepted, counts.routing) == (2, 2)  # the first given twice counts once
    assert not ledger.is_live(2)


def test_route_all_and_dispatch_all_move_only_the_tasks_in_the_right_stage() -> None:
    ledger = Ledger()
    tasks = [make_task(i) for i in range(1, 5)]
    accepted(ledger, *tasks[:3])  # task 4 was never accepted
    jobs = [Job(task=t, candidates=("m",)) for t in tasks]
    assert ledger.route_all(jobs) == jobs[:3]
    assert ledger.route_all(jobs) == []  # routed already
    assert ledger.dispatch_all([jobs[0], jobs[2], jobs[3]], "m", 1) == [jobs[0], jobs[2]]
    counts = ledger.counts()
    assert (counts.routing, counts.queued, counts.in_flight) == (0, 1, 2)
    assert ledger.in_flight_of("m", below=2) == [(jobs[0], 1), (jobs[2], 1)]
    assert ledger.counts().balanced


def test_accept_all_counts_capacity_as_it_accepts_and_never_refuses_a_live_task() -> None:
    ledger = Ledger()
    live = make_task(1, key="k")
    assert ledger.accept_all([live], capacity=2) == [None]
    dup, fresh, late = make_task(2, key="k"), make_task(3), make_task(4)
    # the duplicate takes no room, the fresh task the last of it, the late one finds it full;
    # the live task, given again, is answered live (not full) although the queue is full
    assert ledger.accept_all([dup, fresh, late, live], capacity=2) == [1, None, FULL, LIVE]
    assert ledger.counts().accepted == 2
    assert accept_one(ledger, make_task(5), capacity=2) is FULL


def test_finish_all_delivers_the_rest_of_a_batch_when_one_delivery_raises() -> None:
    class Exploding(Future[Result]):
        def set_result(self, result: Result) -> None:
            raise KeyboardInterrupt  # a BaseException: not caught as a callback error

    ledger = Ledger()
    first, *rest = [make_task(i) for i in range(1, 4)]
    bad = Task(task_id=9, trace_id="t9", request=first.request, submitted_at=0.0)
    bad = dataclasses.replace(bad, future=Exploding())
    accepted(ledger, first, bad, *rest)
    pairs = [(t, done(t)) for t in (first, bad, *rest)]
    with pytest.raises(KeyboardInterrupt):
        ledger.finish_all(pairs)
    assert all(t.future is not None and t.future.result(0).ok for t in (first, *rest))
    assert ledger.wait_idle(0)  # nothing left counted as being delivered


def test_a_cancel_request_is_kept_for_live_tasks_only_and_forgotten_when_they_end() -> None:
    ledger = Ledger()
    unrouted, queued, sent, gone = (make_task(i) for i in (1, 2, 3, 4))
    accepted(ledger, unrouted, queued, sent)
    ledger.route_all([job_of(queued), job_of(sent)])
    ledger.dispatch_all([job_of(sent)], "alpha", 1)
    assert ledger.ask_cancel([1, 2, 3, 4]) == [1, 2, 3]  # 4 was never submitted
    tasks = (unrouted, queued, sent, gone)
    assert [ledger.cancel_wanted(t) for t in tasks] == [True, True, True, False]
    assert ledger.holders([1, 2, 3, 4]) == {"alpha": [3]}
    ledger.finish_all([(t, done(t)) for t in (unrouted, queued, sent)])
    assert not any(ledger.cancel_wanted(t) for t in (unrouted, queued, sent))
    assert ledger._cancel_asked == set()  # nothing left behind
    ledger.cancel_everything()
    assert ledger.cancel_wanted(gone)  # whatever comes after a stop's cancel


def test_a_ctrl_c_as_a_drain_takes_the_ledgers_lock_does_not_leave_it_taken() -> None:
    """``wait_idle`` entered its Condition by a Python ``__enter__``: a Ctrl-C handled
    between the lock's acquire and the ``with`` left the ledger's lock taken for good,
    and every actor (each records its tasks there) and the stop waited for it."""
    ledger = Ledger()
    ledger.accept_all([make_task(1)])  # a live task: the drain waits
    interrupted_taking(ledger._lock, {"__enter__", "wait_idle"}, lambda: ledger.wait_idle(WAIT_S))


def test_the_thread_holding_the_ledger_may_enter_it_again() -> None:
    """A signal handler runs on the main thread, wherever it was: a status handler
    calling ``stats()`` (the ledger's counts) while that thread's ``submit_many`` held
    the ledger's lock waited for itself for good (found by a hunt). Here the handler
    runs from inside ``accept_all``, as the signal arrived."""
    ledger = Ledger()
    seen: list[int] = []

    class Interrupted(list[Task]):
        def __iter__(self) -> Iterator[Task]:
            yield self[0]
            seen.append(ledger.counts().live)  # the handler, under the lock
            yield self[1]

    burst = Interrupted([make_task(1), make_task(2)])
    worker = threading.Thread(target=ledger.accept_all, args=(burst,), daemon=True)
    worker.start()
    worker.join(WAIT_S)
    assert not worker.is_alive(), "the thread waited for itself"
    assert len(seen) == 1  # it ran, and returned


def test_a_task_is_pending_from_its_acceptance_until_its_outcome_is_delivered() -> None:
    """``System.resume`` reads a durable ledger's file: a task ended here whose outcome
    was on its way to the file read as unfinished, was sent again, and its caller got
    two results (a flaky test). Pending lasts until the outcome is delivered."""
    ledger = Ledger()
    task = make_task(1)
    assert accept_one(ledger, task) is None
    assert ledger.pending_ids() == {1}
    delivering = threading.Event()
    release = threading.Event()

    def slow(future: Future[Result]) -> None:  # the delivery is under way: not over yet
        delivering.set()
        release.wait(WAIT_S)

    assert task.future is not None
    task.future.add_done_callback(slow)
    with ThreadPoolExecutor(max_workers=1) as pool:
        finishing = pool.submit(ledger.finish_all, [(task, done(task))])
        assert delivering.wait(WAIT_S)
        assert not ledger.is_live(1)
        assert ledger.pending_ids() == {1}  # ended, its outcome not delivered yet
        release.set()
        finishing.result(WAIT_S)
    assert ledger.pending_ids() == set()


def test_a_reopened_ledger_says_where_its_own_ids_begin() -> None:
    ledger = Ledger()
    assert ledger.first_own_id == 1
    ledger.skip_ids(41)
    assert (ledger.first_own_id, ledger.next_id()) == (42, 42)
