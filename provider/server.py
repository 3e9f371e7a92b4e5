"""The simulated provider: a real HTTP server on loopback that speaks OpenAI's and
Anthropic's wires.

What it is for:
1. the embedded default provider when the user configures none;
2. tests that check the client's behaviour from the server's side (``/stats``
   holds per-model counters and server-side arrival times);
3. the load bench, in its own process: ``callboard mock`` / `run_mock`.

Endpoints (the first three behind the API key if one is set):
- ``POST /v1/chat/completions``: every Chat Completions field; tool calls that
  honour ``tool_choice``, JSON answers valid for a ``json_schema``, ``n``
  choices, logprobs, stop sequences, reasoning tokens; ``"stream": true``
  answers ``chat.completion.chunk`` events (``stream_options.include_usage``
  adds the usage chunk);
- ``POST /v1/embeddings``: strings or token ids, ``dimensions``,
  ``encoding_format`` float or base64;
- ``POST /v1/messages``: Anthropic's Messages API (``x-api-key`` or a bearer
  key, ``anthropic-version``), plain or streamed;
- ``GET /v1/models``, ``GET /stats``, ``POST /stats/reset``,
  ``POST /admin/models/{name}`` (a JSON object of `ModelBehaviour` fields,
  applied over the model's current behaviour).

A request is handled in a fixed order: API key (401), headers and body (400),
forced status, rate limits (429 with the wire's headers, not charged), one
seeded random draw for faults (500; 503, or 529 on the Anthropic wire; a hang;
a dropped connection; a malformed 200; a cut), latency (a stream's time to
first token, then a gap per token), then the answer, whose ``usage`` is
exactly what the limits charged.

What must always hold:
- it listens on loopback only;
- provider state is touched only on the server's event loop; calls from
  other threads (`SimulatedProvider.configure`, `stats`, `pause`...) hop onto
  it and wait for the answer;
- `SimulatedProvider.stop` ends hangs at once and leaves no thread, task or
  socket behind; it is idempotent.

Layout: ``behaviour`` (the per-model settings), ``limits`` (token buckets),
``counters`` (the statistics), ``engine`` (the decision per request),
``reply`` and ``instances`` (what the model says), ``tokens`` (the prompt
size), ``wire``, ``embeddings`` and ``anthropic`` (each endpoint's JSON),
``dialects`` (each endpoint's words for a plan), ``sse`` (how it writes),
``app`` (aiohttp), and this module (the server and its CLI).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, Self, TypeVar

from callboard.provider.app import ProviderApp, check_loopback, check_port, host_arg, port_arg
from callboard.provider.behaviour import (
    CUT_MODES,
    FAULT_RATES,
    ModelBehaviour,
    behaviour_from_json,
)
from callboard.provider.engine import MAX_MODELS, ProviderCore
from callboard.provider.wire import count_prompt_tokens

__all__ = [
    "ModelBehaviour",
    "SimulatedProvider",
    "count_prompt_tokens",
    "run_mock",
    "serve",
]

_T = TypeVar("_T")
_HOP_TIMEOUT_S = 5.0
_START_TIMEOUT_S = 10.0
_DEFAULT = ModelBehaviour()


def _base_url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


class SimulatedProvider:
    """The provider in a daemon thread with its own event loop."""

    def __init__(
        self,
        *,
        default: ModelBehaviour = _DEFAULT,
        models: Mapping[str, ModelBehaviour] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
        api_key: str | None = None,
    ) -> None:
        self._host = check_loopback(host)
        self._requested_port = check_port(port)
        self._api_key = api_key
        self._core = ProviderCore(default=default, models=models, seed=seed)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._app: ProviderApp | None = None
        self._stop: asyncio.Event | None = None
        self._port: int | None = None

    def __repr__(self) -> str:
        where = "stopped" if self._port is None else _base_url(self._host, self._port)
        return f"<SimulatedProvider {where}>"

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the simulated provider has not been started")
        return self._port

    @property
    def base_url(self) -> str:
        return _base_url(self._host, self.port)

    def start(self) -> str:
        """Listen in a background thread; return the base URL once it accepts connections."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the simulated provider is already running")
            started: concurrent.futures.Future[int] = concurrent.futures.Future()
            thread = threading.Thread(
                target=self._run, args=(started,), name="callboard-provider", daemon=True
            )
            thread.start()
            self._thread = thread
        try:
            self._port = started.result(_START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def stop(self, timeout: float = 5.0) -> None:
        """Close the server and join its thread; a no-op if not running."""
        with self._lock:
            thread, loop, stop = self._thread, self._loop, self._stop
            self._thread = self._loop = self._app = self._stop = None
            if thread is None:
                return
            if loop is not None and stop is not None:
                with contextlib.suppress(RuntimeError):  # the loop already closed
                    loop.call_soon_threadsafe(stop.set)
            thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"the simulated provider did not stop within {timeout}s")

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def configure(self, model: str, behaviour: ModelBehaviour) -> None:
        """Serve ``model`` with ``behaviour`` from now on (any thread)."""
        self._call(lambda: self._core.configure(model, behaviour))

    def stats(self) -> dict[str, Any]:
        """The same JSON as ``GET /stats``."""
        return self._call(self._core.stats)

    def reset_stats(self) -> None:
        self._call(self._core.reset_stats)

    @contextlib.contextmanager
    def held(self, model: str) -> Iterator[None]:
        """``with provider.held(model):`` ``model``'s answers wait until the block ends
        (each then after its latency); a stop lets them go too."""
        self._hop(lambda app: app.hold(model))
        try:
            yield
        finally:
            with contextlib.suppress(RuntimeError):  # stopped meanwhile: they went then
                self._hop(lambda app: app.release(model))

    def pause(self) -> None:
        """Stop listening and drop open connections: the provider looks down."""
        self._hop(lambda app: app.pause())

    def resume(self) -> None:
        """Listen again, on the same port."""
        self._hop(lambda app: app.resume())

    def _run(self, started: concurrent.futures.Future[int]) -> None:
        try:
            with asyncio.Runner() as runner:
                runner.run(self._main(started))
        finally:
            if not started.done():
                started.set_exception(RuntimeError("the provider thread ended before listening"))

    async def _main(self, started: concurrent.futures.Future[int]) -> None:
        app = ProviderApp(
            self._core, host=self._host, port=self._requested_port, api_key=self._api_key
        )
        stop = asyncio.Event()
        try:
            try:
                port = await app.start()
            except OSError as exc:
                started.set_exception(exc)
                return
            self._loop, self._app, self._stop = asyncio.get_running_loop(), app, stop
            started.set_result(port)
            await stop.wait()
        finally:
            await app.close()

    def _call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the server loop if it is running, else here."""

        async def run() -> _T:
            return fn()

        with self._lock:
            if self._loop is None:
                return fn()
            return _submit(self._loop, run())

    def _hop(self, fn: Callable[[ProviderApp], Coroutine[Any, Any, None]]) -> None:
        with self._lock:
            if self._loop is None or self._app is None:
                raise RuntimeError("the simulated provider is not running")
            _submit(self._loop, fn(self._app))


def _submit(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, _T]) -> _T:
    try:
        future = asyncio.run_coroutine_threadsafe(coro, loop)
    except RuntimeError:
        coro.close()
        raise
    return future.result(_HOP_TIMEOUT_S)


async def serve(
    *,
    default: ModelBehaviour = _DEFAULT,
    models: Mapping[str, ModelBehaviour] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    seed: int = 0,
    api_key: str | None = None,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve on the running loop until ``stop`` is set (or this task is cancelled)."""
    core = ProviderCore(default=default, models=models, seed=seed)
    app = ProviderApp(core, host=host, port=port, api_key=api_key)
    try:
        bound = await app.start()
        if on_ready is not None:
            on_ready(_base_url(app.host, bound))
        await (stop if stop is not None else asyncio.Event()).wait()
    finally:
        await app.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="callboard mock",
        description="Run the simulated provider (OpenAI's and Anthropic's wires) on loopback.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="exit status: 0 stopped by SIGINT/SIGTERM (or stdin's end), "
        "1 cannot listen, 2 usage error",
    )
    add = parser.add_argument
    add("--host", type=host_arg, default="127.0.0.1", help="loopback address to listen on")
    add("--port", type=port_arg, default=8000, help="port (0 = any free port)")
    add("--latency", type=float, default=0.05, help="mean service time, seconds")
    add("--jitter", type=float, default=0.0, help="uniform +/- jitter on latency, seconds")
    add("--rpm", type=int, default=None, help="requests per minute per model")
    add("--tpm", type=int, default=None, help="tokens per minute per model")
    add("--completion-tokens", type=int, default=None, help="fixed completion size")
    add("--ttft", type=float, default=None, help="a stream's time to first token; None: latency")
    add("--token-gap", type=float, default=0.0, help="a stream's pause between tokens, seconds")
    add("--cut-after", type=int, default=3, help="events a cut stream sends before it is cut")
    add("--cut-mode", choices=CUT_MODES, default="close", help="how a cut stream ends")
    add("--dimensions", type=int, default=1536, help="embedding length when none is asked")
    for rate in FAULT_RATES:  # --error-rate ... --malformed-rate
        kind = rate.removesuffix("_rate")
        add(f"--{kind}-rate", type=float, default=0.0, help=f"fraction of {kind} faults")
    add("--seed", type=int, default=0, help="seed of the fault and size draws")
    add("--models", default=None, help='per-model JSON: {"name": {"rpm": 60, ...}}')
    add("--api-key", type=_key_arg, default=None, help="require this bearer key")
    add(
        "--exit-on-stdin-eof",
        action="store_true",
        help="stop when stdin closes (the bench's watch on its own death)",
    )
    return parser


