"""What a request that is not answered gets: each API's error body and status.

Every way a request can end unanswered maps here, in one table each, to an
``ApiError``: the status the official SDK turns into its own exception class,
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body, and the
retry headers. One ``ApiError`` is rendered per API: ``body()`` is OpenAI's
shape (every route but ``/v1/messages``), ``anthropic_body()`` and
``anthropic_status()`` Anthropic's (``{"type": "error", "error": {"type",
"message"}}``, see "Anthropic's shape" below).

    status  SDK class                  callboard's reason
    400     BadRequestError            InvalidRequestError, NO_ROUTE, REQUEST_ERROR (the
                                       provider refused the request itself; its 413
                                       and 422 keep their status)
    401     AuthenticationError        no key, or not one of ours
    403     PermissionDeniedError      a model or route the key may not use
    404     NotFoundError              an unknown model or route, an unknown path
    409     ConflictError              an Idempotency-Key whose first request ended
                                       unanswered, or that this gateway forgot
    422     UnprocessableEntityError   an Idempotency-Key reused with another body
    429     RateLimitError             QUEUE_FULL (with Retry-After), RATE_LIMITED, and
                                       QUOTA_EXCEEDED / BUDGET_EXCEEDED (insufficient_quota)
    500     InternalServerError        INTERNAL
    502     InternalServerError        PROVIDER_ERROR, CONNECTION, MALFORMED_RESPONSE,
                                       MALFORMED_OUTPUT, STREAM_CUT, AUTHENTICATION (the
                                       provider refused callboard's key: not the client's)
    503     InternalServerError        a system stopping or stopped, PROVIDER_DOWN (with
                                       Retry-After: when a probe may go again),
                                       LOCAL_RESOURCES (the gateway out of file
                                       descriptors or socket buffers, with Retry-After)
    504     InternalServerError        Expired (the request's deadline passed), TIMEOUT

Why 504 for ``Expired``: the SDK's ``APITimeoutError`` is raised only for its own
client-side timeout, never for a status; 408 would reach the caller as a bare
``APIStatusError`` (and the SDK retries 408), while 504 is what a proxy answers
when upstream did not answer in time and reaches the caller as
``InternalServerError`` with ``code == "deadline_exceeded"``.

Anthropic's shape: the error's ``type`` is Anthropic's word for its status
(400 and other 4xx ``invalid_request_error``, 401 ``authentication_error``, 403
``permission_error``, 404 ``not_found_error``, 409 ``conflict_error``, 413
``request_too_large``, 429 ``rate_limit_error``, 504 ``timeout_error``, 529
``overloaded_error``, other 5xx ``api_error``), and a provider that is down
(``PROVIDER_DOWN``) is 529 ``overloaded_error`` (the ``anthropic`` SDK's
``OverloadedError``) where OpenAI's shape says 503. The headers are the same.

Retries: callboard retries by its own policy, so a ``Failed`` result is what is
left after that policy ran out. Its error says ``x-should-retry: false`` (the
SDK obeys it), so a client's retries do not multiply callboard's. What callboard
refused without trying (a full queue, a system stopping) says
``x-should-retry: true`` with ``Retry-After`` (and ``retry-after-ms``, which the
SDK reads first). So does ``PROVIDER_DOWN``: every model the request could use is
given up on, and callboard failed it without a call; its ``Retry-After`` is when a
breaker lets a probe through again (``back_in``: the request's first model's, by the
models' latest health), when a retry may be served. Without it an SDK gave up on a
model that would take a probe seconds later. So does ``LOCAL_RESOURCES``: the gateway
could not open the task's last connection to the provider (out of file descriptors
or socket buffers), so that call was never sent, and what ended the task is the
gateway's own trouble (503, not a provider's 502), which its clients leaving frees.
An expired request is not retried either: its caller's deadline is over.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from callboard.messages import (
    Cancelled,
    Expired,
    Failed,
    FailureReason,
    Health,
    InvalidRequestError,
    QueueFullError,
    Rejected,
    RejectReason,
    Result,
    UnavailableError,
    UnknownModelError,
    UsageError,
)
from callboard.wire.errors import error_body

__all__ = ["ApiError", "back_in", "error_for_exception", "error_for_result", "stopping_error"]

INVALID = "invalid_request_error"
SERVER = "server_error"


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiError:
    """An answer that is an error: status, body (OpenAI's or Anthropic's), retry headers."""

    status: int
    message: str
    type: str = INVALID
    """OpenAI's ``error.type``."""
    code: str | None = None
    """OpenAI's ``error.code`` (``model_not_found``, ``rate_limit_exceeded``...)."""
    param: str | None = None
    """The request field at fault, when one is."""
    retry_after_s: float | None = None
    """Sent as ``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms``."""
    retry: bool | None = None
    """Sent as ``x-should-retry`` (None: not sent; the SDK then decides by status)."""

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_status(self) -> int:
        """The status on Anthropic's route: 529 for an overloaded provider, else the same."""
        return OVERLOADED if self.code in _OVERLOADED_CODES else self.status

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error body."""
        status = self.anthropic_status()
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else INVALID)
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, round(self.retry_after_s * 1000)))
        if self.retry is not None:
            headers["x-should-retry"] = "true" if self.retry else "false"
        return headers


_KEPT_REFUSALS: Final = frozenset({413, 422})
"""The provider's refusals of a request that keep their status: each SDK has a class of
its own for them (Anthropic's ``RequestTooLargeError`` for its 413 ``request_too_large``,
``UnprocessableEntityError``); a 413 reached the anthropic SDK as a bare 400 (a hunt).
Its other 4xx (a model it does not know, a field it will not take) stay 400: what the
gateway's client asked, not a page it asked for, was refused."""
OVERLOADED = 529
"""Anthropic's status for an API that cannot take the request now (``overloaded_error``)."""
_OVERLOADED_CODES: Final = frozenset({"provider_down", "provider_overloaded"})
_ANTHROPIC_TYPES: Final[Mapping[int, str]] = {
    400: INVALID,
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    OVERLOADED: "overloaded_error",
}
"""Anthropic's error ``type`` per status (other 4xx: ``invalid_request_error``; other
5xx: ``api_error``), as its errors reference lists them (504 ``timeout_error`` and 409
``conflict_error`` as the ``anthropic`` SDK's ``ErrorType`` has them)."""


