"""Patterns end to end over real loopback HTTP: gather, as_completed, race, chain, callbacks.

The simulated provider serves ``fast`` (10 ms), ``slow`` (300 ms), ``bad``
(every call a 400) and ``single`` (300 ms, one call at a time on our side),
so which task ends first, and which waits unsent, is decided by wide margins.
One system serves the module (starting one costs ~0.2 s); each test starts
on a drained system and counts outcomes as differences. The tests of the last
section run on ``assorted_system`` (conftest) instead: a race bills every
entrant sent and cancels the unsent one, gather's first result cancels the
unsent rest, a chain keeps its fields, key and trace id. Tests wait on futures
and events, never on sleeps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from callboard.messages import Cancelled, Completed, Failed, FailureReason
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S, served, two_models, wait_until

from callboard import (
    InvalidRequestError,
    ModelSettings,
    Price,
    QueueFullError,
    Rejected,
    RejectReason,
    Request,
    Result,
    SchedulerSettings,
    System,
    SystemConfig,
    UnknownModelError,
    UsageError,
)
from callboard.patterns import (
    CallbackRunner,
    aas_completed,
    achain,
    agather,
    arace,
    as_completed,
    chain,
    fire_and_forget,
    gather,
    race,
)

PRICE = Price(input_per_mtok=Decimal("1.00"), output_per_mtok=Decimal("2.00"))


@pytest.fixture(scope="module")
def system() -> Iterator[System]:
    behaviours = {
        "fast": ModelBehaviour(latency_s=0.01),
        "slow": ModelBehaviour(latency_s=0.3),
        "bad": ModelBehaviour(latency_s=0.0, status=400),
        "single": ModelBehaviour(latency_s=0.3),
    }
    with SimulatedProvider(models=behaviours, seed=3) as provider:
        models = [
            ModelSettings(
                name=name,
                base_url=provider.base_url,
                max_concurrency=1 if name == "single" else 16,
                price=PRICE,
            )
            for name in behaviours
        ]
        system = System(SystemConfig(models=tuple(models)))
        try:
            yield system
        finally:
            system.stop(timeout=WAIT_S)


@pytest.fixture
def shared(system: System) -> System:
    assert system.drain(WAIT_S), "the previous test left work behind"
    return system


def _counts(shared: System) -> Counter[str]:
    """Outcomes so far, plus ``accepted`` and ``cost_nusd``, to subtract from a later count."""
    stats = shared.stats()
    return Counter(
        {**stats.outcomes, "accepted": stats.ledger["accepted"], "cost_nusd": stats.total.cost_nusd}
    )


def _since(shared: System, before: Counter[str]) -> Counter[str]:
    assert shared.drain(WAIT_S)
    after = _counts(shared)
    after.subtract(before)
    return after


@pytest.fixture
def runner() -> Iterator[CallbackRunner]:
    with CallbackRunner(max_workers=2) as r:
        yield r


def _tagged(model: str, i: int) -> Request:
    return Request.of(f"question {i}", model=model, metadata={"i": i})


# -- gather and as_completed ----------------------------------------------------------


def test_gather_returns_every_result_in_input_order_not_finishing_order(shared: System) -> None:
    prompts = [_tagged("slow", 0), _tagged("fast", 1), _tagged("fast", 2), _tagged("slow", 3)]
    results = gather(shared, prompts, timeout=WAIT_S)
    assert [r.metadata["i"] for r in results] == [0, 1, 2, 3]
    assert [r.model for r in results] == ["slow", "fast", "fast", "slow"]
    assert all(isinstance(r, Completed) for r in results)


def test_gather_first_returns_the_first_result_and_cancels_the_unsent_rest(shared: System) -> None:
    before = _counts(shared)
    first = gather(shared, [f"q{i}" for i in range(6)], return_when="first", model="single")
    assert isinstance(first, Completed)
    assert first.model == "single"
    done = _since(shared, before)
    # one answered first; a credit freed by it may have sent one more before the cancel landed
    assert done["cancelled"] >= 4
    assert done["completed"] + done["cancelled"] == done["accepted"] == 6


def test_gather_rejects_a_bad_return_when_before_sending_anything(shared: System) -> None:
    before = _counts(shared)
    with pytest.raises(UsageError, match="return_when"):
        gather(shared, ["a"], return_when="most")  # type: ignore[call-overload]
    with pytest.raises(UsageError, match="at least one prompt"):
        gather(shared, [], return_when="first")
    assert gather(shared, []) == []
    assert _since(shared, before)["accepted"] == 0


def test_gather_timeout_raises_and_cancels_what_was_not_sent(shared: System) -> None:
    before = _counts(shared)
    with pytest.raises(TimeoutError, match="not ready"):
        gather(shared, ["a", "b", "c"], model="single", timeout=0.05)
    assert _since(shared, before)["cancelled"] >= 1


def test_as_completed_yields_in_finishing_order_and_takes_futures_or_prompts(
    shared: System,
) -> None:
    slow = shared.submit("slow one", model="slow")
    done = as_completed(shared, [slow, "fast one"], timeout=WAIT_S, model="fast")
    order = [r.model for r in done]
    assert order == ["fast", "slow"]


def test_as_completed_times_out(shared: System) -> None:
    slow = shared.submit("slow one", model="slow")
    with pytest.raises(TimeoutError):
        list(as_completed(None, [slow], timeout=0.01))
    assert slow.result(WAIT_S).ok


@pytest.mark.parametrize("bad", [float("nan"), -1, "3"])
def test_as_completed_checks_its_timeout_before_sending(shared: System, bad: object) -> None:
    """NaN was no timeout, -1 a timeout at once and "3" a bare TypeError, each after the
    prompts were sent (found by a hunt)."""
    before = _counts(shared)
    with pytest.raises(InvalidRequestError, match="timeout"):
        as_completed(shared, ["a", "b"], timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="timeout"):
        aas_completed(shared, ["a", "b"], timeout=bad)  # type: ignore[arg-type]
    assert _since(shared, before)["accepted"] == 0


@pytest.mark.parametrize("bad", [None, "x", 42])
def test_fire_and_forget_refuses_what_is_not_a_callback(shared: System, bad: object) -> None:
    """``on_error=None`` or ``"x"`` was taken, and a log line said so once the outcome
    came (found by a hunt)."""
    with pytest.raises(UsageError, match="on_error"):
        fire_and_forget(shared, "hi", on_error=bad)  # type: ignore[arg-type]
    if bad is not None:
        with pytest.raises(UsageError, match="on_result must be a callable"):
            fire_and_forget(shared, "hi", on_error=print, on_result=bad)  # type: ignore[arg-type]


def test_aas_completed_yields_as_results_finish(shared: System) -> None:
    async def main() -> list[str | None]:
        slow = shared.submit("slow one", model="slow")
        return [r.model async for r in aas_completed(shared, [slow, _tagged("fast", 1)])]

    assert asyncio.run(main()) == ["fast", "slow"]


def test_agather_all_and_first(shared: System) -> None:
    async def main() -> tuple[list[Result], Result]:
        everything = await agather(shared, [_tagged("slow", 0), _tagged("fast", 1)], timeout=WAIT_S)
        first = await agather(shared, [_tagged("slow", 0), _tagged("fast", 1)], return_when="first")
        return everything, first

    everything, first = asyncio.run(main())
    assert [r.metadata["i"] for r in everything] == [0, 1]
    assert first.model == "fast"


def test_agather_says_what_timed_out_as_gather_does(shared: System) -> None:
    """Its own timeout came as a ``TimeoutError`` with no message at all (found by a
    hunt); the blocking gather says "results not ready within ..."."""

    async def main() -> None:
        await agather(shared, [_tagged("slow", 0)], timeout=0.01)

    with pytest.raises(TimeoutError, match=r"results not ready within 0\.01 s"):
        asyncio.run(main())


# -- race -----------------------------------------------------------------------------------


def test_race_the_fastest_success_wins_without_waiting_for_the_losers(shared: System) -> None:
    before = _counts(shared)
    outcome = race(shared, "hedge me", models=["slow", "fast"], timeout=WAIT_S)
    assert outcome.ok
    assert outcome.model == "fast"
    assert not outcome.losers.done(), "the race must return before the slow loser ends"
    (loser,) = outcome.losers.result(WAIT_S)
    assert isinstance(loser, Completed), "a loser already sent runs to its end"
    assert loser.model == "slow"
    assert loser.cost_nusd > 0
    assert {outcome.result.trace_id, loser.trace_id} == {outcome.trace_id}
    total = outcome.total_cost_usd(WAIT_S)
    assert total == outcome.result.cost_usd + loser.cost_usd
    assert _since(shared, before)["cost_nusd"] == outcome.result.cost_nusd + loser.cost_nusd


def test_race_first_success_beats_an_earlier_failure(shared: System) -> None:
    outcome = race(shared, "hedge me", models=["bad", "slow"], timeout=WAIT_S)
    assert outcome.ok
    assert outcome.model == "slow"
    (loser,) = outcome.losers.result(WAIT_S)
    assert isinstance(loser, Failed)
    assert loser.reason is FailureReason.REQUEST_ERROR


def test_race_with_no_success_reports_a_failure(shared: System) -> None:
    outcome = race(shared, "doomed", models=["bad", "bad"], timeout=WAIT_S)
    assert not outcome.ok
    assert isinstance(outcome.result, Failed)
    assert len(outcome.losers.result(WAIT_S)) == 1


def test_race_cancels_a_loser_that_was_never_sent(shared: System) -> None:
    blocker = shared.submit("hold the only slot", model="single")
    outcome = race(shared, "hedge me", models=["single", "fast"], timeout=WAIT_S)
    assert outcome.model == "fast"
    (loser,) = outcome.losers.result(WAIT_S)
    assert isinstance(loser, Cancelled)
    assert loser.cost_nusd == 0
    assert blocker.result(WAIT_S).ok


def test_race_checks_its_arguments_before_sending(shared: System) -> None:
    before = _counts(shared)
    with pytest.raises(UsageError, match="models"):
        race(shared, "x", models=[])
    with pytest.raises(UsageError, match="models="):
        race(shared, "x", models=["fast"], model="slow")
    with pytest.raises(UnknownModelError):
        race(shared, "x", models=["fast", "nope"])
    assert _since(shared, before)["accepted"] == 0


def test_arace(shared: System) -> None:
    outcome = asyncio.run(arace(shared, "hedge me", models=["slow", "fast"], timeout=WAIT_S))
    assert outcome.model == "fast"
    assert outcome.losers.result(WAIT_S)[0].model == "slow"


# -- chain ------------------------------------------------------------------------------------


def test_chain_feeds_each_stage_the_previous_text_under_one_trace_id(shared: System) -> None:
    seen: list[str] = []

    def title(text: str) -> dict[str, Any]:
        seen.append(text)
        return {"prompt": f"A title for: {text}", "model": "slow", "max_tokens": 16}

    out = chain(shared, ["Summarise: {input}", title, "Translate: {input}"], "a long document")
    assert out.ok
    assert out.failed_stage is None
    assert len(out.results) == 3
    assert seen == [out.results[0].text]
    assert [r.model for r in out.results] == ["fast", "slow", "fast"]
    assert {r.trace_id for r in out.results} == {out.trace_id}
    assert out.text == out.results[-1].text
    assert out.cost_nusd == sum(r.cost_nusd for r in out.results) > 0


def test_a_chain_stage_naming_its_model_overrides_the_chains_route(shared: System) -> None:
    """With the chain's ``route`` and a stage's ``model`` both in its request, the stage
    was refused mid-chain, the stages before it paid for (found by a review): a stage's
    own target overrides the chain's, from a dict or a Request."""

    def named(text: str) -> dict[str, Any]:
        return {"prompt": f"again: {text}", "model": "slow", "max_tokens": 8}

    def as_request(text: str) -> Request:
        return Request.of(f"and again: {text}", model="slow", max_tokens=8)

    out = chain(shared, ["first: {input}", named, as_request], "go", route="auto")
    assert out.ok, out.result
    assert [r.model for r in out.results][1:] == ["slow", "slow"]


