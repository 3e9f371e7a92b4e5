"""Alarm: an actor's timers for one purpose never multiply (issue 14: a dead provider's
model actor set one more timer at every wake-up, without bound)."""

from __future__ import annotations

from callboard.core.alarm import Alarm
from hypothesis import given
from hypothesis import strategies as st


def test_a_timer_is_set_only_when_it_rings_sooner_than_every_one_pending() -> None:
    alarm = Alarm()
    assert alarm.wants(10.0)
    assert not alarm.wants(10.0)  # the same time again: already set
    assert not alarm.wants(12.0)  # the one at 10 wakes the actor first
    assert alarm.wants(5.0)
    assert alarm.pending == 2


def test_a_ring_is_forgotten_and_an_unknown_ring_is_not_ours() -> None:
    alarm = Alarm()
    alarm.wants(10.0)
    alarm.wants(5.0)
    assert alarm.rang(5.0)
    assert not alarm.rang(5.0)  # rang once
    assert not alarm.rang(7.0)  # set by an incarnation before: not ours
    assert not alarm.wants(10.0)  # still pending
    assert alarm.rang(10.0)
    assert alarm.pending == 0
    assert alarm.wants(10.0)


def test_waking_up_again_and_again_for_the_same_times_sets_each_once() -> None:
    # The pattern of issue 14: a far timer (a breaker's reopen time) and a near one (a
    # health report owed) wanted at every wake-up, each wake-up a ring.
    alarm = Alarm()
    now, reopen_at, set_count = 0.0, 120.0, 0
    for _ in range(1000):
        for at in (reopen_at, now + 1.0):
            set_count += alarm.wants(at)
        now += 1.0
        alarm.rang(now)
    assert alarm.pending <= 2
    assert set_count <= 1000 + 2  # one near timer per ring, the far one once


@given(st.lists(st.tuples(st.booleans(), st.floats(0.0, 100.0)), max_size=200))
def test_no_two_pending_timers_share_a_time(steps: list[tuple[bool, float]]) -> None:
    alarm = Alarm()
    pending: list[float] = []
    for ring, at in steps:
        if ring and pending:
            first = min(pending)
            pending.remove(first)
            assert alarm.rang(first)
        elif alarm.wants(at):
            assert all(at < p for p in pending)
            pending.append(at)
    assert alarm.pending == len(pending) == len(set(pending))
