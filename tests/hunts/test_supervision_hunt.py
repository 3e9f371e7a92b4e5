"""Supervision hunt: restart strategies, intensity, escalation, poison, the address book.

Each test marked ``xfail(strict=True)`` reproduces one bug; its reason names it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pykka
import pytest
from callboard.actors.base import CrashPlan
from callboard.messages import Crash
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.supervisor.address_book import AddressBook
from callboard.supervisor.supervisor import (
    ChildSpec,
    Escalation,
    RestartType,
    Strategy,
    Supervisor,
    SupervisorConfig,
)

from callboard import Failed, ModelSettings, System, SystemConfig

SHORT_S = 3.0
"""Upper bound for any wait here (never a sleep): each test stays well under 5 s."""


def wait_until(condition: Callable[[], bool], timeout: float = SHORT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.fixture
def sim() -> Iterator[SimulatedProvider]:
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.01, jitter_s=0.002), seed=5) as p:
        yield p


def one_model(sim: SimulatedProvider, **fields: Any) -> ModelSettings:
    return ModelSettings(name="m", base_url=sim.base_url, **{"max_concurrency": 4, **fields})


# -- a tiny supervised world, without the System ------------------------------------------------


class Echo(pykka.ThreadingActor):
    use_daemon_thread = True

    def __init__(self, name: str, incarnation: int, log: list[tuple[str, int]]) -> None:
        super().__init__()
        self.name, self.incarnation = name, incarnation
        log.append((name, incarnation))

    def on_receive(self, message: Any) -> Any:
        return message


class World:
    """A ``Supervisor`` over ``Echo`` children, with a synchronous zero-delay timer."""

    def __init__(
        self,
        names: list[str],
        config: SupervisorConfig,
        *,
        restart: dict[str, RestartType] | None = None,
        start_hook: Callable[[str, int], None] | None = None,
    ) -> None:
        self.book = AddressBook()
        self.started: list[tuple[str, int]] = []
        self.escalations: list[Escalation] = []
        self.escalated = threading.Event()
        restart = restart or {}

        def start(name: str) -> Callable[[int], pykka.ActorRef[Any]]:
            def go(n: int) -> pykka.ActorRef[Any]:
                if start_hook is not None:
                    start_hook(name, n)
                return Echo.start(name, n, self.started)

            return go

        specs = [
            ChildSpec(name=n, start=start(n), restart=restart.get(n, RestartType.PERMANENT))
            for n in names
        ]
        self.sup = Supervisor.start(
            book=self.book,
            specs=specs,
            config=config,
            clock=time.monotonic,
            timer=lambda delay, msg: threading.Timer(
                delay, self.book.try_tell, ("sup", msg)
            ).start(),
            on_escalate=self._escalate,
            on_poison=lambda msg, why: None,
            rng=random.Random(0),
        )
        self.book.add("sup")
        self.book.register("sup", self.sup)
        self.sup.ask(lambda s: s.start_children(), timeout=SHORT_S)

    def _escalate(self, escalation: Escalation) -> None:
        self.escalations.append(escalation)
        self.escalated.set()

    def crash(self, name: str) -> None:
        """Stop ``name``'s current incarnation and report it as a crash."""
        from callboard.messages import ChildFailed

        ref = self.book.resolve(name)
        assert ref is not None
        incarnation = ref.proxy().incarnation.get(timeout=SHORT_S)
        self.book.fail(name, ref, [])
        ref.stop(block=True, timeout=SHORT_S)
        self.book.tell("sup", ChildFailed(name=name, incarnation=incarnation, error="boom"))

    def state(self) -> dict[str, Any]:
        return self.sup.ask(lambda s: s.snapshot(), timeout=SHORT_S)

    def close(self) -> None:
        if self.sup.is_alive():
            self.sup.ask(lambda s: s.stop_children(), timeout=SHORT_S)
            self.sup.stop(block=True, timeout=SHORT_S)
        for name in self.book.names():
            ref = self.book.resolve(name)
            if ref is not None and ref.is_alive():
                ref.stop(block=True, timeout=SHORT_S)


@pytest.fixture
def worlds() -> Iterator[list[World]]:
    made: list[World] = []
    yield made
    for w in made:
        w.close()


FAST: dict[str, Any] = {
    "backoff_min_s": 0.0,
    "backoff_max_s": 0.0,
    "backoff_jitter": 0.0,
    "liveness_every_s": 0.0,
}


