"""What a caller asks for: a ``Request`` (validated on construction).

A ``Request`` is immutable and self-checking: once one exists it is a request
callboard can serve in principle (non-empty, sane limits). Whether a model of
that name exists is checked at the front door against the configuration.

A request built from a bare prompt string (``Request.of("...")``, the common
case: every ``submit("...")``) holds only the string. Its ``messages`` slot keeps
the prompt itself, and the field's descriptor (``_Turns``) answers every read
with a fresh ``(ChatMessage(role="user", content=prompt),)``: a queued task so
holds no message and no tuple (136 bytes of its ~1 KiB on the backlog bench).
Nothing else sees the difference: equality, ``repr``, ``hash`` (refused, as
every request's metadata is a mapping), pickling, ``dataclasses.replace`` and
``asdict`` all read the field through the descriptor, so a bare request is
indistinguishable from one built with that one message, but for identity
(``r.messages is r.messages`` is false for it: each read is a new tuple).

What must hold: only ``Request.of`` stores a bare prompt (it hands the string
over wrapped in ``_Bare``, which no caller can name); the public constructor
refuses a string for ``messages`` as it always did; a stored bare prompt is a
``str`` of exactly that type (a subclass is held as a message, as before).
"""

from __future__ import annotations

import enum
import math
import re
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from dataclasses import fields as fields_of
from typing import Any

from callboard.messages._body import ANSWER_ONLY, FIELDS, check_field, check_messages
from callboard.messages._errors import InvalidRequestError, shown_value
from callboard.messages._frozen import FrozenMap, quick_init

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
OPTIONS = FIELDS - {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "stream",
    "stream_options",
}
"""The Chat Completions fields a ``Request`` carries in ``options`` (the rest are its own
fields, or callboard's to set: ``model`` per model, ``stream`` by ``stream()``)."""
_MESSAGE_KEYS = (
    "name",
    "tool_calls",
    "tool_call_id",
    "refusal",
    "audio",
    "thinking_blocks",
    "reasoning_content",
)
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
        raise InvalidRequestError(
            f"priority must be one of {names} (or 0-3), got {shown_value(value)}"
        )


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ChatMessage:
    """One chat turn, as OpenAI's Chat Completions API takes it."""

    role: str
    """system, developer, user, assistant or tool."""
    content: str | tuple[Mapping[str, Any], ...] | None = None
    """The text of the turn, or its content parts (``text``, ``image_url``,
    ``input_audio``, ``file``); None only for an assistant turn with tool calls (which
    may leave it out, as OpenAI's API takes it: a turn without it was a ``TypeError``,
    and the gateway's 500; found by a test)."""
    name: str | None = None
    tool_calls: tuple[Mapping[str, Any], ...] | None = None
    """An assistant turn's calls: ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` each."""
    tool_call_id: str | None = None
    """A tool turn's answer is to this call."""
    refusal: str | None = None
    audio: Mapping[str, Any] | None = None
    thinking_blocks: tuple[Mapping[str, Any], ...] | None = None
    """An assistant turn's extended thinking as a Claude model answered it, to be sent
    back as it came: ``{"type": "thinking", "thinking", "signature"}`` or
    ``{"type": "redacted_thinking", "data"}`` each (an answer's ``thinking_blocks``).
    Sent to a model of Anthropic's dialect, first in the turn (the signature is
    Anthropic's), and to one whose ``sends_back`` names them (a proxy in front of
    Claude)."""
    reasoning_content: str | None = None
    """An assistant turn's reasoning as text, as a reasoning model answered it (an
    answer's ``reasoning_content``): sent to a model whose ``sends_back`` names it
    (DeepSeek's thinking mode wants it back in a tool loop; OpenAI's API refuses a
    field it does not know)."""

    def __post_init__(self) -> None:
        if type(self.content) is str and self.tool_calls is None and self.name is None:
            if type(self.role) is not str or self.role not in ROLES:  # plain: no copies
                raise InvalidRequestError(
                    f"message role must be one of {sorted(ROLES)}, got {self.role!r}"
                )
            plain = (
                self.tool_call_id is None
                and self.refusal is None
                and self.audio is None
                and self.thinking_blocks is None
                and self.reasoning_content is None
            )
            if plain and self.role != "tool":  # a tool turn needs its tool_call_id: below
                return
        for key in ("content", *_MESSAGE_KEYS):
            value = getattr(self, key)
            if isinstance(value, Mapping | list | tuple):
                object.__setattr__(self, key, frozen_json(value, f"message {key}"))
        check_messages((self.wire(),), "message")

    def wire(self) -> dict[str, Any]:
        """The turn as the request body carries it."""
        turn: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in _MESSAGE_KEYS:
            value = getattr(self, key)
            if value is not None:
                turn[key] = value
        return turn

    @property
    def text(self) -> str:
        """The turn's text: its string content, or its text parts joined."""
        content = self.content
        if isinstance(content, str):
            return content
        if not content:
            return ""
        return "".join(p["text"] for p in content if p.get("type") == "text")


