"""The simulated provider (provider/server.py), checked over real HTTP on loopback, and
``callboard mock`` serving it from the command line (plus its pure parts)."""

from __future__ import annotations

import json
import math
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import httpx
import pytest
from callboard.provider.limits import ModelLimits, format_duration
from callboard.provider.server import (
    ModelBehaviour,
    SimulatedProvider,
    count_prompt_tokens,
    run_mock,
)
from support import WAIT_S, refused, wait_until

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello to the world, please."},
]
FAST = ModelBehaviour(latency_s=0.0)

Factory = Callable[..., SimulatedProvider]
"""What the ``make_provider`` fixture (conftest.py) gives."""


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5.0) as c:
        yield c


def chat(client: httpx.Client, provider: SimulatedProvider, **body: Any) -> httpx.Response:
    payload = {"model": "m", "messages": MESSAGES, **body}
    return client.post(f"{provider.base_url}/chat/completions", json=payload)


# --- pure parts ----------------------------------------------------------------


def test_count_prompt_tokens_is_ceil_quarter_plus_overheads() -> None:
    assert count_prompt_tokens([{"role": "user", "content": "abcde"}]) == 2 + 4 + 3
    assert count_prompt_tokens([{"role": "user", "content": ""}]) == 4 + 3
    parts = [{"type": "text", "text": "abcd"}, {"type": "image_url", "image_url": {"url": "x"}}]
    # an image of unknown size costs the most OpenAI's rule allows: 2 x 4 tiles of 170, + 85
    assert count_prompt_tokens([{"role": "user", "content": parts}]) == 1 + 1445 + 4 + 3


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.12, "120ms"), (1, "1s"), (1.5, "1.5s"), (360, "6m0s"), (3725, "1h2m5s")],
)
def test_format_duration_matches_openai(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    ("field", "value"),
    [("error_rate", 1.5), ("latency_s", -1.0), ("rpm", 0), ("status", 200), ("tpm", 2.5)],
)
def test_behaviour_names_the_bad_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        ModelBehaviour(**{field: value})


def test_fault_rates_must_not_sum_above_one() -> None:
    with pytest.raises(ValueError, match="error_rate"):
        ModelBehaviour(error_rate=0.6, drop_rate=0.6)


def test_a_request_bigger_than_the_token_bucket_passes_once_and_leaves_debt() -> None:
    limits = ModelLimits(rpm=None, tpm=600, burst_s=1.0, now=0.0)  # 10 tokens, 10/s
    assert limits.try_admit(0.0, 50) is None
    refusal = limits.try_admit(0.0, 5)
    assert refusal is not None
    assert refusal.kind == "tokens"
    assert refusal.wait_s == pytest.approx(4.5)  # from -40 back up to 5 at 10/s
    assert limits.try_admit(4.4, 5) is not None
    assert limits.try_admit(4.5, 5) is None


# --- the HTTP server -------------------------------------------------------------


def test_completion_has_the_openai_shape(make_provider: Factory, client: httpx.Client) -> None:
    provider = make_provider()
    response = chat(client, provider, max_tokens=1000)
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == "m"
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] == count_prompt_tokens(MESSAGES)
    assert 16 <= usage["completion_tokens"] <= 64
    assert len(choice["message"]["content"].split()) == usage["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    model_stats = provider.stats()["models"]["m"]
    assert model_stats["prompt_tokens"] == usage["prompt_tokens"]
    assert model_stats["completion_tokens"] == usage["completion_tokens"]


def test_max_tokens_caps_the_completion(make_provider: Factory, client: httpx.Client) -> None:
    provider = make_provider(default=ModelBehaviour(latency_s=0.0, completion_tokens=50))
    body = chat(client, provider, max_tokens=7).json()
    assert body["usage"]["completion_tokens"] == 7
    assert body["choices"][0]["finish_reason"] == "length"


def test_same_seed_gives_same_completion_sizes(
    make_provider: Factory, client: httpx.Client
) -> None:
    def sizes(provider: SimulatedProvider) -> list[int]:
        return [chat(client, provider).json()["usage"]["completion_tokens"] for _ in range(5)]

    assert sizes(make_provider(seed=7)) == sizes(make_provider(seed=7))


def test_api_key_is_required_and_never_echoed(make_provider: Factory, client: httpx.Client) -> None:
    key = "sk-secret-1234"
    provider = make_provider(api_key=key)
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        url = f"{provider.base_url}/chat/completions"
        response = client.post(url, json={"model": "m", "messages": MESSAGES}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert key not in response.text
    assert client.get(f"{provider.base_url}/models").status_code == 401
    good = {"Authorization": f"Bearer {key}"}
    url = f"{provider.base_url}/chat/completions"
    assert client.post(url, json={"model": "m", "messages": MESSAGES}, headers=good).is_success


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"{not json", None),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": []}).encode(), "messages"),
        (json.dumps({"messages": MESSAGES}).encode(), "model"),
        (json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 0}).encode(), "max_tokens"),
    ],
)
def test_bad_bodies_get_400(
    make_provider: Factory, client: httpx.Client, content: bytes, param: str | None
) -> None:
    provider = make_provider()
    response = client.post(f"{provider.base_url}/chat/completions", content=content)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert provider.stats()["total"]["responses"] == {"400": 1}


