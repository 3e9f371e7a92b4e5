"""A second provider for the bench: a bare ASGI app on uvicorn (uvloop, httptools).

The simulated provider is ours, and a client tuned against one server can be
tuned to its quirks. This one shares no code with it: a bare ASGI callable, no
framework, served by uvicorn with uvloop and httptools (measured the fastest
server for a bare ASGI app here). It answers ``POST .../chat/completions`` after
a fixed latency with a fixed completion in OpenAI's shape, and keeps only the
counters the bench reads (``GET /stats``, ``POST /stats/reset``).

Run as the bench's child: ``python -m callboard.bench.asgi_provider --port 0
--latency 0.05 --exit-on-stdin-eof``; it announces its URL on stdout in the
simulated provider's words, so ``ProviderProcess`` starts either.

What must hold: it listens on loopback only; it exits when its stdin closes if
asked (the bench may die without stopping it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

__all__ = ["App", "main"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]


class App:
    """The ASGI callable: a completion after ``latency_s``, and the bench's counters."""

    def __init__(self, *, latency_s: float, completion_tokens: int = 24) -> None:
        self.latency_s = latency_s
        self.completion_tokens = completion_tokens
        self.requests = 0
        self.first_at: float | None = None
        self.last_at: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await _body(receive)
        path, method = scope["path"], scope["method"]
        if method == "POST" and path.endswith("/chat/completions"):
            await self._complete(body, send)
        elif path == "/stats" and method == "GET":
            await _answer(send, 200, self._stats())
        elif path == "/stats/reset" and method == "POST":
            self.requests, self.first_at, self.last_at = 0, None, None
            await _answer(send, 200, {"reset": True})
        else:
            await _answer(send, 404, {"error": {"message": f"no route {method} {path}"}})

    async def _complete(self, body: bytes, send: Send) -> None:
        now = time.monotonic()
        self.requests += 1
        self.first_at = now if self.first_at is None else self.first_at
        self.last_at = now
        try:
            model = json.loads(body).get("model", "model")
        except (ValueError, AttributeError):
            await _answer(send, 400, {"error": {"message": "the body is not a JSON object"}})
            return
        await asyncio.sleep(self.latency_s)
        words = " ".join(["word"] * self.completion_tokens)
        await _answer(
            send,
            200,
            {
                "id": f"chatcmpl-{self.requests}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": words},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": 10,
                    "completion_tokens": self.completion_tokens,
                    "total_tokens": 10 + self.completion_tokens,
                },
            },
        )

    def _stats(self) -> dict[str, Any]:
        counters: dict[str, float] = {"requests": self.requests, "ok": self.requests}
        if self.first_at is not None and self.last_at is not None:
            counters["span_s"] = self.last_at - self.first_at
        return {"total": counters, "models": {}}


async def _body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _answer(send: Send, status: int, payload: dict[str, Any]) -> None:
    raw = json.dumps(payload).encode()
    headers = [*_JSON, (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until stopped (SIGINT/SIGTERM, or stdin's end with --exit-on-stdin-eof)."""
    parser = argparse.ArgumentParser(prog="python -m callboard.bench.asgi_provider")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (default)")
    parser.add_argument("--latency", type=float, default=0.05, help="seconds per completion")
    parser.add_argument("--completion-tokens", type=int, default=24)
    parser.add_argument("--exit-on-stdin-eof", action="store_true")
    args = parser.parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        parser.error("the ASGI provider needs uvicorn: pip install 'callboard[bench]'")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    app = App(latency_s=args.latency, completion_tokens=args.completion_tokens)
    config = uvicorn.Config(
        app, loop="uvloop", http="httptools", lifespan="off", log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    if args.exit_on_stdin_eof:
        threading.Thread(target=_exit_at_eof, args=(server,), daemon=True).start()
    sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    print(f"callboard mock listening on http://127.0.0.1:{sock.getsockname()[1]}/v1", flush=True)
    server.run(sockets=[sock])
    return 0


def _exit_at_eof(server: Any) -> None:
    sys.stdin.read()
    server.should_exit = True


if __name__ == "__main__":
    sys.exit(main())