def test_chain_takes_its_stages_from_a_generator_too(shared: System) -> None:
    """The stage check read a generator up, and then a TypeError (len of a generator)
    came instead of a chain."""
    out = chain(shared, (f"Step {i}: {{input}}" for i in range(2)), "a document")
    assert out.ok
    assert len(out.results) == 2


def test_chain_stops_at_the_first_failure_and_returns_it(shared: System) -> None:
    later: list[str] = []

    def never_reached(text: str) -> str:
        later.append(text)
        return text

    out = chain(
        shared,
        ["{input}", lambda t: {"prompt": t, "model": "bad"}, never_reached],
        "start",
        trace_id="my-trace",
    )
    assert not out.ok
    assert out.failed_stage == 1
    assert isinstance(out.result, Failed)
    assert later == []
    assert {r.trace_id for r in out.results} == {"my-trace"}


def test_chain_checks_templates_before_sending(shared: System) -> None:
    """``"{"`` and ``"}{input}"`` raised a bare ``ValueError``; ``"{input!z}"`` passed the
    check and raised after the first stage was sent; a first input of None was sent as
    the prompt "None" (found by a hunt)."""
    before = _counts(shared)
    with pytest.raises(UsageError, match="input"):
        chain(shared, ["ok {input}", "bad {other}"], "x")
    with pytest.raises(UsageError, match="non-empty"):
        chain(shared, [], "x")
    for bad in ("{", "}{input}"):
        with pytest.raises(UsageError, match="does not parse"):
            chain(shared, ["ok {input}", bad], "x")
    for bad in ("{input!z}", "{input:>9}", "{input!r}"):
        with pytest.raises(UsageError, match="no conversion or format spec"):
            chain(shared, ["ok {input}", bad], "x")
    with pytest.raises(UsageError, match="first input must be a string"):
        chain(shared, ["ok {input}"], None)  # type: ignore[arg-type]
    assert _since(shared, before)["accepted"] == 0


