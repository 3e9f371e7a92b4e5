"""Pricing in integer nano-dollars (core/pricing.py): exact costs, the reservation
estimate that bounds them, and how amounts print."""

from __future__ import annotations

from decimal import Decimal

import pytest
from callboard.core.pricing import Price, cost_nusd, estimate_nusd, marks_cache, writes_cache
from callboard.messages import ChatMessage, ConfigError, Request, Usage
from hypothesis import given, settings
from hypothesis import strategies as st

MINI = Price(input_per_mtok="0.15", output_per_mtok="0.60", cached_input_per_mtok="0.075")


def test_price_takes_decimal_str_int_and_float_exactly() -> None:
    a = Price(Decimal("2.50"), "10", 1)
    assert (a.input_per_mtok, a.output_per_mtok, a.cached_input_per_mtok) == (
        Decimal("2.50"),
        Decimal(10),
        Decimal(1),
    )
    b = Price(0.1, 0.3)  # floats go through str(): 0.1, not 0.1000000000000000055...
    assert b.input_per_mtok == Decimal("0.1")
    assert b.output_per_mtok == Decimal("0.3")
    assert b.cached_input_per_mtok is None
    assert Price("0.15", "0.60") == Price(Decimal("0.15"), Decimal("0.60"))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input_per_mtok": "-1", "output_per_mtok": 1}, "input_per_mtok"),
        ({"input_per_mtok": 1, "output_per_mtok": "abc"}, "output_per_mtok"),
        ({"input_per_mtok": 1, "output_per_mtok": float("nan")}, "output_per_mtok"),
        ({"input_per_mtok": Decimal("Infinity"), "output_per_mtok": 1}, "input_per_mtok"),
        ({"input_per_mtok": True, "output_per_mtok": 1}, "input_per_mtok"),
        ({"input_per_mtok": 1, "output_per_mtok": 1, "cached_input_per_mtok": []}, "cached"),
        ({"input_per_mtok": 1, "output_per_mtok": 1, "reasoning_per_mtok": "-0.1"}, "reasoning"),
        ({"input_per_mtok": "1e999999", "output_per_mtok": 1}, "input_per_mtok"),  # overflowed
        ({"input_per_mtok": 1, "output_per_mtok": 10**6 + 1}, "output_per_mtok"),
    ],
)
def test_bad_prices_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Price(**kwargs)  # type: ignore[arg-type]


def test_cost_of_a_call() -> None:
    usage = Usage(prompt_tokens=1000, completion_tokens=500)
    assert cost_nusd(MINI, usage) == 1000 * 150 + 500 * 600  # 0.15 $/Mtok = 150 n$/token


def test_cached_tokens_are_priced_at_the_cached_price() -> None:
    usage = Usage(prompt_tokens=1000, completion_tokens=500, cached_tokens=400)
    assert cost_nusd(MINI, usage) == 600 * 150 + 400 * 75 + 500 * 600
    plain = Price("0.15", "0.60")  # no cached price: cached tokens cost full input price
    assert cost_nusd(plain, usage) == 1000 * 150 + 500 * 600


def test_cached_tokens_beyond_the_prompt_are_clamped() -> None:
    usage = Usage(prompt_tokens=10, completion_tokens=0, cached_tokens=50)
    assert cost_nusd(MINI, usage) == 10 * 75


def test_cache_writes_are_priced_at_the_cache_write_price_and_default_to_input() -> None:
    """Anthropic's example: 10 input, 100,000 written to the cache, 10 output tokens,
    at $3 / $15 and writes at 1.25x: $0.37518 (callboard said $0.30018)."""
    usage = Usage(prompt_tokens=100_010, completion_tokens=10, cache_write_tokens=100_000)
    sonnet = Price("3", "15", "0.30", cache_write_per_mtok="3.75")
    assert cost_nusd(sonnet, usage) == 375_180_000
    assert cost_nusd(Price("3", "15"), usage) == 300_180_000  # unset: the input price
    both = Usage(prompt_tokens=100, completion_tokens=0, cached_tokens=80, cache_write_tokens=50)
    assert cost_nusd(sonnet, both) == 80 * 300 + 20 * 3_750  # clamped: each token once
    assert estimate_nusd(sonnet, 100, 0) == 100 * 3_750  # reserved at the dearest input
    kept = Usage(
        prompt_tokens=100, completion_tokens=0, cache_write_tokens=60, cache_write_1h_tokens=40
    )
    hour = Price("3", "15", cache_write_per_mtok="3.75", cache_write_1h_per_mtok="6")
    assert cost_nusd(hour, kept) == 40 * 3_000 + 20 * 3_750 + 40 * 6_000
    assert cost_nusd(sonnet, kept) == 40 * 3_000 + 60 * 3_750  # 1-hour unset: as the others


