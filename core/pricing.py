"""Prices and the cost of a call, in integer nano-dollars.

Theory of operation
-------------------
A ``Price`` is dollars per million tokens as exact ``Decimal`` values: input,
output, and optionally cached input (prompt tokens the provider served from
its cache) and reasoning (completion tokens the model spent thinking, which
the provider reports as part of the completion). Money leaves this module
only as ``int`` nano-dollars (1e-9 USD), so sums over millions of calls never
drift.

``cost_nusd`` computes a call's exact cost from its ``Usage`` and rounds it
half-up to a whole nano-dollar once, at the end: prompt tokens read from the
provider's cache at the cached price, those written to it at the cache-write
price, the other prompt tokens at the input price, reasoning tokens at the
reasoning price and the rest of the completion at the output price. A price
left unset falls back to the one it refines (cached and cache writes to input,
reasoning to output); a model of Anthropic's dialect, whose one published rule
holds for every model, defaults its cached and cache-write prices to
``ANTHROPIC_CACHE_TIMES`` its input price (``core/settings.py``). A price may have
prices of its own for service tiers (``service_tiers``: OpenAI bills the tier that
served a call, named in its answer); ``core/attempt.py`` charges at that one. ``estimate_nusd``
is the upper bound a budget reserves before dispatch: every prompt token at
the dearest of the input prices, ``max_tokens`` at the dearer of the output
and reasoning prices, rounded up.

What always holds: a price is finite and >= 0; floats are accepted only by
way of ``Decimal(str(x))`` (the shortest decimal that round-trips, i.e. what
the user wrote), never ``Decimal(x)``; for the same prompt size,
``cost_nusd <= estimate_nusd`` whenever completion_tokens <= max_tokens.
Reasoning tokens are counted within the completion (clamped to it), never on
top of it.
"""

from __future__ import annotations

import decimal
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_HALF_UP, Decimal

from callboard.messages import ConfigError, Request, Usage

__all__ = [
    "ANTHROPIC_CACHE_TIMES",
    "MAX_PRICE_PER_MTOK",
    "MAX_USD",
    "NUSD_PER_USD",
    "Price",
    "cost_nusd",
    "estimate_nusd",
    "marks_cache",
    "most_nusd",
    "usd_to_nusd",
    "writes_cache",
]

NUSD_PER_USD = 1_000_000_000
_NUSD_PER_TOKEN = Decimal(NUSD_PER_USD) / Decimal(1_000_000)  # per-Mtok USD -> nUSD per token
_CTX = decimal.Context(prec=80, rounding=ROUND_HALF_UP, traps=[decimal.InvalidOperation])

Amount = Decimal | str | int | float

MAX_USD = Decimal(10**12)
"""The largest budget taken: a trillion dollars is no limit, and a larger amount
overflows the nano-dollar arithmetic (``1e999999``) or shows as infinity where it is a
float (the metrics, the dashboard)."""
MAX_PRICE_PER_MTOK = Decimal(10**6)
"""The dearest price taken: a dollar a token (a dearer one is a slip, and ``1e999999``
overflowed at start)."""


def _to_decimal(name: str, value: Amount) -> Decimal:
    known = isinstance(value, Decimal | str | int | float) and not isinstance(value, bool)
    try:
        amount = Decimal(str(value) if isinstance(value, float) else value) if known else None
    except decimal.InvalidOperation:
        amount = None
    if amount is None:
        raise ConfigError(f"{name} must be a Decimal, str, int or float amount, got {value!r}")
    if not amount.is_finite() or not 0 <= amount <= MAX_PRICE_PER_MTOK:
        raise ConfigError(
            f"{name} must be an amount from 0 to {MAX_PRICE_PER_MTOK} (USD per million "
            f"tokens), got {value!r:.40}"
        )
    return amount


