"""The rate limiter: pacing, hard windows, pauses; header parsing; a state machine."""

from __future__ import annotations

import itertools
import math
import operator
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest
from callboard.core.limiter import (
    BACK_OFF,
    CLOCK_SKEW_S,
    MOST_WAIT_S,
    RECOVER,
    RISE,
    UNLIMITED,
    WINDOW_S,
    Admit,
    Headroom,
    LimiterConfig,
    RateLimiter,
    RateLimitHeaders,
    Reservation,
    TooLarge,
    WaitUntil,
    parse_duration,
    parse_retry_after,
    read_headers,
)
from callboard.messages import ConfigError
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)


def admit(lim: RateLimiter, now: float, tokens: int = 1) -> Reservation:
    d = lim.try_acquire(now, tokens)
    assert isinstance(d, Admit), d
    return d.reservation


def wait_at(lim: RateLimiter, now: float, tokens: int = 1) -> float:
    d = lim.try_acquire(now, tokens)
    assert isinstance(d, WaitUntil), d
    assert d.at > now
    return d.at


# -- pacing and windows ---------------------------------------------------------------


def test_unlimited_always_admits() -> None:
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    for _ in range(10_000):
        admit(lim, 0.0, 1_000_000)
    assert lim.headroom(0.0) == Headroom(requests=None, tokens=None, paused_until=None)
    assert lim.grantable(0.0) == UNLIMITED


def test_a_full_burst_then_paced() -> None:
    lim = RateLimiter(LimiterConfig(rpm=1200, tpm=None, burst_s=0.5), 0.0)
    for _ in range(10):  # 0.5 s worth of 20/s
        admit(lim, 0.0)
    assert wait_at(lim, 0.0) == pytest.approx(0.05)


def test_pacing_yields_the_limit_and_never_more() -> None:
    """Greedy for 120 simulated seconds at rpm=1200: 95-100% of the limit per minute."""
    lim = RateLimiter(LimiterConfig(rpm=1200, tpm=None), 0.0)
    now, times = 0.0, []
    while now < 120.0:
        d = lim.try_acquire(now, 1)
        if isinstance(d, Admit):
            times.append(now)
        else:
            assert isinstance(d, WaitUntil)
            now = d.at
    for minute in (0, 1):
        n = sum(1 for t in times if minute * 60 <= t < (minute + 1) * 60)
        assert 0.95 * 1200 <= n <= 1200
    assert max_in_any_window(times, [1] * len(times)) <= 1200
    gaps = [b - a for a, b in itertools.pairwise(times[10:]) if b > a]
    assert min(gaps) >= 0.05 - 1e-9  # paced, not bursty, after the first burst


def test_the_hard_window_holds_even_with_a_minute_long_burst() -> None:
    lim = RateLimiter(LimiterConfig(rpm=60, tpm=None, burst_s=60.0), 0.0)
    for _ in range(60):
        admit(lim, 0.0)
    assert wait_at(lim, 0.0) == 60.0
    assert wait_at(lim, 59.999) == 60.0
    admit(lim, 60.0)


def test_a_request_larger_than_the_bucket_goes_when_the_bucket_is_full() -> None:
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=6000, burst_s=0.5), 0.0)  # bucket: 50 tokens
    admit(lim, 0.0, 1000)
    at = wait_at(lim, 0.0, 1000)
    assert at == pytest.approx(10.0)  # 1000 tokens of debt at 100 tokens/s
    assert isinstance(lim.try_acquire(at, 1000), Admit)


def test_a_request_larger_than_the_limit_is_never_admitted() -> None:
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=6000), 0.0)
    assert lim.try_acquire(0.0, 6001) == TooLarge(6001, 6000)
    assert lim.available_at(0.0, 6001) == math.inf
    assert lim.grantable(0.0, 6001) == 0
    admit(lim, 0.0, 6000)


def test_tokens_pace_too() -> None:
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=600, burst_s=60.0), 0.0)
    admit(lim, 0.0, 500)
    assert wait_at(lim, 0.0, 200) == 60.0
    admit(lim, 0.0, 100)


# -- settle, release -----------------------------------------------------------------


def test_settle_refunds_unused_tokens() -> None:
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=1000, burst_s=60.0), 0.0)
    r = admit(lim, 0.0, 800)
    assert wait_at(lim, 1.0, 800) == 60.0
    lim.settle(1.0, r, 200)
    admit(lim, 1.0, 800)


def test_settle_charges_extra_tokens() -> None:
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=1000, burst_s=60.0), 0.0)
    r = admit(lim, 0.0, 100)
    lim.settle(1.0, r, 700)
    assert wait_at(lim, 1.0, 400) == 60.0
    headroom = lim.headroom(1.0)
    assert headroom.tokens is not None
    assert headroom.tokens <= 300


def test_release_gives_everything_back() -> None:
    lim = RateLimiter(LimiterConfig(rpm=2, tpm=1000, burst_s=60.0), 0.0)
    r1, r2 = admit(lim, 0.0, 400), admit(lim, 0.0, 400)
    wait_at(lim, 0.0, 100)
    lim.release(0.0, r1)
    lim.release(0.0, r2)
    assert lim.outstanding == 0
    admit(lim, 0.0, 1000)


def test_a_reservation_is_settled_once() -> None:
    lim = RateLimiter(LimiterConfig(rpm=10, tpm=1000), 0.0)
    r = admit(lim, 0.0, 10)
    lim.settle(0.0, r, 5)
    with pytest.raises(ValueError, match="not outstanding"):
        lim.settle(0.0, r, 5)
    with pytest.raises(ValueError, match="not outstanding"):
        lim.release(0.0, r)


def test_settling_after_the_window_passed_is_harmless() -> None:
    lim = RateLimiter(LimiterConfig(rpm=10, tpm=1000), 0.0)
    r = admit(lim, 0.0, 500)
    lim.settle(100.0, r, 10)
    admit(lim, 100.0, 1000)


# -- pauses and provider feedback --------------------------------------------------------


def test_a_pause_blocks_until_its_end_and_is_never_shortened() -> None:
    lim = RateLimiter(LimiterConfig(rpm=600, tpm=None), 0.0)
    lim.pause_until(10.0)
    lim.pause_until(5.0)
    assert wait_at(lim, 0.0) == 10.0
    assert lim.headroom(3.0).paused_until == 10.0
    assert lim.grantable(3.0) == 0
    admit(lim, 10.0)
    assert lim.headroom(10.0).paused_until is None


def test_a_pause_applies_even_without_limits() -> None:
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    lim.pause_until(2.5)
    assert wait_at(lim, 1.0) == 2.5


