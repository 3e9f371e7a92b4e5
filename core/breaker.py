"""The circuit breaker a model actor consults before every call.

Theory of operation
-------------------
The breaker stops calling a provider that is failing, and probes it back.

    CLOSED --TRIP--> OPEN --COOLDOWN_ELAPSED--> HALF_OPEN --PROBE_SUCCEEDED--> CLOSED
                      ^                            |
                      +-------PROBE_FAILED---------+
    (any state) --TRIP--> OPEN        (a forced trip: ``trip``)

``TRANSITIONS`` below is the whole state machine; ``next_state`` is the only
way the state changes, and an event the table does not list raises
``IllegalTransition`` before anything is modified.

* CLOSED: every call is allowed. Results count: OUTAGE and SUCCESS add to a
  sliding window of (time, ok) pairs; NEUTRAL counts neither way. The
  breaker trips on ``consecutive_failures`` OUTAGEs in a row, or when the
  window (the last ``window_s``) holds at least ``min_calls`` calls and its
  failures are at least ``failure_rate`` of its calls plus the calls still
  outstanding. A FATAL result (the provider refuses our key or quota) opens
  it at once.

  Both rules ignore the order results arrive in: a provider that fails fast
  and succeeds slowly returns its failures first (counted by arrival, a 10%
  error rate at 200 in flight would look like twenty failures in a row). So
  "in a row" is in *issue* order (each permit carries a sequence number): a
  run is consecutively issued calls that all ended in OUTAGE, NEUTRAL ones
  passed over, none still outstanding; and the rate counts calls still out
  as not failed (yet).
* OPEN: every call is rejected until ``reopen_at = opened + cooldown``. At or
  after ``reopen_at`` it moves to HALF_OPEN: on the owner's timer (``advance``),
  or at the first ``before_call``, whichever comes first.
* HALF_OPEN: up to ``half_open_probes`` calls (probes) may be outstanding.
  A probe's SUCCESS closes the breaker and resets the cooldown; its OUTAGE
  reopens it with ``cooldown *= backoff`` (capped at ``max_cooldown_s``); its
  NEUTRAL, or a ``release``, frees its slot.

Every allowed call gets a permit (``Allow``), handed back to ``record`` or
``release``; its ``epoch`` tells a probe of the current half-open round from a
late result, so only current probes move the state out of HALF_OPEN (while
OPEN every result is late and ignored) and the probe count stays exact.

What always holds: no call is allowed while OPEN before ``reopen_at``; at most
``half_open_probes`` probes are outstanding; ``reopen_at`` never decreases
while OPEN; a NEUTRAL result never changes the state; memory is bounded (the
window by time and by ``max_window_calls``).
Pure: no threads, no I/O, no clock -- every call takes ``now``.
"""

from __future__ import annotations

import enum
import math
import types
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from callboard.core.outcome import Signal
from callboard.messages import BreakerState, ConfigError, is_number

__all__ = [
    "TRANSITIONS",
    "Allow",
    "BreakerConfig",
    "BreakerEvent",
    "CircuitBreaker",
    "IllegalTransition",
    "Reject",
    "next_state",
]

_RUN_REACH = 64
"""How many settled calls a run may span per failure it needs (see ``_run_through``)."""


class BreakerEvent(enum.Enum):
    """What makes a breaker change state."""

    TRIP = "trip"
    COOLDOWN_ELAPSED = "cooldown_elapsed"
    PROBE_SUCCEEDED = "probe_succeeded"
    PROBE_FAILED = "probe_failed"


_C, _O, _H = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

TRANSITIONS: Mapping[tuple[BreakerState, BreakerEvent], BreakerState] = types.MappingProxyType(
    {
        (_C, BreakerEvent.TRIP): _O,
        (_O, BreakerEvent.TRIP): _O,
        (_H, BreakerEvent.TRIP): _O,
        (_O, BreakerEvent.COOLDOWN_ELAPSED): _H,
        (_H, BreakerEvent.PROBE_SUCCEEDED): _C,
        (_H, BreakerEvent.PROBE_FAILED): _O,
    }
)
"""The state machine: (state, event) -> next state. Nothing else is legal."""


class IllegalTransition(RuntimeError):  # noqa: N818 - the name the design gives this error
    """An event the transition table does not allow in the current state (our bug)."""

    def __init__(self, state: BreakerState, event: BreakerEvent) -> None:
        super().__init__(f"illegal breaker transition: {event.name} in state {state.name}")
        self.state = state
        self.event = event


