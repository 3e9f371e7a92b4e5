"""The model actor against the simulated provider over real loopback HTTP.

Limits, Retry-After, retries, the breaker and secrets are checked from the
server's side (its counters and arrival times), never by timing the client:
the limiter charges what a call may have cost and settles what it used, a 429
pauses the model for what the provider says, the breaker lets one probe
through at a time, half-opens on its own timer and gives a recovered model its
work back, a refusal for good moves the task on at once, no call starts after
its task's deadline and a call in flight is cut at it. Where the simulated
provider cannot do what a test needs, a ``WireServer`` (tests/loopback.py)
answers what the test tells it to, i.e. a misbehaving provider.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from aiohttp import web
from callboard.bench.provider_process import ProviderProcess
from callboard.core.breaker import BreakerConfig
from callboard.core.health import LIMITED_RUN
from callboard.core.limiter import LimiterConfig
from callboard.core.pricing import Price, cost_nusd
from callboard.core.retry import RetryConfig
from callboard.core.tokens import MESSAGE_OVERHEAD, REPLY_PRIMER, text_tokens
from callboard.messages import Crash, GetState, Result
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from loopback import USAGE, Arrival, Gate, Reply, WireServer, completion_body, replying
from support import WAIT_S, dead_port, running, served, wait_until

from callboard import (
    BudgetSettings,
    Completed,
    Expired,
    Failed,
    FailureReason,
    ModelSettings,
    Priority,
    SchedulerSettings,
    Secret,
    StreamFailedError,
    System,
    SystemConfig,
    Timeouts,
    Usage,
)


def run(system: System, n: int, **fields: object) -> list[object]:
    futures = system.submit_many([f"prompt {i}" for i in range(n)], **fields)
    _, pending = wait(futures, timeout=60)
    assert not pending
    return [f.result() for f in futures]


def model(provider: SimulatedProvider, **overrides: object) -> ModelSettings:
    fields: dict[str, object] = {"name": "m", "base_url": provider.base_url, "max_concurrency": 32}
    fields.update(overrides)
    return ModelSettings(**fields)  # type: ignore[arg-type]


def test_paced_to_the_server_limit_draws_no_429(provider_in_process: ProviderProcess) -> None:
    # The provider runs in its own process, as a real one would: server-side
    # arrival times are then not distorted by our own threads holding the GIL.
    rpm = 6000  # 100 requests per second
    # The server's bucket holds 2 s worth, ours 0.5 s: the margin absorbs a server
    # that stalls (2 cores shared with the client) and then meets a backlog at once.
    provider_in_process.configure("m", latency_s=0.005, rpm=rpm, burst_s=2.0)
    settings = ModelSettings(
        name="m",
        base_url=provider_in_process.base_url,
        max_concurrency=32,
        limiter=LimiterConfig(rpm=rpm, tpm=None, burst_s=0.5),
    )
    with System(SystemConfig(models=(settings,))) as system:
        results = run(system, 600, max_tokens=16)
        health = system.stats().models["m"]
    assert all(isinstance(r, Completed) for r in results)
    assert health["breaker"] == "closed"
    assert health["latency_ewma_s"] > 0
    assert health["requests_headroom"] is not None
    assert health["tokens_headroom"] is None  # no token limit configured
    server = provider_in_process.stats()["models"]["m"]
    assert server["rate_limited"] == 0
    assert server["requests"] == 600
    # Pacing itself (no 60 s window over the limit, bursts bounded) is proved on
    # admission times by the limiter's state-machine tests; achieved rate / limit
    # is a bench figure. Here: the server, counting at arrival, never refused.


def test_retry_after_is_honoured(provider: SimulatedProvider) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.001, status=429, retry_after_s=2))
    retry = RetryConfig(max_attempts=1, max_rate_limited=2, initial_s=0.01, jitter_s=0.0)
    settings = model(provider, retry=retry)
    with System(SystemConfig(models=(settings,))) as system:
        (result,) = run(system, 1)
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.RATE_LIMITED
    assert result.attempts == 2, "a 429 is no attempt: max_rate_limited bounds them"
    arrivals = provider.stats()["models"]["m"]["arrivals"]
    assert len(arrivals) == 2
    assert arrivals[1] - arrivals[0] >= 2.0


def test_injected_500s_are_retried_until_every_request_succeeds(
    provider: SimulatedProvider,
) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.002, error_rate=0.10))
    settings = model(
        provider,
        retry=RetryConfig(max_attempts=6, initial_s=0.01, max_s=0.1, jitter_s=0.01),
        breaker=BreakerConfig(consecutive_failures=50, min_calls=1000),
    )
    with System(SystemConfig(models=(settings,))) as system:
        results = run(system, 300, max_tokens=8)
    assert all(isinstance(r, Completed) for r in results), [r for r in results if not r.ok]
    server = provider.stats()["models"]["m"]
    failures = server["responses"].get("500", 0)
    assert failures > 0
    assert server["requests"] == 300 + failures
    assert sum(r.attempts for r in results) == server["requests"]


def test_breaker_opens_on_outage_sends_nothing_and_closes_on_recovery(
    provider: SimulatedProvider, caplog: pytest.LogCaptureFixture
) -> None:
    settings = model(
        provider,
        retry=RetryConfig(max_attempts=1),
        breaker=BreakerConfig(consecutive_failures=3, cooldown_s=0.3, max_cooldown_s=1.0),
        timeout=Timeouts(connect=1.0, read=5.0, total=5.0),
    )
    with System(SystemConfig(models=(settings,))) as system:
        provider.pause()  # connection refused
        down = run(system, 3)
        assert all(isinstance(r, Failed) and r.reason is FailureReason.CONNECTION for r in down)
        state = system.ask("model:m", GetState())
        assert state["breaker"] == "open"
        assert state["sent"] == 3
        # why, as it opens (said only when given up on, a minute on; found by a hunt)
        opened = [r.getMessage() for r in caplog.records if "breaker open" in r.getMessage()]
        assert len(opened) == 1
        assert opened[0].startswith("m: breaker open (last failure: connection: connection refused")
        later = system.submit_many([f"later {i}" for i in range(5)])
        provider.resume()
        results = [f.result(WAIT_S) for f in later]
        assert all(isinstance(r, Completed) for r in results), results
        state = system.ask("model:m", GetState())
    assert state["breaker"] == "closed"
    assert state["sent"] == 3 + 5  # nothing was sent while the breaker was open
    assert provider.stats()["models"]["m"]["requests"] == 5


def test_a_request_error_is_not_retried(provider: SimulatedProvider) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.001, status=400))
    settings = model(provider, retry=RetryConfig(max_attempts=5, initial_s=0.01))
    with System(SystemConfig(models=(settings,))) as system:
        (result,) = run(system, 1)
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.REQUEST_ERROR
    assert result.status_code == 400
    assert result.attempts == 1
    assert provider.stats()["models"]["m"]["requests"] == 1


def test_the_api_key_never_reaches_logs_results_or_reprs(caplog: pytest.LogCaptureFixture) -> None:
    key = "sk-test-SECRET-0123456789"
    caplog.set_level(logging.DEBUG)
    # a provider of its own: this one checks the key
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.005), api_key=key, seed=5) as keyed:
        keyed.configure("m", ModelBehaviour(latency_s=0.001, error_rate=0.3, malformed_rate=0.2))
        good = model(
            keyed,
            api_key=Secret(key),
            retry=RetryConfig(max_attempts=2, initial_s=0.01),
            breaker=BreakerConfig(consecutive_failures=100, min_calls=1000),
        )
        bad = model(keyed, name="wrong", api_key=Secret(key + "-wrong"), retry=RetryConfig())
        with System(SystemConfig(models=(good, bad))) as system:
            results = run(system, 40) + run(system, 5, model="wrong")
            shown = repr(system) + repr(system.models) + repr(system.stats())
    assert any(r.ok for r in results)
    unauthorized = results[-5:]
    assert all(isinstance(r, Failed) and r.status_code == 401 for r in unauthorized)
    text = caplog.text + shown + "".join(repr(r) + str(getattr(r, "detail", "")) for r in results)
    assert key not in text
    assert "SECRET" not in text


def test_a_hung_call_times_out_per_attempt_and_the_deadline_bounds_retries(
    provider: SimulatedProvider,
) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.001, timeout_rate=1.0, hang_s=30))
    settings = model(
        provider,
        timeout=Timeouts(connect=1.0, read=0.2, total=0.25),
        retry=RetryConfig(max_attempts=4, initial_s=0.01, jitter_s=0.0),
        breaker=BreakerConfig(consecutive_failures=100, min_calls=1000),
    )
    with System(SystemConfig(models=(settings,))) as system:
        (capped,) = run(system, 1)
        (bounded,) = run(system, 1, deadline_s=0.6)
    assert isinstance(capped, Failed)
    assert capped.reason is FailureReason.TIMEOUT
    assert capped.attempts == 4
    # 0.25 s each: the deadline stops the retries, or cuts the attempt in flight at it
    cut = isinstance(bounded, Expired)
    assert cut or (isinstance(bounded, Failed) and bounded.reason is FailureReason.TIMEOUT)
    assert 1 <= bounded.attempts <= 3
    assert bounded.latency_s < 1.0


@pytest.mark.parametrize("fallback", [True, False], ids=["to-the-fallback", "no-fallback"])
def test_a_call_above_the_tpm_limit_at_admission_goes_to_a_fallback_else_fails_unsent(
    provider: SimulatedProvider, fallback: bool
) -> None:
    # The router's plan leaves such a call out; here it is made to let it through (as a
    # plan would that did not know the limit), so the model's own admission meets it.
    small = model(
        provider,
        name="small",
        limiter=LimiterConfig(rpm=None, tpm=1000),
        fallbacks=("big",) if fallback else (),
    )
    with System(SystemConfig(models=(small, model(provider, name="big")))) as system:
        system.policy._fits["small"] = float("inf")
        result = system.submit("too big for small", model="small", max_tokens=4000).result(WAIT_S)
    assert provider.stats()["models"].get("small", {}).get("requests", 0) == 0
    if fallback:
        assert isinstance(result, Completed), result
        assert result.model == "big"
        assert result.attempts == 1
    else:
        assert isinstance(result, Failed), result
        assert result.reason is FailureReason.REQUEST_ERROR
        assert result.attempts == 0
        assert "admits 1000 per minute" in result.detail


def test_a_fallback_counts_its_own_attempts_and_the_result_counts_them_all(
    provider: SimulatedProvider,
) -> None:
    provider.configure("primary", ModelBehaviour(latency_s=0.001, status=500))
    provider.configure("backup", ModelBehaviour(latency_s=0.001, status=500))
    retry = RetryConfig(max_attempts=3, initial_s=0.001, jitter_s=0.001)
    never_open = BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000)
    primary = model(
        provider, name="primary", fallbacks=("backup",), retry=retry, breaker=never_open
    )
    backup = model(provider, name="backup", retry=RetryConfig(max_attempts=2, initial_s=0.001))
    with System(SystemConfig(models=(primary, backup))) as system:
        (result,) = run(system, 1, model="primary")
    models = provider.stats()["models"]
    requests = {m: s["requests"] for m, s in models.items() if s["requests"]}
    assert requests == {"primary": 3, "backup": 2}  # each by its own max_attempts, no other
    assert isinstance(result, Failed)
    assert result.model == "backup"
    assert result.attempts == 5


def test_restamped_keeps_the_per_model_attempt_count() -> None:
    import dataclasses

    from callboard.actors.base import restamped
    from callboard.messages import Job, Request, Task

    task = Task(task_id=1, trace_id="t", request=Request.of("x"), submitted_at=0.0)
    job = dataclasses.replace(Job(task=task, candidates=("m",)), attempt=3, model_attempt=2)
    again = restamped(job, attempt=4, dispatched_at=1.0)
    assert (again.attempt, again.model_attempt, again.dispatched_at) == (4, 2, 1.0)


# -- an open breaker: recovery, and what it costs meanwhile ---------------------------------


class _Tally:
    """Counts finished tasks by the model that served them, and wakes a waiter when a
    count reaches a mark (futures' callbacks: no polling)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_model: Counter[str] = Counter()
        self._marks: list[tuple[str, int, threading.Event]] = []

    def watch(self, futures: list[Any]) -> None:
        for f in futures:
            f.add_done_callback(self._done)

    def _done(self, future: Any) -> None:
        result = future.result()
        with self._lock:
            self.by_model[result.model or "-"] += 1
            self.by_model["*"] += 1
            for model, count, event in self._marks:
                if self.by_model[model] >= count:
                    event.set()

    def reached(self, model: str, count: int) -> threading.Event:
        """An event set once ``count`` tasks have finished on ``model`` ("*": any)."""
        event = threading.Event()
        with self._lock:
            self._marks.append((model, count, event))
            if self.by_model[model] >= count:
                event.set()
        return event


class _BreakerMoves(logging.Handler):
    """The model actor's "breaker <state>" log lines, as events to wait on."""

    def __init__(self, model: str) -> None:
        super().__init__(logging.WARNING)
        self._prefix = f"{model}: breaker "
        self.counts: Counter[str] = Counter()
        self.moved = {state: threading.Event() for state in ("open", "half_open", "closed")}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith(self._prefix):
            state = text[len(self._prefix) :].split(" ", 1)[0]  # (an opening says why)
            self.counts[state] += 1
            self.moved[state].set()


@pytest.fixture
def breaker_moves() -> Iterator[Callable[[str], _BreakerMoves]]:
    logger = logging.getLogger("callboard.actors.model")
    handlers: list[_BreakerMoves] = []

    def watch(model: str) -> _BreakerMoves:
        handler = _BreakerMoves(model)
        logger.addHandler(handler)
        handlers.append(handler)
        return handler

    yield watch
    for handler in handlers:
        logger.removeHandler(handler)


def test_a_primary_down_in_a_burst_serves_again_before_the_burst_ends(
    provider: SimulatedProvider,
) -> None:
    """Issue 13: the primary goes down about a second into a burst of 600 tasks and is
    back about two seconds later. The work moved to the fallback meanwhile goes back to
    the primary once its breaker closes: it serves most of what is left."""
    healthy = ModelBehaviour(latency_s=0.02)
    provider.configure("primary", healthy)
    provider.configure("backup", ModelBehaviour(latency_s=0.05))
    primary = model(
        provider,
        name="primary",
        max_concurrency=4,
        fallbacks=("backup",),
        breaker=BreakerConfig(consecutive_failures=3, cooldown_s=0.2, max_cooldown_s=0.4),
        retry=RetryConfig(max_attempts=2, initial_s=0.01, jitter_s=0.0),
    )
    backup = model(provider, name="backup", max_concurrency=4)
    tally = _Tally()
    with System(SystemConfig(models=(primary, backup))) as system:
        futures = system.submit_many([f"burst {i}" for i in range(600)], model="primary")
        tally.watch(futures)
        # about a second in (the primary alone serves ~150 a second here)
        assert tally.reached("primary", 150).wait(WAIT_S)
        provider.configure("primary", ModelBehaviour(latency_s=0.005, status=503))
        moved_on = tally.by_model["backup"]
        # about two seconds later: the backup (~80 a second) carried the burst meanwhile
        assert tally.reached("backup", moved_on + 150).wait(WAIT_S)
        down = system.ask("model:primary", GetState())
        queue = system.ask("queue", GetState())
        provider.configure("primary", healthy)
        served_before = tally.by_model["primary"]
        finished_before = tally.by_model["*"]
        results = [f.result(WAIT_S) for f in futures]
    assert down["breaker"] in ("open", "half_open")
    assert down["timers"] <= 3  # its reopen time, its give-up time, a health report owed
    assert queue["down"] == ["primary"]
    assert queue["waiting_for"]["backup"] >= queue["waiting_for"]["primary"] > 0  # kept for it
    assert all(isinstance(r, Completed) for r in results), Counter(type(r) for r in results)
    left = len(results) - finished_before
    assert left >= 100  # the burst was far from over when the primary came back
    served_after = Counter(r.model for r in results)["primary"] - served_before
    assert served_after >= left // 2, (served_after, left)


def test_an_open_breaker_half_opens_on_its_own_timer_holding_nothing_meanwhile(
    provider: SimulatedProvider, breaker_moves: Callable[[str], _BreakerMoves]
) -> None:
    """No task has to arrive for an open breaker to half-open; its probe then takes the
    first task that prefers it, though the fallback is free; once closed, the work is its."""
    provider.configure("m", ModelBehaviour(latency_s=0.002, status=503))
    provider.configure("spare", ModelBehaviour(latency_s=0.002))
    primary = model(
        provider,
        fallbacks=("spare",),
        breaker=BreakerConfig(consecutive_failures=2, cooldown_s=0.3, max_cooldown_s=0.3),
        retry=RetryConfig(max_attempts=1),
    )
    moves = breaker_moves("m")
    with System(SystemConfig(models=(primary, model(provider, name="spare")))) as system:
        first = run(system, 2, model="m")  # both fail at m and complete on spare
        assert moves.moved["open"].wait(WAIT_S)
        opened = system.ask("model:m", GetState())
        assert moves.moved["half_open"].wait(WAIT_S)  # no task was submitted meanwhile
        half = system.ask("model:m", GetState())
        provider.configure("m", ModelBehaviour(latency_s=0.002))
        (probe,) = run(system, 1, model="m")
        assert moves.moved["closed"].wait(WAIT_S)
        later = run(system, 20, model="m")
        state = system.ask("model:m", GetState())
    assert [r.model for r in first] == ["spare", "spare"]
    assert opened["breaker"] in ("open", "half_open")
    assert (opened["admitting"], opened["retrying"]) == (0, 0)  # an open breaker holds nothing
    assert opened["timers"] <= 2
    assert half["sent"] == 2  # half-open with no work: no probe is made up
    assert isinstance(probe, Completed)
    assert probe.model == "m"
    assert [r.model for r in later] == ["m"] * 20  # closed again: the work is m's
    assert state["breaker"] == "closed"


def test_a_provider_that_stays_down_costs_one_timer_per_wake_up(
    provider: SimulatedProvider,
    breaker_moves: Callable[[str], _BreakerMoves],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 14: against a dead provider a model actor set one more timer at every
    wake-up (a timer that rang for another made the next one), and they doubled with
    each cool-down until the process ran out of memory."""
    from callboard.actors.base import Runtime

    timers: Counter[str] = Counter()
    real_after = Runtime.after

    def counting_after(self: Runtime, delay: float, name: str, message: Any) -> None:
        timers[name] += 1
        real_after(self, delay, name, message)

    monkeypatch.setattr(Runtime, "after", counting_after)
    provider.configure("m", ModelBehaviour(latency_s=0.001, status=503))
    settings = model(
        provider,
        breaker=BreakerConfig(consecutive_failures=1, cooldown_s=0.02, max_cooldown_s=0.05),
        retry=RetryConfig(max_attempts=1000, initial_s=0.01, jitter_s=0.0),
    )
    moves = breaker_moves("m")
    with System(SystemConfig(models=(settings,))) as system:
        doomed = system.submit_many([f"doomed {i}" for i in range(5)])
        for cycles in (5, 10, 20, 30):  # each cycle: open, its timer, half-open, a probe
            event = threading.Event()
            moves.moved["open"] = event
            while moves.counts["open"] < cycles:
                assert event.wait(WAIT_S)
                event.clear()
        state = system.ask("model:m", GetState())
        opened = moves.counts["open"]
        set_ = timers["model:m"]
        system.cancel(*(f.task_id for f in doomed))
    assert state["timers"] <= 3
    assert set_ <= 4 * opened + 20, (set_, opened)


# -- what a call is charged, 429s and refusals for good, half-open probes, deadlines -------

NEVER_OPEN = BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000)


def misbehaving(reply: Callable[[int, Any], Reply]) -> WireServer:
    """An OpenAI-shaped endpoint that answers ``reply(n, body)`` to the n-th request."""
    return WireServer(replying(reply))


def completion(usage: object = None) -> bytes:
    """A chat.completion body; ``usage`` None leaves the field out."""
    return json.dumps(completion_body(usage=usage)).encode()


def results(futures: list[Future[Result]]) -> list[Result]:
    _, pending = wait(futures, timeout=WAIT_S)
    assert not pending
    return [f.result() for f in futures]


def reserved_tokens(prompt: str, max_tokens: int) -> int:
    """What the limiter reserves for a one-message prompt (estimate + max_tokens)."""
    return text_tokens(prompt) + MESSAGE_OVERHEAD + REPLY_PRIMER + max_tokens


def _breaker(system: System, model: str) -> str:
    return str(system.ask(f"model:{model}", GetState())["breaker"])


def _server_requests(provider: SimulatedProvider, model: str) -> int:
    return int(served(provider, model).get("requests", 0))


def test_a_completion_without_usage_keeps_its_token_reservation() -> None:
    # tpm=300 and every call reserves 117 tokens: the window admits two in a
    # minute and the bucket (2.5 tokens) one now. A provider that does not say
    # what a call used must not make it free: three calls must not go at once.
    prompt, max_tokens, tpm = "x" * 40, 100, 300
    per_call = reserved_tokens(prompt, max_tokens)
    assert 2 * per_call <= tpm < 3 * per_call
    with misbehaving(lambda n, body: (200, {}, completion(usage=None))) as rogue:
        m = ModelSettings(
            name="m",
            base_url=rogue.base_url,
            max_concurrency=8,
            limiter=LimiterConfig(rpm=None, tpm=tpm),
        )
        with running(m) as system:
            # the first has time to be answered however loaded the machine; the others a
            # second, within which the limiter's bucket lets at most one more go
            deadlines = [WAIT_S, 1.0, 1.0, 1.0]
            done = results(
                [system.submit(prompt, max_tokens=max_tokens, deadline_s=d) for d in deadlines]
            )
        sent = rogue.count()
    assert isinstance(done[0], Completed)
    assert all(isinstance(r, Completed | Expired) for r in done), done
    # charged as the most it could have used, and said so
    assert done[0].usage.estimated
    assert done[0].usage.total_tokens == per_call
    assert sent * per_call <= tpm, f"{sent} calls of {per_call} tokens within a second at tpm={tpm}"


def test_a_completion_with_usage_settles_the_tokens_it_reports(provider: SimulatedProvider) -> None:
    # Control for the test above: with real usage the unused part is refunded (by a
    # provider that refunds it: here told so), and the next call goes as soon as the
    # bucket allows (here: at once).
    provider.configure("m", ModelBehaviour(latency_s=0.002, completion_tokens=1))
    m = ModelSettings(
        name="m",
        base_url=provider.base_url,
        max_concurrency=1,
        # 100 tokens in the bucket
        limiter=LimiterConfig(rpm=None, tpm=6000, burst_s=1.0, refunds=True),
    )
    with running(m) as system:
        first = system.submit("hello", max_tokens=60).result(WAIT_S)
        second = system.submit("hello", max_tokens=60).result(WAIT_S)
        room = system.ask("model:m", GetState())["limiter"]
    assert isinstance(first, Completed)
    assert isinstance(second, Completed)
    assert first.usage.total_tokens == second.usage.total_tokens == 10
    # both calls charged 10 tokens each, not 70: the bucket is short of about 20
    assert 60 <= room.tokens <= 100


@pytest.mark.parametrize(
    "fault",
    [
        {"error_rate": 1.0},
        {"malformed_rate": 1.0},
        {"drop_rate": 1.0},
    ],
    ids=["500", "malformed", "dropped"],
)
def test_a_served_call_without_usage_is_not_refunded(
    provider: SimulatedProvider, fault: dict[str, float]
) -> None:
    # The provider counts tokens when a request arrives (as OpenAI does), before
    # it fails it; so does the simulated one. The client's limit equals the
    # server's: pacing by the reservation never draws a 429.
    tpm = 300  # a bucket of a few tokens: each 49-token call leaves ~9 s of debt
    provider.configure(
        "m", ModelBehaviour(latency_s=0.002, completion_tokens=40, tpm=tpm, burst_s=1.0, **fault)
    )
    m = ModelSettings(
        name="m",
        base_url=provider.base_url,
        max_concurrency=8,
        retry=RetryConfig(max_attempts=1),
        breaker=NEVER_OPEN,
        limiter=LimiterConfig(rpm=None, tpm=tpm),
        timeout=Timeouts(connect=1.0, read=1.0, total=1.0),
    )
    with running(m) as system:
        done = results([system.submit(f"p{i}", max_tokens=40, deadline_s=1.0) for i in range(3)])
    server = provider.stats()["models"]["m"]
    assert all(isinstance(r, Failed | Expired) for r in done), done
    assert server["rate_limited"] == 0, server["responses"]


UNREADABLE = (200, {}, b'{"id": "chatcmpl-1", "choices": [')
"""A 200 whose body is cut: served, so billed, but unreadable."""
PRICED = Price(input_per_mtok=Decimal(1000), output_per_mtok=Decimal(2000))


def test_an_unreadable_answer_retried_or_moved_on_is_charged_to_its_task(
    provider: SimulatedProvider,
) -> None:
    """Each 200 the provider billed counts in the task's usage and cost, though it was
    retried, or its task went to a fallback: they were charged nothing, and a budget
    paid for 1 of 4 such calls (found by a hunt)."""
    answers = [UNREADABLE, UNREADABLE, (200, {}, completion(usage=USAGE))]
    retry = RetryConfig(max_attempts=3, initial_s=0.001, jitter_s=0.001)
    provider.configure("backup", ModelBehaviour(latency_s=0.001))
    with misbehaving(lambda n, body: answers[n] if n < len(answers) else UNREADABLE) as rogue:
        m = ModelSettings(
            name="m", base_url=rogue.base_url, retry=retry, breaker=NEVER_OPEN, price=PRICED
        )
        primary = dataclasses.replace(m, name="primary", fallbacks=("backup",))
        backup = model(provider, name="backup", price=PRICED)
        with running(m, primary, backup) as system:
            retried = system.submit("hello", model="m", max_tokens=16).result(WAIT_S)
            moved = system.submit("hello", model="primary", max_tokens=16).result(WAIT_S)
            stats = system.stats()
            spent = stats.total.cost_nusd
    estimate = Usage(prompt_tokens=reserved_tokens("hello", 0), completion_tokens=16)
    billed = cost_nusd(PRICED, estimate)
    by_model = {name: group.cost_nusd for name, group in stats.by_model.items()}
    assert isinstance(retried, Completed)
    assert retried.attempts == 3
    assert retried.usage.total_tokens == 10 + 2 * estimate.total_tokens
    assert retried.usage.estimated
    assert (
        retried.cost_nusd
        == cost_nusd(PRICED, Usage(prompt_tokens=7, completion_tokens=3)) + 2 * billed
    )
    assert isinstance(moved, Completed)
    assert (moved.model, moved.attempts) == ("backup", 4)
    assert moved.cost_nusd == cost_nusd(PRICED, moved.usage)
    assert moved.cost_nusd > 3 * billed  # the primary's three, and the backup's answer
    assert [b.model for b in moved.billed_before] == ["primary"] * 3
    assert spent == retried.cost_nusd + moved.cost_nusd
    # each model's figures hold what it billed: the primary's three calls were counted
    # on the backup, which answered the task (found by a hunt)
    assert by_model == {
        "m": retried.cost_nusd,
        "primary": 3 * billed,
        "backup": moved.cost_nusd - 3 * billed,
    }


def breaking_off(first_whole: int = 0) -> Callable[[web.Request, Arrival], Any]:
    """A handler that answers 200 with half its body, then resets the connection (billed,
    never read), but for requests from number ``first_whole`` on (0: none), whole."""
    whole = json.dumps(completion_body(usage=USAGE)).encode()

    async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
        if first_whole and arrival.index >= first_whole:
            return web.Response(body=whole, content_type="application/json")
        cut = web.StreamResponse(headers={"Content-Type": "application/json"})
        cut.content_length = len(whole)
        await cut.prepare(request)
        await cut.write(whole[: len(whole) // 2])
        assert request.transport is not None
        request.transport.abort()  # the connection resets mid-body
        return cut

    return handle


def test_an_answer_whose_body_broke_off_is_charged_to_its_task() -> None:
    """A 200 whose body a connection reset cut short was billed by the provider but
    taken for a bare connection error and charged nothing: a budget's calls were billed
    twice its cap (found by a hunt). It keeps its status and is charged its estimate."""
    retry = RetryConfig(max_attempts=2, initial_s=0.001, jitter_s=0.001)
    with WireServer(breaking_off(first_whole=1)) as server:
        m = ModelSettings(
            name="m", base_url=server.base_url, retry=retry, breaker=NEVER_OPEN, price=PRICED
        )
        with running(m) as system:
            result = system.submit("hello", max_tokens=16).result(WAIT_S)
            spent = system.stats().total.cost_nusd
    estimate = Usage(prompt_tokens=reserved_tokens("hello", 0), completion_tokens=16)
    assert isinstance(result, Completed), result
    assert result.attempts == 2
    answered = Usage(prompt_tokens=7, completion_tokens=3)  # loopback's USAGE
    assert result.cost_nusd == cost_nusd(PRICED, answered) + cost_nusd(PRICED, estimate)
    assert spent == result.cost_nusd


def test_billed_retries_stop_where_the_budget_does() -> None:
    """A retry's billed call was settled only at its task's end, so calls that were
    billed and served nothing went on past the budget: 1.8x its cap with half the
    answers broken off (found by a hunt). Charged as it comes, a task whose next call
    would go past the budget ends there, ``budget_exceeded``."""
    call = cost_nusd(PRICED, Usage(prompt_tokens=reserved_tokens("hello", 0), completion_tokens=16))
    retry = RetryConfig(max_attempts=3, initial_s=0.001, jitter_s=0.001)
    with WireServer(breaking_off()) as server:
        m = ModelSettings(
            name="m",
            base_url=server.base_url,
            retry=retry,
            breaker=NEVER_OPEN,
            price=PRICED,
            max_concurrency=2,
        )
        budget = BudgetSettings(total_usd=Decimal(10 * call) / 10**9)
        with System(SystemConfig(models=(m,), budget=budget)) as system:
            results = [f.result(WAIT_S) for f in system.submit_many(["hello"] * 12, max_tokens=16)]
            spent = system.stats().total.cost_nusd
        calls = server.count()
    reasons = Counter(getattr(r, "reason", None) for r in results)
    assert reasons[FailureReason.BUDGET_EXCEEDED] > 0, reasons
    assert spent == sum(r.cost_nusd for r in results) == calls * call  # each billed call
    assert spent <= 10 * call + 2 * call  # the cap, and the calls in flight at most


def test_a_billed_call_a_task_moved_on_from_is_charged_after_the_queue_restarts(
    provider: SimulatedProvider,
) -> None:
    """The ledger's record of the moved job (what a restarted queue rebuilds from)
    lacked what the call had cost: it vanished from the result (found by a review)."""
    provider.configure("backup", ModelBehaviour(latency_s=0.5))
    with misbehaving(lambda n, body: UNREADABLE) as rogue:
        primary = ModelSettings(
            name="primary",
            base_url=rogue.base_url,
            fallbacks=("backup",),
            retry=RetryConfig(max_attempts=1),
            breaker=NEVER_OPEN,
            price=PRICED,
        )
        backup = model(provider, name="backup", max_concurrency=1, price=PRICED)
        with running(primary, backup) as system:
            filler = system.submit("fill", model="backup", max_tokens=16)  # holds backup
            moved = system.submit("hello", model="primary", max_tokens=16)

            def waiting_paid() -> bool:
                jobs = [j for j in system.ledger.routed() if j.task.task_id == moved.task_id]
                return bool(jobs) and sum(b.cost_nusd for b in jobs[0].paid) > 0

            assert wait_until(waiting_paid)
            system.tell("queue", Crash(reason="a restart while the job waits"))
            result = moved.result(WAIT_S)
            assert filler.result(WAIT_S).ok
    billed = cost_nusd(
        PRICED, Usage(prompt_tokens=reserved_tokens("hello", 0), completion_tokens=16)
    )
    assert isinstance(result, Completed)
    assert result.model == "backup"
    assert result.usage.estimated  # the unreadable call's estimate is in it
    assert result.cost_nusd == cost_nusd(PRICED, result.usage) > billed


def test_a_stream_begun_when_its_model_actor_crashes_ends_cut_not_sent_again(
    provider: SimulatedProvider,
) -> None:
    """The new incarnation re-queued the call of a stream whose reader had part of it:
    the answer was written again after that part, and the reader got both, the task
    ending Completed (found by a hunt). A stream is never sent again once begun."""
    provider.configure("m", ModelBehaviour(latency_s=0.0, token_gap_s=0.02))
    with running(model(provider, name="m", price=PRICED)) as system:
        stream = system.stream("a story", model="m", max_tokens=60)
        reading = iter(stream)
        heard = [next(reading).text for _ in range(5)]
        system.tell("model:m", Crash(reason="a crash while a stream is read"))
        with pytest.raises(StreamFailedError):
            heard.extend(d.text for d in reading)
        result = stream.result(WAIT_S)
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.STREAM_CUT
    assert result.partial_text.startswith("".join(heard[:5]))
    assert "".join(heard) == result.partial_text  # nothing twice
    assert _server_requests(provider, "m") == 1
    assert result.usage.estimated
    assert result.cost_nusd == cost_nusd(PRICED, result.usage) > 0


def test_a_negative_usage_does_not_crash_the_model_actor() -> None:
    usage = {"prompt_tokens": -50, "completion_tokens": 10, "total_tokens": -40}
    with misbehaving(lambda n, body: (200, {}, completion(usage=usage))) as rogue:
        m = ModelSettings(
            name="m",
            base_url=rogue.base_url,
            max_concurrency=4,
            retry=RetryConfig(max_attempts=1),
            limiter=LimiterConfig(rpm=None, tpm=100_000),
        )
        with running(m) as system:
            future = system.submit("hello", max_tokens=16)
            wait([future], timeout=1.0)  # a crash loop never answers
            restarts = system.supervision()["model:m"]["restarts"]
            answered = future.done()
        sent = rogue.count()
    assert answered, f"no result after 1 s; the model actor restarted {restarts} times"
    assert restarts == 0
    assert sent == 1


def test_a_call_whose_answer_kills_the_actor_is_not_sent_again_for_ever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug that kills the model actor on every answer (a price it cannot read, found
    by a hunt) had each restart send the call again, paid each time, and the task never
    ended: the supervisor's backoff kept the restarts under its intensity. A task whose
    answer killed the actor twice fails."""

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("a bug in judging an answer")

    monkeypatch.setattr("callboard.actors.model.judge", broken)
    with misbehaving(lambda n, body: (200, {}, completion(usage=USAGE))) as provider:
        m = ModelSettings(
            name="m",
            base_url=provider.base_url,
            retry=RetryConfig(max_attempts=3, initial_s=0.01),
        )
        with running(m) as system:
            result = system.submit("hello").result(WAIT_S)
            alive = system.supervision()["model:m"]["restarts"]
        sent = provider.count()
    assert isinstance(result, Failed), result
    assert result.reason is FailureReason.INTERNAL
    assert "not sent again" in result.detail
    assert sent == alive == 2  # sent again once: a death may be another answer's fault


def test_a_crash_judging_one_answer_keeps_what_was_decided_for_the_others_in_its_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answers land in batches. Judging one raised (once), after others of its batch had
    been moved on to the fallback: ROUTED in the ledger already, their ``Enqueue`` was
    to go after the batch, and the crash dropped it. No successor reclaims a routed
    task, so they waited for nobody until stop (11 runs of 11; found by a hunt)."""
    from callboard.actors import model as model_actor

    judge, crashed = model_actor.judge, threading.Event()

    def once(r: Any, job: Any, *args: Any, **kwargs: Any) -> Any:
        if job.task.request.messages[-1].content == "POISON" and not crashed.is_set():
            crashed.set()
            raise RuntimeError("a one-off bug in judging this answer")
        return judge(r, job, *args, **kwargs)

    monkeypatch.setattr(model_actor, "judge", once)
    behaviours = {
        "alpha": ModelBehaviour(latency_s=0.05, status=500),  # every task moves on
        "beta": ModelBehaviour(latency_s=0.01),
    }
    with SimulatedProvider(models=behaviours, seed=1) as p:
        models = tuple(
            ModelSettings(
                name=name,
                base_url=p.base_url,
                max_concurrency=64,
                retry=RetryConfig(max_attempts=1),
            )
            for name in ("alpha", "beta")
        )
        config = SystemConfig(models=models, routes={"both": ("alpha", "beta")})
        with System(config) as system:
            prompts = [f"task {i}" for i in range(40)] + ["POISON"]
            futures = system.submit_many(prompts, route="both")
            results = [f.result(WAIT_S) for f in futures]
            restarts = system.supervision()["model:alpha"]["restarts"]
        served_by = {name: served(p, name)["requests"] for name in behaviours}
    assert crashed.is_set()
    assert restarts == 1
    assert Counter(type(r).__name__ for r in results) == {"Completed": 41}
    assert served_by["beta"] == 41  # each task once
    assert served_by["alpha"] in {41, 42}  # POISON's task may be called there again


def test_a_crash_judging_the_first_answer_of_a_batch_judges_the_rest_all_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Judging stopped at the answer that raised: those after it in the batch stayed in
    flight in the ledger, and the successor called each again, billed twice (28 of a
    batch of 29; found by a review). Only the crashing one is called again."""
    from callboard.actors import model as model_actor

    judge_all, judge = model_actor.ModelActor._judge_all, model_actor.judge
    armed, crashed, batch = threading.Event(), threading.Event(), []

    def judging(self: Any, msg: Any, *args: Any) -> Any:
        if len(msg.results) >= 4 and not armed.is_set():  # its first answer's judging
            batch.extend(r.task_id for r in msg.results)  # raises
            armed.set()
        return judge_all(self, msg, *args)

    def once(*args: Any, **kwargs: Any) -> Any:
        if armed.is_set() and not crashed.is_set():
            crashed.set()
            raise RuntimeError("a one-off bug judging the first answer of the batch")
        return judge(*args, **kwargs)

    monkeypatch.setattr(model_actor.ModelActor, "_judge_all", judging)
    monkeypatch.setattr(model_actor, "judge", once)
    with SimulatedProvider(models={"m": ModelBehaviour(latency_s=0.05)}, seed=1) as p:
        model = ModelSettings(
            name="m", base_url=p.base_url, max_concurrency=64, retry=RetryConfig(max_attempts=1)
        )
        with System(SystemConfig(models=(model,))) as system:
            results = [f.result(WAIT_S) for f in system.submit_many([f"t{i}" for i in range(40)])]
    assert crashed.is_set()
    assert Counter(type(r).__name__ for r in results) == {"Completed": 40}
    attempts = {r.task_id: r.attempts for r in results if r.task_id in batch}
    first, *rest = batch  # calls elsewhere on the wire as it died are called again
    assert attempts[first] == 2  # the crashing answer's task, called again
    assert {attempts[t] for t in rest} == {1}  # the rest of its batch: judged once


def test_a_call_whose_body_cannot_be_made_fails_its_task_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug, or a value no check foresaw, in making one task's body (an integer of
    5,000 digits in a tool's schema, before it was refused at submit) raised in the
    model actor each time: it was restarted and handed the task again until the
    supervisor gave up and the whole system stopped (found by a hunt)."""
    from callboard.core import admission

    def send_of(task: Any, *args: Any) -> Any:
        if task.request.messages[0].content == "poison":
            raise ValueError("a body no check foresaw")
        return admission.send_of(task, *args)

    monkeypatch.setattr("callboard.actors.model.send_of", send_of)
    with misbehaving(lambda n, body: (200, {}, completion(usage=USAGE))) as provider:
        m = ModelSettings(name="m", base_url=provider.base_url, max_concurrency=4)
        with running(m) as system:
            futures = system.submit_many(["poison", "one", "two"])
            results = [f.result(WAIT_S) for f in futures]
            supervision = system.supervision()["model:m"]
            after = system.submit("after").result(WAIT_S)
            in_flight = system.stats().models["m"]["in_flight"]
        sent = provider.count()
    poisoned, *rest = results
    assert isinstance(poisoned, Failed), poisoned
    assert poisoned.reason is FailureReason.INTERNAL
    assert "could not make the call's body: ValueError" in poisoned.detail
    assert all(isinstance(r, Completed) for r in [*rest, after])
    assert (supervision["restarts"], sent, in_flight) == (0, 3, 0)


def test_a_critical_task_is_not_paced_behind_low_ones_already_granted(
    provider: SimulatedProvider,
) -> None:
    # tpm paces ~47-token calls 0.1 s apart (the bucket holds one call).
    provider.configure("m", ModelBehaviour(latency_s=0.002, completion_tokens=37))
    per_call = reserved_tokens("low 0", 37)
    m = ModelSettings(
        name="m",
        base_url=provider.base_url,
        max_concurrency=16,
        limiter=LimiterConfig(rpm=None, tpm=per_call * 600, burst_s=0.1),
    )
    order: list[str] = []
    lock = threading.Lock()

    def note(name: str) -> Callable[[Future[Result]], None]:
        def done(_: Future[Result]) -> None:
            with lock:
                order.append(name)

        return done

    with running(m) as system:
        low = [system.submit(f"low {i}", max_tokens=37, priority=Priority.LOW) for i in range(8)]
        for i, f in enumerate(low):
            f.add_done_callback(note(f"low {i}"))
        low[0].result(WAIT_S)  # the others are now waiting on the limiter
        critical = system.submit("crit 0", max_tokens=37, priority=Priority.CRITICAL)
        critical.add_done_callback(note("critical"))
        done = results([*low, critical])
    assert all(isinstance(r, Completed) for r in done), done
    # the provider answers in constant time, so answers come in dispatch order
    assert order.index("critical") <= 2, order


QUOTA_BODY = json.dumps(
    {
        "error": {
            "message": "You exceeded your current quota, please check your plan and billing.",
            "type": "insufficient_quota",
            "param": None,
            "code": "insufficient_quota",
        }
    }
).encode()


@pytest.mark.parametrize("status", [429, 401, 404, 400])
def test_a_deployment_that_refuses_a_call_for_good_hands_it_to_the_fallback_at_once(
    provider: SimulatedProvider, status: int
) -> None:
    """An account out of quota (OpenAI's 429 insufficient_quota), a bad key, an unknown
    model, a request this deployment will not take: none is worth a retry here, and
    the next candidate may well serve it (a non-retryable failure moves the task on)."""
    body = QUOTA_BODY if status == 429 else b'{"error": {"message": "no"}}'
    with misbehaving(lambda n, b: (status, {}, body)) as rogue:
        broke = ModelSettings(
            name="broke",
            base_url=rogue.base_url,
            retry=RetryConfig(max_attempts=5, initial_s=0.5),
            fallbacks=("backup",),
        )
        backup = ModelSettings(name="backup", base_url=provider.base_url)
        with running(broke, backup) as system:
            result = system.submit("hello", model="broke").result(WAIT_S)
        sent = rogue.count()
    assert isinstance(result, Completed), result
    assert result.model == "backup"
    assert sent == 1  # not retried: a retry waits 0.5 s and would be seen here


def test_a_fallback_that_cannot_carry_the_request_leaves_the_first_models_error() -> None:
    """OpenAI's ``n=2`` fails with a 500 and its fallback, an Anthropic model, cannot
    carry ``n``: the task ended with the fallback's refusal (a request error, 400 at the
    gateway), the 500 nowhere (found by a hunt). The fallback is no part of the plan."""
    with (
        misbehaving(lambda n, b: (500, {}, b'{"error": {"message": "boom"}}')) as down,
        misbehaving(lambda n, b: (200, {}, b"{}")) as claude_server,
    ):
        gpt = ModelSettings(
            name="gpt",
            base_url=down.base_url,
            retry=RetryConfig(max_attempts=1),
            fallbacks=("claude",),
        )
        claude = ModelSettings(name="claude", base_url=claude_server.base_url, api="anthropic")
        with running(gpt, claude) as system:
            result = system.submit("hello", model="gpt", n=2).result(WAIT_S)
        sent = (down.count(), claude_server.count())
    assert isinstance(result, Failed), result
    assert (result.model, result.reason, result.status_code) == (
        "gpt",
        FailureReason.PROVIDER_ERROR,
        500,
    )
    assert sent == (1, 0)


@pytest.mark.parametrize(
    ("status", "reason"),
    [(429, FailureReason.RATE_LIMITED), (502, FailureReason.PROVIDER_ERROR)],
)
def test_a_call_the_server_says_never_to_retry_is_sent_once(
    status: int, reason: FailureReason
) -> None:
    """``x-should-retry: false``, as OpenAI's and Anthropic's SDKs obey it (and as
    callboard's own gateway says of a request larger than a key's tpm): a 429 was sent
    11 times until the deadline, a 502 five times (found by a hunt)."""
    body = b'{"error": {"message": "no, and never"}}'
    with misbehaving(lambda n, b: (status, {"x-should-retry": "false"}, body)) as rogue:
        m = ModelSettings(
            name="m",
            base_url=rogue.base_url,
            retry=RetryConfig(max_attempts=5, initial_s=0.05),
            breaker=BreakerConfig(consecutive_failures=100, min_calls=100),
        )
        with running(m) as system:
            result = system.submit("hello").result(WAIT_S)
        sent = rogue.count()
    assert isinstance(result, Failed), result
    assert (result.reason, result.status_code) == (reason, status)
    assert sent == 1


def test_a_refusal_the_server_says_to_retry_is_sent_again() -> None:
    replies = [(400, {"x-should-retry": "true"}, b'{"error": {"message": "busy"}}')]
    with misbehaving(
        lambda n, b: replies[n] if n < len(replies) else (200, {}, completion())
    ) as rogue:
        m = ModelSettings(name="m", base_url=rogue.base_url, retry=RetryConfig(initial_s=0.05))
        with running(m) as system:
            result = system.submit("hello").result(WAIT_S)
        sent = rogue.count()
    assert isinstance(result, Completed), result
    assert (result.attempts, sent) == (2, 2)


def test_an_exhausted_quota_fails_typed_when_there_is_no_fallback() -> None:
    with misbehaving(lambda n, b: (429, {}, QUOTA_BODY)) as rogue:
        m = ModelSettings(name="m", base_url=rogue.base_url, retry=RetryConfig(max_attempts=5))
        with running(m) as system:
            result = system.submit("hello").result(WAIT_S)
        sent = rogue.count()
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.QUOTA_EXCEEDED
    assert result.status_code == 429
    assert sent == 1


@pytest.mark.parametrize(
    ("headers", "at_least_s"),
    [
        ({"retry-after-ms": "600"}, 0.6),
        ({"retry-after": "1"}, 1.0),
        ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "800ms"}, 0.8),
        ({}, 1.0),  # a bare 429: one second
    ],
    ids=["retry-after-ms", "retry-after", "reset-header", "bare"],
)
def test_a_429_pauses_the_model_for_what_the_provider_says(
    headers: dict[str, str], at_least_s: float
) -> None:
    def reply(n: int, body: dict[str, Any]) -> Reply:
        if n == 0:
            return (429, headers, b'{"error": {"message": "slow down"}}')
        return (200, {}, completion(usage={"prompt_tokens": 5, "completion_tokens": 1}))

    with misbehaving(reply) as rogue:
        m = ModelSettings(
            name="m",
            base_url=rogue.base_url,
            max_concurrency=1,  # "other" waits for the slot, which frees with the 429
            retry=RetryConfig(max_attempts=3, initial_s=0.01, jitter_s=0.0),
        )
        with running(m) as system:
            first = system.submit("first")
            other = system.submit("other")  # paused too, though it never got a 429
            done = results([first, other])
        times = [a.at for a in rogue.arrivals]
    assert all(isinstance(r, Completed) for r in done), done
    assert len(times) == 3
    assert min(times[1:]) - times[0] >= at_least_s - 0.01


@pytest.mark.parametrize(
    ("statuses", "refused"),
    [((429, 529, 503), 3), ((429, 500), 1), ((408,), 0)],
)
def test_a_result_counts_the_calls_the_provider_refused_unserved(
    statuses: tuple[int, ...], refused: int
) -> None:
    """A 429 and an overloaded 503 or 529 did no work; a 500 or a 408 may have: the
    result says how many of its attempts were refused (what frees an idempotency
    key: ``ledger.binds_key``)."""

    def reply(n: int, body: dict[str, Any]) -> Reply:
        if n < len(statuses):
            return (statuses[n], {"retry-after-ms": "1"}, b'{"error": {"message": "no"}}')
        return (200, {}, completion(usage={"prompt_tokens": 5, "completion_tokens": 1}))

    never_open = BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000)
    with misbehaving(reply) as rogue:
        m = ModelSettings(
            name="m",
            base_url=rogue.base_url,
            retry=RetryConfig(max_attempts=5, initial_s=0.01, jitter_s=0.0),
            breaker=never_open,
        )
        with running(m) as system:
            (done,) = results([system.submit("hi")])
    assert isinstance(done, Completed), done
    assert (done.attempts, done.refused) == (len(statuses) + 1, refused)


def test_after_a_429_s_pause_a_critical_task_goes_before_the_low_retry() -> None:
    """A due retry went to the head of the model's waiting line: after each pause a
    LOW retry took the first call from a CRITICAL task that waited in the queue, drew
    another 429 and paused the model again (found by a hunt). It goes back to the
    queue, where priority decides, as on the cluster."""
    seen: list[str] = []
    with (
        misbehaving(_refusing_first(seen, retry_after_ms=300)) as rogue,
        running(_one_slot(rogue.base_url, backoff_s=0.01)) as system,
    ):
        low = system.submit("batch", priority=Priority.LOW)
        assert wait_until(lambda: rogue.count() == 1), "the LOW call's 429"
        urgent = system.submit("user", priority=Priority.CRITICAL)
        done = results([low, urgent])
    assert all(isinstance(r, Completed) for r in done), done
    assert seen == ["batch", "user", "batch"]


def test_a_critical_task_refused_by_a_429_goes_first_when_the_pause_ends() -> None:
    """Its backoff (1 s here) is not what it waits: the model pauses for the Retry-After
    (200 ms) for every task, and the LOW tasks that were never refused took the room the
    pause freed while the CRITICAL one sat its backoff out (all five went first)."""
    seen: list[str] = []
    with misbehaving(_refusing_first(seen, retry_after_ms=200)) as rogue:
        with running(_one_slot(rogue.base_url, backoff_s=1.0)) as system:
            urgent = system.submit("user", priority=Priority.CRITICAL)
            assert wait_until(lambda: rogue.count() == 1), "the CRITICAL call's 429"
            batch = [system.submit(f"batch {i}", priority=Priority.LOW) for i in range(5)]
            done = results([urgent, *batch])
        times = [a.at for a in rogue.arrivals]
    assert all(isinstance(r, Completed) for r in done), done
    assert seen[:2] == ["user", "user"], seen
    assert times[1] - times[0] >= 0.19  # not before the Retry-After
    assert done[0].attempts == 2


def _refusing_first(seen: list[str], *, retry_after_ms: int) -> Callable[..., Reply]:
    """A provider that refuses its first call (429, with a Retry-After) and answers every
    other, noting each call's last message in ``seen``."""

    def reply(n: int, body: dict[str, Any]) -> Reply:
        seen.append(body["messages"][-1]["content"])
        if n == 0:
            after = {"retry-after-ms": str(retry_after_ms)}
            return (429, after, b'{"error": {"message": "slow down"}}')
        return (200, {}, completion(usage={"prompt_tokens": 5, "completion_tokens": 1}))

    return reply


def _one_slot(base_url: str, *, backoff_s: float) -> ModelSettings:
    """A model of one call at a time whose first retry waits ``backoff_s`` (no jitter)."""
    retry = RetryConfig(max_attempts=3, initial_s=backoff_s, jitter_s=0.0)
    return ModelSettings(name="m", base_url=base_url, max_concurrency=1, retry=retry)


def test_only_one_probe_goes_while_half_open(provider: SimulatedProvider) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.01, status=500))
    m = ModelSettings(
        name="m",
        base_url=provider.base_url,
        max_concurrency=8,
        retry=RetryConfig(max_attempts=1),
        breaker=BreakerConfig(
            consecutive_failures=3, cooldown_s=0.15, max_cooldown_s=0.15, backoff=1.0
        ),
    )
    with running(m) as system:
        done = results([system.submit(f"p{i}") for i in range(16)])
        state = system.ask("model:m", GetState())
    assert all(isinstance(r, Failed) and r.attempts == 1 for r in done), done
    arrivals = provider.stats()["models"]["m"]["arrivals"]
    assert len(arrivals) == 16 == state["sent"]
    # the first wave, sent before the breaker opened: the cap, the two granted ahead
    # (taken back at the first failure, re-admitted while the breaker was still closed)
    # and the refills of the slots the first two failures freed; then one probe per
    # cool-down: never two calls closer than the cool-down after that
    first_wave = [t for t in arrivals if t - arrivals[0] < 0.1]
    assert len(first_wave) <= 8 + 2 + 2
    probes = arrivals[len(first_wave) :]
    assert all(b - a >= 0.14 for a, b in itertools.pairwise(probes)), probes


