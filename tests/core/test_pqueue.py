"""The queue's pure core against a plain reference model of the documented turns
(static order, levels, start-time fair queuing between tenants), plus examples and
the fairness bounds the module docstring proves."""

from __future__ import annotations

import heapq
import itertools
import math
import pickle
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    st.integers(0, 2),  # the tenant, an index into the run's tenants
    st.sampled_from([1, 1, 3, 250, 0.5]),  # cost
)
TENANT_SETS: list[tuple[str | None, ...]] = [
    (None,),
    (None, "t1"),
    ("t1", "t2", "t3"),
    ("t1", "t2"),
]
WEIGHTS: list[dict[str, float]] = [{}, {"t1": 3.0, "t2": 0.5}]


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
    tenant: str | None = None
    cost: float = 1.0


def ref_order(ref: Ref, aging_step_s: float | None, epoch: float) -> tuple[int, float, int]:
    """The documented aged order: (priority aged by whole steps, deadline, push order).
    Within one priority it is the static order."""
    waited = 0 if aging_step_s is None else math.floor((ref.arrival - epoch) / aging_step_s)
    deadline = math.inf if ref.deadline is None else ref.deadline
    return (ref.priority + waited, deadline, ref.seq)


def cannot_make_it(ref: Ref, now: float, min_remaining_s: float) -> bool:
    return ref.deadline is not None and (
        ref.deadline <= now or ref.deadline - now < min_remaining_s
    )


@dataclass
class RefLevel:
    """One priority of a shared model: V, and each waiting tenant's [S, activation]."""

    vtime: float = 0.0
    activations: int = 0
    starts: dict[str | None, list[float]] = field(default_factory=dict)
    charged: dict[str | None, float] = field(default_factory=dict)
    """What each waiting tenant's items sent were charged, less refunds."""

    def activate(self, tenant: str | None) -> None:
        if tenant not in self.starts:  # a tenant that begins waiting starts at S = V
            self.starts[tenant] = [self.vtime, self.activations]
            self.activations += 1


@dataclass
class RefLane:
    """What the reference keeps per model with waiting items: whether its items were
    of more than one tenant since it last had none, and then its levels."""

    shared: bool = False
    levels: dict[int, RefLevel] = field(default_factory=dict)
    credit: float = 0.0
    """Aged turns earned: ``aging_share`` for each turn the aged order's first item
    is of a less urgent level than the first waiting one."""

    def activate(self, ref: Ref) -> None:
        self.levels.setdefault(ref.priority, RefLevel()).activate(ref.tenant)