def next_state(state: BreakerState, event: BreakerEvent) -> BreakerState:
    """Look up the transition table; raise ``IllegalTransition`` for a pair it lacks."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise IllegalTransition(state, event) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerConfig:
    """When a breaker opens and how long it stays open."""

    consecutive_failures: int = 5
    """Open after this many OUTAGEs in a row."""
    window_s: float = 30.0
    """The failure-rate window, in seconds."""
    min_calls: int = 10
    """The rate rule needs at least this many non-neutral calls in the window."""
    failure_rate: float = 0.5
    """Open when the failed fraction of the window reaches this (0 < rate <= 1)."""
    cooldown_s: float = 5.0
    """How long the first opening lasts."""
    max_cooldown_s: float = 120.0
    """The cap on the cooldown as failed probes lengthen it."""
    backoff: float = 2.0
    """Each failed probe multiplies the cooldown by this (>= 1)."""
    half_open_probes: int = 1
    """How many probe calls may be outstanding while half-open."""
    max_window_calls: int = 10_000
    """Hard cap on remembered window entries (the oldest are dropped first)."""
    give_up_s: float | None = None
    """A model whose breaker has not closed for this long since it opened is given
    up on: tasks no other model can take end ``Failed(PROVIDER_DOWN)`` naming its
    last error, until a probe closes it again. None: the system's ``give_up_s`` (60 s
    unless set; a bare breaker: never); ``inf``: never (a deadline still ends a task)."""

    def __post_init__(self) -> None:
        for name in ("consecutive_failures", "min_calls", "half_open_probes", "max_window_calls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("window_s", "cooldown_s", "max_cooldown_s", "backoff", "failure_rate"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        g = self.give_up_s
        if g is not None and not (is_number(g) and g > 0):  # inf: never
            raise ConfigError(f"give_up_s must be None or a number > 0, got {g!r}")
        if self.failure_rate > 1:
            raise ConfigError(f"failure_rate must be in (0, 1], got {self.failure_rate!r}")
        if self.backoff < 1:
            raise ConfigError(f"backoff must be >= 1, got {self.backoff!r}")
        if self.max_cooldown_s < self.cooldown_s:
            raise ConfigError(
                f"max_cooldown_s must be >= cooldown_s ({self.cooldown_s!r}), "
                f"got {self.max_cooldown_s!r}"
            )
        if self.max_window_calls < self.min_calls:
            raise ConfigError(
                f"max_window_calls must be >= min_calls ({self.min_calls}), "
                f"got {self.max_window_calls}"
            )


@dataclass(frozen=True, slots=True)
class Allow:
    """The call may go. Hand this permit back to ``record`` or ``release``."""

    probe: bool = False
    """True when the call is a half-open probe."""
    epoch: int = 0
    """The half-open round the probe belongs to (meaningless when not a probe)."""
    seq: int = field(default=-1, compare=False)
    """The call's place in issue order (-1 outside the breaker's own permits)."""


@dataclass(frozen=True, slots=True)
class Reject:
    """The call may not go now."""

    until: float | None
    """When to ask again (``reopen_at``), or None: when an outstanding probe finishes."""


class CircuitBreaker:
    """A circuit breaker driven by an explicit clock (see the module docstring)."""

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self._state = BreakerState.CLOSED
        self._reopen_at: float | None = None
        self._cooldown = self.config.cooldown_s
        self._consecutive = 0
        self._issued = 0
        self._closed_from = 0
        """The first seq issued since the breaker last closed (older permits are stale)."""
        self._outstanding = 0
        """Calls allowed since then and not yet recorded or released."""
        self._outcomes: dict[int, Signal] = {}
        """Recent closed-state outcomes by issue seq, for runs in issue order."""
        self._window: deque[tuple[float, bool]] = deque()
        self._window_failures = 0
        self._probes = 0
        self._epoch = 0
        self._down_since: float | None = None

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def reopen_at(self) -> float | None:
        """When an open breaker admits probes; None unless OPEN."""
        return self._reopen_at

    @property
    def down_since(self) -> float | None:
        """When it last opened from CLOSED (open or half-open since); None if CLOSED."""
        return self._down_since

    def given_up_at(self) -> float | None:
        """When this model is given up on (``give_up_s`` after ``down_since``): None if
        it is closed or never given up on. It is given up on from then while OPEN;
        half-open, it is not (its probe needs a task)."""
        give_up_s = self.config.give_up_s
        if self._down_since is None or give_up_s is None or math.isinf(give_up_s):
            return None
        return self._down_since + give_up_s

    # -- asking ---------------------------------------------------------------

    def before_call(self, now: float) -> Allow | Reject:
        """May a call go now? An ``Allow`` in HALF_OPEN takes a probe slot."""
        if self._state is BreakerState.OPEN and not self.advance(now):
            assert self._reopen_at is not None
            return Reject(self._reopen_at)
        if self._state is BreakerState.HALF_OPEN:
            if self._probes >= self.config.half_open_probes:
                return Reject(None)
            self._probes += 1
            return Allow(probe=True, epoch=self._epoch, seq=self._next_seq())
        self._outstanding += 1
        return Allow(seq=self._next_seq())

    def _next_seq(self) -> int:
        seq = self._issued
        self._issued = seq + 1
        return seq

    def advance(self, now: float) -> bool:
        """Half-open once the cool-down is over (``now >= reopen_at``), on the owner's
        timer, so probes go out without waiting for work. True if it moved."""
        if self._state is not BreakerState.OPEN:
            return False
        assert self._reopen_at is not None
        if now < self._reopen_at:
            return False
        self._fire(now, BreakerEvent.COOLDOWN_ELAPSED)
        self._reopen_at = None
        self._probes = 0
        self._epoch += 1
        return True

    def capacity(self, now: float) -> int | None:
        """How many calls ``before_call`` would allow now: None for unlimited (CLOSED)."""
        if self._state is BreakerState.CLOSED:
            return None
        if self._state is BreakerState.OPEN:
            assert self._reopen_at is not None
            return 0 if now < self._reopen_at else self.config.half_open_probes
        return self.config.half_open_probes - self._probes

    # -- telling --------------------------------------------------------------

    def release(self, now: float, permit: Allow) -> None:  # noqa: ARG002 - uniform clocked API
        """An allowed call was not sent after all: give back its probe slot."""
        if self._is_current_probe(permit):
            self._probes -= 1
        elif self._state is BreakerState.CLOSED:
            self._settled(permit)
            self._remember(permit.seq, Signal.NEUTRAL)  # a run passes over it

    def record(self, now: float, signal: Signal, permit: Allow) -> None:
        """Learn the outcome of a call that ``before_call`` allowed with ``permit``.
        A FATAL one counts as an OUTAGE and, closed, opens the breaker at once; an
        outcome of a call allowed before the breaker last closed counts for nothing."""
        fatal = signal is Signal.FATAL
        if fatal:
            signal = Signal.OUTAGE
        if self._is_current_probe(permit):
            self._record_probe(now, signal)
        elif self._state is BreakerState.CLOSED and self._stale(permit):
            self._remember(permit.seq, Signal.NEUTRAL)  # a run passes over it
        elif self._state is BreakerState.CLOSED:
            self._settled(permit)
            self._record_closed(now, signal, permit.seq)
            if fatal and self._state is BreakerState.CLOSED:
                self.trip(now)
        # Otherwise (OPEN, or HALF_OPEN and not a current probe) it is a late
        # result of a call that started before the breaker opened: ignored. So is
        # one that ends after it closed again (``_stale``): five calls sent before an
        # outage, timing out after the probe that closed it, opened it again; so did
        # the closing round's other probes (found by a hunt).

    def trip(self, now: float, until: float | None = None) -> None:
        """Open now (from any state) until ``until``, default ``now + cooldown``.

        For a provider that announced an outage. Never shortens an open breaker.
        """
        target = now + self._cooldown if until is None else until
        previous = self._reopen_at if self._state is BreakerState.OPEN else None
        self._fire(now, BreakerEvent.TRIP)
        self._open_until(target if previous is None else max(previous, target))

    def inherit(self, predecessor: CircuitBreaker, now: float) -> None:
        """Take over a breaker whose owner died: open stays open until the same time,
        half-open reopens now (the next call is a probe), the cool-down backed off as
        far as it was; closed stays closed. Counts start afresh (the old owner's calls
        in flight report to nobody)."""
        if predecessor.state is BreakerState.CLOSED:
            return
        self._cooldown = predecessor._cooldown
        self.trip(now, until=predecessor.reopen_at or now)
        self._down_since = predecessor.down_since

    # -- inside ---------------------------------------------------------------

    def _is_current_probe(self, permit: Allow) -> bool:
        return (
            permit.probe and permit.epoch == self._epoch and self._state is BreakerState.HALF_OPEN
        )

    def _stale(self, permit: Allow) -> bool:
        """Allowed before the breaker last closed: a probe of the round that closed it,
        or a call sent before it opened. Its outcome tells of that time, not of now."""
        return permit.probe or permit.seq < self._closed_from

    def _settled(self, permit: Allow) -> None:
        if permit.seq >= self._closed_from and not permit.probe:
            self._outstanding -= 1

    def _record_probe(self, now: float, signal: Signal) -> None:
        if signal is Signal.NEUTRAL:
            self._probes -= 1
        elif signal is Signal.SUCCESS:
            self._fire(now, BreakerEvent.PROBE_SUCCEEDED)
            self._cooldown = self.config.cooldown_s
            self._reopen_at = None
            self._probes = 0
            self._reset_counts()
        else:
            self._fire(now, BreakerEvent.PROBE_FAILED)
            cfg = self.config
            self._cooldown = min(self._cooldown * cfg.backoff, cfg.max_cooldown_s)
            self._open_until(now + self._cooldown)

    def _record_closed(self, now: float, signal: Signal, seq: int) -> None:
        self._remember(seq, signal)
        if signal is Signal.NEUTRAL:  # never changes the state, even if it joins a run
            return
        failed = signal is Signal.OUTAGE
        self._consecutive = self._run_through(seq) if failed else 0
        self._window.append((now, not failed))
        self._window_failures += failed
        if len(self._window) > self.config.max_window_calls:
            self._drop_oldest()
        self._prune(now)
        if failed and self._should_trip():
            self._fire(now, BreakerEvent.TRIP)
            self._open_until(now + self._cooldown)

    def _remember(self, seq: int, signal: Signal) -> None:
        outcomes = self._outcomes
        outcomes[seq] = signal
        limit = self.config.max_window_calls
        if len(outcomes) > 2 * limit:  # forget the oldest issued: O(1) amortized
            horizon = self._issued - limit
            self._outcomes = {k: v for k, v in outcomes.items() if k >= horizon}

    def _run_through(self, seq: int) -> int:
        """The OUTAGEs in the run of settled calls around ``seq`` (issue order).

        Counting stops once the run is long enough to trip, and a stretch of
        more than ``_RUN_REACH`` calls per needed failure (NEUTRAL ones, say
        429s) ends the walk: O(consecutive_failures) per failure.
        """
        outcomes, need = self._outcomes, self.config.consecutive_failures
        reach = min(self.config.max_window_calls, _RUN_REACH * need)
        run = 1
        for step in (-1, 1):
            at = seq + step
            for _ in range(reach):
                if run >= need:
                    return run
                signal = outcomes.get(at)
                if signal is None or signal is Signal.SUCCESS:  # outstanding, or a success
                    break
                run += signal is Signal.OUTAGE
                at += step
        return run

    def _should_trip(self) -> bool:
        cfg = self.config
        if self._consecutive >= cfg.consecutive_failures:
            return True
        calls = len(self._window)
        if calls < cfg.min_calls:
            return False
        # Calls still out count as not failed (yet): failures come back first from a
        # provider that fails fast, and would look like the whole window at start-up.
        return self._window_failures / (calls + self._outstanding) >= cfg.failure_rate

    def _open_until(self, reopen_at: float) -> None:
        self._reopen_at = reopen_at
        self._probes = 0
        self._reset_counts()

    def _reset_counts(self) -> None:
        self._consecutive = 0
        self._outstanding = 0
        self._closed_from = self._issued
        self._outcomes = {}
        self._window.clear()
        self._window_failures = 0

    def _prune(self, now: float) -> None:
        horizon = now - self.config.window_s
        window = self._window
        while window and window[0][0] <= horizon:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, ok = self._window.popleft()
        self._window_failures -= not ok

    def _fire(self, now: float, event: BreakerEvent) -> None:
        source = self._state
        target = next_state(source, event)  # raises before anything changes
        self._state = target
        if source is BreakerState.CLOSED:
            self._down_since = now
        elif target is BreakerState.CLOSED:
            self._down_since = None
