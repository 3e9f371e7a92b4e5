"""A system's machinery when its queue and model actors run on a Ray cluster.

The same parts as the local ``Assembly`` (ledger, I/O loop, address book,
supervisor, ingest, router, aggregator, jobs), with two differences: the
queue's address is served by the ``LinkActor`` (this process's end of the
cluster's shared queue and model actors), and no model actor runs here. The
connection is made before any actor starts; the ``Poller`` starts once the
link can hear it, and stops before the rest.

What must hold: a start that cannot reach the cluster raises
``ClusterUnreachableError`` and leaves nothing running; the shared actors
outlive this system (they are the cluster's, detached).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from callboard.actors.base import QUEUE, CrashPlan, model_address
from callboard.actors.jobs import SubmitRun
from callboard.cluster._connect import Connection, connect
from callboard.cluster._link import LinkActor, Poller
from callboard.messages import ClusterUnreachableError
from callboard.runtime.ledger import Ledger
from callboard.supervisor.supervisor import ChildSpec, Escalation

from callboard._assembly import Assembly
from callboard.config import SystemConfig


class ClusterAssembly(Assembly):
    """``Assembly`` with the queue and the models on the cluster (module docstring)."""

    def __init__(
        self,
        config: SystemConfig,
        *,
        ledger: Ledger | str | Path | None,
        provider: Any,
        crash_plan: CrashPlan | None,
        on_budget_spent: Callable[[], None],
    ) -> None:
        cluster = config.cluster
        assert cluster is not None
        super().__init__(
            config,
            ledger=ledger,
            provider=provider,
            crash_plan=crash_plan,
            on_budget_spent=on_budget_spent,
        )
        try:
            self.connection: Connection = connect(cluster, self.models, config.scheduler)
            ref = self.connection.queue.register.remote(self.connection.owner)
            try:
                self.owner, _ = ray.get(ref, timeout=cluster.connect_timeout_s)
            except ray.exceptions.RayError as exc:
                why = f"its queue did not answer: {type(exc).__name__}"
                raise ClusterUnreachableError(cluster.address, why) from exc
        except BaseException:
            super().stop(lambda: None)
            raise
        self.poller = Poller(self.connection, self.owner, self.book)

    def _specs(self, submit_run: SubmitRun) -> list[ChildSpec]:
        local = {QUEUE, *(model_address(m) for m in self.models)}
        specs = [s for s in super()._specs(submit_run) if s.name not in local]
        at = next(i for i, s in enumerate(specs) if s.name != "aggregator")
        link = ChildSpec(
            name=QUEUE,
            start=lambda n: LinkActor.start(
                self.rt,
                QUEUE,
                n,
                connection=self.connection,
                owner=self.owner,
                models=self.models,
                watch=self.poller.watch,
                seed=self.config.seed,
            ),
        )
        specs.insert(at, link)
        return specs

    def start_actors(
        self,
        *,
        submit_run: SubmitRun,
        on_escalate: Callable[[Escalation], None],
        on_poison: Callable[[Any, str], None],
    ) -> None:
        super().start_actors(submit_run=submit_run, on_escalate=on_escalate, on_poison=on_poison)
        self.poller.start()

    def stop(self, sweep: Callable[[], None]) -> None:
        self.poller.stop()
        super().stop(sweep)
