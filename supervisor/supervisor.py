"""The supervisor: starts, watches and restarts the actors below it.

Theory of operation. Children are declared as ``ChildSpec``s in start order.
A child that crashes tells the supervisor (``ChildFailed``, sent by the base
actor from the dying thread); the supervisor checks the restart intensity
(at most ``max_restarts`` within ``within_s``), waits a backoff (exponential
with jitter, capped, reset after a quiet period), and starts a new
incarnation, which the address book hands every held message.

Strategies mean what Erlang/OTP says: ``ONE_FOR_ONE`` restarts the failed
child; ``ONE_FOR_ALL`` restarts every child; ``REST_FOR_ONE`` restarts the
failed child and those started after it. Restart types, as OTP says:
``PERMANENT`` after any exit, ``TRANSIENT`` only after an abnormal one (a
crash, ``ChildFailed``, or a death nobody reported), not after a normal stop
(``ChildStopped``: someone else stopped it), ``TEMPORARY`` never.

The supervisor takes only its own typed messages (``messages._control``):
the host asks ``StartChildren``, ``StopChildren`` and ``ReplaceChildren`` (a
runtime that changes shape: a cluster's process taking over its queue and
models when the cluster is lost), children report
``ChildFailed`` / ``ChildStopped``, its timers send ``RestartChild`` and
``CheckLiveness``, anyone may ask ``GetState``. Anything else is logged and
ignored: no caller can run code on its thread, so nothing a caller sends can
kill it.

Past the intensity the supervisor stops trying: it calls ``on_escalate`` with
a report naming each actor and reason, and the host stops the system. The
supervisor itself is the root: it is never restarted, and it only ever does
short work on its own thread. So its own end is an escalation too: stopped
by anyone but the host (``pykka``'s ``stop``, or ``ActorRegistry.stop_all``,
which pykka also runs when any actor raises a ``BaseException``) or killed by
an exception in its own handler, it calls ``on_escalate`` as it dies, and the
host stops the system rather than run on with nobody to restart its actors.
"""

from __future__ import annotations

import enum
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import pykka
from callboard.messages import (
    CheckLiveness,
    ChildFailed,
    ChildStopped,
    ConfigError,
    GetState,
    ReplaceChildren,
    RestartChild,
    StartChildren,
    StopChildren,
    is_number,
)
from callboard.runtime import redact
from callboard.runtime.guarded_log import guarded_logger
from callboard.supervisor.address_book import AddressBook

log = guarded_logger(__name__)


class Strategy(enum.Enum):
    ONE_FOR_ONE = "one_for_one"
    ONE_FOR_ALL = "one_for_all"
    REST_FOR_ONE = "rest_for_one"