def _price(prices: tuple[Decimal, ...] | tuple[Decimal | None, ...]) -> Price:
    inp, out, cached, reasoning, write, write_1h = prices
    assert inp is not None
    assert out is not None
    return Price(
        inp, out, cached, reasoning, cache_write_per_mtok=write, cache_write_1h_per_mtok=write_1h
    )


_PRICES = st.tuples(
    *[st.decimals(0, 100, places=6)] * 2, *[st.none() | st.decimals(0, 100)] * 4
).map(_price)
"""Prices: input and output, then cached, reasoning, cache-write and 1-hour cache-write
(each maybe unset)."""


@settings(max_examples=300, deadline=None)
@given(
    price=_PRICES,
    prompt=st.integers(0, 200_000),
    max_tokens=st.integers(0, 100_000),
    data=st.data(),
)
def test_the_estimate_bounds_the_cost_of_cache_reads_and_writes(
    price: Price,
    prompt: int,
    max_tokens: int,
    data: st.DataObject,
) -> None:
    cached = data.draw(st.integers(0, prompt))
    written = data.draw(st.integers(0, prompt - cached))
    completion = data.draw(st.integers(0, max_tokens))
    usage = Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        cache_write_tokens=written,
        cache_write_1h_tokens=data.draw(st.integers(0, written)),
    )
    assert 0 <= cost_nusd(price, usage) <= estimate_nusd(price, prompt, max_tokens)


def test_a_call_that_may_not_write_the_cache_is_bounded_without_its_price() -> None:
    claude = Price(3, 15, cache_write_1h_per_mtok=6)  # 1-hour writes at twice the input
    assert estimate_nusd(claude, 1000, 0) == 6_000_000
    assert estimate_nusd(claude, 1000, 0, cache_writes=False) == 3_000_000
    assert estimate_nusd(claude, 1000, 100, cache_writes=False) == 3_000_000 + 1_500_000


@settings(max_examples=200, deadline=None)
@given(
    price=_PRICES,
    prompt=st.integers(0, 200_000),
    max_tokens=st.integers(0, 100_000),
    data=st.data(),
)
def test_the_estimate_without_cache_writes_bounds_a_call_that_writes_none(
    price: Price,
    prompt: int,
    max_tokens: int,
    data: st.DataObject,
) -> None:
    usage = Usage(
        prompt_tokens=prompt,
        completion_tokens=data.draw(st.integers(0, max_tokens)),
        cached_tokens=data.draw(st.integers(0, prompt)),
    )
    bound = estimate_nusd(price, prompt, max_tokens, cache_writes=False)
    assert 0 <= cost_nusd(price, usage) <= bound <= estimate_nusd(price, prompt, max_tokens)


MARK = {"type": "ephemeral"}
TOOL = {"type": "function", "function": {"name": "t", "parameters": {}}}


@pytest.mark.parametrize(
    ("messages", "options", "marked"),
    [
        ([ChatMessage(role="user", content="hi")], {}, False),
        (
            [
                ChatMessage(role="system", content=[{"type": "text", "text": "s"}]),
                ChatMessage(
                    role="user", content=[{"type": "text", "text": "hi", "cache_control": MARK}]
                ),
            ],
            {},
            True,
        ),
        (
            [ChatMessage(role="user", content="hi")],
            {"tools": [TOOL | {"cache_control": MARK}]},
            True,
        ),
        ([ChatMessage(role="user", content="hi")], {"tools": [TOOL]}, False),
        (
            [ChatMessage(role="user", content="hi")],
            {"extra_body": {"note": "cache_control"}},
            False,
        ),
    ],
)
def test_a_request_writes_the_cache_only_where_it_marks_it(
    messages: list[ChatMessage], options: dict[str, object], marked: bool
) -> None:
    request = Request(messages=tuple(messages), options=options)
    assert writes_cache(request) is marked


def test_a_mark_is_looked_for_only_so_deep() -> None:
    deep: object = {"cache_control": MARK}
    for _ in range(7):
        deep = [deep]
    assert marks_cache(deep, depth=7)
    assert not marks_cache(deep, depth=6)


O_SERIES = Price("1.10", "4.40", "0.55", reasoning_per_mtok="8.80")  # whole n$ per token


