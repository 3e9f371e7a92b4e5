"""Joining a cluster (cluster/_connect.py): one that cannot be reached fails the start
at once with a typed error naming its address, and nothing is left running."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from callboard.cluster import ClusterUnreachableError, _connect
from callboard.cluster._connect import join

from callboard.config import RayCluster

SCRIPT = """
import sys
from callboard import System
from callboard.config import RayCluster, SystemConfig
from callboard.core.settings import ModelSettings
from callboard.cluster import ClusterUnreachableError
model = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1")
wait = {}
for address in sys.argv[1:]:  # in turn, in one child: Ray is imported once
    if address.startswith("timeout="):
        wait = {"connect_timeout_s": float(address.removeprefix("timeout="))}
        continue
    try:
        System(SystemConfig(models=(model,), cluster=RayCluster(address=address, **wait)))
    except ClusterUnreachableError as exc:
        print("unreachable:", exc.address, "|", exc, flush=True)
"""
"""Starts a system at each address of its arguments in turn (``timeout=S`` sets the
connect timeout for the addresses after it), printing each refusal."""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_cluster_is_a_typed_error_naming_its_address() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    done = subprocess.run(  # noqa: S603 - our own script, on this interpreter
        [sys.executable, "-c", SCRIPT, address],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"unreachable: {address} |" in done.stdout
    assert f"the Ray cluster at '{address}' is unreachable" in done.stdout
    assert time.monotonic() - started < 30  # ray.init alone would wait for minutes


def test_a_refusal_ray_says_only_in_its_chain_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster that takes only drivers with its token: Ray raises a bare
    ``ConnectionError`` ("Failed to connect"), its ``AuthenticationError`` in the chain
    alone, which is the one that says what to do (found by a hunt). ``ray.init`` is a
    stand-in raising Ray's chain, as Ray 2.60 words it."""

    class AuthenticationError(Exception):  # Ray's, by name
        pass

    def init(**_: Any) -> None:
        refused = AuthenticationError(
            "Authentication token is missing or incorrect. Set RAY_AUTH_MODE=token."
        )
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.9:6379") from refused

    constants = _connect.ray._private.ray_constants  # what joining sets: put back after
    monkeypatch.setattr(constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", True)
    monkeypatch.setenv(_connect.GCS_RECONNECT_VARIABLE, str(_connect.GCS_RECONNECT_S))
    monkeypatch.setattr(_connect.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(_connect.ray, "init", init)
    monkeypatch.setattr(_connect, "_probe", lambda address, timeout_s: None)
    with pytest.raises(ClusterUnreachableError) as refused:
        join(RayCluster(address="10.0.0.9:6379"))
    said = str(refused.value)
    assert "ConnectionError: Failed to connect" in said
    assert "caused by AuthenticationError: Authentication token is missing" in said
    assert "RAY_AUTH_MODE" in said


def test_an_address_that_is_not_rays_is_refused_at_once() -> None:
    """``ray.init`` has no timeout: at a port that takes connections and says nothing,
    or where a web server listens (a mistyped port), a start waited past ten minutes."""
    with socket.socket() as silent, socket.socket() as web:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections wait in the backlog: taken, never answered
        web.bind(("127.0.0.1", 0))
        web.listen(8)
        # the web server first: the test answers its probe, then the child waits out
        # the silent one
        tried = [(web, "answers HTTP/1"), (silent, "says nothing")]
        addresses = [f"127.0.0.1:{listener.getsockname()[1]}" for listener, _ in tried]
        child = subprocess.Popen(  # noqa: S603 - our own script
            [sys.executable, "-c", SCRIPT, *addresses],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        conn, _ = web.accept()  # answer its probe as a web server would
        with conn:
            conn.recv(64)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    refusals = out.splitlines()
    assert len(refusals) == len(tried), (out, err)
    for line, address, (_, why) in zip(refusals, addresses, tried, strict=True):
        assert line.startswith(f"unreachable: {address} |"), line
        assert why in line


def test_a_silent_address_is_given_up_on_within_a_shorter_connect_timeout() -> None:
    """The probe waited its own 5 s whatever ``connect_timeout_s`` said."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        done = subprocess.run(  # noqa: S603 - our own script, on this interpreter
            [sys.executable, "-c", SCRIPT, "timeout=0.5", address],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    assert "says nothing in 0.5 s" in done.stdout, done.stdout


def test_a_server_that_answers_but_not_as_grpc_is_refused_at_once() -> None:
    """An SSH or Redis banner, or an HTTP/1 server's page with no status line, passed
    the probe (anything not starting ``HTTP/``), and ``ray.init`` hung on each past
    400 s (found by a hunt): the answer must be HTTP/2's SETTINGS frame."""
    banners = [b"SSH-2.0-OpenSSH_9.6\r\n", b"-ERR unknown command\r\n", b"<!DOCTYPE HTML>\n"]
    listeners = [socket.socket() for _ in banners]
    try:
        for listener in listeners:
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
        addresses = [f"127.0.0.1:{listener.getsockname()[1]}" for listener in listeners]
        child = subprocess.Popen(  # noqa: S603 - our own script
            [sys.executable, "-c", SCRIPT, *addresses],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for listener, banner in zip(listeners, banners, strict=True):  # as the child tries
            conn, _ = listener.accept()
            with conn:
                conn.sendall(banner)
                conn.recv(64)
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        refusals = out.splitlines()
        assert len(refusals) == len(banners), (out, err)
        for line, address in zip(refusals, addresses, strict=True):
            assert line.startswith(f"unreachable: {address} |"), line
            assert "not Ray's GCS" in line
    finally:
        for listener in listeners:
            listener.close()


def test_another_clusters_address_in_a_process_that_joined_one_is_refused(
    ray_local: Any, ray_address: str
) -> None:
    """A process joins one Ray cluster; asked for another, the system ran its tasks on
    the one it was in, in that one's namespace, without a word (found by a hunt)."""
    join(RayCluster(address=ray_address))  # the one it is in: taken
    host, _, port = ray_address.rpartition(":")
    join(RayCluster(address=f"127.0.0.1:{port}"))  # this machine, by its loopback name
    with pytest.raises(ClusterUnreachableError, match="already joined the Ray cluster at"):
        join(RayCluster(address="203.0.113.7:6379"))
    with pytest.raises(ClusterUnreachableError, match="already joined"):
        join(RayCluster(address=f"{host}:{int(port) + 1}"))


GUEST = """
import os, signal, sys, threading
import ray
from callboard.cluster._connect import GCS_RECONNECT_VARIABLE, join
from callboard.config import RayCluster
where, address = sys.argv[1:]
termed = threading.Event()
handler = lambda signum, frame: termed.set()
signal.signal(signal.SIGTERM, handler)
if where == "main":
    join(RayCluster(address=address))
else:  # as a gateway joins: from its system's thread
    joining = threading.Thread(target=join, args=(RayCluster(address=address),))
    joining.start()
    joining.join()
print("handler kept:", signal.getsignal(signal.SIGTERM) is handler, flush=True)
print("gcs wait:", os.environ[GCS_RECONNECT_VARIABLE], flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("terminated:", termed.wait(30), flush=True)
ray.shutdown()
"""
"""Joins the cluster at its second argument from the main thread or another
(``main``, ``thread``), then sends itself SIGTERM."""


@pytest.mark.parametrize("where", ["main", "thread"])
def test_joining_leaves_sigterm_to_the_process(ray_address: str, where: str) -> None:
    """``ray.init`` took SIGTERM over: Ray's C++ failure-signal handler printed
    ``*** SIGTERM received`` and aborted the process 3 s later (a gateway's graceful
    drain never happened), and on the main thread Ray's own handler exited at once
    (``callboard run`` wrote nothing); and Ray ended a process whose cluster had been
    lost for a minute, whatever ``when_lost`` said (all found by a hunt). The
    process's own handler gets SIGTERM, and Ray waits for a lost cluster for a year."""
    child = subprocess.run(  # noqa: S603 - this interpreter, this test's script
        [sys.executable, "-c", GUEST, where, ray_address],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.splitlines() == [
        "handler kept: True",
        f"gcs wait: {365 * 86_400}",
        "terminated: True",
    ]
    assert "SIGTERM received" not in child.stderr
