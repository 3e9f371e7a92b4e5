"""The ledger: the one record of every task's life. Actors are disposable; this is the truth.

Each task moves through::

    ACCEPTED --route--> ROUTED --dispatch--> IN_FLIGHT(model, incarnation)
                          ^                        |
                          +-------reclaim----------+      (retry elsewhere, fallback,
                                                           dead incarnation, handed back)
    any live state --finish--> (gone; counted as finished)

What must always hold (``counts().balanced``, shown in stats):

    accepted == routing + queued + in_flight + finished

``finish_all`` is the single place a result is delivered: it records the outcome
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
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import InvalidStateError
from dataclasses import dataclass
from typing import Final, TypeAlias

from callboard.messages import Cancelled, Job, Priority, Result, Task
from callboard.runtime.guarded_log import guarded_logger

log = guarded_logger(__name__)


class Refused(enum.Enum):
    """``accept_all``'s answer for a task it did not accept (but for a key's holder)."""

    FULL = "full"
    """``capacity`` tasks are live."""
    LIVE = "live"
    """A task of its id is live already (its submit was made twice: two ``resume``
    calls at once accepted each id twice, and one of each pair was never answered)."""
    CLOSED = "closed"
    """The ledger was closed (its system stopped): nothing is accepted after."""


FULL: Final = Refused.FULL
LIVE: Final = Refused.LIVE
CLOSED: Final = Refused.CLOSED


_InFlight: TypeAlias = tuple[Job, str, int, bool]
"""(job, model, incarnation, handed) of a task at a model: ``handed`` once its model
handed its call to the I/O loop (``sent``), the job then counting that attempt: a stop
that ends it asks the loop whether the call started (a call in the window has not)."""
_Record: TypeAlias = Task | Job | _InFlight
"""What the ledger holds for a live task; its type is its stage: the ``Task`` while
ACCEPTED, its ``Job`` while ROUTED, an ``_InFlight`` while IN_FLIGHT. No record object
of its own: a queued task costs the ledger one dict slot, not another object."""
Depth: TypeAlias = dict[tuple[Priority, str | None], int]
"""Jobs waiting in the queue by (priority, budget tag)."""


def _depth_key(job: Job) -> tuple[Priority, str | None]:
    request = job.task.request
    return request.priority, request.budget_tag


def _task_of(record: _Record) -> Task:
    if isinstance(record, tuple):
        return record[0].task
    return record.task if isinstance(record, Job) else record


def binds_key(result: Result) -> bool:
    """Whether ``result`` answers its idempotency key for good: an answer, or an end
    after a call the provider may have served (and billed), unless cancelled. One that
    ended with no such call (it expired in the queue, a policy refused it, the system
    stopped, or the provider refused every call it made: ``refused``) leaves its key
    free, as Stripe's API keeps no answer for a request that never ran: a retry with
    the key is a new request. An expired one held its key for good, its retry without
    the deadline answered with the same 504, and one whose calls a rate limit refused
    held its 429 after the limit had passed (both found by hunts); a cancelled one's
    key was free already."""
    return type(result) is not Cancelled and ran(result)


def ran(result: Result) -> bool:
    """Whether ``result``'s task ran: it was answered, or a call was made for it that
    the provider did not refuse unserved."""
    return result.ok or result.attempts > result.refused


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
        self._lock = threading.RLock()
        """Reentrant: a signal handler runs on a thread wherever it was, and one calling
        ``stats()`` while that thread held the lock (in ``submit_many``) waited for
        itself for good. A ``stop()`` from such a handler waits out its timeout for
        what that thread was submitting (the wait lets the lock go)."""
        self._idle = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._live: dict[int, _Record] = {}
        self._routing = 0
        self._queued = 0
        self._in_flight = 0
        self._depth: Counter[tuple[Priority, str | None]] = Counter()
        """The jobs ROUTED by (priority, budget tag), kept as they come and go: the
        queue's depth in a snapshot (``depth``) costs the tenants, not the backlog."""
        self._accepted = 0
        self._finished = 0
        self._rejected = 0
        self._delivering = 0
        self._keys: dict[str, int] = {}
        self._finished_keys: OrderedDict[str, int] = OrderedDict()
        self._remember_keys = remember_keys
        self._cancel_asked: set[int] = set()
        """Pending tasks whose caller asked to cancel them: kept here, not in an actor,
        so a restarted queue or model still knows. An id leaves when its task ends."""
        self._cancel_all = False
        self._closed = False
        self.first_own_id = 1
        """The first task id this ledger gave out: those below are an earlier process's."""
        self.identity: str | None = None
        """What names this ledger's file in every process that opens it (None: it is
        this process's alone). One process holds a file at a time, so one that opens it
        succeeds every process that held it before (a cluster's queue drops what such a
        predecessor left waiting: ``QueueShell.succeed``)."""
        self._finishing: set[int] = set()
        """The tasks ended here whose outcome is on its way (``finish_all`` to
        ``_delivered``): made durable first, by a durable ledger."""

    def next_id(self) -> int:
        return next(self._ids)

    def skip_ids(self, used: int) -> None:
        """Continue numbering after ``used`` (a durable ledger reopened)."""
        self._ids = itertools.count(used + 1)
        self.first_own_id = used + 1

    def close(self, timeout: float = 10.0) -> None:  # noqa: ARG002 - a durable one waits
        """Accept nothing more (``accept_all`` answers ``CLOSED``: a submit that passed its
        checks as the system stopped accepted a task after the stop's sweep, and with a
        durable ledger, whose writer was gone, its future was never resolved; found by a
        review); a durable ledger also flushes what it still has to write."""
        with self._lock:
            self._closed = True

    def _persist_accepts(self, tasks: list[Task]) -> None:
        """Hook for a durable ledger: ``tasks`` were accepted (called outside the lock);
        it returns once they are recorded, before they go anywhere (or, where it may
        not wait, ``when_accepted`` holds what sends them until then)."""

    def when_accepted(self, send: Callable[[bool], None]) -> None:
        """Run ``send`` (what takes the tasks just accepted anywhere) once their
        acceptance is recorded: here at once, ``send(False)``; a durable ledger whose
        caller could not wait for its commit runs ``send(True)`` on its writer's thread
        after the commit (held: nobody is there to raise to)."""
        send(False)

    # -- life of a task ---------------------------------------------------

    def accept_all(
        self, tasks: Sequence[Task], capacity: int | None = None
    ) -> list[int | Refused | None]:
        """Record new tasks, a burst under one hold of the lock; answers in order.

        Each answer is None (accepted), the id of the task already holding its
        idempotency key, ``FULL`` when ``capacity`` live tasks exist (counted as the
        burst is accepted), ``LIVE`` for an id live already, ``CLOSED`` once closed.
        """
        answers: list[int | Refused | None] = []
        accepted: list[Task] = []
        live, keys = self._live, self._keys
        with self._lock:
            if self._closed:
                return [CLOSED] * len(tasks)
            for task in tasks:
                task_id = task.task_id
                if task_id in live:
                    answers.append(LIVE)
                    continue
                key = task.request.idempotency_key
                holder = None if key is None else keys.get(key) or self._finished_keys.get(key)
                if holder is not None:
                    answers.append(holder)
                    continue
                if capacity is not None and len(live) >= capacity:
                    answers.append(FULL)
                    continue
                if key is not None:
                    keys[key] = task_id
                live[task_id] = task
                accepted.append(task)
                answers.append(None)
            self._routing += len(accepted)
            self._accepted += len(accepted)
        if accepted:
            self._persist_accepts(accepted)
        return answers

    def route_all(self, jobs: Iterable[Job]) -> list[Job]:
        """ACCEPTED -> ROUTED for a batch under one hold of the lock: the jobs that were
        routed (a job whose task is not waiting to be routed is left out)."""
        jobs = list(jobs)  # a generator must not run under the lock
        live = self._live
        done: list[Job] = []
        with self._lock:
            for job in jobs:
                task_id = job.task.task_id
                record = live.get(task_id)
                if record is None or isinstance(record, Job | tuple):
                    continue
                live[task_id] = job
                self._depth[_depth_key(job)] += 1
                done.append(job)
            self._routing -= len(done)
            self._queued += len(done)
        return done

    def dispatch_all(self, jobs: Iterable[Job], model: str, incarnation: int) -> list[Job]:
        """ROUTED -> IN_FLIGHT at a model incarnation, for a batch under one hold of the lock.

        Returns the jobs now in flight; a job not queued (any more) is left out: drop it.
        """
        jobs = list(jobs)  # a generator must not run under the lock
        live = self._live
        done: list[Job] = []
        with self._lock:
            for job in jobs:
                task_id = job.task.task_id
                waiting = live.get(task_id)
                if isinstance(waiting, Job):
                    self._left(waiting)
                    live[task_id] = (job, model, incarnation, False)
                    done.append(job)
            self._queued -= len(done)
            self._in_flight += len(done)
        return done

    def sent(
        self, jobs: Iterable[Job], model: str, incarnation: int, *, handed: bool = True
    ) -> None:
        """The jobs (re-stamped with the attempt just sent) went to the I/O loop at
        (model, incarnation), or (not ``handed``) wait at it for a retry, their attempts
        counted: a restarted model re-queues them counting those attempts."""
        jobs = list(jobs)
        live = self._live
        with self._lock:
            for job in jobs:
                record = live.get(job.task.task_id)
                if isinstance(record, tuple) and record[1] == model and record[2] == incarnation:
                    live[job.task.task_id] = (job, model, incarnation, handed)

    def reclaim(self, job: Job, model: str, incarnation: int) -> bool:
        """IN_FLIGHT at (model, incarnation) -> ROUTED with ``job``; False if not there."""
        task_id = job.task.task_id
        with self._lock:
            record = self._live.get(task_id)
            if not isinstance(record, tuple) or record[1] != model or record[2] != incarnation:
                return False
            self._live[task_id] = job
            self._depth[_depth_key(job)] += 1
            self._in_flight -= 1
            self._queued += 1
            return True

    def finish_all(self, pairs: Iterable[tuple[Task, Result]]) -> list[Result]:
        """Record each outcome, then deliver it, for a batch under one hold of the lock:
        the results delivered now (a task not live, e.g. finished already, is skipped)."""
        pairs = list(pairs)  # a generator must not run under the lock
        live = self._live
        done: list[tuple[Task, Result]] = []
        with self._lock:
            for task, result in pairs:
                record = live.pop(task.task_id, None)
                if record is None:
                    continue
                if isinstance(record, tuple):
                    self._in_flight -= 1
                elif isinstance(record, Job):
                    self._left(record)
                    self._queued -= 1
                else:
                    self._routing -= 1
                key = task.request.idempotency_key
                if key is not None:
                    self._keys.pop(key, None)
                    if binds_key(result):  # else the key may be used again (as a new
                        self._finished_keys[key] = task.task_id  # process reading a durable
                        if len(self._finished_keys) > self._remember_keys:  # ledger finds)
                            self._finished_keys.popitem(last=False)
                done.append((task, result))
            if self._cancel_asked:
                self._cancel_asked.difference_update(t.task_id for t, _ in done)
            self._finished += len(done)
            self._delivering += len(done)
            self._finishing.update(task.task_id for task, _ in done)
        failure: BaseException | None = None
        for task, result in done:  # each one delivered, whatever another's delivery raised
            try:
                self._record_then_deliver(task, result)
            except BaseException as exc:  # noqa: BLE001 - re-raised once the batch is out
                failure = failure or exc
        if failure is not None:
            raise failure
        return [result for _, result in done]

    def finish_own(self, pairs: Iterable[tuple[Task, Result]]) -> list[Result]:
        """``finish_all`` for the tasks the ledger holds as these very objects, unsent: for
        a submit cut short (a signal landing in ``accept_all`` or ``route_all``), which
        cannot know which of its tasks were accepted, and must not end another submit's
        task of an id it shares, nor one the queue it told has sent already (its answer
        is coming); then the counters are counted again (``_recount``)."""
        pairs = list(pairs)
        with self._lock:
            live = self._live
            own = [
                (t, r)
                for t, r in pairs
                if (record := live.get(t.task_id)) is not None
                and not isinstance(record, tuple)
                and _task_of(record) is t
            ]
        try:
            return self.finish_all(own)
        finally:
            self._recount()

    def _recount(self) -> None:
        """The counters again from the records (O(live)): the signal that cut a submit
        short may have landed between a record's change and its counters' (in
        ``route_all``, a task left ``routing`` for good and the queue's depth at -1;
        found by a review)."""
        routing = queued = in_flight = 0
        depth: Counter[tuple[Priority, str | None]] = Counter()
        with self._lock:
            for record in self._live.values():
                if isinstance(record, tuple):
                    in_flight += 1
                elif isinstance(record, Job):
                    queued += 1
                    depth[_depth_key(record)] += 1
                else:
                    routing += 1
            self._routing, self._queued, self._in_flight = routing, queued, in_flight
            self._depth = depth
            self._accepted = self._finished + len(self._live)

    def _left(self, job: Job) -> None:
        """``job`` is no longer waiting in the queue (under the lock)."""
        key = _depth_key(job)
        left = self._depth[key] - 1
        if left:
            self._depth[key] = left
        else:
            del self._depth[key]  # a tenant gone leaves nothing behind

    def reopen(self, keys: Iterable[str]) -> None:
        """Idempotency keys answered already that may be accepted again: their requests
        are to be sent anew (a failed result retried, a request that changed), and the
        new outcome replaces the old. A key still live, or never answered, is left."""
        with self._lock:
            for key in keys:
                self._finished_keys.pop(key, None)

    def kept_result(self, key: str) -> Result | None:  # noqa: ARG002 - a durable one reads it
        """The final result kept under the idempotency key ``key``: None here (the
        in-memory ledger keeps no results); a durable ledger reads it from its file."""
        return None

    def reject(self, task: Task, result: Result) -> None:
        """Deliver the result of a task that was never accepted (refused at the door)."""
        with self._lock:
            self._rejected += 1
            self._delivering += 1
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
                self._finishing.discard(task.task_id)
                self._idle.notify_all()  # idle waiters and backpressure waiters

    def _is_idle(self) -> bool:
        return not self._live and not self._delivering

    # -- queries ----------------------------------------------------------

    def wait_for_room(self, capacity: int, extra: int, timeout: float) -> bool:
        """Block until ``extra`` more tasks fit under ``capacity`` (backpressure)."""
        with self._lock:  # the Condition's lock, by its C ``with`` (see ``wait_idle``)
            return self._idle.wait_for(lambda: len(self._live) + extra <= capacity, timeout)

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no task is live (or the timeout passes); True if idle.

        The Condition's lock is taken by ``with self._lock``, never ``with self._idle``:
        a ``Condition``'s ``__enter__`` is Python, and a Ctrl-C handled between its
        acquire and the ``with`` left the ledger's lock taken for good (every actor
        then waited for it, and so did the stop)."""
        with self._lock:
            return self._idle.wait_for(self._is_idle, timeout)

    def is_accepted(self, task_id: int) -> bool:
        """Accepted and waiting to be routed."""
        return isinstance(self._live.get(task_id), Task)

    def is_routed(self, task_id: int) -> bool:
        return isinstance(self._live.get(task_id), Job)

    def is_live(self, task_id: int) -> bool:
        return task_id in self._live

    def pending_ids(self) -> set[int]:
        """The tasks live, or ended here with their outcome not delivered yet (a durable
        ledger delivers once its file holds it): taken before its file is read, every
        task the file shows unfinished is either here or not this process's to have
        ended (``System.resume`` sent again a task whose result was on its way to the
        file, and its caller got two; found by a flaky test)."""
        with self._lock:
            return set(self._live) | self._finishing

    # -- cancel requests --------------------------------------------------

    def ask_cancel(self, task_ids: Iterable[int]) -> list[int]:
        """Remember a cancel for each live task (the ones returned), wherever it is:
        whoever holds it unsent (queue, model) ends it ``Cancelled`` when it sees this."""
        asked: list[int] = []
        with self._lock:
            for task_id in task_ids:
                if task_id in self._live:
                    self._cancel_asked.add(task_id)
                    asked.append(task_id)
        return asked

    def cancel_everything(self) -> None:
        """From now on every task not yet sent is to end ``Cancelled`` (a stop's cancel)."""
        with self._lock:
            self._cancel_all = True

    def holders(self, task_ids: Iterable[int]) -> dict[str, list[int]]:
        """The in-flight ones among ``task_ids``, by the model that holds them."""
        out: dict[str, list[int]] = {}
        with self._lock:
            for task_id in task_ids:
                record = self._live.get(task_id)
                if isinstance(record, tuple):
                    out.setdefault(record[1], []).append(task_id)
        return out

    def cancel_wanted(self, task: Task) -> bool:
        """Whether a cancel was asked for the task or its future was cancelled (lock-free
        read): whoever holds the task unsent (queue, model) ends it ``Cancelled``."""
        future = task.future
        return (
            self._cancel_all
            or task.task_id in self._cancel_asked
            or (future is not None and future.cancelled())
        )

    def counts(self) -> LedgerCounts:
        with self._lock:
            return LedgerCounts(
                accepted=self._accepted,
                rejected=self._rejected,
                routing=self._routing,
                queued=self._queued,
                in_flight=self._in_flight,
                finished=self._finished,
            )

    def accepted_tasks(self) -> list[Task]:
        """Tasks waiting to be routed (for a restarted router)."""
        with self._lock:
            return [r for r in self._live.values() if isinstance(r, Task)]

    def depth(self) -> Depth:
        """How many jobs wait in the queue, by (priority, budget tag): what ``routed``
        holds, counted, in O(tenants)."""
        with self._lock:
            return dict(self._depth)

    def routed(self) -> list[Job]:
        """Jobs waiting in the queue (for a restarted queue), in id order: O(live tasks)
        (the queue's depth alone is ``depth``)."""
        with self._lock:
            return [r for r in self._live.values() if isinstance(r, Job)]

    def in_flight_of(self, model: str, *, below: int) -> list[tuple[Job, int]]:
        """(job, incarnation) in flight at ``model`` incarnations older than ``below``."""
        with self._lock:
            return [
                (r[0], r[2])
                for r in self._live.values()
                if isinstance(r, tuple) and r[1] == model and r[2] < below
            ]

    def live_entries(self) -> list[tuple[Task, Job | None, str | None]]:
        """Each live task with its job once routed (what its calls paid, how many were
        sent) and, for one whose call was handed to the I/O loop, that call's model
        (the job counts that call: it may be on the wire or in the loop's window):
        what a stop needs to end it as it stands."""
        with self._lock:
            records = list(self._live.values())
        out: list[tuple[Task, Job | None, str | None]] = []
        for r in records:
            if isinstance(r, tuple):
                out.append((r[0].task, r[0], r[1] if r[3] else None))
            else:
                out.append((r.task, r, None) if isinstance(r, Job) else (r, None, None))
        return out


def _resolve(task: Task, result: Result) -> None:
    future = task.future
    if future is not None and not future.done():
        try:
            future.set_result(result)
        except InvalidStateError:  # cancelled by its caller in the meantime
            log.debug("task %d: caller cancelled before the result", task.task_id)
