"""Running the gateway: ``callboard serve`` as its own process (``python -m
callboard.gateway``), its graceful stop on SIGTERM, its spend file across a restart
and between two gateways, and what it refuses to do."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from callboard.gateway import ANNOUNCEMENT, Gateway, main
from callboard.gateway import server as server_module
from callboard.gateway import spend as spend_module
from callboard.gateway.settings import ClientKey, GatewayConfig, Limits, UnsafeBindError
from callboard.provider.server import SimulatedProvider
from support import (
    WAIT_S,
    LogCollector,
    accepted_as_it_stops,
    announced,
    child,
    dead_port,
    served,
    threads_since,
    wait_until,
)

KEY = "sk-ops-9876543210"


@contextlib.contextmanager
def serving(
    *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``callboard serve --port 0 ARGS`` in a process of its own; its base URL once it
    listens. Killed at the end if it is still running."""
    with child(["-m", "callboard.gateway", "--port", "0", *args], env=env) as proc:
        yield proc, announced(proc, ANNOUNCEMENT, WAIT_S)


def config_file(
    tmp_path: Path, upstream: SimulatedProvider, gateway: str, *, key: str = ""
) -> Path:
    path = tmp_path / "callboard.toml"
    path.write_text(
        f"""
[gateway]
{gateway}

[gateway.keys.ops]
key_env = "OPS_GATEWAY_KEY"
{key}

[models.gate]
base_url = "{upstream.base_url}"
max_concurrency = 1
price = {{ input = "1", output = "2" }}
""",
        encoding="utf-8",
    )
    return path


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/healthz", timeout=WAIT_S)
    except httpx.ConnectError:
        return True
    return False


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


@pytest.fixture
def in_flight(
    pool: ThreadPoolExecutor,
    upstream: SimulatedProvider,
    slowed: Callable[[str, float], AbstractContextManager[None]],
) -> Callable[[str], Future[httpx.Response]]:
    """``in_flight(url, seconds=1.0)``: a request to ``gate`` that takes ``seconds``
    upstream, returned once its call is there."""

    def send(url: str, seconds: float = 1.0) -> Future[httpx.Response]:
        before = int(served(upstream, "gate").get("requests", 0))
        with slowed("gate", seconds):
            answer = pool.submit(
                httpx.post,
                f"{url}/v1/chat/completions",
                json={"model": "gate", "messages": [{"role": "user", "content": "hold"}]},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=WAIT_S,
            )
            assert wait_until(lambda: int(served(upstream, "gate").get("requests", 0)) > before)
        return answer

    return send


def test_without_a_config_it_serves_the_simulated_provider_open_on_loopback() -> None:
    with serving() as (proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="anything", max_retries=0)
        with client:
            answer = client.chat.completions.create(
                model="sim-fast", messages=[{"role": "user", "content": "hi"}]
            )
        assert answer.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_turns_unready_first_then_lets_the_call_in_flight_finish(
    tmp_path: Path,
    upstream: SimulatedProvider,
    in_flight: Callable[[str], Future[httpx.Response]],
    sig: signal.Signals,
) -> None:
    """SIGHUP too (nginx's and gunicorn's reload, a closed terminal's): left to its
    default it ended the process at once, the call in flight cut off (found by a hunt)."""
    config = config_file(tmp_path, upstream, "grace_s = 10\nunready_s = 0.5", key="operator = true")
    with serving("--config", str(config), env={"OPS_GATEWAY_KEY": KEY}) as (proc, url):
        answer = in_flight(url)
        proc.send_signal(sig)
        unready = httpx.get(f"{url}/readyz", timeout=WAIT_S)
        assert unready.status_code == 503
        stats = httpx.get(  # the dashboard says so (it said "live" while draining)
            f"{url}/v1/callboard/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S
        )
        assert stats.json()["gateway"] == {"status": "draining"}
        finished = answer.result(WAIT_S)
        assert finished.status_code == 200  # the call in flight finished
        # and every answer while draining says its connection is not to be used again
        # (a keep-alive client's next request on it went unanswered; found by a hunt)
        for drained in (unready, stats, finished):
            assert drained.headers["Connection"] == "close"
        assert proc.wait(WAIT_S) == 0
        assert refused(url)
        said = proc.stderr.read() if proc.stderr else ""
    if sig is signal.SIGHUP:  # said as a warning, in the log's layout without -v (a bare
        # message was all a log pipeline got of any warning; found by a hunt)
        layout = r"^\d{4}-\d\d-\d\d [\d:,]+ WARNING callboard\.\S+ .*SIGHUP"
        assert re.search(layout, said, re.MULTILINE), said


