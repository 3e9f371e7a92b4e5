"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

from typing import Any

from callboard import ModelSettings

WAIT_S = 30.0
"""Upper bound for any wait on a future or event in these tests (never a sleep)."""


def two_models(base_url: str, **overrides: Any) -> tuple[ModelSettings, ModelSettings]:
    fields: dict[str, Any] = {"max_concurrency": 16, **overrides}
    return (
        ModelSettings(name="alpha", base_url=base_url, **fields),
        ModelSettings(name="beta", base_url=base_url, **fields),
    )


class ProviderProcess:
    """The simulated provider in its own process (its own GIL), as the bench runs it."""

    def __init__(self, *args: str) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
            [sys.executable, "-m", "callboard.bench.provider", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = _readline(self.proc.stdout, WAIT_S)
        prefix = "callboard mock listening on "
        if not line.startswith(prefix):
            self.stop()
            raise RuntimeError(f"provider did not start: {line!r}")
        self.base_url = line[len(prefix) :].strip()

    def configure(self, model: str, **behaviour: Any) -> None:
        import httpx

        root = self.base_url.removesuffix("/v1")
        httpx.post(
            f"{root}/admin/models/{model}", json=behaviour, timeout=WAIT_S
        ).raise_for_status()

    def stats(self) -> dict[str, Any]:
        import httpx

        root = self.base_url.removesuffix("/v1")
        answer: dict[str, Any] = httpx.get(f"{root}/stats", timeout=WAIT_S).json()
        return answer

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(WAIT_S)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _readline(stream: Any, timeout: float) -> str:
    import threading

    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""