@dataclass(frozen=True, slots=True, init=False)
class Price:
    """US dollars per million tokens."""

    input_per_mtok: Decimal
    output_per_mtok: Decimal
    cached_input_per_mtok: Decimal | None
    """The price of a cached prompt token; None: same as ``input_per_mtok``."""
    reasoning_per_mtok: Decimal | None
    """The price of a reasoning token (part of the completion); None: same as
    ``output_per_mtok``."""
    cache_write_per_mtok: Decimal | None
    """The price of a prompt token written to the provider's cache; None: same as
    ``input_per_mtok`` (Anthropic charges 1.25 times it for its 5-minute cache)."""
    cache_write_1h_per_mtok: Decimal | None
    """The price of one written to its 1-hour cache (Anthropic: 2 times the input
    price); None: same as ``cache_write_per_mtok``."""
    service_tiers: tuple[tuple[str, Price], ...]
    """Prices by service tier (OpenAI's ``service_tier``: ``flex``, ``priority``, ...),
    each whole; a call is charged at the tier its answer says served it
    (``at_service_tier``).
    Empty: one price for every tier."""
    _int_rates: tuple[int, ...] | None = field(repr=False, compare=False)
    """nUSD per (input, output, cached, reasoning, cache write, 1-hour cache write)
    token, when all are whole numbers."""

    def __init__(
        self,
        input_per_mtok: Amount,
        output_per_mtok: Amount,
        cached_input_per_mtok: Amount | None = None,
        reasoning_per_mtok: Amount | None = None,
        *,
        cache_write_per_mtok: Amount | None = None,
        cache_write_1h_per_mtok: Amount | None = None,
        service_tiers: Mapping[str, Price] | None = None,
    ) -> None:
        object.__setattr__(self, "input_per_mtok", _to_decimal("input_per_mtok", input_per_mtok))
        object.__setattr__(self, "output_per_mtok", _to_decimal("output_per_mtok", output_per_mtok))
        for name, value in (
            ("cached_input_per_mtok", cached_input_per_mtok),
            ("reasoning_per_mtok", reasoning_per_mtok),
            ("cache_write_per_mtok", cache_write_per_mtok),
            ("cache_write_1h_per_mtok", cache_write_1h_per_mtok),
        ):
            object.__setattr__(self, name, None if value is None else _to_decimal(name, value))
        object.__setattr__(self, "service_tiers", _tiers(service_tiers))
        rates = [_CTX.multiply(p, _NUSD_PER_TOKEN) for p in self._per_token_prices()]
        whole = all(r == r.to_integral_value() for r in rates)
        object.__setattr__(self, "_int_rates", tuple(int(r) for r in rates) if whole else None)

    def _per_token_prices(self) -> tuple[Decimal, ...]:
        """(input, output, cached input, reasoning, cache write, 1-hour cache write)
        dollars per Mtok, unset ones defaulted."""
        cached, reasoning = self.cached_input_per_mtok, self.reasoning_per_mtok
        written = (
            self.input_per_mtok if self.cache_write_per_mtok is None else self.cache_write_per_mtok
        )
        kept = self.cache_write_1h_per_mtok
        return (
            self.input_per_mtok,
            self.output_per_mtok,
            self.input_per_mtok if cached is None else cached,
            self.output_per_mtok if reasoning is None else reasoning,
            written,
            written if kept is None else kept,
        )

    def at_service_tier(self, tier: object) -> Price:
        """The price of a call served at ``tier`` (the answer's ``service_tier``): that
        tier's when one is set, else this one."""
        if self.service_tiers and isinstance(tier, str):
            for name, price in self.service_tiers:
                if name == tier:
                    return price
        return self

    def caching_at(self, read: Decimal, write: Decimal, write_1h: Decimal) -> Price:
        """This price with cache reads at ``read`` times the input price and cache writes
        at ``write`` times it (``write_1h`` to the 1-hour cache), where it sets none."""
        cached, written, kept = (
            self.cached_input_per_mtok,
            self.cache_write_per_mtok,
            self.cache_write_1h_per_mtok,
        )
        tiers = {name: p.caching_at(read, write, write_1h) for name, p in self.service_tiers}
        if (  # each tier's too: a tier's cached reads were at its whole input (a review)
            cached is not None
            and written is not None
            and kept is not None
            and all(tiers[n] is p for n, p in self.service_tiers)
        ):
            return self

        def times(given: Decimal | None, factor: Decimal) -> Decimal:
            return _CTX.multiply(self.input_per_mtok, factor) if given is None else given

        return Price(
            self.input_per_mtok,
            self.output_per_mtok,
            times(cached, read),
            self.reasoning_per_mtok,
            cache_write_per_mtok=times(written, write),
            cache_write_1h_per_mtok=times(kept, write_1h),
            service_tiers=tiers,
        )