def test_a_request_error_is_not_retried_nor_counted_by_the_breaker(
    provider: SimulatedProvider,
) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.001, status=422))
    m = ModelSettings(
        name="m",
        base_url=provider.base_url,
        max_concurrency=4,
        retry=RetryConfig(max_attempts=5, initial_s=0.01),
        breaker=BreakerConfig(consecutive_failures=1),
    )
    with running(m) as system:
        done = results([system.submit(f"p{i}") for i in range(4)])
        state = system.ask("model:m", GetState())
    assert all(
        isinstance(r, Failed) and r.reason is FailureReason.REQUEST_ERROR and r.attempts == 1
        for r in done
    ), done
    assert state["breaker"] == "closed"
    assert provider.stats()["models"]["m"]["requests"] == 4


def test_a_call_in_flight_is_cut_at_its_tasks_deadline(provider: SimulatedProvider) -> None:
    """One deadline covers the call too: a provider that hangs does not hold the task
    for the call's own timeout (120 s here), and its breaker does not count the cut."""
    provider.configure("m", ModelBehaviour(latency_s=30.0))
    m = ModelSettings(
        name="m",
        base_url=provider.base_url,
        breaker=BreakerConfig(consecutive_failures=1),
        timeout=Timeouts(connect=5.0, read=120.0, total=120.0),
    )
    with running(m) as system:
        t0 = time.monotonic()
        result = system.submit("hangs", deadline_s=0.3).result(WAIT_S)
        took = time.monotonic() - t0
        health = system.ask("model:m", GetState())
    assert isinstance(result, Expired), result
    assert result.attempts == 1
    assert "in flight" in result.detail
    assert took < WAIT_S / 2  # well before the call's own timeout
    assert health["breaker"] == "closed", health["breaker"]


