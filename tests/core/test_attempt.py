"""What one finished attempt means (core/attempt.py), on a fake clock: ``judge`` ends the
task, schedules a retry or gives up on this model; ``learn_limits`` settles the
reservation to what the call used and pauses after a 429 for as long as the provider
says; ``tokens_used`` never charges a 429 and never refunds a call that may have cost."""

from __future__ import annotations

import dataclasses
import random
from decimal import Decimal

import pytest
from callboard.core.attempt import (
    NO_HEADERS,
    End,
    RetryAt,
    judge,
    learn_limits,
    most_charged,
    parts_used,
    pause_s,
    tokens_used,
)
from callboard.core.limiter import Admit, LimiterConfig, RateLimiter, RateLimitHeaders, TooLarge
from callboard.core.outcome import ErrorKind, classify
from callboard.core.pricing import Price, cost_nusd, estimate_nusd
from callboard.core.retry import RetryConfig, RetryPolicy
from callboard.messages import (
    CallResult,
    Completed,
    Expired,
    Failed,
    FailureReason,
    Job,
    Request,
    Task,
    Usage,
)

PRICE = Price(Decimal(1), Decimal(2))
NOW = 100.0
RETRY_ONCE = RetryPolicy(RetryConfig(max_attempts=1), random.Random(0))


def job(*, model_attempt: int = 1, deadline_at: float | None = None) -> Job:
    """Task 7's job, ``model_attempt`` calls to this model made (the one judged included)."""
    task = Task(
        task_id=7,
        trace_id="t7",
        request=Request.of("hello", max_tokens=50),
        submitted_at=0.0,
        deadline_at=deadline_at,
        prompt_tokens=9,
    )
    return Job(task=task, candidates=("m",), model_attempt=model_attempt)


def call(status: int | None = 200, error: ErrorKind | None = None, **fields: object) -> CallResult:
    return CallResult(
        task_id=7,
        attempt=1,
        started_at=NOW - 0.5,
        ended_at=NOW,
        status_code=status,
        error=None if error is None else error.value,
        **fields,  # type: ignore[arg-type]
    )


def decide(
    r: CallResult,
    *,
    attempts: int = 3,
    headers: RateLimitHeaders = NO_HEADERS,
    **job_fields: object,
) -> End | RetryAt:
    error = None if r.error is None else ErrorKind(r.error)
    verdict = classify(r.status_code, error, r.detail or None)
    policy = RetryPolicy(
        RetryConfig(max_attempts=attempts, initial_s=1.0, jitter_s=0.0), random.Random(0)
    )
    return judge(r, job(**job_fields), verdict, headers, retry=policy, price=PRICE, now=NOW)  # type: ignore[arg-type]


# -- judge --------------------------------------------------------------------------------


def test_an_answer_completes_the_task_at_its_reported_usage_and_cost() -> None:
    usage = Usage(prompt_tokens=9, completion_tokens=4)
    decision = decide(call(content="hi", finish_reason="stop", usage=usage, request_id="req_1"))
    assert decision == End(
        Completed,
        {
            "content": "hi",
            "raw": None,
            "ttft_s": None,
            "finish_reason": "stop",
            "usage": usage,
            "cost_nusd": cost_nusd(PRICE, usage),
            "request_id": "req_1",
        },
    )


TIERED = Price(1, 2, service_tiers={"priority": Price(2, 4), "flex": Price("0.5", 1)})


@pytest.mark.parametrize(
    ("served", "asked", "price"),
    [
        ("priority", None, Price(2, 4)),  # the answer says which tier served it
        ("default", "priority", PRICE),  # asked priority, served standard: standard
        (None, "flex", Price("0.5", 1)),  # the answer says none: the one asked for
        ("scale", None, PRICE),  # a tier without a price: the model's
    ],
)
def test_an_answer_is_charged_at_the_tier_that_served_it(
    served: str | None, asked: str | None, price: Price
) -> None:
    """A priority call was charged the standard price (half its bill), a flex one
    twice its bill (found by a hunt)."""
    usage = Usage(prompt_tokens=9, completion_tokens=4)
    answer = {"choices": []} if served is None else {"service_tier": served, "choices": []}
    options = {} if asked is None else {"service_tier": asked}
    task = Task(
        task_id=7,
        trace_id="t7",
        request=Request.of("hello", max_tokens=50, **options),
        submitted_at=0.0,
        prompt_tokens=9,
    )
    error = classify(200, None, None)
    policy = RetryPolicy(RetryConfig(max_attempts=1), random.Random(0))
    r = call(content="hi", finish_reason="stop", usage=usage, answer=answer)
    decision = judge(
        r,
        Job(task=task, candidates=("m",), model_attempt=1),
        error,
        NO_HEADERS,
        retry=policy,
        price=TIERED,
        now=NOW,
    )
    assert isinstance(decision, End)
    assert decision.fields["cost_nusd"] == cost_nusd(price, usage)


