"""The simulated provider's decisions (provider/engine.py), on a fake clock: rate-limit
windows and their headers, seeded faults, and a bound on per-model state."""

from __future__ import annotations

from typing import Any

import pytest
from callboard.provider.behaviour import ModelBehaviour
from callboard.provider.engine import MAX_MODELS, Ask, Outcome, ProviderCore


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
