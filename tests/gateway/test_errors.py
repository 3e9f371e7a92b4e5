"""Every unanswered ending maps to OpenAI's error body (and Anthropic's, on its route)
and a status each SDK turns into its own class; retry headers say what a client may
do."""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

import anthropic
import openai
import pytest
from callboard.gateway.errors import (
    INVALID,
    ApiError,
    back_in,
    error_for_exception,
    error_for_result,
)
from callboard.messages import (
    BreakerState,
    Cancelled,
    ConfigError,
    Expired,
    Failed,
    FailureReason,
    Health,
    InvalidRequestError,
    QueueFullError,
    Rejected,
    RejectReason,
    SystemStoppedError,
    UnknownModelError,
)

IDS = {"task_id": 3, "trace_id": "t.3"}
SDK_HTTP = importlib.import_module(
    openai.DefaultHttpxClient.__mro__[1].__module__.partition(".")[0]
)
"""The HTTP library the SDK is built on (its own ``MockTransport`` and ``Response``)."""


def sdk_error(error: ApiError) -> openai.APIStatusError:
    """What the official SDK raises when a request is answered with ``error``."""

    def answer(request: object) -> object:
        return SDK_HTTP.Response(error.status, json=error.body(), headers=error.headers())

    http = openai.DefaultHttpxClient(transport=SDK_HTTP.MockTransport(answer))
    with (
        openai.OpenAI(
            api_key="x", base_url="http://gateway.test/v1", http_client=http, max_retries=0
        ) as client,
        pytest.raises(openai.APIStatusError) as caught,
    ):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return caught.value


WORTH_A_RETRY = {FailureReason.PROVIDER_DOWN, FailureReason.LOCAL_RESOURCES}
"""Failures callboard met without reaching the provider: a client's retry may be served."""


@pytest.mark.parametrize(
    "reason", [r for r in FailureReason if r not in WORTH_A_RETRY]
)  # a model given up on may serve once its breaker takes a probe (the tests below)
def test_every_failure_reason_has_an_answer_that_says_not_to_retry(reason: FailureReason) -> None:
    error = error_for_result(Failed(reason=reason, detail="why", **IDS), retry_after_s=1)
    assert error.status in {400, 429, 500, 502, 503, 504}
    if reason is not FailureReason.AUTHENTICATION:  # the gateway's key: none of its words
        assert error.message == "why"
    assert error.headers()["x-should-retry"] == "false"
    assert "Retry-After" not in error.headers()


@pytest.mark.parametrize(("status", "kind"), [(529, "overloaded_error"), (429, "rate_limit_error")])
def test_a_stream_cut_by_the_providers_error_event_says_its_type(status: int, kind: str) -> None:
    """Anthropic's ``overloaded_error`` mid-stream reached the client as ``api_error``: code
    that retries on the type missed it. A cut with no error event stays ``api_error``."""
    cut = Failed(reason=FailureReason.STREAM_CUT, detail="overloaded", status_code=status, **IDS)
    assert error_for_result(cut, retry_after_s=1).anthropic_body()["error"]["type"] == kind
    plain = Failed(reason=FailureReason.STREAM_CUT, detail="the stream ended", **IDS)
    assert error_for_result(plain, retry_after_s=1).anthropic_body()["error"]["type"] == "api_error"


BAD = "Invalid value for 'temperature'"


@pytest.mark.parametrize(
    "said",
    [
        {
            "error": {
                "message": "Invalid value for 'temperature'",
                "type": "invalid_request_error",
                "param": "temperature",
                "code": "invalid_value",
            }
        },
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "Invalid value for 'temperature'",
            },
        },
    ],
    ids=["openai", "anthropic"],
)
def test_a_providers_own_error_reaches_the_sdk_as_its_message_param_and_code(
    said: dict[str, Any],
) -> None:
    """Its whole body was the message, a JSON string, and its param and code were lost."""
    failed = Failed(reason=FailureReason.REQUEST_ERROR, detail=json.dumps(said), **IDS)
    error = error_for_result(failed, retry_after_s=1)
    assert error.message == BAD
    assert error.status == 400
    if "param" in said["error"]:
        assert (error.param, error.code) == ("temperature", "invalid_value")
    cut = Failed(reason=FailureReason.REQUEST_ERROR, detail=json.dumps(said)[:30], **IDS)
    assert error_for_result(cut, retry_after_s=1).message == json.dumps(said)[:30]