def frozen_json(value: Any, where: str) -> Any:
    """``value`` (plain JSON) deep-frozen: objects as ``FrozenMap``, arrays as tuples
    (what is frozen already is kept, not copied); ``InvalidRequestError`` naming
    ``where`` for anything JSON cannot hold."""
    problem = _json_problem(value, where, arrays=(list, tuple))
    if problem is not None:
        raise InvalidRequestError(f"{where} cannot be sent as JSON: {problem}")
    return _freeze(value)


def _freeze(value: Any) -> Any:
    if isinstance(value, FrozenMap):
        return value
    if isinstance(value, Mapping):
        return FrozenMap({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


NO_OPTIONS: Mapping[str, Any] = FrozenMap()
"""Shared by every request without options."""
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


def _json_problem(
    value: object, where: str, depth: int = 0, arrays: tuple[type, ...] = (list,)
) -> str | None:
    # arrays: what may stand for a JSON array; with tuple (a request's own values,
    # sent as JSON) any mapping may stand for an object, too
    """Why ``value`` is not plain JSON (dicts with string keys, lists, strings, integers,
    finite floats, booleans, None; nested), or None. ``depth``: the containers around it."""
    if value is None or isinstance(value, str):
        return None
    if isinstance(value, int):  # bool is an int
        return _int_problem(value, where)
    if isinstance(value, float):
        return (
            None if math.isfinite(value) else f"{where} is {value!r}: JSON has no NaN or infinity"
        )
    if isinstance(value, (dict, *arrays)) or (tuple in arrays and isinstance(value, Mapping)):
        return _container_problem(value, where, depth + 1, arrays)
    return (
        f"{where} is of type {type(value).__name__}; allowed: dict with string keys, list, "
        "str, int, finite float, bool, None"
    )


def _finite(number: float) -> bool:
    """Whether ``number`` is finite as a float (an integer too large for one is not:
    ``math.isfinite`` raised ``OverflowError`` on it)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


_ALWAYS_WRITTEN_BITS = 2_000
"""Integers shorter than this are written as JSON whatever the interpreter's limit on
an integer's digits (``sys.set_int_max_str_digits`` takes no less than 640 digits)."""


def _int_problem(value: int, where: str) -> str | None:
    """Why the interpreter cannot write ``value`` as JSON text (more digits than
    ``sys.get_int_max_str_digits``), or None. Accepted, an int of 5,000 digits in a
    tool's schema raised in the model actor each time it made the call's body: the
    actor crash-looped until the supervisor gave up and the whole system stopped
    (found by a hunt); in ``metadata`` it cost the durable ledger a batch of records."""
    if value.bit_length() < _ALWAYS_WRITTEN_BITS:
        return None
    try:
        str(value)
    except ValueError:
        return (
            f"{where} is an integer of more than {sys.get_int_max_str_digits()} digits, "
            "which Python writes as no JSON"
        )
    return None


def _container_problem(value: Any, where: str, depth: int, arrays: tuple[type, ...]) -> str | None:
    if depth > _JSON_DEPTH:  # a cycle too
        return f"{where} nests deeper than {_JSON_DEPTH} levels"
    items = value.items() if isinstance(value, Mapping) else enumerate(value)
    for key, item in items:
        if isinstance(value, Mapping) and not isinstance(key, str):
            return f"{where} has a key that is not a string: {key!r}"
        problem = _json_problem(item, f"{where}[{key!r}]", depth, arrays)
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
    input: tuple[Embeddable, ...] | None = None
    """Texts to embed (each a string, or an array of token ids as the API allows): an
    embeddings request (``messages`` stays empty, ``options`` may hold ``dimensions``,
    ``encoding_format``, ``user`` and ``extra_body``)."""
    options: Mapping[str, Any] = field(default_factory=lambda: NO_OPTIONS)
    """The other Chat Completions fields, sent as given (``OPTIONS``: ``tools``,
    ``tool_choice``, ``response_format``, ``stop``, ``seed``, ..., and ``extra_body``,
    whose fields are sent at the top level of the body for a provider's own use)."""
    models_allowed: frozenset[str] | None = None
    """The only models that may serve it (None: any): candidates and fallbacks outside
    it are dropped, and with none left the request has no route. The gateway sets it
    from a client key's ``models``, so a fallback cannot serve a key a model it may
    not ask for."""
    extra_headers: Mapping[str, str] = field(default_factory=lambda: NO_HEADERS)
    """HTTP headers each call of it sends beside the model's own (the official SDKs'
    ``extra_headers``), such as Anthropic's ``anthropic-beta``: names lower-cased, none
    that callboard sets (the body's type and length, the connection, the encodings)
    and none that carries a credential (those belong to the model's ``headers``, which
    are kept secret; these are stored and shown as the body is)."""

    def __post_init__(self) -> None:
        # On every submit's path: checks that copy nothing (no strip() of the prompt)
        # and writes a field again only when it changes.
        _check_chat(self)
        if type(self.priority) is not Priority:
            object.__setattr__(self, "priority", Priority.parse(self.priority))
        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or not 0 < mt <= MAX_TOKENS_LIMIT:
            raise InvalidRequestError(
                f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}, got {shown_value(mt)}"
            )
        t = self.temperature
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= 2
        ):
            raise InvalidRequestError(f"temperature must be a number in 0..2, got {shown_value(t)}")
        d = self.deadline_s
        if d is not None and (
            isinstance(d, bool) or not isinstance(d, int | float) or not _finite(d) or d <= 0
        ):
            raise InvalidRequestError(f"deadline_s must be a positive number, got {shown_value(d)}")
        for name, value in (
            ("model", self.model),
            ("route", self.route),
            ("idempotency_key", self.idempotency_key),
            ("budget_tag", self.budget_tag),
        ):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"{name} must be a non-empty string, got {value!r}")
            if value is not None and lone_surrogate(value):
                raise InvalidRequestError(  # no ledger, log or file can hold it
                    f"{name} holds a lone surrogate (\\ud800 to \\udfff): not Unicode text"
                )
        if self.models_allowed is not None:
            object.__setattr__(self, "models_allowed", _model_names(self.models_allowed))
        if self.metadata is not _NO_METADATA:
            object.__setattr__(self, "metadata", _frozen_mapping(self.metadata))
        if self.options is not NO_OPTIONS:
            allowed = OPTIONS if self.input is None else EMBEDDING_OPTIONS
            object.__setattr__(self, "options", _checked_options(self.options, allowed))
        if self.extra_headers is not NO_HEADERS:
            object.__setattr__(self, "extra_headers", checked_headers(self.extra_headers))

    @property
    def choices(self) -> int:
        """The choices asked for (``n``, 1 when not given)."""
        n = self.options.get("n")
        return n if type(n) is int and n > 1 else 1

    @property
    def output_tokens(self) -> int:
        """The most completion tokens a call of it may bill: ``max_tokens`` for each of
        its ``n`` choices (what the limiter and a budget reserve)."""
        return self.max_tokens * self.choices

    @property
    def plain(self) -> bool:
        """Whether this is a chat whose every turn is plain text (no parts, tool calls,
        names)."""
        if type(_held(self)) is str:
            return True
        return self.input is None and all(
            type(m.content) is str
            and m.tool_calls is None
            and m.tool_call_id is None
            and m.name is None
            and m.refusal is None
            and m.audio is None
            for m in self.messages
        )

    @property
    def needs(self) -> frozenset[str]:
        """The capabilities a model needs to serve this request: ``vision`` for an
        image, ``tools`` for tool definitions or a tool turn, ``json`` for a JSON
        response format, ``embeddings`` for texts to embed."""
        needs: set[str] = set()
        if self.input is not None:
            needs.add("embeddings")
        options = self.options
        if options.get("tools"):
            needs.add("tools")
        fmt = options.get("response_format")
        if fmt is not None and fmt.get("type") in ("json_object", "json_schema"):
            needs.add("json")
        for m in () if type(_held(self)) is str else self.messages:
            if m.tool_calls or m.role == "tool":
                needs.add("tools")
            if type(m.content) is tuple and any(p.get("type") == "image_url" for p in m.content):
                needs.add("vision")
        return frozenset(needs)

    @property
    def wants_json(self) -> str | None:
        """``json_schema`` or ``json_object`` when the request asks for JSON output
        (``Completed.parsed`` then holds it), else None."""
        fmt = self.options.get("response_format")
        kind = None if fmt is None else fmt.get("type")
        return kind if kind in ("json_object", "json_schema") else None

    @property
    def strict_json(self) -> bool:
        """Whether the request asked for a ``json_schema`` with ``strict``: an answer
        that does not parse then fails ``MALFORMED_OUTPUT``, unless it was cut short
        (``finish_reason`` ``length`` or ``content_filter``)."""
        fmt = self.options.get("response_format")
        if fmt is None or fmt.get("type") != "json_schema":
            return False
        return bool((fmt.get("json_schema") or {}).get("strict"))

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
        msgs: Any
        if type(prompt) is str:
            msgs = _Bare(prompt)  # held as the string itself (see the module docstring)
        elif isinstance(prompt, str):
            msgs = (ChatMessage(role="user", content=prompt),)
        elif isinstance(prompt, list | tuple):
            msgs = _chat_messages(prompt)
        else:
            raise InvalidRequestError(
                f"prompt must be a string or a list of messages, got {type(prompt).__name__}"
            )
        one_target(fields)
        return cls(messages=msgs, **request_fields(fields))


