"""How each endpoint of the simulated provider renders a plan: bodies, errors, headers.

Pure: a `Plan` (the engine's decision) and the parsed request in, an `Answer`
(status, headers, body bytes) or a `sse.Stream` out; the app only moves the
bytes. One `Dialect` per endpoint: OpenAI's chat completions and embeddings
(``x-ratelimit-*`` headers with Go-duration resets, OpenAI's error envelope,
503 for the overload fault) and Anthropic's messages (``anthropic-ratelimit-*``
headers with RFC 3339 resets, ``{"type": "error"}`` bodies, 529
``overloaded_error`` for the overload fault). Every dialect answers a 429 with
``retry-after`` (whole seconds; OpenAI also ``retry-after-ms``).

What must hold: the same plan gives the same fault on every endpoint, only
spelled in that endpoint's words; no body or header carries request data
beyond the model name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from callboard.provider import anthropic, wire
from callboard.provider.embeddings import EmbeddingRequest, embeddings_body
from callboard.provider.engine import Outcome, Plan
from callboard.provider.sse import Stream, compact_bytes
from callboard.provider.wire import BadRequestError, ChatRequest

__all__ = ["ANTHROPIC", "CHAT", "EMBEDDINGS", "Answer", "Dialect", "Served", "request_id"]


@dataclass(frozen=True, slots=True)
class Served:
    """One request being answered: what every rendering needs."""

    model: str
    plan: Plan
    request: Any
    """The endpoint's parsed request (`ChatRequest`, `EmbeddingRequest`...)."""
    seq: int
    """The answer's number, unique per provider: its ids derive from it."""
    wall_now: float
    """Wall-clock seconds (``created``, RFC 3339 resets)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer as bytes."""

    status: int
    headers: dict[str, str]
    body: bytes


def request_id(seq: int) -> str:
    return f"req_{seq:024x}"


class Dialect:
    """OpenAI's words for a plan (the chat endpoint's; subclasses change what differs)."""

    malformed = b'{"id": "chatcmpl-malformed", "object": "chat.completion", "choices": [{'
    """A 200 body that is not JSON (the malformed fault)."""
    malformed_event = b'data: {"id": "chatcmpl-malformed", "choices": [{\n\n'
    """A stream's event that is not JSON (the malformed fault)."""
    unavailable_status = 503

    def status(self, plan: Plan) -> int:
        """The HTTP status a plan answers with here."""
        if plan.outcome is Outcome.UNAVAILABLE:
            return self.unavailable_status
        return plan.status

    def headers(self, served: Served) -> dict[str, str]:
        windows = served.plan.windows
        headers = wire.ratelimit_headers(windows) if windows else {}
        headers["x-request-id"] = request_id(served.seq)
        return headers

    def refusal(self, served: Served) -> Answer:
        """The answer of a plan that does not answer 200."""
        plan = served.plan
        status = self.status(plan)
        headers = self.headers(served)
        if plan.retry_after_s is not None:
            headers["retry-after"] = str(math.ceil(plan.retry_after_s))
            headers["retry-after-ms"] = str(math.ceil(plan.retry_after_s * 1000))
        return Answer(status, headers, compact_bytes(_openai_error(served.model, plan, status)))

    def bad_request(self, exc: BadRequestError, seq: int) -> Answer:
        body = wire.error_body(exc.message, "invalid_request_error", param=exc.param)
        return Answer(400, {"x-request-id": request_id(seq)}, compact_bytes(body))

    def unauthorized(self, *, missing: bool, seq: int) -> Answer:
        message = (
            "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            if missing
            else "Incorrect API key provided. You can find your API key in your account settings."
        )
        body = wire.error_body(message, "invalid_request_error", code="invalid_api_key")
        return Answer(401, {"x-request-id": request_id(seq)}, compact_bytes(body))

    def body(self, served: Served) -> bytes:
        chat: ChatRequest = served.request
        return wire.completion_bytes(
            completion_id=f"chatcmpl-{served.seq:024x}",
            model=served.model,
            created=int(served.wall_now),
            plan=served.plan,
            chat=chat,
            seq=served.seq,
        )

    def stream(self, served: Served) -> Stream:
        chat: ChatRequest = served.request
        return wire.chat_stream(
            completion_id=f"chatcmpl-{served.seq:024x}",
            model=served.model,
            created=int(served.wall_now),
            plan=served.plan,
            chat=chat,
            seq=served.seq,
        )