def test_a_providers_refusal_of_the_gateways_key_passes_on_none_of_its_words() -> None:
    """OpenAI's 401 quotes the key it was given, masked but for its prefix and last four
    characters, with ``code: invalid_api_key``: passed on, every client learned part of
    the gateway's key and was told its own was wrong (found by a hunt)."""
    said = {
        "error": {
            "message": "Incorrect API key provided: sk-proj-********************cdef.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    failed = Failed(
        reason=FailureReason.AUTHENTICATION, detail=json.dumps(said), status_code=401, **IDS
    )
    error = error_for_result(failed, retry_after_s=1)
    assert "cdef" not in error.message
    assert "sk-proj" not in error.message
    assert error.code == "provider_authentication"
    assert "gateway's own credentials" in error.message
    assert error.status == 502
    denied = dataclasses.replace(failed, status_code=403)  # a model or region, not the key
    assert "denied this request" in error_for_result(denied, retry_after_s=1).message


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        (FailureReason.PROVIDER_ERROR, openai.InternalServerError),
        (FailureReason.TIMEOUT, openai.InternalServerError),
        (FailureReason.RATE_LIMITED, openai.RateLimitError),
        (FailureReason.QUOTA_EXCEEDED, openai.RateLimitError),
        (FailureReason.BUDGET_EXCEEDED, openai.RateLimitError),
        (FailureReason.REQUEST_ERROR, openai.BadRequestError),
        (FailureReason.NO_ROUTE, openai.BadRequestError),
        (FailureReason.AUTHENTICATION, openai.InternalServerError),  # callboard's key, not yours
        (FailureReason.INTERNAL, openai.InternalServerError),
    ],
)
def test_the_sdk_raises_its_own_class_for_each_failure(
    reason: FailureReason, kind: type[openai.APIStatusError]
) -> None:
    raised = sdk_error(error_for_result(Failed(reason=reason, **IDS), retry_after_s=1))
    assert type(raised) is kind
    assert raised.code is not None


@pytest.mark.parametrize(
    ("reason", "status", "retry"),
    [
        (RejectReason.UNKNOWN_MODEL, 404, False),
        (RejectReason.QUEUE_FULL, 429, True),
        (RejectReason.STOPPING, 503, True),
        (RejectReason.DUPLICATE, 409, False),
    ],
)
def test_every_refusal_has_an_answer(reason: RejectReason, status: int, retry: bool) -> None:
    error = error_for_result(Rejected(reason=reason, **IDS), retry_after_s=2.5)
    assert error.status == status
    assert error.headers()["x-should-retry"] == ("true" if retry else "false")
    if retry:  # refused without trying: come back later
        assert error.headers()["Retry-After"] == "3"
        assert error.headers()["retry-after-ms"] == "2500"


def test_an_expired_request_is_a_504_deadline_exceeded_not_retried() -> None:
    error = error_for_result(Expired(detail="deadline passed", **IDS), retry_after_s=1)
    raised = sdk_error(error)
    assert isinstance(raised, openai.InternalServerError)
    assert (raised.status_code, raised.code) == (504, "deadline_exceeded")
    assert error.headers() == {"x-should-retry": "false"}


def test_a_cancelled_request_is_unavailable_for_now() -> None:
    error = error_for_result(Cancelled(**IDS), retry_after_s=1)
    assert error.status == 503
    assert error.headers()["x-should-retry"] == "true"


def test_a_completed_result_is_no_error() -> None:
    from callboard.messages import Completed

    with pytest.raises(TypeError):
        error_for_result(Completed(content="x", **IDS), retry_after_s=1)


@pytest.mark.parametrize(
    ("exc", "status", "param"),
    [
        (InvalidRequestError("temperature must be a number in 0..2, got 5"), 400, "temperature"),
        (
            InvalidRequestError("messages[2].tool_calls[0].function: must be an object"),
            400,
            "messages[2].tool_calls[0].function",
        ),
        (InvalidRequestError("messages[0].role: must be one of"), 400, "messages[0].role"),
        (InvalidRequestError("request prompt is empty: every message"), 400, None),
        (ConfigError("bad"), 400, None),
        (UnknownModelError("unknown model 'x'"), 404, "model"),
        (QueueFullError("queue stayed full"), 429, None),
        (SystemStoppedError("callboard is stopped"), 503, None),
    ],
)
def test_a_refused_submit_is_answered_by_what_it_raised(
    exc: Exception, status: int, param: str | None
) -> None:
    error = error_for_exception(exc, retry_after_s=1)
    assert (error.status, error.param) == (status, param)
    assert error.body()["error"]["message"] == str(exc)


