"""Admission (core/admission.py, pure): the gate a call passes (the breaker, then the
limiter), how many credits a model grants, and the body and time left of a call."""

from __future__ import annotations

import json
from typing import Any

import pytest
from callboard.core.admission import (
    Grant,
    Hold,
    Passed,
    admit,
    earliest,
    gate,
    send_of,
    time_left,
    to_grant,
    tokens_of,
    too_large,
    untranslatable,
    window_of,
    wire_body,
)
from callboard.core.breaker import Allow, BreakerConfig, CircuitBreaker, Reject
from callboard.core.limiter import Admit, LimiterConfig, RateLimiter, TooLarge, WaitUntil
from callboard.core.outcome import Signal
from callboard.core.settings import ModelSettings
from callboard.messages import ConfigError, Failed, FailureReason, Request, Task

UNLIMITED = LimiterConfig(rpm=None, tpm=None)


def opened(now: float = 0.0, probes: int = 1) -> CircuitBreaker:
    cfg = BreakerConfig(consecutive_failures=1, cooldown_s=5.0, half_open_probes=probes)
    b = CircuitBreaker(cfg)
    permit = b.before_call(now)
    assert isinstance(permit, Allow)
    b.record(now, Signal.OUTAGE, permit)
    return b


def test_a_closed_breaker_grants_every_free_slot() -> None:
    limiter = RateLimiter(UNLIMITED, 0.0)
    assert to_grant(0.0, 8, CircuitBreaker(), limiter, 100.0, granted=3) == Grant(8)


def test_an_open_breaker_grants_nothing_before_its_reopen_time() -> None:
    limiter = RateLimiter(UNLIMITED, 0.0)
    assert to_grant(1.0, 8, opened(), limiter, 100.0) == Hold(5.0)


def test_a_half_open_breaker_grants_its_probe_slots_once() -> None:
    # Credits out may each come back as a call: a probe slot promised to one is not
    # granted again, however often the model looks (it used to grant one per look).
    limiter = RateLimiter(UNLIMITED, 0.0)
    b = opened(probes=2)
    assert b.advance(5.0)
    assert to_grant(5.0, 8, b, limiter, 100.0) == Grant(2)
    assert to_grant(5.0, 6, b, limiter, 100.0, granted=1) == Grant(1)
    assert to_grant(5.0, 6, b, limiter, 100.0, granted=2) == Hold(None)


# -- gate: the breaker, then the limiter ------------------------------------------------------


def task(prompt_tokens: int = 10, max_tokens: int = 20, **fields: Any) -> Task:
    return Task(
        task_id=1,
        trace_id="t1",
        request=Request.of("hi", max_tokens=max_tokens, **fields),
        submitted_at=0.0,
        prompt_tokens=prompt_tokens,
    )


def test_a_call_reserves_its_prompt_and_all_of_max_tokens() -> None:
    assert tokens_of(task(prompt_tokens=10, max_tokens=20)) == 30
    assert tokens_of(task(prompt_tokens=10, max_tokens=20, n=3)) == 70, "20 for each choice"
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=6000, burst_s=1.0), 0.0)  # 100 tokens
    passed = gate(0.0, CircuitBreaker(), limiter, task())
    assert isinstance(passed, Passed)
    assert isinstance(passed.permit, Allow)
    assert passed.reservation.tokens == 30
    assert limiter.outstanding == 1


def test_an_open_breaker_rejects_before_the_limiter_is_asked() -> None:
    limiter = RateLimiter(UNLIMITED, 0.0)
    answer = gate(1.0, opened(), limiter, task())
    assert isinstance(answer, Reject)
    assert answer.until == 5.0
    assert limiter.outstanding == 0


