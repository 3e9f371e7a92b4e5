"""Classify the outcome of one provider call: the single place that decides.

Theory of operation
-------------------
A call ends either with an HTTP status (the provider answered) or with a
transport-level failure (``ErrorKind``: no usable answer). ``classify`` maps
that to a ``Verdict`` with three independent answers:

* ``retryable`` -- is trying again worth it (the retry policy's input);
* ``breaker``   -- what the circuit breaker should learn (``Signal``): SUCCESS,
  OUTAGE, FATAL (the provider refuses us until someone acts: the breaker opens
  at once) or NEUTRAL (nothing about its health: a bad request, a rate limit);
* ``reason``    -- the ``FailureReason`` a ``Failed`` result carries, or None.

Rules (one table, ``_BY_STATUS`` plus the ranges below):

    2xx                         success              SUCCESS  (reason None)
    408                         retryable            NEUTRAL  TIMEOUT
    409                         retryable            NEUTRAL  PROVIDER_ERROR
    429                         retryable            NEUTRAL  RATE_LIMITED
    429 insufficient_quota      not retryable        FATAL    QUOTA_EXCEEDED
    402 (payment required)      not retryable        FATAL    QUOTA_EXCEEDED
    401                         not retryable        FATAL    AUTHENTICATION
    403                         not retryable        NEUTRAL  AUTHENTICATION
    other 4xx                   not retryable        NEUTRAL  REQUEST_ERROR
    5xx                         retryable            OUTAGE   PROVIDER_ERROR
    anything else (1xx, 3xx)    not retryable        NEUTRAL  PROVIDER_ERROR
    ErrorKind.TIMEOUT           retryable            OUTAGE   TIMEOUT
    ErrorKind.CONNECTION        retryable            OUTAGE   CONNECTION
    ErrorKind.MALFORMED         retryable            OUTAGE   MALFORMED_RESPONSE
    ErrorKind.LOCAL             retryable            NEUTRAL  LOCAL_RESOURCES
    ErrorKind.DEADLINE          not retryable        NEUTRAL  TIMEOUT (ends Expired)

A 403 is a permission the request may lack, not the key's refusal: a beta it asked
for, a model or a region the account may not use. It ends its task (which moves on
to a fallback) and leaves the model's other calls alone: taken for a refused key, one
client's request with a beta its provider refused gave the model up for every key
and tenant of a gateway for the breaker's cooldown, and told them all the gateway's
credentials were refused (found by a hunt). An account that may use nothing of the
model costs each task one refused call, which is not billed.

A 429 saying ``insufficient_quota`` (OpenAI's out-of-credit answer) is no rate
limit: no wait makes it pass, and like a refused key it stops the model's other
calls at once rather than each being sent to hear the same.

What always holds: a transport error wins over any status (a 200 whose body
cannot be parsed is MALFORMED); a verdict has a reason exactly when it is not
a success; a success is never retryable. Verdicts are shared constants, so
classifying allocates nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from callboard.messages import FailureReason
from callboard.wire.errors import error_body

__all__ = ["ErrorKind", "Signal", "Verdict", "classify"]


class ErrorKind(enum.Enum):
    """A call that produced no usable HTTP answer."""

    TIMEOUT = "timeout"
    """No answer within the call's timeout."""
    CONNECTION = "connection"
    """Could not connect, or the connection broke mid-call."""
    MALFORMED = "malformed"
    """An answer arrived (typically 200) but its body could not be parsed."""
    DEADLINE = "deadline"
    """The task's deadline came before the answer: the call was cut (the task
    ends ``Expired``; the provider's health is not judged by it)."""
    CUT = "cut"
    """A stream broke after its first delta reached the reader: not retried (the
    reader has part of an answer), the task fails ``STREAM_CUT`` with that part."""
    ABANDONED = "abandoned"
    """The stream's reader left; the call was ended there (the task is cancelled)."""
    LOCAL = "local"
    """This process could not open the call's connection: out of file descriptors
    (``EMFILE``, ``ENFILE``) or socket buffers. Retried, and no news of the provider:
    read as its connection failing, it opened the breakers of healthy providers while
    idle clients held a gateway's descriptors (found by a hunt). Its task fails
    ``LOCAL_RESOURCES``: the provider was not what failed."""


class Signal(enum.Enum):
    """What a call's outcome tells the circuit breaker about the provider's health."""

    SUCCESS = "success"
    OUTAGE = "outage"
    FATAL = "fatal"
    """The provider refuses us until someone acts (key, quota): open at once."""
    NEUTRAL = "neutral"


@dataclass(frozen=True, slots=True)
class Verdict:
    """How one call ended, as the retry policy, the breaker and the result need it."""

    retryable: bool
    """Whether another attempt could succeed."""
    breaker: Signal
    """What the circuit breaker should record."""
    reason: FailureReason | None
    """Why the call failed, or None when it succeeded."""

    def __post_init__(self) -> None:
        if (self.reason is None) != (self.breaker is Signal.SUCCESS):
            raise ValueError("reason must be None exactly when breaker is SUCCESS")
        if self.retryable and self.reason is None:
            raise ValueError("retryable must be False for a success")

    @property
    def ok(self) -> bool:
        """True when the call succeeded."""
        return self.reason is None


