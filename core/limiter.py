"""The rate limiter a model actor consults before every call: it paces, it never sleeps.

Theory of operation
-------------------
Each configured dimension (requests per minute, tokens per minute) is held by
two mechanisms, and a call is admitted only when both dimensions, and any
pause, allow it:

* a pacing token bucket (rate ``limit / 60`` per second, capacity ``burst_s``
  seconds' worth, at least one unit), kept as a theoretical arrival time
  (GCRA): it holds ``capacity - max(0, tat - now) * rate``. A call needs
  ``min(amount, capacity)`` in it, so one larger than the bucket is admitted
  once it is full, and leaves it in debt;
* a hard sliding window: the amounts admitted in the last 60 s, one entry per
  call. Their sum never exceeds the ceiling, the configured or advertised limit
  (a call larger than it is ``TooLarge``: no wait can ever admit it); a limit a
  back-off lowered below it paces through the bucket alone (the window still held
  the calls sent under the old one, and silenced the model up to a minute).

``try_acquire`` answers ``Admit(reservation)`` or ``WaitUntil(at)``, with
``at`` later than ``now`` and computed by the admission test's own
expressions, so asking again at ``at`` with nothing changed admits (the actor
sets one timer for it). ``settle`` moves a reservation to the tokens used,
``release`` takes back one never sent. ``pause_until`` (a 429) blocks
admission until a time, never shortening a pause; ``observe`` lowers the
buckets to what the provider says remains, never raising them.

The provider's word beats the configuration, downwards only: ``adopt`` takes
its advertised limit for a dimension none was configured for, and makes the
latest advertised limit the ceiling of a configured one, never above the
configuration (4x too high a limit would keep drawing 429s; a limit the
provider raises again is used again, up to the configured one), and an answer's
word puts a limit a back-off lowered back at it (``observe`` keeps the bucket to
what remains). A lower limit
is taken when two answers in a row say it, or a 429 does: one answer's glitch
(``limit-tokens: 100``) failed every task larger as ``TooLarge`` until the next
answer (found by a hunt).
Where the provider says nothing of its limits, the limit in force moves
AIMD-fashion, as TCP's window: each congestion's 429 (``back_off``; a 429
before any answer since the last cut is the same congestion) takes it to
``BACK_OFF`` of itself (the request limit never below ``BACK_OFF`` of the rate
the provider answered over the last ``RECENT_S`` seconds: a provider's window
still holds what was sent before a back-off, so its 429s go on for a while
after it, and each cut again), each answer (``recover``) adds ``RECOVER`` of a unit
(of the call's tokens, for the token limit), and each ``RECENT_S`` seconds with no
429 in which the limit binds raise it ``RISE`` times, up to the limit it was cut
from (no bound, where no answers showed the provider took as much), never above the
ceiling (the configured limit, or the advertised one if lower). With no limit at all, the
first 429 while at least ``LEARN_FROM_RPM`` go out makes a request limit from
the rate sent over the last ``RECENT_S`` seconds, with no ceiling (a server
that refuses without a word, no limit configured, drew 259 429s for 39 answers,
each task retrying on its own: found by a hunt); as answers may raise that one
far above what is sent, a 429 takes it to ``BACK_OFF`` of the rate sent, if
lower (and at least ``LEARN_FROM_RPM``).

A provider that limits a call's input and output tokens apart (Anthropic's
ITPM and OTPM, advertised as ``anthropic-ratelimit-{input,output}-tokens-*``)
has each part held as a dimension of its own, made from its word (``adopt_parts``:
there is nothing to configure), beside the tokens of both together: a call whose
``parts`` (its prompt estimate, its ``max_tokens``) are told is admitted only when
each part fits too, is settled to what each part used (``settle(actual_parts=)``)
and ``observe_parts`` lowers each to what remains of it. Taken as one limit of their
sum, input-heavy calls went past the input limit while the sum had room (a third
of them drew 429s; found by a hunt).

What always holds: requests admitted in any 60 s <= the ceiling (<= rpm);
tokens admitted in any 60 s (after settlement) <= tpm; nothing is admitted
before a pause ends; window memory is bounded by the limit. Times are monotonic
seconds; a ``now`` earlier than one already seen counts as the latest seen.
``read_headers`` and friends, at the end, read a response's rate-limit headers.
"""

from __future__ import annotations

import email.utils
import functools
import itertools
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from callboard.messages import ConfigError, is_number

__all__ = [
    "BACK_OFF",
    "RECOVER",
    "RISE",
    "UNLIMITED",
    "WINDOW_S",
    "Admit",
    "Headroom",
    "LimiterConfig",
    "RateLimitHeaders",
    "RateLimiter",
    "Reservation",
    "TooLarge",
    "WaitUntil",
    "parse_duration",
    "parse_retry_after",
    "read_headers",
]

WINDOW_S = 60.0
"""The hard window, in seconds: limits are per minute."""
RECENT_S = 10
"""The seconds of calls a back-off measures the rate sent over."""
LEARN_FROM_RPM = 120.0
"""The least rate sent (per minute, over ``RECENT_S``) from which a 429 with no limit
anywhere makes one: a 429 on a quiet model says nothing of its pace (one such 429 made
a limit of 4.5 a minute, and a burst of 30 calls then took 38 s; found by a hunt)."""
BACK_OFF = 0.75
"""A 429 lowers the limit in force to this fraction of itself (never below 1)."""
RECOVER = 0.1
"""Each answer raises the limit in force by this much of a unit, up to its ceiling."""
RISE = 1.25
"""Each ``RECENT_S`` seconds with no 429 in which a backed-off limit binds raise it this
many times, up to the limit it was cut from (``_Dimension.fast_to``)."""
BINDS = 0.8
"""A limit binds when at least this much of it was admitted over a step."""
UNLIMITED = 2**31 - 1
"""What ``grantable`` answers when no configured limit applies."""