def test_an_answer_without_usage_is_charged_the_most_it_could_have_cost() -> None:
    decision = decide(call(content="hi"))
    assert isinstance(decision, End)
    usage = decision.fields["usage"]
    assert usage == Usage(prompt_tokens=9, completion_tokens=50, estimated=True)
    assert decision.fields["cost_nusd"] == cost_nusd(PRICE, usage)


CACHE_MARK = {"type": "ephemeral"}
MARKED = Request.of(
    [{"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": CACHE_MARK}]}],
    max_tokens=50,
)


@pytest.mark.parametrize(
    ("price", "request_", "per_mtok"),
    [
        (Price("1", "2", reasoning_per_mtok="4"), None, ("1", "4")),  # all may be reasoning
        (Price("1", "2", cache_write_per_mtok="1.25"), MARKED, ("1.25", "2")),  # all written
        (Price("1", "2", cache_write_per_mtok="1.25"), None, ("1", "2")),  # none asks to be
        (Price("1", "2"), MARKED, ("1", "2")),
    ],
)
def test_a_call_billed_without_its_usage_is_charged_its_dearest_possible_cost(
    price: Price, request_: Request | None, per_mtok: tuple[str, str]
) -> None:
    """Charged at the input and output prices, a reasoning model's cut call cost half what
    the provider billed, under its reservation: a $0.01 budget paid $0.017 (a hunt). A
    prompt is priced as written to the cache only where the request marks it (a review:
    a Claude model's cut calls were charged their prompt at twice the input price)."""
    task_job = job()
    if request_ is not None:
        task_job = Job(task=dataclasses.replace(task_job.task, request=request_), candidates=("m",))
    cut = call(200, ErrorKind.CUT, detail="cut")
    dear_in, dear_out = (Decimal(p) for p in per_mtok)
    expected = (9 * dear_in + 50 * dear_out) * 1000  # n$ for 9 prompt, 50 answer tokens
    for r in (cut, call(content="hi")):
        decision = judge(
            r, task_job, classify(200, None), NO_HEADERS, retry=RETRY_ONCE, price=price, now=NOW
        )
        assert isinstance(decision, End)
        assert decision.fields["cost_nusd"] == expected
        assert decision.fields["cost_nusd"] <= estimate_nusd(price, 9, 50)
    usage, cost = most_charged(task_job.task, price)
    assert usage.estimated
    assert cost == expected


def test_an_embedding_without_usage_is_charged_its_texts_and_no_output() -> None:
    """An embedding has no output: charging it ``max_tokens`` made up tokens it never had."""
    texts = Request(messages=(), input=("a", "b"), max_tokens=1)
    r = call(content="")
    decision = judge(
        r,
        Job(
            task=Task(task_id=7, trace_id="t", request=texts, submitted_at=0.0, prompt_tokens=4),
            candidates=("m",),
        ),
        classify(200, None),
        NO_HEADERS,
        retry=RetryPolicy(RetryConfig(max_attempts=1), random.Random(0)),
        price=PRICE,
        now=NOW,
    )
    assert isinstance(decision, End)
    assert decision.fields["usage"] == Usage(prompt_tokens=4, completion_tokens=0, estimated=True)


def test_an_unreadable_answer_given_up_on_is_charged_its_estimate() -> None:
    """It was served (a 2xx), so billed: the last attempt is charged, as the docs say."""
    decision = decide(call(error=ErrorKind.MALFORMED, detail="unreadable"), attempts=1)
    assert isinstance(decision, End)
    assert decision.kind is Failed
    assert decision.fields["usage"] == Usage(prompt_tokens=9, completion_tokens=50, estimated=True)
    assert decision.fields["cost_nusd"] == cost_nusd(PRICE, decision.fields["usage"])