class QueueMachine(RuleBasedStateMachine):
    """Drive a TaskQueue and a plain dict of Refs side by side; the reference takes
    turns by the module docstring's rules, by scanning."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: TaskQueue[str] = TaskQueue(capacity=1)
        self.refs: dict[int, Ref] = {}
        self.lanes: dict[str, RefLane] = {}
        self.aging_step_s: float | None = None
        self.aging_share = 0.1
        self.epoch = 0.0
        self.now = 0.0
        self.pushes = 0
        self.tenants: tuple[str | None, ...] = (None,)
        self.weights: dict[str, float] = {}
        self.narrow = False
        """Every item may go to model "a" alone: one lane, contended."""

    @initialize(
        capacity=st.sampled_from([20, 5, 1000, 1]),  # the first is the most drawn
        aging_step_s=st.sampled_from([None, 1.0, 2.5]),
        aging_share=st.sampled_from([0.1, 1.0, 0.5, 0.3]),
        epoch=st.sampled_from([0.0, 0.3, -5.0]),
        tenants=st.sampled_from(TENANT_SETS),
        weights=st.sampled_from(WEIGHTS),
        narrow=st.booleans(),
    )
    def start(
        self,
        *,
        capacity: int,
        aging_step_s: float | None,
        aging_share: float,
        epoch: float,
        tenants: tuple[str | None, ...],
        weights: dict[str, float],
        narrow: bool,
    ) -> None:
        self.queue = TaskQueue(
            capacity=capacity,
            aging_step_s=aging_step_s,
            aging_share=aging_share,
            epoch=epoch,
            tenant_weights=weights,
        )
        self.aging_step_s = aging_step_s
        self.aging_share = aging_share
        self.epoch = epoch
        self.tenants = tenants
        self.weights = weights
        self.narrow = narrow

    # -- the reference's turns ----------------------------------------------------

    def order(self, ref: Ref) -> tuple[int, float, int]:
        return ref_order(ref, self.aging_step_s, self.epoch)

    def refs_for(self, model: str) -> list[tuple[int, Ref]]:
        return [(k, r) for k, r in self.refs.items() if model in r.candidates]

    def weight(self, tenant: str | None) -> float:
        return 1.0 if tenant is None else self.weights.get(tenant, 1.0)

    def enter(self, model: str, key: int, ref: Ref) -> None:
        """``ref`` (already in ``refs``) now may go to ``model``."""
        others = [r for k, r in self.refs_for(model) if k != key]
        lane = self.lanes.get(model)
        if lane is None:
            assert not others
            lane = self.lanes[model] = RefLane()
        elif not lane.shared and any(r.tenant != ref.tenant for r in others):
            lane.shared = True  # a second tenant: it begins first, the waiting ones after
            lane.activate(ref)  # it, in push order
            for r in sorted(others, key=lambda r: r.seq):
                lane.activate(r)
        if lane.shared:
            lane.activate(ref)

    def leave(self, model: str, ref: Ref) -> None:
        """``ref`` (already out of ``refs``, or no longer for ``model``) left ``model``
        without being taken there: a tenant or level left with nothing is forgotten."""
        remaining = [r for _, r in self.refs_for(model)]
        if not remaining:
            del self.lanes[model]
            return
        lane = self.lanes[model]
        if lane.shared:
            self.forget_if_gone(lane, ref, remaining)

    @staticmethod
    def forget_if_gone(lane: RefLane, ref: Ref, remaining: list[Ref]) -> None:
        level = lane.levels[ref.priority]
        if not any(r.priority == ref.priority and r.tenant == ref.tenant for r in remaining):
            del level.starts[ref.tenant]
            level.charged.pop(ref.tenant, None)
        if not any(r.priority == ref.priority for r in remaining):
            del lane.levels[ref.priority]

    def turn(self, model: str) -> tuple[int, Ref, float | None]:
        """The key and item whose turn it is at ``model``, and its tenant's S (None when
        the model's items are all of one tenant)."""
        eligible = self.refs_for(model)
        lane = self.lanes[model]
        top = min(r.priority for _, r in eligible)
        _, first = min(eligible, key=lambda kr: self.order(kr[1]))
        chosen = top
        if first.priority != top:  # aged past a more urgent level: a share of turns
            lane.credit += self.aging_share
            if lane.credit >= 1.0 - 1e-9:
                lane.credit -= 1.0
                chosen = first.priority
        eligible = [(k, r) for k, r in eligible if r.priority == chosen]
        if not lane.shared:
            return (*min(eligible, key=lambda kr: self.order(kr[1])), None)
        level = lane.levels[chosen]
        tenant = min(level.starts, key=lambda t: tuple(level.starts[t]))
        mine = [(k, r) for k, r in eligible if r.tenant == tenant]
        key, ref = min(mine, key=lambda kr: self.order(kr[1]))
        return key, ref, level.starts[tenant][0]

    def take(self, model: str, now: float, min_remaining_s: float) -> tuple[Ref, bool]:
        """Take the turn at ``model``: the item, and whether it cannot make its deadline."""
        key, ref, start = self.turn(model)
        del self.refs[key]
        for other in ref.candidates - {model}:
            self.leave(other, ref)
        late = cannot_make_it(ref, now, min_remaining_s)
        remaining = [r for _, r in self.refs_for(model)]
        if not remaining:
            del self.lanes[model]
            return ref, late
        lane = self.lanes[model]
        if start is not None:
            level = lane.levels[ref.priority]
            if not late:  # sent: V is its S, and its tenant's S grows by cost / weight
                level.vtime = start
                level.starts[ref.tenant][0] = start + ref.cost / self.weight(ref.tenant)
                level.charged[ref.tenant] = level.charged.get(ref.tenant, 0.0) + ref.cost
            self.forget_if_gone(lane, ref, remaining)
        return ref, late

    # -- rules --------------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        q = self.queue
        lanes = {m: sorted(q.items_for(m)) for m in MODELS}
        return (len(q), lanes, q.statistics(), q.next_deadline())

    @rule(dt=st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(pushes=st.lists(PUSH, min_size=1, max_size=10))
    def push(
        self, pushes: list[tuple[int, int, set[str], float, float | None, int, float]]
    ) -> None:
        for key, priority, candidates, lag, deadline_in, tenant, cost in pushes:
            self.push_one(
                key,
                priority,
                {"a"} if self.narrow else candidates,
                lag=lag,
                deadline_in=deadline_in,
                tenant=self.tenants[tenant % len(self.tenants)],
                cost=cost,
            )

    def push_one(
        self,
        key: int,
        priority: int,
        candidates: set[str],
        *,
        lag: float,
        deadline_in: float | None,
        tenant: str | None,
        cost: float,
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
                tenant=tenant,
                cost=cost,
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
            ref = Ref(
                item, priority, frozenset(candidates), arrival, deadline, self.pushes, tenant, cost
            )
            self.refs[key] = ref
            for model in ref.candidates:
                self.enter(model, key, ref)

    def pick_key(self, data: st.DataObject) -> int:
        """Mostly a waiting key (live keys come first when shrinking), sometimes any."""
        if not self.refs:
            return data.draw(KEYS)
        return data.draw(st.sampled_from(sorted(self.refs)) | KEYS)

    @rule(
        model=st.sampled_from(MODELS),
        n=st.sampled_from([1, 2, 4, 8, 0]),
        min_remaining_s=st.sampled_from([0.0, 0.0, 0.5, 2.0]),
    )
    def pop_for(self, model: str, n: int, min_remaining_s: float) -> None:
        taken: list[str] = []
        skipped: list[str] = []
        while len(taken) < n and self.refs_for(model):
            ref, late = self.take(model, self.now, min_remaining_s)
            (skipped if late else taken).append(ref.item)
        got = self.queue.pop_for(model, self.now, n, min_remaining_s=min_remaining_s)
        assert got == (taken, skipped)
        # Work conservation, stated on its own: a credit goes unused only if
        # nothing servable may go to the model.
        if len(taken) < n:
            assert not any(
                not cannot_make_it(r, self.now, min_remaining_s) for _, r in self.refs_for(model)
            )

    def remove(self, key: int) -> Ref | None:
        ref = self.refs.pop(key, None)
        if ref is not None:
            for model in ref.candidates:
                self.leave(model, ref)
        return ref

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        key = self.pick_key(data)
        ref = self.remove(key)
        assert self.queue.cancel(key) == (None if ref is None else ref.item)

    @rule(
        model=st.sampled_from(MODELS),
        priority=PRIORITIES,
        tenant=st.integers(0, 2),
        over=st.sampled_from([0, 5, 249, 1000, -3, 0.5]),
    )
    def settle(self, model: str, priority: int, tenant: int, over: float) -> None:
        """An item's call used ``over`` tokens fewer than it was charged: if its tenant
        still waits there, its S moves back by ``over / weight``, never below V."""
        who = self.tenants[tenant % len(self.tenants)]
        lane = self.lanes.get(model)
        level = None if lane is None or not lane.shared else lane.levels.get(priority)
        if level is not None and who in level.starts:
            start = level.starts[who]
            start[0] = max(level.vtime, start[0] - over / self.weight(who))
        self.queue.settle(model, [(priority, who, over)])

    @rule(
        model=st.sampled_from(MODELS),
        priority=PRIORITIES,
        tenant=st.integers(0, 2),
        cost=st.sampled_from([1.0, 5, 250, 10_000]),
        aged=st.sampled_from([0, 0, 1]),
    )
    def refund(self, model: str, priority: int, tenant: int, cost: float, aged: int) -> None:
        """An item taken came back unsent: its tenant's charge is undone (as much as it
        still carries), S below V if need be and V with it; an aged turn is owed."""
        who = self.tenants[tenant % len(self.tenants)]
        lane = self.lanes.get(model)
        if lane is not None:
            lane.credit += aged
        level = None if lane is None or not lane.shared else lane.levels.get(priority)
        if level is not None and who in level.starts:
            back = min(cost, level.charged.get(who, 0.0))
            level.charged[who] = level.charged.get(who, 0.0) - back
            start = level.starts[who]
            start[0] -= back / self.weight(who)
            level.vtime = min(level.vtime, start[0])
        self.queue.refund(model, [(priority, who, cost)], aged)

    @rule()
    def expire(self) -> None:
        due = [
            (k, r)
            for k, r in self.refs.items()
            if r.deadline is not None and r.deadline <= self.now
        ]
        due.sort(key=lambda kr: (kr[1].deadline, kr[1].seq))
        for key, _ in due:
            self.remove(key)
        assert self.queue.expire(self.now) == [r.item for _, r in due]

    @rule(data=st.data(), candidates=CANDIDATES)
    def retarget(self, data: st.DataObject, candidates: set[str]) -> None:
        key = self.pick_key(data)
        ref = self.refs.get(key)
        changed = ref is not None and ref.candidates != frozenset(candidates)
        assert self.queue.retarget(key, candidates) == changed
        if ref is not None and changed:
            old, ref.candidates = ref.candidates, frozenset(candidates)
            for model in ref.candidates - old:
                self.enter(model, key, ref)
            for model in old - ref.candidates:
                self.leave(model, ref)

    @precondition(lambda self: len(self.refs) >= 8)  # rarely: it empties everything
    @rule()
    def clear(self) -> None:
        assert self.queue.clear() == [r.item for r in self.refs.values()]
        self.refs.clear()
        self.lanes.clear()

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
        assert q.statistics().shared_models == sum(lane.shared for lane in self.lanes.values())

    @invariant()
    def memory_is_bounded(self) -> None:
        stats = self.queue.statistics()
        live_entries = sum(len(r.candidates) for r in self.refs.values())
        assert stats.heap_entries <= 2 * live_entries + COMPACT_SLACK * stats.models
        assert stats.models == len({m for r in self.refs.values() for m in r.candidates})
        assert stats.deadline_entries <= 2 * stats.with_deadline + COMPACT_SLACK
        assert_shared_lanes_hold(self.queue)


def assert_shared_lanes_hold(q: TaskQueue[Any]) -> None:
    """The invariants ``_Level`` states, read from the queue's own lanes (a read-only
    look inside: no public reading shows the turn bookkeeping)."""
    live = q._live
    for lane in q._lanes.values():
        if not hasattr(lane, "weights"):  # a solo lane: every live entry is of its one
            for priority, ranked in lane.levels.items():  # tenant, in its level
                assert {e[6] for e in ranked.live_entries(live)} <= {priority}
            assert {e[7] for e in lane.live_entries(live)} <= {lane.tenant}
            continue
        for priority, level in lane.levels.items():
            entries = [e for f in level.flows.values() for e in f.live_entries(live)]
            assert level.live == len(entries) > 0
            assert {e[6] for e in entries} == {priority}
            for tenant, flow in level.flows.items():
                assert flow.tenant == tenant
                assert flow.live == sum(e[7] == tenant for e in entries) > 0
                assert flow.start >= level.vtime
            current = {id(f) for f in level.flows.values()}
            # each waiting flow has a record of its S (others: superseded by settling;
            # one settled back to an S it had holds two, either of which may be met)
            records = {id(f) for s, _, f in level.turns if id(f) in current and s == f.start}
            assert records == current
            assert len(level.turns) <= 2 * len(level.flows) + COMPACT_SLACK + 1
            assert len(level.heads) <= 2 * len(level.flows) + COMPACT_SLACK


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
    """With every aged turn granted (``aging_share=1``) the turns follow the aged order."""
    step = 1.0
    q: TaskQueue[str] = TaskQueue(capacity=64, aging_step_s=step, aging_share=1.0)
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
    q: TaskQueue[str] = TaskQueue(capacity=8, aging_step_s=1.0, aging_share=1.0)
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


def test_an_item_pushed_again_keeps_its_place_among_those_that_came_after_it() -> None:
    """A job a model hands back (its limiter said wait, its breaker opened) is pushed
    again: by push order it went behind every task that came after it (the 44th task
    was sent 59th; found by a hunt). Its ``order`` keeps its seniority."""
    q: TaskQueue[str] = TaskQueue(capacity=8, aging_step_s=10.0)
    for i, name in enumerate(["first", "second", "third"]):
        q.push(i, name, priority=2, candidates=["a"], arrival=float(i), order=i)
    assert q.pop_for("a", now=3.0, n=1)[0] == ["first"]
    q.push(0, "first", priority=2, candidates=["a"], arrival=0.0, order=0)  # handed back
    q.push(3, "fourth", priority=2, candidates=["a"], arrival=3.5, order=3)
    assert q.pop_for("a", now=4.0, n=9)[0] == ["first", "second", "third", "fourth"]
    with pytest.raises(ValueError, match="order must be an int >= 0"):
        q.push(9, "x", priority=2, candidates=["a"], arrival=5.0, order=-1)


def test_without_aging_old_low_tasks_wait_for_any_newer_higher_priority() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=8, aging_step_s=None)
    q.push(1, "low", priority=3, candidates=["a"], arrival=0.0)
    q.push(2, "high", priority=1, candidates=["a"], arrival=1e6)
    assert q.pop_for("a", now=1e6, n=2) == (["high", "low"], [])


# -- tenants: fair queuing within a level ------------------------------------------------

FAIR_WEIGHTS = st.sampled_from([0.25, 0.5, 1.0, 3.0, 20.0])
COSTS = st.integers(1, 100_000)


def push_all(
    q: TaskQueue[int],
    items: Sequence[tuple[str, int, float]],
    *,
    arrival: float = 0.0,
    candidates: tuple[str, ...] = ("m",),
) -> None:
    """Push ``(tenant, priority, cost)`` items into an empty queue, each keyed by its
    index in ``items``; the item is the key."""
    assert not q
    for i, (tenant, priority, cost) in enumerate(items):
        q.push(
            i,
            i,
            priority=priority,
            candidates=candidates,
            arrival=arrival,
            tenant=tenant,
            cost=cost,
        )


@settings(max_examples=100, deadline=None)
@given(
    wa=FAIR_WEIGHTS, wb=FAIR_WEIGHTS, a_costs=st.lists(COSTS, min_size=5, max_size=5), b_cost=COSTS
)
def test_a_flood_cannot_starve_a_light_tenant(
    wa: float, wb: float, a_costs: list[int], b_cost: int
) -> None:
    """A pushes 20 items for each of B's at one level, five times what the model takes.
    Each of B's items is taken at the next turn: B has nothing else waiting, so it
    starts at S = V, and A, served since V was reached, is past it (B's first item
    finds A alone, just served, and goes first on the tie at V = 0). Whatever the
    weights and costs; and no turn is ever left unused: A alone takes every turn."""
    q: TaskQueue[tuple[str, int]] = TaskQueue(
        capacity=10_000, aging_step_s=None, tenant_weights={"A": wa, "B": wb}
    )
    key = 0
    taken: list[tuple[str, int]] = []
    b_arrived: dict[int, int] = {}  # B's key -> turns taken before it arrived
    for step in range(400):
        for i in range(5):
            q.push(
                key,
                ("A", key),
                priority=2,
                candidates=("m",),
                arrival=step,
                tenant="A",
                cost=a_costs[i],
            )
            key += 1
        if step % 4 == 0:
            q.push(
                key,
                ("B", key),
                priority=2,
                candidates=("m",),
                arrival=step,
                tenant="B",
                cost=b_cost,
            )
            b_arrived[key] = len(taken)
            key += 1
        got, skipped = q.pop_for("m", now=float(step), n=1)
        assert (len(got), skipped) == (1, [])
        taken += got
    waits = [taken.index(("B", k)) - before for k, before in b_arrived.items()]
    assert set(waits) == {0}
    assert Counter(t for t, _ in taken) == {"A": 300, "B": 100}


def test_a_tenant_alone_takes_every_turn_in_the_static_order() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=16, aging_step_s=10.0)
    q.push(1, "normal", priority=2, candidates=["m"], arrival=0.0, tenant="A")
    q.push(2, "high-late", priority=1, candidates=["m"], arrival=1.0, deadline=90.0, tenant="A")
    q.push(3, "high-soon", priority=1, candidates=["m"], arrival=2.0, deadline=50.0, tenant="A")
    q.push(4, "other", priority=1, candidates=["m"], arrival=3.0, tenant="B")
    assert q.statistics().shared_models == 1
    assert q.cancel(4) == "other"  # A is alone again: the static order, every turn
    q.push(5, "critical", priority=0, candidates=["m"], arrival=4.0, tenant="A")
    assert q.pop_for("m", now=5.0, n=9) == (["critical", "high-soon", "high-late", "normal"], [])
    assert q.statistics().shared_models == 0  # emptied: the next items start a solo lane


