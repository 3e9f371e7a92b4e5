"""The messages a task travels in, from the front door to its result.

    caller (front door) --Route--> Router --Enqueue--> Queue --Call--> Model
    Model --Ready(n, settled)--> Queue
    Model --Enqueue (handed back, moved on)--> Queue
    Model --Health--> Router, Queue    * --Finished--> Aggregator
    * --BudgetFreed--> Router (a settlement, while plans wait for the budget)
    timers: Model --AdmitDue--> Model; Queue --ExpireDue, EscalateDue--> Queue

Every message is frozen and slotted; pykka does not copy messages, so nothing
here may be mutated after it is sent. The one deliberate exception is the
caller's ``Future`` inside a ``Task``: it is the handle the result travels
back on, and only the ledger's single ``finish_all`` resolves it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from callboard.messages._frozen import quick_init
from callboard.messages._request import Request
from callboard.messages._results import Billed, FailureReason, Result, Usage
from callboard.messages._stream import DeltaSink


class TracePrefix(str):
    """A system's trace id prefix, given as a task's ``trace_id`` to say that its trace
    id is ``<prefix>.<task_id>``: derived each time it is read, never stored (a queued
    task so holds no string of its own: 61 bytes of its ~0.9 KiB on the backlog bench).
    Every reader (``Task.trace_id``, ``TaskFuture.trace_id``, equality, ``repr``,
    pickling) sees the whole trace id; only the prefix itself is shared."""

    __slots__ = ()

    def of(self, task_id: object) -> str:
        """The trace id of task ``task_id``."""
        return f"{self}.{task_id}"


class _TraceId:
    """``Task.trace_id``: the field's slot, read through a descriptor that derives the
    trace id of a task given a ``TracePrefix``."""

    __slots__ = ("_read", "_write")

    def __init__(self, slot: Any) -> None:
        self._read = slot.__get__  # the slot's own member descriptor's
        self._write = slot.__set__

    def __get__(self, task: Task | None, owner: type | None = None) -> Any:
        if task is None:
            return self
        held = self._read(task)
        return held.of(task.task_id) if type(held) is TracePrefix else held

    def __set__(self, task: Task, value: Any) -> None:
        self._write(task, value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """A request accepted for scheduling, with its identity and clock stamps."""

    task_id: int
    trace_id: str
    """The caller's, or a ``TracePrefix``: then ``<prefix>.<task_id>`` when read."""
    request: Request
    submitted_at: float
    """Clock time (monotonic seconds) when the caller submitted."""
    deadline_at: float | None = None
    """Absolute clock time after which the task is ``Expired``, or None."""
    prompt_tokens: int = 0
    """The estimated prompt size, computed once at the front door."""
    future: Future[Result] | None = field(default=None, compare=False, repr=False)
    """The caller's handle; resolved once, by the ledger's ``finish_all``."""
    stream: DeltaSink | None = field(default=None, compare=False, repr=False)
    """Where a streamed call's deltas go as they arrive (None: answered whole)."""

    @property
    def fair_cost(self) -> int:
        """What fair queuing charges the task's tenant when a call of it is sent: the
        prompt estimate (at least 1), the one size known then; settled to what the call
        used, its answer with it, when it ends (``Settlement``). Charged ``max_tokens``
        up front, a tenant that allows long answers and gets short ones paid for
        tokens nobody produced until each call ended: behind a flood at 20 calls in
        flight, 3.8 s at p99 against 0.12 s with the flood's ``max_tokens``."""
        return max(1, self.prompt_tokens)