def test_an_unexpected_exception_is_not_mistaken_for_an_answer() -> None:
    with pytest.raises(KeyError):
        error_for_exception(KeyError("bug"), retry_after_s=1)


# -- Anthropic's shape (POST /v1/messages) ----------------------------------------------------

ANTHROPIC_HTTP = importlib.import_module(
    anthropic.DefaultHttpxClient.__mro__[1].__module__.partition(".")[0]
)


def anthropic_error(error: ApiError) -> anthropic.APIStatusError:
    """What the ``anthropic`` SDK raises when a message is answered with ``error``."""

    def answer(request: object) -> object:
        return ANTHROPIC_HTTP.Response(
            error.anthropic_status(), json=error.anthropic_body(), headers=error.headers()
        )

    http = anthropic.DefaultHttpxClient(transport=ANTHROPIC_HTTP.MockTransport(answer))
    with (
        anthropic.Anthropic(
            api_key="x", base_url="http://gateway.test", http_client=http, max_retries=0
        ) as client,
        pytest.raises(anthropic.APIStatusError) as caught,
    ):
        client.messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    return caught.value


@pytest.mark.parametrize(
    ("error", "kind", "status", "type_"),
    [
        (ApiError(status=400, message="x"), anthropic.BadRequestError, 400, INVALID),
        (
            ApiError(status=401, message="x"),
            anthropic.AuthenticationError,
            401,
            "authentication_error",
        ),
        (
            ApiError(status=403, message="x"),
            anthropic.PermissionDeniedError,
            403,
            "permission_error",
        ),
        (ApiError(status=404, message="x"), anthropic.NotFoundError, 404, "not_found_error"),
        (ApiError(status=409, message="x"), anthropic.ConflictError, 409, "conflict_error"),
        (ApiError(status=422, message="x"), anthropic.UnprocessableEntityError, 422, INVALID),
        (ApiError(status=429, message="x"), anthropic.RateLimitError, 429, "rate_limit_error"),
        (ApiError(status=500, message="x"), anthropic.InternalServerError, 500, "api_error"),
        (ApiError(status=502, message="x"), anthropic.InternalServerError, 502, "api_error"),
        (ApiError(status=504, message="x"), anthropic.InternalServerError, 504, "timeout_error"),
    ],
)
def test_the_anthropic_sdk_raises_its_own_class_for_each_status(
    error: ApiError, kind: type[anthropic.APIStatusError], status: int, type_: str
) -> None:
    raised = anthropic_error(error)
    assert isinstance(raised, kind)
    assert (raised.status_code, raised.type, raised.api_message) == (status, type_, "x")


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (413, anthropic.RequestTooLargeError),
        (422, anthropic.UnprocessableEntityError),
        (404, anthropic.BadRequestError),  # the gateway's model, not the client's page
    ],
)
def test_a_request_the_provider_refused_keeps_a_status_the_sdk_has_a_class_for(
    status: int, kind: type[anthropic.APIStatusError]
) -> None:
    said = Failed(reason=FailureReason.REQUEST_ERROR, status_code=status, detail="no", **IDS)
    assert isinstance(anthropic_error(error_for_result(said, retry_after_s=1)), kind)


def test_a_gateway_out_of_descriptors_is_its_own_503_not_the_providers_502() -> None:
    """A gateway whose process could not open a connection to the provider (idle clients
    held its file descriptors) answered 502 ``provider_connection``, "not to retry": the
    provider was blamed for the gateway's trouble, and the SDK gave up at once."""
    out = Failed(
        reason=FailureReason.LOCAL_RESOURCES,
        detail="out of file descriptors: raise its open-file limit, ulimit -n",
        **IDS,
    )
    error = error_for_result(out, retry_after_s=2)
    assert (error.status, error.code, error.retry) == (503, "gateway_out_of_resources", True)
    assert error.headers() == {
        "Retry-After": "2",
        "retry-after-ms": "2000",
        "x-should-retry": "true",
    }
    assert "file descriptors" in error.message
    raised = sdk_error(error)
    assert type(raised) is openai.InternalServerError
    assert raised.code == "gateway_out_of_resources"
    assert anthropic_error(error).status_code == 503


