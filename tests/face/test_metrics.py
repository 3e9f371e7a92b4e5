"""Optional Prometheus metrics, fed by the aggregator: the figures agree with what the
provider counted, the breaker gauge follows an open breaker, and without
prometheus_client ``install`` names the extra to install."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import pytest
from callboard.core.breaker import BreakerConfig
from callboard.core.retry import RetryConfig
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S, two_models, wait_until

import callboard
from callboard import ModelSettings, System, SystemConfig
from callboard import metrics as cb_metrics


def test_metrics_count_results_cost_and_tasks(make_system: Callable[..., System]) -> None:
    system = make_system()
    metrics = cb_metrics.install(system)
    results = [f.result(WAIT_S) for f in system.submit_many([f"q{i}" for i in range(12)])]
    assert all(r.ok for r in results)
    system.stats()  # an ask to the aggregator: every Finished before it is handled
    text = metrics.text()
    done = 'model="alpha",outcome="completed",priority="NORMAL",reason=""'
    assert f"callboard_results_total{{{done}}} 12.0" in text
    assert 'callboard_tasks{stage="queued"} 0.0' in text
    assert "callboard_latency_seconds_count" in text
    assert 'callboard_breaker_state{model="alpha"} 0.0' in text


def test_latency_percentiles_count_only_tasks_that_made_a_call() -> None:
    """A burst of queue-full refusals (ended at once, no call) must not drag p50 to 0."""
    from callboard.core.stats import StatsBook
    from callboard.messages import Completed, Priority, Rejected, RejectReason

    book = StatsBook()
    served = [
        Completed(
            task_id=i,
            trace_id="t",
            priority=Priority.NORMAL,
            model="m",
            attempts=1,
            latency_s=0.5,
            queue_wait_s=0.1,
            content="x",
        )
        for i in range(3)
    ]
    refused = [
        Rejected(
            task_id=10 + i,
            trace_id="t",
            priority=Priority.NORMAL,
            latency_s=0.0,
            reason=RejectReason.QUEUE_FULL,
        )
        for i in range(30)
    ]
    book.add([*served, *refused])
    total = book.total.freeze()
    assert total.finished == 33
    assert total.latency.count == total.queue_wait.count == 3
    assert total.latency.p50 == 0.5


def test_the_latency_histogram_counts_what_stats_count_in_buckets_of_llm_calls(
    make_system: Callable[..., System],
) -> None:
    """It counted refusals (0 s, ``model="-"``) that ``stats()`` leaves out, and its
    buckets were prometheus_client's, which stop at 10 s: a 30 s call fell in +Inf
    (found by a hunt)."""
    from callboard.messages import Completed, Priority, Rejected, RejectReason

    metrics = cb_metrics.install(make_system())
    common = {"trace_id": "t", "priority": Priority.NORMAL, "model": "m", "attempts": 1}
    served = [
        Completed(task_id=1, latency_s=0.5, queue_wait_s=0.1, content="x", **common),
        Completed(task_id=2, latency_s=30.0, queue_wait_s=0.1, content="x", **common),
    ]
    refused = [
        Rejected(task_id=10 + i, trace_id="t", reason=RejectReason.QUEUE_FULL) for i in range(5)
    ]
    metrics.observe_results([*served, *refused])
    assert _sample(metrics, "callboard_latency_seconds_count", model="m") == 2
    assert _sample(metrics, "callboard_latency_seconds_count", model="-") == 0
    assert _sample(metrics, "callboard_latency_seconds_bucket", model="m", le="10.0") == 1
    assert _sample(metrics, "callboard_latency_seconds_bucket", model="m", le="30.0") == 2
    assert _sample(metrics, "callboard_queue_wait_seconds_count", priority="NORMAL") == 2
    refusals = {"model": "-", "outcome": "rejected", "reason": "queue_full"}
    assert _sample(metrics, "callboard_results_total", **refusals) == 5


def test_a_call_billed_before_a_fallback_counts_on_the_model_that_billed_it(
    make_system: Callable[..., System],
) -> None:
    """A task's unreadable 2xx at "a", then its answer at "b": all of its cost was
    counted on "b" (found by a hunt)."""
    from callboard.messages import Billed, Completed, Usage

    metrics = cb_metrics.install(make_system())
    at_a = Billed(model="a", usage=Usage(prompt_tokens=9, completion_tokens=16), cost_nusd=700)
    served = Usage(prompt_tokens=5, completion_tokens=5)
    metrics.observe_results(
        [
            Completed(
                task_id=1,
                trace_id="t",
                model="b",
                attempts=2,
                content="x",
                usage=served.plus(at_a.usage),
                cost_nusd=700 + 10,
                billed_before=(at_a,),
            )
        ]
    )
    assert _sample(metrics, "callboard_cost_usd_total", model="a") == 700 / 1e9
    assert _sample(metrics, "callboard_cost_usd_total", model="b") == 10 / 1e9
    assert _sample(metrics, "callboard_tokens_total", model="a", kind="prompt") == 9
    assert _sample(metrics, "callboard_tokens_total", model="b", kind="completion") == 5


# -- the figures against the provider's own counts -----------------------------------------


def _no_retry_breaker() -> BreakerConfig:
    return BreakerConfig(consecutive_failures=10_000, min_calls=10_000)


def _fast_retry(attempts: int) -> RetryConfig:
    return RetryConfig(max_attempts=attempts, initial_s=0.01, max_s=0.02, jitter_s=0.0)


def _sample(metrics: cb_metrics.Metrics, name: str, **labels: str) -> float:
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def test_metrics_agree_with_the_provider() -> None:
    behaviours = {
        "alpha": ModelBehaviour(latency_s=0.002),
        "beta": ModelBehaviour(latency_s=0.002, status=500),
    }
    with SimulatedProvider(models=behaviours, seed=3) as p:
        models = (
            ModelSettings(name="alpha", base_url=p.base_url),
            ModelSettings(
                name="beta", base_url=p.base_url, retry=_fast_retry(2), breaker=_no_retry_breaker()
            ),
        )
        with System(SystemConfig(models=models)) as cb:
            m = cb_metrics.install(cb)
            ok = [
                f.result(WAIT_S) for f in cb.submit_many([f"a{i}" for i in range(7)], model="alpha")
            ]
            bad = [
                f.result(WAIT_S)
                for f in cb.submit_many(["b"] * 3, model="beta", priority=callboard.Priority.HIGH)
            ]
            cb.stats()  # every Finished accounted (and observed) before this answer
            prov = p.stats()["models"]
            text = m.text()
    assert all(r.ok for r in ok)
    assert not any(r.ok for r in bad)
    assert (
        _sample(m, "callboard_results_total", model="alpha", outcome="completed", priority="NORMAL")
        == 7
    )
    assert (
        _sample(m, "callboard_results_total", model="beta", outcome="failed", priority="HIGH") == 3
    )
    failed = {"model": "beta", "outcome": "failed", "priority": "HIGH"}  # and why: the 500s
    assert _sample(m, "callboard_results_total", **failed, reason="provider_error") == 3
    assert prov["beta"]["requests"] == 6
    assert (
        _sample(m, "callboard_tokens_total", model="alpha", kind="prompt")
        == prov["alpha"]["prompt_tokens"]
    )
    assert (
        _sample(m, "callboard_tokens_total", model="alpha", kind="completion")
        == prov["alpha"]["completion_tokens"]
    )
    assert _sample(m, "callboard_latency_seconds_count", model="alpha") == 7
    assert _sample(m, "callboard_queue_wait_seconds_count", priority="HIGH") == 3
    for stage in ("routing", "queued", "in_flight"):
        assert f'callboard_tasks{{stage="{stage}"}} 0.0' in text
    for name in (
        "callboard_results_total",
        "callboard_latency_seconds",
        "callboard_queue_wait_seconds",
        "callboard_tokens_total",
        "callboard_cost_usd_total",
        "callboard_breaker_state",
        "callboard_tasks",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name


def test_metrics_breaker_gauge_follows_an_open_breaker() -> None:
    with SimulatedProvider(models={"alpha": ModelBehaviour(latency_s=0.002, status=500)}) as p:
        model = ModelSettings(
            name="alpha",
            base_url=p.base_url,
            retry=_fast_retry(1),
            breaker=BreakerConfig(consecutive_failures=2, cooldown_s=60.0),
        )
        with System(SystemConfig(models=(model,))) as cb:
            m = cb_metrics.install(cb)
            assert _sample(m, "callboard_breaker_state", model="alpha") == 0
            for f in cb.submit_many(["a", "b"]):
                f.result(WAIT_S)
            # the breaker opened: the health report reaches the aggregator a little later
            assert wait_until(lambda: cb.stats().models["alpha"]["breaker"] == "open")
            assert cb.stats().models["alpha"]["breaker"] == "open"
            assert _sample(m, "callboard_breaker_state", model="alpha") == 2


def test_metrics_without_prometheus_client_names_the_extra(
    make_system: Callable[..., System], monkeypatch: pytest.MonkeyPatch
) -> None:
    system = make_system()
    for name in list(sys.modules):
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]
    with pytest.raises(callboard.CallboardError) as info:
        cb_metrics.install(system)
    assert "callboard[metrics]" in str(info.value)


def test_metrics_show_the_queue_by_priority_and_tenant_and_a_models_calls_in_flight() -> None:
    """One long call holds the only slot; what waits behind it is counted by priority and
    by tenant at scrape time, and the model's next health report (a second after its
    last) shows its call in flight and its limiter's headroom."""
    with SimulatedProvider(models={"alpha": ModelBehaviour(latency_s=1.5)}) as p:
        model = ModelSettings(
            name="alpha",
            base_url=p.base_url,
            max_concurrency=1,
            limiter=callboard.LimiterConfig(rpm=6000, tpm=None),
        )
        with System(SystemConfig(models=(model,))) as cb:
            m = cb_metrics.install(cb)
            first = cb.submit("first", priority=callboard.Priority.CRITICAL)
            assert wait_until(lambda: cb.ledger.counts().in_flight == 1)
            waiting = [
                cb.submit("w1", priority=callboard.Priority.LOW, budget_tag="eval"),
                cb.submit("w2", priority=callboard.Priority.LOW, budget_tag="eval"),
                cb.submit("w3", priority=callboard.Priority.HIGH, budget_tag="web"),
            ]
            assert wait_until(lambda: cb.ledger.counts().queued == 3)
            assert _sample(m, "callboard_queue_depth", priority="LOW") == 2
            assert _sample(m, "callboard_queue_depth", priority="HIGH") == 1
            assert _sample(m, "callboard_queue_depth", priority="CRITICAL") == 0
            assert _sample(m, "callboard_queue_depth_by_tenant", tenant="eval") == 2
            assert _sample(m, "callboard_queue_depth_by_tenant", tenant="web") == 1
            stats = cb.stats()  # the same depth, read the same way
            assert dict(stats.queued) == {"CRITICAL": 0, "HIGH": 1, "NORMAL": 0, "LOW": 2}
            assert dict(stats.queued_by_tenant) == {"eval": 2, "web": 1}
            assert wait_until(lambda: _sample(m, "callboard_in_flight", model="alpha") == 1)
            assert _sample(m, "callboard_concurrency_limit", model="alpha") == 1
            assert _sample(m, "callboard_limiter_headroom", model="alpha", kind="requests") > 0
            assert 'kind="tokens"' not in m.text()  # no token limit: no figure
            for f in waiting:
                f.cancel()
            assert first.result(WAIT_S).ok
            assert wait_until(lambda: _sample(m, "callboard_in_flight", model="alpha") == 0)
            assert wait_until(lambda: cb.ledger.counts().queued == 0)
            assert _sample(m, "callboard_queue_depth", priority="LOW") == 0


