"""``System``: the sync face of callboard; it builds and owns one actor system.

``System()`` with no arguments starts the simulated provider on 127.0.0.1
and two models on it; ``System(config)`` runs the configured models. Every
public method is thread-safe. ``submit`` returns a
``concurrent.futures.Future`` that resolves to a ``Result`` (failures are
results, not exceptions); misuse (an empty prompt, an unknown model, a
submit after stop) raises a ``UsageError`` / ``SystemStoppedError`` at once.

Shutdown leaves nothing behind: ``stop`` resolves every future it does not
finish (as ``Cancelled``) and joins every thread it started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from decimal import Decimal
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, cast

import pykka

from callboard.actors._base import (
    AGGREGATOR,
    INGEST,
    QUEUE,
    ROUTER,
    SUPERVISOR,
    CrashPlan,
    Runtime,
    deliver,
    ended,
    model_address,
)
from callboard.actors._io import IoLoop
from callboard.actors.aggregator import STATS_GRACE_S, AggregatorActor
from callboard.actors.budget import Budgets, SharedBudget
from callboard.actors.http import ModelClient, make_transport
from callboard.actors.ingest import Admission, IngestActor
from callboard.actors.model import ModelActor
from callboard.actors.pricing import usd_to_nusd
from callboard.actors.queue import QueueActor
from callboard.actors.router import RouterActor
from callboard.actors.routing import RoutingPolicy
from callboard.actors.settings import ModelSettings
from callboard.actors.tokens import estimate_prompt_tokens
from callboard.messages import (
    Call,
    Cancel,
    Cancelled,
    Enqueue,
    Failed,
    FailureReason,
    GetState,
    QueueFullError,
    Regrant,
    Request,
    Result,
    Route,
    Submit,
    SystemStoppedError,
    Task,
    TaskFuture,
    UnavailableError,
)
from callboard.messages._stats import GetStats, Stats
from callboard.supervisor.address_book import AddressBook, AddressBookClosedError
from callboard.supervisor.ledger import Ledger
from callboard.supervisor.sqlite_ledger import SqliteLedger
from callboard.supervisor.supervisor import ChildSpec, Escalation, Supervisor

from . import jobs as _jobs
from . import patterns
from ._jobs_actor import StopAllJobs
from ._switch import SwitchInterval
from .config import SystemConfig, simulated_models
from .jobs import JOBS, JobHandle, JobInfo, JobsActor
from .patterns import ChainResult, ErrorCallback, RaceResult, ResultCallback, Stage

log = logging.getLogger(__name__)
ASK_TIMEOUT_S = 10.0
_system_ids = itertools.count(1)


class System:
    """One running callboard: actors, I/O thread, and (by default) a simulated provider."""

    def __init__(
        self,
        config: SystemConfig | None = None,
        *,
        crash_plan: CrashPlan | None = None,
        provider: Any = None,
        ledger: Ledger | str | Path | None = None,
    ) -> None:
        """``ledger``: a ``Ledger``, or a path for a durable SQLite ledger (see ``resume``)."""
        self.config = config or SystemConfig()
        # first: a ledger that cannot be opened must leave no thread or server behind
        self.ledger = ledger if isinstance(ledger, Ledger) else _open_ledger(ledger)
        try:
            self._build(provider, crash_plan)
        except BaseException:
            self._abandon(owns_ledger=not isinstance(ledger, Ledger))
            raise

    def _build(self, provider: Any, crash_plan: CrashPlan | None) -> None:
        self._switch_interval = SwitchInterval(self.config.switch_interval_s)
        """Held from just before the actors start until the end of the teardown."""
        self.provider = provider
        self._own_provider = False
        if self.config.simulated and provider is None:
            from callboard.bench.provider import ModelBehaviour, SimulatedProvider

            self.provider = SimulatedProvider(
                models={
                    "sim-fast": ModelBehaviour(latency_s=0.02, jitter_s=0.005),
                    "sim-smart": ModelBehaviour(latency_s=0.06, jitter_s=0.01),
                },
                seed=self.config.seed,
            )
            self.provider.start()
            self._own_provider = True
        models = self.config.models or simulated_models(self.provider.base_url)
        self.models: dict[str, ModelSettings] = {m.name: m for m in models}
        self._prefix = f"{os.getpid():x}.{next(_system_ids)}"
        self._failure: Escalation | None = None
        self._failure_hooks: list[Callable[[Escalation], object]] = []
        self._budget_closed = False
        self._budget_lock = threading.Lock()
        self._stopped = threading.Event()
        """Set when the teardown begins: from then on nothing is admitted or started."""
        self._torn_down = False
        """The teardown has run to its end (``stop`` has nothing left to do)."""
        self._stop_lock = threading.Lock()
        self._on_cancel = self._cancelled_by_caller  # one bound method shared by every future
        self.io = IoLoop()
        self.io.start()
        self.book = AddressBook()
        self.rt = Runtime(book=self.book, ledger=self.ledger, io=self.io, crash_plan=crash_plan)
        default = self.config.default_route
        self.policy = RoutingPolicy(
            self.models,
            default_route=default[0]
            if default and len(default) == 1 and default[0] not in self.models
            else default,
            routes=self.config.routes,
            order=self.config.order,
            escalate_to=self.config.escalate_to,
        )
        self.rt.budget = self._budget()
        self.rt.on_budget_spent = self._budget_spent
        self.admission = Admission(self.config.scheduler.capacity)
        self._transports = {name: make_transport(m) for name, m in self.models.items()}
        self._clients: dict[str, ModelClient] = {}
        self._epoch = self.rt.clock()
        try:
            self._switch_interval.hold()
            self._start_actors()
        except BaseException:
            self._teardown()
            raise

    def _abandon(self, *, owns_ledger: bool) -> None:
        """``__init__`` failed: stop what it had started (unless the teardown did)."""
        stopped = getattr(self, "_stopped", None)
        if stopped is not None and stopped.is_set():
            return
        io = getattr(self, "io", None)
        if io is not None:
            io.stop()
        if getattr(self, "_own_provider", False) and self.provider is not None:
            self.provider.stop()
        if owns_ledger:
            self.ledger.close()

    # -- wiring -------------------------------------------------------------

    def _budget(self) -> SharedBudget | None:
        b = self.config.budget
        if not b.enabled:
            return None
        budgets = Budgets(
            None if b.total_usd is None else usd_to_nusd(b.total_usd),
            {tag: usd_to_nusd(v) for tag, v in b.per_tag_usd.items()},
            downgrade_when_tight=b.downgrade_when_tight,
        )
        return SharedBudget(budgets, {name: m.price for name, m in self.models.items()})

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

    def _specs(self) -> list[ChildSpec]:
        rt = self.rt
        specs = [
            ChildSpec(name=AGGREGATOR, start=lambda n: AggregatorActor.start(rt, AGGREGATOR, n))
        ]
        specs.extend(
            ChildSpec(name=model_address(name), start=functools.partial(self._start_model, name))
            for name in self.models
        )
        specs += [
            ChildSpec(
                name=QUEUE,
                start=lambda n: QueueActor.start(
                    rt,
                    QUEUE,
                    n,
                    settings=self.config.scheduler,
                    epoch=self._epoch,
                    escalate_to=self.config.escalate_to,
                ),
                after_restart=self._queue_restarted,
            ),
            ChildSpec(
                name=ROUTER,
                start=lambda n: RouterActor.start(
                    rt, ROUTER, n, policy=self.policy, budget=rt.budget
                ),
            ),
            ChildSpec(name=JOBS, start=lambda n: JobsActor.start(rt, JOBS, n, system=self)),
            ChildSpec(
                name=INGEST,
                start=lambda n: IngestActor.start(
                    rt, INGEST, n, policy=self.policy, admission=self.admission
                ),
            ),
        ]
        return specs

    def _start_model(self, name: str, incarnation: int) -> pykka.ActorRef[Any]:
        address = model_address(name)
        old = self._clients.get(name)
        if old is not None:  # the dead incarnation's calls are re-queued: stop waiting on them
            self.io.call_soon(_close_later, old)
        client = ModelClient(
            self.models[name],
            incarnation=incarnation,
            deliver=functools.partial(self.book.try_tell, address),
            transport=self._transports[name],
        )
        self._clients[name] = client
        return ModelActor.start(
            self.rt,
            address,
            incarnation,
            settings=self.models[name],
            client=client,
            seed=self.config.seed,
        )

    def _queue_restarted(self, incarnation: int) -> None:  # noqa: ARG002 - hook signature
        for name in self.models:
            self.book.try_tell(model_address(name), Regrant())

    def _start_actors(self) -> None:
        sup = Supervisor.start(
            book=self.book,
            specs=self._specs(),
            config=self.config.supervisor,
            clock=self.rt.clock,
            timer=lambda delay, msg: self.rt.after(delay, SUPERVISOR, msg),
            on_escalate=self._escalated,
            on_poison=self._poisoned,
        )
        self._supervisor = sup
        self.book.add(SUPERVISOR)
        self.book.register(SUPERVISOR, sup)
        sup.ask(lambda s: s.start_children(), timeout=ASK_TIMEOUT_S)

    # -- submitting ----------------------------------------------------------

    def submit(
        self, prompt: Any, /, *, wait_s: float | None = None, **fields: Any
    ) -> Future[Result]:
        """Submit one request (a prompt, chat messages or a ``Request``); returns its future.

        Fields: ``priority``, ``model``, ``route``, ``max_tokens``, ``temperature``,
        ``deadline_s``, ``metadata``, ``idempotency_key``, ``budget_tag``, ``trace_id``.
        A full queue answers with a ``Rejected(QUEUE_FULL)`` result; with ``wait_s``
        the call blocks up to that long for room instead, then raises ``QueueFullError``.
        """
        task = self._task(prompt, fields, trace_id=fields.pop("trace_id", None))
        self._room((task,), wait_s)
        self._send((task,))
        assert task.future is not None
        return task.future

    def submit_many(self, prompts: Iterable[Any], /, **fields: Any) -> list[Future[Result]]:
        """Submit a burst in one message; futures in input order. All are checked first."""
        wait_s = fields.pop("wait_s", None)
        trace_id = fields.pop("trace_id", None)  # shared by the burst, like every other field
        tasks = tuple(self._task(p, fields, trace_id=trace_id) for p in prompts)
        if tasks:
            self._room(tasks, wait_s)
            self._send(tasks)
        return [t.future for t in tasks if t.future is not None]

    def resume(self) -> list[Future[Result]]:
        """Submit again every task a durable ledger holds without an outcome.

        After a crash, a system started on the same ledger file calls this to
        finish what the dead process accepted. Each keeps its task id (and
        idempotency key); its deadline, if any, counts from now. A task resumed
        already (on its way, or live) is not submitted again: a second call
        returns only what is left.
        """
        if not isinstance(self.ledger, SqliteLedger):
            return []
        tasks = tuple(
            self._task(s.request, {}, task_id=s.task_id, trace_id=s.trace_id)
            for s in self.ledger.unfinished()
            if not self.ledger.is_pending(s.task_id)  # resumed already: it is on its way
        )
        if tasks:
            log.warning("resuming %d unfinished tasks from %s", len(tasks), self.ledger.path)
            self._send(tasks)
        return [t.future for t in tasks if t.future is not None]

    def _task(
        self,
        prompt: Any,
        fields: dict[str, Any],
        task_id: int | None = None,
        trace_id: str | None = None,
    ) -> Task:
        """One caller task; ``fields`` are the request's (read, not changed)."""
        self._check_running()
        request = Request.of(prompt, **fields)
        self.policy.check(request)
        now = self.rt.clock()
        task_id = task_id or self.ledger.next_id()
        trace_id = trace_id or f"{self._prefix}.{task_id}"
        future = TaskFuture(task_id, trace_id, on_cancel=self._on_cancel)
        return Task(
            task_id=task_id,
            trace_id=trace_id,
            request=request,
            submitted_at=now,
            deadline_at=None if request.deadline_s is None else now + request.deadline_s,
            prompt_tokens=estimate_prompt_tokens(request.messages),
            future=future,
        )

    def _room(self, tasks: tuple[Task, ...], wait_s: float | None) -> None:
        if wait_s is None:
            return
        capacity = self.admission.capacity
        if len(tasks) > capacity:
            raise QueueFullError(f"{len(tasks)} tasks can never fit a queue of {capacity}")
        if not self.ledger.wait_for_room(capacity, len(tasks), wait_s):
            raise QueueFullError(f"queue stayed full ({capacity} tasks) for {wait_s} s")

    def _send(self, tasks: tuple[Task, ...]) -> None:
        self.ledger.announce(tasks)
        try:
            self.book.tell(INGEST, Submit(tasks=tasks))
        except BaseException as exc:
            self.ledger.forget(tasks)
            if not isinstance(exc, Exception):
                raise
            raise SystemStoppedError(f"callboard is not running: {exc}") from exc

    def _cancelled_by_caller(self, task_id: int) -> None:
        self.book.try_tell(QUEUE, Cancel(task_ids=(task_id,)))

    def cancel(self, *task_ids: int) -> None:
        """Cancel tasks by id wherever they wait unsent (they end as ``Cancelled``):
        on their way to the queue, in it, at a model before admission or between
        retries. A call already sent runs to its end. Raises ``SystemStoppedError``
        once stopped (every task has ended then)."""
        try:
            self.book.tell(QUEUE, Cancel(task_ids=tuple(task_ids)))
        except AddressBookClosedError as exc:
            raise SystemStoppedError(str(exc)) from None

    def _check_running(self) -> None:
        self._check_alive()
        if not self.admission.is_open:
            raise SystemStoppedError(f"callboard is not admitting: {self.admission.reason}")

    def _check_alive(self) -> None:
        """Raise ``SystemStoppedError`` once the system failed or stopped."""
        if self._failure is not None:
            raise SystemStoppedError(str(self._failure))
        if self._stopped.is_set():
            raise SystemStoppedError("callboard is stopped")

    # -- patterns and recurring jobs (see callboard.patterns / callboard.jobs) -

    def gather(
        self,
        prompts: Iterable[Any],
        /,
        *,
        return_when: Literal["all", "first"] = "all",
        timeout: float | None = None,
        **fields: Any,
    ) -> list[Result] | Result:
        """Scatter-gather: results in input order (or the first to end)."""
        return patterns.gather(self, prompts, return_when=return_when, timeout=timeout, **fields)

    def as_completed(
        self, futures_or_prompts: Iterable[Any], timeout: float | None = None, **fields: Any
    ) -> Iterator[Result]:
        """Results as they finish."""
        return patterns.as_completed(self, futures_or_prompts, timeout, **fields)

    def race(
        self, prompt: Any, /, models: Sequence[str], *, timeout: float | None = None, **fields: Any
    ) -> RaceResult:
        """Hedged: the same request to several models; the first success wins."""
        return patterns.race(self, prompt, models, timeout=timeout, **fields)

    def chain(
        self,
        stages: Sequence[Stage],
        first_input: str,
        /,
        *,
        trace_id: str | None = None,
        **fields: Any,
    ) -> ChainResult:
        """A pipeline: each stage's text feeds the next, one trace id throughout."""
        return patterns.chain(self, stages, first_input, trace_id=trace_id, **fields)

    def fire_and_forget(
        self,
        prompt: Any,
        /,
        *,
        on_error: ErrorCallback,
        on_result: ResultCallback | None = None,
        **fields: Any,
    ) -> Future[Result] | None:
        """Submit; ``on_error`` is guaranteed a call for anything but success."""
        return patterns.fire_and_forget(
            self, prompt, on_error=on_error, on_result=on_result, **fields
        )

    def every(
        self,
        interval: str | float,
        request: Any,
        *,
        run_immediately: bool = False,
        max_runs: int | None = None,
        max_cost: Decimal | str | float | None = None,
        timeout: float | None = None,
        name: str | None = None,
    ) -> JobHandle:
        """Submit ``request`` on a schedule ("30m", "hourly", seconds) through the pipeline."""
        return _jobs.every(
            self,
            interval,
            request,
            run_immediately=run_immediately,
            max_runs=max_runs,
            max_cost=max_cost,
            timeout=timeout,
            name=name,
        )

    def jobs(self) -> list[JobInfo]:
        """The recurring jobs with their runs, successes, failures, cost and last result."""
        return _jobs.jobs(self)

    # -- reading -------------------------------------------------------------

    def stats(self) -> Stats:
        """A frozen snapshot: outcomes, latency and queue-wait percentiles, tokens, cost.

        It counts every result handed out before the call (see ``actors.aggregator``),
        and is readable while the aggregator restarts (it answers once back) or the
        system drains. Raises ``SystemStoppedError`` once stopped or failed, and
        ``UnavailableError`` if no answer comes within ``ASK_TIMEOUT_S``."""
        self._check_alive()
        counts = self.ledger.counts()
        stats = self._aggregated(counts.finished + counts.rejected)
        restarts = {n: s["restarts"] for n, s in self.supervision().items() if isinstance(s, dict)}
        return _with_restarts(stats, restarts, self.rt.budget)

    def _aggregated(self, ended: int) -> Stats:
        """The aggregator's snapshot once it has accounted ``ended`` results.

        The question is told, not asked: while the aggregator restarts it is held
        for the next incarnation. An incarnation that dies holding it loses it, so
        it is told again to each new one (an answered question is ignored)."""
        reply: Future[Stats] = Future()
        question = GetStats(finished=ended, reply=reply)
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
        try:
            return cast(dict[str, Any], self._supervisor.ask(GetState(), timeout=ASK_TIMEOUT_S))
        except pykka.ActorDeadError:
            raise SystemStoppedError("callboard is stopped: no supervisor to ask") from None

    def ask(self, name: str, message: Any, timeout: float = ASK_TIMEOUT_S) -> Any:
        """Ask an actor by name (``"queue"``, ``"model:sim-fast"``...); for the REPL and tests."""
        return self._ask(name, message, timeout)

    def tell(self, name: str, message: Any) -> None:
        """Tell an actor by name; held and delivered if it is restarting.

        Raises ``SystemStoppedError`` once stopped."""
        try:
            self.book.tell(name, message)
        except AddressBookClosedError as exc:
            raise SystemStoppedError(f"callboard is stopped: {exc}") from None

    def _ask(self, name: str, message: Any, timeout: float = ASK_TIMEOUT_S) -> Any:
        ref = self.book.resolve(name)
        if ref is None:
            raise SystemStoppedError(f"{name} is not running (restarting or stopped)")
        try:
            return ref.ask(message, timeout=timeout)
        except pykka.ActorDeadError:
            raise SystemStoppedError(f"{name} is not running (restarting or stopped)") from None

    @property
    def failure(self) -> Escalation | None:
        """Why the supervisor gave up, if it did."""
        return self._failure

    # -- stopping ------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting, wait for every accepted task to finish, admit again. True if idle."""
        self.admission.hold("draining")
        try:
            return self.ledger.wait_idle(timeout)
        finally:
            self.admission.release()  # open again unless a stop or a spent budget closed it

    def stop(self, *, cancel: bool = False, timeout: float = 30.0) -> None:
        """Stop. Waits for accepted tasks (queued ones end ``Cancelled`` if ``cancel``).

        Whatever has not finished within ``timeout`` ends ``Cancelled``; then
        every actor and thread is stopped. Idempotent. A stop cut short by an
        exception (a ``KeyboardInterrupt`` while it waits, say) is finished
        by the next call, which waits no longer than its own ``timeout``:
        Ctrl-C during ``stop(timeout=30)`` then ``stop(timeout=0)`` stops at once.
        """
        with self._stop_lock:
            if self._torn_down:
                return
            if not self._stopped.is_set():
                self._stop_jobs()  # first: a job's next tick would be refused at the door
                self.admission.close("stopping")
                if self._failure is None:
                    if cancel:
                        self.book.try_tell(QUEUE, Cancel(everything=True, detail="system stopped"))
                    self.ledger.wait_idle(timeout)
            self._teardown()

    def _stop_jobs(self) -> None:
        ref = self.book.resolve(JOBS)
        if ref is None:
            return
        try:
            ref.ask(StopAllJobs(), timeout=ASK_TIMEOUT_S)
        except Exception:  # a stop goes on whatever the jobs actor does
            log.warning("the jobs actor did not stop its jobs", exc_info=True)

    def _teardown(self) -> None:
        """Stop everything; each step may run again (a teardown cut short is redone)."""
        try:
            self._stop_everything()
        finally:
            self._switch_interval.release()
        self._torn_down = True

    def _stop_everything(self) -> None:
        self._stopped.set()
        self.admission.stop("stopped")
        sup = getattr(self, "_supervisor", None)
        if sup is not None and sup.is_alive():
            try:
                sup.ask(lambda s: s.stop_children(), timeout=ASK_TIMEOUT_S * 3)
            finally:
                sup.stop(block=True, timeout=ASK_TIMEOUT_S)
        self.book.close()  # first: a submit racing the stop fails instead of being held
        self._sweep("system stopped before the task finished")
        self.ledger.close()
        if not self.io.closed:
            try:
                self.io.run(self._close_http(), timeout=ASK_TIMEOUT_S)
            except Exception:  # a transport that will not close must not keep threads alive
                log.exception("closing HTTP clients failed")
        self.io.stop()
        if self._own_provider and self.provider is not None:
            self.provider.stop()

    async def _close_http(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        for transport in self._transports.values():
            await transport.aclose()

    def _sweep(self, why: str) -> None:
        """End every task still live or held, so no future is left unresolved."""
        now = self.rt.clock()
        for name in self.book.names():
            for message in self.book.take_held(name):
                for task in _tasks_in(message):
                    if not self.ledger.is_live(task.task_id):
                        self.ledger.reject(task, ended(Cancelled, task, now, detail=why))
        deliver(
            self.rt, ((t, ended(Cancelled, t, now, detail=why)) for t in self.ledger.live_tasks())
        )
        self.ledger.forget_announced()

    # -- supervision callbacks (run on the supervisor's thread) ---------------

    def on_failure(self, hook: Callable[[Escalation], object]) -> None:
        """Call ``hook(escalation)`` (on a supervisor thread) if the system gives up."""
        self._failure_hooks.append(hook)
        if self._failure is not None:
            hook(self._failure)

    def _escalated(self, escalation: Escalation) -> None:
        self._failure = escalation
        self.admission.stop(str(escalation))
        for hook in self._failure_hooks:
            try:
                hook(escalation)
            except Exception:
                log.exception("a failure hook raised")
        threading.Thread(
            target=self._fail_all, args=(escalation,), name="callboard-escalation"
        ).start()

    def _fail_all(self, escalation: Escalation) -> None:
        with self._stop_lock:
            if not self._stopped.is_set():
                now = self.rt.clock()
                deliver(
                    self.rt,
                    (
                        (
                            t,
                            ended(
                                Failed,
                                t,
                                now,
                                reason=FailureReason.INTERNAL,
                                detail=str(escalation),
                            ),
                        )
                        for t in self.ledger.live_tasks()
                    ),
                )
                self._teardown()

    def _poisoned(self, message: Any, why: str) -> None:
        now = self.rt.clock()
        for task in _tasks_in(message):
            result = ended(Failed, task, now, reason=FailureReason.INTERNAL, detail=why)
            # through deliver, which also settles (releases) the task's budget reservation
            if not deliver(self.rt, ((task, result),)) and not self.ledger.is_live(task.task_id):
                self.ledger.reject(task, result)

    # -- context manager -----------------------------------------------------

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


def _open_ledger(path: str | Path | None) -> Ledger:
    return Ledger() if path is None else SqliteLedger(path)


def _tasks_in(message: Any) -> list[Task]:
    if isinstance(message, Submit | Route):
        return list(message.tasks)
    if isinstance(message, Enqueue | Call):
        return [j.task for j in message.jobs]
    inner = getattr(message, "message", None)
    return _tasks_in(inner) if inner is not None else []


def _close_later(client: ModelClient) -> None:
    task = asyncio.get_running_loop().create_task(client.aclose(close_transport=False))
    _closing.add(task)
    task.add_done_callback(_closing.discard)


_closing: set[Any] = set()


def _with_restarts(stats: Stats, restarts: dict[str, int], budget: Any) -> Stats:
    return dataclasses.replace(
        stats, restarts=restarts, budget=budget.snapshot() if budget is not None else {}
    )
