"""The circuit breaker: examples with a fake clock, then a hypothesis state machine."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from callboard.core.breaker import (
    TRANSITIONS,
    Allow,
    BreakerConfig,
    BreakerEvent,
    CircuitBreaker,
    IllegalTransition,
    Reject,
    next_state,
)
from callboard.core.outcome import Signal
from callboard.messages import BreakerState
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
OK, DOWN, MEH = Signal.SUCCESS, Signal.OUTAGE, Signal.NEUTRAL


def call(b: CircuitBreaker, now: float, signal: Signal) -> Allow:
    """One allowed call that ends at once with ``signal``."""
    permit = b.before_call(now)
    assert isinstance(permit, Allow), permit
    b.record(now, signal, permit)
    return permit


def open_breaker(cfg: BreakerConfig | None = None, now: float = 0.0) -> CircuitBreaker:
    b = CircuitBreaker(cfg or BreakerConfig())
    for _ in range(b.config.consecutive_failures):
        call(b, now, DOWN)
    assert b.state is OPEN
    return b


# -- the table ------------------------------------------------------------------


def test_the_table_is_the_state_machine() -> None:
    for state, event in itertools.product(BreakerState, BreakerEvent):
        if (state, event) in TRANSITIONS:
            assert next_state(state, event) is TRANSITIONS[state, event]
        else:
            with pytest.raises(IllegalTransition) as info:
                next_state(state, event)
            assert (info.value.state, info.value.event) == (state, event)


def test_an_illegal_transition_changes_nothing() -> None:
    b = CircuitBreaker()
    with pytest.raises(IllegalTransition, match="PROBE_SUCCEEDED in state CLOSED"):
        b._fire(0.0, BreakerEvent.PROBE_SUCCEEDED)
    assert b.state is CLOSED


# -- closed ------------------------------------------------------------------------


def test_closed_allows_and_opens_on_consecutive_outages() -> None:
    b = CircuitBreaker()
    for i in range(4):
        call(b, float(i), DOWN)
        assert b.state is CLOSED
    call(b, 4.0, DOWN)
    assert b.state is OPEN
    assert b.reopen_at == 4.0 + 5.0
    assert b.before_call(5.0) == Reject(9.0)
    assert b.capacity(5.0) == 0


def test_a_success_ends_the_consecutive_run() -> None:
    b = CircuitBreaker(BreakerConfig(consecutive_failures=3, min_calls=100, max_window_calls=100))
    for _ in range(10):
        call(b, 0.0, DOWN)
        call(b, 0.0, DOWN)
        call(b, 0.0, OK)
    assert b.state is CLOSED


def test_neutral_results_count_neither_way() -> None:
    by_run = BreakerConfig(consecutive_failures=2)
    by_rate = BreakerConfig(consecutive_failures=100, min_calls=2, failure_rate=0.5)
    for cfg in (by_run, by_rate):  # fifty neutral calls break neither the run nor the rate
        b = CircuitBreaker(cfg)
        call(b, 0.0, DOWN)
        for _ in range(50):
            call(b, 0.0, MEH)
        call(b, 0.0, DOWN)
        assert b.state is OPEN, cfg


def test_the_failure_rate_opens_over_the_window() -> None:
    b = CircuitBreaker(BreakerConfig(consecutive_failures=100, min_calls=10, failure_rate=0.5))
    for i in range(5):
        call(b, float(i), DOWN)
        call(b, float(i), OK)
    assert b.state is CLOSED  # 5 of 10: the rate is judged when a failure arrives
    call(b, 5.0, DOWN)
    assert b.state is OPEN  # 6 of 11


def test_the_rate_needs_min_calls() -> None:
    b = CircuitBreaker(BreakerConfig(consecutive_failures=100, min_calls=10))
    for _ in range(4):
        call(b, 0.0, DOWN)
        call(b, 0.0, OK)
    assert b.state is CLOSED


def test_old_failures_leave_the_window() -> None:
    cfg = BreakerConfig(consecutive_failures=100, window_s=30.0, min_calls=4, failure_rate=0.5)
    b = CircuitBreaker(cfg)
    for signal in (DOWN, OK, OK):
        call(b, 0.0, signal)
    for signal in (OK, DOWN, DOWN):  # with the old three: 3 failures of 6 would open
        call(b, 31.0, signal)
    assert b.state is CLOSED


def test_the_window_memory_is_capped() -> None:
    cfg = BreakerConfig(consecutive_failures=100, min_calls=10, max_window_calls=50)
    b = CircuitBreaker(cfg)
    for _ in range(1000):
        call(b, 1.0, OK)
    assert len(b._window) == 50


# -- open, half-open ---------------------------------------------------------------


def test_cooldown_then_one_probe() -> None:
    b = open_breaker()
    assert b.before_call(4.999) == Reject(5.0)
    assert b.capacity(4.999) == 0
    assert b.capacity(5.0) == 1
    assert b.state is OPEN  # asking the room changes nothing
    probe = b.before_call(5.0)
    assert probe == Allow(probe=True, epoch=1)
    assert b.state is HALF_OPEN
    assert b.before_call(5.0) == Reject(None)
    assert b.capacity(5.0) == 0
    b.record(6.0, OK, probe)
    assert b.state is CLOSED
    assert b.reopen_at is None
    assert b.capacity(6.0) is None


def test_the_owner_half_opens_it_on_its_own_timer_without_a_call() -> None:
    b = open_breaker()
    assert not b.advance(4.999)  # the cool-down is not over
    assert b.state is OPEN
    assert b.advance(5.0)
    assert (b.state, b.reopen_at, b.capacity(5.0)) == (HALF_OPEN, None, 1)
    assert not b.advance(6.0)  # half-open already: nothing to do
    probe = b.before_call(6.0)
    assert probe == Allow(probe=True, epoch=1)  # the probe of the round it opened
    b.record(6.5, OK, probe)
    assert b.state is CLOSED
    assert not b.advance(7.0)  # closed: a no-op


def test_a_failed_probe_reopens_with_a_longer_cooldown_up_to_the_cap() -> None:
    b = open_breaker(BreakerConfig(cooldown_s=5.0, backoff=2.0, max_cooldown_s=30.0))
    now, cooldowns = 0.0, []
    for _ in range(5):
        assert b.reopen_at is not None
        now = b.reopen_at
        probe = b.before_call(now)
        assert isinstance(probe, Allow)
        b.record(now, DOWN, probe)
        assert b.state is OPEN
        assert b.reopen_at is not None
        cooldowns.append(b.reopen_at - now)
    assert cooldowns == [10.0, 20.0, 30.0, 30.0, 30.0]
    assert b.reopen_at is not None
    now = b.reopen_at
    probe = b.before_call(now)
    assert isinstance(probe, Allow)
    b.record(now, OK, probe)
    b.trip(now)
    assert b.reopen_at == now + 5.0  # a success reset the cooldown


def test_a_neutral_probe_or_a_release_frees_the_slot() -> None:
    b = open_breaker()
    probe = b.before_call(5.0)
    assert isinstance(probe, Allow)
    b.record(5.0, MEH, probe)
    assert b.state is HALF_OPEN
    probe = b.before_call(5.0)
    assert isinstance(probe, Allow)
    b.release(5.0, probe)
    assert b.state is HALF_OPEN
    assert isinstance(b.before_call(5.0), Allow)


def test_half_open_allows_exactly_the_configured_probes() -> None:
    b = open_breaker(BreakerConfig(half_open_probes=3))
    permits = [b.before_call(5.0) for _ in range(5)]
    assert permits[:3] == [Allow(probe=True, epoch=1)] * 3
    assert permits[3:] == [Reject(None)] * 2


def test_late_results_while_open_are_ignored() -> None:
    b = CircuitBreaker()
    early = [b.before_call(0.0) for _ in range(20)]
    for p in early[:5]:
        assert isinstance(p, Allow)
        b.record(0.0, DOWN, p)
    assert b.state is OPEN
    for p in early[5:10]:
        assert isinstance(p, Allow)
        b.record(1.0, OK, p)
    for p in early[10:15]:
        assert isinstance(p, Allow)
        b.record(1.0, DOWN, p)
    assert (b.state, b.reopen_at) == (OPEN, 5.0)


def test_late_non_probe_results_in_half_open_do_not_move_it() -> None:
    b = CircuitBreaker()
    late = b.before_call(0.0)
    assert isinstance(late, Allow)
    for _ in range(5):
        call(b, 0.0, DOWN)
    probe = b.before_call(5.0)
    assert isinstance(probe, Allow)
    b.record(6.0, OK, late)
    b.record(6.0, DOWN, late)
    assert b.state is HALF_OPEN
    b.release(6.0, late)
    assert b.before_call(6.0) == Reject(None)  # the probe slot is still the probe's


def test_a_stale_probe_from_an_earlier_round_is_ignored() -> None:
    b = open_breaker(BreakerConfig(half_open_probes=2, cooldown_s=1.0, backoff=1.0))
    first, second = b.before_call(1.0), b.before_call(1.0)
    assert isinstance(first, Allow)
    assert isinstance(second, Allow)
    b.record(1.0, DOWN, first)  # round 1 fails: open until 2.0
    fresh = b.before_call(2.0)
    assert fresh == Allow(probe=True, epoch=2)
    b.record(2.0, OK, second)  # round 1's other probe, late
    assert b.state is HALF_OPEN
    b.record(2.0, OK, fresh)
    assert b.state is CLOSED


def test_trip_never_shortens_an_open_breaker() -> None:
    b = open_breaker()
    b.trip(1.0, until=3.0)
    assert b.reopen_at == 5.0
    b.trip(1.0, until=50.0)
    assert b.reopen_at == 50.0
    b.trip(2.0)
    assert b.reopen_at == 50.0


def test_trip_from_closed_and_half_open() -> None:
    b = CircuitBreaker()
    b.trip(0.0, until=7.0)
    assert (b.state, b.reopen_at) == (OPEN, 7.0)
    probe = b.before_call(7.0)
    assert isinstance(probe, Allow)
    b.trip(7.0)
    assert (b.state, b.reopen_at) == (OPEN, 12.0)
    b.record(8.0, OK, probe)  # the interrupted probe is now late
    assert b.state is OPEN


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("consecutive_failures", 0),
        ("consecutive_failures", 2.5),
        ("consecutive_failures", True),
        ("window_s", 0.0),
        ("window_s", float("nan")),
        ("min_calls", 0),
        ("failure_rate", 0.0),
        ("failure_rate", 1.5),
        ("cooldown_s", -1.0),
        ("cooldown_s", "5"),
        ("max_cooldown_s", 1.0),
        ("backoff", 0.5),
        ("half_open_probes", 0),
        ("max_window_calls", 5),
    ],
)
def test_config_names_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        replace(BreakerConfig(), **{field: value})  # type: ignore[arg-type]


# -- the state machine ---------------------------------------------------------------


class BreakerMachine(RuleBasedStateMachine):
    """Random calls, outcomes, releases, trips and clock jumps; the invariants always hold."""

    def __init__(self) -> None:
        super().__init__()
        self.b = CircuitBreaker()
        self.now = 0.0
        self.permits: list[Allow] = []
        self.epoch = 0
        self.seen: tuple[BreakerState, float | None] = (CLOSED, None)

    @initialize(
        probes=st.integers(1, 3),
        consecutive=st.integers(1, 4),
        backoff=st.sampled_from([1.0, 2.0, 3.0]),
    )
    def configure(self, probes: int, consecutive: int, backoff: float) -> None:
        self.b = CircuitBreaker(
            BreakerConfig(
                consecutive_failures=consecutive,
                window_s=10.0,
                min_calls=4,
                failure_rate=0.5,
                cooldown_s=1.0,
                max_cooldown_s=8.0,
                backoff=backoff,
                half_open_probes=probes,
            )
        )

    @rule(dt=st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0, 12.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def before_call(self) -> None:
        b, now = self.b, self.now
        state, reopen_at = b.state, b.reopen_at
        room = b.capacity(now)
        assert b.state is state  # asking the room has no effect
        decision = b.before_call(now)
        assert isinstance(decision, Allow) == (room is None or room > 0)  # the room is right
        if state is OPEN:
            assert reopen_at is not None
            if now < reopen_at:
                assert decision == Reject(reopen_at)
        if isinstance(decision, Allow):
            self.permits.append(decision)
            self.epoch = max(self.epoch, decision.epoch)

    @precondition(lambda self: self.permits)
    @rule(data=st.data(), signal=st.sampled_from(Signal))
    def record(self, data: st.DataObject, signal: Signal) -> None:
        i = data.draw(st.integers(0, len(self.permits) - 1))
        permit = self.permits.pop(i)
        state = self.b.state
        self.b.record(self.now, signal, permit)
        if signal is MEH:
            assert self.b.state is state

    @precondition(lambda self: self.permits)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        permit = self.permits.pop(data.draw(st.integers(0, len(self.permits) - 1)))
        state = self.b.state
        self.b.release(self.now, permit)
        assert self.b.state is state

    @rule()
    def owner_timer(self) -> None:
        b, now = self.b, self.now
        state, reopen_at = b.state, b.reopen_at
        moved = b.advance(now)
        due = state is OPEN and reopen_at is not None and now >= reopen_at
        assert moved == due
        assert b.state is (HALF_OPEN if moved else state)
        if moved:
            self.epoch += 1  # a new half-open round, with no probe yet

    @rule(offset=st.one_of(st.none(), st.sampled_from([0.0, 0.5, 2.0, 20.0])))
    def trip(self, offset: float | None) -> None:
        self.b.trip(self.now, None if offset is None else self.now + offset)

    @invariant()
    def reopen_at_only_when_open(self) -> None:
        assert (self.b.state is OPEN) == (self.b.reopen_at is not None)

    @invariant()
    def probes_are_bounded_and_exact(self) -> None:
        if self.b.state is HALF_OPEN:
            live = sum(1 for p in self.permits if p.probe and p.epoch == self.epoch)
            assert self.b.config.half_open_probes - (self.b.capacity(self.now) or 0) == live
            assert live <= self.b.config.half_open_probes

    @invariant()
    def reopen_at_never_decreases_while_open(self) -> None:
        state, reopen_at = self.b.state, self.b.reopen_at
        before_state, before_reopen = self.seen
        if state is OPEN and before_state is OPEN:
            assert reopen_at is not None
            assert before_reopen is not None
            assert reopen_at >= before_reopen
        self.seen = (state, reopen_at)


TestBreakerMachine = BreakerMachine.TestCase
TestBreakerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- runs in issue order -------------------------------------------------------------


def issue(b: CircuitBreaker, n: int) -> list[Allow]:
    permits = [b.before_call(0.0) for _ in range(n)]
    assert all(isinstance(p, Allow) for p in permits)
    return permits  # type: ignore[return-value]


@pytest.mark.parametrize(
    "cfg",
    [
        BreakerConfig(consecutive_failures=5, min_calls=1000, max_window_calls=1000),
        BreakerConfig(),  # the default rules: the rate rule too
    ],
    ids=["run rule", "default rules"],
)
def test_fast_failures_arriving_first_neither_make_a_run_nor_fill_the_window(
    cfg: BreakerConfig,
) -> None:
    """A fresh breaker, 200 calls in flight, 10% failing fast: their results arrive
    first (twenty in a row by arrival, the whole window so far) yet no two were
    issued one after the other and the provider is healthy."""
    b = CircuitBreaker(cfg)
    permits = issue(b, 200)
    for p in permits[::10]:
        b.record(0.0, DOWN, p)
    assert b.state is CLOSED
    for i, p in enumerate(permits):
        if i % 10:
            b.record(0.05, OK, p)
    assert b.state is CLOSED


def test_a_run_in_issue_order_trips_whatever_order_its_results_arrive_in() -> None:
    b = CircuitBreaker(BreakerConfig(consecutive_failures=5, min_calls=1000, max_window_calls=1000))
    permits = issue(b, 5)
    for p in reversed(permits[1:]):
        b.record(0.0, DOWN, p)
    assert b.state is CLOSED  # the first of the five is still outstanding
    b.record(0.0, DOWN, permits[0])
    assert b.state is OPEN


def test_an_outstanding_call_holds_a_run_open_until_it_settles() -> None:
    b = CircuitBreaker(BreakerConfig(consecutive_failures=3, min_calls=1000, max_window_calls=1000))
    first, middle, last = issue(b, 3)
    b.record(0.0, DOWN, first)
    b.record(0.0, DOWN, last)
    assert b.state is CLOSED
    b.record(0.0, OK, middle)  # a success in the middle: no run of three
    assert b.state is CLOSED


def test_released_and_neutral_calls_are_passed_over_by_a_run() -> None:
    b = CircuitBreaker(BreakerConfig(consecutive_failures=3, min_calls=1000, max_window_calls=1000))
    a, released, c, neutral, e = issue(b, 5)
    b.release(0.0, released)
    b.record(0.0, MEH, neutral)
    b.record(0.0, DOWN, a)
    b.record(0.0, DOWN, e)
    assert b.state is CLOSED
    b.record(0.0, DOWN, c)
    assert b.state is OPEN


def test_an_outage_that_fails_fast_still_opens_by_rate_with_calls_out() -> None:
    b = CircuitBreaker(BreakerConfig(consecutive_failures=1000, min_calls=10, failure_rate=0.5))
    permits = issue(b, 40)
    for p in permits[10:30]:  # 20 failures back while 20 calls are still out
        b.record(0.0, DOWN, p)
    assert b.state is OPEN


def test_calls_out_before_an_opening_do_not_count_once_it_closes_again() -> None:
    cfg = BreakerConfig(consecutive_failures=1000, min_calls=4, failure_rate=0.5, cooldown_s=1.0)
    b = CircuitBreaker(cfg)
    stale = issue(b, 50)  # still out when the breaker is tripped
    b.trip(0.0)
    probe = b.before_call(1.0)
    assert isinstance(probe, Allow)
    b.record(1.0, OK, probe)
    assert b.state is CLOSED
    for p in stale:  # late answers of calls from before the opening
        b.release(1.0, p)
    for p in issue(b, 4):  # 2 of 4 fail: a rate of 0.5 with nothing out
        b.record(1.0, OK if p.seq % 2 else DOWN, p)  # the last one a failure
    assert b.state is OPEN


def test_late_failures_of_calls_from_before_it_closed_do_not_open_it_again() -> None:
    """Calls out when it opened, failing after a probe closed it, opened it again; so
    did the other probes of the round that closed it (found by a hunt). Their answers
    tell of the outage, not of now."""
    b = CircuitBreaker(BreakerConfig(consecutive_failures=5, cooldown_s=1.0))
    before = issue(b, 20)
    for p in before[:5]:
        b.record(0.0, DOWN, p)
    assert b.state is OPEN
    probe = b.before_call(1.0)
    assert isinstance(probe, Allow)
    b.record(1.0, OK, probe)
    assert b.state is CLOSED
    for p in before[5:]:  # they time out now, long after
        b.record(30.0, DOWN, p)
    assert b.state is CLOSED
    for p in issue(b, 5):  # calls sent since still count
        b.record(31.0, DOWN, p)
    assert b.state is OPEN
    rounds = CircuitBreaker(BreakerConfig(consecutive_failures=2, half_open_probes=3))
    rounds.trip(0.0, until=1.0)
    first, *others = (rounds.before_call(1.0) for _ in range(3))
    assert isinstance(first, Allow)
    rounds.record(1.5, OK, first)
    for p in others:
        assert isinstance(p, Allow)
        rounds.record(1.5, DOWN, p)
    assert rounds.state is CLOSED


@pytest.mark.parametrize("settle", ["neutral", "release"])
def test_a_run_joined_by_a_neutral_call_trips_at_the_next_failure_not_before(settle: str) -> None:
    """A NEUTRAL result (or a release) never changes the state, even when it is the
    last call of a run to settle; the next OUTAGE, next to that run, trips it."""
    b = CircuitBreaker(BreakerConfig(consecutive_failures=4, min_calls=1000, max_window_calls=1000))
    first, middle, third, fourth, fifth = issue(b, 5)
    for p in (first, third, fourth):
        b.record(0.0, DOWN, p)
    if settle == "neutral":
        b.record(0.0, MEH, middle)
    else:
        b.release(0.0, middle)
    assert b.state is CLOSED
    b.record(0.0, DOWN, fifth)
    assert b.state is OPEN


def test_a_successor_takes_over_an_open_breaker_with_its_backed_off_cooldown() -> None:
    cfg = BreakerConfig(consecutive_failures=1, cooldown_s=1.0, backoff=10.0, max_cooldown_s=500.0)
    old = CircuitBreaker(cfg)
    permit = old.before_call(0.0)
    assert isinstance(permit, Allow)
    old.record(0.0, Signal.OUTAGE, permit)  # opens until 1.0
    probe = old.before_call(1.0)
    assert isinstance(probe, Allow)
    old.record(1.0, Signal.OUTAGE, probe)  # the probe failed: open until 1.0 + 10
    new = CircuitBreaker(cfg)
    new.inherit(old, 2.0)
    assert new.state is BreakerState.OPEN
    assert new.reopen_at == old.reopen_at == 11.0
    again = new.before_call(11.0)
    assert isinstance(again, Allow)
    new.record(11.0, Signal.OUTAGE, again)
    assert new.reopen_at == 11.0 + 100.0  # backed off from 10 s, not from 1 s again


def test_a_successor_of_a_closed_breaker_starts_closed_and_of_half_open_probes_at_once() -> None:
    cfg = BreakerConfig(consecutive_failures=1, cooldown_s=1.0)
    closed = CircuitBreaker(cfg)
    new = CircuitBreaker(cfg)
    new.inherit(closed, 0.0)
    assert new.state is BreakerState.CLOSED
    half = CircuitBreaker(cfg)
    permit = half.before_call(0.0)
    assert isinstance(permit, Allow)
    half.record(0.0, Signal.OUTAGE, permit)
    assert isinstance(half.before_call(1.0), Allow)  # half-open, its probe out
    successor = CircuitBreaker(cfg)
    successor.inherit(half, 1.5)
    assert isinstance(successor.before_call(1.5), Allow)  # the dead probe holds no slot


# -- a refusal for good, and how long it has been down ----------------------------------


def test_a_fatal_result_opens_a_closed_breaker_at_once_and_down_since_spans_half_open() -> None:
    breaker = CircuitBreaker(BreakerConfig(consecutive_failures=5, cooldown_s=1.0, give_up_s=30))
    assert breaker.down_since is None
    assert breaker.given_up_at() is None
    breaker.record(3.0, Signal.FATAL, breaker.before_call(3.0))  # type: ignore[arg-type]
    assert breaker.state is OPEN
    assert breaker.down_since == 3.0
    assert breaker.given_up_at() == 33.0
    breaker.advance(4.0)
    probe = breaker.before_call(4.0)
    breaker.record(4.0, Signal.FATAL, probe)  # type: ignore[arg-type]
    assert breaker.state is OPEN
    assert breaker.down_since == 3.0, "still down since it first opened"
    breaker.advance(6.0)
    breaker.record(6.0, Signal.SUCCESS, breaker.before_call(6.0))  # type: ignore[arg-type]
    assert breaker.state is CLOSED
    assert breaker.down_since is None


def test_a_breaker_that_gives_up_never_or_by_default_has_no_give_up_time() -> None:
    for never in (None, float("inf")):
        breaker = CircuitBreaker(BreakerConfig(consecutive_failures=1, give_up_s=never))
        breaker.record(0.0, Signal.OUTAGE, breaker.before_call(0.0))  # type: ignore[arg-type]
        assert breaker.state is OPEN
        assert breaker.given_up_at() is None


def test_a_restarted_breaker_keeps_how_long_the_model_has_been_down() -> None:
    old = CircuitBreaker(BreakerConfig(consecutive_failures=1))
    old.record(2.0, Signal.OUTAGE, old.before_call(2.0))  # type: ignore[arg-type]
    new = CircuitBreaker(BreakerConfig(consecutive_failures=1))
    new.inherit(old, 7.0)
    assert new.down_since == 2.0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "60", True])
def test_give_up_s_must_be_none_or_a_positive_number(bad: object) -> None:
    with pytest.raises(ValueError, match="give_up_s"):
        BreakerConfig(give_up_s=bad)  # type: ignore[arg-type]
