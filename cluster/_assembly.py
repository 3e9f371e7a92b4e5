"""A system's machinery when its queue and model actors run on a Ray cluster.

The same parts as the local ``Assembly`` (ledger, I/O loop, address book,
supervisor, front door, router, aggregator, jobs), with two differences: the
queue's address is served by the ``LinkActor`` (this process's end of the
cluster's shared queue and model actors), and no model actor runs here. The
connection is made before any actor starts; the ``Poller`` starts once the
link can hear it, and stops before the rest.

A cluster lost after the start (the poller heard nothing for ``lost_after_s``):
with ``when_lost = "wait"`` the link is told (``Lost``: see ``_link``); with
``"local"`` the supervisor replaces the link by a local queue and starts this
process's own model actors (``ReplaceChildren``), as if the queue had
restarted: the new queue rebuilds itself from the ledger (every task the
cluster held is routed there, not finished) and the models grant afresh. From
then on this process runs alone (its limits hold per process) until it
restarts; calls the cluster had in flight may be made again (at least once
towards the provider, as after any restart), answered once. A stream that had
started is not: the link first ends it ``STREAM_CUT`` with the text its reader
got (``EndStreams``), since a local call would send its reader the text again.

The link's restarts (the supervisor's, after a bug or its poller's death: see
``_link``) keep the poller and the streams' claims, which belong to this
assembly: the new link revives a dead poller and knows what each started
stream's reader got.

What must hold: a start that cannot reach the cluster raises
``ClusterUnreachableError`` and leaves nothing running; the shared actors
outlive this system (they are the cluster's, detached).
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import ray
from callboard.actors.base import QUEUE, CrashPlan, model_address
from callboard.actors.jobs import SubmitRun
from callboard.cluster._connect import Connection, connect
from callboard.cluster._lease import Calls, Stocks
from callboard.cluster._link import Claims, EndStreams, LinkActor, Lost, Poller
from callboard.cluster._wire import differing, queue_settings
from callboard.core.settings import ModelSettings, SchedulerSettings
from callboard.messages import ClusterUnreachableError, ReplaceChildren
from callboard.runtime import redact
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.io_loop import IoLoop
from callboard.runtime.ledger import Ledger
from callboard.supervisor.supervisor import ChildSpec, Escalation

from callboard._assembly import ASK_TIMEOUT_S, Assembly
from callboard.config import SystemConfig

log = guarded_logger("callboard._system")


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
        io_loop: IoLoop | None = None,
    ) -> None:
        cluster = config.cluster
        assert cluster is not None
        super().__init__(
            config,
            ledger=ledger,
            provider=provider,
            crash_plan=crash_plan,
            on_budget_spent=on_budget_spent,
            io_loop=io_loop,
        )
        try:
            self.connection: Connection = connect(cluster, self.models, config.scheduler)
            self.owner, incarnation, asked, states = _registered(
                self.connection, cluster.address, cluster.connect_timeout_s
            )
            _succeeded(self.connection, self.owner, self.ledger.identity, cluster.connect_timeout_s)
        except BaseException:
            super().stop(lambda: None)
            raise
        self.leasable = frozenset(  # a lease's call is made with this process's settings
            name
            for name, state in zip(asked, states, strict=True)
            if not _warn_if_other(name, self.models[name], state.get("settings"))
            and "lent" in state  # an actor of an older callboard lends nothing
        )
        """The models whose calls this process may make on leases: configured as their
        shared actors were (else its calls would go with other keys or limits)."""
        self.final = threading.Event()
        """Set as this system stops, or gives the cluster up: the link then lets go of its
        calls on the wire (their models free their slots), not on a mere restart."""
        _warn_if_other_queue(self.connection, config.scheduler, cluster.lease_s)
        self.poller = Poller(self.connection, self.owner, self.book, self._lost)
        self.claims: Claims = {}
        """The started streams' claims, kept across the link's incarnations."""
        self.stocks = Stocks()
        self.direct_calls: Calls = {}
        """The permits of leases this process holds, and its calls in flight on them
        (``cluster._lease``), kept across the link's incarnations."""
        self.seen: dict[str, int] = {
            QUEUE: incarnation,
            **{m: state["incarnation"] for m, state in zip(asked, states, strict=True)},
        }
        """Each shared actor's incarnation as this process last knew it, from the start
        (the queue's first news comes after a long poll's wait: one killed before that
        lost this process's tickets unnoticed), across the link's incarnations."""
        self._submit_run: SubmitRun | None = None
        self.alone = False
        """Whether this process took over its queue and models (``when_lost = "local"``)."""

    def _specs(self, submit_run: SubmitRun) -> list[ChildSpec]:
        self._submit_run = submit_run
        local = self._local()
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
                poller=self.poller,
                claims=self.claims,
                seen=self.seen,
                seed=self.config.seed,
                direct=self.clients.direct,
                leasable=self.leasable,
                final=self.final,
                stocks=self.stocks,
                calls=self.direct_calls,
            ),
        )
        specs.insert(at, link)
        return specs

    def _local(self) -> set[str]:
        """The addresses the cluster serves for this process."""
        return {QUEUE, *(model_address(m) for m in self.models)}

    def _lost(self, why: str | None) -> bool:
        """The poller's word (on its thread): lost (``why``) or back (None); whether
        to go on polling."""
        if self.config.cluster is None or self.config.cluster.when_lost == "wait":
            self.book.try_tell(QUEUE, Lost(why))
            return True
        assert why is not None  # a poller that stopped hears nothing back
        self._go_alone(why)
        return False

    def _go_alone(self, why: str) -> None:
        """``when_lost = "local"``: this process's own queue and models from now on."""
        sup, submit_run = self.supervisor, self._submit_run
        if sup is None or submit_run is None:
            return
        self._end_streams(why)
        self.final.set()  # the link stops for good: its calls' permits are let go
        local = self._local()
        specs = [s for s in super()._specs(submit_run) if s.name in local]
        specs.sort(key=lambda s: s.name == QUEUE)  # the models first: the queue regrants them
        log.error("%s: this process runs its own queue and models from now on", why)
        try:
            started = sup.ask(ReplaceChildren(specs=tuple(specs)), timeout=ASK_TIMEOUT_S * 3)
        except Exception:  # the system is stopping meanwhile: nothing to take over
            log.exception("taking over the queue and models failed")
            return
        self.alone = bool(started)

    def _end_streams(self, why: str) -> None:
        """Have the link end the streams that started, and wait until they are ended
        (the local queue rebuilds itself from the ledger: it must not find them)."""
        link = self.book.resolve(QUEUE)
        if link is None:
            return  # restarting: the new link cuts them itself (its claims say what started)
        try:
            reply = link.ask(EndStreams(why), timeout=ASK_TIMEOUT_S)
            ended = cast(list[concurrent.futures.Future[None]], reply)
            _, late = concurrent.futures.wait(ended, timeout=ASK_TIMEOUT_S)
        except Exception:  # the link died meanwhile: its successor cuts them
            log.exception("ending the streams that started failed")
            return
        if late:
            log.error("%d streams that started were not ended in time", len(late))

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
        self.final.set()
        self.poller.stop()
        super().stop(sweep)


