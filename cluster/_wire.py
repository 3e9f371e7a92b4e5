"""What crosses between a process and the cluster's shared actors, and how it is made.

A process's ``Job`` cannot cross as it is: its task holds the caller's future
(and a request with read-only mappings, which do not pickle), and its clock
stamps are the process's monotonic clock. A ``Ticket`` is what the cluster
needs of one task: its place in the global order (priority, arrival and
deadline on the wall clock, shared by every process of a host and, give or
take clock sync, of a cluster), the models it may go to, its tenant and cost
for fair queuing, and the request as JSON for the model actor to build its
call from. Answers come back as ``Attempted`` / ``Unsent`` in a
``ModelNews`` batch, and a queue's expiries in a ``QueueNews``.

A ticket's place in the queue's order (``Ticket.order``) is the queue core's
static order (``core.pqueue``: rank, that is priority then aging window,
deadline, then arrival for the push sequence), so a model comparing the
ticket it holds with a newcomer, and the queue choosing which model's held
ticket a newcomer displaces, decide as the queue itself would. The rank is
the queue's (it knows the aging step): it travels beside each ticket the
queue sends a model (``ModelShell.call``).

A stream's deltas are numbered by their call: each ``Deltas`` batch says the
number of its first (``seq``: 0 for the call's first delta, and each batch's
first follows the last batch's last), and the call's answer how many it sent
(``Attempted.deltas``). An owner that heard ``heard`` of a call's deltas takes
from a batch only what follows them (``unheard``); a batch that starts further
on, or an answer that counts more, means some were lost on the way (a poll's
answer lost with a poller that died fetching it): the owner's reader must not
get what comes after them (``cluster._link``).

What must hold: a ticket names its task by (owner, task id, attempt); an
answer for an attempt the owner no longer waits for is ignored there, so a
duplicate call (after a restart) is never a duplicate result. A call's deltas
are numbered from 0, with no gap and no repeat across its batches. Every type
is frozen, slotted and picklable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from callboard.core.learn import Lesson
from callboard.core.secret import Secret, reveal
from callboard.core.settings import ModelSettings, SchedulerSettings
from callboard.messages import CallResult, DeltaSink, Health, Job, StreamDelta, Task
from callboard.runtime.codec import request_from_json, request_to_json

KEY_BITS = 40
"""A ticket's key in the shared queue: its owner's number above this many bits of task id."""


def key_of(owner: int, task_id: int) -> int:
    """A task's key in the shared queue: its owner's number above its id."""
    return owner << KEY_BITS | task_id


def task_id_of(key: int) -> int:
    """The task id of a key in the shared queue (``key_of``'s)."""
    return key & ((1 << KEY_BITS) - 1)


Order = tuple[int, float, float]
"""A ticket's place in the queue's static order: (rank, deadline or +inf, arrival)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    """One task waiting in the cluster's queue (process -> queue -> model)."""

    owner: int
    """The owning process's number, given by the queue (``QueueShell.register``)."""
    task_id: int
    attempt: int
    """Calls already sent for the task: an answer names it, so a stale one is ignored."""
    priority: int
    arrival: float
    """When the caller submitted, on the wall clock (seconds since the epoch)."""
    deadline: float | None
    """The task's deadline on the wall clock, or None."""
    lanes: tuple[str, ...]
    """The models it may go to now."""
    tenant: str | None
    cost: int
    """What fair queuing charges (``Task.fair_cost``), settled when the call ends."""
    trace_id: str
    request: str
    """The request as JSON (``runtime.codec``)."""
    prompt_tokens: int
    streamed: bool = False
    """The caller reads the answer as a stream: the call streams, its deltas travel
    back in the owner's polls (``Deltas``)."""

    @property
    def key(self) -> int:
        return key_of(self.owner, self.task_id)

    def order(self, rank: int) -> Order:
        """Its place in the queue's static order, given its ``rank`` there: lower goes
        first."""
        return (rank, math.inf if self.deadline is None else self.deadline, self.arrival)


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempted:
    """Model -> owner: a call was made for ``task_id``'s attempt ``attempt``."""

    task_id: int
    attempt: int
    """The ticket's attempt (calls sent before this one)."""
    sent_at: float
    """When the call was sent, on the wall clock."""
    result: CallResult
    lesson: Lesson
    call: int = 0
    """The model actor's number for the call (a stream's ``Deltas`` name it too)."""
    deltas: int = 0
    """How many deltas a streamed call sent its owner (0 for a call that did not
    stream): an owner that heard fewer of them lost some on the way."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Unsent:
    """Model -> owner: no call was made for the ticket and none will be."""

    task_id: int
    attempt: int
    why: str
    """``deadline`` (it passed before a slot freed), ``revoked``, ``refused``, or
    ``unmade`` (its call's body could not be made; ``detail`` says why)."""
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Deltas:
    """Model -> owner: what a streamed call read since the owner's last poll, in order."""

    task_id: int
    attempt: int
    call: int
    """The model actor's number for the call: one call's deltas reach the reader, never
    a second call's for the same attempt (a duplicate after a restart)."""
    seq: int
    """The call's number for the first of ``deltas``: 0 for its first delta; each
    batch's first follows the previous batch's last."""
    deltas: tuple[StreamDelta, ...]

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise ValueError(f"a stream's deltas are numbered from 0, not {self.seq}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelNews:
    """Model -> owner, one batch per poll."""

    model: str
    incarnation: int
    """Changes when Ray restarts the actor: the owner then sends its tickets again."""
    answers: tuple[Attempted | Unsent, ...]
    health: Health | None
    streams: tuple[Deltas, ...] = ()
    """Streamed calls' deltas, each read before any answer of the same batch (a call's
    last deltas come with or before its answer, never after)."""
    lapsed: bool = False
    """The owner's lease had run out here, and answers for it were dropped: the owner
    then sends its tickets again (a silent process that is back loses nothing)."""
    recall: bool = False
    """Work waits for the model: the owner gives back the permits it has not used."""
    at: float | None = None
    """The model actor's clock (its ``time.monotonic``) when ``health`` was read: the
    owner moves the health's times (``reopen_at``, ``paused_until``) onto its own clock
    (``on_my_clock``). Last, and read with ``getattr`` (``clock_of``): a pickled
    dataclass's fields are restored by position, so news from an actor of an older
    callboard lacks it, and one placed before ``streams`` would have read that
    actor's streams as its clock (found by a review)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueNews:
    """Queue -> owner, one batch per poll."""

    incarnation: int
    expired: tuple[int, ...]
    """Task ids whose deadline passed while they waited in the shared queue."""
    lapsed: bool = False
    """The owner's lease had run out here, and its waiting tickets were dropped: the
    owner then sends its tickets again (a silent process that is back loses nothing)."""
    refused: tuple[int, ...] = ()
    """Task ids the shared queue had no room for (its capacity is the cluster's: several
    processes, each within its own, can fill it): each ends ``Rejected(QUEUE_FULL)``."""
    invalid: tuple[tuple[int, str], ...] = ()
    """``(task id, why)`` of the tickets the shared queue could not take (one another
    version of callboard wrote, or a bug): each ends ``Failed(INTERNAL)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class News:
    """Poller -> link (in the process): a batch from ``source`` (the queue or a model)."""

    source: str
    news: ModelNews | QueueNews


@dataclass(frozen=True, slots=True, kw_only=True)
class Unqueue:
    """Link -> itself: take back again what the cluster has not called (a stop's
    cancel), ``left`` times more after this."""

    detail: str
    left: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Unqueued:
    """A shared actor's answer -> link: these tasks' tickets left the cluster uncalled
    (a stop's cancel took them back); they end ``Cancelled`` with ``detail``."""

    task_ids: tuple[int, ...]
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Resend:
    """Link -> itself: a retry's delay is over; send these tasks' tickets again."""

    task_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """Model -> owner: calls the owner may make itself (``cluster._lease``), each one
    admitted already on the model's shared actor: a slot of its cap, the breaker's
    permit and the limiter's reservation of ``tokens``."""

    model: str
    incarnation: int
    """The lending actor's: a permit of another incarnation is void."""
    permits: tuple[int, ...]
    tokens: int
    """The most one permit's call may reserve (``admission.tokens_of`` of its task)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Spent:
    """Owner -> model: the call made on ``permit`` ended with ``result`` (without its
    answer's text: the guards learn from its status, headers and usage). The queue
    never saw it: no tenant was charged for it, and none is settled."""

    permit: int
    result: CallResult


@dataclass(frozen=True, slots=True, kw_only=True)
class Leased:
    """A model actor's answer to an ask for a lease -> link: ``lease``, or None (no
    capacity to spare, or the ask failed)."""

    model: str
    lease: Lease | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Adopted:
    """A restarted model actor's answer to ``adopt`` -> link: the calls of ``task_ids``,
    on the wire on permits of its incarnation before, hold ``permits`` of this one."""

    model: str
    incarnation: int
    task_ids: tuple[int, ...]
    permits: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Direct:
    """The I/O loop -> link: calls this process made on leases of ``model`` ended."""

    model: str
    results: tuple[CallResult, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class StockDue:
    """Link -> itself: permits of a lease received at ``at`` may be past their time."""

    model: str
    at: float


def portable(r: CallResult, task_id: int) -> CallResult:
    """``r`` under its owner's task id, its mappings made plain dicts (they pickle)."""
    answer = None if r.answer is None else dict(r.answer)
    raw = None if r.raw is None else (answer if r.raw is r.answer else dict(r.raw))
    return dataclasses.replace(r, task_id=task_id, answer=answer, raw=raw)


def lesson_only(r: CallResult) -> CallResult:
    """``r`` as a model's guards learn from it: its answer's text left out (it never
    crosses to the shared actor; nothing there reads it)."""
    return dataclasses.replace(r, content="", answer=None, raw=None)


def unheard(batch: Deltas, heard: int) -> tuple[StreamDelta, ...] | None:
    """What of ``batch`` an owner that heard the first ``heard`` deltas of its call has
    not heard yet: its deltas from number ``heard`` on (none, if it heard them all);
    None if it starts past ``heard`` (the deltas between were lost on the way)."""
    if heard < 0:
        raise ValueError(f"heard is a count of deltas, not {heard}")
    if batch.seq > heard:
        return None
    return batch.deltas[heard - batch.seq :]


def ticket_of(job: Job, owner: int, *, now: float, wall: float) -> Ticket:
    """The ticket for ``job``; ``now`` is the process's clock and ``wall`` the wall
    clock at the same instant (their difference maps the task's stamps to the wall)."""
    task = job.task
    request = task.request
    shift = wall - now
    return Ticket(
        owner=owner,
        task_id=task.task_id,
        attempt=job.attempt,
        priority=int(request.priority),
        arrival=task.submitted_at + shift,
        deadline=None if task.deadline_at is None else task.deadline_at + shift,
        lanes=job.candidates,
        tenant=request.budget_tag,
        cost=task.fair_cost,
        trace_id=task.trace_id,
        request=request_to_json(request),
        prompt_tokens=task.prompt_tokens,
        streamed=task.stream is not None,
    )


def task_of(
    ticket: Ticket, call_id: int, *, now: float, wall: float, stream: DeltaSink | None = None
) -> Task:
    """The task a model actor calls for ``ticket``, numbered ``call_id`` (its own
    number for the call) and stamped on its clock ``now`` (``wall`` at the same time);
    a streamed one's deltas go to ``stream``."""
    shift = now - wall
    return Task(
        task_id=call_id,
        trace_id=ticket.trace_id,
        request=request_from_json(ticket.request),
        submitted_at=ticket.arrival + shift,
        deadline_at=None if ticket.deadline is None else ticket.deadline + shift,
        prompt_tokens=ticket.prompt_tokens,
        stream=stream,
    )


def settings_digest(settings: ModelSettings) -> dict[str, str]:
    """Each of a model's settings as a short digest, to tell whether two processes
    configured it alike without showing a value (a secret's digest is of its value)."""
    digest: dict[str, str] = {}
    for f in dataclasses.fields(settings):
        said = _canonical(getattr(settings, f.name))
        digest[f.name] = hashlib.sha256(said.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return digest


def _canonical(value: object) -> str:
    """``value`` written one way for values alike: a set's items and a mapping's in
    sorted order, not in the order of the process's string hash seed (each Ray worker
    has its own: a model with two capabilities differed from itself in the actor its
    own process made, and no call of it went on a lease; found by a hunt); a secret
    as its value."""
    if isinstance(value, Secret):
        return reveal(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        inner = ", ".join(f"{f.name}={_canonical(getattr(value, f.name))}" for f in fields)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, Mapping):
        items = sorted(f"{_canonical(k)}: {_canonical(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, set | frozenset):
        return "{" + ", ".join(sorted(_canonical(v) for v in value)) + "}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_canonical(v) for v in value) + ")"
    return repr(value)


def queue_settings(settings: SchedulerSettings, lease_s: float) -> dict[str, str]:
    """What the shared queue keeps of a process's scheduler settings and lease, each
    written one way for values alike (``30`` and ``30.0``, weights in any order): those
    a process that made it otherwise is told of. ``escalate_margin_s`` is the router's,
    which each process runs itself (found by a review: a digest of each repr warned of
    differences that were none)."""
    aging = settings.aging_step_s
    weights = sorted((str(k), float(v)) for k, v in settings.tenant_weights.items())
    return {
        "capacity": str(int(settings.capacity)),
        "aging_step_s": "none" if aging is None else repr(float(aging)),
        "aging_share": repr(float(settings.aging_share)),
        "tenant_weights": repr(weights),
        "lease_s": repr(float(lease_s)),
    }


def differing(ours: ModelSettings, theirs: Mapping[str, str] | None) -> list[str]:
    """The settings in which ``ours`` differs from a shared actor's ``theirs`` digest."""
    if not theirs:
        return []
    return [k for k, v in settings_digest(ours).items() if theirs.get(k, v) != v]


def clock_of(news: ModelNews) -> float | None:
    """``news.at``, or None from a model actor of an older callboard (unpickled without
    it: the attribute is unset)."""
    return getattr(news, "at", None)


def on_my_clock(health: Health, at: float | None, now: float) -> Health:
    """``health``, read at ``at`` on another process's clock, with its times on this
    process's (``now`` here is taken as ``at`` there: a poll's answer is a moment old).
    Relayed as read, an open breaker's ``reopen_at`` and a 429's ``paused_until`` were
    another process's monotonic times: the stats and the dashboard said "reopens in"
    and "paused for" anything, and a gateway's ``Retry-After`` would have too."""
    if at is None or (health.reopen_at is None and health.paused_until is None):
        return health
    shift = now - at
    return dataclasses.replace(
        health,
        reopen_at=None if health.reopen_at is None else health.reopen_at + shift,
        paused_until=None if health.paused_until is None else health.paused_until + shift,
    )