def test_weights_three_to_one_share_a_saturated_model_three_to_one() -> None:
    q: TaskQueue[int] = TaskQueue(capacity=1000, aging_step_s=None, tenant_weights={"big": 3.0})
    push_all(q, [("big", 2, 100)] * 300 + [("small", 2, 100)] * 300)
    order = ["big" if key < 300 else "small" for key in q.pop_for("m", now=0.0, n=200)[0]]
    counts = Counter(order)
    assert abs(counts["big"] - 150) <= 1, counts  # |n_big / 3 - n_small| <= 1/3 + 1
    for prefix in range(1, 201):  # and so at every moment, not only on average
        seen = Counter(order[:prefix])
        assert abs(seen["big"] / 3 - seen["small"]) <= 1 / 3 + 1


@settings(max_examples=150, deadline=None)
@given(
    tenants=st.lists(
        st.tuples(FAIR_WEIGHTS, st.lists(COSTS, min_size=1, max_size=4)), min_size=2, max_size=5
    ),
    turns=st.integers(1, 150),
)
def test_waiting_tenants_share_tokens_by_weight_within_one_item_each(
    tenants: list[tuple[float, list[int]]], turns: int
) -> None:
    """SFQ's fairness theorem, at every turn: while tenants i and j both wait,
    ``|W_i / w_i - W_j / w_j| <= c_i / w_i + c_j / w_j`` (W tokens taken, c largest cost)."""
    weights = {f"t{i}": w for i, (w, _) in enumerate(tenants)}
    biggest = {f"t{i}": max(costs) for i, (_, costs) in enumerate(tenants)}
    q: TaskQueue[int] = TaskQueue(capacity=10_000, aging_step_s=None, tenant_weights=weights)
    items = [
        (f"t{i}", 1, costs[j % len(costs)])
        for i, (_, costs) in enumerate(tenants)
        for j in range(turns)
    ]
    push_all(q, items)  # each has more than it can be given: all wait throughout
    tokens: Counter[str] = Counter()
    for _ in range(turns):
        ((key,), _) = q.pop_for("m", now=0.0)
        tenant, _, cost = items[key]
        tokens[tenant] += cost
        for a, b in itertools.combinations(weights, 2):
            gap = abs(tokens[a] / weights[a] - tokens[b] / weights[b])
            assert gap <= biggest[a] / weights[a] + biggest[b] / weights[b] + 1e-6


