"""What ``callboard run`` does with each input line, given what earlier runs left.

Earlier runs leave two records of an id: its last line in the output (a status,
and the digest of the request it answered) and, with a ledger, its last final
result there. The ledger's is committed before the output's line is written,
so after a crash between the two the ledger holds a result the output lacks, or
a newer one than the output's line (an id sent again, then killed before its
line was written). ``RunPlan.action`` decides from those and the line's own
digest, in one place:

=========================  ===============================  ========================
the output's line          the ledger's result              action
=========================  ===============================  ========================
none (or ``invalid``)      none                             SEND
none (or ``invalid``)      for the request as asked now     RECOVER
none (or ``invalid``)      for another request              RESEND: the output never
                                                            held the old one
for the request as asked   completed, and the output's      RECOVER: the better
now                        line is not                      answer to the same line
for the request as asked   anything else, or none           SKIP
now
for another request        for the request as asked now     RECOVER
for another request        none, or for another request     KEEP_CHANGED, said
                                                            loudly (RESEND with
                                                            ``resend_changed``)
=========================  ===============================  ========================

With ``retry_failed``, a SKIP or RECOVER of a result that is not ``completed``
is a RESEND instead. A RECOVER writes the ledger's result without sending; where
the output holds a line for the id, that line goes when the run compacts the
output. A RESEND replaces a final result: the ledger must ``reopen`` the id's
key, and the output's old line goes in the same way.

A digest is known from the output line (``request_sha256``), else from the
request the ledger stored; a result with neither (written by an older version,
no ledger) counts as the request asked now: nothing says otherwise. Among two
results that did not complete (failed in one, expired in the other) the
output's stands: with one ledger the ledger's is never older, but the output
may come from a run with another ledger or none, and which is newer cannot be
told; either way the id did not complete.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from callboard.batch import OutputState

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
    """A final result the ledger holds for an id: what it answered and how it ended (the
    result itself stays in the ledger until it is recovered)."""

    digest: str
    """``request_digest`` of the request it answered."""
    status: str
    """The status its output line would have: ``completed``, ``failed``, ..."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPlan:
    output: OutputState
    ledger: Mapping[str, Held]
    retry_failed: bool = False
    """Send again the ids whose last result is not ``completed``."""
    resend_changed: bool = False
    """Send again the ids whose line changed since their result."""

    def action(self, ident: str, digest: str, *, also: str | None = None) -> Action:
        """What to do with the line keyed ``ident`` that asks ``digest``; ``also``: the
        digest of the request as it would be sent, when that differs (an embeddings line's
        with the model callboard chose), which the ledger holds and which an earlier
        callboard wrote for it."""
        status = self.output.statuses.get(ident)
        held = self.ledger.get(ident)
        asks = (digest, also)
        # the ledger's result, where it answers the line as it is now
        fresh = held if held is not None and held.digest in asks else None
        if status is None or status == "invalid":
            if held is None:
                return Action.SEND
            return self._final(fresh.status, Action.RECOVER) if fresh else Action.RESEND
        recorded = self.output.digests.get(ident) or (held.digest if held else None)
        if recorded is not None and recorded not in asks:  # the output answers another line
            if fresh is not None:
                return self._final(fresh.status, Action.RECOVER)
            return Action.RESEND if self.resend_changed else Action.KEEP_CHANGED
        if fresh is not None and fresh.status == "completed" != status:
            return Action.RECOVER  # a crash lost the line of a retry that completed
        return self._final(status, Action.SKIP)

    def _final(self, status: str, action: Action) -> Action:
        """``action`` for a result of ``status`` that stands, unless it is to be retried."""
        return Action.RESEND if self.retry_failed and status != "completed" else action