class RestartType(enum.Enum):
    PERMANENT = "permanent"
    TRANSIENT = "transient"
    TEMPORARY = "temporary"


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorConfig:
    strategy: Strategy = Strategy.ONE_FOR_ONE
    max_restarts: int = 20
    """Restart intensity: at most this many restarts ..."""
    within_s: float = 10.0
    """... within this many seconds, else escalate; nor this many of one child in a row,
    each within ``reset_after_s`` of its last crash (a crash loop the backoff spaces
    out: at 2 s apart, 20 never fall within 10 s, and it would loop for ever)."""
    backoff_min_s: float = 0.0
    """Delay before the first restart after a quiet period."""
    backoff_max_s: float = 2.0
    backoff_factor: float = 2.0
    backoff_jitter: float = 0.2
    """Up to this fraction added at random to each delay."""
    reset_after_s: float = 10.0
    """A child that ran this long without crashing backs off from the start again."""
    liveness_every_s: float = 1.0
    """How often to look for children that died without reporting (0: never)."""

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            raise ConfigError(f"strategy must be a Strategy, got {self.strategy!r}")
        if type(self.max_restarts) is not int or self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        for name in ("within_s", "backoff_min_s", "backoff_max_s", "backoff_factor"):
            value = getattr(self, name)
            if not is_number(value):
                raise ConfigError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ConfigError(f"{name} must be finite, got {value!r}")
        if self.within_s <= 0:
            raise ConfigError("within_s must be > 0")
        if not 0 <= self.backoff_min_s <= self.backoff_max_s:
            raise ConfigError("need 0 <= backoff_min_s <= backoff_max_s")
        jitter = self.backoff_jitter
        if not is_number(jitter):
            raise ConfigError(f"backoff_jitter must be a number, got {jitter!r}")
        if self.backoff_factor < 1 or not 0 <= jitter <= 1:
            raise ConfigError("need backoff_factor >= 1 and backoff_jitter in [0, 1]")
        for name in ("reset_after_s", "liveness_every_s"):
            value = getattr(self, name)
            if not is_number(value):
                raise ConfigError(f"{name} must be a number, got {value!r}")  # (a bare
                # TypeError from the comparison below named none, and True was 1; a hunt)
            if not 0 <= value < float("inf"):  # also refuses NaN
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildSpec:
    name: str
    start: Callable[[int], pykka.ActorRef[Any]]
    """Start incarnation N of the child and return its ref (it must not block)."""
    restart: RestartType = RestartType.PERMANENT
    after_restart: Callable[[int], None] | None = None
    """Run on the supervisor's thread once incarnation N is registered."""
    shutdown_timeout_s: float = 5.0


@dataclass(slots=True)
class _Child:
    spec: ChildSpec
    incarnation: int = 0
    ref: pykka.ActorRef[Any] | None = None
    restarts: int = 0
    backoff_s: float = 0.0
    last_failure_at: float | None = None
    in_a_row: int = 0
    """Its restarts since it last ran ``reset_after_s`` without crashing."""
    failed: bool = False
    seen_dead: bool = False
    """The last liveness check found this incarnation dead, unreported."""
    errors: deque[str] = field(default_factory=lambda: deque(maxlen=5))


@dataclass(frozen=True, slots=True, kw_only=True)
class Escalation:
    """Why the supervisor gave up: each failing actor and its last reasons."""

    reasons: tuple[tuple[str, str], ...]
    cause: str = "restart intensity exceeded"
    """What ended supervision: the intensity, or the root's own death."""
    restarts: tuple[tuple[str, int], ...] = ()
    """Each child's restarts until then (``Stats.restarts`` of the failed system)."""

    def __str__(self) -> str:
        lines = "; ".join(f"{name}: {why}" for name, why in self.reasons[-5:])
        return f"{self.cause}, system stopped ({lines})"


def _restarts(restart: RestartType, *, abnormal: bool) -> bool:
    """Whether a child of this restart type is restarted after an exit (OTP's table)."""
    if restart is RestartType.PERMANENT:
        return True
    return abnormal and restart is RestartType.TRANSIENT


