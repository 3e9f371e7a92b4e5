"""The asyncio face: ``AsyncSystem``'s patterns are the patterns, awaited on the caller's loop.

Each test runs one event loop (``asyncio.run``) over a real ``AsyncSystem`` on
the loopback provider: ``alpha`` answers in ~10 ms, ``slow`` in 300 ms and
``single`` takes one call at a time, so what ends first and what waits
unsent are decided by wide margins. Tests wait on results, never on sleeps.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from callboard.messages import Cancelled, Completed
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S

from callboard import AsyncSystem, ModelSettings, Request, Result, SystemConfig, SystemStoppedError
from callboard.patterns import RaceResult

T = TypeVar("T")


def run_on(provider: SimulatedProvider, test: Callable[[AsyncSystem], Awaitable[T]]) -> T:
    """Run ``test(cb)`` on a fresh loop, with an ``AsyncSystem`` over ``alpha``, ``slow``
    and ``single`` that is stopped however the test ends."""
    provider.configure("slow", ModelBehaviour(latency_s=0.3))
    provider.configure("single", ModelBehaviour(latency_s=0.3))
    models = tuple(
        ModelSettings(
            name=name,
            base_url=provider.base_url,
            max_concurrency=1 if name == "single" else 16,
        )
        for name in ("alpha", "slow", "single")
    )

    async def main() -> T:
        async with AsyncSystem(SystemConfig(models=models)) as cb:
            return await asyncio.wait_for(test(cb), WAIT_S)

    return asyncio.run(main())


def test_gather_answers_in_input_order_or_the_first_to_end(provider: SimulatedProvider) -> None:
    async def test(cb: AsyncSystem) -> tuple[list[Result], Result]:
        everything = await cb.gather(
            [Request.of("late", model="slow"), Request.of("early", model="alpha")]
        )
        first = await cb.gather(
            [Request.of("late", model="slow"), Request.of("early", model="alpha")],
            return_when="first",
        )
        return everything, first

    everything, first = run_on(provider, test)
    assert [r.model for r in everything] == ["slow", "alpha"]
    assert all(isinstance(r, Completed) for r in everything)
    assert first.model == "alpha"


def test_a_gather_past_its_timeout_cancels_what_it_had_not_sent(
    provider: SimulatedProvider,
) -> None:
    async def test(cb: AsyncSystem) -> dict[str, int]:
        with pytest.raises(TimeoutError):
            await cb.gather(["a", "b", "c"], model="single", timeout=0.05)
        assert await cb.drain(WAIT_S)
        return (await cb.stats()).outcomes

    outcomes = run_on(provider, test)
    # one call was on its way at the timeout and ran to its end; the two behind it never left
    assert outcomes == {"completed": 1, "cancelled": 2}


def test_race_hedges_and_reports_the_losers(provider: SimulatedProvider) -> None:
    async def test(cb: AsyncSystem) -> tuple[RaceResult, tuple[Result, ...]]:
        outcome = await cb.race("hedge me", models=["slow", "alpha"])
        losers = await asyncio.wrap_future(outcome.losers)
        return outcome, losers

    outcome, losers = run_on(provider, test)
    assert (outcome.ok, outcome.model) == (True, "alpha")
    assert [r.model for r in losers] == ["slow"]
    assert {r.trace_id for r in (outcome.result, *losers)} == {outcome.trace_id}


def test_chain_awaits_async_stages_under_one_trace(provider: SimulatedProvider) -> None:
    async def shout(text: str) -> dict[str, Any]:
        await asyncio.sleep(0)  # a stage may await what it needs
        return {"prompt": f"SHOUT {text}", "model": "alpha"}

    async def test(cb: AsyncSystem) -> Any:
        return await cb.chain(["first: {input}", shout], "hi", model="alpha")

    out = run_on(provider, test)
    assert out.ok
    assert len(out.results) == 2
    assert {r.trace_id for r in out.results} == {out.trace_id}


def test_stream_yields_results_as_they_end(provider: SimulatedProvider) -> None:
    async def test(cb: AsyncSystem) -> list[str | None]:
        prompts = [Request.of("late", model="slow"), Request.of("early", model="alpha")]
        return [r.model async for r in cb.stream(prompts, timeout=WAIT_S)]

    assert run_on(provider, test) == ["alpha", "slow"]


def test_fire_and_forget_calls_back_on_the_callers_loop(provider: SimulatedProvider) -> None:
    async def test(cb: AsyncSystem) -> tuple[Result, bool]:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[tuple[Result, bool]] = loop.create_future()

        async def on_result(result: Result) -> None:
            on_loop = asyncio.get_running_loop() is loop
            got.set_result((result, on_loop))

        def on_error(failure: object) -> None:
            loop.call_soon_threadsafe(got.set_exception, AssertionError(repr(failure)))

        assert cb.fire_and_forget("hi", model="alpha", on_result=on_result, on_error=on_error)
        return await got

    result, on_loop = run_on(provider, test)
    assert result.ok
    assert on_loop


def test_the_patterns_of_a_face_not_started_raise_the_typed_error() -> None:
    cb = AsyncSystem()
    errors: list[object] = []
    seen = threading.Event()

    def on_error(failure: object) -> None:
        errors.append(failure)
        seen.set()

    async def main() -> None:
        for call in (
            lambda: cb.gather(["x"]),
            lambda: cb.race("x", models=["m"]),
            lambda: cb.chain(["{input}"], "x"),
        ):
            with pytest.raises(SystemStoppedError, match="not started"):
                await call()
        with pytest.raises(SystemStoppedError, match="not started"):
            cb.stream(["x"])
        assert cb.fire_and_forget("x", on_error=on_error) is None  # told, never raised

    asyncio.run(main())
    assert seen.wait(WAIT_S)
    assert [type(e) for e in errors] == [SystemStoppedError]


def test_a_gather_of_many_ends_every_task_exactly_once(provider: SimulatedProvider) -> None:
    async def test(cb: AsyncSystem) -> tuple[list[Result], dict[str, int]]:
        results = await cb.gather([f"q{i}" for i in range(200)], model="alpha")
        assert await cb.drain(WAIT_S)
        return results, (await cb.stats()).ledger

    results, ledger = run_on(provider, test)
    assert Counter(type(r) for r in results) == {Completed: 200}
    assert len({r.task_id for r in results}) == 200
    assert ledger["accepted"] == ledger["finished"] == 200
    assert not any(isinstance(r, Cancelled) for r in results)
