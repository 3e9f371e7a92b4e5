"""What one model of the simulated provider does: latency, limits, faults, streams.

Invariant: a `ModelBehaviour` that exists is valid. Every field is checked in
`__post_init__` (types, ranges, and that the fault rates sum to at most 1), so
the server never meets a negative latency or a rate above 1 at request time.
`behaviour_from_json` is the one way untrusted JSON (the CLI's ``--models``,
``POST /admin/models/{name}``) becomes a behaviour; it raises `ValueError`
naming the offending field (`TypeError` if the JSON is not an object).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["CUT_MODES", "FAULT_RATES", "ModelBehaviour", "behaviour_from_json"]

FAULT_RATES = (
    "error_rate",
    "unavailable_rate",
    "timeout_rate",
    "drop_rate",
    "malformed_rate",
    "cut_rate",
)
"""The fault fractions, in the order a request's single random draw is tested."""
CUT_MODES = ("close", "error")

_OPTIONAL_INTS = ("rpm", "tpm", "completion_tokens", "status")
_INTS = ("cut_after", "dimensions")
_NON_NEGATIVE = ("latency_s", "jitter_s", "hang_s", "token_gap_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelBehaviour:
    """How the simulated provider answers requests for one model."""

    latency_s: float = 0.05
    """Mean service time of an answered request, in seconds."""
    jitter_s: float = 0.0
    """Uniform +/- jitter on `latency_s`; the result is never below 0."""
    rpm: int | None = None
    """Requests per minute (None = unlimited)."""
    tpm: int | None = None
    """Tokens (prompt + completion) per minute (None = unlimited)."""
    burst_s: float = 1.0
    """Buckets hold this many seconds' worth of the limit (at least one request)."""
    completion_tokens: int | None = None
    """Fixed completion size; None = 16 + up to 48 drawn by the seeded RNG."""
    error_rate: float = 0.0
    """Fraction answered 500."""
    unavailable_rate: float = 0.0
    """Fraction answered as overloaded: 503 (OpenAI's wires), 529 ``overloaded_error``
    (Anthropic's)."""
    timeout_rate: float = 0.0
    """Fraction that hang for `hang_s` (ended early by disconnect or stop)."""
    hang_s: float = 30.0
    """How long a hanging request hangs before it is answered 504."""
    drop_rate: float = 0.0
    """Fraction whose connection is closed with no response."""
    malformed_rate: float = 0.0
    """Fraction answered 200 with a body (a stream: an event) that is not valid JSON."""
    status: int | None = None
    """Force every response (any endpoint) to this error status (400..599)."""
    retry_after_s: float | None = None
    """With ``status=429``: the Retry-After to send."""
    cut_rate: float = 0.0
    """Fraction answered 200 and then cut: a stream after `cut_after` events, any other
    answer halfway through its body."""
    cut_after: int = 3
    """How many events a cut stream sends before it ends."""
    cut_mode: str = "close"
    """How a cut stream ends: ``close`` (the connection closes mid-stream) or ``error``
    (the wire's mid-stream error event: OpenAI's ``data: {"error": ...}``, Anthropic's
    ``event: error`` with ``overloaded_error``)."""
    ttft_s: float | None = None
    """A stream's time to first token (None: `latency_s`); `jitter_s` applies."""
    token_gap_s: float = 0.0
    """A stream's pause between tokens (0: as fast as the connection takes them)."""
    dimensions: int = 1536
    """An embedding's length when the request does not ask for ``dimensions``."""

    def __post_init__(self) -> None:
        _check_types(self)
        for name in _NON_NEGATIVE:
            _require(getattr(self, name) >= 0, name, "must be >= 0")
        _require(self.burst_s > 0, "burst_s", "must be > 0")
        _require(self.ttft_s is None or self.ttft_s >= 0, "ttft_s", "must be >= 0 or None")
        _require(self.cut_after >= 0, "cut_after", "must be >= 0")
        _require(self.cut_mode in CUT_MODES, "cut_mode", f"must be one of {CUT_MODES}")
        _require(self.dimensions > 0, "dimensions", "must be a positive integer")
        for name in ("rpm", "tpm", "completion_tokens"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, "must be a positive integer or None")
        for name in FAULT_RATES:
            _require(0.0 <= getattr(self, name) <= 1.0, name, "must be in [0, 1]")
        total = sum(getattr(self, name) for name in FAULT_RATES)
        _require(total <= 1.0 + 1e-9, "+".join(FAULT_RATES), "must sum to at most 1")
        _require(self.status is None or 400 <= self.status <= 599, "status", "must be 400..599")
        retry = self.retry_after_s
        _require(retry is None or retry >= 0, "retry_after_s", "must be >= 0 or None")


def behaviour_from_json(obj: object, base: ModelBehaviour) -> ModelBehaviour:
    """`base` with the fields named in the JSON object `obj` replaced."""
    if not isinstance(obj, dict):
        raise TypeError("behaviour must be a JSON object of ModelBehaviour fields")
    known = {field.name for field in dataclasses.fields(ModelBehaviour)}
    for key in obj:
        if key not in known:
            raise ValueError(f"unknown ModelBehaviour field {key!r}")
    return dataclasses.replace(base, **obj)


def _check_types(behaviour: ModelBehaviour) -> None:
    for field in dataclasses.fields(behaviour):
        value = getattr(behaviour, field.name)
        if field.name in _OPTIONAL_INTS:
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
            _require(ok, field.name, "must be an integer or None")
            continue
        if field.name in _INTS:
            ok = isinstance(value, int) and not isinstance(value, bool)
            _require(ok, field.name, "must be an integer")
            continue
        if field.name == "cut_mode":
            _require(isinstance(value, str), field.name, "must be a string")
            continue
        if value is None and field.name in ("retry_after_s", "ttft_s"):
            continue
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        _require(is_number and math.isfinite(value), field.name, "must be a finite number")


def _require(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise ValueError(f"ModelBehaviour.{field} {problem}")