def _arrivals_monotonic(provider: SimulatedProvider, model: str) -> list[float]:
    """Server-side arrival times of ``model``'s requests, on ``time.monotonic``'s clock."""
    started = provider._core._started
    return [started + t for t in provider.stats()["models"].get(model, {}).get("arrivals", [])]


TRANSIT_S = 0.03
"""How long after a client starts a call the server may stamp its arrival."""


def test_no_call_starts_after_its_deadline_across_queueing_and_retries(
    provider: SimulatedProvider,
) -> None:
    provider.configure("flaky", ModelBehaviour(latency_s=0.02, error_rate=0.5))
    model = ModelSettings(
        name="flaky",
        base_url=provider.base_url,
        max_concurrency=2,
        retry=RetryConfig(max_attempts=10, initial_s=0.05, jitter_s=0.02),
        breaker=BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000),
    )
    with System(SystemConfig(models=(model,))) as system:
        futures = system.submit_many([f"task {i:04d}" for i in range(30)], deadline_s=0.4)
        submitted = time.monotonic()  # every task's deadline is at most this + 0.4
        results = [f.result(WAIT_S) for f in futures]
    kinds = Counter(type(r).__name__ for r in results)
    assert kinds["Completed"] >= 1, kinds
    assert kinds["Expired"] + kinds["Failed"] >= 1, kinds
    arrivals = _arrivals_monotonic(provider, "flaky")
    assert arrivals
    # the server stamps a call when its handler reads it, a little after the client
    # started it (the I/O loop's hop, loopback, parsing: ~2 ms seen on a loaded machine);
    # without the deadline the retries would run on for hundreds of ms past it
    assert max(arrivals) <= submitted + 0.4 + TRANSIT_S, max(arrivals) - submitted
    assert all(r.latency_s <= 0.4 + 1.0 for r in results if not isinstance(r, Completed))