def test_a_limiter_that_says_wait_releases_the_breakers_permit() -> None:
    limiter = RateLimiter(LimiterConfig(rpm=60, tpm=None), 0.0)  # one request now
    breaker = opened(probes=1)
    assert breaker.advance(5.0)  # half-open: one probe slot
    assert isinstance(limiter.try_acquire(5.0, 1), Admit)  # the request window is spent
    answer = gate(5.0, breaker, limiter, task())
    assert isinstance(answer, WaitUntil)
    assert answer.at > 5.0
    assert isinstance(breaker.before_call(5.0), Allow), "the probe slot was given back"


def test_a_call_admitted_before_its_task_is_known_reserves_its_tokens_alike() -> None:
    # what a cluster's model lends a process (cluster/_lease.py): the same breaker and
    # limiter, in the same order, as a task's call
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=1000), 0.0)
    passed = admit(0.0, CircuitBreaker(), limiter, 600)
    assert isinstance(passed, Passed)
    assert passed.reservation.tokens == 600
    assert isinstance(admit(0.0, CircuitBreaker(), limiter, 600), WaitUntil)
    assert isinstance(admit(1.0, opened(), RateLimiter(UNLIMITED, 0.0), 10), Reject)


def test_a_call_larger_than_the_token_limit_can_never_pass_and_moves_on() -> None:
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=100), 0.0)
    breaker = CircuitBreaker()
    answer = gate(0.0, breaker, limiter, task(prompt_tokens=90, max_tokens=20))
    assert isinstance(answer, TooLarge)
    assert (answer.tokens, answer.limit) == (110, 100)
    assert breaker.capacity(0.0) is None  # closed, no permit left out
    end = too_large(answer, "m")
    assert end.kind is Failed
    assert end.move_on
    assert end.fields == {
        "reason": FailureReason.REQUEST_ERROR,
        "detail": "needs 110 tokens; m admits 100 per minute",
    }


# -- to_grant and the limiter -----------------------------------------------------------------


def test_a_limiter_grants_no_more_than_it_would_admit_back_to_back() -> None:
    limiter = RateLimiter(LimiterConfig(rpm=600, tpm=None, burst_s=1.0), 0.0)  # ten now
    assert to_grant(0.0, 64, CircuitBreaker(), limiter, 100.0) == Grant(10)
    assert to_grant(0.0, 3, CircuitBreaker(), limiter, 100.0) == Grant(3)


def test_a_limiter_with_no_room_holds_until_it_has_some() -> None:
    limiter = RateLimiter(LimiterConfig(rpm=60, tpm=None), 0.0)
    assert isinstance(limiter.try_acquire(0.0, 1), Admit)
    answer = to_grant(0.0, 8, CircuitBreaker(), limiter, 1.0)
    assert isinstance(answer, Hold)
    assert answer.until == limiter.available_at(0.0, 1) > 0.0


def test_calls_larger_than_the_limit_now_are_granted_to_be_told_so_at_once() -> None:
    """A provider that lowers its token limit below the calls waiting: held, they waited
    a minute for their ``TooLarge`` (found by a hunt); granted, each hears it at once
    (or, smaller, passes). Paused, they still wait for the pause's end."""
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=1_000_000), 0.0)
    for _ in range(2):  # said twice: no passing word
        limiter.adopt(0.0, limit_requests=None, limit_tokens=3000)
    assert to_grant(0.0, 8, CircuitBreaker(), limiter, 4448.0) == Grant(8)
    # an answer on its way may say the limit anew (a passing word): wait for it
    assert to_grant(0.0, 8, CircuitBreaker(), limiter, 4448.0, answers_due=True) == Hold(None)
    limiter.pause_until(2.0)  # until a call that fits could go: no grant, and a wake-up
    assert to_grant(1.0, 8, CircuitBreaker(), limiter, 4448.0) == Hold(2.0)


def test_no_credit_before_admission_said_it_could_admit() -> None:
    """What admission held back would come again on a credit, and go back again."""
    limiter = RateLimiter(UNLIMITED, 0.0)
    assert to_grant(1.0, 8, CircuitBreaker(), limiter, 1.0, held_until=2.0) == Hold(2.0)
    assert to_grant(2.0, 8, CircuitBreaker(), limiter, 1.0, held_until=2.0) == Grant(8)


