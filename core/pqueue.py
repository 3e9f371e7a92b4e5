"""The queue's pure core: a bounded multi-model priority queue with aging.

Every time (``arrival``, ``now``, ``deadline``) is passed in, on one clock, in
seconds. The Queue actor is the only user of its ``TaskQueue``: nothing locks.

Theory of operation
-------------------
Each waiting item has a key (an ``int`` the caller chooses, e.g. the task id),
a priority (an ``int``, lower is more urgent: 0 CRITICAL .. 3 LOW), an arrival
time, an optional deadline and a set of candidate models it may go to. A model
actor grants credits; ``pop_for(model, now, n)`` hands over the ``n`` best
waiting items that may go to that model.

*Order.* Items are served in increasing order of the static sort key::

    (rank, deadline or +inf, seq)
    rank = priority + floor((arrival - epoch) / s)     with aging step s
    rank = priority                                   without aging (s = None)

where ``seq`` counts pushes, so ties are FIFO. Within one aging window this is
priority, then deadline, then arrival; a task that has waited k steps compares
as if k levels more urgent than one of its level arriving now. The key is
fixed at push, so aging costs nothing: no re-heapifying, no scan.

*Aging bound.* For items A and B (priorities p_A, p_B) that may go to the
same model, write ``x = (arrival - epoch) / s``. Since
``x_B - x_A - 1 < floor(x_B) - floor(x_A) < x_B - x_A + 1``, and ranks are
integers:

- if ``arrival_B >= arrival_A + (p_A - p_B + 1) * s`` then rank_B > rank_A:
  B is served after A, whatever its deadline;
- if ``arrival_B < arrival_A + (p_A - p_B) * s`` then rank_B <= rank_A: B is
  served first, or on a tie if its deadline is earlier (or equal and pushed
  first);
- in between, rank_B is rank_A or rank_A + 1, so B may win only the tie.

So with priorities 0..3 a LOW task that arrived at t can be overtaken only by
tasks that arrived before t + 4s (CRITICAL), t + 3s (HIGH), t + 2s (NORMAL)
or t + s (LOW), whatever their deadline: no task starves while its models
keep granting credits. A task re-queued with its original arrival keeps its
seniority.

*Structure.* ``_live`` maps each key to its entry ``(rank, deadline, seq, key,
item, candidates)``, the same tuple in each of its candidates' lanes. A
``Lane`` holds a bucket per rank and a heap of those ranks; a bucket serves the
smaller head of a FIFO deque (no deadline, pushed in seq order: the common
case, O(1)) and a heap (the rest). A deadline heap holds ``(deadline, seq,
key)``. Removal is lazy: an entry is *live* iff ``_live.get(key) is entry``;
popping, cancelling, expiring or retargeting only changes ``_live``, and stale
entries are dropped at a bucket's head or when the lane is compacted.

Invariants (checked by the tests):

1. ``len(_live) <= capacity``; a rejected push changes nothing.
2. ``_waiting[m]`` is the number of live items that may go to ``m``; the lane
   ``_lanes[m]`` exists iff ``_waiting[m] > 0`` and then holds exactly one
   live entry per such item; every bucket of a lane is non-empty or about to
   be dropped at the head of its rank heap.
3. A lane is compacted (rebuilt from its live entries) as soon as its stale
   entries outnumber its live ones by more than ``COMPACT_SLACK``, so a
   lane holds at most ``2 * _waiting[m] + COMPACT_SLACK`` entries, and
   likewise for the deadline heap. Compaction costs O(stale), paid for by
   the operations that made those entries stale.

Costs (n waiting, c candidates per item, r ranks waiting for a model): push
O(c), O(c log n) with a deadline; pop O(1) per item (O(log n) with a deadline,
O(log r) when a bucket empties), amortized over stale entries; cancel O(c);
retarget O(c log n); expire O(k log n) for k items; next_deadline O(1)
amortized; items_for O(the lane), for the rare moves between lanes. A task's
cost does not grow with the backlog (the bench's ``backlog`` scenario checks
10^3 to 10^6).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final, Generic, TypeAlias, TypeVar

__all__ = ["COMPACT_SLACK", "QueueFull", "QueueStats", "TaskQueue"]

T = TypeVar("T")
_INF: Final = math.inf

# (rank, deadline, seq, key, item, candidates). Heaps order entries by
# (rank, deadline, seq); seq is unique per push, so only an item's own entries
# from before and after a retarget tie there, and those hold the same item
# (equal by identity, never ordered) and differ in candidates (str tuples).
Entry: TypeAlias = tuple[int, float, int, int, T, tuple[str, ...]]


class _Bucket(Generic[T]):
    """The entries of one rank in one lane: in-order ones in a deque, the rest in a heap."""

    __slots__ = ("fifo", "heap", "last_seq")

    def __init__(self) -> None:
        self.fifo: deque[Entry[T]] = deque()
        self.heap: list[Entry[T]] = []
        self.last_seq = -1

    def add(self, entry: Entry[T]) -> None:
        if entry[1] == _INF and entry[2] > self.last_seq:
            self.fifo.append(entry)
            self.last_seq = entry[2]
        else:
            heapq.heappush(self.heap, entry)

    def take(self) -> Entry[T] | None:
        """Remove and return the first entry (live or stale), or None if empty."""
        fifo, heap = self.fifo, self.heap
        if heap and not (fifo and fifo[0] < heap[0]):
            return heapq.heappop(heap)
        return fifo.popleft() if fifo else None


class Lane(Generic[T]):
    """One model's waiting entries: a bucket per rank and a heap of those ranks.

    What must hold: a bucket's deque has increasing seqs and no deadlines;
    ``entries`` counts the buckets' entries, live and stale (liveness is the
    queue's business); a bucket ``take`` finds empty is dropped with its rank.
    """

    __slots__ = ("buckets", "entries", "ranks")

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket[T]] = {}
        self.ranks: list[int] = []
        self.entries = 0
        """Entries in all buckets, live and stale."""

    def add(self, entry: Entry[T]) -> None:
        rank = entry[0]
        bucket = self.buckets.get(rank)
        if bucket is None:
            bucket = self.buckets[rank] = _Bucket()
            heapq.heappush(self.ranks, rank)
        bucket.add(entry)
        self.entries += 1

    def take(self) -> Entry[T] | None:
        """Remove and return the first entry in (rank, deadline, seq) order, or None."""
        buckets, ranks = self.buckets, self.ranks
        while ranks:
            rank = ranks[0]
            entry = buckets[rank].take()
            if entry is not None:
                self.entries -= 1
                return entry
            heapq.heappop(ranks)
            del buckets[rank]
        return None

    def compact(self, live: dict[int, Entry[T]]) -> None:
        """Drop the stale entries (``live`` maps a key to its one live entry): O(entries)."""
        kept = 0
        for rank in list(self.buckets):
            bucket = self.buckets[rank]
            bucket.fifo = deque(e for e in bucket.fifo if live.get(e[3]) is e)  # keeps its order
            bucket.heap = [e for e in bucket.heap if live.get(e[3]) is e]
            heapq.heapify(bucket.heap)
            size = len(bucket.fifo) + len(bucket.heap)
            if size:
                kept += size
            else:
                del self.buckets[rank]
        self.ranks = list(self.buckets)
        heapq.heapify(self.ranks)
        self.entries = kept


COMPACT_SLACK: Final = 8
"""Stale entries a lane (or the deadline heap) may hold beyond its live ones."""

_INTERN_MAX: Final = 1024
"""Distinct candidate tuples shared between items (bounds the intern table)."""


class QueueFull(Exception):  # noqa: N818 - a core signal; callers see QueueFullError or Rejected
    """A push found the queue at capacity; the queue is unchanged."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)  # args stay (capacity,), so it pickles
        self.capacity = capacity

    def __str__(self) -> str:
        return f"queue is full (capacity {self.capacity})"


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueStats:
    """A snapshot of a queue's size and bookkeeping (for stats and tests)."""

    waiting: int
    """Live items."""
    capacity: int
    """The most items that may wait."""
    models: int
    """Models with at least one live item."""
    heap_entries: int
    """Entries in all model heaps, live and stale."""
    deadline_entries: int
    """Entries in the deadline heap, live and stale."""
    with_deadline: int
    """Live items that have a deadline."""