@dataclass(frozen=True, slots=True)
class _Kind:
    status: int
    type: str
    code: str
    waits: bool = False
    """Whether the answer carries ``Retry-After``."""


_FAILED: Final[Mapping[FailureReason, _Kind]] = {
    FailureReason.RATE_LIMITED: _Kind(429, "requests", "rate_limit_exceeded"),
    FailureReason.PROVIDER_ERROR: _Kind(502, SERVER, "provider_error"),
    FailureReason.TIMEOUT: _Kind(504, SERVER, "provider_timeout"),
    FailureReason.CONNECTION: _Kind(502, SERVER, "provider_connection"),
    FailureReason.MALFORMED_RESPONSE: _Kind(502, SERVER, "provider_malformed_response"),
    FailureReason.QUOTA_EXCEEDED: _Kind(429, "insufficient_quota", "insufficient_quota"),
    FailureReason.REQUEST_ERROR: _Kind(400, INVALID, "provider_refused_request"),
    FailureReason.AUTHENTICATION: _Kind(502, SERVER, "provider_authentication"),
    FailureReason.PROVIDER_DOWN: _Kind(503, SERVER, "provider_down", waits=True),
    FailureReason.MALFORMED_OUTPUT: _Kind(502, SERVER, "malformed_output"),
    FailureReason.STREAM_CUT: _Kind(502, SERVER, "stream_cut"),
    FailureReason.BUDGET_EXCEEDED: _Kind(429, "insufficient_quota", "budget_exceeded"),
    FailureReason.NO_ROUTE: _Kind(400, INVALID, "no_route"),
    FailureReason.LOCAL_RESOURCES: _Kind(503, SERVER, "gateway_out_of_resources", waits=True),
    FailureReason.INTERNAL: _Kind(500, SERVER, "internal_error"),
}
"""Each failure reason's answer; none is worth a client's retry (callboard retried) but
``PROVIDER_DOWN``'s, once the ``Retry-After`` it carries has passed, and
``LOCAL_RESOURCES``'s: the gateway itself ran out (of file descriptors: idle clients held
them), which its clients leaving frees; the provider was never called."""