ANTHROPIC_CACHE_TIMES = (Decimal("0.1"), Decimal("1.25"), Decimal(2))
"""A cache read's price over the input price, and a cache write's to the 5-minute and
the 1-hour cache, for a model of Anthropic's dialect that sets none (Anthropic's
docs: "Prompt caching", pricing: reads 0.1x, writes 1.25x and 2x the base input
price). Without the read's, a cached prompt token was charged the whole input price,
ten times Anthropic's bill (found by a hunt)."""


def _tiers(given: Mapping[str, Price] | None) -> tuple[tuple[str, Price], ...]:
    """``given`` as sorted pairs, checked: a tier is a name, its price a ``Price`` with no
    tiers of its own."""
    if not given:
        return ()
    if not isinstance(given, Mapping):
        raise ConfigError(
            f"service_tiers must map a service tier's name to its Price, got {given!r:.60}"
        )
    for name, price in given.items():
        if not isinstance(name, str) or not name or not name.isprintable():
            raise ConfigError(f"a tier's name must be a non-empty string, got {name!r:.40}")
        if not isinstance(price, Price) or price.service_tiers:
            raise ConfigError(f"tier {name!r}: must be a Price with no tiers of its own")
    return tuple(sorted(given.items()))


def _split(usage: Usage) -> tuple[int, ...]:
    """(other prompt, other completion, cached prompt, reasoning, prompt written to the
    cache, of which to its 1-hour cache) tokens, each clamped to what holds it, so
    each token counts once."""
    prompt = max(0, usage.prompt_tokens)
    cached = min(max(0, usage.cached_tokens), prompt)
    written = min(max(0, usage.cache_write_tokens), prompt - cached)
    kept = min(max(0, usage.cache_write_1h_tokens), written)
    completion = max(0, usage.completion_tokens)
    reasoning = min(max(0, usage.reasoning_tokens), completion)
    other = prompt - cached - written
    return other, completion - reasoning, cached, reasoning, written - kept, kept


def cost_nusd(price: Price, usage: Usage) -> int:
    """The exact cost of one call in nano-dollars, rounded half-up once."""
    counts = _split(usage)
    if price._int_rates is not None:
        return sum(n * r for n, r in zip(counts, price._int_rates, strict=True))
    usd_mtok = Decimal(0)
    for n, p in zip(counts, price._per_token_prices(), strict=True):
        usd_mtok = _CTX.add(usd_mtok, _CTX.multiply(Decimal(n), p))
    nusd = _CTX.multiply(usd_mtok, _NUSD_PER_TOKEN)
    return int(nusd.to_integral_value(rounding=ROUND_HALF_UP, context=_CTX))


def estimate_nusd(
    price: Price, prompt_tokens: int, max_tokens: int, *, cache_writes: bool = True
) -> int:
    """An upper bound on a call's cost, for budget reservation (rounded up): at the
    dearest of its prices, service tiers included (the tier is known only from the
    answer), cache writes too where the call may write the cache (``cache_writes``:
    ``writes_cache`` of its request; how much is written is known only then)."""
    return most_nusd(price, prompt_tokens, max_tokens, tiers=True, cache_writes=cache_writes)


def writes_cache(request: Request) -> bool:
    """Whether a call of ``request`` may write the provider's prompt cache: a
    ``cache_control`` mark in it (on a content part, a tool, a provider's own field)."""
    return marks_cache((request.options, *(m.content for m in request.messages)))


