"""callboard's loggers (runtime/guarded_log.py): a host's filter or handler that raises
never raises into callboard, alone or under a running system."""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from concurrent.futures import wait
from typing import Any

import pytest
from callboard.messages import Failed, FailureReason
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.guarded_log import guarded_logger
from support import WAIT_S, running

from callboard import ModelSettings

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")


class _RequestIdFilter(logging.Filter):
    """A host's filter that reads a context variable only its own threads set."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()  # LookupError on callboard's threads
        return True


class _Quiet(logging.Handler):
    """A host's handler that writes nothing (its filter raises first)."""

    def emit(self, record: logging.LogRecord) -> None:
        pass


class _Shipper(logging.Handler):
    """A host's handler whose ``emit`` raises (its log shipper is down)."""

    def emit(self, record: logging.LogRecord) -> None:
        raise ConnectionError("log shipper down")


@pytest.fixture(params=["filter", "emit"])
def raising(request: pytest.FixtureRequest) -> Iterator[str]:
    """The host's handler on the ``callboard`` logger raises (in a filter, or in emit);
    the fixture's value names the case."""
    handler: logging.Handler
    if request.param == "filter":
        handler = _Quiet()
        handler.addFilter(_RequestIdFilter())
    else:
        handler = _Shipper()
    logger = logging.getLogger("callboard")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield str(request.param)
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_record_the_hosts_logging_raises_on_is_dropped_and_said_once(
    raising: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"callboard.test_guarded_log.{raising}"
    log = guarded_logger(name)
    log.info("one")
    log.warning("two")
    err = capsys.readouterr().err
    assert err.count("--- callboard: the application's logging raised") == 1
    assert repr(name) in err


def test_a_record_factory_that_raises_does_not_raise_into_callboard(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A host's record factory (the usual way to stamp request ids) runs as the record
    is made, before any handler: it raised out of the log call (found by a review)."""
    made = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = made(*args, **kwargs)
        record.request_id = request_id.get()  # LookupError on callboard's threads
        return record

    logging.setLogRecordFactory(factory)
    try:
        guarded_logger("callboard.test_guarded_log.factory").warning("made")
    finally:
        logging.setLogRecordFactory(made)
    assert "the application's logging raised LookupError" in capsys.readouterr().err


class _HostLogger(logging.Logger):
    """A host's own logger class (``logging.setLoggerClass``)."""

    def makeRecord(self, *args: Any, **kwargs: Any) -> logging.LogRecord:  # noqa: N802 - logging's name
        record = super().makeRecord(*args, **kwargs)
        record.host = "ours"
        return record


def test_a_logger_of_the_hosts_own_class_is_guarded_and_keeps_its_class() -> None:
    name = "callboard.test_guarded_log.host_class"
    manager = logging.Logger.manager
    before = manager.loggerClass
    manager.setLoggerClass(_HostLogger)
    try:
        log = guarded_logger(name)
    finally:
        manager.loggerClass = before
    assert isinstance(log, _HostLogger)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    log.addHandler(handler)
    log.propagate = False
    handler.addFilter(_RequestIdFilter())  # raises: dropped
    log.warning("dropped")
    handler.filters.clear()
    log.warning("kept")
    assert [(r.getMessage(), r.host, r.filename) for r in seen] == [  # type: ignore[attr-defined]
        ("kept", "ours", "test_guarded_log.py")  # the caller, not the guard
    ]


def test_a_guarded_logger_is_the_same_logger_with_its_levels_and_handlers() -> None:
    plain = logging.getLogger("callboard.test_guarded_log.same")
    plain.setLevel(logging.ERROR)
    guarded = guarded_logger("callboard.test_guarded_log.same")
    assert guarded is plain
    assert guarded.level == logging.ERROR


@pytest.mark.usefixtures("raising")
def test_a_system_under_a_raising_host_log_ends_every_task_and_stops_cleanly(
    provider: SimulatedProvider,
) -> None:
    """Each failed task is logged at INFO as it is delivered: the model actor died in
    that log call, then the root supervisor in its own, and the accepted tasks never
    got a result; ``stop`` raised the host's error (found by a hunt)."""
    provider.configure("bad", ModelBehaviour(latency_s=0.001, status=400))
    provider.configure("good", ModelBehaviour(latency_s=0.001))
    bad = ModelSettings(name="bad", base_url=provider.base_url)
    good = ModelSettings(name="good", base_url=provider.base_url)
    with running(bad, good) as system:
        futures = [system.submit(f"p{i}", model="bad") for i in range(10)]
        _, pending = wait(futures, timeout=WAIT_S)
        assert not pending
        assert all(
            isinstance(r, Failed) and r.reason is FailureReason.REQUEST_ERROR
            for r in (f.result() for f in futures)
        )
        assert system.submit("after them", model="good").result(WAIT_S).ok
        assert system.failure is None
        children = [s for s in system.supervision().values() if isinstance(s, dict)]
        assert children
        assert all(child["restarts"] == 0 for child in children)
