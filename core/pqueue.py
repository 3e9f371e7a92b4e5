"""The queue's pure core: a bounded multi-model priority queue with aging, shared
fairly between tenants within a priority level.

Every time (``arrival``, ``now``, ``deadline``) is passed in, on one clock, in
seconds. The Queue actor is the only user of its ``TaskQueue``: nothing locks.

Theory of operation
-------------------
Each waiting item has a key (an ``int`` the caller chooses, e.g. the task id),
a priority (an ``int``, lower is more urgent: 0 CRITICAL .. 3 LOW), an arrival
time, an optional deadline, a set of candidate models it may go to, a tenant
(any string, or None: the items without one are one tenant together) and a
cost (the tokens it may use: prompt plus ``max_tokens``). A model actor grants
credits; ``pop_for(model, now, n)`` hands over the ``n`` items whose turn it is
among those that may go to that model.

*Two orders.* Every item has two sort keys, fixed at push::

    static order: (priority, window, deadline or +inf, seq)
    aged order:   (priority + window, deadline or +inf, seq)
    window = floor((arrival - epoch) / s)     with aging step s
    window = 0                                without aging (s = None)

where ``seq`` follows arrival (the caller's ``order``, such as a task id, else
the count of pushes), so ties are FIFO, and an item pushed again (a job a model
handed back) keeps its place among those that came after it. Within one level
the two agree: older windows first, then deadline, then arrival. Across levels
the static order is strict priority, and in the aged order a task that has
waited k steps compares as if k levels more urgent than one of its level
arriving now. The keys are fixed at push, so aging costs nothing: no
re-heapifying, no scan. (``rank`` is the static order's first part,
``priority`` above 64 bits of window.)

*Whose turn.* Each credit of a model is answered in three steps:

1. **the level**: the most urgent level with an item waiting for the model,
   unless the aged order's first item is of another level and an *aged turn*
   is due: then that item's level. Each turn on which the aged order's first
   item is not of the most urgent level earns the model ``aging_share`` of an
   aged turn; an aged turn is due once a whole one is earned, and spends it;
2. **the tenant** within that level, by start-time fair queuing (below);
3. **the item**: that tenant's first at that level in the static order.

Why a share of turns rather than the aged order itself (which
``aging_share = 1`` gives): in the aged order every LOW item that waited four
steps goes ahead of every new CRITICAL one, so a user's request waited behind
the whole of a batch submitted 40 s before it (8-16 s, found by a hunt). A share
bounds what aging takes from the urgent work and still keeps every level moving
(the Linux deadline I/O scheduler's ``writes_starved`` rations starved writes
against reads the same way).

With one tenant waiting for a model (the common case: an embedded system whose
requests carry no ``budget_tag``) step 2 has one answer and steps 1 and 3 take
the static order's first item, or on an aged turn the aged order's first: the
queue behaves, and costs, as if there were no tenants.

*Start-time fair queuing* (SFQ: Goyal, Vin and Cheng, SIGCOMM 1996), per model
and level: each tenant waiting there has a start tag S, the level a virtual
time V. The tenant with the smallest S takes the turn (ties: the one that began
waiting first); when its item is sent, V becomes that S and the tenant's S
grows by ``cost / weight``. A tenant that begins waiting starts at S = V; one
left with nothing waiting in the level (its last item taken, cancelled,
expired or moved) is forgotten at once, as deficit round robin resets an
empty flow's deficit: it keeps no credit for the time it had nothing waiting,
and gains at most one item's turn by going idle. When a lane turns shared
every tenant waiting there begins at V = 0, the newcomer first on that tie
(the tenant that was alone has just been served). Every S is >= V throughout.

Why SFQ rather than deficit round robin (DRR): costs range from a few tokens
to hundreds of thousands (prompt plus ``max_tokens``), and DRR must pick a
quantum: one below the largest cost makes a turn loop until a tenant has saved
enough (work per item grows with cost / quantum); one above it lets a tenant
take a whole quantum of small items per round, so a light tenant waits behind
that many. SFQ needs no quantum, costs O(log T) per item for T tenants, and
bounds the wait of a tenant that arrives to one item of each other tenant,
whatever the costs and weights. Tags are assigned when a tenant's turn comes,
not at push, so an item taken by another model, cancelled or expired charges
nothing, and neither does one skipped because its deadline cannot be met.

*Settling* (``settle``). A cost is what is known when the item is sent;
what its call costs is known when the call ends. ``settle`` moves the tenant's
S in that level by the difference over its weight (back if it was charged
more than it used, forward if less), as the Virtual Token Counter charges a
client's prompt when its request starts and its answer as it is produced
(Sheng et al., *Fairness in Serving Large Language Models*, OSDI 2024); never
below V, so a settled tenant is at most next, as a newcomer is. A tenant that
has stopped waiting in the level has no S to settle: it starts at V when it
comes back, as any newcomer. callboard charges the prompt at the send and the
rest at the end: charged ``max_tokens`` up front, a light tenant allowing
1024-token answers and getting answers as short as a flood's 16 paid for ~40
of the flood's turns with each item, its backlog grew and it waited 17-20 s at
p99 (a hunt); settling that charge at the end still left it behind at 20 calls
in flight (3.8 s at p99, the bench's ``tenants``), since each of its calls held
the whole charge while in flight. Fairness then holds in the tokens the calls
used, give or take what the calls in flight at each moment will produce
(at most their ``max_tokens``).

*Refunds* (``refund``). An item taken and then given back unsent (its model's
rate limit or breaker said "not yet") was never served: its charge is undone
whole, S back where it was before it, below V if need be (V follows it down,
so every S stays >= V), and an aged turn it was taken on is owed again. Only a
charge the tenant still carries is undone: one that stopped waiting meanwhile
lost it with its S, and comes back at V.

*What holds* (for one model; every statement is per model, since each model's
capacity is shared on its own):

- **Priority first, aging by a share.** A turn goes to a less urgent level
  than the most urgent one waiting only on an aged turn, and at most
  ``aging_share`` of a model's turns are aged (plus one: the first). So a
  CRITICAL item at the head of its level waits for at most one aged turn
  while ``aging_share <= 0.5`` (after an aged turn the credit is below
  ``share``, so the next turn earns less than a whole one; above 0.5, up to
  ``ceil(share / (1 - share))`` in a row, and at 1 every turn the aged order
  gives); under a CRITICAL flood, aged work takes one turn in ``1 / aging_share``,
  and without aging, or while no item has aged past the most urgent level,
  the levels take their turns exactly in priority order. Tenants only choose
  which of a level's items goes: on an aged turn a fresh item of another
  tenant of that level may go before an older item of a more urgent level.
- **Aging.** For items A and B (priorities p_A, p_B) that may go to the same
  model, write ``x = (arrival - epoch) / s``. Since ``x_B - x_A - 1 <
  floor(x_B) - floor(x_A) < x_B - x_A + 1``, and aged ranks (``p + floor(x)``)
  are integers: if ``arrival_B >= arrival_A + (p_A - p_B + 1) * s`` then B's
  aged rank is above A's; if ``arrival_B < arrival_A + (p_A - p_B) * s`` then
  it is at most A's; in between it is A's or one more, and B may come first
  in the aged order only on the tie (an earlier deadline, or equal and pushed
  first). So the first waiting LOW item, if it arrived at t, is ahead in the
  aged order of every item that arrived after t + 4s (CRITICAL), t + 3s
  (HIGH), t + 2s (NORMAL) or t + s (LOW). Once it is the aged order's first,
  every turn it does not get earns a share of one, so its level's turn comes
  within ``1 / aging_share`` turns, and within it each tenant's (fairness,
  below): no item starves while its models keep granting credits and the
  tenants are finitely many. A task re-queued with its original arrival keeps
  its seniority.
- **Fairness** (SFQ's theorem, applied to the turns of one level): while
  tenants i and j both have items waiting in a level, the tokens W_i, W_j of
  the items taken from it satisfy ``|W_i / w_i - W_j / w_j| <= c_i / w_i +
  c_j / w_j``, with w the weights and c each tenant's largest cost. So with
  weights 3:1 two saturating tenants get tokens 3:1, give or take an item each.
  With settling, W counts each item at its cost less what was settled for it
  (a settlement is a change of that item's cost after the fact), save that a
  settlement that would take S below V stops at V: what it would have given
  beyond that is forfeit, as a tenant's credit is when it stops waiting.
- **A light tenant is served within one round.** An item whose tenant had
  nothing waiting in its level gets S = V. Every other tenant has S >= V, and
  S = V only if it began waiting at this V and has not been served since: a
  tenant just served has S > V (costs are positive), and one that was alone
  in the lane loses the tie to the newcomer. So at most one item of each
  other tenant is taken from the level before it, whatever the weights and
  costs; under a flood of one other tenant, none: it is next.
- **Work conservation.** A credit goes unused only if no item may go to the
  model: a tenant alone takes every turn.

*Structure.* ``_live`` maps each key to its one live entry (a tuple, below),
the same tuple in the lane of each of its candidates. A lane holds either one
tenant's entries (``_SoloLane``: per priority, a bucket per rank and a heap of
those ranks; a bucket serves the smaller head of a FIFO deque, for entries
without a deadline pushed in seq order, the common case, O(1), and a heap,
the rest) or,
from the moment a second tenant's item arrives until the lane empties,
several (``_FairLane``: a ``_Level`` per priority, a ``_Flow`` per tenant in
it, each flow bucketed like a solo lane; the flows in a heap by (S, order);
and each flow's first entry in a heap, for the level's first item). A deadline
heap holds ``(deadline, seq, key)``. Removal is lazy: an entry is *live* iff
``_live.get(key) is entry``; popping, cancelling, expiring or retargeting only
changes ``_live``, and stale entries are dropped when met or when the lane is
compacted.

Invariants (checked by the tests):

1. ``len(_live) <= capacity``; a rejected push changes nothing.
2. ``_waiting[m]`` is the number of live items that may go to ``m``; the lane
   ``_lanes[m]`` exists iff ``_waiting[m] > 0`` and then holds exactly one
   live entry per such item. A solo lane's entries are all of its tenant's.
3. A lane is compacted (rebuilt from its live entries) as soon as its stale
   entries outnumber its live ones by more than ``COMPACT_SLACK``, so a
   lane holds at most ``2 * _waiting[m] + COMPACT_SLACK`` entries, and
   likewise for the deadline heap. Compaction costs O(stale), paid for by
   the operations that made those entries stale. A level's records of turns
   and of first entries are rebuilt past ``2 * flows + COMPACT_SLACK``.
4. In a shared lane, a level exists iff it has live entries, a flow iff its
   tenant has live entries in the level, and every S >= the level's V.

Costs (n waiting, c candidates per item, r ranks waiting for a model, P
priorities waiting for it, P <= 4 with callboard's priorities; in a shared
lane also T tenants): push O(c), O(c log n) with a deadline, plus O(c log T)
in shared lanes; pop O(1) per item with one priority waiting, O(P log P)
with several (O(log n) with a deadline, O(log r) when a bucket empties), plus
O(log T) in shared lanes; all amortized over stale
entries. A lane turning shared costs O(m log m) for its m items, once in its
life (it stays shared until it empties): O(log n) a push amortized. cancel
O(c); retarget O(c log n); expire O(k log n) for k items; next_deadline O(1)
amortized; items_for O(the lane), for the rare moves between lanes. A task's
cost does not grow with the backlog (the bench's ``backlog`` scenario checks
10^3 to 10^6).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Final, Generic, TypeAlias, TypeVar

__all__ = ["AGED_RANK", "COMPACT_SLACK", "MIN_AGING_SHARE", "QueueFull", "QueueStats", "TaskQueue"]

T = TypeVar("T")
_INF: Final = math.inf

# (rank, deadline, seq, key, item, candidates, priority, tenant, cost). Heaps
# order entries by (rank, deadline, seq); seq is unique per push, so only an
# item's own entries from before and after a retarget tie there, and those hold
# the same item (equal by identity, never ordered) and differ in candidates
# (str tuples), so the comparison never reaches the fields after them.
Entry: TypeAlias = tuple[int, float, int, int, T, tuple[str, ...], int, str | None, float]
_PUSH_BITS: Final = 32
_PUSH_MASK: Final = (1 << _PUSH_BITS) - 1
"""An entry's seq is its order (the caller's, or the push count) above the push count's
low 32 bits: ordered by arrival, and unique among an item's own entries (a stale one
and its live one come from pushes fewer than 2**32 apart)."""
_SEQ: Final = itemgetter(2)
_LEVEL_BITS: Final = 64
"""A rank is its priority above this many bits of aging windows (``TaskQueue.rank``)."""
_WINDOWS: Final = 1 << (_LEVEL_BITS - 2)
"""The most aging windows a rank counts, either side of the epoch."""
_WHOLE: Final = 1.0 - 1e-9
"""An aged turn's worth of credit (a sum of shares such as ten 0.1s falls short of 1.0)."""
AGED_RANK: Final = -(1 << (_LEVEL_BITS + 8))
"""A rank ahead of every item's: for an item taken on an aged turn and held outside the
queue (``pop_for``'s ``aged``), so that no newcomer takes its place and the turn with it
(a review found the cluster's held ticket displaced by each CRITICAL newcomer, and the
aged task, handed back, never called)."""
MIN_AGING_SHARE: Final = 0.001
"""The least ``aging_share``: one aged turn in a thousand. (With much smaller shares a
float sum of them stops growing short of a whole turn: 1e-17 stalled at 0.125.)"""


