"""Running the gateway: ``Gateway`` (start, graceful stop), ``serve`` and ``main``.

``Gateway`` owns one I/O loop (``runtime.io_loop``), one ``AsyncSystem`` that makes
its calls on that loop (``io_loop``), one aiohttp server on the same loop and, when
``[gateway] spend_file`` names one, the spend file (``spend``), opened and written
there too. One loop for the server and the calls saves a hand-off between threads
each way for every request (docs/architecture.md, "Threads and the I/O loop");
``Gateway``'s own methods run on the caller's loop and hand the server's work to the
I/O loop. ``start()`` opens the spend file (a damaged one is refused before anything
else starts), builds the system, then listens; ``stop()`` shuts down in the order
an operator behind a load balancer expects:

1. ``/readyz`` answers 503 (for ``unready_s``, so the balancer notices);
2. the listener closes (no new connection), idle keep-alive connections close;
3. requests in flight get up to ``grace_s`` to finish (their tasks keep running);
4. what is still unanswered then gets its answer (``Front.last_word``): a request
   waiting for its quotas, or whose task was still queued or running, a 503 with
   ``Retry-After``; a stream, the API's error event and its end. The system stops,
   cancelling what it still holds. A handler that has not written its answer
   ``LAST_WORD_S`` later is cancelled, and its client's connection closed;
5. the spend file closes, once the last settlements are written; the I/O loop
   stops last.

``hurry()`` (a second SIGTERM or SIGINT) cuts what is left of steps 1 and 3
short: what is unanswered gets its answer at once.

``serve(config, host, port)`` runs a gateway until SIGTERM or SIGINT (on uvloop
when installed, with the collector tuned for a server: ``runtime.collector``);
``main(argv)`` is ``callboard serve``'s command line.

What must hold: an open gateway (no keys) never listens beyond loopback
(``UnsafeBindError`` before anything starts); a start that fails leaves
nothing running; ``stop`` is idempotent.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from callboard.gateway.app import Front
from callboard.gateway.connections import CappedSite, raise_open_file_limit
from callboard.gateway.settings import GatewayConfig, check_bind, load_config
from callboard.gateway.spend import SpendFile, SpendNotRecordedError
from callboard.messages import ClusterUnreachableError, UsageError
from callboard.provider.app import host_arg, port_arg
from callboard.runtime.accepting import stop_accepting
from callboard.runtime.collector import steady_heap
from callboard.runtime.flag import Flag
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.io_loop import IoLoop
from callboard.runtime.server_log import quiet_answers, server_log

from callboard import AsyncSystem, SystemConfig, logs
from callboard._signals import hang_ups, heeded
from callboard.config import RUN_SWITCH_INTERVAL_S

__all__ = ["ANNOUNCEMENT", "Gateway", "main", "serve", "served"]

log = guarded_logger(__name__)
T = TypeVar("T")

LAST_WORD_S = 1.0
"""How long the answers of the last word (step 4) may take to be written after the
grace, at most (and never more than a quarter of ``grace_s``, out of it)."""

STOP_WRITE_TRIES = 3
STOP_WRITE_PAUSE_S = 1.0
"""At a stop, the spend not yet written is tried ``STOP_WRITE_TRIES`` times,
``STOP_WRITE_PAUSE_S`` apart, each waiting up to the spend file's ``BUSY_TIMEOUT_S``
for another gateway's transaction: about 17 s at most, against a file held or a disk
full."""

ANNOUNCEMENT = "callboard serve listening on "
"""The line ``serve`` prints once it listens, followed by its base URL."""


class CannotListenError(OSError):
    """The gateway's address cannot be listened on (taken, not this host's, a port
    this user may not bind): what ``callboard serve`` says so of, and of nothing else
    (a missing CA file read as a port it could not listen on; a hunt)."""


class Gateway:
    """One gateway: callboard's system behind OpenAI's API on ``host:port``.

    ``async with Gateway(config, port=0) as gw: gw.url`` (``port=0``: any free port).
    ``system_options`` go to the ``System`` (``provider``, ``ledger``...).
    """

    def __init__(
        self,
        config: GatewayConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        **system_options: Any,
    ) -> None:
        self.config = config or GatewayConfig()
        check_bind(self.config.gateway, host)
        self.host = host
        self.port = port
        self.url = ""
        """``http://host:port`` once started."""
        self._system_options = system_options
        self.cb: AsyncSystem | None = None
        self._io: IoLoop | None = None
        """The system's I/O loop, where the server runs (see the module docstring)."""
        self._front: Front | None = None
        self._runner: web.AppRunner | None = None
        self._spend: SpendFile | None = None
        self._stopping = False
        self.spend_not_recorded: SpendNotRecordedError | None = None
        """Set at the stop if settled spend could not be written to the spend file."""
        self._hurried = Flag()
        """Set by ``hurry``, on whichever loop; waited for on both."""

    async def start(self) -> str:
        """Build the system, then listen; returns the base URL (``http://host:port``)."""
        if self._io is not None:
            raise RuntimeError("a Gateway starts once: make another")
        settings = self.config.gateway
        self._io = io = IoLoop()
        try:
            io.start()
            if settings.spend_file is not None:  # refused (SpendFileError) before the rest
                self._spend = await self._on_io(_opened(settings.spend_file))
            options = {**self._system_options, "io_loop": io}
            self.cb = cb = AsyncSystem(self.config.system, **options)
            await cb.start()
            # made here: its metrics read the system's stats, an actor's answer awaited
            # in a blocking call, which on the I/O loop would hold every call meanwhile
            self._front = front = Front(cb, settings, spend=self._spend)
            runner = await self._on_io(self._listen(front))
        except BaseException:
            await self.stop()
            raise
        host, port = runner.addresses[0][:2]
        self.url = f"http://{_url_host(host)}:{port}"
        front.ready = True
        most = front.connections.capacity
        log.info(
            "gateway listening on %s (%s; %s)",
            self.url,
            "open, loopback only" if settings.open else f"{len(settings.keys)} keys",
            "no bound on connections" if most is None else f"at most {most} connections",
        )
        return self.url

    async def _on_io(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro`` run on the system's I/O loop, awaited here (cancelled with this)."""
        assert self._io is not None  # started
        return await asyncio.wrap_future(self._io.spawn(coro))

    async def _listen(self, front: Front) -> web.AppRunner:
        """On the I/O loop: the server and its listener."""
        settings = self.config.gateway
        self._runner = runner = web.AppRunner(
            front.app(),
            handler_cancellation=True,  # a client that leaves cancels its handler
            auto_decompress=False,  # inflated by the handler, bounded (app.inflated)
            keepalive_timeout=settings.idle_s,  # also a head's deadline: see idle_s
            access_log=None,
            logger=server_log(),
            # aiohttp waits this long for a handler, then as long again once it
            # has cut the request's body, then cancels it: half the grace, twice,
            # the last word's time (``stop``) included
            shutdown_timeout=settings.grace_s / 2,
        )
        await runner.setup()
        quiet_answers(runner)  # a client's bad bytes are not answered back
        site = CappedSite(runner, self.host, self.port, front.connections)
        try:
            await site.start()
        except OSError as exc:
            raise CannotListenError(exc.errno, f"{self.host}:{self.port}: {exc}") from exc
        return runner

    def hurry(self) -> None:
        """Cut a stop short (a second signal): no more waiting for ``/readyz`` to be
        noticed or for calls in flight; what is unanswered is answered now."""
        self._hurried.set()

    async def _waited(
        self, seconds: float | None, until: asyncio.Future[Any] | None = None
    ) -> bool:
        """Wait ``seconds`` (None: no limit), or less if ``until`` ends or the stop is
        hurried; whether ``until`` ended."""
        hurried = asyncio.ensure_future(self._hurried.wait())
        try:
            waits = {hurried} if until is None else {hurried, until}
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurried.cancel()
        return until is not None and until.done()

    async def stop(self) -> None:
        """Shut down gracefully (see the module docstring); idempotent."""
        if self._stopping:
            return
        self._stopping = True
        settings = self.config.gateway
        if self._front is not None:
            served, self._front.ready = self._front.ready, False
            if served and settings.unready_s:  # a start that failed was never ready
                await self._waited(settings.unready_s)
        try:
            if self._runner is not None:
                await self._on_io(self._drain(self._runner))
        finally:
            try:
                if self.cb is not None:
                    await self.cb.stop(cancel=True, timeout=0)
            finally:
                try:
                    if self._spend is not None:
                        await self._on_io(self._close_spend(self._spend))
                finally:
                    if self._front is not None:
                        self._front.close()
                    if self._io is not None:  # after the system: it closes its clients there
                        await asyncio.to_thread(self._io.stop)

    async def _close_spend(self, spend: SpendFile) -> None:
        """On the I/O loop, once the system has stopped: the last settlements written
        (the stop's own among them: the calls it cut are charged), then the file closed.
        The stop's sweep hands its answers to the loop, then closes the model clients on
        it and waits for that: the settlements those answers make, a few turns each,
        run meanwhile, before this."""
        spend.wait_longer()  # nothing waits on the loop any more
        if self._front is not None:
            unrecorded = self._front.quotas.flush()
            for _ in range(STOP_WRITE_TRIES - 1):  # each waits BUSY_TIMEOUT_S for a lock
                if not unrecorded:
                    break
                await asyncio.sleep(STOP_WRITE_PAUSE_S)
                unrecorded = self._front.quotas.flush()
            if unrecorded:  # logged and kept for ``serve``, which exits 1 naming them:
                # dropped at the close, with exit 0, the next start gave it back (a hunt)
                self.spend_not_recorded = SpendNotRecordedError(spend.path, unrecorded)
                log.error("%s", self.spend_not_recorded)
        spend.close()

    async def _drain(self, runner: web.AppRunner) -> None:
        """Close the listener, give the requests in flight up to ``grace_s``, answer the
        rest (``Front.last_word``), and wait for aiohttp's cleanup; hurried, cut the
        connections it would still wait for (its shutdown timeout, half the grace, for
        a handler still reading a body, say: found by a review)."""
        settings = self.config.gateway
        await stop_accepting(runner.sites)  # so cleanup() sees them all
        server = runner.server
        cleanup = asyncio.ensure_future(runner.cleanup())  # it waits, then cancels the rest
        last_word_s = min(LAST_WORD_S, settings.grace_s / 4)
        try:
            grace = settings.grace_s - last_word_s
            if not await self._waited(grace, cleanup) and self._front is not None:
                await self._front.last_word()
            # aiohttp still waits for what it has (hurried meanwhile, not that long)
            if not await self._waited(None, cleanup) and server is not None:
                await asyncio.wait({cleanup}, timeout=last_word_s)
                for connection in list(server.connections):
                    connection.force_close()
        finally:
            await cleanup

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def _opened(path: Path) -> SpendFile:
    """The spend file, opened on the loop that uses it (SQLite's ``check_same_thread``)."""
    return SpendFile(path)


def serve(
    config: GatewayConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 8080,
    *,
    on_ready: Callable[[str], object] | None = None,
) -> None:
    """Run a gateway until SIGTERM or SIGINT, then stop it gracefully (blocks);
    ``SpendNotRecordedError`` if the spend file could not take the spend settled before
    the stop."""
    gateway = Gateway(served(config), host=host, port=port)  # refuses an unsafe bind first
    raise_open_file_limit()  # this process is the gateway's: its connections, as Go does
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_until_signal(gateway, on_ready))
    if gateway.spend_not_recorded is not None:
        raise gateway.spend_not_recorded


