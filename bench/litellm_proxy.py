"""LiteLLM's proxy beside ``callboard serve``, for the ``gateway`` scenario.

The issue asks for the peer side by side when it is installed. LiteLLM is not a
dependency of callboard (its proxy pulls in a web framework, a database client and
more), so it is looked for as a program: ``CALLBOARD_BENCH_LITELLM`` (the path of a
``litellm`` executable, e.g. from a virtual environment of its own), else the
``litellm`` beside this interpreter, else one on ``PATH``. ``program()`` says which,
or None: then the scenario runs without it and says so.

Run as the bench's child: ``python -m callboard.bench.litellm_proxy --upstream URL
--model NAME``. It writes LiteLLM's configuration (one model, ``openai/NAME`` at
``URL``, one worker: one process, as ``callboard serve`` and the bare proxy are),
starts ``litellm`` on a free loopback port in a process group of its own, waits until
its liveness endpoint answers, announces ``litellm proxy listening on URL`` on stdout,
and stops the group (SIGTERM, then SIGKILL) when its stdin closes (the bench may die
without stopping it), or on SIGTERM or SIGINT.

What must hold: LiteLLM listens on loopback only; it never outlives this process's
stdin; a LiteLLM that does not come up within ``START_TIMEOUT_S`` (or exits) is an
error naming what it printed last, not a hang.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ANNOUNCEMENT", "ENV", "main", "program", "version"]

ANNOUNCEMENT = "litellm proxy listening on "
ENV = "CALLBOARD_BENCH_LITELLM"
"""The path of the ``litellm`` program to run, when it is not beside this interpreter."""
START_TIMEOUT_S = 120.0
"""LiteLLM's proxy imports a great deal before it listens (some 10-30 s here)."""
_STOP_TIMEOUT_S = 10.0


def program() -> str | None:
    """The ``litellm`` program to run, or None when there is none."""
    named = os.environ.get(ENV)
    if named:
        return named if Path(named).is_file() else None
    beside = Path(sys.executable).parent / "litellm"
    if beside.is_file():
        return str(beside)
    return shutil.which("litellm")


def version(exe: str) -> str | None:
    """LiteLLM's version, read from the interpreter ``exe`` runs on (its shebang)."""
    try:
        first = Path(exe).read_text(encoding="utf-8", errors="replace").split("\n", 1)[0]
    except OSError:
        return None
    python = first.removeprefix("#!").strip()
    if not python or not Path(python).is_file():
        return None
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    try:
        done = subprocess.run(  # noqa: S603 - the program's own interpreter, fixed code
            [python, "-c", code], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def config(upstream: str, model: str) -> dict[str, object]:
    """LiteLLM's configuration (YAML; JSON is YAML): ``model`` as an OpenAI-compatible
    deployment at ``upstream``, nothing else (no keys, no database, no callbacks)."""
    return {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    "model": f"openai/{model}",
                    "api_base": upstream,
                    "api_key": "sk-bench-not-a-key",
                },
            }
        ],
        "litellm_settings": {"drop_params": True, "telemetry": False},
        # open on loopback, as the bench runs ``callboard serve`` (LiteLLM refuses to start
        # without a master key unless told this)
        "general_settings": {"dangerously_permit_weak_or_unset_master_key": True},
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as answer:  # noqa: S310 - loopback
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop LiteLLM's process group: SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            continue
        return


def _tail(log: Path) -> str:
    try:
        return log.read_text(encoding="utf-8", errors="replace")[-2000:]
    except OSError:
        return ""


def serve(exe: str, upstream: str, model: str) -> int:
    """Run LiteLLM's proxy in front of ``upstream`` until stdin closes or a signal."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def watch() -> None:
        sys.stdin.read()  # returns at EOF: the bench is gone or stopping us
        stop.set()

    threading.Thread(target=watch, name="stdin-eof", daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="callboard-bench-litellm-") as tmp:
        cfg, log = Path(tmp) / "config.yaml", Path(tmp) / "litellm.log"
        cfg.write_text(json.dumps(config(upstream, model)), encoding="utf-8")
        port = _free_port()
        env = os.environ | {"LITELLM_LOG": "ERROR", "LITELLM_MODE": "PRODUCTION"}
        argv = [exe, "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
        with log.open("wb") as out:
            proc = subprocess.Popen(  # noqa: S603 - the program the operator named
                [*argv, "--num_workers", "1"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _alive(f"http://127.0.0.1:{port}/health/liveliness"):
                if stop.is_set():
                    return 0
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.stderr.write(f"LiteLLM's proxy did not come up: {_tail(log)}\n")
                    return 1
                stop.wait(0.25)
            sys.stdout.write(f"{ANNOUNCEMENT}http://127.0.0.1:{port}/v1\n")
            sys.stdout.flush()
            while not stop.wait(1.0):
                if proc.poll() is not None:
                    sys.stderr.write(f"LiteLLM's proxy exited: {_tail(log)}\n")
                    return 1
            return 0
        finally:
            _stop(proc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m callboard.bench.litellm_proxy")
    parser.add_argument("--upstream", required=True, help="the provider's base URL (…/v1)")
    parser.add_argument("--model", required=True, help="the model name clients ask for")
    args = parser.parse_args(argv)
    exe = program()
    if exe is None:
        sys.stderr.write(f"no litellm program: install litellm[proxy] or set {ENV}\n")
        return 2
    return serve(exe, args.upstream, args.model)


if __name__ == "__main__":
    sys.exit(main())