def test_observe_lowers_but_never_raises() -> None:
    lim = RateLimiter(LimiterConfig(rpm=600, tpm=60_000, burst_s=1.0), 0.0)  # 10 req, 1000 tok
    before = lim.headroom(0.0)
    assert (before.requests, before.tokens) == (10.0, 1000.0)
    lim.observe(0.0, 10_000, 10**9, 1.0, 1.0)
    assert lim.headroom(0.0) == before
    lim.observe(0.0, 2, 300, 0.5, 0.5)
    after = lim.headroom(0.0)
    assert (after.requests, after.tokens) == (2.0, 300.0)
    lim.observe(0.0, 0, None, 0.0, None)  # a reset already due: stale, ignored
    assert lim.headroom(0.0) == after


def test_grantable_and_available_at_agree_with_try_acquire() -> None:
    lim = RateLimiter(LimiterConfig(rpm=1200, tpm=None), 0.0)
    assert lim.grantable(0.0) == 10
    for _ in range(10):
        admit(lim, 0.0)
    assert lim.grantable(0.0) == 0
    at = lim.available_at(0.0)
    assert at == wait_at(lim, 0.0)
    assert lim.grantable(at) == 1
    admit(lim, at)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rpm": 0, "tpm": None}, "rpm"),
        ({"rpm": 0.5, "tpm": None}, "rpm"),
        ({"rpm": float("inf"), "tpm": None}, "rpm"),
        ({"rpm": None, "tpm": -5}, "tpm"),
        ({"rpm": None, "tpm": "100"}, "tpm"),
        ({"rpm": 10, "tpm": None, "burst_s": 0}, "burst_s"),
        ({"rpm": 10, "tpm": None, "burst_s": 61}, "burst_s"),
        ({"rpm": True, "tpm": None}, "rpm"),
        ({"rpm": 10, "tpm": None, "refunds": "yes"}, "refunds"),
    ],
)
def test_config_names_the_bad_field(kwargs: dict[str, object], field: str) -> None:
    """A ``ConfigError`` (a ``UsageError``): a bare ``ValueError`` escaped ``except
    UsageError`` (a hunt)."""
    with pytest.raises(ConfigError, match=field):
        LimiterConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_arguments_are_rejected() -> None:
    lim = RateLimiter(LimiterConfig(rpm=10, tpm=100), 0.0)
    with pytest.raises(ValueError, match="tokens"):
        lim.try_acquire(0.0, 0)
    with pytest.raises(ValueError, match="now"):
        lim.try_acquire(math.nan, 1)
    with pytest.raises(ValueError, match="at"):
        lim.pause_until(math.inf)
    r = admit(lim, 0.0, 5)
    with pytest.raises(ValueError, match="actual_tokens"):
        lim.settle(0.0, r, -1)


# -- headers ---------------------------------------------------------------------------

NOW_EPOCH = 1_700_000_000.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("120", 120.0),
        (" 1.5 ", 1.5),
        ("0", 0.0),
        ("-3", 0.0),
        ("garbage", None),
        ("", None),
        ("1e3", None),
        ("nan", None),
        ("9" * 400, None),
    ],
)
def test_retry_after_seconds(value: str, expected: float | None) -> None:
    assert parse_retry_after(value, NOW_EPOCH) == expected


def test_retry_after_http_date() -> None:
    when = datetime.fromtimestamp(NOW_EPOCH + 30, tz=UTC)
    assert parse_retry_after(format_datetime(when, usegmt=True), NOW_EPOCH) == 30.0
    past = datetime.fromtimestamp(NOW_EPOCH - 30, tz=UTC)
    assert parse_retry_after(format_datetime(past, usegmt=True), NOW_EPOCH) == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 1445412480.0 - 5) == 5.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00", 1445412480.0 - 5) == 5.0  # naive: GMT
    assert parse_retry_after("Wed, 32 Oct 2015 07:28:00 GMT", NOW_EPOCH) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0.5s", 0.5),
        ("59.9s", 59.9),
        ("7.66s", 7.66),
        ("250us", 0.00025),
        ("2", 2.0),
        (" 3S ", 3.0),
        ("-1s", 0.0),
        ("", None),
        ("s", None),
        ("1x", None),
        ("1s2", None),
        ("soon", None),
        ("--1s", None),
    ],
)
def test_openai_durations(value: str, expected: float | None) -> None:
    got = parse_duration(value)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


def test_read_headers_case_insensitive() -> None:
    got = read_headers(
        {
            "Retry-After": "7",
            "X-RateLimit-Remaining-Requests": "59",
            "x-ratelimit-remaining-tokens": "149984",
            "X-RATELIMIT-RESET-REQUESTS": "1s",
            "x-ratelimit-reset-tokens": "6m0s",
            "content-type": "application/json",
        },
        NOW_EPOCH,
    )
    assert got == RateLimitHeaders(
        retry_after_s=7.0,
        remaining_requests=59,
        remaining_tokens=149984,
        reset_requests_s=1.0,
        reset_tokens_s=360.0,
    )


def test_retry_after_ms_wins_and_garbage_is_none() -> None:
    got = read_headers({"retry-after": "7", "retry-after-ms": "250"}, NOW_EPOCH)
    assert got.retry_after_s == 0.25
    got = read_headers(
        {"retry-after-ms": "soon", "retry-after": "2", "x-ratelimit-remaining-tokens": "lots"},
        NOW_EPOCH,
    )
    assert (got.retry_after_s, got.remaining_tokens) == (2.0, None)
    assert read_headers({}, NOW_EPOCH) == RateLimitHeaders()


def test_a_negative_count_is_no_figure_not_none_left() -> None:
    """Azure sends ``-1`` for a limit or a remainder it does not report; read as 0 left,
    one such answer stopped the model sending (found by a hunt)."""
    got = read_headers(
        {
            "x-ratelimit-limit-tokens": "-1",
            "x-ratelimit-remaining-tokens": "-1",
            "x-ratelimit-remaining-requests": "-5",
            "x-ratelimit-limit-requests": "600",
        },
        NOW_EPOCH,
    )
    assert (got.limit_tokens, got.remaining_tokens, got.remaining_requests) == (None, None, None)
    assert got.limit_requests == 600


@pytest.mark.parametrize(
    "headers",
    [
        {"retry-after": "1000000000"},
        {"retry-after": "99999999999999999999999"},
        {"retry-after-ms": "1000000000000000"},
        {"retry-after": "Fri, 31 Dec 9999 23:59:59 GMT"},
        {"x-ratelimit-reset-requests": "1000000h", "x-ratelimit-reset-tokens": "99999999s"},
    ],
)
def test_no_header_imposes_a_wait_longer_than_the_cap(headers: dict[str, str]) -> None:
    """One 429 saying ``Retry-After: 1000000000`` paused its model for 31 years: every
    task without a deadline waited that long."""
    got = read_headers(headers, NOW_EPOCH)
    waits = [got.retry_after_s, got.reset_requests_s, got.reset_tokens_s]
    assert max(w for w in waits if w is not None) == MOST_WAIT_S