def one_target(fields: Mapping[str, Any]) -> None:
    """Refuse a request that names both a ``model`` and a ``route``: the model won and the
    route was dropped unsaid (found by a hunt). Checked where requests are made, not on
    every ``Request``: a ledger written before holds such requests, and resumes them."""
    if fields.get("model") is not None and fields.get("route") is not None:
        raise InvalidRequestError(
            "give one of 'model' (a model by name) or 'route' (a route to choose one on)"
        )


class _Bare:
    """A bare prompt on its way into a ``Request`` (only ``Request.of`` makes one):
    the ``messages`` descriptor stores the string it wraps, and drops the wrapper."""

    __slots__ = ("prompt",)

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt


class _Turns:
    """``Request.messages``: the field's slot, read through a descriptor that turns a
    bare prompt held there into its one user turn (see the module docstring)."""

    __slots__ = ("_read", "_write")

    def __init__(self, slot: Any) -> None:
        self._read = slot.__get__  # the slot's own member descriptor's
        self._write = slot.__set__

    def __get__(self, request: Request | None, owner: type | None = None) -> Any:
        if request is None:
            return self
        held = self._read(request)
        if type(held) is str:
            return (_user_turn(held),)
        return held

    def __set__(self, request: Request, value: Any) -> None:
        if type(value) is _Bare:
            value = value.prompt
        elif isinstance(value, str):  # a caller's string is a sequence, as before: refused
            value = tuple(value)
        self._write(request, value)