@dataclass(frozen=True, slots=True)
class LimiterConfig:
    """A model's published limits."""

    rpm: float | None
    """Requests per minute, or None for no request limit (>= 1)."""
    tpm: float | None
    """Tokens per minute, or None for no token limit (>= 1)."""
    burst_s: float = 0.5
    """The bucket holds this many seconds' worth of each limit (0 < burst_s <= 60)."""
    refunds: bool | None = None
    """Whether the provider's token limit gives back what an answered call reserved and
    did not use (None: as its API does, ``ModelSettings.refunds_tokens``)."""

    def __post_init__(self) -> None:
        # a ConfigError (a ValueError): ``except UsageError`` missed these (a hunt)
        if self.refunds is not None and not isinstance(self.refunds, bool):
            raise ConfigError(f"refunds must be None or a boolean, got {self.refunds!r}")
        for name in ("rpm", "tpm"):
            value = getattr(self, name)
            if value is None:
                continue
            if not (is_number(value) and math.isfinite(value) and value >= 1):
                raise ConfigError(f"{name} must be None or a finite number >= 1, got {value!r}")
        b = self.burst_s
        if not (is_number(b) and 0 < b <= WINDOW_S):
            raise ConfigError(f"burst_s must be a number in (0, 60], got {b!r}")


@dataclass(frozen=True, slots=True)
class Reservation:
    """An admitted call's claim on the limits; settle or release it exactly once."""

    id: int
    tokens: int
    """The tokens reserved (the estimate: prompt + max_tokens)."""
    at: float = 0.0
    """When it was admitted."""
    tokens_before: int = 0
    """The tokens reserved by every call admitted before it (a running total)."""
    parts: tuple[int, int] | None = None
    """Of ``tokens``, the (input, output) it was admitted with (its prompt, its cap),
    held apart where the provider limits them apart; None: not told."""
    parts_before: tuple[int, int] = (0, 0)
    """The parts reserved by every call admitted before it, each a running total."""


@dataclass(frozen=True, slots=True)
class Admit:
    """The call may go now."""

    reservation: Reservation


@dataclass(frozen=True, slots=True)
class WaitUntil:
    """Ask again at ``at`` (always later than the ``now`` asked at)."""

    at: float


@dataclass(frozen=True, slots=True)
class TooLarge:
    """The call needs more tokens than the limit admits in a whole minute: never."""

    tokens: int
    limit: float


@dataclass(frozen=True, slots=True)
class Headroom:
    """What could be admitted right now, per dimension (None: unlimited)."""

    requests: float | None
    tokens: float | None
    paused_until: float | None
    """The end of the pause in force, or None."""


class _Charge:
    """One admitted call's entry in a window (mutable: settlement adjusts it)."""

    __slots__ = ("amount", "expires_at")

    def __init__(self, expires_at: float, amount: int) -> None:
        self.expires_at = expires_at
        self.amount = amount