class TaskQueue(Generic[T]):
    """A bounded priority queue of items, each of which may go to several models."""

    __slots__ = (
        "_aging_step_s",
        "_capacity",
        "_deadlines",
        "_epoch",
        "_intern",
        "_lanes",
        "_live",
        "_n_deadlined",
        "_seq",
        "_waiting",
    )

    def __init__(
        self, *, capacity: int, aging_step_s: float | None = 10.0, epoch: float = 0.0
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity!r}")
        if aging_step_s is not None and not (0.0 < aging_step_s < _INF):
            raise ValueError(
                f"aging_step_s must be positive and finite or None, got {aging_step_s!r}"
            )
        if not math.isfinite(epoch):
            raise ValueError(f"epoch must be finite, got {epoch!r}")
        self._capacity = capacity
        self._aging_step_s = aging_step_s
        self._epoch = epoch
        self._live: dict[int, Entry[T]] = {}
        self._lanes: dict[str, Lane[T]] = {}
        self._waiting: dict[str, int] = {}
        self._deadlines: list[tuple[float, int, int]] = []
        self._n_deadlined = 0
        self._seq = 0
        self._intern: dict[tuple[str, ...], tuple[str, ...]] = {}

    # -- adding and changing --------------------------------------------------

    def push(
        self,
        key: int,
        item: T,
        *,
        priority: int,
        candidates: Collection[str],
        arrival: float,
        deadline: float | None = None,
    ) -> None:
        """Queue ``item`` under ``key``.

        Raises ``ValueError`` for a key already waiting, no candidates, or a
        non-finite arrival or NaN deadline; ``QueueFull`` at capacity. Either
        way the queue is unchanged. A deadline of +inf counts as none.
        """
        cands = self._candidates(candidates)
        if key in self._live:
            raise ValueError(f"key {key!r} is already waiting")
        if not math.isfinite(arrival):
            raise ValueError(f"arrival must be finite, got {arrival!r}")
        dl = _INF if deadline is None else float(deadline)
        if math.isnan(dl):
            raise ValueError("deadline must not be NaN")
        if len(self._live) >= self._capacity:
            raise QueueFull(self._capacity)
        seq = self._seq
        self._seq = seq + 1
        step = self._aging_step_s
        rank = priority if step is None else priority + math.floor((arrival - self._epoch) / step)
        entry: Entry[T] = (rank, dl, seq, key, item, cands)
        self._live[key] = entry
        self._enter(entry, cands)
        if dl < _INF:
            heapq.heappush(self._deadlines, (dl, seq, key))
            self._n_deadlined += 1

    def retarget(self, key: int, candidates: Collection[str]) -> bool:
        """Change the models a waiting item may go to; its place in order stays.

        Returns whether anything changed: False if ``key`` is not waiting or
        already goes to exactly these models (in whatever order).
        """
        cands = self._candidates(candidates)
        old = self._live.get(key)
        if old is None or cands == old[5] or set(cands) == set(old[5]):
            return False
        new: Entry[T] = (*old[:5], cands)
        self._live[key] = new
        self._enter(new, cands)  # before leaving, so shared models keep their heap
        self._leave_models(old[5], None)
        return True

    # -- taking out -----------------------------------------------------------

    def pop_for(
        self, model: str, now: float, n: int = 1, *, min_remaining_s: float = 0.0
    ) -> tuple[list[T], list[T]]:
        """Remove and return ``(taken, skipped)`` for ``n`` credits of ``model``.

        ``taken`` holds up to ``n`` of the best items that may go to ``model``,
        best first. ``skipped`` holds the items met on the way whose deadline
        cannot be met: ``deadline <= now`` (as ``expire`` counts it) or
        ``deadline - now < min_remaining_s``; they are removed too, and the
        caller reports them expired. Fewer than ``n`` are taken only when no
        other item may go to ``model``.
        """
        if n < 0:
            raise ValueError(f"n must not be negative, got {n!r}")
        taken: list[T] = []
        skipped: list[T] = []
        live = self._live
        while len(taken) < n:
            lane = self._lanes.get(model)
            if lane is None:  # no live item may go to model
                break
            entry = lane.take()  # invariant 2: the lane holds a live entry
            assert entry is not None
            key = entry[3]
            if live.get(key) is not entry:
                continue
            del live[key]
            self._leave(entry, model)
            dl = entry[1]
            if dl <= now or dl - now < min_remaining_s:
                skipped.append(entry[4])
            else:
                taken.append(entry[4])
        left = self._waiting.get(model)
        if left is not None:
            self._compact_model(model, left)
        return taken, skipped

    def cancel(self, key: int) -> T | None:
        """Remove and return the item waiting under ``key``, or None."""
        entry = self._live.pop(key, None)
        if entry is None:
            return None
        self._leave(entry, None)
        return entry[4]

    def expire(self, now: float) -> list[T]:
        """Remove and return every item whose ``deadline <= now``, in deadline order."""
        expired: list[T] = []
        live = self._live
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, key = heapq.heappop(self._deadlines)
            entry = live.get(key)
            if entry is None or entry[2] != seq:
                continue
            del live[key]
            self._leave(entry, None)
            expired.append(entry[4])
        return expired

    def clear(self) -> list[T]:
        """Remove and return every waiting item, in push order."""
        items = [entry[4] for entry in self._live.values()]
        self._live.clear()
        self._lanes.clear()
        self._waiting.clear()
        self._deadlines = []
        self._n_deadlined = 0
        return items

    # -- reading --------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting item, or None (for the one timer)."""
        heap = self._deadlines
        live = self._live
        while heap:
            dl, seq, key = heap[0]
            entry = live.get(key)
            if entry is not None and entry[2] == seq:
                return dl
            heapq.heappop(heap)
        return None

    def waiting_for(self, model: str) -> int:
        """How many waiting items may go to ``model``."""
        return self._waiting.get(model, 0)

    def items_for(self, model: str) -> list[T]:
        """The waiting items that may go to ``model``, in no particular order (a
        snapshot: the queue may change meanwhile)."""
        lane = self._lanes.get(model)
        if lane is None:
            return []
        live = self._live
        return [
            entry[4]
            for bucket in lane.buckets.values()
            for part in (bucket.fifo, bucket.heap)
            for entry in part
            if live.get(entry[3]) is entry
        ]

    def statistics(self) -> QueueStats:
        """Sizes of the queue and of its bookkeeping."""
        return QueueStats(
            waiting=len(self._live),
            capacity=self._capacity,
            models=len(self._lanes),
            heap_entries=sum(lane.entries for lane in self._lanes.values()),
            deadline_entries=len(self._deadlines),
            with_deadline=self._n_deadlined,
        )

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __repr__(self) -> str:
        return (
            f"TaskQueue(waiting={len(self._live)}, capacity={self._capacity}, "
            f"models={len(self._lanes)}, aging_step_s={self._aging_step_s!r})"
        )

    # -- bookkeeping ----------------------------------------------------------

    def _candidates(self, candidates: Collection[str]) -> tuple[str, ...]:
        """Deduplicate (keeping order) and intern a candidate collection."""
        if type(candidates) is tuple:  # fast path: an interned tuple is deduplicated
            shared = self._intern.get(candidates)
            if shared is not None:
                return shared
        elif isinstance(candidates, str):
            raise TypeError(f"candidates must be a collection of model names, not {candidates!r}")
        cands = tuple(dict.fromkeys(candidates))
        if not cands:
            raise ValueError("candidates must name at least one model")
        shared = self._intern.get(cands)
        if shared is not None:
            return shared
        if len(self._intern) < _INTERN_MAX:
            self._intern[cands] = cands
        return cands

    def _enter(self, entry: Entry[T], cands: tuple[str, ...]) -> None:
        """Put ``entry`` into the lane of each of its candidates."""
        lanes = self._lanes
        waiting = self._waiting
        for model in cands:
            lane = lanes.get(model)
            if lane is None:
                lane = lanes[model] = Lane()
                waiting[model] = 1
            else:
                waiting[model] += 1
            lane.add(entry)

    def _leave(self, entry: Entry[T], popped_from: str | None) -> None:
        """Account for ``entry`` having left ``_live`` (its heap entries went stale)."""
        self._leave_models(entry[5], popped_from)
        if entry[1] < _INF:
            self._n_deadlined -= 1
            self._compact_deadlines()

    def _leave_models(self, cands: tuple[str, ...], popped_from: str | None) -> None:
        """Count one live item less for each of ``cands``; drop or compact their lanes.

        The lane being popped (``popped_from``) is compacted by ``pop_for``
        when it is done with it.
        """
        waiting = self._waiting
        for model in cands:
            left = waiting[model] - 1
            if left == 0:  # every entry left in the lane is stale
                del waiting[model]
                del self._lanes[model]
            else:
                waiting[model] = left
                if model != popped_from:
                    self._compact_model(model, left)

    def _compact_model(self, model: str, live_count: int) -> None:
        lane = self._lanes[model]
        if lane.entries > 2 * live_count + COMPACT_SLACK:
            lane.compact(self._live)

    def _compact_deadlines(self) -> None:
        count = self._n_deadlined
        if count == 0:
            self._deadlines = []
        elif len(self._deadlines) > 2 * count + COMPACT_SLACK:
            live = self._live
            fresh = [
                (dl, seq, key)
                for dl, seq, key in self._deadlines
                if (entry := live.get(key)) is not None and entry[2] == seq
            ]
            heapq.heapify(fresh)
            self._deadlines = fresh
