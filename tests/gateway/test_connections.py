"""The gateway's client connections, bounded (``gateway/connections.py``)."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from callboard.gateway import Gateway
from callboard.gateway import app as gateway_app
from callboard.gateway.connections import LEAST, MARGIN, ConnectionCap, auto_capacity
from support import WAIT_S, LogCollector, wait_until


def _address(gateway: Gateway) -> tuple[str, int]:
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _open_connections(gateway: Gateway) -> int:
    assert gateway._front is not None
    return gateway._front.connections.open


@contextlib.contextmanager
def idle(gateway: Gateway, n: int) -> Iterator[list[socket.socket]]:
    """``n`` connections to ``gateway`` that send nothing, open once the server has them."""
    with contextlib.ExitStack() as stack:
        held = [
            stack.enter_context(socket.create_connection(_address(gateway), timeout=WAIT_S))
            for _ in range(n)
        ]
        assert wait_until(lambda: _open_connections(gateway) == n), _open_connections(gateway)
        yield held


def _answer_of(conn: socket.socket) -> bytes:
    """All the server sends before it closes ``conn``."""
    answer = b""
    while chunk := conn.recv(65536):
        answer += chunk
    return answer


def test_a_connection_past_max_connections_is_answered_503_and_closed(
    make_gateway: Callable[..., Gateway], keys: dict[str, str], debug_logs: LogCollector
) -> None:
    """Idle clients (no key, not a byte) took every descriptor of a gateway limited to
    1,024 open files, and its calls to the providers failed to connect (a hunt). One
    connection past the bound is answered 503 with ``Retry-After`` and closed; the
    connections open go on, and once one closes a new one is served."""
    gateway = make_gateway(settings={"max_connections": 3})
    with idle(gateway, 3) as held:
        with socket.create_connection(_address(gateway), timeout=WAIT_S) as fourth:
            answer = _answer_of(fourth)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert b"\r\nRetry-After: 1\r\n" in head
        error = json.loads(body)["error"]
        assert error["type"] == "overloaded_error"
        assert "gateway.max_connections" in error["message"]
        with (
            openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=keys["team"], max_retries=0) as sdk,
            pytest.raises(openai.InternalServerError) as raised,
        ):
            sdk.chat.completions.create(
                model="fast", messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        assert raised.value.status_code == 503
        assert raised.value.response.headers["retry-after"] == "1"
        held.pop().close()
        assert wait_until(lambda: _open_connections(gateway) == 2)
        with httpx.Client(timeout=WAIT_S) as client:
            assert client.get(f"{gateway.url}/healthz").status_code == 200
        assert wait_until(lambda: _open_connections(gateway) == 2)  # the client's closed
        assert gateway._front is not None
        assert gateway._front.connections.statistics() == {
            "open": 2,
            "capacity": 3,
            "refused": 2,
        }
    warnings = [r for r in debug_logs.records if r.name == "callboard.gateway.connections"]
    assert len(warnings) == 1  # the second refusal within the minute is counted, not logged
    assert warnings[0].levelno == logging.WARNING
    assert "1 client connections turned away" in warnings[0].getMessage()


def test_the_refusals_are_in_the_metrics_and_the_stats(
    make_gateway: Callable[..., Gateway], keys: dict[str, str]
) -> None:
    gateway = make_gateway(settings={"max_connections": 2})
    with idle(gateway, 1), httpx.Client(timeout=WAIT_S) as client:
        with idle_more(gateway, 1), socket.create_connection(_address(gateway)) as third:
            assert _answer_of(third).startswith(b"HTTP/1.1 503")
        assert wait_until(lambda: _open_connections(gateway) == 1)
        metrics = client.get(f"{gateway.url}/metrics").text
        stats = client.get(
            f"{gateway.url}/v1/callboard/stats",
            headers={"Authorization": f"Bearer {keys['admin']}"},
        ).json()
    assert "callboard_gateway_connections_capacity 2.0" in metrics
    assert "callboard_gateway_connections_refused_total 1.0" in metrics
    assert "callboard_gateway_connections_open 2.0" in metrics  # the scrape's and one idle
    assert stats["connections"] == {"open": 2, "capacity": 2, "refused": 1}


@contextlib.contextmanager
def idle_more(gateway: Gateway, n: int) -> Iterator[None]:
    """``n`` more idle connections, open once the server has them."""
    before = _open_connections(gateway)
    with contextlib.ExitStack() as stack:
        for _ in range(n):
            stack.enter_context(socket.create_connection(_address(gateway), timeout=WAIT_S))
        assert wait_until(lambda: _open_connections(gateway) == before + n)
        yield


@pytest.mark.parametrize(
    ("soft", "models", "expected"),
    [
        (1024, (64, 64), 1024 - 128 - MARGIN),
        (1_048_576, (1000,), 1_048_576 - 1000 - MARGIN),
        (256, (64,), LEAST),  # the models take the lot: a few clients still
        (-1, (64,), None),  # unlimited
    ],
)
def test_the_bound_by_default_leaves_the_models_their_descriptors(
    soft: int, models: tuple[int, ...], expected: int | None
) -> None:
    assert auto_capacity(soft, models) == expected


class _Server:
    """What ``ConnectionCap.admitting`` uses of aiohttp's ``web.Server``."""

    def __init__(self) -> None:
        self.connections: list[object] = []

    def __call__(self) -> Any:
        return self


def test_refusals_are_logged_once_a_minute_and_counted_each(debug_logs: LogCollector) -> None:
    now = [0.0]
    cap = ConnectionCap(1, clock=lambda: now[0])
    server = _Server()
    admit = cap.admitting(server)  # type: ignore[arg-type]
    assert admit() is server
    server.connections.append(object())
    for _ in range(3):
        assert admit() is not server
    now[0] += 60
    assert admit() is not server
    lines = [r.getMessage() for r in debug_logs.records if r.name.endswith("connections")]
    assert [line.split(" client")[0] for line in lines] == ["gateway: 1", "gateway: 3"]
    assert cap.refused == 4


def test_a_cap_takes_at_least_one_connection() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        ConnectionCap(0)
    assert ConnectionCap(None).admitting(_Server()) is not None  # type: ignore[arg-type]


def test_a_small_bound_by_default_is_warned_of_at_start(
    make_gateway: Callable[..., Gateway],
    monkeypatch: pytest.MonkeyPatch,
    debug_logs: LogCollector,
) -> None:
    """Twelve models of 64 slots under systemd's 1,024 open files left 16 connections,
    and nothing said so (a review)."""
    monkeypatch.setattr(gateway_app, "open_file_limit", lambda: 300)
    gateway = make_gateway()
    assert gateway._front is not None
    assert gateway._front.connections.capacity == LEAST  # 300 less 31 slots less 256
    (warning,) = [r for r in debug_logs.records if "client connections:" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert "ulimit -n" in warning.getMessage()


RAISE = """
import resource
from callboard.gateway.connections import raise_open_file_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
raise_open_file_limit()
print(resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard))
"""


def test_serve_raises_the_soft_open_file_limit_to_the_hard_one() -> None:
    """As Go's runtime does: a service's soft limit bounds its connections for nothing."""
    child = subprocess.run(  # noqa: S603 - this interpreter, this test's script
        [sys.executable, "-c", RAISE], capture_output=True, text=True, timeout=60, check=True
    )
    assert child.stdout.strip() == "True", child.stderr