def _registered(
    connection: Connection, address: str, within_s: float
) -> tuple[int, int, list[str], list[dict[str, Any]]]:
    """This process's owner number and the queue's incarnation, and each model actor's
    state (its incarnation), asked until they answer or ``within_s`` has passed: a
    shared actor Ray is restarting (a second or two) answers ``ActorUnavailableError``
    meanwhile, which failed a process starting then as if the cluster were unreachable."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            ref = connection.queue.register.remote(connection.owner)
            asked = {m: h.state.remote() for m, h in connection.models.items()}
            left = max(0.0, deadline - time.monotonic())
            owner, incarnation = ray.get(ref, timeout=left)
            states = ray.get(list(asked.values()), timeout=max(0.0, deadline - time.monotonic()))
            return owner, incarnation, list(asked), states
        except ray.exceptions.ActorUnavailableError as exc:
            if time.monotonic() >= deadline:
                why = f"its shared actors did not come back: {ray_said(exc)}"
                raise ClusterUnreachableError(address, why) from exc
            time.sleep(RESTART_POLL_S)
        except ray.exceptions.RayError as exc:
            why = f"its queue did not answer: {ray_said(exc)}"
            raise ClusterUnreachableError(address, why) from exc


def _succeeded(connection: Connection, owner: int, ledger: str | None, within_s: float) -> None:
    """Tell the queue that ``owner`` holds ``ledger`` now: what an earlier holder left
    waiting there is dropped (``QueueShell.succeed``) before this process sends the
    ledger's unfinished tasks again. A queue that cannot say so (one of an older
    callboard) leaves them to their owner's lease, as before: said in the log."""
    if ledger is None:
        return
    try:
        dropped = ray.get(connection.queue.succeed.remote(owner, ledger), timeout=within_s)
    except ray.exceptions.RayError as exc:
        log.warning(
            "the shared queue did not hear that this process holds its ledger now (%s): "
            "what a process that held it before left waiting may be called until that "
            "process's lease runs out",
            ray_said(exc),
        )
        return
    if dropped:
        log.info("%d tickets a process that held this ledger before left waiting dropped", dropped)


