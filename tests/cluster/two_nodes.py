"""A 2-node Ray cluster on this machine for the cross-process cluster tests, as a
process of its own: ``python two_nodes.py``.

It starts a head node (1 CPU, resource ``near``) and a worker node (1 CPU,
resource ``far``) with ``ray.cluster_utils.Cluster``, prints the address
clients join it at (one line), and keeps the cluster until its stdin closes
(the test is done, or the test process died), then shuts it down. Kept out of
the test process, which may hold a Ray connection of its own (``ray_local``):
a process joins one Ray cluster.

The nodes start while this process holds ``START_LOCK`` (an ``flock``): one Ray
starts at a time on this machine. Ray gives a node 30 s to register; test
workers starting three at once on the loaded 2-core machine ran past that
("The current node timed out during startup").
"""

from __future__ import annotations

import fcntl
import sys
import tempfile
import warnings
from pathlib import Path

START_LOCK = Path(tempfile.gettempdir()) / "callboard-tests-ray-start.lock"


def main() -> None:
    with warnings.catch_warnings():  # Ray's own start-up warnings are not ours
        warnings.simplefilter("ignore")
        from ray.cluster_utils import Cluster

        with START_LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            cluster = Cluster(
                initialize_head=True,
                connect=False,
                head_node_args={
                    "num_cpus": 1,
                    "resources": {"near": 1},
                    "include_dashboard": False,
                },
            )
            try:
                cluster.add_node(num_cpus=1, resources={"far": 1})
                cluster.wait_for_nodes()
            except BaseException:
                cluster.shutdown()
                raise
        try:
            sys.stdout.write(f"{cluster.address}\n")
            sys.stdout.flush()
            sys.stdin.read()  # until the test closes it (or dies)
        finally:
            cluster.shutdown()


if __name__ == "__main__":
    main()
