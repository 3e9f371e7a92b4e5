"""The ``callboard`` command's entry point: a signal while the CLI loads (most of a
second on a small machine) ends it with its status and a word, not a traceback out
of whichever import it landed in."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import CLI_TIMEOUT_S

SIGNALLED_AS_IT_LOADS = """
import importlib.abc, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sig = getattr(signal, sys.argv.pop(1))
class Trip(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "callboard._system":
            os.kill(os.getpid(), sig)
        return None
sys.meta_path.insert(0, Trip())
from callboard._entry import main
sys.exit(main())
"""
"""The entry point, sent the signal named by its first argument as the CLI's code
loads (as ``callboard._system`` is looked for)."""


@pytest.mark.parametrize(("sig", "status"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_while_the_cli_loads_ends_it_without_a_traceback(sig: str, status: int) -> None:
    proc = subprocess.run(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-c", SIGNALLED_AS_IT_LOADS, sig, "run", "--help"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == status, proc.stderr
    assert proc.stderr == "callboard: interrupted\n"
