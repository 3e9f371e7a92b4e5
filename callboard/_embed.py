"""Embeddings: ``embed`` splits texts into provider-sized calls and puts the vectors back.

Theory of operation
-------------------
``Batching`` reads only the configuration (safe from any thread). For an
``embed`` or a ``callboard run`` line it decides which model serves texts when
none is named (the first model with the ``embeddings`` capability), how much
one call may carry (``limits``: the least, over every model the calls may go
to, the one named and its fallbacks, of its ``embedding_batch_size`` texts and
of the tokens its ``embedding_batch_tokens``, tokens per minute and context
window allow, less the one token of ``max_tokens`` the limiter reserves for an
embeddings call), and the calls (``split``: consecutive runs of texts, each
within both limits, taken greedily; a text too large for any call is refused
by its index). Tokens are estimated as ``core.tokens.text_tokens`` per text,
as the simulated provider counts them, many texts in one pass (``texts_tokens``).

``chunks`` plans an input as it is sent: it refuses a text too large for any
call before anything is sent (only texts longer than a third of the limit,
``MOST_TOKENS_PER_CHAR``, need counting for that), and its ``Plan`` counts and
splits ``CHUNK_TEXTS`` texts at a time (the first chunk one call's worth), so
``embed`` sends each chunk's calls while it counts the next: the first call is
on the wire after one call's texts are counted, not after all of them (100k
short texts took 1-1.5 s to count one by one). ``plan`` walks it whole.

A call is an ordinary task (priority, limiter, breaker, retries and budget
apply). ``Gathering`` puts their results back together, given a whole input's
batches or a chunk's at a time (``add``, then ``seal``). A batch's future
resolves on an actor thread; its done-callback only hands it to the
``Assembler`` (one thread per system), so reading vectors (base64 to floats:
about 0.1 s for 2048 vectors of 1536 on this machine) never holds up an actor,
and every step of one gathering runs on that thread, in the order it was
handed over (a chunk is added before any of its batches is taken; no lock).
The vectors are asked for as base64 unless the caller asks for floats: JSON
numbers cost the I/O thread some 30 times more to parse.

The first batch that does not end usable fails the whole result: the batches
not sent yet are cancelled (no money is spent on them), and once every batch
has ended the future resolves with that failure, naming the batch and its
texts. A batch is usable when it completed with one vector per text (by
``data[i].index``), of the dimensions asked (all of one length when none
were), from the model every other batch came from (vectors of two models
cannot be compared).

A ledger's ``resume`` after a crash submits each unfinished call on its own:
its ``Completed.raw`` holds that call's vectors (no gathering survives a crash).

What must hold: the future resolves exactly once, after it is sealed and every
batch has ended (so usage and cost are whole), with every vector in input order
or none; a caller who cancels it cancels every batch not sent yet, and a batch
added after a failure or a cancel is cancelled at once; a plan splits an input
exactly as ``split`` splits it whole; a bug in gathering reaches the caller as
the future's exception, never a future left pending.
"""

from __future__ import annotations

import array
import binascii
import dataclasses
import functools
import math
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from callboard.core.routing import AUTO
from callboard.core.settings import ModelSettings
from callboard.core.tokens import MOST_TOKENS_PER_CHAR, inputs_tokens, text_tokens
from callboard.messages import (
    EMBEDDING_OPTIONS,
    TOKEN_IDS_END,
    CallerFuture,
    Completed,
    Embeddable,
    EmbeddingResult,
    InvalidRequestError,
    Request,
    Result,
    UnknownModelError,
    Usage,
    embeddable_inputs,
    on_done,
    one_target,
    token_ids,
)
from callboard.runtime.guarded_log import guarded_logger
from callboard.runtime.http import MAX_ANSWER_BYTES

__all__ = [
    "EMBED_MAX_TOKENS",
    "Assembler",
    "Batching",
    "Calls",
    "EmbedFuture",
    "Gathering",
    "Limits",
    "Plan",
    "Splitter",
    "UnusableAnswerError",
    "embedding_request",
    "ordered_vectors",
    "split",
    "texts_of",
]

log = guarded_logger(__name__)

EMBED_MAX_TOKENS = 1
"""An embeddings request's ``max_tokens``: it has no output, and the limiter reserves
prompt + max_tokens (at least one token)."""
CAPABILITY = "embeddings"
_OWN_FIELDS = frozenset(
    {"model", "route", "priority", "deadline_s", "metadata", "budget_tag", "idempotency_key"}
)
"""The ``Request`` fields an embeddings request takes besides its texts and options."""


