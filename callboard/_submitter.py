"""What the patterns need of a running system: the ``Submitter`` interface.

Every pattern (gather, race, chain, callbacks) is written once, against
``Submitter``: submit one request, submit a burst, cancel by task id. A
``System`` is one. An ``AsyncSystem`` is a ``Fronts``: it holds a ``System``
and submits through it, so a pattern given either face finds the submitter
with ``submitter_of``, and the asyncio face awaits the same futures the sync
face blocks on.

It also reads a submit's arguments, once for every face: ``request_of``
builds the ``Request`` that a prompt (or ``prompt=`` / ``messages=``, as a
JSONL line gives them) and the request's fields describe; ``checked_fields``,
``checked_prompts``, ``checked_seconds`` and ``checked_trace_id`` refuse
everything else (``checked_seconds`` also reads the faces' timeouts).

What must hold: ``cancel_unsent`` only asks, so a task already sent runs to
its end and its future gets its real result; a system stopped meanwhile is
not an error (the stop resolves every future). Every misuse of a submit's
arguments raises ``InvalidRequestError`` naming the argument and what is
allowed, before anything is sent; metadata is plain JSON, nested, or refused.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import inspect
import threading
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from callboard.messages import (
    OPTIONS,
    InvalidRequestError,
    Request,
    Result,
    SystemStoppedError,
    TaskFuture,
    shown_value,
    unprintable,
)
from callboard.runtime.guarded_log import guarded_logger
from callboard.supervisor.address_book import AddressError

__all__ = [
    "NO_PROMPT",
    "REQUEST_FIELDS",
    "Face",
    "Fronts",
    "Submitter",
    "cancel_unsent",
    "checked_fields",
    "checked_prompts",
    "checked_seconds",
    "checked_trace_id",
    "new_trace_id",
    "refuse_keywords",
    "request_of",
    "submitter_of",
]

log = guarded_logger("callboard.patterns")  # the public module's name


class Submitter(Protocol):
    """Submit requests and cancel them by id; every call thread-safe (``System`` is one)."""

    def submit(self, prompt: Any = ..., /, **fields: Any) -> Future[Result]:
        """One request; its future resolves to its ``Result``. Misuse raises at once."""
        ...

    def submit_many(self, prompts: Iterable[Any], /, **fields: Any) -> Sequence[Future[Result]]:
        """A burst, in one message; the futures in input order (a ``System``'s: a list
        of ``TaskFuture``)."""
        ...

    def cancel(self, *task_ids: int) -> None:
        """Cancel tasks that were not sent yet (they end ``Cancelled``)."""
        ...


class Fronts(abc.ABC):
    """A face that submits through a ``Submitter`` it holds (``AsyncSystem`` holds a ``System``)."""

    @property
    @abc.abstractmethod
    def system(self) -> Submitter:
        """The submitter behind this face; ``SystemStoppedError`` when there is none."""


Face = Submitter | Fronts
"""What a pattern is given: a submitter, or a face in front of one."""


def submitter_of(face: Face) -> Submitter:
    """The ``Submitter`` ``face`` submits through (itself, unless it fronts one)."""
    return face.system if isinstance(face, Fronts) else face


def new_trace_id(kind: str) -> str:
    """A fresh trace id for a chain or a race (``chain.<16 hex>``)."""
    return f"{kind}.{uuid.uuid4().hex[:16]}"


def cancel_unsent(face: Face, futures: Iterable[Future[Result]]) -> None:
    """Ask the queue to cancel the tasks of ``futures`` that are still live.

    A task waiting in the queue, or still on its way there, ends ``Cancelled``;
    one already sent runs to its end and its future gets its real result.
    """
    ids = [f.task_id for f in futures if not f.done() and isinstance(f, TaskFuture)]
    if ids:
        try:
            submitter_of(face).cancel(*ids)
        except (AddressError, SystemStoppedError) as exc:  # stopping: the stop resolves them
            log.debug("cancel of %s not sent: %s", ids, exc)


# -- a submit's arguments ---------------------------------------------------------------

NO_PROMPT: Any = object()
"""A submit given no prompt argument: its prompt is its ``prompt=`` or ``messages=``."""

REQUEST_FIELDS = (
    (frozenset(f.name for f in dataclasses.fields(Request)) - {"messages"})
    | OPTIONS
    | {"max_completion_tokens"}
)
"""callboard's own request fields and every Chat Completions field it passes on."""
"""The keywords a submit passes to its ``Request``."""

