"""The room for request bodies on a real event loop: bounded, first come first served,
every hold given back exactly once, whoever leaves."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from callboard.gateway.room import Hold, NoRoom, Room
from hypothesis import given, settings
from hypothesis import strategies as st
from support import WAIT_S

_T = TypeVar("_T")


def run(scenario: Callable[[], Awaitable[_T]]) -> _T:
    return asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


async def waiting(room: Room, count: int) -> None:
    """Until ``count`` requests wait (each ``take`` queues in one turn of the loop)."""
    while room.waiting < count:
        await asyncio.sleep(0)


def test_a_body_that_fits_takes_its_room_at_once_and_gives_it_back_when_done() -> None:
    async def scenario() -> None:
        room = Room(100)
        hold = await room.take(60, within_s=1)
        assert (room.held, room.waiting) == (60, 0)
        hold.done()
        hold.done()  # once only
        assert room.held == 0

    run(scenario)


def test_waiters_are_let_in_first_come_first_served() -> None:
    """A body that would fit does not pass a larger one that came before it (which
    would then wait as long as smaller ones keep coming)."""

    async def scenario() -> list[int]:
        room = Room(100)
        first = await room.take(80, within_s=1)
        order: list[int] = []

        async def take(size: int) -> Hold:
            hold = await room.take(size, within_s=WAIT_S)
            order.append(size)
            return hold

        big = asyncio.ensure_future(take(50))
        await waiting(room, 1)
        small = asyncio.ensure_future(take(20))  # fits now, but 50 came first
        await waiting(room, 2)
        assert room.held == 80
        first.done()
        for hold in await asyncio.gather(big, small):
            hold.done()
        assert room.held == 0
        return order

    assert run(scenario) == [50, 20]


def test_a_small_body_that_fits_goes_in_while_a_large_one_waits() -> None:
    async def scenario() -> None:
        room = Room(100, small=10)
        first = await room.take(80, within_s=1)
        big = asyncio.ensure_future(room.take(50, within_s=WAIT_S))
        await waiting(room, 1)
        chat = await room.take(5, within_s=0.01)  # no wait
        assert (room.held, room.waiting) == (85, 1)
        chat.done()
        first.done()
        (await big).done()
        assert room.held == 0

    run(scenario)


def test_no_room_within_the_deadline_is_no_room_and_the_next_waiter_goes_in() -> None:
    """A waiter at the front that gives up lets in the smaller ones behind it."""

    async def scenario() -> None:
        room = Room(100)
        first = await room.take(70, within_s=1)
        big = asyncio.ensure_future(room.take(60, within_s=0.05))
        await waiting(room, 1)
        behind = asyncio.ensure_future(room.take(30, within_s=WAIT_S))
        await waiting(room, 2)
        with pytest.raises(NoRoom) as refused:
            await big
        assert refused.value.size == 60
        hold = await behind
        assert (room.held, room.waiting, room.refused, room.waited) == (100, 0, 1, 2)
        hold.done()
        first.done()
        assert room.held == 0

    run(scenario)


def test_a_waiter_that_leaves_takes_nothing() -> None:
    async def scenario() -> None:
        room = Room(100)
        first = await room.take(100, within_s=1)
        leaving = asyncio.ensure_future(room.take(10, within_s=WAIT_S))
        await waiting(room, 1)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert room.waiting == 0
        first.done()
        assert room.held == 0

    run(scenario)


def test_a_waiter_granted_as_it_leaves_gives_its_room_back() -> None:
    """Room given in the same turn of the loop as the waiter is cancelled: the
    cancelled ``take`` returns no hold, so the room comes back at once."""

    async def scenario() -> None:
        room = Room(100)
        first = await room.take(100, within_s=1)
        leaving = asyncio.ensure_future(room.take(40, within_s=WAIT_S))
        await waiting(room, 1)
        first.done()  # grants the waiter ...
        leaving.cancel()  # ... which leaves before it runs again
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert (room.held, room.waiting) == (0, 0)

    run(scenario)


def test_a_hold_lasts_until_the_handler_and_everything_it_was_kept_for_end() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        room = Room(100)
        hold = await room.take(50, within_s=1)
        task: asyncio.Future[Any] = loop.create_future()
        reader: asyncio.Future[Any] = loop.create_future()
        hold.keep_until(task)
        hold.keep_until(reader)
        hold.done()
        assert room.held == 50
        reader.set_result(None)
        await asyncio.sleep(0)  # done callbacks run in the next turn
        assert room.held == 50
        task.cancel()
        await asyncio.sleep(0)
        assert room.held == 0
        hold.keep_until(loop.create_future())  # once given back, nothing holds it again
        assert room.held == 0

    run(scenario)


def test_a_chunked_body_gives_back_what_it_did_not_use() -> None:
    async def scenario() -> None:
        room = Room(100)
        hold = await room.take(100, within_s=1)  # a chunked body: room for the largest
        waiter = asyncio.ensure_future(room.take(30, within_s=WAIT_S))
        await waiting(room, 1)
        hold.shrink(20)  # it came with 20 bytes
        other = await waiter
        assert room.held == 50
        hold.shrink(40)  # never grows
        hold.done()
        other.done()
        assert room.held == 0

    run(scenario)


def test_a_body_larger_than_the_room_is_a_bug_of_the_caller() -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="can never fit"):
            await Room(100).take(101, within_s=1)

    run(scenario)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 100), min_size=1, max_size=12),
    patience=st.lists(st.sampled_from([0.0, 0.002, 1.0]), min_size=12, max_size=12),
    order=st.randoms(use_true_random=False),
)
def test_the_room_is_never_overdrawn_and_always_comes_back(
    sizes: list[int], patience: list[float], order: Any
) -> None:
    """Requests of any sizes and deadlines, their handlers ending in any order: held
    never passes the capacity, and is 0 once every request has ended."""

    async def scenario() -> None:
        room = Room(100, small=10)
        peak = 0

        async def request(size: int, within_s: float) -> None:
            nonlocal peak
            try:
                hold = await room.take(size, within_s=within_s)
            except NoRoom:
                return
            peak = max(peak, room.held)
            await asyncio.sleep(order.random() / 1000)
            hold.done()

        await asyncio.gather(*(request(s, p) for s, p in zip(sizes, patience, strict=False)))
        assert peak <= room.capacity
        assert room.most <= room.capacity
        assert (room.held, room.waiting) == (0, 0)

    run(scenario)
