"""Starting a ``System``: its provider, ledger, routing, budget, model clients and actors.

``System._build`` calls these in order; each builds one part from the
configuration and hands it back (``start_actors`` records the supervisor on
the system itself, see below).

What must hold:

* A failed start leaves nothing behind: ``start_actors`` records the
  supervisor on the system *before* asking it to start its children, so the
  teardown that follows a failure stops whatever did start.
* ``ModelClients`` owns every model's transport for the system's whole life
  and the client of each model's current incarnation; a restarted model gets
  a new client on the same transport, and the dead incarnation's client is
  closed (on the I/O loop) without closing that transport.
* The children start in dependency order: the aggregator first (everything
  ends there), then the models, the queue, the router, the jobs actor and
  the ingest actor last (nothing is admitted before the rest can take it).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pykka

from callboard._system_read import ASK_TIMEOUT_S
from callboard.actors.aggregator import AggregatorActor
from callboard.actors.base import (
    AGGREGATOR,
    INGEST,
    QUEUE,
    ROUTER,
    SUPERVISOR,
    Runtime,
    model_address,
)
from callboard.actors.ingest import IngestActor
from callboard.actors.model import ModelActor
from callboard.actors.queue import QueueActor
from callboard.actors.router import RouterActor
from callboard.config import SystemConfig
from callboard.core.budget import Budgets, SharedBudget
from callboard.core.pricing import usd_to_nusd
from callboard.core.routing import RoutingPolicy
from callboard.core.settings import ModelSettings
from callboard.jobs import JOBS, JobsActor
from callboard.messages import Regrant
from callboard.runtime.http import ModelClient, make_transport
from callboard.runtime.ledger import Ledger
from callboard.runtime.sqlite_ledger import SqliteLedger
from callboard.supervisor.address_book import AddressBook
from callboard.supervisor.supervisor import ChildSpec, Escalation, Supervisor

if TYPE_CHECKING:
    from callboard._system import System
    from callboard.provider.server import SimulatedProvider


def open_ledger(path: str | Path | None) -> Ledger:
    """An in-memory ledger, or a durable SQLite one at ``path``."""
    return Ledger() if path is None else SqliteLedger(path)


def start_simulated_provider(seed: int) -> SimulatedProvider:
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


def routing_policy(config: SystemConfig, models: dict[str, ModelSettings]) -> RoutingPolicy:
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
    )


def shared_budget(config: SystemConfig, models: dict[str, ModelSettings]) -> SharedBudget | None:
    """The budget every actor shares, or ``None`` when budgets are off."""
    b = config.budget
    if not b.enabled:
        return None
    budgets = Budgets(
        None if b.total_usd is None else usd_to_nusd(b.total_usd),
        {tag: usd_to_nusd(v) for tag, v in b.per_tag_usd.items()},
        downgrade_when_tight=b.downgrade_when_tight,
    )
    return SharedBudget(budgets, {name: m.price for name, m in models.items()})


class ModelClients:
    """Each model's transport, and the HTTP client of its current incarnation."""

    def __init__(self, models: dict[str, ModelSettings], rt: Runtime, *, seed: int) -> None:
        self._models = models
        self._rt = rt
        self._seed = seed
        self._transports = {name: make_transport(m) for name, m in models.items()}
        self._clients: dict[str, ModelClient] = {}

    def start_model(self, name: str, incarnation: int) -> pykka.ActorRef[Any]:
        """Start incarnation ``incarnation`` of model ``name`` with a client of its own."""
        address = model_address(name)
        old = self._clients.get(name)
        if old is not None:  # the dead incarnation's calls are re-queued: stop waiting on them
            self._rt.io.call_soon(_close_later, old)
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

    async def aclose(self) -> None:
        """Close every current client, then every transport (on the I/O loop)."""
        for client in self._clients.values():
            await client.aclose()
        for transport in self._transports.values():
            await transport.aclose()


def start_actors(
    system: System,
    clients: ModelClients,
    *,
    on_escalate: Callable[[Escalation], None],
    on_poison: Callable[[Any, str], None],
) -> None:
    """Start the supervisor (recorded as ``system._supervisor``) and, through it, every actor."""
    sup = Supervisor.start(
        book=system.book,
        specs=_specs(system, clients),
        config=system.config.supervisor,
        clock=system.rt.clock,
        timer=lambda delay, msg: system.rt.after(delay, SUPERVISOR, msg),
        on_escalate=on_escalate,
        on_poison=on_poison,
    )
    system._supervisor = sup
    system.book.add(SUPERVISOR)
    system.book.register(SUPERVISOR, sup)
    sup.ask(lambda s: s.start_children(), timeout=ASK_TIMEOUT_S)


def _specs(system: System, clients: ModelClients) -> list[ChildSpec]:
    rt = system.rt
    specs = [ChildSpec(name=AGGREGATOR, start=lambda n: AggregatorActor.start(rt, AGGREGATOR, n))]
    specs.extend(
        ChildSpec(name=model_address(name), start=functools.partial(clients.start_model, name))
        for name in system.models
    )
    specs += [
        ChildSpec(
            name=QUEUE,
            start=lambda n: QueueActor.start(
                rt,
                QUEUE,
                n,
                settings=system.config.scheduler,
                epoch=system._epoch,
                escalate_to=system.config.escalate_to,
            ),
            after_restart=functools.partial(_regrant, system.book, system.models),
        ),
        ChildSpec(
            name=ROUTER,
            start=lambda n: RouterActor.start(
                rt, ROUTER, n, policy=system.policy, budget=rt.budget
            ),
        ),
        ChildSpec(name=JOBS, start=lambda n: JobsActor.start(rt, JOBS, n, system=system)),
        ChildSpec(
            name=INGEST,
            start=lambda n: IngestActor.start(
                rt, INGEST, n, policy=system.policy, admission=system.admission
            ),
        ),
    ]
    return specs


def _regrant(book: AddressBook, models: Iterable[str], incarnation: int) -> None:  # noqa: ARG001 - hook signature
    """A restarted queue has no credits: every model grants them again."""
    for name in models:
        book.try_tell(model_address(name), Regrant())


def _close_later(client: ModelClient) -> None:
    task = asyncio.get_running_loop().create_task(client.aclose(close_transport=False))
    _closing.add(task)
    task.add_done_callback(_closing.discard)


_closing: set[Any] = set()