class _Bucket(Generic[T]):
    """The entries of one rank: in-order ones in a deque, the rest in a heap."""

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

    def first(self) -> Entry[T] | None:
        """The first entry (live or stale), left in place, or None if empty."""
        fifo, heap = self.fifo, self.heap
        if heap and not (fifo and fifo[0] < heap[0]):
            return heap[0]
        return fifo[0] if fifo else None

    def take(self) -> Entry[T] | None:
        """Remove and return the first entry (live or stale), or None if empty."""
        fifo, heap = self.fifo, self.heap
        if heap and not (fifo and fifo[0] < heap[0]):
            return heapq.heappop(heap)
        return fifo.popleft() if fifo else None


class _Ranked(Generic[T]):
    """Entries in static order: a bucket per rank and a heap of those ranks.

    What must hold: a bucket's deque has increasing seqs and no deadlines;
    ``entries`` counts the buckets' entries, live and stale (``live`` maps a key
    to its one live entry); a bucket found empty is dropped with its rank.
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

    def take(self, live: dict[int, Entry[T]]) -> Entry[T] | None:
        """Remove and return the first live entry (dropping the stale ones before it),
        or None if there is none."""
        buckets, ranks = self.buckets, self.ranks
        while ranks:
            rank = ranks[0]
            entry = buckets[rank].take()
            if entry is None:
                heapq.heappop(ranks)
                del buckets[rank]
                continue
            self.entries -= 1
            if live.get(entry[3]) is entry:
                return entry
        return None

    def first(self, live: dict[int, Entry[T]]) -> Entry[T] | None:
        """The first live entry, left in place (the stale ones before it are dropped)."""
        buckets, ranks = self.buckets, self.ranks
        while ranks:
            rank = ranks[0]
            bucket = buckets[rank]
            entry = bucket.first()
            if entry is None:
                heapq.heappop(ranks)
                del buckets[rank]
            elif live.get(entry[3]) is entry:
                return entry
            else:
                bucket.take()
                self.entries -= 1
        return None

    def compact(self, live: dict[int, Entry[T]]) -> None:
        """Drop the stale entries: O(entries)."""
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

    def live_entries(self, live: dict[int, Entry[T]]) -> Iterator[Entry[T]]:
        """The live entries, in no particular order."""
        for bucket in self.buckets.values():
            for part in (bucket.fifo, bucket.heap):
                for entry in part:
                    if live.get(entry[3]) is entry:
                        yield entry


class _Shared:
    """The ``tenant`` of a lane that holds several tenants' items (never equal to one)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<several tenants>"


