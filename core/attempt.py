"""Attempt: what one finished attempt at a model means, and what it teaches the limits.

From the attempt's verdict (``outcome.classify``) ``judge`` decides, and the
model actor carries it out:

* the deadline cut the call in flight: ``End(Expired)``, never retried;
* it answered: ``End(Completed)`` with the provider's usage (or, if it
  reported none, the most the call could have used) and its cost;
* ``RetryAt``: the job waits off the concurrency cap until ``at``, then goes
  through admission again (a 429 counts in ``Job.rate_limited``, not as an
  attempt);
* this model gives up on it: ``End(Failed, move_on=True)``, the job leaves
  for the rest of its plan (``fallback.leave``) if any, else it ends ``Failed``.

``learn_limits`` feeds the response back into the rate limiter (settle,
adopt, observe, back off and pause after a 429, recover after an answer).

What must hold: every attempt gets exactly one decision; the retry policy is
asked only about an attempt that failed and was not cut (its seeded jitter
draws nothing otherwise), counting this model's calls only (a fallback has
retries of its own); a 429 is never charged against the token limit and
always pauses the model. Nothing here touches an actor, a thread, the clock
or the network: times and the parsed headers come in as arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from callboard.core.answer import read_answer
from callboard.core.limiter import RateLimiter, RateLimitHeaders, Reservation
from callboard.core.outcome import ErrorKind, Verdict, classify
from callboard.core.pricing import Price, cost_nusd, most_nusd, writes_cache
from callboard.core.retry import GiveUp, RetryPolicy
from callboard.messages import (
    CallResult,
    Cancelled,
    Completed,
    Expired,
    Failed,
    FailureReason,
    Job,
    Result,
    Task,
    Usage,
)

__all__ = [
    "NO_HEADERS",
    "Decision",
    "End",
    "Paid",
    "RetryAt",
    "judge",
    "learn_limits",
    "pause_s",
    "said",
    "tokens_used",
    "unserved",
]

NO_HEADERS = RateLimitHeaders()
"""What a response without rate-limit headers says (most successes)."""
_CUT_DETAIL = "the deadline passed while the call was in flight; it was cut"


@dataclass(frozen=True, slots=True)
class End:
    """The task ends with a ``kind`` result carrying ``fields`` (besides the common
    ones), unless ``move_on`` is set and another model can take the job."""

    kind: type[Result]
    fields: Mapping[str, Any]
    move_on: bool = False
    """This model gives up on the job: the rest of its plan may take it first
    (``fallback.leave``)."""


@dataclass(frozen=True, slots=True)
class RetryAt:
    """Call this model again, through admission, at clock time ``at``."""

    at: float
    paid: Paid | None = None
    """What the call just made used and cost, if it was billed though it served
    nothing (a 200 that could not be read): the task's result counts it."""


Paid = tuple[Usage, int]
"""A call's usage and cost (nano-USD)."""


Decision = End | RetryAt


_ANSWERED_UNREAD = frozenset(
    {ErrorKind.MALFORMED.value, ErrorKind.CONNECTION.value, ErrorKind.TIMEOUT.value}
)
"""The errors of a call answered 2xx whose answer could not be read: billed all the same
(a completion's 2xx comes once it is made; one whose body stalled past the timeout was
charged nothing, then sent again: found by a hunt)."""


