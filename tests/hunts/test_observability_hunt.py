"""Observability hunt: logs (task/trace ids, no secrets, bounded volume), metrics,
the CLI's progress display and the stats snapshot."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from callboard.core.breaker import BreakerConfig
from callboard.core.retry import RetryConfig
from callboard.messages import CallsDone, Completed, Failed
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.http import ModelClient
from support import WAIT_S

import callboard
from callboard import ModelSettings, System, SystemConfig
from callboard import metrics as cb_metrics
from callboard._callbacks import CallbackRunner, when_done
from callboard._progress import RunProgress

KEY = "sk-hunt-0bs3rvab1l1ty-K3Y-9f8e7d6c5b4a"
PROXY_PASSWORD = "pr0xyPa55w0rdZQX"  # noqa: S105 - a test value
LOGGERS = ("callboard", "httpx", "httpcore", "aiohttp", "asyncio", "pykka", "concurrent.futures")


class _Collect(logging.Handler):
    """Keeps every record and formats each with callboard's own format and filter."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.lines: list[str] = []
        self.addFilter(callboard.TaskLogFilter())
        self.setFormatter(logging.Formatter(callboard.LOG_FORMAT))
        self._lock2 = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record)  # the traceback included
        with self._lock2:
            self.records.append(record)
            self.lines.append(line + " " + repr(record.args))


@pytest.fixture
def debug_logs() -> Iterator[_Collect]:
    handler = _Collect()
    saved = []
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger, level in saved:
            logger.removeHandler(handler)
            logger.setLevel(level)


def _no_retry_breaker() -> BreakerConfig:
    return BreakerConfig(consecutive_failures=10_000, min_calls=10_000)


def _fast_retry(attempts: int) -> RetryConfig:
    return RetryConfig(max_attempts=attempts, initial_s=0.01, max_s=0.02, jitter_s=0.0)


def _callboard_records(h: _Collect) -> list[logging.LogRecord]:
    return [r for r in h.records if r.name.startswith("callboard")]


# -- logs: volume, ids ---------------------------------------------------------


def test_failing_provider_logs_one_record_per_task_with_ids(debug_logs: _Collect) -> None:
    with SimulatedProvider(models={"alpha": ModelBehaviour(latency_s=0.002, status=500)}) as p:
        model = ModelSettings(
            name="alpha", base_url=p.base_url, retry=_fast_retry(3), breaker=_no_retry_breaker()
        )
        with System(SystemConfig(models=(model,))) as cb:
            futures = cb.submit_many([f"q{i}" for i in range(6)], trace_id="trace-hunt")
            results = [f.result(WAIT_S) for f in futures]
            sent = p.stats()["models"]["alpha"]["requests"]
    assert all(isinstance(r, Failed) and r.attempts == 3 for r in results)
    assert sent == 18  # every attempt reached the provider
    info = [r for r in _callboard_records(debug_logs) if r.levelno >= logging.INFO]
    per_task = [r for r in info if "failed" in r.getMessage()]
    assert sorted(r.task_id for r in per_task) == sorted(r.task_id for r in results)  # type: ignore[attr-defined]
    trace_of = {res.task_id: res.trace_id for res in results}
    assert all(r.trace_id == trace_of[r.task_id] for r in per_task)  # type: ignore[attr-defined]
    assert len(info) <= len(results) + 2  # not one record per retry


def test_every_task_record_carries_ids_through_a_normal_run(debug_logs: _Collect) -> None:
    with SimulatedProvider(models={"alpha": ModelBehaviour(latency_s=0.002)}) as p:
        model = ModelSettings(name="alpha", base_url=p.base_url)
        with System(SystemConfig(models=(model,))) as cb:
            results = [f.result(WAIT_S) for f in cb.submit_many(["a", "b", "c"])]
    assert all(r.ok for r in results)
    ids = {r.task_id for r in results}
    for rec in _callboard_records(debug_logs):
        msg = rec.getMessage()
        if any(f"task {i}" in msg for i in ids):
            assert hasattr(rec, "task_id"), msg
            assert hasattr(rec, "trace_id"), msg


