"""Control messages: supervision, timers, introspection."""

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
    in_start: bool = False
    """The failure happened while starting (``on_start``)."""
    poison: Any = None
    """A message that crashed the actor twice: its tasks are failed, not redelivered."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartChild:
    """Supervisor -> itself (via the timer): the backoff for ``name`` is over."""

    name: str
    incarnation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Redelivered:
    """The message an actor crashed on, handed to its next incarnation once more."""

    message: Any
    count: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Regrant:
    """Supervisor -> Model: the queue restarted; void old credits and grant afresh."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GetState:
    """Anyone -> any actor (``ask``): a readable snapshot of its state."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Crash:
    """Anyone -> any actor (``tell``): raise, as a bug would (for the REPL and tests)."""

    reason: str = "crash requested"
