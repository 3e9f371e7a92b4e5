"""The permits a process holds of its models' leases (cluster/_lease.py): a task takes one
that fits it from the first of its candidates holding one, each taken or missed permit
asks for one more (one ask a model at a time, at most ``WANT_MOST`` held), permits go
back unused after ``PERMIT_S``, and every permit received is taken once or given back."""

from __future__ import annotations

from collections import Counter

from callboard.cluster._lease import PERMIT_S, REFUSED_REST_S, WANT_MOST, Ask, Stocks, Void
from callboard.cluster._wire import Lease
from hypothesis import given, settings
from hypothesis import strategies as st


def _lease(model: str, *permits: int, incarnation: int = 1, tokens: int = 100) -> Lease:
    return Lease(model=model, incarnation=incarnation, permits=permits, tokens=tokens)


def test_a_task_takes_a_fitting_permit_of_its_first_candidate_that_has_one() -> None:
    stocks = Stocks()
    stocks.got("b", _lease("b", 7, tokens=50), now=0.0)
    assert stocks.take(["a", "b"], 40, now=0.1) == ("b", 1, 7)
    assert stocks.take(["a", "b"], 40, now=0.1) is None  # b's only permit is taken
    stocks.got("b", _lease("b", 8, tokens=50), now=0.2)
    assert stocks.take(["b"], 51, now=0.2) is None  # larger than a permit reserves
    assert stocks.take(["b"], 50, now=0.2) == ("b", 1, 8)


def test_every_permit_taken_or_missed_asks_for_one_more_one_ask_at_a_time() -> None:
    stocks = Stocks()
    assert stocks.take(["a", "b"], 30, now=0.0) is None
    assert stocks.take(["a"], 80, now=0.0) is None
    assert stocks.asks(0.0) == [Ask("a", 2, 80)]  # the first candidate, for the largest
    assert stocks.take(["a"], 10, now=0.0) is None
    assert stocks.asks(0.0) == []  # one ask a model in flight
    stocks.got("a", _lease("a", 1, 2, tokens=80), now=0.01)
    assert stocks.asks(0.01) == [Ask("a", 1, 80)]  # the task that missed meanwhile
    stocks.got("a", None, now=0.02)
    assert stocks.take(["a"], 10, now=0.02) == ("a", 1, 1)  # the oldest first
    assert stocks.asks(0.02) == []  # refused just now: the queue takes the tasks a while
    assert stocks.asks(0.02 + REFUSED_REST_S) == [Ask("a", 1, 80)]


def test_a_process_never_asks_to_hold_more_than_want_most() -> None:
    stocks = Stocks()
    for _ in range(3 * WANT_MOST):
        stocks.take(["a"], 10, now=0.0)
    assert stocks.asks(0.0) == [Ask("a", WANT_MOST, 10)]
    stocks.got("a", _lease("a", *range(WANT_MOST), tokens=10), now=0.0)
    stocks.take(["a"], 10, now=0.0)
    assert stocks.asks(0.0) == [Ask("a", 1, 10)]  # back up to WANT_MOST held


def test_permits_not_used_in_their_time_go_back_to_the_incarnation_that_lent_them() -> None:
    stocks = Stocks()
    stocks.got("a", _lease("a", 1, 2, incarnation=5), now=10.0)
    assert stocks.due("a", 10.0 + PERMIT_S / 2) is None
    assert stocks.due("a", 10.0 + PERMIT_S) == Void("a", 5, (1, 2))
    assert stocks.take(["a"], 10, now=10.0 + PERMIT_S) is None
    assert stocks.held() == 0


def test_under_steady_traffic_each_permit_goes_back_at_its_own_time() -> None:
    # one time for a model's whole stock, renewed by each lease, kept the oldest permit
    # unused for as long as tasks came (found by a review)
    stocks, half = Stocks(), PERMIT_S / 2
    stocks.got("a", _lease("a", 1), now=0.0)
    stocks.got("a", _lease("a", 2), now=half)
    assert stocks.due("a", PERMIT_S) == Void("a", 1, (1,))  # its time, whatever came since
    assert stocks.take(["a"], 10, now=PERMIT_S) == ("a", 1, 2)
    stocks.got("a", _lease("a", 3, 4), now=PERMIT_S)
    assert stocks.take(["a"], 10, now=PERMIT_S + half) == ("a", 1, 3)
    assert stocks.due("a", 2 * PERMIT_S) == Void("a", 1, (4,))


def test_a_lease_of_a_new_incarnation_voids_the_permits_of_the_old_one() -> None:
    stocks = Stocks()
    stocks.got("a", _lease("a", 1, 2, incarnation=5), now=0.0)
    assert stocks.got("a", _lease("a", 1, incarnation=6), now=0.1) == Void("a", 5, (1, 2))
    assert stocks.take(["a"], 10, now=0.1) == ("a", 6, 1)
    stocks.got("a", _lease("a", 3, incarnation=6), now=0.2)
    assert stocks.drop("a") == Void("a", 6, (3,))
    assert stocks.drop("a") is None


_steps = st.lists(
    st.one_of(
        st.tuples(st.just("got"), st.integers(1, 3), st.integers(0, 3), st.booleans()),
        st.tuples(st.just("take"), st.integers(1, 150)),
        st.tuples(st.just("due"), st.floats(0, 2 * PERMIT_S)),
        st.tuples(st.just("drop")),
    ),
    max_size=60,
)


@given(_steps)
@settings(max_examples=200, deadline=None)
def test_every_permit_received_is_taken_once_or_given_back_once(steps: list[tuple]) -> None:  # type: ignore[type-arg]
    stocks = Stocks()
    now, next_permit = 0.0, 1
    received: Counter[tuple[int, int]] = Counter()
    ended: Counter[tuple[int, int]] = Counter()
    for step in steps:
        if step[0] == "got":
            _, incarnation, n, big = step
            permits = tuple(range(next_permit, next_permit + n))
            next_permit += n
            received.update((incarnation, p) for p in permits)
            lease = _lease("m", *permits, incarnation=incarnation, tokens=100 if big else 50)
            void = stocks.got("m", lease if n else None, now)
            if void is not None:
                ended.update((void.incarnation, p) for p in void.permits)
        elif step[0] == "take":
            taken = stocks.take(["m"], step[1], now)
            if taken is not None:
                ended[(taken[1], taken[2])] += 1
        elif step[0] == "due":
            now += step[1]
            void = stocks.due("m", now)
            if void is not None:
                ended.update((void.incarnation, p) for p in void.permits)
        else:
            void = stocks.drop("m")
            if void is not None:
                ended.update((void.incarnation, p) for p in void.permits)
    for void in stocks.drop_all():
        ended.update((void.incarnation, p) for p in void.permits)
    assert ended == received  # each once: none lost, none twice