_SLOT = Request.__dict__["messages"]
_held = _SLOT.__get__
"""What ``Request.messages``' slot holds: the tuple of turns, or a bare prompt."""
Request.messages = _Turns(_SLOT)  # type: ignore[assignment,misc]
quick_init(Request)


def _user_turn(text: str) -> ChatMessage:
    """``ChatMessage(role="user", content=text)``, built through its slots: the prompt
    was checked when its request was built, and a plain user turn of a string passes
    every check of ``ChatMessage``."""
    turn: ChatMessage = _new(ChatMessage)
    _set_role(turn, "user")
    _set_content(turn, text)
    for set_default, default in _DEFAULTS:
        set_default(turn, default)
    return turn


_new = object.__new__
_set_role = ChatMessage.__dict__["role"].__set__
_set_content = ChatMessage.__dict__["content"].__set__
_DEFAULTS = tuple(
    (ChatMessage.__dict__[f.name].__set__, f.default)
    for f in fields_of(ChatMessage)
    if f.name not in ("role", "content")
)
"""Every other field of a turn, with its default (a constant: none has a factory)."""
_BLANK = "request prompt is empty: every message content is blank"


def _check_chat(request: Request) -> None:
    """Check what ``request`` asks about: its turns (a list is frozen into a tuple), its
    bare prompt (one user turn), or its texts to embed."""
    given: Any = _held(request)
    if type(given) is str:  # a bare prompt (Request.of)
        if request.input is not None:
            _check_input(request, (given,))
        elif not given or given.isspace():
            raise InvalidRequestError(_BLANK)
        return
    if type(given) is not tuple:  # a list is accepted and frozen
        given = tuple(given)
        object.__setattr__(request, "messages", given)
    if request.input is None:
        _check_messages(given)
    else:
        _check_input(request, given)


