"""Control messages: supervision, timers, introspection.

The supervisor takes only the messages defined here (``StartChildren``,
``StopChildren``, ``CheckLiveness``, ``ChildFailed``, ``ChildStopped``,
``RestartChild``, ``GetState``); it logs and ignores anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildFailed:
    """A child -> Supervisor: I crashed (sent from the dying incarnation's thread)."""

    name: str
    incarnation: int
    error: str
    """``repr`` of the exception, for logs and the escalation report."""
    poison: Any = None
    """A message that crashed the actor twice: its tasks are failed, not redelivered."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildStopped:
    """A child -> Supervisor: I stopped normally (someone asked me to stop); sent from
    the stopping incarnation's thread. A stop the supervisor asked for is ignored."""

    name: str
    incarnation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StartChildren:
    """Host -> Supervisor (``ask``): start every child in order; answers ``None``.

    A child whose start raises is the asker's error (the supervisor lives on)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StopChildren:
    """Host -> Supervisor (``ask``): stop every child, newest first, and restart none
    from now on; answers the names of those that did not stop in time (a tuple)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckLiveness:
    """Supervisor -> itself (via the timer): look for children that died unreported."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartChild:
    """Supervisor -> itself (via the timer): the backoff for ``name`` is over."""

    name: str
    incarnation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplaceChildren:
    """Host -> supervisor (``ask``): run these ``ChildSpec``s from now on, started in order.

    A name already supervised has its live incarnation stopped and the new spec
    started as its next incarnation (its ``after_restart`` runs, as after a
    restart); a new name joins the children just before the first already
    supervised name of the batch, so it stops after it. The answer: the names
    started (none once the system is stopping)."""

    specs: tuple[Any, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Redelivered:
    """The message an actor crashed on, handed to its next incarnation once more."""

    message: Any
    count: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Regrant:
    """Supervisor -> Model: the queue restarted; void old credits and grant afresh."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LetGo:
    """An actor -> itself: nothing to do. pykka's loop keeps the last message it handled
    while it waits for the next; an actor that handled a burst (a ``Route`` of 30,000
    tasks holds their futures, and so their results) tells itself this, so the burst
    is let go even if nothing else comes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GetState:
    """Anyone -> any actor (``ask``): a readable snapshot of its state."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Crash:
    """Anyone -> any actor (``tell``): raise, as a bug would (for the REPL and tests)."""

    reason: str = "crash requested"