def test_no_credit_before_the_call_held_back_could_go() -> None:
    """A bucket of 550 tokens holds a usual 50-token call but not the 520-token one it
    said "not yet" to: granted now, the credit took the next small call of another
    tenant and the large one went back and forth behind them all (found by a hunt)."""
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=60_000, burst_s=0.55), 0.0)
    assert isinstance(limiter.try_acquire(0.0, 400), Admit)  # 150 left, 1,000 a second
    assert to_grant(0.0, 1, CircuitBreaker(), limiter, 50.0) == Grant(1)
    held = to_grant(0.0, 1, CircuitBreaker(), limiter, 50.0, held_back_tokens=520)
    assert held == Hold(limiter.available_at(0.0, 520))
    assert held.until is not None
    assert held.until == pytest.approx(0.37)
    assert to_grant(0.37, 1, CircuitBreaker(), limiter, 50.0, held_back_tokens=520) == Grant(1)


def test_calls_too_large_are_not_granted_while_a_call_that_fits_must_wait() -> None:
    """Granted while the window is spent, the waiting calls came, were held back and
    came again, back and forth (733 grants a second on a cluster; a review)."""
    limiter = RateLimiter(LimiterConfig(rpm=None, tpm=6000), 0.0)
    admitted = limiter.try_acquire(0.0, 100)  # the bucket (50) spent and then some
    assert isinstance(admitted, Admit)
    for _ in range(2):  # said twice: no passing word
        limiter.adopt(0.0, limit_requests=None, limit_tokens=200)
    answer = to_grant(0.0, 8, CircuitBreaker(), limiter, 500.0)
    assert answer == Hold(limiter.available_at(0.0, 1))
    assert answer.until is not None
    assert answer.until > 0.0


def test_a_paused_limiter_holds_until_the_pause_ends() -> None:
    limiter = RateLimiter(UNLIMITED, 0.0)
    limiter.pause_until(3.0)
    assert to_grant(1.0, 8, CircuitBreaker(), limiter, 1.0) == Hold(3.0)
    assert to_grant(3.0, 8, CircuitBreaker(), limiter, 1.0) == Grant(8)


# -- the call's body and time --------------------------------------------------------------


def test_the_body_names_the_wire_model_and_sends_the_cap_in_its_field() -> None:
    settings = ModelSettings(
        name="m",
        base_url="http://127.0.0.1:9/v1",
        provider_model="org/model",
        max_tokens_param="max_completion_tokens",
    )
    task_id, attempt, body, left, rank, shape = send_of(task(), 2, settings, now=0.0)
    assert shape is None  # a plain chat completion
    assert (task_id, attempt, left, rank) == (1, 2, None, int(task().request.priority))
    assert json.loads(body) == {
        "model": "org/model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 20,
    }


def test_a_temperature_is_sent_only_when_set_and_zero_is_a_value() -> None:
    settings = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1")
    cold = Task(
        task_id=1,
        trace_id="t",
        request=Request.of("hi", temperature=0),
        submitted_at=0.0,
    )
    assert json.loads(wire_body(settings, cold))["temperature"] == 0
    assert "temperature" not in json.loads(wire_body(settings, task()))


def test_time_left_counts_down_to_the_deadline_and_never_below_zero() -> None:
    due = Task(task_id=1, trace_id="t", request=Request.of("hi"), submitted_at=0.0, deadline_at=5.0)
    assert time_left(due, 2.0) == 3.0
    assert time_left(due, 9.0) == 0.0
    assert time_left(task(), 9.0) is None


def test_earliest_of_two_optional_times() -> None:
    assert earliest(None, None) is None
    assert earliest(3.0, None) == 3.0
    assert earliest(None, 4.0) == 4.0
    assert earliest(5.0, 4.0) == 4.0


def test_the_window_is_a_quarter_of_the_cap_and_none_below_four() -> None:
    free = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    assert [window_of(cap, free) for cap in (1, 3, 4, 7, 8, 50, 200)] == [0, 0, 1, 1, 2, 12, 50]