def _check_messages(messages: tuple[Any, ...]) -> None:
    if not messages:
        raise InvalidRequestError("request has no messages: give a prompt or messages")
    blank = True
    for i, m in enumerate(messages):
        if type(m) is not ChatMessage and not isinstance(m, ChatMessage):
            raise InvalidRequestError(
                f"messages[{i}] must be a ChatMessage, got {type(m).__name__}"
            )
        if blank and (m.tool_calls or (m.content and not m.text.isspace())):
            blank = False
    if blank:
        raise InvalidRequestError(_BLANK)


MAX_INPUTS = 2048
"""Texts one embeddings request may hold (OpenAI's limit per call)."""


def _check_input(request: Request, messages: tuple[Any, ...]) -> None:
    texts: Any = request.input
    if isinstance(texts, str) or not isinstance(texts, list | tuple):
        raise InvalidRequestError(f"input must be a list of strings, got {type(texts).__name__}")
    if type(texts) is not tuple:
        texts = tuple(texts)
        object.__setattr__(request, "input", texts)
    if messages:
        raise InvalidRequestError("give messages (a chat) or input (texts to embed), not both")
    if not 0 < len(texts) <= MAX_INPUTS:
        raise InvalidRequestError(
            f"input must hold 1 to {MAX_INPUTS} texts per request, got {len(texts)}"
        )
    checked = embeddable_inputs(texts, "input")
    if checked is not texts:
        object.__setattr__(request, "input", checked)


Embeddable = str | tuple[int, ...]
"""One input to embed: a text, or its token ids (as OpenAI's embeddings API takes them,
and LangChain's ``OpenAIEmbeddings`` sends them)."""


def embeddable_inputs(inputs: tuple[Any, ...], where: str) -> tuple[Embeddable, ...]:
    """``inputs`` as inputs to embed: each a non-empty text, or a list of token ids (made
    a tuple); ``InvalidRequestError`` names one that is neither by its index in ``where``.
    ``inputs`` itself when no list needed making a tuple."""
    tokens = None
    for i, text in enumerate(inputs):
        if type(text) is str and text:
            continue
        ids = token_ids(text)
        if ids is None:
            shown = type(text).__name__ if not isinstance(text, str) else "an empty string"
            raise InvalidRequestError(
                f"{where}[{i}] must be a non-empty string or list of token ids, got {shown}"
            )
        if tokens is None:
            tokens = list(inputs)
        tokens[i] = ids
    return inputs if tokens is None else tuple(tokens)


TOKEN_IDS_END = 2**31
"""Token ids are integers from 0 to below this."""


def token_ids(value: object) -> tuple[int, ...] | None:
    """``value`` as an input's token ids (a non-empty list of integers from 0 to below
    ``TOKEN_IDS_END``), or None."""
    if not isinstance(value, list | tuple) or not value:
        return None
    if not all(type(t) is int and 0 <= t < TOKEN_IDS_END for t in value):
        return None
    return tuple(value)


def _chat_messages(
    messages: list[Any] | tuple[Any, ...],
) -> tuple[ChatMessage, ...]:
    """``messages`` (``ChatMessage``s, or the dicts a request body carries) checked and
    frozen, as ``Request.of`` takes a list of them (``InvalidRequestError`` naming
    ``messages[i]``)."""
    if not all(isinstance(m, ChatMessage) for m in messages):
        check_messages([_as_turn(m) for m in messages])  # names messages[i]
    return tuple(_as_chat_message(m) for m in messages)


