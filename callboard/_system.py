"""``System``: the sync face of callboard; it builds and owns one actor system.

``System()`` with no arguments starts the simulated provider on 127.0.0.1
and two models on it; ``System(config)`` runs the configured models. Every
public method is thread-safe. ``submit`` returns a ``TaskFuture`` (a
``concurrent.futures.Future`` that knows its task id) that resolves to a ``Result``
(failures are results, not exceptions); misuse (an empty prompt, an unknown model, a
submit after stop) raises a ``UsageError`` / ``SystemStoppedError`` at once.

The machinery (provider, ledger, I/O loop, HTTP clients, address book,
supervisor and actors) is the ``Assembly`` the system holds (with
``config.cluster``, a ``callboard.cluster.ClusterAssembly``: the queue and the
models on Ray, imported only then); the system
keeps the decisions: what is admitted and sent, how a read is answered, and
how a stop or an escalation ends the tasks it finds. The patterns (gather,
race, chain, callbacks) and recurring jobs are written once, in their own
modules, and are this class's methods as they are (``cb.gather(...)`` is
``patterns.gather(cb, ...)``).

What must hold:

* Misuse raises before anything is sent: a system stopped, failed or not
  admitting, an invalid request or an unknown model raise at once, and a
  burst that can never fit raises before it waits for room.
* A task is admitted on the submitting thread (``actors.ingest.FrontDoor``):
  in the ledger before ``submit`` returns (so a ``cancel`` finds it), and ended
  at once if the router cannot be told of it: nothing is half-sent. Every
  task's future shares the system's one ``on_cancel`` hook.
* Every question to an actor has a deadline (``ASK_TIMEOUT_S``); a system
  stopped (or failed) answers ``SystemStoppedError``, never a pykka error.
* ``_stopped`` is set when the teardown begins (nothing is admitted or started
  after), ``_torn_down`` once it ran to its end (``rt.stats`` then counts every
  result, the sweep's own included). A stop cut short is finished by the next
  call, which waits no longer than its own ``timeout`` (see ``stop``), and once
  the teardown began, not at all.
* Nothing is left behind: every future not finished ends ``Cancelled`` (or
  ``Failed`` when the supervisor gave up), every actor and thread the system
  started is stopped.
* ``stop`` and the escalation's ``_fail_all`` run under ``_stop_lock``, one
  at a time; ``_fail_all`` does nothing once a stop began its teardown.
* A failed system (the supervisor gave up, or the root itself died) is a
  stopped one: ``submit`` raises ``SystemStoppedError``, every live task ends
  ``Failed`` (internal) at once, then the ``on_failure`` hooks run (never on an
  actor thread), and ``stats()`` answers the figures it ended with.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Never, Self, cast

import pykka

from callboard import _callbacks, _chain, _gather, _race
from callboard import jobs as _jobs
from callboard._assembly import ASK_TIMEOUT_S, Assembly
from callboard._embed import (
    Assembler,
    Batching,
    EmbedFuture,
    Gathering,
    embedding_request,
    texts_of,
)
from callboard._stream import ChatStream
from callboard._submitter import (
    NO_PROMPT,
    cancel_unsent,
    checked_fields,
    checked_prompts,
    checked_seconds,
    checked_trace_id,
    new_trace_id,
    refuse_keywords,
    request_of,
)
from callboard.actors.aggregator import STATS_GRACE_S, snapshot
from callboard.actors.base import (
    AGGREGATOR,
    QUEUE,
    CrashPlan,
    account,
    deliver,
    ended,
    note_health,
    unsent,
)
from callboard.actors.jobs import settle_runs
from callboard.config import SystemConfig
from callboard.core.attempt import most_charged
from callboard.core.tokens import (
    GPT_4O_IMAGES,
    ImageRule,
    count_chat_tokens,
    estimate_prompt_tokens,
    estimate_prompts_tokens,
    image_rule_of,
    inputs_tokens,
)
from callboard.messages import (
    Call,
    CallsDone,
    Cancel,
    Cancelled,
    ConfigError,
    Enqueue,
    Failed,
    FailureReason,
    Finished,
    GetState,
    GetStats,
    InvalidRequestError,
    Priority,
    QueueFullError,
    ReplaceChildren,
    Request,
    Result,
    Route,
    StartChildren,
    Stats,
    StopChildren,
    SystemStoppedError,
    Task,
    TaskFuture,
    TracePrefix,
    UnavailableError,
    UnknownModelError,
    UsageError,
    flush_callbacks,
    on_callback_thread,
)
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.http import UNSENT
from callboard.runtime.io_loop import IoLoop
from callboard.runtime.ledger import Ledger
from callboard.runtime.sqlite_ledger import SqliteLedger
from callboard.runtime.stream import StreamChannel
from callboard.supervisor.address_book import (
    AddressBookClosedError,
    AddressError,
    UnknownActorError,
)
from callboard.supervisor.supervisor import Escalation

__all__ = ["ASK_TIMEOUT_S", "System"]

log = guarded_logger(__name__)
_system_ids = itertools.count(1)

CALLBACKS_AT_STOP_S = 5.0
"""How long ``stop`` waits for the callers' done-callbacks of what ended."""
FAILURE_POLL_S = 0.05
"""How soon a ``stop`` waiting for tasks to end notices that the system failed."""
ROOM_POLL_S = 1.0
"""How often ``resume`` looks whether the system stopped while it waits for room."""


