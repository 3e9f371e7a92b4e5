"""What a caller asks for: a ``Request`` (validated on construction).

A ``Request`` is immutable and self-checking: once one exists it is a request
callboard can serve in principle (non-empty, sane limits). Whether a model of
that name exists is checked at the front door against the configuration.
"""

from __future__ import annotations

import enum
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from callboard.messages._errors import InvalidRequestError

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
MAX_TOKENS_LIMIT = 1_000_000


class Priority(enum.IntEnum):
    """Lower value is more urgent; the queue serves CRITICAL first."""

    CRITICAL = 0
    HIGH = 1
    NORMAL = 2
    LOW = 3

    @classmethod
    def parse(cls, value: object) -> Priority:
        """Accept a Priority, its name (any case) or its number."""
        if isinstance(value, Priority):
            return value
        name = value.strip().upper() if isinstance(value, str) else ""
        if name in cls.__members__:
            return cls[name]
        if isinstance(value, int) and not isinstance(value, bool) and value in list(cls):
            return cls(value)
        names = ", ".join(p.name.lower() for p in cls)
        raise InvalidRequestError(f"priority must be one of {names} (or 0-3), got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatMessage:
    """One chat turn, as the OpenAI chat API takes it."""

    role: str
    """system, user, assistant, tool or developer."""
    content: str
    """The text of the turn."""

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or self.role not in ROLES:
            raise InvalidRequestError(
                f"message role must be one of {sorted(ROLES)}, got {self.role!r}"
            )
        if not isinstance(self.content, str):
            raise InvalidRequestError(
                f"message content must be a string, got {type(self.content).__name__}"
            )


_NO_METADATA: Mapping[str, Any] = types.MappingProxyType({})
"""Shared by every request without metadata (read-only, so sharing is safe)."""


def _frozen_mapping(value: object) -> Mapping[str, Any]:
    if value is None or value is _NO_METADATA:
        return _NO_METADATA
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidRequestError(
            f"metadata must be a mapping with string keys, got {type(value).__name__}"
        )
    if not value:
        return _NO_METADATA
    problem = _json_problem(dict(value), "metadata")  # a durable ledger stores it as JSON
    if problem is not None:
        raise InvalidRequestError(f"metadata cannot be stored as JSON: {problem}")
    return types.MappingProxyType(dict(value))


_JSON_DEPTH = 100
"""Metadata nested deeper than this is refused (it would not be read back)."""


def _json_problem(value: object, where: str, depth: int = 0) -> str | None:
    """Why ``value`` is not plain JSON (dicts with string keys, lists, strings, integers,
    finite floats, booleans, None; nested), or None. ``depth``: the containers around it."""
    if value is None or isinstance(value, str | int):  # bool is an int
        return None
    if isinstance(value, float):
        return (
            None if math.isfinite(value) else f"{where} is {value!r}: JSON has no NaN or infinity"
        )
    if isinstance(value, dict | list):
        return _container_problem(value, where, depth + 1)
    return (
        f"{where} is of type {type(value).__name__}; allowed: dict with string keys, list, "
        "str, int, finite float, bool, None"
    )


def _container_problem(value: dict[Any, Any] | list[Any], where: str, depth: int) -> str | None:
    if depth > _JSON_DEPTH:  # a cycle too
        return f"{where} nests deeper than {_JSON_DEPTH} levels"
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(value, dict) and not isinstance(key, str):
            return f"{where} has a key that is not a string: {key!r}"
        problem = _json_problem(item, f"{where}[{key!r}]", depth)
        if problem is not None:
            return problem
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """A request for one completion: what to ask, how urgent, where, how big."""

    messages: tuple[ChatMessage, ...]
    """The chat; a bare prompt becomes one user message (see ``Request.of``)."""
    priority: Priority = Priority.NORMAL
    """Urgency; the queue serves more urgent work first."""
    model: str | None = None
    """An explicit model name, or None to let the router choose."""
    route: str | None = None
    """A routing hint (a tier or alias such as ``fast``), or None."""
    max_tokens: int = 256
    """Upper bound on completion tokens; also what the limiter reserves."""
    temperature: float | None = None
    """Sampling temperature passed to the provider, or None for its default."""
    deadline_s: float | None = None
    """Seconds from submission after which the result is ``Expired``."""
    metadata: Mapping[str, Any] = field(default_factory=lambda: _NO_METADATA)
    """Caller's data, carried through to the result untouched."""
    idempotency_key: str | None = None
    """Deduplicates resubmissions: one result per key."""
    budget_tag: str | None = None
    """The budget (tenant, team) this request's cost is charged to."""

    def __post_init__(self) -> None:
        # On every submit's path: checks that copy nothing (no strip() of the prompt)
        # and writes a field again only when it changes.
        given: Any = self.messages
        if type(given) is not tuple:  # a list is accepted and frozen
            given = tuple(given)
            object.__setattr__(self, "messages", given)
        _check_messages(given)
        if type(self.priority) is not Priority:
            object.__setattr__(self, "priority", Priority.parse(self.priority))
        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or not 0 < mt <= MAX_TOKENS_LIMIT:
            raise InvalidRequestError(
                f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}, got {mt!r}"
            )
        t = self.temperature
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= 2
        ):
            raise InvalidRequestError(f"temperature must be a number in 0..2, got {t!r}")
        d = self.deadline_s
        if d is not None and (
            isinstance(d, bool) or not isinstance(d, int | float) or not math.isfinite(d) or d <= 0
        ):
            raise InvalidRequestError(f"deadline_s must be a positive number, got {d!r}")
        for name, value in (
            ("model", self.model),
            ("route", self.route),
            ("idempotency_key", self.idempotency_key),
            ("budget_tag", self.budget_tag),
        ):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"{name} must be a non-empty string, got {value!r}")
        if self.metadata is not _NO_METADATA:
            object.__setattr__(self, "metadata", _frozen_mapping(self.metadata))

    @classmethod
    def of(
        cls,
        prompt: str | Request | list[ChatMessage] | tuple[ChatMessage, ...] | list[dict[str, Any]],
        **fields: Any,
    ) -> Request:
        """Build a request from a prompt string, chat messages or dicts."""
        if isinstance(prompt, Request):
            if fields:
                raise InvalidRequestError("pass either a Request or request fields, not both")
            return prompt
        if isinstance(prompt, str):
            msgs: tuple[ChatMessage, ...] = (ChatMessage(role="user", content=prompt),)
        elif isinstance(prompt, list | tuple):
            msgs = tuple(_as_chat_message(m, i) for i, m in enumerate(prompt))
        else:
            raise InvalidRequestError(
                f"prompt must be a string or a list of messages, got {type(prompt).__name__}"
            )
        return cls(messages=msgs, **fields)


def _check_messages(messages: tuple[Any, ...]) -> None:
    if not messages:
        raise InvalidRequestError("request has no messages: give a prompt or messages")
    blank = True
    for i, m in enumerate(messages):
        if type(m) is not ChatMessage and not isinstance(m, ChatMessage):
            raise InvalidRequestError(
                f"messages[{i}] must be a ChatMessage, got {type(m).__name__}"
            )
        if blank and m.content and not m.content.isspace():
            blank = False
    if blank:
        raise InvalidRequestError("request prompt is empty: every message content is blank")


def _as_chat_message(value: object, index: int) -> ChatMessage:
    if isinstance(value, ChatMessage):
        return value
    if isinstance(value, Mapping):
        extra = set(value) - {"role", "content"}  # a 'name' would be dropped: refused
        if extra or "role" not in value or "content" not in value:
            raise InvalidRequestError(
                f"messages[{index}] must have 'role' and 'content'"
                + (f" (unexpected keys: {sorted(extra)})" if extra else "")
            )
        return ChatMessage(role=value["role"], content=value["content"])
    raise InvalidRequestError(f"messages[{index}] must be a mapping, got {type(value).__name__}")