_SHARED: Final = _Shared()


class _SoloLane(Generic[T]):
    """A model's waiting entries, all of one tenant: a ``_Ranked`` per priority.

    What must hold: each level holds only entries of its priority; a level may hold
    only stale entries until a turn meets it empty and drops it.
    """

    __slots__ = ("credit", "levels", "tenant")

    def __init__(self, tenant: str | None) -> None:
        self.levels: dict[int, _Ranked[T]] = {}
        self.tenant: str | _Shared | None = tenant
        self.credit = 0.0
        """Aged turns earned (``_turn``)."""

    @property
    def entries(self) -> int:
        """Entries in all levels, live and stale: O(P)."""
        return sum(level.entries for level in self.levels.values())

    def add(self, entry: Entry[T]) -> None:
        level = self.levels.get(entry[6])
        if level is None:
            level = self.levels[entry[6]] = _Ranked()
        level.add(entry)

    def take(self, live: dict[int, Entry[T]], share: float) -> Entry[T] | None:
        """Remove and return the entry whose turn it is (``_turn``), or None if none is
        live."""
        levels = self.levels
        if len(levels) == 1:  # one priority waiting: the common case
            for level in levels.values():
                return level.take(live)
        firsts: list[Entry[T]] = []
        for priority in sorted(levels):
            first = levels[priority].first(live)
            if first is None:
                del levels[priority]  # only stale entries, dropped by ``first``
            else:
                firsts.append(first)
        if not firsts:
            return None
        return levels[_turn(self, firsts, share)].take(live)

    def compact(self, live: dict[int, Entry[T]]) -> None:
        levels = self.levels
        for priority in list(levels):
            level = levels[priority]
            level.compact(live)
            if not level.entries:
                del levels[priority]

    def live_entries(self, live: dict[int, Entry[T]]) -> Iterator[Entry[T]]:
        for level in self.levels.values():
            yield from level.live_entries(live)


