"""The provider in its own process (bench/provider_process.py): it is always stopped and
reaped, whether the block around it raises or its parent is killed outright."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest
from callboard.bench.provider_process import ProviderProcess
from support import alive, kill_stray_provider, listening_ports, proc_stat, refused, wait_until

_HOLDS_A_PROVIDER = """
import sys, threading
from callboard.bench.provider_process import ProviderProcess
prov = ProviderProcess()
prov.start()
print(prov.pid, flush=True)
threading.Event().wait(60)
"""


@pytest.mark.timeout(90)
def test_a_bench_killed_outright_still_leaves_no_provider_process() -> None:
    # SIGKILL runs no handler and no finally: only the child's stdin EOF can stop it
    holder = subprocess.Popen(  # noqa: S603 - our own module
        [sys.executable, "-c", _HOLDS_A_PROVIDER], stdout=subprocess.PIPE, text=True
    )
    pid = 0
    try:
        assert holder.stdout is not None
        pid = int(holder.stdout.readline())
        assert wait_until(lambda: bool(listening_ports(pid)), 30.0)
        port = listening_ports(pid)[0]
        holder.kill()
        holder.wait(10)
        gone = wait_until(lambda: not alive(pid), 10.0)
        assert gone, f"provider pid {pid} outlived its parent"
        assert refused(port)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()
        kill_stray_provider(pid)


def test_an_exception_inside_the_provider_block_stops_and_reaps_the_child() -> None:
    seen: dict[str, Any] = {}

    def scenario() -> None:
        with ProviderProcess() as prov:
            seen.update(prov=prov, pid=prov.pid, port=httpx.URL(prov.base_url).port)
            assert alive(prov.pid)
            prov.reset_stats()
            raise RuntimeError("scenario failed")

    with pytest.raises(RuntimeError, match="scenario failed"):
        scenario()
    pid, port, prov = seen["pid"], seen["port"], seen["prov"]
    assert proc_stat(pid) is None  # stopped and reaped, no zombie
    assert refused(port)
    with pytest.raises(RuntimeError, match="not running"):
        prov.stats()
    prov.stop()  # idempotent