def test_matching_rpm_sends_no_429_and_keeps_the_rate(provider: SimulatedProvider) -> None:
    # the server's bucket holds 1 s, ours 0.5 s: the margin absorbs the arrival times an
    # in-process server sees late (it shares the GIL with the client) and then at once
    provider.configure("m", ModelBehaviour(latency_s=0.01, rpm=1200, burst_s=1.0))
    model = ModelSettings(
        name="m",
        base_url=provider.base_url,
        max_concurrency=16,
        limiter=LimiterConfig(rpm=1200, tpm=None, burst_s=0.5),
    )
    with System(SystemConfig(models=(model,))) as system:
        t0 = time.monotonic()
        results = [f.result(WAIT_S) for f in system.submit_many([f"t{i}" for i in range(50)])]
        took = time.monotonic() - t0
    assert all(r.ok for r in results)
    stats = provider.stats()["models"]["m"]
    assert stats["rate_limited"] == 0
    assert stats["requests"] == 50
    assert took < 6, took  # 50 at 20/s after a burst of 10: ~2 s


def test_matching_tpm_with_large_max_tokens_sends_no_429_and_is_not_starved(
    provider: SimulatedProvider,
) -> None:
    """Anthropic's output-token limit is estimated from ``max_tokens`` and adjusted to
    the output made: reservations of prompt + max_tokens (512) far above the real use
    (~20) must be refunded at settlement, or the model would run at 1/25 of its token
    rate (the simulator's Messages API counts as Anthropic's does)."""
    provider.configure("m", ModelBehaviour(latency_s=0.01, tpm=12000, completion_tokens=12))
    model = ModelSettings(
        name="m",
        base_url=provider.base_url,
        api="anthropic",
        max_concurrency=8,
        limiter=LimiterConfig(rpm=None, tpm=12000),
    )
    with System(SystemConfig(models=(model,))) as system:
        t0 = time.monotonic()
        futures = system.submit_many([f"t{i}" for i in range(40)], max_tokens=512)
        results = [f.result(WAIT_S) for f in futures]
        took = time.monotonic() - t0
    assert all(r.ok for r in results)
    assert provider.stats()["models"]["m"]["rate_limited"] == 0
    # 40 x ~20 tokens at 200 tokens/s: ~4 s; charged at 512 each it would take ~100 s
    assert took < 10, took