class _Dimension:
    """One limit (requests or tokens): a GCRA bucket plus a hard 60 s window."""

    def __init__(
        self, limit: float, burst_s: float, now: float, *, configured: float | None = None
    ) -> None:
        self.configured = limit if configured is None else configured
        """The configured limit (``math.inf``: none, one learned): no ceiling above it."""
        self.ceiling = limit
        """The most the limit in force may be: configured, or advertised if lower."""
        self.pending: float | None = None
        """A lower ceiling said once, taken when said again (or by a 429): one answer's
        glitch (``limit-tokens: 100``) failed every task larger as ``TooLarge`` until
        the next answer, and paced as the limit it stalled the model a window long."""
        self.burst_s = burst_s
        self.limit = limit
        self.rate = limit / WINDOW_S
        self.capacity = max(1.0, limit * burst_s / WINDOW_S)
        self._tat = now  # full bucket
        self._window: deque[_Charge] = deque()
        self._used = 0
        self.admitted = 0
        """The units ever admitted (a running total, for ``climbed``)."""
        self.fast_to = 0.0
        """The limit the last back-off cut from: ``climbed`` rises towards it."""
        self._step_at = now
        self._step_from = 0

    def restep(self, now: float) -> None:
        """Start a new step of ``climbed`` at ``now`` (a 429 came: no rise for a while)."""
        self._step_at, self._step_from = now, self.admitted

    def climbed(self, now: float) -> float:
        """The limit in force, ``RISE`` times higher (up to ``fast_to``) when a step of
        ``RECENT_S`` seconds has passed since the last one, or the last 429, in which at
        least ``BINDS`` of it was admitted (a limit that does not bind says nothing of
        what the provider takes)."""
        elapsed = now - self._step_at
        if elapsed < RECENT_S:
            return self.limit
        binding = self.admitted - self._step_from >= BINDS * self.limit * elapsed / WINDOW_S
        self.restep(now)
        if binding and self.limit < self.fast_to:
            return min(self.limit * RISE, self.fast_to)
        return self.limit

    def relimit(self, now: float, limit: float) -> None:
        """Put ``limit`` in force (within [1, ceiling]); the bucket keeps its level,
        up to the new capacity, and the window its charges."""
        limit = max(1.0, min(limit, self.ceiling))
        if limit == self.limit:
            return
        level = self.capacity - max(0.0, self._tat - now) * self.rate
        self.limit = limit
        self.rate = limit / WINDOW_S
        self.capacity = max(1.0, limit * self.burst_s / WINDOW_S)
        self._tat = now + (self.capacity - min(level, self.capacity)) / self.rate

    def ready_at(self, now: float, amount: int) -> float:
        """The earliest time both checks pass for ``amount`` (<= now: they pass now)."""
        need = min(amount, self.capacity)
        bucket_at = self._tat - (self.capacity - need) / self.rate
        return max(bucket_at, self._window_ready_at(now, amount))

    def _window_ready_at(self, now: float, amount: int) -> float:
        self._prune(now)
        # held to the ceiling (the configured or advertised limit), not to a limit a
        # back-off lowered, which paces through the bucket alone: the calls admitted
        # under the old one (and those refused) filled the window past the new one, and
        # silenced the model for up to a minute (found by a hunt). A call above it is
        # TooLarge; an infinite (learned) ceiling holds nothing here
        ceiling = self.ceiling
        excess = self._used + min(amount, ceiling) - ceiling
        if excess <= 0:
            return now
        freed = 0
        for charge in self._window:
            freed += charge.amount
            if freed >= excess:
                return charge.expires_at
        raise AssertionError("unreachable: amount exceeds the window limit")

    def admit(self, now: float, amount: int) -> _Charge:
        self._tat = max(self._tat, now) + amount / self.rate
        self.admitted += amount
        charge = _Charge(now + WINDOW_S, amount)
        self._window.append(charge)
        self._used += amount
        return charge

    def adjust(self, now: float, charge: _Charge, delta: int) -> None:
        """Charge (``delta > 0``) or refund (``delta < 0``) an admitted call."""
        if delta > 0:
            self._tat = max(self._tat, now) + delta / self.rate
        else:
            self._tat += delta / self.rate
        self._prune(now)
        if charge.expires_at <= now:  # already out of the window
            return
        charge.amount += delta
        self._used += delta
        if charge.amount == 0:
            self._window.remove(charge)

    def lower_to(self, now: float, remaining: float) -> None:
        """Lower the bucket to ``remaining`` units if it holds more; never raise it."""
        self._tat = max(self._tat, now + (self.capacity - remaining) / self.rate)

    def told(
        self,
        now: float,
        remaining: int | None,
        reset_s: float | None,
        sent_at: float | None,
        admitted_since: int,
    ) -> None:
        """What the provider says remains, counted when the call sent at ``sent_at``
        (None: now) reached it: the bucket lowered to that, plus what refilled since,
        less ``admitted_since`` (see ``RateLimiter.observe``). Nothing said, or a count
        whose reset is already due (stale), changes nothing."""
        if remaining is None or (reset_s is not None and reset_s <= 0):
            return
        refilled = 0.0 if sent_at is None else (now - sent_at) * self.rate
        self.lower_to(now, max(0.0, remaining + refilled - admitted_since))

    def headroom(self, now: float) -> float:
        self._prune(now)
        level = self.capacity - max(0.0, self._tat - now) * self.rate
        return min(level, self.ceiling - self._used)

    def refilled(self, now: float) -> bool:
        """Whether the headroom is all it can be: the bucket full, the window with room
        for it."""
        return self.headroom(now) >= min(self.capacity, self.ceiling)

    def grantable(self, now: float, amount: int) -> int:
        """How many admissions of ``amount`` would pass back to back at ``now``, to
        within one: the bucket's level is a float, and its rounding here and in the
        admissions' own sums may differ by one at the edge (a hunt). A credit too many
        comes back as its job is handed back; one too few waits for the next grant."""
        if self.ready_at(now, amount) > now:  # the very test admission applies
            return 0
        level = self.capacity - max(0.0, self._tat - now) * self.rate
        by_bucket = math.floor((level - min(amount, self.capacity)) / amount) + 1
        room = self.ceiling - self._used
        by_window = math.floor(room / amount) if room < math.inf else by_bucket
        return max(1, min(by_bucket, by_window))

    def _prune(self, now: float) -> None:
        window = self._window
        while window and window[0].expires_at <= now:
            self._used -= window.popleft().amount


class _Recent:
    """How much was admitted (or answered) lately, by second: a ring of ``RECENT_S``
    counts, one add and no allocation a call (a list of times would hold a minute of
    calls)."""

    __slots__ = ("_counts", "_stamps")

    def __init__(self) -> None:
        self._counts = [0] * RECENT_S
        self._stamps = [-1] * RECENT_S

    def add(self, now: float, amount: int = 1) -> None:
        second = int(now)
        i = second % RECENT_S
        if self._stamps[i] != second:
            self._stamps[i] = second
            self._counts[i] = 0
        self._counts[i] += amount

    def per_minute(self, now: float) -> float:
        """The rate of the last ``RECENT_S`` seconds, per minute: over all of them,
        however recent the first call (over the time since it, the first calls of a
        burst made a rate ten times what was sent over ten seconds, and a limit that
        took 18 minutes to recover; found by a hunt)."""
        second = int(now)
        count = sum(
            n for n, at in zip(self._counts, self._stamps, strict=True) if second - at < RECENT_S
        )
        covered = RECENT_S - 1 + (now - second)  # this second so far, and those before
        return count * WINDOW_S / covered


_Parts = tuple[tuple[_Dimension, _Charge] | None, tuple[_Dimension, _Charge] | None]
"""An outstanding reservation's entries in the (input, output) windows, each with its
dimension (None: that part not held)."""
_Held = tuple[_Charge | None, _Charge | None, _Parts | None]
"""An outstanding reservation's entries in the (requests, tokens) windows, and its parts'."""


