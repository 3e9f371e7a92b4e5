"""The queue's pure core against a plain sorted-list model, plus examples."""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

import pytest
from callboard.core.pqueue import COMPACT_SLACK, QueueFull, TaskQueue
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

MODELS = ("a", "b", "c")
KEYS = st.integers(0, 40)
CANDIDATES = st.sets(st.sampled_from(MODELS), min_size=1, max_size=3)
PRIORITIES = st.integers(0, 3)
PUSH = st.tuples(
    KEYS,
    PRIORITIES,
    CANDIDATES,
    st.sampled_from([0.0, 0.0, 0.25, 1.0, 5.0]),  # arrival lag behind now
    st.none() | st.sampled_from([-1.0, 0.0, 0.25, 1.0, 2.0, 5.0, 10.0]),  # deadline from now
)


# -- the reference model ------------------------------------------------------


@dataclass
class Ref:
    """One waiting item as the reference model sees it."""

    item: str
    priority: int
    candidates: frozenset[str]
    arrival: float
    deadline: float | None
    seq: int


def ref_order(ref: Ref, aging_step_s: float | None, epoch: float) -> tuple[int, float, int]:
    """The documented order: (priority aged by whole steps, deadline, push order)."""
    waited = 0 if aging_step_s is None else math.floor((ref.arrival - epoch) / aging_step_s)
    deadline = math.inf if ref.deadline is None else ref.deadline
    return (ref.priority + waited, deadline, ref.seq)


def cannot_make_it(ref: Ref, now: float, min_remaining_s: float) -> bool:
    return ref.deadline is not None and (
        ref.deadline <= now or ref.deadline - now < min_remaining_s
    )


