"""A streamed call's deltas on a model actor (cluster/_spool.py): bounded, handed over in
batches that wake the owner's poll once, numbered (so a batch lost on its way shows),
held while the owner is paused (but for a call that ended), and a reader who left ends
the call where it waits. Real asyncio, no Ray."""

from __future__ import annotations

import asyncio

import pytest
from callboard.cluster._spool import DeltaSpool
from callboard.messages import StreamDelta
from callboard.runtime.stream import Abandoned

WAIT_S = 5.0


def _spool(wakes: list[int], limit: int = 3) -> DeltaSpool:
    return DeltaSpool(task_id=7, attempt=0, call=1, wake=lambda: wakes.append(1), limit=limit)


def _texts(deltas: tuple[StreamDelta, ...]) -> list[str]:
    return [d.text for d in deltas]


def test_a_full_spool_makes_the_call_wait_until_the_owner_takes() -> None:
    async def run() -> None:
        wakes: list[int] = []
        spool = _spool(wakes)
        for text in "abc":
            await spool.put(StreamDelta(text=text))
        assert wakes == [1]  # one wake for the batch, not one per delta
        fourth = asyncio.ensure_future(spool.put(StreamDelta(text="d")))
        await asyncio.sleep(0)  # let it run up to its wait
        assert not fourth.done()  # the call stops reading: no fourth delta held
        assert _texts(spool.take()) == ["a", "b", "c"]
        await asyncio.wait_for(fourth, WAIT_S)
        assert wakes == [1, 1]  # the spool was empty again: the next poll is woken
        assert _texts(spool.take()) == ["d"]
        assert spool.received

    asyncio.run(run())


def test_deltas_are_numbered_as_put_and_as_handed_over() -> None:
    async def run() -> None:
        spool = _spool([], limit=10)
        for text in "ab":
            await spool.put(StreamDelta(text=text))
        assert (spool.count, spool.handed) == (2, 0)  # the next batch starts at 0
        assert _texts(spool.take()) == ["a", "b"]
        await spool.put(StreamDelta(text="c"))
        spool.pause(True, 1)
        assert (spool.take(), spool.handed) == ((), 2)  # nothing taken while paused
        assert (spool.count, spool.handed, spool.waiting) == (3, 2, 1)  # next batch at 2
        spool.close()
        assert _texts(spool.take()) == ["c"]
        assert (spool.count, spool.handed, spool.waiting) == (3, 3, 0)

    asyncio.run(run())


def test_a_paused_owner_gets_nothing_until_it_goes_on_or_the_call_ends() -> None:
    async def run() -> None:
        wakes: list[int] = []
        spool = _spool(wakes)
        spool.pause(True, 1)
        await spool.put(StreamDelta(text="a"))
        assert (wakes, spool.due, spool.take()) == ([], False, ())
        spool.pause(False, 2)  # caught up: the poll is woken for what waits
        assert (wakes, spool.due) == ([1], True)
        spool.pause(True, 3)
        spool.close()  # the call ended: its last deltas go before its answer
        assert _texts(spool.take()) == ["a"]

    asyncio.run(run())


def test_a_go_on_that_overtook_its_pause_is_not_undone_by_it() -> None:
    """Ray runs an async actor's calls in no set order: a go-on (ask 2) that arrived
    before its pause (ask 1) was undone by it, and the stream hung for good."""

    async def run() -> None:
        wakes: list[int] = []
        spool = _spool(wakes)
        await spool.put(StreamDelta(text="a"))
        spool.pause(False, 2)
        spool.pause(True, 1)  # the older ask, late
        assert (spool.paused, spool.due, _texts(spool.take())) == (False, True, ["a"])

    asyncio.run(run())


def test_a_reader_who_left_ends_the_call_where_it_waits() -> None:
    """What waits is dropped, never sent: the call's count (its answer's) leaves it out."""

    async def run() -> None:
        spool = _spool([], limit=1)
        await spool.put(StreamDelta(text="0"))
        assert _texts(spool.take()) == ["0"]
        await spool.put(StreamDelta(text="a"))
        waiting = asyncio.ensure_future(spool.put(StreamDelta(text="b")))
        stuck = asyncio.ensure_future(asyncio.sleep(60))  # the call, waiting on its socket
        spool.attach(stuck)
        await asyncio.sleep(0)
        spool.abandon()
        with pytest.raises(Abandoned):
            await asyncio.wait_for(waiting, WAIT_S)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(stuck, WAIT_S)
        assert spool.take() == ()
        with pytest.raises(Abandoned):
            await spool.put(StreamDelta(text="c"))
        assert (spool.count, spool.handed) == (1, 1)

    asyncio.run(run())