def test_an_unreadable_answer_retried_is_charged_to_its_task() -> None:
    """Billed though it served nothing: the retry carries what it cost (it was charged
    nothing, and a budget paid for 1 of 4 such calls; found by a hunt)."""
    decision = decide(call(error=ErrorKind.MALFORMED), attempts=2)
    usage = Usage(prompt_tokens=9, completion_tokens=50, estimated=True)
    assert decision == RetryAt(NOW + 1.0, (usage, cost_nusd(PRICE, usage)))


def test_a_2xx_whose_body_timed_out_retried_is_charged_to_its_task() -> None:
    """A completion's 2xx comes once it is made: its body stalled past the timeout, it
    was billed all the same (it was charged nothing; found by a hunt)."""
    decision = decide(call(error=ErrorKind.TIMEOUT), attempts=2)
    usage = Usage(prompt_tokens=9, completion_tokens=50, estimated=True)
    assert decision == RetryAt(NOW + 1.0, (usage, cost_nusd(PRICE, usage)))


def test_a_failure_nothing_was_served_for_costs_nothing() -> None:
    for failed in (
        call(status=503),
        call(status=None, error=ErrorKind.MALFORMED),
        call(status=None, error=ErrorKind.TIMEOUT),
    ):
        decision = decide(failed, attempts=1)
        assert isinstance(decision, End)
        assert "cost_nusd" not in decision.fields


def test_a_call_cut_at_the_deadline_expires_and_is_never_retried() -> None:
    decision = decide(call(status=None, error=ErrorKind.DEADLINE), attempts=5)
    assert isinstance(decision, End)
    assert decision.kind is Expired
    assert "deadline" in decision.fields["detail"]
    assert not decision.move_on


def test_a_retryable_failure_is_called_again_after_the_backoff() -> None:
    assert decide(call(status=500)) == RetryAt(NOW + 1.0)
    assert decide(call(status=500), model_attempt=2) == RetryAt(NOW + 2.0)


def test_a_429_that_says_when_goes_back_at_once_its_models_pause_holding_it() -> None:
    headers = RateLimitHeaders(retry_after_s=7.0)
    assert decide(call(status=429), headers=headers) == RetryAt(NOW)
    far = RateLimitHeaders(retry_after_s=90.0)  # past what is trusted: waited out here
    assert decide(call(status=429), headers=far) == RetryAt(NOW + 90.0)


def test_a_request_error_gives_up_on_this_model_at_once() -> None:
    decision = decide(call(status=400, detail="bad request", request_id="req_2"), attempts=5)
    assert decision == End(
        Failed,
        {
            "reason": FailureReason.REQUEST_ERROR,
            "status_code": 400,
            "detail": "bad request",
            "request_id": "req_2",
        },
        move_on=True,
    )


def test_the_last_attempt_this_model_allows_gives_up_saying_why() -> None:
    decision = decide(call(status=503), attempts=2, model_attempt=2)
    assert isinstance(decision, End)
    assert decision.kind is Failed
    assert decision.move_on
    assert decision.fields["reason"] is FailureReason.PROVIDER_ERROR
    assert decision.fields["status_code"] == 503
    assert decision.fields["detail"]  # the policy's reason, the call having none


def test_a_retry_that_would_land_after_the_deadline_gives_up() -> None:
    decision = decide(call(status=500), attempts=5, deadline_at=NOW + 0.5)
    assert isinstance(decision, End)
    assert decision.kind is Failed


def test_a_malformed_answer_fails_as_malformed() -> None:
    decision = decide(call(status=200, error=ErrorKind.MALFORMED), attempts=1)
    assert isinstance(decision, End)
    assert decision.fields["reason"] is FailureReason.MALFORMED_RESPONSE


# -- tokens_used and learn_limits ---------------------------------------------------------


def reserve(limiter: RateLimiter, tokens: int = 59) -> Admit:
    admitted = limiter.try_acquire(NOW, tokens)
    assert isinstance(admitted, Admit)
    return admitted