def test_a_provider_that_is_down_is_anthropics_529_overloaded() -> None:
    error = error_for_result(Failed(reason=FailureReason.PROVIDER_DOWN, **IDS), retry_after_s=1)
    assert error.status == 503  # OpenAI's shape keeps its status
    raised = anthropic_error(error)
    assert isinstance(raised, anthropic.InternalServerError)
    assert (raised.status_code, raised.type) == (529, "overloaded_error")


def test_a_provider_that_is_down_says_when_a_retry_may_be_served() -> None:
    """A ``PROVIDER_DOWN`` 503 said ``x-should-retry: false`` and no ``Retry-After``: an
    SDK gave up at once, though the model's breaker would take a probe seconds later."""
    down = Failed(reason=FailureReason.PROVIDER_DOWN, detail="m is given up on", **IDS)
    error = error_for_result(down, retry_after_s=1, back_in_s=12.3)
    assert (error.status, error.code, error.retry) == (503, "provider_down", True)
    assert error.headers() == {
        "Retry-After": "13",
        "retry-after-ms": "12300",
        "x-should-retry": "true",
    }
    unknown = error_for_result(down, retry_after_s=2.5)  # no model's health says when
    assert unknown.headers()["Retry-After"] == "3"
    other = error_for_result(Failed(reason=FailureReason.TIMEOUT, **IDS), 1, back_in_s=12.3)
    assert other.headers() == {"x-should-retry": "false"}  # callboard retried it already


def _down(model: str, reopen_at: float | None, given_up: FailureReason | None) -> Health:
    breaker = BreakerState.OPEN if reopen_at is not None else BreakerState.CLOSED
    return Health(model=model, breaker=breaker, reopen_at=reopen_at, given_up=given_up)


def test_the_wait_of_a_provider_down_is_its_first_models_else_the_soonest() -> None:
    down = FailureReason.PROVIDER_DOWN
    health = {
        "a": _down("a", 130.0, down),
        "b": _down("b", 105.0, down),
        "c": _down("c", 101.0, FailureReason.AUTHENTICATION),  # given up on, not down
        "d": _down("d", None, None),
    }
    assert back_in(health, "a", now=100.0, longest_s=120.0) == 30.0  # the request's own
    assert back_in(health, "d", now=100.0, longest_s=120.0) == 5.0  # else the soonest down
    assert back_in(health, None, now=100.0, longest_s=120.0) == 5.0
    assert back_in(health, "a", now=100.0, longest_s=12.0) == 12.0  # no longer than a
    # breaker stays open here: a time read on another clock says nothing sane
    assert back_in(health, "a", now=131.0, longest_s=120.0) is None  # passed: the breaker
    # half-opens as it is next read; said as 1 ms, an SDK spent its retries at once
    assert back_in({"d": health["d"]}, "d", now=100.0, longest_s=120.0) is None


def test_a_providers_own_529_is_anthropics_overloaded_error_too() -> None:
    """A Claude model's 529, given up on, reached the anthropic SDK as a 502
    ``api_error`` (found by a hunt): its route says what the provider said."""
    said = Failed(reason=FailureReason.PROVIDER_ERROR, status_code=529, detail="Overloaded", **IDS)
    error = error_for_result(said, retry_after_s=1)
    assert error.status == 502  # OpenAI's shape: a provider's error
    raised = anthropic_error(error)
    assert (raised.status_code, raised.type) == (529, "overloaded_error")
    other = error_for_result(
        Failed(reason=FailureReason.PROVIDER_ERROR, status_code=500, **IDS), retry_after_s=1
    )
    assert anthropic_error(other).status_code == 502


def test_a_full_queue_is_anthropics_rate_limit_error_with_its_retry_headers() -> None:
    error = error_for_exception(QueueFullError("the queue is full"), retry_after_s=2.5)
    raised = anthropic_error(error)
    assert isinstance(raised, anthropic.RateLimitError)
    assert raised.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "the queue is full"},
    }
    assert raised.response.headers["Retry-After"] == "3"
    assert raised.response.headers["x-should-retry"] == "true"