def test_a_chain_stage_whose_request_is_invalid_ends_it_keeping_what_ran(shared: System) -> None:
    """A stage fed "" (the answer before it a tool call, a stage function returning "")
    raised an ``InvalidRequestError`` naming no stage, and the stages that ran (paid
    for) went with it (found by a hunt). A first stage's still raises, naming it."""
    bad_fields = {"prompt": "x", "metadata": {"capabilities": 5}}  # refused by the submit
    for later in (lambda _text: "   ", lambda _text: bad_fields):
        done = chain(shared, ["{input}", later, "never {input}"], "hello")
        assert done.failed_stage == 1
        assert isinstance(done.result, Failed)
    done = chain(shared, ["{input}", lambda _text: "   ", "never {input}"], "hello")
    assert not done.ok
    assert done.failed_stage == 1
    assert done.results[0].ok
    assert isinstance(done.result, Failed)
    assert done.result.reason is FailureReason.REQUEST_ERROR
    assert done.result.detail.startswith("stage 1: ")
    assert done.cost_nusd == done.results[0].cost_nusd > 0
    with pytest.raises(InvalidRequestError, match=r"^stage 0: "):
        chain(shared, [lambda _text: ""], "hello")


def test_a_chain_whose_system_stops_between_stages_returns_what_ran(
    provider: SimulatedProvider,
) -> None:
    """It raised ``SystemStoppedError`` from its second stage's submit, and the first
    stage's result and cost went with it (found by a hunt)."""
    system = System(SystemConfig(models=two_models(provider.base_url)))

    def stop_then(text: str) -> str:
        system.stop(timeout=WAIT_S)  # the first stage ran; the system stops before the next
        return f"again: {text}"

    try:
        done = chain(system, ["hi {input}", stop_then], "x", model="alpha")
    finally:
        system.stop(timeout=0)
    assert not done.ok
    assert done.failed_stage == 1
    assert done.results[0].ok
    assert isinstance(done.result, Rejected)
    assert done.result.reason is RejectReason.STOPPING
    assert done.cost_nusd == done.results[0].cost_nusd


