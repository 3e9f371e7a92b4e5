"""Routing policy (pure): where a task *may* go.

Theory of operation
-------------------
``RoutingPolicy.plan`` turns a request into a ``Plan`` in four steps:

1. **Wanted models.** An explicit ``model``; else a ``route`` (a tier from
   ``ModelSettings.tiers`` or an explicit route); else the default route (a
   list of models, a route name, or ``"auto"``). ``"auto"`` asks the
   ``Classifier`` (``complexity``) for a label and takes the first tier it
   prefers that has a model meeting the constraints.
2. **Constraints.** A model qualifies when its context window and its
   tokens-per-minute limit (above it the limiter says ``TooLarge``) both
   hold the estimated prompt plus ``max_tokens``, and it has every required
   capability (``request.metadata["capabilities"]`` plus ``plan``'s, plus what the
   request itself needs once any model declares capabilities: ``vision`` for an
   image, ``tools`` for tools, ``json`` for a JSON response format).
   Candidates are the qualifying wanted models; fallbacks the qualifying
   ``fallbacks`` of the wanted models, in order, then ``escalate_to``. With
   no qualifying candidate the first fallback is promoted; with nothing at
   all the answer is a typed ``NoRoute``.
3. **Order** (``Order``): config order, estimated cost, EWMA latency, or
   least busy (in flight / ``max_concurrency``); sorts are stable.
   ``CHEAPEST`` (and any route in ``cheapest_routes``) keeps only the
   cheapest candidate and demotes the rest to the head of the fallbacks.
4. **Reason**: a one-line account of the decision for logs and the REPL.

A plan is where the task *wants* to go, whatever the breakers say now
(``fallback.place`` derives where it may go), and only ``fallback`` rewrites
it. Load balancing within a group needs no weights: the queue gives a task to
whichever candidate grants a credit first, so the split follows free capacity.

What must hold: a plan never names an unknown model; candidates are never
empty; no model appears twice in a plan; every model in a plan meets the
context, token-limit and capability constraints. ``check`` reads only
configuration and is safe from any thread. ``observe`` is called by one owner
(the router actor); ``plan`` by it and, when ``plans_anywhere``, by any thread
at once (the front door plans on the submitting thread): it reads the health
view by single lookups, never iterating what ``observe`` changes, and its
caches take single gets and sets of values equal whoever stores them. Pure: no
clock, no I/O.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from callboard.core.admission import refusal
from callboard.core.complexity import MEDIUM, TIER_PREFERENCES, Classifier, HeuristicClassifier
from callboard.core.health import RecentLatency
from callboard.core.pricing import list_nusd
from callboard.core.settings import ModelSettings
from callboard.messages import (
    ConfigError,
    Health,
    InvalidRequestError,
    Request,
    UnknownModelError,
)

__all__ = [
    "AUTO",
    "AboveTokenLimit",
    "CannotCarry",
    "ContextTooLarge",
    "HealthView",
    "MissingCapability",
    "NoRoute",
    "NotAllowed",
    "Order",
    "Plan",
    "RoutingPolicy",
]

_Models = tuple[str, ...] | None
_NONE: frozenset[str] = frozenset()
_SHARED_MAX = 4096
"""Distinct candidate and fallback lists kept as shared tuples (bounds the table)."""

AUTO = "auto"
"""The reserved route name that asks the classifier."""


class NoRoute(Exception):  # noqa: N818 - a decision, named as the outcome
    """No configured model can serve this request."""


class NotAllowed(NoRoute):
    """None of the models the request may go to is among its ``models_allowed``."""


class MissingCapability(NoRoute):
    """No model the request may go to has every required capability.

    ``missing`` holds the required capabilities that no model of the route has
    at all; it is empty when each exists somewhere but no one model has all.
    """

    def __init__(self, message: str, *, required: frozenset[str], missing: frozenset[str]) -> None:
        super().__init__(message)
        self.required = required
        self.missing = missing


class CannotCarry(NoRoute):
    """No model the request may go to can carry it in its dialect (``n`` > 1 to
    Anthropic's Messages API, say): ``refusals`` says why, by model."""

    def __init__(self, message: str, *, refusals: Mapping[str, str]) -> None:
        super().__init__(message)
        self.refusals = dict(refusals)


class ContextTooLarge(NoRoute):
    """The prompt plus ``max_tokens`` fits no context window of the route."""

    def __init__(self, message: str, *, need: int, largest: int) -> None:
        super().__init__(message)
        self.need = need
        self.largest = largest


class AboveTokenLimit(NoRoute):
    """The prompt plus ``max_tokens`` fits a context window of the route, but every
    such model's tokens-per-minute limit is below it: no wait would admit the call.

    ``largest`` is the largest such limit (the request asks more than any model
    that could hold it admits in a minute).
    """

    def __init__(self, message: str, *, need: int, largest: float) -> None:
        super().__init__(message)
        self.need = need
        self.largest = largest


class Order(enum.Enum):
    """How candidates are ordered."""

    CONFIG = "config"
    COST = "cost"
    CHEAPEST = "cheapest"
    """Cost order, and only the cheapest stays a candidate."""
    LATENCY = "latency"
    """Lowest EWMA latency first; a model with no measurement yet sorts first."""
    LEAST_BUSY = "least_busy"
    """Lowest in_flight / max_concurrency first; no report counts as idle."""


@dataclass(frozen=True, slots=True)
class Plan:
    candidates: tuple[str, ...]
    fallbacks: tuple[str, ...]
    reason: str = ""
    """A one-line account of the decision, e.g. ``route=fast: [a, b] fallbacks [c]``."""


class HealthView:
    """Each model's health as reported to the router, for the order: its latency faded
    since it last moved, and its load counting the tasks planned to it since.

    Reports come when a model's state moves, else at most once a second, and a latency
    moves only when an answer comes. Ranked by the last report alone, a model that had
    a slow spell got no task again under ``order = "latency"`` (none answered, so its
    average stayed at its worst), and under ``order = "least_busy"`` every task of a
    second went to the one that last said it was idle, then every task of the next to
    the other (found by a hunt)."""

    __slots__ = ("_latency", "_latest", "_planned")

    def __init__(self) -> None:
        self._latest: dict[str, Health] = {}
        self._latency = RecentLatency(falling_fades_on=True)
        self._planned: dict[str, deque[float]] = {}
        """When each task planned to go first to each model since its last report was."""

    def observe(self, health: Health, now: float) -> None:
        model = health.model
        self._latest[model] = health
        if health.latency_ewma_s is not None:
            self._latency.observe(model, health.latency_ewma_s, now)
        self._planned[model] = deque()

    def latency_s(self, model: str, now: float) -> float:
        """Its latency as last reported, halved every ``LATENCY_HALF_LIFE_S`` since that
        value came (0 before any: a model never measured is tried)."""
        return self._latency.get(model, now)

    def in_flight(self, model: str, now: float) -> int:
        """Its calls in flight as last reported, and the tasks planned to it since that
        would not have had its latency to answer by ``now`` (all of them while its
        latency is unknown)."""
        h = self._latest.get(model)
        planned = self._planned.get(model)
        latency = None if h is None else h.latency_ewma_s
        if planned is not None and latency is not None:
            with contextlib.suppress(IndexError):  # any thread may plan: another may take
                while planned[0] < now - latency:  # the last one between the look and the
                    planned.popleft()  # take (found by a review)
        return (0 if h is None else h.in_flight) + len(planned or ())

    def planned(self, model: str, now: float) -> None:
        """A task was planned to go first to ``model`` at ``now``."""
        self._planned.setdefault(model, deque()).append(now)


class RoutingPolicy:
    """Explicit model, routes (tiers), auto classification; constraints and order."""

    def __init__(
        self,
        models: Mapping[str, ModelSettings],
        *,
        default_route: tuple[str, ...] | str | None = None,
        routes: Mapping[str, tuple[str, ...]] | None = None,
        classifier: Classifier | None = None,
        order: Order | str = Order.COST,
        cheapest_routes: Collection[str] = ("cheap",),
        escalate_to: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not models:
            raise ValueError("routing needs at least one model")
        self._models = dict(models)
        self._fits = {name: _largest_call(s) for name, s in self._models.items()}
        self._declared = any(s.capabilities for s in self._models.values())
        """Some model says what it can do: a request's own needs (``Request.needs``:
        an image, tools, a JSON format) then route it; with none declared, nothing
        is known and nothing is refused."""
        """The largest prompt + max_tokens each model can ever take (window and tpm)."""
        self._routes = _route_table(self._models, routes or {})
        self._default = self._default_route(default_route)
        self._classifier: Classifier = classifier or HeuristicClassifier()
        self._own_classifier = classifier is None
        self._order = Order(order)
        self._cheapest_routes = frozenset(cheapest_routes)
        if escalate_to is not None and escalate_to not in self._models:
            raise UnknownModelError(f"escalate_to names unknown model {escalate_to!r}")
        self._escalate = escalate_to
        self._chains: dict[tuple[str, ...], tuple[str, ...]] = {}
        """Fallback chain per wanted tuple; keys come from the configuration only."""
        self.health = HealthView()
        self._clock = clock
        self._tuples: dict[tuple[str, ...], tuple[str, ...]] = {}

    def _default_route(self, given: tuple[str, ...] | str | None) -> tuple[str, _Models]:
        """(how the plan's reason names it, its models; None: classify)."""
        if given is None:
            return "default", (next(iter(self._models)),)
        if given in (AUTO, (AUTO,)):  # (AUTO,): a list-valued config key naming the policy
            return f"default={AUTO}", None
        if isinstance(given, str):
            if given not in self._routes:
                raise UnknownModelError(f"default route {given!r} is not a configured route")
            return f"default route={given}", self._routes[given]
        if not given:
            raise ConfigError("the default route lists no model")
        for member in given:
            if member not in self._models:
                raise UnknownModelError(f"route 'default' names unknown model {member!r}")
        return "default", _unique(given)

    @property
    def plans_anywhere(self) -> bool:
        """Whether ``plan`` may run on any thread, the submitting one included: it runs
        no plugged-in code (a classifier of the host's may be slow, or keep state for
        one thread)."""
        return self._own_classifier

    @property
    def routes(self) -> Mapping[str, tuple[str, ...]]:
        return self._routes

    def observe(self, health: Health) -> None:
        """Learn a model's health (latency, load) for later plans."""
        if health.model in self._models:
            self.health.observe(health, self._clock())

    def check(self, request: Request) -> None:
        """Raise ``UnknownModelError`` if the request names what is not configured,
        ``InvalidRequestError`` if its ``metadata["capabilities"]`` is malformed."""
        self._check_names(request)
        _metadata_capabilities(request)

    def _check_names(self, request: Request) -> None:
        if request.model is not None and request.model not in self._models:
            known = ", ".join(sorted(self._models))
            raise UnknownModelError(f"unknown model {request.model!r} (configured: {known})")
        if (
            request.route is not None
            and request.route != AUTO
            and request.route not in self._routes
        ):
            known = ", ".join([*sorted(self._routes), AUTO])
            raise UnknownModelError(f"unknown route {request.route!r} (configured: {known})")

    def list_nusd(self, model: str, prompt_tokens: int, max_tokens: int) -> int:
        """What one call of ``model`` costs at its list prices: the cost order's key
        (``pricing.list_nusd``)."""
        return list_nusd(self._models[model].price, prompt_tokens, max_tokens)

    def context_window(self, model: str) -> int:
        """The most tokens ``model`` takes in one call, prompt and answer."""
        return self._models[model].context_window

    def plan(
        self,
        request: Request,
        prompt_tokens: int,
        *,
        capabilities: Iterable[str] = (),
        order: Order | str | None = None,
    ) -> Plan:
        """Candidates and fallbacks for ``request``; ``NoRoute`` when none can serve it."""
        self._check_names(request)
        required = _metadata_capabilities(request)
        if capabilities:
            required = required.union(capabilities)
        if self._declared and (request.options or not request.plain):
            required = required | request.needs
        need = prompt_tokens + request.max_tokens  # each choice's, in the context window
        models, fits, allowed = self._models, self._fits, request.models_allowed
        rated = prompt_tokens + request.output_tokens  # every choice's, in the tokens per minute

        @functools.cache
        def refused(m: str) -> str | None:
            """Why ``m``'s dialect cannot carry the request, asked once a model. Left in
            the plan, such a model ended the task when an earlier one failed: the first's
            retryable 500 became its request error, a 400 at the gateway (a hunt)."""
            return refusal(models[m], request)

        def ok(m: str) -> bool:
            return (
                fits[m] >= need
                and (rated == need or _tpm(models[m]) >= rated)
                and required <= models[m].capabilities
                and (allowed is None or m in allowed)
                and refused(m) is None
            )

        how, wanted = self._wanted(request, prompt_tokens, ok)
        candidates = [m for m in wanted if ok(m)]
        notes: list[str] = []
        if len(candidates) < len(wanted):
            notes = [
                self._why_not(m, need, rated, required, allowed, refused=refused(m))
                for m in wanted
                if m not in candidates
            ]
        # texts to embed never fall back: another model's vectors are not comparable
        chain = self._chain(wanted) if request.input is None else []
        fallbacks = [m for m in chain if ok(m)]  # the chain holds no wanted model
        if not candidates and not fallbacks:
            raise self._no_route(
                how, [*wanted, *chain], required, request, need=need, rated=rated, refused=refused
            )
        if not candidates:
            notes.append(f"promoted fallback {fallbacks[0]}")
            candidates, fallbacks = fallbacks[:1], fallbacks[1:]
        chosen = self._choose_order(request, order)
        if len(candidates) > 1:
            candidates = self._sorted(candidates, chosen, prompt_tokens, request.output_tokens)
            if chosen is not Order.CONFIG:
                notes.append(f"order={chosen.value}")
        if chosen is Order.CHEAPEST:
            candidates, fallbacks = candidates[:1], [*candidates[1:], *fallbacks]
        elif chosen is Order.LEAST_BUSY:
            self.health.planned(candidates[0], self._clock())
        return Plan(
            candidates=self._shared(candidates),
            fallbacks=self._shared(fallbacks),
            reason=_reason(how, candidates, fallbacks, notes),
        )

    # -- steps --------------------------------------------------------------

    def _shared(self, models: list[str]) -> tuple[str, ...]:
        """One tuple object per distinct model list: every queued job holds its plan's
        tuples, so a million jobs share a handful instead of owning a million."""
        key = tuple(models)
        shared = self._tuples.get(key)
        if shared is None:
            shared = key
            if len(self._tuples) < _SHARED_MAX:
                self._tuples[key] = key
        return shared

    def _wanted(
        self, request: Request, prompt_tokens: int, ok: Callable[[str], bool]
    ) -> tuple[str, tuple[str, ...]]:
        """(how it was chosen, the wanted models in config order)."""
        if request.model is not None:
            return f"model={request.model}", (request.model,)
        if request.route == AUTO:
            return self._auto(f"route={AUTO}", request, prompt_tokens, ok)
        if request.route is not None:
            return f"route={request.route}", self._routes[request.route]
        how, models = self._default
        if models is None:
            return self._auto(how, request, prompt_tokens, ok)
        return how, models

    def _auto(
        self, prefix: str, request: Request, prompt_tokens: int, ok: Callable[[str], bool]
    ) -> tuple[str, tuple[str, ...]]:
        """Classify, then take the first preferred configured tier with a qualifying model."""
        try:
            answer = self._classifier(request, prompt_tokens)
        except Exception as exc:  # noqa: BLE001 - a plugged-in classifier degrades, never loses a task
            answer, prefix = MEDIUM, f"{prefix} (classifier failed: {type(exc).__name__})"
        # the protocol says str, but a plugged-in classifier may answer anything, and a
        # list or a dict would raise in the route lookups below, failing the task
        label: object = answer
        if not isinstance(label, str):
            got = type(label).__name__
            label, prefix = MEDIUM, f"{prefix} (classifier answered a {got}, not a label)"
        if label in self._routes:
            return f"{prefix} classified {label}", self._routes[label]
        tiers = [
            t for t in TIER_PREFERENCES.get(label, TIER_PREFERENCES[MEDIUM]) if t in self._routes
        ]
        for tier in tiers:
            if any(ok(m) for m in self._routes[tier]):
                return f"{prefix} classified {label} -> {tier}", self._routes[tier]
        if tiers:
            return f"{prefix} classified {label} -> {tiers[0]}", self._routes[tiers[0]]
        return f"{prefix} classified {label} -> no tier", self._default[1] or tuple(self._models)

    def _chain(self, wanted: tuple[str, ...]) -> tuple[str, ...]:
        """The wanted models' fallbacks in order, then ``escalate_to``; no repeats."""
        known = self._chains.get(wanted)
        if known is None:
            known = self._chains[wanted] = tuple(self._build_chain(wanted))
        return known

    def _build_chain(self, wanted: Sequence[str]) -> list[str]:
        chain: list[str] = []
        for m in wanted:
            chain.extend(fb for fb in self._models[m].fallbacks if fb not in chain)
        if self._escalate is not None and self._escalate not in chain:
            chain.append(self._escalate)
        return [m for m in chain if m not in wanted]

    def _choose_order(self, request: Request, given: Order | str | None) -> Order:
        if given is not None:
            return Order(given)
        if request.route is not None and request.route in self._cheapest_routes:
            return Order.CHEAPEST
        return self._order

    def _sorted(
        self, models: list[str], order: Order, prompt_tokens: int, max_tokens: int
    ) -> list[str]:
        if order in (Order.COST, Order.CHEAPEST):
            return sorted(models, key=lambda m: self.list_nusd(m, prompt_tokens, max_tokens))
        if order is Order.LATENCY:
            now = self._clock()
            return sorted(models, key=lambda m: self.health.latency_s(m, now))
        if order is Order.LEAST_BUSY:
            now = self._clock()
            return sorted(
                models,
                key=lambda m: self.health.in_flight(m, now) / self._models[m].max_concurrency,
            )
        return models

    def _why_not(
        self,
        model: str,
        need: int,
        rated: int,
        required: frozenset[str],
        allowed: frozenset[str] | None,
        *,
        refused: str | None = None,
    ) -> str:
        """Why ``model`` cannot take a call of ``need`` tokens in its context window and
        ``rated`` in its tokens per minute (more for ``n`` choices), or the request
        (``refused``: why its dialect cannot carry it)."""
        if allowed is not None and model not in allowed:
            return f"{model} not allowed"
        if refused is not None:
            return f"{model} cannot carry it ({refused})"
        s = self._models[model]
        lacking = sorted(required - s.capabilities)
        if lacking:
            return f"{model} lacks {', '.join(lacking)}"
        if s.context_window < need:
            return f"{model} too small ({s.context_window} < {need} tokens)"
        return f"{model} admits {s.limiter.tpm:g} tokens per minute (< {rated})"

    def _no_route(
        self,
        how: str,
        considered: list[str],
        required: frozenset[str],
        request: Request,
        *,
        need: int,
        rated: int,
        refused: Callable[[str], str | None],
    ) -> NoRoute:
        allowed = request.models_allowed
        if allowed is not None:
            considered = [m for m in considered if m in allowed]
            if not considered:
                return NotAllowed(
                    f"{how}: no model it may go to is allowed for this request "
                    f"(allowed: {', '.join(sorted(allowed)) or 'none'})"
                )
        refusals = {m: said for m in considered if (said := refused(m)) is not None}
        if len(refusals) == len(considered):
            why = "; ".join(f"{m}: {said}" for m, said in refusals.items())
            return CannotCarry(f"{how}: no model can carry this request ({why})", refusals=refusals)
        considered = [m for m in considered if m not in refusals]
        capable = [m for m in considered if required <= self._models[m].capabilities]
        if not capable:
            held = frozenset().union(*(self._models[m].capabilities for m in considered))
            why = "; ".join(self._why_not(m, need, rated, required, None) for m in considered)
            return MissingCapability(
                f"{how}: no model has every required capability {sorted(required)} ({why})",
                required=required,
                missing=required - held,
            )
        holding = [m for m in capable if self._models[m].context_window >= need]
        if holding:
            limit = max(_tpm(self._models[m]) for m in holding)
            each = "" if request.choices == 1 else f" x {request.choices}"
            return AboveTokenLimit(
                f"{how}: no model admits {rated} tokens (prompt ~{need - request.max_tokens} + "
                f"max_tokens {request.max_tokens}{each}) in a minute; largest tokens per "
                f"minute: {limit:g}",
                need=rated,
                largest=limit,
            )
        largest = max(self._models[m].context_window for m in capable)
        return ContextTooLarge(
            f"{how}: no model fits {need} tokens (prompt ~{need - request.max_tokens} + max_tokens "
            f"{request.max_tokens}); largest context: {largest}",
            need=need,
            largest=largest,
        )


def _tpm(settings: ModelSettings) -> float:
    """The model's tokens-per-minute limit (inf: none)."""
    tpm = settings.limiter.tpm
    return math.inf if tpm is None else tpm


def _largest_call(settings: ModelSettings) -> float:
    """The largest prompt + max_tokens the model takes: its context window, and no more
    than its limiter admits in a minute (a call above ``tpm`` is ``TooLarge`` there)."""
    return min(settings.context_window, _tpm(settings))


def _route_table(
    models: Mapping[str, ModelSettings], routes: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    """Tiers from the models (config order), then explicit routes (which override).

    A model named twice (a tier listed twice, a route repeating a member) is kept
    once, at its first place: a plan never names a model twice."""
    table: dict[str, list[str]] = {}
    for m in models.values():
        for tier in m.tiers:
            table.setdefault(tier, []).append(m.name)
    for name, members in routes.items():
        table[name] = list(members)
    if AUTO in table:
        raise ConfigError(f"{AUTO!r} is reserved for the classifier; rename that route or tier")
    for name, listed in table.items():
        if not listed:
            raise ConfigError(f"route {name!r} lists no model")
        for member in listed:
            if member not in models:
                raise UnknownModelError(f"route {name!r} names unknown model {member!r}")
    return {k: _unique(v) for k, v in table.items()}


def _unique(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` without repeats, in first-seen order."""
    return tuple(dict.fromkeys(names))


def _metadata_capabilities(request: Request) -> frozenset[str]:
    """``request.metadata["capabilities"]``: a list of strings (or one string)."""
    given = request.metadata.get("capabilities") if request.metadata else None
    if given is None:
        return _NONE
    if isinstance(given, str):
        given = (given,)
    if not isinstance(given, list | tuple | set | frozenset) or not all(
        isinstance(c, str) and c for c in given
    ):
        raise InvalidRequestError(
            f"metadata['capabilities'] must be a list of capability names, got {given!r}"
        )
    return frozenset(given)


def _reason(how: str, candidates: list[str], fallbacks: list[str], notes: list[str]) -> str:
    text = f"{how}: [{', '.join(candidates)}] fallbacks [{', '.join(fallbacks)}]"
    return f"{text} ({'; '.join(notes)})" if notes else text
