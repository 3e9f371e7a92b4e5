"""The one Ray cluster of a test run, kept by a process of its own:
``python two_nodes.py STATE WATCH_PID``.

It starts a 2-node cluster on this machine with ``ray.cluster_utils.Cluster``:
a head node (2 CPUs, resource ``near``) and a worker node (1 CPU, resource
``far``), prints the address drivers join it at (the one line it writes to stdout; what
Ray prints goes to stderr), and keeps it until
the process WATCH_PID ends (the test run's controller: the xdist controller, or
the pytest process itself with ``-n 0``), then shuts the cluster down and
removes STATE (the file the test workers found the address in).

It goes on in a process forked from the one started (which exits at once, so
the test worker that started it reaps it and may end before the cluster does),
in a session of its own (the conftest starts it so): a Ctrl-C at the terminal
interrupts the test run, not a Ray start or shutdown half done; the controller's
end, however it ends, is what shuts the cluster down. A SIGTERM or SIGHUP to
the keeper (its process group: the keeper and its Ray) shuts it down too.

The nodes start while this process holds ``START_LOCK`` (an ``flock``): one Ray
starts at a time on this machine. Ray gives a node 30 s to register; three
Rays starting at once on the loaded 2-core machine ran past that ("The current
node timed out during startup").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import sys
import tempfile
import warnings
from pathlib import Path
from types import FrameType

START_LOCK = Path(tempfile.gettempdir()) / "callboard-tests-ray-start.lock"
QUIET = {
    "enable_metrics_collection": False,
    "task_events_report_interval_ms": 0,
    "event_stats": False,
}
"""Ray's own book-keeping, which no test reads, off in the test cluster: each actor's
worker process reported task events every second and metrics, and kept event stats
(with the log monitors, measured: the cluster tests used 254 CPU-seconds of the 2-core
machine instead of 301, each shared actor's process 1.1 s instead of 1.4; 140 s
instead of 160). Every test makes a queue and a model actor of its own, so an actor
process's start is most of what a cluster test costs the machine."""


def main(state: Path, watched: int) -> None:
    if os.fork():  # the starter reaps this process at once; the keeper goes on alone
        os._exit(0)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit)
    try:
        controller = os.pidfd_open(watched)  # readable once that process has ended
    except ProcessLookupError:
        return  # the test run ended before its cluster started
    out = os.dup(sys.stdout.fileno())  # the address goes there, and nothing else
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what Ray prints goes to stderr
    with warnings.catch_warnings():  # Ray's own start-up warnings are not ours
        warnings.simplefilter("ignore")
        from ray.cluster_utils import Cluster

        with START_LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            cluster = Cluster(
                initialize_head=True,
                connect=False,
                head_node_args={
                    "num_cpus": 2,
                    "resources": {"near": 1},
                    "include_dashboard": False,
                    "include_log_monitor": False,
                    "_system_config": QUIET,
                },
            )
            try:
                cluster.add_node(num_cpus=1, resources={"far": 1}, include_log_monitor=False)
                cluster.wait_for_nodes()
            except BaseException:
                cluster.shutdown()
                raise
    try:
        with os.fdopen(out, "w") as reader:  # then closed: the reader leaves
            reader.write(f"{cluster.address}\n")
        select.select([controller], [], [])  # until the test run's controller ends
    finally:
        cluster.shutdown()
        with contextlib.suppress(FileNotFoundError):
            state.unlink()


def _exit(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
