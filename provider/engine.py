"""The simulated provider's decisions: what to do with one request, of any endpoint.

Pure apart from the injected clock and seeded RNG: no sockets, no asyncio.
`ProviderCore.plan` answers an `Ask` (what the wire read from the request: its
prompt size, its answer's fixed size if it has one, ``max_tokens``...) with a
`Plan` (forced status, 429, a fault, or an answer after some latency) and the
HTTP layer carries it out. All state lives on the server's event loop; nothing
here is thread-safe.

Invariants:
- the order is fixed: forced status, then rate limits, then faults, then latency;
- the completion size is decided before the limit check (a structured answer's
  fixed size, else a seeded draw; then ``max_tokens`` and a stop sequence), so
  a request is charged exactly the tokens its ``usage`` reports (prompt, and
  output with reasoning, times the choices), or, where the API's limit counts all
  of ``max_tokens`` as the request arrives (``Ask.counts_cap``: OpenAI's), the prompt
  and ``max_tokens`` if more; a refused request nothing;
- a request that offers a prompt prefix for caching (``Ask.prefix``) and is
  admitted stores it in its model's `cache.PromptCache`; its plan says how
  much of the prompt was read from the cache, or written to it;
- the number of per-model states is bounded (`MAX_MODELS`); request names past
  the bound share one state, ``OTHER_MODELS``; configuring a new name past it
  raises `ValueError`.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from callboard.provider.behaviour import ModelBehaviour
from callboard.provider.cache import Prefix, PromptCache
from callboard.provider.counters import Counters
from callboard.provider.limits import ModelLimits, Refusal, Window

__all__ = [
    "MAX_MODELS",
    "OTHER_MODELS",
    "Ask",
    "Finish",
    "ModelState",
    "Outcome",
    "Plan",
    "ProviderCore",
]

MAX_MODELS = 1024
OTHER_MODELS = "(other)"


class Outcome(enum.Enum):
    """What the provider does with an admitted or refused request."""

    FORCED = enum.auto()
    LIMITED = enum.auto()
    ERROR = enum.auto()
    UNAVAILABLE = enum.auto()
    HANG = enum.auto()
    DROP = enum.auto()
    MALFORMED = enum.auto()
    CUT = enum.auto()
    OK = enum.auto()


_STATUS = {Outcome.ERROR: 500, Outcome.UNAVAILABLE: 503, Outcome.HANG: 504, Outcome.DROP: 0}
_FAULTS = (
    ("error_rate", Outcome.ERROR),
    ("unavailable_rate", Outcome.UNAVAILABLE),
    ("timeout_rate", Outcome.HANG),
    ("drop_rate", Outcome.DROP),
    ("malformed_rate", Outcome.MALFORMED),
    ("cut_rate", Outcome.CUT),
)
_ANSWERED = (Outcome.OK, Outcome.MALFORMED, Outcome.CUT)
"""Outcomes that answer 200 after the latency."""

Finish = Literal["stop", "length", "stop_sequence"]
"""Why the answer ended: naturally, at ``max_tokens``, or at a stop sequence (each wire
names these its own way: ``tool_calls``, ``end_turn``, ``max_tokens``...)."""


@dataclass(frozen=True, slots=True)
class Ask:
    """What the engine needs to know of one request."""

    prompt_tokens: int
    max_tokens: int | None = None
    """The output cap (reasoning included), None for none."""
    fixed_tokens: int | None = None
    """The size of a structured answer (tool calls, JSON); None: filler, drawn."""
    stop_at: int | None = None
    """Filler only: the words said before a stop sequence."""
    choices: int = 1
    reasoning_tokens: int = 0
    """Hidden output per choice (``reasoning_effort``), counted in the completion."""
    stream: bool = False
    prefix: Prefix | None = None
    """The part of the prompt offered for caching, if any (see ``cache``)."""
    counts_cap: bool = False
    """The token limit counts all of ``max_tokens`` as the request arrives, as OpenAI's
    does ("usage needs are estimated from this value"), rather than the output made,
    as Anthropic's does once it has adjusted its estimate."""