def _as_turn(value: object) -> object:
    return value.wire() if isinstance(value, ChatMessage) else value


def _as_chat_message(value: object) -> ChatMessage:
    if isinstance(value, ChatMessage):
        return value
    assert isinstance(value, Mapping)  # check_messages refused anything else
    if not ANSWER_ONLY.isdisjoint(value):
        value = {k: v for k, v in value.items() if k not in ANSWER_ONLY}
    return ChatMessage(**value)


EMBEDDING_OPTIONS = frozenset({"dimensions", "encoding_format", "user", "extra_body"})
"""The fields an embeddings request carries in ``options``."""
_OWN_FIELDS = frozenset(
    {
        "input",
        "priority",
        "model",
        "route",
        "max_tokens",
        "temperature",
        "deadline_s",
        "metadata",
        "idempotency_key",
        "budget_tag",
        "options",
        "models_allowed",
        "extra_headers",
    }
)


def _model_names(given: object) -> frozenset[str]:
    """``models_allowed`` as a frozenset of names; anything else is refused by name."""
    if isinstance(given, set | frozenset | list | tuple) and all(
        isinstance(n, str) and n.strip() for n in given
    ):
        return given if type(given) is frozenset else frozenset(given)
    raise InvalidRequestError(f"models_allowed must be a set of model names, got {given!r}")


NO_HEADERS: Mapping[str, str] = FrozenMap()
"""Shared by every request without headers of its own."""
OWNED_HEADERS = frozenset(
    {
        "host",
        "content-type",
        "content-length",
        "content-encoding",
        "transfer-encoding",
        "accept-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "anthropic-version",
        "api-version",
    }
)
"""What ``extra_headers`` may not set: callboard writes these for each call (the body it
sends, the connection, the encodings it decodes, the dialect's version)."""
_CREDENTIAL_STEMS = re.compile(
    r"auth|key|token|secret|cookie|passw|passphrase|passcode|pwd|signature|credential|session"
)
"""A name holding one of these anywhere carries a credential (``Authorization``,
``x-api-key``, ``apikey``, ``access_token``, ``X-Amz-Security-Token``, ``dbpwd``,
``X-Session-Id``...)."""
_CREDENTIAL_WORDS = frozenset({"pass", "sig", "sid"})
"""Short ones, a credential as a word of the name (``sig``, ``X-Api-Pass``,
``userPass``), or as a word's start or end for ``pass`` and ``sig`` (``mypass``,
``apisig``, ``passe``), but not inside one (``x-design``)."""
_NOT_CREDENTIAL = frozenset({"bypass", "compass", "passthrough", "passive", "passage", "passenger"})
_CREDENTIAL_NAMES = frozenset({"code"})
"""A credential only as the whole name: Azure Functions' ``?code=`` (``x-error-code``
is none)."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate: a Python string may (JSON's
    ``"\\ud800"``), UTF-8 has no form for one, so no file, log or ledger can hold it."""
    return not text.isascii() and _SURROGATE.search(text) is not None


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
"""Control characters (C0, DEL, C1), line and paragraph separators, lone surrogates."""


def unprintable(text: str) -> bool:
    """Whether ``text`` holds what a log line cannot show as itself: a control character
    (a newline, a terminal's escape), a line separator or a lone surrogate. A name or
    id that callboard logs (a trace id, a job's name) with one could forge log lines."""
    return _UNPRINTABLE.search(text) is not None


