"""What ``callboard run`` does with each input line, given what earlier runs left.

Earlier runs leave two records of an id: its last line in the output (a status,
and the digest of the request it answered) and, with a ledger, its last result
there (which the output lacks after a crash between the two). ``RunPlan.action``
decides from those and the line's own digest, in one place:

=====================================  =========================================
what earlier runs left for the id      action
=====================================  =========================================
nothing final (or an ``invalid`` line)  SEND
a result, the request as asked now     SKIP (RESEND if not completed and
                                       ``retry_failed``)
a result for another request           KEEP_CHANGED, said loudly (RESEND with
                                       ``resend_changed``)
only the ledger's result, same request RECOVER: write it, send nothing
                                       (RESEND if not completed and
                                       ``retry_failed``)
only the ledger's, another request     RESEND: the output never held the old one
=====================================  =========================================

A RESEND replaces a final result: the ledger must ``reopen`` the id's key, and
the output's old line goes when the run compacts it. A digest is known from the
output line (``request_sha256``), else from the request the ledger stored; a
result with neither (written by an older version, no ledger) counts as the
request asked now: nothing says otherwise.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from callboard.batch import OutputState
from callboard.messages import Completed, Result

__all__ = ["Action", "Held", "RunPlan"]


class Action(enum.Enum):
    SEND = "send"
    """No final result yet."""
    SKIP = "skip"
    """Its result stands."""
    RECOVER = "recover"
    """The ledger's result is written to the output; nothing is sent."""
    RESEND = "resend"
    """Sent again; the new result replaces the final one held."""
    KEEP_CHANGED = "keep-changed"
    """The line changed since its result; the old result is kept, and that is said."""


@dataclass(frozen=True, slots=True)
class Held:
    """A final result the ledger holds for an id."""

    digest: str
    """``request_digest`` of the request it answered."""
    result: Result


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPlan:
    output: OutputState
    ledger: Mapping[str, Held]
    retry_failed: bool = False
    """Send again the ids whose last result is not ``completed``."""
    resend_changed: bool = False
    """Send again the ids whose line changed since their result."""

    def action(self, ident: str, digest: str) -> Action:
        """What to do with the line keyed ``ident`` that asks ``digest``."""
        status = self.output.statuses.get(ident)
        held = self.ledger.get(ident)
        if status is not None and status != "invalid":
            recorded = self.output.digests.get(ident) or (held.digest if held else None)
            if recorded is not None and recorded != digest:
                return Action.RESEND if self.resend_changed else Action.KEEP_CHANGED
            return self._final(completed=status == "completed")
        if held is None:
            return Action.SEND
        if held.digest != digest:
            return Action.RESEND
        action = self._final(completed=isinstance(held.result, Completed))
        return Action.RECOVER if action is Action.SKIP else action

    def _final(self, *, completed: bool) -> Action:
        return Action.RESEND if self.retry_failed and not completed else Action.SKIP