class _Flow(_Ranked[T]):
    """One tenant's entries in one level of a shared lane, and its place in the turns."""

    __slots__ = ("best", "charged", "live", "order", "start", "tenant", "weight")

    def __init__(self, tenant: str | None, weight: float, start: float, order: int) -> None:
        super().__init__()
        self.tenant = tenant
        self.weight = weight
        self.start = start
        """The tenant's start tag S: its next item's turn, in the level's virtual time."""
        self.charged = 0.0
        """What its items sent since it began waiting were charged, less refunds: the
        most a ``refund`` can give back."""
        self.order = order
        """When it began waiting (breaks ties of S: the first to wait goes first)."""
        self.live = 0
        """Its live entries."""
        self.best: Entry[T] | None = None
        """The entry last recorded as this flow's first in the level's ``heads``."""


class _Level(Generic[T]):
    """One priority's entries in a shared lane: a flow per tenant, turns by SFQ.

    What must hold: ``flows`` holds exactly the tenants with live entries here
    (a tenant left with none is forgotten at once, its stale entries with it);
    ``turns`` holds ``(start, order, flow)`` for each of them, with ``start``
    its current S, every S >= ``vtime``, and records of forgotten flows and
    superseded ones (a settled S: ``start`` is not the flow's); each
    flow's ``best`` is its first live entry, or an earlier one of its entries
    gone stale since, and is in ``heads``, with records superseded since;
    ``turns`` and ``heads`` hold at most ``2 * len(flows) + COMPACT_SLACK``
    records after any change but a new flow's; ``live`` and ``entries``
    count the flows' live entries and all their entries.
    """

    __slots__ = (
        "_served",
        "activations",
        "entries",
        "flows",
        "heads",
        "live",
        "turns",
        "vtime",
    )

    def __init__(self) -> None:
        self.flows: dict[str | None, _Flow[T]] = {}
        self.turns: list[tuple[float, int, _Flow[T]]] = []
        self.heads: list[Entry[T]] = []
        self.vtime = 0.0
        """V: the start tag of the last item sent."""
        self.activations = 0
        self.live = 0
        self.entries = 0
        self._served: tuple[float, _Flow[T] | None] = (0.0, None)
        """The last ``take``: the S of its turn, and its flow unless forgotten since."""

    def add(self, entry: Entry[T], weights: Mapping[str, float]) -> None:
        tenant = entry[7]
        flow = self.flows.get(tenant)
        if flow is None:  # the tenant begins waiting here: S = V
            weight = 1.0 if tenant is None else weights.get(tenant, 1.0)
            flow = self.flows[tenant] = _Flow(tenant, weight, self.vtime, self.activations)
            self.activations += 1
            heapq.heappush(self.turns, (flow.start, flow.order, flow))
        flow.add(entry)
        flow.live += 1
        self.live += 1
        self.entries += 1
        best = flow.best
        if best is None or entry < best:
            flow.best = entry
            heads = self.heads
            heapq.heappush(heads, entry)
            if len(heads) > 2 * len(self.flows) + COMPACT_SLACK:
                self._record_heads()

    def gone(self, entry: Entry[T]) -> None:
        """``entry``, live here, was taken elsewhere, cancelled, expired or moved."""
        flow = self.flows[entry[7]]
        flow.live -= 1
        self.live -= 1
        if not flow.live:
            self._forget(flow)

    def first(self, live: dict[int, Entry[T]]) -> Entry[T] | None:
        """The level's first live entry in the static order, left in place, or None."""
        heads, flows = self.heads, self.flows
        while heads:
            entry = heads[0]
            flow = flows.get(entry[7])
            if flow is None or flow.best is not entry:  # superseded by a later record
                heapq.heappop(heads)
            elif live.get(entry[3]) is entry:
                return entry
            else:  # gone: record the flow's first live entry instead
                before = flow.entries
                head = flow.best = flow.first(live)
                self.entries -= before - flow.entries
                assert head is not None  # a flow in ``flows`` has a live entry
                heapq.heapreplace(heads, head)
        return None

    def take(self, live: dict[int, Entry[T]]) -> Entry[T]:
        """Remove and return the first live entry of the tenant whose turn it is (its S
        stays until ``charge``); a tenant left with nothing live is forgotten.
        The level must hold a live entry."""
        turns, flows = self.turns, self.flows
        while True:
            start, _, flow = turns[0]
            if flows.get(flow.tenant) is flow and start == flow.start:
                break
            heapq.heappop(turns)  # a forgotten tenant's record, or one settled since
        before = flow.entries
        entry = flow.take(live)
        assert entry is not None  # a flow in ``flows`` has a live entry
        self.entries -= before - flow.entries
        flow.live -= 1
        self.live -= 1
        if flow.live:
            self._served = (start, flow)
        else:
            self._served = (start, None)
            self._forget(flow)
        return entry

    def charge(self, entry: Entry[T]) -> None:
        """``entry``, just taken, is sent: V becomes its turn's S, and its tenant's S
        grows by its cost over the tenant's weight."""
        start, flow = self._served
        self.vtime = start
        if flow is not None and self.flows.get(flow.tenant) is flow:
            flow.charged += entry[8]
            flow.start = start + entry[8] / flow.weight
            heapq.heapreplace(self.turns, (flow.start, flow.order, flow))  # it is first

    def settle(self, tenant: str | None, over: float) -> None:
        """``tenant``'s item sent from here was charged ``over`` tokens more than its call
        used (negative: fewer): its S moves back by ``over`` over its weight, never
        below V, if it still waits here."""
        flow = self.flows.get(tenant)
        if flow is None:
            return
        self._move(flow, max(self.vtime, flow.start - over / flow.weight))

    def refund(self, tenant: str | None, cost: float) -> None:
        """An item of ``tenant``'s that was charged ``cost`` when it was taken came back
        unsent: the charge is undone, its S back where it was before it (V with it, if
        that is below V), if the tenant has waited here since; a tenant that stopped
        waiting meanwhile was never charged (and comes back at V, as any newcomer)."""
        flow = self.flows.get(tenant)
        if flow is None:
            return
        back = min(cost, flow.charged)
        flow.charged -= back
        start = flow.start - back / flow.weight
        self.vtime = min(self.vtime, start)
        self._move(flow, start)

    def _move(self, flow: _Flow[T], start: float) -> None:
        """``flow``'s S becomes ``start``."""
        if start == flow.start:
            return
        flow.start = start
        turns = self.turns
        heapq.heappush(turns, (start, flow.order, flow))  # the old record goes when met
        if len(turns) > 2 * len(self.flows) + COMPACT_SLACK:
            self._record_turns()

    def compact(self, live: dict[int, Entry[T]]) -> None:
        """Drop the stale entries and records."""
        for flow in self.flows.values():
            flow.compact(live)
            flow.best = flow.first(live)
        self.entries = self.live
        self._record_turns()
        self._record_heads()

    def _forget(self, flow: _Flow[T]) -> None:
        """``flow`` has nothing live: drop it and its stale entries (its records in
        ``turns`` and ``heads`` go when met, or when such records pile up)."""
        flows = self.flows
        del flows[flow.tenant]
        self.entries -= flow.entries
        bound = 2 * len(flows) + COMPACT_SLACK
        if len(self.turns) > bound:
            self._record_turns()
        if len(self.heads) > bound:
            self._record_heads()

    def _record_turns(self) -> None:
        """Rebuild ``turns`` from ``flows``: O(T)."""
        self.turns = [(f.start, f.order, f) for f in self.flows.values()]
        heapq.heapify(self.turns)

    def _record_heads(self) -> None:
        """Rebuild ``heads`` from the flows' ``best`` records: O(T)."""
        heads = [f.best for f in self.flows.values() if f.best is not None]
        heapq.heapify(heads)
        self.heads = heads


