"""The simulated provider's decisions (provider/engine.py), on a fake clock: rate-limit
windows and their headers, seeded faults, and a bound on per-model state."""

from __future__ import annotations

from typing import Any

import pytest
from callboard.provider.behaviour import ModelBehaviour
from callboard.provider.engine import MAX_MODELS, Ask, Outcome, Plan, ProviderCore


def test_configured_models_respect_the_state_bound() -> None:
    core = ProviderCore(default=ModelBehaviour(), models=None, seed=0)
    for i in range(MAX_MODELS + 50):
        try:
            core.configure(f"m{i}", ModelBehaviour(latency_s=0.0))
        except ValueError:
            break
    stats: Any = core.stats()
    assert len(stats["models"]) <= MAX_MODELS + 1


def test_rpm_window_headers_and_seeded_faults_hold_on_a_fake_clock() -> None:
    now = [0.0]
    core = ProviderCore(
        default=ModelBehaviour(rpm=60, completion_tokens=8),
        models=None,
        seed=1,
        clock=lambda: now[0],
    )
    state = core.state("m")
    admitted, first_refusal = 0, None
    for k in range(1000):  # 100 req/s for 10 s against 60 rpm, burst of one second
        now[0] = k * 0.01
        plan = core.plan(state, Ask(10))
        if plan.outcome is Outcome.OK:
            admitted += 1
        elif first_refusal is None:
            first_refusal = plan
    assert admitted == 10  # t = 0, 1, ..., 9
    assert first_refusal is not None
    assert first_refusal.status == 429
    assert first_refusal.retry_after_s == pytest.approx(0.99, abs=1e-4)
    (window,) = first_refusal.windows
    assert (window.kind, window.limit, window.remaining) == ("requests", 60, 0)

    def outcomes(seed: int) -> list[Outcome]:
        c = ProviderCore(default=ModelBehaviour(error_rate=0.1), models=None, seed=seed)
        s = c.state("m")
        return [c.plan(s, Ask(10)).outcome for _ in range(3000)]

    a = outcomes(3)
    assert a == outcomes(3)
    assert a != outcomes(4)
    assert 0.08 < a.count(Outcome.ERROR) / len(a) < 0.12


def plan_for(ask: Ask, **behaviour: Any) -> Plan:
    core = ProviderCore(default=ModelBehaviour(**behaviour), models=None, seed=0)
    return core.plan(core.state("m"), ask)


@pytest.mark.parametrize(
    ("ask", "size", "finish"),
    [
        (Ask(10), 20, "stop"),
        (Ask(10, max_tokens=20), 20, "length"),
        (Ask(10, max_tokens=5), 5, "length"),
        (Ask(10, fixed_tokens=7), 7, "stop"),
        (Ask(10, max_tokens=7, fixed_tokens=7), 7, "stop"),  # a fixed answer that just fits
        (Ask(10, max_tokens=6, fixed_tokens=7), 6, "length"),
        (Ask(10, stop_at=3), 3, "stop_sequence"),
        (Ask(10, max_tokens=2, stop_at=3), 2, "length"),
        (Ask(10, stop_at=30), 20, "stop"),
    ],
)
def test_the_answer_is_sized_before_the_limits_see_it(ask: Ask, size: int, finish: str) -> None:
    plan = plan_for(ask, completion_tokens=20)
    assert (plan.completion_tokens, plan.finish_reason) == (size, finish)


def test_reasoning_and_choices_multiply_into_the_charged_output() -> None:
    plan = plan_for(Ask(10, reasoning_tokens=32, choices=3), completion_tokens=20)
    assert plan.output_tokens == (20 + 32) * 3
    capped = plan_for(Ask(10, max_tokens=40, reasoning_tokens=32), completion_tokens=20)
    assert (capped.completion_tokens, capped.reasoning_tokens, capped.finish_reason) == (
        8,
        32,
        "length",
    )
    starved = plan_for(Ask(10, max_tokens=16, reasoning_tokens=32), completion_tokens=20)
    assert (starved.completion_tokens, starved.reasoning_tokens) == (0, 16)
    core = ProviderCore(
        default=ModelBehaviour(tpm=6000, completion_tokens=20),  # 100 tokens a second
        models=None,
        seed=0,
        clock=lambda: 0.0,
    )
    state = core.state("m")
    charged = core.plan(state, Ask(10, reasoning_tokens=1, choices=2))
    assert charged.outcome is Outcome.OK
    (window,) = core.plan(state, Ask(1, max_tokens=1)).windows
    assert window.remaining == 100 - (10 + (20 + 1) * 2) - (1 + 1)


def test_openais_token_limit_counts_all_of_max_tokens_anthropics_the_output_made() -> None:
    """As the providers document: OpenAI estimates a request's tokens from its prompt and
    ``max_tokens`` as it arrives ("usage needs are estimated from this value"); Anthropic
    adjusts its output estimate to the tokens made."""
    core = ProviderCore(
        default=ModelBehaviour(tpm=6000, completion_tokens=20),  # 100 tokens a second
        models=None,
        seed=0,
        clock=lambda: 0.0,
    )
    for counts_cap, charged in ((True, 10 + 50), (False, 10 + 20)):
        state = core.state(f"m{counts_cap}")
        assert core.plan(state, Ask(10, max_tokens=50, counts_cap=counts_cap)).outcome is Outcome.OK
        (window,) = core.plan(state, Ask(1, max_tokens=1)).windows
        assert window.remaining == 100 - charged - (1 + 1)


def test_a_stream_is_paced_by_its_ttft_and_gap_and_cut_where_told() -> None:
    knobs = {"latency_s": 0.5, "token_gap_s": 0.01, "cut_rate": 1.0, "cut_after": 2}
    plan = plan_for(Ask(10, stream=True), **knobs, cut_mode="error")
    assert (plan.outcome, plan.delay_s, plan.gap_s, plan.cut_after, plan.cut_error) == (
        Outcome.CUT,
        0.5,
        0.01,
        2,
        True,
    )
    assert plan_for(Ask(10, stream=True), **knobs, ttft_s=0.1).delay_s == 0.1
    unstreamed = plan_for(Ask(10), **knobs)
    assert (unstreamed.outcome, unstreamed.delay_s, unstreamed.gap_s) == (Outcome.CUT, 0.5, 0.0)
