"""What ``embed`` answers: an ``EmbeddingResult``, every vector or a typed failure.

An input larger than one call is sent as several batches (ordinary tasks);
the result puts their vectors back in input order. What must hold: a result
is either whole (``ok``: one vector per text, in input order) or a failure
that names the batch that failed and the texts it held (``failed_inputs``),
with no vectors at all: never a list with holes. ``usage`` and the cost are
the sums over every batch that ran, failed or not (that money was spent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

from callboard.messages._results import NANO, ZERO_USAGE, Result, Usage

__all__ = ["EmbeddingResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingResult:
    """The vectors of one ``embed``: all of them in input order, or a failure."""

    vectors: list[list[float]] = field(default_factory=list)
    """One vector per text, in input order (empty on failure, and when the caller kept
    base64: see ``vectors_base64``)."""
    vectors_base64: list[str] | None = None
    """With ``keep_base64``: each vector as base64 of little-endian float32 values, in
    input order: as the provider sent it, or packed so when it sent floats (None
    otherwise)."""
    model: str | None = None
    """The model that served every batch (the last one tried, on failure)."""
    usage: Usage = ZERO_USAGE
    """Summed over the batches that ran (prompt tokens: embeddings have no output);
    ``estimated`` when any batch's was."""
    cost_nusd: int = 0
    """Summed over the batches that ran, in nano-dollars."""
    batches: int = 1
    """Calls the input was split into; on failure, those planned before the failure was
    seen (embed sends no more after a batch fails, and the input's rest is not split)."""
    trace_id: str = ""
    """Shared by every batch's task."""
    failure: Result | None = None
    """The result of the batch that failed first (``Failed``, ``Expired``,
    ``Cancelled``, ``Rejected``; a ``Completed`` whose answer was unusable, see
    ``detail``); None when ``ok`` (and for a batch whose future was cancelled
    before it had a result)."""
    failed_batch: int | None = None
    """Which batch (0-based, in input order) ``failure`` is of."""
    failed_inputs: range | None = None
    """The indices of the texts that batch held: whose vectors are missing for sure
    (on failure no vector is given at all)."""
    detail: str = ""
    """Why the result failed, in words."""

    @property
    def ok(self) -> bool:
        return self.failed_batch is None

    @property
    def cost_usd(self) -> Decimal:
        return Decimal(self.cost_nusd) / NANO
