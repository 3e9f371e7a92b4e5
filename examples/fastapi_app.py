"""callboard inside a FastAPI app: one AsyncSystem for the app's life, priorities per request.

    pip install 'callboard[examples]'          # fastapi (+ uvicorn to serve it)
    uvicorn examples.fastapi_app:app           # CALLBOARD_CONFIG=callboard.toml for real models

``POST /complete`` takes ``{"prompt": ..., "model"?, "route"?, "max_tokens"?,
"temperature"?}`` and an optional ``X-Priority`` header (critical, high,
normal, low, or 0-3; default normal). It answers ``{"text", "model",
"usage", "cost_usd", ...}``; ``cost_usd`` is a string, the exact decimal.
A bad header or request is a 400; a result that is not ok maps to 502, 503
or 504 with the reason. ``GET /stats`` reports outcomes, latency and cost
(503 if the system cannot answer: stopped, say).

What must hold: the lifespan starts the system before the first request and
stops it after the last; handlers await results with ``AsyncSystem`` (which
never blocks the loop), so requests of every priority are served
concurrently and the queue, not the web server, decides their order.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from callboard import (
    AsyncSystem,
    Expired,
    Failed,
    FailureReason,
    GroupStats,
    Priority,
    Rejected,
    RejectReason,
    Result,
    Stats,
    SystemConfig,
    UnavailableError,
    UsageError,
)


class CompleteBody(BaseModel):
    """The JSON body of ``POST /complete``."""

    prompt: str = Field(min_length=1)
    model: str | None = None
    route: str | None = None
    max_tokens: int = 256
    temperature: float | None = None


def parse_priority(header: str | None) -> Priority:
    """``X-Priority``: a name (any case) or a number 0-3; missing means normal."""
    if header is None:
        return Priority.NORMAL
    value: str | int = int(header) if header.strip().isdigit() else header
    try:
        return Priority.parse(value)
    except UsageError as exc:
        raise HTTPException(status_code=400, detail=f"X-Priority: {exc}") from exc


_UNAVAILABLE = {FailureReason.RATE_LIMITED}


def _status_of(result: Result) -> int:
    """The HTTP status for a result that is not ok."""
    if isinstance(result, Expired) or (
        isinstance(result, Failed) and result.reason is FailureReason.TIMEOUT
    ):
        return 504
    if isinstance(result, Rejected):
        return 503 if result.reason in {RejectReason.QUEUE_FULL, RejectReason.STOPPING} else 400
    if isinstance(result, Failed) and result.reason in _UNAVAILABLE:
        return 503
    return 502


def result_json(result: Result) -> dict[str, Any]:
    usage = result.usage
    return {
        "text": result.text,
        "model": result.model,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        },
        "cost_usd": str(result.cost_usd),
        "priority": result.priority.name.lower(),
        "task_id": result.task_id,
        "trace_id": result.trace_id,
        "latency_s": round(result.latency_s, 6),
    }


def _group_json(group: GroupStats) -> dict[str, Any]:
    return {
        "finished": group.finished,
        "ok": group.ok,
        "failed": group.failed,
        "latency_p50_s": group.latency.p50,
        "latency_p95_s": group.latency.p95,
        "cost_usd": str(group.cost_usd),
    }


def stats_json(stats: Stats) -> dict[str, Any]:
    return {
        "outcomes": dict(stats.outcomes),
        "failures": dict(stats.failures),
        "total": _group_json(stats.total),
        "by_model": {name: _group_json(g) for name, g in stats.by_model.items()},
        "by_priority": {name.lower(): _group_json(g) for name, g in stats.by_priority.items()},
        "restarts": dict(stats.restarts),
    }


def _system(request: Request) -> AsyncSystem:
    cb: AsyncSystem = request.app.state.cb
    return cb


async def complete(
    body: CompleteBody,
    request: Request,
    x_priority: Annotated[str | None, Header()] = None,
) -> Any:
    priority = parse_priority(x_priority)
    fields = body.model_dump(exclude_none=True)
    prompt = fields.pop("prompt")
    try:
        result = await _system(request).submit(prompt, priority=priority, **fields)
    except UsageError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc
    except UnavailableError as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from exc
    if result.ok:
        return result_json(result)
    reason = getattr(result, "reason", None)
    return JSONResponse(
        status_code=_status_of(result),
        content={
            "error": type(result).__name__,
            "reason": None if reason is None else reason.value,
            "detail": getattr(result, "detail", ""),
            "task_id": result.task_id,
        },
    )


async def bad_body(_request: Request, exc: Exception) -> JSONResponse:
    """A body that does not validate is a 400, as the docstring says (FastAPI's own is a
    422 that echoes each bad input: ``1e400`` there made it a 500, JSON has no inf)."""
    assert isinstance(exc, RequestValidationError)
    said = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]
    return JSONResponse(status_code=400, content={"detail": said})


async def stats(request: Request) -> dict[str, Any]:
    try:
        return stats_json(await _system(request).stats())
    except UnavailableError as exc:  # stopped, or the aggregator did not answer
        raise HTTPException(status_code=503, detail=str(exc)) from exc


STOP_S = 5.0
"""How long the calls in flight get to answer when the app stops: less than the
server's own grace (uvicorn's ``--timeout-graceful-shutdown``, Kubernetes'
``terminationGracePeriodSeconds``). ``async with AsyncSystem()`` gives them 30 s,
and uvicorn's timeout and its force quit cancel the lifespan once, which does not
cut that wait short: the process lingered 24 s past both (a hunt)."""


def _config_from_env() -> SystemConfig | None:
    path = os.environ.get("CALLBOARD_CONFIG")
    if not path:
        return None
    from callboard.toml_config import load_config

    return load_config(Path(path))


def create_app(config: SystemConfig | None = None, **system_kwargs: Any) -> FastAPI:
    """The app; ``config`` (else ``$CALLBOARD_CONFIG``, else the simulated provider)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cb = await AsyncSystem(config or _config_from_env(), **system_kwargs).start()
        app.state.cb = cb
        try:
            yield
        finally:  # within the server's own grace (see STOP_S)
            await cb.stop(cancel=True, timeout=STOP_S)

    app = FastAPI(title="callboard example", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, bad_body)
    app.post("/complete")(complete)
    app.get("/stats")(stats)
    return app


app = create_app()