# -- what is asked ---------------------------------------------------------------------


def texts_of(texts: object, where: str = "texts") -> tuple[tuple[Embeddable, ...], bool]:
    """The inputs to embed, and whether one was given (a string, or one list of token
    ids, as OpenAI's API takes them) rather than a list of them. Each input is a text or
    a list of token ids; ``InvalidRequestError`` names one that is neither by its index."""
    one = token_ids(texts)
    if one is None and isinstance(texts, list | tuple) and texts:
        _check_token_ids(texts, where)
    if isinstance(texts, str) or one is not None:
        listed: tuple[Any, ...] = (texts if one is None else one,)
    elif isinstance(texts, list | tuple):
        listed = tuple(texts)
    else:
        raise InvalidRequestError(
            f"{where} must be a string or a list of strings (or of token-id lists), "
            f"got {type(texts).__name__}"
        )
    if not listed:
        raise InvalidRequestError(f"{where} is empty: give at least one text to embed")
    return embeddable_inputs(listed, where), isinstance(texts, str) or one is not None


def _check_token_ids(values: list[Any] | tuple[Any, ...], where: str) -> None:
    """``InvalidRequestError`` naming the id out of range in a list of integers (one
    list of token ids, whose bad id said "input[0] must be a non-empty string or list
    of token ids, got int" of a good one; found by a hunt); nothing for another list."""
    if not all(type(v) is int for v in values):
        return
    i, bad = next((i, v) for i, v in enumerate(values) if not 0 <= v < TOKEN_IDS_END)
    raise InvalidRequestError(
        f"{where}[{i}]: a token id is an integer from 0 to {TOKEN_IDS_END - 1}, got {bad}"
    )


def embedding_request(texts: tuple[Embeddable, ...], fields: Mapping[str, Any]) -> Request:
    """One embeddings call's ``Request``: ``fields`` are its own (``model``, ``route``,
    ``priority``, ``deadline_s``, ``metadata``, ``budget_tag``, ``idempotency_key``) and
    the embeddings options (``dimensions``, ``encoding_format``, ``user``,
    ``extra_body``); None leaves one out. Anything else is refused by name."""
    own: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for name, value in fields.items():
        if name in _OWN_FIELDS:
            own[name] = value
        elif name in EMBEDDING_OPTIONS:
            options[name] = value
        else:
            allowed = ", ".join(sorted(_OWN_FIELDS | EMBEDDING_OPTIONS))
            raise InvalidRequestError(f"{name}: not a field of an embeddings request ({allowed})")
    one_target(own)
    options = {k: v for k, v in options.items() if v is not None}
    return Request(messages=(), input=texts, max_tokens=EMBED_MAX_TOKENS, options=options, **own)


# -- how it is split -------------------------------------------------------------------


FLOAT_BYTES = 32
"""The most bytes one dimension of a vector takes as a JSON number: ``-0.0123456789``,
its comma, and a pretty-printed answer's newline and indent (measured: 67.5 MB for
2,048 vectors of 1,536, 21.5 bytes a number)."""
FLOAT_DIMENSIONS = 3072
"""The dimensions assumed when none are asked: the most of OpenAI's models' defaults."""