# -- the state machine -------------------------------------------------------------------


def max_in_any_window(times: list[float], amounts: list[int]) -> int:
    """The largest sum admitted in any 60 s (as the limiter counts: t_j + 60 > t_k)."""
    best = 0
    for tk in times:
        best = max(
            best, sum(a for tj, a in zip(times, amounts, strict=True) if tj <= tk < tj + WINDOW_S)
        )
    return best


@dataclass
class Admitted:
    at: float
    reservation: Reservation
    tokens: int
    requests: int = 1
    open: bool = True
    parts: tuple[int, int] = (0, 0)


class LimiterMachine(RuleBasedStateMachine):
    """Random acquisitions, settlements, releases, pauses and observations."""

    def __init__(self) -> None:
        super().__init__()
        self.lim = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
        self.now = 0.0
        self.paused_until = -math.inf
        self.log: list[Admitted] = []
        self.parts: tuple[int, int] | None = None

    @initialize(
        rpm=st.sampled_from([None, 3, 10, 61.5]),
        tpm=st.sampled_from([None, 100, 1000]),
        burst_s=st.sampled_from([0.5, 5.0, 60.0]),
        parts=st.sampled_from([None, (300, 200)]),
    )
    def configure(
        self, rpm: float | None, tpm: float | None, burst_s: float, parts: tuple[int, int] | None
    ) -> None:
        self.lim = RateLimiter(LimiterConfig(rpm=rpm, tpm=tpm, burst_s=burst_s), 0.0)
        self.parts = parts
        if parts is not None:  # the provider limits input and output apart
            self.lim.adopt_parts(0.0, parts)

    @property
    def open_ones(self) -> list[Admitted]:
        return [a for a in self.log if a.open]

    @rule(dt=st.sampled_from([0.0, 0.01, 0.3, 1.0, 7.0, 30.0, 60.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(tokens=st.integers(1, 1100), share=st.floats(0, 1), jump=st.booleans())
    def acquire(self, tokens: int, share: float, jump: bool) -> None:
        given = round(tokens * share)
        parts = (given, tokens - given)
        d = self.lim.try_acquire(self.now, tokens, parts)
        tpm = self.lim.config.tpm
        over = tpm is not None and tokens > tpm
        over = over or (self.parts is not None and any(map(operator.gt, parts, self.parts)))
        assert isinstance(d, TooLarge) == over
        if isinstance(d, WaitUntil):
            assert d.at > self.now
            if not jump:
                return
            self.now = d.at
            d = self.lim.try_acquire(self.now, tokens, parts)
            assert isinstance(d, Admit), "asking again at WaitUntil.at must admit"
        if isinstance(d, Admit):
            assert self.now >= self.paused_until
            self.log.append(Admitted(self.now, d.reservation, tokens, parts=parts))

    @precondition(lambda self: self.open_ones)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.open_ones))
        parts = tuple(data.draw(st.integers(0, n)) for n in a.parts)  # upper bounds
        actual = sum(parts)
        self.lim.settle(self.now, a.reservation, actual, (parts[0], parts[1]))
        a.tokens, a.parts, a.open = actual, (parts[0], parts[1]), False

    @precondition(lambda self: self.open_ones)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.open_ones))
        self.lim.release(self.now, a.reservation)
        a.tokens, a.requests, a.parts, a.open = 0, 0, (0, 0), False

    @rule(offset=st.sampled_from([0.0, 0.5, 3.0, 45.0]))
    def pause(self, offset: float) -> None:
        self.lim.pause_until(self.now + offset)
        self.paused_until = max(self.paused_until, self.now + offset)

    @rule(
        requests=st.one_of(st.none(), st.integers(0, 20)),
        tokens=st.one_of(st.none(), st.integers(0, 2000)),
        reset=st.one_of(st.none(), st.sampled_from([0.0, 0.02, 1.0, 60.0])),
    )
    def observe(self, requests: int | None, tokens: int | None, reset: float | None) -> None:
        before = self.lim.headroom(self.now)
        self.lim.observe(self.now, requests, tokens, reset, reset)
        after = self.lim.headroom(self.now)
        for old, new in ((before.requests, after.requests), (before.tokens, after.tokens)):
            assert (old is None) == (new is None)
            if old is not None and new is not None:
                assert new <= old
        assert after.paused_until == before.paused_until

    @invariant()
    def windows_hold(self) -> None:
        times = [a.at for a in self.log]
        cfg = self.lim.config
        if cfg.rpm is not None:
            assert max_in_any_window(times, [a.requests for a in self.log]) <= cfg.rpm
        if cfg.tpm is not None:
            assert max_in_any_window(times, [a.tokens for a in self.log]) <= cfg.tpm
        for i, limit in enumerate(self.parts or ()):
            assert max_in_any_window(times, [a.parts[i] for a in self.log]) <= limit

    @invariant()
    def bookkeeping(self) -> None:
        assert self.lim.outstanding == len(self.open_ones)
        h = self.lim.headroom(self.now)
        assert (h.paused_until is not None) == (self.paused_until > self.now)


TestLimiterMachine = LimiterMachine.TestCase
TestLimiterMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


def test_an_unset_dimension_takes_the_advertised_limit_only_when_asked() -> None:
    unset = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    unset.adopt(0.0, limit_requests=120, limit_tokens=None)  # an answer: no limit of ours
    assert not unset.limited
    unset.adopt(0.0, limit_requests=120, limit_tokens=None, unset_too=True)  # after a 429
    assert isinstance(unset.try_acquire(0.0, 10), Admit)
    waiting = unset.try_acquire(0.0, 10)  # a bucket of one request, refilled at 2/s
    assert isinstance(waiting, WaitUntil)
    assert waiting.at == pytest.approx(0.5)


def test_an_advertised_limit_lowers_a_configured_one() -> None:
    """Issue 14: configured at 1200 rpm against a provider's 300, the bucket refilled at
    1200 and the advertised limit was ignored: 337 429s for 200 tasks."""
    lim = RateLimiter(LimiterConfig(rpm=1200, tpm=None, burst_s=0.5), 0.0)
    for _ in range(2):  # every answer says it
        lim.adopt(0.0, limit_requests=300, limit_tokens=None)
    assert lim.limits() == (300, None)
    admitted = 0
    for step in range(6000):  # a minute, asking every 10 ms
        if isinstance(lim.try_acquire(step / 100, 1), Admit):
            admitted += 1
    assert 295 <= admitted <= 300