SUCCESS = Verdict(retryable=False, breaker=Signal.SUCCESS, reason=None)
_RATE_LIMITED = Verdict(retryable=True, breaker=Signal.NEUTRAL, reason=FailureReason.RATE_LIMITED)
_REQUEST_TIMEOUT = Verdict(retryable=True, breaker=Signal.OUTAGE, reason=FailureReason.TIMEOUT)
_REQUEST_ERROR = Verdict(
    retryable=False, breaker=Signal.NEUTRAL, reason=FailureReason.REQUEST_ERROR
)
_SERVER_ERROR = Verdict(retryable=True, breaker=Signal.OUTAGE, reason=FailureReason.PROVIDER_ERROR)
_CONFLICT = Verdict(retryable=True, breaker=Signal.NEUTRAL, reason=FailureReason.PROVIDER_ERROR)
"""A 409: OpenAI and Anthropic answer it when a lock on their side timed out; their own
SDKs retry it (as they retry 408, 429 and 5xx). The request was not wrong, and one
request's conflict says nothing about the provider's health."""
_REQUEST_TIMED_OUT = Verdict(retryable=True, breaker=Signal.NEUTRAL, reason=FailureReason.TIMEOUT)
"""A 408: the server did not get the request in time, and says the client may send it
again (RFC 9110). Often no answer to this request at all: a proxy (HAProxy) writes it
on an idle keep-alive connection before closing it, and the next request sent on that
connection reads it as its answer. Retried, as the SDKs do; no sign of an outage (eight
pooled connections so answered opened a healthy model's breaker)."""
_UNEXPECTED = Verdict(retryable=False, breaker=Signal.NEUTRAL, reason=FailureReason.PROVIDER_ERROR)

_BY_ERROR: dict[ErrorKind, Verdict] = {
    ErrorKind.TIMEOUT: _REQUEST_TIMEOUT,
    ErrorKind.CONNECTION: Verdict(
        retryable=True, breaker=Signal.OUTAGE, reason=FailureReason.CONNECTION
    ),
    ErrorKind.MALFORMED: Verdict(
        retryable=True, breaker=Signal.OUTAGE, reason=FailureReason.MALFORMED_RESPONSE
    ),
    ErrorKind.DEADLINE: Verdict(
        retryable=False, breaker=Signal.NEUTRAL, reason=FailureReason.TIMEOUT
    ),
    ErrorKind.CUT: Verdict(retryable=False, breaker=Signal.OUTAGE, reason=FailureReason.STREAM_CUT),
    ErrorKind.ABANDONED: Verdict(
        retryable=False, breaker=Signal.NEUTRAL, reason=FailureReason.STREAM_CUT
    ),
    ErrorKind.LOCAL: Verdict(
        retryable=True, breaker=Signal.NEUTRAL, reason=FailureReason.LOCAL_RESOURCES
    ),
}

_OUT_OF_QUOTA = Verdict(retryable=False, breaker=Signal.FATAL, reason=FailureReason.QUOTA_EXCEEDED)
_REFUSED_KEY = Verdict(retryable=False, breaker=Signal.FATAL, reason=FailureReason.AUTHENTICATION)
_DENIED = Verdict(retryable=False, breaker=Signal.NEUTRAL, reason=FailureReason.AUTHENTICATION)

_BY_STATUS: dict[int, Verdict] = {
    401: _REFUSED_KEY,
    402: _OUT_OF_QUOTA,
    403: _DENIED,
    408: _REQUEST_TIMED_OUT,
    409: _CONFLICT,
    429: _RATE_LIMITED,
}

_QUOTA_MARK = "insufficient_quota"
"""OpenAI's error type and code for an account out of quota (a 429)."""
_CREDIT_SAID = "Your credit balance is too low"
"""Anthropic's account out of credit: a 400 ``invalid_request_error`` whose message
begins so ("... to access the Anthropic API"), or a ``billing_error``. Taken for a bad
request, it opened no breaker: every task tried the model first, one refused call
each, until someone paid. Read from the error object's fields, never from the text
around them: a 400 may echo what the request said."""


def classify(status_code: int | None, error: ErrorKind | None, body: str | None = None) -> Verdict:
    """Classify a call's outcome; ``error`` (a transport failure) wins over any status.
    ``body``, the error response's text, tells an exhausted quota from a rate limit."""
    if error is not None:
        return _BY_ERROR[error]
    if status_code is None:
        raise ValueError("classify needs a status_code or an error, got neither")
    if body is not None and _out_of_money(status_code, body):
        return _OUT_OF_QUOTA
    special = _BY_STATUS.get(status_code)
    return special if special is not None else _by_class(status_code)


def _by_class(status_code: int) -> Verdict:
    """A status's verdict by its class (2xx, 4xx, 5xx)."""
    if 200 <= status_code < 300:
        return SUCCESS
    if 400 <= status_code < 500:
        return _REQUEST_ERROR
    if 500 <= status_code < 600:
        return _SERVER_ERROR
    return _UNEXPECTED


def _out_of_money(status_code: int, body: str) -> bool:
    """An account out of quota or credit, by what its error body says: OpenAI's 429
    ``insufficient_quota``, Anthropic's 400 (or 402) out of credit."""
    if status_code == 429:
        return _QUOTA_MARK in body
    if status_code not in (400, 402):
        return False
    kind, message = _error_said(body)
    return kind == "billing_error" or (
        kind == "invalid_request_error" and message.startswith(_CREDIT_SAID)
    )


def _error_said(body: str) -> tuple[str, str]:
    """The type and message of the JSON error object ``body`` holds ("" if none)."""
    read = error_body(body)
    if read is None:
        return "", ""
    kind, message = read[1].get("type"), read[1].get("message")
    return (kind if isinstance(kind, str) else ""), (message if isinstance(message, str) else "")