class _FairLane(Generic[T]):
    """A model's waiting entries once more than one tenant's are among them: a level
    per priority that has live entries (``_turn`` chooses the level), and within it,
    turns by SFQ."""

    __slots__ = ("_last", "credit", "levels", "weights")

    tenant: Final = _SHARED

    def __init__(self, weights: Mapping[str, float], credit: float = 0.0) -> None:
        self.levels: dict[int, _Level[T]] = {}
        self.weights = weights
        self._last: _Level[T] | None = None
        """The level of the last ``take``, which ``charge`` charges."""
        self.credit = credit
        """Aged turns earned (``_turn``)."""

    @classmethod
    def of(
        cls,
        solo: _SoloLane[T],
        newcomer: Entry[T],
        live: dict[int, Entry[T]],
        weights: Mapping[str, float],
    ) -> _FairLane[T]:
        """A shared lane holding ``solo``'s live entries and ``newcomer``, another
        tenant's: O(m log m), once per lane. Every tenant begins at S = V = 0; the
        newcomer's goes first on that tie, since the solo tenant has just been served."""
        lane = cls(weights, solo.credit)
        lane.add(newcomer)
        for entry in sorted(solo.live_entries(live), key=_SEQ):  # keeps the flows' deques
            lane.add(entry)
        return lane

    @property
    def entries(self) -> int:
        """Entries in all flows, live and stale: O(P)."""
        return sum(level.entries for level in self.levels.values())

    def add(self, entry: Entry[T]) -> None:
        priority = entry[6]
        level = self.levels.get(priority)
        if level is None:
            level = self.levels[priority] = _Level()
        level.add(entry, self.weights)

    def gone(self, entry: Entry[T]) -> None:
        """``entry``, live here, left the queue or this model without being taken here."""
        priority = entry[6]
        level = self.levels[priority]
        level.gone(entry)
        if not level.live:
            del self.levels[priority]

    def take(self, live: dict[int, Entry[T]], share: float) -> Entry[T]:
        """Remove and return the entry whose turn it is. The lane must hold a live one."""
        levels = self.levels
        if len(levels) == 1:
            priority, level = next(iter(levels.items()))
        else:
            firsts: list[Entry[T]] = []
            for p in sorted(levels):
                first = levels[p].first(live)
                assert first is not None  # a level in ``levels`` has a live entry
                firsts.append(first)
            priority = _turn(self, firsts, share)
            level = levels[priority]
        self._last = level
        entry = level.take(live)
        if not level.live:
            del levels[priority]
        return entry

    def charge(self, entry: Entry[T]) -> None:
        """``entry``, the last one taken, is sent (see ``_Level.charge``)."""
        assert self._last is not None
        self._last.charge(entry)

    def settle(self, priority: int, tenant: str | None, over: float) -> None:
        """See ``_Level.settle``: nothing, if no item of ``priority`` waits here."""
        level = self.levels.get(priority)
        if level is not None:
            level.settle(tenant, over)

    def refund(self, priority: int, tenant: str | None, cost: float) -> None:
        """See ``_Level.refund``: nothing, if no item of ``priority`` waits here."""
        level = self.levels.get(priority)
        if level is not None:
            level.refund(tenant, cost)

    def compact(self, live: dict[int, Entry[T]]) -> None:
        for level in self.levels.values():
            level.compact(live)

    def live_entries(self, live: dict[int, Entry[T]]) -> Iterator[Entry[T]]:
        for level in self.levels.values():
            for flow in level.flows.values():
                yield from flow.live_entries(live)