def test_reasoning_tokens_are_priced_at_the_reasoning_price() -> None:
    usage = Usage(prompt_tokens=100, completion_tokens=500, reasoning_tokens=300)
    assert O_SERIES.reasoning_per_mtok == Decimal("8.80")
    assert cost_nusd(O_SERIES, usage) == 100 * 1_100 + 200 * 4_400 + 300 * 8_800


def test_without_a_reasoning_price_reasoning_costs_the_output_price() -> None:
    usage = Usage(prompt_tokens=100, completion_tokens=500, reasoning_tokens=300)
    assert MINI.reasoning_per_mtok is None
    plain = Usage(prompt_tokens=100, completion_tokens=500)
    assert cost_nusd(MINI, usage) == cost_nusd(MINI, plain)
    assert cost_nusd(MINI, usage) == 100 * 150 + 500 * 600


def test_reasoning_beyond_the_completion_is_clamped() -> None:
    usage = Usage(prompt_tokens=0, completion_tokens=10, reasoning_tokens=50)
    assert cost_nusd(O_SERIES, usage) == 10 * 8_800  # all ten were reasoning, none twice


def test_the_reasoning_price_is_part_of_what_makes_a_price() -> None:
    assert Price(1, 2, None, 3) != Price(1, 2)
    assert Price(1, 2, reasoning_per_mtok=2) != Price(1, 2)  # same charge, different table
    assert Price(1, 2, reasoning_per_mtok="3") == Price(1, 2, reasoning_per_mtok=3)


def test_a_fractional_reasoning_price_is_exact_too() -> None:
    p = Price("1", "1", reasoning_per_mtok="0.0125")  # 12.5 n$ per reasoning token
    usage = Usage(prompt_tokens=0, completion_tokens=1, reasoning_tokens=1)
    assert cost_nusd(p, usage) == 13  # 12.5 rounded half-up, once
    total = sum(cost_nusd(p, Usage(completion_tokens=2, reasoning_tokens=2)) for _ in range(1000))
    assert total == 1000 * 25


def test_rounding_is_half_up_and_happens_once() -> None:
    p = Price("0.0004", "0.0004")  # 0.4 n$ per token
    assert cost_nusd(p, Usage(prompt_tokens=1, completion_tokens=1)) == 1  # 0.8, not 0 + 0
    assert cost_nusd(p, Usage(prompt_tokens=1, completion_tokens=0)) == 0  # 0.4
    half = Price("0.0005", "0")  # 0.5 n$ per token
    assert cost_nusd(half, Usage(prompt_tokens=1)) == 1
    assert cost_nusd(half, Usage(prompt_tokens=3)) == 2  # 1.5


def test_many_tiny_costs_sum_to_the_exact_product() -> None:
    # 1.05 n$ apiece in floats of dollars would have drifted long before 100,000
    usage = Usage(prompt_tokens=7, completion_tokens=3)
    total = sum(cost_nusd(MINI, usage) for _ in range(100_000))
    exact = (Decimal(700_000) * Decimal("0.15") + Decimal(300_000) * Decimal("0.60")) * 1000
    assert total == exact == 285_000_000


def test_exact_on_the_decimal_path_too() -> None:
    p = Price("0.0375", "1.0125")  # 37.5 and 1012.5 n$ per token: not whole numbers
    usage = Usage(prompt_tokens=2, completion_tokens=2)
    total = sum(cost_nusd(p, usage) for _ in range(100_000))
    exact = (Decimal(200_000) * Decimal("0.0375") + Decimal(200_000) * Decimal("1.0125")) * 1000
    assert total == exact == 210_000_000


@settings(max_examples=300, deadline=None)
@given(
    prices=st.tuples(*[st.decimals(0, 100, places=6)] * 3),
    prompt=st.integers(0, 200_000),
    max_tokens=st.integers(0, 100_000),
    data=st.data(),
)
def test_the_estimate_bounds_the_cost(
    prices: tuple[Decimal, Decimal, Decimal], prompt: int, max_tokens: int, data: st.DataObject
) -> None:
    price = Price(*prices)
    completion = data.draw(st.integers(0, max_tokens))
    cached = data.draw(st.integers(0, prompt))
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
    assert 0 <= cost_nusd(price, usage) <= estimate_nusd(price, prompt, max_tokens)


@settings(max_examples=300, deadline=None)
@given(
    prices=st.tuples(*[st.decimals(0, 100, places=6)] * 2, *[st.none() | st.decimals(0, 100)] * 2),
    prompt=st.integers(0, 200_000),
    max_tokens=st.integers(0, 100_000),
    data=st.data(),
)
def test_the_estimate_bounds_the_cost_of_reasoning_too(
    prices: tuple[Decimal, Decimal, Decimal | None, Decimal | None],
    prompt: int,
    max_tokens: int,
    data: st.DataObject,
) -> None:
    price = Price(*prices)
    completion = data.draw(st.integers(0, max_tokens))
    reasoning = data.draw(st.integers(0, completion))
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion, reasoning_tokens=reasoning)
    assert 0 <= cost_nusd(price, usage) <= estimate_nusd(price, prompt, max_tokens)


