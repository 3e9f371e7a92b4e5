"""``runtime.flag.Flag``: set from any thread, awaited on any loop."""

from __future__ import annotations

import asyncio
import threading

from callboard.runtime.flag import Flag

WAIT_S = 10.0


def test_one_set_from_another_thread_wakes_a_waiter_on_each_loop() -> None:
    flag = Flag()
    waiting = threading.Barrier(3, timeout=WAIT_S)
    woken: list[bool] = []

    async def wait() -> None:
        task = asyncio.ensure_future(flag.wait())
        await asyncio.sleep(0)  # the waiter is registered
        waiting.wait()
        woken.append(await asyncio.wait_for(task, WAIT_S))

    threads = [threading.Thread(target=asyncio.run, args=(wait(),)) for _ in range(2)]
    for t in threads:
        t.start()
    waiting.wait()
    flag.set()
    for t in threads:
        t.join(WAIT_S)
    assert woken == [True, True]
    assert flag.is_set()


def test_a_wait_after_set_returns_at_once_and_a_given_up_one_leaves_nothing() -> None:
    flag = Flag()

    async def main() -> None:
        given_up = asyncio.ensure_future(flag.wait())
        await asyncio.sleep(0)
        given_up.cancel()
        await asyncio.gather(given_up, return_exceptions=True)
        assert not flag._waiters  # nothing kept for a waiter gone
        flag.set()
        assert await asyncio.wait_for(flag.wait(), WAIT_S)

    asyncio.run(main())


def test_set_with_a_waiter_on_a_closed_loop_does_not_raise() -> None:
    flag = Flag()
    loop = asyncio.new_event_loop()
    task = loop.create_task(flag.wait())
    loop.run_until_complete(asyncio.sleep(0))  # registered, then the loop is gone
    task.cancel()
    loop.close()  # without running the cancel: its waiter is still listed
    flag.set()
    assert flag.is_set()