_LAST_ERROR = re.compile(r"^\s*([\w.]*(?:Error|Exception)): (.+)$", re.MULTILINE)


def ray_said(exc: BaseException) -> str:
    """Ray's error in a line: its type, and the last error its text names, the root of
    it (an actor whose creation failed: ``ImportError: ...`` where callboard is not
    installed on the cluster's nodes), redacted and cut short. The type alone sent an
    operator looking at the network (found by a hunt)."""
    found = _LAST_ERROR.findall(str(exc))
    if not found:
        return type(exc).__name__
    name, said = found[-1]
    return f"{type(exc).__name__} ({name}: {redact.hide_cut(said.strip(), 200)})"


RESTART_POLL_S = 0.1
"""How often a starting process asks again a shared actor that Ray is restarting."""


def _warn_if_other_queue(connection: Connection, ours: SchedulerSettings, lease_s: float) -> None:
    """Say it when this process configured the shared queue otherwise than the process
    that made it (its capacity, aging, tenants' weights, lease): the queue keeps its own,
    and a later process's ``capacity = 2`` held nothing back, in silence (found by a
    hunt). A queue that does not answer in time is not waited for: its polls tell."""
    try:
        state = ray.get(connection.queue.state.remote(), timeout=STATE_TIMEOUT_S)
    except ray.exceptions.RayError as exc:
        log.info("the shared queue's settings were not read: %s", type(exc).__name__)
        return
    theirs = dict(state.get("settings") or {})
    other = [k for k, v in queue_settings(ours, lease_s).items() if theirs.get(k, v) != v]
    if other:
        log.warning(
            "the cluster's shared queue was made with other %s than this process's; it "
            "keeps its own (the first process's) for as long as it lives, which outlives "
            "every process (a detached actor): use a new namespace, or remove it with "
            "ray.kill(ray.get_actor('callboard.queue', namespace=...)) once no process uses it",
            ", ".join(other),
        )


STATE_TIMEOUT_S = 5.0
"""How long a starting process waits for the shared queue's settings."""


def _warn_if_other(model: str, ours: ModelSettings, theirs: Mapping[str, str] | None) -> bool:
    """Say it when this process configured a shared model otherwise than the process that
    made its actor: the actor keeps its own (Ray restarts it with them), so a rotated
    key, a new base_url or a new limit here changed nothing, in silence. Whether it did."""
    other = differing(ours, theirs)
    if other:
        log.warning(
            "model %s: the cluster's shared actor was made with other %s than this "
            "process's; it keeps its own (the first process's) for as long as it lives, "
            "which outlives every process (a detached actor): use a new namespace, or "
            "remove it with ray.kill(ray.get_actor('callboard.model:<name>', namespace=...)) "
            "once no process uses it",
            model,
            ", ".join(other),
        )
    return bool(other)