def marks_cache(value: object, depth: int = 6) -> bool:
    """Whether ``value`` (a request's fields and messages, parsed or as sent) holds a
    ``cache_control`` key within ``depth`` levels. Anthropic writes its cache only
    where a request marks it, at up to twice the input price: a cut call without a
    mark charged at that price paid twice its prompt (a review), and a budget
    reserving it held twice a Claude prompt's cost of every call, so a budget with
    room for the call refused or downgraded it."""
    if depth < 0:
        return False
    if isinstance(value, Mapping):
        inside = value.values()
        return "cache_control" in value or any(marks_cache(v, depth - 1) for v in inside)
    if isinstance(value, list | tuple):
        return any(marks_cache(v, depth - 1) for v in value)
    return False


def most_nusd(
    price: Price,
    prompt_tokens: int,
    max_tokens: int,
    *,
    tiers: bool = False,
    cache_writes: bool = True,
) -> int:
    """The most a call of ``prompt_tokens`` and ``max_tokens`` can cost at ``price``
    (rounded up): every prompt token at the dearest of input, cached and (with
    ``cache_writes``: the call may write the cache) cache-write prices, every answer
    token at the dearer of output and reasoning; at the dearest service tier too with
    ``tiers``. What a call billed without its usage is charged: charged its prompt at
    the input price and its answer at the output price, it fell below its reservation
    where reasoning or cache writes cost more, and the budget freed money the provider
    had spent (1.7x a budget with reasoning at twice the output price; a hunt)."""
    _check_sizes(prompt_tokens, max_tokens)
    dearest_in = dearest_out = Decimal(0)
    for each in (price, *(p for _, p in price.service_tiers if tiers)):
        inp, out, cached, reasoning, written, kept = each._per_token_prices()
        dearest_in = max(dearest_in, inp, cached, *((written, kept) if cache_writes else ()))
        dearest_out = max(dearest_out, out, reasoning)
    return _ceiling_nusd(prompt_tokens, dearest_in, max_tokens, dearest_out)


def list_nusd(price: Price, prompt_tokens: int, max_tokens: int) -> int:
    """What a call costs at ``price``'s list prices (rounded up): its prompt at the input
    price, its answer at the dearer of the output and reasoning prices; what routing's
    cost order compares. Not a bound: a dearer service tier and cache writes are paid
    only by the calls they serve, so ranking by them put a model whose 1-hour cache
    writes cost twice its input (Anthropic's default) after a dearer one (found by a
    hunt), as a dearer tier did before (a review)."""
    _check_sizes(prompt_tokens, max_tokens)
    inp, out, _, reasoning, _, _ = price._per_token_prices()
    return _ceiling_nusd(prompt_tokens, inp, max_tokens, max(out, reasoning))


def _check_sizes(prompt_tokens: int, max_tokens: int) -> None:
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError(
            f"prompt_tokens and max_tokens must be >= 0, got {prompt_tokens}, {max_tokens}"
        )


def _ceiling_nusd(prompt_tokens: int, per_in: Decimal, max_tokens: int, per_out: Decimal) -> int:
    usd_mtok = _CTX.add(
        _CTX.multiply(Decimal(prompt_tokens), per_in),
        _CTX.multiply(Decimal(max_tokens), per_out),
    )
    nusd = _CTX.multiply(usd_mtok, _NUSD_PER_TOKEN)
    return int(nusd.to_integral_value(rounding=ROUND_CEILING, context=_CTX))


def usd_text(usd: Decimal) -> str:
    """Dollars as plain decimal text, without trailing zeros or an exponent
    (``0.00000029``, where ``str`` gave ``2.9E-7``): what every face writes."""
    return format(usd.normalize(), "f")


def usd_to_nusd(usd: Decimal | int | str) -> int:
    """Dollars (exact: Decimal, int or a decimal string) as integer nano-dollars."""
    return int((Decimal(usd) * NUSD_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))
