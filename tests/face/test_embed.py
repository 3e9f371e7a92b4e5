"""``embed`` (callboard/_embed.py and ``System.embed``): texts split into provider-sized
calls, sent as ordinary tasks in one burst, and put back in input order.

End to end through real actors against the simulated provider (its vectors are a pure
function of text and length, ``provider.embeddings.vector``: the oracle here), or a
loopback server playing a provider that fails one batch or answers unusably. Pure
parts (``Batching``, ``ordered_vectors``) are tested directly, and ``Gathering`` with
futures the test resolves itself.
"""

from __future__ import annotations

import base64
import gc
import json
import math
import struct
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from decimal import Decimal
from typing import Any

import pytest
from callboard.core.limiter import LimiterConfig
from callboard.core.retry import RetryConfig
from callboard.core.tokens import MOST_TOKENS_PER_CHAR, text_tokens
from callboard.messages import Rejected, RejectReason, Result, Usage
from callboard.provider.embeddings import vector
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from hypothesis import given, settings
from hypothesis import strategies as st
from loopback import Cue, Reply, WireServer, openai_error, replying
from support import WAIT_S, requests_seen, running, threads_since, wait_until

from callboard import (
    BudgetSettings,
    Cancelled,
    Completed,
    EmbeddingResult,
    EmbedFuture,
    Expired,
    Failed,
    FailureReason,
    InvalidRequestError,
    ModelSettings,
    Price,
    SchedulerSettings,
    System,
    SystemConfig,
    UnknownModelError,
    _embed,
)
from callboard._embed import (
    CHUNK_TEXTS,
    FLOAT_BYTES,
    FLOAT_DIMENSIONS,
    Assembler,
    Batching,
    Gathering,
    Limits,
    Plan,
    UnusableAnswerError,
    answer_texts,
    ordered_vectors,
    split,
)

NUSD_PER_TOKEN = 1_000
PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(0))
"""$1 a million prompt tokens: a token costs 1,000 nano-dollars, an embedding nothing more."""


def embedder(base_url: str, name: str = "e", **fields: Any) -> ModelSettings:
    """A priced model that embeds."""
    settings: dict[str, Any] = {
        "capabilities": frozenset({"embeddings"}),
        "price": PRICE,
        "max_concurrency": 4,
        **fields,
    }
    return ModelSettings(name=name, base_url=base_url, **settings)


def texts(n: int, width: int = 12) -> list[str]:
    """``n`` different texts of ``width`` characters each."""
    return [f"text {i:0{width - 5}d}" for i in range(n)]


def oracle(text: str, dimensions: int) -> list[float]:
    """What the simulated provider embeds ``text`` as."""
    return vector(text.encode(), dimensions)


def embedded(cb: System, inputs: Any, **fields: Any) -> EmbeddingResult:
    return cb.embed(inputs, **fields).result(WAIT_S)


# -- end to end on the simulated provider ------------------------------------------------------


def test_5000_texts_go_as_3_calls_and_come_back_in_input_order(
    provider: SimulatedProvider,
) -> None:
    inputs = texts(5000)
    with running(embedder(provider.base_url)) as cb:
        before = requests_seen(provider)
        result = embedded(cb, inputs, dimensions=8)
        sent = requests_seen(provider) - before
    assert result.ok, result.detail
    assert (result.batches, sent) == (3, 3)  # 2048 + 2048 + 904
    assert result.vectors == [oracle(t, 8) for t in inputs]
    tokens = sum(text_tokens(t) for t in inputs)
    assert result.usage == Usage(prompt_tokens=tokens)
    assert result.cost_nusd == tokens * NUSD_PER_TOKEN
    assert result.cost_usd == Decimal(tokens) / 10**6
    assert result.model == "e"


