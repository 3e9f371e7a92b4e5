"""Succession (runtime/succession.py): what a restarted model actor takes over from the
incarnation before. Its limiter, with what was sent still in the windows; its breaker's
state, open until the same time with the cool-down backed off as far as it was; and
the calls it left in flight, taken back from the ledger and sent again (each counted
as an attempt).

The functions first, with a fake clock; then a real ``System`` whose model actor is
crashed while its limits hold.
"""

from __future__ import annotations

from concurrent.futures import Future, wait

import pytest
from callboard.core.breaker import BreakerConfig, CircuitBreaker
from callboard.core.limiter import Admit, LimiterConfig, RateLimiter
from callboard.core.outcome import Signal
from callboard.core.retry import RetryConfig
from callboard.messages import BreakerState, Crash, GetState, Job, Request, Result, Task
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.ledger import Ledger
from callboard.runtime.succession import KeptLimits, inherit_limits, reclaim_predecessors
from support import WAIT_S, accept_one, route_one, running, served, wait_until

from callboard import Completed, Expired, Failed, ModelSettings, System, SystemConfig

ONE_FAILURE = BreakerConfig(consecutive_failures=1, cooldown_s=10.0, backoff=2.0)


def limiter(now: float = 0.0) -> RateLimiter:
    return RateLimiter(LimiterConfig(rpm=600, tpm=None, burst_s=1.0), now)  # ten at once


def opened(now: float) -> CircuitBreaker:
    """A breaker that a failed call opened at ``now``."""
    breaker = CircuitBreaker(ONE_FAILURE)
    permit = breaker.before_call(now)
    breaker.record(now, Signal.OUTAGE, permit)
    assert breaker.state is BreakerState.OPEN
    return breaker


def results(futures: list[Future[Result]]) -> list[Result]:
    _, pending = wait(futures, timeout=WAIT_S)
    assert not pending
    return [f.result() for f in futures]


# -- inherit_limits ---------------------------------------------------------------------


def test_the_first_incarnation_keeps_its_own_limits() -> None:
    kept: dict[str, KeptLimits] = {}
    mine, breaker = limiter(), CircuitBreaker(ONE_FAILURE)
    got, abandoned = inherit_limits(kept, "m", mine, breaker, lambda: 0.0)
    assert (got, abandoned) == (mine, 0)
    assert kept == {"m": KeptLimits(mine, breaker)}


def test_a_new_incarnation_takes_over_the_limiter_with_its_calls_still_charged() -> None:
    kept: dict[str, KeptLimits] = {}
    old_limiter = limiter()
    inherit_limits(kept, "m", old_limiter, CircuitBreaker(ONE_FAILURE), lambda: 0.0)
    sent = [old_limiter.try_acquire(0.0, 1) for _ in range(2)]  # in flight when it died
    assert all(isinstance(s, Admit) for s in sent)
    fresh, breaker = limiter(), CircuitBreaker(ONE_FAILURE)
    got, abandoned = inherit_limits(kept, "m", fresh, breaker, lambda: 0.0)
    assert got is old_limiter
    assert abandoned == 2
    assert old_limiter.outstanding == 0  # never settled here: charged in full
    assert kept["m"] == KeptLimits(old_limiter, breaker)
    assert old_limiter.grantable(0.0) == fresh.grantable(0.0) - 2 == 8


def test_an_open_breaker_stays_open_until_the_same_time() -> None:
    kept: dict[str, KeptLimits] = {}
    old = opened(now=0.0)
    inherit_limits(kept, "m", limiter(), old, lambda: 0.0)
    new = CircuitBreaker(ONE_FAILURE)
    inherit_limits(kept, "m", limiter(), new, lambda: 3.0)
    assert new.state is BreakerState.OPEN
    assert new.reopen_at == old.reopen_at == pytest.approx(10.0)
    assert kept["m"].breaker is new


def test_a_closed_breaker_leaves_the_new_one_closed_with_its_own_counts() -> None:
    kept: dict[str, KeptLimits] = {}
    inherit_limits(kept, "m", limiter(), CircuitBreaker(ONE_FAILURE), lambda: 0.0)
    new = CircuitBreaker(ONE_FAILURE)
    inherit_limits(kept, "m", limiter(), new, lambda: 1.0)
    assert new.state is BreakerState.CLOSED
    assert kept["m"].breaker is new


def test_models_are_kept_apart() -> None:
    kept: dict[str, KeptLimits] = {}
    a, b = limiter(), limiter()
    inherit_limits(kept, "a", a, opened(0.0), lambda: 0.0)
    got, _ = inherit_limits(kept, "b", b, CircuitBreaker(ONE_FAILURE), lambda: 0.0)
    assert got is b
    assert kept["b"].breaker.state is BreakerState.CLOSED


# -- reclaim_predecessors ---------------------------------------------------------------