def judge(
    r: CallResult,
    job: Job,
    verdict: Verdict,
    headers: RateLimitHeaders,
    *,
    retry: RetryPolicy,
    price: Price,
    now: float,
) -> Decision:
    """What one attempt (``r``, classified as ``verdict``) means for ``job``."""
    task = job.task
    price = served_price(price, r.answer, task)
    if r.error in _UNFINISHED:
        return _unfinished(r, task, price)
    if verdict.reason is None and r.error is None:
        usage, cost = charged(r, task, price)
        extra = read_answer(r.answer, task.request) if r.answer is not None else {}
        if "reason" in extra:  # asked for strict JSON, answered otherwise: paid, not served
            return End(
                Failed, {**extra, "usage": usage, "cost_nusd": cost, "request_id": r.request_id}
            )
        return End(Completed, {**_completed(r, usage, cost), **extra})
    reason = verdict.reason or FailureReason.MALFORMED_RESPONSE
    decision = retry.decide(
        attempt=job.model_attempt,  # this model's calls: a fallback has retries of its own
        verdict=verdict,
        retry_after_s=headers.retry_after_s,
        now=now,
        deadline=task.deadline_at,
        refused=job.rate_limited + (reason is FailureReason.RATE_LIMITED),
    )
    paid: Paid | None = None
    if r.error in _ANSWERED_UNREAD and r.status_code is not None and r.status_code < 300:
        # answered, so billed, but unreadable (or its body broke off): charged as the docs
        # say, at its estimate, whether the task ends here, is retried or moves on (a
        # retried or moved one was charged nothing, and a budget paid for 1 of 4 such
        # calls; found by a hunt)
        paid = charged(r, task, price)
    if not isinstance(decision, GiveUp):
        return RetryAt(now + decision.delay_s, paid)
    detail = r.detail or decision.why
    failed: dict[str, Any] = {
        "reason": reason,
        "status_code": r.status_code,
        "detail": detail,
        "request_id": r.request_id,
    }
    if paid is not None:
        failed |= {"usage": paid[0], "cost_nusd": paid[1]}
    return End(Failed, failed, move_on=True)


_UNFINISHED = frozenset(k.value for k in (ErrorKind.DEADLINE, ErrorKind.ABANDONED, ErrorKind.CUT))
"""Calls that end their task unfinished, whatever their status: never retried."""

_REFUSALS = frozenset({429, 503, 529})
"""A provider's statuses for a call it refused without serving it: its rate limit or
quota (429), overloaded or unavailable (503; Anthropic's 529)."""


def unserved(r: CallResult) -> bool:
    """Whether the provider refused call ``r`` without serving it (``_REFUSALS``; not a
    stream's error event after its deltas, which served part of an answer)."""
    return r.status_code in _REFUSALS and r.error not in _UNFINISHED


def _unfinished(r: CallResult, task: Task, price: Price) -> End:
    """A call cut by the deadline (``Expired``), a stream whose reader left
    (``Cancelled``), or a stream broken after its first delta (``STREAM_CUT``, with the
    text the reader had). Each was sent and may be billed: charged what it used, or
    (no usage came) the most it could have, marked estimated."""
    usage, cost = charged(r, task, price)
    paid = {"usage": usage, "cost_nusd": cost, "request_id": r.request_id}
    if r.error == ErrorKind.DEADLINE.value:
        return End(Expired, {"detail": _CUT_DETAIL, **paid})
    if r.error == ErrorKind.ABANDONED.value:
        return End(Cancelled, {"detail": "the stream's reader closed it", **paid})
    cut = {"reason": FailureReason.STREAM_CUT, "detail": r.detail, "partial_text": r.content}
    if r.status_code is not None and r.status_code >= 400:  # a provider's error event: what
        cut["status_code"] = r.status_code  # it stood for (Anthropic's overloaded: 529)
    return End(Failed, {**cut, **paid})


def served_price(price: Price, answer: Mapping[str, Any] | None, task: Task) -> Price:
    """``price`` at the service tier that served the call: the answer's ``service_tier``,
    else (no answer says) the one the request asked for. A priority call was charged the
    standard price, a flex one too (found by a hunt)."""
    if not price.service_tiers:
        return price
    tier = answer.get("service_tier") if answer is not None else None
    return price.at_service_tier(
        tier if tier is not None else task.request.options.get("service_tier")
    )


def most_charged(task: Task, price: Price) -> tuple[Usage, int]:
    """A call of ``task`` cut without its usage: the most it could have used
    (``most_used``) and the most that can cost at ``price`` (the tier it asked for)."""
    return _most(task, served_price(price, None, task))


def charged(r: CallResult, task: Task, price: Price) -> tuple[Usage, int]:
    """What a call used and cost at ``price`` (its served tier's): the provider's count,
    else (none given) the most it could have (``most_used``, ``most_nusd``), with its
    prompt as the provider counted it if a stream said so before it ended
    (``prompt_heard``: an Anthropic stream cut after its ``message_start`` was charged
    callboard's estimate of its prompt, 8 tokens for 3,000 said; found by a hunt)."""
    usage = known_usage(r, task)
    if usage is None:
        return _most(task, price)
    return usage, cost_nusd(price, usage)


