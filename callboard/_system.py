"""``System``: the sync face of callboard; it builds and owns one actor system.

``System()`` with no arguments starts the simulated provider on 127.0.0.1
and two models on it; ``System(config)`` runs the configured models. Every
public method is thread-safe. ``submit`` returns a
``concurrent.futures.Future`` that resolves to a ``Result`` (failures are
results, not exceptions); misuse (an empty prompt, an unknown model, a
submit after stop) raises a ``UsageError`` / ``SystemStoppedError`` at once.

Shutdown leaves nothing behind: ``stop`` resolves every future it does not
finish (as ``Cancelled``) and joins every thread it started.

This module is the class: its state (created in ``_build``, including what
the stopping machinery reads: ``_stopped``, ``_torn_down``, ``_stop_lock``,
``_failure``) and its public methods. The work lives in private modules, one
part each: ``_system_start`` builds the parts and starts the actors,
``_system_submit`` makes, bounds and sends tasks, ``_system_read`` answers
``stats``/``supervision``/``ask``, and ``_system_stop`` stops, tears down and
gives up on escalation.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from decimal import Decimal
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import pykka

from callboard import _system_read, _system_start, _system_stop, _system_submit, patterns
from callboard import jobs as _jobs
from callboard._system_read import ASK_TIMEOUT_S
from callboard.actors.base import QUEUE, CrashPlan, Runtime
from callboard.actors.ingest import Admission
from callboard.config import SystemConfig, simulated_models
from callboard.core.settings import ModelSettings
from callboard.jobs import JobHandle, JobInfo
from callboard.messages import (
    Cancel,
    InvalidRequestError,
    Request,
    Result,
    Stats,
    SystemStoppedError,
)
from callboard.patterns import ChainResult, ErrorCallback, RaceResult, ResultCallback, Stage
from callboard.runtime.io_loop import IoLoop
from callboard.runtime.ledger import Ledger
from callboard.runtime.sqlite_ledger import SqliteLedger
from callboard.runtime.switch_interval import SwitchInterval
from callboard.supervisor.address_book import AddressBook, AddressBookClosedError
from callboard.supervisor.supervisor import Escalation, Supervisor

__all__ = ["ASK_TIMEOUT_S", "System"]

log = logging.getLogger(__name__)
_system_ids = itertools.count(1)


class System:
    """One running callboard: actors, I/O thread, and (by default) a simulated provider."""

    _supervisor: pykka.ActorRef[Supervisor]
    """Set by ``_system_start.start_actors`` as soon as the supervisor runs."""

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
        self.ledger = ledger if isinstance(ledger, Ledger) else _system_start.open_ledger(ledger)
        try:
            self._build(provider, crash_plan)
        except BaseException:
            _system_stop.abandon(self, owns_ledger=not isinstance(ledger, Ledger))
            raise

    def _build(self, provider: Any, crash_plan: CrashPlan | None) -> None:
        self._switch_interval = SwitchInterval(self.config.switch_interval_s)
        """Held from just before the actors start until the end of the teardown."""
        self.provider = provider
        self._own_provider = False
        if self.config.simulated and provider is None:
            self.provider = _system_start.start_simulated_provider(self.config.seed)
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
        self.policy = _system_start.routing_policy(self.config, self.models)
        self.rt.budget = _system_start.shared_budget(self.config, self.models)
        self.rt.on_budget_spent = self._budget_spent
        self.admission = Admission(self.config.scheduler.capacity)
        self._clients = _system_start.ModelClients(self.models, self.rt, seed=self.config.seed)
        self._epoch = self.rt.clock()
        try:
            self._switch_interval.hold()
            _system_start.start_actors(
                self,
                self._clients,
                on_escalate=functools.partial(_system_stop.escalated, self),
                on_poison=functools.partial(_system_stop.poisoned, self),
            )
        except BaseException:
            _system_stop.teardown(self)
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
        self, prompt: Any, /, *, wait_s: float | None = None, **fields: Any
    ) -> Future[Result]:
        """Submit one request (a prompt, chat messages or a ``Request``); returns its future.

        Fields: ``priority``, ``model``, ``route``, ``max_tokens``, ``temperature``,
        ``deadline_s``, ``metadata``, ``idempotency_key``, ``budget_tag``, ``trace_id``.
        A full queue answers with a ``Rejected(QUEUE_FULL)`` result; with ``wait_s``
        the call blocks up to that long for room instead, then raises ``QueueFullError``.
        """
        task = _system_submit.new_task(self, prompt, fields, trace_id=fields.pop("trace_id", None))
        _system_submit.wait_for_room(self, (task,), wait_s)
        _system_submit.send(self, (task,))
        assert task.future is not None
        return task.future

    def submit_many(self, prompts: Iterable[Any], /, **fields: Any) -> list[Future[Result]]:
        """Submit a burst in one message; futures in input order. All are checked first."""
        if isinstance(prompts, str | Request):  # would be sent a character at a time
            raise InvalidRequestError(
                "submit_many takes a collection of prompts; for one prompt use submit"
            )
        wait_s = fields.pop("wait_s", None)
        trace_id = fields.pop("trace_id", None)  # shared by the burst, like every other field
        tasks = tuple(_system_submit.new_task(self, p, fields, trace_id=trace_id) for p in prompts)
        if tasks:
            _system_submit.wait_for_room(self, tasks, wait_s)
            _system_submit.send(self, tasks)
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
            _system_submit.new_task(self, s.request, {}, task_id=s.task_id, trace_id=s.trace_id)
            for s in self.ledger.unfinished()
            if not self.ledger.is_pending(s.task_id)  # resumed already: it is on its way
        )
        if tasks:
            log.warning("resuming %d unfinished tasks from %s", len(tasks), self.ledger.path)
            _system_submit.send(self, tasks)
        return [t.future for t in tasks if t.future is not None]

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

    # -- reading (see callboard._system_read) ----------------------------------

    def stats(self) -> Stats:
        """A frozen snapshot: outcomes, latency and queue-wait percentiles, tokens, cost.

        It counts every result handed out before the call (see ``actors.aggregator``),
        and is readable while the aggregator restarts (it answers once back) or the
        system drains. Raises ``SystemStoppedError`` once stopped or failed, and
        ``UnavailableError`` if no answer comes within ``ASK_TIMEOUT_S``."""
        return _system_read.stats(self)

    def supervision(self) -> dict[str, Any]:
        """Each actor's incarnation, restarts and last errors.

        Raises ``SystemStoppedError`` once stopped (the supervisor is gone)."""
        return _system_read.supervision(self)

    def ask(self, name: str, message: Any, timeout: float = ASK_TIMEOUT_S) -> Any:
        """Ask an actor by name (``"queue"``, ``"model:sim-fast"``...); for the REPL and tests."""
        return _system_read.ask(self, name, message, timeout)

    def tell(self, name: str, message: Any) -> None:
        """Tell an actor by name; held and delivered if it is restarting.

        Raises ``SystemStoppedError`` once stopped."""
        try:
            self.book.tell(name, message)
        except AddressBookClosedError as exc:
            raise SystemStoppedError(f"callboard is stopped: {exc}") from None

    @property
    def failure(self) -> Escalation | None:
        """Why the supervisor gave up, if it did."""
        return self._failure

    def on_failure(self, hook: Callable[[Escalation], object]) -> None:
        """Call ``hook(escalation)`` (on a supervisor thread) if the system gives up."""
        self._failure_hooks.append(hook)
        if self._failure is not None:
            hook(self._failure)

    # -- stopping (see callboard._system_stop) ---------------------------------

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
        _system_stop.stop(self, cancel=cancel, timeout=timeout)

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
