"""Admission: whether a model's next call may start now, and how many credits to grant.

A call starts only through ``gate``: the breaker's permit first, then the
limiter's reservation of ``tokens_of(task)`` (prompt + max_tokens, settled
later). The model actor acts on its answer: ``Passed`` (start it), the
breaker's ``Reject`` or the limiter's ``WaitUntil`` (hand the waiting jobs
back to the queue; nothing goes before ``until`` / ``at``) or ``TooLarge``
(this model can never admit it: ``too_large``). ``to_grant`` answers how many
credits the queue may have now (``Grant``) or when to look again (``Hold``),
from the free slots and the breaker's and the limiter's room for a call of
the typical size. ``send_of`` is the call an admitted job makes.

What must hold: a permit the limiter refuses is released before ``gate``
returns, so a refused call holds no probe slot; given free slots, ``to_grant``
never grants more than they, the breaker's room less the credits out, or the
limiter's ``grantable``, and never zero. Pure: ``now`` is an argument.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from callboard.core.attempt import End
from callboard.core.breaker import Allow, CircuitBreaker, Reject
from callboard.core.limiter import Admit, RateLimiter, Reservation, TooLarge, WaitUntil
from callboard.core.secret import reveal
from callboard.core.settings import ModelSettings
from callboard.messages import (
    REASONING_BACK,
    CallShape,
    Failed,
    FailureReason,
    InvalidRequestError,
    Job,
    Request,
    Task,
)
from callboard.wire import anthropic, azure

__all__ = [
    "Flight",
    "Grant",
    "Hold",
    "Passed",
    "Send",
    "admit",
    "earliest",
    "gate",
    "refusal",
    "send_of",
    "to_grant",
    "tokens_of",
    "too_large",
    "window_of",
]


Send = tuple[int, int, bytes, float | None, int, CallShape | None]
"""One call for the I/O loop: task id, attempt, request body, seconds left to the
task's deadline (None: none), rank (the task's priority: lower starts first), and
what else the loop must know of it (None for a plain chat completion)."""


@dataclass(frozen=True, slots=True)
class Passed:
    """The call may start: the breaker allowed it and the limiter reserved for it."""

    permit: Allow
    reservation: Reservation


@dataclass(slots=True)
class Flight:
    """An admitted call in flight: its job, and the permit and reservation it holds
    until its outcome is recorded and settled."""

    job: Job
    permit: Allow
    reservation: Reservation


@dataclass(frozen=True, slots=True)
class Grant:
    """Grant the queue this many credits (> 0) now."""

    credits: int


@dataclass(frozen=True, slots=True)
class Hold:
    """Grant nothing now; look again at ``until`` (None: when a call settles)."""

    until: float | None


def tokens_of(task: Task) -> int:
    """What admission reserves for a call of ``task``: its prompt and all of max_tokens,
    for each of its choices."""
    return task.prompt_tokens + task.request.output_tokens


def gate(
    now: float, breaker: CircuitBreaker, limiter: RateLimiter, task: Task
) -> Passed | Reject | WaitUntil | TooLarge:
    """Admission for one call of ``task``: the breaker, then the limiter."""
    parts = (task.prompt_tokens, task.request.output_tokens)  # what tokens_of adds up
    return admit(now, breaker, limiter, tokens_of(task), parts)


def admit(
    now: float,
    breaker: CircuitBreaker,
    limiter: RateLimiter,
    tokens: int,
    parts: tuple[int, int] | None = None,
) -> Passed | Reject | WaitUntil | TooLarge:
    """Admission for one call of ``tokens`` (``parts``: its input and output, where they
    are limited apart), the task not known yet: a permit a cluster's model lends a
    process (``cluster._lease``) for whichever task takes it. The breaker, then the
    limiter; what one passes the other refuses is given back."""
    permit = breaker.before_call(now)
    if not isinstance(permit, Allow):
        return permit
    decision = limiter.try_acquire(now, tokens, parts)
    if isinstance(decision, Admit):
        return Passed(permit, decision.reservation)
    breaker.release(now, permit)
    return decision


def too_large(decision: TooLarge, model: str) -> End:
    """A call ``model``'s token limit can never admit: the job leaves it for the rest of
    its plan if any (the limit is this model's), else fails as a bad request."""
    detail = f"needs {decision.tokens} tokens; {model} admits {decision.limit:g} per minute"
    return End(Failed, {"reason": FailureReason.REQUEST_ERROR, "detail": detail}, move_on=True)


def untranslatable(settings: ModelSettings, task: Task) -> End | None:
    """A request ``settings``' dialect cannot carry (``refusal``): the job leaves this
    model for the rest of its plan if any, else fails as a bad request naming the
    field. Routing leaves such a model out of the plan already; this holds for a plan
    made before (a job restored from a ledger, a configuration changed)."""
    said = refusal(settings, task.request)
    if said is None:
        return None
    detail = f"{settings.name}: {said}"
    return End(Failed, {"reason": FailureReason.REQUEST_ERROR, "detail": detail}, move_on=True)


def refusal(settings: ModelSettings, request: Request) -> str | None:
    """Why ``settings``' dialect cannot carry ``request`` (Anthropic's has no ``n`` > 1,
    no ``logprobs``, ``seed``, penalties, ``json_object``, names or a temperature above
    1, an empty turn), naming the field; None when it can (every plain request with no
    empty turn, at a temperature Anthropic takes, can, and is not looked at twice: an
    empty turn, taken for one it could carry, failed ``INTERNAL`` when its body was
    made, its fallback never tried; found by a hunt)."""
    hot = request.temperature is not None and request.temperature > anthropic.MAX_TEMPERATURE
    if settings.api != "anthropic":
        return None
    if not request.options and request.plain and not hot and _carried_as_is(request):
        return None
    try:
        _body(settings, request, streamed=False)
    except InvalidRequestError as exc:
        return str(exc)
    return None


def _carried_as_is(request: Request) -> bool:
    """Whether a plain chat's turns are ones the Messages API takes as they are: none
    empty, and one at least not the system's (a chat of system turns alone went out
    with no messages, a 400)."""
    messages = request.messages
    return all(m.content for m in messages) and any(
        m.role not in ("system", "developer") for m in messages
    )


def to_grant(
    now: float,
    free: int,
    breaker: CircuitBreaker,
    limiter: RateLimiter,
    typical_tokens: float,
    *,
    granted: int = 0,
    answers_due: bool = False,
    held_until: float | None = None,
    held_back_tokens: int = 0,
) -> Grant | Hold:
    """How many of ``free`` slots to grant now, calls being ``typical_tokens`` large,
    ``granted`` credits being out already (each may come back as a call: a half-open
    breaker's probe slots are promised to them), ``answers_due``: calls in flight,
    whose answers may say the provider's limits anew; ``held_until``: when admission
    last said "not before" (no credit until then: the calls it held back would come
    again on it, back and forth); ``held_back_tokens``: the size of the call the
    limiter said it to, if larger than usual (no credit before a call that large could
    go: granted as soon as a usual one fit, each credit took a small call of another
    tenant whose turn it was, and the large one went back and forth behind them all;
    199 hand-backs for 2 calls, found by a hunt)."""
    if held_until is not None and now < held_until:
        return Hold(held_until)
    breaker_room = breaker.capacity(now)
    if breaker_room is not None:
        breaker_room -= granted
        if breaker_room <= 0:
            return Hold(breaker.reopen_at)
        free = min(free, breaker_room)
    typical = max(1, round(typical_tokens), held_back_tokens)
    limit = limiter.grantable(now, typical)
    if limit <= 0:
        at = limiter.available_at(now, typical)
        if at != math.inf:
            return Hold(at)
        # the typical call is larger than the model now admits in a minute (the provider
        # lowered its limit): once a call that fits could go and no answer is coming
        # that may say the limit anew, what waits comes to be told, each ``TooLarge``
        # ending or moving on at once and a smaller one passing (held, 26 queued tasks
        # waited 63 s for the verdict; found by a hunt); before, a grant would only
        # bring back calls that wait, and they went back and forth (a review)
        fits_at = limiter.available_at(now, 1)
        if answers_due or fits_at > now:
            return Hold(None if answers_due else fits_at)
        return Grant(free)
    return Grant(min(free, limit))


def send_of(task: Task, attempt: int, settings: ModelSettings, now: float) -> Send:
    """The call for the I/O loop that attempt ``attempt`` at ``task`` makes."""
    req = task.request
    rank = int(req.priority)
    shape = None
    json_tool = None
    if settings.api == "anthropic" and req.wants_json == "json_schema":
        json_tool = anthropic.json_tool_of(req.options)
    headers = req.extra_headers or None
    plain = json_tool is None and task.stream is None and req.input is None
    if not plain or headers is not None:
        shape = CallShape(
            json_tool=json_tool,
            stream=task.stream,
            embeddings=req.input is not None,
            choices=req.choices,
            headers=headers,
        )
    return (task.task_id, attempt, wire_body(settings, task), time_left(task, now), rank, shape)


def unmade(said: str) -> End:
    """How a task ends whose call's body could not be made (``send_of`` raised; ``said``:
    the error, in words, redacted): a bug, or a value no check foresaw, of this task's
    alone, not its request's fault, so it goes to no fallback. The model's actor
    raised it, was restarted and handed the task again, until the supervisor gave up
    and the whole system stopped (an integer of 5,000 digits in a tool's schema; found
    by a hunt)."""
    detail = f"callboard could not make the call's body: {said}"
    return End(Failed, {"reason": FailureReason.INTERNAL, "detail": detail})


def window_of(cap: int, limiter: RateLimiter) -> int:
    """How many admitted calls may wait on the I/O loop beyond the ``cap`` on the wire,
    to refill a freed slot in the loop iteration it frees in (see ``runtime.http``).

    A quarter of the cap, rounded down: every call granted ahead starts within one
    slot cycle, so a CRITICAL task waits at most that long behind granted LOW work.
    Zero below four slots (the hop it saves is small beside a call's own time), and
    zero while a rate limit is in force: a call waiting there was charged when
    admitted, and sent later it could put more in the provider's window than the
    limit."""
    if limiter.limited:
        return 0
    return cap // 4


def _compact_encoder() -> Callable[[Any], str]:
    """JSON text without spaces, as ``json.dumps(separators=(",", ":"))`` writes it. Built
    once from the C encoder when there is one: ``JSONEncoder.encode`` builds a new C
    encoder per call, with a table of the objects seen (cycles), and that was most of
    the cost (measured 6.0 against 1.8 us a chat body; a body is built from a checked
    request, which holds no cycle)."""
    python = json.JSONEncoder(separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - an interpreter without the C accelerator
        return python.encode
    chunks = make(
        None,  # no cycle check
        python.default,
        json.encoder.encode_basestring_ascii,
        None,  # no indent
        ":",
        ",",
        False,  # sort_keys
        False,  # skipkeys
        True,  # allow_nan, as json.dumps
    )
    return lambda body: "".join(chunks(body, 0))


_COMPACT = _compact_encoder()


def wire_body(settings: ModelSettings, task: Task) -> bytes:
    """The JSON body a call of ``task`` sends: for a chat, the request's Chat
    Completions fields, the cap in the field the model takes it in
    (``max_tokens_param``), ``stream`` with the usage asked for when the caller reads
    a stream, and the dialect's translation for a model whose ``api`` is not OpenAI's;
    for texts to embed, the embeddings body. ``extra_body``'s fields go at the top
    level (as the official SDK sends them)."""
    return _COMPACT(_body(settings, task.request, streamed=task.stream is not None)).encode()


def _body(settings: ModelSettings, req: Request, *, streamed: bool) -> dict[str, Any]:
    body: dict[str, Any]
    if req.input is not None:
        body = {"model": settings.wire_model, "input": req.input}
    else:
        body = {
            "model": settings.wire_model,
            "messages": [m.wire() for m in req.messages],
            settings.max_tokens_param: req.max_tokens,
        }
        if req.temperature is not None:
            body["temperature"] = req.temperature
        if streamed:
            body["stream"] = True
            if _asks_usage(settings):
                body["stream_options"] = {"include_usage": True}
    if req.options:  # never stream_options: a request cannot carry it
        body.update(req.options)
    if settings.api == "anthropic":
        if req.input is not None:
            raise InvalidRequestError("input: Anthropic's API has no embeddings")
        return anthropic.request_body(body)  # extra_body's fields go in there
    body.pop("thinking", None)  # Anthropic's: no other API takes it (extra_body's goes)
    if "extra_body" in body:
        body.update(body.pop("extra_body"))
    if req.input is None and any(
        m.thinking_blocks is not None or m.reasoning_content is not None for m in req.messages
    ):
        unsent = REASONING_BACK - settings.sends_back
        body["messages"] = [_without(turn, unsent) for turn in body["messages"]]
    return body


def _without(turn: dict[str, Any], unsent: frozenset[str]) -> dict[str, Any]:
    """A turn without the reasoning its model is not sent (``sends_back``): a Claude
    model's signed thinking, which only Anthropic's API and a proxy in front of it
    read, and a reasoning model's text, which DeepSeek's thinking mode wants back and
    OpenAI's API refuses (a conversation moved between models goes on without it, as
    its text answer and tool calls)."""
    for field in unsent:
        turn.pop(field, None)
    return turn


def _asks_usage(settings: ModelSettings) -> bool:
    """Whether a stream of this model asks for its usage (``stream_options``): OpenAI's
    does; Anthropic's says it unasked; Azure's if the API version it asks for takes the
    field (an older one refused every stream with a 400; its usage is then estimated,
    and marked so)."""
    if settings.api == "azure":
        version = azure.version_of(reveal(settings.base_url), settings.api_version)
        return azure.streams_usage(version)
    return settings.api != "anthropic"


def time_left(task: Task, now: float) -> float | None:
    """Seconds until the task's deadline (never negative), or None without one."""
    return None if task.deadline_at is None else max(0.0, task.deadline_at - now)


def earliest(a: float | None, b: float | None) -> float | None:
    """The sooner of two optional times (None: no time)."""
    if a is None:
        return b
    return a if b is None else min(a, b)