def test_a_limit_the_provider_raises_again_is_used_again_up_to_the_configured_one() -> None:
    """Lowered only, an account's limit raised mid-run (120 rpm, then 600) was never
    used, and one answer's ``limit-tokens: 100`` failed every later task of 128 tokens
    as too large, for the life of the process (found by a hunt)."""
    lim = RateLimiter(LimiterConfig(rpm=600, tpm=100_000, burst_s=0.5), 0.0)
    for _ in range(2):  # said twice: no passing word
        lim.adopt(0.0, limit_requests=120, limit_tokens=100)
    assert lim.limits() == (120, 100)
    assert isinstance(lim.try_acquire(0.0, 128), TooLarge)  # while the provider says so
    lim.adopt(1.0, limit_requests=6000, limit_tokens=100_000)
    assert lim.limits() == (600, 100_000), "raised again, never above the configured"
    assert isinstance(lim.try_acquire(2.0, 128), Admit)  # once its bucket has refilled


def test_one_answers_glitch_is_no_limit_two_in_a_row_or_a_429_are() -> None:
    """``limit-tokens: 100`` in one answer among answers of 100,000: every task larger
    than it failed ``TooLarge`` until the next answer (found by a hunt). A lower limit
    is taken when two answers in a row say it, or a 429 does."""
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=100_000, burst_s=60.0), 0.0)
    lim.adopt(0.0, limit_requests=None, limit_tokens=100)
    assert lim.limits() == (None, 100_000), "said once: a passing word, perhaps"
    assert isinstance(lim.try_acquire(0.0, 128), Admit)
    lim.adopt(1.0, limit_requests=None, limit_tokens=100_000)  # the next answer
    lim.adopt(1.0, limit_requests=None, limit_tokens=100)  # not twice in a row
    assert lim.limits() == (None, 100_000)
    lim.adopt(1.0, limit_requests=None, limit_tokens=100)  # twice in a row: the limit
    assert lim.try_acquire(1.0, 128) == TooLarge(128, 100)
    sure = RateLimiter(LimiterConfig(rpm=None, tpm=100_000), 0.0)
    sure.adopt(0.0, limit_requests=None, limit_tokens=100, sure=True)  # a 429 says it
    assert sure.try_acquire(0.0, 128) == TooLarge(128, 100)
    parts = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    parts.adopt_parts(0.0, (30000, 8000))
    parts.adopt_parts(0.0, (30000, 10))  # one answer's glitch
    assert parts.parts_limits() == (30000, 8000)
    parts.adopt_parts(0.0, (30000, 10))
    assert parts.try_acquire(0.0, 1100, (100, 1000)) == TooLarge(1000, 10)
    refused = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    refused.adopt_parts(0.0, (30000, 8000))
    refused.adopt_parts(0.0, (30000, 10), sure=True)  # a 429 says it, as adopt takes it
    assert refused.parts_limits() == (30000, 10)


def test_a_raised_ceiling_said_by_a_429_leaves_a_backed_off_limit_to_recover() -> None:
    """A 429's word raises only a limit that stood at the old ceiling: it says the
    provider takes less than that, and answers bring it back as they do. (An answer's
    word puts it back at once: see the next test.)"""
    lim = RateLimiter(LimiterConfig(rpm=600, tpm=None), 0.0)
    for _ in range(2):  # every answer says it
        lim.adopt(0.0, limit_requests=300, limit_tokens=None)
    sent = lim.try_acquire(0.0, 1)
    assert isinstance(sent, Admit)
    lim.recover(0.1, tokens=1)  # an answer since: the 429 is news
    lim.back_off(0.2, sent.reservation)
    assert lim.limits() == (300 * BACK_OFF, None)
    lim.adopt(0.3, limit_requests=600, limit_tokens=None, sure=True)
    assert lim.limits() == (300 * BACK_OFF, None)
    lim.recover(0.4, tokens=1)
    assert lim.limits() == (pytest.approx(300 * BACK_OFF + RECOVER), None)


@pytest.mark.parametrize("configured", [None, 3000])
def test_an_answer_advertising_its_limit_lifts_a_limit_a_back_off_learned(
    configured: int | None,
) -> None:
    """429s without a word of the limits cut it (learnt from the rate sent, or from a
    configured 3000), then every answer said ``limit-requests: 3000`` and it stayed at
    the cut, about 231 a minute, for minutes (found by a hunt). The provider's word on an
    answer puts it back in force, never above the configured one; what remains
    (``observe``) keeps the bucket safe."""
    lim = RateLimiter(LimiterConfig(rpm=configured, tpm=None), 0.0)
    calls = [admit(lim, k / 100) for k in range(40)]  # 240 a minute over ten seconds
    lim.back_off(0.5, calls[-1])
    assert lim.limits()[0] is not None
    assert lim.limits()[0] < 3000
    for _ in range(2):  # every answer says it (a lower ceiling: taken said twice)
        lim.adopt(1.0, limit_requests=3000, limit_tokens=None)
    assert lim.limits() == (3000, None)
    lim.adopt(1.1, limit_requests=6000, limit_tokens=None)
    assert lim.limits() == (6000 if configured is None else 3000, None)


def test_429s_back_off_once_per_congestion_and_answers_step_back_up() -> None:
    lim = RateLimiter(LimiterConfig(rpm=1000, tpm=None), 0.0)
    first = [lim.try_acquire(0.0, 1) for _ in range(3)]
    reservations = [d.reservation for d in first if isinstance(d, Admit)]
    assert len(reservations) == 3
    for res in reservations:  # three 429s for calls sent together: one congestion
        lim.back_off(1.0, res)
    assert lim.limits() == (1000 * BACK_OFF, None)
    later = lim.try_acquire(2.0, 1)
    assert isinstance(later, Admit)
    lim.back_off(3.0, later.reservation)  # sent after it, but no answer came since: a
    assert lim.limits() == (1000 * BACK_OFF, None)  # provider refusing all says no rate
    lim.recover(3.5, tokens=1)
    again = lim.try_acquire(3.5, 1)
    assert isinstance(again, Admit)
    lim.back_off(3.5, again.reservation)  # sent after the back-off, answers between: new
    cut = (1000 * BACK_OFF + RECOVER) * BACK_OFF
    assert lim.limits() == (pytest.approx(cut), None)
    for _ in range(10):
        lim.recover(4.0, tokens=1)
    assert lim.limits() == (pytest.approx(cut + 10 * RECOVER), None)
    for _ in range(100_000):
        lim.recover(5.0, tokens=1)
    assert lim.limits() == (1000, None), "never above the ceiling"


def test_a_storm_of_429s_with_no_answer_between_cuts_the_limit_once() -> None:
    """A provider refusing every call for 4 s (each 429 with ``Retry-After: 1``), then
    serving all: each second's calls cut the limit again, five times, to a quarter of
    the 600 a minute it then served, and at ``RECOVER`` an answer the backlog took
    minutes (a hunt). Refusals with no answer between say nothing of the rate."""
    lim = RateLimiter(LimiterConfig(rpm=1000, tpm=None), 0.0)
    for second in range(5):
        d = lim.try_acquire(float(second), 1)
        assert isinstance(d, Admit)
        lim.back_off(second + 0.5, d.reservation)
        lim.pause_until(second + 1.0)
    assert lim.limits() == (1000 * BACK_OFF, None)
    lim.recover(6.0, 1)  # it serves again: the next 429 is news
    d = lim.try_acquire(6.0, 1)
    assert isinstance(d, Admit)
    lim.back_off(6.5, d.reservation)
    assert lim.limits()[0] == pytest.approx((1000 * BACK_OFF + RECOVER) * BACK_OFF)