_REJECTED: Final[Mapping[RejectReason, tuple[_Kind, bool]]] = {
    RejectReason.UNKNOWN_MODEL: (_Kind(404, INVALID, "model_not_found"), False),
    RejectReason.QUEUE_FULL: (_Kind(429, "requests", "queue_full", waits=True), True),
    RejectReason.STOPPING: (_Kind(503, SERVER, "stopping", waits=True), True),
    RejectReason.DUPLICATE: (_Kind(409, INVALID, "idempotency_key_reused"), False),
}
"""Each refusal's answer, and whether a retry may succeed."""


def error_for_result(
    result: Result, retry_after_s: float, *, back_in_s: float | None = None
) -> ApiError:
    """The answer to a request whose ``result`` is not ``Completed``; ``back_in_s``: for
    ``PROVIDER_DOWN`` (the caller gives it for no other), the seconds until a model it
    could use takes a probe again (None: not known, ``retry_after_s`` is said)."""
    detail = getattr(result, "detail", "") or ""
    if isinstance(result, Failed):
        kind = _FAILED[result.reason]
        if result.reason is FailureReason.AUTHENTICATION:  # the gateway's key, not the client's:
            words = _OUR_KEY if result.status_code != 403 else _DENIED  # none of the provider's
            return _error(kind, words, retry_after_s, retry=False)
        if kind.waits:  # PROVIDER_DOWN, LOCAL_RESOURCES: the last call was never made; a
            wait_s = retry_after_s if back_in_s is None else back_in_s  # retry may be served
            return _error(kind, detail or result.reason.value, wait_s, retry=True)
        error = _error(kind, detail or result.reason.value, retry_after_s, retry=False)
        said_status = result.status_code
        if result.reason is FailureReason.STREAM_CUT and said_status and said_status >= 400:
            error = dataclasses.replace(error, status=said_status)  # the provider's event: its
            # type goes on (a client retries an overloaded_error, not an api_error)
        if result.reason is FailureReason.REQUEST_ERROR and said_status in _KEPT_REFUSALS:
            error = dataclasses.replace(error, status=said_status)
        said = _provider_said(detail)
        if said is not None:
            message, param, code = said
            error = dataclasses.replace(
                error, message=message, param=param or error.param, code=code or error.code
            )
        if result.reason is FailureReason.PROVIDER_ERROR and said_status == OVERLOADED:
            error = dataclasses.replace(error, code="provider_overloaded")  # Anthropic's 529:
        return error  # its route says overloaded_error, which its SDK raises as such
    if isinstance(result, Rejected):
        kind, retry = _REJECTED[result.reason]
        return _error(kind, detail or result.reason.value, retry_after_s, retry=retry)
    if isinstance(result, Expired):
        message = "the request's deadline passed before it was served" + (
            f": {detail}" if detail else ""
        )
        return ApiError(
            status=504, message=message, type=SERVER, code="deadline_exceeded", retry=False
        )
    if isinstance(result, Cancelled):
        return ApiError(
            status=503,
            message=f"the request was cancelled: {detail or 'callboard is stopping'}",
            type=SERVER,
            code="cancelled",
            retry_after_s=retry_after_s,
            retry=True,
        )
    raise TypeError(f"{type(result).__name__} is not an unanswered result")


