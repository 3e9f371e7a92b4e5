"""Hunting bugs in a model actor's limiter, retries, breaker and HTTP layer.

Every test runs a real ``System`` against a real HTTP server on 127.0.0.1: the
simulated provider where it can do what the test needs, else ``RogueProvider``,
a small aiohttp server defined here that answers what the test tells it to (a
completion without ``usage``, a negative ``usage``...), i.e. a misbehaving
provider. Limits are checked from the server's side: its arrival log and its
counters, never by timing the client. Confirmed bugs are strict xfails.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import Any

import pytest
from aiohttp import web
from callboard.core.attempt import pause_s as _pause_s
from callboard.core.breaker import BreakerConfig
from callboard.core.limiter import LimiterConfig, RateLimitHeaders
from callboard.core.retry import RetryConfig
from callboard.messages import Crash, GetState, Result
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from loopback import Arrival, WireServer
from support import WAIT_S

from callboard import (
    Completed,
    Expired,
    Failed,
    FailureReason,
    ModelSettings,
    Priority,
    System,
    SystemConfig,
    Timeouts,
)

Reply = tuple[int, dict[str, str], bytes]
NEVER_OPEN = BreakerConfig(consecutive_failures=1000, failure_rate=1.0, min_calls=1000)


class RogueProvider(WireServer):
    """An OpenAI-shaped endpoint on loopback that answers ``reply(n, body)`` to the
    n-th request (from 0); ``arrivals`` records each, with its time and body."""

    def __init__(self, reply: Callable[[int, dict[str, Any]], Reply]) -> None:
        async def handle(request: web.Request, arrival: Arrival) -> web.StreamResponse:
            status, headers, raw = reply(arrival.index, arrival.json)
            return web.Response(
                status=status, headers=headers, body=raw, content_type="application/json"
            )

        super().__init__(handle)


def completion(usage: object = None, *, raw_usage: str | None = None) -> bytes:
    """A chat.completion body; ``usage`` None leaves the field out."""
    body: dict[str, Any] = {
        "id": "chatcmpl-rogue",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "stop",
            }
        ],
    }
    if usage is not None:
        body["usage"] = usage
    text = json.dumps(body)
    if raw_usage is not None:  # JSON that json.dumps would not write (Infinity...)
        text = text[:-1] + f', "usage": {raw_usage}}}'
    return text.encode()


@contextlib.contextmanager
def running(*models: ModelSettings) -> Iterator[System]:
    """A System that is stopped (cancelling what is left) however the test ends."""
    system = System(SystemConfig(models=models))
    try:
        yield system
    finally:
        system.stop(cancel=True, timeout=5)


def results(futures: list[Future[Result]]) -> list[Result]:
    _, pending = wait(futures, timeout=WAIT_S)
    assert not pending
    return [f.result() for f in futures]


def reserved_tokens(prompt: str, max_tokens: int) -> int:
    """What the limiter reserves for a one-message prompt (estimate + max_tokens)."""
    return (len(prompt) + 3) // 4 + 4 + 3 + max_tokens


@pytest.fixture
def sim() -> Iterator[SimulatedProvider]:
    with SimulatedProvider(default=ModelBehaviour(latency_s=0.005), seed=11) as p:
        yield p


# -- tokens: settled from real usage, never from a usage that is not there ------


def test_a_completion_without_usage_keeps_its_token_reservation() -> None:
    # tpm=300 and every call reserves 117 tokens: the window admits two in a
    # minute and the bucket (2.5 tokens) one now. A provider that does not say
    # what a call used must not make it free: three calls must not go at once.
    prompt, max_tokens, tpm = "x" * 40, 100, 300
    per_call = reserved_tokens(prompt, max_tokens)
    assert 2 * per_call <= tpm < 3 * per_call
    with RogueProvider(lambda n, body: (200, {}, completion(usage=None))) as rogue:
        m = ModelSettings(
            name="m",
            base_url=rogue.base_url,
            max_concurrency=8,
            limiter=LimiterConfig(rpm=None, tpm=tpm),
        )
        with running(m) as system:
            done = results(
                [system.submit(prompt, max_tokens=max_tokens, deadline_s=1.0) for _ in range(4)]
            )
        sent = rogue.count()
    assert isinstance(done[0], Completed)
    assert all(isinstance(r, Completed | Expired) for r in done), done
    # charged as the most it could have used, and said so
    assert done[0].usage.estimated
    assert done[0].usage.total_tokens == per_call
    assert sent * per_call <= tpm, f"{sent} calls of {per_call} tokens within a second at tpm={tpm}"


def test_a_completion_with_usage_settles_the_tokens_it_reports(sim: SimulatedProvider) -> None:
    # Control for the test above: with real usage the unused part is refunded, and
    # the next call goes as soon as the bucket allows (here: at once).
    sim.configure("m", ModelBehaviour(latency_s=0.002, completion_tokens=1))
    m = ModelSettings(
        name="m",
        base_url=sim.base_url,
        max_concurrency=1,
        limiter=LimiterConfig(rpm=None, tpm=6000, burst_s=1.0),  # 100 tokens in the bucket
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
    sim: SimulatedProvider, fault: dict[str, float]
) -> None:
    # The provider counts tokens when a request arrives (as OpenAI does), before
    # it fails it; so does the simulated one. The client's limit equals the
    # server's: pacing by the reservation never draws a 429.
    tpm = 300  # a bucket of a few tokens: each 49-token call leaves ~9 s of debt
    sim.configure(
        "m", ModelBehaviour(latency_s=0.002, completion_tokens=40, tpm=tpm, burst_s=1.0, **fault)
    )
    m = ModelSettings(
        name="m",
        base_url=sim.base_url,
        max_concurrency=8,
        retry=RetryConfig(max_attempts=1),
        breaker=NEVER_OPEN,
        limiter=LimiterConfig(rpm=None, tpm=tpm),
        timeout=Timeouts(connect=1.0, read=1.0, total=1.0),
    )
    with running(m) as system:
        done = results([system.submit(f"p{i}", max_tokens=40, deadline_s=1.0) for i in range(3)])
    server = sim.stats()["models"]["m"]
    assert all(isinstance(r, Failed | Expired) for r in done), done
    assert server["rate_limited"] == 0, server["responses"]


# -- a provider's bad numbers never crash the actor ------------------------------


def test_a_negative_usage_does_not_crash_the_model_actor() -> None:
    usage = {"prompt_tokens": -50, "completion_tokens": 10, "total_tokens": -40}
    with RogueProvider(lambda n, body: (200, {}, completion(usage=usage))) as rogue:
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


def test_a_usage_of_infinity_is_a_malformed_response() -> None:
    body = completion(raw_usage='{"prompt_tokens": Infinity, "completion_tokens": 1}')
    with RogueProvider(lambda n, b: (200, {}, body)) as rogue:
        m = ModelSettings(name="m", base_url=rogue.base_url, retry=RetryConfig(max_attempts=1))
        with running(m) as system:
            result = system.submit("hello").result(WAIT_S)
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.MALFORMED_RESPONSE


# -- credits under a token limit --------------------------------------------------


def test_a_critical_task_is_not_paced_behind_low_ones_already_granted(
    sim: SimulatedProvider,
) -> None:
    # tpm paces ~46-token calls 0.1 s apart (the bucket holds one call).
    sim.configure("m", ModelBehaviour(latency_s=0.002, completion_tokens=37))
    per_call = reserved_tokens("low 0", 37)
    m = ModelSettings(
        name="m",
        base_url=sim.base_url,
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


# -- limits and breaker survive a restart of the model actor ----------------------


def test_a_restarted_model_actor_keeps_its_rate_limit(sim: SimulatedProvider) -> None:
    rpm = 2
    m = ModelSettings(
        name="m",
        base_url=sim.base_url,
        max_concurrency=4,
        limiter=LimiterConfig(rpm=rpm, tpm=None),
    )
    with running(m) as system:
        first = system.submit("one").result(WAIT_S)
        assert isinstance(first, Completed)
        later = []
        for i in range(2):
            system.tell("model:m", Crash(reason=f"restart {i}"))
            later.append(system.submit(f"later {i}", deadline_s=0.5))
            wait([later[-1]], timeout=WAIT_S)
        done = results(later)
    sent = sim.stats()["models"]["m"]["requests"]
    assert all(isinstance(r, Completed | Expired) for r in done), done
    assert sent <= rpm, f"{sent} requests within a second at rpm={rpm}"


def test_a_restarted_model_actor_keeps_its_breaker_open(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.002, error_rate=1.0))
    m = ModelSettings(
        name="m",
        base_url=sim.base_url,
        retry=RetryConfig(max_attempts=1),
        breaker=BreakerConfig(consecutive_failures=1, cooldown_s=60.0),
    )
    with running(m) as system:
        failed = system.submit("opens the breaker").result(WAIT_S)
        assert isinstance(failed, Failed)
        system.tell("model:m", Crash(reason="restart while open"))
        later = system.submit("must not be sent", deadline_s=0.5).result(WAIT_S)
        state = system.ask("model:m", GetState())
    assert isinstance(later, Expired), later
    assert sim.stats()["models"]["m"]["requests"] == 1
    assert state["incarnation"] == 2


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
    sim: SimulatedProvider, status: int
) -> None:
    """An account out of quota (OpenAI's 429 insufficient_quota), a bad key, an unknown
    model, a request this deployment will not take: none is worth a retry here, and
    the next candidate may well serve it (a non-retryable failure moves the task on)."""
    body = QUOTA_BODY if status == 429 else b'{"error": {"message": "no"}}'
    with RogueProvider(lambda n, b: (status, {}, body)) as rogue:
        broke = ModelSettings(
            name="broke",
            base_url=rogue.base_url,
            retry=RetryConfig(max_attempts=5, initial_s=0.5),
            fallbacks=("backup",),
        )
        backup = ModelSettings(name="backup", base_url=sim.base_url)
        with running(broke, backup) as system:
            result = system.submit("hello", model="broke").result(WAIT_S)
        sent = rogue.count()
    assert isinstance(result, Completed), result
    assert result.model == "backup"
    assert sent == 1  # not retried: a retry waits 0.5 s and would be seen here


def test_an_exhausted_quota_fails_typed_when_there_is_no_fallback() -> None:
    with RogueProvider(lambda n, b: (429, {}, QUOTA_BODY)) as rogue:
        m = ModelSettings(name="m", base_url=rogue.base_url, retry=RetryConfig(max_attempts=5))
        with running(m) as system:
            result = system.submit("hello").result(WAIT_S)
        sent = rogue.count()
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.QUOTA_EXCEEDED
    assert result.status_code == 429
    assert sent == 1


# -- things that hold (regression guards found while hunting) ---------------------


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

    with RogueProvider(reply) as rogue:
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


def test_only_one_probe_goes_while_half_open(sim: SimulatedProvider) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.01, status=500))
    m = ModelSettings(
        name="m",
        base_url=sim.base_url,
        max_concurrency=8,
        retry=RetryConfig(max_attempts=1),
        breaker=BreakerConfig(
            consecutive_failures=3, cooldown_s=0.15, max_cooldown_s=0.15, backoff=1.0
        ),
    )
    with running(m) as system:
        done = results([system.submit(f"p{i}") for i in range(12)])
        state = system.ask("model:m", GetState())
    assert all(isinstance(r, Failed) and r.attempts == 1 for r in done), done
    arrivals = sim.stats()["models"]["m"]["arrivals"]
    assert len(arrivals) == 12 == state["sent"]
    # the first wave (at most the cap, sent before the breaker opened), then one
    # probe per cool-down: never two calls closer than the cool-down after that
    first_wave = [t for t in arrivals if t - arrivals[0] < 0.1]
    assert len(first_wave) <= 8 + 2
    probes = arrivals[len(first_wave) :]
    assert all(b - a >= 0.14 for a, b in itertools.pairwise(probes)), probes


def test_a_request_error_is_not_retried_nor_counted_by_the_breaker(
    sim: SimulatedProvider,
) -> None:
    sim.configure("m", ModelBehaviour(latency_s=0.001, status=422))
    m = ModelSettings(
        name="m",
        base_url=sim.base_url,
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
    assert sim.stats()["models"]["m"]["requests"] == 4


@pytest.mark.parametrize(
    ("headers", "pause_s"),
    [
        (RateLimitHeaders(retry_after_s=2.0, reset_tokens_s=360.0), 2.0),
        # only the requests ran out: their reset, not the tokens' six minutes
        (
            RateLimitHeaders(
                remaining_requests=0,
                reset_requests_s=0.8,
                remaining_tokens=5000,
                reset_tokens_s=360.0,
            ),
            0.8,
        ),
        (
            RateLimitHeaders(
                remaining_requests=0, reset_requests_s=0.8, remaining_tokens=0, reset_tokens_s=9.0
            ),
            9.0,
        ),
        (RateLimitHeaders(reset_requests_s=0.8, reset_tokens_s=360.0), 0.8),  # no remaining
        (RateLimitHeaders(), 1.0),
    ],
    ids=["retry-after", "requests-spent", "both-spent", "sooner-reset", "bare"],
)
def test_a_429_pauses_for_the_limit_it_says_is_spent(
    headers: RateLimitHeaders, pause_s: float
) -> None:
    assert _pause_s(headers) == pause_s


def test_a_call_in_flight_is_cut_at_its_tasks_deadline(sim: SimulatedProvider) -> None:
    """One deadline covers the call too: a provider that hangs does not hold the task
    for the call's own timeout (120 s here), and its breaker does not count the cut."""
    sim.configure("m", ModelBehaviour(latency_s=30.0))
    m = ModelSettings(
        name="m",
        base_url=sim.base_url,
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