def test_rpm_limit_refuses_past_the_burst(make_provider: Factory, client: httpx.Client) -> None:
    limited = ModelBehaviour(latency_s=0.0, rpm=6, burst_s=20.0)  # 2 requests, then 1 per 10 s
    provider = make_provider(models={"m": limited})
    responses = [chat(client, provider) for _ in range(5)]
    assert [r.status_code for r in responses] == [200, 200, 429, 429, 429]
    refused = responses[2]
    assert refused.json()["error"]["type"] == "requests"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    wait_ms = int(refused.headers["retry-after-ms"])
    assert 9_000 < wait_ms <= 10_000
    assert refused.headers["retry-after"] == str(math.ceil(wait_ms / 1000))
    for response in responses:
        assert response.headers["x-ratelimit-limit-requests"] == "6"
        assert response.headers["x-ratelimit-remaining-requests"] in {"0", "1"}
        assert response.headers["x-ratelimit-reset-requests"].endswith("s")
    stats = provider.stats()["models"]["m"]
    assert stats["requests"] == 5
    assert stats["rate_limited"] == 3
    assert stats["responses"] == {"200": 2, "429": 3}
    assert len(stats["arrivals"]) == 5
    assert stats["arrivals"] == sorted(stats["arrivals"])
    assert stats["refused_arrivals"] == stats["arrivals"][2:]  # the 429s' own arrivals


def test_tpm_limit_charges_what_usage_reports(make_provider: Factory, client: httpx.Client) -> None:
    tokens = count_prompt_tokens(MESSAGES) + 10
    limited = ModelBehaviour(latency_s=0.0, tpm=tokens, completion_tokens=10, burst_s=60.0)
    provider = make_provider(models={"m": limited})
    first = chat(client, provider)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-remaining-tokens"] == "0"
    assert first.headers["x-ratelimit-limit-tokens"] == str(tokens)
    second = chat(client, provider)
    assert second.status_code == 429
    assert second.json()["error"]["type"] == "tokens"


def test_forced_status(make_provider: Factory, client: httpx.Client) -> None:
    provider = make_provider(models={"down": ModelBehaviour(status=503)})
    assert chat(client, provider, model="down").status_code == 503
    provider.configure("m", ModelBehaviour(status=429, retry_after_s=2.0))
    response = chat(client, provider)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert provider.stats()["models"]["m"]["rate_limited"] == 1


def test_error_rate_one_gives_500(make_provider: Factory, client: httpx.Client) -> None:
    provider = make_provider(default=ModelBehaviour(latency_s=0.0, error_rate=1.0))
    assert [chat(client, provider).status_code for _ in range(3)] == [500, 500, 500]
    assert chat(client, provider).json()["error"]["type"] == "server_error"


def test_malformed_rate_one_gives_non_json_200(
    make_provider: Factory, client: httpx.Client
) -> None:
    provider = make_provider(default=ModelBehaviour(latency_s=0.0, malformed_rate=1.0))
    response = chat(client, provider)
    assert response.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        response.json()


def test_drop_rate_one_closes_the_connection(make_provider: Factory, client: httpx.Client) -> None:
    provider = make_provider(default=ModelBehaviour(latency_s=0.0, drop_rate=1.0))
    with pytest.raises(httpx.RemoteProtocolError):
        chat(client, provider)
    total = provider.stats()["total"]
    assert total["dropped"] == 1
    assert total["responses"] == {}