def test_failing_callback_record_carries_task_ids(
    make_system: Callable[..., System], debug_logs: _Collect
) -> None:
    system = make_system()
    ran = threading.Event()

    def boom(_: Any) -> None:
        ran.set()
        raise RuntimeError("callback bug")

    runner = CallbackRunner()
    try:
        future = system.submit("hello", trace_id="trace-cb")
        when_done(future, on_result=boom, on_error=boom, runner=runner)
        result = future.result(WAIT_S)
        assert ran.wait(WAIT_S)
    finally:
        runner.close(wait=True)
    recs = [
        r for r in debug_logs.records if "callback" in r.getMessage() and "failed" in r.getMessage()
    ]
    assert recs
    assert getattr(recs[0], "task_id", None) == result.task_id
    assert getattr(recs[0], "trace_id", None) == "trace-cb"


def test_unhandled_failure_warning_carries_task_ids(
    make_system: Callable[..., System], debug_logs: _Collect
) -> None:
    system = make_system()
    runner = CallbackRunner()
    try:
        future = system.submit("hello", trace_id="trace-warn", deadline_s=1e-9)
        done = threading.Event()
        when_done(future, runner=runner)
        future.add_done_callback(lambda _: done.set())
        result = future.result(WAIT_S)
        assert done.wait(WAIT_S)
    finally:
        runner.close(wait=True)
    assert not result.ok
    recs = [r for r in debug_logs.records if "without success" in r.getMessage()]
    assert recs
    assert getattr(recs[0], "task_id", None) == result.task_id
    assert getattr(recs[0], "trace_id", None) == "trace-warn"


