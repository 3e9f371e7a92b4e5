"""Results: the closed set of ways a task ends.

Every accepted task ends in exactly one of ``Completed``, ``Failed``,
``Expired``, ``Cancelled`` or ``Rejected``. Failures are values, not
exceptions: ``result.ok`` tells them apart, ``Failed.reason`` says why.

Money is carried as integer nano-dollars (``cost_nusd``) so sums never drift;
``cost_usd`` shows it as an exact ``Decimal``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, ClassVar

from callboard.messages._errors import MalformedOutputError
from callboard.messages._frozen import quick_init
from callboard.messages._request import Priority

NANO = Decimal(1_000_000_000)


class FailureReason(enum.Enum):
    """Why a task failed; the first group is the provider's doing, the second ours or yours."""

    RATE_LIMITED = "rate_limited"
    PROVIDER_ERROR = "provider_error"
    TIMEOUT = "timeout"
    CONNECTION = "connection"
    MALFORMED_RESPONSE = "malformed_response"
    QUOTA_EXCEEDED = "quota_exceeded"
    """The provider's account is out of quota or credit (OpenAI's 429
    ``insufficient_quota``): not retried, since waiting does not help."""
    REQUEST_ERROR = "request_error"
    """The provider refused the request itself (400, 404, 413, 422)."""
    AUTHENTICATION = "authentication"
    """The provider refused the key (401) or its permissions (403): not retried,
    and the model's other calls stop at once (fix the key, then retry)."""
    PROVIDER_DOWN = "provider_down"
    """Every model the task could use has been down longer than its ``give_up_s``:
    ``detail`` names the last error each one gave."""
    MALFORMED_OUTPUT = "malformed_output"
    """The request asked for a strict ``json_schema`` and the answer's text is not JSON
    (``detail`` says where it broke; the call's cost is charged)."""
    STREAM_CUT = "stream_cut"
    """A stream broke after its first delta reached the reader (not retried: the
    reader has part of an answer); ``Failed.partial_text`` holds the text received."""
    BUDGET_EXCEEDED = "budget_exceeded"
    NO_ROUTE = "no_route"
    LOCAL_RESOURCES = "local_resources"
    """This process could not open the connection of the task's last call (out of file
    descriptors or socket buffers: ``detail`` says which); that call never reached the
    provider (as every reason, the last call's: one before it may have). Read as
    ``CONNECTION``, a gateway's clients heard the provider was unreachable (502) when
    the gateway was what had run out."""
    INTERNAL = "internal"


class RejectReason(enum.Enum):
    """Why the front door refused a task before it was queued."""

    UNKNOWN_MODEL = "unknown_model"
    QUEUE_FULL = "queue_full"
    STOPPING = "stopping"
    DUPLICATE = "duplicate"


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """Token counts as the provider reported them (or, if it did not, the most the
    call could have used: see ``estimated``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the provider's cache (cheaper where priced)."""
    reasoning_tokens: int = 0
    """Completion tokens the model spent reasoning (part of ``completion_tokens``, as
    OpenAI's ``completion_tokens_details.reasoning_tokens``; priced at their own rate
    where one is set)."""
    cache_write_tokens: int = 0
    """Prompt tokens written to the provider's cache (part of ``prompt_tokens``:
    Anthropic's ``cache_creation_input_tokens``), dearer than other input there."""
    cache_write_1h_tokens: int = 0
    """Of ``cache_write_tokens``, those written to a longer-lived cache (Anthropic's
    1-hour cache, ``cache_creation.ephemeral_1h_input_tokens``), dearer still."""
    estimated: bool = False
    """The provider's answer had no usage: these are callboard's prompt estimate and
    the request's ``max_tokens``, an upper bound, so cost, budgets and the token
    limit never count such a call as cheaper than it may have been."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, other: Usage) -> Usage:
        """Both calls' counts together (estimated if either was)."""
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            reasoning_tokens=self.reasoning_tokens + other.reasoning_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
            cache_write_1h_tokens=self.cache_write_1h_tokens + other.cache_write_1h_tokens,
            estimated=self.estimated or other.estimated,
        )


ZERO_USAGE = Usage()


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Billed:
    """A call billed though it served nothing (a 2xx whose body could not be read, then
    retried or moved on from): its model, what it used and what it cost."""

    model: str
    usage: Usage
    cost_nusd: int