NOHUP = """
import runpy, signal, sys
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
sys.argv = ["callboard serve", *sys.argv[1:]]
runpy.run_module("callboard.gateway", run_name="__main__")
"""


def test_under_nohup_a_sighup_leaves_the_gateway_serving() -> None:
    """``nohup callboard serve`` survives its session: SIGHUP was taken over regardless
    of nohup's ignoring it, and the gateway stopped (a review)."""
    with child(["-c", NOHUP, "--port", "0"]) as proc:
        url = announced(proc, ANNOUNCEMENT, WAIT_S)
        proc.send_signal(signal.SIGHUP)
        assert httpx.get(f"{url}/readyz", timeout=WAIT_S).status_code == 200
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0


def test_what_outlasts_the_grace_is_answered_503_and_the_process_still_exits(
    tmp_path: Path,
    upstream: SimulatedProvider,
    pool: ThreadPoolExecutor,
    in_flight: Callable[..., Future[httpx.Response]],
) -> None:
    """At the grace's end, not twice it (aiohttp waits its shutdown timeout twice: a 1 s
    call outlived a 0.6 s grace, and a 30 s grace was a minute), and with an answer: a
    call still running and a request still waiting for its key's rpm got their
    connections closed without a status line (found by a hunt); each gets a 503 with
    ``Retry-After`` its SDK retries elsewhere."""
    # a grace of 2 s leaves the last word 0.5 s (a quarter): at 0.6 s it had 0.15 s, and
    # on a loaded machine the stop's answer could come after aiohttp cut the connection
    config = config_file(tmp_path, upstream, "grace_s = 2", key="operator = true\nrpm = 1")
    with serving("--config", str(config), env={"OPS_GATEWAY_KEY": KEY}) as (proc, url):
        auth = {"Authorization": f"Bearer {KEY}"}
        # the key's one request this minute, far longer than the grace: at 1 s, on a
        # loaded machine, it could end before a grace that began late (a 200, not a 503)
        answer = in_flight(url, 10.0)
        waiting = pool.submit(
            httpx.post,
            f"{url}/v1/chat/completions",
            json={"model": "gate", "messages": [{"role": "user", "content": "wait"}]},
            headers=auth,
            timeout=WAIT_S,
        )

        def queued() -> bool:
            stats = httpx.get(f"{url}/v1/callboard/stats", headers=auth, timeout=WAIT_S).json()
            return any(scope["waiting"] for scope in stats["quotas"]["scopes"])

        assert wait_until(queued)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(WAIT_S)
        assert code == 0, proc.stderr.read() if proc.stderr else ""
        running, queued_answer = answer.result(WAIT_S), waiting.result(WAIT_S)
    assert running.status_code == queued_answer.status_code == 503, (
        running.text,
        queued_answer.text,
    )
    assert running.headers["Retry-After"]
    assert queued_answer.headers["Retry-After"]
    assert queued_answer.json()["error"]["code"] == "stopping"
    assert running.json()["error"]["code"] == "cancelled"


def test_a_second_signal_cuts_the_drain_short(
    tmp_path: Path, upstream: SimulatedProvider, in_flight: Callable[..., Future[httpx.Response]]
) -> None:
    """An operator who will not wait: the second SIGTERM ends the unready time and
    the grace (ten minutes each here), answering the call in flight 503 at once; it
    did nothing, and ``unready_s = 1e308`` (taken then) never ended (found by a hunt)."""
    config = config_file(tmp_path, upstream, "grace_s = 600\nunready_s = 600")
    with serving("--config", str(config), env={"OPS_GATEWAY_KEY": KEY}) as (proc, url):
        answer = in_flight(url, 60.0)
        port = int(url.rsplit(":", 1)[1])
        coming = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)  # a body still
        coming.sendall(  # coming held aiohttp's own wait, half the grace, after the 503s
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {KEY}\r\n".encode()
            + b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"mo'
        )
        proc.send_signal(signal.SIGTERM)
        assert httpx.get(f"{url}/readyz", timeout=WAIT_S).status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
        coming.close()
        cut = answer.result(WAIT_S)
    assert cut.status_code == 503, cut.text
    assert cut.json()["error"]["code"] == "cancelled"


