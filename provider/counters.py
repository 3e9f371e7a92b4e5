"""Counters the simulated provider keeps, served as ``GET /stats``.

Invariants: every update to a model's counters is applied to the total as
well (the total is kept, not summed afterwards, so its ``max_in_flight`` is
real); ``in_flight`` is never reset, only the others are (a reset during load
must not drive it negative); ``arrivals`` is bounded.
"""

from __future__ import annotations

from collections import deque

__all__ = ["ARRIVALS_KEPT", "Counters"]

ARRIVALS_KEPT = 20_000
"""How many recent arrival times each counter set keeps."""


class Counters:
    """Request counters of one model, or of all of them (``parent=None``)."""

    __slots__ = (
        "arrivals",
        "completion_tokens",
        "cut",
        "dropped",
        "hung",
        "in_flight",
        "max_in_flight",
        "parent",
        "prompt_tokens",
        "rate_limited",
        "refused_arrivals",
        "requests",
        "responses",
    )

    def __init__(self, parent: Counters | None = None) -> None:
        self.parent = parent
        self.in_flight = 0
        self.arrivals: deque[float] = deque(maxlen=ARRIVALS_KEPT)
        self.refused_arrivals: deque[float] = deque(maxlen=ARRIVALS_KEPT)
        """The arrival times of the requests answered 429 (a rate over the arrivals
        less these is what was served)."""
        self.responses: dict[int, int] = {}
        self.reset()

    def reset(self) -> None:
        """Zero everything but ``in_flight``, which tracks live requests."""
        self.requests = 0
        self.responses.clear()
        self.rate_limited = 0
        self.max_in_flight = self.in_flight
        self.dropped = 0
        self.hung = 0
        self.cut = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.arrivals.clear()
        self.refused_arrivals.clear()

    def arrive(self, t: float) -> None:
        """A request arrived at ``t`` seconds since the provider started."""
        self.requests += 1
        self.arrivals.append(round(t, 4))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.parent is not None:
            self.parent.arrive(t)

    def leave(self) -> None:
        """A request is over (answered, dropped, or its client went away)."""
        self.in_flight -= 1
        if self.parent is not None:
            self.parent.leave()

    def respond(self, status: int, arrived: float | None = None) -> None:
        """An answer of ``status`` to the request that arrived at ``arrived``."""
        self.responses[status] = self.responses.get(status, 0) + 1
        if status == 429:
            self.rate_limited += 1
            if arrived is not None:
                self.refused_arrivals.append(round(arrived, 4))
        if self.parent is not None:
            self.parent.respond(status, arrived)

    def served(self, prompt_tokens: int, completion_tokens: int) -> None:
        """A completion with this usage was answered."""
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if self.parent is not None:
            self.parent.served(prompt_tokens, completion_tokens)

    def fault(self, *, dropped: bool) -> None:
        """A request was dropped (``dropped=True``) or hung."""
        if dropped:
            self.dropped += 1
        else:
            self.hung += 1
        if self.parent is not None:
            self.parent.fault(dropped=dropped)

    def cut_short(self) -> None:
        """An answer was cut after its first bytes (the ``cut_rate`` fault)."""
        self.cut += 1
        if self.parent is not None:
            self.parent.cut_short()

    def as_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "responses": {str(code): n for code, n in sorted(self.responses.items())},
            "rate_limited": self.rate_limited,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "dropped": self.dropped,
            "hung": self.hung,
            "cut": self.cut,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "arrivals": list(self.arrivals),
            "refused_arrivals": list(self.refused_arrivals),
        }
