"""The simulated provider as a child process, for the bench.

The bench's client figures (wall time, ``time.process_time``) must not include
the server's work, so the provider runs in its own interpreter:
``python -m callboard.provider.server --port 0 ...`` on 127.0.0.1, announcing
its URL on stdout. ``ProviderProcess`` starts it, reconfigures models at run
time (``POST /admin/models/{name}``), reads and resets ``/stats``.

What must hold: the child is always stopped (SIGINT, then SIGKILL after a
grace period) and its pipes, log file and HTTP client are closed, whether
the bench finishes, fails or is interrupted; should the bench die without
running its finally blocks (SIGKILL), the child still stops: its stdin is a
pipe from the bench, and it exits at that pipe's EOF; reading the announcement uses
no thread (a selector with a deadline), so nothing is left running.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Self

import httpx

__all__ = ["ProviderProcess", "stop_child"]

_ANNOUNCE = "callboard mock listening on "
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0
_HTTP_TIMEOUT_S = 30.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ProviderProcess:
    """One provider child process; use as a context manager (it always stops)."""

    def __init__(
        self,
        *,
        latency_s: float = 0.05,
        jitter_s: float = 0.0,
        models: Mapping[str, Mapping[str, Any]] | None = None,
        seed: int = 0,
        extra_args: Sequence[str] = (),
        server: str = "sim",
    ) -> None:
        """``server``: ``sim`` (the simulated provider) or ``asgi`` (a bare ASGI app on
        uvicorn, see ``asgi_provider``: steady load only)."""
        asgi = server == "asgi"
        if asgi and (models or jitter_s):
            raise ValueError("the ASGI provider has one fixed latency and no models table")
        module = "callboard.bench.asgi_provider" if asgi else "callboard.provider.server"
        self._argv = [sys.executable, "-m", module, "--port", "0", "--latency", repr(latency_s)]
        if not asgi:
            self._argv += ["--host", "127.0.0.1", "--jitter", repr(jitter_s), "--seed", str(seed)]
        # if this process dies outright, the child follows
        self._argv += ["--exit-on-stdin-eof", *extra_args]
        if models:
            self._argv += ["--models", json.dumps({k: dict(v) for k, v in models.items()})]
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None
        self._http: httpx.Client | None = None
        self.base_url = ""
        self.pid = 0

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> str:
        """Start the child and wait for its announcement; return the base URL (``.../v1``)."""
        if self._proc is not None:
            raise RuntimeError("the provider process is already running")
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        try:
            self._proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
                self._argv,
                stdin=subprocess.PIPE,  # never written; its EOF tells the child we are gone
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
            )
            self.pid = self._proc.pid
            self.base_url = self._base_url(self._announcement(_START_TIMEOUT_S))
            root = self.base_url.removesuffix("/v1")
            self._http = httpx.Client(base_url=root, timeout=_HTTP_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def _announcement(self, timeout: float) -> str:
        assert self._proc is not None
        assert self._proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if sel.select(left):
                    return self._proc.stdout.readline()
        return ""

    def _base_url(self, line: str) -> str:
        if not line.startswith(_ANNOUNCE):
            raise RuntimeError(f"provider did not start: {line!r}; {self._stderr()}")
        return line.removeprefix(_ANNOUNCE).strip()

    def _stderr(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()[-2000:].decode("utf-8", "replace")

    def stop(self) -> None:
        """Stop the child (SIGINT, then SIGKILL) and close everything; idempotent."""
        proc, self._proc = self._proc, None
        if self._http is not None:
            self._http.close()
            self._http = None
        if proc is not None:
            stop_child(proc)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- control ------------------------------------------------------------

    def configure(self, model: str, **behaviour: Any) -> None:
        """Apply ``ModelBehaviour`` fields to ``model`` from now on."""
        self._client().post(f"/admin/models/{model}", json=behaviour).raise_for_status()

    def stats(self) -> dict[str, Any]:
        """``GET /stats``: totals and per-model counters."""
        response = self._client().get("/stats")
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def reset_stats(self) -> None:
        self._client().post("/stats/reset").raise_for_status()

    def cpu_s(self) -> float | None:
        """The child's CPU seconds so far (user + system, from ``/proc``; None where
        there is no ``/proc``): whether the server, not the client, bound a run."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def _client(self) -> httpx.Client:
        if self._http is None:
            raise RuntimeError("the provider process is not running")
        return self._http


def stop_child(
    proc: subprocess.Popen[str], sig: int = signal.SIGINT, timeout: float = _STOP_TIMEOUT_S
) -> None:
    """Stop a child process (``sig``, then SIGKILL after ``timeout``) and close its
    pipes."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
