"""The ledger: the one record of every task's life. Actors are disposable; this is the truth.

Each task moves through::

    ACCEPTED --route--> ROUTED --dispatch--> IN_FLIGHT(model, incarnation)
                          ^                        |
                          +-------reclaim----------+      (retry elsewhere, fallback,
                                                           dead incarnation, handed back)
    any live state --finish--> (gone; counted as finished)

What must always hold (checked by ``check``, shown in stats):

    accepted == routing + queued + in_flight + finished

``finish`` is the single place a result is delivered: it records the outcome
first, then resolves the caller's future, and it succeeds once per task; every
later attempt to finish the same task is refused. That makes results
exactly-once towards the caller whatever crashes and duplicates happen
upstream. The ledger is a thread-safe store, not an actor, so it outlives
every actor restart: a restarted queue rebuilds its heap from ``routed()``, a
restarted model reclaims its dead incarnation's calls with ``in_flight_of``.

The in-memory ledger forgets a task once finished (it keeps counts and a
bounded set of finished idempotency keys); a durable ledger keeps results.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import InvalidStateError
from dataclasses import dataclass

from callboard.messages import Job, Result, Task

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    ACCEPTED = "accepted"
    ROUTED = "routed"
    IN_FLIGHT = "in_flight"


@dataclass(slots=True)
class Entry:
    """The ledger's mutable record of one live task (only touched under the lock)."""

    task: Task
    stage: Stage
    job: Job | None = None
    model: str | None = None
    incarnation: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerCounts:
    """A consistent snapshot of the ledger's counters."""

    accepted: int
    rejected: int
    routing: int
    queued: int
    in_flight: int
    finished: int

    @property
    def live(self) -> int:
        return self.routing + self.queued + self.in_flight

    @property
    def balanced(self) -> bool:
        return self.accepted == self.live + self.finished