def test_serve_runs_with_shorter_gil_hand_offs_unless_the_config_sets_its_own() -> None:
    from callboard.gateway.server import served as as_served
    from callboard.gateway.settings import GatewayConfig

    from callboard import SystemConfig
    from callboard.config import RUN_SWITCH_INTERVAL_S

    assert as_served(None).system is not None
    assert as_served(None).system.switch_interval_s == RUN_SWITCH_INTERVAL_S
    own = GatewayConfig(system=SystemConfig(switch_interval_s=0.002, seed=3))
    assert as_served(own) is own  # its own interval: untouched
    given = GatewayConfig(system=SystemConfig(seed=3))
    system = as_served(given).system
    assert system is not None
    assert (system.switch_interval_s, system.seed) == (RUN_SWITCH_INTERVAL_S, 3)


def test_an_open_gateway_refuses_to_bind_beyond_loopback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--host", "0.0.0.0", "--port", "0"]) == 2
    assert "binds loopback only" in capsys.readouterr().err
    with pytest.raises(UnsafeBindError):
        Gateway(host="::")


def test_a_bad_config_is_reported_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "callboard.toml"
    path.write_text("[gateway]\ngrace = 1\n", encoding="utf-8")
    assert main(["--config", str(path)]) == 2
    assert f"{path}: gateway.grace: unknown key" in capsys.readouterr().err


