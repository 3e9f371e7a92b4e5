"""The room for request bodies on a real event loop: bounded, and every hold given back
exactly once, whoever ends last."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from callboard.gateway.room import Hold, Room
from hypothesis import given, settings
from hypothesis import strategies as st
from support import WAIT_S

_T = TypeVar("_T")


def run(scenario: Callable[[], Awaitable[_T]]) -> _T:
    return asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


async def turn() -> None:
    """One turn of the loop: a hold let go is given back in the next."""
    await asyncio.sleep(0)


def test_a_body_takes_room_while_there_is_some_and_gives_it_back_when_done() -> None:
    async def scenario() -> None:
        room = Room(100)
        first = room.take(60)
        assert first is not None
        assert room.take(50) is None  # 110 > 100: refused, nothing taken
        second = room.take(40)
        assert second is not None
        assert (room.held, room.most, room.refused) == (100, 100, 1)
        first.done()
        first.done()  # the handler ends once
        await turn()
        assert room.held == 40
        second.done()
        await turn()
        assert room.held == 0

    run(scenario)


def test_a_hold_lasts_until_the_handler_and_everything_it_was_kept_for_end() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        room = Room(100)
        hold = room.take(50)
        assert hold is not None
        task: asyncio.Future[Any] = loop.create_future()
        reader: asyncio.Future[Any] = loop.create_future()
        hold.keep_until(task)
        hold.keep_until(reader)
        hold.done()
        reader.set_result(None)
        await turn()
        await turn()
        assert room.held == 50  # the task still holds the request
        task.cancel()
        await turn()
        await turn()
        assert room.held == 0
        hold.keep_until(loop.create_future())  # once given back, nothing holds it again
        assert room.held == 0

    run(scenario)


def test_a_hold_handed_on_by_a_later_callback_of_the_same_future_is_kept() -> None:
    """The reader's work, done, runs its callbacks in the order they were added: the
    hold's own (the handler left meanwhile: the last holder lets go), then the one that
    follows the task the work made, which keeps the hold for that task. The room must
    still be held then (it was given back, and the task's body held no room)."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        room = Room(100)
        hold = room.take(50)
        assert hold is not None
        work: asyncio.Future[Any] = loop.create_future()
        task: asyncio.Future[Any] = loop.create_future()
        hold.keep_until(work)
        work.add_done_callback(lambda _: hold.keep_until(task))
        hold.done()  # the client left
        work.set_result(None)
        for _ in range(3):
            await turn()
        assert room.held == 50
        task.set_result(None)
        for _ in range(3):
            await turn()
        assert room.held == 0

    run(scenario)


def test_a_body_on_its_way_grows_its_room_until_the_room_has_none_left() -> None:
    """A body is counted as it comes (it was counted only once whole, and eight stalled
    bodies held 250 MB the room never saw: found by a hunt): its hold grows by each
    piece, a piece the room cannot take is refused and nothing taken, and the hold
    gives back all it grew to, once."""

    async def scenario() -> None:
        room = Room(100)
        other = room.take(30)
        coming = room.take(0)
        assert other is not None
        assert coming is not None
        assert coming.grow(40)
        assert coming.grow(25)
        assert (room.held, coming.size) == (95, 65)
        assert not coming.grow(6)  # 101 > 100: refused, nothing taken
        assert (room.held, room.most, room.refused, coming.size) == (95, 95, 1, 65)
        coming.done()
        await turn()
        assert room.held == 30
        with pytest.raises(RuntimeError, match="given back"):
            coming.grow(1)
        other.done()
        await turn()
        assert room.held == 0

    run(scenario)


def test_a_declared_length_is_turned_away_without_taking_anything() -> None:
    room = Room(100)
    hold = room.take(60)
    assert hold is not None
    assert room.turns_away(41)
    assert not room.turns_away(40)  # it fits: nothing is taken for it either
    assert (room.held, room.refused) == (60, 1)


def test_a_negative_size_is_a_bug_of_the_caller() -> None:
    with pytest.raises(ValueError, match="negative"):
        Room(100).take(-1)
    hold = Room(100).take(0)
    assert hold is not None
    with pytest.raises(ValueError, match="negative"):
        hold.grow(-1)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 100), min_size=1, max_size=12),
    order=st.randoms(use_true_random=False),
)
def test_the_room_is_never_overdrawn_and_always_comes_back(sizes: list[int], order: Any) -> None:
    """Bodies of any sizes, taken at once or grown as they come, their handlers and
    tasks ending in any order: held never passes the capacity, and is 0 once every
    request has ended."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        room = Room(100)
        holds: list[tuple[Hold, asyncio.Future[Any]]] = []
        for size in sizes:
            hold = room.take(size // 2)  # half as the body's head, half as it comes
            assert room.held <= room.capacity
            if hold is not None and not hold.grow(size - size // 2):
                hold.done()  # refused as it came: its handler ends
                hold = None
            assert room.held <= room.capacity
            if hold is not None:
                task: asyncio.Future[Any] = loop.create_future()
                hold.keep_until(task)
                holds.append((hold, task))
        ends = [h.done for h, _ in holds] + [(lambda t=t: t.set_result(None)) for _, t in holds]
        order.shuffle(ends)
        for end in ends:
            end()
            await turn()
            assert 0 <= room.held <= room.capacity
        await turn()
        assert room.held == 0
        assert room.most <= room.capacity

    run(scenario)
