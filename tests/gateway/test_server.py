"""Running the gateway: ``callboard serve`` as its own process (``python -m
callboard.gateway``), its graceful stop on SIGTERM, and what it refuses to do."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import openai
import pytest
from callboard.gateway import ANNOUNCEMENT, Gateway, main
from callboard.gateway.settings import UnsafeBindError
from callboard.provider.server import SimulatedProvider
from support import WAIT_S, announced, child, served, threads_since, wait_until

KEY = "sk-ops-9876543210"


@contextlib.contextmanager
def serving(
    *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``callboard serve --port 0 ARGS`` in a process of its own; its base URL once it
    listens. Killed at the end if it is still running."""
    with child(["-m", "callboard.gateway", "--port", "0", *args], env=env) as proc:
        yield proc, announced(proc, ANNOUNCEMENT, WAIT_S)


def config_file(tmp_path: Path, upstream: SimulatedProvider, gateway: str) -> Path:
    path = tmp_path / "callboard.toml"
    path.write_text(
        f"""
[gateway]
{gateway}

[gateway.keys.ops]
key_env = "OPS_GATEWAY_KEY"

[models.gate]
base_url = "{upstream.base_url}"
max_concurrency = 1
""",
        encoding="utf-8",
    )
    return path


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/healthz", timeout=WAIT_S)
    except httpx.ConnectError:
        return True
    return False


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


@pytest.fixture
def in_flight(
    pool: ThreadPoolExecutor,
    upstream: SimulatedProvider,
    slowed: Callable[[str, float], AbstractContextManager[None]],
) -> Callable[[str], Future[httpx.Response]]:
    """``in_flight(url)``: a request to ``gate`` that takes 1 s upstream, returned once
    its call is there."""

    def send(url: str) -> Future[httpx.Response]:
        before = int(served(upstream, "gate").get("requests", 0))
        with slowed("gate", 1.0):
            answer = pool.submit(
                httpx.post,
                f"{url}/v1/chat/completions",
                json={"model": "gate", "messages": [{"role": "user", "content": "hold"}]},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=WAIT_S,
            )
            assert wait_until(lambda: int(served(upstream, "gate").get("requests", 0)) > before)
        return answer

    return send


def test_without_a_config_it_serves_the_simulated_provider_open_on_loopback() -> None:
    with serving() as (proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="anything", max_retries=0)
        with client:
            answer = client.chat.completions.create(
                model="sim-fast", messages=[{"role": "user", "content": "hi"}]
            )
        assert answer.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0


def test_sigterm_turns_unready_first_then_lets_the_call_in_flight_finish(
    tmp_path: Path, upstream: SimulatedProvider, in_flight: Callable[[str], Future[httpx.Response]]
) -> None:
    config = config_file(tmp_path, upstream, "grace_s = 10\nunready_s = 0.5")
    with serving("--config", str(config), env={"OPS_GATEWAY_KEY": KEY}) as (proc, url):
        answer = in_flight(url)
        proc.send_signal(signal.SIGTERM)
        unready = httpx.get(f"{url}/readyz", timeout=WAIT_S)
        assert unready.status_code == 503
        assert answer.result(WAIT_S).status_code == 200  # the call in flight finished
        assert proc.wait(WAIT_S) == 0
        assert refused(url)


def test_what_outlasts_the_grace_is_cut_and_the_process_still_exits(
    tmp_path: Path, upstream: SimulatedProvider, in_flight: Callable[[str], Future[httpx.Response]]
) -> None:
    config = config_file(tmp_path, upstream, "grace_s = 0.2")
    with serving("--config", str(config), env={"OPS_GATEWAY_KEY": KEY}) as (proc, url):
        answer = in_flight(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
        with pytest.raises(httpx.HTTPError):  # cut after the grace, not answered after 1 s
            answer.result(WAIT_S).raise_for_status()


def test_an_open_gateway_refuses_to_bind_beyond_loopback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--host", "0.0.0.0", "--port", "0"]) == 2
    assert "binds loopback only" in capsys.readouterr().err
    with pytest.raises(UnsafeBindError):
        Gateway(host="::")


def test_a_bad_config_is_reported_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "callboard.toml"
    path.write_text("[gateway]\ngrace = 1\n", encoding="utf-8")
    assert main(["--config", str(path)]) == 2
    assert f"{path}: gateway.grace: unknown key" in capsys.readouterr().err


def test_a_port_in_use_is_reported_and_nothing_is_left_running(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = set(threading.enumerate())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--port", str(port)]) == 1
    assert "cannot listen" in capsys.readouterr().err
    assert wait_until(lambda: not threads_since(before))
