"""A streamed task's deltas from the cluster into its reader's channel (cluster/_feed.py):
in order, each once; the model actor asked to pause the call while the reader is behind
and to go on once it caught up; the task's end delivered after its last delta; a reader
who left drops what waits. A real ``StreamChannel`` on a real loop, no Ray."""

from __future__ import annotations

import asyncio

from callboard.cluster._feed import StreamFeed
from callboard.messages import StreamDelta
from callboard.runtime.stream import END, StreamChannel

WAIT_S = 5.0


def _deltas(texts: str) -> list[StreamDelta]:
    return [StreamDelta(text=t) for t in texts]


def test_a_slow_reader_pauses_the_call_and_gets_every_delta_before_the_end() -> None:
    async def run() -> None:
        channel = StreamChannel(limit=2)
        paused: list[tuple[bool, int]] = []
        ended = asyncio.Event()
        feed = StreamFeed(channel, lambda *ask: paused.append(ask), limit=3)
        feed.push(_deltas("abcd"))  # 2 fit the channel, 2 wait here
        feed.push(_deltas("ef"))  # 4 wait here: the call is paused
        feed.end(ended.set)
        read: list[str] = []
        while (delta := await asyncio.wait_for(channel.aget(), WAIT_S)) is not END:
            assert delta is not None
            read.append(delta.text)
            if len(read) == 6:
                await asyncio.wait_for(ended.wait(), WAIT_S)  # after the last, not before
                channel.close()  # as the task's future does
        assert read == list("abcdef")
        assert paused == [(True, 1), (False, 2)]  # once each way, numbered

    asyncio.run(run())


def test_a_reader_who_left_gets_nothing_more_and_the_end_still_comes() -> None:
    async def run() -> None:
        channel = StreamChannel(limit=1)
        paused: list[tuple[bool, int]] = []
        ended = asyncio.Event()
        feed = StreamFeed(channel, lambda *ask: paused.append(ask), limit=10)
        feed.push(_deltas("abc"))
        channel.abandon()
        feed.push(_deltas("d"))
        feed.end(ended.set)
        await asyncio.wait_for(ended.wait(), WAIT_S)
        assert paused == []

    asyncio.run(run())


def test_a_cut_ends_at_once_and_says_how_many_deltas_its_reader_gets() -> None:
    async def run() -> None:
        channel = StreamChannel(limit=2)
        paused: list[tuple[bool, int]] = []
        put: list[int] = []
        feed = StreamFeed(channel, lambda *ask: paused.append(ask), limit=10)
        feed.push(_deltas("abcde"))  # 2 fit the channel, 3 wait here for the reader
        await asyncio.sleep(0)  # the drain runs up to its wait for room
        feed.cut(put.append)
        assert put == [2]  # at once, not waiting for the reader
        channel.close()  # as the task's end does
        read: list[str] = []
        while (delta := await asyncio.wait_for(channel.aget(), WAIT_S)) is not END:
            assert delta is not None
            read.append(delta.text)
        assert read == list("ab")  # what the cut said, and nothing after it
        feed.end(put.append)  # nothing more runs: the cut was the end
        feed.push(_deltas("f"))
        await asyncio.sleep(0)
        assert put == [2]

    asyncio.run(run())
