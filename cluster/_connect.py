"""Joining a Ray cluster and finding (or creating) its shared actors.

The first process to start creates the queue and one actor per model,
named in the cluster's namespace, detached (they outlive the process) and
restarted by Ray when they die (``max_restarts=-1``); every later process
finds them by name (``get_if_exists``). Creating and finding are one call, so
two processes starting at once agree on one actor each.

A cluster that cannot be reached fails the start with a
``ClusterUnreachableError`` naming its address, within
``connect_timeout_s``: an address that is a host and port is probed first,
since ``ray.init`` would otherwise wait for minutes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from callboard.cluster._model import ModelShell
from callboard.cluster._queue import QueueShell
from callboard.core.settings import ModelSettings, SchedulerSettings
from callboard.messages import ClusterUnreachableError
from callboard.runtime.guarded_log import guarded_logger

from callboard.config import RayCluster

log = guarded_logger(__name__)

QUEUE_NAME = "callboard.queue"
MODEL_PREFIX = "callboard.model:"
GCS_RECONNECT_VARIABLE = "RAY_gcs_rpc_server_reconnect_timeout_s"
GCS_RECONNECT_S = 365 * 86_400
"""How long a process waits for a lost GCS before Ray ends it: a year (Ray's own
default, 60 s, ended every process a minute into a lost cluster, whatever
``when_lost`` said)."""
PROBE_TIMEOUT_S = 5.0
"""How long the probe of a host:port address waits for the connection and the GCS's
first word, at most (``connect_timeout_s`` if that is shorter)."""


def model_name(model: str) -> str:
    return f"{MODEL_PREFIX}{model}"


@dataclass(frozen=True, slots=True)
class Connection:
    """This process's way into the cluster's shared actors."""

    cluster: RayCluster
    owner: str
    """This process's (this system's) unique name."""
    queue: Any
    models: Mapping[str, Any]


def connect(
    cluster: RayCluster, models: Mapping[str, ModelSettings], scheduler: SchedulerSettings
) -> Connection:
    """Join ``cluster`` (unless this process already has) and get its shared actors."""
    join(cluster)
    ns = cluster.namespace
    common: dict[str, Any] = {
        "namespace": ns,
        "lifetime": "detached",
        "get_if_exists": True,
        "max_restarts": -1,
        "max_task_retries": 0,
        "num_cpus": 0,
        "max_concurrency": 10_000,
    }
    queue = (
        ray.remote(QueueShell).options(name=QUEUE_NAME, **common).remote(scheduler, cluster.lease_s)
    )
    handles = {
        name: ray.remote(ModelShell)
        .options(name=model_name(name), **common)
        .remote(settings, queue, cluster.lease_s)
        for name, settings in models.items()
    }
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    return Connection(cluster=cluster, owner=owner, queue=queue, models=handles)


def join(cluster: RayCluster) -> None:
    """``ray.init`` for ``cluster``; a ``ClusterUnreachableError`` if it cannot be reached."""
    address = cluster.address
    if ray.is_initialized():  # a process joins one Ray cluster: the one it is in, if that
        _same_cluster(address)  # is the one asked for (another was used: found by a hunt)
        return
    _probe(address, min(PROBE_TIMEOUT_S, cluster.connect_timeout_s))
    try:
        with _as_a_guest():
            ray.init(
                address=None if address == "local" else address,
                namespace=cluster.namespace,
                log_to_driver=False,
                include_dashboard=False if address == "local" else None,
            )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterUnreachableError(address, _with_cause(exc)) from exc


def _with_cause(exc: BaseException) -> str:
    """``exc`` in words, and what first caused it if something did: Ray says "Failed to
    connect to Ray cluster" for a cluster that refused this process's token, its
    ``AuthenticationError`` (naming ``RAY_AUTH_MODE``) only in the chain (found by a
    hunt)."""
    said = f"{type(exc).__name__}: {exc}"
    root, seen = exc, {id(exc)}
    while (cause := root.__cause__ or root.__context__) is not None and id(cause) not in seen:
        root = cause
        seen.add(id(root))
    if root is not exc:
        said += f" (caused by {type(root).__name__}: {root})"
    return said


@contextlib.contextmanager
def _as_a_guest() -> Iterator[None]:
    """``ray.init`` in a process that is callboard's (a gateway, a run) or its host's,
    not Ray's: what Ray would take over for a driver of its own is left as it was
    (each found by a hunt), unless the environment says otherwise (Ray's own variables):

    * its failure-signal handler (C++, installed under Python's) took SIGTERM, printed
      ``*** SIGTERM received`` and aborted the process 3 s later: a gateway's graceful
      drain (``unready_s``, ``grace_s``, its spend written) never happened;
    * on the main thread it replaced the SIGTERM handler with one that exits at once
      (``sys.exit(15)``): ``callboard run`` wrote nothing and waited for no call;
    * a driver whose GCS has been gone ``gcs_rpc_server_reconnect_timeout_s`` (60 s)
      exits: ``when_lost`` (wait, or run alone) held for a minute, then the process
      died with its calls in flight. A lost cluster is callboard's to handle."""
    if "RAY_DISABLE_FAILURE_SIGNAL_HANDLER" not in os.environ:
        ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    os.environ.setdefault(GCS_RECONNECT_VARIABLE, str(GCS_RECONNECT_S))
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and before is not None:
            signal.signal(signal.SIGTERM, before)


def _probe(address: str, timeout_s: float) -> None:
    """Fail fast on a host:port (or ray://host:port) nobody listens at, or that does not
    answer as Ray's GCS within ``timeout_s``."""
    if address in ("auto", "local"):
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterUnreachableError(address, "not host:port, ray://host:port, auto or local")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(_H2_PREFACE)
            said = _first_bytes(sock, _FRAME_HEAD)
    except TimeoutError as exc:
        why = f"it takes connections but says nothing in {timeout_s:g} s: not Ray's GCS"
        raise ClusterUnreachableError(address, why) from exc
    except OSError as exc:
        raise ClusterUnreachableError(address, f"nothing answers there ({exc})") from exc
    if said[:1] in _TLS_RECORDS:
        return  # a TLS GCS refusing our plain bytes: ray.init speaks TLS, and judges
    if len(said) < _FRAME_HEAD or said[3] != _SETTINGS:
        why = (
            "it hangs up at once"
            if not said
            else "it answers HTTP/1, not Ray's gRPC"
            if said.startswith(b"HTTP/")
            else "it answers, but not with HTTP/2's SETTINGS as gRPC does"
        )  # an SSH or Redis banner, an HTTP/1 server's page: ray.init hung on each
        raise ClusterUnreachableError(address, f"not Ray's GCS: {why}")


_FRAME_HEAD = 9
"""The bytes of an HTTP/2 frame's head: length (3), type (1), flags (1), stream (4)."""
_SETTINGS = 0x04
"""The type of the frame a gRPC server answers a connection preface with."""
_TLS_RECORDS = (b"\x15", b"\x16")
"""A TLS record's first byte: an alert, a handshake."""


def _first_bytes(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes, however many reads they take (fewer if the peer closes)."""
    got = b""
    while len(got) < n:
        more = sock.recv(n - len(got))
        if not more:
            break
        got += more
    return got


def _same_cluster(address: str) -> None:
    """Refuse an ``address`` that is not the cluster this process already joined (a
    ``ray.init`` of the application's, or another system's): its tasks went to that one,
    in its namespace, without a word. ``auto``, ``local`` and a client's ``ray://``
    (whose port is its server's, not the GCS's) are taken as they come."""
    if address in ("auto", "local") or address.startswith("ray://"):
        return
    joined = ray.get_runtime_context().gcs_address
    host, _, port = address.rpartition(":")
    joined_host, _, joined_port = joined.rpartition(":")
    try:
        ip = socket.gethostbyname(host)
        same_host = ip.startswith("127.") or ip == socket.gethostbyname(joined_host)
    except OSError:  # (loopback: this machine, which Ray names by its address on the net)
        same_host = False
    if port != joined_port or not same_host:
        raise ClusterUnreachableError(
            address, f"this process already joined the Ray cluster at {joined}, and is in it"
        )


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""HTTP/2's connection preface and an empty SETTINGS frame: Ray's GCS (gRPC) answers
with its own SETTINGS. ``ray.init`` has no timeout of its own: at an address that
takes connections and never answers (a stuck GCS), or a mistyped port where another
server listens, it waited past ten minutes, whatever ``connect_timeout_s`` said. A
reply that is not HTTP/1 (a TLS GCS's alert) is left for ``ray.init`` to judge."""