class System:
    """One running callboard: actors, I/O thread, and (by default) a simulated provider."""

    def __init__(  # noqa: PLR0915 - one statement per part it holds, each documented
        self,
        config: SystemConfig | None = None,
        *,
        crash_plan: CrashPlan | None = None,
        provider: Any = None,
        ledger: Ledger | str | Path | None = None,
        io_loop: IoLoop | None = None,
    ) -> None:
        """``ledger``: a ``Ledger``, or a path for a durable SQLite ledger (see ``resume``).
        ``io_loop``: the I/O loop to make the calls on, started, and stopped by whoever
        made it, after this system (a server's, to serve on the loop its answers land
        on: ``gateway.server``); by default the system runs one of its own.
        ``provider``: a running simulated provider to call instead of starting one
        (anything with a ``base_url``; used only where no models are configured)."""
        if config is not None and not isinstance(config, SystemConfig):
            raise ConfigError(
                "config must be a SystemConfig (callboard.toml_config.load_config reads one "
                f"from a file), got {type(config).__name__}"
            )
        if io_loop is not None and not isinstance(io_loop, IoLoop):  # failed deep inside
            raise ConfigError(  # with an AttributeError (found by a hunt)
                "io_loop must be a started callboard.runtime.io_loop.IoLoop, got "
                f"{type(io_loop).__name__}"
            )
        if provider is not None and not isinstance(getattr(provider, "base_url", None), str):
            raise ConfigError(
                "provider must be a running simulated provider (callboard.provider.server."
                f"SimulatedProvider, or anything with a base_url), got {type(provider).__name__}"
            )
        self.config = config or SystemConfig()
        self._failure: Escalation | None = None
        self._failure_hooks: list[Callable[[Escalation], object]] = []
        self._hooks_lock = threading.Lock()
        self._failure_told: Escalation | None = None
        """Set once the failure hooks were called: a hook added later is called at once."""
        self._budget_closed = False
        self._budget_lock = threading.Lock()
        self._stopped = threading.Event()
        """Set when the teardown begins: from then on nothing is admitted or started."""
        self._torn_down = threading.Event()
        """The teardown has run to its end (``stop`` has nothing left to do)."""
        self._stop_lock = threading.RLock()
        """Taken by ``with`` on the main thread: a Ctrl-C handled as a Python-level
        ``acquire()`` returns would leave it held, every later stop waiting for it."""
        self._stopper: int | None = None
        self._stop_begun = threading.Event()  # a submit waiting for room then never sends
        """The thread whose ``stop`` is under way; another stop on that very thread is a
        signal handler's (it hurries the one it interrupted)."""
        self._hurry_by = math.inf
        """A stop asked during another: the other's wait ends by then (``_hurry``)."""
        self._resuming = threading.Lock()  # held by ``resume``: its read to its submit
        self._assembler = Assembler()
        """The thread embeddings are put together on (``_embed``)."""
        self._assembly = parts = _assembly_for(self.config)(
            self.config,
            ledger=ledger,
            provider=provider,
            crash_plan=crash_plan,
            on_budget_spent=self._budget_spent,
            io_loop=io_loop,
        )
        self.ledger = parts.ledger
        self.provider = parts.provider
        self.models = parts.models
        self.io = parts.io
        self.book = parts.book
        self.rt = parts.rt
        self.policy = parts.policy
        self.admission = parts.admission
        self._door = parts.door
        self.batching = Batching(self.models, self.policy.routes, self.config.escalate_to)
        """How texts to embed are split into calls (configuration only)."""
        self._dialects = tuple(sorted({m.api for m in self.models.values()} - {"azure"}))
        """The token rules a prompt is counted by: each dialect's that a model speaks
        (Azure's is OpenAI's)."""
        rules = tuple(
            dict.fromkeys(
                image_rule_of(m.wire_model) for m in self.models.values() if m.api != "anthropic"
            )
        )
        self.image_rules: tuple[ImageRule, ...] = () if rules in ((), (GPT_4O_IMAGES,)) else rules
        """The image rules of the OpenAI models (``core.tokens.image_rule_of``) when one
        is not GPT-4o's: a prompt with images is counted by each (none: GPT-4o's). The
        gateway's quota estimates count by them too."""
        self._pid = os.getpid()
        """The process whose threads these are: a fork's child has none of them."""
        self._prefix = TracePrefix(f"{self._pid:x}.{next(_system_ids)}")
        self._on_cancel = self._cancelled_by_caller  # one bound method shared by every future
        try:
            parts.start_actors(
                submit_run=self.submit, on_escalate=self._escalated, on_poison=self._poisoned
            )
        except BaseException:
            self._teardown()
            raise

    def _budget_spent(self) -> None:
        """The total budget is spent: refuse new work; stop if configured to."""
        with self._budget_lock:  # called from the router's and delivering threads
            if self._budget_closed:
                return
            self._budget_closed = True
        log.warning("the total budget is spent: no new tasks are admitted")
        self.admission.close("the total budget is spent")
        if self.config.budget.stop_when_spent:
            threading.Thread(
                target=self.stop, kwargs={"cancel": True}, name="callboard-budget"
            ).start()

    # -- submitting ----------------------------------------------------------

    def submit(
        self, prompt: Any = NO_PROMPT, /, *, wait_s: float | None = None, **fields: Any
    ) -> TaskFuture:
        """Submit one request (a prompt, chat messages or a ``Request``); returns its future
        (a ``TaskFuture``: its ``task_id`` is what ``cancel`` takes).

        The prompt may be given as ``prompt=`` or ``messages=`` instead, as in a JSONL
        line. Fields: ``priority``, ``model``, ``route``, ``max_tokens``, ``temperature``,
        ``deadline_s``, ``metadata`` (plain JSON), ``idempotency_key``, ``budget_tag``,
        ``trace_id``, ``extra_headers`` (sent with the request's calls, such as
        ``{"anthropic-beta": ...}``), and the Chat Completions fields (``tools``,
        ``response_format``, ..., ``extra_body``); any other keyword is an
        ``InvalidRequestError``.
        A full queue answers with a ``Rejected(QUEUE_FULL)`` result; with ``wait_s``
        the call blocks up to that long for room instead, then raises ``QueueFullError``
        (``SystemStoppedError`` if a stop began while it waited: the room it makes is
        not for new work).
        """
        checked_fields(fields, "submit", ("trace_id", "prompt", "messages"))
        wait = checked_seconds(wait_s, "wait_s")
        trace_id = checked_trace_id(fields.pop("trace_id", None))
        task = self._task(prompt, fields, trace_id=trace_id)
        self._wait_for_room((task,), wait)
        self._send((task,))
        future = task.future
        assert isinstance(future, TaskFuture)
        return future

    def stream(
        self, prompt: Any = NO_PROMPT, /, *, wait_s: float | None = None, **fields: Any
    ) -> ChatStream:
        """Submit one request whose answer streams: ``for delta in cb.stream("...")``
        yields each ``StreamDelta`` (text and tool-call fragments) as it arrives, and
        ``stream.result()`` is the whole ``Result`` (text, tool calls, usage, cost).

        Scheduled like ``submit`` (the same fields, priority, limits, retries before
        the first delta, budget). Iteration raises ``StreamFailedError`` if the task
        did not complete (a stream cut after its first delta fails ``STREAM_CUT`` with
        the text received). ``close()`` (or leaving the ``with`` block) stops it; a
        reader slower than the provider makes the call wait, never a growing buffer.
        """
        checked_fields(fields, "stream", ("trace_id", "prompt", "messages"))
        wait = checked_seconds(wait_s, "wait_s")
        trace_id = checked_trace_id(fields.pop("trace_id", None))
        channel = StreamChannel()
        task = self._task(prompt, fields, trace_id=trace_id, stream=channel)
        self._wait_for_room((task,), wait)
        self._send((task,))
        assert task.future is not None
        task_id = task.task_id
        cancel = functools.partial(self._cancelled_by_caller, task_id)  # no closure cells
        return ChatStream(task.future, channel, cancel)

    def submit_many(self, prompts: Iterable[Any], /, **fields: Any) -> list[TaskFuture]:
        """Submit a burst in one message; futures in input order. All are checked first
        (an invalid one named by its place: ``prompts[i]: ...``).

        ``fields`` are ``submit``'s (but the prompt's) and apply to every prompt; an
        ``idempotency_key`` becomes one per prompt (``key:i``), as a race's and a chain's
        do: one key for all had every prompt after the first refused as its duplicate."""
        checked_fields(fields, "submit_many", ("trace_id", "wait_s"))
        listed = checked_prompts(prompts, "submit_many")
        wait_s = checked_seconds(fields.pop("wait_s", None), "wait_s")
        trace_id = checked_trace_id(fields.pop("trace_id", None))  # shared, like every field
        key = fields.pop("idempotency_key", None)
        requests = []
        for i, prompt in enumerate(listed):
            own = fields if key is None else {**fields, "idempotency_key": _nth(key, i)}
            try:
                requests.append(self._request(prompt, own))
            except InvalidRequestError as exc:  # which of thousands (found by a hunt)
                raise InvalidRequestError(f"prompts[{i}]: {exc}") from None
        estimates = _prompts_tokens(requests, self._dialects, self.image_rules)
        tasks = tuple(
            self._task_of(request, trace_id=trace_id, prompt_tokens=tokens)
            for request, tokens in zip(requests, estimates, strict=True)
        )
        if tasks:
            self._wait_for_room(tasks, wait_s)
            self._send(tasks)
        return [f for t in tasks if isinstance(f := t.future, TaskFuture)]

    def embed(
        self,
        texts: str | Sequence[int] | Sequence[str | Sequence[int]],
        /,
        *,
        model: str | None = None,
        dimensions: int | None = None,
        encoding_format: Literal["float", "base64"] | None = None,
        keep_base64: bool = False,
        priority: Priority | str | int = Priority.NORMAL,
        route: str | None = None,
        budget_tag: str | None = None,
        deadline_s: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        user: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        trace_id: str | None = None,
        wait_s: float | None = None,
        **unknown: Never,
    ) -> EmbedFuture:
        """Embed ``texts`` (one string, or a list; a text may be given as its token ids, a
        list of integers, as OpenAI's API takes it); the future's ``EmbeddingResult``
        holds one vector per text, in input order, or a failure naming the batch that
        failed.

        Without ``model`` (or ``route``) the first model with the ``embeddings``
        capability serves. An input larger than one call is split into calls within the
        models' ``embedding_batch_size`` and ``embedding_batch_tokens`` (and their tokens
        per minute), sent in one burst as ordinary tasks: priority, limits, retries and
        budget apply to each. ``dimensions``, ``user`` and ``extra_body`` go to the
        provider. Vectors are sent as base64 (cheaper to read) unless
        ``encoding_format="float"``, and given as floats unless ``keep_base64``.
        ``wait_s``, ``trace_id`` and misuse as for ``submit`` (``wait_s`` waits for room
        for each chunk of calls; ``QueueFullError`` only while none has gone out: after
        that the queue's refusal fails the future's result, which the caller has);
        cancelling the future cancels the calls not sent yet, and its ``spent`` then
        says what the calls sent before cost (``EmbedFuture``). Any other keyword is an
        ``InvalidRequestError`` naming the one meant (and, to mypy, an argument of type
        ``Never``).
        """
        refuse_keywords(unknown, "embed", System.embed)
        wait = checked_seconds(wait_s, "wait_s")
        trace = checked_trace_id(trace_id) or new_trace_id("embed")
        listed, _ = texts_of(texts)
        if type(keep_base64) is not bool:
            raise InvalidRequestError(f"keep_base64 must be True or False, got {keep_base64!r}")
        if keep_base64 and encoding_format == "float":
            raise InvalidRequestError(
                "keep_base64 keeps base64 vectors: it cannot go with encoding_format='float'"
            )
        fields: dict[str, Any] = {
            "route": route,
            "priority": priority,
            "budget_tag": budget_tag,
            "deadline_s": deadline_s,
            "metadata": metadata,
            "dimensions": dimensions,
            "encoding_format": encoding_format or "base64",
            "user": user,
            "extra_body": extra_body,
        }
        self.policy.check(embedding_request(listed[:1], {**fields, "model": model}))
        plan = self.batching.chunks(listed, model, route, fields)  # refuses a text too large now
        fields["model"] = plan.model
        gathering = Gathering(
            assembler=self._assembler,
            cancel=functools.partial(cancel_unsent, self),
            trace_id=trace,
            keep_base64=keep_base64,
            dimensions=dimensions,
        )
        sent_any = False
        try:  # each chunk's calls go out while the next chunk is counted
            for calls in plan:
                if gathering.failing:  # a batch failed: the rest would only be cancelled
                    break
                tasks = tuple(
                    self._task(
                        embedding_request(listed[span.start : span.stop], fields),
                        {},
                        trace_id=trace,
                        prompt_tokens=tokens,
                    )
                    for span, tokens in zip(calls.spans, calls.tokens, strict=True)
                )
                try:
                    self._wait_for_room(tasks, wait)
                except QueueFullError:
                    if not sent_any:  # nothing went out: the caller's to retry
                        raise
                    # calls went out and were charged: the caller gets the future, its
                    # result failing by what the queue refuses (Rejected QUEUE_FULL)
                self._send(tasks)
                sent_any = True
                gathering.add(calls.spans, [t.future for t in tasks if t.future is not None])
        except BaseException:
            gathering.future.cancel()  # what was sent before the refusal, not yet on the wire
            gathering.seal()  # its spent resolves once what was sent has ended
            raise
        gathering.seal()
        return gathering.future

    def resume(self) -> list[TaskFuture]:
        """Submit again every task a durable ledger holds without an outcome.

        After a crash, a system started on the same ledger file calls this to
        finish what the dead process accepted. Each keeps its task id (and
        idempotency key); its deadline, if any, counts from now. The queue's
        capacity does not refuse them (they were accepted once): with more than it
        holds, this returns once the last is submitted, waiting for room as the
        first finish (call it from a thread of its own to go on meanwhile); a stop
        meanwhile raises ``SystemStoppedError``, and what was not submitted stays
        unfinished in the file for the next resume (a second call meanwhile waits for
        the first to have submitted all it took, then returns what is left). A task this
        configuration cannot serve as it was asked (a model or route no longer
        configured) ends ``Failed(REQUEST_ERROR)`` saying why, and the others resume
        (one such task stopped every other from resuming; found by a hunt). A task
        resumed already (live) is not submitted again: a second call, even at the
        same time, returns only what is left.
        """
        if not isinstance(self.ledger, SqliteLedger):
            return []
        with self._resuming:  # two at once submitted each task twice (found by a review)
            tasks: list[Task] = []
            broken: list[tuple[Task, Result]] = []
            ours = self.ledger.first_own_id  # this process's tasks are not to resume, and
            pending = self.ledger.pending_ids()  # those resumed already, nor those ended
            for stored in self.ledger.unfinished():  # whose outcome is on its way to the file
                if stored.task_id >= ours or stored.task_id in pending:
                    continue
                try:
                    tasks.append(
                        self._task(
                            stored.request, {}, task_id=stored.task_id, trace_id=stored.trace_id
                        )
                    )
                except (InvalidRequestError, UnknownModelError) as exc:
                    task = self._unchecked_task(stored.request, stored.task_id, stored.trace_id)
                    said = f"resumed, and this configuration cannot serve it: {exc}"
                    failed = ended(
                        Failed,
                        task,
                        task.submitted_at,
                        reason=FailureReason.REQUEST_ERROR,
                        detail=said,
                    )
                    broken.append((task, failed))
            if tasks or broken:
                log.warning(
                    "resuming %d unfinished tasks from %s",
                    len(tasks) + len(broken),
                    self.ledger.path,
                )
            if broken:
                log.warning("%d of them cannot be served as asked: each ends failed", len(broken))
                self._door.end_at_once(broken)
            self._resubmit(tuple(tasks))
        resumed = (*(t for t, _ in broken), *tasks)
        return [f for t in resumed if isinstance(f := t.future, TaskFuture)]

    def _resubmit(self, tasks: tuple[Task, ...]) -> None:
        """Admit resumed ``tasks``, in order, as room in the queue allows: each wait is
        for room for a batch (a quarter of the queue, or what is left), and only that
        batch is offered (offering all that waited after each freed slot asked the
        ledger, under its lock, 166 times as many answers as tasks; a review)."""
        capacity = self.admission.capacity
        batch = len(tasks)
        told = False
        while tasks:
            crowded: list[Task] = []
            self._send(tasks[:batch], crowded=crowded)
            tasks = (*crowded, *tasks[batch:])
            if not tasks:
                return
            if not told:
                told = True
                log.warning(
                    "%d resumed tasks wait for room in the queue (%d tasks)",
                    len(tasks),
                    capacity,
                )
            batch = min(len(tasks), max(1, capacity // 4))
            while not self.ledger.wait_for_room(capacity, batch, ROOM_POLL_S):
                self._check_alive()  # stopped meanwhile: the rest stay in the file

    def _unchecked_task(self, request: Request, task_id: int, trace_id: str) -> Task:
        """A resumed task as it was asked, not checked against this configuration (it
        is about to end failed)."""
        return Task(
            task_id=task_id,
            trace_id=trace_id,
            request=request,
            submitted_at=self.rt.clock(),
            prompt_tokens=0,
            future=TaskFuture(task_id, trace_id, on_cancel=self._on_cancel),
        )

    def cancel(self, *task_ids: int) -> None:
        """Cancel tasks by id wherever they wait unsent (they end as ``Cancelled``):
        on their way to the queue, in it, at a model before admission or between
        retries. A call already sent runs to its end. Raises ``SystemStoppedError``
        once stopped (every task has ended then)."""
        if not all(type(i) is int for i in task_ids):
            raise InvalidRequestError(f"cancel takes task ids (integers), got {task_ids!r}")
        self._check_process()
        try:
            self.book.tell(QUEUE, Cancel(task_ids=tuple(task_ids)))
        except AddressBookClosedError as exc:
            raise SystemStoppedError(str(exc)) from None

    def _cancelled_by_caller(self, task_id: int) -> None:
        self.book.try_tell(QUEUE, Cancel(task_ids=(task_id,)))

    def _task(
        self,
        prompt: Any,
        fields: dict[str, Any],
        task_id: int | None = None,
        trace_id: str | None = None,
        stream: StreamChannel | None = None,
        *,
        prompt_tokens: int | None = None,
    ) -> Task:
        """One caller task, checked; ``fields`` are the request's (``request_of``'s);
        ``stream``: where its deltas go, for a streamed one; ``prompt_tokens``: its
        estimate when the caller has it already."""
        request = self._request(prompt, fields)
        return self._task_of(request, task_id, trace_id, stream, prompt_tokens=prompt_tokens)

    def _request(self, prompt: Any, fields: dict[str, Any]) -> Request:
        """One caller request, checked, while the system admits."""
        self._check_alive()
        if not self.admission.is_open:
            raise SystemStoppedError(f"callboard is not admitting: {self.admission.reason}")
        request = request_of(prompt, fields)
        self.policy.check(request)
        return request

    def _task_of(
        self,
        request: Request,
        task_id: int | None = None,
        trace_id: str | None = None,
        stream: StreamChannel | None = None,
        *,
        prompt_tokens: int | None = None,
    ) -> Task:
        """The task of a checked ``request`` (``_request``)."""
        now = self.rt.clock()
        task_id = task_id or self.ledger.next_id()
        trace_id = trace_id or self._prefix  # <prefix>.<task id>, derived when read
        return Task(
            task_id=task_id,
            trace_id=trace_id,
            request=request,
            submitted_at=now,
            deadline_at=None if request.deadline_s is None else now + request.deadline_s,
            prompt_tokens=(
                _prompt_tokens(request, self._dialects, self.image_rules)
                if prompt_tokens is None
                else prompt_tokens
            ),
            future=TaskFuture(task_id, trace_id, on_cancel=self._on_cancel),
            stream=stream,
        )

    def _wait_for_room(self, tasks: tuple[Task, ...], wait_s: float | None) -> None:
        """With ``wait_s``, block until the queue has room for ``tasks`` (or ``QueueFullError``)."""
        if wait_s is None:
            return
        capacity = self.admission.capacity
        if len(tasks) > capacity:
            raise QueueFullError(
                f"{len(tasks)} tasks can never fit a queue of {capacity}", for_good=True
            )
        began = self._stop_begun.is_set()  # then, as any submit, it is refused (Rejected)
        if not self.ledger.wait_for_room(capacity, len(tasks), wait_s):
            raise QueueFullError(f"queue stayed full ({capacity} tasks) for {wait_s} s")
        if not began and self._stop_begun.is_set():  # the room is the stop's: not for new
            raise SystemStoppedError("callboard stopped while the submit waited for room")

    def _send(self, tasks: tuple[Task, ...], *, crowded: list[Task] | None = None) -> None:
        """Admit ``tasks`` at the front door, on this thread (``actors.ingest``)."""
        try:
            self._door.admit(tasks, crowded=crowded)
        except AddressError as exc:  # each accepted task ended (Rejected) first
            raise SystemStoppedError(f"callboard is not running: {exc}") from exc

    def _check_alive(self) -> None:
        """Raise ``SystemStoppedError`` once the system failed or stopped, or in a fork's
        child."""
        self._check_process()
        if self._failure is not None:
            raise SystemStoppedError(str(self._failure))
        if self._stopped.is_set():
            raise SystemStoppedError("callboard is stopped")

    def _check_process(self) -> None:
        """Raise ``SystemStoppedError`` in a process this system was not started in: a
        fork copies the object, not its actors' threads (gunicorn's ``--preload``, a
        ``multiprocessing`` pool's workers). A task handed to them there was never
        answered, and a stop waited a minute for actors that are not there."""
        if os.getpid() != self._pid:
            raise SystemStoppedError(
                f"this System was started in process {self._pid} and this is process "
                f"{os.getpid()} (a fork): its actors run only there; build a System in "
                "this process (after the fork: gunicorn's post_fork, a pool's initializer)"
            )

    # -- patterns and recurring jobs: written once, in their modules ---------------

    gather = _gather.gather
    as_completed = _gather.as_completed
    race = _race.race
    chain = _chain.chain
    fire_and_forget = _callbacks.fire_and_forget
    every = _jobs.every
    jobs = _jobs.jobs

    # -- reading -------------------------------------------------------------------

    def stats(self) -> Stats:
        """A frozen snapshot: outcomes, latency and queue-wait percentiles, tokens, cost.

        It counts every result handed out before the call (see ``actors.aggregator``),
        and is readable while the aggregator restarts (it answers once back) or the
        system drains. A failed system answers what it ended with, every task
        counted. Raises ``SystemStoppedError`` once stopped, and ``UnavailableError``
        if no answer comes within ``ASK_TIMEOUT_S``."""
        self._check_process()
        failure = self._failure
        if failure is not None:
            return self._final_stats(failure)
        self._check_alive()
        counts = self.ledger.counts()
        snapshot = self._aggregated(counts.finished + counts.rejected)
        restarts = {n: s["restarts"] for n, s in self.supervision().items() if isinstance(s, dict)}
        return self._completed(snapshot, restarts)

    def _final_stats(self, failure: Escalation) -> Stats:
        """The stats of a failed system, read once its teardown has counted every result."""
        if not self._torn_down.wait(ASK_TIMEOUT_S):
            raise UnavailableError(f"the failed system did not stop within {ASK_TIMEOUT_S} s")
        return self._completed(snapshot(self.rt), dict(failure.restarts))

    def _completed(self, stats: Stats, restarts: dict[str, int]) -> Stats:
        """``stats`` with what the aggregator does not know: restarts and the budget."""
        budget = self.rt.budget
        budgets = budget.snapshot() if budget is not None else {}
        return dataclasses.replace(stats, restarts=restarts, budget=budgets)

    def _aggregated(self, results: int) -> Stats:
        """The aggregator's snapshot once it has accounted ``results`` results. The
        question is told, not asked (held while the aggregator restarts), and told again
        to each new incarnation: a dying one loses it (an answered question is ignored)."""
        reply: Future[Stats] = Future()
        question = GetStats(finished=results, reply=reply)
        deadline = time.monotonic() + ASK_TIMEOUT_S
        told = self.book.resolve(AGGREGATOR)
        self.tell(AGGREGATOR, question)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UnavailableError(f"the aggregator did not answer within {ASK_TIMEOUT_S} s")
            try:  # a live aggregator answers within its grace
                return reply.result(timeout=min(left, STATS_GRACE_S + 0.5))
            except TimeoutError:
                self._check_alive()
            current = self.book.resolve(AGGREGATOR)
            if current is not None and current is not told:
                told = current
                self.tell(AGGREGATOR, question)

    def supervision(self) -> dict[str, Any]:
        """Each actor's incarnation, restarts and last errors.

        Raises ``SystemStoppedError`` once stopped (the supervisor is gone)."""
        self._check_process()
        sup = self._assembly.supervisor
        try:
            if sup is not None:
                return cast(dict[str, Any], sup.ask(GetState(), timeout=ASK_TIMEOUT_S))
        except pykka.ActorDeadError:
            pass
        raise SystemStoppedError("callboard is stopped: no supervisor to ask")

    def ask(self, name: str, message: Any, timeout: float = ASK_TIMEOUT_S) -> Any:
        """Ask an actor by name (``"queue"``, ``"model:sim-fast"``...); for the REPL and tests.

        Raises ``UnknownActorError`` for a name no actor has, ``SystemStoppedError``
        if that actor is not running (restarting, or the system stopped), and
        ``UsageError`` for the supervisor's start and stop, which are ``System``'s."""
        self._check_process()
        _not_lifecycle(message)
        if name not in self.book.names():  # a typo, not a restart
            raise UnknownActorError(
                f"no actor named {name!r}; there are {sorted(self.book.names())}"
            )
        ref = self.book.resolve(name)
        if ref is None:
            raise SystemStoppedError(f"{name} is not running (restarting or stopped)")
        try:
            return ref.ask(message, timeout=timeout)
        except pykka.ActorDeadError:
            raise SystemStoppedError(f"{name} is not running (restarting or stopped)") from None

    def tell(self, name: str, message: Any) -> None:
        """Tell an actor by name; held and delivered if it is restarting.

        Raises ``SystemStoppedError`` once stopped, ``UsageError`` for the supervisor's
        start and stop."""
        self._check_process()
        _not_lifecycle(message)
        try:
            self.book.tell(name, message)
        except AddressBookClosedError as exc:
            raise SystemStoppedError(f"callboard is stopped: {exc}") from None

    @property
    def stop_begun(self) -> bool:
        """Whether a stop has begun: a submit that was waiting for room then raises
        ``SystemStoppedError`` (one made after it is refused, as any submit is)."""
        return self._stop_begun.is_set()

    @property
    def failure(self) -> Escalation | None:
        """Why the supervisor gave up, if it did."""
        return self._failure

    def on_failure(self, hook: Callable[[Escalation], object]) -> None:
        """Call ``hook(escalation)`` if the system gives up: on a thread of its own, once
        every task has ended (at once, here, if that is done already)."""
        with self._hooks_lock:
            told = self._failure_told
            if told is None:
                self._failure_hooks.append(hook)
                return
        hook(told)

    # -- draining and stopping -------------------------------------------------------

    def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting, wait for every accepted task to finish, admit again. True if idle."""
        timeout = checked_seconds(timeout, "timeout")
        self._check_process()
        self.admission.hold("draining")
        try:
            return self.ledger.wait_idle(timeout)
        finally:
            self.admission.release()  # open again unless a stop or a spent budget closed it

    def stop(self, *, cancel: bool = False, timeout: float | None = 30.0) -> None:
        """Stop. Waits for accepted tasks (queued ones end ``Cancelled`` if ``cancel``).

        Whatever has not finished within ``timeout`` ends ``Cancelled``; then
        every actor and thread is stopped. A failure (``on_failure``) meanwhile
        ends the wait: what is left ends ``Failed`` at once. Idempotent. A stop
        cut short (a ``KeyboardInterrupt`` while it waits, say) is finished by
        the next call: ``stop(timeout=0)`` then stops at once.

        Called while another stop is under way, its ``cancel`` and a shorter
        ``timeout`` hurry that stop, and it returns once that stop has ended; but on
        the same thread (a signal handler that interrupted it) or from a done-callback
        (whose thread the stop waits for) it returns at once, as waiting would never
        end. In a fork's child it returns at once: what it would stop runs in the parent
        (a ``with System()`` block the fork happened in ends there as well).
        """
        timeout = checked_seconds(timeout, "timeout")
        if os.getpid() != self._pid:  # a fork's child: the actors to stop are the parent's
            return
        if on_callback_thread():  # never the main thread, where a Ctrl-C lands
            if not self._stop_lock.acquire(blocking=False):  # a stop or a failure's
                self._hurry(cancel=cancel, timeout=timeout)  # teardown holds it, and
                return  # waits for this very thread
            try:
                self._stop_held(cancel=cancel, timeout=timeout)
            finally:
                self._stop_lock.release()
            return
        if self._stopper != threading.get_ident():  # another thread's stop, under way or
            self._hurry(cancel=cancel, timeout=timeout)  # about to be (it may hold the lock
        with self._stop_lock:  # before it says so): this one's cancel and timeout hold for
            self._stop_held(cancel=cancel, timeout=timeout)  # it (re-entrant: a handler's)

    def _stop_held(self, *, cancel: bool, timeout: float | None) -> None:
        """``stop``'s work, with ``_stop_lock`` held."""
        me = threading.get_ident()
        if self._stopper == me:  # inside a stop under way on this very thread
            self._hurry(cancel=cancel, timeout=timeout)
            return
        try:
            self._stopper = me
            if self._torn_down.is_set():
                return
            if not self._stopped.is_set():
                self._stop_begun.set()  # before the cancel below frees any room
                _jobs.stop_jobs(self, ASK_TIMEOUT_S)  # first: a job's tick finds the door shut
                self.admission.close("stopping")
                if self._failure is None:
                    if cancel:
                        self._cancel_everything()
                    self._wait_idle(timeout)
            self._teardown()
        finally:
            self._stopper = None
            self._hurry_by = math.inf  # what hurried this stop is done with

    def _cancel_everything(self) -> None:
        self.book.try_tell(QUEUE, Cancel(everything=True, detail="system stopped"))

    def _hurry(self, *, cancel: bool, timeout: float | None) -> None:
        """A stop asked while another is under way: its wait ends no later than this
        one's ``timeout`` allows, cancelling first if asked (signal-safe: no lock)."""
        if cancel:
            self._cancel_everything()
        if timeout is not None:
            self._hurry_by = min(self._hurry_by, time.monotonic() + timeout)

    def _wait_idle(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for every accepted task to end, or for a failure (the
        ledger's wait cannot hear of one: it is taken in slices of ``FAILURE_POLL_S``)."""
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        while self._failure is None:
            left = min(deadline, self._hurry_by) - time.monotonic()
            if self.ledger.wait_idle(max(0.0, min(left, FAILURE_POLL_S))) or left <= 0:
                return

    def _teardown(self) -> None:
        """Shut the door for good and stop the assembly; may run again if cut short."""
        self._stopped.set()
        self.admission.stop("stopped")
        self._assembly.stop(sweep=self._sweep)
        self._assembler.close()  # after the sweep: every embedding has its batches' results
        # the callers' done-callbacks of what ended (they ran on the actors' threads,
        # which the stop joins: they had all run when it returned); bounded
        flush_callbacks(CALLBACKS_AT_STOP_S)
        self._torn_down.set()

    def _sweep(self) -> None:
        """End every task still live or held, so no future is left unresolved: ``Cancelled``,
        or ``Failed`` (internal) once the supervisor gave up. Runs once every actor
        stopped, so it counts in ``rt.stats`` what it ends and what the aggregator missed,
        and accounts each job's run still in flight, whose report no actor took."""
        now = self.rt.clock()
        failure = self._failure
        kind: type[Result] = Cancelled if failure is None else Failed
        fields: dict[str, Any] = (
            {"detail": "system stopped before the task finished"}
            if failure is None
            else {"reason": FailureReason.INTERNAL, "detail": str(failure)}
        )
        stats = self.rt.stats  # the aggregator is gone: its counts are the sweep's to finish
        answered: set[int] = set()  # calls that ended, their results held unjudged
        for name in self.book.names():
            for message in self.book.take_held(name):
                late = getattr(message, "message", message)  # a ``Redelivered`` one, unwrapped
                if type(late) is Finished:  # the held tasks are live: ended just below
                    account(self.rt, late.results)
                elif type(late) is CallsDone:
                    answered.update(r.task_id for r in late.results if r.error != UNSENT)
        on_wire = self._assembly.on_wire() | answered
        live = []
        for task, job, handed_to in self.ledger.live_entries():
            cut: dict[str, Any] = {}
            counted = job
            if job is not None and handed_to is not None:  # its job counts the call
                if task.task_id in on_wire:
                    cut = self._cut_call(task, handed_to)
                else:  # in the loop's window: never sent, not counted (nor charged)
                    counted = unsent(job)
            live.append((task, ended(kind, task, now, job=counted, **fields, **cut)))
        deliver(self.rt, live)  # its word to the aggregator is refused: counted here
        account(self.rt, tuple(r for _, r in live))
        for health in list(stats.health.values()):  # nothing is in flight any more
            note_health(self.rt, dataclasses.replace(health, in_flight=0))
        settle_runs(self.rt.jobs)  # the jobs actor is gone: the runs it awaited, accounted

    def _cut_call(self, task: Task, model: str) -> dict[str, Any]:
        """What a call the stop cut on the wire may have cost: the most it could have
        used at ``model``'s price, marked estimated, as any call cut without its usage
        (a stop past its grace charged such calls nothing, and a gateway gave their
        reservations back; found by a hunt). Only a call the loop started: one waiting
        in its window, or a job waiting for a retry, was charged too (a review)."""
        settings = self.models.get(model)
        if settings is None:
            return {}
        usage, cost = most_charged(task, settings.price)  # on its model: stats by model
        return {"model": model, "usage": usage, "cost_nusd": cost}  # summed to the total

    # -- supervision callbacks (run on the supervisor's thread) ----------------------

    def _escalated(self, escalation: Escalation) -> None:
        """The supervisor gave up, or died: refuse everything, fail all, then tell the
        hooks (on a thread: never on the supervisor's)."""
        self._failure = escalation
        self.admission.stop(str(escalation))
        threading.Thread(
            target=self._fail_all, args=(escalation,), name="callboard-escalation"
        ).start()

    def _fail_all(self, escalation: Escalation) -> None:
        """Tear down, unless a stop began (its sweep ends every live task ``Failed``,
        internal: the actors are stopped first, so nothing they were told is lost);
        then call the failure hooks."""
        try:
            with self._stop_lock:
                if not self._stopped.is_set():
                    self._teardown()
        except Exception:  # the hooks must hear of it even if the teardown fails
            log.exception("tearing down the failed system failed")
        with self._hooks_lock:
            self._failure_told = escalation
            hooks = list(self._failure_hooks)
        for hook in hooks:
            try:
                hook(escalation)
            except Exception:
                log.exception("a failure hook raised")

    def _poisoned(self, message: Any, why: str) -> None:
        """A message its actor crashed on twice: its tasks end ``Failed`` (internal)."""
        now = self.rt.clock()
        ledger = self.rt.ledger
        failed = [
            (task, ended(Failed, task, now, reason=FailureReason.INTERNAL, detail=why))
            for task in tasks_in(message)
            if not isinstance(message, Route) or ledger.is_accepted(task.task_id)
        ]  # a Route's tasks that the router's successor routed (its setup routes every
        # task still accepted) are on their way: failed, their calls went out and were
        # billed, and neither the stats nor the budget counted them (found by a hunt)
        deliver(self.rt, failed)  # which also settles (releases) their budget reservations

    # -- context manager -----------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop(cancel=exc is not None)

    def __repr__(self) -> str:
        state = "failed" if self._failure else "stopped" if self._stopped.is_set() else "running"
        return f"<callboard.System {state} models={list(self.models)}>"


def _assembly_for(config: SystemConfig) -> type[Assembly]:
    """The machinery ``config`` runs on: this process alone (pykka), or, with a
    ``cluster``, the queue and models on Ray (imported only then)."""
    if config.cluster is None:
        return Assembly
    from callboard.cluster import ClusterAssembly

    return ClusterAssembly


def _not_lifecycle(message: Any) -> None:
    """Refuse the supervisor's start, stop and replacement of its children from a
    caller: ``StopChildren`` told by hand stopped every actor behind the system's back,
    and submits were accepted that nothing would ever take (found by a hunt)."""
    if isinstance(message, StartChildren | StopChildren | ReplaceChildren):
        raise UsageError(
            f"{type(message).__name__} is the system's own: use System.stop() (or a new "
            "System) instead"
        )


def tasks_in(message: Any) -> list[Task]:
    """The tasks a pipeline message carries (looking inside a wrapped one)."""
    if isinstance(message, Route):
        return list(message.tasks)
    if isinstance(message, Enqueue | Call):
        return [j.task for j in message.jobs]
    inner = getattr(message, "message", None)
    return tasks_in(inner) if inner is not None else []


def _prompt_tokens(
    request: Request, dialects: tuple[str, ...], image_rules: tuple[ImageRule, ...] = ()
) -> int:
    """The request's prompt estimate: its turns, and its tools and JSON schema if any,
    by the larger count of the ``dialects`` its models may speak (Anthropic's frames
    tools and images otherwise than OpenAI's), each image by the costliest of the
    ``image_rules`` of its OpenAI models (gpt-4o-mini counts one 33 times GPT-4o's;
    none: GPT-4o's), so the reservation holds whichever serves; for texts to embed,
    their tokens (as the simulated provider counts them)."""
    if request.input is not None:
        return sum(inputs_tokens(request.input))
    counted_by = dialects or ("openai",)
    images = image_rules or (GPT_4O_IMAGES,)
    if _one_chat_estimate(request, counted_by):  # the common case
        return estimate_prompt_tokens(request.messages, dialect=counted_by[0], images=images)
    if not request.options:
        return max(
            estimate_prompt_tokens(request.messages, dialect=d, images=images) for d in counted_by
        )
    turns = [m.wire() for m in request.messages]
    tools = request.options.get("tools")
    response_format = request.options.get("response_format")
    return max(
        count_chat_tokens(
            turns, tools=tools, response_format=response_format, dialect=d, images=images
        )
        for d in counted_by
    )


def _prompts_tokens(
    requests: Sequence[Request], dialects: tuple[str, ...], image_rules: tuple[ImageRule, ...] = ()
) -> list[int]:
    """``_prompt_tokens`` of each request; the chats without options, counted by one
    dialect, together (``estimate_prompts_tokens``: the same numbers, measured 3.1 us a
    short prompt against 8.9 us alone, on the submitting thread, which holds the
    interpreter's lock meanwhile)."""
    counted_by = dialects or ("openai",)
    together = [i for i, r in enumerate(requests) if _one_chat_estimate(r, counted_by)]
    if len(together) < 2:
        return [_prompt_tokens(r, dialects, image_rules) for r in requests]
    counted = estimate_prompts_tokens(
        [requests[i].messages for i in together],
        dialect=counted_by[0],
        images=image_rules or (GPT_4O_IMAGES,),
    )
    estimates = dict(zip(together, counted, strict=True))
    return [
        estimates[i] if i in estimates else _prompt_tokens(r, dialects, image_rules)
        for i, r in enumerate(requests)
    ]


def _one_chat_estimate(request: Request, counted_by: tuple[str, ...]) -> bool:
    """Whether ``request``'s estimate is its turns' alone, by one dialect: a chat with
    no options (tools, a JSON schema), counted one way (``estimate_prompt_tokens``)."""
    return request.input is None and not request.options and len(counted_by) == 1


def _nth(key: object, i: int) -> object:
    """The ``i``-th prompt's own idempotency key (a key not a string is left for the
    request's check to refuse)."""
    return f"{key}:{i}" if isinstance(key, str) and key.strip() else key
