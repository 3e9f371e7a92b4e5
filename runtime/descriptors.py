"""Room for a system's connections in the process's open-file limit.

Each call in flight holds a socket, and the soft ``RLIMIT_NOFILE`` many hosts start a
process with (1024 under systemd, less in some containers) is below what a few models
of a high ``max_concurrency`` need. Past it, a connect fails with ``Too many open files``,
which reads as the provider's failure: the breaker opened on a healthy provider and a
gateway answered ``provider_down`` (found by a hunt). So a system raises the soft limit
towards the hard one (as Go's runtime does for every program) when its models may hold
more, and says so; where the hard limit is too low itself, it says that instead.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["HEADROOM", "make_room"]

log = logging.getLogger(__name__)

HEADROOM = 256
"""Descriptors besides the calls in flight: the ledger, logs, the gateway's clients."""


def make_room(calls: int) -> None:
    """Raise the soft open-file limit to hold ``calls`` connections and ``HEADROOM``
    more, within the hard limit (never lowered; a warning if the hard one is short)."""
    if sys.platform == "win32":  # no such limit to raise
        return
    import resource  # (POSIX only)

    needed = calls + HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if raised > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, raised, exc)
            return
        log.info("open-file limit raised from %d to %d for %d calls in flight", soft, raised, calls)
    if raised < needed:
        log.warning(
            "the open-file limit (hard %d) holds fewer than the %d calls the models may have "
            "in flight and %d more: calls past it fail to connect (raise it: ulimit -n)",
            hard,
            calls,
            HEADROOM,
        )
