"""The embeddings scenario (bench/embeddings.py): the vector check catches a vector out of
place or missing, and a small run through a real provider sends the same batches at the
same concurrency from both systems and reports every figure the targets read."""

from __future__ import annotations

import dataclasses

import pytest
from callboard.bench.embeddings import check_vectors, run_embeddings
from callboard.bench.plan import Options, Scale
from callboard.bench.targets import evaluate
from callboard.provider.embeddings import vector

TEXTS = [f"text {i}" for i in range(10)]


def test_vectors_in_input_order_pass_the_check() -> None:
    vectors = [vector(t.encode(), 8) for t in TEXTS]
    assert check_vectors(vectors, TEXTS, 8) == (10, 0)


def test_vectors_swapped_or_missing_fail_the_check() -> None:
    vectors = [vector(t.encode(), 8) for t in TEXTS]
    vectors[3], vectors[4] = vectors[4], vectors[3]
    assert check_vectors(vectors, TEXTS, 8) == (10, 2)
    assert check_vectors(vectors[:-1], TEXTS, 8) == (10, 10)  # none is sure to be in place
    assert check_vectors([], [], 8) == (0, 0)


@pytest.mark.timeout(90)
def test_a_small_run_sends_the_same_batches_from_both_systems() -> None:
    scale = dataclasses.replace(
        Scale.small(),
        embed_texts=300,
        embed_batch=50,
        embed_concurrency=2,
        embed_dimensions=16,
        embed_rounds=1,
    )
    opts = Options(scale=scale, scenarios=("embeddings",), baselines=("aiohttp",))
    result = run_embeddings(opts)
    assert [r.system for r in result.runs] == ["callboard", "aiohttp"]
    for run in result.runs:
        assert (run.tasks, run.ok, run.failed) == (300, 300, 0)
        assert run.server["requests"] == 6  # 300 texts in batches of 50
        assert run.server["max_in_flight"] <= 2
        assert run.extra["vectors_wrong"] == 0
        assert run.extra["vectors_checked"] > 0
        assert run.prompt_tokens > 0
    assert result.runs[0].prompt_tokens == result.runs[1].prompt_tokens
    assert result.runs[0].cost_nusd == result.runs[1].cost_nusd
    figures = result.figures
    assert figures["calls_expected"] == 6
    assert figures["throughput_ratio"] > 0
    assert (figures["failed_texts"], figures["vectors_wrong"]) == (0, 0)
    verdicts = {t.name: t.verdict for t in evaluate({"embeddings": result}, [])}
    assert verdicts["texts without a vector"] == "PASS"
    assert verdicts["vectors wrong or out of order (sampled)"] == "PASS"
    assert verdicts["texts/s / aiohttp"] in {"PASS", "MISS"}