class _BrokenTransport(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise RuntimeError("transport bug")


def test_unexpected_transport_error_record_carries_task_id(debug_logs: _Collect) -> None:
    settings = ModelSettings(name="alpha", base_url="http://127.0.0.1:9/v1")
    delivered: list[CallsDone] = []

    async def run() -> None:
        client = ModelClient(
            settings, incarnation=1, deliver=delivered.append, transport=_BrokenTransport()
        )
        client.start([(42, 1, b"{}", None)])
        for _ in range(1000):
            if delivered:
                break
            await asyncio.sleep(0)
        await client.aclose()

    asyncio.run(asyncio.wait_for(run(), WAIT_S))
    assert delivered
    assert delivered[0].results[0].task_id == 42
    recs = [r for r in debug_logs.records if "failed unexpectedly" in r.getMessage()]
    assert recs
    assert getattr(recs[0], "task_id", None) == 42


def _until(predicate: Callable[[], bool]) -> bool:
    """Poll ``predicate`` (a state with no event to wait on) up to WAIT_S."""
    tick = threading.Event()
    for _ in range(int(WAIT_S / 0.005)):
        if predicate():
            return True
        tick.wait(0.005)
    return predicate()


# -- logs: secrets ---------------------------------------------------------------


def _assert_no_secret(h: _Collect, *secrets: str) -> None:
    for line in h.lines:
        for s in secrets:
            assert s not in line, line[:300]


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
def test_debug_logs_never_show_the_api_key(debug_logs: _Collect, transport: str) -> None:
    behaviours = {
        "good": ModelBehaviour(latency_s=0.002),
        "bad": ModelBehaviour(latency_s=0.002, status=500),
    }
    with SimulatedProvider(models=behaviours, api_key=KEY) as p:
        models = (
            ModelSettings(name="good", base_url=p.base_url, api_key=KEY, transport=transport),  # type: ignore[arg-type]
            ModelSettings(
                name="bad",
                base_url=p.base_url,
                api_key=KEY,
                transport=transport,  # type: ignore[arg-type]
                retry=_fast_retry(2),
                breaker=_no_retry_breaker(),
            ),
            ModelSettings(  # the wrong key: answered 401
                name="wrong",
                provider_model="good",
                base_url=p.base_url,
                api_key=KEY[::-1],
                transport=transport,  # type: ignore[arg-type]
                retry=_fast_retry(2),
                breaker=_no_retry_breaker(),
            ),
        )
        with System(SystemConfig(models=models)) as cb:
            rs = [
                f.result(WAIT_S)
                for m in ("good", "bad", "wrong")
                for f in cb.submit_many(["x", "y"], model=m)
            ]
            stats = cb.stats()
            text = repr(stats) + str(stats) + repr(cb)
    assert [r.ok for r in rs] == [True, True, False, False, False, False]
    assert debug_logs.lines  # DEBUG was on
    _assert_no_secret(debug_logs, KEY, KEY[::-1], KEY[3:])
    assert KEY not in text
    assert KEY[::-1] not in text
    for r in rs:
        assert KEY not in repr(r)
        assert KEY[::-1] not in repr(r)


def test_debug_logs_never_show_proxy_credentials(debug_logs: _Collect) -> None:
    with SimulatedProvider(models={"alpha": ModelBehaviour(latency_s=0.002)}) as p:
        proxy = f"http://hunter:{PROXY_PASSWORD}@127.0.0.1:{p.port}"  # the provider as proxy
        dead = f"http://hunter:{PROXY_PASSWORD}@127.0.0.1:9"  # nobody listens
        models = (
            ModelSettings(name="alpha", base_url=p.base_url, transport="httpx", proxy=proxy),
            ModelSettings(
                name="beta",
                provider_model="alpha",
                base_url=p.base_url,
                transport="httpx",
                proxy=dead,
                retry=_fast_retry(2),
                breaker=_no_retry_breaker(),
            ),
        )
        with System(SystemConfig(models=models)) as cb:
            rs = [
                f.result(WAIT_S) for m in ("alpha", "beta") for f in cb.submit_many(["x"], model=m)
            ]
            text = repr(cb.stats()) + repr(models)
    assert not rs[1].ok
    for r in rs:
        assert PROXY_PASSWORD not in repr(r)
    assert PROXY_PASSWORD not in text
    _assert_no_secret(debug_logs, PROXY_PASSWORD)


# -- metrics ------------------------------------------------------------------------


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
            assert _until(lambda: cb.stats().models["alpha"]["breaker"] == "open")
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


# -- progress ------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _completed(model: str | None, task_id: int = 1) -> Completed:
    return Completed(
        task_id=task_id, trace_id="t", model=model, content="", latency_s=0.25, cost_nusd=1_500
    )


@pytest.mark.parametrize("stream_cls", [io.StringIO, _Tty])
def test_progress_zero_lines(stream_cls: type[io.StringIO]) -> None:
    stream = stream_cls()
    with RunProgress(0, stream=stream) as progress:
        pass
    progress.summary()  # nothing to summarise: must not crash


@pytest.mark.parametrize("stream_cls", [io.StringIO, _Tty])
def test_progress_long_model_name_and_plain_lines(
    stream_cls: type[io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    import callboard._progress as prog

    monkeypatch.setattr(prog, "PLAIN_EVERY_S", 0.0)
    stream = stream_cls()
    name = "m" * 400
    with RunProgress(3, stream=stream) as progress:
        progress.add(_completed(name))
        progress.add(None)
        progress.add(_completed(None, 2))
    progress.summary()
    out = stream.getvalue()
    assert "3/3" in out
    if stream_cls is io.StringIO:
        assert "\x1b[" not in out  # no escape codes in a pipe
    assert progress.errors == 1


def test_progress_summary_with_bracketed_model_name() -> None:
    stream = io.StringIO()
    with RunProgress(2, stream=stream) as progress:
        progress.add(_completed("llama[/x]"))
        progress.add(_completed("gpt[red]", 2))
    progress.summary()
    out = stream.getvalue()
    assert "llama[/x]" in out
    assert "gpt[red]" in out


# -- stats snapshot ------------------------------------------------------------------


def test_stats_snapshot_repr_str_and_json(make_system: Callable[..., System]) -> None:
    system = make_system()
    for f in system.submit_many(["a", "b"]):
        f.result(WAIT_S)
    stats = system.stats()
    assert repr(stats).startswith("Stats(")
    assert str(stats)
    data = json.loads(json.dumps(dataclasses.asdict(stats)))
    assert data["outcomes"] == {"completed": 2}
    assert data["total"]["finished"] == 2
    assert str(stats.cost_usd) == str(stats.total.cost_usd)


def test_stats_snapshot_is_frozen_all_the_way(make_system: Callable[..., System]) -> None:
    system = make_system()
    system.submit("a").result(WAIT_S)
    stats = system.stats()
    with pytest.raises(TypeError):
        stats.outcomes["completed"] = 99  # type: ignore[index]