Task.trace_id = _TraceId(Task.__dict__["trace_id"])  # type: ignore[assignment,misc]
quick_init(Task)


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A task with its routing decision: where it may go, and its attempt count."""

    task: Task
    candidates: tuple[str, ...]
    """Models the task may be dispatched to now."""
    fallbacks: tuple[str, ...] = ()
    """Models to try, in order, when every candidate gives up on the task or is down.
    With ``candidates``, the task's plan: only ``callboard.core.fallback`` rewrites it,
    and where the task may go *now* is derived from it there, never written into it."""
    attempt: int = 0
    """Calls already sent for this task (across models): the result's ``attempts``."""
    model_attempt: int = 0
    """Calls sent since the job last left a model for good, counted against that model's
    ``max_attempts``; 0 again when a model gives up on it."""
    dispatched_at: float | None = None
    """Clock time the first call was sent (queue wait ends there)."""
    rate_limited: int = 0
    """Calls at the model it is with that a 429 refused (not in ``model_attempt``;
    bounded by ``RetryConfig.max_rate_limited``); 0 again when a model gives up on it."""
    refused: int = 0
    """Of ``attempt``, the calls a provider refused without serving them (a 429, an
    overloaded 503 or 529), across models: the result's ``refused``."""
    last_error: str = ""
    """The last failed attempt's reason and detail, for a result that ends the task
    without another call (expired, given up)."""
    paid: tuple[Billed, ...] = ()
    """The task's earlier calls that were billed but served nothing (a 200 whose body
    could not be read, then retried or moved on), each on its model: its result counts
    them."""

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError(f"job for task {self.task.task_id} has no candidate models")


@dataclass(frozen=True, slots=True)
class BudgetFreed:
    """Whoever settles a task's cost -> Router: money reserved came back while tasks
    wait for the budget; place them again."""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """The front door (on the submitting thread) -> Router: admitted tasks to route."""

    tasks: tuple[Task, ...]


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Enqueue:
    """Router (or a model handing work back) -> Queue: jobs to hold until a credit."""

    jobs: tuple[Job, ...]


Settlement = tuple[int, str | None, int]
"""``(priority, tenant, over)``: a call of ``tenant``'s task at ``priority`` ended having
used ``over`` tokens fewer than fair queuing charged when it was sent (negative: more);
the queue gives them back to the tenant (``TaskQueue.settle``)."""


def settlement(
    priority: int, tenant: str | None, charged: int, usage: Usage | None
) -> Settlement | None:
    """What to settle for a call charged ``charged`` that ended with ``usage``: None when
    the provider reported no usage (the charge stands: the call may have cost it all)
    or the charge was exact."""
    if usage is None or usage.estimated:
        return None
    over = charged - usage.total_tokens
    return (priority, tenant, over) if over else None


