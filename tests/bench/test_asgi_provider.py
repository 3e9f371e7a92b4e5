"""The bench's second provider (bench/asgi_provider.py): the bare ASGI ``App`` driven
directly (a fake receive and send, no server), and the app served by uvicorn in its own
process through ``ProviderProcess(server="asgi")``, as ``callboard bench --provider asgi``
runs it: it answers completions, counts them, resets its counters and is gone after the
block."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from callboard.bench.asgi_provider import App, Message
from callboard.bench.provider_process import ProviderProcess
from support import WAIT_S, alive

# -- the app on its own ---------------------------------------------------------------------


def call(app: App, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """``app``'s status and JSON answer to one request, its body received in two chunks."""
    chunks = [body[: len(body) // 2], body[len(body) // 2 :]]
    sent: list[Message] = []

    async def receive() -> Message:
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: dict[str, Any] = {"type": "http", "method": method, "path": path}
    asyncio.run(app(scope, receive, send))
    start, answer = sent
    assert start["type"] == "http.response.start"
    assert answer["type"] == "http.response.body"
    assert dict(start["headers"])[b"content-length"] == str(len(answer["body"])).encode()
    return start["status"], json.loads(answer["body"])


def test_an_unknown_path_is_a_404_naming_it() -> None:
    status, answer = call(App(latency_s=0.0), "GET", "/v1/models")
    assert status == 404
    assert answer["error"]["message"] == "no route GET /v1/models"


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b""])
def test_a_completion_whose_body_is_not_a_json_object_is_a_400(body: bytes) -> None:
    status, answer = call(App(latency_s=0.0), "POST", "/v1/chat/completions", body)
    assert status == 400
    assert "not a JSON object" in answer["error"]["message"]


def test_a_completion_answers_in_openais_shape() -> None:
    app = App(latency_s=0.0, completion_tokens=3)
    request = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    status, answer = call(app, "POST", "/v1/chat/completions", request.encode())
    assert status == 200
    assert answer["model"] == "m"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "word word word"}
    assert answer["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}


# -- served by uvicorn in its own process ----------------------------------------------------


@pytest.mark.timeout(60)
def test_the_asgi_provider_process_answers_counts_resets_and_is_gone_after_the_block() -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with ProviderProcess(server="asgi", latency_s=0.01) as prov:
        pid = prov.pid
        assert alive(pid)
        response = httpx.post(prov.base_url + "/chat/completions", json=request, timeout=WAIT_S)
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "stop"
        assert prov.stats()["total"]["requests"] == 1
        prov.reset_stats()
        assert prov.stats()["total"] == {"requests": 0, "ok": 0}
    assert not alive(pid)


def test_the_asgi_provider_takes_no_models_table_or_jitter() -> None:
    with pytest.raises(ValueError, match="one fixed latency and no models table"):
        ProviderProcess(server="asgi", models={"m": {"latency_s": 0.1}})
    with pytest.raises(ValueError, match="one fixed latency"):
        ProviderProcess(server="asgi", jitter_s=0.01)
