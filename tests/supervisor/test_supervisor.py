"""Supervisor semantics: strategies, start failures, liveness, backoff, restart types."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pykka
import pytest
from callboard.actors.base import SUPERVISOR, Actor, CrashPlan, Runtime
from callboard.messages import Crash, GetState
from callboard.messages._control import CheckLiveness, StartChildren, StopChildren
from callboard.provider.server import SimulatedProvider
from callboard.runtime.io_loop import IoLoop
from callboard.runtime.ledger import Ledger
from callboard.supervisor.address_book import AddressBook
from callboard.supervisor.supervisor import (
    ChildSpec,
    RestartType,
    Strategy,
    Supervisor,
    SupervisorConfig,
    _Child,
)
from support import WAIT_S, two_models, wait_until

from callboard import System, SystemConfig

ORDER = ["aggregator", "model:alpha", "model:beta", "queue", "router", "ingest"]


def works(system: System, n: int = 10) -> bool:
    return all(f.result(WAIT_S).ok for f in system.submit_many([f"q{i}" for i in range(n)]))


def incarnations(system: System) -> dict[str, int]:
    return {
        name: state["incarnation"] for name, state in system.supervision().items() if name in ORDER
    }


@pytest.mark.parametrize(
    ("strategy", "victim", "restarted"),
    [
        (Strategy.ONE_FOR_ONE, "queue", {"queue"}),
        (Strategy.ONE_FOR_ALL, "queue", set(ORDER)),
        (Strategy.REST_FOR_ONE, "queue", {"queue", "router", "ingest"}),
    ],
)
def test_strategies_restart_what_erlang_says(
    provider: SimulatedProvider, strategy: Strategy, victim: str, restarted: set[str]
) -> None:
    config = SystemConfig(
        models=two_models(provider.base_url), supervisor=SupervisorConfig(strategy=strategy)
    )
    with System(config) as system:
        assert works(system)
        before = incarnations(system)
        system.tell(victim, Crash())
        assert works(system)  # the crash is handled before later messages are served
        after = incarnations(system)
    changed = {name for name in ORDER if after[name] != before[name]}
    assert changed == restarted


def test_a_failure_while_starting_is_detected_and_retried(
    make_system: Callable[..., System], provider: SimulatedProvider
) -> None:
    plan = CrashPlan({}, fail_starts={"router": 2})
    system = make_system(SystemConfig(models=two_models(provider.base_url)), crash_plan=plan)
    system.tell("router", Crash())
    assert works(system)
    state = system.supervision()["router"]
    assert state["restarts"] == 3  # the crash, then two failed starts
    assert any("while starting" in e for e in state["last_errors"])
    assert state["alive"]


def test_an_actor_stopped_from_elsewhere_is_restarted(make_system: Callable[..., System]) -> None:
    system = make_system()
    ref = system.book.resolve("router")
    assert ref is not None
    ref.stop(block=True)  # a normal exit, reported: the router is permanent
    assert works(system)  # held while dead, delivered to the new incarnation
    assert system.supervision()["router"]["restarts"] == 1


# -- a bare supervisor: its own messages only, and restart types as OTP says ----------


class Echo(Actor):
    """A supervised child that answers what it is asked."""

    def handle(self, message: Any) -> Any:
        return message


class Silent(pykka.ThreadingActor):
    """A child that reports nothing when it dies (not built on ``actors.base.Actor``)."""

    use_daemon_thread = True


@pytest.fixture
def rt() -> Iterator[Runtime]:
    io = IoLoop()
    io.start()
    try:
        yield Runtime(book=AddressBook(), ledger=Ledger(), io=io)
    finally:
        io.stop()


Supervise = Callable[..., "pykka.ActorRef[Supervisor]"]


@pytest.fixture
def checks() -> list[CheckLiveness]:
    """Every liveness check the supervisors of a test armed, in order."""
    return []


@pytest.fixture
def supervise(rt: Runtime, checks: list[CheckLiveness]) -> Iterator[Supervise]:
    """``supervise(*specs, **config)``: a started supervisor, stopped in teardown."""
    started: list[pykka.ActorRef[Supervisor]] = []

    def timer(delay: float, message: Any) -> None:
        if isinstance(message, CheckLiveness):
            checks.append(message)
        rt.after(delay, SUPERVISOR, message)

    def supervise(*specs: ChildSpec, **config: Any) -> pykka.ActorRef[Supervisor]:
        sup = Supervisor.start(
            book=rt.book,
            specs=list(specs),
            config=SupervisorConfig(**{"backoff_jitter": 0.0, **config}),
            clock=time.monotonic,
            timer=timer,
            on_escalate=lambda esc: None,
            on_poison=lambda msg, why: None,
        )
        started.append(sup)
        rt.book.add(SUPERVISOR)
        rt.book.register(SUPERVISOR, sup)
        sup.ask(StartChildren(), timeout=WAIT_S)
        return sup

    yield supervise
    for sup in started:
        sup.ask(StopChildren(), timeout=WAIT_S)
        sup.stop(block=True, timeout=WAIT_S)


def echo(rt: Runtime, name: str, restart: RestartType = RestartType.PERMANENT) -> ChildSpec:
    return ChildSpec(name=name, start=lambda n: Echo.start(rt, name, n), restart=restart)


def state(sup: pykka.ActorRef[Supervisor], name: str) -> dict[str, Any]:
    answer: dict[str, Any] = sup.ask(GetState(), timeout=WAIT_S)[name]
    return answer


def test_the_supervisor_runs_no_callable_and_survives_whatever_it_is_sent(
    rt: Runtime, supervise: Supervise, caplog: pytest.LogCaptureFixture
) -> None:
    sup = supervise(echo(rt, "child"))
    ran = threading.Event()

    def thunk(_: object) -> None:
        ran.set()
        raise RuntimeError("run on the supervisor's thread, this would kill the root")

    with caplog.at_level(logging.ERROR, logger="callboard.supervisor"):
        sup.tell(thunk)  # told: had it raised there, the supervisor would be dead
        assert sup.ask(lambda s: s.stop_children(), timeout=WAIT_S) is None
        assert sup.ask("liveness-check", timeout=WAIT_S) is None
    assert not ran.is_set()
    assert sup.is_alive()
    assert state(sup, "child")["alive"]  # nothing was stopped by the thunk asked for it
    assert rt.book.resolve("child") is not None
    assert caplog.text.count("the supervisor ignores") == 3


def test_a_transient_child_is_restarted_after_a_crash_not_after_a_normal_stop(
    rt: Runtime, supervise: Supervise, checks: list[CheckLiveness]
) -> None:
    sup = supervise(echo(rt, "transient", RestartType.TRANSIENT), liveness_every_s=0.01)
    rt.book.tell("transient", Crash(reason="a bug"))  # abnormal: restarted
    assert wait_until(lambda: state(sup, "transient")["incarnation"] == 2)
    assert wait_until(lambda: state(sup, "transient")["alive"])
    second = rt.book.resolve("transient")
    assert second is not None
    assert second.stop(block=True, timeout=WAIT_S)  # normal: its report is told before this returns
    after = state(sup, "transient")  # asked after the report: handled in order
    assert (after["incarnation"], after["restarts"], after["alive"]) == (2, 1, False)
    assert after["last_errors"][-1] == "stopped"
    armed = len(checks)
    assert wait_until(lambda: len(checks) >= armed + 3)  # liveness checks came and went
    assert state(sup, "transient")["incarnation"] == 2


def test_a_permanent_child_is_restarted_after_a_normal_stop(
    rt: Runtime, supervise: Supervise
) -> None:
    sup = supervise(echo(rt, "permanent"))
    first = rt.book.resolve("permanent")
    assert first is not None
    assert first.stop(block=True, timeout=WAIT_S)
    after = state(sup, "permanent")
    assert (after["incarnation"], after["restarts"]) == (2, 1)
    assert rt.book.resolve("permanent") is not first
    assert rt.book.resolve("permanent") is not None


def test_a_death_nobody_reports_is_found_and_counts_as_abnormal(
    rt: Runtime, supervise: Supervise
) -> None:
    spec = ChildSpec(name="silent", start=lambda n: Silent.start(), restart=RestartType.TRANSIENT)
    sup = supervise(spec, liveness_every_s=0.01)
    first = rt.book.resolve("silent")
    assert first is not None
    first.stop(block=True, timeout=WAIT_S)  # no report: only the liveness check can notice
    assert wait_until(lambda: state(sup, "silent")["incarnation"] == 2)
    assert "found dead" in state(sup, "silent")["last_errors"]
    assert rt.book.resolve("silent") is not first


def test_a_temporary_child_is_restarted_after_nothing(rt: Runtime, supervise: Supervise) -> None:
    sup = supervise(echo(rt, "temporary", RestartType.TEMPORARY))
    rt.book.tell("temporary", Crash(reason="a bug"))
    assert wait_until(lambda: state(sup, "temporary")["last_errors"])  # the report was handled
    after = state(sup, "temporary")
    assert (after["incarnation"], after["restarts"], after["alive"]) == (1, 0, False)


def test_backoff_grows_with_jitter_caps_and_resets_after_a_quiet_period() -> None:
    config = SupervisorConfig(
        backoff_min_s=0.1,
        backoff_max_s=1.0,
        backoff_factor=2.0,
        backoff_jitter=0.0,
        reset_after_s=5.0,
    )
    sup = Supervisor(
        book=AddressBook(),
        specs=[],
        config=config,
        clock=lambda: 0.0,
        timer=lambda delay, msg: None,
        on_escalate=lambda esc: None,
        on_poison=lambda msg, why: None,
        rng=random.Random(1),
    )
    child = _Child(spec=ChildSpec(name="x", start=lambda n: None))  # type: ignore[arg-type, return-value]
    delays = []
    now = 0.0
    for _ in range(6):
        delays.append(sup._next_backoff(child, now))
        child.last_failure_at = now
        now += 0.5
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert sup._next_backoff(child, now + 10.0) == 0.1  # quiet for longer than reset_after_s


@pytest.mark.parametrize("field", ["reset_after_s", "liveness_every_s"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_supervisor_config_refuses_a_bad_period(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SupervisorConfig(**{field: value})