def test_matching_tpm_on_openai_paces_by_max_tokens_and_draws_no_429(
    provider: SimulatedProvider,
) -> None:
    """OpenAI counts all of ``max_tokens`` as a request arrives (the simulator's Chat
    Completions too): refunded to the ~20 tokens used, callboard sent 1.4x the limit
    and drew 429s (found by a hunt); kept, it paces to what the provider counts.

    The provider's bucket holds two seconds, callboard's half of one: what the
    provider, on a thread of this process, takes in late and together when the
    machine is loaded is no 429 (with a bucket of one second it drew one, once)."""
    behaviour = ModelBehaviour(latency_s=0.01, tpm=60000, burst_s=2.0, completion_tokens=12)
    provider.configure("m", behaviour)
    model = ModelSettings(
        name="m",
        base_url=provider.base_url,
        max_concurrency=8,
        limiter=LimiterConfig(rpm=None, tpm=60000),
    )
    with System(SystemConfig(models=(model,))) as system:
        futures = system.submit_many([f"t{i}" for i in range(8)], max_tokens=512)
        results = [f.result(WAIT_S) for f in futures]
    assert all(r.ok for r in results)
    assert provider.stats()["models"]["m"]["rate_limited"] == 0


def test_retry_after_is_honoured_without_a_configured_limit(provider: SimulatedProvider) -> None:
    provider.configure("m", ModelBehaviour(latency_s=0.005, rpm=60, burst_s=1.0))
    model = ModelSettings(
        name="m",
        base_url=provider.base_url,
        max_concurrency=4,
        retry=RetryConfig(max_attempts=6, initial_s=0.01, jitter_s=0.01),
    )
    with System(SystemConfig(models=(model,))) as system:
        results = [f.result(WAIT_S) for f in system.submit_many(["a", "b", "c"])]
    assert all(r.ok for r in results), results
    stats = provider.stats()["models"]["m"]
    arrivals = sorted(stats["arrivals"])
    # one per second is served; the client waits out each Retry-After (~1 s) instead of
    # retrying after its own 10 ms backoff
    assert stats["rate_limited"] <= 4, stats["rate_limited"]
    first = arrivals[0]
    assert not [a for a in arrivals if 0.1 < a - first < 0.9], [a - first for a in arrivals]