Lane: TypeAlias = "_SoloLane[T] | _FairLane[T]"


def _aged(entry: Entry[T]) -> tuple[int, float, int]:
    """``entry``'s place in the aged order: (priority + aging windows, deadline, seq)."""
    priority = entry[6]
    return (priority + entry[0] - (priority << _LEVEL_BITS), entry[1], entry[2])


def _turn(lane: _SoloLane[T] | _FairLane[T], firsts: list[Entry[T]], share: float) -> int:
    """The priority whose turn it is in ``lane``, given each waiting level's first
    live entry, most urgent level first: that level's, unless the first entry in the
    aged order is of another level and ``lane`` has earned an aged turn (each such
    turn earns ``share`` of one)."""
    top = firsts[0]
    aged = min(firsts, key=_aged)
    if aged is top:
        return top[6]
    lane.credit += share
    if lane.credit < _WHOLE:
        return top[6]
    lane.credit -= 1.0
    return aged[6]


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
    shared_models: int
    """Models whose waiting items are (or were, since the model last had none
    waiting) of more than one tenant, so take turns by weight."""
    heap_entries: int
    """Entries in all model lanes, live and stale."""
    deadline_entries: int
    """Entries in the deadline heap, live and stale."""
    with_deadline: int
    """Live items that have a deadline."""


