"""The channel between a streamed call and its reader (runtime/stream.py).

The producer side runs on a real I/O loop (``IoLoop``), the reader on the test's
thread or on an asyncio loop of its own, as in use. A waiting ``put`` is shown
waiting by the loop's own order: once a later coroutine on the same loop has run,
the put has had its turn and is parked, not merely late. The bound is shown under
a real HTTP stream: a ``ModelClient`` reading a loopback server that writes far
more than the channel holds, while nobody reads.
"""

from __future__ import annotations

import asyncio
import json
import queue
from collections.abc import Coroutine, Iterator
from typing import Any, Literal, TypeVar

import pytest
from callboard.messages import CallResult, CallsDone, CallShape, StreamDelta
from callboard.runtime.http import ModelClient
from callboard.runtime.io_loop import IoLoop
from callboard.runtime.stream import END, LIMIT, Abandoned, StreamChannel
from loopback import Flood, WireServer
from support import WAIT_S, wait_until

from callboard import ModelSettings

T = TypeVar("T")


def delta(n: int) -> StreamDelta:
    return StreamDelta(text=str(n))


class Producer:
    """The I/O loop's side: coroutines started as tasks on a real ``IoLoop``."""

    def __init__(self) -> None:
        self.io = IoLoop(name="test-io")
        self.io.start()

    def start(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        async def spawn() -> asyncio.Task[T]:
            return asyncio.get_running_loop().create_task(coro)

        return self.io.run(spawn())

    def settle(self) -> None:
        """Return once every task started so far has had its turn on the loop."""
        self.io.run(asyncio.sleep(0))

    def done(self, task: asyncio.Task[Any]) -> bool:
        async def ask() -> bool:
            return task.done()

        return self.io.run(ask())

    def outcome(self, task: asyncio.Task[T]) -> T:
        """What ``task`` ends with (its exception raised here), waiting up to WAIT_S."""

        async def wait() -> T:
            return await asyncio.wait_for(asyncio.shield(task), WAIT_S)

        return self.io.run(wait(), timeout=WAIT_S * 2)

    def cancelled(self, task: asyncio.Task[Any]) -> bool:
        """Whether ``task`` ends cancelled (waiting up to WAIT_S for it to end)."""

        async def wait() -> bool:
            await asyncio.wait([task], timeout=WAIT_S)
            return task.cancelled()

        return self.io.run(wait(), timeout=WAIT_S * 2)


@pytest.fixture
def producer() -> Iterator[Producer]:
    p = Producer()
    yield p
    p.io.stop()


def test_a_put_waits_while_the_channel_is_full_and_is_let_in_at_a_quarter(
    producer: Producer,
) -> None:
    """A full channel's put waits until the reader has taken it down to a quarter of
    its limit: one wake-up for three quarters of a channel, not one per delta taken
    (a thread hand-off each)."""
    channel = StreamChannel(limit=8)
    for n in range(1, 9):
        producer.outcome(producer.start(channel.put(delta(n))))
    ninth = producer.start(channel.put(delta(9)))
    producer.settle()
    assert not producer.done(ninth), "a ninth delta waits for room"
    assert channel.received
    assert [channel.get(WAIT_S) for _ in range(5)] == [delta(n) for n in range(1, 6)]
    producer.settle()
    assert not producer.done(ninth), "three wait: more than a quarter of eight"
    assert channel.get(WAIT_S) == delta(6)
    producer.outcome(ninth)  # let in by the take that left two
    assert [channel.get(WAIT_S) for _ in range(3)] == [delta(7), delta(8), delta(9)]


def test_close_lets_the_reader_take_what_is_left_then_end(producer: Producer) -> None:
    channel = StreamChannel(limit=4)
    with pytest.raises(TimeoutError, match="no delta arrived"):
        channel.get(timeout=0.0)
    producer.outcome(producer.start(channel.put(delta(1))))
    channel.close()
    assert channel.get(WAIT_S) == delta(1)
    assert channel.get(WAIT_S) is END
    assert channel.get(WAIT_S) is END  # and stays ended


def test_abandon_drops_what_waits_and_a_waiting_put_raises_abandoned(producer: Producer) -> None:
    channel = StreamChannel(limit=1)
    producer.outcome(producer.start(channel.put(delta(1))))
    waiting = producer.start(channel.put(delta(2)))
    producer.settle()
    assert not producer.done(waiting)
    channel.abandon()
    with pytest.raises(Abandoned):
        producer.outcome(waiting)
    with pytest.raises(Abandoned):  # and every put after
        producer.outcome(producer.start(channel.put(delta(3))))
    channel.close()
    assert channel.get(WAIT_S) is END, "what waited unread was dropped"


def test_cut_refuses_the_calls_next_delta_keeps_those_taken_and_says_their_text(
    producer: Producer,
) -> None:
    """A model actor's successor cuts a begun stream off the dead incarnation's call:
    the reader keeps what came, the call can add nothing after the text the task ends
    with (``partial_text``)."""
    channel = StreamChannel(limit=1)
    producer.outcome(producer.start(channel.put(delta(1))))
    waiting = producer.start(channel.put(delta(2)))  # the channel is full: it waits
    producer.settle()
    assert channel.cut() == "1"
    assert channel.get(WAIT_S) == delta(1)  # room: the waiting put offers again, refused
    with pytest.raises(Abandoned):
        producer.outcome(waiting)
    with pytest.raises(Abandoned):
        producer.outcome(producer.start(channel.put(delta(3))))
    channel.close()
    assert channel.get(WAIT_S) is END


def test_cut_says_choice_zeros_text_of_an_n_stream(producer: Producer) -> None:
    """``Result.text`` is choice 0's: a cut n=2 stream's partial text was both choices'
    text in the order it came, nobody's answer (a review)."""
    channel = StreamChannel(limit=8)
    for choice, text in ((0, "A1 "), (1, "B1 "), (0, "A2 "), (1, "B2 ")):
        producer.outcome(producer.start(channel.put(StreamDelta(text=text, choice=choice))))
    assert channel.cut() == "A1 A2 "


@pytest.mark.parametrize("abandon_first", [False, True])
def test_abandon_cancels_the_attached_call_whichever_comes_first(
    producer: Producer, abandon_first: bool
) -> None:
    """A call waiting on its socket (no put to notice the reader left) is cancelled."""
    channel = StreamChannel()
    never = asyncio.Event()

    async def call() -> None:
        task = asyncio.current_task()
        assert task is not None
        channel.attach(task)
        await never.wait()  # a provider that sends nothing for now

    if abandon_first:
        channel.abandon()
    task = producer.start(call())
    producer.settle()
    if not abandon_first:
        assert not producer.done(task)
        channel.abandon()
    assert producer.cancelled(task)
    assert channel.abandoned


def test_an_async_reader_on_its_own_loop_is_woken_by_a_put_from_the_io_loop(
    producer: Producer,
) -> None:
    channel = StreamChannel(limit=1)

    async def read() -> list[StreamDelta | None]:
        got: list[StreamDelta | None] = []
        for n in range(3):
            producer.start(channel.put(delta(n)))  # one at a time: the limit is 1
            got.append(await channel.aget())
        channel.close()
        got.append(await channel.aget())
        return got

    got = asyncio.run(asyncio.wait_for(read(), WAIT_S))
    assert got == [delta(0), delta(1), delta(2), END]


def test_offer_takes_a_delta_without_waiting_and_says_when_the_channel_is_full(
    producer: Producer,
) -> None:
    """What a call does with each delta (``put`` only when this says full): the reader
    gets what was offered, in order, and a full channel takes nothing more."""
    channel = StreamChannel(limit=2)

    async def offer(n: int) -> bool:
        return channel.offer(delta(n))

    assert [producer.outcome(producer.start(offer(n))) for n in (1, 2, 3)] == [True, True, False]
    assert channel.received
    assert [channel.get(WAIT_S), channel.get(WAIT_S)] == [delta(1), delta(2)]
    assert producer.outcome(producer.start(offer(3)))  # room again
    channel.abandon()
    with pytest.raises(Abandoned):
        producer.outcome(producer.start(offer(4)))


def test_next_or_waiter_gives_a_delta_or_a_future_that_a_put_resolves(producer: Producer) -> None:
    """``aget`` without its coroutine: a future while nothing waits, resolved by the next
    put (from the I/O loop), then the delta; ``END`` once closed and drained."""
    channel = StreamChannel()

    async def read() -> list[Any]:
        waiter = channel.next_or_waiter()
        assert isinstance(waiter, asyncio.Future)
        assert not waiter.done()
        producer.outcome(producer.start(channel.put(delta(1))))
        await asyncio.wait_for(waiter, WAIT_S)
        got = [channel.next_or_waiter()]
        producer.outcome(producer.start(channel.put(delta(2))))
        channel.close()
        return [*got, channel.next_or_waiter(), channel.next_or_waiter()]

    assert asyncio.run(read()) == [delta(1), delta(2), END]


class CountingLoop(asyncio.SelectorEventLoop):
    """A reader's loop that counts the wake-ups other threads send it."""

    def __init__(self) -> None:
        super().__init__()
        self.woken = 0

    def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> Any:
        self.woken += 1
        return super().call_soon_threadsafe(callback, *args, context=context)


def test_puts_while_a_wake_up_is_on_its_way_ride_on_it(producer: Producer) -> None:
    """Three streams read on one loop, five deltas each put while that loop is busy (it
    cannot run the first wake-up yet): its readers' loop is woken once, and every
    reader gets its five in order."""
    channels = [StreamChannel() for _ in range(3)]

    async def burst() -> None:
        for n in range(5):
            for channel in channels:
                await channel.put(delta(n))

    async def read(channel: StreamChannel) -> list[StreamDelta | None]:
        return [await channel.aget() for _ in range(5)]

    async def main(loop: CountingLoop) -> list[list[StreamDelta | None]]:
        reads = [asyncio.ensure_future(read(c)) for c in channels]
        await asyncio.sleep(0)  # every reader has found its channel empty and waits
        before = loop.woken
        producer.outcome(producer.start(burst()))  # this loop waits: it runs nothing
        got = await asyncio.wait_for(asyncio.gather(*reads), WAIT_S)
        assert loop.woken - before == 1, "one wake-up for the fifteen deltas"
        return got

    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        loop = runner.get_loop()
        assert isinstance(loop, CountingLoop)
        got = runner.run(main(loop))
    assert got == [[delta(n) for n in range(5)]] * 3


@pytest.mark.parametrize("another_starts", [False, True])
def test_a_later_delta_waits_for_the_io_loops_next_turn_a_first_one_does_not(
    producer: Producer, another_starts: bool
) -> None:
    """Stream A has had its first delta; its reader waits for the next. A's next delta
    sends no wake-up at once: one goes at the I/O loop's next turn. A first delta (of
    stream B, put in the same turn) is sent at once, and carries A's with it."""
    a, b = StreamChannel(), StreamChannel()

    async def put_then_count(loop: CountingLoop, before: int) -> tuple[int, int]:
        await a.put(delta(1))
        if another_starts:
            await b.put(delta(0))
        at_once = loop.woken - before
        await asyncio.sleep(0)  # the I/O loop's next turn
        return at_once, loop.woken - before

    async def main(loop: CountingLoop) -> tuple[tuple[int, int], list[StreamDelta | None]]:
        first: asyncio.Future[StreamDelta | None] = loop.create_future()

        async def read_a() -> StreamDelta | None:
            first.set_result(await a.aget())
            return await a.aget()  # waiting again in the same step: nothing in between

        reading_a = asyncio.ensure_future(read_a())
        reading_b = asyncio.ensure_future(b.aget())
        await asyncio.sleep(0)  # both readers wait
        producer.outcome(producer.start(a.put(delta(0))))  # A's first: woken at once
        assert await asyncio.wait_for(first, WAIT_S) == delta(0)
        counts = producer.outcome(producer.start(put_then_count(loop, loop.woken)))
        got = [await asyncio.wait_for(reading_a, WAIT_S)]  # this loop runs again
        if another_starts:
            got.append(await asyncio.wait_for(reading_b, WAIT_S))
        else:
            reading_b.cancel()
        return counts, got

    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        loop = runner.get_loop()
        assert isinstance(loop, CountingLoop)
        counts, got = runner.run(main(loop))
    assert counts == ((1, 1) if another_starts else (0, 1))
    assert got == ([delta(1), delta(0)] if another_starts else [delta(1)])


# -- the bound under a real stream ------------------------------------------------------------


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
def test_a_reader_that_does_not_read_holds_the_server_not_a_growing_buffer(
    transport: Literal["aiohttp", "httpx"],
) -> None:
    """The server writes 3000 deltas; nobody reads. The channel fills to its limit and no
    further, and the call waits for room there, reading nothing more (the provider's
    bytes wait in the kernel's buffers, then TCP's window: how much of the 3 MB those
    take is the kernel's, up to all of it on a loaded machine whose loopback windows
    grew, as a fresh clone's CI run found). Then the reader takes every delta, in
    order: on the default transport's aiohttp session and through an httpx transport
    alike."""
    flood = Flood(3000, size=1024)
    io = IoLoop(name="test-io")
    io.start()
    done: queue.Queue[CallResult] = queue.Queue()

    def deliver(msg: CallsDone) -> None:
        for r in msg.results:
            done.put(r)

    channel = StreamChannel()
    with WireServer(flood.handler) as srv:
        client = ModelClient(
            ModelSettings(name="m", base_url=srv.base_url, transport=transport),
            incarnation=1,
            deliver=deliver,
        )
        body = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
        try:
            io.call_soon(client.start, [(1, 1, body, None, 0, CallShape(stream=channel))])
            # the call waits for room: nothing more is read (311-415 of the 3,000 written
            # on a quiet machine, the server blocked; all of them once, into the windows)
            assert wait_until(lambda: len(channel._deltas) == LIMIT and channel._room)
            assert len(channel._deltas) == LIMIT == channel.limit
            room = channel._room
            assert room is not None
            assert not room.done()
            texts = [channel.get(WAIT_S) for _ in range(flood.n + 1)]  # + the finish
            result = done.get(timeout=WAIT_S)
        finally:
            io.run(client.aclose(close_transport=True))
            io.stop()
    assert flood.done.is_set()
    read = [d.text for d in texts if d is not None]
    assert flood.indices(read) == list(range(flood.n))
    assert (result.error, result.finish_reason) == (None, "stop")
    assert result.content == "".join(read)