class RateLimiter:
    """Paces calls under rpm and tpm limits (see the module docstring)."""

    def __init__(self, config: LimiterConfig, now: float, *, refunds: bool = True) -> None:
        self.config = config
        self.refunds = refunds
        """Whether the provider's token limit gives back what an answered call reserved
        and did not use (``attempt.tokens_used``; ``ModelSettings.refunds_tokens``)."""
        self._now = _finite("now", now)
        rpm, tpm = config.rpm, config.tpm
        self._requests = None if rpm is None else _Dimension(rpm, config.burst_s, now)
        self._tokens = None if tpm is None else _Dimension(tpm, config.burst_s, now)
        self._paused_until: float | None = None
        self._held: dict[int, _Held] = {}
        self._ids = itertools.count(1)
        self._last_id = 0
        self._tokens_admitted = 0
        self._backed_off_through = 0
        """The last reservation id issued when the limit last backed off."""
        self._answered_since = True
        """A call admitted after the last back-off was answered: a 429 now is news."""
        self._recent = _Recent()
        self._served = _Recent()
        """The answers of the last ``RECENT_S`` seconds: what the provider just took."""
        self._input: _Dimension | None = None
        self._output: _Dimension | None = None
        """The input and output token limits, where the provider says them apart."""
        self._parts_admitted = (0, 0)

    def try_acquire(
        self, now: float, tokens: int, parts: tuple[int, int] | None = None
    ) -> Admit | WaitUntil | TooLarge:
        """Admit a call of ``tokens`` now, or say when it could be admitted; ``parts``:
        its (input, output) tokens, for a provider that limits them apart."""
        now = self._tick(now)
        if not (_is_int(tokens) and tokens >= 1):
            raise ValueError(f"tokens must be an integer >= 1, got {tokens!r}")
        if self._tokens is not None and tokens > self._tokens.ceiling:
            return TooLarge(tokens, self._tokens.ceiling)
        split = self._split(parts)
        for dim, amount in split:
            if amount > dim.ceiling:
                return TooLarge(amount, dim.ceiling)
        at = self._ready_at(now, tokens)
        for dim, amount in split:
            at = max(at, dim.ready_at(now, amount))
        if at > now:
            return WaitUntil(at)
        req = None if self._requests is None else self._requests.admit(now, 1)
        tok = None if self._tokens is None else self._tokens.admit(now, tokens)
        held: _Parts | None = None
        if split:
            assert parts is not None
            held = (_charged(self._input, now, parts[0]), _charged(self._output, now, parts[1]))
        self._last_id = next(self._ids)
        self._recent.add(now)
        reservation = Reservation(
            id=self._last_id,
            tokens=tokens,
            at=now,
            tokens_before=self._tokens_admitted,
            parts=parts,
            parts_before=self._parts_admitted,
        )
        self._tokens_admitted += tokens
        if parts is not None:
            before = self._parts_admitted
            self._parts_admitted = (before[0] + parts[0], before[1] + parts[1])
        self._held[reservation.id] = (req, tok, held)
        return Admit(reservation)

    def settle(
        self,
        now: float,
        reservation: Reservation,
        actual_tokens: int,
        actual_parts: tuple[int, int] | None = None,
    ) -> None:
        """The call finished having used ``actual_tokens`` (``actual_parts`` of its
        input and output, where they are held apart; None: as reserved): refund or
        charge the difference."""
        now = self._tick(now)
        if not (_is_int(actual_tokens) and actual_tokens >= 0):
            raise ValueError(f"actual_tokens must be an integer >= 0, got {actual_tokens!r}")
        _, tok, held = self._take(reservation)
        if self._tokens is not None and tok is not None:
            self._tokens.adjust(now, tok, actual_tokens - reservation.tokens)
        if held is not None and reservation.parts is not None and actual_parts is not None:
            for entry, reserved, used in zip(held, reservation.parts, actual_parts, strict=True):
                if entry is not None and used != reserved:
                    entry[0].adjust(now, entry[1], max(0, used) - reserved)

    def release(self, now: float, reservation: Reservation) -> None:
        """The admitted call was never sent: give back everything it reserved."""
        now = self._tick(now)
        req, tok, held = self._take(reservation)
        if self._requests is not None and req is not None:
            self._requests.adjust(now, req, -1)
        if self._tokens is not None and tok is not None:
            self._tokens.adjust(now, tok, -reservation.tokens)
        if held is not None and reservation.parts is not None:
            for entry, reserved in zip(held, reservation.parts, strict=True):
                if entry is not None:
                    entry[0].adjust(now, entry[1], -reserved)

    def _split(self, parts: tuple[int, int] | None) -> list[tuple[_Dimension, int]]:
        """The part dimensions a call of ``parts`` must fit, with its amount in each."""
        if parts is None or (self._input is None and self._output is None):
            return []
        return [
            (d, n) for d, n in ((self._input, parts[0]), (self._output, parts[1])) if d is not None
        ]

    def adopt_parts(
        self, now: float, limits: tuple[int | None, int | None], *, sure: bool = False
    ) -> None:
        """Take the provider's (input, output) token limits per minute: a part with none
        yet gets one, whose bucket holds the whole minute (Anthropic's are token buckets
        "continuously replenished up to your maximum limit"; the 60 s window still holds
        the minute to the limit, and what remains of it is read from each answer): paced
        at half a second's worth, a 900-token prompt against 3,000 a minute waited 18 s
        for the next. One it had follows the provider's latest word, up or down (there
        is no configured one to stay within), a lower one as ``adopt`` takes it: said
        twice in a row, or at once when ``sure`` (a 429 said it)."""
        now = self._tick(now)
        for name, advertised in zip(("_input", "_output"), limits, strict=True):
            if advertised is None or advertised < 1:
                continue
            dim: _Dimension | None = getattr(self, name)
            if dim is None:
                made = _Dimension(advertised, WINDOW_S, now, configured=math.inf)
                setattr(self, name, made)
            elif _taken(dim, advertised, sure=sure) and advertised != dim.ceiling:
                dim.ceiling = advertised
                dim.relimit(now, advertised)

    def observe_parts(
        self,
        now: float,
        remaining: tuple[int | None, int | None],
        reset_s: tuple[float | None, float | None],
        *,
        since: Reservation | None = None,
    ) -> None:
        """``observe`` for the input and output limits: lower each part's bucket to
        what the provider says remains of it, counted as ``observe`` counts."""
        now = self._tick(now)
        dims = (self._input, self._output)
        sent_at = None if since is None else since.at
        for i, (dim, left, reset) in enumerate(zip(dims, remaining, reset_s, strict=True)):
            if dim is None:
                continue
            after = 0
            if since is not None:
                own = 0 if since.parts is None else since.parts[i]
                after = self._parts_admitted[i] - since.parts_before[i] - own
            dim.told(now, left, reset, sent_at, after)

    def parts_limits(self) -> tuple[float | None, float | None]:
        """The (input, output) per-minute limits in force (None: not held apart)."""
        return (
            None if self._input is None else self._input.limit,
            None if self._output is None else self._output.limit,
        )

    def pause_until(self, at: float) -> None:
        """Admit nothing before ``at`` (a 429's reset); never shortens a pause."""
        at = _finite("at", at)
        if self._paused_until is None or at > self._paused_until:
            self._paused_until = at

    def adopt(
        self,
        now: float,
        limit_requests: int | None,
        limit_tokens: int | None,
        *,
        unset_too: bool = False,
        sure: bool = False,
    ) -> None:
        """Take the provider's advertised per-minute limits as the ceilings, within the
        configured ones: a lower one lowers the limit in force with it; a higher one (the
        provider raised it, or a lower one was a passing word) raises a limit in force
        that stood at the old ceiling (one that backs off recovers as always). Taken
        down only, one answer's ``limit-tokens: 100`` failed every later task of 128
        tokens, and an account's limit raised mid-run was never used (found by a hunt).
        With ``unset_too`` (after a 429), a dimension with no limit takes one, its
        bucket holding one unit (the provider's burst is unknown), and no configured
        ceiling. A lower ceiling is taken when said twice in a row, or at once when
        ``sure`` (a 429 said it: ``_taken``)."""
        now = self._tick(now)
        for name, advertised in (("_requests", limit_requests), ("_tokens", limit_tokens)):
            if advertised is None or advertised < 1:
                continue
            dim: _Dimension | None = getattr(self, name)
            if dim is None:
                if unset_too:  # a bucket of one request; of the whole minute of tokens,
                    # which holds any call that fits (one token: a 1708-token call went
                    # as soon as one had refilled, whatever remained; found by a hunt)
                    burst_s = WINDOW_S / advertised if name == "_requests" else WINDOW_S
                    made = _Dimension(advertised, burst_s, now, configured=math.inf)
                    setattr(self, name, made)
                continue
            ceiling = min(advertised, dim.configured)
            if not _taken(dim, ceiling, sure=sure):
                continue
            if ceiling < dim.ceiling and (sure or dim.limit >= ceiling):
                dim.ceiling = ceiling
                dim.relimit(now, min(dim.limit, ceiling))
                # the 429s of calls admitted before this were the old limit's doing
                self._backed_off_through = self._last_id
            elif ceiling != dim.ceiling or (not sure and dim.limit < ceiling):
                # an answer's word puts a limit a back-off learned back in force (what
                # remains, ``observe``, keeps the bucket safe): held at the cut, every
                # answer saying 3000 left it at 231 (found by a hunt); a 429's word
                # raises only a limit that stood at the old ceiling
                stood_at = dim.limit >= dim.ceiling
                dim.ceiling = ceiling
                if stood_at or not sure:
                    dim.relimit(now, ceiling)

    def back_off(self, now: float, refused: Reservation, *, tokens_spent: bool = False) -> None:
        """A 429 for the call admitted as ``refused``: lower the request limit in force
        (the token limit if the provider said tokens ran out, or there is no request
        limit; the request limit if there is no token limit, whatever ran out: pacing
        the requests is then the one way to slow down) to ``BACK_OFF`` of itself; with
        no limit at all, a request limit from the rate sent lately (see the module
        docstring); never below ``BACK_OFF`` of the rate the provider answered over
        the last ``RECENT_S`` seconds. Once per congestion, as TCP does: a
        429 for a call admitted before the last back-off (or the last lowering by
        ``adopt``) is the same one, and changes nothing; so is one before any answer
        came since the last back-off: a provider refusing everything says nothing of
        the rate it takes (4 s of 429s, each with ``Retry-After: 1``, cut the limit five
        times, to a quarter of what it then served, and at ``RECOVER`` an answer it took
        minutes to come back; found by a hunt)."""
        now = self._tick(now)
        for held in (self._requests, self._tokens):
            if held is not None:  # no rise (``recover``) until RECENT_S without a 429
                held.restep(now)
        if refused.id <= self._backed_off_through or not self._answered_since:
            return
        tokens = tokens_spent and self._tokens is not None
        sent = self._recent.per_minute(now)
        if self._tokens is None and self._requests is None and sent >= LEARN_FROM_RPM:
            self._requests = _Dimension(sent, WINDOW_S / sent, now, configured=math.inf)
            self._requests.ceiling = math.inf  # the provider's limit: found by AIMD
        dim = self._tokens if tokens or self._requests is None else self._requests
        if dim is None:  # nothing to lower (a quiet 429, no limit anywhere): no congestion
            return  # marked, so the next 429 may still learn a limit (a review)
        self._backed_off_through = self._last_id
        self._answered_since = False
        if dim.ceiling == math.inf:  # a learned limit, which answers may have raised
            cut_from = min(dim.limit, max(sent, LEARN_FROM_RPM))  # far above
        else:  # (a quiet spell's pace says nothing)
            cut_from = dim.limit
        lowered = cut_from * BACK_OFF
        if dim is self._requests:  # never below what the provider has just shown it takes:
            # its window still holds what was sent before the last back-off, so each of its
            # 429s cut again (20 a 10 s, 600 rpm configured: 0.65 of it, now 0.84). Counted
            # over the whole ten seconds: the first second's answers, a burst, would make
            # a rate the provider has not shown it keeps (a review)
            shown = min(self._served.per_minute(now), sent)
            lowered = max(lowered, min(dim.limit, shown * BACK_OFF))
            # answers climb back fast (``recover``) to the limit cut from; with no
            # answers to show it took as much (a refusal of all, from the start: a
            # transient), to no bound but the ceiling, while no 429 comes
            dim.fast_to = cut_from if shown >= lowered else math.inf
        else:
            dim.fast_to = cut_from
        dim.relimit(now, lowered)

    def recover(self, now: float, tokens: int, answered: Reservation | None = None) -> None:
        """An answer (to the call admitted as ``answered``): raise each limit in force by
        ``RECOVER`` of the call (one request, its ``tokens``), and ``RISE`` times where a
        step of binding with no 429 has passed (``_Dimension.climbed``), up to its
        ceiling. An answer
        to a call admitted after the last back-off makes the next 429 news (one to a call
        sent before it came in the same congestion, and re-armed the cut; a review)."""
        now = self._tick(now)
        self._served.add(now)
        if answered is None or answered.id > self._backed_off_through:
            self._answered_since = True
        for dim, amount in ((self._requests, 1), (self._tokens, tokens)):
            if dim is not None and dim.limit < dim.ceiling:
                dim.relimit(now, dim.climbed(now) + RECOVER * amount)

    def limits(self) -> tuple[float | None, float | None]:
        """The (requests, tokens) per-minute limits in force (None: unlimited)."""
        return (
            None if self._requests is None else self._requests.limit,
            None if self._tokens is None else self._tokens.limit,
        )

    def observe(
        self,
        now: float,
        remaining_requests: int | None,
        remaining_tokens: int | None,
        reset_requests_s: float | None,
        reset_tokens_s: float | None,
        *,
        since: Reservation | None = None,
    ) -> None:
        """Lower the buckets to what the provider says remains; never raise them.

        The provider counted when the call admitted as ``since`` reached it: what
        remains now is that, plus what refilled since, less what was admitted after
        it (else each answer would take back the calls sent during its round trip).
        A count whose reset is already due (``reset <= 0``) is stale and ignored; a
        positive reset adds nothing (OpenAI's is the time to a full refill, and the
        bucket already refills at the provider's rate).
        """
        now = self._tick(now)
        requests_after = tokens_after = 0
        if since is not None:
            requests_after = self._last_id - since.id
            tokens_after = self._tokens_admitted - since.tokens_before - since.tokens
        pairs = (
            (self._requests, remaining_requests, reset_requests_s, requests_after),
            (self._tokens, remaining_tokens, reset_tokens_s, tokens_after),
        )
        sent_at = None if since is None else since.at
        for dim, remaining, reset_s, admitted_since in pairs:
            if dim is not None:
                dim.told(now, remaining, reset_s, sent_at, admitted_since)

    @property
    def paused_until(self) -> float | None:
        """When the last 429's pause ends (clock time; it may have passed), or None."""
        return self._paused_until

    def headroom(self, now: float) -> Headroom:
        """What could be admitted now: min(bucket level, window room) per dimension.

        Negative while a large call's debt is being paid off.
        """
        now = self._tick(now)
        paused = self._paused_until
        return Headroom(
            requests=None if self._requests is None else self._requests.headroom(now),
            tokens=None if self._tokens is None else self._tokens.headroom(now),
            paused_until=paused if paused is not None and paused > now else None,
        )

    def refilled(self, now: float) -> bool:
        """Whether every dimension's headroom is all it can be: an idle model's reports
        stop changing then (``actors.model``)."""
        now = self._tick(now)
        return all(d.refilled(now) for d in (self._requests, self._tokens) if d is not None)

    def available_at(
        self, now: float, tokens: int = 1, parts: tuple[int, int] | None = None
    ) -> float:
        """When ``try_acquire(_, tokens, parts)`` would admit: ``now`` if now, inf if
        never."""
        now = self._tick(now)
        if self._tokens is not None and tokens > self._tokens.ceiling:
            return math.inf
        at = self._ready_at(now, max(1, tokens))
        for dim, amount in self._split(parts):
            if amount > dim.ceiling:
                return math.inf
            at = max(at, dim.ready_at(now, amount))
        return at

    def grantable(self, now: float, tokens: int = 1) -> int:
        """How many calls of ``tokens`` each could be admitted back to back now.

        For credits: ``UNLIMITED`` when no dimension limits, 0 while paused. It is
        at least 1 exactly when ``try_acquire(now, tokens)`` would admit; when it
        is 0, ``available_at`` says when to ask again.
        """
        now = self._tick(now)
        if self._paused_until is not None and self._paused_until > now:
            return 0
        n = UNLIMITED
        if self._requests is not None:
            n = min(n, self._requests.grantable(now, 1))
        if self._tokens is not None:
            if tokens > self._tokens.ceiling:
                return 0
            n = min(n, self._tokens.grantable(now, max(1, tokens)))
        return n

    def abandon_held(self) -> int:
        """Forget the outstanding reservations (a dead model actor's calls, which will
        never be settled here): their charges stay in the windows in full, as calls
        that were sent. Returns how many there were."""
        count = len(self._held)
        self._held.clear()
        return count

    @property
    def limited(self) -> bool:
        """Whether any limit is in force (configured or adopted from the provider)."""
        return self._requests is not None or self._tokens is not None

    @property
    def outstanding(self) -> int:
        """Reservations neither settled nor released."""
        return len(self._held)

    def _ready_at(self, now: float, tokens: int) -> float:
        at = now
        if self._paused_until is not None:
            at = max(at, self._paused_until)
        if self._requests is not None:
            at = max(at, self._requests.ready_at(now, 1))
        if self._tokens is not None:
            at = max(at, self._tokens.ready_at(now, tokens))
        return at

    def _take(self, reservation: Reservation) -> _Held:
        held = self._held.pop(reservation.id, None)
        if held is None:
            raise ValueError(f"reservation {reservation.id} is not outstanding here")
        return held

    def _tick(self, now: float) -> float:
        self._now = max(self._now, _finite("now", now))
        return self._now


