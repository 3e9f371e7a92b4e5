"""The tenants scenario (bench/tenants.py): the light tenant's tasks come at a steady
pace among the flood's, and a small run through a real provider serves the light
tenant long before the flood, loses nothing, and reports every figure the targets read."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from callboard.bench.plan import Options, Scale
from callboard.bench.targets import evaluate
from callboard.bench.tenants import FLOOD, TENANTS, arrivals, run_tenants

A, B = TENANTS


def test_the_light_tenant_has_one_task_in_each_run_of_the_floods() -> None:
    order = arrivals(5 * (FLOOD + 1))
    assert order.count(B) == 5
    assert order.count(A) == 5 * FLOOD
    spots = [i for i, t in enumerate(order) if t == B]
    assert {b - a for a, b in itertools.pairwise(spots)} == {FLOOD + 1}
    assert 0 < spots[0] < FLOOD  # among A's, not before or after them all


@pytest.mark.timeout(60)
def test_a_small_run_serves_the_light_tenant_before_the_flood_and_loses_nothing() -> None:
    scale = dataclasses.replace(
        Scale.small(), tenants_concurrency=4, tenants_latency_s=0.05, tenants_overload_s=0.3
    )
    result = run_tenants(Options(scale=scale, scenarios=("tenants",)))
    assert [r.label for r in result.runs] == ["shared", "long", "alone"]
    for run in result.runs:
        assert run.tasks > 0
        assert (run.ok, run.failed, run.lost, run.duplicated) == (run.tasks, 0, 0, 0)
    figures = result.figures
    shared, alone = figures["shared"], figures["alone"]
    assert 0 < FLOOD * (shared["tasks"][B] - 1) < shared["tasks"][A]
    assert alone["tasks"] == {A: shared["tasks"][A]}
    for phase in (shared, figures["long"]):  # B's max_tokens 128x A's in "long": its
        waits = phase["wait_ms"]  # calls are charged what they used, as short as A's
        assert waits[B].p99 < waits[A].p50  # A's backlog waits; B goes at the next free slot
    assert figures["service_time_ms"] > 0
    assert figures["a_alone_capacity_share"] > 0
    assert (figures["lost"], figures["duplicated"]) == (0, 0)
    verdicts = {t.name: t.verdict for t in evaluate({"tenants": result}, [])}
    assert verdicts["lost tasks"] == verdicts["duplicated results"] == "PASS"
    assert verdicts["light tenant's p99 queue wait ms"] in {"PASS", "MISS"}
    assert verdicts["light tenant's p99 queue wait ms, its max_tokens 128x"] in {"PASS", "MISS"}
    assert verdicts["flooding tenant alone: share of capacity"] in {"PASS", "MISS"}
