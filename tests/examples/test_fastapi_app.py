"""examples/fastapi_app.py over a real ASGI client, with the app's lifespan run.

``httpx.ASGITransport`` serves the app in-process; the lifespan (which starts
and stops the ``AsyncSystem``) runs through ``app.router.lifespan_context``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi", reason="the example needs fastapi: pip install -e '.[test]'")

from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S, two_models

from callboard import ModelSettings, SystemConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fastapi_app.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fastapi_app_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the body model's annotations here
    spec.loader.exec_module(module)
    return module


async def serve(app: Any, calls: Any) -> Any:
    """Run ``calls(client)`` against ``app`` inside its lifespan."""
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://example", timeout=WAIT_S) as c,
    ):
        return await calls(c)


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example()


def test_concurrent_requests_of_every_priority_all_succeed(example: ModuleType) -> None:
    priorities = ["critical", "high", "normal", "low", "0", "3", "HIGH", None] * 3

    async def calls(client: httpx.AsyncClient) -> tuple[list[httpx.Response], httpx.Response]:
        requests = [
            client.post(
                "/complete",
                json={"prompt": f"question {i}", "max_tokens": 32},
                headers={} if p is None else {"X-Priority": p},
            )
            for i, p in enumerate(priorities)
        ]
        answers = await asyncio.gather(*requests)
        return answers, await client.get("/stats")

    answers, stats = asyncio.run(serve(example.create_app(), calls))
    assert [a.status_code for a in answers] == [200] * len(priorities)
    bodies = [a.json() for a in answers]
    expected = {"critical", "high", "normal", "low"}
    assert {b["priority"] for b in bodies} == expected
    assert [b["priority"] for b in bodies[:8]] == [
        "critical", "high", "normal", "low", "critical", "low", "high", "normal",
    ]  # fmt: skip
    for body in bodies:
        assert body["text"]
        assert body["model"] == "sim-fast"
        assert body["usage"]["total_tokens"] == (
            body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        )
        assert float(body["cost_usd"]) > 0
    assert len({b["task_id"] for b in bodies}) == len(bodies)
    assert stats.status_code == 200
    report = stats.json()
    assert report["outcomes"] == {"completed": len(priorities)}
    assert set(report["by_priority"]) == expected
    assert float(report["total"]["cost_usd"]) == pytest.approx(
        sum(float(b["cost_usd"]) for b in bodies)
    )


def test_a_bad_priority_header_or_request_is_a_400(example: ModuleType) -> None:
    async def calls(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [
            await client.post("/complete", json={"prompt": "hi"}, headers={"X-Priority": "urgent"}),
            await client.post("/complete", json={"prompt": "hi"}, headers={"X-Priority": "9"}),
            await client.post("/complete", json={"prompt": "hi", "model": "nope"}),
            await client.post("/complete", json={"prompt": "hi", "max_tokens": -1}),
            await client.post("/complete", json={"prompt": "   "}),
            await client.post("/complete", json={"prompt": ""}),
            await client.post(  # JSON has no inf: FastAPI's own answer to it was a 500
                "/complete",
                content=b'{"prompt": "hi", "max_tokens": 1e400}',
                headers={"content-type": "application/json"},
            ),
        ]

    answers = asyncio.run(serve(example.create_app(), calls))
    assert [a.status_code for a in answers] == [400] * 7
    assert answers[-1].json()["detail"][0]["loc"] == ["body", "max_tokens"]
    assert "X-Priority" in answers[0].json()["detail"]
    assert "priority must be one of" in answers[1].json()["detail"]
    assert "nope" in answers[2].json()["detail"]


def test_a_failed_result_maps_to_a_gateway_status(
    example: ModuleType, provider: SimulatedProvider
) -> None:
    provider.configure("beta", ModelBehaviour(status=400))
    config = SystemConfig(models=two_models(provider.base_url))

    async def calls(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/complete", json={"prompt": "hi", "model": "beta"})

    answer = asyncio.run(serve(example.create_app(config), calls))
    assert answer.status_code == 502
    assert answer.json()["error"] == "Failed"
    assert answer.json()["reason"] == "request_error"


def test_priority_header_parsing(example: ModuleType) -> None:
    from callboard import Priority

    assert example.parse_priority(None) is Priority.NORMAL
    assert example.parse_priority("Critical") is Priority.CRITICAL
    assert example.parse_priority(" 1 ") is Priority.HIGH


def test_stats_of_a_stopped_system_is_a_503(example: ModuleType) -> None:
    app = example.create_app()

    async def calls(client: httpx.AsyncClient) -> httpx.Response:
        await app.state.cb.stop()  # e.g. a spent budget stopped it under the running app
        return await client.get("/stats")

    answer = asyncio.run(serve(app, calls))
    assert answer.status_code == 503
    assert "stopped" in answer.json()["detail"]


def test_the_lifespan_stops_the_system_within_its_own_bound(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``async with AsyncSystem()`` gave the calls in flight 30 s at the app's stop, and
    uvicorn's graceful timeout and force quit did not cut that short: the process
    lingered 24 s past both (a hunt). The lifespan stops the system within ``STOP_S``."""
    monkeypatch.setattr(example, "STOP_S", 0.0)
    with SimulatedProvider(models={"m": ModelBehaviour(latency_s=0.01)}) as provider:
        config = SystemConfig(models=(ModelSettings(name="m", base_url=provider.base_url),))
        app = example.create_app(config)

        async def main() -> int:
            transport = httpx.ASGITransport(app=app)
            client = httpx.AsyncClient(transport=transport, base_url="http://x", timeout=WAIT_S)
            with provider.held("m"):  # the call stays at the provider while the app stops
                async with app.router.lifespan_context(app):
                    asking = asyncio.ensure_future(
                        client.post("/complete", json={"prompt": "hi", "model": "m"})
                    )
                    while not provider.stats()["models"].get("m", {}).get("requests"):
                        await asyncio.sleep(0.01)
                answer = await asyncio.wait_for(asking, WAIT_S)  # the lifespan has ended
            await client.aclose()
            return answer.status_code

        assert asyncio.run(asyncio.wait_for(main(), WAIT_S)) >= 500