def test_tokens_used_is_the_usage_else_nothing_for_a_429_else_the_whole_reservation() -> None:
    res = reserve(RateLimiter(LimiterConfig(rpm=None, tpm=6000), NOW)).reservation
    assert tokens_used(call(usage=Usage(prompt_tokens=9, completion_tokens=4)), res) == 13
    assert tokens_used(call(status=429), res) == 0
    assert tokens_used(call(status=500), res) == res.tokens == 59
    assert tokens_used(call(status=None, error=ErrorKind.CONNECTION), res) == 59


def test_parts_used_are_the_uncached_prompt_and_the_completion() -> None:
    """Anthropic's ITPM counts uncached input (cache reads do not count), its OTPM the
    output; a 429 counted nothing, a call without usage all it reserved."""
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=6000, burst_s=60.0), NOW)
    admitted = limiter.try_acquire(NOW, 59, (50, 9))
    assert isinstance(admitted, Admit)
    res = admitted.reservation
    usage = Usage(prompt_tokens=40, cached_tokens=30, completion_tokens=4)
    assert parts_used(call(usage=usage), res) == (10, 4)
    assert parts_used(call(usage=usage), res, refunds=False) == (50, 9)
    assert parts_used(call(status=429), res) == (0, 0)
    assert parts_used(call(status=500), res) == (50, 9)
    assert parts_used(call(usage=usage), reserve(limiter).reservation) is None  # not told


def test_a_provider_that_refunds_nothing_keeps_a_calls_whole_reservation() -> None:
    """OpenAI counts the prompt and all of ``max_tokens`` as a request arrives: settled
    to the 10 used of 59 reserved, callboard sent 1.4x its tokens-per-minute limit and
    drew its 429s (found by a hunt). More used than reserved is still charged."""
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=6000, burst_s=1.0), NOW, refunds=False)
    res = reserve(limiter).reservation
    used = call(usage=Usage(prompt_tokens=9, completion_tokens=1))
    assert tokens_used(used, res, refunds=False) == 59
    assert tokens_used(call(usage=Usage(prompt_tokens=9, completion_tokens=90)), res) == 99
    assert tokens_used(call(status=429), res, refunds=False) == 0  # refused: not counted
    learn_limits(limiter, NOW, res, used, NO_HEADERS)
    assert limiter.headroom(NOW).tokens == pytest.approx(41)  # 100 - 59


def test_learn_limits_settles_to_the_tokens_used() -> None:
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=6000, burst_s=1.0), NOW)  # 100 in the bucket
    res = reserve(limiter).reservation
    assert limiter.outstanding == 1
    learn_limits(
        limiter, NOW, res, call(usage=Usage(prompt_tokens=9, completion_tokens=1)), NO_HEADERS
    )
    assert limiter.outstanding == 0
    assert limiter.headroom(NOW).tokens == pytest.approx(90)  # charged 10, not 59


def test_a_429_pauses_the_limiter_for_its_retry_after() -> None:
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=None), NOW)
    res = reserve(limiter).reservation
    learn_limits(limiter, NOW, res, call(status=429), RateLimitHeaders(retry_after_s=3.0))
    assert limiter.headroom(NOW).paused_until == NOW + 3.0
    assert limiter.grantable(NOW + 2.9) == 0
    assert limiter.grantable(NOW + 3.0) > 0


def test_a_429_for_a_call_larger_than_the_limit_it_advertises_pauses_nothing() -> None:
    """Refused for its size (4448 tokens, 3000 a minute), not its pace: the limit is
    taken in, so what is as large ends ``TooLarge`` at once, and the calls that fit go
    on; paused for the tokens' reset, 26 tasks waited a minute for that verdict (found
    by a hunt)."""
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=1_000_000), NOW)
    res = reserve(limiter, tokens=4448).reservation
    said = RateLimitHeaders(limit_tokens=3000, remaining_tokens=0, reset_tokens_s=58.0)
    learn_limits(limiter, NOW, res, call(status=429), said)
    assert limiter.headroom(NOW).paused_until is None
    assert isinstance(limiter.try_acquire(NOW, 4448), TooLarge)
    assert isinstance(limiter.try_acquire(NOW + 1.0, 100), Admit)