def test_an_answer_to_a_call_sent_before_the_cut_is_the_same_congestion() -> None:
    """Answers still on their way when the limit was cut re-armed it, and the next 429
    cut again: the storm's compounding once more (a review)."""
    lim = RateLimiter(LimiterConfig(rpm=1000, tpm=None), 0.0)
    early = [lim.try_acquire(0.0, 1) for _ in range(3)]
    held = [d.reservation for d in early if isinstance(d, Admit)]
    lim.back_off(1.0, held[0])
    lim.recover(1.1, 1, held[1])  # sent before the cut: no news
    late = lim.try_acquire(1.2, 1)
    assert isinstance(late, Admit)
    lim.back_off(1.3, late.reservation)
    assert lim.limits()[0] == pytest.approx(1000 * BACK_OFF + RECOVER)
    lim.recover(1.4, 1, late.reservation)  # sent after it: the next 429 is news
    again = lim.try_acquire(1.5, 1)
    assert isinstance(again, Admit)
    lim.back_off(1.6, again.reservation)
    assert lim.limits()[0] == pytest.approx((1000 * BACK_OFF + 2 * RECOVER) * BACK_OFF)


def test_a_quiet_429_with_no_limit_anywhere_does_not_stop_a_later_one_learning() -> None:
    """A 429 that lowered nothing (no limit anywhere, too few calls to learn from) still
    marked a congestion, and a burst drawing only 429s after it never learnt a limit (a
    review)."""
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    quiet = lim.try_acquire(0.0, 1)
    assert isinstance(quiet, Admit)
    lim.back_off(0.5, quiet.reservation)  # one call a minute: says nothing
    assert lim.limits() == (None, None)
    burst = [lim.try_acquire(1.0 + i / 100, 1) for i in range(100)]  # 600 a minute
    last = burst[-1]
    assert isinstance(last, Admit)
    lim.back_off(2.0, last.reservation)
    assert lim.limits()[0] is not None  # learnt from the burst


def test_a_back_off_keeps_most_of_the_rate_the_provider_just_answered() -> None:
    """A provider's window still holds what was sent before a back-off, so its 429s go
    on after it, each cutting again: a provider answering 20 in any 10 s without a word
    of its limit, with 600 rpm configured, was then sent 0.65 of its 120 a minute (60
    tasks took 93 s, found by a hunt). A back-off now keeps ``BACK_OFF`` of the rate
    it answered over the last ``RECENT_S`` seconds."""
    lim = RateLimiter(LimiterConfig(rpm=600, tpm=None), 0.0)
    window: deque[float] = deque()  # the provider's: what it took in the last 10 s
    answered: list[float] = []
    now, pending = 0.0, []  # calls out: (when they answer, reservation, taken)
    while now < 300.0:
        for at, res, taken in [p for p in pending if p[0] <= now]:
            pending.remove((at, res, taken))
            lim.settle(at, res, 1)
            if taken:
                lim.recover(at, 1)
                answered.append(at)
            else:  # a bare 429: a back-off and a pause of a second (``pause_s``)
                lim.back_off(at, res)
                lim.pause_until(at + 1.0)
        decision = lim.try_acquire(now, 1) if len(pending) < 20 else None
        if isinstance(decision, Admit):
            while window and window[0] <= now - 10.0:
                window.popleft()
            taken = len(window) < 20
            if taken:
                window.append(now)
            pending.append((now + 0.05, decision.reservation, taken))
            continue
        due = [p[0] for p in pending]
        if isinstance(decision, WaitUntil):
            due.append(decision.at)
        now = max(min(due), now + 1e-6)
    per_minute = sum(1 for at in answered if at >= 60.0) / 4
    assert per_minute >= 0.8 * 120, per_minute


def test_a_first_seconds_answers_are_no_rate_to_keep() -> None:
    """Thirteen answers in the first second, then a 429: read as 780 a minute, the
    floor held a 600 rpm limit at 585 (a review). Over the whole ten seconds they are
    78 a minute, and the back-off takes the limit to 450."""
    lim = RateLimiter(LimiterConfig(rpm=600, tpm=None, burst_s=2.0), 0.0)
    admitted = [lim.try_acquire(k / 20, 1) for k in range(14)]
    reservations = [d.reservation for d in admitted if isinstance(d, Admit)]
    assert len(reservations) == 14
    for res in reservations[:13]:
        lim.settle(0.8, res, 1)
        lim.recover(0.8, 1)
    lim.back_off(0.9, reservations[13])
    assert lim.limits()[0] == pytest.approx(600 * BACK_OFF)


def test_a_429_with_no_limit_anywhere_makes_one_from_the_rate_sent() -> None:
    """No limit configured and a 429 that says nothing: nothing was paced, each task
    retried on its own, and a server allowing 60 a minute drew 259 429s for 39 answers
    (found by a hunt). The first 429 makes a request limit of ``BACK_OFF`` of the rate
    sent; answers raise it with no ceiling; a later 429 takes it back to ``BACK_OFF`` of
    what was sent, however high the answers raised it."""
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    admitted = [lim.try_acquire(t / 10, 1) for t in range(100)]  # 10 a second for 10 s
    assert all(isinstance(d, Admit) for d in admitted)
    assert lim.limits() == (None, None)
    last = admitted[-1]
    assert isinstance(last, Admit)
    lim.back_off(10.0, last.reservation)
    requests, _ = lim.limits()
    assert requests == pytest.approx(600 * BACK_OFF, rel=0.02)
    assert isinstance(lim.try_acquire(10.0, 1), Admit)  # one unit of burst, then paced
    assert isinstance(lim.try_acquire(10.0, 1), WaitUntil)
    for _ in range(100_000):
        lim.recover(11.0, tokens=1)
    assert lim.limits()[0] == pytest.approx(600 * BACK_OFF + 100_000 * RECOVER), "no ceiling"
    then = lim.try_acquire(20.0, 1)
    assert isinstance(then, Admit)
    lim.back_off(20.0, then.reservation)
    assert lim.limits()[0] < 600 * BACK_OFF, "from what was sent, not the raised limit"


def test_a_429_on_a_quiet_model_makes_no_limit() -> None:
    """One call in ten seconds and a 429: that says nothing of the provider's pace (a
    limit of 4.5 a minute made from it held a burst of 30 calls to 38 s)."""
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    admitted = lim.try_acquire(5.0, 1)
    assert isinstance(admitted, Admit)
    lim.back_off(5.1, admitted.reservation)
    assert lim.limits() == (None, None)
    assert all(isinstance(lim.try_acquire(5.2, 1), Admit) for _ in range(30))


