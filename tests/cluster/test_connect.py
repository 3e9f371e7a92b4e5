"""Joining a cluster (cluster/_connect.py): one that cannot be reached fails the start
at once with a typed error naming its address, and nothing is left running."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

SCRIPT = """
import sys
from callboard import System
from callboard.config import RayCluster, SystemConfig
from callboard.core.settings import ModelSettings
from callboard.cluster import ClusterUnreachableError
model = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1")
try:
    System(SystemConfig(models=(model,), cluster=RayCluster(address=sys.argv[1])))
except ClusterUnreachableError as exc:
    print("unreachable:", exc.address, "|", exc)
"""


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