def test_no_window_while_a_rate_limit_is_in_force() -> None:
    configured = RateLimiter(LimiterConfig(rpm=600, tpm=None), 0.0)
    assert window_of(200, configured) == 0
    adopted = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    adopted.adopt(0.0, limit_requests=None, limit_tokens=100_000, unset_too=True)
    assert window_of(200, adopted) == 0


def _task_of(request: Request) -> Task:
    return Task(task_id=1, trace_id="t1", request=request, submitted_at=0.0, prompt_tokens=10)


def test_options_and_extra_body_fields_go_in_the_body_as_the_sdk_sends_them() -> None:
    settings = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1")
    request = Request.of("hi", seed=7, stop=["\n"], extra_body={"top_k": 3})
    body = json.loads(wire_body(settings, _task_of(request)))
    assert body["seed"] == 7
    assert body["stop"] == ["\n"]
    assert body["top_k"] == 3
    assert "extra_body" not in body


def test_a_claude_models_signed_thinking_goes_back_to_claude_alone() -> None:
    """A conversation that moves from a Claude model to another goes on without the
    signed thinking blocks no other API reads; the text of its answer stays."""
    signed = {"type": "thinking", "thinking": "hm", "signature": "EqQB"}
    request = Request.of(
        [
            {"role": "user", "content": "who?"},
            {"role": "assistant", "content": "me", "thinking_blocks": [signed]},
            {"role": "user", "content": "and?"},
        ]
    )
    other = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1")
    sent = json.loads(wire_body(other, _task_of(request)))["messages"]
    assert sent[1] == {"role": "assistant", "content": "me"}
    claude = ModelSettings(name="claude", base_url="http://127.0.0.1:9/v1", api="anthropic")
    turn = json.loads(wire_body(claude, _task_of(request)))["messages"][1]
    assert turn["content"] == [signed, {"type": "text", "text": "me"}]


def test_an_anthropic_model_gets_a_messages_body_and_its_json_tool_in_the_calls_shape() -> None:
    settings = ModelSettings(name="claude", base_url="http://127.0.0.1:9/v1", api="anthropic")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": {"type": "object"}}}
    request = Request.of(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "who?"}],
        response_format=fmt,
    )
    *_, body, _, _, shape = send_of(_task_of(request), 1, settings, now=0.0)
    sent = json.loads(body)
    assert sent["system"] == "be brief"
    assert sent["max_tokens"] == 256
    assert sent["tool_choice"] == {"type": "tool", "name": "person"}
    assert shape is not None
    assert shape.json_tool == "person"


def test_a_request_a_dialect_cannot_carry_leaves_that_model_naming_the_field() -> None:
    claude = ModelSettings(name="claude", base_url="http://127.0.0.1:9/v1", api="anthropic")
    gpt = ModelSettings(name="gpt", base_url="http://127.0.0.1:9/v1")
    task = _task_of(Request.of("hi", n=2))
    end = untranslatable(claude, task)
    assert end is not None
    assert end.move_on
    assert "n:" in end.fields["detail"]
    assert end.fields["reason"] is FailureReason.REQUEST_ERROR
    assert untranslatable(gpt, task) is None
    assert untranslatable(claude, _task_of(Request.of("plain"))) is None


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (Request.of("hi", temperature=1.3), "temperature"),
        (Request.of([{"role": "user", "content": "hi", "name": "alice"}]), "messages[0].name"),
        (Request.of([_user("a"), _assistant(""), _user("b")]), "messages[1]"),
        (Request.of([_user("a"), _assistant("x"), _user("")]), "messages[2].content"),
        (Request.of([{"role": "system", "content": "be brief"}]), "messages"),
    ],
)
def test_a_plain_text_request_anthropic_cannot_carry_leaves_it_before_any_call(
    request_: Request, field: str
) -> None:
    """Plain text was never looked at twice: a temperature above Anthropic's 1 was sent
    (and answered 400) instead of moving on to the next model, and a name dropped; an
    empty turn failed ``INTERNAL`` as its body was made, its fallback never tried (a
    hunt)."""
    claude = ModelSettings(name="claude", base_url="http://127.0.0.1:9/v1", api="anthropic")
    end = untranslatable(claude, _task_of(request_))
    assert end is not None
    assert end.move_on
    assert f"{field}:" in end.fields["detail"]
    assert untranslatable(claude, _task_of(Request.of("hi", temperature=1.0))) is None