class Ledger:
    """In-memory ledger; thread-safe; every method is O(1) except the recovery scans."""

    def __init__(self, *, remember_keys: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._live: dict[int, Entry] = {}
        self._stage_counts = dict.fromkeys(Stage, 0)
        self._accepted = 0
        self._finished = 0
        self._rejected = 0
        self._delivering = 0
        self._announced: set[int] = set()
        self._keys: dict[str, int] = {}
        self._finished_keys: OrderedDict[str, int] = OrderedDict()
        self._remember_keys = remember_keys

    def next_id(self) -> int:
        return next(self._ids)

    def skip_ids(self, used: int) -> None:
        """Continue numbering after ``used`` (a durable ledger reopened)."""
        self._ids = itertools.count(used + 1)

    def close(self, timeout: float = 10.0) -> None:
        """Flush whatever a durable ledger still has to write (nothing here)."""

    def _persist_accept(self, task: Task) -> None:
        """Hook for a durable ledger: a task was accepted (called outside the lock)."""

    # -- life of a task ---------------------------------------------------

    def announce(self, tasks: Iterable[Task]) -> None:
        """Tasks are on their way to the front door: the ledger is not idle until each
        is accepted or rejected (so ``wait_idle`` right after a submit waits for it)."""
        with self._lock:
            self._announced.update(t.task_id for t in tasks)

    def accept(self, task: Task) -> int | None:
        """Record a new task. Returns None, or the id of the task already holding its key."""
        key = task.request.idempotency_key
        with self._lock:
            self._announced.discard(task.task_id)
            if task.task_id in self._live:  # a redelivered Submit: already accepted
                return None
            if key is not None:
                holder = self._keys.get(key) or self._finished_keys.get(key)
                if holder is not None:
                    return holder
                self._keys[key] = task.task_id
            self._live[task.task_id] = Entry(task, Stage.ACCEPTED)
            self._stage_counts[Stage.ACCEPTED] += 1
            self._accepted += 1
        self._persist_accept(task)
        return None

    def route(self, job: Job) -> bool:
        """ACCEPTED -> ROUTED. False if the task is not waiting to be routed."""
        with self._lock:
            entry = self._live.get(job.task.task_id)
            if entry is None or entry.stage is not Stage.ACCEPTED:
                return False
            self._move(entry, Stage.ROUTED)
            entry.job = job
            return True

    def dispatch(self, job: Job, model: str, incarnation: int) -> bool:
        """ROUTED -> IN_FLIGHT at a model incarnation. False if not queued (drop it)."""
        with self._lock:
            entry = self._live.get(job.task.task_id)
            if entry is None or entry.stage is not Stage.ROUTED:
                return False
            self._move(entry, Stage.IN_FLIGHT)
            entry.job, entry.model, entry.incarnation = job, model, incarnation
            return True

    def reclaim(self, job: Job, model: str, incarnation: int) -> bool:
        """IN_FLIGHT at (model, incarnation) -> ROUTED with ``job``; False if not there."""
        with self._lock:
            entry = self._live.get(job.task.task_id)
            if (
                entry is None
                or entry.stage is not Stage.IN_FLIGHT
                or entry.model != model
                or entry.incarnation != incarnation
            ):
                return False
            self._move(entry, Stage.ROUTED)
            entry.job, entry.model = job, None
            return True

    def finish(self, task: Task, result: Result) -> bool:
        """Record the outcome, then deliver it. True the first time only."""
        with self._lock:
            entry = self._live.pop(task.task_id, None)
            if entry is None:
                return False
            self._stage_counts[entry.stage] -= 1
            self._finished += 1
            self._delivering += 1
            key = task.request.idempotency_key
            if key is not None:
                self._keys.pop(key, None)
                self._finished_keys[key] = task.task_id
                if len(self._finished_keys) > self._remember_keys:
                    self._finished_keys.popitem(last=False)
        self._record_then_deliver(task, result)
        return True

    def reject(self, task: Task, result: Result) -> None:
        """Deliver the result of a task that was never accepted (refused at the door)."""
        with self._lock:
            self._rejected += 1
            self._delivering += 1
            self._announced.discard(task.task_id)
        self._delivered(task, result)

    def _record_then_deliver(self, task: Task, result: Result) -> None:
        """Make the outcome durable, then deliver it. In memory it is recorded already;
        a durable ledger overrides this to commit first (off the caller's thread)."""
        self._delivered(task, result)

    def _delivered(self, task: Task, result: Result) -> None:
        try:
            _resolve(task, result)
        finally:
            with self._lock:
                self._delivering -= 1
                self._idle.notify_all()  # idle waiters and backpressure waiters

    def _is_idle(self) -> bool:
        return not self._live and not self._delivering and not self._announced

    def forget(self, tasks: Iterable[Task]) -> None:
        """These announced tasks will never arrive (their submit failed)."""
        with self._lock:
            self._announced.difference_update(t.task_id for t in tasks)
            if self._is_idle():
                self._idle.notify_all()

    def forget_announced(self) -> None:
        """Shutdown: whatever never reached the front door was dealt with by the sweep."""
        with self._lock:
            self._announced.clear()
            if self._is_idle():
                self._idle.notify_all()

    def _move(self, entry: Entry, stage: Stage) -> None:
        self._stage_counts[entry.stage] -= 1
        self._stage_counts[stage] += 1
        entry.stage = stage

    # -- queries ----------------------------------------------------------

    def wait_for_room(self, capacity: int, extra: int, timeout: float) -> bool:
        """Block until ``extra`` more tasks fit under ``capacity`` (backpressure)."""
        with self._idle:
            return self._idle.wait_for(
                lambda: len(self._live) + len(self._announced) + extra <= capacity, timeout
            )

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no task is live (or the timeout passes); True if idle."""
        with self._idle:
            return self._idle.wait_for(self._is_idle, timeout)

    def stage_of(self, task_id: int) -> Stage | None:
        with self._lock:
            entry = self._live.get(task_id)
            return None if entry is None else entry.stage

    def is_routed(self, task_id: int) -> bool:
        entry = self._live.get(task_id)
        return entry is not None and entry.stage is Stage.ROUTED

    def is_live(self, task_id: int) -> bool:
        return task_id in self._live

    def live_count(self) -> int:
        return len(self._live)

    def counts(self) -> LedgerCounts:
        with self._lock:
            c = self._stage_counts
            return LedgerCounts(
                accepted=self._accepted,
                rejected=self._rejected,
                routing=c[Stage.ACCEPTED],
                queued=c[Stage.ROUTED],
                in_flight=c[Stage.IN_FLIGHT],
                finished=self._finished,
            )

    def accepted_tasks(self) -> list[Task]:
        """Tasks waiting to be routed (for a restarted router)."""
        with self._lock:
            return [e.task for e in self._live.values() if e.stage is Stage.ACCEPTED]

    def routed(self) -> list[Job]:
        """Jobs waiting in the queue (for a restarted queue), in id order."""
        with self._lock:
            jobs = [e.job for e in self._live.values() if e.stage is Stage.ROUTED]
        return [j for j in jobs if j is not None]

    def in_flight_of(self, model: str, *, below: int) -> list[tuple[Job, int]]:
        """(job, incarnation) in flight at ``model`` incarnations older than ``below``."""
        with self._lock:
            return [
                (e.job, e.incarnation)
                for e in self._live.values()
                if e.stage is Stage.IN_FLIGHT
                and e.model == model
                and e.incarnation < below
                and e.job is not None
            ]

    def live_tasks(self) -> list[Task]:
        with self._lock:
            return [e.task for e in self._live.values()]

    def finish_all(self, results: Iterable[tuple[Task, Result]]) -> int:
        return sum(self.finish(task, result) for task, result in results)


def _resolve(task: Task, result: Result) -> None:
    future = task.future
    if future is not None and not future.done():
        try:
            future.set_result(result)
        except InvalidStateError:  # cancelled by its caller in the meantime
            log.debug("task %d: caller cancelled before the result", task.task_id)