def test_hang_times_the_client_out_and_stop_is_prompt(make_provider: Factory) -> None:
    provider = make_provider(default=ModelBehaviour(timeout_rate=1.0, hang_s=30.0))
    with httpx.Client(timeout=0.3) as short, pytest.raises(httpx.ReadTimeout):
        chat(short, provider)
    assert provider.stats()["total"]["hung"] == 1
    assert wait_until(
        lambda: provider.stats()["total"]["in_flight"] == 0
    )  # ended by the disconnect
    with socket.create_connection(("127.0.0.1", provider.port), timeout=5.0) as raw:
        body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}"
        raw.sendall(head.encode() + b"\r\nContent-Type: application/json\r\n\r\n" + body)
        assert wait_until(lambda: provider.stats()["total"]["in_flight"] == 1)
        began = time.monotonic()
        provider.stop()
        assert time.monotonic() - began < 2.0
        reply = b"".join(iter(lambda: raw.recv(4096), b""))  # ends: the server closed it
        assert reply == b"" or reply.startswith(b"HTTP/1.1 504")


def test_held_answers_wait_for_their_release_and_others_are_not_held(
    make_provider: Factory, client: httpx.Client
) -> None:
    provider = make_provider(default=FAST)
    with ThreadPoolExecutor(max_workers=2) as pool:
        with provider.held("m"):
            plain = pool.submit(chat, client, provider)
            streamed = pool.submit(chat, client, provider, stream=True)
            assert wait_until(lambda: provider.stats()["total"]["in_flight"] == 2)
            other = client.post(
                f"{provider.base_url}/chat/completions", json={"model": "n", "messages": MESSAGES}
            )
            assert other.status_code == 200  # another model is answered meanwhile
            assert not plain.done()
            assert not streamed.done()
        assert plain.result(WAIT_S).status_code == 200
        assert "[DONE]" in streamed.result(WAIT_S).text
    assert chat(client, provider).status_code == 200  # held no more


def test_a_stop_lets_held_answers_go(make_provider: Factory) -> None:
    provider = make_provider(default=FAST)
    with ThreadPoolExecutor(max_workers=1) as pool, httpx.Client(timeout=WAIT_S) as client:
        with provider.held("m"):
            plain = pool.submit(chat, client, provider)
            assert wait_until(lambda: provider.stats()["total"]["in_flight"] == 1)
            began = time.monotonic()
            provider.stop()
            assert time.monotonic() - began < WAIT_S / 2
        done, _ = wait([plain], timeout=WAIT_S)
        assert done  # answered, or its connection closed: never left held


def test_pause_refuses_and_resume_serves_on_the_same_port(
    make_provider: Factory, client: httpx.Client
) -> None:
    provider = make_provider()
    port = provider.port
    assert chat(client, provider).status_code == 200  # leaves a keep-alive connection
    provider.pause()
    with pytest.raises(httpx.ConnectError):
        chat(client, provider)
    provider.resume()
    assert provider.port == port
    assert chat(client, provider).status_code == 200


def test_configure_at_runtime_and_via_admin(make_provider: Factory, client: httpx.Client) -> None:
    provider = make_provider(models={"a": FAST})
    provider.configure("b", ModelBehaviour(latency_s=0.0, status=400))
    assert chat(client, provider, model="b").status_code == 400
    admin = f"http://127.0.0.1:{provider.port}/admin/models"
    response = client.post(f"{admin}/a", json={"error_rate": 1.0})
    assert response.status_code == 200
    assert response.json()["behaviour"]["error_rate"] == 1.0
    assert chat(client, provider, model="a").status_code == 500
    bad = client.post(f"{admin}/a", json={"error_rate": 2.0})
    assert bad.status_code == 400
    assert "error_rate" in bad.json()["error"]["message"]
    assert "colour" in client.post(f"{admin}/a", json={"colour": 1}).json()["error"]["message"]
    models = client.get(f"{provider.base_url}/models").json()
    assert [m["id"] for m in models["data"]] == ["a", "b"]


def test_stats_reset_over_http(make_provider: Factory, client: httpx.Client) -> None:
    provider = make_provider()
    chat(client, provider)
    root = f"http://127.0.0.1:{provider.port}"
    assert client.get(f"{root}/stats").json()["total"]["requests"] == 1
    assert client.post(f"{root}/stats/reset").status_code == 200
    stats = client.get(f"{root}/stats").json()
    assert stats["total"]["requests"] == 0
    assert stats["models"]["m"]["arrivals"] == []
    assert stats == {**provider.stats(), "uptime_s": stats["uptime_s"]}