@settings(max_examples=150, deadline=None)
@given(
    others=st.lists(st.tuples(FAIR_WEIGHTS, COSTS), min_size=1, max_size=6),
    warmup=st.integers(0, 40),
    newcomer=st.tuples(FAIR_WEIGHTS, COSTS),
)
def test_a_tenant_that_begins_waiting_waits_for_one_item_of_each_other_at_most(
    others: list[tuple[float, int]], warmup: int, newcomer: tuple[float, int]
) -> None:
    weights = {f"t{i}": w for i, (w, _) in enumerate(others)} | {"new": newcomer[0]}
    q: TaskQueue[int] = TaskQueue(capacity=10_000, aging_step_s=None, tenant_weights=weights)
    push_all(q, [(f"t{i}", 2, c) for i, (_, c) in enumerate(others) for _ in range(50)])
    q.pop_for("m", now=0.0, n=warmup)
    key = 10_000
    q.push(key, key, priority=2, candidates=("m",), arrival=0.0, tenant="new", cost=newcomer[1])
    taken, _ = q.pop_for("m", now=0.0, n=len(others) + 1)
    assert key in taken  # after at most one item of each of the others


def test_a_tenant_that_begins_waiting_gets_no_credit_for_the_time_it_did_not() -> None:
    """A newcomer starts at S = V: it shares from now on, it does not catch up on the
    turns the others took while it had nothing waiting."""
    q: TaskQueue[int] = TaskQueue(capacity=1000, aging_step_s=None)
    push_all(q, [("A", 2, 10)] * 200 + [("B", 2, 10)] * 200)
    assert len(q.pop_for("m", now=0.0, n=100)[0]) == 100
    for key in range(400, 430):
        q.push(key, key, priority=2, candidates=("m",), arrival=0.0, tenant="C", cost=10)
    taken, _ = q.pop_for("m", now=0.0, n=30)
    assert sum(key >= 400 for key in taken) in {10, 11}  # a third, not every turn