def back_in(
    health: Mapping[str, Health], model: str | None, now: float, longest_s: float
) -> float | None:
    """For a request failed ``PROVIDER_DOWN`` (every model it could use given up on):
    the seconds until a probe may go again, by the models' latest ``health`` at ``now``.
    Its first model's time (``model``, the result's) where that health says it is
    given up, else the soonest of all models given up on (a result does not carry its
    plan). None (``retry_after_s`` is said): no health says, or the time has passed
    (the breaker half-opens as it is next read: said as a millisecond, a retry spent
    an SDK's retries on the same 503; found by a review). At most ``longest_s``, the
    longest a breaker here may stay open: a time read on another clock says nothing
    sane."""
    down = {
        name: h.reopen_at
        for name, h in health.items()
        if h.given_up is FailureReason.PROVIDER_DOWN and h.reopen_at is not None
    }
    at = down.get(model or "")
    if at is None and down:
        at = min(down.values())
    if at is None or at <= now:
        return None
    return min(at - now, longest_s)


_OUR_KEY: Final = (
    "the provider refused the gateway's own credentials for this model: a matter for "
    "the gateway's operator (its log has the provider's answer), not for this request"
)
"""What a client is told of a provider's 401 to the gateway: not the provider's
words, which quote the gateway's key (OpenAI's "Incorrect API key provided: sk-proj-
***...abcd", its prefix and last four characters) and whose code (``invalid_api_key``)
would say the client's key was wrong."""
_DENIED: Final = (
    "the provider denied this request to the gateway (a permission its key lacks, a model "
    "or region it may not use): the gateway's log has the provider's answer"
)
"""What a client is told of a provider's 403: it may be the request's model or region,
not the key; its words, as a 401's, stay in the gateway's log."""


def error_for_exception(exc: Exception, retry_after_s: float) -> ApiError:
    """The answer to a request that ``submit`` refused by raising ``exc``."""
    message = str(exc)
    if isinstance(exc, UnknownModelError):
        return ApiError(status=404, message=message, code="model_not_found", param="model")
    if isinstance(exc, InvalidRequestError | UsageError):
        return ApiError(status=400, message=message, param=_param(message))
    if isinstance(exc, QueueFullError):
        kind = _REJECTED[RejectReason.QUEUE_FULL][0]
        return _error(kind, message, retry_after_s, retry=True)
    if isinstance(exc, UnavailableError):
        return ApiError(
            status=503,
            message=message,
            type=SERVER,
            code="unavailable",
            retry_after_s=retry_after_s,
            retry=True,
        )
    raise exc


def stopping_error(message: str, retry_after_s: float) -> ApiError:
    """The answer to a request callboard stopped before it could serve: the 503 of a
    task refused ``STOPPING``, with ``Retry-After``."""
    kind, retry = _REJECTED[RejectReason.STOPPING]
    return _error(kind, message, retry_after_s, retry=retry)


def _provider_said(detail: str) -> tuple[str, str | None, str | None] | None:
    """The message, param and code of a provider's own error body (OpenAI's shape, or
    Anthropic's), when ``detail`` is one: passed on as the SDK reads them, not as a JSON
    string in the message with the param and code lost."""
    read = error_body(detail) if detail.startswith("{") else None  # None: not JSON, or
    if read is None or not isinstance(read[1].get("message"), str):  # one cut as text
        return None
    error = read[1]
    param, code = error.get("param"), error.get("code")
    return (
        error["message"],
        param if isinstance(param, str) else None,
        code if isinstance(code, str) else None,
    )


def _error(kind: _Kind, message: str, retry_after_s: float, *, retry: bool) -> ApiError:
    return ApiError(
        status=kind.status,
        message=message,
        type=kind.type,
        code=kind.code,
        retry_after_s=retry_after_s if kind.waits else None,
        retry=retry,
    )


_PARAM = re.compile(r"([A-Za-z_][\w]*(?:\[\d+\]|\.[A-Za-z_]\w*)*)(?::| must )")


def _param(message: str) -> str | None:
    """The field an ``InvalidRequestError`` names first (``messages[0].role``), if any."""
    match = _PARAM.match(message)
    return match.group(1) if match else None
