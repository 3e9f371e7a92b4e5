"""The command line joining a Ray cluster: ``callboard run`` and two ``callboard serve``
replicas, each a process of its own, configured with ``[cluster] engine = "ray"``
in one file, share one scheduler (one queue, one limiter for the provider).

The cluster is the test run's (``ray_address``), which the children join at its
address, in a namespace of the test's own; the provider is a simulated one in a
process of its own.
"""

from __future__ import annotations

import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
from callboard.bench.provider_process import ProviderProcess
from callboard.gateway import ANNOUNCEMENT
from support import (
    CLI_TIMEOUT_S,
    WAIT_S,
    announced,
    child,
    cli,
    good,
    records,
    wait_until,
    write_lines,
)

RPM = 120
"""The provider's limit, and each process's: three limiters would send three times it."""


def callboard(*args: str) -> AbstractContextManager[subprocess.Popen[str]]:
    """``python -m callboard ARGS`` as a process of its own; stopped at the end."""
    return child(["-m", "callboard", *args], gently=True)


def _announced(proc: subprocess.Popen[str]) -> str:
    return announced(proc, ANNOUNCEMENT)


def _chat(url: str, text: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=2 * WAIT_S)


def test_run_and_two_serve_replicas_share_one_scheduler(
    ray_local: Any, ray_address: str, ray_namespace: str, tmp_path: Path
) -> None:
    lines = [good(f"r{i}") for i in range(4)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    with ProviderProcess(latency_s=0.02, models={"m": {"rpm": RPM, "burst_s": 1.0}}) as upstream:
        config = tmp_path / "callboard.toml"
        config.write_text(
            f"""
[cluster]
engine = "ray"
address = "{ray_address}"
namespace = "{ray_namespace}"

[models.m]
base_url = "{upstream.base_url}"
rpm = {RPM}
max_concurrency = 4
""",
            encoding="utf-8",
        )
        with (
            callboard("serve", "--config", str(config), "--port", "0") as one,
            callboard("serve", "--config", str(config), "--port", "0") as two,
            callboard("run", str(source), "-o", str(output), "--config", str(config)) as run,
        ):
            urls = [_announced(one), _announced(two)]
            asked = [
                (url, f"{name} {i}") for i in range(2) for name, url in zip("ab", urls, strict=True)
            ]
            with ThreadPoolExecutor(len(asked)) as pool:
                answers = list(pool.map(lambda a: _chat(*a), asked))
            assert run.wait(CLI_TIMEOUT_S) == 0, run.stderr.read() if run.stderr else ""
            queue = ray_local.get_actor("callboard.queue", namespace=ray_namespace)
            model = ray_local.get_actor("callboard.model:m", namespace=ray_namespace)
            queue_state = ray_local.get(queue.state.remote(), timeout=WAIT_S)
        served = upstream.stats()["models"]["m"]
    assert [a.status_code for a in answers] == [200] * len(asked), [a.text for a in answers]
    assert all(a.json()["choices"][0]["message"]["content"] for a in answers)
    out = records(output)
    assert sorted(r["id"] for r in out) == sorted(line["id"] for line in lines)
    assert all(r["ok"] and r["status"] == "completed" for r in out), out
    # one scheduler: three owners on one queue, every call admitted by one model actor:
    # sent there on a ticket, or made by a process on its permit (``spent``: reported
    # once the call ended, so perhaps a moment after the answer; a full suite's run read
    # the model's state before the last report had landed)
    assert len(queue_state["owners"]) == 3

    def admitted_there() -> int:
        state = ray_local.get(model.state.remote(), timeout=WAIT_S)
        return int(state["sent"] + state["spent"])

    assert wait_until(lambda: admitted_there() == len(lines) + len(asked)), admitted_there()
    # and one limiter: the provider, at RPM, refused nothing
    assert served["requests"] == len(lines) + len(asked)
    assert served["rate_limited"] == 0


def test_an_unreachable_cluster_is_a_usage_error_naming_it_not_a_traceback(
    tmp_path: Path,
) -> None:
    """``callboard run`` ended in a traceback and exit 1 (which says "some ids did not
    complete") when the configured cluster was not there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends
    config = tmp_path / "callboard.toml"
    config.write_text(
        f'[models.m]\nbase_url = "http://127.0.0.1:9/v1"\n\n'
        f'[cluster]\nengine = "ray"\naddress = "{address}"\n',
        encoding="utf-8",
    )
    source = write_lines(tmp_path / "in.jsonl", [good("a")])
    proc = cli("run", source, "-o", tmp_path / "out.jsonl", "--config", config)
    assert proc.returncode == 2, proc.stderr
    assert f"the Ray cluster at '{address}' is unreachable" in proc.stderr
    assert "Traceback" not in proc.stderr