def test_the_rate_sent_is_measured_over_the_last_ten_seconds() -> None:
    """As documented: four calls sent at once, then a 429, are 24 a minute over ten
    seconds, too few to learn from; over the time since the first call (at least a
    second) they read as 240 a minute, made a limit of 180 and the model took 18
    minutes to come back to its 1200 (found by a hunt)."""
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    burst = [admit(lim, 0.0) for _ in range(4)]
    lim.back_off(0.01, burst[-1])
    assert lim.limits() == (None, None)


def _served_at(lim: RateLimiter, start: float, end: float, per_s: int) -> float:
    """Send and answer ``per_s`` calls a second from ``start`` to ``end``, as the limiter
    admits them; the time it stopped."""
    now = start
    while now < end:
        d = lim.try_acquire(now, 1)
        if isinstance(d, Admit):
            lim.settle(now, d.reservation, 1)
            lim.recover(now, 1, d.reservation)
            now += 1.0 / per_s
        else:
            assert isinstance(d, WaitUntil)
            now = max(d.at, now + 1.0 / per_s)
    return now


def _refused(lim: RateLimiter, now: float) -> float:
    """The next call admitted (at ``now`` or as soon as the limiter lets it) draws a
    bare 429: a back-off; when it came."""
    at = lim.available_at(now)
    lim.back_off(at, admit(lim, at))
    return at


def test_a_cut_limit_that_binds_climbs_back_in_seconds() -> None:
    """After a transient 429, at ``RECOVER`` a request per answer, a model sending 20 a
    second took 18 minutes to get back (found by a hunt): while no 429 comes, each ten
    seconds in which the limit binds raise it ``RISE`` times, up to the limit it was
    cut from; additive after that."""
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    now = _refused(lim, _served_at(lim, 0.0, 10.0, 20))
    cut = lim.limits()[0]
    assert cut is not None
    assert cut == pytest.approx(1200 * BACK_OFF, rel=0.05)
    now = _served_at(lim, now, now + 25.0, 40)  # wants more than the limit: it binds
    climbed = lim.limits()[0]
    assert climbed is not None
    assert climbed >= 0.99 * 1200, "back to the rate it was cut from in two steps"
    _refused(lim, now)  # a provider really at its limit: one cut per probe
    assert lim.limits()[0] <= climbed * BACK_OFF


def test_a_limit_that_does_not_bind_or_draws_429s_does_not_climb() -> None:
    """The rise is only for a limit the calls press on, with no 429 for ten seconds."""
    lim = RateLimiter(LimiterConfig(rpm=600, tpm=None), 0.0)
    now = _refused(lim, _served_at(lim, 0.0, 10.0, 10))
    cut = lim.limits()[0]
    assert cut == pytest.approx(600 * BACK_OFF)
    quiet = _served_at(lim, now, now + 30.0, 1)  # one a second: far below the limit
    assert lim.limits()[0] == pytest.approx(cut + 30 * RECOVER, abs=2 * RECOVER)
    lim2 = RateLimiter(LimiterConfig(rpm=600, tpm=None), 0.0)
    now = _served_at(lim2, 0.0, 10.0, 10)
    stale = [admit(lim2, now + k) for k in range(6)]  # out when the limit is cut
    now = _refused(lim2, now + 6.0)
    for early in stale:  # their 429s, one each 5 s: the same congestion, no cut, but
        now = _served_at(lim2, now, now + 5.0, 20)  # no ten seconds without a 429
        lim2.back_off(now, early)
    assert lim2.limits()[0] < 600 * BACK_OFF * RISE, "additive only"
    assert quiet > 0


def test_a_limit_lowered_by_a_back_off_paces_through_the_bucket_only() -> None:
    """Configured at 3000 a minute against a provider taking 600: after the back-offs
    the 60 s window still held the calls admitted under the old limit, more than the
    lowered one, and the model was silent for 35 s (found by a hunt). The window holds
    the configured (or advertised) limit; a back-off's paces through the bucket."""
    lim = RateLimiter(LimiterConfig(rpm=3000, tpm=None, burst_s=60.0), 0.0)
    sent = [admit(lim, 0.0) for _ in range(1000)]  # 1000 in the window, few answered
    now = 1.0
    for _ in range(4):
        lim.recover(now, 1)  # an answer since: the next 429 is news
        now = _refused(lim, now)
    limit = lim.limits()[0]
    assert limit == pytest.approx(3000 * BACK_OFF**4, rel=0.01)
    assert limit < len(sent)
    at = lim.available_at(now)
    assert at <= now + 60.0 / limit, "paced, not held until the window frees"


def test_an_adopted_token_limit_holds_a_call_in_its_bucket() -> None:
    """Adopted after a 429 with a bucket of one token, a 1708-token call went as soon as
    one token had refilled, whatever the provider said remained (found by a hunt)."""
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=None), 0.0)
    lim.adopt(0.0, limit_requests=None, limit_tokens=60_000, unset_too=True)
    lim.observe(0.0, None, 300, None, 58.5)
    wait = lim.try_acquire(0.0, 1708)
    assert isinstance(wait, WaitUntil)
    assert wait.at == pytest.approx((1708 - 300) / 1000)


def test_a_429_saying_tokens_ran_out_backs_off_the_requests_when_no_tokens_are_limited() -> None:
    """An Azure deployment's 429 with ``x-ratelimit-remaining-tokens: 0`` for a model
    configured with rpm only: pacing the requests is the one way to slow down (found
    by a hunt: the limit stayed put through 254 429s)."""
    lim = RateLimiter(LimiterConfig(rpm=600, tpm=None), 0.0)
    admitted = lim.try_acquire(0.0, 1)
    assert isinstance(admitted, Admit)
    lim.back_off(1.0, admitted.reservation, tokens_spent=True)
    assert lim.limits() == (600 * BACK_OFF, None)
    both = RateLimiter(LimiterConfig(rpm=600, tpm=60_000), 0.0)
    admitted = both.try_acquire(0.0, 100)
    assert isinstance(admitted, Admit)
    both.back_off(1.0, admitted.reservation, tokens_spent=True)
    assert both.limits() == (600, 60_000 * BACK_OFF)  # the tokens, when they are limited


def test_what_remains_counts_from_when_the_call_was_admitted() -> None:
    """An answer arrives a round trip late: the provider's "remaining" is as of then.
    The calls admitted since and the refill since are taken into account, so pacing
    at the provider's own limit does not lose a round trip per call."""
    lim = RateLimiter(LimiterConfig(rpm=600, tpm=None, burst_s=1.0), 0.0)  # 10/s, bucket 10
    first = lim.try_acquire(0.0, 1)
    assert isinstance(first, Admit)
    for _ in range(4):  # four more while the first is out
        assert isinstance(lim.try_acquire(0.0, 1), Admit)
    # the provider had 9 left after the first; 0.1 s later one more has refilled
    lim.observe(0.1, 9, None, None, None, since=first.reservation)
    assert lim.headroom(0.1).requests == pytest.approx(6.0)  # our own count: 10 - 5 + 1
    lim.observe(0.1, 5, None, None, None, since=first.reservation)  # it had only 5 left
    assert lim.headroom(0.1).requests == pytest.approx(5 + 1 - 4)


