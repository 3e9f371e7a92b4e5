"""Optional Prometheus metrics (``pip install 'callboard[metrics]'``).

``callboard.metrics.install(system)`` registers collectors fed by the
aggregator (results, after they were delivered) and by model health reports:

- ``callboard_results_total{model,outcome,priority}``
- ``callboard_latency_seconds{model}`` and ``callboard_queue_wait_seconds{priority}``
- ``callboard_ttft_seconds{model,priority}``: a streamed answer's time to first token
- ``callboard_tokens_total{model,kind}`` and ``callboard_cost_usd_total{model}``
- ``callboard_breaker_state{model}`` (0 closed, 1 half-open, 2 open)
- ``callboard_tasks{stage}`` (routing, queued, in_flight: read from the ledger at scrape time)

What must hold: feeding the metrics never blocks an actor (prometheus_client
updates are in-memory and thread-safe); nothing here does I/O unless
``serve(port)`` is asked for, which listens on 127.0.0.1 by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from callboard.messages import BreakerState, ConfigError, Health, Result

if TYPE_CHECKING:
    from callboard._system import System

BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class Metrics:
    """The collectors of one system, in ``registry`` (a fresh one by default)."""

    def __init__(self, system: System, registry: Any = None) -> None:
        _require_prometheus()
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.results = Counter(
            "callboard_results", "Results by outcome", ["model", "outcome", "priority"], registry=r
        )
        self.latency = Histogram(
            "callboard_latency_seconds", "Submission to result", ["model"], registry=r
        )
        self.queue_wait = Histogram(
            "callboard_queue_wait_seconds", "Time waiting in the queue", ["priority"], registry=r
        )
        self.ttft = Histogram(
            "callboard_ttft_seconds",
            "A streamed answer's time to first token",
            ["model", "priority"],
            registry=r,
        )
        self.tokens = Counter("callboard_tokens", "Tokens used", ["model", "kind"], registry=r)
        self.cost = Counter("callboard_cost_usd", "Cost in USD", ["model"], registry=r)
        self.breaker = Gauge(
            "callboard_breaker_state", "0 closed, 1 half-open, 2 open", ["model"], registry=r
        )
        r.register(_LedgerCollector(system))

    def observe_results(self, results: Iterable[Result]) -> None:
        for res in results:
            model = res.model or "-"
            outcome = "completed" if res.ok else type(res).__name__.lower()
            self.results.labels(model, outcome, res.priority.name).inc()
            self.latency.labels(model).observe(res.latency_s)
            if res.attempts:
                self.queue_wait.labels(res.priority.name).observe(res.queue_wait_s)
            ttft = getattr(res, "ttft_s", None)
            if ttft is not None:
                self.ttft.labels(model, res.priority.name).observe(ttft)
            if res.usage.total_tokens:
                self.tokens.labels(model, "prompt").inc(res.usage.prompt_tokens)
                self.tokens.labels(model, "completion").inc(res.usage.completion_tokens)
            if res.cost_nusd:
                self.cost.labels(model).inc(res.cost_nusd / 1e9)

    def observe_health(self, health: Health) -> None:
        self.breaker.labels(health.model).set(BREAKER_VALUE[health.breaker])

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose ``/metrics`` over HTTP (a daemon thread of prometheus_client)."""
        _require_prometheus()
        from prometheus_client import start_http_server

        start_http_server(port, addr=addr, registry=self.registry)

    def text(self) -> str:
        _require_prometheus()
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class _LedgerCollector:
    """Task counts by stage, read from the ledger when scraped."""

    def __init__(self, system: System) -> None:
        self._ledger = system.ledger

    def collect(self) -> Iterator[Any]:
        _require_prometheus()
        from prometheus_client.core import GaugeMetricFamily

        counts = self._ledger.counts()
        family = GaugeMetricFamily("callboard_tasks", "Live tasks by stage", labels=["stage"])
        for stage in ("routing", "queued", "in_flight"):
            family.add_metric([stage], getattr(counts, stage))
        yield family


def install(system: System, registry: Any = None) -> Metrics:
    """Create the collectors and have the aggregator feed them."""
    metrics = Metrics(system, registry)
    system.rt.observers.append(metrics)
    for model, health in system.stats().models.items():  # what was reported before now
        metrics.breaker.labels(model).set(BREAKER_VALUE[BreakerState(health["breaker"])])
    return metrics


def _require_prometheus() -> None:
    """A typed error naming the extra when prometheus_client is not installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError(
            "metrics need prometheus_client: pip install 'callboard[metrics]'"
        ) from None