def test_a_tenant_charged_for_tokens_its_calls_did_not_use_gets_them_back() -> None:
    """B asks for long answers (cost 1010) and gets answers as short as A's (cost 20):
    charged the estimate alone, B waits for 50 of A's items after each of its own;
    settled to what each call used, the two alternate."""

    def b_share(settled: bool) -> int:
        q: TaskQueue[int] = TaskQueue(capacity=1000, aging_step_s=None)
        push_all(q, [("A", 2, 20)] * 200 + [("B", 2, 1010)] * 50)
        order: list[str] = []
        for _ in range(40):
            ((key,), _) = q.pop_for("m", now=0.0)
            order.append("A" if key < 200 else "B")
            if settled:
                q.settle("m", [(2, order[-1], 1010 - 20 if key >= 200 else 0)])
        return order.count("B")

    assert b_share(settled=False) == 1
    assert b_share(settled=True) == 20


def test_a_settled_tenant_goes_no_earlier_than_a_newcomer_would() -> None:
    """Settling never takes S below V: a refund larger than the charge makes the
    tenant next at most, it does not bank turns (A keeps its 1-in-2 share after)."""
    q: TaskQueue[int] = TaskQueue(capacity=1000, aging_step_s=None)
    push_all(q, [("A", 2, 10)] * 100 + [("B", 2, 10)] * 100)
    q.pop_for("m", now=0.0, n=20)
    q.settle("m", [(2, "B", 10_000)])  # far more than B was ever charged
    taken, _ = q.pop_for("m", now=0.0, n=20)
    assert 9 <= sum(key >= 100 for key in taken) <= 11
    q.settle("m", [(2, "nobody", 10)])  # a tenant not waiting there, a model or level
    q.settle("x", [(2, "B", 10)])  # with nothing waiting: nothing to settle
    q.settle("m", [(0, "B", 10)])
    with pytest.raises(ValueError, match="finite"):
        q.settle("m", [(2, "B", math.nan)])