def served(config: GatewayConfig | None) -> GatewayConfig:
    """``config`` as ``serve`` runs it: the process is the gateway's own, so, as
    ``callboard run`` does, with shorter GIL hand-offs (``RUN_SWITCH_INTERVAL_S``) unless
    the config sets its own. Every request crosses three threads and back (the I/O
    loop, the queue, the model); with the server on a loop of its own (four), at 50 in
    flight, against the interpreter's 5 ms: 780-800 requests a second against 745,
    p50 60.4-61.1 ms against 63.5-64.3 (the provider's 50), p99 80-96 against 101-117."""
    config = config or GatewayConfig()
    system = config.system or SystemConfig()
    if system.switch_interval_s is not None:
        return config
    system = dataclasses.replace(system, switch_interval_s=RUN_SWITCH_INTERVAL_S)
    return dataclasses.replace(config, system=system)


def _stop_signals() -> tuple[signal.Signals, ...]:
    """What drains the gateway and stops it: SIGINT, SIGTERM, and SIGHUP unless it is
    ignored (``nohup``) or there is none (Windows); none that the process ignores
    (``heeded``). SIGHUP is the reload signal of nginx
    and gunicorn (``systemctl reload``, ``kill -HUP``) and a closed terminal's, and left
    to its default it ended the process at once, no drain, the calls in flight cut off
    and the spend not yet written lost (found by a hunt). A reload is a restart here: a
    service manager that restarts the gateway brings it back with the configuration
    read again."""
    return (*heeded(signal.SIGINT, signal.SIGTERM), *hang_ups())


