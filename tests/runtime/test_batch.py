"""Batch: the requests of one turn of the loop go to a real System; a request
the System refuses gets its own error and the others still go; a handler cancelled
before its batch went sends nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

import pytest
from callboard.messages import (
    Cancelled,
    Completed,
    Request,
    Result,
    SystemStoppedError,
    UnknownModelError,
)
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.batch import Batch
from support import WAIT_S, requests_seen, settle

from callboard import ModelSettings, System, SystemConfig


def _request(text: str, model: str = "alpha") -> Request:
    return Request.of(text, model=model, max_tokens=8)


def test_every_request_of_a_turn_goes_in_its_order(
    make_system: Callable[..., System],
) -> None:
    system = make_system()

    async def main() -> list[Future[Result]]:
        batch = Batch(system)
        handlers = [batch.submit(_request(f"n{i}")) for i in range(20)]
        return list(await asyncio.wait_for(asyncio.gather(*handlers), WAIT_S))

    results = settle(asyncio.run(main()))
    assert all(isinstance(r, Completed) for r in results)
    ids = [r.task_id for r in results]
    assert ids == sorted(ids)  # accepted in the order the handlers submitted


def test_a_request_the_system_refuses_fails_alone(
    make_system: Callable[..., System], provider: SimulatedProvider
) -> None:
    system = make_system()

    async def main() -> list[Future[Result] | BaseException]:
        batch = Batch(system)
        requests = [_request("a"), _request("b", model="nope"), _request("c")]
        handlers = [batch.submit(r) for r in requests]
        return await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), WAIT_S)

    first, refused, last = asyncio.run(main())
    assert isinstance(refused, UnknownModelError)
    assert "'nope'" in str(refused)
    assert isinstance(first, Future)
    assert isinstance(last, Future)
    assert all(isinstance(r, Completed) for r in settle([first, last]))
    assert requests_seen(provider) == 2


def test_a_handler_cancelled_before_its_batch_went_sends_nothing(
    make_system: Callable[..., System], provider: SimulatedProvider
) -> None:
    system = make_system()

    async def main() -> list[Future[Result]]:
        batch = Batch(system)
        handlers = [asyncio.ensure_future(batch.submit(_request(t))) for t in "abc"]
        await asyncio.sleep(0)  # each handler waits for the batch
        handlers[1].cancel()
        kept = [handlers[0], handlers[2]]
        return list(await asyncio.wait_for(asyncio.gather(*kept), WAIT_S))

    futures = asyncio.run(main())
    assert all(isinstance(r, Completed) for r in settle(futures))
    assert requests_seen(provider) == 2


def test_a_handler_cancelled_after_its_batch_went_cancels_its_task(
    make_system: Callable[..., System], provider: SimulatedProvider
) -> None:
    """The batch went, and the handler is cancelled before it resumes with its task's
    future: nobody holds that future, so the task must be cancelled here (it was sent
    and paid for, found by a hunt). The model's one slot is busy, so it is unsent."""
    provider.configure("held", ModelBehaviour(latency_s=0.3))
    models = (ModelSettings(name="held", base_url=provider.base_url, max_concurrency=1),)
    system = make_system(SystemConfig(models=models))

    async def main() -> list[Future[Result]]:
        batch = Batch(system)
        handlers = [asyncio.ensure_future(batch.submit(_request(t, model="held"))) for t in "abc"]
        await asyncio.sleep(0)  # a went alone; b and c wait for the turn's end (flush)
        asyncio.get_running_loop().call_soon(handlers[1].cancel)  # right after the flush
        done = await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), WAIT_S)
        assert isinstance(done[1], asyncio.CancelledError)
        return [f for f in done if isinstance(f, Future)]

    futures = asyncio.run(main())
    assert all(isinstance(r, Completed) for r in settle(futures))
    assert len(futures) == 2
    assert requests_seen(provider) == 2


def test_a_stopped_system_refuses_each_request_with_its_error(
    make_system: Callable[..., System],
) -> None:
    system = make_system()
    system.stop(timeout=WAIT_S)

    async def main() -> list[Future[Result] | BaseException]:
        batch = Batch(system)
        handlers = [batch.submit(_request(t)) for t in "ab"]
        return await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), WAIT_S)

    answers = asyncio.run(main())
    assert len(answers) == 2
    for answer in answers:
        assert isinstance(answer, SystemStoppedError)