@pytest.mark.parametrize(
    ("strategy", "victim", "expected"),
    [
        (Strategy.ONE_FOR_ONE, "b", [("b", 2)]),
        (Strategy.ONE_FOR_ALL, "b", [("a", 2), ("b", 2), ("c", 2)]),
        (Strategy.REST_FOR_ONE, "b", [("b", 2), ("c", 2)]),
        (Strategy.REST_FOR_ONE, "c", [("c", 2)]),
    ],
)
def test_strategies_restart_the_right_siblings_in_start_order(
    worlds: list[World], strategy: Strategy, victim: str, expected: list[tuple[str, int]]
) -> None:
    w = World(["a", "b", "c"], SupervisorConfig(strategy=strategy, **FAST))
    worlds.append(w)
    w.crash(victim)
    assert wait_until(lambda: len(w.started) == 3 + len(expected))
    assert w.started[3:] == expected
    assert all(s["alive"] for name, s in w.state().items() if name != "escalated")


def test_restart_intensity_counts_total_restarts_and_escalates_past_n(
    worlds: list[World],
) -> None:
    w = World(["a", "b"], SupervisorConfig(max_restarts=2, within_s=60.0, **FAST))
    worlds.append(w)
    w.crash("a")
    assert wait_until(lambda: ("a", 2) in w.started)
    w.crash("b")
    assert wait_until(lambda: ("b", 2) in w.started)
    assert not w.escalated.is_set()
    w.crash("a")  # the third restart within the window, across children: escalate
    assert w.escalated.wait(SHORT_S)
    assert "a" in str(w.escalations[0])
    assert ("a", 3) not in w.started


def test_a_temporary_sibling_is_not_restarted_by_one_for_all(worlds: list[World]) -> None:
    w = World(
        ["a", "b", "c"],
        SupervisorConfig(strategy=Strategy.ONE_FOR_ALL, **FAST),
        restart={"c": RestartType.TEMPORARY},
    )
    worlds.append(w)
    w.crash("c")  # temporary: stays down
    assert wait_until(lambda: w.state()["c"]["alive"] is False)
    w.crash("a")
    assert wait_until(lambda: ("b", 2) in w.started)
    assert ("c", 2) not in w.started


def test_a_restart_whose_start_raises_is_a_failure_not_a_dead_supervisor(
    worlds: list[World],
) -> None:
    def hook(name: str, n: int) -> None:
        if name == "b" and n == 2:
            raise RuntimeError("cannot start b #2")

    w = World(
        ["a", "b"],
        SupervisorConfig(max_restarts=5, within_s=60.0, **FAST),
        start_hook=hook,
    )
    worlds.append(w)
    w.crash("b")
    # correct: the failed start counts as a failure, b #3 starts (or the system escalates)
    assert wait_until(lambda: ("b", 3) in w.started or w.escalated.is_set(), 2.0)
    assert w.sup.is_alive()


# -- poison and the liveness check ----------------------------------------------------------


class _HoldCrashReport(logging.Handler):
    """Blocks the dying ingest #2 between its book hand-over and its ``ChildFailed``
    (the "crashed" warning lies in between) until the supervisor has restarted it."""

    def __init__(self, system_box: list[System]) -> None:
        super().__init__(logging.WARNING)
        self.box = system_box
        self.held = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        actor = record.args[0] if isinstance(record.args, tuple) and record.args else None
        if "crashed" not in record.msg or getattr(actor, "name", None) != "ingest":
            return
        if actor.incarnation != 2:
            return
        system = self.box[0]
        dying = actor.actor_ref
        # the liveness check sees the dead ref before the report and restarts ingest
        if wait_until(lambda: system.book.resolve("ingest") not in (None, dying), 2.0):
            self.held.set()


def test_poison_reported_after_the_liveness_check_restarted_the_actor_still_ends_its_tasks(
    sim: SimulatedProvider,
) -> None:
    plan = CrashPlan({"ingest": 1})
    config = SystemConfig(
        models=(one_model(sim),),
        supervisor=SupervisorConfig(
            max_restarts=100, within_s=60.0, backoff_max_s=0.001, liveness_every_s=0.002
        ),
    )
    box: list[System] = []
    handler = _HoldCrashReport(box)
    logger = logging.getLogger("callboard.actors.base")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.WARNING)
    system = System(config, crash_plan=plan)
    box.append(system)
    try:
        future = system.submit("x")  # ingest crashes on it twice: poison
        assert handler.held.wait(SHORT_S)  # the race was provoked
        result = future.result(2.0)  # correct: Failed (internal) at once
        assert isinstance(result, Failed)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        system.stop(timeout=0.5)