def test_a_fallback_retries_its_own_429s(provider: SimulatedProvider) -> None:
    provider.configure("primary", ModelBehaviour(latency_s=0.005, status=500))
    provider.configure("backup", ModelBehaviour(latency_s=0.005, rpm=1200, burst_s=0.1))
    retry = RetryConfig(max_attempts=3, initial_s=0.01, jitter_s=0.01)
    never_open = BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000)
    primary = ModelSettings(
        name="primary",
        base_url=provider.base_url,
        max_concurrency=20,
        fallbacks=("backup",),
        retry=retry,
        breaker=never_open,
    )
    backup = ModelSettings(
        name="backup", base_url=provider.base_url, max_concurrency=20, retry=retry
    )
    with System(SystemConfig(models=(primary, backup))) as system:
        futures = system.submit_many([f"t{i}" for i in range(20)], model="primary")
        results = [f.result(WAIT_S) for f in futures]
    assert provider.stats()["models"]["backup"]["rate_limited"] >= 1  # the probe bites
    failed = Counter(getattr(r, "reason", None) for r in results if not r.ok)
    assert not failed, failed


def test_breaker_opens_probes_are_limited_fallback_takes_the_load_then_recovery(
    provider: SimulatedProvider,
) -> None:
    provider.configure("primary", ModelBehaviour(latency_s=0.005, status=503))
    primary = ModelSettings(
        name="primary",
        base_url=provider.base_url,
        max_concurrency=8,
        fallbacks=("backup",),
        retry=RetryConfig(max_attempts=1),
        breaker=BreakerConfig(
            consecutive_failures=3, cooldown_s=0.2, max_cooldown_s=0.2, half_open_probes=2
        ),
    )
    backup = ModelSettings(name="backup", base_url=provider.base_url, max_concurrency=8)
    with System(SystemConfig(models=(primary, backup))) as system:
        t0 = time.monotonic()
        waves = []
        # ~0.6 s of outage, in waves larger than the cap: some jobs of each wait in the
        # queue, which places them on the fallback while the primary is down
        for w in range(6):
            futures = system.submit_many([f"w{w} t{i}" for i in range(10)], model="primary")
            waves += [f.result(WAIT_S) for f in futures]
        outage_s = time.monotonic() - t0
        assert all(isinstance(r, Completed) for r in waves)
        served = Counter(r.model for r in waves)
        assert served == {"backup": 60}
        calls = _server_requests(provider, "primary")
        # the calls in flight when it opened (<= cap), then <= 2 probes per cool-down
        assert calls <= 8 + 2 * (outage_s / 0.2 + 1), (calls, outage_s)
        provider.configure("primary", ModelBehaviour(latency_s=0.005))
        served_by = ""
        for i in range(200):
            served_by = system.submit(f"after {i}", model="primary").result(WAIT_S).model or ""
            if served_by == "primary":
                break
        assert served_by == "primary"
        again = [
            f.result(WAIT_S)
            for f in system.submit_many([f"r{i}" for i in range(10)], model="primary")
        ]
        assert _breaker(system, "primary") == "closed"
    assert Counter(r.model for r in again) == {"primary": 10}  # closed: all the work is back


# -- the window: calls granted ahead to the I/O loop, and priority ------------------


def test_a_critical_task_goes_to_the_front_of_the_window_ahead_of_granted_low_work() -> None:
    """Cap 8, so two calls are granted ahead to the I/O loop. A CRITICAL task that
    arrives while both are LOW takes the next credit, and the next freed slot, ahead
    of the LOW one still waiting there: it waits behind no granted LOW work."""
    gate = Gate()
    with WireServer(gate.handler) as server:
        m = ModelSettings(name="m", base_url=server.base_url, max_concurrency=8)
        try:
            with running(m) as system:
                lows = [system.submit(f"low{i}", priority=Priority.LOW) for i in range(12)]
                server.wait_for(8)
                assert wait_until(lambda: system.ledger.counts().in_flight == 10)
                critical = system.submit("critical", priority=Priority.CRITICAL)
                # submit returns before the task reaches the queue: the slot must not free
                # while it is on its way (the credit would take a LOW task then)
                assert wait_until(lambda: system.ask("queue", GetState())["waiting"] == 3)
                gate.release()  # a slot frees: the window's first LOW call takes it
                server.wait_for(9)
                # the model has admitted it and handed it to the loop (8 on the wire, low9
                # and the CRITICAL call in the window): the ledger says it left the queue
                # before the model has it, so the slot must not free before this
                # (its count of calls handed to the loop, not its in_flight: that is 10
                # too while the freed slot's completion is still on its way to it)
                assert wait_until(lambda: system.ask("model:m", GetState())["sent"] == 11), (
                    "the CRITICAL task took the credit the freed slot gave back"
                )
                # handed to the loop is not yet in the window: uvloop runs a thread's
                # callbacks after the I/O events of the same turn, so a slot freeing now
                # could be refilled first; one more callback through the loop is a barrier
                system.rt.io.run(asyncio.sleep(0))
                gate.release()  # the next freed slot: the CRITICAL call, not the LOW one
                server.wait_for(10)
                sent = [a.json["messages"][0]["content"] for a in server.arrivals]
                gate.release(20)
                done = [f.result(WAIT_S) for f in [*lows, critical]]
        finally:
            gate.release(20)
    assert sorted(sent[:8]) == [f"low{i}" for i in range(8)]  # at once: any order
    assert sent[8:10] == ["low8", "critical"]
    assert all(r.ok for r in done)


def test_a_call_waiting_in_the_window_counts_that_wait_as_queue_wait_not_service() -> None:
    """Cap 4, so one call is granted ahead to the I/O loop. It waits there while the
    four on the wire are held; that wait is its task's queue wait (until its first
    call), and its service time is its own call's, as a client's with a semaphore."""
    gate = Gate()
    held_s = 0.4
    with WireServer(gate.handler) as server:
        m = ModelSettings(name="m", base_url=server.base_url, max_concurrency=4)
        try:
            with running(m) as system:
                futures = system.submit_many([f"t{i}" for i in range(5)])
                server.wait_for(4)
                assert wait_until(lambda: system.ledger.counts().in_flight == 5)
                threading.Event().wait(held_s)  # the wait under test: time must pass
                gate.release(5)  # the four answer; the fifth starts and answers at once
                done = [f.result(WAIT_S) for f in futures]
        finally:
            gate.release(5)
    assert all(r.ok for r in done)
    windowed = max(done, key=lambda r: r.queue_wait_s)
    assert windowed.queue_wait_s >= held_s
    assert windowed.latency_s - windowed.queue_wait_s < held_s / 2
    assert sorted(r.queue_wait_s for r in done)[3] < held_s / 2  # the four went at once