def _in_flight(ledger: Ledger, task_id: int, incarnation: int) -> Job:
    task = Task(task_id=task_id, trace_id=f"t{task_id}", request=Request.of("hi"), submitted_at=0.0)
    assert accept_one(ledger, task) is None
    job = Job(task=task, candidates=("m",))
    assert route_one(ledger, job)
    assert ledger.dispatch_all([job], "m", incarnation) == [job]
    return job


def test_the_calls_older_incarnations_left_in_flight_are_taken_back_once() -> None:
    ledger = Ledger()
    first = _in_flight(ledger, 1, incarnation=1)
    second = _in_flight(ledger, 2, incarnation=2)
    third = _in_flight(ledger, 3, incarnation=3)  # the live incarnation's own call
    assert reclaim_predecessors(ledger, "m", 3) == [first, second]
    assert ledger.is_routed(1)
    assert ledger.is_routed(2)
    assert not ledger.is_routed(third.task.task_id)
    assert reclaim_predecessors(ledger, "m", 3) == []  # taken back already
    assert reclaim_predecessors(ledger, "other", 9) == []


# -- a real System whose model actor restarts -------------------------------------------


def test_a_restarted_model_actor_keeps_its_breakers_backed_off_cooldown(
    provider: SimulatedProvider,
) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.002, status=500))
    m = ModelSettings(
        name="m",
        base_url=provider.base_url,
        retry=RetryConfig(max_attempts=1),
        breaker=BreakerConfig(
            consecutive_failures=1, cooldown_s=0.1, backoff=10.0, max_cooldown_s=100.0
        ),
    )
    system = System(SystemConfig(models=(m,)))
    try:
        assert isinstance(system.submit("opens the breaker").result(WAIT_S), Failed)
        # waits for the half-open probe (0.1 s), which fails: reopened for 0.1 * 10 s
        assert isinstance(system.submit("the failed probe").result(WAIT_S), Failed)
        old = system.rt.kept_limits["m"].breaker
        backed_off = old._cooldown
        assert backed_off == pytest.approx(1.0)
        system.tell("model:m", Crash(reason="restart while backed off"))
        assert wait_until(lambda: system.rt.kept_limits["m"].breaker is not old), (
            "the restarted incarnation"
        )
        new = system.rt.kept_limits["m"].breaker
        state, cooldown = new.state, new._cooldown
    finally:
        system.stop(cancel=True, timeout=5)
    assert state.value == "open"
    assert cooldown == pytest.approx(backed_off), (
        f"the next failed probe reopens for {cooldown * 10:g} s, not {backed_off * 10:g} s"
    )


def test_a_restarted_model_actor_keeps_its_rate_limit(provider: SimulatedProvider) -> None:
    rpm = 2
    m = ModelSettings(
        name="m",
        base_url=provider.base_url,
        max_concurrency=4,
        limiter=LimiterConfig(rpm=rpm, tpm=None),
    )
    with running(m) as system:
        first = system.submit("one").result(WAIT_S)
        assert isinstance(first, Completed)
        later = []
        for i in range(2):
            system.tell("model:m", Crash(reason=f"restart {i}"))
            later.append(system.submit(f"later {i}", deadline_s=0.5))
            wait([later[-1]], timeout=WAIT_S)
        done = results(later)
    sent = provider.stats()["models"]["m"]["requests"]
    assert all(isinstance(r, Completed | Expired) for r in done), done
    assert sent <= rpm, f"{sent} requests within a second at rpm={rpm}"


def test_a_restarted_model_actor_keeps_its_breaker_open(provider: SimulatedProvider) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.002, error_rate=1.0))
    m = ModelSettings(
        name="m",
        base_url=provider.base_url,
        retry=RetryConfig(max_attempts=1),
        breaker=BreakerConfig(consecutive_failures=1, cooldown_s=60.0),
    )
    with running(m) as system:
        failed = system.submit("opens the breaker").result(WAIT_S)
        assert isinstance(failed, Failed)
        system.tell("model:m", Crash(reason="restart while open"))
        later = system.submit("must not be sent", deadline_s=0.5).result(WAIT_S)
        state = system.ask("model:m", GetState())
    assert isinstance(later, Expired), later
    assert provider.stats()["models"]["m"]["requests"] == 1
    assert state["incarnation"] == 2


def test_attempts_count_the_call_sent_again_after_a_model_restart(
    assorted_system: System, provider: SimulatedProvider
) -> None:
    future = assorted_system.submit("hello there", model="slow")
    assert wait_until(lambda: served(provider, "slow").get("in_flight", 0) == 1)
    assorted_system.tell("model:slow", Crash())
    result = future.result(WAIT_S)
    assert result.ok
    assert assorted_system.drain(WAIT_S)
    sent = served(provider, "slow")["requests"]
    assert sent == 2  # the dead incarnation's call, and the one sent again
    assert result.attempts == sent
    assert assorted_system.stats().total.attempts == sent
