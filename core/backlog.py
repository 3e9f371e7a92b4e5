"""Backlog: the jobs a model actor holds unsent, in the order they are to go.

Two places: ``waiting``, the jobs granted to this model that wait for
admission, first come first served; and ``retrying``, the jobs whose call
failed and that wait off the concurrency cap for their retry time, as a heap
by (due time, seq). A retry that falls due leaves (``take_due``): the model
hands it back to the queue, where priority decides when it goes.

What must hold: a job is in at most one of the two; the operations keep the
order of what they leave, and ``waiting`` stays the same deque object
throughout. Pure: no actor, thread or clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from callboard.core.admission import earliest
from callboard.messages import Job

__all__ = ["Backlog"]

T = TypeVar("T")


class Backlog:
    """What one model holds unsent: jobs waiting for admission, jobs waiting to retry."""

    __slots__ = ("_seq", "retrying", "waiting")

    def __init__(self) -> None:
        self.waiting: deque[Job] = deque()
        self.retrying: list[tuple[float, int, Job]] = []
        self._seq = itertools.count()

    def retry_at(self, at: float, job: Job) -> None:
        """Hold ``job`` off the cap until ``at``."""
        heapq.heappush(self.retrying, (at, next(self._seq), job))

    def next_retry(self) -> float | None:
        """When the first retry is due, or None if none waits."""
        return self.retrying[0][0] if self.retrying else None

    def take_due(self, now: float) -> tuple[Job, ...]:
        """Take out the retries due by ``now``; return them in due order."""
        due = []
        while self.retrying and self.retrying[0][0] <= now:
            due.append(heapq.heappop(self.retrying)[2])
        return tuple(due)

    def take_waiting(self) -> tuple[Job, ...]:
        """Empty ``waiting``; return what it held, in order."""
        jobs = tuple(self.waiting)
        self.waiting.clear()
        return jobs

    def take_retrying(self) -> tuple[Job, ...]:
        """Empty ``retrying``; return what it held, in due order."""
        jobs = tuple(job for _, _, job in sorted(self.retrying))
        self.retrying = []
        return jobs

    def pull_waiting(self, pick: Callable[[Job], T | None]) -> list[tuple[Job, T]]:
        """Take out of ``waiting`` each job ``pick`` answers for (not None), in order,
        with that answer; the rest stay in order. ``pick`` sees each job once."""
        pulled: list[tuple[Job, T]] = []
        keep: list[Job] = []
        for job in self.waiting:
            answer = pick(job)
            if answer is None:
                keep.append(job)
            else:
                pulled.append((job, answer))
        self.waiting.clear()
        self.waiting.extend(keep)
        return pulled

    def next_deadline(self) -> float | None:
        """The soonest deadline among the waiting jobs, if any has one."""
        first: float | None = None
        for job in self.waiting:
            first = earliest(first, job.task.deadline_at)
        return first

    def drop(self, wanted: Callable[[Job], bool]) -> list[Job]:
        """Take out every held job ``wanted`` answers True for: the waiting ones in
        order, then the retrying ones."""
        dropped = [j for j in self.waiting if wanted(j)]
        dropped += [j for _, _, j in self.retrying if wanted(j)]
        if dropped:
            keep = [j for j in self.waiting if not wanted(j)]
            self.waiting.clear()
            self.waiting.extend(keep)
            self.retrying = [r for r in self.retrying if not wanted(r[2])]
            heapq.heapify(self.retrying)
        return dropped