def _taken(dim: _Dimension, ceiling: float, *, sure: bool) -> bool:
    """Whether the provider's ``ceiling`` for ``dim`` is taken now: a higher one (or the
    same) at once, a lower one when ``sure`` (a 429 said it) or said a second time in a
    row (``_Dimension.pending``)."""
    if ceiling >= dim.ceiling or sure or dim.pending == ceiling:
        dim.pending = None
        return True
    dim.pending = ceiling
    return False


def _charged(dim: _Dimension | None, now: float, amount: int) -> tuple[_Dimension, _Charge] | None:
    """``amount`` admitted into ``dim``, and its entry there (None: no such limit)."""
    return None if dim is None or not amount else (dim, dim.admit(now, amount))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


# -- response headers ----------------------------------------------------------

_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_DURATION = re.compile(r"(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h|d))+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h|d)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True, slots=True, kw_only=True)
class RateLimitHeaders:
    """The rate-limit facts one response carried (None: absent or unreadable)."""

    retry_after_s: float | None = None
    """From retry-after-ms, else retry-after: seconds from now, >= 0."""
    limit_requests: int | None = None
    limit_tokens: int | None = None
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests_s: float | None = None
    reset_tokens_s: float | None = None
    should_retry: bool | None = None
    """``x-should-retry``: the server's own word on whether this request may be sent
    again (OpenAI's and Anthropic's SDKs obey it before the status), None unsaid."""
    limit_parts: tuple[int | None, int | None] = (None, None)
    """The (input, output) token limits, where the provider says them apart
    (Anthropic's ``input-tokens-limit``, ``output-tokens-limit``)."""
    remaining_parts: tuple[int | None, int | None] = (None, None)
    reset_parts_s: tuple[float | None, float | None] = (None, None)


def parse_retry_after(value: str, now_epoch: float) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP-date; garbage -> None.

    Negative values and dates in the past give 0.
    """
    text = value.strip()
    if _NUMBER.fullmatch(text):
        seconds = _number(text)
        return None if seconds is None else max(0.0, seconds)
    when = _http_date(text)
    return None if when is None else max(0.0, when - now_epoch)


def parse_duration(value: str) -> float | None:
    """A Go-style duration as OpenAI sends resets ("6m0s", "20ms", "1h2m3.5s") -> seconds.

    A bare number is seconds; a leading "-" gives 0; garbage -> None.
    """
    text = value.strip().lower()
    negative = text.startswith("-")
    text = text.removeprefix("-").removeprefix("+")
    if _NUMBER.fullmatch(text) and text[0] not in "+-":
        seconds = float(text)
    elif _DURATION.fullmatch(text):
        seconds = sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART.findall(text))
    else:
        return None
    if not math.isfinite(seconds):
        return None
    return 0.0 if negative else seconds


def read_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
    now_epoch: float,
    heard_epoch: float | None = None,
) -> RateLimitHeaders:
    """Pull retry-after(-ms) and the limits out of response headers: OpenAI's
    ``x-ratelimit-*`` (resets are durations), else Anthropic's ``anthropic-ratelimit-*``
    (resets are RFC 3339 times). A header sent twice is read the cautious way: the
    longest wait, the lowest limit or remainder.

    Anthropic's token limits: each part apart (``limit_parts``, ``remaining_parts``,
    ``reset_parts_s``, for ``RateLimiter.adopt_parts``), and a tpm reservation holding
    prompt and ``max_tokens`` together, the token limit taken is its input-token limit
    plus its output-token limit, and what remains the sum of what remains of each (0
    once either is spent). Its combined ``tokens-*`` headers show whichever of the two
    is the more restrictive now, often the output one: taken as the limit of prompt
    and output together, 8,000 output tokens a minute refused for good every call of a
    5,000-token prompt and 4,096 ``max_tokens`` (found by a hunt). Their remainder and
    reset are still read where no split is sent: a limit spent is a limit spent.

    Times of day (Anthropic's resets, a ``Retry-After`` date) are the provider's clock:
    where the answer's ``Date`` was more than ``CLOCK_SKEW_S`` from this host's clock
    when it arrived (``heard_epoch``), they are read against the provider's clock now
    (see ``_server_now``)."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    h: dict[str, str | list[str]] = {}
    for name, value in pairs:
        key = name.lower()
        had = h.setdefault(key, value)
        if had is not value:  # sent twice (a list only then: one answer in many)
            h[key] = [*had, value] if isinstance(had, list) else [had, value]
    a = "anthropic-ratelimit-"
    anthropic = any(name.startswith(a) for name in h)
    dated = anthropic or "retry-after" in h
    if dated and heard_epoch is not None and "date" in h:  # (OpenAI's say durations:
        now_epoch = _server_now(h["date"], now_epoch, heard_epoch)  # no date read, 5 us)
    retry_after = _most(h.get("retry-after-ms"), _millis)
    if retry_after is None:
        retry_after = _most(h.get("retry-after"), lambda v: parse_retry_after(v, now_epoch))
    should_retry = _should_retry(h.get("x-should-retry"))
    if not anthropic:
        return RateLimitHeaders(
            should_retry=should_retry,
            retry_after_s=_capped(retry_after),
            limit_requests=_least(h.get("x-ratelimit-limit-requests"), _count),
            limit_tokens=_least(h.get("x-ratelimit-limit-tokens"), _count),
            remaining_requests=_least(h.get("x-ratelimit-remaining-requests"), _count),
            remaining_tokens=_least(h.get("x-ratelimit-remaining-tokens"), _count),
            reset_requests_s=_capped(_most(h.get("x-ratelimit-reset-requests"), _duration)),
            reset_tokens_s=_capped(_most(h.get("x-ratelimit-reset-tokens"), _duration)),
        )

    def until(name: str) -> float | None:
        return _most(h.get(a + name), lambda v: _until(v, now_epoch))

    limits = [_least(h.get(f"{a}{kind}-tokens-limit"), _count) for kind in ("input", "output")]
    left = [_least(h.get(f"{a}{kind}-tokens-remaining"), _count) for kind in ("input", "output")]
    resets = [until(f"{kind}-tokens-reset") for kind in ("input", "output")]
    remaining_tokens = _least(h.get(f"{a}tokens-remaining"), _count)
    reset_tokens = until("tokens-reset")
    if None not in left:
        remaining_tokens = 0 if 0 in left else sum(n for n in left if n is not None)
        spent = [r for n, r in zip(left, resets, strict=True) if n == 0 and r is not None]
        known = [r for r in resets if r is not None]
        reset_tokens = max(spent or known, default=reset_tokens)
    return RateLimitHeaders(
        should_retry=should_retry,
        retry_after_s=_capped(retry_after),
        limit_requests=_least(h.get(f"{a}requests-limit"), _count),
        limit_tokens=None if None in limits else sum(n for n in limits if n is not None),
        remaining_requests=_least(h.get(f"{a}requests-remaining"), _count),
        remaining_tokens=remaining_tokens,
        reset_requests_s=_capped(until("requests-reset")),
        reset_tokens_s=_capped(reset_tokens),
        limit_parts=(limits[0], limits[1]),
        remaining_parts=(left[0], left[1]),
        reset_parts_s=(_capped(resets[0]), _capped(resets[1])),
    )


_N = TypeVar("_N", int, float)


def _should_retry(values: str | list[str] | None) -> bool | None:
    """``x-should-retry``: ``true`` or ``false`` (as the SDKs read it, exactly; sent
    twice, a ``false`` wins), anything else unsaid."""
    said = [values] if isinstance(values, str) else values or []
    if "false" in said:
        return False
    return True if "true" in said else None


def _most(values: str | list[str] | None, parse: Callable[[str], _N | None]) -> _N | None:
    """The largest of ``values`` that ``parse`` reads (None: none does)."""
    return _pick(values, parse, max)


def _least(values: str | list[str] | None, parse: Callable[[str], _N | None]) -> _N | None:
    """The smallest of ``values`` that ``parse`` reads (None: none does)."""
    return _pick(values, parse, min)


def _pick(
    values: str | list[str] | None,
    parse: Callable[[str], _N | None],
    pick: Callable[[list[_N]], _N],
) -> _N | None:
    """One header's value (``values``: a list when it came more than once), read by
    ``parse``; of several, the one ``pick`` chooses among those it reads."""
    if not isinstance(values, list):
        return None if values is None else parse(values)
    read = [x for x in map(parse, values) if x is not None]
    return pick(read) if read else None


MOST_WAIT_S = 600.0
"""The longest wait a provider's headers can impose (``Retry-After``, a window's reset):
a longer one (a server that says 31 years, by mistake or not) would stop the model,
and every task without a deadline, for that long; past ``MOST_WAIT_S`` the model asks
again, and a task's deadline or budget still ends it."""


CLOCK_SKEW_S = 2.0
"""How far the answer's ``Date`` may be from this host's clock before the provider's
times of day are read against it: ``Date`` counts whole seconds (truncated) and is
stamped as the answer starts, so within this it says nothing the local clock does not
say better."""


def _server_now(dates: str | list[str], now_epoch: float, heard_epoch: float) -> float:
    """The provider's clock at ``now_epoch``: this host's, moved by how far the
    answer's ``Date`` was from it when the answer arrived (``heard_epoch``), where that
    is more than ``CLOCK_SKEW_S``.

    A reset or ``Retry-After`` date is the provider's time of day. Read against a clock
    a minute behind the provider's, a window's reset 20 s away was 80 s away and paused
    the model four times as long; against one a minute ahead it was past, taken as
    stale, and the spent window drew 429s (a host without NTP, or a provider's). The
    offset errs towards the longer wait: ``Date`` is truncated to the second and
    stamped before the answer travelled. Sent twice, the earliest ``Date``."""
    said = _least(dates, _http_date)
    if said is None:
        return now_epoch
    offset = said - heard_epoch
    return now_epoch + offset if abs(offset) > CLOCK_SKEW_S else now_epoch


@functools.lru_cache(maxsize=8)  # a provider's Date changes once a second (5 us a read)
def _http_date(value: str) -> float | None:
    """An HTTP-date (RFC 9110: ``Sun, 06 Nov 1994 08:49:37 GMT``) as epoch seconds, or None."""
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT
        when = when.replace(tzinfo=UTC)
    seconds = when.timestamp()
    return seconds if math.isfinite(seconds) else None


def _capped(seconds: float | None) -> float | None:
    return None if seconds is None else min(seconds, MOST_WAIT_S)


def _until(value: str | None, now_epoch: float) -> float | None:
    """An RFC 3339 time (Anthropic's resets) as seconds from now (0 if past); else None."""
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value.strip().upper())  # 3.11 reads "Z"; RFC 3339
        # allows "t" and "z" too, which it does not read
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    seconds = when.timestamp() - now_epoch
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _number(text: str | None) -> float | None:
    """A plain decimal number (no exponent, no inf/nan), or None."""
    if text is None or not _NUMBER.fullmatch(text.strip()):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _millis(value: str | None) -> float | None:
    ms = _number(value)
    return None if ms is None else max(0.0, ms / 1000.0)


def _count(value: str | None) -> int | None:
    """A count the provider gives, or None: a negative one says it gives none (Azure's
    ``-1`` for a figure it does not report), not that none is left (read as 0, one such
    answer stopped the model sending; found by a hunt)."""
    n = _number(value)
    return None if n is None or n < 0 else math.floor(n)


def _duration(value: str | None) -> float | None:
    return None if value is None else parse_duration(value)