@dataclass(frozen=True, slots=True)
class Plan:
    """The decision for one request."""

    outcome: Outcome
    status: int
    """HTTP status to answer (0 for a drop)."""
    windows: tuple[Window, ...]
    """The rate-limit windows' state, for each wire's headers (empty when unlimited)."""
    prompt_tokens: int
    completion_tokens: int
    """Visible output per choice."""
    finish_reason: Finish
    reasoning_tokens: int = 0
    """Hidden output per choice."""
    choices: int = 1
    delay_s: float = 0.0
    """Latency before answering (a stream's time to first token), or how long to hang."""
    gap_s: float = 0.0
    """A stream's pause between tokens."""
    cut_after: int = 0
    """CUT: the events a stream sends before it is cut."""
    cut_error: bool = False
    """CUT: a stream ends with the wire's error event (else the connection closes)."""
    cache_read: int = 0
    """Prompt tokens read from the prompt cache (part of `prompt_tokens`)."""
    cache_write: int = 0
    """Prompt tokens written to the prompt cache (part of `prompt_tokens`)."""
    retry_after_s: float | None = None
    """For a 429: the Retry-After to send."""
    refusal: Refusal | None = None
    """For a rate-limit 429: which limit refused."""

    @property
    def output_tokens(self) -> int:
        """The completion tokens ``usage`` reports: output and reasoning, every choice."""
        return (self.completion_tokens + self.reasoning_tokens) * self.choices


class ModelState:
    """Behaviour, buckets and counters of one model name."""

    __slots__ = ("behaviour", "cache", "counters", "faults", "limits")

    def __init__(self, behaviour: ModelBehaviour, total: Counters, now: float) -> None:
        self.behaviour = behaviour
        self.cache = PromptCache()
        self.faults = _fault_table(behaviour)
        self.counters = Counters(parent=total)
        self.limits = _limits_for(behaviour, now)

    def set_behaviour(self, behaviour: ModelBehaviour, now: float) -> None:
        """Change behaviour; buckets restart full only if the limits changed."""
        old, self.behaviour = self.behaviour, behaviour
        self.faults = _fault_table(behaviour)
        if (old.rpm, old.tpm, old.burst_s) != (behaviour.rpm, behaviour.tpm, behaviour.burst_s):
            self.limits = _limits_for(behaviour, now)


def _fault_table(behaviour: ModelBehaviour) -> tuple[tuple[float, Outcome], ...]:
    """The non-zero fault rates, in draw order."""
    rates = ((getattr(behaviour, name), outcome) for name, outcome in _FAULTS)
    return tuple((rate, outcome) for rate, outcome in rates if rate > 0.0)


def _limits_for(behaviour: ModelBehaviour, now: float) -> ModelLimits:
    return ModelLimits(behaviour.rpm, behaviour.tpm, behaviour.burst_s, now)


