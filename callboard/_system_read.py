"""Reading a running ``System``: its stats, its supervision state, and asking an actor.

``System.stats``, ``System.supervision`` and ``System.ask`` carry the public
docstrings; the work is here. ``ASK_TIMEOUT_S`` bounds every question the
system asks its own actors (here, at start-up and while stopping).

What must hold:

* Every question has a deadline: no caller waits on an actor forever, and
  one that gets no answer in time raises ``UnavailableError``.
* A system stopped (or failed) answers ``SystemStoppedError``, never a
  pykka error: a dead actor is reported as "not running".
* ``stats`` counts every result handed out before the call, and reads
  through an aggregator restart (see ``aggregated``).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

import pykka

from callboard.actors.aggregator import STATS_GRACE_S
from callboard.actors.base import AGGREGATOR
from callboard.messages import GetState, GetStats, Stats, SystemStoppedError, UnavailableError
from callboard.supervisor.address_book import UnknownActorError

if TYPE_CHECKING:
    from callboard._system import System

ASK_TIMEOUT_S = 10.0


def stats(system: System) -> Stats:
    """The aggregator's snapshot of every result ended so far, with restarts and budget."""
    system._check_alive()
    counts = system.ledger.counts()
    snapshot = aggregated(system, counts.finished + counts.rejected)
    supervision_state = supervision(system).items()
    restarts = {n: s["restarts"] for n, s in supervision_state if isinstance(s, dict)}
    budget = system.rt.budget
    return dataclasses.replace(
        snapshot, restarts=restarts, budget=budget.snapshot() if budget is not None else {}
    )


def aggregated(system: System, ended: int) -> Stats:
    """The aggregator's snapshot once it has accounted ``ended`` results.

    The question is told, not asked: while the aggregator restarts it is held
    for the next incarnation. An incarnation that dies holding it loses it, so
    it is told again to each new one (an answered question is ignored)."""
    reply: Future[Stats] = Future()
    question = GetStats(finished=ended, reply=reply)
    deadline = time.monotonic() + ASK_TIMEOUT_S
    told = system.book.resolve(AGGREGATOR)
    system.tell(AGGREGATOR, question)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise UnavailableError(f"the aggregator did not answer within {ASK_TIMEOUT_S} s")
        try:  # a live aggregator answers within its grace
            return reply.result(timeout=min(left, STATS_GRACE_S + 0.5))
        except TimeoutError:
            system._check_alive()
        current = system.book.resolve(AGGREGATOR)
        if current is not None and current is not told:
            told = current
            system.tell(AGGREGATOR, question)


def supervision(system: System) -> dict[str, Any]:
    """The supervisor's state of each actor; ``SystemStoppedError`` once it is gone."""
    try:
        return cast(dict[str, Any], system._supervisor.ask(GetState(), timeout=ASK_TIMEOUT_S))
    except pykka.ActorDeadError:
        raise SystemStoppedError("callboard is stopped: no supervisor to ask") from None


def ask(system: System, name: str, message: Any, timeout: float) -> Any:
    """Ask the actor now registered as ``name``; ``SystemStoppedError`` if there is none."""
    if name not in system.book.names():  # a typo, not a restart
        raise UnknownActorError(f"no actor named {name!r}; there are {sorted(system.book.names())}")
    ref = system.book.resolve(name)
    if ref is None:
        raise SystemStoppedError(f"{name} is not running (restarting or stopped)")
    try:
        return ref.ask(message, timeout=timeout)
    except pykka.ActorDeadError:
        raise SystemStoppedError(f"{name} is not running (restarting or stopped)") from None
