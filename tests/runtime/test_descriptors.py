"""Room for a system's connections in the open-file limit (runtime/descriptors.py), in a
child process of its own (the limit is the process's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import logging, resource, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
from callboard.runtime.descriptors import make_room
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
make_room(int(sys.argv[3]))
print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _probe(soft: int, hard: int, calls: int) -> str:
    return subprocess.run(  # noqa: S603 - this interpreter, our own code
        [sys.executable, "-c", PROBE, str(soft), str(hard), str(calls)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


@pytest.mark.skipif(sys.platform == "win32", reason="no RLIMIT_NOFILE")
def test_the_soft_limit_is_raised_for_the_calls_in_flight_within_the_hard_one() -> None:
    """A soft limit of 64 under 200 calls in flight failed every connect past it with
    ``Too many open files``, read as the provider's failure: the breaker opened on a
    healthy provider (found by a hunt)."""
    raised = _probe(64, 4096, 200)
    assert raised.splitlines()[-1] == "soft 456"
    assert "raised from 64 to 456" in raised
    short = _probe(64, 300, 200)
    assert short.splitlines()[-1] == "soft 300"
    assert "WARNING the open-file limit (hard 300) holds fewer" in short
    assert _probe(2048, 4096, 200).splitlines() == ["soft 2048"]  # room already: untouched