class ProviderCore:
    """Per-model state, the seeded RNG and the counters of one provider."""

    def __init__(
        self,
        *,
        default: ModelBehaviour,
        models: Mapping[str, ModelBehaviour] | None,
        seed: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.default = default
        self.total = Counters()
        self._rng = random.Random(seed)
        self._clock = clock
        self._started = clock()
        self._states: dict[str, ModelState] = {}
        self._configured: list[str] = []
        for name, behaviour in (models or {}).items():
            self.configure(name, behaviour)

    def mark_started(self) -> None:
        """Arrival times count from now."""
        self._started = self._clock()

    def elapsed(self) -> float:
        return self._clock() - self._started

    def configure(self, name: str, behaviour: ModelBehaviour) -> None:
        """Serve ``name`` with ``behaviour``; `ValueError` for a new name past `MAX_MODELS`."""
        if name not in self._states and len(self._states) >= MAX_MODELS:
            raise ValueError(
                f"cannot configure model {name!r}: the provider holds at most {MAX_MODELS} models"
            )
        if name not in self._configured:
            self._configured.append(name)
        state = self._states.get(name)
        if state is None:
            self._states[name] = ModelState(behaviour, self.total, self._clock())
        else:
            state.set_behaviour(behaviour, self._clock())

    def behaviour(self, name: str) -> ModelBehaviour:
        state = self._states.get(name)
        return self.default if state is None else state.behaviour

    def model_names(self) -> list[str]:
        """The configured model names, in the order they were configured."""
        return list(self._configured)

    def state(self, name: str) -> ModelState:
        """The state for ``name``, created with the default behaviour on first use."""
        state = self._states.get(name)
        if state is None:
            if len(self._states) >= MAX_MODELS:
                name = OTHER_MODELS
                state = self._states.get(name)
            if state is None:
                state = self._states[name] = ModelState(self.default, self.total, self._clock())
        return state

    def plan(self, state: ModelState, ask: Ask) -> Plan:  # noqa: PLR0911 - one per outcome
        """Decide what to do with one request for ``state``'s model."""
        behaviour, limits, now = state.behaviour, state.limits, self._clock()
        completion, reasoning, finish = self._size(behaviour, ask)

        cache = (0, 0)  # (read, written): known once the request is admitted

        def make(outcome: Outcome, status: int, delay_s: float = 0.0) -> Plan:
            windows = limits.windows(now) if limits.limited else ()
            return Plan(
                outcome,
                status,
                windows,
                ask.prompt_tokens,
                completion,
                finish,
                reasoning,
                ask.choices,
                delay_s,
                cache_read=cache[0],
                cache_write=cache[1],
            )

        if behaviour.status is not None:
            plan = make(Outcome.FORCED, behaviour.status)
            if behaviour.status == 429:
                return dataclasses.replace(plan, retry_after_s=behaviour.retry_after_s)
            return plan
        made = completion + reasoning
        cap = ask.max_tokens if ask.counts_cap and ask.max_tokens is not None else made
        charge = ask.prompt_tokens + max(cap, made) * ask.choices
        refusal = limits.try_admit(now, charge) if limits.limited else None
        if refusal is not None:
            plan = make(Outcome.LIMITED, 429)
            return dataclasses.replace(plan, retry_after_s=refusal.wait_s, refusal=refusal)
        if ask.prefix is not None:
            tokens = ask.prefix.tokens
            cache = (tokens, 0) if state.cache.lookup(ask.prefix.key, now) else (0, tokens)
        outcome = self._roll_fault(state.faults)
        if outcome is Outcome.HANG:
            return make(outcome, 504, behaviour.hang_s)
        if outcome not in _ANSWERED:
            return make(outcome, _STATUS[outcome])
        if not ask.stream:
            return make(outcome, 200, self._latency(behaviour))
        ttft = behaviour.latency_s if behaviour.ttft_s is None else behaviour.ttft_s
        plan = make(outcome, 200, self._latency(behaviour, ttft))
        return dataclasses.replace(
            plan,
            gap_s=behaviour.token_gap_s,
            cut_after=behaviour.cut_after,
            cut_error=behaviour.cut_mode == "error",
        )

    def _size(self, behaviour: ModelBehaviour, ask: Ask) -> tuple[int, int, Finish]:
        """(output, reasoning, finish) per choice."""
        reasoning = ask.reasoning_tokens
        cap = ask.max_tokens
        if cap is not None and reasoning >= cap:
            return 0, cap, "length"
        room = None if cap is None else cap - reasoning
        if ask.fixed_tokens is not None:
            size = ask.fixed_tokens
        else:
            drawn = behaviour.completion_tokens
            size = 16 + self._rng.randint(0, 48) if drawn is None else drawn
            stop = ask.stop_at
            if stop is not None and stop < size and (room is None or stop < room):
                return stop, reasoning, "stop_sequence"
        if room is not None and size >= room:
            return room, reasoning, "length" if size > room or ask.fixed_tokens is None else "stop"
        return size, reasoning, "stop"

    def _roll_fault(self, faults: tuple[tuple[float, Outcome], ...]) -> Outcome:
        if not faults:
            return Outcome.OK
        draw = self._rng.random()
        for rate, outcome in faults:
            if draw < rate:
                return outcome
            draw -= rate
        return Outcome.OK

    def _latency(self, behaviour: ModelBehaviour, mean: float | None = None) -> float:
        mean = behaviour.latency_s if mean is None else mean
        if behaviour.jitter_s == 0.0:
            return mean
        jitter = self._rng.uniform(-behaviour.jitter_s, behaviour.jitter_s)
        return max(0.0, mean + jitter)

    def stats(self) -> dict[str, object]:
        models = {name: s.counters.as_dict() for name, s in self._states.items()}
        return {"total": self.total.as_dict(), "models": models, "uptime_s": self.elapsed()}

    def reset_stats(self) -> None:
        self.total.reset()
        for state in self._states.values():
            state.counters.reset()
