"""classify: the one table from a call's ending to a verdict."""

from __future__ import annotations

import json

import pytest
from callboard.core.outcome import ErrorKind, Signal, Verdict, classify
from callboard.messages import FailureReason

R = FailureReason


@pytest.mark.parametrize("status", [200, 201, 204, 299])
def test_2xx_is_success(status: int) -> None:
    v = classify(status, None)
    assert v == Verdict(retryable=False, breaker=Signal.SUCCESS, reason=None)
    assert v.ok


def test_429_pauses_the_limiter_not_the_breaker() -> None:
    assert classify(429, None) == Verdict(True, Signal.NEUTRAL, R.RATE_LIMITED)


@pytest.mark.parametrize("status", [500, 502, 503, 504, 529, 599])
def test_5xx_is_a_retryable_outage(status: int) -> None:
    assert classify(status, None) == Verdict(True, Signal.OUTAGE, R.PROVIDER_ERROR)


def test_402_is_an_account_out_of_money_as_a_spent_quota_is() -> None:
    """Anthropic's ``billing_error``, OpenRouter's "insufficient credits": every call
    of the account will fail until someone pays."""
    assert classify(402, None) == Verdict(False, Signal.FATAL, R.QUOTA_EXCEEDED)


def test_409_is_retried_as_the_official_sdks_do_and_says_nothing_of_health() -> None:
    assert classify(409, None) == Verdict(True, Signal.NEUTRAL, R.PROVIDER_ERROR)


def test_408_is_retried_and_says_nothing_of_health() -> None:
    """A proxy writes it on an idle pooled connection; the next call reads it."""
    assert classify(408, None) == Verdict(True, Signal.NEUTRAL, R.TIMEOUT)


@pytest.mark.parametrize("status", [400, 404, 413, 422, 451])
def test_other_4xx_is_the_callers_fault(status: int) -> None:
    assert classify(status, None) == Verdict(False, Signal.NEUTRAL, R.REQUEST_ERROR)


def test_a_refused_key_is_authentication_and_opens_the_breaker_at_once() -> None:
    assert classify(401, None) == Verdict(False, Signal.FATAL, R.AUTHENTICATION)


def test_a_denied_request_is_authentication_and_tells_the_breaker_nothing() -> None:
    """A 403 may be the request's (a beta, a model or region): one client's gave the
    model up for every tenant of a gateway (found by a hunt)."""
    assert classify(403, None) == Verdict(False, Signal.NEUTRAL, R.AUTHENTICATION)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (
            400,
            (
                '{"type":"error","error":{"type":"invalid_request_error","message":"Your credit '
                "balance is too low to access the Anthropic API. Please go to Plans & Billing "
                'to upgrade or purchase credits."}}'
            ),
        ),
        (402, '{"type":"error","error":{"type":"billing_error","message":"Out of credit"}}'),
        (400, '{"type":"error","error":{"type":"billing_error","message":"Out of credit"}}'),
    ],
)
def test_an_anthropic_account_out_of_credit_opens_the_breaker_at_once(
    status: int, body: str
) -> None:
    """Anthropic answers an account out of credit 400 ``invalid_request_error``: taken
    for a bad request, every task tried the model first (found by a hunt)."""
    assert classify(status, None, body) == Verdict(False, Signal.FATAL, R.QUOTA_EXCEEDED)
    bad = '{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: 0"}}'
    assert classify(400, None, bad).reason is R.REQUEST_ERROR


def test_a_bad_request_echoing_the_words_of_a_spent_credit_is_still_a_bad_request() -> None:
    """A 400 quotes the value it refused: matched as text anywhere, a request asking
    for ``reasoning_effort: "credit balance is too low"`` opened the model's breaker
    for every caller (found by a review)."""
    echoed = json.dumps(
        {
            "error": {
                "message": "Invalid value: 'credit balance is too low \"billing_error\"'.",
                "type": "invalid_request_error",
                "param": "reasoning_effort",
                "code": "invalid_value",
            }
        }
    )
    assert classify(400, None, echoed).reason is R.REQUEST_ERROR
    assert classify(400, None, "Your credit balance is too low").reason is R.REQUEST_ERROR


def test_an_exhausted_quota_opens_the_breaker_at_once() -> None:
    body = '{"error": {"type": "insufficient_quota", "code": "insufficient_quota"}}'
    assert classify(429, None, body) == Verdict(False, Signal.FATAL, R.QUOTA_EXCEEDED)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        (ErrorKind.TIMEOUT, R.TIMEOUT),
        (ErrorKind.CONNECTION, R.CONNECTION),
        (ErrorKind.MALFORMED, R.MALFORMED_RESPONSE),
    ],
)
def test_transport_errors_are_retryable_outages(kind: ErrorKind, reason: FailureReason) -> None:
    assert classify(None, kind) == Verdict(True, Signal.OUTAGE, reason)


def test_a_transport_error_wins_over_the_status() -> None:
    assert classify(200, ErrorKind.MALFORMED).reason is R.MALFORMED_RESPONSE
    assert classify(503, ErrorKind.TIMEOUT).reason is R.TIMEOUT


@pytest.mark.parametrize("status", [100, 101, 301, 302, 304, 0, 600, 999])
def test_unexpected_statuses_fail_without_blaming_provider_health(status: int) -> None:
    assert classify(status, None) == Verdict(False, Signal.NEUTRAL, R.PROVIDER_ERROR)


def test_nothing_to_classify_is_a_bug() -> None:
    with pytest.raises(ValueError, match="status_code"):
        classify(None, None)


def test_every_status_gives_a_consistent_verdict() -> None:
    for status in range(1000):
        v = classify(status, None)
        assert (v.reason is None) == (v.breaker is Signal.SUCCESS) == (200 <= status < 300)
        assert not (v.retryable and v.ok)


def test_error_kinds_round_trip_from_their_wire_names() -> None:
    assert {ErrorKind(k.value) for k in ErrorKind} == set(ErrorKind)
    assert ErrorKind("malformed") is ErrorKind.MALFORMED


def test_inconsistent_verdicts_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="reason"):
        Verdict(False, Signal.SUCCESS, R.TIMEOUT)
    with pytest.raises(ValueError, match="reason"):
        Verdict(False, Signal.OUTAGE, None)
    with pytest.raises(ValueError, match="retryable"):
        Verdict(True, Signal.SUCCESS, None)


def test_a_connection_this_process_could_not_open_is_retried_and_no_news_of_the_provider() -> None:
    """Out of file descriptors (idle clients held a gateway's) was read as the provider's
    connection failing: the breakers of healthy providers opened (found by a hunt)."""
    verdict = classify(None, ErrorKind.LOCAL)
    assert verdict.retryable
    assert verdict.breaker is Signal.NEUTRAL
    assert verdict.reason is FailureReason.LOCAL_RESOURCES  # not the provider's connection