def _openai_error(model: str, plan: Plan, status: int) -> dict[str, Any]:
    refusal = plan.refusal
    if refusal is not None:
        per = "requests per min (RPM)" if refusal.kind == "requests" else "tokens per min (TPM)"
        message = (
            f"Rate limit reached for {model} on {per}. Please try again in {refusal.wait_s:.3f}s."
        )
        return wire.error_body(message, refusal.kind, code="rate_limit_exceeded")
    if plan.outcome is Outcome.HANG:
        return wire.error_body("The request timed out.", "timeout", code="timeout")
    kind, message = _STATUS_ERRORS.get(status, ("server_error", "Simulated error."))
    if status == 429:
        return wire.error_body(message, kind, code="rate_limit_exceeded")
    return wire.error_body(message, kind)


class _Embeddings(Dialect):
    """OpenAI's embeddings endpoint: OpenAI's errors and headers, a ``list`` body."""

    malformed = b'{"object": "list", "data": [{"object": "embedding", "embedding": [0.1,'

    def body(self, served: Served) -> bytes:
        embeddings: EmbeddingRequest = served.request
        return embeddings_body(embeddings, model=served.model)


class _Anthropic(Dialect):
    """Anthropic's Messages endpoint."""

    malformed = b'{"id": "msg_malformed", "type": "message", "content": [{'
    malformed_event = b'event: content_block_delta\ndata: {"type": "content_block_delta", {\n\n'
    unavailable_status = 529

    def headers(self, served: Served) -> dict[str, str]:
        windows = served.plan.windows
        headers = anthropic.ratelimit_headers(windows, served.wall_now) if windows else {}
        headers["request-id"] = request_id(served.seq)
        return headers

    def refusal(self, served: Served) -> Answer:
        plan, model = served.plan, served.model
        status = self.status(plan)
        headers = self.headers(served)
        if plan.retry_after_s is not None:
            headers["retry-after"] = str(math.ceil(plan.retry_after_s))
        message = None
        if plan.refusal is not None:
            per = "requests" if plan.refusal.kind == "requests" else "input tokens"
            message = (
                f"This request would exceed the rate limit for your organization of "
                f"{_limit_of(plan, plan.refusal.kind)} {per} per minute for {model}. "
                "Please try again later."
            )
        body = anthropic.error_body(status, message, request_id=request_id(served.seq))
        return Answer(status, headers, compact_bytes(body))

    def bad_request(self, exc: BadRequestError, seq: int) -> Answer:
        body = anthropic.error_body(400, exc.message, request_id=request_id(seq))
        return Answer(400, {"request-id": request_id(seq)}, compact_bytes(body))

    def unauthorized(self, *, missing: bool, seq: int) -> Answer:
        message = "x-api-key header is required" if missing else "invalid x-api-key"
        body = anthropic.error_body(401, message, request_id=request_id(seq))
        return Answer(401, {"request-id": request_id(seq)}, compact_bytes(body))

    def body(self, served: Served) -> bytes:
        return compact_bytes(anthropic.message_body(**_message_args(served)))

    def stream(self, served: Served) -> Stream:
        return anthropic.message_stream(**_message_args(served))


def _message_args(served: Served) -> dict[str, Any]:
    return {
        "message_id": f"msg_{served.seq:024x}",
        "model": served.model,
        "plan": served.plan,
        "request": served.request,
        "seq": served.seq,
    }


def _limit_of(plan: Plan, kind: str) -> int:
    return next((w.limit for w in plan.windows if w.kind == kind), 0)


_STATUS_ERRORS = {
    400: ("invalid_request_error", "Simulated bad request."),
    401: ("invalid_request_error", "Incorrect API key provided."),
    403: ("permission_error", "You are not allowed to access this model."),
    404: ("invalid_request_error", "The model does not exist or you do not have access to it."),
    429: ("requests", "Rate limit reached. Please try again later."),
    500: ("server_error", "The server had an error while processing your request."),
    503: ("server_error", "The engine is currently overloaded, please try again later."),
}

CHAT = Dialect()
EMBEDDINGS = _Embeddings()
ANTHROPIC = _Anthropic()