def test_achain_accepts_async_stages(shared: System) -> None:
    async def shout(text: str) -> str:
        await asyncio.sleep(0)
        return f"LOUDER: {text}"

    out = asyncio.run(achain(shared, ["{input}", shout], "hi"))
    assert out.ok
    assert len(out.results) == 2


def test_a_blocking_chain_refuses_an_async_stage_and_sends_nothing_more(
    shared: System, recwarn: pytest.WarningsRecorder
) -> None:
    async def shout(text: str) -> str:
        return f"LOUDER: {text}"

    before = _counts(shared)
    with pytest.raises(UsageError, match="achain"):
        chain(shared, ["{input}", shout, "{input}"], "hi")
    assert _since(shared, before)["accepted"] == 1  # the first stage ran; nothing after it
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


# -- the submitter interface ----------------------------------------------------------------


class Counting:
    """A ``Submitter`` in front of a system: counts what the patterns ask of it."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.calls: Counter[str] = Counter()

    def submit(self, prompt: Any, /, **fields: Any) -> concurrent.futures.Future[Result]:
        self.calls["submit"] += 1
        return self.system.submit(prompt, **fields)

    def submit_many(
        self, prompts: Any, /, **fields: Any
    ) -> list[concurrent.futures.Future[Result]]:
        self.calls["submit_many"] += 1
        return self.system.submit_many(prompts, **fields)

    def cancel(self, *task_ids: int) -> None:
        self.calls["cancel"] += 1
        self.system.cancel(*task_ids)


def test_every_pattern_runs_on_any_submitter(shared: System) -> None:
    sub = Counting(shared)
    assert [r.ok for r in gather(sub, ["a", "b"], model="fast")] == [True, True]
    assert race(sub, "hedge", models=["slow", "fast"], timeout=WAIT_S).model == "fast"
    assert chain(sub, ["{input}", "again: {input}"], "x", model="fast").ok
    done = threading.Event()
    fire_and_forget(sub, "y", model="fast", on_result=lambda _: done.set(), on_error=_never)
    assert done.wait(WAIT_S)
    # one burst each for gather and race, a submit per stage and one for the callback;
    # the race's loser was in flight at the win: asked to cancel (its real result comes)
    assert sub.calls == {"submit_many": 2, "submit": 3, "cancel": 1}


def test_the_systems_methods_are_the_patterns(shared: System) -> None:
    first = shared.gather(["q1", "q2"], return_when="first", model="fast")
    assert isinstance(first, Completed)
    out = shared.chain(["{input}"], "x", model="fast")
    assert out.ok
    assert [r.model for r in shared.as_completed(["p"], timeout=WAIT_S, model="fast")] == ["fast"]


# -- callbacks --------------------------------------------------------------------------------


def test_fire_and_forget_calls_on_result_off_the_actor_threads(
    shared: System, runner: CallbackRunner
) -> None:
    got: list[tuple[Result, str]] = []
    done = threading.Event()

    def on_result(result: Result) -> None:
        got.append((result, threading.current_thread().name))
        done.set()

    future = fire_and_forget(shared, "hi", on_result=on_result, on_error=_never, runner=runner)
    assert future is not None
    assert done.wait(WAIT_S)
    ((result, thread),) = got
    assert result.ok
    assert thread.startswith("callboard-callback")


def test_on_error_gets_every_failure_and_every_submit_exception(
    shared: System, runner: CallbackRunner
) -> None:
    errors: list[Result | BaseException] = []
    three = threading.Semaphore(0)

    def on_error(what: Result | BaseException) -> None:
        errors.append(what)
        three.release()

    assert fire_and_forget(shared, "x", model="bad", on_error=on_error, runner=runner) is not None
    assert fire_and_forget(shared, "   ", on_error=on_error, runner=runner) is None
    assert fire_and_forget(shared, "x", model="nope", on_error=on_error, runner=runner) is None
    for _ in range(3):
        assert three.acquire(timeout=WAIT_S)
    kinds = {type(e) for e in errors}
    assert kinds == {Failed, InvalidRequestError, UnknownModelError}


def test_a_blocked_callback_does_not_delay_other_results(
    shared: System, runner: CallbackRunner
) -> None:
    gate, blocked, other = threading.Event(), threading.Event(), threading.Event()

    def stuck(_: Result) -> None:
        blocked.set()
        gate.wait(WAIT_S)

    fire_and_forget(shared, "first", on_result=stuck, on_error=_never, runner=runner)
    assert blocked.wait(WAIT_S)
    results = gather(shared, [f"q{i}" for i in range(20)], timeout=WAIT_S)
    assert all(r.ok for r in results)
    fire_and_forget(shared, "next", on_result=lambda _: other.set(), on_error=_never, runner=runner)
    assert other.wait(WAIT_S), "the second worker serves callbacks while the first is stuck"
    assert not gate.is_set()
    gate.set()


def test_a_failing_callback_is_logged_with_its_task(
    shared: System, runner: CallbackRunner, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(_: Result) -> None:
        raise ValueError("boom")

    future = fire_and_forget(shared, "hi", on_result=broken, on_error=_never, runner=runner)
    assert future is not None
    result = future.result(WAIT_S)
    with caplog.at_level(logging.ERROR, logger="callboard.patterns"):
        runner.close()  # waits for the scheduled callbacks
    (record,) = [r for r in caplog.records if r.name == "callboard.patterns"]
    assert f"task {result.task_id}" in record.getMessage()
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ValueError)


def test_async_callbacks_run_on_the_callers_loop(shared: System, runner: CallbackRunner) -> None:
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        ran: asyncio.Future[int] = loop.create_future()

        async def on_result(_: Result) -> None:
            ran.set_result(threading.get_ident())

        fire_and_forget(shared, "hi", on_result=on_result, on_error=_never, runner=runner)
        return await asyncio.wait_for(ran, WAIT_S), threading.get_ident()

    callback_thread, loop_thread = asyncio.run(main())
    assert callback_thread == loop_thread


def test_async_callbacks_without_a_loop_run_on_the_runners_loop_thread(shared: System) -> None:
    names: list[str] = []
    done = threading.Event()

    async def on_result(_: Result) -> None:
        names.append(threading.current_thread().name)
        done.set()

    with CallbackRunner() as runner:
        fire_and_forget(shared, "hi", on_result=on_result, on_error=_never, runner=runner)
        assert done.wait(WAIT_S)
    assert names == ["callboard-callback-loop"]


def _never(what: object) -> None:
    raise AssertionError(f"on_error called with {what!r}")


def test_on_error_hears_of_a_future_the_caller_cancelled(
    shared: System, runner: CallbackRunner
) -> None:
    errors: list[Result | BaseException] = []
    called = threading.Event()

    def on_error(what: Result | BaseException) -> None:
        errors.append(what)
        called.set()

    blocker = shared.submit("hold the only slot", model="single")
    future = fire_and_forget(shared, "x", model="single", on_error=on_error, runner=runner)
    assert future is not None
    assert future.cancel()
    assert called.wait(WAIT_S)
    assert [type(e) for e in errors] == [concurrent.futures.CancelledError]
    assert blocker.result(WAIT_S).ok


def test_a_sync_callback_may_return_an_awaitable_which_is_run() -> None:
    done = threading.Event()

    async def later() -> None:
        done.set()

    with CallbackRunner() as runner:
        runner.run(lambda _: later(), "x")
        assert done.wait(WAIT_S)


def test_a_closed_runner_logs_a_callback_it_cannot_run(caplog: pytest.LogCaptureFixture) -> None:
    runner = CallbackRunner()
    runner.close()
    with caplog.at_level(logging.ERROR, logger="callboard.patterns"):
        runner.run(_never, "late")
    assert "runner is closed" in caplog.text


# -- races, gathers and chains: billing, cancelling, fields and keys -----------------------


SHORT_S = 5.0
"""How long a future that should resolve promptly is given."""


def test_race_of_one_model_twice_with_an_idempotency_key_refuses_neither(
    provider: SimulatedProvider,
) -> None:
    """Each entrant's key was ``key:model``: the same model twice refused its twin as a
    duplicate (found by a hunt)."""
    provider.configure("alpha", ModelBehaviour(latency_s=0.01))
    with System(SystemConfig(models=two_models(provider.base_url))) as own:
        raced = own.race("hi", models=["alpha", "alpha"], idempotency_key="twin", timeout=SHORT_S)
        losers = raced.losers.result(SHORT_S)
    assert raced.ok
    assert not [r for r in losers if isinstance(r, Rejected)], losers


def test_race_entrants_do_not_fall_back_onto_each_others_models(
    provider: SimulatedProvider,
) -> None:
    """alpha fails and has beta as its fallback: its entrant went on to beta, which the
    other entrant was already asking, and beta was called and paid twice (found by a
    hunt). Each entrant keeps to its own model."""
    provider.configure("alpha", ModelBehaviour(latency_s=0.01, status=400))  # never retried
    provider.configure("beta", ModelBehaviour(latency_s=0.05))
    alpha, beta = two_models(provider.base_url)
    models = (dataclasses.replace(alpha, fallbacks=("beta",)), beta)
    with System(SystemConfig(models=models)) as own:
        raced = own.race("hi", models=["alpha", "beta"], timeout=SHORT_S)
        (loser,) = raced.losers.result(SHORT_S)
        allowed = own.race(
            "hi", models=["alpha", "beta"], models_allowed=["alpha", "beta"], timeout=SHORT_S
        )
        allowed.losers.result(SHORT_S)
    assert raced.model == allowed.model == "beta"
    assert isinstance(loser, Failed)
    assert loser.model == "alpha"
    assert served(provider, "beta")["requests"] == 2, "once a race, with models_allowed too"


def test_race_with_an_idempotency_key_still_hedges(provider: SimulatedProvider) -> None:
    provider.configure("alpha", ModelBehaviour(latency_s=0.01, status=400))  # never retried
    with System(SystemConfig(models=two_models(provider.base_url))) as own:
        plain = own.race("hi", models=["alpha", "beta"], timeout=SHORT_S)
        assert plain.ok
        assert plain.model == "beta"
        keyed = own.race("hi", models=["alpha", "beta"], idempotency_key="rk", timeout=SHORT_S)
        losers = keyed.losers.result(SHORT_S)
    assert keyed.ok, (keyed.result, losers)
    assert keyed.model == "beta"


def test_a_race_bills_every_entrant_sent_and_cancels_the_unsent_one(
    assorted_system: System, provider: SimulatedProvider
) -> None:
    race = assorted_system.race("hello", models=["alpha", "slow"], timeout=WAIT_S)
    assert race.ok
    assert race.model == "alpha"
    (loser,) = race.losers.result(WAIT_S)
    assert isinstance(loser, Completed)
    assert loser.model == "slow"
    assert race.total_cost_usd(WAIT_S) == Decimal(race.result.cost_nusd + loser.cost_nusd) / (10**9)
    blocker = assorted_system.submit("hold the single slot", model="single")
    assert wait_until(lambda: served(provider, "single").get("in_flight", 0) == 1)
    second = assorted_system.race("again", models=["alpha", "single"], timeout=WAIT_S)
    assert second.model == "alpha"
    (unsent,) = second.losers.result(WAIT_S)
    assert isinstance(unsent, Cancelled)
    assert unsent.cost_nusd == 0
    assert blocker.result(WAIT_S).ok
    assert assorted_system.drain(WAIT_S)
    stats = assorted_system.stats()
    assert stats.outcomes == {"completed": 4, "cancelled": 1}
    assert served(provider, "single")["requests"] == 1  # the cancelled loser was never sent
    assert served(provider, "slow")["requests"] == 1
    expected = race.result.cost_nusd + loser.cost_nusd + second.result.cost_nusd
    expected += blocker.result().cost_nusd
    assert stats.total.cost_nusd == expected
    assert len({race.trace_id, second.trace_id}) == 2


def test_gather_refuses_a_bare_string_before_sending_anything(assorted_system: System) -> None:
    before = assorted_system.stats().ledger["accepted"]
    with pytest.raises(UsageError):
        assorted_system.gather("hi")
    assert assorted_system.stats().ledger["accepted"] == before


def test_a_chain_stage_returning_a_request_does_not_drop_the_chains_fields(
    assorted_system: System,
) -> None:
    out = assorted_system.chain(["first: {input}", Request.of], "go", model="beta")
    assert out.ok
    assert [r.model for r in out.results] == ["beta", "beta"]


def test_a_chain_with_an_idempotency_key_runs_every_stage(assorted_system: System) -> None:
    out = assorted_system.chain(["a {input}", "b {input}"], "x", model="alpha", idempotency_key="k")
    assert out.ok, out.result  # each stage's key is its own ("k:<stage>")
    assert len(out.results) == 2


def test_chain_stops_at_a_failure_and_shares_one_trace_id(assorted_system: System) -> None:
    out = assorted_system.chain(["a {input}", "b {input}", "c {input}"], "x", model="alpha")
    assert out.ok
    assert len(out.results) == 3
    assert {r.trace_id for r in out.results} == {out.trace_id}
    failed = assorted_system.chain(
        ["a {input}", lambda t: {"prompt": t, "model": "bad"}, "never {input}"], "x", model="alpha"
    )
    assert not failed.ok
    assert failed.failed_stage == 1
    assert len(failed.results) == 2


def test_gather_first_returns_one_result_and_cancels_the_unsent_rest(
    assorted_system: System, provider: SimulatedProvider
) -> None:
    first = assorted_system.gather(["one", "two", "three"], return_when="first", model="single")
    assert first.ok
    assert assorted_system.drain(WAIT_S)
    outcomes = assorted_system.stats().outcomes
    # a freed slot is refilled before its result is delivered: the next may be sent already
    assert outcomes.get("cancelled", 0) >= 1
    assert outcomes["completed"] + outcomes["cancelled"] == 3
    assert served(provider, "single")["requests"] == outcomes["completed"]


def test_a_burst_larger_than_the_queue_is_queue_full_not_a_timeout(
    provider: SimulatedProvider,
) -> None:
    """With ``wait_s`` above its ``timeout``, every queue-full became a timeout, the
    burst that can never fit too, as if waiting might help (found by a review)."""
    model = ModelSettings(name="m", base_url=provider.base_url)
    config = SystemConfig(models=(model,), scheduler=SchedulerSettings(capacity=1))
    with System(config) as system, pytest.raises(QueueFullError, match="can never fit"):
        system.gather(["a", "b"], wait_s=5, timeout=1)