def refund(task: Task) -> Settlement:
    """The charge to undo for a call of ``task`` charged at its grant and never sent
    (handed back, moved on, or ended where it waited): all of it (``Ready.refunds``)."""
    return (int(task.request.priority), task.request.budget_tag, task.fair_cost)


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Ready:
    """Model -> Queue: the model can start ``credits`` more calls now (0: it only
    brings ``settled``)."""

    model: str
    incarnation: int
    epoch: int
    """Bumped when the queue restarts; credits of an older epoch are void."""
    credits: int
    settled: tuple[Settlement, ...] = ()
    """Calls ended since the last ``Ready``, whose tenants' charges are to be settled."""
    refunds: tuple[Settlement, ...] = ()
    """Jobs granted and not sent since the last ``Ready`` (``refund``): their tenants'
    charges are undone (``TaskQueue.refund``)."""
    aged: int = 0
    """How many of those were granted on aged turns, which the model is owed again."""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """Queue -> Model: the jobs for the credits it was granted (at most that many)."""

    model: str
    incarnation: int
    epoch: int
    jobs: tuple[Job, ...]
    aged: frozenset[int] = frozenset()
    """The task ids of the jobs granted on aged turns (owed again if they come back
    unsent: ``Ready.aged``)."""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    """Anyone -> Queue: cancel these tasks if they have not been sent."""

    task_ids: tuple[int, ...] = ()
    everything: bool = False
    """Cancel every waiting task (``stop(cancel=True)``)."""
    detail: str = "cancelled by caller"


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Health:
    """Model -> Router/Queue/Aggregator: the model's health (always when its breaker
    moves, else at most once a second)."""

    model: str
    breaker: BreakerState
    reopen_at: float | None = None
    """When an open breaker will admit probes (clock time), if open."""
    latency_ewma_s: float | None = None
    """Recent call latency (exponentially weighted), None before the first call."""
    error_rate: float = 0.0
    """Recent fraction of calls that failed at the provider (weighted the same way)."""
    in_flight: int = 0
    max_concurrency: int = 1
    requests_headroom: float | None = None
    """Requests the limiter could admit now (None: no request limit)."""
    tokens_headroom: float | None = None
    """Tokens the limiter could admit now (None: no token limit)."""
    paused_until: float | None = None
    """A 429's Retry-After pause, if one is in force (clock time)."""
    resting: bool = False
    """The pause ends more than ``core.health.RESTING_S`` from now: the model is out
    for tasks with somewhere else to go, as one whose breaker is open."""
    given_up: FailureReason | None = None
    """Set while the model is given up on (``core.health``): tasks with no other model
    end with this reason."""
    last_error: str = ""
    """The model's last failed attempt (reason and detail), for those results."""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """Whoever ends tasks -> Aggregator: results already delivered, for accounting."""

    results: tuple[Result, ...]


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class AdmitDue:
    """Model -> itself, by timer: look again at admission and credits (a retry is
    due, the limiter has room, the breaker's cool-down is over, a report is owed)."""

    at: float
    """The clock time the timer was set for (tells it from a timer set earlier)."""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ExpireDue:
    """Queue -> itself, by timer: the earliest deadline of a waiting job has come."""

    at: float
    """The clock time the timer was set for (tells it from a timer set earlier)."""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class EscalateDue:
    """Queue -> itself, by timer: jobs still waiting this close to their deadline
    go to the model they escalate to."""

    at: float
    """The clock time the timer was set for (tells it from a timer set earlier)."""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class CallResult:
    """What one HTTP attempt came to (built on the I/O loop, read by the model actor)."""

    task_id: int
    attempt: int
    started_at: float
    ended_at: float
    status_code: int | None = None
    """HTTP status, or None when no response arrived (see ``error``)."""
    error: str | None = None
    """Why the call yielded no completion (an ``ErrorKind`` value, or ``unsent``)."""
    detail: str = ""
    content: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    headers: tuple[tuple[str, str], ...] = ()
    """Only the rate-limit headers (retry-after, x-ratelimit-*), lower-cased, and the
    answer's ``date`` with them."""
    heard_epoch: float | None = None
    """The wall clock when the headers arrived, with a ``date`` among them: how far the
    provider's clock is from this host's (``core.limiter.read_headers``)."""
    answer: Mapping[str, Any] | None = None
    """The whole ``chat.completion`` (a dialect's answer translated to it), redacted."""
    raw: Mapping[str, Any] | None = None
    """The provider's answer as received (``answer`` itself for OpenAI's dialect)."""
    first_token_at: float | None = None
    """A stream's first delta arrived then (the loop's clock, as ``started_at``)."""
    request_id: str | None = None
    """The provider's id of this call, as its answer's headers said (``REQUEST_ID_HEADERS``)."""
    prompt_heard: Usage | None = None
    """A stream that ended unfinished (cut, at its deadline, its reader gone) with no
    usage: its prompt's count as the provider said it before that (Anthropic's
    ``message_start``), the rest of the counts unknown. Read with ``getattr``: one
    from an older callboard's model actor has no such slot."""


@dataclass(frozen=True, slots=True)
class CallShape:
    """What the I/O loop needs to know of a call beyond its body (None for a plain
    chat completion)."""

    json_tool: str | None = None
    """The tool a ``json_schema`` answer comes back through (Anthropic's dialect)."""
    stream: DeltaSink | None = None
    """A streamed call's deltas go here."""
    embeddings: bool = False
    """An embeddings call (``/embeddings``), not a chat completion."""
    choices: int = 1
    """The choices asked for (``n``): a stream ends when each has finished."""
    headers: Mapping[str, str] | None = None
    """The request's own ``extra_headers``, sent over the model's."""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class CallsDone:
    """I/O loop -> Model: the attempts that ended in one loop iteration."""

    incarnation: int
    results: tuple[CallResult, ...]