class QueueMachine(RuleBasedStateMachine):
    """Drive a TaskQueue and a plain dict of Refs side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: TaskQueue[str] = TaskQueue(capacity=1)
        self.refs: dict[int, Ref] = {}
        self.aging_step_s: float | None = None
        self.epoch = 0.0
        self.now = 0.0
        self.pushes = 0

    @initialize(
        capacity=st.sampled_from([20, 5, 1000, 1]),  # the first is the most drawn
        aging_step_s=st.sampled_from([None, 1.0, 2.5]),
        epoch=st.sampled_from([0.0, 0.3, -5.0]),
    )
    def start(self, capacity: int, aging_step_s: float | None, epoch: float) -> None:
        self.queue = TaskQueue(capacity=capacity, aging_step_s=aging_step_s, epoch=epoch)
        self.aging_step_s = aging_step_s
        self.epoch = epoch

    def snapshot(self) -> tuple[object, ...]:
        q = self.queue
        lanes = {m: sorted(q.items_for(m)) for m in MODELS}
        return (len(q), lanes, q.statistics(), q.next_deadline())

    def sorted_refs(self, model: str) -> list[tuple[int, Ref]]:
        eligible = [(k, r) for k, r in self.refs.items() if model in r.candidates]
        return sorted(eligible, key=lambda kr: ref_order(kr[1], self.aging_step_s, self.epoch))

    @rule(dt=st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(pushes=st.lists(PUSH, min_size=1, max_size=6))
    def push(self, pushes: list[tuple[int, int, set[str], float, float | None]]) -> None:
        for key, priority, candidates, lag, deadline_in in pushes:
            self.push_one(key, priority, candidates, lag, deadline_in)

    def push_one(
        self, key: int, priority: int, candidates: set[str], lag: float, deadline_in: float | None
    ) -> None:
        item = f"item{self.pushes}"
        self.pushes += 1
        arrival = self.now - lag  # a re-queued task keeps its original arrival
        deadline = None if deadline_in is None else self.now + deadline_in
        before = self.snapshot()

        def push() -> None:
            self.queue.push(
                key,
                item,
                priority=priority,
                candidates=candidates,
                arrival=arrival,
                deadline=deadline,
            )

        if key in self.refs:
            with pytest.raises(ValueError, match="already waiting"):
                push()
            assert self.snapshot() == before
        elif len(self.refs) >= self.queue.statistics().capacity:
            with pytest.raises(QueueFull, match=f"capacity {self.queue.statistics().capacity}"):
                push()
            assert self.snapshot() == before
        else:
            push()
            ref = Ref(item, priority, frozenset(candidates), arrival, deadline, self.pushes)
            self.refs[key] = ref

    def pick_key(self, data: st.DataObject) -> int:
        """Mostly a waiting key (live keys come first when shrinking), sometimes any."""
        if not self.refs:
            return data.draw(KEYS)
        return data.draw(st.sampled_from(sorted(self.refs)) | KEYS)

    @rule(
        model=st.sampled_from(MODELS),
        n=st.sampled_from([1, 2, 4, 0]),
        min_remaining_s=st.sampled_from([0.0, 0.0, 0.5, 2.0]),
    )
    def pop_for(self, model: str, n: int, min_remaining_s: float) -> None:
        taken: list[str] = []
        skipped: list[str] = []
        for key, ref in self.sorted_refs(model):
            if len(taken) == n:
                break
            del self.refs[key]
            (skipped if cannot_make_it(ref, self.now, min_remaining_s) else taken).append(ref.item)
        got = self.queue.pop_for(model, self.now, n, min_remaining_s=min_remaining_s)
        assert got == (taken, skipped)
        # Work conservation, stated on its own: a credit goes unused only if
        # nothing servable may go to the model.
        if len(taken) < n:
            assert not any(
                not cannot_make_it(r, self.now, min_remaining_s) for _, r in self.sorted_refs(model)
            )

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        key = self.pick_key(data)
        ref = self.refs.pop(key, None)
        assert self.queue.cancel(key) == (None if ref is None else ref.item)

    @rule()
    def expire(self) -> None:
        due = [
            (k, r)
            for k, r in self.refs.items()
            if r.deadline is not None and r.deadline <= self.now
        ]
        due.sort(key=lambda kr: (kr[1].deadline, kr[1].seq))
        for key, _ in due:
            del self.refs[key]
        assert self.queue.expire(self.now) == [r.item for _, r in due]

    @rule(data=st.data(), candidates=CANDIDATES)
    def retarget(self, data: st.DataObject, candidates: set[str]) -> None:
        key = self.pick_key(data)
        ref = self.refs.get(key)
        changed = ref is not None and ref.candidates != frozenset(candidates)
        assert self.queue.retarget(key, candidates) == changed
        if ref is not None:
            ref.candidates = frozenset(candidates)

    @precondition(lambda self: len(self.refs) >= 8)  # rarely: it empties everything
    @rule()
    def clear(self) -> None:
        assert self.queue.clear() == [r.item for r in self.refs.values()]
        self.refs.clear()

    @invariant()
    def agrees_with_reference(self) -> None:
        q = self.queue
        assert len(q) == len(self.refs) <= q.statistics().capacity
        for key in range(41):
            assert (key in q) == (key in self.refs)
        for model in (*MODELS, "unknown"):
            mine = [r.item for r in self.refs.values() if model in r.candidates]
            assert q.waiting_for(model) == len(mine)
            assert sorted(q.items_for(model)) == sorted(mine)
        # push order, which nothing reads without taking the items, is checked by ``clear``
        deadlines = [r.deadline for r in self.refs.values() if r.deadline is not None]
        assert q.next_deadline() == (min(deadlines) if deadlines else None)

    @invariant()
    def memory_is_bounded(self) -> None:
        stats = self.queue.statistics()
        live_entries = sum(len(r.candidates) for r in self.refs.values())
        assert stats.heap_entries <= 2 * live_entries + COMPACT_SLACK * stats.models
        assert stats.models == len({m for r in self.refs.values() for m in r.candidates})
        assert stats.deadline_entries <= 2 * stats.with_deadline + COMPACT_SLACK


QueueMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestQueueMachine = QueueMachine.TestCase


# -- aging ----------------------------------------------------------------------


def grid(ticks: int) -> float:
    """Times on a 1/64 s grid, exact in binary floating point."""
    return ticks / 64


@settings(max_examples=300, deadline=None)
@given(
    t0=st.integers(-64_000, 64_000).map(grid),
    low_deadline=st.none() | st.integers(0, 6400).map(grid),
    others=st.lists(
        st.tuples(
            PRIORITIES,
            st.integers(-640, 3200).map(grid),  # arrival offset from t0
            st.none() | st.integers(0, 6400).map(grid),  # deadline offset from t0
            CANDIDATES,
        ),
        max_size=30,
    ),
)
def test_low_task_precedes_every_task_pushed_4_steps_later(
    t0: float,
    low_deadline: float | None,
    others: list[tuple[int, float, float | None, set[str]]],
) -> None:
    step = 1.0
    q: TaskQueue[str] = TaskQueue(capacity=64, aging_step_s=step)
    pushes = [(0.0, -1, 3, low_deadline, {"a"})]  # the LOW task; -1 sorts it first at ties
    pushes += [(off, i, p, dl, {"a"} | c) for i, (p, off, dl, c) in enumerate(others)]
    late = set()
    for off, i, priority, dl, cands in sorted(pushes, key=lambda p: (p[0], p[1])):
        name = "low" if i < 0 else f"other{i}"
        deadline = None if dl is None else t0 + dl
        q.push(i, name, priority=priority, candidates=cands, arrival=t0 + off, deadline=deadline)
        if off >= 4 * step:
            late.add(name)
    taken, skipped = q.pop_for("a", now=t0 - 100.0, n=len(pushes))
    assert skipped == []
    assert len(taken) == len(pushes)
    assert all(taken.index("low") < taken.index(name) for name in late)


def test_aging_bound_is_tight_in_the_worst_window_alignment() -> None:
    # LOW at the start of a window: a CRITICAL task with a deadline still
    # overtakes it 3.5 steps later (same rank, earlier deadline) ...
    q: TaskQueue[str] = TaskQueue(capacity=8, aging_step_s=1.0)
    q.push(1, "low", priority=3, candidates=["a"], arrival=0.0)
    q.push(2, "critical", priority=0, candidates=["a"], arrival=3.5, deadline=100.0)
    assert q.pop_for("a", now=0.0, n=2) == (["critical", "low"], [])
    # ... and without a deadline the tie goes to the earlier arrival.
    q.push(1, "low", priority=3, candidates=["a"], arrival=0.0)
    q.push(2, "critical", priority=0, candidates=["a"], arrival=3.99)
    assert q.pop_for("a", now=0.0, n=2) == (["low", "critical"], [])
    # LOW at the end of a window: overtaken at +3.0, never from +3.01 (the next window).
    q.push(1, "low", priority=3, candidates=["a"], arrival=0.99)
    q.push(2, "critical", priority=0, candidates=["a"], arrival=3.99, deadline=100.0)
    q.push(3, "too late", priority=0, candidates=["a"], arrival=4.0, deadline=1.0)
    assert q.pop_for("a", now=0.0, n=3) == (["critical", "low", "too late"], [])


def test_within_one_window_order_is_priority_then_deadline_then_fifo() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=8, aging_step_s=10.0)
    q.push(1, "normal", priority=2, candidates=["a"], arrival=0.0)
    q.push(2, "high-late", priority=1, candidates=["a"], arrival=1.0, deadline=90.0)
    q.push(3, "high-none", priority=1, candidates=["a"], arrival=2.0)
    q.push(4, "high-soon", priority=1, candidates=["a"], arrival=3.0, deadline=50.0)
    q.push(5, "high-late-2", priority=1, candidates=["a"], arrival=4.0, deadline=90.0)
    q.push(6, "critical", priority=0, candidates=["a"], arrival=9.9)
    assert q.pop_for("a", now=5.0, n=9)[0] == [
        "critical",
        "high-soon",
        "high-late",
        "high-late-2",
        "high-none",
        "normal",
    ]


def test_without_aging_old_low_tasks_wait_for_any_newer_higher_priority() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=8, aging_step_s=None)
    q.push(1, "low", priority=3, candidates=["a"], arrival=0.0)
    q.push(2, "high", priority=1, candidates=["a"], arrival=1e6)
    assert q.pop_for("a", now=1e6, n=2) == (["high", "low"], [])


# -- examples -------------------------------------------------------------------


def test_an_item_with_two_candidates_goes_to_whichever_asks_first() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=8)
    q.push(1, "both", priority=2, candidates=("a", "b"), arrival=0.0)
    q.push(2, "b only", priority=3, candidates=("b",), arrival=0.0)
    assert (q.waiting_for("a"), q.waiting_for("b")) == (1, 2)
    assert q.pop_for("a", now=1.0, n=5) == (["both"], [])
    assert (q.waiting_for("a"), q.waiting_for("b")) == (0, 1)
    assert q.pop_for("b", now=1.0, n=5) == (["b only"], [])
    assert q.statistics().heap_entries == 0


def test_pop_for_drops_items_that_cannot_meet_their_deadline() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=8, aging_step_s=None)
    q.push(1, "passed", priority=0, candidates=["a"], arrival=0.0, deadline=5.0)
    q.push(2, "at now", priority=0, candidates=["a"], arrival=0.0, deadline=10.0)
    q.push(3, "too close", priority=0, candidates=["a"], arrival=0.0, deadline=10.5)
    q.push(4, "fine", priority=1, candidates=["a"], arrival=0.0, deadline=60.0)
    q.push(5, "next", priority=2, candidates=["a"], arrival=0.0)
    assert q.pop_for("a", now=10.0, n=1, min_remaining_s=1.0) == (
        ["fine"],
        ["passed", "at now", "too close"],
    )
    assert (len(q), q.items_for("a")) == (1, ["next"])
    assert q.next_deadline() is None


def test_expire_removes_due_items_in_deadline_order_and_moves_the_timer() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=8)
    q.push(1, "t3", priority=0, candidates=["a"], arrival=0.0, deadline=3.0)
    q.push(2, "t1", priority=3, candidates=["b"], arrival=0.0, deadline=1.0)
    q.push(3, "none", priority=3, candidates=["b"], arrival=0.0)
    q.push(4, "t2", priority=1, candidates=["a", "b"], arrival=0.0, deadline=2.0)
    q.push(5, "inf", priority=1, candidates=["a"], arrival=0.0, deadline=math.inf)
    assert q.next_deadline() == 1.0
    assert q.cancel(2) == "t1"
    assert q.next_deadline() == 2.0
    assert q.expire(2.5) == ["t2"]
    assert q.expire(2.5) == []
    assert q.next_deadline() == 3.0
    assert q.expire(1e9) == ["t3"]
    assert q.next_deadline() is None
    assert (len(q), q.items_for("a"), q.items_for("b")) == (2, ["inf"], ["none"])


def test_retarget_keeps_the_place_in_order() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=8, aging_step_s=None)
    q.push(1, "first", priority=1, candidates=["broken"], arrival=0.0)
    q.push(2, "second", priority=1, candidates=["fallback"], arrival=1.0)
    assert q.retarget(1, ["fallback"])
    assert not q.retarget(1, ["fallback"])  # nothing changed
    assert q.retarget(1, ["fallback", "other"])
    assert not q.retarget(1, ["other", "fallback"])  # the same models: nothing changed
    assert q.retarget(1, ["fallback"])
    assert q.items_for("broken") == []
    assert sorted(q.items_for("fallback")) == ["first", "second"]
    assert q.pop_for("broken", now=2.0) == ([], [])
    assert q.pop_for("fallback", now=2.0, n=2) == (["first", "second"], [])
    assert not q.retarget(1, ["broken"])  # no longer waiting


def test_a_model_that_comes_back_gets_its_items_back_in_their_order() -> None:
    # What the queue actor does when a breaker opens and closes again: the items of the
    # model's lane are placed on the fallback too, then on the model alone.
    q: TaskQueue[str] = TaskQueue(capacity=8, aging_step_s=None)
    for key, name in enumerate(["a1", "a2", "a3"]):
        q.push(key, name, priority=2, candidates=("a",), arrival=float(key))
    q.push(9, "b-only", priority=2, candidates=("b",), arrival=0.5)
    for key in range(3):
        assert q.retarget(key, ("a", "b"))  # a is down: b may take them
    assert q.pop_for("b", now=5.0) == (["a1"], [])
    assert sorted(q.items_for("a")) == ["a2", "a3"]
    for key in (1, 2):
        assert q.retarget(key, ("a",))  # a is back
    assert q.pop_for("b", now=5.0, n=3) == (["b-only"], [])
    assert q.pop_for("a", now=5.0, n=3) == (["a2", "a3"], [])


def test_full_queue_rejects_with_a_typed_error_and_keeps_its_items() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=2)
    q.push(1, "x", priority=0, candidates=["a"], arrival=0.0)
    q.push(2, "y", priority=0, candidates=["a"], arrival=0.0)
    with pytest.raises(QueueFull, match="capacity 2") as info:
        q.push(3, "z", priority=0, candidates=["a"], arrival=0.0)
    assert info.value.capacity == 2
    again = pickle.loads(pickle.dumps(info.value))  # noqa: S301 - our own bytes, round-tripped
    assert (type(again), again.capacity, str(again)) == (QueueFull, 2, str(info.value))
    assert (len(q), sorted(q.items_for("a"))) == (2, ["x", "y"])
    assert 3 not in q
    assert q.cancel(1) == "x"
    q.push(3, "z", priority=0, candidates=["a"], arrival=0.0)  # room again
    assert len(q) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"candidates": "ab"}, TypeError, "collection of model names"),
        ({"candidates": ()}, ValueError, "at least one model"),
        ({"arrival": math.nan}, ValueError, "arrival must be finite"),
        ({"arrival": math.inf}, ValueError, "arrival must be finite"),
        ({"deadline": math.nan}, ValueError, "NaN"),
    ],
)
def test_bad_push_is_refused_and_changes_nothing(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    q: TaskQueue[str] = TaskQueue(capacity=4)
    push: dict[str, Any] = {"priority": 0, "candidates": ["a"], "arrival": 0.0, **kwargs}
    with pytest.raises(error, match=match):
        q.push(1, "x", **push)
    assert (len(q), q.statistics().heap_entries, q.next_deadline()) == (0, 0, None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 0},
        {"capacity": 1, "aging_step_s": 0.0},
        {"capacity": 1, "aging_step_s": math.inf},
        {"capacity": 1, "epoch": math.nan},
    ],
)
def test_bad_configuration_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be"):
        TaskQueue(**kwargs)


def test_pop_for_with_no_credit_or_unknown_model_takes_nothing() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=4)
    q.push(1, "x", priority=0, candidates=["a"], arrival=0.0)
    assert q.pop_for("a", now=0.0, n=0) == ([], [])
    assert q.pop_for("zzz", now=0.0, n=3) == ([], [])
    with pytest.raises(ValueError, match="negative"):
        q.pop_for("a", now=0.0, n=-1)
    assert len(q) == 1


def test_duplicate_candidates_count_once() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=4)
    q.push(1, "x", priority=0, candidates=["a", "a", "b"], arrival=0.0)
    assert (q.waiting_for("a"), q.statistics().heap_entries) == (1, 2)


def test_churn_compacts_heaps_so_memory_follows_the_live_items() -> None:
    q: TaskQueue[int] = TaskQueue(capacity=100)
    for key in range(50):  # long-lived items on "a" and "b"
        q.push(key, key, priority=3, candidates=("a", "b"), arrival=0.0, deadline=1e9)
    for key in range(50, 20_050):  # each popped from "a" leaves a stale entry in "b"
        q.push(key, key, priority=0, candidates=("a", "b"), arrival=1.0, deadline=1e9)
        assert q.pop_for("a", now=1.0) == ([key], [])
        q.push(-key, -key, priority=0, candidates=("b", "c"), arrival=1.0, deadline=1e9)
        assert q.cancel(-key) == -key
        assert q.retarget(key % 50, ("b",) if (key // 50) % 2 else ("a", "b"))
    stats = q.statistics()
    assert (stats.waiting, stats.models) == (50, 2)
    assert stats.heap_entries <= 2 * 100 + 2 * COMPACT_SLACK
    assert stats.deadline_entries <= 2 * 50 + COMPACT_SLACK
    assert q.pop_for("b", now=2.0, n=100)[0] == list(range(50))


def test_popping_past_stale_entries_compacts_the_heap_it_pops() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=100)
    for key in range(40):  # on "a" and "b", at the bottom of "a"
        q.push(key, f"low{key}", priority=3, candidates=("a", "b"), arrival=0.0)
    for key in range(40, 80):  # on "a" only, at its top
        q.push(key, f"top{key}", priority=0, candidates=("a",), arrival=0.0)
    assert len(q.pop_for("b", now=0.0, n=40)[0]) == 40  # 40 stale entries left in "a"
    assert len(q.pop_for("a", now=0.0, n=39)[0]) == 39  # 1 live entry left in "a"
    stats = q.statistics()
    assert (stats.waiting, stats.models) == (1, 1)
    assert stats.heap_entries <= 2 * 1 + COMPACT_SLACK


def test_a_deadline_equal_to_now_is_expired_not_dispatched() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=4)
    q.push(1, "due", priority=0, candidates=["a"], arrival=0.0, deadline=5.0)
    q.push(2, "in time", priority=1, candidates=["a"], arrival=0.0, deadline=5.5)
    assert q.pop_for("a", now=5.0) == (["in time"], ["due"])
    q.push(3, "due too", priority=0, candidates=["a"], arrival=0.0, deadline=5.0)
    assert q.expire(5.0) == ["due too"]


def test_clear_returns_everything_in_push_order_and_resets() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=4)
    for key, name in enumerate("xyz"):
        q.push(key, name, priority=3 - key, candidates=["a"], arrival=0.0, deadline=5.0)
    assert q.clear() == ["x", "y", "z"]
    assert (len(q), q.next_deadline(), q.waiting_for("a")) == (0, None, 0)
    assert q.statistics().heap_entries == q.statistics().deadline_entries == 0
    q.push(0, "again", priority=0, candidates=["a"], arrival=1.0)
    assert q.pop_for("a", now=1.0) == (["again"], [])


def test_repr_shows_sizes_not_items() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=4)
    q.push(1, "sk-secret", priority=0, candidates=["a"], arrival=0.0)
    assert "secret" not in repr(q)
    assert "waiting=1" in repr(q)