# -- a provider that stays down, a refused key: given up on ------------------------------

# OpenAI's answer to a wrong key (its error-codes guide): 401, invalid_api_key.
BAD_KEY_BODY = json.dumps(
    {
        "error": {
            "message": "Incorrect API key provided: sk-wrong. You can find your API key at "
            "https://platform.openai.com/account/api-keys.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()


def test_a_provider_that_stays_down_is_given_up_on_and_its_tasks_fail_naming_the_error() -> None:
    """Issue 14: five tasks against an endpoint nothing listens on waited for ever. Once
    the breaker has not closed for ``give_up_s`` they end ``PROVIDER_DOWN`` saying the
    connection was refused; a task submitted then fails at once, without a call."""
    port = dead_port()
    m = ModelSettings(
        name="m",
        base_url=f"http://127.0.0.1:{port}/v1",
        breaker=BreakerConfig(
            consecutive_failures=2, cooldown_s=0.1, max_cooldown_s=0.2, give_up_s=0.5
        ),
        retry=RetryConfig(max_attempts=3, initial_s=0.01, jitter_s=0.0),
    )
    with running(m) as system:
        first = results(system.submit_many([f"doomed {i}" for i in range(5)]))
        started = time.monotonic()
        late = system.submit("after").result(WAIT_S)
        took = time.monotonic() - started
        state = system.ask("model:m", GetState())
    assert {type(r) for r in first} == {Failed}, first
    down = [r for r in first if isinstance(r, Failed) and r.reason is FailureReason.PROVIDER_DOWN]
    assert down, "some tasks outlived the first attempts and waited for the breaker"
    for r in down:
        assert "m is given up on (connection" in r.detail, r.detail
        assert "refused" in r.detail.lower(), r.detail
    assert isinstance(late, Failed)
    if late.attempts == 0:  # ended on arrival: the model was given up on
        assert late.reason is FailureReason.PROVIDER_DOWN
        assert took < 0.5
    else:  # it arrived while the breaker was half-open and was sent as its probe
        assert late.reason in (FailureReason.PROVIDER_DOWN, FailureReason.CONNECTION), late
        assert "refused" in late.detail.lower(), late.detail
    assert state["timers"] <= 3


def test_a_refused_key_stops_the_models_other_calls_at_once() -> None:
    """Issue 14: a 401 was a request error, and each of the other queued calls was
    sent to hear the same. Now the first refusal opens the breaker: nothing else is
    sent, and every task ends ``AUTHENTICATION`` naming what the provider said."""
    with misbehaving(lambda n, b: (401, {}, BAD_KEY_BODY)) as rogue:
        m = ModelSettings(
            name="m",
            base_url=rogue.base_url,
            max_concurrency=2,
            retry=RetryConfig(max_attempts=5),
            breaker=BreakerConfig(cooldown_s=30.0, max_cooldown_s=30.0),
        )
        with running(m) as system:
            done = results(system.submit_many([f"hello {i}" for i in range(20)]))
        sent = rogue.count()
    assert sent <= 2, f"{sent} calls sent after the key was refused"
    assert {r.reason for r in done if isinstance(r, Failed)} == {FailureReason.AUTHENTICATION}
    assert all(isinstance(r, Failed) for r in done)
    said = [r for r in done if isinstance(r, Failed) and r.status_code == 401]
    assert said
    assert "Incorrect API key" in said[0].detail
    waited = [r for r in done if isinstance(r, Failed) and r.attempts == 0]
    assert waited  # they say why, not what the provider answered another task (which
    assert "authentication (HTTP 401)" in waited[0].detail  # may echo its prompt)
    assert "Incorrect API key" not in waited[0].detail


@pytest.mark.parametrize(
    ("status", "said"),
    [
        (429, {"error": {"message": "Rate limit reached for requests per day", "type": "tokens"}}),
        (503, {"error": {"message": "The service is unavailable", "type": "server_error"}}),
        (529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    ],
    ids=["429", "503", "anthropic-529"],
)
def test_a_model_resting_out_a_long_retry_after_lets_its_fallback_serve(
    provider: SimulatedProvider, status: int, said: dict[str, Any]
) -> None:
    """A 429 with ``Retry-After: 30`` (a spent daily limit can say hours): the breaker
    stays closed, yet the work with a fallback goes there at once instead of waiting
    the pause out while the fallback stands idle (found by a hunt: 45 s in, none of
    ten tasks had ended), tasks with a deadline too. A 503's Retry-After (RFC 9110: how
    long the service is out) and Anthropic's 529 overloaded say the same: the task sat
    out each 30 s at the model, three calls in a minute before its fallback served it
    (found by a hunt)."""
    pause = (status, {"retry-after": "30"}, json.dumps(said).encode())
    with misbehaving(lambda n, b: pause) as rogue:
        paused = ModelSettings(
            name="paused", base_url=rogue.base_url, max_concurrency=1, fallbacks=("backup",)
        )
        backup = ModelSettings(name="backup", base_url=provider.base_url)
        with running(paused, backup) as system:
            first = system.submit("hi", model="paused").result(WAIT_S)
            later = system.submit_many([f"hi {i}" for i in range(10)], model="paused")
            soon = system.submit_many(["a", "b"], model="paused", deadline_s=WAIT_S / 2)
            done = results([*later, *soon])
        sent = rogue.count()
    assert isinstance(first, Completed), first
    assert first.model == "backup"
    assert all(isinstance(r, Completed) and r.model == "backup" for r in done), done
    assert sent == 1


def test_a_refused_key_moves_waiting_work_to_the_fallback(provider: SimulatedProvider) -> None:
    with misbehaving(lambda n, b: (401, {}, BAD_KEY_BODY)) as rogue:
        broke = ModelSettings(
            name="broke", base_url=rogue.base_url, max_concurrency=2, fallbacks=("backup",)
        )
        backup = ModelSettings(name="backup", base_url=provider.base_url)
        with running(broke, backup) as system:
            done = results(system.submit_many([f"hi {i}" for i in range(10)], model="broke"))
        sent = rogue.count()
    assert all(isinstance(r, Completed) and r.model == "backup" for r in done), done
    assert sent <= 2


def test_a_request_denied_403_ends_alone_and_the_models_other_calls_go_on(
    provider: SimulatedProvider,
) -> None:
    """A 403 on one request (a beta its key may not use): it was taken for a refused key,
    and every other task's call was refused without being sent for the breaker's
    cooldown (found by a hunt). Only that task ends, on its fallback; the rest are
    served by the model."""
    denied = json.dumps({"type": "error", "error": {"type": "permission_error", "message": "no"}})

    async def handler(request: Any, arrival: Any) -> Any:
        from aiohttp import web

        if "forbidden-beta" in request.headers.get("anthropic-beta", ""):
            return web.Response(status=403, body=denied, content_type="application/json")
        return web.json_response(completion_body())

    with WireServer(handler) as rogue:
        m = ModelSettings(name="m", base_url=rogue.base_url, fallbacks=("backup",))
        backup = ModelSettings(name="backup", base_url=provider.base_url)
        with running(m, backup) as system:
            beta = {"anthropic-beta": "forbidden-beta-2099"}
            first = system.submit("hi", model="m", extra_headers=beta).result(WAIT_S)
            rest = results(system.submit_many([f"hi {i}" for i in range(5)], model="m"))
    assert isinstance(first, Completed), first
    assert first.model == "backup"
    assert all(isinstance(r, Completed) and r.model == "m" for r in rest), rest


def test_an_expired_task_says_what_its_last_attempt_met() -> None:
    """Issue 14: after failed attempts the ``Expired`` detail was empty. A 500, then a
    call that hangs until the deadline cuts it: the result says both."""
    err = json.dumps({"error": {"message": "The server had an error", "type": "server_error"}})
    hang = threading.Event()

    async def handler(request: Any, arrival: Any) -> Any:
        from aiohttp import web

        if arrival.index == 0:
            return web.Response(status=500, body=err, content_type="application/json")
        await asyncio.get_running_loop().run_in_executor(None, hang.wait, WAIT_S)
        return web.json_response(completion_body(usage=None))

    with WireServer(handler) as rogue:
        m = ModelSettings(
            name="m",
            base_url=rogue.base_url,
            breaker=NEVER_OPEN,
            retry=RetryConfig(max_attempts=5, initial_s=0.01, jitter_s=0.0),
        )
        try:
            with running(m) as system:
                result = system.submit("hello", deadline_s=0.5).result(WAIT_S)
        finally:
            hang.set()
    assert isinstance(result, Expired), result
    assert result.attempts == 2
    assert "in flight" in result.detail, result.detail
    assert "provider_error (HTTP 500)" in result.detail, result.detail


def test_queue_wait_ends_when_the_first_call_is_sent_not_when_the_queue_hands_it_on() -> None:
    """Issue 14: with a binding limit the queue wait was stamped at the first hand-off
    and kept when the model handed the job back, so it read 4 s while tasks waited 35."""
    with misbehaving(lambda n, b: (200, {}, completion(usage=USAGE))) as fast:
        m = ModelSettings(
            name="m", base_url=fast.base_url, limiter=LimiterConfig(rpm=240, tpm=None)
        )
        with running(m) as system:
            done = results(system.submit_many([f"hi {i}" for i in range(6)]))
    assert all(isinstance(r, Completed) for r in done), done
    served_after = [r.latency_s - r.queue_wait_s for r in done]
    assert max(served_after) < 0.5, served_after  # each answered at once once sent
    assert max(r.queue_wait_s for r in done) >= 1.0  # 4 a second: the sixth waited


# -- a limit lower than the one configured -------------------------------------------------


class LimitedServer:
    """An endpoint enforcing ``rpm`` as the providers' documentation describes: a bucket
    of one second's worth refilled continuously; a 429 past it, with the provider's
    error body and retry-after. ``advertise`` says whose rate-limit headers every
    answer carries: OpenAI's ``x-ratelimit-*-requests`` (resets as durations),
    Anthropic's ``anthropic-ratelimit-requests-*`` (resets as RFC 3339 times), or
    none."""

    def __init__(self, rpm: int, *, advertise: str | None) -> None:
        self.rpm, self.advertise = rpm, advertise
        self.rate = rpm / 60.0
        self.capacity = self.rate  # one second's worth
        self.level, self.at = self.capacity, time.monotonic()
        self.refused = 0
        self.server = WireServer(self.handle)

    def headers(self, remaining: int, reset_s: float) -> dict[str, str]:
        if self.advertise == "openai":
            return {
                "x-ratelimit-limit-requests": str(self.rpm),
                "x-ratelimit-remaining-requests": str(remaining),
                "x-ratelimit-reset-requests": f"{reset_s:.3f}s",
            }
        if self.advertise == "anthropic":
            at = datetime.now(UTC) + timedelta(seconds=reset_s)
            return {
                "anthropic-ratelimit-requests-limit": str(self.rpm),
                "anthropic-ratelimit-requests-remaining": str(remaining),
                "anthropic-ratelimit-requests-reset": at.isoformat().replace("+00:00", "Z"),
            }
        return {}

    async def handle(self, request: Any, arrival: Any) -> Any:
        from aiohttp import web

        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1:
            self.refused += 1
            wait_s = (1 - self.level) / self.rate
            headers = self.headers(0, wait_s)
            if self.advertise == "anthropic":  # whole seconds, and its own error shape
                headers["retry-after"] = str(math.ceil(wait_s))
                body: dict[str, Any] = {
                    "type": "error",
                    "error": {"type": "rate_limit_error", "message": "Rate limit exceeded"},
                }
            else:
                headers["retry-after-ms"] = str(math.ceil(wait_s * 1000))
                body = {
                    "error": {
                        "message": f"Rate limit reached for requests per min (RPM): Limit "
                        f"{self.rpm}. Please try again in {math.ceil(wait_s * 1000)}ms.",
                        "type": "requests",
                        "param": None,
                        "code": "rate_limit_exceeded",
                    }
                }
            return web.json_response(body, status=429, headers=headers)
        self.level -= 1
        headers = self.headers(math.floor(self.level), (self.capacity - self.level) / self.rate)
        return web.json_response(completion_body(usage=USAGE), headers=headers)


@pytest.mark.parametrize("advertise", ["openai", "anthropic", None])
def test_a_limit_configured_4x_above_the_providers_completes_every_task(
    advertise: str | None,
) -> None:
    """Issue 14: configured at 4x the provider's limit, 47 of 200 tasks failed
    RATE_LIMITED and callboard kept sending at 3x the server's rate. The advertised
    limit (OpenAI's or Anthropic's headers) now lowers ours; a provider that says
    nothing is found by backing off."""
    limited = LimitedServer(1200, advertise=advertise)
    with limited.server as server:
        m = ModelSettings(
            name="m",
            base_url=server.base_url,
            limiter=LimiterConfig(rpm=4800, tpm=None, burst_s=0.25),
            retry=RetryConfig(max_attempts=2),
            # what goes out before an answer can teach the limiter is the calls in
            # flight: capped, so the count below depends on what the answers say, not on
            # how late a loaded machine delivers them (uncapped, a late first answer let
            # the configured 80/s run on for a while: seen 21+ 429s under load)
            max_concurrency=4,
        )
        with running(m) as system:
            done = results(system.submit_many([f"hi {i}" for i in range(80)]))
    assert all(isinstance(r, Completed) for r in done), kinds_of(done)
    # seen on an idle machine: 3 advertised, 9 silent; sending at the configured 4x, as
    # before, is 50 and more (the cap does not slow that down: a loopback answer takes
    # about a millisecond)
    assert limited.refused <= 20, f"{limited.refused} 429s for 80 tasks"


def kinds_of(done: list[Result]) -> Counter[str]:
    return Counter(type(r).__name__ + getattr(r, "detail", "")[:60] for r in done)


# -- calls the limiter holds back: handed back whole ------------------------------------------


@pytest.mark.parametrize("cap", [1, 2])
def test_a_tenant_whose_large_calls_a_limit_holds_back_still_gets_its_turns(
    provider: SimulatedProvider, cap: int
) -> None:
    """Under 60,000 tokens a minute in a bucket of 550, A's ~520-token calls fit only a
    full bucket, and B's ~50-token calls drain it as fast as it fills. Each of A's calls
    granted too early went back to the queue unsent, charged to A (so B had every turn
    after it), and credits were granted again as soon as one of B's fit: both of A's
    calls went after all 100 of B's, handed back 13 to 199 times (found by a hunt).
    The charge undone and no credit granted before A's call fits, the two share the
    tokens: about ten of B's calls per one of A's."""
    provider.configure("m", ModelBehaviour(latency_s=0.4, completion_tokens=16))
    limiter = LimiterConfig(rpm=None, tpm=60_000, burst_s=0.55)
    model = ModelSettings(
        name="m", base_url=provider.base_url, max_concurrency=cap, limiter=limiter
    )
    with System(SystemConfig(models=(model,))) as system:
        blockers = system.submit_many(["blocker"] * cap, max_tokens=16)  # the rest waits
        assert wait_until(lambda: served(provider, "m").get("requests") == cap)
        provider.configure("m", ModelBehaviour(latency_s=0.005, completion_tokens=16))
        t = time.monotonic()  # both wait from here: the order is the queue's alone
        large = "hello " * 500
        a = system.submit_many([f"a{i} {large}" for i in range(2)], budget_tag="A", max_tokens=16)
        small = "hello " * 30
        b = system.submit_many([f"b{i} {small}" for i in range(100)], budget_tag="B", max_tokens=16)
        assert not any(f.done() for f in blockers)
        assert a[1].result(WAIT_S).ok
        system.cancel(*(f.task_id for f in b))
        a_ids = {f.task_id for f in a}
        results = [f.result(WAIT_S) for f in a + b]
    went = sorted((t + r.queue_wait_s, r.task_id in a_ids) for r in results if r.attempts)
    order = "".join("A" if is_a else "B" for _, is_a in went)
    second_a = order.index("A", order.index("A") + 1)
    assert second_a <= 31, order  # ~10 of B's per A, give or take a call each


def test_an_aged_task_a_limit_holds_back_keeps_its_aged_turn(provider: SimulatedProvider) -> None:
    """One call at a time, 120,000 tokens a minute in a bucket of 550: the LOW task's
    ~520 tokens fit only a full bucket, and a stream of ~26-token CRITICAL calls keeps
    it below that. Aged past them, the LOW task gets every tenth turn; each time it did
    not fit it went back to the queue with the turn spent, and went after the whole
    stream (600 calls, 64 hand-backs, 7.96 s; found by a hunt). Owed its turn again,
    it goes at the grant where it fits."""
    provider.configure("m", ModelBehaviour(latency_s=0.4, completion_tokens=16))
    limiter = LimiterConfig(rpm=None, tpm=120_000, burst_s=0.275)
    model = ModelSettings(name="m", base_url=provider.base_url, max_concurrency=1, limiter=limiter)
    scheduler = SchedulerSettings(aging_step_s=0.1)
    with System(SystemConfig(models=(model,), scheduler=scheduler)) as system:
        system.submit("blocker", max_tokens=16)  # what comes next waits in the queue
        assert wait_until(lambda: served(provider, "m").get("requests") == 1)
        provider.configure("m", ModelBehaviour(latency_s=0.005, completion_tokens=16))
        t_low = time.monotonic()
        low = system.submit("L " + "hello " * 500, priority=Priority.LOW, max_tokens=16)
        stream: list[tuple[float, Future[Result]]] = []
        while not low.done() and len(stream) < 600:  # a stream, paced by its answers
            if len(stream) >= 40:
                stream[-40][1].result(WAIT_S)  # 40-50 waiting at any time
            came = time.monotonic()
            burst = system.submit_many(
                [f"c{len(stream) + i}" for i in range(10)],
                priority=Priority.CRITICAL,
                max_tokens=16,
            )
            stream += [(came, f) for f in burst]
        result = low.result(WAIT_S)
        system.cancel(*(f.task_id for _, f in stream))
        went = t_low + result.queue_wait_s
        ahead = sum(
            1
            for came, f in stream
            if (r := f.result(WAIT_S)).attempts and came + r.queue_wait_s < went
        )
    assert result.ok
    assert len(stream) < 600, (ahead, result.queue_wait_s)
    assert ahead < 200, (ahead, result.queue_wait_s)  # ~60: it waits to fit, then goes


@pytest.mark.parametrize("how", ["cancelled", "expired"])
def test_a_call_that_leaves_the_window_unsent_gives_its_tenant_its_turn_back(
    provider: SimulatedProvider, how: str
) -> None:
    """Four slots and a window of one, A and B waiting: B's first task, granted into the
    window (charged to B), leaves it unsent, cancelled or past its deadline, while the
    four blockers run. Its charge is undone with the next credit (``Ready.refunds``),
    so B's next task goes before A's, as if B's first had never been taken (B, the
    newcomer, had the turn); left charged, the turn went to A."""
    provider.configure("m", ModelBehaviour(latency_s=1.0, completion_tokens=16))
    model = ModelSettings(name="m", base_url=provider.base_url, max_concurrency=4)
    with System(SystemConfig(models=(model,))) as system:

        def in_flight() -> int:
            return system.stats().ledger["in_flight"]

        blockers = system.submit_many(["blocker"] * 4, max_tokens=16)
        assert wait_until(lambda: served(provider, "m").get("requests") == 4)
        window = system.submit("w", max_tokens=16)
        assert wait_until(lambda: in_flight() == 5)  # w waits in the window
        t = time.monotonic()
        a = system.submit_many(["a0", "a1"], budget_tag="A", max_tokens=16)
        deadline_s = 0.3 if how == "expired" else None
        b0 = system.submit("b0", budget_tag="B", max_tokens=16, deadline_s=deadline_s)
        b1 = system.submit("b1", budget_tag="B", max_tokens=16)
        system.cancel(window.task_id)  # its credit goes to B's b0, the newcomer's turn
        assert window.result(WAIT_S).attempts == 0
        assert wait_until(lambda: in_flight() == 5)  # b0 waits in the window
        if how == "cancelled":
            system.cancel(b0.task_id)
        ended = b0.result(WAIT_S)
        assert type(ended).__name__ == how.capitalize(), ended
        assert ended.attempts == 0
        results = [f.result(WAIT_S) for f in (*a, b1)]
        assert all(r.ok for r in (*[f.result(WAIT_S) for f in blockers], *results))
    went = sorted((t + r.queue_wait_s, name) for r, name in zip(results, "AAB", strict=True))
    assert [name for _, name in went] == list("BAA"), went


def test_an_idle_models_headroom_is_said_again_until_it_is_full(
    provider: SimulatedProvider,
) -> None:
    """Idle, a model reported once, 50 ms in, and that figure stayed in stats() and the
    metrics for good: 23 of 100 requests for a bucket long full again, a token debt long
    paid (found by a hunt). It reports each second until the bucket is full."""
    provider.configure("m", ModelBehaviour(latency_s=0.005))
    limiter = LimiterConfig(rpm=600, tpm=None, burst_s=5.0)  # 10 a second, 50 at most
    model = ModelSettings(name="m", base_url=provider.base_url, limiter=limiter)
    with System(SystemConfig(models=(model,))) as system:
        assert all(f.result(WAIT_S).ok for f in system.submit_many(["q"] * 40))

        def headroom() -> float:
            return float(system.stats().models["m"]["requests_headroom"])

        assert wait_until(lambda: headroom() < 40)  # drawn down, a credit still there
        assert wait_until(lambda: headroom() >= 49.9), headroom()  # full in ~4 s


def test_a_provider_that_refuses_every_call_429_is_said_in_the_log_once_a_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It let 5,000 tasks expire with no warning at the default level (found by a hunt)."""
    refused = json.dumps({"error": {"message": "slow down", "type": "rate_limit_error"}})
    with misbehaving(lambda n, body: (429, {"retry-after": "0"}, refused.encode())) as rogue:
        m = ModelSettings(
            name="m",
            base_url=rogue.base_url,
            retry=RetryConfig(max_attempts=2, initial_s=0.01, max_s=0.01),
            breaker=BreakerConfig(consecutive_failures=1000, min_calls=1000),
        )
        with running(m) as system:
            done = results([system.submit("hi", deadline_s=2.0) for _ in range(8)])
    assert not any(r.ok for r in done)  # refused, or expired waiting for the limit
    said = [r.getMessage() for r in caplog.records if "rate limited:" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"m: rate limited: {LIMITED_RUN} calls in a row refused")