def _key_arg(text: str) -> str:
    """``--api-key``'s argparse type: a key a client can send. An empty one made a
    provider that refused every SDK (none sends an empty key), and a key with white
    space or a control character cannot be sent in a header as it was given."""
    if not text:
        raise argparse.ArgumentTypeError("an empty key: leave --api-key out to require none")
    if text != text.strip() or not text.isprintable() or " " in text or not text.isascii():
        raise argparse.ArgumentTypeError(
            "a key with white space, control or non-ASCII characters cannot go in a header as given"
        )
    return text


def _behaviours(args: argparse.Namespace) -> tuple[ModelBehaviour, dict[str, ModelBehaviour]]:
    default = ModelBehaviour(
        latency_s=args.latency,
        jitter_s=args.jitter,
        rpm=args.rpm,
        tpm=args.tpm,
        completion_tokens=args.completion_tokens,
        ttft_s=args.ttft,
        token_gap_s=args.token_gap,
        cut_after=args.cut_after,
        cut_mode=args.cut_mode,
        dimensions=args.dimensions,
        **{rate: getattr(args, rate) for rate in FAULT_RATES},
    )
    try:
        spec = {} if args.models is None else json.loads(args.models)
    except ValueError as exc:  # it said only "Expecting value: line 1 column 1" (a hunt)
        raise ValueError(
            f'--models is not JSON ({exc}): give {{"model": {{field: value}}}}'
        ) from None
    if not isinstance(spec, dict):
        raise TypeError('--models must be a JSON object: {"model": {field: value}}')
    if len(spec) > MAX_MODELS:
        raise ValueError(f"--models names {len(spec)} models; the provider holds {MAX_MODELS}")
    return default, {name: behaviour_from_json(b, default) for name, b in spec.items()}


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve_until_signal(*, watch_stdin: bool, **kwargs: Any) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if watch_stdin:
        # The bench starts its provider with a pipe on stdin that it never writes:
        # however the bench ends (SIGKILL included), the OS closes the pipe and the
        # provider stops instead of lingering, listening, as an orphan. Portable,
        # unlike a parent-death signal.
        args = (sys.stdin.fileno(), loop, stop)
        threading.Thread(target=_read_to_eof, args=args, name="stdin-eof", daemon=True).start()
    try:
        await serve(stop=stop, on_ready=_announce, **kwargs)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _read_to_eof(fd: int, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass
    with contextlib.suppress(RuntimeError):  # the loop closed first: nothing to stop
        loop.call_soon_threadsafe(_stdin_closed, stop)


def _stdin_closed(stop: asyncio.Event) -> None:
    if not stop.is_set():
        sys.stderr.write("callboard mock: stdin closed (its parent is gone); stopping\n")
        stop.set()


def _announce(url: str) -> None:
    print(f"callboard mock listening on {url}", flush=True)


def run_mock(argv: Sequence[str] | None = None) -> int:
    """``callboard mock``: serve until SIGINT/SIGTERM; 0 then, 1 if it cannot listen."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        host = check_loopback(args.host)
        default, models = _behaviours(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    options = {"default": default, "models": models, "host": host, "port": args.port}
    options |= {"seed": args.seed, "api_key": args.api_key, "watch_stdin": args.exit_on_stdin_eof}
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve_until_signal(**options))
    except OSError as exc:
        sys.stderr.write(f"callboard mock: cannot listen on {host}:{args.port}: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_mock())