def test_an_item_given_back_unsent_is_as_if_never_taken() -> None:
    """A takes a turn and gives it back unsent (its model's limit said "not yet"): its
    charge is undone, below V if need be, and it is next again, before B, whose turn
    came after. A settlement would stop at V, and the tie went to B (found by a hunt)."""
    q: TaskQueue[int] = TaskQueue(capacity=1000, aging_step_s=None)
    push_all(q, [("A", 2, 500)] * 3 + [("B", 2, 50)] * 30)
    taken, _ = q.pop_for("m", now=0.0, n=2)
    assert taken == [3, 0]  # B's (the newcomer goes first on the tie), then A's
    q.push(0, 0, priority=2, candidates=["m"], arrival=0.0, tenant="A", cost=500)
    q.refund("m", [(2, "A", 500)])
    assert q.pop_for("m", now=0.0, n=1)[0] in ([0], [1], [2])  # A's turn, again
    # only what A still carries is undone: no turns are banked by a refund
    q.refund("m", [(2, "A", 10_000)])
    taken, _ = q.pop_for("m", now=0.0, n=12)
    assert sum(key < 3 for key in taken) == 2  # A's other two, ten of B's 50 each
    q.refund("m", [(2, "nobody", 10)])  # nobody waiting so, no such model or level
    q.refund("x", [(2, "A", 10)])
    q.refund("m", [(0, "A", 10)])
    with pytest.raises(ValueError, match="finite"):
        q.refund("m", [(2, "A", math.inf)])
    with pytest.raises(ValueError, match="negative"):
        q.refund("m", [], aged=-1)


def test_a_tenant_that_stopped_waiting_gets_nothing_back_and_comes_back_at_v() -> None:
    q: TaskQueue[int] = TaskQueue(capacity=1000, aging_step_s=None)
    push_all(q, [("B", 2, 50)] * 30 + [("A", 2, 500)])
    assert q.pop_for("m", now=0.0, n=1)[0] == [30]  # A's only item: A is forgotten
    q.push(30, 30, priority=2, candidates=["m"], arrival=0.0, tenant="A", cost=500)
    q.refund("m", [(2, "A", 500)])  # A came back at V as a newcomer: nothing to undo
    taken, _ = q.pop_for("m", now=0.0, n=3)
    assert taken == [0, 30, 1]  # B (waiting before A, on the tie at V), then A


def test_an_aged_turn_given_back_unsent_is_owed_again() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=32, aging_step_s=1.0, aging_share=0.5)
    q.push(0, "old-low", priority=3, candidates=["m"], arrival=0.0)
    for key in range(1, 7):
        q.push(key, f"critical{key}", priority=0, candidates=["m"], arrival=10.0)
    aged: list[str] = []
    assert q.pop_for("m", now=10.0, n=2, aged=aged)[0] == ["critical1", "old-low"]
    q.push(0, "old-low", priority=3, candidates=["m"], arrival=0.0)  # back unsent
    q.refund("m", [], aged=len(aged))
    assert q.pop_for("m", now=10.0, n=2)[0] == ["old-low", "critical2"]


def test_priority_comes_before_tenancy_and_weight() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=32, aging_step_s=10.0, tenant_weights={"heavy": 100.0})
    for key in range(10):
        q.push(key, f"heavy-high{key}", priority=1, candidates=["m"], arrival=0.0, tenant="heavy")
    q.push(10, "light-critical", priority=0, candidates=["m"], arrival=1.0, tenant="light")
    q.push(11, "light-low", priority=3, candidates=["m"], arrival=1.0, tenant="light")
    q.push(12, "heavy-critical", priority=0, candidates=["m"], arrival=2.0, tenant="heavy")
    taken, _ = q.pop_for("m", now=2.0, n=20)
    high = [f"heavy-high{key}" for key in range(10)]
    assert taken == ["light-critical", "heavy-critical", *high, "light-low"]


@settings(max_examples=200, deadline=None)
@given(
    pushes=st.lists(
        st.tuples(
            PRIORITIES,
            st.integers(0, 3),
            st.sampled_from([1, 50, 4000]),
            st.none() | st.integers(1, 9),
        ),
        min_size=1,
        max_size=60,
    ),
    batch=st.sampled_from([1, 3, 8]),
)
def test_without_aging_levels_take_turns_exactly_as_without_tenants(
    pushes: list[tuple[int, int, int, int | None]], batch: int
) -> None:
    """Tenants decide which item of a level goes, never which level: without aging the
    priorities come out as from a queue without tenants; and each tenant's items of a
    level come out in the static order (deadline, then arrival)."""
    fair: TaskQueue[int] = TaskQueue(capacity=64, aging_step_s=None, tenant_weights={"t1": 2.0})
    plain: TaskQueue[int] = TaskQueue(capacity=64, aging_step_s=None)
    for key, (priority, tenant, cost, deadline) in enumerate(pushes):
        for q, who in ((fair, f"t{tenant}"), (plain, None)):
            q.push(
                key,
                key,
                priority=priority,
                candidates=("m",),
                arrival=float(key),
                deadline=deadline,
                tenant=who,
                cost=cost,
            )
    fair_order: list[int] = []
    while len(plain):
        got, _ = fair.pop_for("m", now=0.0, n=batch)
        want, _ = plain.pop_for("m", now=0.0, n=batch)
        assert [pushes[k][0] for k in got] == [pushes[k][0] for k in want]
        fair_order += got
    for tenant in range(4):
        for priority in range(4):
            mine = [k for k in fair_order if pushes[k][:2] == (priority, tenant)]
            assert mine == sorted(mine, key=lambda k: (pushes[k][3] or math.inf, k))