@pytest.mark.parametrize(("status", "pauses"), [(503, True), (529, True), (500, False)])
def test_a_service_out_for_a_while_pauses_the_limiter_for_its_retry_after(
    status: int, pauses: bool
) -> None:
    """A 503's Retry-After is how long the service is out (RFC 9110), Anthropic's 529
    says it is overloaded; a 500's is one request's failure, and no pause for the
    model. Without a Retry-After, none either (the breaker judges the failures)."""
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=None), NOW)
    learn_limits(limiter, NOW, reserve(limiter).reservation, call(status=status), NO_HEADERS)
    assert limiter.headroom(NOW).paused_until is None
    said = RateLimitHeaders(retry_after_s=30.0)
    learn_limits(limiter, NOW, reserve(limiter).reservation, call(status=status), said)
    assert limiter.headroom(NOW).paused_until == (NOW + 30.0 if pauses else None)


def test_a_429_with_advertised_limits_adopts_them_when_none_was_configured() -> None:
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=None), NOW)
    res = reserve(limiter).reservation
    headers = RateLimitHeaders(retry_after_s=0.0, limit_requests=60)
    learn_limits(limiter, NOW, res, call(status=429), headers)
    assert limiter.headroom(NOW).requests is not None


@pytest.mark.parametrize(
    ("headers", "expected_s"),
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
    headers: RateLimitHeaders, expected_s: float
) -> None:
    assert pause_s(headers) == expected_s


def test_a_quota_429_neither_backs_off_nor_pauses_the_limiter() -> None:
    """``insufficient_quota`` is the account's billing, the breaker's business: four
    such 429s, learned as a rate, cut a configured 3000 a minute to 2250 (no limit: to
    225), and paused the model (found by a hunt). A rate limit's 429 still does both."""
    quota = '{"error": {"type": "insufficient_quota", "code": "insufficient_quota"}}'
    rate = '{"error": {"type": "requests", "code": "rate_limit_exceeded"}}'
    for detail, cut in ((quota, False), (rate, True)):
        limiter = RateLimiter(LimiterConfig(rpm=3000, tpm=None, burst_s=1.0), NOW)
        limiter.recover(NOW, 1)  # an answer came: a 429 is news
        learn_limits(limiter, NOW, reserve(limiter).reservation, call(429, detail=detail),
                     NO_HEADERS)  # fmt: skip
        assert limiter.limits()[0] == (2250 if cut else 3000)
        assert (limiter.headroom(NOW).paused_until is not None) is cut


def test_a_spent_limit_pauses_for_the_deficit_not_the_whole_refill() -> None:
    """A reset is the time to a full refill, and the provider refills continuously: a
    spent 600 a minute (reset 60 s) paused the model for the minute, when its next
    request was there in a tenth of a second (found by a hunt)."""
    spent = RateLimitHeaders(limit_requests=600, remaining_requests=0, reset_requests_s=60.0)
    assert pause_s(spent) == pytest.approx(0.1)
    assert pause_s(RateLimitHeaders(remaining_requests=0, reset_requests_s=60.0)) == 60.0
    short = RateLimitHeaders(limit_tokens=60_000, remaining_tokens=300, reset_tokens_s=0.5)
    assert pause_s(short, 1708) == 0.5, "never longer than the reset"


@pytest.mark.parametrize(("rpm", "tpm"), [(3000, 60_000), (None, None)])
def test_a_token_429_holds_a_call_until_its_tokens_have_refilled(
    rpm: int | None, tpm: int | None
) -> None:
    """A 429 for 1708 tokens with 300 left and no Retry-After paused 20 ms (the requests'
    reset) and the next such call went at once: 814 429s for 9 answers (found by a
    hunt). It pauses for the deficit at the limit's pace, and the refund of the refused
    call's charge (a 429 counts nothing) does not reopen the bucket past what remains."""
    limiter = RateLimiter(LimiterConfig(rpm=rpm, tpm=tpm), NOW, refunds=False)
    res = reserve(limiter, tokens=1708).reservation
    said = RateLimitHeaders(
        limit_requests=3000, remaining_requests=2990, reset_requests_s=0.02,
        limit_tokens=60_000, remaining_tokens=300, reset_tokens_s=58.5,
    )  # fmt: skip
    learn_limits(limiter, NOW, res, call(429, detail='{"error":{"type":"tokens"}}'), said)
    refill = (1708 - 300) / 1000
    assert pause_s(said, 1708) == pytest.approx(refill)
    assert limiter.available_at(NOW, 1708) >= NOW + refill - 1e-9
