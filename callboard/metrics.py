"""Optional Prometheus metrics (``pip install 'callboard[metrics]'``).

``callboard.metrics.install(system)`` registers collectors fed by the
aggregator (results, after they were delivered) and by model health reports:

- ``callboard_results_total{model,outcome,priority,reason}``: ``reason`` is a
  ``Failed``'s or ``Rejected``'s reason (``rate_limited``, ``queue_full``...), ``""``
  for the other outcomes
- ``callboard_latency_seconds{model}`` and ``callboard_queue_wait_seconds{priority}``
- ``callboard_ttft_seconds{model,priority}``: a streamed answer's time to first token
- ``callboard_tokens_total{model,kind}`` and ``callboard_cost_usd_total{model}``
- ``callboard_breaker_state{model}`` (0 closed, 1 half-open, 2 open), and from the same
  health reports ``callboard_in_flight{model}``, ``callboard_concurrency_limit{model}``
  and ``callboard_limiter_headroom{model,kind}`` (requests or tokens the limiter admits
  now; below 0 while a large call's debt is paid off, by the amount still owed;
  absent for a limit not set)
- ``callboard_tasks{stage}`` (routing, queued, in_flight), ``callboard_queue_depth{priority}``
  and ``callboard_queue_depth_by_tenant{tenant}``: read from the ledger at scrape time
  (the depth as ``core.stats.queue_depth`` counts it for ``System.stats``)

Labels are model, route and tenant names, priorities, outcomes and kinds: never a
key, a prompt or anything a caller sent but its budget tag.

What must hold: feeding the metrics never blocks an actor (prometheus_client
updates are in-memory and thread-safe); nothing here does I/O unless
``serve(port)`` is asked for, which listens on 127.0.0.1 by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from callboard.core.stats import OTHER_TENANTS, queue_depth
from callboard.messages import BreakerState, ConfigError, Failed, Health, Rejected, Result

if TYPE_CHECKING:
    from callboard._async import AsyncSystem
    from callboard._system import System

BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
"""The histograms' buckets, in seconds: an LLM call's range (prometheus_client's own
stop at 10 s, and every longer call fell in +Inf)."""


class Metrics:
    """The collectors of one system, in ``registry`` (a fresh one by default)."""

    def __init__(self, system: System, registry: Any = None) -> None:
        _require_prometheus()
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.results = Counter(
            "callboard_results",
            "Results by outcome",
            ["model", "outcome", "priority", "reason"],
            registry=None,
        )
        self.latency = Histogram(
            "callboard_latency_seconds",
            "Submission to result, of the tasks that made a call",
            ["model"],
            registry=None,
            buckets=SECONDS,
        )
        self.queue_wait = Histogram(
            "callboard_queue_wait_seconds",
            "Time waiting in the queue",
            ["priority"],
            registry=None,
            buckets=SECONDS,
        )
        self.ttft = Histogram(
            "callboard_ttft_seconds",
            "A streamed answer's time to first token",
            ["model", "priority"],
            registry=None,
            buckets=SECONDS,
        )
        self.tokens = Counter("callboard_tokens", "Tokens used", ["model", "kind"], registry=None)
        self.cost = Counter("callboard_cost_usd", "Cost in USD", ["model"], registry=None)
        self.breaker = Gauge(
            "callboard_breaker_state", "0 closed, 1 half-open, 2 open", ["model"], registry=None
        )
        self.in_flight = Gauge(
            "callboard_in_flight", "Calls on the wire at a model", ["model"], registry=None
        )
        self.concurrency_limit = Gauge(
            "callboard_concurrency_limit",
            "A model's cap on calls in flight",
            ["model"],
            registry=None,
        )
        self.headroom = Gauge(
            "callboard_limiter_headroom",
            "Requests or tokens a model's rate limiter admits now (below 0: still owed)",
            ["model", "kind"],
            registry=None,
        )
        self._system = system
        self._registered: list[Any] = []
        collectors: list[Any] = [
            self.results,
            self.latency,
            self.queue_wait,
            self.ttft,
            self.tokens,
            self.cost,
            self.breaker,
            self.in_flight,
            self.concurrency_limit,
            self.headroom,
            _LedgerCollector(system),
        ]
        try:
            for collector in collectors:
                r.register(collector)
                self._registered.append(collector)
        except ValueError:  # its names are taken: another system's callboard metrics
            self._unregister()
            raise ConfigError(
                "this registry holds callboard's metrics already (another system's): "
                "close() those first (Metrics.close)"
            ) from None

    def close(self) -> None:
        """Take these collectors out of their registry and stop being fed (a system
        stopped: its series would go on being exported, stale, and a new system's
        could not be installed in the same registry; found by a hunt). Idempotent."""
        observers = self._system.rt.observers
        if self in observers:
            observers.remove(self)
        self._unregister()

    def _unregister(self) -> None:
        while self._registered:
            self.registry.unregister(self._registered.pop())

    def observe_results(self, results: Iterable[Result]) -> None:
        for res in results:
            model = res.model or "-"
            outcome = "completed" if res.ok else type(res).__name__.lower()
            self.results.labels(model, outcome, res.priority.name, _reason(res)).inc()
            if res.attempts:  # as stats(): refusals and unsent ends would drag it to 0
                self.latency.labels(model).observe(res.latency_s)
                self.queue_wait.labels(res.priority.name).observe(res.queue_wait_s)
            ttft = getattr(res, "ttft_s", None)
            if ttft is not None:
                self.ttft.labels(model, res.priority.name).observe(ttft)
            for billed in res.billed_before:  # on the model that billed it, as the stats
                used = billed.usage
                self._spent(
                    billed.model, used.prompt_tokens, used.completion_tokens, billed.cost_nusd
                )
            self._spent(model, *res.own_share())

    def _spent(self, model: str, prompt: int, completion: int, cost_nusd: int) -> None:
        if prompt or completion:
            self.tokens.labels(model, "prompt").inc(prompt)
            self.tokens.labels(model, "completion").inc(completion)
        if cost_nusd:
            self.cost.labels(model).inc(cost_nusd / 1e9)

    def observe_health(self, health: Health) -> None:
        _show_health(
            self,
            health.model,
            health.breaker,
            in_flight=health.in_flight,
            cap=health.max_concurrency,
            requests=health.requests_headroom,
            tokens=health.tokens_headroom,
        )

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
    """Task counts by stage and the queue's depth, read from the ledger when scraped."""

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
        by_priority, by_tenant = queue_depth(self._ledger.depth())
        depth = GaugeMetricFamily(
            "callboard_queue_depth", "Tasks waiting in the queue", labels=["priority"]
        )
        for priority, n in by_priority.items():
            depth.add_metric([priority], n)
        yield depth
        tenants = GaugeMetricFamily(
            "callboard_queue_depth_by_tenant",
            f"Tasks waiting in the queue by tenant ('' untagged, '{OTHER_TENANTS}' the rest)",
            labels=["tenant"],
        )
        for tenant, n in by_tenant.items():
            tenants.add_metric([tenant], n)
        yield tenants