def test_aging_lifts_a_light_tenants_low_task_over_a_critical_flood() -> None:
    """An aged LOW task takes one turn in 1 / ``aging_share`` ahead of a CRITICAL flood."""
    q: TaskQueue[str] = TaskQueue(capacity=32, aging_step_s=1.0, aging_share=0.25)
    q.push(0, "light-low", priority=3, candidates=["m"], arrival=0.0, tenant="light")
    flood = [f"flood{key}" for key in range(1, 11)]
    for key, name in enumerate(flood, 1):  # four steps later: rank 4, behind LOW's 3
        q.push(key, name, priority=0, candidates=["m"], arrival=4.0 + key / 100, tenant="flood")
    q.push(11, "light-low-fresh", priority=3, candidates=["m"], arrival=4.0, tenant="light")
    assert q.pop_for("m", now=5.0, n=12)[0] == [
        *flood[:3],
        "light-low",
        *flood[3:],
        "light-low-fresh",
    ]


def test_pop_for_names_the_items_it_took_on_aged_turns() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=32, aging_step_s=1.0, aging_share=0.5)
    q.push(0, "old-low", priority=3, candidates=["m"], arrival=0.0)
    q.push(1, "old-low-2", priority=3, candidates=["m"], arrival=0.0)
    for key in range(2, 6):
        q.push(key, f"critical{key}", priority=0, candidates=["m"], arrival=10.0)
    aged: list[str] = []
    taken, _ = q.pop_for("m", now=10.0, n=6, aged=aged)
    assert taken == ["critical2", "old-low", "critical3", "old-low-2", "critical4", "critical5"]
    assert aged == ["old-low", "old-low-2"]


def test_a_critical_task_goes_ahead_of_a_batch_that_waited_for_minutes() -> None:
    """A LOW batch 40 s old (4 aging steps) went ahead of every new CRITICAL task, all
    of it: 8-16 s waits for a user's request behind a batch (found by a hunt). Aged
    tasks now take a share of the turns (``aging_share``, one in ten by default)."""
    q: TaskQueue[str] = TaskQueue(capacity=2000)
    for key in range(1000):
        q.push(key, f"batch{key}", priority=3, candidates=["m"], arrival=0.0)
    assert q.pop_for("m", now=1.0, n=100)[0][-1] == "batch99"
    q.push(1000, "user", priority=0, candidates=["m"], arrival=300.0)
    assert q.pop_for("m", now=300.0, n=1)[0] == ["user"]
    for key in range(1001, 1100):  # a flood of users: the batch still moves, 1 in 10
        q.push(key, f"user{key}", priority=0, candidates=["m"], arrival=301.0)
    taken = q.pop_for("m", now=301.0, n=100)[0]
    assert [i for i, name in enumerate(taken) if name.startswith("batch")] == [*range(8, 100, 10)]


def test_a_level_lifted_by_aging_shares_its_turns_between_its_tenants() -> None:
    """LOW's oldest item (rank 3) precedes HIGH's (rank 4), so LOW takes the turns until
    that item is gone; which LOW item goes is the tenants' turn: the light tenant's fresh
    LOW item (rank 6) gets the second, before HIGH's."""
    q: TaskQueue[str] = TaskQueue(capacity=32, aging_step_s=1.0, aging_share=1.0)
    for key in range(5):
        q.push(key, f"old-low{key}", priority=3, candidates=["m"], arrival=0.0, tenant="flood")
    for key in range(5, 10):
        q.push(key, f"high{key}", priority=1, candidates=["m"], arrival=3.5, tenant="other")
    q.push(10, "fresh-low", priority=3, candidates=["m"], arrival=3.5, tenant="light")
    taken, _ = q.pop_for("m", now=4.0, n=11)
    old = [f"old-low{key}" for key in range(1, 5)]
    assert taken == ["old-low0", "fresh-low", *old, *(f"high{key}" for key in range(5, 10))]


def test_an_item_skipped_for_its_deadline_costs_its_tenant_nothing() -> None:
    q: TaskQueue[str] = TaskQueue(capacity=32, aging_step_s=None)
    for key in range(4):
        q.push(key, f"a{key}", priority=2, candidates=["m"], arrival=0.0, tenant="A", cost=10)
    q.push(
        4,
        "b-too-late",
        priority=2,
        candidates=["m"],
        arrival=0.0,
        deadline=1.5,
        tenant="B",
        cost=1000,
    )
    q.push(5, "b-fine", priority=2, candidates=["m"], arrival=0.0, tenant="B", cost=10)
    # B's turn first (it found A alone); it meets an item it cannot send in time:
    # dropped, uncharged, so B's turn goes on with its next item; then A's.
    assert q.pop_for("m", now=1.0, n=2, min_remaining_s=1.0) == (["b-fine", "a0"], ["b-too-late"])


def test_shared_lanes_keep_their_memory_to_their_live_items_under_churn() -> None:
    rounds = 3000
    q: TaskQueue[int] = TaskQueue(capacity=rounds, aging_step_s=1.0)
    for key in range(rounds):
        tenant = f"t{key % 37}"
        cands = ("a", "b") if key % 3 else ("b",)
        q.push(
            key,
            key,
            priority=key % 4,
            candidates=cands,
            arrival=key / 100,
            tenant=tenant,
            deadline=1e9 if key % 5 == 0 else None,
            cost=1 + key % 7,
        )
        if key % 5:
            q.pop_for("a" if key % 2 else "b", now=key / 100)
        if key % 7 == 0:
            q.cancel(key - 3)
        if key % 11 == 0:
            q.retarget(key - 1, ("a",) if key % 2 else ("a", "b"))
        stats = q.statistics()
        assert stats.heap_entries <= 2 * (2 * stats.waiting) + COMPACT_SLACK * stats.models
        if key % 97 == 0:
            assert_shared_lanes_hold(q)
    assert q.statistics().shared_models == 2
    assert_shared_lanes_hold(q)
    for model in ("a", "b"):
        q.pop_for(model, now=1e3, n=rounds)
    stats = q.statistics()
    assert (stats.waiting, stats.models, stats.shared_models, stats.heap_entries) == (0, 0, 0, 0)