_PROMPT_KEYWORDS = ("prompt", "messages")


def checked_fields(fields: Collection[str], call: str, also: Collection[str] = ()) -> None:
    """Refuse a keyword ``call`` does not take (the request's fields, and ``also``),
    naming the close match of a misspelt one."""
    allowed = REQUEST_FIELDS.union(also)
    unknown = [name for name in fields if name not in allowed]
    if not unknown:
        return
    if any(n in ("stream", "stream_options") for n in unknown):
        raise InvalidRequestError(f"{call}() does not stream: use stream() for a stream")
    refuse_keywords(unknown, call, allowed)


def refuse_keywords(
    unknown: Collection[str], call: str, takes: Collection[str] | Callable[..., object]
) -> None:
    """Refuse the keywords ``unknown`` that ``call`` was given (it takes ``takes``, or the
    keyword-only parameters of the function ``takes``), naming the close match of a
    misspelt one, as ``checked_fields`` does: for a call whose keywords are its own,
    taking the rest as ``**unknown: Never`` (mypy flags a typo; this names it, where
    Python's own ``TypeError`` would not say what it takes)."""
    if not unknown:
        return
    if callable(takes):
        takes = [
            name
            for name, p in inspect.signature(takes).parameters.items()
            if p.kind is p.KEYWORD_ONLY
        ]
    named = []
    for name in sorted(unknown, key=str):
        close = difflib.get_close_matches(str(name), takes, n=1)
        named.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise InvalidRequestError(
        f"{call}() got an unknown keyword {', '.join(named)}; it takes {', '.join(sorted(takes))}"
    )


def request_of(prompt: Any, fields: dict[str, Any]) -> Request:
    """The ``Request`` of one submit's prompt and fields (``fields`` loses ``prompt`` and
    ``messages``, which may stand for the prompt argument, as in a JSONL line)."""
    given = [name for name in _PROMPT_KEYWORDS if name in fields]
    if prompt is NO_PROMPT:
        if len(given) != 1:
            raise InvalidRequestError(
                "give one prompt: as the first argument, or prompt=, or messages="
            )
        prompt = fields.pop(given[0])
    elif given:
        raise InvalidRequestError(
            f"give one prompt: a first argument and {given[0]}= are both given"
        )
    return Request.of(prompt, **fields)


def checked_prompts(prompts: object, call: str) -> list[Any] | tuple[Any, ...]:
    """A burst's prompts as a sequence; one prompt, a mapping or no collection is refused."""
    if isinstance(prompts, str | bytes | Request | Mapping) or not isinstance(prompts, Iterable):
        raise InvalidRequestError(
            f"{call}() takes a list of prompts (strings, message lists or Requests), "
            f"got {type(prompts).__name__}; for one prompt use submit"
        )
    return prompts if isinstance(prompts, list | tuple) else list(prompts)


def checked_seconds(value: object, name: str) -> float | None:
    """A wait: None (``wait_s``: none at all; a timeout: no bound) or seconds, as the
    platform can wait them (``threading.TIMEOUT_MAX``)."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= threading.TIMEOUT_MAX  # also refuses NaN
    ):
        raise InvalidRequestError(
            f"{name} must be None or a number of seconds from 0 to {threading.TIMEOUT_MAX:.0f}, "
            f"got {shown_value(value)}"
        )
    return float(value)


def checked_trace_id(value: object) -> str | None:
    if value is None or (isinstance(value, str) and value.strip() and not unprintable(value)):
        return value
    raise InvalidRequestError(
        f"trace_id must be None or a non-empty string without control characters or line "
        f"separators (it is logged), got {value!r}"
    )
