"""Lanes: how the queue core keeps one model's waiting entries (see ``pqueue``).

A lane holds a bucket per rank and a heap of the ranks that have a bucket.
Within a bucket every entry has the same rank, so its order is (deadline,
seq): a FIFO deque holds the entries added in seq order with no deadline,
and a heap holds the rest. ``take`` serves the smaller of the two heads, so a
lane hands out entries in exactly (rank, deadline, seq) order.

What must hold: the deque's seqs increase from head to tail and every one of
its entries has no deadline; ``entries`` counts what the buckets hold, live
and stale (liveness is the queue's business, not the lane's); a bucket that
``take`` finds empty is dropped with its rank.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Final, Generic, TypeAlias, TypeVar

__all__ = ["Entry", "Lane"]

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
    """One model's waiting entries: a bucket per rank and a heap of those ranks."""

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
