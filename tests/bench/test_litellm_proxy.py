"""LiteLLM's proxy as the gateway scenario's child (bench/litellm_proxy.py): found as a
program (the environment variable first), configured for one model at the provider,
announced once its liveness endpoint answers, and stopped with its whole process group
when the bench's pipe closes; a program that dies before it listens is an error that
shows what it printed. LiteLLM is not a dependency, so the program here is a stand-in
that keeps LiteLLM's command line and liveness endpoint (the real one was run by hand:
docs/bench.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from callboard.bench import litellm_proxy
from support import alive

_STAND_IN = """#!{python}
import argparse, http.server, json, os, subprocess, sys
p = argparse.ArgumentParser()
p.add_argument("--config"); p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("--num_workers")
a = p.parse_args()
# a worker of its own, as LiteLLM's server may have: the group must go with it
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["STAND_IN_SEEN"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "config": open(a.config).read(),
               "pids": [os.getpid(), worker.pid]}}, f)
if os.environ.get("STAND_IN_FAIL"):
    print("no master key, refusing to start"); sys.exit(3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health/liveliness" else 404)
        self.end_headers(); self.wfile.write(b'"I\\'m alive!"')
    def log_message(self, *args): pass
http.server.HTTPServer((a.host, a.port), H).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "litellm"
    exe.write_text(_STAND_IN.format(python=sys.executable), encoding="utf-8")
    exe.chmod(0o755)
    monkeypatch.setenv(litellm_proxy.ENV, str(exe))
    monkeypatch.setenv("STAND_IN_SEEN", str(tmp_path / "seen.json"))
    return tmp_path / "seen.json"


def _wrapper() -> subprocess.Popen[str]:
    argv = ["--upstream", "http://127.0.0.1:9/v1", "--model", "steady"]
    return subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-m", litellm_proxy.__name__, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _gone(pids: list[int], within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_program_is_the_one_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = tmp_path / "litellm"
    exe.write_text("#!/bin/sh\n", encoding="utf-8")
    monkeypatch.setenv(litellm_proxy.ENV, str(exe))
    assert litellm_proxy.program() == str(exe)
    monkeypatch.setenv(litellm_proxy.ENV, str(tmp_path / "missing"))
    assert litellm_proxy.program() is None  # named and absent: not some other one


def test_the_configuration_is_one_openai_model_at_the_provider() -> None:
    config = litellm_proxy.config("http://127.0.0.1:8000/v1", "steady")
    assert json.loads(json.dumps(config)) == config  # JSON is YAML: what LiteLLM reads
    (model,) = config["model_list"]  # type: ignore[misc]
    assert model["model_name"] == "steady"
    assert model["litellm_params"]["model"] == "openai/steady"
    assert model["litellm_params"]["api_base"] == "http://127.0.0.1:8000/v1"


@pytest.mark.timeout(60)
def test_it_announces_once_alive_and_its_group_goes_when_the_pipe_closes(stand_in: Path) -> None:
    wrapper = _wrapper()
    assert wrapper.stdout is not None
    line = wrapper.stdout.readline()
    assert line.startswith(litellm_proxy.ANNOUNCEMENT), wrapper.stderr
    url = line.removeprefix(litellm_proxy.ANNOUNCEMENT).strip()
    assert url.startswith("http://127.0.0.1:")
    assert url.endswith("/v1")
    seen = json.loads(stand_in.read_text(encoding="utf-8"))
    argv = seen["argv"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"  # loopback only
    assert argv[argv.index("--port") + 1] == url.split(":")[2].removesuffix("/v1")
    assert argv[argv.index("--num_workers") + 1] == "1"
    assert json.loads(seen["config"])["model_list"][0]["model_name"] == "steady"
    wrapper.communicate(timeout=30)  # stdin closed: the bench is gone
    assert wrapper.returncode == 0
    assert _gone(seen["pids"])  # LiteLLM and its worker with it


@pytest.mark.timeout(60)
def test_a_program_that_dies_before_it_listens_is_an_error_with_its_words(
    stand_in: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAND_IN_FAIL", "1")
    wrapper = _wrapper()
    assert wrapper.wait(30) == 1  # stdin still open: it gave up of itself
    out, err = wrapper.communicate(timeout=30)
    assert out == ""  # never announced
    assert "no master key, refusing to start" in err
    assert _gone(json.loads(stand_in.read_text(encoding="utf-8"))["pids"])


def test_without_a_program_it_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(litellm_proxy.ENV, "/nonexistent/litellm")
    done = subprocess.run(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-m", litellm_proxy.__name__, "--upstream", "u", "--model", "m"],
        capture_output=True,
        text=True,
        timeout=30,
        env=os.environ,
        check=False,
    )
    assert done.returncode == 2
    assert "litellm[proxy]" in done.stderr