# -- escalation racing stop -------------------------------------------------------------------


def test_a_stop_racing_the_escalation_still_fails_the_live_tasks(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=1.0))
    config = SystemConfig(
        models=(one_model(sim),),
        supervisor=SupervisorConfig(max_restarts=0, within_s=60.0),
    )
    system = System(config)
    heard = threading.Event()
    stopper = threading.Thread(target=lambda: system.stop(timeout=0.5))

    def hook(_: Escalation) -> None:  # on the supervisor's thread, before fail_all starts
        heard.set()
        stopper.start()  # the host reacts to the failure by stopping
        wait_until(system._stopped.is_set, 2.0)

    system.on_failure(hook)
    try:
        futures = system.submit_many(["a", "b"])
        assert wait_until(lambda: system.ledger.counts().in_flight == 2)
        system.tell("router", Crash())  # max_restarts=0: the supervisor gives up
        assert heard.wait(SHORT_S)
        results = [f.result(SHORT_S) for f in futures]
    finally:
        if stopper.is_alive() or stopper.ident is not None:
            stopper.join(SHORT_S)
        system.stop(timeout=0.5)
    assert system.failure is not None
    assert [type(r).__name__ for r in results] == ["Failed", "Failed"]


# -- SupervisorConfig checks ------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"within_s": float("nan")},
        {"max_restarts": float("nan")},
        {"max_restarts": 1.5},
        {"backoff_factor": float("nan")},
    ],
    ids=["within_nan", "max_nan", "max_float", "factor_nan"],
)
def test_supervisor_config_refuses_nan_and_non_integer_intensity(fields: dict[str, Any]) -> None:
    with pytest.raises((ValueError, TypeError), match=next(iter(fields))):
        SupervisorConfig(**fields)


def test_supervisor_config_refuses_a_strategy_that_is_not_a_strategy() -> None:
    with pytest.raises((ValueError, TypeError), match="strategy"):
        SupervisorConfig(strategy="one_for_all")  # type: ignore[arg-type]


def test_supervisor_config_refuses_the_documented_bad_values() -> None:
    for fields in (
        {"max_restarts": -1},
        {"within_s": 0.0},
        {"backoff_min_s": 1.0, "backoff_max_s": 0.5},
        {"backoff_factor": 0.5},
        {"backoff_jitter": 2.0},
    ):
        with pytest.raises(ValueError, match=r"must|need"):
            SupervisorConfig(**fields)  # type: ignore[arg-type]


# -- a crash in setup() racing the register that hands over the held messages -----------------


class _HoldStartFailure(logging.Handler):
    """Blocks ingest #2's failed start after its book hand-over (the "crashed while
    starting" warning) until the supervisor has registered it and handed it the hold."""

    def __init__(self, system_box: list[System]) -> None:
        super().__init__(logging.WARNING)
        self.box = system_box
        self.held = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        actor = args[0] if args else None
        if getattr(actor, "name", None) != "ingest" or actor.incarnation != 2:
            return
        if "while starting" not in str(args[1]):
            return
        system = self.box[0]
        dying = actor.actor_ref
        entry = system.book._entries["ingest"]

        def registered() -> bool:  # handed the hold (the bug), or refused it (the fix)
            return system.book.resolve("ingest") is dying or entry.died_unregistered is not dying

        if wait_until(registered, 2.0):
            self.held.set()


def test_messages_held_for_an_incarnation_that_fails_in_setup_reach_the_next(
    sim: SimulatedProvider,
) -> None:
    plan = CrashPlan({}, fail_starts={"ingest": 1})
    config = SystemConfig(
        models=(one_model(sim),),
        supervisor=SupervisorConfig(
            backoff_min_s=0.2, backoff_max_s=0.2, backoff_jitter=0.0, liveness_every_s=0.0
        ),
    )
    box: list[System] = []
    handler = _HoldStartFailure(box)
    logger = logging.getLogger("callboard.actors.base")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.WARNING)
    system = System(config, crash_plan=plan)
    box.append(system)
    try:
        system.tell("ingest", Crash(reason="down for 0.2 s"))
        assert wait_until(lambda: system.book.resolve("ingest") is None)
        future = system.submit("x")  # held for ingest #2, whose start fails
        assert handler.held.wait(SHORT_S)  # the race was provoked
        result = future.result(2.0)  # correct: ingest #3 gets it, it completes
        assert result.ok
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        system.stop(timeout=0.5)
