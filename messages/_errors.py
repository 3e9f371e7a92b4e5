"""The one typed error tree of callboard.

Errors are for misuse and for a system that cannot serve; a provider that
misbehaves is not an error but a result (``Failed`` with a ``FailureReason``).

    CallboardError
    +-- UsageError                 the caller did something wrong
    |   +-- InvalidRequestError    a request that can never be served as given, or a
    |   |                          call's argument of the wrong kind (a keyword the call
    |   |                          does not take, a timeout that cannot be waited)
    |   +-- UnknownModelError      a model or route name that is not configured
    |   +-- ConfigError            a bad configuration key or value
    +-- UnavailableError               the system cannot take the call now
        +-- SystemStoppedError     submit after stop, or the system escalated
        +-- QueueFullError         admission refused for capacity (when waiting)
        +-- ClusterUnreachableError  the Ray cluster configured cannot be reached at start

Every message names the problem (the field, the key, the line); no error
text ever contains a secret.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, TypeGuard


class CallboardError(Exception):
    """Base of every error callboard raises."""


class UsageError(CallboardError):
    """The caller's fault: fix the call, not the provider."""


class InvalidRequestError(UsageError, ValueError):
    """A request that can never be served as given, or a call's argument of the wrong
    kind (names the field or argument, and what is allowed)."""


class UnknownModelError(UsageError, KeyError):
    """A model or route name that is not configured."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown model"


class ConfigError(UsageError, ValueError):
    """A bad configuration key or value (names the key)."""


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether a setting's ``value`` is a number: an int or a float, not a bool (``True``
    taken as 1 made a 1 s timeout and a restart every second)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


class UnavailableError(CallboardError):
    """The system cannot take the call now."""


class SystemStoppedError(UnavailableError, RuntimeError):
    """The system is stopped or stopping, or it escalated a failure."""


class QueueFullError(UnavailableError):
    """The queue stayed full for as long as the caller was willing to wait (or, with
    ``for_good``, the burst is larger than the whole queue: no wait would help)."""

    def __init__(self, *args: object, for_good: bool = False) -> None:
        super().__init__(*args)
        self.for_good = for_good


class ClusterUnreachableError(UnavailableError):
    """The Ray cluster a ``RayCluster`` names could not be reached at start (a
    subclass here, so a caller catches it without importing Ray)."""

    def __init__(self, address: str, why: str) -> None:
        shown = shown_address(address)
        super().__init__(f"the Ray cluster at {shown!r} is unreachable: {why}")
        self.address = address
        self.why = why

    def __reduce__(self) -> tuple[Any, ...]:
        """Made again from what it was made of: raised in a pool's worker, it reached
        the parent as ``BrokenProcessPool`` (found by a hunt)."""
        return (type(self), (self.address, self.why))


def shown_address(address: str) -> str:
    """A Ray cluster's ``address`` as an error or a log shows it: what comes before an
    ``@`` in its authority (credentials: ``ray://user:token@host:10001``) as ``***``.
    It was printed whole (found by a hunt)."""
    scheme, sep, rest = address.rpartition("://")
    authority, slash, path = rest.partition("/")
    _, at, host = authority.rpartition("@")
    if not at:
        return address
    return f"{scheme}{sep}***@{host}{slash}{path}"


class MalformedOutputError(CallboardError, ValueError):
    """A model's output is not what it was asked for (tool arguments or an answer that
    should be JSON and is not)."""


SHOWN_TEXT_AT_MOST = 16
"""The longest text a configuration error repeats (``'fortnightly'``): a longer one
may be a key pasted into the wrong field."""


SHOWN_NAME_AT_MOST = 64
"""The longest name (of a model, a route) a configuration error repeats: model names
run long (``claude-3-5-sonnet-20241022``), and the name is how a typo is found."""


def shown_name(value: object) -> str:
    """A name as an error may show it: as written up to ``SHOWN_NAME_AT_MOST``
    characters, else as ``shown_value`` shows a text."""
    if isinstance(value, str) and len(value) <= SHOWN_NAME_AT_MOST:
        return repr(value)
    return shown_value(value)


def shown_number(value: object) -> str:
    """A value where a number (or a flag) belongs, as an error may show it: a number or a
    flag as written; anything else by its type only, a type error (a text there may be
    a secret typed in the wrong place, and a short one was shown whole)."""
    if isinstance(value, int) and value.bit_length() > _SHOWN_BITS:  # bool is an int
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, Decimal):  # as written, as TOML and a reader of money write it:
        shown = str(value)  # -1, not Decimal('-1')
        return shown if len(shown) <= _SHOWN_DIGITS else f"a decimal of {len(shown)} characters"
    if value is None or isinstance(value, bool | int | float | Decimal):
        return repr(value)
    return f"a {type(value).__name__}"


_SHOWN_BITS = 64
"""An integer longer than this is shown by its length (one of 5,000 digits had no
``repr``: the error meant to name it raised ``ValueError``; found by a review)."""

_SHOWN_DIGITS = 40
"""A decimal longer than this, written out, is shown by its length."""


def shown_value(value: object) -> str:
    """A configuration value as an error may show it: a number, a flag or a text of at
    most ``SHOWN_TEXT_AT_MOST`` characters as written; a longer text by its length only;
    anything else by its type (as ``shown_number`` shows it)."""
    if isinstance(value, str):
        return (
            repr(value)
            if len(value) <= SHOWN_TEXT_AT_MOST
            else f"a text of {len(value)} characters"
        )
    return shown_number(value)