def known_usage(r: CallResult, task: Task) -> Usage | None:
    """What the provider said call ``r`` used: its usage, else the prompt a stream said
    before it ended, its output at the most it could have been (marked estimated);
    None if it said neither."""
    if r.usage is not None:
        return r.usage
    heard: Usage | None = getattr(r, "prompt_heard", None)  # (an older actor's: none)
    if heard is None:
        return None
    return replace(heard, completion_tokens=most_used(task).completion_tokens)


def _most(task: Task, price: Price) -> tuple[Usage, int]:
    usage = most_used(task)
    writes = writes_cache(task.request)
    cost = most_nusd(price, usage.prompt_tokens, usage.completion_tokens, cache_writes=writes)
    return usage, cost


def most_used(task: Task) -> Usage:
    """The most a call of ``task`` could have used, marked estimated: its prompt and all
    of its ``max_tokens`` (an embedding has no output to count)."""
    return Usage(
        prompt_tokens=task.prompt_tokens,
        completion_tokens=0 if task.request.input is not None else task.request.output_tokens,
        estimated=True,
    )


def said(reason: FailureReason | None, status_code: int | None, detail: str) -> str:
    """A failed attempt in words: its reason, HTTP status if any, and detail."""
    what = (reason or FailureReason.MALFORMED_RESPONSE).value
    if status_code is not None:
        what = f"{what} (HTTP {status_code})"
    return f"{what}: {detail}" if detail else what


def _completed(r: CallResult, usage: Usage, cost: int) -> dict[str, Any]:
    return {
        "content": r.content,
        "finish_reason": r.finish_reason,
        "usage": usage,
        "cost_nusd": cost,
        "raw": r.raw,
        "ttft_s": None if r.first_token_at is None else r.first_token_at - r.started_at,
        "request_id": r.request_id,
    }


OUT_FOR_A_WHILE = frozenset({503, 529})
"""Statuses whose ``Retry-After`` says how long the service itself is out (RFC 9110's
503; Anthropic's 529, overloaded): the model pauses for it as for a 429's, and a long
one makes it *resting* (``core.health``), its work with a fallback going there."""


def learn_limits(
    limiter: RateLimiter, now: float, res: Reservation, r: CallResult, headers: RateLimitHeaders
) -> None:
    """Settle the call's reservation and take in what the response says of the limits:
    an advertised limit lower than ours; after a 429, a limit where we had none, a
    pause and, from a provider that does not say its limits, a back-off; after a 503
    or a 529 that says when to come back, a pause; after an answer, a step back up
    (``RateLimiter.recover``)."""
    used = tokens_used(r, res, refunds=limiter.refunds)
    limiter.settle(now, res, used, parts_used(r, res, refunds=limiter.refunds))
    # a rate limit's refusal only: a 429 saying the account is out of quota (billing)
    # is the breaker's business, not a pace (four such 429s cut the limit to 225 rpm,
    # a configured 3000 to 2250: found by a hunt)
    refused = r.status_code == 429 and _rate_limited(r)
    advertised = bool(headers.limit_requests or headers.limit_tokens)
    if advertised:
        # the provider's word beats ours, downwards; with no limit of ours, only once
        # it has said no (taken as per minute, as OpenAI's and Anthropic's are)
        limiter.adopt(
            now, headers.limit_requests, headers.limit_tokens, unset_too=refused, sure=refused
        )
    limiter.observe(
        now,
        remaining_requests=headers.remaining_requests,
        remaining_tokens=headers.remaining_tokens,
        reset_requests_s=headers.reset_requests_s,
        reset_tokens_s=headers.reset_tokens_s,
        since=res,
    )
    if headers.limit_parts != (None, None):  # input and output limited apart: each held
        limiter.adopt_parts(now, headers.limit_parts, sure=refused)
        limiter.observe_parts(now, headers.remaining_parts, headers.reset_parts_s, since=res)
    if refused and headers.limit_tokens is not None and res.tokens > headers.limit_tokens:
        return  # refused for its size, not its pace: no pause for the calls that fit (the
        # 26 waiting behind it waited a minute's reset for their own TooLarge; a hunt)
    if refused and headers.should_retry is False:
        return  # this request never goes, says the server: its refusal paces no other
    if refused:
        if not advertised:  # where it says its limits, what remains says the rest
            limiter.back_off(now, res, tokens_spent=headers.remaining_tokens == 0)
        limiter.pause_until(now + pause_s(headers, res.tokens))
    elif r.status_code in OUT_FOR_A_WHILE and headers.retry_after_s is not None:
        limiter.pause_until(now + headers.retry_after_s)
    elif r.error is None and r.status_code is not None and 200 <= r.status_code < 300:
        limiter.recover(now, used, res)