_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
"""A name's words, camelCase split (``userPass``: ``user``, ``Pass``); digits part them."""
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""An HTTP header name (RFC 9110's token): a model's ``headers`` and a request's own."""
MAX_EXTRA_HEADERS = 32
MAX_HEADER_VALUE = 8192


def credential_like(name: str) -> bool:
    """Whether a header's or a URL query parameter's name says it carries a credential
    (``Authorization``, ``api-key``, ``x-goog-api-key``, ``Cookie``, ``X-Session``,
    ``sig``...): the one rule for both, so a name is a secret wherever it is written."""
    low = name.lower()
    if _CREDENTIAL_STEMS.search(low) or low in _CREDENTIAL_NAMES:
        return True
    return any(_credential_word(w.lower()) for w in _WORD.findall(name))


def _credential_word(word: str) -> bool:
    if word in _CREDENTIAL_WORDS:
        return True
    if word in _NOT_CREDENTIAL:
        return False
    return word.startswith("pass") or word.endswith(("pass", "sig"))


def checked_headers(given: object) -> Mapping[str, str]:
    """``extra_headers`` as a frozen map of lower-cased names to values; a name that is
    no HTTP token, a value that is no single-line text, a header callboard sets or one
    that looks like a credential is refused by name."""
    if not isinstance(given, Mapping):
        raise InvalidRequestError(
            f"extra_headers must be a mapping of header names to values, got {type(given).__name__}"
        )
    if len(given) > MAX_EXTRA_HEADERS:
        raise InvalidRequestError(f"extra_headers: at most {MAX_EXTRA_HEADERS}, got {len(given)}")
    headers: dict[str, str] = {}
    for name, value in given.items():
        if not isinstance(name, str) or not HEADER_NAME.fullmatch(name):
            raise InvalidRequestError(f"extra_headers: {name!r} is not a header name")
        low = name.lower()
        where = f"extra_headers[{low!r}]"
        if low in headers:
            raise InvalidRequestError(f"{where}: given twice (names are case-insensitive)")
        if low in OWNED_HEADERS:
            raise InvalidRequestError(f"{where}: callboard sets it for each call")
        if credential_like(low):
            raise InvalidRequestError(
                f"{where}: looks like a credential; give it in the model's headers, "
                "which are kept secret (a request's headers are stored as its body is)"
            )
        if not isinstance(value, str) or len(value) > MAX_HEADER_VALUE:
            raise InvalidRequestError(f"{where}: must be a string of at most {MAX_HEADER_VALUE}")
        if not value.isascii() or any((c < " " and c != "\t") or c == "\x7f" for c in value):
            raise InvalidRequestError(f"{where}: must be printable ASCII on one line")
        headers[low] = value.strip(" \t")
    return FrozenMap(headers) if headers else NO_HEADERS


def request_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword fields as ``Request`` takes them: its own as they are, the other Chat
    Completions fields into ``options`` (``max_completion_tokens`` is ``max_tokens``:
    each model sends it in the field it takes). Anything else is refused by name."""
    own: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for name, value in fields.items():
        if value is None and name in _NULL_IS_UNSET:
            continue  # OpenAI's API reads a null cap as none given: so does callboard (the
            # openai SDK sends one for max_tokens=None; it was refused; found by a hunt)
        if name in _OWN_FIELDS:
            own[name] = value
        elif name == "max_completion_tokens":
            if fields.get("max_tokens") is not None:
                raise InvalidRequestError("give max_tokens or max_completion_tokens, not both")
            own["max_tokens"] = value
        elif name in OPTIONS:
            options[name] = value
        else:
            raise InvalidRequestError(_unknown(name))
    if options:
        if "options" in own:
            raise InvalidRequestError("give options= or its fields as keywords, not both")
        own["options"] = options
    return own


_NULL_IS_UNSET = frozenset({"max_tokens", "max_completion_tokens"})
"""The fields whose null means "not given" (the request's default applies)."""


def _unknown(name: str) -> str:
    if name in ("stream", "stream_options"):
        return f"{name}: a stream is asked for with stream(), not a field"
    return (
        f"{name}: not a request field (Chat Completions fields, callboard's own, or a "
        "provider's own inside extra_body)"
    )


def _checked_options(options: object, allowed: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(options, Mapping):
        raise InvalidRequestError(f"options must be a mapping, got {type(options).__name__}")
    for name, value in options.items():
        if name not in allowed:
            raise InvalidRequestError(_unknown(name))
        if name in FIELDS:
            check_field(name, value)
        elif name == "dimensions" and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise InvalidRequestError(f"dimensions: must be an integer >= 1, got {value!r}")
        elif name == "encoding_format" and value not in ("float", "base64"):
            raise InvalidRequestError(f"encoding_format: must be float or base64, got {value!r}")
    if not options:
        return NO_OPTIONS
    frozen: Mapping[str, Any] = frozen_json(
        {k: v for k, v in options.items() if v is not None}, "options"
    )
    return frozen