def test_the_estimate_reserves_the_completion_at_the_dearer_of_output_and_reasoning() -> None:
    assert estimate_nusd(O_SERIES, 0, 100) == 100 * 8_800
    cheap_thinking = Price("1.10", "4.40", reasoning_per_mtok="1")
    assert estimate_nusd(cheap_thinking, 0, 100) == 100 * 4_400


def test_the_estimate_rounds_up() -> None:
    assert estimate_nusd(Price("0.0001", "0"), 1, 0) == 1  # 0.1 n$
    assert estimate_nusd(MINI, 1000, 500) == 1000 * 150 + 500 * 600
    with pytest.raises(ValueError, match="prompt_tokens"):
        estimate_nusd(MINI, -1, 10)


@settings(max_examples=300, deadline=None)
@given(
    price=st.tuples(st.decimals(0, 1000, places=4), st.decimals(0, 1000, places=4), st.none()),
    cached=st.none() | st.decimals(0, 1000, places=4),
    prompt=st.integers(0, 2_000_000),
    completion=st.integers(0, 100_000),
    cached_tokens=st.integers(0, 2_000_000),
    max_tokens=st.integers(0, 100_000),
)
def test_cost_never_exceeds_the_reservation(
    *,
    price: tuple[Decimal, Decimal, None],
    cached: Decimal | None,
    prompt: int,
    completion: int,
    cached_tokens: int,
    max_tokens: int,
) -> None:
    p = Price(price[0], price[1], cached)
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached_tokens)
    cost = cost_nusd(p, usage)
    assert cost >= 0
    if completion <= max_tokens:
        assert cost <= estimate_nusd(p, prompt, max_tokens)


GPT5 = Price(
    "1.25",
    "10",
    service_tiers={"priority": Price("2.5", "20"), "flex": Price("0.625", "5")},
)
"""GPT-5's standard price with its priority and flex tiers (OpenAI's pricing page)."""


def test_a_call_is_priced_at_the_tier_that_served_it() -> None:
    usage = Usage(prompt_tokens=1_000_000, completion_tokens=100_000)
    assert cost_nusd(GPT5.at_service_tier("priority"), usage) == 4_500_000_000  # $2.50 + $2.00
    assert cost_nusd(GPT5.at_service_tier("flex"), usage) == 1_125_000_000
    assert GPT5.at_service_tier("default") is GPT5  # a tier with no price of its own: the model's
    assert GPT5.at_service_tier(None) is GPT5
    assert cost_nusd(GPT5, usage) == 2_250_000_000


def test_the_reservation_bounds_the_dearest_tier() -> None:
    """The tier is known only from the answer: a reservation at the standard price was
    half what a priority call costs, and a budget could be overspent (found by a hunt)."""
    usage = Usage(prompt_tokens=1_000, completion_tokens=500)
    assert estimate_nusd(GPT5, 1_000, 500) >= cost_nusd(GPT5.at_service_tier("priority"), usage)
    assert estimate_nusd(GPT5, 1_000, 500) == estimate_nusd(Price("2.5", "20"), 1_000, 500)


@pytest.mark.parametrize(
    "tiers",
    [
        {"": Price(1, 2)},
        {"priority": "2.5"},
        {"priority": Price(1, 2, service_tiers={"flex": Price(1, 1)})},
        ["priority"],
    ],
)
def test_a_tier_is_a_name_and_a_plain_price(tiers: object) -> None:
    with pytest.raises(ConfigError, match="tier"):
        Price(1, 2, service_tiers=tiers)  # type: ignore[arg-type]


def test_tiers_make_prices_differ_and_survive_the_anthropic_defaults() -> None:
    assert Price(1, 2, service_tiers={"priority": Price(2, 4)}) != Price(1, 2)
    assert hash(GPT5) == hash(Price("1.25", "10", service_tiers=dict(GPT5.service_tiers)))
    cached = GPT5.caching_at(Decimal("0.1"), Decimal("1.25"), Decimal(2))
    priority = cached.at_service_tier("priority")  # each tier's cache at its own rates
    assert priority.cached_input_per_mtok == Decimal("0.25")  # (it was at 1x; a review)
    assert priority.cache_write_per_mtok == Decimal("3.125")