def test_vectors_asked_as_numbers_go_in_calls_whose_answers_fit(
    provider: SimulatedProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,048 vectors of 1,536 as JSON numbers made a 67.5 MB answer, past the 64 MB an
    answer may be: malformed, sent again, billed each time (found by a hunt). Here the
    bound is 256 KB: 128 vectors of 64 a call."""
    monkeypatch.setattr(_embed, "MAX_ANSWER_BYTES", 256 * 1024)
    inputs = texts(300)
    with running(embedder(provider.base_url)) as cb:
        before = requests_seen(provider)
        floats = embedded(cb, inputs, dimensions=64, encoding_format="float")
        sent = requests_seen(provider) - before
        as_base64 = embedded(cb, inputs, dimensions=64)
    assert floats.ok, floats.detail
    assert (floats.batches, sent) == (3, 3)  # 128 + 128 + 44
    assert as_base64.batches == 1, "base64 is bounded by the batch size alone"
    assert floats.vectors == as_base64.vectors == [oracle(t, 64) for t in inputs]


def test_answer_texts_bounds_numbers_only() -> None:
    assert answer_texts({"encoding_format": "base64", "dimensions": 3072}) is None
    assert answer_texts({}) is None
    most = _embed.MAX_ANSWER_BYTES
    assert answer_texts({"encoding_format": "float", "dimensions": 1536}) == most // (
        1536 * FLOAT_BYTES
    )
    unsaid = answer_texts({"encoding_format": "float"})
    assert unsaid == most // (FLOAT_DIMENSIONS * FLOAT_BYTES)
    assert 2048 * 1536 * 21.5 > most > 1365 * 1536 * 21.5, "the hunt's answer, and ours"
    assert answer_texts({"encoding_format": "float", "dimensions": 10**9}) == 1


def test_dimensions_are_honoured_and_every_encoding_gives_the_same_vectors(
    provider: SimulatedProvider,
) -> None:
    inputs = ["alpha", "beta", "gamma"]
    with running(embedder(provider.base_url)) as cb:
        default = embedded(cb, inputs, dimensions=5)  # base64 on the wire, floats out
        floats = embedded(cb, inputs, dimensions=5, encoding_format="float")
        kept = embedded(cb, inputs, dimensions=5, keep_base64=True)
        natural = embedded(cb, inputs)
    assert default.vectors == floats.vectors == [oracle(t, 5) for t in inputs]
    assert kept.vectors == []
    assert kept.vectors_base64 is not None
    assert [list(struct.unpack("<5f", base64.b64decode(v))) for v in kept.vectors_base64] == (
        default.vectors
    )
    assert {len(v) for v in natural.vectors} == {ModelBehaviour().dimensions}


def test_one_string_is_one_text(provider: SimulatedProvider) -> None:
    with running(embedder(provider.base_url)) as cb:
        result = embedded(cb, "just one", dimensions=4)
    assert result.vectors == [oracle("just one", 4)]


def test_token_ids_are_texts_as_the_api_takes_them(provider: SimulatedProvider) -> None:
    """A list of integers is one input, a list of them several; counted by their length."""
    with running(embedder(provider.base_url)) as cb:
        many = embedded(cb, [[1820, 374], "a text", [9906]], dimensions=4)
        one = embedded(cb, [1820, 374], dimensions=4)
        for bad in ([[1820, True]], [[-1]], [[]], [[1.5]]):
            with pytest.raises(
                InvalidRequestError,
                match=r"texts\[0\] must be a non-empty string or list of token ids",
            ):
                cb.embed(bad)
    assert len(many.vectors) == 3
    assert one.vectors == many.vectors[:1]
    assert many.vectors[1] == oracle("a text", 4)


@pytest.mark.parametrize(
    ("size", "calls"),
    [(2, 3), (10, 2)],
    ids=["two-a-call-by-count", "three-a-call-by-tokens"],
)
def test_the_models_limits_split_by_count_and_by_tokens(
    provider: SimulatedProvider, size: int, calls: int
) -> None:
    inputs = ["some words to embed"] * 5 + ["last"]
    each = text_tokens(inputs[0])
    # room for three such texts a call (and max_tokens' one), or two of them at most
    model = embedder(
        provider.base_url, embedding_batch_size=size, embedding_batch_tokens=3 * each + 1
    )
    with running(model) as cb:
        before = requests_seen(provider)
        result = embedded(cb, inputs, dimensions=3)
        sent = requests_seen(provider) - before
    assert (result.batches, sent) == (calls, calls)
    assert result.vectors == [oracle(t, 3) for t in inputs]


def test_the_estimate_is_what_the_provider_reports_so_an_exact_budget_suffices(
    provider: SimulatedProvider,
) -> None:
    inputs = ["a" * 8, "b" * 8, "c" * 8, "d" * 8]  # 2 tokens each, two calls of 4
    cost = 8 * NUSD_PER_TOKEN
    config = SystemConfig(
        models=(embedder(provider.base_url, embedding_batch_size=2),),
        budget=BudgetSettings(total_usd=Decimal(cost) / 10**9),
    )
    with System(config) as cb:
        result = embedded(cb, inputs, dimensions=2)
    assert result.ok, result.detail
    assert result.cost_nusd == cost
    assert result.usage.prompt_tokens == sum(text_tokens(t) for t in inputs)


def test_a_budget_refusal_fails_the_batch_it_refused_and_names_its_texts(
    provider: SimulatedProvider,
) -> None:
    inputs = ["a" * 8, "b" * 8, "c" * 8, "d" * 8]
    config = SystemConfig(
        models=(embedder(provider.base_url, embedding_batch_size=2, max_concurrency=1),),
        budget=BudgetSettings(total_usd=Decimal(8 * NUSD_PER_TOKEN - 1) / 10**9),
    )
    with System(config) as cb:
        result = embedded(cb, inputs, dimensions=2)
    assert not result.ok
    assert isinstance(result.failure, Failed)
    assert result.failure.reason is FailureReason.BUDGET_EXCEEDED
    assert (result.failed_batch, result.failed_inputs) == (1, range(2, 4))
    assert "batch 1 (texts 2..3)" in result.detail
    assert result.vectors == []
    assert result.vectors_base64 is None
    # batch 0 was cancelled with the refusal unless it was sent already
    assert result.cost_nusd in (0, 4 * NUSD_PER_TOKEN)


def test_no_call_is_above_the_tokens_per_minute_and_the_next_waits_for_the_window(
    provider: SimulatedProvider,
) -> None:
    # tpm = the input's estimate: it cannot go as one call (max_tokens adds one); it goes
    # as all texts but one, then that one, which the limiter holds for most of a minute:
    # with a 2 s deadline it expires, and the result names it.
    inputs = ["a few words to embed"] * 100
    tpm = 100 * text_tokens(inputs[0])
    model = embedder(provider.base_url, limiter=LimiterConfig(rpm=None, tpm=tpm))
    with running(model) as cb:
        result = embedded(cb, inputs, dimensions=2, deadline_s=2.0)
    assert result.batches == 2
    assert isinstance(result.failure, Expired)
    assert (result.failed_batch, result.failed_inputs) == (1, range(99, 100))
    assert 0 < result.usage.prompt_tokens < tpm  # the first call went, within the limit


def test_without_a_model_the_first_that_embeds_serves(provider: SimulatedProvider) -> None:
    chat = ModelSettings(name="chat", base_url=provider.base_url, capabilities={"tools"})
    with running(chat, embedder(provider.base_url)) as cb:
        result = embedded(cb, ["hi"], dimensions=2)
    assert result.model == "e"


def test_an_input_of_more_calls_than_the_queue_holds_goes_chunk_by_chunk(
    provider: SimulatedProvider,
) -> None:
    """With ``wait_s``, each chunk's calls wait for room in the queue while the calls
    before them are on the wire: 26 calls through a queue of 8, all in input order."""
    listed = texts(3 * CHUNK_TEXTS + 300)
    config = SystemConfig(
        models=(embedder(provider.base_url, embedding_batch_size=256),),
        scheduler=SchedulerSettings(capacity=8),
    )
    with System(config) as cb:
        result = embedded(cb, listed, dimensions=8, wait_s=WAIT_S)
    assert result.ok, result.detail
    assert result.batches == -(-len(listed) // 256) == 26
    assert result.vectors[::97] == [oracle(t, 8) for t in listed[::97]]
    assert result.vectors[-1] == oracle(listed[-1], 8)


def test_a_queue_still_full_after_calls_went_out_fails_the_result_not_the_call() -> None:
    """``embed(..., wait_s=...)`` raised ``QueueFullError`` for its second chunk after
    the first chunk's calls were sent and charged: the caller had no future for them.
    Once a call went out, the caller gets the future; its result fails by the refusal."""
    cue = Cue()
    held = WireServer(_held(cue))
    with held:
        config = SystemConfig(
            models=(embedder(held.base_url, embedding_batch_size=1024, max_concurrency=1),),
            scheduler=SchedulerSettings(capacity=3),
        )
        with System(config) as cb:
            future = cb.embed(texts(2 * CHUNK_TEXTS), wait_s=0.3)  # 2 calls, then 2 more
            cue.set()
            result = future.result(WAIT_S)
            assert cb.drain(WAIT_S)
    assert held.count() >= 1  # the first chunk's calls went out
    assert not result.ok
    assert isinstance(result.failure, Rejected), result.failure
    assert result.failure.reason is RejectReason.QUEUE_FULL


def test_the_default_system_embeds_on_its_simulated_models() -> None:
    with System() as cb:
        future = cb.embed(["hello", "world"], dimensions=6)
        result = future.result(WAIT_S)
    assert isinstance(future, EmbedFuture)  # public, with its ``spent`` (it was not)
    assert future.spent.result(WAIT_S) == result
    assert result.ok, result.detail
    assert result.vectors == [oracle("hello", 6), oracle("world", 6)]
    assert result.model == "sim-fast"


def test_priority_and_budget_tag_go_with_every_batch(provider: SimulatedProvider) -> None:
    config = SystemConfig(
        models=(embedder(provider.base_url, embedding_batch_size=1),),
        budget=BudgetSettings(per_tag_usd={"team-a": Decimal(1)}),
    )
    with System(config) as cb:
        result = embedded(cb, ["aaaa", "bbbb"], priority="high", budget_tag="team-a")
        stats = cb.stats()
    assert result.ok
    assert stats.by_priority["HIGH"].finished == 2
    assert stats.budget["spent_nusd"] == 2 * NUSD_PER_TOKEN


@pytest.mark.parametrize(
    ("inputs", "fields", "error", "needle"),
    [
        ([], {}, InvalidRequestError, "empty"),
        (["a", ""], {}, InvalidRequestError, "texts[1]"),
        (["a", 5], {}, InvalidRequestError, "texts[1]"),
        (5, {}, InvalidRequestError, "texts must be"),
        (["a"], {"model": "nope"}, UnknownModelError, "nope"),
        (["a"], {"dimensions": 0}, InvalidRequestError, "dimensions"),
        (["a"], {"encoding_format": "int8"}, InvalidRequestError, "encoding_format"),
        (["a"], {"keep_base64": True, "encoding_format": "float"}, InvalidRequestError, "keep"),
        (["a"], {"priority": "urgent"}, InvalidRequestError, "priority"),
        (["a"], {"wait_s": -1}, InvalidRequestError, "wait_s"),
        (["a"], {"model": "e", "route": "r"}, InvalidRequestError, "one of 'model'"),
        (["a"], {"dimension": 3}, InvalidRequestError, "did you mean 'dimensions'"),  # a TypeError
        (["x" * 4000], {}, InvalidRequestError, f"texts[0] is about {text_tokens('x' * 4000)}"),
    ],
)
def test_misuse_raises_before_anything_is_sent(
    provider: SimulatedProvider, inputs: Any, fields: dict[str, Any], error: type, needle: str
) -> None:
    model = embedder(provider.base_url, embedding_batch_tokens=500)
    with running(model) as cb:
        before = requests_seen(provider)
        with pytest.raises(error) as raised:
            cb.embed(inputs, **fields)
        assert requests_seen(provider) == before
    assert needle in str(raised.value)


def test_without_a_model_that_embeds_one_must_be_named(provider: SimulatedProvider) -> None:
    chat = ModelSettings(name="chat", base_url=provider.base_url)
    with running(chat) as cb, pytest.raises(InvalidRequestError, match="need a model"):
        cb.embed(["hi"])


# -- a provider that fails a batch, or answers one unusably -----------------------------------


def _embeddings(n: int, body: Any) -> Reply:
    """An embeddings provider: the vector of a text is [its length, 1.0], the items in
    reverse order (each with its index); a batch holding ``poison`` is refused (400),
    one holding ``short`` answered with a vector too few, one holding ``flaky`` is a 500
    for the model ``first``."""
    inputs = body["input"]
    if "poison" in inputs:
        return 400, {}, json.dumps(openai_error("poison", "invalid_request_error")).encode()
    if "flaky" in inputs and body["model"] == "first":
        return 500, {}, json.dumps(openai_error("try later")).encode()
    data = [
        {"object": "embedding", "index": i, "embedding": [float(len(t)), 1.0]}
        for i, t in enumerate(inputs)
    ][::-1]
    if "short" in inputs:
        data = data[1:]
    tokens = sum(text_tokens(t) for t in inputs)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return 200, {}, json.dumps({"object": "list", "data": data, "usage": usage}).encode()


@pytest.fixture
def wire() -> Iterator[WireServer]:
    with WireServer(replying(_embeddings)) as server:
        yield server


def test_vectors_are_placed_by_their_index_not_their_place_in_the_answer(
    wire: WireServer,
) -> None:
    with running(embedder(wire.base_url, embedding_batch_size=2)) as cb:
        result = embedded(cb, ["a", "bb", "ccc"], encoding_format="float")
    assert result.vectors == [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]


def test_a_failing_batch_fails_the_whole_naming_it_and_its_texts(wire: WireServer) -> None:
    with running(embedder(wire.base_url, embedding_batch_size=2)) as cb:
        result = embedded(cb, ["a", "b", "c", "poison", "e"])
    assert not result.ok
    assert isinstance(result.failure, Failed)
    assert result.failure.reason is FailureReason.REQUEST_ERROR
    assert (result.failed_batch, result.failed_inputs) == (1, range(2, 4))
    assert result.detail.startswith("batch 1 (texts 2..3) ended Failed (request_error)")
    assert result.vectors == []
    assert result.usage.prompt_tokens >= 2  # batch 0 ran, and is paid for


def test_a_failed_batch_stops_the_chunks_not_sent_yet(wire: WireServer) -> None:
    """A call a chunk: with a queue of one, each chunk waits for the call before it to
    end, and the first is refused. embed stops sending (after the chunk whose room it
    was waiting for, and on a slow machine the next: the failure reaches the gathering
    a moment after the room frees), and every task it sent ends."""
    listed = ["poison", *texts(20 * CHUNK_TEXTS)]
    config = SystemConfig(
        models=(embedder(wire.base_url, embedding_batch_size=CHUNK_TEXTS),),
        scheduler=SchedulerSettings(capacity=1),
    )
    with System(config) as cb:
        result = embedded(cb, listed, wait_s=WAIT_S)
        assert cb.drain(WAIT_S)
        counts = cb.ledger.counts()
    assert (result.failed_batch, result.failed_inputs) == (0, range(CHUNK_TEXTS))
    assert wire.count() <= result.batches <= 3, (wire.count(), result.batches)  # of 21
    assert counts.accepted == counts.finished == result.batches


def test_an_answer_short_of_a_vector_is_a_failure_not_a_hole(wire: WireServer) -> None:
    with running(embedder(wire.base_url, embedding_batch_size=2)) as cb:
        result = embedded(cb, ["a", "b", "short", "d"])
    assert isinstance(result.failure, Completed)  # the call completed; its answer is unusable
    assert result.failed_inputs == range(2, 4)
    assert "answered 1 vectors for 2 texts" in result.detail
    assert result.vectors == []


def test_a_batch_never_falls_back_to_another_model(wire: WireServer) -> None:
    # another model's vectors would not be comparable with the others': a batch the
    # first model gives up on fails the embedding, its fallback is never asked
    first = embedder(
        wire.base_url,
        "first",
        fallbacks=("second",),
        retry=RetryConfig(max_attempts=1),
        embedding_batch_size=1,
    )
    second = embedder(wire.base_url, "second")
    with running(first, second) as cb:
        result = embedded(cb, ["a", "flaky", "c"], model="first")
    assert not result.ok
    assert result.failed_batch == 1
    assert {a.json["model"] for a in wire.arrivals} == {"first"}


def test_cancelling_the_future_cancels_the_batches_not_sent_and_spent_says_what_was(
    provider: SimulatedProvider,
) -> None:
    cue = Cue()
    held = WireServer(_held(cue))
    with held, running(embedder(held.base_url, embedding_batch_size=1, max_concurrency=1)) as cb:
        future = cb.embed(["a", "b", "c"])
        held.wait_for(1)  # the first is at the provider; the others wait in the queue
        assert future.cancel()
        # the cancel reaches them before the first answer frees the slot (released at
        # once, the answer raced the cancel to the model holding the next batch)
        assert wait_until(lambda: cb.stats().outcomes.get("cancelled") == 2)
        cue.set()
        assert cb.drain(WAIT_S)
        outcomes, charged = cb.stats().outcomes, cb.stats().total.cost_nusd
    assert held.count() == 1, "the batches not sent were sent"
    assert (outcomes.get("cancelled"), outcomes.get("completed")) == (2, 1)
    spent = future.spent.result(WAIT_S)  # what the cancelled embed was charged: the one sent
    assert not spent.ok
    assert spent.usage.total_tokens > 0
    assert spent.cost_nusd == charged > 0


def test_a_stop_resolves_an_embedding_in_progress_and_leaves_no_thread() -> None:
    cue = Cue()
    held = WireServer(_held(cue))
    with held:
        before = set(threading.enumerate())
        cb = System(SystemConfig(models=(embedder(held.base_url, embedding_batch_size=1),)))
        future = cb.embed(["a", "b"])
        held.wait_for(2)
        cb.stop(cancel=True, timeout=0)
        result = future.result(WAIT_S)
        cue.set()
        left = threads_since(before)
    assert not result.ok
    assert isinstance(result.failure, Cancelled)
    assert not [t for t in left if t.startswith("callboard")], left


def _held(cue: Cue) -> Any:
    async def handle(request: Any, arrival: Any) -> Any:
        from aiohttp import web

        await cue.wait()
        status, _headers, raw = _embeddings(arrival.index, arrival.json)
        return web.Response(status=status, body=raw, headers={"content-type": "application/json"})

    return handle


# -- the pure parts ------------------------------------------------------------------------------


def batching(**models: dict[str, Any]) -> Batching:
    settings = {n: embedder("http://127.0.0.1:9/v1", n, **f) for n, f in models.items()}
    return Batching(settings, {})


def test_split_is_greedy_within_both_limits() -> None:
    tokens = [3, 3, 3, 1, 5]
    assert split(tokens, Limits(inputs=3, tokens=7)) == (range(2), range(2, 4), range(4, 5))
    assert split(tokens, Limits(inputs=2, tokens=100)) == (range(2), range(2, 4), range(4, 5))
    assert split(tokens, Limits(inputs=10, tokens=100)) == (range(5),)
    assert split(tokens, Limits(inputs=1, tokens=5)) == tuple(range(i, i + 1) for i in range(5))


def test_a_text_no_call_can_carry_is_refused_by_its_index() -> None:
    with pytest.raises(InvalidRequestError, match=r"texts\[1\] is about 9 tokens"):
        split([1, 9], Limits(inputs=10, tokens=8))


class _Read(list[str]):
    """Texts that note how far they have been read (a plan reads them in slices)."""

    def __init__(self, texts: list[str]) -> None:
        super().__init__(texts)
        self.read = 0

    def __getitem__(self, at: Any) -> Any:
        got = super().__getitem__(at)
        if isinstance(at, slice):
            self.read = max(self.read, at.stop or len(self))
        return got


def test_a_plan_gives_its_first_call_once_that_call_is_counted() -> None:
    listed = _Read(texts(3 * CHUNK_TEXTS))
    plan = Plan(listed, "e", Limits(inputs=100, tokens=10_000))
    first = next(iter(plan))
    assert first.spans == (range(100),)
    assert listed.read == 100  # nothing past the first call was counted yet
    assert first.tokens == (sum(text_tokens(t) for t in listed[:100]),)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=120),
    st.integers(1, 9),
    st.integers(36, 80),  # no text of 12 characters is above 36 tokens
    st.integers(1, 50),
)
def test_a_plan_walked_in_chunks_splits_as_split_does(
    listed: list[str], inputs: int, tokens: int, chunk: int
) -> None:
    limits = Limits(inputs=inputs, tokens=tokens)
    counted = [text_tokens(t) for t in listed]
    walked = list(Plan(listed, "e", limits, chunk=chunk))
    spans = [s for calls in walked for s in calls.spans]
    assert tuple(spans) == split(counted, limits)
    assert [t for calls in walked for t in calls.tokens] == [
        sum(counted[s.start : s.stop]) for s in spans
    ]


def test_a_text_too_large_is_refused_before_any_call_is_planned() -> None:
    b = batching(e={"embedding_batch_tokens": 1001})
    long = " ".join(["word"] * 1000)  # 1000 tokens: within the limit, longer than its bound
    assert len(long) * MOST_TOKENS_PER_CHAR > 1000
    assert b.plan(["a", long], "e", None).tokens[-1] == text_tokens(long)
    with pytest.raises(InvalidRequestError, match=r"texts\[5000\] is about 1001 tokens"):
        b.chunks([*texts(5000), long + " word"], "e", None)


def test_limits_are_the_least_of_every_model_a_call_may_go_to() -> None:
    b = batching(
        e={"fallbacks": ("f",), "embedding_batch_size": 100},
        f={"embedding_batch_tokens": 5000, "limiter": LimiterConfig(rpm=None, tpm=9000)},
        g={"embedding_batch_size": 1},  # not on e's way
    )
    assert b.limits("e", None) == Limits(inputs=100, tokens=4999)
    assert b.limits("g", None) == Limits(inputs=1, tokens=128_000 - 1)  # its context window
    assert b.limits(None, None) == Limits(inputs=1, tokens=4999)


def test_limits_leave_out_models_that_do_not_embed() -> None:
    chat = ModelSettings(
        name="chat", base_url="http://127.0.0.1:9/v1", capabilities={"tools"}, context_window=10
    )
    e = embedder("http://127.0.0.1:9/v1", fallbacks=("chat",))
    assert Batching({"chat": chat, "e": e}, {}).limits("e", None).tokens == 128_000 - 1


def _body(vectors: list[Any], order: list[int] | None = None) -> dict[str, Any]:
    items = [{"index": i, "embedding": v} for i, v in enumerate(vectors)]
    return {"data": [items[i] for i in order] if order else items}


def test_ordered_vectors_decode_base64_and_keep_what_is_asked() -> None:
    """Kept as base64 (what a gateway's caller asked), a vector that came as floats (a
    provider that ignored ``encoding_format``) is packed as OpenAI packs one: it was
    passed on as floats, which ``base64.b64decode`` refuses (found by a hunt)."""
    packed = base64.b64encode(struct.pack("<2f", 0.5, -2.0)).decode()
    raw = _body([packed, [1.0, 2]], order=[1, 0])
    assert ordered_vectors(raw, 2, decode=True) == ([[0.5, -2.0], [1.0, 2]], 2)
    floats = base64.b64encode(struct.pack("<2f", 1.0, 2.0)).decode()
    assert ordered_vectors(raw, 2, decode=False) == ([packed, floats], 2)


@pytest.mark.parametrize(("vector", "needle"), [(["x"], "not a number"), ([1e300], "float32")])
def test_a_float_vector_kept_as_base64_is_checked_first(vector: list[Any], needle: str) -> None:
    with pytest.raises(UnusableAnswerError, match=needle):
        ordered_vectors(_body([vector]), 1, decode=False)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (None, "answered no vectors for 2 texts"),
        (_body([[1.0]]), "answered 1 vectors"),
        ({"data": [{"index": 0, "embedding": [1.0]}, {"index": 0, "embedding": [1.0]}]}, "index"),
        ({"data": [{"index": 0, "embedding": [1.0]}, {"index": 7, "embedding": [1.0]}]}, "index"),
        (_body([[1.0], [1.0, 2.0]]), "vector 1 has 2 dimensions"),
        (_body([[1.0], "not base64!"]), "not valid base64"),
        (_body([[1.0], base64.b64encode(b"abc").decode()]), "not float32"),
        (_body([[1.0], ["x"]]), "not a number"),
        (_body([[1.0], {"x": 1}]), "neither"),
        *(  # JSON has no NaN: one would reach a results file or a gateway's client so
            (_body([[1.0], base64.b64encode(struct.pack("<2f", 1, bad)).decode()]), "NaN or inf")
            for bad in (math.nan, math.inf, -math.inf)
        ),
    ],
)
def test_an_unusable_answer_says_why(raw: Any, needle: str) -> None:
    with pytest.raises(UnusableAnswerError, match=needle):
        ordered_vectors(raw, 2, decode=True)


@given(
    words=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    at=st.integers(0, 39),
    special=st.sampled_from(
        [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0x7F7FFFFF, 0xFF7FFFFF]
    ),
)
def test_a_base64_vector_is_refused_exactly_when_a_value_is_not_finite(
    words: list[int], at: int, special: int
) -> None:
    """Every float32 bit pattern, NaN and infinity among them and the largest finite ones
    beside them: the quick scan of high bytes never lets one through nor refuses a finite
    vector."""
    words[at % len(words)] = special
    packed = struct.pack(f"<{len(words)}I", *words)
    floats = list(struct.unpack(f"<{len(words)}f", packed))
    raw = {"data": [{"index": 0, "embedding": base64.b64encode(packed).decode()}]}
    if all(math.isfinite(f) for f in floats):
        assert ordered_vectors(raw, 1, decode=True)[0][0] == floats
    else:
        with pytest.raises(UnusableAnswerError, match="NaN or infinity"):
            ordered_vectors(raw, 1, decode=True)


def test_dimensions_asked_are_checked() -> None:
    with pytest.raises(UnusableAnswerError, match="vector 0 has 2 dimensions, asked 3"):
        ordered_vectors(_body([[1.0, 2.0], [1.0, 2.0]]), 2, decode=True, dimensions=3)
    packed = base64.b64encode(struct.pack("<2f", 1, 2)).decode()
    with pytest.raises(UnusableAnswerError, match="asked 3"):
        ordered_vectors(_body([packed, packed]), 2, decode=False, dimensions=3)


class _Cancels:
    """What a gathering asked to cancel."""

    def __init__(self) -> None:
        self.asked: list[list[Future[Result]]] = []

    def __call__(self, futures: Any) -> None:
        self.asked.append(list(futures))


def _completed(vectors: list[list[float]], model: str = "e", tokens: int = 1) -> Completed:
    return Completed(
        task_id=1,
        trace_id="t",
        model=model,
        content="",
        usage=Usage(prompt_tokens=tokens),
        cost_nusd=tokens * NUSD_PER_TOKEN,
        raw=_body(vectors),
    )


def test_a_failure_cancels_the_batches_left_and_the_result_waits_for_them() -> None:
    futures: list[Future[Result]] = [Future() for _ in range(3)]
    cancels = _Cancels()
    assembler = Assembler()
    assembler.close()  # work runs at once, on this thread
    spans = (range(1), range(1, 2), range(2, 3))
    g = Gathering(spans, futures, assembler=assembler, cancel=cancels, trace_id="t")
    futures[1].set_result(Failed(task_id=2, trace_id="t", reason=FailureReason.TIMEOUT))
    assert cancels.asked == [[futures[0], futures[2]]]  # the batches that have not ended
    assert not g.future.done()  # the others may still cost money: it waits for them
    futures[0].set_result(_completed([[1.0]], tokens=3))
    futures[2].set_result(_completed([[2.0]], tokens=4))
    result = g.future.result(0)
    assert (result.failed_batch, result.failed_inputs) == (1, range(1, 2))
    assert result.usage.prompt_tokens == 7
    assert result.cost_nusd == 7 * NUSD_PER_TOKEN
    assert result.vectors == []


def test_a_gathering_lets_go_of_each_answer_once_its_vectors_are_taken() -> None:
    """A batch's answer holds every vector as it came (base64 text, a dict per item): a
    large embed kept them all to its end, beside the decoded floats."""
    futures: list[Future[Result]] = [Future() for _ in range(2)]
    assembler = Assembler()
    assembler.close()
    g = Gathering(
        (range(1), range(1, 2)), futures, assembler=assembler, cancel=_Cancels(), trace_id="t"
    )
    futures[0].set_result(_completed([[1.0]], tokens=3))
    taken = weakref.ref(futures[0])
    del futures[0]
    gc.collect()
    assert taken() is None
    futures[0].set_result(_completed([[2.0]], tokens=4))
    result = g.future.result(0)
    assert (result.vectors, result.usage.prompt_tokens) == ([[1.0], [2.0]], 7)


def test_a_gathering_added_to_chunk_by_chunk_resolves_once_sealed() -> None:
    futures: list[Future[Result]] = [Future() for _ in range(3)]
    assembler = Assembler()
    assembler.close()
    g = Gathering(assembler=assembler, cancel=_Cancels(), trace_id="t")
    g.add([range(1)], futures[:1])
    futures[0].set_result(_completed([[1.0]], tokens=2))
    assert not g.future.done()  # more may come
    g.add([range(1, 2), range(2, 3)], futures[1:])
    futures[2].set_result(_completed([[3.0]]))
    futures[1].set_result(_completed([[2.0]]))
    g.seal()
    result = g.future.result(0)
    assert result.vectors == [[1.0], [2.0], [3.0]]
    assert (result.batches, result.usage.prompt_tokens) == (3, 4)


def test_batches_added_after_a_failure_are_cancelled_at_once() -> None:
    futures: list[Future[Result]] = [Future() for _ in range(2)]
    cancels = _Cancels()
    assembler = Assembler()
    assembler.close()
    g = Gathering(assembler=assembler, cancel=cancels, trace_id="t")
    g.add([range(1)], futures[:1])
    assert not g.failing
    futures[0].set_result(Failed(task_id=1, trace_id="t", reason=FailureReason.TIMEOUT))
    assert g.failing  # a sender may stop here
    g.add([range(1, 2)], futures[1:])
    assert cancels.asked[-1] == futures[1:]
    futures[1].set_result(Cancelled(task_id=2, trace_id="t"))
    g.seal()
    result = g.future.result(0)
    assert (result.failed_batch, result.failed_inputs, result.batches) == (0, range(1), 2)


def test_cancelling_a_gathering_cancels_its_batches() -> None:
    futures: list[Future[Result]] = [Future(), Future()]
    cancels = _Cancels()
    assembler = Assembler()
    assembler.close()
    g = Gathering(
        (range(1), range(1, 2)), futures, assembler=assembler, cancel=cancels, trace_id="t"
    )
    assert g.future.cancel()
    assert cancels.asked == [futures]
    futures[0].set_result(_completed([[1.0]]))  # late results change nothing
    futures[1].set_result(_completed([[1.0]]))
    assert g.future.cancelled()


def test_a_bug_in_gathering_reaches_the_caller() -> None:
    future: Future[Result] = Future()
    assembler = Assembler()
    assembler.close()
    g = Gathering((range(1),), [future], assembler=assembler, cancel=_Cancels(), trace_id="t")
    future.set_exception(RuntimeError("a bug upstream"))
    with pytest.raises(RuntimeError, match="a bug upstream"):
        g.future.result(0)


def test_the_assembler_runs_work_off_the_resolving_thread_and_stops() -> None:
    assembler = Assembler()
    ran: Future[str] = Future()
    assembler.submit(lambda: ran.set_result(threading.current_thread().name))
    assert ran.result(WAIT_S).startswith("callboard-embed")
    assembler.close()
    after: Future[str] = Future()
    assembler.submit(lambda: after.set_result(threading.current_thread().name))
    assert after.result(0) == threading.current_thread().name