class TaskQueue(Generic[T]):
    """A bounded priority queue of items, each of which may go to several models,
    shared between tenants by weight within a priority level."""

    __slots__ = (
        "_aging_share",
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
        "_weights",
    )

    def __init__(
        self,
        *,
        capacity: int,
        aging_step_s: float | None = 10.0,
        aging_share: float = 0.1,
        epoch: float = 0.0,
        tenant_weights: Mapping[str, float] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity!r}")
        if aging_step_s is not None and not (0.0 < aging_step_s < _INF):
            raise ValueError(
                f"aging_step_s must be positive and finite or None, got {aging_step_s!r}"
            )
        if not MIN_AGING_SHARE <= aging_share <= 1.0:
            raise ValueError(
                f"aging_share must be at least {MIN_AGING_SHARE} and at most 1, got {aging_share!r}"
            )
        if not math.isfinite(epoch):
            raise ValueError(f"epoch must be finite, got {epoch!r}")
        weights = dict(tenant_weights or {})
        for tenant, weight in weights.items():
            if not isinstance(tenant, str):
                raise TypeError(f"a tenant must be a string, got {tenant!r}")
            if not 0.0 < weight < _INF:
                raise ValueError(f"tenant {tenant!r} must weigh more than 0, got {weight!r}")
        self._capacity = capacity
        self._aging_step_s = aging_step_s
        self._aging_share = aging_share
        self._epoch = epoch
        self._weights = weights
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
        tenant: str | None = None,
        cost: float = 1.0,
        order: int | None = None,
    ) -> None:
        """Queue ``item`` under ``key``, for ``tenant`` (None: the untagged tenant),
        charged ``cost`` (tokens, say) when it is sent. Ties go by ``order`` (a number
        that grows with arrival, such as a task id: an item that comes back keeps its
        place among those that came after it), else by push.

        Raises ``ValueError`` for a key already waiting, no candidates, a
        non-finite arrival, a NaN deadline, a cost that is not positive and
        finite or an ``order`` that is not an int >= 0; ``TypeError`` for a tenant
        that is not a string; ``QueueFull`` at capacity. Either way the queue is
        unchanged. A deadline of +inf counts as none.
        """
        cands = self._candidates(candidates)
        if key in self._live:
            raise ValueError(f"key {key!r} is already waiting")
        if not math.isfinite(arrival):
            raise ValueError(f"arrival must be finite, got {arrival!r}")
        dl = _INF if deadline is None else float(deadline)
        if math.isnan(dl):
            raise ValueError("deadline must not be NaN")
        if not 0.0 < cost < _INF:
            raise ValueError(f"cost must be positive and finite, got {cost!r}")
        if tenant is not None and type(tenant) is not str:
            raise TypeError(f"a tenant must be a string or None, got {tenant!r}")
        if order is not None and not (type(order) is int and order >= 0):
            raise ValueError(f"order must be an int >= 0, got {order!r}")
        if len(self._live) >= self._capacity:
            raise QueueFull(self._capacity)
        push = self._seq
        self._seq = push + 1
        seq = ((push if order is None else order) << _PUSH_BITS) | (push & _PUSH_MASK)
        rank = self.rank(priority, arrival)
        entry: Entry[T] = (rank, dl, seq, key, item, cands, priority, tenant, cost)
        self._live[key] = entry
        self._enter(entry, cands, tenant)
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
        new: Entry[T] = (*old[:5], cands, *old[6:])
        self._live[key] = new
        self._enter(new, cands, new[7])  # before leaving, so shared models keep their lane
        self._leave_models(old, None)
        return True

    # -- taking out -----------------------------------------------------------

    def pop_for(
        self,
        model: str,
        now: float,
        n: int = 1,
        *,
        min_remaining_s: float = 0.0,
        aged: list[T] | None = None,
    ) -> tuple[list[T], list[T]]:
        """Remove and return ``(taken, skipped)`` for ``n`` credits of ``model``.

        ``taken`` holds up to ``n`` items whose turn it is for ``model``, in turn
        order. ``skipped`` holds the items met on the way whose deadline
        cannot be met: ``deadline <= now`` (as ``expire`` counts it) or
        ``deadline - now < min_remaining_s``; they are removed too (their
        tenant is not charged), and the caller reports them expired. Fewer
        than ``n`` are taken only when no other item may go to ``model``.
        ``aged``, if given, gets the taken items that went on an aged turn too:
        a caller that holds items outside the queue ranks those ``AGED_RANK``,
        so that no newcomer takes back the turn they were given.
        """
        if n < 0:
            raise ValueError(f"n must not be negative, got {n!r}")
        taken: list[T] = []
        skipped: list[T] = []
        lane = self._lanes.get(model)
        if lane is None:  # no live item may go to model
            return taken, skipped
        live, waiting, share = self._live, self._waiting, self._aging_share
        fair = type(lane) is _FairLane
        while len(taken) < n:
            credit = lane.credit
            entry = lane.take(live, share)  # invariant 2: the lane holds a live entry
            assert entry is not None
            del live[entry[3]]
            self._leave(entry, model)
            dl = entry[1]
            if dl <= now or dl - now < min_remaining_s:
                skipped.append(entry[4])
            else:
                taken.append(entry[4])
                if aged is not None and lane.credit < credit:  # only an aged turn spends
                    aged.append(entry[4])
                if fair:
                    lane.charge(entry)  # type: ignore[union-attr]  # fair: a _FairLane
            if model not in waiting:  # nothing left: the lane was dropped
                return taken, skipped
        self._compact_model(model, waiting[model])
        return taken, skipped

    def settle(self, model: str, settled: Iterable[tuple[int, str | None, float]]) -> None:
        """For each ``(priority, tenant, over)``: an item of ``tenant`` and ``priority``
        that ``pop_for(model)`` took was charged ``over`` more than its call used
        (negative: less): its tenant's S there moves back by ``over / weight``, never
        below V, if the tenant still waits for ``model`` at ``priority`` in a shared
        lane (see *Settling*); else nothing. ``ValueError`` for an ``over`` that is
        not finite, and then nothing is settled."""
        settled = tuple(settled)
        for _, _, over in settled:
            if not math.isfinite(over):
                raise ValueError(f"over must be finite, got {over!r}")
        lane = self._lanes.get(model)
        if type(lane) is _FairLane:
            for priority, tenant, over in settled:
                lane.settle(priority, tenant, over)

    def refund(
        self, model: str, refunds: Iterable[tuple[int, str | None, float]], aged: int = 0
    ) -> None:
        """Items ``pop_for(model)`` took came back unsent, as if never taken: each
        ``(priority, tenant, cost)`` undoes that item's charge (see *Settling*), and
        ``aged`` of them were taken on aged turns, which ``model`` owes again. Left
        standing, a tenant whose large calls a rate limit sent back each time it was
        their turn paid again at every turn and went behind every other tenant (both
        calls of a test after 100 small ones), and an aged LOW item lost its turn at
        each hand-back to the CRITICAL flood it was to get past (found by a hunt).
        ``ValueError`` for a cost that is not finite or an ``aged`` below 0, and then
        nothing is refunded."""
        refunds = tuple(refunds)
        for _, _, cost in refunds:
            if not math.isfinite(cost):
                raise ValueError(f"cost must be finite, got {cost!r}")
        if aged < 0:
            raise ValueError(f"aged must not be negative, got {aged!r}")
        lane = self._lanes.get(model)
        if lane is None:
            return
        lane.credit += aged
        if type(lane) is _FairLane:
            for priority, tenant, cost in refunds:
                lane.refund(priority, tenant, cost)

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

    def rank(self, priority: int, arrival: float) -> int:
        """The rank of an item of ``priority`` that arrived at ``arrival``: the first part
        of its key in the static order (module docstring: its priority, then its aging
        window), for a caller comparing items held outside the queue as the queue's
        static order would."""
        step = self._aging_step_s
        if step is None:
            return priority << _LEVEL_BITS
        windows = (arrival - self._epoch) / step
        if not -_WINDOWS < windows < _WINDOWS:
            windows = math.copysign(_WINDOWS, windows)
        return (priority << _LEVEL_BITS) + math.floor(windows)

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
        return [entry[4] for entry in lane.live_entries(self._live)]

    def statistics(self) -> QueueStats:
        """Sizes of the queue and of its bookkeeping."""
        lanes = self._lanes.values()
        return QueueStats(
            waiting=len(self._live),
            capacity=self._capacity,
            models=len(self._lanes),
            shared_models=sum(lane.tenant is _SHARED for lane in lanes),
            heap_entries=sum(lane.entries for lane in lanes),
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
            f"models={len(self._lanes)}, aging_step_s={self._aging_step_s!r}, "
            f"aging_share={self._aging_share!r})"
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

    def _enter(self, entry: Entry[T], cands: tuple[str, ...], tenant: str | None) -> None:
        """Put ``entry`` (of ``tenant``) into the lane of each of its candidates; a solo
        lane meeting a second tenant turns shared."""
        lanes = self._lanes
        waiting = self._waiting
        for model in cands:
            lane = lanes.get(model)
            if lane is None:
                lane = lanes[model] = _SoloLane(tenant)
                waiting[model] = 1
            else:
                waiting[model] += 1
                if lane.tenant != tenant and type(lane) is _SoloLane:
                    lanes[model] = _FairLane.of(lane, entry, self._live, self._weights)
                    continue
            lane.add(entry)

    def _leave(self, entry: Entry[T], popped_from: str | None) -> None:
        """Account for ``entry`` having left ``_live`` (its lane entries went stale)."""
        self._leave_models(entry, popped_from)
        if entry[1] < _INF:
            self._n_deadlined -= 1
            self._compact_deadlines()

    def _leave_models(self, entry: Entry[T], popped_from: str | None) -> None:
        """``entry`` left each of its candidates' lanes: count one live item less for
        each; drop, tell (a shared lane) or compact them.

        The lane being popped (``popped_from``) took the entry itself and is
        compacted by ``pop_for`` when it is done with it.
        """
        waiting, lanes = self._waiting, self._lanes
        for model in entry[5]:
            left = waiting[model] - 1
            if left == 0:  # every entry left in the lane is stale
                del waiting[model]
                del lanes[model]
            else:
                waiting[model] = left
                if model != popped_from:
                    lane = lanes[model]
                    if type(lane) is _FairLane:
                        lane.gone(entry)
                    if lane.entries > 2 * left + COMPACT_SLACK:
                        lane.compact(self._live)

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
