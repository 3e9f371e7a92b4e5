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

import os
import socket
import uuid
from collections.abc import Mapping
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
    if ray.is_initialized():
        return  # a process joins one Ray cluster: the one it is in
    address = cluster.address
    _probe(address, min(PROBE_TIMEOUT_S, cluster.connect_timeout_s))
    try:
        ray.init(
            address=None if address == "local" else address,
            namespace=cluster.namespace,
            log_to_driver=False,
            include_dashboard=False if address == "local" else None,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterUnreachableError(address, f"{type(exc).__name__}: {exc}") from exc


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
            said = sock.recv(16)
    except TimeoutError as exc:
        why = f"it takes connections but says nothing in {timeout_s:g} s: not Ray's GCS"
        raise ClusterUnreachableError(address, why) from exc
    except OSError as exc:
        raise ClusterUnreachableError(address, f"nothing answers there ({exc})") from exc
    if not said or said.startswith(b"HTTP/"):
        why = "it answers HTTP/1, not Ray's gRPC" if said else "it hangs up at once"
        raise ClusterUnreachableError(address, f"not Ray's GCS: {why}")


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""HTTP/2's connection preface and an empty SETTINGS frame: Ray's GCS (gRPC) answers
with its own SETTINGS. ``ray.init`` has no timeout of its own: at an address that
takes connections and never answers (a stuck GCS), or a mistyped port where another
server listens, it waited past ten minutes, whatever ``connect_timeout_s`` said. A
reply that is not HTTP/1 (a TLS GCS's alert) is left for ``ray.init`` to judge."""