def answer_texts(options: Mapping[str, Any]) -> int | None:
    """How many vectors one answer can hold (``MAX_ANSWER_BYTES``) when they come as
    JSON numbers (``encoding_format="float"``); None as base64 (a sixth of the size: the
    batch size bounds them). 2,048 float vectors of 1,536 made a 67.5 MB answer, read
    as malformed, sent again, billed each time and taken for an outage (a hunt)."""
    if options.get("encoding_format") != "float":
        return None
    dimensions = options.get("dimensions") or FLOAT_DIMENSIONS
    return max(1, MAX_ANSWER_BYTES // (int(dimensions) * FLOAT_BYTES))


@dataclass(frozen=True, slots=True)
class Limits:
    """What one embeddings call may carry."""

    inputs: int
    """Texts, at most."""
    tokens: int
    """Estimated prompt tokens, at most."""


class Batching:
    """Where texts go and how they are split into calls (see the module docstring)."""

    def __init__(
        self,
        models: Mapping[str, ModelSettings],
        routes: Mapping[str, tuple[str, ...]],
        escalate_to: str | None = None,
    ) -> None:
        self._models = dict(models)
        self._routes = dict(routes)
        self._escalate_to = escalate_to
        self._declared = any(s.capabilities for s in self._models.values())

    def model_for(self, model: str | None, route: str | None) -> str | None:
        """``model``, or with neither a model nor a route the first model with the
        ``embeddings`` capability (the default route is for chats). Raises
        ``InvalidRequestError`` when there is none to choose."""
        if model is not None or route is not None:
            return model
        for name, settings in self._models.items():
            if CAPABILITY in settings.capabilities:
                return name
        raise InvalidRequestError(
            "embeddings need a model: name one (model=...), or give a model the "
            f"{CAPABILITY!r} capability in the config so callboard can choose it"
        )

    def limits(self, model: str | None, route: str | None, most: int | None = None) -> Limits:
        """What one call may carry, whichever of the models it may go to serves it, and at
        most ``most`` texts (``answer_texts``) if given."""
        serving = [self._models[m] for m in self._serving(model, route)]
        tokens = min(_call_tokens(s) for s in serving) - EMBED_MAX_TOKENS
        inputs = min(s.embedding_batch_size for s in serving)
        return Limits(inputs=inputs if most is None else min(inputs, most), tokens=tokens)

    def _serving(self, model: str | None, route: str | None) -> list[str]:
        """The models a call may be served by: those wanted, their fallbacks (and theirs)
        and the escalation model; of those, the ones able to embed when models say
        what they can do."""
        if model is not None:
            if model not in self._models:
                known = ", ".join(sorted(self._models))
                raise UnknownModelError(f"unknown model {model!r} (configured: {known})")
            wanted = [model]
        elif route is not None and route != AUTO and route in self._routes:
            wanted = list(self._routes[route])
        else:
            wanted = list(self._models)
        seen = [m for m in dict.fromkeys(wanted) if m in self._models]
        for name in seen:  # grows while it is walked: the fallbacks' fallbacks too
            seen.extend(
                f for f in self._models[name].fallbacks if f not in seen and f in self._models
            )
        if self._escalate_to is not None and self._escalate_to not in seen:
            seen.append(self._escalate_to)
        if self._declared:
            able = [m for m in seen if CAPABILITY in self._models[m].capabilities]
            seen = able or seen  # none able: routing refuses it, naming the capability
        return seen

    def chunks(
        self,
        texts: Sequence[Embeddable],
        model: str | None,
        route: str | None,
        options: Mapping[str, Any] | None = None,
    ) -> Plan:
        """The calls ``texts`` go in (asked with the embeddings ``options``), counted and
        split a chunk at a time as the ``Plan`` is walked. Raises at once, before a call
        can be sent: no model to choose, an unknown model, a text no call can carry
        (``InvalidRequestError`` naming it)."""
        chosen = self.model_for(model, route)
        limits = self.limits(chosen, route, answer_texts(options or {}))
        _refuse_too_large(texts, limits)
        return Plan(texts, chosen, limits)

    def plan(
        self,
        texts: Sequence[Embeddable],
        model: str | None,
        route: str | None,
        options: Mapping[str, Any] | None = None,
    ) -> Calls:
        """Every call ``texts`` go in at once (``chunks``, walked to its end)."""
        plan = self.chunks(texts, model, route, options)
        spans: list[range] = []
        tokens: list[int] = []
        for calls in plan:
            spans += calls.spans
            tokens += calls.tokens
        return Calls(plan.model, tuple(spans), tuple(tokens))

    def one_call(self, request: Request) -> Request:
        """An embeddings request that must go as it is (a ``callboard run`` line), with
        its model chosen if it names none; ``InvalidRequestError`` if one call cannot
        carry it."""
        assert request.input is not None
        model = self.model_for(request.model, request.route)
        limits = self.limits(model, request.route, answer_texts(request.options))
        texts = request.input
        tokens = sum(inputs_tokens(texts))
        if len(texts) > limits.inputs or tokens > limits.tokens:
            raise InvalidRequestError(
                f"input: {len(texts)} texts of about {tokens} tokens; one embeddings call "
                f"takes at most {limits.inputs} texts and {max(0, limits.tokens)} tokens "
                "here: split the line"
            )
        if model == request.model:
            return request
        return _with_model(request, model)


@dataclass(frozen=True, slots=True)
class Calls:
    """How an input is sent."""

    model: str | None
    """The model every call names (None: a route chooses)."""
    spans: tuple[range, ...]
    """Each call's texts, as a range of their indices."""
    tokens: tuple[int, ...]
    """Each call's prompt estimate (its texts' ``text_tokens``)."""


class Plan:
    """An input's calls, as they are counted: walking it counts ``chunk`` texts at a
    time (``CHUNK_TEXTS`` unless told; the first chunk only one call's worth, so the
    first call can go at once) and gives the calls each completes, in input order.
    ``Batching.chunks`` checked every text against the limits before, so walking its
    plan raises nothing."""

    def __init__(
        self, texts: Sequence[Embeddable], model: str | None, limits: Limits, chunk: int = 0
    ) -> None:
        self.model = model
        """The model every call names (None: a route chooses)."""
        self.limits = limits
        self._texts = texts
        self._chunk = chunk or CHUNK_TEXTS

    def __iter__(self) -> Iterator[Calls]:
        splitter = Splitter(self.limits)
        at, size, end = 0, self.limits.inputs, len(self._texts)
        while at < end:
            chunk = self._texts[at : at + size]
            at += len(chunk)
            spans, tokens = splitter.feed(inputs_tokens(chunk))
            if at == end:
                last, held = splitter.end()
                if last:
                    spans.append(last)
                    tokens.append(held)
            if spans:
                yield Calls(self.model, tuple(spans), tuple(tokens))
            size = self._chunk


CHUNK_TEXTS = 2048
"""Texts counted between two sends (about 4 ms of counting): the calls they make go out
while the next chunk is counted."""


class Splitter:
    """Texts into calls, their estimates fed in input order: consecutive, each within
    ``limits``, filled greedily. A call is given as soon as the next text cannot join
    it, or as soon as it holds ``limits.inputs`` texts."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._start = self._at = self._held = 0

    def feed(self, tokens: Iterable[int]) -> tuple[list[range], list[int]]:
        """The calls these texts complete, and each one's estimate. Raises
        ``InvalidRequestError`` naming a text no call can carry."""
        most, inputs = self._limits.tokens, self._limits.inputs
        spans: list[range] = []
        held: list[int] = []
        start, at, holding = self._start, self._at, self._held
        for need in tokens:
            if need > most:
                raise InvalidRequestError(_too_large(at, need, self._limits))
            if holding + need > most:
                spans.append(range(start, at))
                held.append(holding)
                start, holding = at, 0
            holding += need
            at += 1
            if at - start == inputs:
                spans.append(range(start, at))
                held.append(holding)
                start, holding = at, 0
        self._start, self._at, self._held = start, at, holding
        return spans, held

    def end(self) -> tuple[range, int]:
        """The last call (the texts fed since the last one given) and its estimate."""
        return range(self._start, self._at), self._held


def split(tokens: Sequence[int], limits: Limits) -> tuple[range, ...]:
    """Texts of these estimated ``tokens`` into calls, as ranges of their indices (the
    ``Splitter``'s rule, all at once). ``InvalidRequestError`` naming a text no call can
    carry."""
    splitter = Splitter(limits)
    spans, _ = splitter.feed(tokens)
    last, _ = splitter.end()
    return (*spans, last) if last or not spans else tuple(spans)


def _refuse_too_large(texts: Sequence[Embeddable], limits: Limits) -> None:
    """``InvalidRequestError`` naming the first text no call can carry. Only texts longer
    than the limit's bound (``MOST_TOKENS_PER_CHAR``) are counted for it: the others
    cannot be too large."""
    if max(map(len, texts), default=0) * MOST_TOKENS_PER_CHAR <= limits.tokens:
        return
    for i, text in enumerate(texts):
        if len(text) * MOST_TOKENS_PER_CHAR > limits.tokens:
            need = text_tokens(text) if type(text) is str else len(text)
            if need > limits.tokens:
                raise InvalidRequestError(_too_large(i, need, limits))


def _too_large(index: int, need: int, limits: Limits) -> str:
    return (
        f"texts[{index}] is about {need} tokens; one embeddings call takes at most "
        f"{max(0, limits.tokens)} here (the models' embedding_batch_tokens, "
        "tokens per minute and context window)"
    )


def _with_model(request: Request, model: str | None) -> Request:
    fields = {name: getattr(request, name) for name in _OWN_FIELDS}
    fields["model"] = model
    return Request(
        messages=(),
        input=request.input,
        max_tokens=request.max_tokens,
        options=request.options,
        **fields,
    )


def _call_tokens(settings: ModelSettings) -> int:
    """The most prompt + max_tokens one call of ``settings`` may hold: its batch limit,
    and what routing admits (context window; tokens per minute, above which the limiter
    says the call is too large)."""
    tpm = settings.limiter.tpm
    most = min(settings.embedding_batch_tokens, settings.context_window)
    return most if tpm is None else min(most, int(tpm))


# -- what comes back -------------------------------------------------------------------


class UnusableAnswerError(Exception):
    """A completed embeddings call whose answer cannot be used (says why)."""


def ordered_vectors(
    raw: Mapping[str, Any] | None, count: int, *, decode: bool, dimensions: int | None = None
) -> tuple[list[Any], int]:
    """The vectors of an embeddings answer, in input order (by each item's ``index``),
    and their length: float lists when ``decode`` (base64 ones decoded), else base64
    (as they came, or float lists packed as OpenAI packs them: a provider that ignored
    ``encoding_format`` answered floats to a caller that asked base64, and the gateway
    passed them on; found by a hunt). Raises ``UnusableAnswerError`` unless there is
    exactly one per text, all of one length (``dimensions``, when given)."""
    data = None if raw is None else raw.get("data")
    if not isinstance(data, list | tuple) or len(data) != count:
        got = len(data) if isinstance(data, list | tuple) else "no"
        raise UnusableAnswerError(f"the provider answered {got} vectors for {count} texts")
    ordered: list[Any] = [None] * count
    for position, item in enumerate(data):
        index = item.get("index", position) if isinstance(item, Mapping) else None
        if type(index) is not int or not 0 <= index < count or ordered[index] is not None:
            raise UnusableAnswerError(f"data[{position}] has no usable index ({index!r})")
        ordered[index] = item.get("embedding")
    if decode:
        vectors: list[Any] = [_vector(v, i) for i, v in enumerate(ordered)]
        lengths = [len(v) for v in vectors]
    else:
        vectors = [_packed(v, i) for i, v in enumerate(ordered)]
        lengths = [_length(v, i) for i, v in enumerate(vectors)]
    want = lengths[0] if dimensions is None else dimensions
    for i, length in enumerate(lengths):
        if length != want:
            asked = "asked" if dimensions is not None else "expected"
            raise UnusableAnswerError(f"vector {i} has {length} dimensions, {asked} {want}")
    return vectors, want


def _vector(value: object, index: int) -> list[float]:
    """One vector as floats: a JSON array as it is (its JSON had no NaN: the model
    client refuses one), a base64 string decoded (OpenAI sends little-endian float32),
    every value finite."""
    if isinstance(value, list):
        if not all(type(x) is float or type(x) is int for x in value):
            raise UnusableAnswerError(f"vector {index} holds something that is not a number")
        return value
    if not isinstance(value, str):
        raise UnusableAnswerError(f"vector {index} is neither an array nor base64")
    try:  # strict: only the alphabet and its padding (b64decode's check is a regex)
        packed = binascii.a2b_base64(value, strict_mode=True)
    except (binascii.Error, ValueError):
        raise UnusableAnswerError(f"vector {index} is not valid base64") from None
    if len(packed) % 4:
        raise UnusableAnswerError(f"vector {index} is {len(packed)} bytes: not float32 values")
    values = array.array("f")
    values.frombytes(packed)
    if sys.byteorder == "big":
        values.byteswap()
    floats = values.tolist()
    # NaN and infinity have every exponent bit set: a high byte (sign and the top seven
    # exponent bits) of 0x7F or 0xFF. Scanning those bytes costs a fraction of summing the
    # floats; only a vector that has one (or a value near float32's largest) is summed.
    high = packed[3::4]
    if (b"\x7f" in high or b"\xff" in high) and not math.isfinite(sum(floats)):
        raise UnusableAnswerError(f"vector {index} holds NaN or infinity")
    return floats


def _packed(value: object, index: int) -> object:
    """One vector kept as base64: as it came, or a float list packed as little-endian
    float32 (each value a finite number that float32 holds)."""
    if not isinstance(value, list):
        return value  # ``_length`` checks it
    floats = array.array("f", _vector(value, index))
    if not all(map(math.isfinite, floats)):
        raise UnusableAnswerError(f"vector {index} holds a value float32 cannot hold")
    if sys.byteorder == "big":
        floats.byteswap()
    return binascii.b2a_base64(floats.tobytes(), newline=False).decode("ascii")


def _length(value: object, index: int) -> int:
    """The length of a vector kept as it came (base64 measured, not decoded)."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, str) and len(value) % 4 == 0:
        size = len(value) * 3 // 4 - (len(value) - len(value.rstrip("=")))
        if size % 4 == 0:
            return size // 4
    raise UnusableAnswerError(f"vector {index} is neither an array nor float32 base64")


# -- putting it together ---------------------------------------------------------------


class Assembler:
    """The one thread a system gathers embeddings on, started at first use. After
    ``close`` what is handed to it runs at once on the caller's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._mine = threading.local()

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            if not self._closed:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="callboard-embed")
                try:
                    self._pool.submit(self._run, work)
                except RuntimeError:  # the interpreter is shutting down
                    pass
                else:
                    return
        work()

    def _run(self, work: Callable[[], None]) -> None:
        self._mine.on = True
        work()

    def close(self) -> None:
        """Run what was handed over, then stop the thread (not waiting for it when
        called on it: a callback on a result that stops the system)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=not getattr(self._mine, "on", False))


class EmbedFuture(CallerFuture[EmbeddingResult]):
    """``System.embed``'s future. ``spent`` resolves once every call of the embed has
    ended, with what they used and cost (its ``usage`` and ``cost_nusd``): the same
    result as this future, or, once this one was cancelled, the failure that says what
    the calls sent before the cancel cost (a caller that gave up still learns what it
    was charged: a gateway charged every batch's upper bound to a key whose client
    left, though one had been sent; found by a hunt)."""

    def __init__(self) -> None:
        super().__init__()
        self.spent: CallerFuture[EmbeddingResult] = CallerFuture()


class Gathering:
    """The batches of one ``embed``, gathered into its ``future`` (see the module
    docstring): given whole (``spans`` and their ``futures``), or chunk by chunk as
    they are sent (``add``, then ``seal`` after the last). Everything but ``add``,
    ``seal``, ``_ended`` and ``_given_up`` runs on the assembler, in the order those
    handed it over (a chunk's batches are taken after the chunk is added)."""

    def __init__(
        self,
        spans: Sequence[range] = (),
        futures: Sequence[Future[Result]] = (),
        *,
        assembler: Assembler,
        cancel: Callable[[Iterable[Future[Result]]], None],
        trace_id: str,
        keep_base64: bool = False,
        dimensions: int | None = None,
    ) -> None:
        self.future = EmbedFuture()
        self._assembler = assembler
        self._cancel = cancel
        self._trace_id = trace_id
        self._keep_base64 = keep_base64
        self._dimensions = dimensions
        """The length every vector must have: asked, else that of the first batch's."""
        self._added = 0
        """Batches handed to ``add`` (on the caller's thread)."""
        self._spans: list[range] = []
        self._futures: list[Future[Result] | None] = []
        """Each batch's future, None once taken: a taken one holds the provider's whole
        answer (every vector as it came), which the gathering no longer needs."""
        self._results: list[Result | None] = []
        """Each batch's result once taken; a usable one without its ``raw`` answer."""
        self._vectors: list[list[Any]] = []
        self._left = 0
        self._sealed = False
        self._model: str | None = None
        """The model of the first usable batch: every other must match it."""
        self._failed: int | None = None
        self._detail = ""
        self.future.on_done(self._given_up)
        if spans:
            self.add(spans, futures)
            self.seal()

    def add(self, spans: Sequence[range], futures: Sequence[Future[Result]]) -> None:
        """The next batches, in input order: their texts and their futures."""
        if len(spans) != len(futures):
            raise ValueError(f"{len(spans)} spans for {len(futures)} futures")
        first = self._added
        self._added += len(spans)
        self._assembler.submit(functools.partial(self._add, tuple(spans), tuple(futures)))
        for index, future in enumerate(futures, first):
            on_done(future, functools.partial(self._ended, index))

    def seal(self) -> None:
        """No batch comes after those added: the future resolves once they have ended."""
        self._assembler.submit(self._seal)

    @property
    def failing(self) -> bool:
        """A batch has failed (or the caller cancelled): batches added now would only be
        cancelled, so a sender may stop and ``seal``. Read from the sender's thread, it
        may lag the assembler by a batch or two (one more chunk sent, then cancelled)."""
        return self._failed is not None or self.future.done()

    def _add(self, spans: tuple[range, ...], futures: tuple[Future[Result], ...]) -> None:
        self._spans += spans
        self._futures += futures
        self._results += [None] * len(spans)
        self._left += len(spans)
        if self._failed is None:
            self._vectors += [[] for _ in spans]
        if self._failed is not None or self.future.cancelled():
            self._cancel(futures)  # what is not sent yet is not paid for

    def _seal(self) -> None:
        self._sealed = True
        if self._left == 0:
            self._resolve(self._gathered())

    def _ended(self, index: int, future: Future[Result]) -> None:
        """On the thread that resolved a batch (an actor's): hand it on, nothing more."""
        self._assembler.submit(functools.partial(self._take, index, future))

    def _given_up(self, future: Future[EmbeddingResult]) -> None:
        if future.cancelled():
            self._assembler.submit(self._cancel_all)

    def _cancel_all(self) -> None:
        self._cancel(self._unended())

    def _unended(self) -> list[Future[Result]]:
        return [f for f in self._futures if f is not None]

    def _take(self, index: int, future: Future[Result]) -> None:
        try:
            result = None if future.cancelled() else future.result()
            self._futures[index] = None
            self._results[index] = result
            if self._failed is None:
                problem = self._problem(index, result)
                if problem is not None:
                    self._failed, self._detail = index, problem
                    self._vectors = []
                    self._cancel(self._unended())  # what is not sent yet is not paid for
                elif isinstance(result, Completed):  # its vectors are taken: the answer
                    self._results[index] = dataclasses.replace(result, raw=None)  # goes
            self._left -= 1
            if self._left == 0 and self._sealed:
                self._resolve(self._gathered())
        except Exception as exc:  # a bug: the caller hears of it rather than wait forever
            log.exception("gathering the embeddings of trace %s failed", self._trace_id)
            self._resolve(exc)

    def _problem(self, index: int, result: Result | None) -> str | None:
        """Why batch ``index`` is not usable, or None (its vectors are then kept)."""
        span = self._spans[index]
        where = f"batch {index} (texts {span.start}..{span.stop - 1})"
        if result is None:
            return f"{where} was cancelled"
        if not isinstance(result, Completed):
            reason = getattr(result, "reason", None)
            said = getattr(result, "detail", "")
            kind = type(result).__name__ + ("" if reason is None else f" ({reason.value})")
            return f"{where} ended {kind}" + (f": {said}" if said else "")
        if self._model is not None and result.model != self._model:
            return (
                f"{where} was served by {result.model}, the batches before it by "
                f"{self._model}: vectors of two models cannot be compared"
            )
        try:
            vectors, self._dimensions = ordered_vectors(
                result.raw, len(span), decode=not self._keep_base64, dimensions=self._dimensions
            )
        except UnusableAnswerError as exc:
            return f"{where}: {exc}"
        self._model = result.model
        self._vectors[index] = vectors
        return None

    def _gathered(self) -> EmbeddingResult:
        ran = [r for r in self._results if r is not None]
        usage = functools.reduce(Usage.plus, (r.usage for r in ran), Usage())
        common: dict[str, Any] = {
            "usage": usage,
            "cost_nusd": sum(r.cost_nusd for r in ran),
            "batches": len(self._spans),
            "trace_id": self._trace_id,
        }
        if self._failed is not None:
            failure = self._results[self._failed]
            return EmbeddingResult(
                model=self._model if failure is None else failure.model,
                failure=failure,
                failed_batch=self._failed,
                failed_inputs=self._spans[self._failed],
                detail=self._detail,
                **common,
            )
        vectors = [v for batch in self._vectors for v in batch]
        if self._keep_base64:
            return EmbeddingResult(vectors_base64=vectors, model=self._model, **common)
        return EmbeddingResult(vectors=vectors, model=self._model, **common)

    def _resolve(self, outcome: EmbeddingResult | BaseException) -> None:
        self._results = []
        self._vectors = []
        for future in (self.future, self.future.spent):
            try:
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
            except InvalidStateError:  # the caller cancelled it: nobody reads it
                pass