class Supervisor(pykka.ThreadingActor):
    """The root actor. It takes only its own messages (see the module docstring)."""

    use_daemon_thread = True  # a host that forgets stop() must still be able to exit

    def __init__(
        self,
        *,
        book: AddressBook,
        specs: list[ChildSpec],
        config: SupervisorConfig,
        clock: Callable[[], float],
        timer: Callable[[float, Any], None],
        on_escalate: Callable[[Escalation], None],
        on_poison: Callable[[Any, str], None],
        rng: random.Random | None = None,
    ) -> None:
        super().__init__()
        self._book = book
        self._children = {s.name: _Child(spec=s) for s in specs}
        self._order = [s.name for s in specs]
        self._config = config
        self._clock = clock
        self._timer = timer
        self._on_escalate = on_escalate
        self._on_poison = on_poison
        self._rng = rng or random.Random(0)
        self._restart_times: deque[float] = deque()
        self._escalated: Escalation | None = None
        self._stopping = False

    # -- start and stop ---------------------------------------------------

    def _start_children(self) -> None:
        for name in self._order:
            self._book.add(name)
        for name in self._order:
            self._start(self._children[name])
        self._arm_liveness()

    def _arm_liveness(self) -> None:
        if self._config.liveness_every_s > 0:
            self._timer(self._config.liveness_every_s, CheckLiveness())

    def _check_liveness(self) -> None:
        """Catch a child that died without reporting (a failure hook that itself
        failed): an abnormal exit, whatever the child's restart type. A child is
        found dead at the second check that sees it so: a normal stop reports
        itself (``ChildStopped``) only once its actor is dead already."""
        if self._escalated or self._stopping:
            return
        for name, child in self._children.items():
            ref = child.ref
            if ref is not None and not child.failed and not ref.is_alive():
                if not child.seen_dead:
                    child.seen_dead = True  # its report, if it sent one, comes first
                    continue
                self._book.fail(name, ref, [])
                self._failed(
                    ChildFailed(name=name, incarnation=child.incarnation, error="found dead")
                )
        self._arm_liveness()

    def _start(self, child: _Child) -> None:
        child.incarnation += 1
        child.failed = child.seen_dead = False
        child.ref = child.spec.start(child.incarnation)
        self._book.register(child.spec.name, child.ref)

    def _replace(self, specs: tuple[ChildSpec, ...]) -> tuple[str, ...]:
        """``ReplaceChildren``: stop what runs under these names, start the new specs."""
        if self._escalated or self._stopping:
            return ()
        known = [s.name for s in specs if s.name in self._children]
        at = self._order.index(known[0]) if known else len(self._order)
        for spec in specs:
            child = self._children.get(spec.name)
            if child is None:
                self._children[spec.name] = _Child(spec=spec)
                self._order.insert(at, spec.name)
                at += 1
                self._book.add(spec.name)
            else:
                child.spec = spec
        for spec in reversed(specs):  # stop the live ones, newest first, as a restart does
            ref = self._book.detach(spec.name)
            if ref is not None:
                self._stop_ref(spec.name, ref)
        started = []
        for spec in specs:
            child = self._children[spec.name]
            try:
                self._start(child)
                if child.incarnation > 1 and spec.after_restart is not None:
                    spec.after_restart(child.incarnation)
            except Exception as exc:
                log.exception("starting %s in its new shape failed", spec.name)
                self.actor_ref.tell(
                    ChildFailed(
                        name=spec.name,
                        incarnation=child.incarnation,
                        error=f"start failed: {type(exc).__name__}: {exc}",
                    )
                )
            else:
                started.append(spec.name)
        return tuple(started)

    def _stop_children(self) -> tuple[str, ...]:
        """Stop every child in reverse start order; names of those that would not stop."""
        self._stopping = True
        stuck = []
        for name in reversed(self._order):
            child = self._children[name]
            ref = self._book.detach(name) or child.ref
            child.ref = None
            if ref is not None and not self._stop_ref(name, ref):
                stuck.append(name)
        return tuple(stuck)

    def _stop_ref(self, name: str, ref: pykka.ActorRef[Any]) -> bool:
        """Stop ``name``'s incarnation ``ref``; False (logged) if it did not stop in time."""
        timeout = self._children[name].spec.shutdown_timeout_s
        try:
            ref.stop(block=True, timeout=timeout)
        except pykka.Timeout:
            # a timeout, not a crash: no traceback to show
            log.error("%s did not stop within %.1f s", name, timeout)  # noqa: TRY400
            return False
        return True

    # -- messages ---------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        kind = type(message)
        if kind is ChildFailed:
            self._failed(message)
        elif kind is ChildStopped:
            self._stopped(message)
        elif kind is RestartChild:
            self._restart_due(message)
        elif kind is CheckLiveness:
            self._check_liveness()
        elif kind is GetState:
            return self._snapshot()
        elif kind is StartChildren:
            self._start_children()
        elif kind is StopChildren:
            return self._stop_children()
        elif kind is ReplaceChildren:
            return self._replace(message.specs)
        else:  # never run, never raised on: a tell that raised would kill the root
            log.error("the supervisor ignores %r: it takes only its own messages", message)
        return None

    # -- the root's own end: pykka's hooks -----------------------------------

    def on_stop(self) -> None:
        """Stopped: by the host after ``StopChildren`` (nothing to say), or by anyone else."""
        if not self._stopping:
            self._died("the root supervisor was stopped from outside the system")

    def on_failure(
        self,
        exception_type: type[BaseException] | None,  # noqa: ARG002 - pykka's hook signature
        exception_value: BaseException | None,
        traceback: TracebackType | None,  # noqa: ARG002 - pykka's hook signature
    ) -> None:
        self._died(redact.hide(f"the root supervisor crashed: {exception_value!r}"))

    def _died(self, why: str) -> None:
        """The root is gone, so nobody restarts anything: the host must stop the system."""
        if self._escalated is not None:  # the host is stopping the system already
            return
        self._escalated = Escalation(
            reasons=(("supervisor", why),),
            cause="the root supervisor died",
            restarts=self._restart_counts(),
        )
        log.error("%s", self._escalated)
        self._guarded(self._on_escalate, self._escalated)

    def _restart_counts(self) -> tuple[tuple[str, int], ...]:
        return tuple((name, c.restarts) for name, c in self._children.items())

    def _snapshot(self) -> dict[str, Any]:
        return {
            name: {
                "incarnation": c.incarnation,
                "restarts": c.restarts,
                "alive": c.ref is not None and c.ref.is_alive() and not c.failed,
                "last_errors": list(c.errors),
            }
            for name, c in ((n, self._children[n]) for n in self._order)
        } | {"escalated": str(self._escalated) if self._escalated else None}

    def _failed(self, msg: ChildFailed) -> None:
        child = self._children.get(msg.name)
        error = redact.hide(msg.error)  # it goes on to supervision(), the failure raised
        # to callers, hooks and the poisoned tasks' results (a key an exception quoted
        # reached all four; found by a hunt)
        if msg.poison is not None and child is not None:
            # whatever the incarnation, escalated or stopping: the report is the only
            # holder of that message, and nobody else would end its tasks
            log.error("%s crashed twice on one message; failing its tasks", msg.name)
            self._guarded(
                self._on_poison, msg.poison, f"{msg.name} crashed twice handling it: {error}"
            )
        if child is not None and self._current(child, msg.incarnation):
            self._exited(child, error, abnormal=True)

    def _stopped(self, msg: ChildStopped) -> None:
        """A child stopped by someone else (a stop the supervisor asked for is stale
        or comes while stopping, and is ignored here)."""
        child = self._children.get(msg.name)
        if child is None or child.ref is None or child.failed:
            return
        if self._current(child, msg.incarnation):
            self._book.fail(msg.name, child.ref, [])
            self._exited(child, "stopped", abnormal=False)

    def _current(self, child: _Child, incarnation: int) -> bool:
        """A report about ``child``'s live incarnation, while the supervisor still acts."""
        return incarnation == child.incarnation and not self._escalated and not self._stopping

    def _exited(self, child: _Child, why: str, *, abnormal: bool) -> None:
        """``child`` is gone: restart it (after its backoff) if its type says so."""
        name = child.spec.name
        child.failed = True
        child.errors.append(why)
        if not _restarts(child.spec.restart, abnormal=abnormal):
            log.warning(
                "%s (%s) exited and is not restarted: %s", name, child.spec.restart.value, why
            )
            return
        now = self._clock()
        looping = self._crash_loop(child, now)
        if self._intensity_exceeded(now) or looping:
            self._escalate(name, why)
            return
        delay = self._next_backoff(child, now)
        child.last_failure_at = now
        log.warning("restarting %s in %.3f s after: %s", name, delay, why)
        if delay <= 0:
            self._restart(child)
        else:
            self._timer(delay, RestartChild(name=name, incarnation=child.incarnation))

    def _restart_due(self, msg: RestartChild) -> None:
        child = self._children.get(msg.name)
        if self._escalated or self._stopping:  # a timer set before the stop: start nothing
            return
        if child and child.failed and child.incarnation == msg.incarnation:
            self._restart(child)

    def _intensity_exceeded(self, now: float) -> bool:
        times = self._restart_times
        times.append(now)
        while times and times[0] < now - self._config.within_s:
            times.popleft()
        return len(times) > self._config.max_restarts

    def _crash_loop(self, child: _Child, now: float) -> bool:
        """Whether ``child``, failing now, has been restarted ``max_restarts`` times in
        a row without running ``reset_after_s`` between: the backoff spaces such a loop
        out beyond what the intensity's window counts."""
        child.in_a_row = 1 if self._quiet(child, now) else child.in_a_row + 1
        return child.in_a_row > self._config.max_restarts

    def _quiet(self, child: _Child, now: float) -> bool:
        """Whether ``child`` ran ``reset_after_s`` without crashing before failing now
        (its backoff and its crashes in a row start again)."""
        last = child.last_failure_at
        return last is None or now - last > self._config.reset_after_s

    def _next_backoff(self, child: _Child, now: float) -> float:
        cfg = self._config
        quiet = self._quiet(child, now)
        if quiet or child.backoff_s <= 0:
            base = cfg.backoff_min_s if quiet else max(cfg.backoff_min_s, 0.01)
        else:
            base = min(cfg.backoff_max_s, child.backoff_s * cfg.backoff_factor)
        child.backoff_s = base
        return min(cfg.backoff_max_s, base * (1 + cfg.backoff_jitter * self._rng.random()))

    def _restart(self, failed: _Child) -> None:
        """Restart ``failed`` and what its strategy takes with it. A step that raises
        (a stop that times out, a start or an ``after_restart`` hook that fails) is
        logged and counted as that child failing to start, never kills the supervisor."""
        names = self._affected(failed.spec.name)
        for name in reversed(names):  # stop the live ones among them, newest first
            ref = None if self._children[name] is failed else self._book.detach(name)
            if ref is not None:
                self._stop_ref(name, ref)
        for name in names:
            child = self._children[name]
            child.restarts += 1
            try:
                self._start(child)
                if child.spec.after_restart is not None:
                    child.spec.after_restart(child.incarnation)
            except Exception as exc:
                log.exception("restarting %s failed", name)
                self.actor_ref.tell(
                    ChildFailed(
                        name=name,
                        incarnation=child.incarnation,
                        error=f"restart failed: {type(exc).__name__}: {exc}",
                    )
                )

    def _guarded(self, hook: Callable[..., object], *args: Any) -> None:
        """Call a system callback; one that raises is logged, never kills the supervisor."""
        try:
            hook(*args)
        except Exception:
            log.exception("a supervisor callback (%r) raised", hook)

    def _affected(self, name: str) -> list[str]:
        """The children a failure of ``name`` restarts: by the strategy, less the
        temporary ones (never restarted, whoever failed)."""
        strategy = self._config.strategy
        if strategy is Strategy.ONE_FOR_ALL:
            names = list(self._order)
        elif strategy is Strategy.REST_FOR_ONE:
            names = self._order[self._order.index(name) :]
        else:
            names = [name]
        return [n for n in names if self._children[n].spec.restart is not RestartType.TEMPORARY]

    def _escalate(self, name: str, why: str) -> None:
        reasons = tuple(
            (n, err) for n, c in self._children.items() for err in c.errors if c.failed
        ) or ((name, why),)
        self._escalated = Escalation(reasons=reasons, restarts=self._restart_counts())
        log.error("%s", self._escalated)
        self._guarded(self._on_escalate, self._escalated)