def install(system: System | AsyncSystem, registry: Any = None) -> Metrics:
    """Create the collectors and have the aggregator feed them (an ``AsyncSystem``'s:
    those of the ``System`` it fronts, once started)."""
    from callboard import _async  # loaded with the system it fronts, if any

    if isinstance(system, _async.AsyncSystem):  # it failed deep inside, with an
        system = system.system  # AttributeError (found by a hunt)
    metrics = Metrics(system, registry)
    system.rt.observers.append(metrics)
    for model, health in system.stats().models.items():  # what was reported before now
        _show_health(
            metrics,
            model,
            BreakerState(health["breaker"]),
            in_flight=health["in_flight"],
            cap=health["max_concurrency"],
            requests=health["requests_headroom"],
            tokens=health["tokens_headroom"],
        )
    return metrics


def _reason(res: Result) -> str:
    """A failure's or refusal's reason, as its enum's value; ``""`` for the rest (an
    operator asking why calls fail had only ``outcome="failed"``, which does not tell
    a provider's 429s from its outages or a spent budget)."""
    if isinstance(res, Failed | Rejected):
        return str(res.reason.value)
    return ""


def _show_health(
    metrics: Metrics,
    model: str,
    breaker: BreakerState,
    *,
    in_flight: int,
    cap: int,
    requests: float | None,
    tokens: float | None,
) -> None:
    metrics.breaker.labels(model).set(BREAKER_VALUE[breaker])
    metrics.in_flight.labels(model).set(in_flight)
    metrics.concurrency_limit.labels(model).set(cap)
    for kind, headroom in (("requests", requests), ("tokens", tokens)):
        if headroom is not None:
            metrics.headroom.labels(model, kind).set(headroom)


def _require_prometheus() -> None:
    """A typed error naming the extra when prometheus_client is not installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError(
            "metrics need prometheus_client: pip install 'callboard[metrics]'"
        ) from None