def test_a_closed_metrics_leaves_its_registry_for_the_next_system(
    make_system: Callable[..., System],
) -> None:
    """Installed in one registry (prometheus_client's own, say), a stopped system's
    collectors stayed there, stale, and the next system's install raised a bare
    ``Duplicated timeseries`` (found by a hunt)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    first, second = make_system(), make_system()
    installed = cb_metrics.install(first, registry)
    with pytest.raises(callboard.ConfigError, match="holds callboard's metrics already"):
        cb_metrics.install(second, registry)
    installed.close()
    installed.close()  # idempotent
    assert installed not in first.rt.observers
    cb_metrics.install(second, registry)
    assert second.submit("counted").result(WAIT_S).ok
    assert wait_until(
        lambda: registry.get_sample_value("callboard_results_total", _labels(second)) == 1
    )


def _labels(system: System) -> dict[str, str]:
    model = next(iter(system.models))
    return {"model": model, "outcome": "completed", "priority": "NORMAL", "reason": ""}


def test_install_takes_an_async_system_as_the_docs_and_the_fastapi_example_use_one(
    provider: SimulatedProvider,
) -> None:
    """``metrics.install(cb)`` with an ``AsyncSystem`` failed deep inside with an
    ``AttributeError`` (found by a hunt); before ``start`` there is no system to feed it."""
    config = SystemConfig(models=two_models(provider.base_url))
    with pytest.raises(callboard.SystemStoppedError, match="not started"):
        cb_metrics.install(callboard.AsyncSystem(config))

    async def main() -> float | None:
        async with callboard.AsyncSystem(config) as cb:
            m = cb_metrics.install(cb)
            assert (await cb.submit("counted")).ok
            await cb.stats()  # an ask to the aggregator: every Finished before it is handled
            counted = m.registry.get_sample_value("callboard_results_total", _labels(cb.system))
            m.close()
            return counted

    assert asyncio.run(main()) == 1


def test_what_a_stop_ends_itself_reaches_the_metrics_on_the_model_it_ran_on() -> None:
    """``stop(timeout=...)`` ends what is left itself, once the aggregator is gone: those
    results, and the estimate charged for each call it cut on the wire, were counted in
    ``stats()`` and never reached the metrics (6 of 10 results, cost 0); the cut calls
    belonged to no model, so the models' costs did not sum to the total, and the
    in-flight gauge said 4 for good (found by a hunt)."""
    price = callboard.Price(1, 2)
    with SimulatedProvider(models={"m": ModelBehaviour(latency_s=30)}) as p:
        model = ModelSettings(name="m", base_url=p.base_url, price=price, max_concurrency=4)
        cb = System(SystemConfig(models=(model,)))
        m = cb_metrics.install(cb)
        try:
            futures = cb.submit_many([f"q{i}" for i in range(10)], max_tokens=100)
            assert wait_until(lambda: p.stats()["total"]["in_flight"] == 4)
            assert wait_until(lambda: _sample(m, "callboard_in_flight", model="m") == 4)
            cb.stop(cancel=True, timeout=0.2)
            results = [f.result(WAIT_S) for f in futures]
            cost = sum(r.cost_nusd for r in results)
            assert cost > 0, "the cut calls are charged their estimates"
            counted = _sample(m, "callboard_results_total", model="m", outcome="cancelled")
            counted += _sample(m, "callboard_results_total", model="-", outcome="cancelled")
            assert counted == 10
            assert round(_sample(m, "callboard_cost_usd_total") * 10**9) == cost
            by_model = cb.rt.stats.by_model
            assert sum(g.cost_nusd for g in by_model.values()) == cost
            assert _sample(m, "callboard_in_flight", model="m") == 0
        finally:
            m.close()
