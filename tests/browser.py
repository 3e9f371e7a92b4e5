"""A real headless Chromium, driven over the DevTools protocol (CDP) on a websocket of
aiohttp's client: no Python dependency beyond what callboard has.

``Chromium.start()`` launches ``chromium --headless`` on a free debugging port (it
writes the port to ``DevToolsActivePort`` in its profile) and attaches to its page;
calls are made from the test's thread and run on an event loop of the browser's own,
in a thread (as the gateway's fixtures do). ``evaluate`` runs an expression in the
page and returns its value; ``wait_for`` asks an expression again until it is true
(a page's figures change when its own timer polls: no event reaches the test, so it
reads them, as ``support.wait_until`` does). The page's console errors, uncaught
exceptions and every request it makes are kept for the test to look at.

``find_chromium()`` is None where no browser is installed (``.ci/run`` installs
Debian's ``chromium``); tests then skip, naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from support import WAIT_S, wait_until

T = TypeVar("T")

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class BrowserError(Exception):
    """The browser could not start, or a command it was sent failed."""


def find_chromium() -> str | None:
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class Chromium:
    """One headless browser with one page (see the module docstring)."""

    def __init__(self, executable: str, *, width: int = 1400, height: int = 1000) -> None:
        self._executable = executable
        self._size = (width, height)
        self._profile = tempfile.TemporaryDirectory(prefix="callboard-chromium-")
        self._process: subprocess.Popen[bytes] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cdp", daemon=True)
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self.console_errors: list[str] = []
        """Console errors, uncaught exceptions and refusals (CSP) the page reported."""
        self.requests: list[str] = []
        """Every URL the page requested, in order."""

    # -- life -----------------------------------------------------------------------------

    def start(self) -> Chromium:
        width, height = self._size
        args = [
            self._executable,
            "--headless=new",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--remote-debugging-port=0",
            f"--user-data-dir={self._profile.name}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to sandbox as root
        self._process = subprocess.Popen(  # noqa: S603 - a fixed argument list
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its helpers too are in the group ``stop`` ends
        )
        self._thread.start()
        try:
            self._run(self._attach(self._port()))
            self.command("Page.enable")
            self.command("Runtime.enable")
            self.command("Log.enable")
            self.command("Network.enable")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._run(self._close(), timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()
        if self._process is not None:
            self._end_group(self._process)
        self._profile.cleanup()

    @staticmethod
    def _end_group(process: subprocess.Popen[bytes]) -> None:
        """End Chromium and every helper it started (renderer, zygote, crash handler):
        they outlive the main process, and one still writing into the profile while
        it is removed failed a CI run's teardown (``Directory not empty: 'Default'``)."""
        group = process.pid  # its own session: the group's id is its pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # helpers that did not follow it
        gone = wait_until(lambda: not _group_alive(group), WAIT_S)
        assert gone, f"chromium's helpers (process group {group}) did not end"

    def __enter__(self) -> Chromium:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what a test does -----------------------------------------------------------------

    def command(self, method: str, **params: Any) -> Any:
        """Send one CDP command to the page; its result."""
        return self._run(self._command(method, params))

    def navigate(self, url: str) -> None:
        """Open ``url`` and wait until it has loaded."""
        self.command("Page.navigate", url=url)
        if not self.wait_for(
            "document.readyState === 'complete' && location.href !== 'about:blank'"
        ):
            raise BrowserError(f"{url} did not load within {WAIT_S} s")

    def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (awaited if it is a promise)."""
        answer = self.command(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in answer:
            raise BrowserError(f"{expression!r} raised: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def wait_for(self, expression: str, timeout: float = WAIT_S) -> bool:
        """Evaluate ``expression`` every 100 ms until it is truthy; False after ``timeout``."""
        return bool(self._run(self._wait_for(expression, timeout), timeout=timeout + 5))

    def screenshot(self) -> bytes:
        import base64

        return base64.b64decode(self.command("Page.captureScreenshot", format="png")["data"])

    # -- the protocol ---------------------------------------------------------------------

    def _port(self) -> int:
        marker = Path(self._profile.name) / "DevToolsActivePort"
        deadline = self._loop.time() + WAIT_S
        while self._loop.time() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise BrowserError(f"chromium exited at start (status {self._process.returncode})")
            with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                return int(marker.read_text().splitlines()[0])
            threading.Event().wait(0.05)
        raise BrowserError(f"chromium did not open its debugging port within {WAIT_S} s")

    async def _attach(self, port: int) -> None:
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        pages = [t for t in targets if t.get("type") == "page"]
        if not pages:
            raise BrowserError("chromium has no page to attach to")
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.ensure_future(self._read())

    async def _close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _command(self, method: str, params: dict[str, Any]) -> Any:
        if self._ws is None:
            raise BrowserError("not attached to a page")
        call_id = next(self._ids)
        answer: asyncio.Future[Any] = self._loop.create_future()
        self._pending[call_id] = answer
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        return await asyncio.wait_for(answer, WAIT_S)

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            if message.type is not aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            if "id" in data:
                answer = self._pending.pop(data["id"], None)
                if answer is None or answer.done():
                    continue
                if "error" in data:
                    answer.set_exception(BrowserError(f"CDP: {data['error']}"))
                else:
                    answer.set_result(data.get("result", {}))
            else:
                self._event(data.get("method", ""), data.get("params", {}))
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(BrowserError("the browser closed its connection"))

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.exceptionThrown":
            self.console_errors.append(json.dumps(params["exceptionDetails"])[:500])
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.console_errors.append(json.dumps(params.get("args"))[:500])
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            self.console_errors.append(f"{entry.get('source')}: {entry.get('text')}"[:500])

    async def _wait_for(self, expression: str, timeout: float) -> bool:
        deadline = self._loop.time() + timeout
        while True:
            answer = await self._command(
                "Runtime.evaluate", {"expression": expression, "returnByValue": True}
            )
            if answer.get("result", {}).get("value"):
                return True
            if self._loop.time() > deadline:
                return False
            await asyncio.sleep(0.1)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = WAIT_S + 5) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


def _group_alive(group: int) -> bool:
    """Whether a process of ``group`` still runs (an ended one its new parent has not
    reaped yet, a zombie, writes nothing: it does not count)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: any process of the group, reaped or not
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text("ascii").rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # it ended while we looked
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == group and state != "Z":
            return True
    return False