def test_backing_off_never_goes_below_one_request_a_minute() -> None:
    lim = RateLimiter(LimiterConfig(rpm=2, tpm=None), 0.0)
    for t in range(50):
        if t:
            lim.recover(t * 60.0 - 30, 1)  # an answer between congestions
        d = lim.try_acquire(t * 60.0, 1)
        assert isinstance(d, Admit)
        lim.back_off(t * 60.0, d.reservation)
    assert lim.limits() == (1, None)


def test_anthropics_headers_are_read() -> None:
    now = 1_700_000_000.0
    reset = datetime.fromtimestamp(now + 20, tz=UTC).isoformat().replace("+00:00", "Z")
    h = read_headers(
        {
            "anthropic-ratelimit-requests-limit": "50",
            "anthropic-ratelimit-requests-remaining": "0",
            "anthropic-ratelimit-requests-reset": reset,
            "anthropic-ratelimit-tokens-limit": "80000",
            "anthropic-ratelimit-tokens-remaining": "79000",
            "anthropic-ratelimit-tokens-reset": "garbage",
            "anthropic-ratelimit-input-tokens-limit": "40000",
            "retry-after": "7",
        },
        now,
    )
    assert (h.limit_requests, h.remaining_requests) == (50, 0)
    assert h.reset_requests_s == pytest.approx(20.0)
    assert (h.limit_tokens, h.remaining_tokens, h.reset_tokens_s) == (None, 79000, None)
    assert h.retry_after_s == 7.0
    only_input = read_headers(
        {"anthropic-ratelimit-requests-limit": "50", "anthropic-ratelimit-input-tokens-limit": "9"},
        now,
    )
    assert only_input.limit_tokens is None, "an input-token limit is not a tpm"


@pytest.mark.parametrize("spelled", [str.lower, str.upper])
def test_a_reset_is_read_in_either_case_rfc_3339_allows(spelled: Callable[[str], str]) -> None:
    """RFC 3339 allows "t" and "z" lower-case; they were read as no reset at all."""
    now = 1_700_000_000.0
    reset = datetime.fromtimestamp(now + 20, tz=UTC).isoformat().replace("+00:00", "Z")
    h = read_headers({"anthropic-ratelimit-requests-reset": spelled(reset)}, now)
    assert h.reset_requests_s == pytest.approx(20.0)


def _anthropic_tier_1(now: float, output_left: int) -> dict[str, str]:
    """Tier 1's headers (50 rpm, 30,000 input and 8,000 output tokens a minute) after
    a call, its combined ``tokens-*`` showing the more restrictive: the output's."""
    at = datetime.fromtimestamp(now + 30, tz=UTC).isoformat()
    return {
        "anthropic-ratelimit-requests-limit": "50",
        "anthropic-ratelimit-requests-remaining": "49",
        "anthropic-ratelimit-tokens-limit": "8000",
        "anthropic-ratelimit-tokens-remaining": str(output_left),
        "anthropic-ratelimit-tokens-reset": at,
        "anthropic-ratelimit-input-tokens-limit": "30000",
        "anthropic-ratelimit-input-tokens-remaining": "25000",
        "anthropic-ratelimit-input-tokens-reset": at,
        "anthropic-ratelimit-output-tokens-limit": "8000",
        "anthropic-ratelimit-output-tokens-remaining": str(output_left),
        "anthropic-ratelimit-output-tokens-reset": at,
    }


def test_anthropics_token_limit_is_its_input_and_output_limits_together() -> None:
    """Its combined ``tokens-limit`` shows the more restrictive of the two (here the 8,000
    output tokens): taken as the limit of prompt and ``max_tokens`` together, a call of
    a 5,000-token prompt and 4,096 ``max_tokens``, within both, was refused for good
    (found by a hunt)."""
    now = 1_700_000_000.0
    h = read_headers(_anthropic_tier_1(now, output_left=7000), now)
    assert (h.limit_tokens, h.remaining_tokens) == (38000, 32000)  # 25,000 of 30,000 in
    assert (h.limit_parts, h.remaining_parts) == ((30000, 8000), (25000, 7000))
    assert h.reset_parts_s == (pytest.approx(30.0), pytest.approx(30.0))
    lim = RateLimiter(LimiterConfig(rpm=50, tpm=None), 0.0)
    lim.adopt(0.0, h.limit_requests, h.limit_tokens, unset_too=True)
    assert isinstance(lim.try_acquire(120.0, 5000 + 4096), Admit)
    spent = read_headers(_anthropic_tier_1(now, output_left=0), now)
    assert spent.remaining_tokens == 0, "one of the two spent is the limit spent"
    assert spent.reset_tokens_s == pytest.approx(30.0)


@pytest.mark.parametrize(
    ("values", "said"),
    [
        (["true"], True),
        (["false"], False),
        (["True"], None),  # the SDKs compare exactly
        (["yes"], None),
        (["true", "false"], False),  # sent twice: the cautious way
        ([], None),
    ],
)
def test_x_should_retry_is_read_as_the_sdks_read_it(values: list[str], said: bool | None) -> None:
    pairs = [("x-should-retry", v) for v in values]
    assert read_headers(pairs, 0.0).should_retry is said
    anthropic = [*pairs, ("anthropic-ratelimit-requests-limit", "50")]
    assert read_headers(anthropic, 0.0).should_retry is said


def _split_limiter(now: float = 0.0) -> RateLimiter:
    """No limit configured; the provider's word: 30,000 input and 8,000 output tokens
    a minute."""
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=None, burst_s=WINDOW_S), now)
    lim.adopt_parts(now, (30000, 8000))
    return lim


def test_input_and_output_limited_apart_each_holds_its_own_part() -> None:
    """Taken as one limit of 38,000, input-heavy calls went past the input limit while
    the sum had room: a third of them drew 429s (found by a hunt)."""
    lim = _split_limiter()
    assert lim.parts_limits() == (30000, 8000)
    admitted = [lim.try_acquire(0.0, 5100, (5000, 100)) for _ in range(5)]
    assert all(isinstance(a, Admit) for a in admitted)
    held = lim.try_acquire(0.0, 6100, (6000, 100))
    assert isinstance(held, WaitUntil), "25,000 input tokens are in: the sum had 12,500 left"
    assert held.at == pytest.approx(60.0)
    assert isinstance(lim.try_acquire(0.0, 4100, (100, 4000)), Admit), "both have room"
    assert isinstance(lim.try_acquire(0.0, 4500, (500, 4000)), WaitUntil), "output is full"
    assert lim.try_acquire(0.0, 9001, (1, 9000)) == TooLarge(9000, 8000)