def test_a_key_naming_a_model_there_is_not_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo in a key's ``models`` started a gateway whose key could use nothing: every
    request it made was a 403 or a 404, found out only then."""
    path = tmp_path / "callboard.toml"
    path.write_text(
        '[gateway.keys.a]\nkey_sha256 = "' + "0" * 64 + '"\nmodels = ["fsat"]\n',
        encoding="utf-8",
    )
    before = set(threading.enumerate())
    assert main(["--config", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "gateway.keys.a.models: 'fsat' is no model or route" in err
    assert "sim-fast" in err  # what there is
    assert wait_until(lambda: not threads_since(before))  # nothing left running


def test_cas_that_cannot_be_loaded_are_no_port_it_could_not_listen_on(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A missing ``SSL_CERT_FILE`` was said as ``cannot listen on 127.0.0.1:PORT: [Errno
    2] No such file or directory``, the port free (a hunt): every ``OSError`` of the
    start was taken for the listener's."""
    missing = tmp_path / "no-such-ca.pem"
    monkeypatch.setenv("SSL_CERT_FILE", str(missing))
    before = set(threading.enumerate())
    assert main(["--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "cannot listen" not in err
    assert "SSL_CERT_FILE" in err
    assert str(missing) in err
    assert wait_until(lambda: not threads_since(before))


def test_a_port_in_use_is_reported_and_nothing_is_left_running(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = set(threading.enumerate())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--port", str(port)]) == 1
    assert "cannot listen" in capsys.readouterr().err
    assert wait_until(lambda: not threads_since(before))


# -- budgets kept in a spend file ---------------------------------------------------------------

BUDGETED = 'budget_usd = "0.0001"\nbudget_period = "1mo"'
"""The ops key's budget: $0.0001 a month, a few requests of ~50 uUSD each (20 tokens
at most at $2 per million, the prompt at $1)."""


def spend_until_refused(url: str) -> int:
    """Requests of the ops key until its budget refuses one; how many were served."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)
    served_ = 0
    with client:
        while served_ < 50:
            try:
                client.chat.completions.create(model="gate", messages=HI, max_tokens=20)
            except openai.RateLimitError as exc:
                refusal = exc
                break
            served_ += 1
        else:
            raise AssertionError("the budget never refused")
    assert refusal.code == "insufficient_quota", refusal
    return served_


def refused_for_budget(url: str) -> openai.RateLimitError:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)
    with client, pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="gate", messages=HI, max_tokens=20)
    return caught.value


HI = [{"role": "user", "content": "hi"}]


def quota_scopes(url: str) -> list[dict[str, Any]]:
    """The quotas of ``/v1/callboard/stats``, scope by scope."""
    stats = httpx.get(
        f"{url}/v1/callboard/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S
    ).json()
    scopes: list[dict[str, Any]] = stats["quotas"]["scopes"]
    return scopes


def test_a_restarted_gateway_keeps_refusing_a_key_whose_budget_is_spent(
    tmp_path: Path, upstream: SimulatedProvider
) -> None:
    config = config_file(tmp_path, upstream, 'spend_file = "spend.db"', key=BUDGETED)
    env = {"OPS_GATEWAY_KEY": KEY}
    with serving("--config", str(config), env=env) as (proc, url):
        assert spend_until_refused(url) >= 1
        (spent,) = quota_scopes(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
    assert (tmp_path / "spend.db").exists()  # beside the config, as the config names it
    with serving("--config", str(config), env=env) as (proc, url):
        refusal = refused_for_budget(url)  # the first request after the restart
        assert refusal.code == "insufficient_quota"
        assert "per 1mo" in refusal.message
        assert "until it renews at" in refusal.message
        (scope,) = quota_scopes(url)
        assert scope["spent_usd"] == spent["spent_usd"]  # what the first run spent, exactly
        assert Decimal(0) < Decimal(scope["spent_usd"]) <= Decimal(scope["budget_usd"])
        assert (scope["budget_usd"], scope["budget_period"]) == ("0.0001", "1mo")
        assert scope["period_started_at"].endswith("-01T00:00:00Z")
        assert scope["period_ends_at"].endswith("-01T00:00:00Z")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
        assert proc.stderr is not None
        err = proc.stderr.read()
    # read at start on the thread that opened it (the I/O loop's): it was read on the
    # caller's, SQLite refused, and every start logged that budgets went on from memory
    # (found by a hunt)
    assert "spend file" not in err, err


def test_a_call_its_stop_cut_is_charged_to_the_budget_the_restart_reads(
    tmp_path: Path,
    upstream: SimulatedProvider,
    in_flight: Callable[[str, float], Future[httpx.Response]],
) -> None:
    """A call still at the provider when SIGTERM's grace runs out was sent and may be
    billed: its reservation is charged, and the spend file has it after the restart.
    The stop's sweep ended it with 0 attempts and no cost, so the gateway gave its
    reservation back and the budget never heard of it (found by a hunt)."""
    # 2 s: the last word has a quarter of it; at 0.4 s its 0.1 s was too short on a loaded
    # machine, the connection cut before the 503 (a fresh-clone CI run's failure)
    grace = 'spend_file = "spend.db"\ngrace_s = 2'
    config = config_file(tmp_path, upstream, grace, key='budget_usd = "100"')
    env = {"OPS_GATEWAY_KEY": KEY}
    with serving("--config", str(config), env=env) as (proc, url):
        answer = in_flight(url, 30.0)  # still at the provider when the grace runs out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
        cut = answer.result(WAIT_S)
    assert cut.status_code >= 500
    assert cut.headers["X-Callboard-Attempts"] == "1"
    assert Decimal(cut.headers["X-Callboard-Cost"]) > 0
    with serving("--config", str(config), env=env) as (proc, url):
        (scope,) = quota_scopes(url)
        assert Decimal(scope["spent_usd"]) == Decimal(cut.headers["X-Callboard-Cost"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0


def test_spend_the_file_cannot_take_at_the_stop_is_named_not_dropped(
    tmp_path: Path,
    base_config: GatewayConfig,
    keys: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process holds the spend file as a request settles and as the gateway
    stops: its spend was dropped at the close, with exit 0, and the next start gave it
    back to the budget (found by a hunt). It is tried again, then named."""
    monkeypatch.setattr(spend_module, "BUSY_TIMEOUT_S", 0.2)  # each try's wait for the lock
    monkeypatch.setattr(server_module, "STOP_WRITE_PAUSE_S", 0.05)
    path = tmp_path / "spend.db"
    secret = keys["team"]
    team = ClientKey(
        name="team",
        digest=hashlib.sha256(secret.encode()).digest(),
        tenant="team",
        limits=Limits(budget_usd=Decimal(1)),
    )
    gateway = dataclasses.replace(base_config.gateway, keys=(team,), spend_file=path)
    ask: dict[str, Any] = {
        "model": "fast",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
    }

    async def scenario() -> tuple[Decimal, int, int, Gateway]:
        async with (
            Gateway(dataclasses.replace(base_config, gateway=gateway), port=0) as gw,
            openai.AsyncOpenAI(
                base_url=f"{gw.url}/v1", api_key=secret, max_retries=0, timeout=WAIT_S
            ) as client,
        ):
            await client.chat.completions.create(**ask)
            with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
                assert wait_until(lambda: _spent(other) > 0)  # the first is in the file
                written = _spent(other)
                other.execute("BEGIN EXCLUSIVE")  # no write goes in until it ends
                held = await client.chat.completions.with_raw_response.create(**ask)
                await gw.stop()
                other.execute("ROLLBACK")
                return Decimal(held.headers["X-Callboard-Cost"]), written, _spent(other), gw

    cost, before, after, gw = asyncio.run(scenario())
    assert after == before  # the second is not in the file
    lost = gw.spend_not_recorded
    assert lost is not None
    assert [(c.scope, Decimal(c.nusd) / 10**9) for c in lost.charges] == [("key:team", cost)]
    assert f"key:team total from 0: {cost} USD" in str(lost)


def _spent(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT COALESCE(SUM(spent_nusd), 0) FROM spend").fetchone()[0])


def test_two_gateways_on_one_spend_file_share_the_budget(
    tmp_path: Path, upstream: SimulatedProvider
) -> None:
    config = config_file(tmp_path, upstream, 'spend_file = "spend.db"', key=BUDGETED)
    env = {"OPS_GATEWAY_KEY": KEY}
    with (
        serving("--config", str(config), env=env) as (_, one),
        serving("--config", str(config), env=env) as (_, two),
    ):
        assert spend_until_refused(one) >= 1
        assert refused_for_budget(two).code == "insufficient_quota"  # spent at the other


def test_a_damaged_spend_file_is_reported_and_nothing_starts(
    tmp_path: Path, upstream: SimulatedProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_file(tmp_path, upstream, 'spend_file = "spend.db"', key=BUDGETED)
    damaged = b"SQLite format 3\x00" + b"\xff" * 2000
    (tmp_path / "spend.db").write_bytes(damaged)
    before = set(threading.enumerate())
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPS_GATEWAY_KEY", KEY)
        assert main(["--config", str(config), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"the spend file {tmp_path / 'spend.db'}" in err
    assert "move it aside" in err
    assert (tmp_path / "spend.db").read_bytes() == damaged  # left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["callboard.toml", "spend.db"]
    assert wait_until(lambda: not threads_since(before))


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        ('budget_usd = 1\nbudget_period = "-1d"', "gateway.keys.ops.budget_period: must be"),
        ('budget_usd = 1\nbudget_period = "0"', "gateway.keys.ops.budget_period: must be"),
        ('budget_period = "1d"', "gateway.keys.ops.budget_period: renews a budget"),
    ],
)
def test_a_bad_budget_period_is_reported_with_its_path(
    tmp_path: Path,
    upstream: SimulatedProvider,
    capsys: pytest.CaptureFixture[str],
    limits: str,
    named: str,
) -> None:
    config = config_file(tmp_path, upstream, 'spend_file = "spend.db"', key=limits)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPS_GATEWAY_KEY", KEY)
        assert main(["--config", str(config)]) == 2
    assert f"{config}: {named}" in capsys.readouterr().err
    assert not (tmp_path / "spend.db").exists()  # nothing written


def test_a_connection_that_trickles_its_head_is_closed_after_idle_s(
    make_gateway: Callable[..., Gateway],
) -> None:
    """A caller sending its request head a byte at a time (slowloris) holds its
    connection ``idle_s``, not for as long as it keeps sending; and a connection
    that never sends a head is closed the same way."""
    gateway = make_gateway(settings={"idle_s": 0.5})
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=WAIT_S) as trickling,
        socket.create_connection((host, int(port)), timeout=WAIT_S) as silent,
    ):
        trickling.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        trickling.settimeout(0.05)
        closed = False
        deadline = time.monotonic() + WAIT_S
        while not closed and time.monotonic() < deadline:
            try:
                trickling.sendall(b"X")  # a header line that never ends
                closed = trickling.recv(1024) == b""
            except TimeoutError:
                continue
            except OSError:  # the server closed it: a reset, at times
                closed = True
        assert closed, f"still open after {WAIT_S} s of trickling"
        assert silent.recv(1024) == b""  # closed, never answered
    # a connection opened after both is served as ever
    assert httpx.get(f"{gateway.url}/healthz", timeout=WAIT_S).status_code == 200


def test_a_malformed_request_carrying_a_key_is_logged_without_it(
    gateway: Gateway, keys: dict[str, str], debug_logs: LogCollector
) -> None:
    """aiohttp logged a malformed request at ERROR with its exception, whose message
    quotes the offending line: a client's key in a malformed ``Authorization`` line
    reached the log, and aiohttp's answer quoted it back. It is one line at INFO now,
    without the bytes, and the answer says its status alone."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    for line in (
        f"Authorization: Bearer {keys['team']}\x01",
        f"Authorization Bearer {keys['team']}",
    ):
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{line}\r\n\r\n"
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
            conn.sendall(head.encode())
            answer = conn.recv(65536)
            assert answer.startswith(b"HTTP/1.0 400")
            assert keys["team"].encode() not in answer  # aiohttp's answer quoted the line
            assert answer.endswith(b"400 Bad Request")
    debug_logs.assert_no_secret(keys["team"])
    refused = [r for r in debug_logs.records if r.name == "aiohttp.server"]
    assert len(refused) == 2
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in refused)


def test_a_connection_accepted_as_the_gateway_stops_is_closed_not_left_open(
    make_gateway: Callable[..., Gateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepted in the loop turn the stop closed the listening server, a connection
    never reached aiohttp, so its cleanup could not close it (CPython gh-109564). The
    race is asyncio's selector loop's (uvloop accepts in one callback): the gateway's
    I/O loop is asyncio's here. (With uvloop, as the test extra installs, this was
    skipped, and it had run the stop on the I/O loop itself, which the stop stops; a
    hunt found both.)"""
    monkeypatch.setitem(sys.modules, "uvloop", None)  # asyncio's loop for the I/O loop
    gateway = make_gateway()
    site = next(iter(gateway._runner.sites))  # type: ignore[union-attr]
    loop = site._server.get_loop()  # type: ignore[union-attr]
    port = int(gateway.url.rpartition(":")[2])

    def stop() -> None:  # from a loop of its own, as a host stops it: not the I/O loop
        asyncio.run(gateway.stop())

    accepted_as_it_stops(loop, port, stop)


def test_a_gateway_whose_system_failed_still_answers_health_503(
    base_config: Any, keys: dict[str, str]
) -> None:
    """The server runs on the system's I/O loop, which the gateway owns: a supervisor
    that gives up (every model actor crashing on its calls) tears the system down, not
    the server, so ``/healthz`` and ``/readyz`` say ``failed``/``unready`` (503) and
    a request gets the API's 503, rather than a refused connection."""
    from callboard.actors.base import CrashPlan
    from callboard.messages import Call
    from callboard.supervisor.supervisor import SupervisorConfig

    system = dataclasses.replace(
        base_config.system,
        supervisor=SupervisorConfig(max_restarts=1, within_s=60.0, backoff_max_s=0.01),
    )
    config = dataclasses.replace(base_config, system=system)
    crashes = {f"model:{m.name}": 1 for m in system.models}
    plan = CrashPlan(crashes, only=dict.fromkeys(crashes, (Call,)))

    async def main() -> tuple[int, Any, int, int]:
        async with Gateway(config, port=0, crash_plan=plan) as gw, httpx.AsyncClient() as http:
            assert gw.cb is not None
            auth = {"Authorization": f"Bearer {keys['admin']}"}
            body = {"model": "fast", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(3):  # each crashes its model: the second restart gives up
                await http.post(f"{gw.url}/v1/chat/completions", json=body, headers=auth)
                if gw.cb.failed.is_set():
                    break
            await asyncio.wait_for(gw.cb.failed.wait(), WAIT_S)
            health = await http.get(f"{gw.url}/healthz", timeout=WAIT_S)
            ready = await http.get(f"{gw.url}/readyz", timeout=WAIT_S)
            after = await http.post(
                f"{gw.url}/v1/chat/completions", json=body, headers=auth, timeout=WAIT_S
            )
            return health.status_code, health.json(), ready.status_code, after.status_code

    health, said, ready, after = asyncio.run(main())
    assert (health, said, ready, after) == (503, {"status": "failed"}, 503, 503)


@pytest.mark.parametrize("closed", ["<&-", ">&-"], ids=["stdin", "stdout"])
def test_serve_started_with_stdin_or_stdout_closed_serves_and_stops_cleanly(closed: str) -> None:
    """Its event loop's descriptors took 0 or 1, and libuv aborted closing one (exit
    134): with stdout closed it never served, with stdin closed every stop aborted
    (found by a hunt)."""
    port = dead_port()
    command = [sys.executable, "-m", "callboard", "serve", "--port", str(port)]
    proc = subprocess.Popen(  # noqa: S603 - this interpreter, our own module
        ["sh", "-c", f'exec "$@" {closed}', "sh", *command],  # noqa: S607 - the shell
        stdout=subprocess.DEVNULL if closed == "<&-" else None,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/healthz"

        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url, timeout=1.0).status_code == 200
            return False

        assert wait_until(healthy, WAIT_S), "it never served"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
    assert proc.returncode == 0, err