def _loaded(cls: type[Result], state: dict[str, Any]) -> Result:
    """A pickled result, as it was (see ``Result.__reduce__``)."""
    result = object.__new__(cls)
    for name, value in state.items():
        object.__setattr__(result, name, value)
    object.__setattr__(result, "metadata", types.MappingProxyType(state["metadata"]))
    return result


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """What every result carries."""

    ok: ClassVar[bool] = False
    task_id: int
    """The id callboard gave the task."""
    trace_id: str
    """Shared by every task of one chain or race; a fresh id otherwise."""
    priority: Priority = Priority.NORMAL
    model: str | None = None
    """The model that served (or last tried) the task, if any."""
    attempts: int = 0
    """Calls sent to providers for this task."""
    refused: int = 0
    """Of ``attempts``, the calls a provider refused without serving them (a 429 for a
    rate limit or the account's quota, an overloaded 503 or 529): no work done,
    nothing billed."""
    latency_s: float = 0.0
    """Submission to result, in seconds."""
    queue_wait_s: float = 0.0
    """Time spent waiting in the queue before the first call."""
    usage: Usage = ZERO_USAGE
    cost_nusd: int = 0
    """Cost in nano-dollars (integer, exact)."""
    metadata: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}))
    request_id: str | None = None
    """The provider's id of the task's last call (OpenAI's and Azure's ``x-request-id``
    header, Anthropic's ``request-id``): what its support asks for. None when no call
    answered, or its answer named none."""
    billed_before: tuple[Billed, ...] = ()
    """The task's earlier calls billed though they served nothing, each on its model
    (counted in ``usage`` and ``cost_nusd`` too): the stats and metrics count each on
    the model that billed it, not on ``model``."""

    @property
    def cost_usd(self) -> Decimal:
        return Decimal(self.cost_nusd) / NANO

    def own_share(self) -> tuple[int, int, int]:
        """The prompt tokens, completion tokens and cost (nano-USD) of the task less its
        calls ``billed_before``: what ``model`` billed, for figures kept by model."""
        prompt, completion = self.usage.prompt_tokens, self.usage.completion_tokens
        cost = self.cost_nusd
        for billed in self.billed_before:
            prompt -= billed.usage.prompt_tokens
            completion -= billed.usage.completion_tokens
            cost -= billed.cost_nusd
        return prompt, completion, cost

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its metadata as a dict, read-only again once loaded: a
        ``mappingproxy`` does not pickle, so no result crossed to another process (a
        pool's worker returning one, a queue; found by a hunt)."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        state["metadata"] = dict(self.metadata)
        return (_loaded, (type(self), state))

    @property
    def text(self) -> str | None:
        return None


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A function the model asks the caller to call."""

    id: str
    """The call's id: a ``tool`` turn answering it names it (``tool_call_id``)."""
    name: str
    arguments: str
    """The arguments as the model wrote them: a JSON text, not checked."""

    def parsed_arguments(self) -> Any:
        """The arguments as JSON; ``MalformedOutputError`` naming the tool when they
        are not."""
        try:
            return json.loads(self.arguments)
        except ValueError as exc:
            raise MalformedOutputError(
                f"the arguments of tool call {self.id!r} to {self.name!r} are not JSON: {exc}"
            ) from None

    def wire(self) -> dict[str, Any]:
        """The call as Chat Completions writes it, in an answer and in the assistant turn
        that sends it back."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """One of the answers a request with ``n`` > 1 asked for."""

    index: int
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    refusal: str | None = None
    logprobs: Mapping[str, Any] | None = None

    @property
    def text(self) -> str:
        return self.content or ""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Completed(Result):
    """The provider answered."""

    ok: ClassVar[bool] = True
    content: str
    """The answer's text ("" when the model only called tools, or refused before it
    said anything)."""
    finish_reason: str | None = None
    """``stop``, ``length``, ``tool_calls``, ``content_filter`` (OpenAI's words, also
    for a model of another dialect)."""
    tool_calls: tuple[ToolCall, ...] = ()
    refusal: str | None = None
    """The model's refusal, when it refused (OpenAI's structured outputs)."""
    parsed: Any = None
    """The answer as JSON, when the request asked for a JSON response format and the
    text parses (None otherwise)."""
    logprobs: Mapping[str, Any] | None = None
    choices: tuple[Choice, ...] = ()
    """Every answer, when the request asked for ``n`` > 1 (the first is also this
    result's ``content``, ``tool_calls`` ...)."""
    raw: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    """The provider's answer body as received (redacted), for anything else; for a
    stream, the answer its events assembled."""
    ttft_s: float | None = None
    """A streamed answer's time to first token: from its call's start to the first
    delta (None for an answer not streamed)."""
    reasoning: str | None = None
    """The model's reasoning, when it said it: a Claude model's extended thinking,
    DeepSeek's or vLLM's ``reasoning_content``, OpenRouter's ``reasoning`` (not part of
    ``content``)."""
    thinking_blocks: tuple[Mapping[str, Any], ...] = ()
    """A Claude model's thinking, signed (``{"type": "thinking", "thinking",
    "signature"}`` or ``{"type": "redacted_thinking", "data"}``): what a thinking tool
    loop sends back first in the turn (``message`` carries them)."""

    @property
    def text(self) -> str:
        return self.content

    @property
    def message(self) -> dict[str, Any]:
        """The answer as the assistant turn to send back with the next request (the
        tool loop's ``messages.append(...)``): its text, tool calls, refusal, reasoning
        and signed thinking, in Chat Completions' shape, whichever dialect the model
        spoke (each model is sent what it takes of the reasoning: ``sends_back``)."""
        said = self.content if self.content or not self.tool_calls else None
        turn: dict[str, Any] = {"role": "assistant", "content": said}
        if self.tool_calls:
            turn["tool_calls"] = [c.wire() for c in self.tool_calls]
        if self.refusal:
            turn["refusal"] = self.refusal
        if self.reasoning is not None:  # for a model that takes it back (DeepSeek's)
            turn["reasoning_content"] = self.reasoning
        if self.thinking_blocks:
            turn["thinking_blocks"] = [dict(b) for b in self.thinking_blocks]
        return turn


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Failed(Result):
    """The task could not be served; ``reason`` says why, ``detail`` says more."""

    reason: FailureReason
    detail: str = ""
    status_code: int | None = None
    partial_text: str = ""
    """The text a stream delivered before it broke (``STREAM_CUT``)."""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Expired(Result):
    """The task's deadline passed before it could be served."""

    detail: str = ""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Cancelled(Result):
    """The task was cancelled (by the caller, or by ``stop(cancel=True)``)."""

    detail: str = ""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected(Result):
    """The front door refused the task; nothing was sent anywhere."""

    reason: RejectReason
    detail: str = ""