@pytest.mark.parametrize(
    "weights",
    [{"a": 0.0}, {"a": -1.0}, {"a": math.nan}, {"a": math.inf}],
)
def test_a_tenant_weight_must_be_positive_and_finite(weights: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="tenant 'a' must weigh more than 0"):
        TaskQueue(capacity=1, tenant_weights=weights)


def test_a_tenant_in_the_weights_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="a tenant must be a string"):
        TaskQueue(capacity=1, tenant_weights={1: 2.0})  # type: ignore[dict-item]


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
        ({"cost": 0}, ValueError, "cost must be positive and finite"),
        ({"cost": -5.0}, ValueError, "cost must be positive and finite"),
        ({"cost": math.nan}, ValueError, "cost must be positive and finite"),
        ({"cost": math.inf}, ValueError, "cost must be positive and finite"),
        ({"tenant": 7}, TypeError, "tenant must be a string or None"),
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
        {"capacity": 1, "aging_share": 1e-17},  # a float sum of it stalls short of a turn
        {"capacity": 1, "aging_share": 1.5},
        {"capacity": 1, "aging_share": math.nan},
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


def _overload_waits(
    *, slots: int, window: int, light_share: float, seconds: float = 1.0
) -> tuple[dict[str, list[float]], float]:
    """The ``tenants`` bench scenario on the core alone, on an injected clock: a model of
    ``slots`` calls of 25-75 ms (seeded), a window of ``window`` calls granted ahead
    (each granted call takes its turn when granted and starts when a slot frees, as the
    model actor and the I/O loop do), tasks arriving at 5x capacity, B's every
    ``1 / light_share``-th. Returns each tenant's queue waits (arrival to its turn,
    seconds) and the share of slot time busy while A waited."""
    rng = random.Random(7)
    q: TaskQueue[tuple[str, float]] = TaskQueue(capacity=100_000, aging_step_s=10.0)
    capacity = slots / 0.05
    gap = 1.0 / (5.0 * capacity)
    every = round(1.0 / light_share)
    arrivals = [
        (i * gap, "B" if i % every == every // 2 else "A") for i in range(int(seconds / gap))
    ]
    frees: list[float] = [0.0] * slots  # when each slot frees, a heap
    granted: list[tuple[str, float]] = []  # the window, oldest first
    waits: dict[str, list[float]] = {"A": [], "B": []}
    busy = idle_while_waiting = 0.0
    nxt = 0

    def grant(now: float, n: int) -> None:
        got, _ = q.pop_for("m", now, n)
        for tenant, arrived in got:
            waits[tenant].append(now - arrived)
        granted.extend(got)

    while nxt < len(arrivals) or len(q) or granted:
        free_at = frees[0]
        if nxt < len(arrivals) and arrivals[nxt][0] <= free_at:
            now, tenant = arrivals[nxt]
            q.push(nxt, (tenant, now), priority=2, candidates=("m",), arrival=now, tenant=tenant)
            nxt += 1
            grant(now, window - len(granted))  # the window refills when work arrives
            continue
        now = free_at
        if not granted:  # nothing to start: the slot idles until the next arrival
            if nxt < len(arrivals):
                if len(q):
                    idle_while_waiting += arrivals[nxt][0] - now
                heapq.heapreplace(frees, arrivals[nxt][0])
                continue
            break
        granted.pop(0)
        service = rng.uniform(0.025, 0.075)
        busy += service
        heapq.heapreplace(frees, now + service)
        grant(now, window - len(granted))
    return waits, idle_while_waiting


@pytest.mark.parametrize(("slots", "window"), [(10, 1), (20, 5), (200, 50)])
def test_a_light_tenant_under_a_flood_at_5x_overload_waits_under_one_service_time(
    slots: int, window: int
) -> None:
    """The bound the ``tenants`` scenario checks, with time: A floods at 20x B's rate,
    the two at five times what ``slots`` calls of 50 ms (25-75) take. Every turn goes
    to B's task as soon as one is waiting, so B waits at most for the next turn: a
    call's end among ``slots`` running, well under one service time (50 ms), whatever
    the window; A waits for the backlog (seconds), and no slot idles while it does."""
    waits, idle = _overload_waits(slots=slots, window=window, light_share=1 / 21)
    assert max(waits["B"]) < 0.050  # the first wave's calls all end after 25 ms at most
    median = sorted(waits["B"])[len(waits["B"]) // 2]
    assert median <= 0.075 / slots  # the next call's end: calls end every 50 / slots ms
    assert sorted(waits["A"])[len(waits["A"]) // 2] > 1.0
    assert idle == 0.0


def test_a_tenant_asking_more_than_its_share_queues_behind_its_own_tasks() -> None:
    """Why the bench saw the light tenant wait longer on a loaded machine: fairness
    gives B its share (half, with two tenants of equal weight), not precedence. When
    B's tasks come faster than half of what the model takes (here 55% of the arrivals
    at 5x overload: 2.75x capacity), B's own backlog grows and its waits with it;
    at 1/21 of them it never waits past the next turn."""
    heavy, _ = _overload_waits(slots=20, window=5, light_share=0.55)
    light, _ = _overload_waits(slots=20, window=5, light_share=1 / 21)
    assert max(heavy["B"]) > 0.25
    assert max(light["B"]) < 0.050