def test_stop_leaves_no_thread_and_is_idempotent(client: httpx.Client) -> None:
    before = set(threading.enumerate())
    with SimulatedProvider(default=FAST) as provider:
        assert chat(client, provider).status_code == 200
        assert set(threading.enumerate()) != before
    assert set(threading.enumerate()) == before
    provider.stop()
    with pytest.raises(httpx.ConnectError):
        chat(client, provider)


def test_non_loopback_host_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="loopback"):
        SimulatedProvider(host="0.0.0.0")
    with pytest.raises(SystemExit) as exit_info:
        run_mock(["--host", "0.0.0.0"])
    assert exit_info.value.code == 2
    assert "loopback" in capsys.readouterr().err


@pytest.mark.parametrize(
    "module",
    [["callboard", "mock"], ["callboard.provider.server"]],
    ids=["callboard-mock", "provider-module"],
)
def test_the_mock_prints_its_ready_line_serves_and_exits_0_on_sigint(
    module: list[str], client: httpx.Client, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", *module, "--port", "0", "--latency", "0"]
    # cwd: so `-m` imports the installed package, not whatever the test's cwd holds.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=tmp_path)  # noqa: S603 - our own module
    try:
        lines: queue.Queue[str] = queue.Queue()
        stdout = proc.stdout
        assert stdout is not None
        threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
        ready = lines.get(timeout=WAIT_S)
        prefix = "callboard mock listening on "
        assert ready.startswith(prefix + "http://127.0.0.1:"), (ready, proc.poll())
        base_url = ready[len(prefix) :].strip()
        payload = {"model": "any", "messages": MESSAGES}
        reply = client.post(f"{base_url}/chat/completions", json=payload)
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10.0) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5.0)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_mock_port_out_of_range_is_a_clean_error(port: str) -> None:
    # in a subprocess: the failed bind also leaks its socket (create_server closes it on
    # OSError only), which would surface here as an unraisable ResourceWarning
    argv = [sys.executable, "-m", "callboard", "mock", "--port", port]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)  # noqa: S603
    assert "Traceback" not in proc.stderr, proc.stderr[-300:]
    assert proc.returncode in (1, 2)
    assert "port" in proc.stderr


@pytest.mark.timeout(60)
def test_mock_sigterm_ends_a_hang_and_exits_0_with_its_port_closed() -> None:
    argv = [sys.executable, "-m", "callboard", "mock", "--port", "0", "--timeout-rate", "1"]
    proc = subprocess.Popen(  # noqa: S603 - our own module
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("callboard mock listening on http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1].strip()
        port = httpx.URL(url).port
        assert port is not None
        answers: list[int] = []

        def hang() -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            answers.append(httpx.post(url + "/chat/completions", json=body, timeout=30).status_code)

        caller = threading.Thread(target=hang)
        caller.start()
        root = url.removesuffix("/v1")
        assert wait_until(lambda: httpx.get(root + "/stats").json()["total"]["hung"] == 1, 10.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        caller.join(10)
        assert answers == [504]
        assert refused(port)
        assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_mock_bad_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--latency", "nan"],
        ["--rpm", "0"],
        ["--error-rate", "0.6", "--drop-rate", "0.6"],
        ["--models", "[1]"],
        ["--models", "{bad json"],
        ["--models", '{"m": {"nope": 1}}'],
        ["--host", "0.0.0.0"],
    ):
        with pytest.raises(SystemExit) as exc:
            run_mock(argv)
        assert exc.value.code == 2, argv
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("key", ["", " sk-lead", "sk-two words", "sk-line\nend", "sk-été"])
def test_mock_refuses_a_key_no_client_can_send_without_showing_it(
    key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--api-key ""`` made a provider that refused every SDK (none sends an empty key)."""
    with pytest.raises(SystemExit) as exc:
        run_mock(["--api-key", key])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--api-key" in err
    assert not key.strip() or key.strip() not in err


def test_mock_models_that_are_not_json_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    """It said only "Expecting value: line 1 column 1 (char 0)" (found by a hunt)."""
    with pytest.raises(SystemExit):
        run_mock(["--models", "m1"])
    assert "--models is not JSON" in capsys.readouterr().err