def test_the_first_request_of_a_turn_goes_without_waiting_for_the_turn(
    make_system: Callable[..., System],
) -> None:
    """The handler of a lone request is not suspended: its future comes back at once."""
    system = make_system()

    async def main() -> Future[Result]:
        batch = Batch(system)
        first = batch.submit(_request("a"))
        with pytest.raises(StopIteration) as went:
            first.send(None)  # one step of the coroutine: it finishes there
        future: Future[Result] = went.value.value
        second = asyncio.ensure_future(batch.submit(_request("b")))
        assert isinstance(await asyncio.wait_for(second, WAIT_S), Future)
        return future

    future = asyncio.run(main())
    assert isinstance(future.result(WAIT_S), Completed)


class _Recording:
    """The system, and the size of each submission made to it."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.sizes: list[int] = []

    def submit(self, request: Request, /) -> Future[Result]:
        self.sizes.append(1)
        return self.system.submit(request)

    def submit_many(self, requests: list[Request], /) -> list[Future[Result]]:
        self.sizes.append(len(requests))
        return self.system.submit_many(requests)


def test_a_turn_opened_ahead_takes_its_first_request_too(
    make_system: Callable[..., System],
) -> None:
    """``open_turn`` before the callers run (as a handoff's delivery does): the turn's
    requests, the first included, go in one submission; the next turn's first goes
    at once again."""
    recording = _Recording(make_system())

    async def main() -> list[Future[Result]]:
        batch = Batch(recording)
        handlers = [asyncio.ensure_future(batch.submit(_request(f"n{i}"))) for i in range(5)]
        batch.open_turn()  # the callers are scheduled and have not run: as after a delivery
        together = await asyncio.wait_for(asyncio.gather(*handlers), WAIT_S)
        alone = await batch.submit(_request("next turn"))
        return [*together, alone]

    results = settle(asyncio.run(main()))
    assert all(isinstance(r, Completed) for r in results)
    ids = [r.task_id for r in results]
    assert ids == sorted(ids)
    assert recording.sizes == [5, 1]


class _CancellingOne(_Recording):
    """The system, where a caller is cancelled while its batch is being submitted: as
    Ctrl-C under ``asyncio.run`` cancels the main task from the signal's handler, which
    Python runs between two bytecodes of ``submit_many``."""

    def __init__(self, system: System) -> None:
        super().__init__(system)
        self.victim: asyncio.Task[Future[Result]] | None = None
        self.made: list[Future[Result]] = []

    def submit_many(self, requests: list[Request], /) -> list[Future[Result]]:
        futures = super().submit_many(requests)
        self.made.extend(futures)
        assert self.victim is not None
        self.victim.cancel()  # cancels the future it awaits, at once
        return futures


def test_a_caller_cancelled_while_its_batch_is_submitted_leaves_the_others_their_futures(
    make_system: Callable[..., System],
) -> None:
    """Its future was set regardless: ``InvalidStateError``, and the callers after it in
    the batch never got theirs (found by a hunt). The cancelled caller's task is
    cancelled: nobody holds its future."""
    system = _CancellingOne(make_system())

    async def main() -> list[Future[Result]]:
        batch = Batch(system)
        first = asyncio.ensure_future(batch.submit(_request("alone")))  # goes on its own
        system.victim = asyncio.ensure_future(batch.submit(_request("victim")))  # these
        rest = [asyncio.ensure_future(batch.submit(_request(t))) for t in "bc"]  # wait
        done = await asyncio.wait_for(asyncio.gather(first, *rest), WAIT_S)
        with pytest.raises(asyncio.CancelledError):
            await system.victim
        return list(done)

    futures = asyncio.run(main())
    assert system.sizes == [1, 3]
    assert all(isinstance(r, Completed) for r in settle(futures))
    victim = system.made[0]
    assert victim.cancelled() or isinstance(victim.result(WAIT_S), Cancelled)
