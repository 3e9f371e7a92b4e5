"""The redaction scenario (bench/redaction.py): the redactor's cost by the number of
keys it holds, on an answer, one naming the keys' public start, embeddings, a streamed
delta, and a hostile answer."""

from __future__ import annotations

import dataclasses

import pytest
from callboard.bench.plan import Options, Scale
from callboard.bench.redaction import run_redaction
from callboard.bench.targets import evaluate


@pytest.mark.timeout(60)
def test_the_figures_say_what_each_count_of_keys_costs_each_text() -> None:
    scale = dataclasses.replace(Scale.small(), redaction_share_s=0.005)
    result = run_redaction(Options(scale=scale, scenarios=("redaction",)))
    f = result.figures
    for name in ("answer_us", "named_us", "embeddings_us", "delta_us"):
        assert list(f[name]) == ["1", "10", "100"], name
        assert all(us > 0 for us in f[name].values()), name
    # naming the keys' public start makes each key's loose search rule it out
    assert f["named_us"]["100"] > f["answer_us"]["100"]
    assert f["answer_bytes"] > 900
    assert f["hostile_bytes"] == 8 * scale.redaction_hostile_repeats
    assert f["hostile_keys"] == 100


def test_the_targets_judge_its_figures() -> None:
    scale = dataclasses.replace(Scale.small(), redaction_share_s=0.002)
    result = run_redaction(Options(scale=scale, scenarios=("redaction",)))
    names = [t.name for t in evaluate({"redaction": result}, [])]
    assert any("1,000 keys / 1 key" in name for name in names)
    assert any("public start" in name for name in names)