async def _until_signal(gateway: Gateway, on_ready: Callable[[str], object] | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled(sig: signal.Signals) -> None:
        if stop.is_set():  # again, while stopping: an operator who will not wait
            log.info("stopping now: the requests still unanswered are answered 503")
            gateway.hurry()
        elif sig not in (signal.SIGINT, signal.SIGTERM):  # a hang-up
            log.warning(
                "SIGHUP: callboard serve does not reload its configuration; it drains and "
                "stops, and a restart reads the configuration again"
            )
        stop.set()

    stops = _stop_signals()
    for sig in stops:
        loop.add_signal_handler(sig, signalled, sig)
    try:
        async with gateway:
            with steady_heap():
                if on_ready is not None:
                    on_ready(gateway.url)
                await stop.wait()
            log.info(
                "stopping: waiting up to %s s for calls in flight", gateway.config.gateway.grace_s
            )
    finally:
        for sig in stops:
            loop.remove_signal_handler(sig)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _announce(url: str) -> None:
    sys.stdout.write(f"{ANNOUNCEMENT}{url}\n")  # the command's one line of output
    sys.stdout.flush()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="callboard serve",
        description="Serve callboard behind OpenAI's API (chat completions, streams, "
        "embeddings, models) and Anthropic's (messages), with priorities and budgets "
        "per client key.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="callboard.toml: its [gateway] table and the models (default: the simulated "
        "provider, open on loopback)",
    )
    parser.add_argument(
        "--host",
        type=host_arg,
        default="127.0.0.1",
        help="address to listen on (default: %(default)s)",
    )
    parser.add_argument(
        "--port", type=port_arg, default=8080, help="port (default: %(default)s; 0: any)"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="-v info, -vv debug logging"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``callboard serve``: 0 after a clean stop, 1 if it cannot listen or the spend
    file could not take the spend settled before the stop, 2 for a bad config or
    argument."""
    args = _parser().parse_args(argv)
    logs.configure(args.verbose)  # warnings with their time, level and task by default
    # (a bare message was all a log pipeline got of an opened breaker; found by a hunt)
    try:
        config = load_config(args.config) if args.config is not None else GatewayConfig()
        serve(config, args.host, args.port, on_ready=_announce)
    except (UsageError, ClusterUnreachableError) as exc:  # a ConfigError, an
        sys.stderr.write(f"callboard serve: error: {exc}\n")  # UnsafeBindError among them
        return 2
    except SpendNotRecordedError as exc:  # logged too, at the stop
        sys.stderr.write(f"callboard serve: error: {exc}\n")
        return 1
    except CannotListenError as exc:
        sys.stderr.write(f"callboard serve: cannot listen on {exc.strerror}\n")
        return 1
    except OSError as exc:  # a file it could not read or write
        sys.stderr.write(f"callboard serve: error: {exc}\n")
        return 1
    return 0