def test_a_part_settles_to_what_it_used_and_a_release_gives_it_back() -> None:
    lim = _split_limiter()
    first = lim.try_acquire(0.0, 29000, (25000, 4000))
    assert isinstance(first, Admit)
    assert isinstance(lim.try_acquire(0.0, 6000, (6000, 0)), WaitUntil)
    lim.settle(1.0, first.reservation, 20500, actual_parts=(20000, 500))  # 5,000 back
    second = lim.try_acquire(1.0, 6000, (6000, 0))
    assert isinstance(second, Admit)
    lim.release(2.0, second.reservation)
    assert isinstance(lim.try_acquire(2.0, 9500, (9500, 0)), Admit), "20,000 + 9,500 in"


def test_what_remains_of_a_part_lowers_it_counting_what_went_since() -> None:
    lim = _split_limiter()
    first = lim.try_acquire(0.0, 200, (100, 100))
    assert isinstance(first, Admit)
    assert isinstance(lim.try_acquire(0.0, 2000, (1000, 1000)), Admit)  # after it
    # the provider counted the first as it came: 5,000 input left then, 1,000 sent since
    lim.observe_parts(0.0, (5000, None), (30.0, None), since=first.reservation)
    assert isinstance(lim.try_acquire(0.0, 4001, (4001, 0)), WaitUntil)
    assert isinstance(lim.try_acquire(0.0, 4000, (4000, 0)), Admit)


def test_a_provider_that_raises_a_part_has_it_raised() -> None:
    lim = _split_limiter()
    lim.adopt_parts(0.0, (None, 16000))
    assert lim.parts_limits() == (30000, 16000)
    for _ in range(2):  # a lower one, said twice
        lim.adopt_parts(0.0, (10000, None))
    assert lim.parts_limits() == (10000, 16000)


def test_a_call_not_told_its_parts_is_held_by_the_sum_alone() -> None:
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=1000, burst_s=WINDOW_S), 0.0)
    lim.adopt_parts(0.0, (100, 100))
    assert isinstance(lim.try_acquire(0.0, 900), Admit)  # the gateway's quotas: no parts


def test_a_header_sent_twice_is_read_the_cautious_way() -> None:
    """``retry-after: 4`` then ``retry-after: 1``: the last one won, and the model
    came back three seconds early (found by a hunt)."""
    h = read_headers(
        [
            ("retry-after", "4"),
            ("Retry-After", "1"),
            ("x-ratelimit-limit-requests", "500"),
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-tokens", "9"),
            ("x-ratelimit-remaining-tokens", "lots"),
            ("x-ratelimit-reset-tokens", "2s"),
            ("x-ratelimit-reset-tokens", "1m"),
        ],
        NOW_EPOCH,
    )
    assert (h.retry_after_s, h.limit_requests) == (4.0, 60)
    assert (h.remaining_tokens, h.reset_tokens_s) == (9, 60.0)


def test_a_back_off_never_makes_a_call_too_large_for_good() -> None:
    """Review: back-offs lowered the token limit under a 4000-token call, which then
    failed TooLarge (a request error) for a slow-down that passes."""
    lim = RateLimiter(LimiterConfig(rpm=None, tpm=8000), 0.0)
    for t in range(6):
        if t:
            lim.recover(t * 60.0 - 30, 100)  # an answer between congestions
        d = lim.try_acquire(t * 60.0, 100)
        assert isinstance(d, Admit)
        lim.back_off(t * 60.0, d.reservation)
    assert lim.limits()[1] < 4000
    big = lim.try_acquire(1000.0, 4000)
    assert isinstance(big, Admit), big  # admitted into debt once the window is empty
    assert isinstance(lim.try_acquire(1000.0, 9000), TooLarge), "the ceiling still rules"


def test_limit_headers_are_read() -> None:
    h = read_headers({"x-ratelimit-limit-requests": "500", "x-ratelimit-limit-tokens": "9e9"}, 0)
    assert (h.limit_requests, h.limit_tokens) == (500, None)


@pytest.mark.parametrize("offset", [-3600.0, -30.0, 30.0, 3600.0])
def test_times_of_day_are_read_on_the_providers_clock(offset: float) -> None:
    """A reset or a Retry-After date is the provider's time of day: read against the
    answer's ``Date``, not this host's clock, where the two are apart (a minute behind,
    a reset 20 s away was 80 s away; a minute ahead, it was past and ignored)."""
    here = 1_700_000_000.0
    theirs = here + offset
    reset = datetime.fromtimestamp(theirs + 20, tz=UTC).isoformat()
    later = format_datetime(datetime.fromtimestamp(theirs + 7, tz=UTC), usegmt=True)
    h = read_headers(
        {
            "anthropic-ratelimit-requests-remaining": "0",
            "anthropic-ratelimit-requests-reset": reset,
            "retry-after": later,
            "date": format_datetime(datetime.fromtimestamp(theirs, tz=UTC), usegmt=True),
        },
        here + 0.5,  # read half a second after the answer came
        here,
    )
    assert h.reset_requests_s == pytest.approx(19.5)
    assert h.retry_after_s == pytest.approx(6.5)


def test_a_date_close_to_ours_changes_nothing_and_none_is_trusted_without_its_arrival() -> None:
    """``Date`` counts whole seconds: within ``CLOCK_SKEW_S`` this host's clock says it
    better. Without the time the answer arrived (``heard_epoch``), a ``Date`` says
    nothing of the clocks (a long stream's answer is read long after its ``Date``)."""
    here = 1_700_000_000.0
    reset = datetime.fromtimestamp(here + 20, tz=UTC).isoformat()
    for date in (here - CLOCK_SKEW_S, here + CLOCK_SKEW_S, here - 999):
        said = {
            "anthropic-ratelimit-requests-reset": reset,
            "date": format_datetime(datetime.fromtimestamp(date, tz=UTC), usegmt=True),
        }
        heard = None if date == here - 999 else here
        assert read_headers(said, here, heard).reset_requests_s == pytest.approx(20.0)
    unreadable = {"anthropic-ratelimit-requests-reset": reset, "date": "yesterday"}
    assert read_headers(unreadable, here, here).reset_requests_s == pytest.approx(20.0)
    twice = [
        ("anthropic-ratelimit-requests-reset", reset),
        ("date", format_datetime(datetime.fromtimestamp(here - 60, tz=UTC), usegmt=True)),
        ("date", format_datetime(datetime.fromtimestamp(here - 30, tz=UTC), usegmt=True)),
    ]
    assert read_headers(twice, here, here).reset_requests_s == pytest.approx(80.0)  # earliest
