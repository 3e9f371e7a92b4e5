"""The assembly: the parts of one running system, started in order, stopped in reverse.

A ``System`` holds one ``Assembly`` and keeps the decisions (what to admit,
how a stop ends the tasks it finds); the assembly keeps the machinery.
Building an ``Assembly`` opens the ledger (first: a ledger that cannot be
opened leaves nothing running), starts the simulated provider when no model
is configured, starts the I/O loop, and makes what the actors share: the
address book, the ``Runtime``, the routing policy, the shared budget, the
front door (admission, on the submitting thread) and each model's HTTP client.
``start_actors`` then starts the supervisor, which starts the actors in
dependency order: the aggregator first (everything ends there), then the
models, the queue, the router, and the jobs actor last (its ticks submit). The
system admits nothing before they are all up: its ``submit`` is not reachable
until ``start_actors`` returned. ``stop`` stops it all, newest first: through
the supervisor, or, once it is dead, each actor it left by its address.

What must hold:

* A failed start leaves nothing behind: a build that raises undoes what it
  had started; ``start_actors`` records the supervisor before asking it to
  start its children, so the ``stop`` that follows a failure stops whatever
  did start.
* ``stop`` may run again after it was cut short (each step sees what is
  left to do), and releases the switch interval even when a step raised.
* ``ModelClients`` owns every model's transport for the system's whole life
  and the client of each model's current incarnation; a restarted model gets
  a new client on the same transport, and the dead incarnation's client is
  closed (on the I/O loop) without closing that transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pykka

from callboard.actors.aggregator import AggregatorActor
from callboard.actors.base import (
    AGGREGATOR,
    QUEUE,
    ROUTER,
    SUPERVISOR,
    CrashPlan,
    Runtime,
    model_address,
)
from callboard.actors.ingest import Admission, FrontDoor
from callboard.actors.jobs import JOBS, JobsActor, SubmitRun
from callboard.actors.model import ModelActor
from callboard.actors.queue import QueueActor
from callboard.actors.router import RouterActor
from callboard.config import SystemConfig, simulated_models
from callboard.core.budget import Budgets
from callboard.core.pricing import usd_to_nusd
from callboard.core.routing import RoutingPolicy
from callboard.core.settings import ModelSettings
from callboard.messages import (
    BudgetFreed,
    CallsDone,
    ConfigError,
    Regrant,
    StartChildren,
    StopChildren,
    UsageError,
)
from callboard.runtime.collector import SteadyHeap
from callboard.runtime.descriptors import make_room
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.http import ModelClient, make_transport
from callboard.runtime.io_loop import IoLoop
from callboard.runtime.ledger import Ledger
from callboard.runtime.shared_budget import SharedBudget
from callboard.runtime.sqlite_ledger import SqliteLedger
from callboard.runtime.switch_interval import SwitchInterval
from callboard.supervisor.address_book import AddressBook
from callboard.supervisor.supervisor import ChildSpec, Escalation, Supervisor

if TYPE_CHECKING:
    from callboard.provider.server import SimulatedProvider

__all__ = ["ASK_TIMEOUT_S", "Assembly", "ModelClients"]

log = guarded_logger("callboard._system")  # the System's logger: it is the system's machinery

ASK_TIMEOUT_S = 10.0
"""Bounds every question the system asks its own actors (at start-up, while
stopping, and for ``System.stats``/``supervision``/``ask``)."""


class Assembly:
    """The machinery of one system: provider, ledger, I/O loop, clients, book, supervisor."""

    def __init__(
        self,
        config: SystemConfig,
        *,
        ledger: Ledger | str | Path | None,
        provider: Any,
        crash_plan: CrashPlan | None,
        on_budget_spent: Callable[[], None],
        io_loop: IoLoop | None = None,
    ) -> None:
        """Open the ledger, start the provider (if simulated) and the I/O loop, make the rest.

        ``ledger``: a ``Ledger``, or a path for a durable SQLite one, or None (in memory).
        ``io_loop``: an I/O loop its owner started and stops (the gateway's, its server
        on it): used, never stopped here.
        """
        if io_loop is not None and not io_loop.running:  # it would drop every call
            raise UsageError("io_loop must be started (IoLoop.start) and not stopped")
        self.config = config
        self.ledger = ledger if isinstance(ledger, Ledger) else _open_ledger(ledger)
        self.provider = provider
        self._owns_provider = config.simulated and provider is None
        self._switch_interval = SwitchInterval(config.switch_interval_s)
        self._steady_heap = SteadyHeap(config.steady_heap)
        """Both held from just before the actors start until the end of ``stop``."""
        self.supervisor: pykka.ActorRef[Supervisor] | None = None
        with contextlib.ExitStack() as undo:  # a build that raises stops what it started
            if not isinstance(ledger, Ledger):
                undo.callback(self.ledger.close)
            if self._owns_provider:
                self.provider = _start_simulated_provider(config.seed)
                undo.callback(self.provider.stop)
            models = config.models or simulated_models(self.provider.base_url)
            self.models: dict[str, ModelSettings] = {m.name: m for m in models}
            make_room(sum(m.max_concurrency for m in models))
            self._owns_io = io_loop is None
            self.io = IoLoop() if io_loop is None else io_loop
            if self._owns_io:
                self.io.start()
                undo.callback(self.io.stop)
            self.book = AddressBook()
            self.rt = Runtime(book=self.book, ledger=self.ledger, io=self.io, crash_plan=crash_plan)
            self.rt.budget = _shared_budget(config, self.models)
            if self.rt.budget is not None:  # a settlement wakes the tasks that wait for it
                self.rt.budget.wake = functools.partial(self.book.try_tell, ROUTER, BudgetFreed())
            self.rt.on_budget_spent = on_budget_spent
            self.policy = _routing_policy(config, self.models, self.rt.clock)
            self.admission = Admission(config.scheduler.capacity)
            self.door = FrontDoor(self.rt, self.admission, self.policy)
            self.clients = ModelClients(self.models, self.rt, seed=config.seed)
            self.epoch = self.rt.clock()
            undo.pop_all()  # built: from here on, ``stop`` undoes it

    def start_actors(
        self,
        *,
        submit_run: SubmitRun,
        on_escalate: Callable[[Escalation], None],
        on_poison: Callable[[Any, str], None],
    ) -> None:
        """Start the supervisor (recorded first) and, through it, every actor."""
        self._switch_interval.hold()
        self._steady_heap.hold()
        sup = Supervisor.start(
            book=self.book,
            specs=self._specs(submit_run),
            config=self.config.supervisor,
            clock=self.rt.clock,
            timer=lambda delay, msg: self.rt.after(delay, SUPERVISOR, msg),
            on_escalate=on_escalate,
            on_poison=on_poison,
        )
        self.supervisor = sup
        self.book.add(SUPERVISOR)
        self.book.register(SUPERVISOR, sup)
        sup.ask(StartChildren(), timeout=ASK_TIMEOUT_S)

    def _specs(self, submit_run: SubmitRun) -> list[ChildSpec]:
        rt, config = self.rt, self.config
        specs = [
            ChildSpec(name=AGGREGATOR, start=lambda n: AggregatorActor.start(rt, AGGREGATOR, n))
        ]
        specs.extend(
            ChildSpec(
                name=model_address(name), start=functools.partial(self.clients.start_model, name)
            )
            for name in self.models
        )
        specs += [
            ChildSpec(
                name=QUEUE,
                start=lambda n: QueueActor.start(
                    rt,
                    QUEUE,
                    n,
                    settings=config.scheduler,
                    epoch=self.epoch,
                    escalate_to=config.escalate_to,
                ),
                after_restart=functools.partial(_regrant, self.book, self.models),
            ),
            ChildSpec(
                name=ROUTER,
                start=lambda n: RouterActor.start(
                    rt, ROUTER, n, policy=self.policy, budget=rt.budget
                ),
            ),
            ChildSpec(name=JOBS, start=lambda n: JobsActor.start(rt, JOBS, n, submit=submit_run)),
        ]
        return specs

    def on_wire(self) -> frozenset[int]:
        """The tasks whose call has started on the I/O loop and not ended (none on a
        cluster: its calls are the shared model actors')."""
        return self.clients.on_wire()

    def stop(self, sweep: Callable[[], None]) -> None:
        """Stop the actors, close the book, ``sweep`` (end what is left), close the rest.

        Each step may run again: a stop cut short is redone by the next call."""
        try:
            sup = self.supervisor
            if sup is not None and sup.is_alive():
                try:
                    sup.ask(StopChildren(), timeout=ASK_TIMEOUT_S * 3)
                except pykka.ActorDeadError:
                    pass  # it died meanwhile: its children are orphans, stopped below
                finally:
                    sup.stop(block=True, timeout=ASK_TIMEOUT_S)
            self._stop_orphans()
            self.book.close()  # first: a submit racing the stop fails instead of being held
            sweep()
            self.ledger.close()
            if not self.io.closed:
                try:
                    self.io.run(self.clients.aclose(), timeout=ASK_TIMEOUT_S)
                except TimeoutError:  # issue 14: a traceback at SIGTERM said nothing more
                    log.warning(
                        "the HTTP clients did not close within %.0f s: their calls are "
                        "abandoned with the I/O loop",
                        ASK_TIMEOUT_S,
                    )
                except Exception:  # a transport that will not close must not keep threads alive
                    log.exception("closing HTTP clients failed")
            if self._owns_io:
                self.io.stop()
            if self._owns_provider and self.provider is not None:
                self.provider.stop()
        finally:
            self._steady_heap.release()
            self._switch_interval.release()

    def _stop_orphans(self) -> None:
        """Stop, newest first, the actors a dead supervisor left running (none after
        ``StopChildren``, which detached them all)."""
        for name in reversed(self.book.names()):
            ref = self.book.detach(name)
            if ref is None or name == SUPERVISOR:
                continue
            try:
                ref.stop(block=True, timeout=ASK_TIMEOUT_S)
            except pykka.Timeout:
                log.error("%s did not stop within %.1f s", name, ASK_TIMEOUT_S)  # noqa: TRY400 - no traceback to show


class ModelClients:
    """Each model's transport, and the HTTP client of its current incarnation."""

    def __init__(self, models: dict[str, ModelSettings], rt: Runtime, *, seed: int) -> None:
        self._models = models
        self._rt = rt
        self._seed = seed
        self._transports = {name: make_transport(m) for name, m in models.items()}
        self._clients: dict[str, ModelClient] = {}
        self._direct: dict[str, ModelClient] = {}

    def direct(self, name: str, deliver: Callable[[CallsDone], object]) -> ModelClient:
        """The client of the calls this process makes itself on leases of model
        ``name``'s shared actor (``cluster._lease``): one for the system's life, on the
        model's transport, its results to ``deliver`` (on the I/O loop). Its cap is the
        model's; the permits bound it anyway."""
        client = self._direct.get(name)
        if client is None:
            client = self._direct[name] = ModelClient(
                self._models[name],
                incarnation=0,
                deliver=deliver,
                transport=self._transports[name],
            )
        return client

    def start_model(self, name: str, incarnation: int) -> pykka.ActorRef[Any]:
        """Start incarnation ``incarnation`` of model ``name`` with a client of its own."""
        address = model_address(name)
        old = self._clients.get(name)
        if old is not None:  # the dead incarnation's calls are re-queued: none may go on
            self._stop_calls(name, old)
        client = ModelClient(
            self._models[name],
            incarnation=incarnation,
            deliver=functools.partial(self._rt.book.try_tell, address),
            transport=self._transports[name],
        )
        self._clients[name] = client
        return ModelActor.start(
            self._rt,
            address,
            incarnation,
            settings=self._models[name],
            client=client,
            seed=self._seed,
        )

    def _stop_calls(self, name: str, old: ModelClient) -> None:
        """End the dead incarnation's calls before its successor starts. Its successor
        re-queues them, or ends a stream whose reader has part of one: closed later,
        on the loop's next turn, a stream's old call could still hand its reader a
        first delta after the successor had found none and sent it again, and the
        reader got both answers mixed (found by a review). Waits ``STOP_CALLS_S`` at
        most (a wedged loop: the calls end with the client later)."""
        try:
            self._rt.io.run(old.aclose(close_transport=False), timeout=STOP_CALLS_S)
        except (TimeoutError, RuntimeError) as exc:  # RuntimeError: the loop is closed
            log.warning("%s: the calls of the dead incarnation did not end: %r", name, exc)
            self._rt.io.call_soon(_close_later, old)

    def on_wire(self) -> frozenset[int]:
        """The tasks whose call a current client has started and not ended (read from
        any thread: each set is copied whole under the interpreter's lock)."""
        clients = [*self._clients.values(), *self._direct.values()]
        return frozenset().union(*(set(c.on_wire) for c in clients))

    async def aclose(self) -> None:
        """Close every current client, then every transport (on the I/O loop)."""
        for client in [*self._clients.values(), *self._direct.values()]:
            await client.aclose()
        for transport in self._transports.values():
            await transport.aclose()


def _open_ledger(path: str | Path | None) -> Ledger:
    """An in-memory ledger, or a durable SQLite one at ``path``."""
    if path is not None and not isinstance(path, str | Path):
        raise ConfigError(f"ledger must be a Ledger or a file path, got {type(path).__name__}")
    if path is not None and (not str(path) or Path(path).name in ("", ".", "..")):
        raise ConfigError(f"ledger must name a file, got {str(path)!r}")
    return Ledger() if path is None else SqliteLedger(path)


def _start_simulated_provider(seed: int) -> SimulatedProvider:
    """The simulated provider ``System()`` runs on 127.0.0.1: a fast and a smart model."""
    from callboard.provider.server import ModelBehaviour, SimulatedProvider

    provider = SimulatedProvider(
        models={
            "sim-fast": ModelBehaviour(latency_s=0.02, jitter_s=0.005),
            "sim-smart": ModelBehaviour(latency_s=0.06, jitter_s=0.01),
        },
        seed=seed,
    )
    provider.start()
    return provider


def _routing_policy(
    config: SystemConfig, models: dict[str, ModelSettings], clock: Callable[[], float]
) -> RoutingPolicy:
    """The router's policy; a default route of one name that is not a model names a route."""
    default = config.default_route
    return RoutingPolicy(
        models,
        default_route=default[0]
        if default and len(default) == 1 and default[0] not in models
        else default,
        routes=config.routes,
        order=config.order,
        escalate_to=config.escalate_to,
        clock=clock,
    )


def _shared_budget(config: SystemConfig, models: dict[str, ModelSettings]) -> SharedBudget | None:
    """The budget every actor shares, or ``None`` when budgets are off."""
    b = config.budget
    if not b.enabled:
        return None
    budgets = Budgets(
        None if b.total_usd is None else usd_to_nusd(b.total_usd),
        {tag: usd_to_nusd(v) for tag, v in b.per_tag_usd.items()},
        downgrade_when_tight=b.downgrade_when_tight,
        close_on_refusals=b.stop_when_spent if b.close_on_refusals is None else b.close_on_refusals,
    )
    return SharedBudget(budgets, {name: m.price for name, m in models.items()})


def _regrant(book: AddressBook, models: Iterable[str], incarnation: int) -> None:  # noqa: ARG001 - hook signature
    """A restarted queue has no credits: every model grants them again."""
    for name in models:
        book.try_tell(model_address(name), Regrant())


STOP_CALLS_S = 5.0
"""How long a model's restart waits for its dead incarnation's calls to end."""


def _close_later(client: ModelClient) -> None:
    task = asyncio.get_running_loop().create_task(client.aclose(close_transport=False))
    _closing.add(task)
    task.add_done_callback(_closing.discard)


_closing: set[Any] = set()