def test_an_empty_last_assistant_turn_is_one_anthropic_carries() -> None:
    """It asks for nothing and is left out of the body: not a refusal."""
    claude = ModelSettings(name="claude", base_url="http://127.0.0.1:9/v1", api="anthropic")
    request = Request.of([_user("a"), _assistant("")])
    assert untranslatable(claude, _task_of(request)) is None


def test_a_body_is_the_compact_json_json_dumps_writes() -> None:
    settings = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1")
    request = Request.of(
        'héllo \u2603 "quoted" \\ back\nslash',
        temperature=0.25,
        stop=["\n", "\u00e9"],
        extra_body={"nested": {"list": [1, 2.5, None, True], "empty": {}}, "big": 10**20},
    )
    body = _task_of(request)
    wire = wire_body(settings, body)
    expected = json.loads(wire)
    assert wire == json.dumps(expected, separators=(",", ":")).encode()
    assert wire.isascii(), "non-ASCII text goes escaped, as json.dumps writes it"
    assert expected["messages"][0]["content"].startswith("héllo \u2603")


def test_thinking_goes_to_a_claude_model_alone_and_extra_bodys_to_every_model() -> None:
    """Given as ``thinking``, Anthropic's extended thinking is not sent to a fallback of
    another dialect (given in ``extra_body``, OpenAI's API refused the request; found by
    a hunt); given in ``extra_body`` (DeepSeek's own ``thinking``), it is sent as said."""
    think = {"type": "enabled", "budget_tokens": 1024}
    claude = ModelSettings(name="claude", base_url="http://127.0.0.1:9/v1", api="anthropic")
    other = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1")
    asked = _task_of(Request.of("hi", max_tokens=2048, thinking=think))
    assert json.loads(wire_body(claude, asked))["thinking"] == think
    assert "thinking" not in json.loads(wire_body(other, asked))
    deepseek = _task_of(Request.of("hi", extra_body={"thinking": {"type": "enabled"}}))
    assert json.loads(wire_body(other, deepseek))["thinking"] == {"type": "enabled"}


def test_an_answers_reasoning_goes_back_to_a_model_that_takes_it() -> None:
    """DeepSeek's thinking mode wants a tool turn's ``reasoning_content`` back (turn two
    was a 400 without it; found by a hunt); OpenAI's API refuses a field it does not
    know, and a proxy in front of Claude takes the signed blocks: each model is sent
    what its ``sends_back`` names."""
    signed = {"type": "thinking", "thinking": "hm", "signature": "EqQB"}
    turn = {"role": "assistant", "content": "me", "reasoning_content": "hm"}
    request = Request.of(
        [{"role": "user", "content": "who?"}, {**turn, "thinking_blocks": [signed]}]
    )
    sent = {}
    for name, back in (
        ("openai", ()),
        ("deepseek", ("reasoning_content",)),
        ("proxy", ("thinking_blocks",)),
    ):
        settings = ModelSettings(name=name, base_url="http://127.0.0.1:9/v1", sends_back=back)
        sent[name] = json.loads(wire_body(settings, _task_of(request)))["messages"][1]
    assert sent["openai"] == {"role": "assistant", "content": "me"}
    assert sent["deepseek"] == turn
    assert sent["proxy"] == {"role": "assistant", "content": "me", "thinking_blocks": [signed]}
    with pytest.raises(ConfigError, match="sends_back takes"):
        ModelSettings(name="m", base_url="http://127.0.0.1:9/v1", sends_back=("thoughts",))