def pause_s(h: RateLimitHeaders, tokens: int = 1) -> float:
    """How long a 429 (for a call of ``tokens``) pauses the model: its Retry-After;
    else, for each limit that has less left than the call needs (one request, its
    tokens), the time the provider takes to refill the deficit, the longer if both
    are short; else the sooner reset; else one second.

    A reset is the time to a full refill (OpenAI's and Anthropic's refill continuously),
    so the deficit takes ``reset * deficit / (limit - remaining)``, and never longer
    than the reset, nor shorter than the deficit at ``limit / 60`` a second. Paused for
    the whole reset, a spent 600 rpm limit (reset 60 s) stopped the model for a minute
    when the next request was there in a tenth of a second; not paused for a token
    deficit (1708 tokens needed, 300 left), 16 callers drew 814 429s for 9 answers
    (found by a hunt). Without a limit said, the deficit is paced by the reset alone."""
    if h.retry_after_s is not None:
        return h.retry_after_s
    short = [
        _refill_s(limit, remaining, reset, need)
        for limit, remaining, reset, need in (
            (h.limit_requests, h.remaining_requests, h.reset_requests_s, 1),
            (h.limit_tokens, h.remaining_tokens, h.reset_tokens_s, max(1, tokens)),
        )
        if remaining is not None and remaining < need and (reset is not None or limit)
    ]
    if short:
        return max(short)
    resets = [t for t in (h.reset_requests_s, h.reset_tokens_s) if t is not None]
    return min(resets) if resets else 1.0


def _refill_s(limit: int | None, remaining: int, reset: float | None, need: int) -> float:
    """How long the provider takes to refill what a call of ``need`` lacks of
    ``remaining``: at its limit a minute, or what its reset says if slower; never more
    than the reset (a full refill), the whole reset where no limit is said."""
    if not limit or limit <= remaining:
        return reset if reset is not None else 1.0
    deficit = need - remaining
    wait = deficit * 60.0 / limit
    if reset is not None:
        wait = min(reset, max(wait, reset * deficit / (limit - remaining)))
    return wait


def _rate_limited(r: CallResult) -> bool:
    """Whether a 429 refused the call for its pace (not the account's quota)."""
    return classify(429, None, r.detail or None).reason is FailureReason.RATE_LIMITED


def parts_used(r: CallResult, res: Reservation, *, refunds: bool = True) -> tuple[int, int] | None:
    """``tokens_used`` for the (input, output) parts a reservation holds apart (None:
    it holds none): the input that counts against an input limit is the prompt not
    read from the provider's cache (Anthropic's ITPM counts uncached input and cache
    writes), the output the completion."""
    reserved = res.parts
    if reserved is None:
        return None
    if r.usage is not None:
        used = (max(0, r.usage.prompt_tokens - r.usage.cached_tokens), r.usage.completion_tokens)
        if refunds:
            return used
        return (max(used[0], reserved[0]), max(used[1], reserved[1]))
    return (0, 0) if r.status_code == 429 else reserved


def tokens_used(r: CallResult, res: Reservation, *, refunds: bool = True) -> int:
    """What a finished call counts against the token limit: its reported usage, or,
    unless the provider ``refunds`` what a call reserved and did not use, the whole
    reservation if more; nothing for a 429; else the whole reservation (a provider
    counts a request's tokens when it arrives, as OpenAI does, so a failed or
    usage-less call may have cost them all)."""
    if r.usage is not None:
        used = r.usage.total_tokens
        return used if refunds else max(used, res.tokens)
    return 0 if r.status_code == 429 else res.tokens
