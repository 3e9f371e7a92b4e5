"""The redaction scenario (bench/redaction.py): the redactor's cost by the number of
keys it holds, measured its own way and searching every form, and a hostile answer."""

from __future__ import annotations

import dataclasses

import pytest
from callboard.bench.plan import Options, Scale
from callboard.bench.redaction import run_redaction
from callboard.bench.targets import evaluate


@pytest.mark.timeout(60)
def test_the_figures_say_what_each_count_of_keys_costs_both_ways() -> None:
    scale = dataclasses.replace(Scale.small(), redaction_share_s=0.005)
    result = run_redaction(Options(scale=scale, scenarios=("redaction",)))
    f = result.figures
    assert set(f["answer_us"]) == {"redactor", "searching"}
    assert list(f["answer_us"]["redactor"]) == ["1", "10", "100"]
    assert all(us > 0 for way in f["delta_us"].values() for us in way.values())
    # searching every form of 100 keys costs more than the gate does (10x, measured)
    assert f["answer_us"]["searching"]["100"] > f["answer_us"]["redactor"]["100"]
    assert f["answer_bytes"] > 900
    assert f["hostile_bytes"] == 8 * scale.redaction_hostile_repeats
    assert f["hostile_keys"] == 100


def test_the_targets_judge_its_figures() -> None:
    scale = dataclasses.replace(Scale.small(), redaction_share_s=0.002)
    result = run_redaction(Options(scale=scale, scenarios=("redaction",)))
    names = [t.name for t in evaluate({"redaction": result}, [])]
    assert any("1,000 keys / 1 key" in name for name in names)
    assert any("public start" in name for name in names)
